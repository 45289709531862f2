"""Sections with device functions in Python, without a GPU: kernels/sections/gate_up_silu@numba.py compiled by
numba-cuda to PTX, spliced into the whole build (or linked into the units build), its errors reported at the .py
file's lines and its machine code listed by them. Running and verifying it needs a GPU (tests/test_gpu.py)."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import paths
from workbench.compiler import compile as C
from workbench.compiler import numba_sections as N
from workbench.compiler.assemble import BuildOptions, assemble, numba_path, section_path
from workbench.compiler.units import units_linkable
from workbench.model.config import get_config
from test_ptx_sections import _under, needs_ptxas

needs_numba = pytest.mark.skipif(N.numba_problem() is not None, reason=(N.numba_problem() or "").split(":")[0])

NUMBA = BuildOptions(variants=(("gate_up_silu", "numba"),))
PY = "kernels/sections/gate_up_silu@numba.py"
EXAMPLE = numba_path("gate_up_silu", "numba").read_text()
RETURN_LINE = next(n for n, line in enumerate(EXAMPLE.splitlines(), 1) if line.strip().startswith("return"))


def _with_text(asm, text: str):
    """`asm` with the numba file's text replaced by `text` (as an edit not yet saved would be)."""
    (src,) = asm.numba
    return dataclasses.replace(asm, numba=(N.declarations(src.section, src.display, text),))


def _workspace(tmp_path, text: str | None = None) -> str:
    """A copy of the kernel sources in tmp_path/kernels, its numba file replaced by `text`: its folder."""
    ws = tmp_path / "kernels"
    shutil.copytree(paths.template_dir(), ws, ignore=shutil.ignore_patterns(".history", "__pycache__", "*.pyc"))
    if text is not None:
        (ws / "sections" / "gate_up_silu@numba.py").write_text(text)
    return str(ws)


def _build(*args, workspace: str | None = None, pre: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(paths.ROOT)}
    if workspace:
        env["MONOKERNEL_WORKSPACE"] = workspace
    code = f"{pre}import sys; from workbench.cli import main; sys.exit(main({['build', *args]!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=paths.ROOT)


# ---- declarations: read off the file, no numba needed --------------------------------------------------------------

def test_a_numba_variant_is_a_cuh_with_a_py_beside_it():
    assert N.is_numba_variant("numba") and N.is_numba_variant("numba_fast") and not N.is_numba_variant("fast")
    assert section_path("gate_up_silu", "numba").name == "gate_up_silu@numba.cuh"
    assert numba_path("gate_up_silu", "numba").name == "gate_up_silu@numba.py"
    with pytest.raises(ValueError, match="only a stage's section can call device functions written in Python"):
        section_path("matvec", "numba")


def test_the_declared_signature_becomes_the_prototype_before_the_stages():
    asm = assemble(get_config("tiny"), NUMBA)
    (src,) = asm.numba
    assert src.display == PY and [d.name for d in src.functions] == ["wb_silu_mul"]
    proto = 'extern "C" __device__ float wb_silu_mul(float, float);'
    assert src.functions[0].prototype() == proto
    # pasted once, before the first stage, so that every unit of the units build declares it too
    assert asm.source.count(proto) == 1 and asm.source.index(proto) < asm.source.index("stage_embedding(")
    assert asm.text_of(PY) == EXAMPLE and asm.key != assemble(get_config("tiny")).key


@pytest.mark.parametrize("decorator, says", [
    ('@export("float(float)")', "wb_silu_mul takes 2 arguments, its signature declares 1"),
    ('@export("float(half, float)")', "C type 'half' is not one a numba section passes"),
    ('@export("float float")', "is not a C signature"),
    ('@export("void(float, float)")', "C type 'void' is not one a numba section passes"),
    ("@export(float32(float32, float32))", "export takes one string, the C signature"),
])
def test_a_malformed_declaration_is_reported_at_its_line(decorator, says):
    text = EXAMPLE.replace('@export("float(float, float)")', decorator)
    line = next(n for n, l in enumerate(text.splitlines(), 1) if l.startswith("@export"))
    with pytest.raises(N.NumbaError) as e:
        N.declarations("gate_up_silu", PY, text)
    ((f, n, sev, msg, src),) = e.value.messages
    assert (f, n, sev) == (PY, line, "error") and says in msg and src == decorator


def test_invalid_python_and_a_file_that_declares_nothing_are_reported_at_their_lines():
    with pytest.raises(N.NumbaError) as e:
        N.declarations("gate_up_silu", PY, EXAMPLE.replace("return g /", "return g //// "))
    assert e.value.messages[0][:2] == (PY, RETURN_LINE) and "invalid Python" in e.value.messages[0][3]
    with pytest.raises(N.NumbaError, match="no device function is declared"):
        N.declarations("gate_up_silu", PY, "def wb_silu_mul(g, u):\n    return g\n")


# ---- compiled: numba, ptxas, nvJitLink -----------------------------------------------------------------------------

@needs_numba
@needs_ptxas
def test_the_example_compiles_into_the_whole_build_with_its_lines():
    """The epilogue's PTX is defined in the module where NVRTC declared it, its `.loc` lines at the .py file, the
    kernel keeps off the stack, and its SASS is listed under the .py line that asked for it."""
    cfg = get_config("llama-3.2-1b")
    asm = assemble(cfg, NUMBA)
    N._CACHE.clear()
    t0 = time.perf_counter()
    (compiled,) = C.compile_numba(asm, "sm_90")
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    C.compile_numba(asm, "sm_90")
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    cubin, ptx, _ = C.compile_nvidia(asm)
    whole = time.perf_counter() - t0
    t0 = time.perf_counter()
    C.compile_nvidia(assemble(cfg))
    cpp = time.perf_counter() - t0
    print(f"numba compile: {cold:.3f} s cold (this process's first), {warm:.4f} s cached; whole build with it "
          f"{whole:.2f} s, all-C++ build {cpp:.2f} s")
    assert ".visible .func" in compiled.ptx["wb_silu_mul"] and compiled.seconds > 0
    assert not re.search(r"\.extern\s+\.func[^;]*\bwb_silu_mul\b", ptx)
    assert ".visible .func  (.param .b32 func_retval0) wb_silu_mul(" in ptx and "call.uni" in ptx
    (r,) = C.resource_usage(cubin)
    assert r.stack == 0
    assert f'"{PY}"' in ptx                                       # the .py is a file of the module's line info
    listing = C.dump_section(asm, "sass", "gate_up_silu")
    assert listing.startswith("// gate_up_silu@numba.py:")      # the stage's name picks the Python code
    assert "MUFU.EX2" in _under(listing, f"gate_up_silu@numba.py:{RETURN_LINE} ", "//")
    assert "ex2.approx" in _under(C.dump_section(asm, "ptx", "gate_up_silu"),
                                  f"gate_up_silu@numba.py:{RETURN_LINE} ", "//")


@needs_numba
@pytest.mark.skipif(not units_linkable(), reason="no nvJitLink (cuda-bindings and nvidia-nvjitlink, the cuda extra)")
def test_the_units_build_links_the_numba_ptx():
    asm = assemble(get_config("tiny"), dataclasses.replace(NUMBA, units=True))
    assert asm.units
    t0 = time.perf_counter()
    cubin, _, _ = C.compile_nvidia(asm)
    print(f"units build with the numba PTX linked: {time.perf_counter() - t0:.2f} s")
    assert b"wb_silu_mul" in cubin and C.resource_usage(cubin)[0].kernel == "wb_generate"
    # without it the stage's unit leaves wb_silu_mul undefined: the link says so
    bare = dataclasses.replace(asm, numba=())
    with pytest.raises(C.CompileError, match="wb_silu_mul"):
        C.compile_nvidia(bare)


@needs_numba
@needs_ptxas
def test_build_prints_the_kernels_resources():
    r = _build("--model", "tiny", "--variant", "gate_up_silu=numba")
    assert r.returncode == 0, r.stderr
    assert "tiny sm_90 wb_generate:" in r.stdout and "registers, 0 B local (spills)" in r.stdout


@needs_numba
def test_a_typing_error_is_reported_at_its_py_line():
    asm = _with_text(assemble(get_config("tiny"), NUMBA), EXAMPLE.replace("* u\n", '* u + "x"\n'))
    with pytest.raises(C.CompileError) as e:
        C.compile_nvidia(asm)
    ((f, n, sev, msg, src),) = e.value.messages
    assert (f, n, sev) == (PY, RETURN_LINE, "error") and src.strip().endswith('* u + "x"')
    assert msg.startswith("numba: No implementation of function") and "add(float32, Literal[str](x))" in msg


@needs_numba
def test_a_result_of_another_type_than_declared_is_reported_at_the_function():
    """A bare 1.0 is a float64 in numba: the result is one, where the declaration (and the C++ caller) says
    float."""
    asm = _with_text(assemble(get_config("tiny"), NUMBA), EXAMPLE.replace("float32(1.0)", "1.0"))
    with pytest.raises(C.CompileError) as e:
        C.compile_nvidia(asm)
    ((f, n, _, msg, src),) = e.value.messages
    assert (f, src.strip()) == (PY, "def wb_silu_mul(g, u):")
    assert msg.startswith("wb_silu_mul returns float64 where its declaration says float (float32)")


@needs_numba
def test_an_error_running_the_file_is_reported_at_its_line():
    text = EXAMPLE.replace("from numba import float32", "from numba import float33")
    line = next(n for n, l in enumerate(text.splitlines(), 1) if "float33" in l)
    asm = _with_text(assemble(get_config("tiny"), NUMBA), text)
    with pytest.raises(C.CompileError) as e:
        C.compile_nvidia(asm)
    assert e.value.messages[0][:2] == (PY, line) and "ImportError" in e.value.messages[0][3]


@needs_numba
def test_a_call_that_does_not_match_the_declaration_is_reported_at_the_cpp_line():
    """The prototype comes from the declaration, so NVRTC checks the C++ section's calls against it."""
    cuh = section_path("gate_up_silu", "numba").read_text()
    bad = cuh.replace("wb_silu_mul(gu[0], gu[1])", "wb_silu_mul(gu[0], gu[1], 2.f)")
    line = next(n for n, l in enumerate(bad.splitlines(), 1) if "2.f)" in l)
    with pytest.raises(C.CompileError) as e:
        C.compile_nvidia(assemble(get_config("tiny"), NUMBA, overrides={"gate_up_silu": bad}))
    assert ("kernels/sections/gate_up_silu@numba.cuh", line) in [m[:2] for m in e.value.messages]


@needs_numba
def test_the_cli_reports_a_wrong_typed_edit_in_one_line_at_the_py_line(tmp_path):
    ws = _workspace(tmp_path, EXAMPLE.replace("* u\n", '* u + "x"\n'))
    r = _build("--model", "tiny", "--variant", "gate_up_silu=numba", workspace=ws)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert errors == [next(line for line in errors if line.startswith(f"{PY}:{RETURN_LINE}: error: numba: "))]


@needs_numba
def test_a_numpy_without_row_stack_still_compiles_numba_sections():
    """NumPy 2.5 removed the np.row_stack alias, which numba-cuda (0.30.4 and before) overloads as its typing loads
    at the first compile: on the GPU machine every numba section died inside numba. The build runs here in a
    process whose NumPy has no row_stack, as that one's, and must still compile the shipped epilogue."""
    r = _build("--model", "tiny", "--variant", "gate_up_silu=numba",
               pre="import numpy; del numpy.row_stack; ")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wb_generate" in r.stdout


@needs_numba
def test_a_fault_inside_numba_cuda_is_one_line_naming_the_versions():
    """The same NumPy without row_stack, with the alias not put back: the fault is numba-cuda's own, so the build
    says so in one line (numba-cuda's and NumPy's versions, the function it was compiling), not a traceback, and
    does not blame the section's code."""
    r = _build("--model", "tiny", "--variant", "gate_up_silu=numba",
               pre="import numpy; del numpy.row_stack; import workbench.compiler.numba_sections as N; "
                   "N._numpy_names_numba_cuda_needs = lambda: None; ")
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: numba-cuda ") and "failed inside its own code compiling wb_silu_mul" in line
    assert "AttributeError" in line and "row_stack" in line and "with NumPy " in line


def test_a_missing_numba_is_refused_in_one_line_naming_the_install():
    r = _build("--model", "tiny", "--variant", "gate_up_silu=numba", pre="sys_ = __import__('sys'); "
               "sys_.modules['numba'] = None; ")
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: --variant gate_up_silu=numba: a numba section needs numba and numba-cuda")
    assert "pip install" in line and "[cuda]" in line


def test_a_numba_variant_without_its_py_is_refused_in_one_line(tmp_path):
    ws = _workspace(tmp_path)
    os.remove(os.path.join(ws, "sections", "gate_up_silu@numba.py"))
    r = _build("--model", "tiny", "--variant", "gate_up_silu=numba", workspace=ws)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "gate_up_silu@numba.py does not exist" in line


HELPERS = '''import math

from numba import cuda, float32

from workbench.compiler.numba_sections import export


@cuda.jit(device=True)
def sigmoid(x):
    return float32(1.0) / (float32(1.0) + math.exp(-x))


@export("float(float, float)")
def wb_silu_mul(g, u):
    return g * sigmoid(g) * u


@export("float(float)")
def wb_gate(g):
    return sigmoid(g)
'''


@needs_numba
@needs_ptxas
def test_exported_functions_may_share_a_helper_compiled_for_the_builds_arch(tmp_path):
    """A `@cuda.jit(device=True)` helper, which numba-cuda compiles for the current device (none here), is
    compiled for the build's arch; two exported functions calling it both reach the C++ and the module assembles.
    Each numba module carries its own copy of what NVVM kept out of line (here NVVM inlines the helper, so a
    function is added to both modules): the splice defines it once."""
    cuh = section_path("gate_up_silu", "numba").read_text()
    calls = cuh.replace("wb_silu_mul(gu[0], gu[1])", "wb_silu_mul(gu[0], gu[1]) * wb_gate(gu[1])")
    with paths.use_kernels_dir(_workspace(tmp_path, HELPERS)):
        asm = assemble(get_config("tiny"), NUMBA, overrides={"gate_up_silu": calls})
    assert [d.prototype() for d in asm.numba[0].functions] == [
        'extern "C" __device__ float wb_silu_mul(float, float);', 'extern "C" __device__ float wb_gate(float);']
    for arch in ("sm_90", "sm_100"):
        cubin, ptx, _ = C.compile_nvidia(asm, arch)
        assert "wb_silu_mul(" in ptx and "wb_gate(" in ptx and C.resource_usage(cubin)[0].stack == 0
        assert f".target {arch}" in ptx
    from workbench.compiler.nvrtc import NVRTC_OPTIONS, nvrtc_program
    (compiled,) = C.compile_numba(asm, "sm_90")
    ok, _, module, _ = nvrtc_program(asm.source, ["--gpu-architecture=compute_90", *NVRTC_OPTIONS], cubin=False)
    helper = ".func  (.param .b32 r) wb_kept(\n\t.param .b32 x\n)\n{\n\t.reg .b32 %r<2>;\n\tld.param.b32 %r1, [x];\n" \
             "\tst.param.b32 [r], %r1;\n\tret;\n}\n\n"
    both = dataclasses.replace(compiled, ptx={k: v.replace(".visible .func", helper + ".visible .func", 1)
                                              for k, v in compiled.ptx.items()})
    ptx, spans = N.splice(module, [both])
    assert ok and ptx.count(") wb_kept(") == 1
    C.ptxas(ptx, asm, spans)


@needs_numba
@needs_ptxas
def test_an_assembler_error_in_numbas_ptx_is_reported_at_the_py_line():
    """ptxas's messages about the spliced functions are mapped back through their line info to the .py line."""
    from workbench.compiler.nvrtc import NVRTC_OPTIONS, nvrtc_program
    asm = assemble(get_config("tiny"), NUMBA)
    (compiled,) = C.compile_numba(asm, "sm_90")
    ok, _, module, _ = nvrtc_program(asm.source, ["--gpu-architecture=compute_90", *NVRTC_OPTIONS], cubin=False)
    assert ok
    broken = dataclasses.replace(compiled, ptx={k: v.replace("ex2.approx.ftz.f32", "ex2.approx.ftz.f33")
                                                for k, v in compiled.ptx.items()})
    ptx, spans = N.splice(module, [broken])
    with pytest.raises(C.CompileError) as e:
        C.ptxas(ptx, asm, spans)
    (f, n, sev, msg, src) = e.value.messages[0]
    assert (f, n, sev) == (PY, RETURN_LINE, "error") and "f33" in msg and src.strip().startswith("return")


def test_the_amd_build_of_a_numba_variant_is_refused_in_one_line():
    r = _build("--model", "tiny", "--target", "hip", "--variant", "gate_up_silu=numba")
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if ": error: " in line]
    assert errors == [f"{PY}: error: device functions in Python are compiled by numba-cuda, to PTX: build the AMD "
                      "target without the variant (its C++ section, gate_up_silu.cuh)"]


@needs_numba
@needs_ptxas
def test_the_loop_builds_a_numba_variant_reports_its_errors_reloads_on_a_py_save_and_undoes(tmp_path, monkeypatch):
    """A CPU-mode Workbench: the numba variant builds (debug and timed), a save of the .py that does not type is a
    compile error at its line, the watcher reloads on that file; an edit of the .py through the workbench is
    undone byte for byte, from a history of its own (the .cuh's is untouched)."""
    from workbench.loop import session
    ws = _workspace(tmp_path)
    monkeypatch.setattr(session, "_ACTIVE", None)
    with paths.use_kernels_dir(ws), session.Workbench("tiny", device="cpu") as wb:
        rec = wb.use_variant("gate_up_silu", "numba")
        assert rec.status == session.NO_GPU and rec.resources["registers"] > 0, rec.report()
        py = numba_path("gate_up_silu", "numba")
        assert py.resolve() in wb.build_files()
        n = len(wb.history)
        wb.watch(interval_s=0.05, debounce_s=0.1)
        try:
            py.write_text(EXAMPLE.replace("* u\n", '* u + "x"\n'))
            deadline = time.monotonic() + 60
            while len(wb.history) == n and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            wb.unwatch()
        bad = wb.last
        assert bad.trigger == "watch" and (bad.section, bad.variant) == ("gate_up_silu", "numba")
        assert bad.status == session.COMPILE_ERROR and bad.messages[0][:2] == (PY, RETURN_LINE), bad.report()
        py.write_text(EXAMPLE)
        assert wb.reload().status == session.NO_GPU
        wrong = EXAMPLE.replace("float32(1.0)", "1.0")
        assert wb.edit("gate_up_silu", wrong, "numba", python=True) is not None and py.read_text() == wrong
        rec = wb.reload(section="gate_up_silu", variant="numba")
        assert rec.status == session.COMPILE_ERROR and "returns float64" in rec.messages[0][3]
        assert len(wb.section_history("gate_up_silu", "numba", python=True)) == 1
        assert wb.section_history("gate_up_silu", "numba") == []
        rec = wb.undo("gate_up_silu", "numba", python=True)
        assert py.read_text() == EXAMPLE and rec.status == session.NO_GPU and rec.trigger == "undo"
        with pytest.raises(ValueError, match="is not one"):
            wb.edit("gate_up_silu", EXAMPLE, "ptx", python=True)


POINTERS = '''from numba import float32

from workbench.compiler.numba_sections import export


@export("int(float *, const float*, int)")
def wb_twice(out, x, n):
    for i in range(n):
        out[i] = x[i] * float32(2.0)
    return n
'''


@needs_numba
def test_pointers_pass_as_the_c_abi_passes_them_const_kept_in_the_prototype():
    src = N.declarations("gate_up_silu", PY, POINTERS)
    assert src.functions[0].prototype() == 'extern "C" __device__ int wb_twice(float*, const float*, int);'
    head = N.compile_source(src).ptx["wb_twice"]
    head = head[head.index(".visible"):head.index("{")]
    assert head.count(".param .b64") == 2 and head.count(".param .b32") == 2     # two addresses; n and the result


@needs_numba
def test_the_numba_loop_benchmark_runs_its_edits_and_puts_every_file_back(tmp_path):
    """The device suite's measurement of a numba edit, on the CPU backend: its harmless .py edits compile, its
    typing error comes back at the return line of the .py, and undo leaves both files as they were."""
    from workbench.loop.benchmark import numba_loop_benchmark
    ws = _workspace(tmp_path)
    py, cuh = Path(ws) / "sections" / "gate_up_silu@numba.py", Path(ws) / "sections" / "gate_up_silu.cuh"
    before = py.read_bytes(), cuh.read_bytes()
    with paths.use_kernels_dir(ws):
        out = numba_loop_benchmark("tiny", edits=1, device="cpu")
    assert [r["status"] for r in out["numba_edits"] + out["cpp_edits"]] == ["compiled; no GPU to run"] * 2
    t = out["typing_error"]
    assert t["status"] == "compile error" and t["at_py_line"] and t["expected_line"] == RETURN_LINE
    assert out["undo_restored"] and out["files_restored"]
    assert (py.read_bytes(), cuh.read_bytes()) == before

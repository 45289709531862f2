"""Portability: every preset compiles for NVIDIA sm_90 (NVRTC) and AMD gfx942 (clang's HIP front end), messages map
back to section files on both, the per-section machine-code dumps work, and no section hard-codes a warp width or
a model shape. CPU only: nothing here runs a kernel.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from workbench.compiler import compile as C
from workbench.cli import main
from workbench.compiler.assemble import BuildOptions, assemble, section_path, smem_bytes
from workbench.paths import kernels_dir
from workbench.model.config import PRESETS, get_config
from workbench.plan import Launch


def _clang_missing() -> str | None:
    try:
        C.clang_path()
    except FileNotFoundError as e:
        return str(e)
    return None


needs_clang = pytest.mark.skipif(_clang_missing() is not None,
                                 reason=f"no clang for the AMD build ({_clang_missing()}); .ci/run installs clang-19")

# ---- every preset, both targets ------------------------------------------------------------------------------------
# qwen2.5-1.5b (head_dim 128, 6 query heads a kv head, biases) still spills in the stages' loops (104 B without
# early loads; 304 with round 13's attention, which ran and verified on the H200, NOTES.md round 11). With early
# loads (the default since round 16) it spills 128 B, and qwen3-4b (head_dim 128, q_dim 4,096) 104 B: the early
# path's second copy of a unit's first chunk at the 128-register cap (NOTES.md rounds 16 and 17). strict: the marker goes
# when the spills do. (The Qwen3 presets' 8 B, the step's token held across the sampler call, went with the step's
# values to shared memory, round 15.)
SPILLS = {"qwen2.5-1.5b": "the stages' loops spill with 6 query heads of 128 per kv head and biases",
          "qwen3-4b": "the early loads' path spills at the register cap (104 B)"}


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=SPILLS[p]))
                                    if p in SPILLS else p for p in PRESETS])
def test_every_preset_compiles_for_sm90_without_spills(preset):
    cubin, _ = C.compile_cubin(assemble(get_config(preset)), arch="sm_90")
    (r,) = C.resource_usage(cubin)
    assert r.kernel == "wb_generate" and 0 < r.registers <= 255
    assert r.stack == 0, f"{preset}: {r.stack} B of local memory (spills) on sm_90"


@needs_clang
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_compiles_for_gfx942(preset):
    cfg, opt = get_config(preset), BuildOptions().for_target("hip")
    text, _ = C.compile_hip(assemble(cfg, opt), arch="gfx942")
    (r,) = C.amdgpu_resources(text)
    assert r.kernel == "wb_generate"
    assert r.wavefront == 64 and r.max_threads == BuildOptions().launch.threads
    assert 0 < r.vgprs <= 512 and 0 < r.sgprs <= 112 and r.scratch >= 0
    assert r.lds + smem_bytes(cfg, opt) <= 65536, f"{preset}: more LDS than a gfx942 workgroup has"
    # spills are not held against the AMD build here (it is not run yet): `build --target hip --no-spills` shows them


@needs_clang
@pytest.mark.parametrize("opt", [BuildOptions(timing=True), BuildOptions(hang=("attention_decode", 0, 1)),
                                 BuildOptions(launch=Launch(threads=256)),
                                 BuildOptions(launch=Launch(early=("qkv_rope_append", "o_proj_residual",
                                                                   "gate_up_silu", "lm_head")))],
                         ids=["timing", "hang", "threads256", "early"])
def test_build_options_compile_for_gfx942(opt):
    text, _ = C.compile_hip(assemble(get_config("tiny"), opt))
    assert C.amdgpu_resources(text)[0].max_threads == opt.launch.threads


# ---- compiler messages point at the section file and line, on both targets ----------------------------------------
def _broken_lm_head() -> tuple[str, int]:
    """lm_head.cuh with one bad line appended (independent of what the section holds), and that line's number."""
    lines = section_path("lm_head").read_text().rstrip("\n").splitlines()
    lines.append("__device__ int wb_broken_probe() { return no_such_identifier; }")
    return "\n".join(lines) + "\n", len(lines)


@pytest.mark.parametrize("target", ["cuda", pytest.param("hip", marks=needs_clang)])
def test_broken_section_reports_file_and_line(target):
    text, line = _broken_lm_head()
    asm = assemble(get_config("tiny"), overrides={"lm_head": text})
    with pytest.raises(C.CompileError) as ei:
        C.compile_cubin(asm) if target == "cuda" else C.compile_hip(asm)
    errors = [m for m in ei.value.messages if m[2] == "error"]
    assert errors, ei.value.log
    f, n, _, msg, src = errors[0]
    assert (f, n) == ("kernels/sections/lm_head.cuh", line)
    assert "no_such_identifier" in msg and "no_such_identifier" in src
    assert f"kernels/sections/lm_head.cuh:{line}: error" in str(ei.value)


def test_parse_log_reads_clang_messages():
    log = ("kernels/sections/matvec.cuh:27:17: error: no matching function for call to 'f'\n"
           "kernels/portability.cuh:3:1: note: candidate function not viable\n"
           "<generated: Params, Stage>:2:5: warning: unused variable 'x' [-Wunused-variable]\n"
           "1 error generated when compiling for gfx942.\n")
    got = [(f, n, sev) for f, n, sev, _, _ in C.parse_log(log)]
    assert got == [("kernels/sections/matvec.cuh", 27, "error"), ("<generated: Params, Stage>", 2, "warning")]


@pytest.mark.parametrize("target", ["cuda", pytest.param("hip", marks=needs_clang)])
def test_cli_build_exits_nonzero_on_compile_error(target, monkeypatch, capsys):
    import workbench.compiler.assemble as A
    text, line = _broken_lm_head()
    real = A.assemble
    monkeypatch.setattr(A, "assemble", lambda cfg, opt=BuildOptions(), overrides=None:
                        real(cfg, opt, {"lm_head": text}))
    assert main(["build", "--model", "tiny", "--target", target]) == 1
    assert f"kernels/sections/lm_head.cuh:{line}: error" in capsys.readouterr().err


# ---- resources off the AMDGCN assembly -----------------------------------------------------------------------------
def test_amdgpu_resources_from_comments_only():
    text = """\t.amdhsa_kernel k1
\t.end_amdhsa_kernel
; Kernel info:
; codeLenInByte = 100
; NumSgprs: 40
; NumVgprs: 77
; NumAgprs: 4
; TotalNumVgprs: 84
; ScratchSize: 16
; LDSByteSize: 1024 bytes/workgroup (compile time only)
"""
    (r,) = C.amdgpu_resources(text)
    assert (r.kernel, r.vgprs, r.sgprs, r.agprs, r.lds, r.scratch, r.spills) == ("k1", 77, 40, 4, 1024, 16, True)


@needs_clang
def test_cli_build_hip_reports_resources(capsys):
    assert main(["build", "--model", "tiny", "--target", "hip"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^tiny gfx942 wb_generate: \d+ VGPRs, \d+ SGPRs, \d+ AGPRs, \d+ B scratch \(spills\), "
                     r"\d+ B static LDS", out, re.M), out


@pytest.mark.parametrize("scratch", [0, 16])
def test_cli_no_spills_fails_on_amd_scratch(scratch, monkeypatch, capsys):
    """--no-spills exits 1 exactly when the private segment is in use (the compiler itself stubbed out)."""
    monkeypatch.setattr(C, "compile_hip", lambda asm, arch="gfx942", debug=False: ("", ""))
    monkeypatch.setattr(C, "amdgpu_resources", lambda text: [C.AmdResources("wb_generate", 100, 50, 0, 32, scratch)])
    assert main(["build", "--model", "tiny", "--target", "hip", "--no-spills"]) == (1 if scratch else 0)
    assert ("scratch in use" in capsys.readouterr().err) == bool(scratch)


def test_cli_all_presets_builds_each(monkeypatch, capsys):
    seen = []
    def fake(asm, arch="sm_90"):
        seen.append(re.search(r"#define WB_VOCAB (\d+)", asm.source)[1])
        return b"", ""
    monkeypatch.setattr(C, "compile_cubin", fake)
    monkeypatch.setattr(C, "resource_usage", lambda cubin: [C.Resources("wb_generate", 100, 0, 0, 0)])
    assert main(["build", "--all-presets", "--no-spills"]) == 0
    assert len(seen) == len(PRESETS)
    assert sorted(seen) == sorted(str(PRESETS[n].vocab) for n in PRESETS)
    assert [l.split()[0] for l in capsys.readouterr().out.splitlines()] == list(PRESETS)


# ---- machine code of one section ----------------------------------------------------------------------------------
# an instruction each target must spend on qkv_rope_append's dot products (the fused FMAs of wb_dot8)
_MNEMONIC = {"ptx": r"\bfma\.rn\.f32\b", "sass": r"\bFFMA\b", "amdgcn": r"\bv_(pk_)?fma(c|k)?_f32"}


@pytest.mark.parametrize("kind", ["ptx", "sass", pytest.param("amdgcn", marks=needs_clang)])
def test_dump_section_names_its_instructions(kind, capsys):
    assert main(["build", "--model", "tiny", "--dump", kind, "--section", "qkv_rope_append"]) == 0
    out = capsys.readouterr().out
    code = [l for l in out.splitlines() if l.strip() and not l.startswith(("//", ";"))]
    heads = [l for l in out.splitlines() if l.startswith(("//", ";"))]
    assert len(code) > 50 and re.search(_MNEMONIC[kind], out), out[:2000]
    # every run of code is headed by its source, starting at the section's own line
    assert heads and all(h.split()[1].startswith("qkv_rope_append.cuh:") for h in heads)
    assert any("matvec.cuh:" in h for h in heads)               # inlined helpers are followed into
    # and nothing of another stage is in it
    assert "lm_head.cuh" not in out and "attention_decode.cuh" not in out


@needs_clang
def test_amdgcn_dump_without_llvm_tools_falls_back_to_the_assembly(monkeypatch):
    def missing(name):
        raise FileNotFoundError(name)
    monkeypatch.setattr(C, "llvm_tool", missing)
    asm = assemble(get_config("tiny"))
    lst = C.machine_listing(asm, "amdgcn")
    assert lst and all(len(chain) == 1 for _, chain in lst)          # innermost frames only
    out = C.dump_section(asm, "amdgcn", "matvec")
    assert re.search(_MNEMONIC["amdgcn"], out) and out.startswith("; matvec.cuh:")


def test_dump_rejects_unknown_section_and_wrong_target(capsys):
    assert main(["build", "--model", "tiny", "--dump", "ptx", "--section", "no_such_section"]) == 2
    assert "no_such_section" in capsys.readouterr().err
    assert main(["build", "--model", "tiny", "--dump", "sass", "--target", "hip"]) == 2


def test_listing_ptx_follows_inlining():
    ptx = """\t.loc\t1 10 5
\tmov.u32 %r1, %tid.x;
\t.loc\t2 20 3, function_name $L__info_string0, inlined_at 1 11 7
\t.loc\t3 30 9, function_name $L__info_string1, inlined_at 2 20 3
\tfma.rn.f32 %f1, %f2, %f3, %f4;
\t.loc\t3 31 9, function_name $L__info_string1, inlined_at 2 20 3
\tadd.f32 %f5, %f1, %f1;
\t.file\t1 "/x/kernels/sections/a.cuh"
\t.file\t2 "/x/kernels/sections/b.cuh"
\t.file\t3 "/x/kernels/portability.cuh"
"""
    lst = C.listing_ptx(ptx)
    assert [c for _, c in lst] == [
        (("/x/kernels/sections/a.cuh", 10),),
        (("/x/kernels/portability.cuh", 30), ("/x/kernels/sections/b.cuh", 20), ("/x/kernels/sections/a.cuh", 11)),
        (("/x/kernels/portability.cuh", 31), ("/x/kernels/sections/b.cuh", 20), ("/x/kernels/sections/a.cuh", 11)),
    ]


# ---- no warp width, no model shape in the kernel sources ----------------------------------------------------------
def _code_only(text: str) -> str:
    """The source without comments and string literals (line structure kept)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m[0].count("\n"), text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def _literals(text: str):
    """(line, integer literal, the text before it on its line) for each decimal integer literal: not part of an
    identifier (u32), of a hex or float literal (0x20, 1.32, 32.f), and with its suffix (32u, 32ull) stripped.
    A `#define NAME_BYTES n` is a byte count (a tunable such as a staging size), not a shape or a warp width."""
    for n, line in enumerate(_code_only(text).splitlines(), 1):
        if re.match(r"^\s*#\s*define\s+\w+_BYTES\s+\d+\s*$", line):
            continue
        for m in re.finditer(r"(?<![\w.])(\d+)(?:[uUlL]*)(?![\w.])", line):
            yield n, int(m[1]), line[:m.start()]


KERNEL_FILES = sorted([*kernels_dir().rglob("*.cuh"), *kernels_dir().rglob("*.ptx")])
WARP_FILES = [p for p in KERNEL_FILES if p.name != "portability.cuh"]   # the one place WB_WARP is defined


def _shapes() -> set[int]:
    """Sizes a preset could leak into the source: widths, vocabularies, sequence lengths. Small powers of two that
    are thread-count or scratch bounds (256, 512, 1024) are not shapes."""
    out = {2048, 4096, 128256}
    for c in PRESETS.values():
        out |= {c.hidden, c.intermediate, c.vocab, c.q_dim, c.kv_dim, c.qkv_rows, c.max_seq}
    return {v for v in out if v > 128 and v not in (256, 512, 1024)}


def test_kernel_files_found():
    names = {p.name for p in KERNEL_FILES}
    assert {"portability.cuh", "monokernel.cuh", "qkv_rope_append.cuh", "lm_head.cuh"} <= names


@pytest.mark.parametrize("path", WARP_FILES, ids=lambda p: p.name)
def test_no_literal_warp_width(path):
    bad = [f"{path.name}:{n}: {v}" for n, v, before in _literals(path.read_text())
           if v in (32, 64) and not re.search(r"(<<|>>)\s*$", before)]       # shifts by 32 are not warp widths
    assert not bad, "warp width as a literal (use WB_WARP, WB_MAX_WARPS): " + "; ".join(bad)


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_no_literal_model_shape(path):
    shapes = _shapes()
    bad = [f"{path.name}:{n}: {v}" for n, v, _ in _literals(path.read_text()) if v in shapes]
    assert not bad, "model shape as a literal (shapes come from the WB_* defines): " + "; ".join(bad)


def test_literal_checks_catch_what_they_should_and_nothing_else():
    src = """// a comment with 32 and 4096
u32 a = 0x20 + 1.32f; u64 b = x >> 32; float c = 32.f;
int lane = tid % 32;   /* 64 in a block comment */
int w = tid / 64u;
int d = 2048;
#define WB_STAGE_BYTES 8192
"""
    hits = [(n, v) for n, v, before in _literals(src) if v in (32, 64) and not re.search(r"(<<|>>)\s*$", before)]
    assert hits == [(3, 32), (4, 64)]
    assert [(n, v) for n, v, _ in _literals(src) if v in _shapes()] == [(5, 2048)]


# ---- the notebook runs headless -----------------------------------------------------------------------------------
@needs_clang
def test_assembly_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    path = Path(__file__).resolve().parent.parent / "notebooks" / "assembly.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "gfx942" in text and "VGPRs" in text and "instruction lines attributed to" in text
    assert "LDG.E.NA.128" in text and "v_pk_fma_f32" in text          # the GEMV's loop, on both vendors
    html = "".join(o.get("data", {}).get("text/html", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    assert "PTX" in html and "SASS" in html and "AMDGCN" in html


def test_barrier_fences_only_where_the_memory_model_needs_them():
    """NVIDIA: release-add arrival and acquire spin with bar.sync on both sides, no extra fence (WB_BAR_FENCES=1
    adds one on each side of every barrier); AMD keeps them by default."""
    cfg = get_config("tiny")
    ptx = {f: C.compile_ptx(assemble(cfg, BuildOptions(defines=(("WB_BAR_FENCES", f),))))[0] for f in ("0", "1")}
    default_ptx, _ = C.compile_ptx(assemble(cfg))

    def fences(text):
        return len(re.findall(r"fence\.acq_rel\.gpu|membar\.gl", text))
    assert fences(default_ptx) == fences(ptx["0"])
    assert fences(ptx["1"]) > fences(ptx["0"])
    assert "red.release.gpu" in default_ptx and "ld.acquire.gpu" in default_ptx
    amd = {f: C.compile_hip(assemble(cfg, BuildOptions(defines=(("WB_BAR_FENCES", f),))))[0] for f in ("0", "1")}
    amd_default, _ = C.compile_hip(assemble(cfg))

    def writebacks(text):
        return len(re.findall(r"buffer_wbl2|global_wb", text))
    assert writebacks(amd_default) == writebacks(amd["1"])
    assert writebacks(amd["1"]) > writebacks(amd["0"])

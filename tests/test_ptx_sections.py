"""Sections written in assembly, without a GPU: a stage's body in PTX (kernels/sections/NAME@ptx*.ptx) spliced into
the module's PTX and assembled by ptxas, its messages at the .ptx file's lines and its SASS listed by them; the
AMDGCN inline-asm variant compiled for gfx942. Running and verifying them needs a GPU (tests/test_gpu.py)."""
from __future__ import annotations

import re

import pytest

from workbench.compiler import compile as C
from workbench.compiler.assemble import BuildOptions, assemble, section_path
from workbench.compiler.ptx import cpp_params, is_ptx_variant
from workbench.model.config import get_config
from workbench.plan import STAGE_NAMES, Launch
from test_portability import needs_clang

PTX = BuildOptions(variants=(("embedding", "ptx"),))
EMBED_PTX = "kernels/sections/embedding@ptx.ptx"


def _ptxas_found() -> bool:
    try:
        C.cuda_tool("ptxas")
        return True
    except FileNotFoundError:
        return False


needs_ptxas = pytest.mark.skipif(not _ptxas_found(), reason="no ptxas (CUDA toolkit or the nvidia-cuda-nvcc wheel)")


def _under(listing: str, head: str, comment: str) -> str:
    """The machine code listed under every heading line that contains `head` (a listing is headed by source
    lines, each run of instructions under the line it came from)."""
    out, inside = [], False
    for line in listing.splitlines():
        if line.startswith(comment):
            inside = head in line
        elif inside:
            out.append(line)
    return "\n".join(out)


def test_a_ptx_variant_is_a_ptx_file_of_a_stage():
    assert is_ptx_variant("ptx") and is_ptx_variant("ptx_fast") and not is_ptx_variant("fast")
    assert section_path("embedding", "ptx").name == "embedding@ptx.ptx"
    with pytest.raises(ValueError, match="only a stage's function"):
        section_path("matvec", "ptx")


def test_parameters_are_named_as_the_cpp_declaration_names_them():
    assert cpp_params(section_path("embedding").read_text(), "stage_embedding") == ("token", "embed", "x")
    with pytest.raises(ValueError, match="must define it"):
        cpp_params("void other() {}", "stage_embedding")


@needs_ptxas
@pytest.mark.parametrize("model,stage", [(m, s) for m in ("tiny", "qwen3-0.6b") for s in STAGE_NAMES])
def test_every_stage_can_be_written_in_ptx_with_all_its_parameters(model, stage):
    """A body (here one that only returns) can replace any stage's: the compiler keeps every parameter of the C++
    declaration, even those the C++ body leaves unused (layer, a family's buffers) or that every call passes the
    same value for (smem), and the kernel keeps its registers off the stack."""
    cfg = get_config(model)
    asm = assemble(cfg, BuildOptions(variants=((stage, "ptx"),)), overrides={stage: "\tret;\n"})
    cubin, ptx, _ = C.compile_nvidia(asm)
    assert C.resource_usage(cubin)[0].stack == 0
    head = ptx[ptx.index(f"stage_{stage}_ptx", ptx.index(".func")):]
    head = head[:head.index("{")]
    assert head.count("_param_") == len(cpp_params(section_path(stage).read_text(), f"stage_{stage}"))


@needs_ptxas
def test_the_ptx_embedding_assembles_and_its_sass_is_listed_by_its_lines():
    asm = assemble(get_config("tiny"), PTX)
    assert [b.display for b in asm.ptx_bodies] == [EMBED_PTX] and asm.key != assemble(get_config("tiny")).key
    cubin, ptx, _ = C.compile_nvidia(asm)
    (r,) = C.resource_usage(cubin)
    assert r.stack == 0
    # the body is in place, its parameters and constants resolved, its comments gone, each instruction at its line
    body = ptx[ptx.index(".func _Z19stage_embedding_ptx"):]
    body = body[:body.index("\n}\n")]
    assert "[_Z19stage_embedding_ptxiPKtPx_param_1]" in body and "[embed]" not in body
    assert not re.search(r"(?<![$\w])WB_D\b", body) and ", 264;" in body and "//" not in body
    line = next(n for n, l in enumerate(section_path("embedding", "ptx").read_text().splitlines(), 1)
                if "ld.global.nc.u16" in l)
    sass = C.dump_section(asm, "sass", "embedding")
    assert "LDG.E.U16" in _under(sass, f"embedding@ptx.ptx:{line} ", "//")     # the load it made, under its line


OPROJ = BuildOptions(variants=(("o_proj_residual", "ptx"),))


@pytest.mark.parametrize("model", ["tiny", "llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"])
def test_the_ptx_gemv_assembles_without_spills_and_its_loop_is_listed_by_its_lines(model):
    """o_proj_residual@ptx.ptx, the O projection's warp GEMV in PTX: it uses the plan header's shared-memory
    offset by name, assembles on every shape without stack, and its 16-byte weight loads and FMAs are listed under
    the .ptx lines that asked for them."""
    cfg = get_config(model)
    asm = assemble(cfg, OPROJ)
    (b,) = asm.ptx_bodies
    assert dict(b.constants)["WB_SMEM_O_PROJ_RESIDUAL_ACT"] == "0"
    cubin, ptx, _ = C.compile_nvidia(asm)
    (r,) = C.resource_usage(cubin)
    assert r.stack == C.resource_usage(C.compile_cubin(assemble(cfg))[0])[0].stack == 0
    text = section_path("o_proj_residual", "ptx").read_text().splitlines()
    tail = next(n for n, l in enumerate(text, 1) if l.startswith("$WB_TAIL"))
    # rows of ≥ 1,024 elements take the four-piece loop (tiny's 192 only the tail: ptxas drops the loop)
    load = next(n for n, l in enumerate(text, 1) if ("[%rd9+WB_WARP*16]" in l if cfg.q_dim >= 1024 else
                                                     n > tail and "ld.global.nc" in l))
    fma = next(n for n, l in enumerate(text, 1) if "fma.rn.f32" in l and (cfg.q_dim >= 1024 or n > tail))
    sass = C.dump_section(asm, "sass", "o_proj_residual")
    assert re.search(r"LDG\.E(\.\w+)*\.128", _under(sass, f"o_proj_residual@ptx.ptx:{load} ", "//"))
    assert "FFMA" in _under(sass, f"o_proj_residual@ptx.ptx:{fma} ", "//")


def test_a_ptx_body_of_a_streamed_stage_is_refused_in_a_stream_build():
    stream = Launch(stream=True)
    with pytest.raises(ValueError, match="its weights arrive through the ring"):
        assemble(get_config("tiny"), BuildOptions(variants=(("o_proj_residual", "ptx"),), launch=stream))
    assemble(get_config("tiny"), BuildOptions(variants=(("embedding", "ptx"),), launch=stream))   # no weight stream


def test_the_plan_headers_integer_constants_reach_a_ptx_body():
    from workbench.compiler.ptx import header_constants
    got = header_constants("constexpr int A = 1, B_FLOATS = 20;\nconstexpr u32 C = 3u << 2;\n"
                           "constexpr long long D = 5LL;\nconstexpr int E = 4 * 7, F = 1 << 4, G = -2;")
    assert got == {"A": "1", "B_FLOATS": "20", "D": "5", "G": "-2"}      # expressions are left out


@needs_ptxas
@pytest.mark.parametrize("find, replace, says", [
    ("ld.global.nc.u16", "ld.global.nc.u17", "Unknown modifier '.u17'"),
    ("shl.b32 \t%r4, %r3, 16;", "shl.b32 \t%r4, %r9, 16;", "Unknown symbol '%r9'"),
    ("[embed]", "[embedding]", "embedding"),                     # not a parameter of stage_embedding
    ("shl.b32 \t%r4, %r3, 16;", "shl.b32 \t%r4, %r3 16;", "Parsing error"),   # a comma missing: ptxas's "fatal"
    ("shl.b32 \t%r4, %r3, 16;", "shl.b32 \t%r4, %r3, 16", "Parsing error"),   # the ';' missing: it runs into the next
])
def test_an_assembler_error_is_reported_at_the_ptx_line(find, replace, says):
    text = section_path("embedding", "ptx").read_text()
    bad = text.replace(find, replace)
    assert bad != text
    line = next(n for n, l in enumerate(text.splitlines(), 1) if find in l)        # the edited line
    with pytest.raises(C.CompileError) as e:
        C.compile_nvidia(assemble(get_config("tiny"), PTX, overrides={"embedding": bad}))
    hits = [m for m in e.value.messages if m[0] == EMBED_PTX and m[1] == line]
    assert hits and any(says in m[3] for m in hits), e.value.messages
    assert replace in hits[0][4]                                 # the user's own line, as written
    assert f"{EMBED_PTX}:{line}: error" in str(e.value)


@needs_ptxas
def test_the_stream_builds_stage_threads_leave_out_the_streaming_warp():
    asm = assemble(get_config("tiny"), BuildOptions(variants=(("embedding", "ptx"),), launch=Launch(stream=True)))
    assert dict(asm.ptx_bodies[0].constants)["WB_STAGE_THREADS"] == "480"
    _, ptx, _ = C.compile_nvidia(asm)
    assert "add.s32 \t%r2, %r2, 480;" in ptx


@needs_clang
def test_the_amdgcn_variant_compiles_for_gfx942_with_its_instruction():
    asm = assemble(get_config("tiny"), BuildOptions(variants=(("embedding", "gcn"),)))
    listing = C.dump_section(asm, "amdgcn", "embedding")
    line = next(n for n, l in enumerate(section_path("embedding", "gcn").read_text().splitlines(), 1)
                if "asm volatile" in l)
    assert "v_lshlrev_b32" in _under(listing, f"embedding@gcn.cuh:{line} ", ";")


@needs_clang
@pytest.mark.parametrize("model", ["tiny", "llama-3.2-1b"])
def test_the_amdgcn_gemv_compiles_for_gfx942_with_packed_fmas_and_is_portable_code_on_nvidia(model):
    """o_proj_residual@gcn.cuh: the O projection's dot products as v_pk_fma_f32 (two fp32 FMAs each) on gfx942,
    listed under its asm line, without scratch; on NVIDIA the same file is the portable GEMV, without stack."""
    cfg = get_config(model)
    opt = BuildOptions(variants=(("o_proj_residual", "gcn"),))
    asm = assemble(cfg, opt)
    listing = C.dump_section(asm, "amdgcn", "o_proj_residual")
    line = next(n for n, l in enumerate(section_path("o_proj_residual", "gcn").read_text().splitlines(), 1)
                if l.strip().startswith('asm("v_pk_fma_f32'))
    assert "v_pk_fma_f32" in _under(listing, f"o_proj_residual@gcn.cuh:{line} ", ";")
    text, _ = C.compile_hip(asm)
    assert all(r.stack == 0 for r in C.amdgpu_resources(text))
    (r,) = C.resource_usage(C.compile_cubin(asm)[0])
    assert r.stack == 0


@needs_ptxas
def test_the_loop_builds_a_ptx_section_and_keeps_a_wrong_edit_where_it_was(tmp_path):
    """Through a CPU-mode Workbench: the PTX variant builds; an edit of the .ptx that does not assemble is a
    compile error at its line, the last good build stays, and the text stays on disk until undone."""
    from test_session import copy_kernels

    from workbench.loop import session
    mp = pytest.MonkeyPatch()
    try:
        copy_kernels(tmp_path, mp)
        mp.setattr(session, "_ACTIVE", None)
        wb = session.Workbench("tiny", device="cpu", activate=False)
        try:
            rec = wb.use_variant("embedding", "ptx")
            assert rec.status == session.NO_GPU and rec.variants == (("embedding", "ptx"),), rec.report()
            good = dict(wb.backend.cubins)
            path = session.section_file("embedding", "ptx")
            text = path.read_text()
            bad = text.replace("ld.global.nc.u16", "ld.global.nc.u17")
            line = next(n for n, l in enumerate(bad.splitlines(), 1) if ".u17" in l)
            wb.edit("embedding", bad, variant="ptx")
            rec = wb.reload(trigger="edit", section="embedding", variant="ptx")
            assert rec.status == session.COMPILE_ERROR
            assert any(m[0] == EMBED_PTX and m[1] == line for m in rec.messages), rec.messages
            assert wb.backend.cubins == good and path.read_text() == bad
            assert wb.undo("embedding", "ptx").status == session.NO_GPU and path.read_text() == text
        finally:
            wb.close()
    finally:
        mp.undo()


@needs_ptxas
def test_build_dumps_a_ptx_sections_sass_and_refuses_it_for_amd(capsys):
    from workbench.cli import main
    assert main(["build", "--model", "tiny", "--variant", "embedding=ptx", "--dump", "sass", "--section",
                 "embedding"]) == 0
    out = capsys.readouterr().out
    assert "// embedding@ptx.ptx:" in out and "LDG.E.U16" in out
    assert main(["build", "--model", "tiny", "--variant", "embedding=ptx", "--target", "hip"]) == 1
    assert "a section written in PTX is NVIDIA's" in capsys.readouterr().err


@needs_ptxas
@pytest.mark.parametrize("opt", [BuildOptions(fast_compile="min", taps=True), BuildOptions(ptxas_opt=1)],
                         ids=["verification build", "ptxas -O1"])
def test_the_builds_compile_options_reach_ptxas(opt):
    """NVRTC stops at PTX for a build with PTX sections; its fast-compile level or ptxas -O level goes to the
    ptxas that assembles the spliced module (the registers and stack come out as the C++ build's: the rest of the
    kernel, not the embedding, sets them)."""
    import dataclasses
    cfg = get_config("tiny")
    (cpp,) = C.resource_usage(C.compile_cubin(assemble(cfg, opt))[0])
    (ptx,) = C.resource_usage(C.compile_cubin(assemble(cfg, dataclasses.replace(opt, variants=PTX.variants)))[0])
    assert (ptx.registers, ptx.stack) == (cpp.registers, cpp.stack)


def test_the_splice_finds_the_definition_and_maps_its_lines():
    """On a small module: a prototype of the function and a longer-named function that starts with its name are
    passed over; the body lands in the definition; with line info each instruction gets a .loc of the file (and the
    module a .file for it); without, none; the spans map module lines back to the body's."""
    from workbench.compiler.ptx import PtxBody, splice
    body = PtxBody("lm_head", "kernels/sections/lm_head@ptx.ptx", "// load\n\tld.param.u64 %rd1, [x];\n\tret;\n",
                   ("x",), (("WB_D", "8"),))
    fn = "_Z17stage_lm_head_ptxPKf"
    module = [".func " + fn + "(", "\t.param .b64 " + fn + "_param_0", ");",                 # a prototype
              ".func _Z21stage_lm_head_ptx_oldPKf(", "\t.param .b64 _Z21stage_lm_head_ptx_oldPKf_param_0", ")",
              "{", "\tret;", "}",
              ".func " + fn + "(", "\t.param .b64 " + fn + "_param_0", ")", "{", "\told body;", "}"]
    for files in ([], ['\t.file\t1 "/x/kernels/sections/lm_head.cuh"']):
        out, (span,) = splice("\n".join(module + files) + "\n", [body])
        lines = out.splitlines()
        assert lines[:9] == module[:9] and "old body;" not in out
        got = lines[span.first - 1:span.first - 1 + len(span.source)]
        assert ("\tld.param.u64 %rd1, [" + fn + "_param_0];") in got
        assert any(l.startswith("\t.loc\t2 2 0") for l in got) == bool(files)
        assert (('\t.file\t2 "' in out) == bool(files)) and out.count(".file") == 2 * len(files)
        n = span.first + got.index("\tret;")
        assert span.line_of(n) == 3 and (not files or span.line_of(n - 1) == 2)   # a .loc counts as the line before


def test_a_build_with_a_ptx_section_is_rebuilt_exactly_from_its_texts():
    """What the loop keeps of a build to put it back (texts_of: the overrides that rebuild it) holds a PTX stage's
    .ptx body, not its C++ declaration: the rebuilt source and bodies are the same, key for key."""
    from workbench.loop.sections import texts_of
    for opt in (OPROJ, PTX):
        asm = assemble(get_config("tiny"), opt)
        again = assemble(get_config("tiny"), opt, texts_of(asm))
        assert again.key == asm.key and again.ptx_bodies == asm.ptx_bodies

"""The verification build in units (workbench/compiler/units.py), without a GPU: the split, the real NVRTC compiles of
every unit, the nvJitLink link, that an edit recompiles only its own unit, and compiler messages at the section's
line as in the whole build. Whether the linked kernel computes what the whole build does is the GPU test's
(tests/test_gpu.py::test_the_units_build_verifies)."""
from __future__ import annotations

import re

import pytest

from workbench import plan
from workbench.compiler import units as U
from workbench.compiler.assemble import BuildOptions, assemble, section_path
from workbench.compiler.compile import CompileError, compile_cubin, resource_usage
from workbench.model.config import get_config

needs_link = pytest.mark.skipif(not U.units_linkable(), reason=f"{U.nvjitlink_problem()}")
OPT = BuildOptions(taps=True, fast_compile="min", units=True)


def test_the_split_gives_each_stage_its_unit_and_the_decode_step_the_prototypes():
    asm = assemble(get_config("llama-3.2-1b"), OPT)
    assert asm.units == OPT.launch.threads
    units = U.split(asm)
    assert [u.name for u in units] == [U.DECODE_UNIT, *plan.STAGE_NAMES]
    decode, *stages = units
    for u in stages:                                       # its own section, no other's
        bodies = set(re.findall(r"WB_SECTION\s+\w+\s+(stage_\w+)\s*\([^)]*\)\s*\{", u.asm.source))
        assert bodies == {f"stage_{u.name}"}, (u.name, bodies)
        # the library's block-shared variables are the decode unit's, declared here; its out-of-line functions
        # are private copies
        assert not re.search(r"^__shared__ ", u.asm.source, re.M)
        assert re.search(r"^extern __shared__ u32 wb_epoch;", u.asm.source, re.M)
        assert not re.search(r"^__device__\s+__noinline__", u.asm.source, re.M)
    assert not re.findall(r"WB_SECTION\s+\w+\s+stage_\w+\s*\([^)]*\)\s*\{", decode.asm.source)
    assert all(re.search(rf"WB_SECTION \w+ stage_{s}\(", decode.asm.source) for s in plan.STAGE_NAMES)
    assert re.search(r"^__shared__ u32 wb_epoch;", decode.asm.source, re.M)
    assert "wb_generate" in decode.asm.source
    # every line of every section is where the whole build has it, counted from its #line marker
    for u in stages:
        (_, display, text), = [p for p in u.asm.pieces if p[1].endswith(f"sections/{u.name}.cuh")]
        assert text == section_path(u.name).read_text()


def test_builds_that_stay_whole():
    cfg = get_config("tiny")
    assert assemble(cfg, BuildOptions(taps=True, units=True, variants=(("embedding", "ptx"),))).units == 0
    assert assemble(cfg, BuildOptions(launch=plan.Launch(stream=True), taps=True, units=True)).units == 0
    assert assemble(cfg, BuildOptions(taps=True)).units == 0
    assert assemble(cfg, OPT).key != assemble(cfg, BuildOptions(taps=True, fast_compile="min")).key


@needs_link
def test_the_units_link_into_the_kernel_and_an_edit_compiles_only_its_own():
    cfg = get_config("tiny")
    first = U.link(U.split(assemble(cfg, OPT)))
    (r,) = [r for r in resource_usage(first.cubin) if r.kernel == "wb_generate"]
    assert r.registers <= 65536 // OPT.launch.threads
    again = U.link(U.split(assemble(cfg, OPT)))
    assert again.compiled == [] and again.cubin == first.cubin          # every unit from the cache
    text = section_path("lm_head").read_text() + "\n// an edit\n"
    edited = U.link(U.split(assemble(cfg, OPT, overrides={"lm_head": text})))
    assert edited.compiled == ["lm_head"]
    assert compile_cubin(assemble(cfg, OPT, overrides={"lm_head": text}))[0] == edited.cubin


@needs_link
def test_a_compile_error_in_a_unit_names_the_section_file_and_line():
    text = section_path("gate_up_silu").read_text()
    lines = text.splitlines()
    k = next(i for i, line in enumerate(lines) if "hmlp[j] =" in line)
    lines[k] += " undeclared_symbol += 1;"
    with pytest.raises(CompileError) as e:
        compile_cubin(assemble(get_config("tiny"), OPT, overrides={"gate_up_silu": "\n".join(lines)}))
    assert f"kernels/sections/gate_up_silu.cuh:{k + 1}: error" in str(e.value)
    assert any(m[0] == "kernels/sections/gate_up_silu.cuh" and "undeclared_symbol" in m[4] for m in e.value.messages)


@needs_link
def test_too_much_shared_memory_at_the_link_lands_at_the_sections_declaration():
    """The link, not a unit's compile, finds that the kernel's static shared memory is over the limit (each unit is
    within it alone); nvJitLink names the kernel only, so the report points at the section's `__shared__` array,
    as ptxas's does in the whole build (the failure suite's too-much-shared injection, which the H200 reported
    unnamed before)."""
    from workbench.check.failures import by_name
    inj = by_name("too-much-shared")
    mutated = inj.apply(section_path(inj.section).read_text())
    with pytest.raises(CompileError) as e:
        compile_cubin(assemble(get_config("tiny"), OPT, overrides={inj.section: mutated}))
    line = 1 + mutated.splitlines().index("    __shared__ float huge[64 * 1024];")
    assert f"kernels/sections/{inj.section}.cuh:{line}: error: static shared memory" in str(e.value)
    assert "uses too much shared data" in str(e.value)


def test_a_section_without_its_stage_function_is_named():
    text = section_path("publish").read_text().replace("stage_publish", "stage_publish_renamed")
    with pytest.raises(ValueError, match="stage_publish"):
        U.split(assemble(get_config("tiny"), OPT, overrides={"publish": text}))

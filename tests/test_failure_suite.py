"""The failure-injection suite without a GPU: every injected edit applies where it means to, and each compiles
(the ones meant to fail at run time) or fails to compile with a message naming the file (the one that asks for
more shared memory than a block can have). The compiler hang is not compiled here: that is what it is for."""
from __future__ import annotations

import re

import pytest

from workbench.compiler.assemble import BuildOptions, assemble, section_path
from workbench.compiler.compile import CompileError, compile_cubin
from workbench import plan
from workbench.check import failures as suite
from workbench.model.config import get_config


def test_at_least_eight_kinds():
    assert len(suite.INJECTIONS) >= 8
    assert {i.section for i in suite.INJECTIONS} <= set(plan.FILES)
    assert {"hang", "fault", "compile error", "compiler hang or crash"} <= {i.expect for i in suite.INJECTIONS}


@pytest.mark.parametrize("inj", [i for i in suite.INJECTIONS if i.name != "compiler-hangs"], ids=lambda i: i.name)
def test_each_injection_applies_and_builds_as_meant(inj):
    mutated = inj.apply(section_path(inj.section).read_text())
    asm = assemble(get_config("tiny"), BuildOptions(taps=True, fast_compile="min", sampler="greedy"),
                   overrides={inj.section: mutated})
    if inj.expect == "compile error":
        with pytest.raises(CompileError) as e:
            compile_cubin(asm)
        assert "too much shared data" in str(e.value)
        # ptxas names no line: the report points at the section's static shared array, at its line in the edit
        line = 1 + mutated.splitlines().index("    __shared__ float huge[64 * 1024];")
        assert f"kernels/sections/{inj.section}.cuh:{line}: error: static shared memory" in str(e.value)
        from workbench.loop.records import ReloadRecord, format_compile_error
        rec = ReloadRecord(0.0, "edit", inj.section, None, ())
        rec.error = format_compile_error(e.value)
        assert inj.named(rec), rec.error
    else:
        compile_cubin(asm)


@pytest.mark.parametrize("inj", [i for i in suite.INJECTIONS if i.block is not None], ids=lambda i: i.name)
def test_the_block_a_report_must_name_is_the_one_the_edit_picks(inj):
    if "wb_bid()" in inj.replace:
        assert f"wb_bid() == {inj.block}" in inj.replace
    else:                                         # the sampler runs in block 0 alone
        assert inj.section == "sampling" and inj.block == 0


def test_named_wants_the_block_inside_its_section_or_in_the_report():
    from workbench.loop.records import ReloadRecord
    from workbench.run.worker import BlockState
    inj = suite.by_name("illegal-address")
    rec = ReloadRecord(0.0, "edit", inj.section, None, ())
    rec.blocks = [BlockState(b, "down_residual", 1, 0, True, False) for b in range(12)]
    assert not inj.named(rec)                               # every block waiting: nobody named
    rec.blocks[9] = BlockState(9, "down_residual", 1, 0, False, False)
    assert inj.named(rec)
    rec.blocks[9] = BlockState(9, "gate_up_silu", 1, 0, False, False)
    assert not inj.named(rec)                               # stopped, but in another section
    rec.error = "a barrier timed out ... first missing block 19, ..."
    assert not inj.named(rec)
    rec.error = "a barrier timed out ... first missing block 9, last seen in down_residual"
    assert inj.named(rec)
    ce = suite.by_name("too-much-shared")
    rec.error = "kernels/sections/attention_decode.cuh:12: error: too much shared data"
    assert ce.named(rec)


def test_named_alone_wants_every_other_block_waiting():
    """The hang inside attention while o_proj loads early: the blocks held at o_proj's owed wait must read as
    waiting (the barrier after attention), not as inside o_proj, or every one of them would look hung."""
    from workbench.loop.records import ReloadRecord
    from workbench.run.worker import BlockState
    inj = suite.by_name("spin-in-attention")
    rec = ReloadRecord(0.0, "edit", inj.section, None, ())
    rec.blocks = [BlockState(b, "attention_decode", 1, 0, True, False) for b in range(12)]
    rec.blocks[4] = BlockState(4, "attention_decode", 1, 0, False, False)
    assert inj.named(rec)
    rec.blocks[7] = BlockState(7, "o_proj_residual", 1, 0, False, False)     # shown inside its early stage
    assert not inj.named(rec)
    rec.blocks[7] = BlockState(7, "o_proj_residual", 1, 0, False, True)      # its where-word changed after the stop
    assert not inj.named(rec)
    rec.blocks[7] = BlockState(7, "attention_decode", 1, 0, True, False)
    rec.blocks[4] = BlockState(4, "attention_decode", 1, 0, False, True)     # the named block moving on: not stuck
    assert not inj.named(rec)


def test_a_runtime_compile_log_of_too_much_shared_data_lands_at_the_declaration():
    """CuPy's compile (the kernel the GPU runs) hands back NVRTC's log as this text, as the H200 printed it: the
    same messages as the compile without a driver, at the section's static shared array."""
    from workbench.compiler.compile import compile_error
    inj = suite.by_name("too-much-shared")
    mutated = inj.apply(section_path(inj.section).read_text())
    asm = assemble(get_config("tiny"), BuildOptions(timing=True), overrides={inj.section: mutated})
    log = ("ptxas error   : Entry function 'wb_generate' uses too much shared data (0x40020 bytes, 0xc000 max)\n"
           "\x00")
    e = compile_error(log, asm)
    line = 1 + mutated.splitlines().index("    __shared__ float huge[64 * 1024];")
    text = str(e)
    assert f"kernels/sections/{inj.section}.cuh:{line}: error: static shared memory" in text
    assert "uses too much shared data" in text
    # and never at the declaration the section's wb:checks block quotes (a comment)
    named = [int(n) for n in re.findall(rf"kernels/sections/{inj.section}\.cuh:(\d+)", text)]
    assert named and max(named) < 1 + mutated.splitlines().index("/* wb:checks")
    # the user's section before the library's own arrays (the timing build's stamps)
    assert text.index(f"kernels/sections/{inj.section}.cuh") < text.index("kernels/lib/grid_sync.cuh")

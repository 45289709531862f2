"""Units copied ahead (Launch.ahead): where the copy is posted, sent and read, its shared-memory region, the refusals,
and the build. The GPU side (stage by stage, and the same bits as the register path) is in tests/test_gpu.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from workbench import plan, schedule
from workbench.compiler.assemble import BuildOptions, assemble, with_fields
from workbench.compiler.compile import compile_cubin, resource_usage
from workbench.compiler.header import decode_step
from workbench.model.config import get_config

GATE_UP = plan.Launch(ahead=("gate_up_silu",))


def _ends(regions: dict) -> int:
    return sum(n for _, n in regions.values())


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "tiny", "qwen3-0.6b"])
@pytest.mark.parametrize("budget", [65536, 131072])
def test_the_region_lies_above_everything_in_use_from_the_post_to_the_read(name, budget):
    cfg = get_config(name)
    launch = plan.Launch(ahead=("gate_up_silu",), ahead_bytes=budget)
    a = schedule.ahead(cfg, launch)
    # posted after attention's barrier, sent by o_proj (the slot before the MLP's), read by gate_up
    assert (a.stage, a.issuer, a.posted_after, a.buffer) == ("gate_up_silu", "o_proj_residual", "attention_decode",
                                                             "wgu")
    assert (a.k, a.rows, a.units) == (cfg.hidden, 2, cfg.intermediate)
    regions = schedule.smem_regions(cfg, launch)
    live = [_ends(regions[s]) for s in ("o_proj_residual", "gate_up_silu")] + [sum(schedule.early_region(cfg, launch))]
    assert a.offset >= max(live) and a.offset % 4 == 0
    # whole units, one a warp, within the budget and what shared memory allows
    assert a.floats * 4 == a.warps * a.unit_bytes <= budget
    assert 1 <= a.warps <= launch.consumer_warps
    top = schedule.smem_bytes(cfg, launch)
    assert 4 * (a.offset + a.floats) <= top <= schedule.SMEM_LIMIT - schedule.STATIC_SMEM
    # one more unit would not have fitted, unless every warp has one
    room = min(budget, schedule.SMEM_LIMIT - schedule.STATIC_SMEM - 4 * a.offset)
    assert a.warps == launch.consumer_warps or (a.warps + 1) * a.unit_bytes > room


def test_the_1b_gets_fifteen_warps_units_and_the_8b_six():
    assert schedule.ahead(get_config("llama-3.2-1b"), GATE_UP).warps == 15
    assert schedule.ahead(get_config("llama-3.1-8b"), GATE_UP).warps == 6
    assert schedule.ahead(get_config("llama-3.2-1b"), plan.Launch(ahead=("gate_up_silu",), ahead_bytes=65536)).warps == 8


def test_each_block_copies_its_first_units_once():
    cfg = get_config("llama-3.2-1b")
    a = schedule.ahead(cfg, GATE_UP)
    per = a.block_bytes(GATE_UP.grid)
    # 8,192 units over 132 blocks: 62 or 63 a block, of which 15 are copied; 16.2 MB a layer of the MLP's 100.7 MB
    assert set(per) == {15 * a.unit_bytes} and sum(per) == 132 * 15 * 8192
    few = schedule.ahead(get_config("tiny"), GATE_UP)           # tiny: 712 units, 5 or 6 a block, fewer than warps
    units = [len(plan.block_units(few.units, GATE_UP.grid, b)) for b in range(GATE_UP.grid)]
    assert few.block_bytes(GATE_UP.grid) == [min(n, few.warps) * few.unit_bytes for n in units]
    assert sum(few.block_bytes(GATE_UP.grid)) == few.units * few.unit_bytes


def test_without_ahead_nothing_changes():
    cfg = get_config("llama-3.2-1b")
    assert schedule.ahead(cfg, plan.Launch()) is None
    assert "wb_ahead" not in decode_step(cfg, plan.Launch())
    assert schedule.smem_bytes(cfg, plan.Launch()) < schedule.smem_bytes(cfg, GATE_UP)


@pytest.mark.parametrize("launch,match", [
    (plan.Launch(ahead=("o_proj_residual",)), "o_proj_residual is not a layer stage .* dealt by blocks"),
    # down reads Wdᵀ by columns in its own loop: nothing would read its copy
    (plan.Launch(ahead=("down_residual",)), "down_residual is not a layer stage that reads a weight as dot products"),
    (plan.Launch(ahead=("lm_head",)), "lm_head is not a layer stage"),
    (plan.Launch(ahead=("gate_up_silu", "o_proj_residual")), "one stage's units"),
    (plan.Launch(ahead=("gate_up",)), "unknown stage 'gate_up'"),
    (plan.Launch(ahead=("gate_up_silu",), stream=True), "register path"),
    (plan.Launch(ahead=("gate_up_silu",), ahead_bytes=4096), "hold no unit of gate_up_silu .*raise ahead_bytes"),
])
def test_what_cannot_be_copied_ahead_is_one_clear_error(launch, match):
    with pytest.raises(ValueError, match=match):
        schedule.ahead(get_config("llama-3.2-1b"), launch)


@pytest.mark.parametrize("value", [-16, 100, "64k"])
def test_ahead_bytes_is_checked(value):
    with pytest.raises(ValueError, match="ahead_bytes"):
        plan.Launch(ahead_bytes=value)


def test_the_decode_step_posts_at_attentions_barrier_and_sends_after_o_proj():
    lines = decode_step(get_config("llama-3.2-1b"), GATE_UP).splitlines()
    at = lambda text: next(i for i, line in enumerate(lines) if text in line)
    post, send = at("wb_ahead_post<"), at("wb_ahead_issue();")
    # every thread fences its last use of the region before the arrival's block barrier; the copy goes out after it
    assert at("stage_attention_decode(") < post == at("WB_ARRIVE(ST_ATTENTION_DECODE") - 1
    assert at("stage_o_proj_residual(") == send - 1
    assert post < send < at("stage_gate_up_silu(")
    assert "P->wgu + layer * WB_PER_LAYER_WGU" in lines[post]


def test_the_text_forms_take_ahead_as_a_stage_set():
    opt = with_fields(ahead="gate_up_silu", ahead_bytes=65536)
    assert opt.launch.ahead == ("gate_up_silu",) and opt.launch.ahead_bytes == 65536
    # the AMD build has no copy engine reachable: it copies nothing ahead
    assert opt.for_target("hip").launch.ahead == ()


@pytest.mark.parametrize("name,budget,taps", [("llama-3.2-1b", 131072, False), ("llama-3.2-1b", 65536, True),
                                              ("llama-3.1-8b", 131072, False)])
def test_the_build_compiles_without_spills(name, budget, taps):
    opt = BuildOptions(taps=taps, launch=plan.Launch(ahead=("gate_up_silu",), ahead_bytes=budget))
    asm = assemble(get_config(name), opt)
    assert "wb_ahead_post<WB_AHEAD_K, WB_AHEAD_ROWS>" in asm.source
    cubin, _ = compile_cubin(asm, arch="sm_90")
    (r,) = resource_usage(cubin)
    assert r.stack == 0 and r.registers <= 128


def test_build_on_the_command_line():
    run = lambda *a: subprocess.run([sys.executable, "-m", "workbench", "build", "--model", "llama-3.2-1b", *a],
                                    capture_output=True, text=True, timeout=300)
    ok = run("--set", "ahead=gate_up_silu")
    assert ok.returncode == 0, ok.stderr
    a = schedule.ahead(get_config("llama-3.2-1b"), GATE_UP)
    assert f"+ {schedule.smem_bytes(get_config('llama-3.2-1b'), GATE_UP)} B dynamic" in ok.stdout
    assert 4 * (a.offset + a.floats) <= schedule.smem_bytes(get_config("llama-3.2-1b"), GATE_UP)
    bad = run("--set", "ahead=o_proj_residual")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "o_proj_residual is not a layer stage" in bad.stderr


def test_the_verification_build_in_units_links_with_the_copy():
    """The loop's verification build is linked from one unit per stage: the copy's block-shared words are the
    decode step's unit's, declared in the others (o_proj's unit sends the copy, gate_up's reads it)."""
    from workbench.compiler import units as U
    if not U.units_linkable():
        pytest.skip(U.nvjitlink_problem())
    opt = BuildOptions(taps=True, fast_compile="min", units=True, launch=GATE_UP)
    parts = U.split(assemble(get_config("tiny"), opt))
    assert [u.name for u in parts if "wb_ahead_post<" in u.asm.source] == [U.DECODE_UNIT]
    assert "extern __shared__ __attribute__((aligned(8))) u64 wb_ahead_bar;" in parts[1].asm.source
    linked = U.link(parts)
    (r,) = [r for r in resource_usage(linked.cubin) if r.kernel == "wb_generate"]
    assert r.registers <= 65536 // opt.launch.threads


def test_a_hang_report_says_what_the_block_waited_for():
    """The kernel's status words as the host reads them: a grid barrier's timeout names its missing blocks; a copy
    ahead that never landed names the unit that waited for it (or the kernel's end), not missing blocks."""
    from workbench import abi
    base = {"code": abi.ERRORS.index("hang"), "layer": 1, "step": 3, "block": 4, "epoch": 9, "missing_block": 9,
            "missing_where": abi.where(plan.STAGE_NAMES.index("down_residual"), 1, 3),
            "n_missing": 2, "stream_want": 0, "stream_got": 0, "waited_on": 0, "unit": 0,
            "stage": plan.STAGE_NAMES.index("down_residual")}
    assert abi.describe_hang(base) == (
        "grid barrier timed out after the down_residual stage of layer 1 at step 3: block 4 waited, 2 block(s) never "
        "arrived, the first being block 9, last seen in down_residual of layer 1 at step 3")
    ahead = {**base, "stage": plan.STAGE_NAMES.index("gate_up_silu"), "block": 2, "unit": 14,
             "waited_on": abi.WAITED_ON.index("copy_ahead")}
    assert abi.describe_hang(ahead).startswith(
        "gate_up_silu of layer 1 at step 3, block 2: its unit 14 of gate_up_silu copied ahead into shared memory "
        "(Launch.ahead) never landed")
    assert "missing" not in abi.describe_hang(ahead) and "block 9" not in abi.describe_hang(ahead)
    assert abi.describe_hang({**ahead, "unit": -1}).startswith(
        "at the kernel's end (gate_up_silu of layer 1 at step 3), block 2: the last units it copied ahead")
    assert set(base) == set(abi.STATUS_WORDS) and len(abi.STATUS_WORDS) <= abi.STATUS_LEN

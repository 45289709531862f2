"""The plan: one declaration of the decode step, and what derives from it."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from workbench import abi, plan, schedule
from workbench.model.config import PRESETS, get_config

ROOT = Path(__file__).resolve().parent.parent


def test_decode_order_and_scopes():
    names = plan.STAGE_NAMES
    assert names[0] == "embedding" and names[-2:] == ("sampling", "publish")
    assert plan.LAYER_STAGES == tuple(s.name for s in plan.STAGES if s.scope == "layer")
    cfg = get_config("tiny")
    ex = schedule.execution(cfg)
    assert ex[0] == ("embedding", -1) and ex[-1] == ("publish", -1)
    assert len(ex) == len(plan.TOKEN_STAGES) + cfg.n_layers * len(plan.LAYER_STAGES)


def test_barriers_follow_from_the_reads_and_writes():
    cfg = get_config("tiny")
    slots = schedule.slots(cfg)
    # a barrier after every layer stage and the LM head; none between sampling, publish and the next embedding
    # (one block runs those three, in order)
    assert [s.stages[-1] for s in slots][:2] == [("embedding", -1), ("qkv_rope_append", 0)]
    assert slots[0].stages == (("sampling", -1), ("publish", -1), ("embedding", -1))
    assert slots[0].label == "sampling+publish+embedding"
    assert slots[-1].stages == (("lm_head", -1),)
    # the MLP is one slot: down reads only the hmlp rows its own block's gate_up wrote (a block barrier)
    mlp = [s for s in slots if s.stages[0][0] == "gate_up_silu"]
    assert [s.stages for s in mlp] == [(("gate_up_silu", l), ("down_residual", l)) for l in range(cfg.n_layers)]
    assert mlp[0].label == "gate_up_silu+down_residual"
    assert all(len(s.stages) == 1 for s in slots[1:] if s not in mlp)
    assert schedule.barrier_slot(cfg, "sampling", -1) is None and schedule.barrier_slot(cfg, "lm_head", -1) == len(slots) - 1
    assert schedule.barrier_slot(cfg, "gate_up_silu", 0) is None and schedule.block_barrier_before(cfg, "down_residual")
    for name, p in PRESETS.items():
        assert schedule.n_slots(p) == 4 * p.n_layers + 2, name
        assert schedule.local_problem(p) is None, name


def test_a_local_read_needs_the_same_units_dealt_by_blocks(monkeypatch):
    """A read declared local that the writer's units do not cover is refused, and without both stages dealing by
    blocks the plan puts a grid barrier there instead."""
    cfg = get_config("tiny")
    down = plan.stage("down_residual")
    shifted = dataclasses.replace(down, reads=(dataclasses.replace(down.reads[0], rows=lambda c, j: ((j + 1, j + 2),)),)
                                  + down.reads[1:])
    monkeypatch.setattr(plan, "STAGES", tuple(shifted if s is down else s for s in plan.STAGES))
    assert "unit 0 reads rows ((1, 2),)" in schedule.local_problem(cfg)
    gate = plan.stage("gate_up_silu")
    warps = dataclasses.replace(gate, deal="warps")
    assert schedule.local_reads(warps, down) == set() and schedule.conflicts(warps, down) == {"hmlp"}
    assert schedule.conflicts(gate, down) == set()


def test_a_new_stage_gets_its_barrier(monkeypatch):
    """Declaring a stage that reads what the one before wrote puts a barrier between them; one that touches
    nothing the neighbours touch does not."""
    extra = plan.Stage("scale_x", "layer", "x *= 1", reads=(plan.Use("x"),), writes=(plan.Use("x"),),
                       units=lambda c, l: c.hidden, unit="a row")
    noop = plan.Stage("noop", "layer", "nothing", reads=(), writes=(), units=lambda c, l: 1, unit="-")
    stages = list(plan.STAGES)
    i = plan.STAGE_NAMES.index("down_residual") + 1
    monkeypatch.setattr(plan, "STAGES", tuple(stages[:i] + [extra, noop] + stages[i:]))
    monkeypatch.setattr(plan, "_BY_NAME", {s.name: s for s in plan.STAGES})
    schedule._slots.cache_clear()
    schedule._execution.cache_clear()
    try:
        cfg = get_config("tiny")
        assert schedule.barrier_slot(cfg, "down_residual", 0) is not None       # scale_x reads its x
        assert schedule.barrier_slot(cfg, "scale_x", 0) is None                 # noop needs nothing
        assert schedule.n_slots(cfg) == 5 * cfg.n_layers + 2
    finally:
        schedule._slots.cache_clear()
        schedule._execution.cache_clear()


def test_producers():
    cfg = get_config("tiny")
    assert schedule.producer(cfg, "x", "qkv_rope_append", 0) == ("embedding", -1)
    assert schedule.producer(cfg, "x", "qkv_rope_append", 1) == ("down_residual", 0)
    assert schedule.producer(cfg, "x", "o_proj_residual", 1) == ("down_residual", 0)
    assert schedule.producer(cfg, "h", "gate_up_silu", 1) == ("o_proj_residual", 1)
    assert schedule.producer(cfg, "q", "attention_decode", 1) == ("qkv_rope_append", 1)
    assert schedule.producer(cfg, "x", "lm_head", -1) == ("down_residual", cfg.n_layers - 1)
    assert schedule.producer(cfg, "sampled", "publish", -1) == ("sampling", -1)
    assert schedule.producer(cfg, "token", "embedding", -1) is None        # the previous step's publish


def test_dependencies_at_the_finest_grain():
    """What per-unit dependency counters would count: each consumer unit waits for exactly the producer units
    whose rows it reads."""
    cfg = get_config("tiny")
    d = schedule.dependencies(cfg)
    half = cfg.head_dim // 2
    assert d["attention_decode", "q"] == ("qkv_rope_append", [cfg.group * half] * cfg.n_kv_heads)
    assert d["attention_decode", "k_cache"] == ("qkv_rope_append", [half] * cfg.n_kv_heads)
    assert d["attention_decode", "v_cache"] == ("qkv_rope_append", [half] * cfg.n_kv_heads)
    assert d["o_proj_residual", "o"] == ("attention_decode", [cfg.n_kv_heads] * cfg.hidden)
    # every unit of down adds into every row of x
    assert d["o_proj_residual", "x"] == ("down_residual", [cfg.intermediate] * cfg.hidden)
    assert d["gate_up_silu", "h"] == ("o_proj_residual", [cfg.hidden] * cfg.intermediate)
    assert d["down_residual", "hmlp"] == ("gate_up_silu", [1] * cfg.intermediate)   # its own row of hmlp


def test_a_unit_reads_only_the_rows_it_writes_of_a_buffer_it_updates():
    """o_proj adds into x row by row: a unit may read only the x rows it writes, else it races with the unit that
    writes them. down adds into all of x atomically and reads none of it."""
    cfg = get_config("tiny")
    for st in plan.STAGES:
        both = {u.buffer for u in st.reads} & {u.buffer for u in st.writes}
        for buf in both:
            r = next(u for u in st.reads if u.buffer == buf)
            w = next(u for u in st.writes if u.buffer == buf)
            if w.atomic:
                assert r.rows is None and w.rows is None, (st.name, buf)
                continue
            assert r.rows is not None and w.rows is not None, (st.name, buf)
            for unit in range(st.units(cfg, plan.Launch())):
                assert r.rows(cfg, unit) == w.rows(cfg, unit), (st.name, buf, unit)


def test_bytes_per_token():
    """The schedule's bytes of each stage, over a token's execution, sum to the config's weight bytes per token
    (the one count of them): every layer's stages, the LM head, and the embedding's one row, which the config
    leaves out as negligible."""
    for name, cfg in PRESETS.items():
        per_stage = sum(schedule.stage_weight_bytes(cfg, s) for s, _ in schedule.execution(cfg))
        assert per_stage == cfg.weight_bytes_per_token() + schedule.stage_weight_bytes(cfg, "embedding"), name
        assert schedule.stage_weight_bytes(cfg, "embedding") == 2 * cfg.hidden, name
        a0, a1 = (schedule.stage_bytes(cfg, "attention_decode", p) for p in (0, 1000))
        assert a1 - a0 == 2 * 2 * cfg.kv_dim * 1000


def test_taps_tile_the_step_record():
    cfg = get_config("llama-3.2-1b")
    off = 0
    for t in schedule.taps(cfg):
        assert t.offset == off
        off += t.size * t.layers
    assert off == schedule.tap_step_floats(cfg)
    assert schedule.tap(cfg, "qkv_rope_append", "k_cache").size == cfg.kv_dim


def test_shared_memory_is_the_largest_stage():
    cfg = get_config("llama-3.2-1b")
    regions = schedule.smem_regions(cfg)
    assert schedule.smem_floats(cfg) == max(sum(n for _, n in r.values()) for r in regions.values())
    for r in regions.values():
        for off, n in r.values():
            assert off % 4 == 0 and n % 4 == 0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_attentions_rings_fit_their_budget_and_the_block(preset):
    """As many warps get a ring of attention's K/V steps as the budget holds (at most the block's, one in a stream
    build, none in the AMD build), and the whole stage stays inside a block's shared memory."""
    from workbench.compiler.assemble import BuildOptions
    cfg = get_config(preset)
    launch = plan.Launch()
    per_warp = launch.attn_ring_bytes(cfg)
    assert per_warp == launch.attn_bufs * plan.ATTN_STEP * 2 * (cfg.head_dim + 8) * 2    # steps × (K + V) rows × bf16
    w = launch.attn_warps(cfg)
    assert 1 <= w <= launch.consumer_warps and w * per_warp <= launch.attn_kv_bytes < (w + 1) * per_warp or \
        w == launch.consumer_warps
    regions = schedule.smem_regions(cfg, launch)["attention_decode"]
    assert regions["kv"][1] * 4 == w * per_warp                    # floats of the region: the rings' bytes / 4
    assert schedule.smem_bytes(cfg, launch) <= schedule.SMEM_LIMIT - schedule.STATIC_SMEM
    assert plan.Launch(stream=True).attn_warps(cfg) == 1
    assert BuildOptions().for_target("hip").launch.attn_warps(cfg) == 0


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b", "tiny"])
def test_attentions_splits_follow_its_rings(preset):
    """By default a split gives every reading warp one step, and one block takes a kv head alone (no merge) up to
    attn_single such chunks; the header carries both, and an explicit attn_min_chunk wins."""
    from workbench.compiler.assemble import BuildOptions, with_fields
    from workbench.compiler.header import plan_header
    cfg = get_config(preset)
    launch = plan.Launch()
    chunk = launch.attn_warps(cfg) * plan.ATTN_STEP
    assert launch.attn_chunk(cfg) == chunk and launch.attn_single_positions(cfg) == 2 * chunk
    assert f"WB_ATTN_MIN_CHUNK = {chunk}, WB_ATTN_SINGLE = {2 * chunk};" in plan_header(cfg, launch)
    chosen = plan.Launch(attn_min_chunk=40, attn_single=3)
    assert chosen.attn_single_positions(cfg) == 120
    assert with_fields(attn_min_chunk=40, attn_single=3).effective_launch() == chosen      # the text names' route
    assert BuildOptions().for_target("hip").launch.attn_chunk(cfg) == 32        # no rings: the CUDA-core path's 32
    paths = {p + 1 for p in plan.attention_paths(cfg, launch)}
    assert {2 * chunk, 2 * chunk + 1} <= paths or 2 * chunk >= cfg.max_seq


def test_where_words_round_trip():
    for stage_i, name in enumerate(plan.STAGE_NAMES):
        for layer in (-1, 0, 31):
            for waiting in (False, True):
                w = abi.where(stage_i, layer, 4097, waiting)
                assert abi.decode_where(w) == (name, layer, 4097, waiting)
                signed = int(np.array([w], np.uint32).view(np.int32)[0])     # as the host's int32 view reads it
                assert abi.decode_where(signed) == (name, layer, 4097, waiting)
    assert abi.describe_where(abi.where(2, 3, 7)) == "attention_decode of layer 3 at step 7"
    assert abi.describe_where(abi.where(2, 3, 7, True)) == "waiting after attention_decode of layer 3 at step 7"
    assert abi.describe_where(-1) == "unknown"


def test_the_mapped_block_layout():
    assert abi.mapped_offset("status") == 0
    assert abi.mapped_offset("host_abort") == abi.STATUS_LEN
    assert abi.mapped_offset("where") == abi.STATUS_LEN + 3
    assert abi.mapped_offset("tokens_out") == abi.STATUS_LEN + 3 + abi.MAX_BLOCKS
    assert abi.mapped_words(10) == abi.mapped_offset("tokens_out") + 10
    assert len(abi.STATUS_WORDS) <= abi.STATUS_LEN


def test_describe():
    text = schedule.describe(get_config("llama-3.2-1b"))
    assert "66 grid barriers per token" in text
    for st in plan.STAGES:
        assert st.name in text and st.math in text


# ---- the plan is the only place that writes down the decode step ---------------------------------------------------

def _string_constants(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_other_module_lists_the_stages():
    """No Python module but the plan holds the stage names as data (a list, a dict of them...): everything else
    asks the plan. A module may name one or two stages it special-cases (e.g. attention's cache); a run of them is a
    copy of the decode step."""
    names = set(plan.STAGE_NAMES)
    offenders = {}
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        # the prefill's GPU path names the stages it implements: a table keyed by the plan's stages, not a
        # statement of the decode step (test_stage_tables holds it to the plan's stages). The mutants and the
        # failure injections are declared in the kernel files they edit (check/mutants.py).
        if path.name in ("plan.py", "prefill_gpu.py"):
            continue
        found = {s for s in _string_constants(path) if s in names}
        if len(found) >= 3:
            offenders[str(path.relative_to(ROOT))] = sorted(found)
    assert not offenders, offenders


def test_no_kernel_file_restates_the_step():
    """The kernel files use the generated constants: no stage enum, no slot count, no 'five per layer'."""
    for path in sorted([*(ROOT / "kernels").rglob("*.cuh"), *(ROOT / "kernels").rglob("*.ptx")]):
        text = path.read_text()
        assert not re.search(r"enum\s+Stage\b", text), path
        assert not re.search(r"\bST_[A-Z_]+\s*=", text), path
        assert not re.search(r"layer\s*\*\s*5\b|5\s*\*\s*layer", text), path
        assert "WB_SLOTS" not in text or str(path).endswith(("lib/instrument.cuh", "lib/grid_sync.cuh")), path


def test_the_stage_files_are_the_plan():
    """kernels/sections/ holds exactly one file per stage of the plan (plus variants NAME@VARIANT.cuh, and
    NAME@ptx....ptx for a stage's variant in PTX)."""
    files = {p.stem for p in (ROOT / "kernels" / "sections").glob("*.cuh") if "@" not in p.stem}
    assert files == set(plan.STAGE_NAMES)
    lib = {p.stem for p in (ROOT / "kernels" / "lib").glob("*.cuh") if "@" not in p.stem}
    assert lib == set(plan.LIBRARY)

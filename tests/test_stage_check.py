"""The stage-local verifier on the CPU: a stand-in for the kernel's taps build (tests/kernel_sim.py: the reference
interpreter in fp32, its outputs packed where the debug build puts them) passes, and each deliberately wrong stage
is caught at its own stage, layer and step, down to 1e-4 relative and at positions only a long context reaches."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_sim import SimKernel

from workbench import plan
from workbench.check.verify import coverage, end_to_end, verify_stages
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights
from workbench.reference import round_bf16


@pytest.fixture(scope="module")
def tiny_p():
    return prepare(random_weights(get_config("tiny"), seed=3, progress=False), progress=False)


def run(p, sampling=False, **kw):
    sim = SimKernel(p, **kw)
    table, results = verify_stages(sim, sampling=sampling, seed=1)
    return table, results


def test_coverage_takes_every_attention_path():
    cfg, launch = get_config("llama-3.2-1b"), plan.Launch()
    runs = coverage(cfg, launch)
    pos = sorted(p for r in runs for p in r.positions)
    n = [p + 1 for p in pos]                                   # attention reads n = pos + 1 positions
    c, S, one = launch.attn_chunk(cfg), launch.max_splits(cfg), launch.attn_single_positions(cfg)
    assert {one, one + 1} <= set(n) and {c * S, c * S + 1} <= set(n) and max(pos) >= 4096
    assert {cfg.max_seq - 2, cfg.max_seq - 1} <= set(pos)       # the context's end, wherever --max-seq puts it
    # attention's steps: a chunk of one step and of one more; every reading warp one step, and one more; a warp's
    # ring refilled, and come round to its first buffer
    every = launch.attn_warps(cfg) * plan.ATTN_STEP
    assert {plan.ATTN_STEP, plan.ATTN_STEP + 1} <= set(n)
    assert {S * every, S * (every + 1), S * (every * (launch.attn_bufs - 1) + 1),
            S * (every * launch.attn_bufs + 1)} <= set(n)
    long = get_config("llama-3.2-1b", max_seq=131072)
    assert 131071 in {p for r in coverage(long, launch) for p in r.positions}
    assert runs[0].pos0 == 0 and runs[0].new > 1              # the generation path, from position 0
    flat = [p for r in runs for p in r.positions]
    assert len(flat) == len(set(flat)) and flat == sorted(flat)   # no run writes rows another one reads
    thorough = {p + 1 for r in coverage(cfg, launch, thorough=True) for p in r.positions}
    assert all({c * m, c * m + 1} <= thorough for m in range(2, S + 1))
    sampled = coverage(cfg, launch, sampling=True)
    assert len([r for r in sampled if r.sampling]) == 4
    flat = [p for r in sampled for p in r.positions]
    assert len(flat) == len(set(flat)) and flat == sorted(flat) and flat[-1] == cfg.max_seq - 1
    near = get_config("llama-3.2-1b", max_seq=4105)              # the end just past the 4,096 paths
    assert len([r for r in coverage(near, launch, sampling=True) if r.sampling]) == 4


def test_a_faithful_kernel_passes(tiny_p):
    table, results = run(tiny_p)
    print(table)
    assert table.passed, table.summary()
    assert max(table.positions) >= 4096 and len(results) >= 4
    # every stage output of every layer was checked, and the worst is far inside its tolerance
    outs = {(s, b) for s, b, _ in table.cells}
    want = {(st.name, b) for st in plan.STAGES for b in st.tolerances}
    assert outs == want
    assert all(c.margin < 0.5 for c in table.cells.values()), max(table.cells.values(), key=lambda c: c.margin)


def test_sampler_modes_pass_draw_by_draw(tiny_p):
    table, results = run(tiny_p, sampling=True)
    assert table.passed, table.summary()
    assert sum(1 for c in table.extra if c.buffer.startswith("draws")) >= 4


def _scale(stage, buffer, layer, factor, *, from_pos=0):
    def hook(st, l, step, res):
        if st == stage and l == layer:
            res = dict(res)
            res[buffer] = res[buffer] * np.float32(factor)
        return res
    return hook


CASES = {
    "q 1e-4 off at layer 1": (_scale("qkv_rope_append", "q", 1, 1 + 1e-4), ("qkv_rope_append", "q", 1)),
    "hmlp 1e-4 off at layer 0": (_scale("gate_up_silu", "hmlp", 0, 1 - 1e-4), ("gate_up_silu", "hmlp", 0)),
    "logits 1e-4 off": (_scale("lm_head", "logits", -1, 1 + 1e-4), ("lm_head", "logits", -1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_small_scale_error_is_named(tiny_p, name):
    hook, want = CASES[name]
    table, _ = run(tiny_p, hook=hook)
    f = table.first_failure
    assert f is not None and (f.stage, f.buffer, f.layer) == want, table.summary()
    # the stages after it were given its wrong output and pass on it
    assert sum(not c.passed for c in table.cells.values()) == 1


def test_an_error_only_at_long_positions_is_caught(tiny_p):
    def hook(st, l, step, res):
        if st == "attention_decode" and l == 1 and hook.pos + step >= 4096:
            res = {"o": res["o"] * np.float32(1.001)}
        return res
    sim = SimKernel(tiny_p)
    orig = sim.generate

    def gen(*a, pos0=0, **kw):
        hook.pos = pos0
        return orig(*a, pos0=pos0, **kw)
    hook.pos = 0
    sim.generate, sim.hook = gen, hook
    table, _ = verify_stages(sim, seed=1)
    f = table.first_failure
    assert f is not None and (f.stage, f.layer) == ("attention_decode", 1) and f.position >= 4095, table.summary()


def test_a_missing_residual_in_one_layer(tiny_p):
    def hook(st, l, step, res):
        if st == "down_residual" and l == 1:
            return {"x": res["x"] - hook_x[0]}
        if st == "o_proj_residual" and l == 1:
            hook_x[0] = res["x"]
        return res
    hook_x = [0]
    table, _ = run(tiny_p, hook=hook)
    f = table.first_failure
    assert (f.stage, f.layer) == ("down_residual", 1), table.summary()


def test_kv_truncated_instead_of_rounded(tiny_p):
    def hook(st, l, step, res):
        if st == "qkv_rope_append" and l == 0:
            res = dict(res)
            k = np.ascontiguousarray(res["k_cache"], np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
            res["k_cache"] = k.view(np.float32)
        return res
    table, _ = run(tiny_p, hook=hook)
    f = table.first_failure
    assert (f.stage, f.buffer, f.layer) == ("qkv_rope_append", "k_cache", 0), table.summary()
    assert "ulp" in f.note


def test_one_stale_element_of_a_long_vector(tiny_p):
    def hook(st, l, step, res):
        if st == "lm_head":
            lg = res["logits"].copy()
            lg[..., -1] = 0.5 * lg[..., -1]                  # the last row wrong by half its value
            return {"logits": lg}
        return res
    table, _ = run(tiny_p, hook=hook)
    assert table.first_failure.stage == "lm_head", table.summary()


def test_nan_never_passes(tiny_p):
    def hook(st, l, step, res):
        if st == "gate_up_silu" and l == 1 and step == 2:
            h = res["hmlp"].copy()
            h[..., 5] = np.nan
            return {"hmlp": h}
        return res
    table, _ = run(tiny_p, hook=hook)
    f = table.first_failure
    assert (f.stage, f.layer, f.step) == ("gate_up_silu", 1, 2) and "NaN" in f.note, table.summary()


def test_a_sampler_boundary_error(tiny_p):
    table, _ = run(tiny_p, sampling=True, sampler_bug=True)
    f = table.first_failure
    assert f is not None and f.stage == "sampling", table.summary()


def test_publish_feeding_the_wrong_token(tiny_p):
    table, _ = run(tiny_p, publish_bug=True)
    f = table.first_failure
    assert f is not None and f.stage == "publish", table.summary()


def test_a_kernel_that_stops_early_is_named_by_the_last_stage(tiny_p):
    """A run that ends before its steps (the stop decision is publish's) fails, named after what ran passed."""
    table, results = run(tiny_p, stops_early=True)
    f = table.first_failure
    assert f is not None and f.stage == "publish", table.summary()
    assert any(c.buffer == "run stopped" and "ran" in c.note for c in table.extra)
    first = results[0]                                # cut to what ran, so the end-to-end check can take it
    assert first.recorded_steps and max(first.recorded_steps) < first.steps
    assert end_to_end(tiny_p, first, len(first.prompt))


def test_round_bf16_rounds_to_nearest_even():
    x = np.float32([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -1.0 - 2 ** -9, np.nan])
    r = round_bf16(x)
    assert r[0] == 1.0 and r[1] == 1.0 + 2 ** -6 and r[2] == -1.0 and np.isnan(r[3])


def test_an_unwritten_element_that_stops_the_kernel_is_still_named(tiny_p):
    """A row a stage never writes stays NaN (the runtime poisons it), the NaN reaches the logits and the kernel stops
    at its first sampled token: the check still names the stage, from the steps that ran."""
    def hook(st, l, step, res):
        if st == "gate_up_silu" and l == 0:
            h = res["hmlp"].copy()
            h[..., -1] = np.nan
            return {"hmlp": h}
        return res
    table, results = run(tiny_p, hook=hook)
    f = table.first_failure
    assert (f.stage, f.buffer, f.layer, f.step) == ("gate_up_silu", "hmlp", 0, 0), table.summary()
    assert any(c.buffer == "run stopped" and "NaN" in c.note for c in table.extra)
    # the end-to-end check of that run (the loop's, after the table) takes only what ran: the step that stopped has
    # NaN logits and chose no token
    first = results[0]
    assert first.recorded_steps and max(first.recorded_steps) < first.steps
    e2e = end_to_end(tiny_p, first, len(first.prompt))
    assert e2e and not e2e[-1].finite and e2e[-1].token_ok is None

"""The schedule simulator (workbench.measure.simulate) and the work lists it runs (workbench.worklists): every unit
of every stage dealt once and its bytes counted once; the fluid model's arithmetic on cases worked by hand; the
calibration reproducing the trace it was fitted on; designs parsed and priced; the CLI's one-line refusals."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workbench import plan, schedule
from workbench.cli import main
from workbench.measure import dataflow
from workbench.measure import simulate as S
from workbench.measure import trace as T
from workbench.model.config import get_config
from workbench.worklists import attention_split, handoffs, unit_blocks, work_lists

MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pos", [0, 127, 481, 4095, 8000])
def test_every_unit_is_dealt_once_and_every_byte_counted_once(model, pos):
    cfg = get_config(model)
    launch = plan.Launch()
    lists = work_lists(cfg, launch, pos)
    units, nbytes = {}, {}
    for items in lists:
        for it in items:
            units[it.stage, it.layer] = units.get((it.stage, it.layer), 0) + it.units
            nbytes[it.stage, it.layer] = nbytes.get((it.stage, it.layer), 0) + it.bytes
    for name, layer in schedule.execution(cfg):
        st = plan.stage(name)
        if name == S.ATTENTION:                      # one unit a kv head, each split over S blocks
            s, _ = attention_split(cfg, launch, pos)
            assert units[name, layer] == cfg.n_kv_heads * s
        else:
            assert units[name, layer] == st.units(cfg, launch), name
        want = schedule.stage_bytes(cfg, name, pos)
        assert abs(nbytes[name, layer] - want) <= st.units(cfg, launch), (name, nbytes[name, layer], want)
    # each block's list runs in decode order
    order = {e: i for i, e in enumerate(schedule.execution(cfg))}
    for items in lists:
        keys = [order[it.stage, it.layer] for it in items]
        assert keys == sorted(keys)


def test_attention_splits_as_the_section_does():
    cfg, launch = get_config("llama-3.2-1b"), plan.Launch()
    single = launch.attn_single_positions(cfg)
    assert attention_split(cfg, launch, single - 1) == (1, single)
    s, chunk = attention_split(cfg, launch, single)
    assert s == 3 and chunk * s >= single + 1                                  # n > single: ceil(n / chunk) splits
    assert attention_split(cfg, launch, 100_000)[0] == launch.max_splits(cfg)


@pytest.mark.parametrize("share", ["_share", "_share_python"])
def test_the_fluid_model_shares_hbm_and_caps_an_sm(share):
    share = getattr(S, share)
    c = S.Costs(hbm_tbps=1.0, sm_gbps=100.0)                         # 1e6 bytes/µs shared, 1e5 a block at most
    one, _ = share(np.zeros(1), np.array([1e6]), np.zeros(1), c)
    assert one[0] == pytest.approx(10.0)                              # alone: the SM's own limit
    many, _ = share(np.zeros(20), np.full(20, 1e6), np.zeros(20), c)
    assert many == pytest.approx(np.full(20, 20.0))                   # 20 blocks: 5e4 each, HBM-bound
    # a late starter streams alone at first, then shares; a block with nothing to stream arrives at its start
    arr, landed = share(np.array([0.0, 5.0, 2.0]), np.array([1e6, 1e6, 0.0]), np.array([0.0, 0.0, 3e5]), c)
    assert arr[2] == 2.0 and landed[2] == pytest.approx(5.0)           # 3e5 bytes at 1e5/µs from 2 µs
    assert arr[0] == pytest.approx(10.0) and arr[1] == pytest.approx(15.0)


@pytest.mark.parametrize("pos,design", [(0, S.Design(handoff="flag")), (128, S.Design()),
                                        (3709, S.Design(early_bytes=200_000))])
def test_the_compiled_fluid_model_prices_as_the_numpy_one(monkeypatch, recorded, costs, pos, design):
    pytest.importorskip("numba", reason="needs numba, the compiled fluid model (the dev extra installs it)")
    fast = S.simulate(recorded.cfg, costs, pos, design=design)
    monkeypatch.setattr(S, "_share", S._share_python)
    ref = S.simulate(recorded.cfg, costs, pos, design=design)
    # the same operations in the same order: equal, not close
    for a, b in ((fast.boundary_us, ref.boundary_us), (fast.start_us, ref.start_us), (fast.arrive_us, ref.arrive_us)):
        assert np.array_equal(a, b, equal_nan=True)


def test_calibration_reproduces_the_trace_it_was_fitted_on(recorded, costs):
    sim = S.simulate(recorded.cfg, costs, recorded.pos0 + recorded.stamps.shape[0] // 2 + 1)
    assert sim.us_per_token == pytest.approx(S.measured_us(recorded), rel=0.02)
    assert set(costs.fixed_us) == set(dict(recorded.slot_names))
    # and the simulation is a function of its inputs: the same bits twice
    again = S.simulate(recorded.cfg, costs, recorded.pos0 + recorded.stamps.shape[0] // 2 + 1)
    assert np.array_equal(sim.boundary_us, again.boundary_us)


def test_measured_spans_sum_to_the_steps(recorded):
    spans = S.measured_spans(recorded)
    leave = recorded.stamps[..., 1].astype(np.float64).mean(axis=2) / 1e3
    np.testing.assert_allclose(spans.sum(axis=1), leave[1:, -1] - leave[:-1, -1], rtol=1e-9)


def test_designs_are_parsed_and_priced(recorded, costs):
    name, design, launch = S.parse_design("ring:early_bytes=200000,handoff=flag,attn_min_chunk=32,early=lm_head")
    assert (name, design) == ("ring", S.Design(early_bytes=200_000, handoff="flag"))
    assert launch == {"attn_min_chunk": 32, "early": ("lm_head",)}
    with pytest.raises(ValueError, match="no field 'bogus'"):
        S.parse_design("x:bogus=1")
    cfg = recorded.cfg
    today = S.simulate(cfg, costs, 128).us_per_token
    # more bytes loaded while waiting, and no spread of departures, can only help in this model
    assert S.simulate(cfg, costs, 128, design=S.Design(early_bytes=200_000)).us_per_token < today
    assert S.simulate(cfg, costs, 128, design=S.Design(handoff="flag")).us_per_token < today
    assert S.simulate(cfg, costs, 128, dataclasses.replace(plan.Launch(), early=()), S.Design()).us_per_token > 0
    table = dataflow.predict(cfg, costs, ["today", "flag:handoff=flag"], [128])
    assert "flag" in table and "+0.0%" in table


def test_the_copy_ahead_is_priced_by_its_bytes(recorded, costs):
    """Launch.ahead in the slot model: the MLP's first units asked for after attention's barrier (on top of the early
    loads, in a region of their own), the rest of them while the block waits after o_proj. More bytes copied, less
    left for the MLP's slot; nothing else changes."""
    cfg = recorded.cfg
    today = S.simulate(cfg, costs, 128)
    price = lambda b: S.simulate(cfg, costs, 128, plan.Launch(ahead=("gate_up_silu",), ahead_bytes=b))
    small, big = price(65536), price(131072)
    assert big.us_per_token < small.us_per_token < today.us_per_token
    mlp = today.labels.index("gate_up_silu+down_residual")
    assert big.spans()[mlp] < small.spans()[mlp] < today.spans()[mlp]
    # the slots before the copy's are not priced faster than today's
    assert np.all(big.spans()[:2] >= today.spans()[:2] - 1e-9)
    # a copy as large as the whole MLP share of a block cannot take the slot below what its other stage needs
    assert price(131072).us_per_token > S.simulate(cfg, costs, 128, design=S.Design(early_bytes=10**9)).us_per_token
    assert S.parse_design("x:ahead=gate_up_silu,ahead_bytes=65536")[2] == {"ahead": ("gate_up_silu",),
                                                                          "ahead_bytes": 65536}


def test_the_cli_prices_designs_and_refuses_bad_input_in_one_line(capsys, tmp_path):
    trace = str(T.recorded_path(0))
    assert main(["simulate", trace, "--design", "flag:handoff=flag", "--positions", "128"]) == 0
    out = capsys.readouterr().out
    assert "simulated against the trace" in out and "flag" in out
    assert main(["simulate", str(tmp_path / "none.npz")]) == 2
    assert main(["simulate", trace, "--design", "x:nope=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_handoffs_name_each_dependencys_fan_in():
    """Today's deals make nearly every dependency grid-wide; the exceptions are attention's reads of q, k and v
    (a kv head's rows, written by the blocks its row pairs are dealt to) and down's read of its own block's hmlp."""
    cfg, launch = get_config("llama-3.2-1b"), plan.Launch()
    rows = {(h.consumer, h.buffer): h for h in handoffs(cfg, launch, 128)}
    assert rows["down_residual", "hmlp"].kind == "block" and rows["down_residual", "hmlp"].fan_in == (1, 1, 1)
    assert rows["qkv_rope_append", "x"].kind == "grid"
    assert rows["gate_up_silu", "h"].kind == "grid"
    k = rows["attention_decode", "k_cache"]
    # a kv head's k: head_dim / 2 row pairs, dealt block-fastest to consecutive blocks, one each
    assert k.kind == "counter" and k.fan_in == (cfg.head_dim // 2,) * 3 and k.consumers == cfg.n_kv_heads
    # every unit is on exactly the blocks unit_blocks says: each row pair once
    qkv = plan.stage("qkv_rope_append")
    assert len(unit_blocks(cfg, qkv, launch)) == qkv.units(cfg, launch)
    assert main(["plan", "--handoffs", "128"]) == 0
    assert main(["plan", "--handoffs", str(cfg.max_seq)]) == 2


def test_the_simulator_predicts_a_position_it_was_not_fitted_on():
    """Issue 37's calibration, held as a test: fitted on the register path's traces at positions 0 and 4,096 of one
    H100 (fixtures/h100_round25, the kernel of that day), the simulator prices position 128, a trace it never saw,
    within ±5% of its measured µs per token (+3.0% when recorded), and the two it was fitted on within 2%. A cost
    model that only echoed its inputs would miss the unseen position by the attention's growth; one that fitted
    nothing would miss all three."""
    folder = T.FIXTURES / "h100_round25"
    fit = [T.load_trace(folder / f"trace_llama-3.2-1b_pos{p}.npz") for p in (0, 4096)]
    unseen = T.load_trace(folder / "trace_llama-3.2-1b_pos128.npz")
    costs = S.calibrate(fit, hbm_tbps=fit[0].roofline_tbps, sm_gbps=S.SM_GBPS)
    for tr, rel in ((fit[0], 0.02), (fit[1], 0.02), (unseen, 0.05)):
        sim = S.simulate(tr.cfg, costs, tr.pos0 + tr.stamps.shape[0] // 2 + 1)
        assert sim.us_per_token == pytest.approx(S.measured_us(tr), rel=rel), tr.label


def test_the_queueing_model_prices_the_measured_levers_and_the_slot_model_does_not():
    """Round 30 measured four levers on one H100 against the register path at position 128, each end to end and
    verified first (fixtures/bench/round30, `scripts/ab.py`): two chunks of early loads (`early_loads=16`), none at
    all (`early=`), the MLP's first units copied ahead (`ahead=gate_up_silu`, 120 KB) and the first and third
    together. Priced on the H100 fixtures of round 25, the block-by-block engine with its queueing what-if
    (`queue=1`: a round trip waits behind the bytes every SM has in flight beyond what saturates HBM) gives three of
    them their sign and each within 2.5 points of its measured change. The slot model, which has no queue, priced
    two chunks early at +4.3% where the card measured −4.2%, and the copy at +7.1% where it measured −2.0%, which is
    why a design is now priced with `queue=1` before device time goes to it (NOTES.md, round 31). The copy alone is
    the queueing model's miss, left out here and written down there: +0.9% against the measured −2.0%. A model that echoed today's kernel
    would price both at 0 and fail the first; one that only counted bytes loaded ahead would fail the sign."""
    import json

    folder = T.FIXTURES / "h100_round25"
    fit = [T.load_trace(folder / f"trace_llama-3.2-1b_pos{p}.npz") for p in (0, 4096)]
    costs = S.calibrate(fit, hbm_tbps=fit[0].roofline_tbps, sm_gbps=62.5)
    folder30 = T.FIXTURES / "bench" / "round30"
    stages = json.loads((folder30 / "ab_stages_h100_llama-3.2-1b.json").read_text())
    levers = json.loads((folder30 / "ab_levers_h100_llama-3.2-1b.json").read_text())
    cfg = fit[0].cfg
    base = dataflow.price(cfg, costs, 128, design=S.Design(queue=1))
    ahead = ("gate_up_silu",)
    for measured, variant, launch in ((stages, "e16", plan.Launch(early_loads=16)),
                                      (stages, "noearly", plan.Launch(early=())),
                                      (levers, "e16-ahead120", plan.Launch(ahead=ahead, early_loads=16))):
        want = measured[variant]["tok_s@128"] / measured["main"]["tok_s@128"] - 1
        got = base / dataflow.price(cfg, costs, 128, launch, S.Design(queue=1)) - 1
        assert np.sign(got) == np.sign(want) and abs(got - want) < 0.025, (variant, got, want)

"""Schedules priced block by block (workbench.measure.dataflow): run with barriers, the events give what the slot
simulator gives; the dataflow design's deal (each kv head on a group of blocks) deals every unit once and shrinks
the hand-offs it is for; counters and a ring are priced; bad designs are refused in one line."""
from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest

from workbench import plan, schedule
from workbench.cli import main
from workbench.measure import dataflow as D
from workbench.measure import simulate as S
from workbench.measure import trace as T
from workbench.model.config import get_config
from workbench.worklists import handoffs, head_group, kv_head_of, split_by_heads, unit_blocks

MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b")


@pytest.mark.parametrize("pos", [9, 128])
def test_run_with_barriers_the_events_agree_with_the_slot_simulator(recorded, costs, pos):
    slots = S.simulate(recorded.cfg, costs, pos).us_per_token
    events, spans = D.run(recorded.cfg, costs, pos)
    # the same costs, two engines: the events differ in where a token starts and in how a block's early loads
    # share HBM with the stragglers it waits for (~1%)
    assert events == pytest.approx(slots, rel=0.015)
    assert all(0 <= a <= b for a, b in spans.values())


def test_at_a_long_position_the_merge_of_split_heads_is_priced_alike(recorded):
    both = [recorded, T.load_recorded(3700)]
    costs = S.calibrate(both, hbm_tbps=recorded.roofline_tbps, sm_gbps=S.SM_GBPS)
    assert costs.merge_us > 0
    assert D.run(recorded.cfg, costs, 3709)[0] == pytest.approx(S.simulate(recorded.cfg, costs, 3709).us_per_token,
                                                                rel=0.015)


def test_counters_and_a_ring_are_priced_and_the_price_repeats(recorded, costs):
    cfg = recorded.cfg
    barrier = D.run(cfg, costs, 128)[0]
    counter = D.run(cfg, costs, 128, design=S.Design(handoff="counter"))[0]
    ring = D.run(cfg, costs, 128, design=S.Design(handoff="counter", early_bytes=200_000))[0]
    # no departure spread, then the next items' weights loaded while waiting: each can only help in this model
    assert ring < counter < barrier
    assert D.run(cfg, costs, 128, design=S.Design(handoff="counter"))[0] == counter


@pytest.mark.parametrize("model", MODELS)
def test_the_heads_deal_deals_every_unit_once_on_its_heads_group(model):
    cfg, launch = get_config(model), plan.Launch()
    stages = D.stages_of(cfg, S.Design(deal="heads"))
    for name in ("qkv_rope_append", "o_proj_residual"):
        st = stages[name]
        assert st.deal == "heads"
        blocks = unit_blocks(cfg, st, launch)
        assert len(blocks) == st.units(cfg, launch) and all(len(b) == 1 for b in blocks)
        for u in (0, len(blocks) // 3, len(blocks) - 1):          # each unit on its own kv head's group
            assert blocks[u][0] in head_group(cfg, launch, kv_head_of(cfg, st, u))
        per = collections.Counter(b for (b,) in blocks)           # every block takes some; a group's alike
        assert len(per) == launch.grid
        for h in range(cfg.n_kv_heads):
            mine = [per[b] for b in head_group(cfg, launch, h)]
            assert max(mine) - min(mine) <= 1
    # the O-projection split by heads: the same weight bytes, each unit one kv head's columns of one row
    o, whole = stages["o_proj_residual"], plan.stage("o_proj_residual")
    assert o.units(cfg, launch) == cfg.n_kv_heads * whole.units(cfg, launch)
    w = next(u for u in o.reads if u.buffer == "wo")
    assert sum(hi - lo for u in range(o.units(cfg, launch)) for lo, hi in w.rows(cfg, u)) == cfg.hidden * cfg.q_dim
    assert split_by_heads(cfg, plan.stage("gate_up_silu")) is plan.stage("gate_up_silu")   # reads no heads


def test_the_heads_deal_shrinks_the_hand_offs_inside_attention():
    cfg, launch = get_config("llama-3.2-1b"), plan.Launch()
    group = max(len(head_group(cfg, launch, h)) for h in range(cfg.n_kv_heads))
    rows = {(h.consumer, h.buffer): h for h in handoffs(cfg, launch, 128, D.stages_of(cfg, S.Design(deal="heads")))}
    for buf in ("q", "k_cache", "v_cache"):                       # a kv head's rows: its own group's blocks only
        assert rows["attention_decode", buf].kind == "counter" and rows["attention_decode", buf].fan_in[2] <= group
    o = rows["o_proj_residual", "o"]                              # one block's attention (one split at 128)
    assert o.kind == "counter" and o.fan_in == (1, 1, 1)
    assert rows["gate_up_silu", "h"].kind == "grid"               # the norm needs all of h: no deal changes that
    today = {(h.consumer, h.buffer): h for h in handoffs(cfg, launch, 128)}
    assert today["o_proj_residual", "o"].kind == "grid"


def test_a_design_is_refused_in_one_line(recorded, capsys):
    with pytest.raises(ValueError, match="deal 'rows'"):
        S.Design(deal="rows")
    with pytest.raises(ValueError, match="handoff 'flags'"):
        S.Design(handoff="flags")
    trace = str(T.recorded_path(0))
    assert main(["simulate", trace, "--design", "x:deal=rows"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --design x:deal=rows")


def test_the_cli_prices_a_dataflow_design(recorded, capsys):
    trace = str(T.recorded_path(0))
    assert main(["simulate", trace, "--design", "df:handoff=counter,deal=heads", "--positions", "128"]) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("df "))
    assert row.split()[1] == "128" and row.split()[-1].endswith("%")
    assert schedule.n_slots(recorded.cfg) > 0


def test_hbm_is_water_filled_and_bytes_in_flight_cost_the_latency_bound_moments(recorded, costs):
    rates = D._water_fill({"a": 1.0, "b": 10.0, "c": 10.0}, 9.0)
    assert rates == {"a": 1.0, "b": 4.0, "c": 4.0}                 # a capped transfer leaves its share to the rest
    assert D._water_fill({"a": 1.0, "b": 2.0}, 9.0) == {"a": 1.0, "b": 2.0}
    cfg = recorded.cfg
    ring = S.Design(handoff="counter", early_bytes=200_000)
    free = D.run(cfg, costs, 128, design=ring)[0]
    queued = D.run(cfg, costs, 128, design=S.Design(handoff="counter", early_bytes=200_000, queue=1))[0]
    metered = D.run(cfg, costs, 128, design=S.Design(handoff="counter", early_bytes=200_000, queue=1,
                                                     inflight=32_768))[0]
    # a ring that asks for all it may hold queues every hand-off behind it; a meter gives most of that back
    assert free < metered < queued


NEEDS_NUMBA = "needs numba, the compiled engine (the dev extra installs it)"


@pytest.fixture(scope="module")
def long_costs(recorded):
    """Costs fitted at 0 and 3700: a split kv head's merge is priced (costs.merge_us > 0)."""
    return S.calibrate([recorded, T.load_recorded(3700)], hbm_tbps=recorded.roofline_tbps, sm_gbps=S.SM_GBPS)


# every value of every field at least once, at each position (the Python engine takes ~12 s a run)
DESIGNS = [(0, S.Design()),
           (128, S.Design(handoff="counter", deal="heads", early_bytes=200_000, queue=1, inflight=32_768)),
           (3709, S.Design(handoff="counter", queue=1)),
           (3709, S.Design(deal="heads", early_bytes=200_000, inflight=32_768))]


@pytest.mark.parametrize("pos,design", DESIGNS, ids=[f"{p}-{d.handoff}-{d.deal}-{d.early_bytes}-q{d.queue}-{d.inflight}"
                                                     for p, d in DESIGNS])
def test_the_compiled_engine_prices_as_the_python_one(recorded, costs, long_costs, pos, design):
    pytest.importorskip("numba", reason=NEEDS_NUMBA)
    c = long_costs if pos > 1000 else costs
    us, spans = D.run(recorded.cfg, c, pos, design=design, engine="numba")
    ref_us, ref_spans = D.run(recorded.cfg, c, pos, design=design, engine="python")
    # the same events and the same floating-point operations in the same order: equal, not close
    assert us == ref_us
    assert spans == ref_spans


def _check_spans(g, spans):
    """Each block's nodes run one after the other, and none starts before what it waits for was seen."""
    assert len(spans) == sum(map(len, g.nodes))
    seen = {}                                                 # (key, set id) → the last of its blocks' finishes
    for b, nodes in enumerate(g.nodes):
        prev = 0.0
        for nd in nodes:
            start, end = spans[nd.key, b]
            assert prev <= start <= end
            for (pkey, sid), delay in zip(nd.deps, nd.delay):
                if (pkey, sid) not in seen:
                    seen[pkey, sid] = max(spans[pkey, p][1] for p in g.sets[sid])
                assert start >= seen[pkey, sid] + delay - 1e-9
            prev = end


@pytest.mark.parametrize("handoff,deal", list(itertools.product(("barrier", "counter"), ("today", "heads"))))
def test_the_compiled_engine_keeps_the_order_of_every_design(recorded, costs, handoff, deal):
    pytest.importorskip("numba", reason=NEEDS_NUMBA)
    cfg, launch = recorded.cfg, plan.Launch()
    for early_bytes, queue in ((None, 0), (200_000, 1)):        # a graph of the heads deal takes seconds
        base = S.Design(handoff=handoff, deal=deal, early_bytes=early_bytes, queue=queue)
        g = D._Graph(cfg, costs, 128, launch, base, 2)       # the meter changes the events, not the graph
        for inflight in (None, 32_768):
            spans = D._run_flat(g, costs, dataclasses.replace(base, inflight=inflight))
            _check_spans(g, spans)


class _Ran(Exception):
    pass


def test_without_numba_the_python_engine_runs(monkeypatch, recorded, costs):
    monkeypatch.setattr(D, "numba", None)

    def python_engine(g, c, d):
        raise _Ran

    monkeypatch.setattr(D, "_run_python", python_engine)
    with pytest.raises(_Ran):
        D.run(recorded.cfg, costs, 0)
    with pytest.raises(ImportError, match="numba"):
        D.run(recorded.cfg, costs, 0, engine="numba")
    with pytest.raises(ValueError, match="engine 'c'"):
        D.run(recorded.cfg, costs, 0, engine="c")


def test_the_copy_ahead_is_posted_once_a_layer_and_priced_alike_by_both_engines(recorded, costs):
    """Launch.ahead in the block-by-block engine: every block with units of the stage copied ahead posts one copy a
    layer, at its arrival at attention's barrier (with counters, once past attention's slot), for its own node of
    that stage, of the bytes the schedule deals it; the two engines price it to the same bits; and the bytes the copy brings are taken off the
    stage's own stream (with the queue off, the MLP's nodes get shorter)."""
    cfg = recorded.cfg
    launch = plan.Launch(ahead=("gate_up_silu",))
    a = schedule.ahead(cfg, launch)
    g = D._Graph(cfg, costs, 128, launch, S.Design(queue=1), 2)
    per = a.block_bytes(launch.grid)
    for b, cps in enumerate(g.copies):
        assert len(cps) == 2 * cfg.n_layers if per[b] else not cps
        for post, dest, nbytes in cps:
            nodes = g.nodes[b]
            assert nodes[dest].stage == a.stage and nbytes == per[b]
            assert nodes[post].stage is None and post < dest
            assert all(nd.stage in (None, a.issuer) for nd in nodes[post + 1:dest])
    counter = D._Graph(cfg, costs, 128, launch, S.Design(handoff="counter"), 2)
    for b, cps in enumerate(counter.copies):
        for post, dest, _ in cps:
            assert counter.nodes[b][post].stage in (a.issuer, a.stage) and post <= dest
    design = S.Design(queue=1)
    if D.numba is not None:
        assert D.run(cfg, costs, 128, launch, design, engine="numba") == \
            D.run(cfg, costs, 128, launch, design, engine="python")
    _, plain = D.run(cfg, costs, 128)
    _, copied = D.run(cfg, costs, 128, launch)
    mlp = [k for k in plain if k[0] >= 0 and g.nodes[k[1]] and
           any(nd.key == k[0] and nd.stage == a.stage for nd in g.nodes[k[1]])]
    took = lambda spans: sum(spans[k][1] - spans[k][0] for k in mlp)
    assert took(copied) < took(plain)

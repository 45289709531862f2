"""Timing traces (workbench.measure.trace) and the dashboards (workbench.ui.dashboard), in-process, no GPU.

A synthetic trace with hand-computable spans checks the numbers every figure shows; the recorded H200 fixtures check
the file format, the metadata and the titles; snapshots with unwritten (0) stamps check the live path. The slot
layout is the plan's: every slot stamped in every step, slot 0 "sampling+publish+embedding" (at step 0 only the
embedding), then one per barrier of each layer (qkv, attention, o_proj, and the MLP's gate_up and down together in
one slot), then lm_head.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from workbench import abi, plan, schedule  # noqa: E402
from workbench.ui import dashboard as D                          # noqa: E402
from workbench.measure import trace as T                              # noqa: E402
from workbench.model.config import PRESETS                           # noqa: E402
from workbench.measure.timing import slot_labels, slot_names, spans, stage_bytes, stage_table  # noqa: E402

CFG = PRESETS["tiny"]                  # 2 layers: 10 slots
LAYER_SLOTS = [s.label for s in schedule.slots(CFG) if s.layer == 0]      # one layer's slots, in order
SLOTS_PER_LAYER = len(LAYER_SLOTS)
N_SLOTS = SLOTS_PER_LAYER * CFG.n_layers + 2
SLOT0 = "sampling+publish+embedding"
MLP = "gate_up_silu+down_residual"     # gate_up and down between the same two barriers: one slot, one timing row
RECORDED_TITLE = "recorded on NVIDIA H200, 2026-12-06, commit 1150903"   # fixtures/timing_*
L_NS = 500                             # barrier latency of the synthetic trace
T0 = 10**15
CHROMIUM = "/usr/bin/chromium"


def synthetic(cfg=CFG, steps=5, blocks=4, work_scale=None, t0=T0):
    """Stamps where block b spends W[k] + 100·b ns on slot k after leaving the previous barrier, the barrier lets go
    L_NS after the last arrival, and block b leaves 10·b ns after that. Then every slot's span (release to release)
    is W[k] + 300 + L_NS + 30 ns, with W[k] = 1000·(k + 1)."""
    n_slots = len(slot_names(cfg))
    t = np.zeros((steps, n_slots, blocks, 2), np.uint64)
    b = np.arange(blocks, dtype=np.int64)
    prev = None
    for s in range(steps):
        for k in range(n_slots):
            w = 1000 * (k + 1) * (1 if work_scale is None else work_scale(k)) + 100 * b
            start = np.full(blocks, t0, np.int64) if prev is None else prev
            arrive = start + w
            leave = arrive.max() + L_NS + 10 * b
            t[s, k, :, 0], t[s, k, :, 1] = arrive, leave
            prev = leave
    return t


def layer_slot(label: str, layer: int) -> int:
    """The index of the slot `label` of `layer` in a step (CFG's layout)."""
    return next(s.index for s in schedule.slots(CFG) if (s.label, s.layer) == (label, layer))


def slot_span_ns(k):
    return 1000 * (k + 1) + 100 * 3 + L_NS + 30           # 4 blocks: the slowest is block 3


STEP_NS = sum(slot_span_ns(k) for k in range(N_SLOTS))   # a step after the first: every slot


def as_v1(t: np.ndarray) -> np.ndarray:
    """The same barriers in the older layout (format /1): slot 0 the first embedding, stamped in step 0 only, then
    the layers and lm_head, then sampling, whose barrier is the next step's slot 0 (the last step's is made up)."""
    S, K, B, _ = t.shape
    old = np.zeros((S, K + 1, B, 2), t.dtype)
    old[:, 1:-1] = t[:, 1:]
    old[0, 0] = t[0, 0]
    old[:-1, -1] = t[1:, 0]
    old[-1, -1] = t[-1, -1] + np.uint64(5000)
    return old


def save_v1(path, t: np.ndarray, meta: dict) -> Path:
    base, delta = T.encode(t)
    meta = dict(meta, format=T.FORMAT_V1)
    meta.pop("slots", None)
    np.savez_compressed(path, format=np.array(T.FORMAT_V1), base_ns=np.array(base, np.uint64), delta_ns=delta,
                        meta=np.array(json.dumps(meta)))
    return Path(path)


# -- synthetic: the analysis ----------------------------------------------------------------------------------------

def test_slot_layout_comes_from_the_plan():
    names = slot_names(CFG)
    assert names == [(s.label, s.layer) for s in schedule.slots(CFG)] and len(names) == schedule.n_slots(CFG) == N_SLOTS
    assert names[0] == (SLOT0, -1) and names[-1] == ("lm_head", -1)
    assert slot_names(CFG, first_step=True)[0] == ("embedding", -1)
    assert slot_labels(CFG) == [SLOT0, *LAYER_SLOTS, "lm_head"]
    assert LAYER_SLOTS == ["qkv_rope_append", "attention_decode", "o_proj_residual", MLP] and N_SLOTS == 10
    for layer in range(CFG.n_layers):                  # each layer's slots run the layer stages once, in order
        mine = [s for s in schedule.slots(CFG) if s.layer == layer]
        assert [s.label for s in mine] == LAYER_SLOTS
        assert [st for s in mine for st in s.stages] == [(st, layer) for st in plan.LAYER_STAGES]
        assert schedule.barrier_slot(CFG, "gate_up_silu", layer) is None           # no grid barrier inside the MLP
        assert schedule.barrier_slot(CFG, "down_residual", layer) == layer_slot(MLP, layer)
    assert stage_bytes(CFG, MLP, 7) == sum(schedule.stage_bytes(CFG, s, 7) for s in ("gate_up_silu", "down_residual"))
    assert stage_bytes(CFG, SLOT0, 7) == sum(schedule.stage_bytes(CFG, s, 7) for s in ("sampling", "publish",
                                                                                    "embedding"))
    assert stage_bytes(CFG, "attention_decode", 9) == schedule.stage_bytes(CFG, "attention_decode", 9)


def test_synthetic_spans_are_what_the_construction_says():
    rows = {r.stage: r for r in stage_table(CFG, synthetic(), 0)}
    assert list(rows) == slot_labels(CFG)
    qkv_slots = [k for k, (s, _) in enumerate(slot_names(CFG)) if s == "qkv_rope_append"]
    assert qkv_slots == [1 + SLOTS_PER_LAYER * l for l in range(CFG.n_layers)] == [1, 5]
    assert rows[SLOT0].us_per_token == pytest.approx(slot_span_ns(0) / 1e3)
    assert rows["qkv_rope_append"].us_per_token == pytest.approx(sum(slot_span_ns(k) for k in qkv_slots) / 1e3)
    assert rows["qkv_rope_append"].spread == pytest.approx((rows["qkv_rope_append"].us_per_token,) * 2)
    assert rows["lm_head"].us_per_token == pytest.approx(slot_span_ns(N_SLOTS - 1) / 1e3)
    mlp_slots = [layer_slot(MLP, l) for l in range(CFG.n_layers)]
    assert rows[MLP].us_per_token == pytest.approx(sum(slot_span_ns(k) for k in mlp_slots) / 1e3)
    assert sum(r.us_per_token for r in rows.values()) == pytest.approx(STEP_NS / 1e3)
    assert np.allclose(T.step_ns(synthetic())[1:], STEP_NS)


def test_complete_steps_and_partial_stamps():
    t = synthetic()
    assert T.complete_steps(t) == 5
    p = t.copy()
    p[3, 5:] = 0
    p[4] = 0
    assert T.complete_steps(p) == 3
    p[0, 0, 2, 1] = 0                                    # one leave stamp of the first embedding missing
    assert T.complete_steps(p) == 0
    assert T.complete_steps(np.zeros_like(t)) == 0
    assert T.stage_rows(np.zeros_like(t), CFG) == []
    assert T.step_ns(np.zeros_like(t)).size == 0
    one = t.copy()
    one[1:] = 0
    assert len(T.stage_rows(one, CFG)) == len(slot_labels(CFG)) == 6      # a single complete step is used, not skipped


def test_intervals_tile_each_block_without_gaps():
    t = synthetic()
    iv = T.intervals(t)
    assert iv.known.all()                                                        # every slot, every step
    assert (iv.work[iv.known] >= 0).all() and (iv.wait[iv.known] > 0).all()    # step 0 starts at the first arrival
    for s in range(1, 5):
        for b in range(4):
            total = (iv.work[s, :, b] + iv.wait[s, :, b]).sum()
            assert total == int(t[s, -1, b, 1]) - int(t[s - 1, -1, b, 1])
            assert iv.start[s, 0, b] == t[s - 1, -1, b, 1]          # slot 0 starts where the last step let go
    assert (iv.work[2, 3] == 1000 * 4 + 100 * np.arange(4)).all()
    assert (iv.work[3, 0] == 1000 + 100 * np.arange(4)).all()
    _, work, wait = spans(t)                                                   # timing.spans agrees, per block
    assert np.array_equal(work, iv.work) and np.array_equal(wait, iv.wait)


# -- the trace file -------------------------------------------------------------------------------------------------

def test_save_load_roundtrip_with_unwritten_stamps(tmp_path):
    t = synthetic()
    t[4, 7:] = 0
    meta = T.recording_meta(CFG, position=12, tok_s=1234.5, roofline_tbps=4.2, device="Test GPU",
                            date="2026-01-02", commit="abc1234", note="ümlaut ok")
    path = T.save_trace(tmp_path / "x.npz", t, meta)
    tr = T.load_trace(path)
    assert np.array_equal(tr.stamps, t) and tr.stamps.dtype == np.uint64
    assert tr.meta["note"] == "ümlaut ok" and tr.meta["format"] == T.FORMAT
    assert tr.pos0 == 12 and tr.tok_s == 1234.5 and tr.roofline_tbps == 4.2 and tr.recorded
    assert tr.cfg == CFG
    assert tr.title == "recorded on Test GPU, 2026-01-02, commit abc1234"
    assert T.FORMAT == "workbench-timing-trace/2"
    assert tr.meta["slots"]["labels"] == [n for n, _ in slot_names(CFG)]            # the trace describes its layout
    assert tr.meta["slots"]["layers"] == [l for _, l in slot_names(CFG)]
    assert tr.meta["slots"]["step0_label"] == "embedding" and tr.slot_names == slot_names(CFG)
    with np.load(path) as z:
        assert z["delta_ns"].dtype == np.int32 and (z["delta_ns"][4, 7:] == -1).all()
    with pytest.raises(ValueError, match="slots per step"):
        T.save_trace(tmp_path / "y.npz", as_v1(t), meta)                        # older-layout stamps do not fit


def test_a_trace_is_read_with_its_own_layout(tmp_path):
    """A trace whose recorded layout names stages differently from today's plan keeps its own rows."""
    t = synthetic()
    meta = T.recording_meta(CFG, device="x", commit="y")
    meta["slots"]["labels"][0] = "old_first_stage"
    tr = T.load_trace(T.save_trace(tmp_path / "own.npz", t, meta))
    rows = tr.stage_table()
    assert rows[0].stage == "old_first_stage" and rows[0].bytes == 0
    assert [r.us_per_token for r in rows] == pytest.approx([r.us_per_token for r in stage_table(CFG, t)])
    d = D.Dashboard.from_trace(tr)
    assert list(d.figures["stages"].data[0].x)[0] == "old_first_stage"
    assert d.figures["stages"].data[0].marker.color[0] == D.UNKNOWN_COLOR


def test_long_runs_use_int64_deltas(tmp_path):
    t = synthetic()
    t[-1, -1, :, 1] += np.uint64(3 * 10**9)              # a step that took 3 s
    T.save_trace(tmp_path / "long.npz", t, T.recording_meta(CFG, device="x", commit="y"))
    with np.load(tmp_path / "long.npz") as z:
        assert z["delta_ns"].dtype == np.int64
    assert np.array_equal(T.load_trace(tmp_path / "long.npz").stamps, t)


def test_not_a_trace_is_refused(tmp_path):
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not a workbench timing trace"):
        T.load_trace(tmp_path / "other.npz")


def test_convert_v1_regroups_the_same_barriers():
    t = synthetic()
    old = as_v1(t)
    assert old.shape == (5, N_SLOTS + 1, 4, 2) and (old[1:, 0] == 0).all()
    new = T.convert_v1(old)
    assert new.shape == t.shape and np.array_equal(new, t)
    assert np.array_equal(new[1:, 0], old[:-1, -1]) and np.array_equal(new[0, 0], old[0, 0])
    assert np.array_equal(new[:, 1:], old[:, 1:-1])
    with pytest.raises(ValueError):
        T.convert_v1(np.zeros((2, 2, 4, 2), np.uint64))


def test_an_old_layout_trace_is_refused_with_one_line(tmp_path, capsys):
    t = synthetic()
    meta = T.recording_meta(CFG, position=3, device="Test GPU", date="2026-01-02", commit="abc1234", note="kept")
    old = save_v1(tmp_path / "old.npz", as_v1(t), meta)
    with pytest.raises(T.OldLayoutError) as e:
        T.load_trace(old)
    msg = str(e.value)
    assert "\n" not in msg and "old slot layout" in msg and "trace convert" in msg
    assert T.main(["info", str(old)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "old slot layout" in err and len(err.splitlines()) == 1
    # converted: the same stamps in this layout, the metadata kept, a note added
    assert T.main(["convert", str(old), str(tmp_path / "new.npz")]) == 0
    tr = T.load_trace(tmp_path / "new.npz")
    assert np.array_equal(tr.stamps, t) and tr.meta["format"] == T.FORMAT
    assert tr.meta["converted_from"] == T.FORMAT_V1 and tr.meta["device"] == "Test GPU" and tr.pos0 == 3
    assert tr.meta["note"].startswith("kept; converted from the older slot layout")
    assert tr.meta["slots"]["labels"][0] == SLOT0
    assert T.main(["convert", str(tmp_path / "new.npz"), str(tmp_path / "again.npz")]) == 2   # already /2


def test_cli_pack_from_v1(tmp_path, capsys):
    t = synthetic()
    np.save(tmp_path / "old.npy", as_v1(t))
    args = ["--model", "tiny", "--device", "Test GPU", "--date", "2026-01-02", "--commit", "abc1234"]
    assert T.main(["pack", str(tmp_path / "old.npy"), str(tmp_path / "x.npz"), *args]) == 2
    err = capsys.readouterr().err
    assert "--from-v1" in err and len(err.strip().splitlines()) == 1
    assert T.main(["pack", str(tmp_path / "old.npy"), str(tmp_path / "t.npz"), *args, "--from-v1"]) == 0
    tr = T.load_trace(tmp_path / "t.npz")
    assert np.array_equal(tr.stamps, t) and tr.meta["converted_from"] == T.FORMAT_V1


def test_cli_pack_info_perfetto(tmp_path, capsys):
    np.save(tmp_path / "raw.npy", synthetic())
    assert T.main(["pack", str(tmp_path / "raw.npy"), str(tmp_path / "t.npz"), "--model", "tiny", "--steps", "3",
                   "--device", "Test GPU", "--date", "2026-01-02", "--commit", "abc1234", "--tok-s", "9000",
                   "--roofline-tbps", "3.5", "--meta", '{"weights": "random"}']) == 0
    tr = T.load_trace(tmp_path / "t.npz")
    assert tr.stamps.shape[0] == 3 and tr.meta["steps_in_run"] == 5 and tr.meta["weights"] == "random"
    assert T.main(["info", str(tmp_path / "t.npz")]) == 0
    out = capsys.readouterr().out
    assert "recorded on Test GPU, 2026-01-02, commit abc1234" in out
    assert f"{N_SLOTS} slots per step: {SLOT0}, qkv_rope_append" in out
    assert T.main(["perfetto", str(tmp_path / "t.npz"), str(tmp_path / "t.json"), "--steps", "1-2"]) == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    assert {e["args"]["step"] for e in doc["traceEvents"] if e["ph"] == "X"} == {1, 2}


def test_info_columns_have_units(capsys):
    assert T.main(["info", str(T.recorded_path(0))]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("stage"))
    assert header.split()[1:] == ["µs/token", "p10–p90", "µs", "work", "µs", "wait", "µs", "skew", "µs", "MB", "TB/s",
                                  "%roof"]


def test_perfetto_steps_out_of_range_is_an_error(tmp_path, capsys):
    """A 17-step trace asked for step 99 wrote an empty file; now: one line saying which steps exist, exit 2."""
    out = tmp_path / "none.json"
    assert T.main(["perfetto", str(T.recorded_path(0)), str(out), "--steps", "99"]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --steps 99: ")
    assert "step 99 is not in the trace: it has steps 0–16" in err
    assert not out.exists()
    assert T.main(["perfetto", str(T.recorded_path(0)), str(out), "--steps", "15-20"]) == 2
    assert "steps 17–20 are not in the trace: it has steps 0–16" in capsys.readouterr().err
    assert T.main(["perfetto", str(T.recorded_path(0)), str(out), "--steps", "x"]) == 2
    assert "give N or A-B" in capsys.readouterr().err
    with pytest.raises(ValueError, match="block 9 is not in the trace: it has blocks 0–3"):
        T.to_perfetto(synthetic(), CFG, blocks=[9])
    assert not out.exists()


# -- the recorded fixtures ------------------------------------------------------------------------------------------

def test_recorded_fixtures_are_small_and_labelled():
    total = 0
    for pos, tok_s in ((0, 1225.7), (3700, 1097.2)):
        path = T.recorded_path(pos)
        total += path.stat().st_size
        tr = T.load_trace(path)
        m = tr.meta
        assert m["recorded"] is True and m["device"] == "NVIDIA H200" and m["date"] == "2026-12-06"
        assert m["commit"] == "1150903" and m["model"] == "llama-3.2-1b" and m["position"] == pos
        assert m["tok_s"] == pytest.approx(tok_s, abs=0.1) and m["roofline_tbps"] == pytest.approx(4.437, abs=0.005)
        assert m["format"] == T.FORMAT
        n_slots = schedule.n_slots(PRESETS["llama-3.2-1b"])
        assert n_slots == SLOTS_PER_LAYER * PRESETS["llama-3.2-1b"].n_layers + 2 == 66       # 16 layers of four
        assert tr.stamps.shape == (17, n_slots, 132, 2) and tr.complete_steps == 17
        assert tr.slot_names == slot_names(tr.cfg)
        assert tr.cfg == PRESETS["llama-3.2-1b"]
        assert tr.title == RECORDED_TITLE
    assert total < 3e6


def test_recorded_stage_table_matches_the_notes():
    """The per-stage table of the recorded fixtures (re-recorded at 1150903 on 2026-12-06, as `python -m workbench
    trace info` prints it, NOTES.md round 28): their 16 steps after step 0, from the kernel generated from the plan.
    gate_up and down share a slot, so they are one row. Means over the steps (a mean is what lets the rows add
    up)."""
    notes = {SLOT0: 9.2, "qkv_rope_append": 74.7, "attention_decode": 85.4, "o_proj_residual": 87.7,
             MLP: 433.5, "lm_head": 121.4}
    near = T.load_recorded(0)
    rows = {r.stage: r for r in near.stage_table()}
    assert list(rows) == list(notes)
    for stage, us in notes.items():
        assert rows[stage].us_per_token == pytest.approx(us, rel=0.02), stage
    assert rows["lm_head"].tbps / near.roofline_tbps == pytest.approx(0.975, abs=0.01)
    mlp_bytes = sum(schedule.stage_bytes(near.cfg, st, 0) for st in ("gate_up_silu", "down_residual"))
    assert rows[MLP].bytes == mlp_bytes * near.cfg.n_layers                  # both stages' weights, every layer
    far = {r.stage: r for r in T.load_recorded(3700).stage_table()}
    assert far["attention_decode"].us_per_token == pytest.approx(179.2, rel=0.02)
    assert far["attention_decode"].bytes == pytest.approx(121.5e6, rel=0.01)


# -- Perfetto -------------------------------------------------------------------------------------------------------

def _no_arrays(x) -> bool:
    if isinstance(x, list):
        return False
    if isinstance(x, dict):
        return all(_no_arrays(v) for v in x.values())
    return True


def check_perfetto(doc: dict, stamps: np.ndarray | None = None) -> dict:
    """Structure Perfetto's JSON importer accepts (also its older tokenizer: traceEvents first, only known top-level
    keys, no arrays inside an event, no \\u escapes); slices on a track never overlap once ts and dur are truncated
    to integer ns; returns {tid: [(start_ns, end_ns, event)]}."""
    assert list(doc)[0] == "traceEvents"
    assert set(doc) <= {"traceEvents", "otherData", "displayTimeUnit", "metadata", "systemTraceEvents"}
    text = json.dumps(doc)
    assert text.isascii() and "\\u" not in text
    named = {}
    tracks: dict = {}
    for e in doc["traceEvents"]:
        assert isinstance(e, dict) and e["ph"] in ("X", "M") and _no_arrays(e)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "M":
            if e["name"] == "thread_name":
                named[e["tid"]] = e["args"]["name"]
            continue
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["ts"] >= 0 and e["dur"] >= 0
        start = int(e["ts"] * 1000)                       # what an importer that truncates makes of it
        tracks.setdefault(e["tid"], []).append((start, start + int(e["dur"] * 1000), e))
    assert set(tracks) <= set(named), "every track has a thread_name"
    for tid, sl in tracks.items():
        sl.sort(key=lambda x: x[0])
        for (s0, e0, _), (s1, _, _) in zip(sl, sl[1:]):
            assert e0 <= s1, f"overlapping slices on track {named[tid]}"
    if stamps is not None:
        base = int(stamps[stamps > 0].min())
        for tid, sl in tracks.items():
            for s, e, ev in sl:
                a = ev["args"]
                if ev["cat"] == "wait":
                    assert s == int(stamps[a["step"], a["slot"], a["block"], 0]) - base
                    assert e == int(stamps[a["step"], a["slot"], a["block"], 1]) - base
    return {"tracks": tracks, "names": named}


def test_perfetto_synthetic_structure_and_sums():
    t = synthetic()
    doc = T.to_perfetto(t, CFG, pos0=100, meta={"device": "Test GPU", "recorded": True, "commit": "abc"})
    got = check_perfetto(doc, t)
    tracks, names = got["tracks"], got["names"]
    assert sorted(names.values()) == sorted([f"block {b}" for b in range(4)] + ["grid: barrier to barrier"])
    blocks = {tid: sl for tid, sl in tracks.items() if names[tid].startswith("block")}
    assert len(blocks) == 4
    for tid, sl in blocks.items():
        b = int(names[tid].split()[1])
        assert all(ev["args"]["block"] == b for _, _, ev in sl)
        for s in range(1, 5):
            mine = [ev for _, _, ev in sl if ev["args"]["step"] == s]
            assert len(mine) == 2 * N_SLOTS                  # work and wait for every slot
            assert {ev["cat"] for ev in mine} == {"work", "wait"}
            assert {ev["args"]["position"] for ev in mine} == {100 + s}
            expect_ns = int(t[s, -1, b, 1]) - int(t[s - 1, -1, b, 1])
            assert sum(int(ev["dur"] * 1000) for ev in mine) == expect_ns        # exact, in integer ns
            assert sum(ev["dur"] for ev in mine) == pytest.approx(expect_ns / 1e3, abs=1e-2)
        work = [ev for _, _, ev in sl if ev["cat"] == "work" and ev["args"]["step"] == 2]
        layers = {(ev["name"], ev["args"]["layer"]) for ev in work}
        assert ("qkv_rope_append", 0) in layers and ("qkv_rope_append", 1) in layers and ("lm_head", -1) in layers
        assert (SLOT0, -1) in layers
        first = {ev["name"] for _, _, ev in sl if ev["args"]["step"] == 0 and ev["args"]["slot"] == 0}
        assert first == {"embedding", "wait (embedding)"}                         # step 0 only embeds
    grid = next(sl for tid, sl in tracks.items() if names[tid].startswith("grid"))
    for s in range(1, 5):
        assert sum(int(ev["dur"] * 1000) for _, _, ev in grid if ev["args"]["step"] == s) == STEP_NS
    assert doc["otherData"]["device"] == "Test GPU" and doc["otherData"]["model"] == "tiny"


def test_perfetto_of_partial_stamps_skips_unwritten_slots():
    t = synthetic()
    t[2, 4:] = 0
    t[3:] = 0
    doc = T.to_perfetto(t, CFG)
    got = check_perfetto(doc, t)
    steps = {ev["args"]["step"] for sl in got["tracks"].values() for _, _, ev in sl}
    assert steps == {0, 1, 2}
    slots2 = {ev["args"]["slot"] for sl in got["tracks"].values() for _, _, ev in sl if ev["args"]["step"] == 2}
    assert slots2 == {0, 1, 2, 3}


def test_perfetto_of_the_recorded_fixture(tmp_path):
    tr = T.load_recorded(0)
    out = tr.write_perfetto(tmp_path / "trace.json", steps=[1], blocks=range(8))
    doc = json.loads(out.read_text())
    got = check_perfetto(doc, tr.stamps)
    assert len([n for n in got["names"].values() if n.startswith("block")]) == 8
    x = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "grid"]
    assert len(x) == 8 * schedule.n_slots(tr.cfg) * 2
    assert doc["otherData"]["recorded"] is True and doc["otherData"]["device"] == "NVIDIA H200"
    grid = [e for e in doc["traceEvents"] if e.get("cat") == "grid"]
    assert sum(e["dur"] for e in grid) == pytest.approx(T.step_ns(tr.stamps)[1] / 1e3, abs=0.01)


# -- the dashboard: synthetic ---------------------------------------------------------------------------------------

def test_dashboard_figures_synthetic():
    t = synthetic()
    d = D.Dashboard(CFG, roofline_tbps=2.0, source="synthetic")
    assert d.update_timing(t, pos0=100, tok_s=9999.0) == 5
    rows = stage_table(CFG, t, 100)
    st = d.figures["stages"].data[0]
    assert list(st.x) == slot_labels(CFG) == [r.stage for r in rows]
    assert list(st.y) == pytest.approx([r.us_per_token for r in rows])
    assert list(st.error_y.array) == pytest.approx([0.0] * len(rows), abs=1e-9)     # every step alike
    assert list(st.marker.color) == [D.color_of(s) for s in slot_labels(CFG)]

    bw = d.figures["bandwidth"]
    moved = [r for r in rows if r.bytes > 0]
    assert list(bw.data[0].x) == [r.stage for r in moved]
    layers = CFG.n_layers
    gu = next(r for r in rows if r.stage == MLP)
    assert gu.bytes == stage_bytes(CFG, MLP, 102) * layers
    assert gu.bytes == sum(schedule.stage_bytes(CFG, st, 102) for st in ("gate_up_silu", "down_residual")) * layers
    assert bw.data[0].y[list(bw.data[0].x).index(MLP)] == pytest.approx(gu.bytes / gu.us_per_token / 1e6)
    assert bw.layout.shapes[0].y0 == bw.layout.shapes[0].y1 == 2.0
    assert "2.00 TB/s" in bw.layout.annotations[0].text

    tk = d.figures["tok_s"]
    assert list(tk.data[0].x) == [100, 101, 102, 103, 104]
    assert list(tk.data[0].y)[1:] == pytest.approx([1e9 / STEP_NS] * 4)
    roof = [2.0e12 / (CFG.weight_bytes_per_token() + CFG.kv_bytes_per_token(p)) for p in range(100, 105)]
    assert list(tk.data[1].y) == pytest.approx(roof)

    assert "synthetic" in d.header.value and "9,999 tok/s" in d.header.value
    for fig in d.figures.values():
        assert "synthetic" in fig.layout.title.text


def test_colours_and_short_names_come_from_the_plan():
    assert list(D.COLORS) == list(D.SHORT) == list(plan.STAGE_NAMES)
    for i, name in enumerate(plan.STAGE_NAMES):
        assert D.COLORS[name] == D.PALETTE[i % len(D.PALETTE)]
    assert D.WAIT_COLOR not in D.PALETTE and D.UNKNOWN_COLOR not in D.PALETTE
    assert D.color_of(SLOT0) == D.COLORS["sampling"]                      # a slot of several: its first stage's
    assert D.short_of(SLOT0) == "+".join(D.SHORT[s] for s in ("sampling", "publish", "embedding"))
    assert [D.SHORT[s] for s in plan.LAYER_STAGES] == ["qkv", "attention", "o-proj", "gate-up", "down"]
    assert D.SHORT["lm_head"] == "lm-head"


def _png_indices(png: bytes) -> np.ndarray:
    """The colour indices [height, width] of a palette PNG as workbench.ui.png writes it (8-bit, rows unfiltered)."""
    import struct
    import zlib
    pos, idat, w = 8, b"", 0
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, colour_type = struct.unpack(">IIBB", data[:10])
            assert depth == 8 and colour_type == 3
        elif kind == b"IDAT":
            idat += data
        pos += 12 + n
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, w + 1)
    assert (rows[:, 0] == 0).all()                                    # filter type 0 on every row
    return rows[:, 1:]


def _cells(d):
    """The Gantt chart's blocks' rows as the page gets them: the stage code of every cell [blocks, bins] (the picture
    drawn is checked to be made of them), the start and length its hover text gives (from the table the page reads),
    the bin width, and each code's colour in the picture's palette."""
    c, hover = d.gantt_cells, d.figures["gantt"]._hover_cells
    rows = list(d.gantt_heatmap.y)[1:]
    assert list(d.gantt_heatmap.y)[0] == D.GRID_Y and hover["rows"] == ["grid"] + [f"block {b}" for b in rows]
    assert (_png_indices(d.gantt_png) == D.gantt_picture(c["z"], rows, d.stamps.shape[2])).all()
    index = D.from_typed_array(hover["index"])
    start, length = (D.from_typed_array(hover[k])[index] for k in ("start", "length"))
    z = c["z"][1:]
    assert z.shape == start[1:].shape == length[1:].shape

    def colour(code):
        return d._gantt_palette[int(code) + 1]
    return z, start[1:], length[1:], c["dx"], colour


def _cell_of(d, block, t0, t1):
    """(code, start, length, the name kept in Python) of the Gantt chart's cell at the middle of [t0, t1] on
    `block`."""
    z, start, length, dx, _ = _cells(d)
    i, j = list(d.gantt_heatmap.y)[1:].index(block), int((t0 + t1) / 2 / dx)
    return z[i, j], start[i, j], length[i, j], d.gantt_names()[i, j]


def test_gantt_synthetic():
    t = synthetic()
    d = D.Dashboard(CFG, source="synthetic")
    d.update_timing(t)
    assert d.step_slider.max == 4 and d.step_slider.value == 4    # follows the newest token
    d.step_slider.value = 2
    g = d.figures["gantt"]
    z, _, _, dx, colour = _cells(d)
    assert z.shape == (4, D.GANTT_BINS) and list(d.gantt_heatmap.y) == [D.GRID_Y, 0, 1, 2, 3]
    iv = T.intervals(t)
    t0 = int(t[1, -1, :, 1].max())
    # every block's work and wait in every slot, in its stage's colour (the wait grey), with its hover text
    qkv = D.COLORS["qkv_rope_append"]
    seen = set()
    for k, (label, layer) in enumerate(slot_names(CFG)):
        for b in range(4):
            s0, a, l0 = ((iv.start[2, k, b] - t0) / 1e3, (iv.arrive[2, k, b] - t0) / 1e3,
                         (iv.leave[2, k, b] - t0) / 1e3)
            code, start, length, txt = _cell_of(d, b, s0, a)
            assert colour(code) == D.color_of(label) and code != 0, (label, b)
            assert txt == label + (f" layer {layer}" if layer >= 0 else "")
            assert [start, length] == pytest.approx([s0, a - s0], abs=1e-3)
            code, start, length, txt = _cell_of(d, b, a, l0)
            assert code == 0 and colour(code) == D.WAIT_COLOR and txt.startswith(f"wait at {label}")
            assert [start, length] == pytest.approx([a, l0 - a], abs=1e-3)
            seen.add(label)
    assert "qkv_rope_append" in seen and colour(1 + d._gantt_labels.index("qkv_rope_append")) == qkv
    # every colour drawn has a legend entry, and only the stages drawn have one
    drawn = {colour(c) for c in np.unique(z[~np.isnan(z)])}
    legend = {tr.marker.color: tr.name for tr in g.data[1:] if tr.showlegend}
    assert drawn <= set(legend) and legend[D.WAIT_COLOR] == D.WAIT_TRACE
    assert d.gantt_trace("qkv_rope_append").marker.color == qkv and d.gantt_trace("qkv_rope_append").showlegend
    assert d.gantt_trace(MLP, wait=True).name == D.WAIT_TRACE
    for tr in g.data[1:]:                 # a legend entry's one point lies outside the chart, so it is never drawn
        assert list(tr.y) == [-1e6] and not (g.layout.yaxis.range[1] <= -1e6 <= g.layout.yaxis.range[0])
    assert not d.gantt_trace("embedding").showlegend              # the embedding alone: step 0 only
    assert d.gantt_trace(SLOT0).showlegend and d.gantt_trace(SLOT0).marker.color == D.COLORS["sampling"]
    # the grid's row: every slot of the step, in order, end to end over the step's span
    c = d.gantt_cells
    grid = c["shown"]["name"][c["index"][0]]
    names = [c["names"][i] for i in dict.fromkeys(grid.tolist()) if c["names"][i]]
    assert names == [label + (f" layer {layer}" if layer >= 0 else "") for label, layer in slot_names(CFG)]
    assert "Token 2" in g.layout.title.text
    d.step_slider.value = 0
    assert d.gantt_trace("embedding").showlegend and not d.gantt_trace(SLOT0).showlegend
    z, colour = _cells(d)[0], _cells(d)[4]
    assert d.gantt_names()[3, 0] == "embedding" and colour(z[3, 0]) == D.COLORS["embedding"]   # block 3: 300 ns
    c = d.gantt_cells
    assert c["names"][c["shown"]["name"][c["index"][0, 0]]] == "embedding"       # the grid's first slot


def test_gantt_cells_keep_what_is_shorter_than_a_bin():
    """A cell shows the interval over its centre; one shorter than a bin (over no centre) takes the cell of its
    midpoint, the shortest winning."""
    work = {"a": (np.array([0, 1]), np.array([0.0, 0.0]), np.array([10.0, 10.2]), np.array([0, 0])),
            "b": (np.array([0, 1]), np.array([10.3, 10.5]), np.array([9.7, 9.5]), np.array([0, 0]))}
    wait = (np.array([0, 1]), np.array([10.0, 10.2]), np.array([0.3, 0.3]), np.array(["a", "a"]),
            np.array([0, 0]))
    c = D.gantt_cells({"work": work, "wait": wait}, ["a", "b"], [0, 1], 20.0, n_bins=20)
    assert c["dx"] == 1.0
    assert list(c["z"][0]) == [1] * 10 + [0] + [2] * 9        # the 0.3 µs wait over no centre: its own cell
    assert list(c["z"][1]) == [1] * 10 + [0] + [2] * 9        # over a centre (10.5): the cell is the wait's
    assert c["text"][0, 10] == "wait at a layer 0" and c["text"][0, 3] == "a layer 0"
    assert [c["start"][0, 10], c["length"][0, 10]] == pytest.approx([10.0, 0.3])
    tiny = dict(work, c=(np.array([0]), np.array([3.2]), np.array([0.1]), np.array([-1])))
    c = D.gantt_cells({"work": tiny, "wait": wait}, ["a", "b", "c"], [0, 1], 20.0, n_bins=20)
    assert c["z"][0, 3] == 3 and c["text"][0, 3] == "c"       # 0.1 µs inside a's 10 µs still shows
    assert np.isnan(D.gantt_cells({"work": {}, "wait": tuple(np.zeros(0) for _ in range(5))}, ["a"], [0], 0.0,
                                  n_bins=4)["z"]).all()


def test_gantt_hover_shows_the_length():
    """A bar with a base: plotly's %{x} is where it ends (a 3.7 µs wait read "305.06 µs from 301.38 µs"). The hover
    text of a cell gives the length and start of the interval it shows (the grid's row its end too), made in the page
    from the table of the intervals shown (figure_widget), which goes with the token: nothing is sent a cell but the
    index into it, and the transparent heatmap that carries the hover never changes from step to step."""
    d = D.Dashboard(CFG, source="synthetic")
    d.update_timing(synthetic())
    g = d.figures["gantt"]
    h = d.gantt_heatmap
    assert h.hovertemplate.startswith("%{_cellhover}") and h.meta == {"hover": "cells"}
    assert h.hovertext is None and h.customdata is None and h.text is None
    for tr in g.data[1:]:                                                    # legend entries: no hover of their own
        assert tr.hoverinfo == "skip"
    hover = g._hover_cells
    index = D.from_typed_array(hover["index"])
    assert index.dtype == np.uint16 and index.shape == d.gantt_cells["z"].shape == (1 + 4, D.GANTT_BINS)
    shown = {k: D.from_typed_array(hover[k]) for k in ("name", "start", "length")}
    n = shown["name"].size                                                   # the intervals shown, and nothing
    assert set(range(n - 1)) <= set(np.unique(index)) <= set(range(n))
    assert shown["name"][-1] == len(hover["names"]) - 1 and np.isnan(shown["start"][-1])
    assert len(hover["names"]) < 100 and hover["names"][-1] == ""
    assert set(range(len(hover["names"]) - 1)) <= set(shown["name"][index].ravel())     # no name unused but ""
    assert hover["ends"] == [True] + [False] * 4                             # the grid's row gives the end
    # a wait's cell: its length, not where it ends
    d.step_slider.value = 2
    iv, t = T.intervals(synthetic()), synthetic()
    t0 = int(t[1, -1, :, 1].max())
    a, l0 = (iv.arrive[2, 1, 0] - t0) / 1e3, (iv.leave[2, 1, 0] - t0) / 1e3
    _, start, length, _ = _cell_of(d, 0, a, l0)
    assert [start, length] == pytest.approx([a, l0 - a], abs=1e-3) and length < l0


def test_figures_share_one_plotly_module():
    """Every figure's module is the small loader and plotly's module one plain trait: anywidget imports each model's
    module apart, and five 5 MB imports at once on a page reload ran past its 2 s a model."""
    import plotly.graph_objects as go
    d = D.Dashboard(CFG, source="synthetic")
    plotly_module = str(go.FigureWidget._esm)
    for fig in [*d.figures.values(), d.ab.fig]:
        state = fig.get_state()
        assert len(state["_esm"]) < 10_000 and "import(url)" in state["_esm"]
        assert state["_plotly_module"] == plotly_module and len(plotly_module) > 1_000_000


def _hover_texts(fig_json: str, points: list[str], cells: dict | None = None) -> list[str]:
    """The hover label plotly.js draws for each hover (the JS argument of Plotly.Fx.hover) of a figure, in
    headless Chromium; `cells`: the Gantt chart's hover table (its widget's _hover_cells), as the page gets it."""
    sync_api = pytest.importorskip("playwright.sync_api")
    import plotly
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM}")
    from workbench.ui.figure_widget import LOADER
    js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text()
    # the cells' names filled in as the widget's loader does it in JupyterLab, by its own code
    page = ("<html><body><div id='g'></div><script>" + js + "</script><script>var f = " + fig_json
            + "; var cells = " + json.dumps(cells) + "; var loader = " + json.dumps(LOADER % {"hash": "test"})
            + ";</script><script type='module'>"
            "const m = await import(URL.createObjectURL(new Blob([loader], {type: 'text/javascript'})));"
            "await Plotly.newPlot('g', f.data, f.layout); m.attach(document.getElementById('g'), () => cells);"
            "window.__wb_ready = true;</script></body></html>")
    out = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            pg = browser.new_page()
            pg.set_content(page)
            pg.wait_for_function("window.__wb_ready === true")
            for point in points:
                pg.evaluate("Plotly.Fx.unhover('g')")
                pg.wait_for_timeout(100)                        # plotly.js drops hovers closer than 50 ms apart
                pg.evaluate(f"Plotly.Fx.hover('g', {point})")
                out.append(pg.evaluate("Array.from(document.querySelectorAll('#g .hovertext'))"
                                       ".map(e => e.textContent).join(' | ')"))
        finally:
            browser.close()
    return out


def test_gantt_hover_in_a_browser():
    """What plotly.js itself shows when hovering a wait cell, a work cell and the grid's row: the block, stage and
    layer (the cell's name, made in the page from the hover table), the length, then where it starts (and for the
    grid, its slot, layer and end)."""
    import plotly.io as pio
    t = synthetic()
    d = D.Dashboard(CFG, source="synthetic")
    d.update_timing(t)
    d.step_slider.value = 2
    g = d.figures["gantt"]
    iv = T.intervals(t)
    t0 = int(t[1, -1, :, 1].max())
    k, b = layer_slot(MLP, 1), 2
    s0, a, l0 = ((x[2, k, b] - t0) / 1e3 for x in (iv.start, iv.arrive, iv.leave))
    c = d.gantt_cells                                       # the grid's qkv slot of layer 0: where its cells are
    grid = c["shown"]["name"][c["index"][0]]
    j = int(np.flatnonzero(np.array(c["names"], dtype=object)[grid] == "qkv_rope_append layer 0").mean())
    i = c["index"][0, j]
    start, length = float(c["shown"]["start"][i]), float(c["shown"]["length"][i])
    texts = _hover_texts(pio.to_json(g), [f"{{xval: {(a + l0) / 2}, yval: {b}}}", f"{{xval: {(s0 + a) / 2}, yval: {b}}}",
                                          f"{{xval: {start + length / 2}, yval: {D.GRID_Y}}}"], g._hover_cells)
    assert f"block {b}: wait at {MLP} layer 1" in texts[0] and f"{l0 - a:.2f} µs, from {a:.2f} µs" in texts[0]
    assert f"block {b}: {MLP} layer 1" in texts[1] and f"{a - s0:.2f} µs, from {s0:.2f} µs" in texts[1]
    assert "grid: qkv_rope_append layer 0" in texts[2], texts[2]
    assert f"{length:.2f} µs, from {start:.2f} µs to {start + length:.2f} µs" in texts[2], texts[2]


def test_partial_snapshots_as_while_the_kernel_runs():
    """Feed snapshots that fill up slot by slot; every call must work and the end equals the full run."""
    full = synthetic()
    d = D.Dashboard(CFG, roofline_tbps=2.0, source="live on Test GPU")
    n_steps, n_slots = full.shape[:2]
    order = [(s, k) for s in range(n_steps) for k in range(n_slots)]
    seen = []
    snap = np.zeros_like(full)
    assert d.update_timing(snap, CFG, progress=0) == 0
    assert d.rows == [] and len(d.figures["stages"].data[0].x) == 0
    for i, (s, k) in enumerate(order):
        snap[s, k, :, 0] = full[s, k, :, 0]                     # arrivals first ...
        d.update_timing(snap, CFG, progress=s)
        snap[s, k, :, 1] = full[s, k, :, 1]                     # ... then the barrier lets go
        seen.append(d.update_timing(snap, CFG, progress=s))
        if s == 2 and k == layer_slot("qkv_rope_append", 1):         # step 2 has just run qkv of both layers
            assert d.n_complete == 2 and d.step_slider.max == 2     # the step being written is on show
            g = d.figures["gantt"]
            z = _cells(d)[0]
            qkv = 1 + d._gantt_labels.index("qkv_rope_append")
            assert ((z == qkv).sum(axis=1) > 0).all()                    # on every block
            assert np.isnan(z).any()                                    # the rest of the step: not yet
            assert "being written" in g.layout.title.text
            assert "kernel at step 2" in d.header.value
    assert seen == sorted(seen) and seen[-1] == n_steps
    ref = D.Dashboard(CFG, roofline_tbps=2.0, source="x")
    ref.update_timing(full, CFG)
    assert list(d.figures["stages"].data[0].y) == pytest.approx(list(ref.figures["stages"].data[0].y))
    assert d.update_timing(None) == n_steps                     # a non-timing build's snapshot: nothing changes
    with pytest.raises(ValueError, match="do not fit"):
        d.update_timing(np.zeros((2, 7, 4, 2), np.uint64), CFG)


def test_poller_reads_snapshots():
    full = synthetic()

    class FakeKernel:
        cfg = CFG
        calls = 0

        def timing_snapshot(self):
            FakeKernel.calls += 1
            s = np.zeros_like(full)
            s[:FakeKernel.calls] = full[:FakeKernel.calls]
            return s

    d = D.Dashboard(CFG, source="live")
    poll = d.poller(pos0=7, every_s=0.0)
    mk = FakeKernel()
    for i in range(3):
        poll(mk, i)
    assert d.n_complete == 3 and d.pos0 == 7 and d.progress == 2
    slow = d.poller(every_s=3600)
    slow(mk, 9)
    slow(mk, 10)                                                # throttled: one snapshot, not two
    assert FakeKernel.calls == 4


def test_step_slider_stays_where_the_user_put_it():
    full = synthetic()
    d = D.Dashboard(CFG, source="live")
    part = full.copy()
    part[3:] = 0
    d.update_timing(part, CFG)
    assert d.step_slider.value == 2
    d.step_slider.value = 1
    d.update_timing(full, CFG)
    assert d.step_slider.value == 1 and d.step_slider.max == 4
    d.step_slider.value = 4                                     # back at the newest: follow again
    d.update_timing(synthetic(t0=T0 * 2), CFG)                  # a new run
    assert d.step_slider.value == 4


# -- the dashboard: recorded ----------------------------------------------------------------------------------------

def test_dashboard_from_the_recorded_trace():
    d = D.Dashboard.from_trace(T.recorded_path(0))
    title = RECORDED_TITLE
    assert d.title == title and title in d.header.value
    for name, fig in d.figures.items():
        assert title in fig.layout.title.text, name
    rows = T.load_recorded(0).stage_table()
    assert list(d.figures["stages"].data[0].y) == pytest.approx([r.us_per_token for r in rows])
    assert d.figures["bandwidth"].layout.shapes[0].y0 == pytest.approx(4.4371, abs=1e-4)
    assert "1,226 tok/s" in d.header.value and "4.44 TB/s" in d.header.value
    g = d.figures["gantt"]
    n_slots = schedule.n_slots(PRESETS["llama-3.2-1b"])
    z = _cells(d)[0]
    assert z.shape == (132, D.GANTT_BINS) and ((z == 0).sum(axis=1) > 0).all()   # every block waits
    assert not np.isnan(z[:, :-20]).any()
    assert list(d.gantt_heatmap.y) == [D.GRID_Y, *range(d.stamps.shape[2])]      # the grid, then every block
    c = d.gantt_cells                                                   # the grid's row: every slot of the step
    assert len({i for i in c["shown"]["name"][c["index"][0]].tolist() if c["names"][i]}) == n_slots
    toks = d.figures["tok_s"].data[0].y
    assert len(toks) == 17 and 1200 < np.median(toks) < 1300
    kids = d.widget.children
    assert d.header in kids and d.figures["gantt"] in kids
    assert d.panel("gantt").children[1] is g and d.panel("history") is d.history.widget
    with pytest.raises(KeyError):
        d.panel("nope")


def test_bars_above_the_roofline_are_marked_and_explained():
    """A stage read faster than the same run's streaming read (the recording of 44eafba had lm_head at 101%; the one
    of 1150903 at 97.5%, so a roofline just under lm_head's rate stands in for such a run): its bar says so with a
    †, and a note on the chart says why a stage can (what the text tables' footnote says)."""
    d = D.Dashboard.from_trace(T.recorded_path(0))
    bw = d.figures["bandwidth"]
    assert not any(t.endswith("†") for t in bw.data[0].text)            # the recording as measured: none above
    roof = 0.99 * max(bw.data[0].y)                                       # lm_head's rate, just above the roof
    d.update_timing(d.stamps, roofline_tbps=roof)
    marked = [t.endswith("†") for t in bw.data[0].text]
    assert marked == [y > roof for y in bw.data[0].y] and any(marked) and not all(marked)
    note = [a for a in bw.layout.annotations if a.name == "roof-note"]
    assert len(note) == 1 and note[0].text.startswith("†") and "L2" in note[0].text
    assert bw.layout.yaxis.range[1] > max(bw.data[0].y)                 # the marked bar is not cut off
    d.update_timing(d.stamps, roofline_tbps=roof * 2)                   # none above: no note
    assert not any(t.endswith("†") for t in bw.data[0].text)
    assert not [a for a in bw.layout.annotations if a.name == "roof-note"]


def test_titles_below_the_modebar_and_the_ab_legend_beside_the_bars():
    """plotly's modebar sits in the top ~25 px at the right: every title starts below it; the A/B legend sits
    right of the plot, where it covered the stage names when below it. (The browser test checks the boxes.)"""
    d = D.Dashboard.from_trace(T.recorded_path(0))
    for fig in [*d.figures.values(), d.ab.fig]:
        t = fig.layout.title
        below = (1 - t.y) * fig.layout.height                               # px from the figure's top
        assert (t.yref, t.yanchor) == ("container", "top") and below == pytest.approx(D.MODEBAR_PX)
        assert fig.layout.margin.t >= below + 55 - 16                       # two lines of title between
    leg = d.ab.fig.layout.legend
    assert leg.x >= 1 and leg.xanchor == "left" and d.ab.fig.layout.margin.r >= 120


def test_a_reloaded_page_starts_from_the_figure_as_it_is_now(monkeypatch):
    """A page loaded later (a browser reload) starts each figure from its _widget_data and _widget_layout, which
    plotly sets only on display: they follow every update, without sending the figure again."""
    d = D.Dashboard.from_trace(T.recorded_path(0))
    d.widget                                                             # displayed: the state as shown now
    g = d.figures["gantt"]
    sent = []
    monkeypatch.setattr(g, "_send", lambda msg, buffers=None: sent.append(msg), raising=False)
    d.step_slider.value = 3
    state = g.get_state()
    assert state["_widget_layout"]["title"]["text"].startswith("Token 3 ")
    assert state["_widget_layout"]["images"][0]["source"] == g.layout.images[0].source
    keys = {k for m in sent for k in m.get("state", {})}
    assert "_py2js_update" in keys and not keys & {"_widget_data", "_widget_layout"}   # open views: the update only
    ab = d.ab.set(T.recorded_path(0), T.recorded_path(3700))
    assert ab.fig.get_state()["_widget_layout"]["title"]["text"].startswith("A/B per stage")


def test_a_recorded_run_shows_one_tok_s_on_every_panel():
    """The header gives the run's measured tok/s; the stages chart names the same figure (its µs are the stages'
    sum, which leaves out the time outside the stamped steps), and the A/B of two runs speaks in µs: no second tok/s
    for a run anywhere on the dashboard."""
    d = D.Dashboard.from_trace(T.recorded_path(0))
    d.compare(T.recorded_path(0), T.recorded_path(3700))
    texts = [d.header.value, d.ab.table.value] + [f.layout.title.text for f in d.figures.values()] + \
        [d.ab.fig.layout.title.text]
    figures = {m for t in texts for m in re.findall(r"([\d,]+) tok/s", t)}
    assert figures == {"1,226"}, figures
    stages = d.figures["stages"].layout.title.text
    assert "µs (run: 1,226 tok/s)" in stages
    assert "µs a token" in d.ab.fig.layout.title.text


def test_save_from_the_dashboard(tmp_path):
    d = D.Dashboard(CFG, roofline_tbps=2.0, source="live on Test GPU")
    with pytest.raises(ValueError):
        d.save_trace(tmp_path / "none.npz")
    d.update_timing(synthetic(), CFG, pos0=5, tok_s=100.0)
    p = d.save_trace(tmp_path / "live.npz", device="Test GPU", commit="abc", note="kept")
    tr = T.load_trace(p)
    assert tr.meta["note"] == "kept" and tr.pos0 == 5 and tr.roofline_tbps == 2.0 and tr.recorded
    again = D.Dashboard.from_trace(p)
    assert again.title == f"recorded on Test GPU, {tr.meta['date']}, commit abc"


# -- history --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Rec:
    section: str | None
    variant: str | None
    compile_s: float | None
    passed: bool | None
    tok_per_s: float | None


def test_history_records():
    d = D.Dashboard(CFG, source="x")
    assert "no reloads yet" in d.history.widget.value
    r1 = Rec("gate_up_silu", None, 1.234, True, 1071.4)
    assert isinstance(r1, D.HistoryRecord)
    d.add_record(r1)
    d.add_record(Rec("qkv_rope_append", "split", 1.5, False, None))
    d.add_record({"section": "lm_head", "compile_s": float("nan"), "passed": None, "status": "compile error",
                  "error": "kernels/sections/lm_head.cuh:12: error: expected a \";\"\n   12 | x"})
    d.add_record({"sections": ["a", "b"], "verified": "skipped", "tok_s": 900, "time": 0,
                  "variants": (("qkv_rope_append", "split"), ("lm_head", "wide"))})
    rows = d.history.rows
    assert rows[0] == {"time": "", "section": "gate_up_silu", "variant": "—", "compile_s": 1.234,
                       "verdict_s": None, "verified": "PASS", "tok_s": 1071.4, "error": ""}
    assert rows[1]["variant"] == "split" and rows[1]["verified"] == "FAIL" and rows[1]["tok_s"] is None
    assert rows[2]["compile_s"] is None and rows[2]["verified"] == "compile error"
    assert rows[2]["error"].startswith("kernels/sections/lm_head.cuh:12")
    assert rows[3]["section"] == "a, b" and rows[3]["variant"] == "qkv_rope_append@split, lm_head@wide"
    assert rows[3]["verified"] == "skipped" and rows[3]["tok_s"] == 900.0 and rows[3]["time"]
    html = d.history.widget.value
    assert html.count("<tr>") == 1 + 4 and "1,071" in html and "1.23 s" in html and "PASS" in html
    assert "&quot;;&quot;" in html or "&quot;" in html                       # escaped
    d.add_record({"section": "lm_head", "compile_s": 0.8, "verdict_s": 0.85, "passed": True})
    assert d.history.rows[-1]["verdict_s"] == 0.85 and "0.85 s" in d.history.widget.value
    d.history.clear()
    assert "no reloads yet" in d.history.widget.value


def test_history_reads_session_records():
    session = pytest.importorskip("workbench.loop.session")
    rec = session.ReloadRecord(time=1.7e9, trigger="edit", section="lm_head", variant=None,
                               variants=(("qkv_rope_append", "split"),), status="ok", compile_s=2.5, passed=True,
                               tok_per_s=1065.0)
    assert isinstance(rec, D.HistoryRecord)
    row = D.record_row(rec)
    assert (row["section"], row["variant"], row["compile_s"], row["verified"], row["tok_s"]) == \
        ("lm_head", "qkv_rope_append@split", 2.5, "PASS", 1065.0)
    nogpu = session.ReloadRecord(time=1.7e9, trigger="magic", section="lm_head", variant=None, variants=(),
                                 status=session.NO_GPU, compile_s=1.0)
    row = D.record_row(nogpu)
    assert row["verified"] == session.NO_GPU and row["tok_s"] is None and row["compile_s"] == 1.0


def test_follow_a_workbench():
    full = synthetic()

    class FakeWorkbench:
        cfg = CFG
        stamps = full                   # Workbench.stamps: the last timed run's, from wherever it ran

        def __init__(self):
            self.history = [Rec(None, None, 1.0, True, 1200.0)]
            self.on_record = []

    wb = FakeWorkbench()
    d = D.Dashboard(source="live")
    cb = d.follow(wb)
    assert wb.on_record == [cb] and len(d.history.rows) == 1 and d.n_complete == 5
    cb(Rec("lm_head", None, 0.5, True, 1300.0))
    assert len(d.history.rows) == 2 and d.tok_s == 1300.0


# -- A/B ------------------------------------------------------------------------------------------------------------

def test_ab_rows_and_view_synthetic():
    a = synthetic()
    attn = [schedule.barrier_slot(CFG, "attention_decode", l) for l in range(CFG.n_layers)]
    assert attn == [layer_slot("attention_decode", l) for l in range(CFG.n_layers)] == [2, 6]
    b = synthetic(work_scale=lambda k: 3 if k in attn else 1)        # attention three times the work
    view = D.ABView((a, CFG, 0), (b, CFG, 0), labels=("base", "slow attention"))
    rows = {r["stage"]: r for r in view.rows}
    attn_extra = 2 * sum(1000 * (k + 1) for k in attn) / 1e3
    assert rows["attention_decode"]["delta_us"] == pytest.approx(attn_extra)
    assert rows[MLP]["delta_us"] == pytest.approx(0.0, abs=1e-9)
    assert rows["total"]["delta_us"] == pytest.approx(attn_extra)
    assert rows["total"]["a_tok_s"] == pytest.approx(1e9 / STEP_NS)
    fa, fb = view.fig.data
    assert (fa.name, fb.name) == ("base", "slow attention")
    labels = slot_labels(CFG)
    assert list(fa.x) == list(fb.x) == labels
    assert fb.y[labels.index("attention_decode")] - fa.y[labels.index("attention_decode")] == \
        pytest.approx(attn_extra)
    assert "slow attention" in view.table.value and f"+{attn_extra:.1f} µs" in view.table.value


def test_ab_of_the_recorded_traces():
    d = D.Dashboard.from_trace(T.recorded_path(3700))
    assert d.ab.widget.layout.display == "none"
    view = d.compare(T.recorded_path(0), T.load_recorded(3700))
    assert d.ab.widget.layout.display is None
    rows = {r["stage"]: r for r in view.rows}
    assert rows["attention_decode"]["delta_us"] == pytest.approx(94, abs=5)
    assert abs(rows[MLP]["delta_pct"]) < 3
    assert view.labels == ("llama-3.2-1b pos 0", "llama-3.2-1b pos 3,700")
    assert RECORDED_TITLE in view.fig.layout.title.text
    with pytest.raises(TypeError):
        D.ABView([1, 2], [3, 4])
    assert math.isfinite(rows["total"]["b_tok_s"])


def test_ab_from_an_ab_record():
    a, b = T.load_recorded(0).stage_table(), T.load_recorded(3700).stage_table()

    @dataclasses.dataclass
    class ABRec:
        a: tuple
        b: tuple
        a_timing: list | None
        b_timing: list | None

    d = D.Dashboard(CFG, source="x")
    view = d.compare(ABRec((), (("attention_decode", "split"),), a, b))
    assert view.labels == ("base sections", "attention_decode@split")
    assert view.rows[-1]["delta_us"] == pytest.approx(sum(r.us_per_token for r in b) - sum(r.us_per_token for r in a))
    with pytest.raises(ValueError, match="no timing"):
        D.ABView(ABRec((), (), None, None))


def test_blocks_panel_shows_a_hang_from_its_record():
    """A record of a hang brings every block's state (ReloadRecord.blocks, made by the worker from the where-words
    the kernel writes into mapped memory): the blocks panel appears, the block that stopped inside its stage is
    the one outlined, the waiting ones are grey, and its hover text says where it was."""
    from workbench.loop.records import ReloadRecord
    from workbench.run.worker import block_states

    attn = plan.STAGE_NAMES.index("attention_decode")
    words = np.array([abi.where(attn, 5, 17, waiting=True)] * 132, np.uint32).view(np.int32)
    words[7] = abi.where(attn, 5, 17)                               # block 7 never left attention at layer 5
    words[131] = 0                                                     # one block never started
    blocks = block_states(words, words.copy(), 132)
    d = D.Dashboard(CFG, source="x")
    assert d.blocks.widget.layout.display == "none"
    rec = ReloadRecord(time=0.0, trigger="edit", section="attention_decode", variant=None, variants=(), status="hang",
                       blocks=blocks, error="no progress for 2.0 s")
    d.add_record(rec)
    assert d.blocks.widget.layout.display is None
    cells = d.blocks.cells
    assert [c["block"] for c in cells if c["suspect"]] == [7]
    assert cells[7]["text"] == "block 7: in attention_decode of layer 5 at step 17 (stopped moving)"
    assert cells[7]["colour"] == D.COLORS["attention_decode"]
    assert cells[0]["colour"] == D.WAIT_COLOR and cells[0]["short"] == "w"
    assert cells[131]["text"] == "block 131: never started"
    page = d.panel("blocks").value
    assert "130 waiting at the barrier, 1 stopped inside their stage" in page
    assert "hang, reload 1: attention_decode" in page
    assert page.count("<td ") == 132 and page.count("#cf222e") >= 1


def test_blocks_panel_takes_mappings_and_ignores_records_without_blocks():
    d = D.Dashboard(CFG, source="x")
    d.add_record({"section": "lm_head", "compile_s": 1.0, "passed": True, "tok_s": 1000.0})
    assert d.blocks.widget.layout.display == "none"
    cells = d.show_blocks([{"block": 0, "stage": "lm_head", "layer": -1, "step": 3, "waiting": False, "moved": True}])
    assert cells[0]["text"] == "block 0: in lm_head at step 3" and not cells[0]["suspect"]

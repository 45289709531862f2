"""The per-stage timing table adds up: on every row work + wait + skew is the µs per token, the rows add up to the
token's total, and a run shows one tok/s (the table's, or the run's own with the time outside the stamped steps
named). Checked on the recorded H200 traces, in the numbers and in the printed text."""
from __future__ import annotations

import re

import numpy as np
import pytest

from workbench.measure import timing
from workbench.measure import trace as T


@pytest.fixture(params=sorted(T.RECORDED), ids=lambda p: f"pos{p}")
def recorded(request):
    return T.load_recorded(request.param)


def test_work_wait_and_skew_make_each_row(recorded):
    rows = recorded.stage_table()
    assert rows
    for r in rows:
        assert r.work_us + r.wait_us + r.skew_us == pytest.approx(r.us_per_token, abs=1e-9), r.stage
    steps = T.step_ns(recorded.stamps)[1:] / 1e3               # the table skips the first step
    assert sum(r.us_per_token for r in rows) == pytest.approx(float(steps.mean()), rel=1e-12)
    # over a whole step the skews telescope: each barrier's lag is the next slot's head start
    assert abs(sum(r.skew_us for r in rows)) < 0.5


def _cells(text: str) -> tuple[dict, str]:
    """{stage: [µs/token, work, wait, skew]} as printed, and the total line."""
    lines = text.splitlines()
    head = lines[0].split()
    assert head[:1] == ["stage"] and "skew" in head
    rows, total = {}, None
    for line in lines[1:]:
        if line.startswith("total"):
            total = line
            break
        stage, us, _spread, work, wait, skew = line.split()[:6]
        rows[stage] = [float(us), float(work), float(wait), float(skew)]
    return rows, total


def test_the_printed_table_adds_up_to_rounding(recorded):
    text = timing.format_table(recorded.stage_table(), recorded.roofline_tbps)
    rows, total = _cells(text)
    assert rows
    for stage, (us, work, wait, skew) in rows.items():
        assert abs(work + wait + skew - us) <= 0.15 + 1e-9, f"{stage}: {work} + {wait} + {skew} ≠ {us}"
    printed_total = float(total.split()[1])
    assert abs(sum(r[0] for r in rows.values()) - printed_total) <= 0.05 * len(rows) + 1e-9
    assert len(re.findall(r"tok/s", text)) == 1
    assert f"{1e6 / printed_total:,.0f} tok/s" in total


def test_a_runs_own_tok_s_is_the_one_figure_and_the_rest_is_named(recorded):
    rows = recorded.stage_table()
    text = timing.format_table(rows, recorded.roofline_tbps, recorded.tok_s)
    figures = re.findall(r"([\d,]+) tok/s", text)
    assert figures == [f"{recorded.tok_s:,.0f}"]                # one tok/s, the run's
    lines = {line[:17]: line for line in text.splitlines()}
    steps = float(lines["total (the steps)"].split()[3])
    outside = float(lines["outside the steps"].split()[3])
    run = float(lines["the run          "].split()[2])
    assert steps + outside == pytest.approx(run, abs=1e-6)       # as printed
    assert run == pytest.approx(1e6 / recorded.tok_s, abs=0.05)


def test_above_the_roofline_is_explained_and_only_then(recorded):
    rows = recorded.stage_table()
    top = max(r.tbps for r in rows)
    over = timing.format_table(rows, top / 1.05)                 # the fastest stage at 105% of this roofline
    assert "105.0*" in over and "above 100% of the roofline" in over and "L2" in over
    under = timing.format_table(rows, top * 1.5)
    assert "*" not in under and "above 100%" not in under


def test_signed_never_prints_minus_zero():
    assert timing._signed(-0.04, 6) == "   0.0"
    assert timing._signed(0.04, 6) == "   0.0"
    assert timing._signed(-0.06, 6) == "  -0.1"
    assert timing._signed(2.34, 6) == "  +2.3"


def test_synthetic_rows_reconcile_when_blocks_leave_apart():
    """Blocks leaving a barrier at different times (a slow release) give a skew; still work + wait + skew = span."""
    from workbench.model.config import get_config
    cfg = get_config("tiny")
    S, G, n = len(timing.slot_names(cfg)), 4, 5
    rng = np.random.default_rng(1)
    t = np.zeros((n, S, G, 2), np.uint64)
    now = 1_000_000
    for i in range(n):
        for s in range(S):
            arrive = now + rng.integers(200, 900, G)
            release = arrive.max() + 300
            leave = release - rng.integers(0, 250, G)
            leave[rng.integers(G)] = release
            t[i, s, :, 0], t[i, s, :, 1] = arrive, leave
            now = int(release)
    rows = timing.stage_table(cfg, t)
    assert any(abs(r.skew_us) > 1e-3 for r in rows)
    for r in rows:
        assert r.work_us + r.wait_us + r.skew_us == pytest.approx(r.us_per_token, abs=1e-9)

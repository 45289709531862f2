"""The A/B text tables, on constructed results: columns that line up whatever the names, no "-0%" (a change that
rounds to nothing prints unsigned), and no raw dict or tuple in a cell."""
from __future__ import annotations

import re

from workbench.loop.records import ABRecord
from workbench.measure.bench import format_ab
from workbench.measure.timing import StageRow, barrier_cost, format_barrier, signed
from workbench.measure import trace as T


def _row(stage, us):
    return StageRow(stage, us, (us - 1, us + 1), us / 2, us / 2, 1000, 1.0)


def _record(a_tok_s=1000.0, b_tok_s=999.9):
    a = [_row("qkv_rope_append", 65.3), _row("gate_up_silu+down_residual", 416.3), _row("lm_head", 118.5)]
    b = [_row("qkv_rope_append", 65.31), _row("gate_up_silu+down_residual", 410.0)]
    return ABRecord((), (("attention_decode", "split"),), a_tok_s, b_tok_s, [a_tok_s], [b_tok_s], True, True,
                    None, None, a, b)


def _no_raw(text):
    assert not re.search(r"[{}]|\(\(|\[\(", text), text


def test_signed_has_no_minus_zero():
    assert signed(-0.04) == "0.0" and signed(0.04) == "0.0" and signed(-0.4, 0, "%") == "0%"
    assert signed(-0.6, 0, "%") == "-1%" and signed(2.0, 0, "%") == "+2%" and signed(float("nan")) == "—"


def test_ab_record_report_lines_up_and_never_prints_minus_zero():
    text = _record().report()
    assert "-0%" not in text and "-0.0%" not in text and "+-" not in text
    assert "B/A: 1.000× (0.0%)" in text
    _no_raw(text)
    table = [line for line in text.splitlines() if line.startswith("  ")]
    assert table[0].split()[:1] == ["stage"] and len(table) == 4
    # every column ends where the header's does
    ends = [m.end() for m in re.finditer(r"[AB] µs/token|B − A|%", table[0])]
    assert len(ends) == 4
    for line in table[1:]:
        assert [m.end() for m in re.finditer(r"\S+", line)][-4:] == ends, line
    qkv = next(line for line in table if "qkv_rope_append" in line)
    assert qkv.split()[-2:] == ["0.0", "0%"]                    # +0.01 µs: no sign, no "-0%"
    mlp = next(line for line in table if "gate_up" in line)
    assert mlp.split()[-2:] == ["-6.3", "-2%"]
    lm = next(line for line in table if "lm_head" in line)
    assert lm.split()[-3:] == ["—", "—", "—"]                  # a stage only A has


def test_ab_summary_lines_up_with_no_raw_cells():
    results = {"base": {"passed": True, "tok_s@0": 1275.2, "tok_s@3700": 1139.7,
                        "resources": {"registers": 119, "local_bytes": 0}},
               "a_much_longer_name": {"passed": False, "tok_s@0": 1275.0, "tok_s@3700": 1150.1,
                                      "resources": {"registers": 128, "local_bytes": 16}},
               "broken": {"passed": False, "resources": {}}}
    text = format_ab(results, [0, 3700])
    _no_raw(text)
    assert "-0%" not in text and "-0.0%" not in text
    lines = text.splitlines()
    # the numbers' columns are right-aligned under their headers (name and verdict are left-aligned)
    ends = [m.end() for m in re.finditer(r"\S+(?: @\d+| B| first)?", lines[0])][2:]
    for line in lines[1:]:
        assert [m.end() for m in re.finditer(r"\S+", line)][2:] == ends, line
    assert lines[2].split() == ["a_much_longer_name", "FAIL", "1,275", "0.0%", "1,150", "+0.9%", "128", "16"]
    assert lines[3].split() == ["broken", "FAIL", "—", "—", "—", "—", "—", "—"]


def test_the_barrier_line_is_words_not_a_dict():
    text = format_barrier(barrier_cost(T.load_recorded(0).stamps))
    _no_raw(text)
    assert text.startswith("barrier: the first block leaves ") and "66 barriers a token" in text


def test_ab_rows_as_text_line_up_with_dashes_for_a_missing_stage():
    from workbench.measure.timing import format_ab_rows
    nan = float("nan")
    rows = [{"stage": "qkv_rope_append", "a_us": 65.3, "b_us": 65.31, "delta_us": 0.01, "delta_pct": 0.015},
            {"stage": "gate_up_silu+down_residual", "a_us": 416.3, "b_us": 410.0, "delta_us": -6.3,
             "delta_pct": -1.5},
            {"stage": "new_stage", "a_us": nan, "b_us": 3.0, "delta_us": nan, "delta_pct": nan},
            {"stage": "total", "a_us": 481.6, "b_us": 478.31, "delta_us": -3.29, "delta_pct": -0.4,
             "a_tok_s": 2076.0, "b_tok_s": 2090.0}]
    text = format_ab_rows(rows)
    _no_raw(text)
    assert "-0%" not in text and "+0%" not in text
    lines = text.splitlines()
    ends = [m.end() for m in re.finditer(r"[AB] µs|B − A|%", lines[0])]
    for line in lines[1:]:
        assert [m.end() for m in re.finditer(r"\S+", line)][1:] == ends, line
    assert lines[1].split()[1:] == ["65.3", "65.3", "0.0", "0%"]
    assert lines[3].split()[1:] == ["—", "3.0", "—", "—"]
    assert lines[4].split()[1:] == ["481.6", "478.3", "-3.3", "0%"]

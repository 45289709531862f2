"""The bench's table without a GPU: its default positions, and both rooflines in every row of the table."""
from __future__ import annotations

from workbench.measure.bench import Row, bench_positions, format_rows


def test_default_positions_reach_16k_and_32k_for_the_1b():
    assert bench_positions("llama-3.2-1b") == (128, 4096, 16384, 32768)
    assert bench_positions("llama-3.1-8b") == (128, 4096, 16384)


def test_the_table_shows_both_rooflines():
    import dataclasses
    rows = [dataclasses.asdict(Row("monokernel", 32768, 1250.0, 800.0, (790.0, 805.0), 71.3, "", 44.6))]
    out = {"model": "llama-3.2-1b", "device": "H200", "tokens": 128, "repeats": 5, "roofline_tbps": 4.45,
           "rows": rows}
    text = format_rows(out)
    header, legend, line = text.splitlines()[1:4]
    assert " %roof " in header and " %w roof " in header
    assert "weights + KV-cache" in legend
    assert line.split()[:2] == ["monokernel", "32768"] and line.split()[-2:] == ["71.3", "44.6"]

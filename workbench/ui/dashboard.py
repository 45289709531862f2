"""Dashboards of the kernel's timing in Jupyter: ipywidgets and plotly FigureWidgets, live or from a recorded trace.

    dash = Dashboard.from_trace(workbench.trace.recorded_path(0))     # no GPU: a recording, titled as one
    dash.show()

    dash = Dashboard(mk.cfg, roofline_tbps=4.48, source="live on NVIDIA H200")   # on a GPU, while the kernel runs
    res = mk.generate(prompt, 64, timing_steps=64, on_poll=dash.poller(pos0=0))
    dash.update_timing(res.timing, mk.cfg, pos0=0, tok_s=res.tok_per_s)

Panels, each a FigureWidget (or an HTML table) the tests and notebooks can read back:
  stages     per-stage time per token (summed over layers), mean over tokens, p10–p90 as error bars; one bar per
             slot of the plan (a slot running several stages between two barriers is one bar, "a+b")
  bandwidth  achieved TB/s per stage (stage bytes / time) against the measured streaming-read roofline
  gantt      one token on every block: work (coloured by stage) and wait at the barrier (grey), one heatmap of
             GANTT_BINS time bins a block (gantt_cells: which interval a bin shows), under the grid's row of
             barrier-to-barrier bars with the stages labelled; a legend entry per colour
  tok_s      tok/s of every step of the run, against the roofline at that position
  history    one row per reload record (HistoryRecord; `follow(workbench)` feeds it): section, variant,
             compile time, verification, tok/s
  blocks     after a hang or a fault, every block's last state (in which stage of which layer and step, or
             waiting at the barrier after it; the blocks that stopped inside their stage outlined): shown when a
             record brings blocks, or by show_blocks(WorkerFailure.blocks)
  ab         two runs' per-stage times side by side, with the differences (also alone: ABView)

`update_timing` may be called again and again with a growing snapshot (`Monokernel.timing_snapshot()`: stamps not
yet written are 0); only complete steps enter the tables, and a step still being written shows in the Gantt chart
as far as it got.

Stage order, colours and short names come from `workbench.plan`: a stage's colour is PALETTE at its position in
plan.STAGE_NAMES, a slot of several stages takes its first stage's colour, and its short name joins theirs with "+".
"""
from __future__ import annotations

import base64
import html
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from .. import plan
from ..model.config import ModelConfig
from ..measure.timing import StageRow, first_step_label, label_stages, slot_names
from ..measure.trace import (Trace, complete_steps, intervals, load_trace, names_at, recording_meta, roofline_tok_s,
                             save_trace, slots_from_meta, source_title, stage_rows, step_ns)
from ..run.worker import BlockState
from .figure_widget import figure_widget
from .png import palette_png

# colours by the stage's position in the plan (category10 without its grey, which is the wait's)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#393b79")
UNKNOWN_COLOR = "#555555"         # a stage the plan does not know (an older trace's)
WAIT_COLOR = "#c8c8c8"
WAIT_TRACE = "wait at the barrier"
GRID_Y = -3                       # the Gantt chart's row of barrier-to-barrier spans, above block 0
GRID_HALF = 1.2                   # the grid row's half height, in block rows
GANTT_SIZE = (980, 800)           # the Gantt chart's width and height in pixels, and its margins: fixed (no
GANTT_MARGIN = dict(l=70, r=20, t=105, b=112, autoexpand=False)  # automargin, no legend pushing a margin), so
#                                 that the picture is drawn 1:1 on the plot area
GANTT_BINS = GANTT_SIZE[0] - GANTT_MARGIN["l"] - GANTT_MARGIN["r"]  # time bins a block: one a pixel of the plot area
GANTT_PLOT_PX = GANTT_SIZE[1] - GANTT_MARGIN["t"] - GANTT_MARGIN["b"]   # the plot area's height in pixels
# under the bandwidth chart's title when a stage is above 100% of the roofline (its bar's text marked †)
ROOF_NOTE_CHART = ("† above the roofline: that is a separate launch's streaming read, timed whole;<br>a stage is "
                   "timed between barriers, and may find some of its bytes in L2")
# The Gantt chart's hover (one cell of a transparent heatmap over the picture, the grid's row included): the row,
# the stage and layer, the length and start (and for the grid, the end) of the interval the cell shows, in µs from the
# token's start; made in the page from the figure's hover table (Dashboard._hover_cells, figure_widget.py) on the
# first hover of a token, not sent one string a cell (~120k a token).
GANTT_HOVER = "%{_cellhover}<extra></extra>"


def short_name(stage: str) -> str:
    """A stage's name for a narrow bar: its first word, with the words of one or two letters next to it
    (qkv_rope_append → qkv, o_proj_residual → o-proj, gate_up_silu → gate-up, lm_head → lm-head)."""
    words = stage.split("_")
    out = [words[0]]
    for w in words[1:]:
        if len(w) > 2 and len("-".join(out)) > 2:
            break
        out.append(w)
    return "-".join(out)


COLORS = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(plan.STAGE_NAMES)}
SHORT = {name: short_name(name) for name in plan.STAGE_NAMES}


def color_of(label: str) -> str:
    """A stage's or a slot's colour: that of its first stage."""
    return COLORS.get(label_stages(label)[0], UNKNOWN_COLOR)


def short_of(label: str) -> str:
    """A stage's or a slot's short name: its stages' short names joined with "+"."""
    return "+".join(SHORT.get(s, s) for s in label_stages(label))


def gantt_labels(names: list[tuple[str, int]], step0_label: str) -> list[str]:
    """The labels the Gantt chart draws, each once, in slot order (slot 0's label at step 0 just before its own)."""
    out = []
    for k, (label, _) in enumerate(names):
        out += ([step0_label] if k == 0 else []) + [label]
    return list(dict.fromkeys(out))


def _widgets():
    import ipywidgets
    return ipywidgets


def _synced(*figs):
    """Copy each FigureWidget's current traces and layout into the state its front end starts from. plotly does
    this when a figure is displayed by itself (_repr_mimebundle_); inside an ipywidgets container it does not, and
    the view then starts from the figure as it was created (styles set at creation were lost in the browser)."""
    for f in figs:
        f._repr_mimebundle_()
    return figs


MODEBAR_PX = 46


def title_below_modebar(height: int) -> dict:
    """A figure's title below plotly's modebar, which takes the top ~24 px at the right, where a centred or long
    title ran under it (title.pad did not move it). MODEBAR_PX is where the title's anchor goes; its box starts ~16 px
    above that (measured in Chromium: two lines, anchored at the top), so just under the modebar. The top margins
    make room for the two lines."""
    return dict(yref="container", y=1 - MODEBAR_PX / height, yanchor="top", x=0.02, xanchor="left")


def _keep_state(*figs):
    """Make the state a page loaded later (a browser reload) starts each FigureWidget from the figure as it is
    now. plotly sends every change as a one-off restyle or relayout message and sets the traits a new view starts
    from (_widget_data, _widget_layout) only when the figure is displayed, so a reloaded page drew the figure as first
    shown (the Gantt chart's first token, whatever the slider said). The traits are set without notifying: the
    views already open have the change, and sending the whole figure again would double the cost of every update.
    Copies of the dicts and lists, as plotly makes (it prunes _widget_layout in place when the browser reports
    layout defaults); the leaves are shared: plotly stores arrays read-only, and a deep copy of the Gantt chart's
    cell texts alone took ~50 ms."""
    for f in figs:
        f._trait_values["_widget_data"] = _tree_copy(f._data)
        f._trait_values["_widget_layout"] = _tree_copy(f._layout_obj._props)
    return figs


def _tree_copy(v):
    if isinstance(v, dict):
        return {k: _tree_copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and any(isinstance(x, dict) for x in v):
        return [_tree_copy(x) for x in v]
    return v                      # a leaf, or a list of values (a heatmap's z): plotly replaces those, never edits


# -- reload records ------------------------------------------------------------------------------------------------

@runtime_checkable
class HistoryRecord(Protocol):
    """What the history table reads off a reload record: workbench.session.ReloadRecord is one; so is any object
    (or mapping) with these fields. Optional, read when present: status (text shown when not verified), error and
    first_failure (the note), time (epoch seconds or a datetime), variants (all (section, variant) pairs in force).
    Other spellings accepted: verified for passed, tok_s for tok_per_s, compile_time_s / compile_time for
    compile_s."""
    section: str | None          # the section that was edited (None: a rebuild of everything)
    variant: str | None          # the variant of that section (None: the base file)
    compile_s: float | None      # seconds; None or nan: it did not compile (or did not get that far)
    passed: bool | None          # verification; None: not verified (no GPU, or no kernel)
    tok_per_s: float | None      # None: not timed


_ALIASES = {"section": ("section", "sections"),
            "variant": ("variants", "variant"),
            "compile_s": ("compile_s", "compile_time_s", "compile_time", "compile_seconds"),
            "verdict_s": ("verdict_s",),
            "passed": ("passed", "verified", "verification"),
            "status": ("status",),
            "tok_s": ("tok_per_s", "tok_s", "tokens_per_s"),
            "error": ("error", "first_failure", "message"),
            "time": ("time", "when", "timestamp")}


def _field(rec: Any, key: str):
    """The first alias of `key` that the record has with a value (None and empty collections skipped)."""
    for name in _ALIASES[key]:
        v = rec.get(name) if isinstance(rec, Mapping) else getattr(rec, name, None)
        if v is None or (isinstance(v, (tuple, list, dict, str)) and len(v) == 0):
            continue
        return v
    return None


def _number(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None


def _variant_text(v) -> str | None:
    """None, "name", {section: variant} or ((section, variant), ...) (BuildOptions.variants) → text."""
    if not v:
        return None
    if isinstance(v, Mapping):
        v = list(v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(f"{x[0]}@{x[1]}" if isinstance(x, (list, tuple)) and len(x) == 2 else str(x) for x in v)
    return str(v)


def record_row(rec: Any) -> dict:
    """A record (HistoryRecord-like object or mapping) → the history table's cells, as plain values."""
    section = _field(rec, "section")
    if isinstance(section, (list, tuple)):
        section = ", ".join(map(str, section))
    ver = _field(rec, "passed")
    if hasattr(ver, "passed"):                        # a VerifyReport
        ver = ver.passed
    status = _field(rec, "status")
    if isinstance(ver, (bool, np.bool_)):
        verified = "PASS" if ver else "FAIL"
    elif isinstance(ver, str):
        verified = ver
    else:
        verified = str(status) if status else "—"
    when = _field(rec, "time")
    if isinstance(when, (int, float)):
        when = time.strftime("%H:%M:%S", time.localtime(when))
    elif hasattr(when, "strftime"):
        when = when.strftime("%H:%M:%S")
    err = _field(rec, "error")
    err = str(err).strip().splitlines()[0] if err else ""
    if status and verified != str(status) and str(status) not in ("ok",):
        err = f"{status}: {err}" if err else str(status)
    return {"time": "" if when is None else str(when), "section": section or "(all)",
            "variant": _variant_text(_field(rec, "variant")) or "—",
            "compile_s": _number(_field(rec, "compile_s")), "verdict_s": _number(_field(rec, "verdict_s")),
            "verified": verified,
            "tok_s": _number(_field(rec, "tok_s")), "error": err}


class HistoryTable:
    """The reloads so far, newest last, as an HTML table widget."""

    COLUMNS = ("#", "time", "section", "variant", "compile", "verdict after", "verification", "tok/s", "note")

    def __init__(self):
        self.rows: list[dict] = []
        self.widget = _widgets().HTML(self._html())

    def add(self, rec: Any) -> dict:
        row = record_row(rec)
        self.rows.append(row)
        self.widget.value = self._html()
        return row

    def clear(self):
        self.rows.clear()
        self.widget.value = self._html()

    def _html(self) -> str:
        head = "".join(f"<th style='text-align:left;padding:2px 8px'>{c}</th>" for c in self.COLUMNS)
        body = []
        colour = {"PASS": "#1a7f37", "FAIL": "#cf222e"}
        for i, r in enumerate(self.rows, 1):
            cells = [str(i), r["time"], r["section"], r["variant"],
                     "—" if r["compile_s"] is None else f"{r['compile_s']:.2f} s",
                     "—" if r["verdict_s"] is None else f"{r['verdict_s']:.2f} s",
                     f"<span style='color:{colour.get(r['verified'], 'inherit')}'>{html.escape(r['verified'])}</span>",
                     "—" if r["tok_s"] is None else f"{r['tok_s']:,.0f}", html.escape(r["error"][:160])]
            cells = [c if k in (6, 8) else html.escape(c) for k, c in enumerate(cells)]
            body.append("<tr>" + "".join(f"<td style='padding:2px 8px'>{c}</td>" for c in cells) + "</tr>")
        if not body:
            body = [f"<tr><td colspan={len(self.COLUMNS)} style='padding:2px 8px;color:#777'>"
                    "no reloads yet</td></tr>"]
        return ("<div class='wb-history'><b>Reloads</b><table style='border-collapse:collapse;font-size:12px'>"
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


# -- a hang or a fault: where every block was ------------------------------------------------------------------------

def block_cells(blocks) -> list[dict]:
    """Blocks (workbench.run.worker.BlockState, or mappings of its fields) → one cell each: its label, colour and
    text (the BlockState's own). A block still inside its stage that stopped moving is a suspect (the section it is
    in hangs or faulted, or it never reached the barrier); one waiting at the barrier only waits for the suspects."""
    out = []
    for b in blocks:
        b = BlockState(**b) if isinstance(b, Mapping) else b
        if b.stage is None:
            colour, short = UNKNOWN_COLOR, "·"
        else:
            colour = WAIT_COLOR if b.waiting else COLORS.get(b.stage, UNKNOWN_COLOR)
            short = "w" if b.waiting else SHORT.get(b.stage, b.stage)[:7]
        out.append({"block": b.block, "colour": colour, "short": short, "text": str(b),
                    "suspect": b.stage is not None and not b.waiting and not b.moved})
    return out


class BlockGrid:
    """The grid after a hang or a fault, one cell per block (per SM), coloured by the stage it was in; waiting
    blocks grey, suspects outlined in red. An HTML widget; `set(blocks, title)` redraws it."""

    COLUMNS = 22                          # 132 SMs: six rows

    def __init__(self):
        self.cells: list[dict] = []
        self.title = ""
        self.widget = _widgets().HTML(self._html())

    def set(self, blocks, title: str = "") -> list[dict]:
        self.cells = block_cells(blocks or [])
        self.title = title
        self.widget.value = self._html()
        return self.cells

    def _html(self) -> str:
        if not self.cells:
            return "<div class='wb-blocks' style='color:#777'>no hang or fault to show</div>"
        n_sus = sum(c["suspect"] for c in self.cells)
        n_wait = sum(c["short"] == "w" for c in self.cells)
        cells = [f"<td title='{html.escape(c['text'], quote=True)}' style='background:{c['colour']};border:"
                 f"{'2px solid #cf222e' if c['suspect'] else '1px solid #fff'};width:34px;height:22px;"
                 f"text-align:center;font-size:9px;color:#111'>{c['block']}<br>{html.escape(c['short'])}</td>"
                 for c in self.cells]
        rows = ["<tr>" + "".join(cells[i:i + self.COLUMNS]) + "</tr>" for i in range(0, len(cells), self.COLUMNS)]
        suspects = [c["text"] for c in self.cells if c["suspect"]][:4]
        head = (f"<b>Blocks</b> {html.escape(self.title)} — {len(self.cells)} blocks: {n_wait} waiting at the "
                f"barrier, {n_sus} stopped inside their stage")
        notes = "".join(f"<div>{html.escape(t)}</div>" for t in suspects)
        return (f"<div class='wb-blocks'>{head}<table style='border-collapse:collapse'>{''.join(rows)}</table>"
                f"<div style='font-size:12px;color:#cf222e'>{notes}</div></div>")


# -- data for the figures ------------------------------------------------------------------------------------------

def gantt_data(stamps: np.ndarray, cfg: ModelConfig, step: int, blocks=None, layout=None) -> dict:
    """One step on every block, in µs from the step's start (the previous step's last release; step 0: the first
    arrival). {"work": {label: (block, start, dur, layer)}, "wait": (block, start, dur, label, layer),
    "grid": (label, start, dur, layer), "t0_ns": int}; only slots whose stamps are written. `layout`: (slot names,
    slot 0's label at step 0) of a trace (default the plan's)."""
    t = np.asarray(stamps)
    iv = intervals(t)
    names, step0 = layout or (slot_names(cfg), first_step_label(cfg))
    names = names_at(names, step0, int(step))
    blocks = np.arange(t.shape[2]) if blocks is None else np.asarray(list(blocks))
    s = int(step)
    t0 = (int(iv.leave[s - 1, -1].max()) if s > 0 and iv.leave[s - 1, -1].min() > 0
          else int(iv.start[s][iv.known[s]].min()) if iv.known[s].any() else 0)
    stage_of = np.array([n for n, _ in names])
    layer_of = np.array([l for _, l in names])
    k_idx, b_idx = np.nonzero(iv.known[s][:, blocks])                      # of [slots, blocks]
    b = blocks[b_idx]
    start = (iv.start[s][k_idx, b] - t0) / 1e3
    arrive = (iv.arrive[s][k_idx, b] - t0) / 1e3
    leave = (iv.leave[s][k_idx, b] - t0) / 1e3
    work = {}
    for label in dict.fromkeys(stage_of[k_idx].tolist()):
        m = stage_of[k_idx] == label
        work[label] = (b[m], start[m], arrive[m] - start[m], layer_of[k_idx[m]])
    wait = (b, arrive, leave - arrive, stage_of[k_idx], layer_of[k_idx])      # block, start, dur, stage, layer
    g_idx = np.flatnonzero(iv.known[s].all(axis=1))                        # slots stamped by every block
    g_start = np.array([(iv.start[s][k].max() if not (s == 0 and k == 0) else iv.start[0, 0, 0]) for k in g_idx])
    g_end = iv.leave[s][g_idx].max(axis=1) if g_idx.size else np.zeros(0)
    grid = (stage_of[g_idx], (g_start - t0) / 1e3 if g_idx.size else np.zeros(0),
            (g_end - g_start) / 1e3 if g_idx.size else np.zeros(0), layer_of[g_idx])
    return {"work": work, "wait": wait, "grid": grid, "t0_ns": t0}


def gantt_cells(d: dict, labels: list[str], rows, x_max: float, n_bins: int = GANTT_BINS,
                names: bool = True) -> dict:
    """gantt_data's intervals as heatmap cells: rows = `rows` (block ids), n_bins time bins of x_max / n_bins µs.
    {"z": [rows, bins] float32 stage code (0 the wait, 1 + i labels[i], NaN nothing), "start", "length": [rows,
    bins] float32 of the interval shown, "names": what cells show, by name ("<label> layer <l>", "wait at <label>
    layer <l>", "" last: nothing), "shown": the intervals some cell shows, {"name": uint16 into names, "start",
    "length": float32}, one more last for nothing (name "", NaN), "index": [rows, bins] uint16 (uint32 past 65,535
    intervals) into shown, "text" (with names=True): [rows, bins] the names themselves, "dx": the bin width}.
    The page gets z, names, shown and index, and makes a cell's hover from them (figure_widget): the per-cell
    starts and lengths would be 1.3 MB more a slider step.

    Which interval a cell shows: the one that covers the cell's centre (for intervals that tile a block's time,
    the one covering most of the cell, give or take half a bin); an interval that covers no centre (shorter than a
    bin) takes the cell holding its midpoint, the shortest winning where several fall in one cell. Without that, a
    short stage or a short wait would vanish from the chart without a trace; with "shortest wins" over every
    touched cell instead, each of a block's ~130 waits would take a whole bin and the grey would be inflated."""
    rows = np.asarray(rows)
    n_rows = rows.size
    dx = x_max / n_bins if x_max > 0 else 1.0
    row_of = np.full(int(rows.max()) + 1 if n_rows else 1, -1)
    row_of[rows] = np.arange(n_rows)
    code_of = {label: 1 + i for i, label in enumerate(labels)}
    parts = [(b, st, du, np.full(len(b), code_of.get(label, 0)), layer) for label, (b, st, du, layer)
             in d["work"].items()]
    wb, wst, wdu, wlab, wlayer = d["wait"]
    parts.append((wb, wst, wdu, np.zeros(len(wb), int), wlayer))
    b, start, dur, code, layer = (np.concatenate([np.asarray(p[i]) for p in parts]) if parts else np.zeros(0)
                                  for i in range(5))
    wait_of, wait_inv = np.unique(np.asarray(wlab, dtype=str), return_inverse=True)
    wait_label = np.concatenate([np.zeros(sum(len(p[0]) for p in parts[:-1]), int), 1 + wait_inv.ravel()])
    b = b.astype(int)
    keep = (b < row_of.size) & (dur > 0)
    keep[keep] &= row_of[b[keep]] >= 0
    b, start, dur, code, layer, wait_label = (a[keep] for a in (b, start, dur, code, layer, wait_label))
    r = row_of[b]
    order = np.lexsort((start, r))
    r, start, dur, code, layer, wait_label = (a[order] for a in (r, start, dur, code, layer, wait_label))
    end = start + dur
    span = 2 * max(x_max, float(end.max()) if end.size else 0.0) + 1.0      # rows laid end to end on one axis
    centre = (np.arange(n_bins) + 0.5) * dx
    q = (np.arange(n_rows)[:, None] * span + centre[None, :]).ravel()
    p = np.searchsorted(r * span + start, q, side="right") - 1
    pc = np.clip(p, 0, max(len(r) - 1, 0))
    ok = (p >= 0) & (len(r) > 0)
    if len(r):
        ok &= (r[pc] == np.repeat(np.arange(n_rows), n_bins)) & (np.tile(centre, n_rows) < end[pc])
    cell = np.where(ok, pc, -1)
    covered = np.zeros(len(r), bool)
    covered[cell[cell >= 0]] = True
    lost = np.flatnonzero(~covered)
    if lost.size:
        lost = lost[np.argsort(dur[lost], kind="stable")]                    # shortest first
        j = np.clip(((start[lost] + dur[lost] / 2) / dx).astype(int), 0, n_bins - 1)
        flat = r[lost] * n_bins + j
        _, first = np.unique(flat, return_index=True)                       # the shortest of each cell
        cell[flat[first]] = lost[first]
    has = cell >= 0
    z = np.full(n_rows * n_bins, np.nan, np.float32)
    z[has] = code[cell[has]]
    # the names: one per (stage, layer, wait or not), a small table
    key = (code.astype(np.int64) * (len(wait_of) + 1) + wait_label) * (int(layer.max()) + 2 if layer.size else 1) \
        + layer.astype(np.int64) + 1
    keys, first, inv = np.unique(key, return_index=True, return_inverse=True)
    labels_of = ["", *labels]
    names_of = [(f"wait at {wait_of[wait_label[i] - 1]}" if code[i] == 0 else labels_of[int(code[i])])
                + (f" layer {int(layer[i])}" if layer[i] >= 0 else "") for i in first] + [""]
    # the intervals some cell shows, and each cell's index into them (the last: nothing)
    shown, at = np.unique(cell[has], return_inverse=True)
    index = np.full(n_rows * n_bins, shown.size, np.uint16 if shown.size < 2 ** 16 else np.uint32)
    index[has] = at.ravel()
    table = {"name": np.append(inv.ravel()[shown], len(keys)).astype(np.uint16),
             "start": np.append(start[shown], np.nan).astype(np.float32),
             "length": np.append(dur[shown], np.nan).astype(np.float32)}
    index = index.reshape(n_rows, n_bins)
    out = {"z": z.reshape(n_rows, n_bins), "start": table["start"][index], "length": table["length"][index],
           "names": names_of, "shown": table, "index": index, "dx": dx}
    if names:
        out["text"] = np.array(names_of, dtype=object)[table["name"][index]]
    return out


def gantt_picture(z: np.ndarray, rows, n_blocks: int, height: int = GANTT_PLOT_PX) -> np.ndarray:
    """The Gantt chart's plot area as colour indices [height, bins]: z is gantt_cells' [1 + rows, bins] with the
    grid's row first (code c: index c + 1; NaN, nothing: 0, transparent). Pixel rows lie on the y axis as the chart
    draws it, [GRID_Y - 2, n_blocks] top to bottom; a block row covers its heatmap brick (±0.5 about the block, or
    to the midpoints between the rows shown), the grid row GRID_Y ± GRID_HALF."""
    z = np.asarray(z)
    rows = np.asarray(rows, dtype=float)
    top, bottom = GRID_Y - 2, n_blocks
    y = top + (np.arange(height) + 0.5) * (bottom - top) / height
    if rows.size > 1:
        mid = (rows[1:] + rows[:-1]) / 2
        edges = np.concatenate([[rows[0] - (mid[0] - rows[0])], mid, [rows[-1] + (rows[-1] - mid[-1])]])
    else:
        edges = np.concatenate([rows - 0.5, rows + 0.5])
    which = np.searchsorted(edges, y, side="right") - 1                       # the block row of each pixel row
    which = np.where((which >= 0) & (which < rows.size), which + 1, -1)
    which[np.abs(y - GRID_Y) <= GRID_HALF] = 0
    codes = np.where(np.isnan(z), 0, np.nan_to_num(z) + 1).astype(np.uint8)
    out = np.zeros((height, z.shape[1]), np.uint8)
    out[which >= 0] = codes[which[which >= 0]]
    return out


def typed_array(a: np.ndarray, dtype: str | None = None) -> dict:
    """A numpy array as plotly.js's typed-array spec (base64 little-endian: `dtype`, or u2/u4 for a uint16/uint32
    array and f4 for any other, with its shape): a
    2-D or 3-D array goes to the browser as one string, where plotly's widget serializer would send it as nested
    JSON lists (and NaN is no JSON)."""
    dtype = dtype or {np.dtype(np.uint16): "u2", np.dtype(np.uint32): "u4"}.get(np.asarray(a).dtype, "f4")
    a = np.ascontiguousarray(a, dtype={"f4": "<f4", "u2": "<u2", "u4": "<u4"}[dtype])
    return {"dtype": dtype, "bdata": base64.b64encode(a.tobytes()).decode("ascii"),
            "shape": ", ".join(map(str, a.shape))}


def from_typed_array(spec) -> np.ndarray:
    """typed_array's inverse (a plain list or array passes through as an array)."""
    if isinstance(spec, Mapping) and "bdata" in spec:
        dt = {"f4": "<f4", "f8": "<f8", "i4": "<i4", "u1": "u1", "i1": "i1", "u2": "<u2", "i2": "<i2",
              "u4": "<u4"}[spec["dtype"]]
        a = np.frombuffer(base64.b64decode(spec["bdata"]), dtype=dt)
        shape = spec.get("shape")
        return a.reshape([int(x) for x in str(shape).split(",")]) if shape else a
    return np.asarray(spec)


def ab_rows(rows_a: list[StageRow], rows_b: list[StageRow]) -> list[dict]:
    """Per stage (in the order of A's rows, then any only B has): A and B µs/token, B − A in µs and %; then a total
    row with tok/s."""
    a = {r.stage: r for r in rows_a}
    b = {r.stage: r for r in rows_b}
    out = []
    for st in dict.fromkeys([r.stage for r in rows_a] + [r.stage for r in rows_b]):
        ua = a[st].us_per_token if st in a else float("nan")
        ub = b[st].us_per_token if st in b else float("nan")
        out.append({"stage": st, "a_us": ua, "b_us": ub, "delta_us": ub - ua,
                    "delta_pct": 100 * (ub - ua) / ua if ua else float("nan")})
    ta, tb = sum(r.us_per_token for r in rows_a), sum(r.us_per_token for r in rows_b)
    out.append({"stage": "total", "a_us": ta, "b_us": tb, "delta_us": tb - ta,
                "delta_pct": 100 * (tb - ta) / ta if ta else float("nan"),
                "a_tok_s": 1e6 / ta if ta else float("nan"), "b_tok_s": 1e6 / tb if tb else float("nan")})
    return out


def _rows_of(x, cfg: ModelConfig | None = None, pos0: int = 0) -> tuple[list[StageRow], str]:
    """StageRows and a label from a Trace, a trace path, a (stamps, cfg[, pos0]) tuple, or StageRows."""
    if isinstance(x, (str, bytes)) or hasattr(x, "__fspath__"):
        x = load_trace(x)
    if isinstance(x, Trace):
        return x.stage_table(), x.label
    if isinstance(x, tuple) and x and isinstance(x[0], np.ndarray):
        stamps, c = x[0], (x[1] if len(x) > 1 else cfg)
        p = x[2] if len(x) > 2 else pos0
        return stage_rows(stamps, c, p), f"{c.name} pos {p:,}"
    if isinstance(x, np.ndarray):
        if cfg is None:
            raise ValueError("stamps need a cfg")
        return stage_rows(x, cfg, pos0), f"{cfg.name} pos {pos0:,}"
    rows = list(x)
    if rows and not isinstance(rows[0], StageRow):
        raise TypeError(f"cannot compare {type(x).__name__}: pass a Trace, a path, (stamps, cfg, pos0) or StageRows")
    return rows, "run"


class _Shown:
    """A panel set that shows itself (its `widget`) in a notebook."""

    def show(self):
        from IPython.display import display
        display(self.widget)

    def _ipython_display_(self):
        self.show()


# -- A/B -----------------------------------------------------------------------------------------------------------

class ABView(_Shown):
    """Two runs' per-stage times side by side (grouped bars, p10–p90 error bars) and a table of the differences."""

    def __init__(self, a=None, b=None, labels: tuple[str, str] | None = None, title: str | None = None):
        """Empty until `set` (see there for what a and b may be), unless given them here."""
        w = _widgets()
        self.fig = figure_widget()
        for name, colour in (("A", "#4c78a8"), ("B", "#f58518")):
            self.fig.add_bar(name=name, x=[], y=[], marker_color=colour,
                             error_y=dict(type="data", symmetric=False, array=[], arrayminus=[]),
                             hovertemplate="%{x}: %{y:.1f} µs/token<extra>%{fullData.name}</extra>")
        # the legend at the right, outside the plot: below it, it covered the stage names under the bars
        self.fig.update_layout(barmode="group", width=860, height=450, margin=dict(l=60, r=160, t=110, b=60),
                               yaxis_title="µs per token (all layers)", title=title_below_modebar(450),
                               legend=dict(x=1.02, xanchor="left", y=1, yanchor="top"))
        self.table = w.HTML()
        self.rows: list[dict] = []
        self._box = w.VBox([self.fig, self.table])
        if a is not None:
            self.set(a, b, labels, title)

    def set(self, a, b=None, labels: tuple[str, str] | None = None, title: str | None = None, *,
            cfg: ModelConfig | None = None):
        """a, b: Traces, trace paths, (stamps, cfg, pos0) tuples or StageRows; or `a` alone an A/B record with
        a_timing / b_timing StageRows and a / b variant pairs (workbench.session.ABRecord)."""
        if b is None and hasattr(a, "a_timing") and hasattr(a, "b_timing"):
            rec = a
            if not rec.a_timing or not rec.b_timing:
                raise ValueError("the A/B record has no timing (no GPU, or a build failed)")
            labels = labels or tuple(_variant_text(getattr(rec, k, None)) or "base sections" for k in ("a", "b"))
            a, b = rec.a_timing, rec.b_timing
        a, b = (load_trace(x) if isinstance(x, (str, bytes)) or hasattr(x, "__fspath__") else x for x in (a, b))
        ra, la = _rows_of(a, cfg)
        rb, lb = _rows_of(b, cfg)
        la, lb = labels or (la, lb)
        if title is None:
            ta, tb = (x.title if isinstance(x, Trace) else None for x in (a, b))
            title = ta if ta == tb else " vs ".join(t for t in (ta, tb) if t) or None
        self.rows = ab_rows(ra, rb)
        self.labels = (la, lb)
        with self.fig.batch_update():
            for tr, rows, label in zip(self.fig.data, (ra, rb), (la, lb)):
                by = {r.stage: r for r in rows}
                st = [r["stage"] for r in self.rows[:-1] if r["stage"] in by]
                tr.name = label
                tr.x = st
                tr.y = [by[s].us_per_token for s in st]
                tr.error_y.array = [by[s].spread[1] - by[s].us_per_token for s in st]
                tr.error_y.arrayminus = [by[s].us_per_token - by[s].spread[0] for s in st]
            tot = self.rows[-1]
            # µs, the chart's unit: a tok/s here, from the stages' sum, would be a second figure for a run whose
            # dashboard header gives its measured one
            self.fig.layout.title.text = (f"A/B per stage: {html.escape(la)} ({tot['a_us']:,.1f} µs a token) vs "
                                          f"{html.escape(lb)} ({tot['b_us']:,.1f} µs)"
                                          + (f"<br><sup>{html.escape(title)}</sup>" if title else ""))
        _keep_state(self.fig)
        self.table.value = self._html()
        return self

    def _html(self) -> str:
        la, lb = (html.escape(x) for x in self.labels)
        td = "<td style='text-align:right;padding:2px 8px'>"
        head = "".join(f"<th style='text-align:right;padding:2px 8px'>{c}</th>"
                       for c in ("stage", f"A: {la}", f"B: {lb}", "B − A", "B − A %"))
        body = []
        for r in self.rows:
            colour = "#1a7f37" if r["delta_us"] < -0.5 else "#cf222e" if r["delta_us"] > 0.5 else "inherit"
            cells = [r["stage"], f"{r['a_us']:.1f} µs", f"{r['b_us']:.1f} µs",
                     f"<span style='color:{colour}'>{r['delta_us']:+.1f} µs</span>", f"{r['delta_pct']:+.1f}%"]
            body.append("<tr>" + "".join(f"{td}{c}</td>" for c in cells) + "</tr>")
        return ("<table class='wb-ab' style='border-collapse:collapse;font-size:12px'>"
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")

    @property
    def widget(self):
        """The figure and the table, ready to display."""
        _synced(self.fig)
        return self._box


# -- the dashboard -------------------------------------------------------------------------------------------------

class Dashboard(_Shown):
    """Live or recorded timing dashboard; see the module docstring. `figures` maps panel names to FigureWidgets."""

    def __init__(self, cfg: ModelConfig | None = None, *, roofline_tbps: float | None = None,
                 source: str | None = None, meta: dict | None = None, gantt_blocks=None):
        w = _widgets()
        self.cfg = cfg
        self.meta = dict(meta or {})
        self.roofline_tbps = roofline_tbps if roofline_tbps is not None else self.meta.get("roofline_tbps")
        self.source = source or (source_title(self.meta) if self.meta else "live")
        self.stamps: np.ndarray | None = None
        self.pos0 = int(self.meta.get("position", 0))
        self.tok_s: float | None = self.meta.get("tok_s")
        self.progress: int | None = None
        self.rows: list[StageRow] = []
        self.n_complete = 0
        self.gantt_blocks = gantt_blocks
        self.updates = 0
        self._gantt_key = None
        # the slot layout of a trace's metadata (a trace describes itself); None: the plan's for cfg
        self.layout = slots_from_meta(self.meta)
        self._gantt_labels = None

        self.header = w.HTML()
        self.step_slider = w.IntSlider(value=0, min=0, max=0, description="token", continuous_update=False,
                                       layout=w.Layout(width="420px"))
        self.step_slider.observe(self._on_step, names="value")
        self._follow = True

        stages = figure_widget()
        stages.add_bar(name="µs per token (mean)", x=[], y=[], marker_color=[],
                       error_y=dict(type="data", symmetric=False, array=[], arrayminus=[], color="#333"),
                       customdata=[], hovertemplate="%{x}<br>mean %{y:.1f} µs/token<br>p10–p90 %{customdata[0]:.1f}"
                       "–%{customdata[1]:.1f} µs<br>work %{customdata[2]:.1f} µs, wait %{customdata[3]:.1f} µs"
                       "<extra></extra>")
        stages.update_layout(width=480, height=410, margin=dict(l=60, r=20, t=105, b=90), showlegend=False,
                             title=title_below_modebar(410),
                             yaxis_title="µs per token (all layers)")

        bw = figure_widget()
        bw.add_bar(name="achieved TB/s", x=[], y=[], marker_color=[], text=[], textposition="outside",
                   customdata=[], hovertemplate="%{x}<br>%{y:.2f} TB/s (%{text} of roofline)<br>"
                   "%{customdata:.1f} MB per token<extra></extra>")
        bw.update_layout(width=480, height=440, margin=dict(l=60, r=20, t=130, b=90), showlegend=False,
                         title=title_below_modebar(440),
                         yaxis_title="TB/s")

        # The token's picture is a layout image, drawn 1:1 on the plot area: a slider step changes its source and
        # the title, which plotly.js redraws alone. A heatmap's z (or a bar's data) is a full replot: a step took
        # 200-300 ms in JupyterLab on a 2-core machine, and 70% of it was plotly.js. The hover is a transparent
        # heatmap over the picture that changes only with the rows or the time axis (_gantt_frame).
        gantt = figure_widget()
        self._gantt_stage_traces: dict[str, int] = {}
        self.gantt_cells: dict | None = None
        self._gantt_frame = None
        gantt.update_layout(width=GANTT_SIZE[0], height=GANTT_SIZE[1], margin=GANTT_MARGIN, autosize=False,
                            title=title_below_modebar(GANTT_SIZE[1]),
                            xaxis=dict(title="µs from the start of the token", automargin=False,
                                       ticklabeloverflow="allow", showgrid=False, zeroline=False),
                            yaxis=dict(title="block (one per SM)", autorange=False, zeroline=False, showgrid=False,
                                       automargin=False, ticklabeloverflow="allow"),
                            legend=dict(orientation="h", y=-0.07, x=0.5, xanchor="center", yanchor="top"),
                            images=[dict(source=None, xref="x", yref="y", x=0, y=GRID_Y - 2, sizex=1, sizey=1,
                                         xanchor="left", yanchor="top", sizing="stretch", layer="above")])

        toks = figure_widget()
        toks.add_scatter(name="tok/s of each step", x=[], y=[], mode="lines+markers", line=dict(color="#4c78a8"),
                         hovertemplate="position %{x}: %{y:,.0f} tok/s<extra></extra>")
        toks.add_scatter(name="roofline at that position", x=[], y=[], mode="lines",
                         line=dict(color="#888", dash="dash"),
                         hovertemplate="position %{x}: roofline %{y:,.0f} tok/s<extra></extra>")
        toks.update_layout(width=480, height=370, margin=dict(l=60, r=20, t=105, b=50), xaxis_title="position",
                           title=title_below_modebar(370),
                           yaxis_title="tok/s", legend=dict(orientation="h", y=-0.25))

        self.figures = {"stages": stages, "bandwidth": bw, "gantt": gantt, "tok_s": toks}
        self.history = HistoryTable()
        self.blocks = BlockGrid()
        self.blocks.widget.layout.display = "none"          # shown when a record brings a hang or a fault
        self.ab = ABView()
        self.ab._box.layout.display = "none"
        self._box = w.VBox([self.header, self.blocks.widget, w.HBox([stages, bw]), self.step_slider, gantt,
                            w.HBox([toks, self.history.widget]), self.ab._box])
        if cfg is not None:
            self._setup_gantt(cfg)
        self._render_header()

    def slot_layout(self, cfg: ModelConfig | None = None) -> tuple[list[tuple[str, int]], str]:
        """(slot names, slot 0's label at step 0): the trace's own when it came with one, else the plan's."""
        if self.layout is not None:
            return self.layout
        cfg = cfg or self.cfg
        return slot_names(cfg), first_step_label(cfg)

    def _setup_gantt(self, cfg: ModelConfig):
        """The hover heatmap (trace 0, transparent: the picture is a layout image), and one legend entry per colour
        (the picture has none of its own), made again when the layout changes; the palette that the picture's
        codes index: nothing (transparent), the wait's grey, then each slot label's colour."""
        labels = gantt_labels(*self.slot_layout(cfg))
        if labels == self._gantt_labels:
            return
        fig = self.figures["gantt"]
        self._gantt_palette = ["transparent", WAIT_COLOR] + [color_of(label) for label in labels]
        if len(self._gantt_palette) > 256:
            raise ValueError(f"the Gantt chart draws at most 254 slot labels, not {len(labels)}")
        clear = [[0, "rgba(0,0,0,0)"], [1, "rgba(0,0,0,0)"]]
        with fig.batch_update():
            fig.data = []
            fig.add_heatmap(name="blocks", z=[], x0=0, dx=1, y=[], colorscale=clear, showscale=False,
                            zsmooth=False, showlegend=False, meta={"hover": "cells"}, hovertemplate=GANTT_HOVER,
                            hoverlabel=dict(bgcolor="#333333", font=dict(color="white")))
            # legend entries: plotly leaves out the entry of a trace with no points, so each has one point far
            # above the chart (the y axis range is fixed: it is never shown)
            self._gantt_stage_traces = {}
            for label in labels + [WAIT_TRACE]:
                fig.add_scatter(name=label, x=[0], y=[-1e6], mode="markers", hoverinfo="skip", legendgroup=label,
                                marker=dict(symbol="square", size=11,
                                            color=WAIT_COLOR if label == WAIT_TRACE else color_of(label)))
                self._gantt_stage_traces[label] = len(fig.data) - 1
        self._gantt_labels = labels
        self._gantt_key = None
        self._gantt_frame = None

    @property
    def gantt_heatmap(self):
        """The Gantt chart's hover heatmap (transparent; its rows: the grid, then the blocks shown)."""
        return self.figures["gantt"].data[0]

    @property
    def gantt_png(self) -> bytes:
        """The picture of the token on show (a palette PNG of the plot area; see gantt_picture)."""
        src = self.figures["gantt"].layout.images[0].source
        return base64.b64decode(src.split(",", 1)[1]) if src else b""

    def gantt_names(self) -> np.ndarray:
        """What each cell of the blocks' rows shows, by name: [blocks, bins] "<label> layer <l>" or "wait at
        <label> layer <l>" ("" where nothing); the grid's row is gantt_cells' row 0."""
        c = self.gantt_cells
        return np.array(c["names"], dtype=object)[c["shown"]["name"][c["index"][1:]]]

    def gantt_trace(self, label: str, wait: bool = False):
        """The Gantt chart's legend entry of a slot label (of the wait, with wait=True): shown while the token on
        show has that label."""
        return self.figures["gantt"].data[self._gantt_stage_traces[WAIT_TRACE if wait else label]]

    # -- constructors --------------------------------------------------------------------------------------------
    @classmethod
    def from_trace(cls, trace, **kw) -> "Dashboard":
        """A dashboard of a saved trace (a path or a Trace), titled with where and when it was recorded."""
        tr = trace if isinstance(trace, Trace) else load_trace(trace)
        if not tr.meta and "cfg" not in kw:
            raise ValueError("a raw .npy trace has no metadata: pass cfg=")
        cfg = kw.pop("cfg", None) or tr.cfg
        d = cls(cfg, meta=tr.meta, **kw)
        d.update_timing(tr.stamps, cfg, pos0=tr.pos0, tok_s=tr.tok_s)
        return d

    # -- inputs --------------------------------------------------------------------------------------------------
    def update_timing(self, stamps: np.ndarray | None, cfg: ModelConfig | None = None, *, pos0: int | None = None,
                      tok_s: float | None = None, roofline_tbps: float | None = None,
                      progress: int | None = None) -> int:
        """Redraw from stamps [steps, slots, blocks, 2] (a finished run's `Result.timing` or a snapshot with zeros
        where stamps are not yet written). Returns the number of complete steps. Cheap enough to call every
        poll: the Gantt chart is only redrawn when its step changes or is still being written."""
        if stamps is None:
            return self.n_complete
        stamps = np.asarray(stamps)
        cfg = cfg or self.cfg
        if cfg is None:
            raise ValueError("update_timing needs the model config (cfg=) the first time")
        if self.layout is not None and self.cfg is not None and cfg != self.cfg:
            self.layout = None                      # another model: the plan's layout, not the trace's
        n_slots = len(self.slot_layout(cfg)[0])
        if stamps.ndim != 4 or stamps.shape[1] != n_slots or stamps.shape[3] != 2:
            raise ValueError(f"stamps of shape {stamps.shape} do not fit {cfg.name}: expected "
                             f"[steps, {n_slots}, blocks, 2]")
        old = self.stamps
        new_run = (old is None or old.shape != stamps.shape or cfg != self.cfg
                   or (pos0 is not None and pos0 != self.pos0)
                   or (stamps.size > 0 and int(old.flat[0]) != 0 and int(stamps.flat[0]) != int(old.flat[0])))
        self.cfg = cfg
        self._setup_gantt(cfg)
        self.stamps = stamps
        if pos0 is not None:
            self.pos0 = int(pos0)
        if tok_s is not None:
            self.tok_s = float(tok_s)
        if roofline_tbps is not None:
            self.roofline_tbps = float(roofline_tbps)
        self.progress = progress
        self.n_complete = complete_steps(stamps)
        self.rows = stage_rows(stamps, cfg, self.pos0, names=self.slot_layout(cfg)[0])
        self.updates += 1
        with self.figures["stages"].batch_update():
            self._draw_stages()
        with self.figures["bandwidth"].batch_update():
            self._draw_bandwidth()
        with self.figures["tok_s"].batch_update():
            self._draw_tok_s()
        _keep_state(self.figures["stages"], self.figures["bandwidth"], self.figures["tok_s"])
        self._update_slider(new_run)
        self._draw_gantt(force=new_run)
        self._render_header()
        return self.n_complete

    def poller(self, pos0: int = 0, every_s: float = 0.5) -> Callable:
        """An `on_poll` for Monokernel.stream_tokens/generate: redraws from `mk.timing_snapshot()` at most every
        `every_s` seconds while the kernel runs."""
        last = [-math.inf]

        def on_poll(mk, progress):
            now = time.monotonic()
            if now - last[0] < every_s:
                return
            last[0] = now
            snap = mk.timing_snapshot()
            if snap is not None:
                self.update_timing(snap, mk.cfg, pos0=pos0, progress=progress)
        return on_poll

    def add_record(self, record) -> dict:
        """Append a reload record (see HistoryRecord) to the history table; usable as an on_record callback. A
        record of a hang or a fault (one with `blocks`) shows where every block was, in the blocks panel."""
        row = self.history.add(record)
        blocks = record.get("blocks") if isinstance(record, Mapping) else getattr(record, "blocks", None)
        if blocks:
            status = record.get("status") if isinstance(record, Mapping) else getattr(record, "status", "")
            self.show_blocks(blocks, f"({status}, reload {len(self.history.rows)}: {row['section']})")
        return row

    def show_blocks(self, blocks, title: str = "") -> list[dict]:
        """Show the blocks panel: every block's last state (WorkerFailure.blocks, ReloadRecord.blocks)."""
        cells = self.blocks.set(blocks, title)
        self.blocks.widget.layout.display = None
        return cells

    def follow(self, wb) -> Callable:
        """Show a Workbench's reloads (workbench.session): the history so far and every new record (through
        `wb.on_record`); where a reload ran the timing build (a GPU), its stamps too. Returns the callback (remove
        it from wb.on_record to stop following)."""
        def timing_of(rec=None):
            stamps = getattr(wb, "stamps", None)        # the last timed run's, wherever it ran (a worker too)
            if stamps is not None:
                tps = _number(_field(rec, "tok_s")) if rec is not None else None
                self.update_timing(stamps, wb.cfg, pos0=0, tok_s=tps)

        for rec in list(getattr(wb, "history", [])):
            self.add_record(rec)
        timing_of(wb.history[-1] if getattr(wb, "history", None) else None)

        def on_record(rec):
            self.add_record(rec)
            timing_of(rec)
        wb.on_record.append(on_record)
        return on_record

    def compare(self, a, b=None, labels: tuple[str, str] | None = None, title: str | None = None) -> ABView:
        """Show the A/B panel: two runs (Trace, path, (stamps, cfg, pos0) or StageRows) per stage, or one A/B
        record (Workbench.compare's)."""
        self.ab.set(a, b, labels, title, cfg=self.cfg)
        self.ab._box.layout.display = None
        return self.ab

    def save_trace(self, path, **meta) -> Path:
        """Save the stamps shown (with this dashboard's metadata, or a fresh recording's) as a trace file."""
        if self.stamps is None:
            raise ValueError("no timing to save yet")
        m = dict(self.meta) if self.meta else recording_meta(self.cfg, position=self.pos0, tok_s=self.tok_s,
                                                             roofline_tbps=self.roofline_tbps)
        m.update(meta)
        return save_trace(path, self.stamps, m)

    def panel(self, name: str):
        """One panel alone, to display by itself: stages, bandwidth, gantt (with its token slider), tok_s, history,
        blocks, ab."""
        if name == "gantt":
            return _widgets().VBox([self.step_slider, *_synced(self.figures["gantt"])])
        if name == "history":
            return self.history.widget
        if name == "blocks":
            return self.blocks.widget
        if name == "ab":
            return self.ab.widget
        if name not in self.figures:
            raise KeyError(f"no panel {name!r}: stages, bandwidth, gantt, tok_s, history, blocks, ab")
        return _synced(self.figures[name])[0]

    @property
    def widget(self):
        """Every panel in one ipywidgets box, ready to display."""
        _synced(*self.figures.values(), self.ab.fig)
        return self._box

    # -- drawing -------------------------------------------------------------------------------------------------
    @property
    def title(self) -> str:
        return self.source

    def _render_header(self):
        cfg = self.cfg
        bits = [f"<b style='font-size:14px'>{html.escape(self.title)}</b>"]
        if cfg is not None:
            bits.append(f"{html.escape(cfg.name)}, position {self.pos0:,}")
        if self.stamps is not None:
            run = f"{self.n_complete} of {self.stamps.shape[0]} steps complete"
            if self.progress is not None:
                run += f" (kernel at step {self.progress})"
            bits.append(run + f", {self.stamps.shape[2]} blocks")
        if self.rows and not self.tok_s:        # one tok/s a run: the measured one where there is one
            total = sum(r.us_per_token for r in self.rows)
            bits.append(f"trace: {total:,.1f} µs/token = {1e6 / total:,.0f} tok/s (the mean stamped step)")
        if self.tok_s:
            bits.append(f"measured {self.tok_s:,.0f} tok/s")
        if self.roofline_tbps:
            bits.append(f"streaming-read roofline {self.roofline_tbps:.2f} TB/s")
        self.header.value = "<div class='wb-dashboard-header'>" + " · ".join(bits) + "</div>"

    def _sub(self) -> str:
        return f"<br><sup>{html.escape(self.title)}</sup>"

    def _draw_stages(self):
        fig, rows = self.figures["stages"], self.rows
        tr = fig.data[0]
        tr.x = [r.stage for r in rows]
        tr.y = [r.us_per_token for r in rows]
        tr.marker.color = [color_of(r.stage) for r in rows]
        tr.error_y.array = [r.spread[1] - r.us_per_token for r in rows]
        tr.error_y.arrayminus = [r.us_per_token - r.spread[0] for r in rows]
        tr.customdata = [[r.spread[0], r.spread[1], r.work_us, r.wait_us] for r in rows]
        total = sum(r.us_per_token for r in rows)
        # one tok/s a run, the header's: the run's measured one where there is one (its time outside the stamped
        # steps makes it differ from the stages' sum), else the stages' sum's
        if not total:
            fig.layout.title.text = "Per-stage time per token (no complete step yet)" + self._sub()
            return
        rate = f"run: {self.tok_s:,.0f} tok/s" if self.tok_s else f"{1e6 / total:,.0f} tok/s"
        fig.layout.title.text = (f"Per-stage time per token: {total:,.0f} µs ({rate})"
                                 + self._sub())

    def _draw_bandwidth(self):
        fig = self.figures["bandwidth"]
        rows = [r for r in self.rows if r.bytes > 0]
        roof = self.roofline_tbps
        tr = fig.data[0]
        tr.x = [r.stage for r in rows]
        tr.y = [r.tbps for r in rows]
        tr.marker.color = [color_of(r.stage) for r in rows]
        over = [bool(roof) and r.tbps > roof for r in rows]
        tr.text = [f"{100 * r.tbps / roof:.0f}%" + ("†" if o else "") if roof else "" for r, o in zip(rows, over)]
        tr.customdata = [r.bytes / 1e6 for r in rows]
        if roof:
            fig.layout.shapes = [dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=roof, y1=roof,
                                      line=dict(color="#333", dash="dash", width=2), name="roofline")]
            notes = [dict(xref="paper", x=0.01, y=roof, yref="y", xanchor="left", yanchor="bottom",
                          showarrow=False, text=f"streaming-read roofline {roof:.2f} TB/s")]
            if any(over):           # the text tables' footnote (measure.timing.ROOF_NOTE), short, on the chart
                notes.append(dict(xref="paper", yref="paper", x=0, y=1.01, xanchor="left", yanchor="bottom",
                                  showarrow=False, align="left", font=dict(size=10, color="#555"), name="roof-note",
                                  text=ROOF_NOTE_CHART))
            fig.layout.annotations = notes
            top = max([r.tbps for r in rows], default=0.0)
            fig.layout.yaxis.range = [0, max(roof * 1.2, top * 1.12)]
        else:
            fig.layout.shapes, fig.layout.annotations = [], []
        fig.layout.title.text = "Achieved bandwidth per stage" + self._sub()

    def _draw_tok_s(self):
        fig = self.figures["tok_s"]
        ns = step_ns(self.stamps) if self.stamps is not None else np.zeros(0)
        pos = [self.pos0 + i for i in range(ns.size)]
        fig.data[0].x = pos
        fig.data[0].y = (1e9 / ns).tolist() if ns.size else []
        if self.roofline_tbps and ns.size:
            fig.data[1].x = pos
            fig.data[1].y = [roofline_tok_s(self.cfg, self.roofline_tbps, p) for p in pos]
        else:
            fig.data[1].x, fig.data[1].y = [], []
        med = f": median {1e9 / np.median(ns):,.0f}" if ns.size else ""
        fig.layout.title.text = f"tok/s over the run{med}" + self._sub()

    def _update_slider(self, new_run: bool):
        n = self.stamps.shape[0]
        # a step still being written is shown too, as far as it got
        have = max(self.n_complete + (1 if self.n_complete < n and (self.stamps[self.n_complete] > 0).any() else 0),
                   1)
        follow = new_run or self._follow
        self._updating = True
        try:
            self.step_slider.max = have - 1
            if follow:
                self.step_slider.value = have - 1
        finally:
            self._updating = False

    def _on_step(self, change):
        if getattr(self, "_updating", False):
            return
        self._follow = change["new"] == self.step_slider.max
        self._draw_gantt()

    def _set_gantt_frame(self, rows: np.ndarray, n_blocks: int, span: float):
        """The rows shown and the time axis (0 to `span` µs): the axes, the picture's place and the hover heatmap's
        cells (one a bin, as the picture's), set when they change, not on every step."""
        fig = self.figures["gantt"]
        dx = span / GANTT_BINS
        with fig.batch_update():
            h = fig.data[0]
            # a plain list, not a typed array: after every update plotly's widget sends back each trace's full data
            # where it differs from the data it was given (z decoded from a typed array always does), and its model
            # deep-compares that with the last (lodash isEqual): 2 s a step for this z unchanged
            h.z = np.zeros((1 + rows.size, GANTT_BINS), np.int8).tolist()
            h.x0, h.dx = dx / 2, dx
            h.y = np.concatenate([[GRID_Y], rows]).astype(np.int32)
            # the picture's place and size with the axes (a new array: a frame changes seldom, a step only its source)
            fig.layout.images = [dict(fig.layout.images[0].to_plotly_json(), sizex=span, sizey=n_blocks - (GRID_Y - 2))]
            fig.layout.yaxis.tickvals = [GRID_Y] + list(range(0, n_blocks, 8))
            fig.layout.yaxis.ticktext = ["grid"] + [str(i) for i in range(0, n_blocks, 8)]
            fig.layout.yaxis.range = [n_blocks, GRID_Y - 2]          # reversed: block 0 on top, the grid above
            fig.layout.xaxis.range = [0, span]

    def _draw_gantt(self, force: bool = False):
        if self.stamps is None:
            return
        step = int(self.step_slider.value)
        partial = step >= self.n_complete
        key = (id(self.stamps), step) if not partial else None
        if not force and key is not None and key == self._gantt_key:
            return
        self._gantt_key = key
        d = gantt_data(self.stamps, self.cfg, step, self.gantt_blocks, self.slot_layout())
        fig = self.figures["gantt"]
        n_blocks = self.stamps.shape[2]
        rows = np.arange(n_blocks) if self.gantt_blocks is None else np.asarray(list(self.gantt_blocks))
        g_stage, g_start, g_dur, g_layer = d["grid"]
        ends = [g_start + g_dur, d["wait"][1] + d["wait"][2]]
        x_max = max((float(np.max(e)) for e in ends if len(e)), default=0.0)
        # one time axis for the run: the longest complete token (a longer one widens it), so a step redraws no axis
        if self._gantt_frame is None or self._gantt_frame[0] != (id(self.stamps), tuple(rows)) \
                or x_max > self._gantt_frame[1]:
            done = step_ns(self.stamps) / 1e3 if self.n_complete else np.zeros(0)
            span = max(float(done.max()) if done.size else 0.0, x_max) * 1.02 or 1.0
            self._set_gantt_frame(rows, n_blocks, span)
            self._gantt_frame = ((id(self.stamps), tuple(rows)), span)
        span = self._gantt_frame[1]
        # the grid's row joins the blocks' as one more block (id n_blocks), put first
        work = dict(d["work"])
        for label in dict.fromkeys(g_stage.tolist()):
            m = g_stage == label
            b, st, du, ly = work.get(label, (np.zeros(0, int), np.zeros(0), np.zeros(0), np.zeros(0, int)))
            work[label] = (np.concatenate([b, np.full(m.sum(), n_blocks)]), np.concatenate([st, g_start[m]]),
                           np.concatenate([du, g_dur[m]]), np.concatenate([ly, g_layer[m]]))
        cells = gantt_cells({"work": work, "wait": d["wait"]}, self._gantt_labels,
                            np.concatenate([[n_blocks], rows]), span, names=False)
        self.gantt_cells = cells
        present = set(d["work"]) | ({WAIT_TRACE} if len(d["wait"][0]) else set())
        png = palette_png(gantt_picture(cells["z"], rows, n_blocks), self._gantt_palette)
        shown = cells["shown"]
        fig._hover_cells = {"rows": ["grid"] + [f"block {int(b)}" for b in rows], "ends": [True] + [False] * rows.size,
                            "names": cells["names"], "index": typed_array(cells["index"]),
                            "name": typed_array(shown["name"]), "start": typed_array(shown["start"]),
                            "length": typed_array(shown["length"])}
        with fig.batch_update():
            # an element's edit: plotly.js draws it alone (arraydraw), where a new array is a replot of the figure
            fig.layout.images[0].source = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            for label, i in self._gantt_stage_traces.items():
                show = label in present
                if fig.data[i].showlegend != show:
                    fig.data[i].showlegend = show
            total = float((g_start + g_dur).max()) if len(g_stage) else 0.0
            what = "being written" if partial else f"{total:,.1f} µs"
            fig.layout.title.text = (f"Token {step} (position {self.pos0 + step:,}) on every block: work by stage, "
                                     f"grey = wait at the barrier ({what})" + self._sub())
        _keep_state(fig)

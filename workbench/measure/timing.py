"""Per-stage timing from the kernel's %globaltimer stamps (a build with BuildOptions(timing=True)).

The stamps are [steps, slots, blocks, 2]: for every grid barrier of a step (a slot of `schedule.slots`), when each block
arrived (its share of the slot's work done) and when it left (everyone had arrived). Every slot is stamped in every
step. Slot 0 ends at the barrier after the stages the plan runs before the first layer stage, and also holds what
the previous step ran after its last barrier (with the plan of today: the previous step's sampling and publish,
then this step's embedding, "sampling+publish+embedding"; at step 0 only the embedding). Then come the layers'
slots and the slots after them, in the plan's order.

A block's work in a slot runs from its leaving the previous barrier to its arriving at this one, its wait from
arriving to leaving; slot 0 of step s starts where the last slot of step s − 1 let go, and at step 0 (whose start
is not stamped) at the first arrival. A slot's span runs from the previous barrier's release (the last block to
leave) to its own. All blocks read one clock, so spans from different SMs line up.

The span is not the mean block's work + wait: blocks leave a barrier over a microsecond or two, so the mean block
starts a slot before the previous release (its head start) and leaves it before this release (its lag). Per slot
span = work + wait + skew exactly, with work and wait the mean block's and skew = this barrier's lag − the previous
barrier's, the lag being how long after the mean block the last block left. Over a whole step the skews telescope
to the last barrier's lag less the previous step's: close to nothing.

Slot names and bytes come from `workbench.plan`; nothing here lists the stages.
"""
from __future__ import annotations

import dataclasses
import textwrap

import numpy as np

from .. import plan, schedule
from ..model.config import ModelConfig


def slot_names(cfg: ModelConfig, first_step: bool = False) -> list[tuple[str, int]]:
    """(label, layer) of every slot of a step, in order: the plan's slots. With first_step, the labels of step 0,
    where slot 0 holds only its own stages (nothing ran before it)."""
    names = [(s.label, s.layer) for s in schedule.slots(cfg)]
    if first_step and names:
        names[0] = (first_step_label(cfg), names[0][1])
    return names


def first_step_label(cfg: ModelConfig) -> str:
    """Slot 0's label at step 0: its stages without those the previous step carries into it (they come after the
    step's last barrier in execution order)."""
    slots = schedule.slots(cfg)
    order = schedule.execution(cfg)
    last = order.index(slots[-1].stages[-1])
    own = [st for st, layer in slots[0].stages if order.index((st, layer)) <= last]
    return "+".join(dict.fromkeys(own)) or slots[0].label


def slot_labels(cfg: ModelConfig, names: list[tuple[str, int]] | None = None) -> list[str]:
    """The distinct slot labels in slot order: the rows of `stage_table` (layer stages once, not per layer)."""
    return list(dict.fromkeys(label for label, _ in (names or slot_names(cfg))))


def label_stages(label: str) -> list[str]:
    """The stages a slot label names ("sampling+publish+embedding" → three)."""
    return label.split("+")


def stage_bytes(cfg: ModelConfig, stage: str, pos: int) -> int:
    """Bytes a stage must move from memory at position `pos` (schedule.stage_bytes: weights bf16, the KV cache read by
    attention); a slot label made of several stages gives their sum; a stage the plan does not know (an older
    trace's) gives 0."""
    return sum(schedule.stage_bytes(cfg, name, pos) for name in label_stages(stage) if name in plan.STAGE_NAMES)


@dataclasses.dataclass
class StageRow:
    stage: str                 # a slot label: one stage, or several run between the same two barriers ("a+b")
    us_per_token: float        # span summed over layers, mean over steps (so that the rows add up to the mean step)
    spread: tuple              # (p10, p90) over steps
    work_us: float             # mean over blocks and steps of the work part, summed over layers
    wait_us: float             # likewise the wait at the barrier
    bytes: int
    tbps: float                # bytes / span
    skew_us: float = 0.0       # us_per_token − work − wait: the release's lag behind the mean block, this barrier's
                               # less the previous one's (see the module's docstring)


def _releases(t: np.ndarray):
    """arrive, leave [steps, slots, blocks], and each barrier's release and the one before it [steps, slots], ns.
    Step 0's slot 0 starts at the first arrival (the kernel's start is not stamped)."""
    arrive, leave = t[..., 0].astype(np.int64), t[..., 1].astype(np.int64)
    release = leave.max(axis=2)                              # when the last block left: the barrier's release
    prev = np.empty_like(release)
    prev[:, 1:] = release[:, :-1]
    prev[1:, 0] = release[:-1, -1]
    prev[0, 0] = arrive[0, 0].min()
    return arrive, leave, release, prev


def spans(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """span [steps, slots], work and wait [steps, slots, blocks] in ns."""
    arrive, leave, release, prev = _releases(t)
    span = release - prev
    start = np.empty_like(leave)                             # each block starts a slot when it left the last one
    start[:, 1:] = leave[:, :-1]
    start[1:, 0] = leave[:-1, -1]
    start[0, 0] = prev[0, 0]
    return span, arrive - start, leave - arrive


def _by_label(cfg: ModelConfig, t: np.ndarray, names: list[tuple[str, int]] | None) -> list[tuple[str, list[int]]]:
    """(label, its slots' indices) per distinct slot label of the layout `names` (default the plan's) the stamps fit."""
    names = names or slot_names(cfg)
    if t.shape[1] != len(names):
        raise ValueError(f"stamps have {t.shape[1]} slots per step, the layout {len(names)}")
    return [(label, [i for i, (s, _) in enumerate(names) if s == label]) for label in slot_labels(cfg, names)]


def stage_table(cfg: ModelConfig, t: np.ndarray, pos0: int = 0, skip_first: int = 1,
                names: list[tuple[str, int]] | None = None) -> list[StageRow]:
    """One row per distinct slot label, in slot order (a layer stage's slots summed over the layers), over the
    steps from `skip_first` on. Bytes at the run's middle position. `names`: the trace's own slot layout (default
    the plan's). Every statistic is a mean over the steps, so that each row's work + wait + skew is its µs/token
    and the rows add up to the mean step (a median would not add up); the p10–p90 spread shows the steps' scatter."""
    labels = _by_label(cfg, t, names)
    span, work, wait = spans(t)
    steps = range(skip_first, t.shape[0])
    mid = pos0 + t.shape[0] // 2
    rows = []
    for label, idx in labels:
        per_step = span[steps][:, idx].sum(axis=1) / 1e3
        nbytes = stage_bytes(cfg, label, mid) * len(idx)
        us = float(per_step.mean())
        wk = float(work[steps][:, idx].mean(axis=(0, 2)).sum() / 1e3)
        wt = float(wait[steps][:, idx].mean(axis=(0, 2)).sum() / 1e3)
        rows.append(StageRow(label, us, (float(np.percentile(per_step, 10)), float(np.percentile(per_step, 90))),
                             wk, wt, nbytes, nbytes / (us * 1e-6) / 1e12 if us > 0 else 0.0, us - wk - wt))
    return rows


# printed under the stage table
COLUMNS_NOTE = ("work, wait: the mean block's; skew: the rest of the µs/token (how long after the mean block the last "
                "block left this barrier, less the same at the barrier before); the rows add up to the total")
# printed under a table that shows a stage above 100% of the roofline
ROOF_NOTE = ("* above 100% of the roofline: the roofline is a separate launch's streaming read of the weights, timed "
             "whole with CUDA events (its launch, ramp-up and drain included), while a stage is timed between two "
             "barriers of the running kernel, with none of those, and may find a little of its data in L2. Above "
             "100% means the stage reads at the streaming read's full rate, not faster than the memory.")


def wrap_note(text: str, width: int = 118) -> str:
    return "\n".join(textwrap.wrap(text, width, subsequent_indent="  "))


def format_table(rows: list[StageRow], roofline_tbps: float | None = None, tok_s: float | None = None) -> str:
    """The stage table, with work + wait + skew = µs/token on every row and the rows adding up to the total (the
    mean stamped step). `tok_s`: the run's own figure (steps over the launch's time), when known: the table then
    says how much of the run's time per token lies outside the stamped steps (the launch, the first step, which
    the table skips), so that one run shows one tok/s and the numbers add up to it."""
    total = sum(r.us_per_token for r in rows)
    w = max([18] + [len(r.stage) for r in rows])
    out = [f"{'stage':{w}s} {'µs/token':>9s} {'p10–p90 µs':>15s} {'work µs':>8s} {'wait µs':>8s} {'skew µs':>8s} "
           f"{'MB':>8s} {'TB/s':>6s}" + (f" {'%roof':>6s}" if roofline_tbps else "")]
    over = False
    for r in rows:
        line = (f"{r.stage:{w}s} {r.us_per_token:9.1f} {r.spread[0]:7.1f}–{r.spread[1]:<7.1f} {r.work_us:8.1f} "
                f"{r.wait_us:8.1f} {_signed(r.skew_us, 8)} {r.bytes / 1e6:8.1f} {r.tbps:6.2f}")
        if roofline_tbps:
            pct = 100 * r.tbps / roofline_tbps
            over |= round(pct, 1) > 100
            line += f" {pct:6.1f}" + ("*" if round(pct, 1) > 100 else "")
        out.append(line)
    if total <= 0:
        out.append(f"{'total':{w}s} —")
    elif tok_s:
        run = 1e6 / tok_s
        out.append(f"{'total (the steps)':{w}s} {total:9.1f}")
        # from the printed figures, so that the three lines add up as printed
        out.append(f"{'outside the steps':{w}s} {_signed(round(run, 1) - round(total, 1), 9)}   (the launch, and "
                   "steps the table skips)")
        out.append(f"{'the run':{w}s} {run:9.1f}   = {tok_s:,.0f} tok/s, the run's steps over its launch time")
    else:
        out.append(f"{'total':{w}s} {total:9.1f}   = {1e6 / total:,.0f} tok/s, the mean stamped step (no launch)")
    out.append(wrap_note(COLUMNS_NOTE))
    if over:
        out.append(wrap_note(ROOF_NOTE))
    return "\n".join(out)


def _signed(v: float, width: int, digits: int = 1) -> str:
    return f"{signed(v, digits):>{width}s}"


def signed(v: float, digits: int = 1, unit: str = "") -> str:
    """v with its sign ("+1.2", "-0.4"), never "-0" or "+0": a value that rounds to zero prints unsigned; "—" for
    a missing one (None or NaN). `unit` follows the number ("%")."""
    if v is None or v != v:
        return "—"
    text = f"{v:+.{digits}f}"
    if float(text) == 0:
        text = f"{0:.{digits}f}"
    return text + unit


def format_ab_rows(rows: list[dict]) -> str:
    """The A/B differences per stage as text (the rows of ui.dashboard.ab_rows, or any dicts with stage, a_us, b_us,
    delta_us, delta_pct): columns that line up whatever the stages' names, "—" for a stage one run lacks, changes
    that round to nothing unsigned (never "-0%")."""
    w = max([len("stage")] + [len(r["stage"]) for r in rows])
    out = [f"{'stage':{w}s} {'A µs':>8s} {'B µs':>8s} {'B − A':>8s} {'%':>6s}"]
    for r in rows:
        a, b = (("—" if r[k] != r[k] else f"{r[k]:.1f}") for k in ("a_us", "b_us"))
        out.append(f"{r['stage']:{w}s} {a:>8s} {b:>8s} {signed(r['delta_us']):>8s} "
                   f"{signed(r['delta_pct'], 0, '%'):>6s}")
    return "\n".join(out)


def format_barrier(cost: dict) -> str:
    """barrier_cost's figures as one line."""
    return (f"barrier: the first block leaves {cost['first_out_ns'] / 1e3:.2f} µs and the last "
            f"{cost['last_out_ns'] / 1e3:.2f} µs after the last arrival (medians), "
            f"{cost['barriers_per_token']} barriers a token")


def barrier_cost(t: np.ndarray, skip_first: int = 1) -> dict:
    """The grid barrier measured in the kernel: from the last block's arrival to the first block's and to the last
    block's departure (ns, medians over every barrier of the recorded steps: every slot is one)."""
    arrive, leave = t[skip_first:, :, :, 0].astype(np.int64), t[skip_first:, :, :, 1].astype(np.int64)
    last_in = arrive.max(axis=2)
    first_out = leave.min(axis=2) - last_in
    last_out = leave.max(axis=2) - last_in
    return {"first_out_ns": float(np.median(first_out)), "last_out_ns": float(np.median(last_out)),
            "barriers_per_token": int(t.shape[1])}


@dataclasses.dataclass
class BoundaryRow:
    """How one slot label's barrier plays out, in µs after the previous barrier's release (means over its layers
    and the recorded steps): when the first and the last block arrived, and how long after the last arrival the
    first and the last block left. A late last arrival is a straggling block (its data came late); a long release
    is the barrier itself slowed (its atomics queued behind other traffic)."""
    stage: str
    first_arrival_us: float
    last_arrival_us: float
    first_leave_us: float      # after the last arrival
    last_leave_us: float


def boundary_table(cfg: ModelConfig, t: np.ndarray, skip_first: int = 1,
                   names: list[tuple[str, int]] | None = None) -> list[BoundaryRow]:
    """One row per slot label, in slot order, from the stamps [steps, slots, blocks, 2] (see `spans`)."""
    labels = _by_label(cfg, t, names)
    arrive, leave, release, prev = _releases(t)
    last_in = arrive.max(axis=2)
    parts = (arrive.min(axis=2) - prev, last_in - prev, leave.min(axis=2) - last_in, release - last_in)
    return [BoundaryRow(label, *(float(p[skip_first:, idx].mean() / 1e3) for p in parts)) for label, idx in labels]


def format_boundaries(rows: list[BoundaryRow]) -> str:
    w = max([18] + [len(r.stage) for r in rows])
    out = [f"{'stage':{w}s} {'first in':>9s} {'last in':>9s} {'first out':>10s} {'last out':>9s}   "
           "(µs: arrivals after the previous release, departures after the last arrival)"]
    for r in rows:
        out.append(f"{r.stage:{w}s} {r.first_arrival_us:9.2f} {r.last_arrival_us:9.2f} {r.first_leave_us:10.2f} "
                   f"{r.last_leave_us:9.2f}")
    return "\n".join(out)


@dataclasses.dataclass
class CriticalRow:
    """Which blocks hold a slot's barrier up, and by how much (medians over its layers and the recorded steps):
    the typical block's work, the last arrival's work, and the blocks that arrive last most often with the share of
    barriers at which each did. A slot whose last blocks are always the same few (attention's kv-head blocks at
    short positions) waits on their latency chain, not on bandwidth; one whose last block changes from barrier
    to barrier waits on the memory system's tail."""
    stage: str
    median_work_us: float      # the median block's work
    last_work_us: float        # the last block to arrive: its work
    last_blocks: tuple         # ((block, share of barriers it arrived last at), ...), most often first; blocks tied
                               # for last (the stamps tick in 32 ns) share that barrier equally
    idle_pct: float            # share of the blocks' time in the slot spent waiting at the barrier


def critical_table(cfg: ModelConfig, t: np.ndarray, skip_first: int = 1, names: list[tuple[str, int]] | None = None,
                   top: int = 4) -> list[CriticalRow]:
    """One row per slot label, in slot order, from the stamps [steps, slots, blocks, 2] (see `spans`)."""
    labels = _by_label(cfg, t, names)
    if t.shape[0] == 0:
        raise ValueError("no steps in the stamps")
    _, work, wait = spans(t)
    arrive = t[..., 0].astype(np.int64)
    steps = slice(skip_first if t.shape[0] > skip_first else 0, t.shape[0])     # as stage_rows skips the first
    rows = []
    for label, idx in labels:
        w = work[steps][:, idx].reshape(-1, t.shape[2])                # [barriers, blocks]
        a = arrive[steps][:, idx].reshape(-1, t.shape[2])
        last = a.argmax(axis=1)
        tied = a == a.max(axis=1, keepdims=True)
        share = (tied / tied.sum(axis=1, keepdims=True)).sum(axis=0) / len(a)       # [blocks]
        order = [b for b in np.argsort(-share, kind="stable")[:top] if share[b] > 0]
        busy, idle = w.sum(), wait[steps][:, idx].sum()
        rows.append(CriticalRow(label, float(np.median(w) / 1e3), float(np.median(w[np.arange(len(last)), last]) / 1e3),
                                tuple((int(b), float(share[b])) for b in order),
                                float(100 * idle / (busy + idle)) if busy + idle > 0 else 0.0))
    return rows


def format_critical(rows: list[CriticalRow]) -> str:
    w = max([20] + [len(r.stage) for r in rows])
    out = [f"{'stage (µs a barrier)':{w}s} {'median work':>12s} {'last work':>10s} {'idle %':>7s}   last to arrive, "
           "most often (block: share of barriers, ties shared)"]
    for r in rows:
        last = ", ".join(f"{b}: {100 * s:.0f}%" for b, s in r.last_blocks)
        out.append(f"{r.stage:{w}s} {r.median_work_us:12.2f} {r.last_work_us:10.2f} {r.idle_pct:7.1f}   {last}")
    return "\n".join(out)

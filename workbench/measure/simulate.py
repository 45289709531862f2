"""The schedule simulator: per-SM timelines of one token from the plan's work lists (workbench.worklists), with
costs calibrated on the kernel's own timing traces, to choose between schedules before spending GPU time.

What it models (each part calibrated, none assumed):
* **Memory.** HBM is shared: the blocks streaming at a moment split the aggregate rate `hbm_tbps` evenly, each
  at most `sm_gbps` (one SM's own limit: its loads in flight). A block's bytes stream at that fluid rate.
* **A block's latency outside its bytes.** Every block pays `fixed_us[label]` once per slot before its bytes:
  the departure from the barrier, the prologue (RMSNorm of x from L2), the first loads' round trip and the
  epilogue. It comes from the median block of the trace, less what its bytes take at the slot's rate.
* **Stragglers.** The memory system does not serve every block alike: a slot's last block arrives later than its
  median one. Each block of a slot gets a jitter, a fixed quantile of an exponential whose mean `jitter_us[label]`
  puts the last of a slot's blocks as far after its median block as the trace's last arrivals are (a waiting unit
  that needs a few producers then waits for the last of those few, not of all: what dataflow gains).
* **Attention.** A block's time grows with the positions it reads (`position_ns`, the chain of its warps' steps)
  and by `merge_us` where a kv head's positions are split over blocks (the last block folds the partials in).
* **Hand-offs.** In the barrier design a block leaves a slot's barrier between `barrier_us[label]`'s first and last
  departure after the last arrival (the trace's: the barriers before an early stage release their blocks over
  1–3 µs, the others over 0.3 µs, and a block that leaves late arrives late). A flag hand-off would have every
  waiting block see its producers `counter_us` after the last of them arrived (the trace's fastest departure).

`calibrate(traces)` fits these to traces at several positions (least squares over blocks and layers for
attention's two slopes); `simulate(cfg, costs, pos)` gives µs per token and each slot's span; `compare` prints the
simulated against the measured per slot. The fit uses only some positions: the others are the check (DESIGN.md,
the simulator; NOTES.md for the calibration).
"""
from __future__ import annotations

import dataclasses

import numpy as np

try:
    import numba
except ImportError:          # optional (the dev extra): without it `_share` runs its numpy loop, ~7× slower
    numba = None

from .. import plan, schedule
from ..model.config import ModelConfig
from ..worklists import Item, reads_cache, work_lists
from . import timing

# the stage whose units split the cache's positions over blocks (attention): its latency grows with them
ATTENTION = next(s.name for s in plan.STAGES if reads_cache(s))
SM_GBPS = 60.0          # one SM streaming alone (scripts/sm_bandwidth.py; NOTES.md, the simulator's calibration)


@dataclasses.dataclass
class Costs:
    hbm_tbps: float                                   # all SMs streaming: the same-run streaming read
    sm_gbps: float                                    # one SM streaming alone
    fixed_us: dict = dataclasses.field(default_factory=dict)     # slot label → a block's latency outside its bytes
    jitter_us: dict = dataclasses.field(default_factory=dict)    # slot label → the mean of a block's lateness
    position_ns: float = 0.0                          # attention: per cache position a block reads
    merge_us: float = 0.0                             # attention: folding a split kv head's partials
    barrier_us: dict = dataclasses.field(default_factory=dict)   # slot label → (first, last) departure after the
    #                                                               last arrival
    counter_us: float = 0.7                           # the last arrival → a polling block sees it (the fastest)


@dataclasses.dataclass(frozen=True)
class Design:
    """What a schedule changes that the simulator can price (the plan's Launch carries the rest: attention's
    splits, the grid, the early stages).
    early_bytes: what a block may hold of weights loaded ahead (None: the early loads of today, Launch.early_loads
    per thread of the next stage, where that stage is one of Launch.early; a number: a shared-memory ring of that
    many bytes, filled while the block waits with the weights of its next items in decode order, across stages).
    handoff: "barrier" (blocks leave over the trace's spread of departures, label by label) or "flag" (every
    block sees its producers counter_us after the last of them arrived: no spread; what per-block flags or
    data-as-flag would give if nothing else queued the polls), both slot by slot; or "counter": block by block
    (workbench.measure.dataflow), each item waiting for its own producer blocks only.
    deal: "today" (the plan's deals) or "heads" (each kv head's qkv rows, attention and O-projection share on a
    group of blocks: worklists.head_group), priced block by block.
    queue: 1 prices what the bytes in flight cost the latency-bound moments (block by block): a block that starts
    an item, its hand-off and first round trip included, waits behind the bytes every SM has in flight beyond
    what saturates HBM, (in flight)/hbm − counter_us. A streaming block keeps sm_gbps · counter_us in flight
    (Little's law at its own rate); a block loading ahead keeps all it asked for (`inflight`: at most this many
    bytes, a meter), and barriers release at counter_us, the queue spreading them instead of the trace. What
    rounds 7 and 12 measured (bytes issued ahead of a latency-bound stage cost it), as a what-if that ranks designs
    by their bytes in flight: it is not calibrated (today's kernel prices 5% under its trace with it)."""
    early_bytes: int | None = None
    handoff: str = "barrier"
    deal: str = "today"
    queue: int = 0
    inflight: int | None = None

    def __post_init__(self):
        if self.handoff not in ("barrier", "flag", "counter"):
            raise ValueError(f"handoff {self.handoff!r}: barrier, flag or counter")
        if self.deal not in ("today", "heads"):
            raise ValueError(f"deal {self.deal!r}: today or heads")


def _jitter(n: int, mean: float, salt: int) -> np.ndarray:
    """n lateness values about the median block: the quantiles (k + ½)/n of an exponential of this mean less its
    median, in an order fixed by `salt`. The last of the n is mean · ln(n) after the median one; any subset of
    them sees its own last, earlier."""
    if mean <= 0 or n == 0:
        return np.zeros(n)
    q = -mean * np.log(1.0 - (np.arange(n) + 0.5) / n) - mean * np.log(2.0)
    return np.random.default_rng(salt).permutation(q)


@dataclasses.dataclass
class Timeline:
    """One token, µs from its start: when each block left each slot's barrier before it and arrived at its own,
    and each slot's boundary (its blocks' mean departure from its barrier: what measured_spans measures)."""
    labels: list                                      # slot label per slot
    boundary_us: np.ndarray                           # [slots]
    start_us: np.ndarray                              # [slots, blocks]
    arrive_us: np.ndarray                             # [slots, blocks] (nan: no work in the slot)

    @property
    def us_per_token(self) -> float:
        return float(self.boundary_us[-1])

    def spans(self) -> np.ndarray:
        return np.diff(np.concatenate([[0.0], self.boundary_us]))


def _item_latency(it: Item, costs: Costs) -> float:
    if it.stage == ATTENTION:
        return it.positions * costs.position_ns / 1e3
    return 0.0


def _programs(cfg: ModelConfig, costs: Costs, pos: int, launch: plan.Launch, design: Design = Design()):
    """Per slot: each block's latency, bytes, how many of them it may load early (before the barrier it owes:
    Launch.early, Launch.early_loads per thread), whether it has work, the label, and the kv head of a block of a
    split head (−1: none), as [slots] of ([blocks] arrays..., label, heads)."""
    lists = work_lists(cfg, launch, pos)
    grid = launch.grid
    ring = design.early_bytes is not None
    by_slot: dict = {}
    for b, items in enumerate(lists):
        for it in items:
            by_slot.setdefault(it.slot, {}).setdefault(b, []).append(it)
    out = []
    for sl in schedule.slots(cfg):
        lat, nbytes, early = np.zeros(grid), np.zeros(grid), np.zeros(grid)
        busy = np.zeros(grid, dtype=bool)
        heads = np.full(grid, -1)                # a split kv head's blocks: its last one merges
        for b, mine in by_slot.get(sl.index, {}).items():
            busy[b] = True
            lat[b] = costs.fixed_us.get(sl.label, 0.0) + sum(_item_latency(it, costs) for it in mine)
            nbytes[b] = sum(it.bytes for it in mine)
            if ring:                             # any weights of the slot, whatever the stage
                early[b] = sum(it.weight_bytes for it in mine)
            elif mine[0].stage in launch.early and sl.index > 0:
                early[b] = mine[0].bytes
            split = [it for it in mine if it.merges]
            if split:
                heads[b] = b // split[0].merges
        jit = np.zeros(grid)
        jit[busy] = _jitter(int(busy.sum()), costs.jitter_us.get(sl.label, 0.0), sl.index)
        out.append((lat + jit, nbytes, early, busy, sl.label, heads))
    return out


def simulate(cfg: ModelConfig, costs: Costs, pos: int = 0, launch: plan.Launch = plan.Launch(),
             design: Design = Design()) -> Timeline:
    """The barrier design: a block leaves a barrier over the label's spread of departures (or a flag's, by the
    design), pays its latency, then streams what it has not loaded early; a block that has arrived at a barrier it
    owes to an early stage loads that stage's first bytes while it waits. All streams share HBM (see _share)."""
    progs = _programs(cfg, costs, pos, launch, design)
    grid, n = launch.grid, len(progs)
    if design.early_bytes is None:                # today: the next stage's first loads, the plan's early region
        cap, ahead = 4 * schedule.early_region(cfg, launch)[1], 1
    else:
        cap, ahead = design.early_bytes, n
    copies = _copies_ahead(cfg, launch)
    boundary = np.zeros(n)
    starts = np.zeros((n, grid))
    arrive = np.full((n, grid), np.nan)
    start = np.zeros(grid)                        # when each block leaves the previous barrier
    held = np.zeros((n, grid))                    # bytes of each slot a block has loaded ahead
    copied = np.zeros((n, grid))                  # of those, what Launch.ahead's copy brought
    for s, (lat, nbytes, early, busy, label, heads) in enumerate(progs):
        main = np.maximum(nbytes - held[s], 0.0)
        held[s] = copied[s] = 0.0
        # what each block asks for while it waits after this slot: its next slots' loadable bytes, in order
        want = np.zeros((n, grid))
        room = np.maximum(cap - (held - copied).sum(axis=0), 0.0)      # the copy has a region of its own
        for s2 in range(s + 1, min(n, s + 1 + ahead)):
            want[s2] = np.minimum(np.maximum(progs[s2][2] - held[s2], 0.0), room)
            room -= want[s2]
        # Launch.ahead: the copy posted after this slot's barrier asks for its bytes on top (its own region), and
        # what has not landed by the next barrier goes on loading while the block waits at that one
        want_copy = np.zeros((n, grid))
        for s2 in (s + 1, s + 2):
            if s2 in copies and copies[s2][0] in (s, s - 1):
                want_copy[s2] = np.maximum(copies[s2][1] - copied[s2], 0.0)
        early_want = want.copy()
        want += want_copy
        t_arrive, landed = _share(start + lat * busy, main, want.sum(axis=0), costs)
        for g in np.unique(heads[heads >= 0]):      # the last block of a split head folds the partials in
            mine = np.flatnonzero(heads == g)
            t_arrive[mine[np.argmax(t_arrive[mine])]] += costs.merge_us
        starts[s] = start
        arrive[s, busy] = t_arrive[busy]
        first, last = costs.barrier_us.get(label, (costs.counter_us, costs.counter_us))
        if design.handoff == "flag":
            first = last = costs.counter_us
        dep = np.random.default_rng(10_000 + s).permutation(np.linspace(first, last, grid))
        start = float(np.nanmax(t_arrive)) + dep
        boundary[s] = float(start.mean())
        # what landed by each block's departure, given to its next slots in order (the rest they stream as theirs)
        own = np.where(np.isnan(t_arrive), start, t_arrive)
        took = np.maximum(landed - own, 1e-9)
        got = want.sum(axis=0) * np.clip((start - own) / took, 0.0, 1.0)
        for s2 in range(s + 1, n):
            part = np.minimum(want[s2], got)
            held[s2] += part
            copied[s2] += np.maximum(part - early_want[s2], 0.0)    # the copy's share comes after the early loads
            got -= part
    return Timeline([p[4] for p in progs], boundary, starts, arrive)


def _copies_ahead(cfg: ModelConfig, launch: plan.Launch) -> dict:
    """Launch.ahead as the model takes it: {slot of the stage copied ahead: (the slot after whose barrier the copy is
    posted, [blocks] bytes copied)}: each block's first units of the stage, one for each of its first warps."""
    a = schedule.ahead(cfg, launch)
    if a is None:
        return {}
    per = np.array(a.block_bytes(launch.grid), dtype=float)
    return {sl.index: (sl.index - 2, per) for sl in schedule.slots(cfg)
            if any(name == a.stage for name, _ in sl.stages) and sl.index >= 2}


def _share(t_main: np.ndarray, main: np.ndarray, early: np.ndarray, costs: Costs):
    """One slot of the fluid model. Block b streams `main` bytes from t_main[b] and arrives when done; from its
    arrival it loads early[b] bytes of the next slot. Every stream in flight gets an equal share of hbm_tbps, at
    most sm_gbps. → (arrivals, when each block's early loads landed: its arrival where it has none). Compiled
    (`_share_loop`) where numba imports; `_share_python` is the reference, and the two agree bit for bit."""
    if numba is None:
        return _share_python(t_main, main, early, costs)
    f64 = np.float64
    return _share_loop(np.asarray(t_main, f64), np.array(main, f64), np.asarray(early, f64),
                       float(costs.sm_gbps * 1e3), float(costs.hbm_tbps * 1e6))


def _jit(fn):
    return numba.njit(cache=True)(fn) if numba is not None else fn


@_jit
def _share_loop(t_main, left, early, cap, hbm):
    """`_share_python`'s loop block by block, the same operations in the same order (`left`: main, consumed)."""
    n = len(t_main)
    pre = np.zeros(n)
    arrived = np.full(n, np.nan)
    landed = np.full(n, np.nan)
    for b in range(n):
        if left[b] <= 0:
            arrived[b] = t_main[b]
    t = t_main.min()
    streaming = np.zeros(n, np.bool_)
    loading = np.zeros(n, np.bool_)
    while True:
        all_done = True
        all_landed = True
        for b in range(n):
            done = not np.isnan(arrived[b])
            if done and np.isnan(landed[b]) and pre[b] >= early[b] - 1e-6 and arrived[b] <= t + 1e-9:
                landed[b] = max(arrived[b], t)
            all_done = all_done and done
            all_landed = all_landed and not np.isnan(landed[b])
        if all_done and all_landed:
            return arrived, landed
        k = 0
        pending = False
        first = 0.0
        for b in range(n):
            done = not np.isnan(arrived[b])
            streaming[b] = not done and t_main[b] <= t + 1e-9
            loading[b] = done and np.isnan(landed[b]) and arrived[b] <= t + 1e-9
            k += streaming[b] + loading[b]
            if (not done and t_main[b] > t + 1e-9) or (done and arrived[b] > t + 1e-9):
                e = arrived[b] if done else t_main[b]
                if not pending or e < first:
                    first = e
                pending = True
        if k == 0 and not pending:
            raise ValueError("min() arg is an empty sequence")       # where _share_python fails
        rate = 0.0
        if k:
            rate = hbm / k
            if not rate < cap:
                rate = cap
        t_next = first
        found = pending
        m = 0.0
        any_s = False
        for b in range(n):
            if streaming[b] and (not any_s or left[b] < m):
                m = left[b]
                any_s = True
        if any_s:
            e = t + m / rate
            if not found or e < t_next:
                t_next = e
            found = True
        any_l = False
        for b in range(n):
            if loading[b] and (not any_l or early[b] - pre[b] < m):
                m = early[b] - pre[b]
                any_l = True
        if any_l:
            e = t + m / rate
            if not found or e < t_next:
                t_next = e
        for b in range(n):
            if streaming[b]:
                left[b] -= rate * (t_next - t)
            if loading[b]:
                pre[b] += rate * (t_next - t)
        t = t_next
        for b in range(n):
            if streaming[b] and left[b] <= 1e-6:
                arrived[b] = t


def _share_python(t_main: np.ndarray, main: np.ndarray, early: np.ndarray, costs: Costs):
    """`_share` in numpy, the reference."""
    n = len(t_main)
    cap = costs.sm_gbps * 1e3                      # bytes per µs
    left, pre = main.astype(float).copy(), np.zeros(n)
    arrived = np.where(left <= 0, t_main, np.nan)
    landed = np.full(n, np.nan)
    t = float(t_main.min())
    while True:
        done = ~np.isnan(arrived)
        fresh = done & np.isnan(landed) & (pre >= early - 1e-6) & (arrived <= t + 1e-9)
        landed[fresh] = np.maximum(arrived[fresh], t)
        if done.all() and not np.isnan(landed).any():
            return arrived, landed
        streaming = (~done) & (t_main <= t + 1e-9)
        loading = done & np.isnan(landed) & (arrived <= t + 1e-9)
        k = int(streaming.sum() + loading.sum())
        events = []
        pending = ((~done) & (t_main > t + 1e-9)) | (done & (arrived > t + 1e-9))
        if pending.any():
            events.append(float(np.where(done, arrived, t_main)[pending].min()))
        rate = min(cap, costs.hbm_tbps * 1e6 / k) if k else 0.0
        if streaming.any():
            events.append(t + float(left[streaming].min()) / rate)
        if loading.any():
            events.append(t + float((early - pre)[loading].min()) / rate)
        t_next = min(events)
        left[streaming] -= rate * (t_next - t)
        pre[loading] += rate * (t_next - t)
        t = t_next
        now = streaming & (left <= 1e-6)
        arrived[now] = t


# ---- calibration ---------------------------------------------------------------------------------------------------

def _observed(trace, launch: plan.Launch):
    """Per slot label of a trace: the median block's work and how much later the last block arrives than it (µs,
    medians over the recorded steps and the label's slots), and attention's per-block rows."""
    cfg = trace.cfg
    t = trace.stamps[1:]                                         # the first step warms up
    _, work, _ = timing.spans(t)
    work = work / 1e3
    pos = trace.pos0 + t.shape[0] // 2 + 1
    busy = _programs(cfg, Costs(1.0, 1.0), pos, launch)
    med, late = {}, {}
    for s, (label, _) in enumerate(trace.slot_names):
        b = busy[s][3]
        if not b.any():
            continue
        w = work[:, s][:, b]
        m = np.median(w, axis=1)
        med.setdefault(label, []).extend(m)
        late.setdefault(label, []).extend(w.max(axis=1) - m)
    return ({k: float(np.median(v)) for k, v in med.items()}, {k: float(np.median(v)) for k, v in late.items()},
            pos, work)


def _simulated(cfg, costs: Costs, pos: int, launch: plan.Launch):
    tl = simulate(cfg, costs, pos, launch)
    work = tl.arrive_us - tl.start_us
    med, late = {}, {}
    for s, label in enumerate(tl.labels):
        w = work[s][~np.isnan(work[s])]
        if w.size:
            med.setdefault(label, []).append(float(np.median(w)))
            late.setdefault(label, []).append(float(w.max() - np.median(w)))
    return {k: float(np.median(v)) for k, v in med.items()}, {k: float(np.median(v)) for k, v in late.items()}


def calibrate(traces: list, hbm_tbps: float, sm_gbps: float, launch: plan.Launch = plan.Launch(),
              rounds: int = 6) -> Costs:
    """Costs fitted to timing traces (workbench.measure.trace.Trace, one model, any positions). hbm_tbps: the same-run
    streaming read; sm_gbps: one SM's streaming rate (measured alone). The departures are read off the stamps, label
    by label, and counter_us is the fastest first departure; attention's latency is a least-squares line in the
    positions a block reads, plus the merge where the positions are split; every other slot label's latency and
    jitter are moved until the simulated median block and last arrival match the traces' (a few rounds of the
    simulator itself, so the early loads and HBM sharing it models are not counted twice)."""
    cfg = traces[0].cfg
    costs = Costs(hbm_tbps=hbm_tbps, sm_gbps=sm_gbps)
    dep: dict = {}
    rows, ys, merge = [], [], []
    obs = [_observed(tr, launch) for tr in traces]
    for tr, (_, _, pos, work) in zip(traces, obs):
        t = tr.stamps[1:]
        arrive, leave = t[..., 0].astype(np.int64), t[..., 1].astype(np.int64)
        last_in = arrive.max(axis=2)
        first, last = (leave.min(axis=2) - last_in) / 1e3, (leave.max(axis=2) - last_in) / 1e3   # [steps, slots]
        for s, (label, _) in enumerate(tr.slot_names):
            dep.setdefault(label, []).extend(zip(first[:, s], last[:, s]))
        lists = work_lists(cfg, launch, pos)
        arrive_us = arrive / 1e3
        for s, (label, _) in enumerate(tr.slot_names):
            if label != ATTENTION:
                continue
            mine = [(b, it) for b, items in enumerate(lists) for it in items if it.slot == s]
            rate = min(sm_gbps * 1e3, hbm_tbps * 1e6 / len(mine))
            last = {}                                            # a split head's last block, each step: its merge
            if mine[0][1].merges:
                for g in range(cfg.n_kv_heads):
                    bl = [b for b, it in mine if b // it.merges == g]
                    a = arrive_us[:, s, bl]
                    last[g] = (np.array(bl)[a.argmax(axis=1)], np.sort(a, axis=1))
            for b, it in mine:
                w = work[:, s, b].copy()
                if it.merges:                                    # the steps it merged: only up to its own data
                    g = b // it.merges
                    merged = last[g][0] == b
                    w[merged] = np.nan
                rows.append([1.0, it.positions / 1e3])
                ys.append(float(np.nanmedian(w)) - it.bytes / rate if np.isfinite(w).any() else np.nan)
            for g, (who, a) in last.items():                     # the last arrival after the one before it
                merge.extend(a[:, -1] - a[:, -2])
    costs.barrier_us = {k: tuple(float(x) for x in np.median(np.array(v), axis=0)) for k, v in dep.items()}
    costs.counter_us = min(first for first, _ in costs.barrier_us.values())
    if rows:
        ok = np.isfinite(ys)
        a, *_ = np.linalg.lstsq(np.array(rows)[ok], np.array(ys)[ok], rcond=None)
        costs.fixed_us[ATTENTION], costs.position_ns = float(a[0]), float(a[1])
        costs.merge_us = float(np.median(merge)) if merge else 0.0
    labels = {k for m, _, _, _ in obs for k in m} - {ATTENTION}
    for _ in range(rounds):
        fix = {k: [] for k in labels}
        jit = {k: [] for k in labels}
        for tr, (m_med, m_late, pos, _) in zip(traces, obs):
            s_med, s_late = _simulated(cfg, costs, pos, launch)
            for k in labels:
                if k in m_med and k in s_med:
                    fix[k].append(m_med[k] - s_med[k])
                    jit[k].append(m_late[k] - s_late[k])
        n = np.log(launch.grid)
        for k in labels:
            costs.fixed_us[k] = costs.fixed_us.get(k, 0.0) + float(np.mean(fix[k]))
            costs.jitter_us[k] = max(0.0, costs.jitter_us.get(k, 0.0) + float(np.mean(jit[k])) / n)
    return costs


def measured_spans(trace) -> np.ndarray:
    """[steps − 1, slots] µs from the blocks' mean departure from the barrier before to their mean departure from
    this one (the first step left out): the simulator's boundaries, which sum to the step's time as the
    releases' do."""
    leave = trace.stamps[..., 1].astype(np.float64).mean(axis=2) / 1e3      # [steps, slots]
    flat = leave.reshape(-1)
    return np.diff(flat)[trace.stamps.shape[1] - 1:].reshape(-1, trace.stamps.shape[1])


def measured_us(trace) -> float:
    """The trace's µs per token: the median step (its first left out)."""
    return float(np.median(measured_spans(trace).sum(axis=1)))


def compare(trace, costs: Costs, launch: plan.Launch = plan.Launch()) -> str:
    """Simulated against measured, per slot label: µs per token (summed over layers), and the departures from its
    barrier after the last arrival, first and last (µs, medians)."""
    cfg = trace.cfg
    pos = trace.pos0 + trace.stamps.shape[0] // 2 + 1
    sim = simulate(cfg, costs, pos, launch)
    meas = np.median(measured_spans(trace), axis=0)
    t = trace.stamps[1:]
    last_in = t[..., 0].astype(np.int64).max(axis=2)
    leave = t[..., 1].astype(np.int64)
    m_dep = np.median((leave.min(axis=2) - last_in) / 1e3, axis=0), np.median((leave.max(axis=2) - last_in) / 1e3,
                                                                           axis=0)
    s_dep = np.full((len(sim.labels), t.shape[2]), np.nan)     # the token's last barrier leads into the next token
    s_dep[:-1] = sim.start_us[1:] - np.nanmax(sim.arrive_us, axis=1)[:-1, None]
    spans = sim.spans()
    out = [f"{cfg.name} at position {pos}: simulated against the trace (µs per token; departures in µs after the "
           f"last arrival, first–last)",
           f"{'slot':30s} {'measured':>9s} {'simulated':>10s} {'error':>7s} {'departures':>13s} {'simulated':>13s}"]
    for label in dict.fromkeys(sim.labels):
        idx = [i for i, x in enumerate(sim.labels) if x == label]
        m_us, s_us = float(meas[idx].sum()), float(spans[idx].sum())
        md = f"{np.median(m_dep[0][idx]):.2f}–{np.median(m_dep[1][idx]):.2f}"
        d = s_dep[idx][~np.isnan(s_dep[idx]).any(axis=1)]
        sd = f"{np.median(d.min(axis=1)):.2f}–{np.median(d.max(axis=1)):.2f}" if len(d) else "—"
        out.append(f"{label:30s} {m_us:9.1f} {s_us:10.1f} {100 * (s_us / m_us - 1):+6.1f}% {md:>13s} {sd:>13s}")
    m = measured_us(trace)
    out.append(f"{'total':30s} {m:9.1f} {sim.us_per_token:10.1f} {100 * (sim.us_per_token / m - 1):+6.1f}%")
    return "\n".join(out)


# ---- designs, priced --------------------------------------------------------------------------------------------

def parse_design(text: str) -> tuple[str, Design, dict]:
    """"NAME:field=value,..." → (name, Design, Launch fields): a field of Design (early_bytes, handoff) or of the
    plan's Launch (attn_min_chunk, attn_single, grid, early, ...). "today" alone is the kernel as it is."""
    name, _, rest = text.partition(":")
    design, launch = {}, {}
    d_fields = {f.name: f for f in dataclasses.fields(Design)}
    l_fields = {f.name: f for f in dataclasses.fields(plan.Launch)}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"design {name!r}: {part!r} is not FIELD=VALUE")
        if key not in d_fields and key not in l_fields:
            raise ValueError(f"design {name!r}: no field {key!r} (Design: {', '.join(d_fields)}; Launch: "
                             f"{', '.join(l_fields)})")
        v: object = value
        if value.lstrip("-").isdigit():
            v = int(value)
        elif key in ("early", "ahead"):
            v = tuple(filter(None, value.split("+")))
        (design if key in d_fields else launch)[key] = v
    return name or "today", Design(**design), launch

"""Each block's work for one token, in decode order, derived from the plan: the per-SM work lists of the dataflow
schedule (DESIGN.md, the decode step), and what the schedule simulator (workbench.measure.simulate) runs.

An `Item` is one block's share of one stage at one layer: how many of the stage's units the block takes (the
stage's deal: warps round-robin, block-fastest, contiguous by blocks, or block 0 alone), and the bytes those units
must bring from memory (their weight rows; for attention, the K and V of the block's chunk of positions). Items
carry no timing: costs are measured (the simulator calibrates them on the kernel's own traces).

A block's list follows `schedule.execution`, so it is the order the barrier design runs; `slot` is the grid barrier
each item ends before (schedule.slots), which the barrier design waits on and a dataflow design replaces with the
hand-offs of `schedule.dependencies`.
"""
from __future__ import annotations

import collections
import dataclasses

from . import plan, schedule
from .model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Item:
    stage: str
    layer: int                 # -1: a token stage
    slot: int                  # the grid barrier it ends before (schedule.slots' index)
    units: int                 # the stage's units this block takes
    weight_bytes: int          # weight bytes those units read
    cache_bytes: int           # K/V bytes (attention's chunk)
    positions: int = 0         # attention: cache positions the block reads
    merges: int = 0            # attention: splits whose partials this block merges (0: no merge)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes


def reads_cache(stage: plan.Stage) -> bool:
    """Whether the stage reads the cache's positions 0..pos (attention: its units are split by positions)."""
    return any(plan.BUFFERS[u.buffer].kind == "cache" and u.positions == "0..pos" for u in stage.reads)


def attention_split(cfg: ModelConfig, launch: plan.Launch, pos: int) -> tuple[int, int]:
    """(splits S, chunk of positions) of each kv head's positions 0..pos: attn_splits in the attention section."""
    n = pos + 1
    if n <= launch.attn_single_positions(cfg):
        return 1, n
    s = min(-(-n // launch.attn_chunk(cfg)), launch.max_splits(cfg))
    return s, -(-n // s)


def _attention(cfg: ModelConfig, launch: plan.Launch, pos: int, block: int) -> tuple[int, int, int, int]:
    """(kv heads, positions, cache bytes, merges) block `block` takes in attention at `pos`."""
    s, chunk = attention_split(cfg, launch, pos)
    if block >= cfg.n_kv_heads * s:
        return 0, 0, 0, 0
    split = block % s
    start = split * chunk
    positions = max(0, min(chunk, pos + 1 - start))
    per_position = 2 * cfg.head_dim * 2                  # one K row and one V row of hd bf16
    return 1, positions, positions * per_position, (s if s > 1 else 0)


def work_lists(cfg: ModelConfig, launch: plan.Launch = plan.Launch(), pos: int = 0) -> list[list[Item]]:
    """[block] → its items of one token at position `pos`, in decode order (items of no units left out)."""
    slot_of = {}
    for sl in schedule.slots(cfg):
        for st in sl.stages:
            slot_of[st] = sl.index
    lists: list[list[Item]] = [[] for _ in range(launch.grid)]
    counts: dict = {}                         # stage → {block: units}, the same at every layer
    for name, layer in schedule.execution(cfg):
        st = plan.stage(name)
        n = st.units(cfg, launch)
        per_unit = schedule.stage_weight_bytes(cfg, name) / max(1, n)
        split = reads_cache(st)
        if name not in counts and not split:
            counts[name] = collections.Counter(b for blocks in unit_blocks(cfg, st, launch) for b in blocks)
        for b in range(launch.grid):
            if split:
                units, positions, cache, merges = _attention(cfg, launch, pos, b)
            else:
                units, positions, cache, merges = counts[name][b], 0, 0, 0
            if units:
                lists[b].append(Item(name, layer, slot_of[name, layer], units, round(units * per_unit), cache,
                                     positions, merges))
    return lists


# ---- hand-offs: which producer blocks each consumer block waits for ------------------------------------------------

def unit_blocks(cfg: ModelConfig, stage: plan.Stage, launch: plan.Launch, pos: int = 0,
                deal: str | None = None) -> list[tuple[int, ...]]:
    """[unit] → the blocks that run it (several for a kv head whose positions are split over blocks). `deal`
    overrides the stage's own: "heads" is the dataflow design's (see `head_group`)."""
    n, grid = stage.units(cfg, launch), launch.grid
    if stage.runs_on == "block0":
        return [(0,)] * n
    if (deal or stage.deal) == "heads":
        return _head_deal(cfg, stage, launch, pos)
    if reads_cache(stage):
        s, _ = attention_split(cfg, launch, pos)
        return [tuple(range(u * s, (u + 1) * s)) for u in range(n)]
    if stage.deal == "blocks":
        out = []
        for b in range(grid):
            out += [(b,)] * len(plan.block_units(n, grid, b))
        return out
    warps = launch.consumer_warps
    lanes = grid * warps
    if stage.deal == "across":
        return [((u % lanes) % grid,) for u in range(n)]
    return [((u % lanes) // warps,) for u in range(n)]


# ---- the dataflow design's deal: each kv head on a group of blocks -------------------------------------------------
# What a schedule without grid barriers inside the attention block needs (NOTES.md, round 21): a kv head's q, k and
# v row pairs, its attention and its share of the O-projection on one group of blocks, so that each of those
# hand-offs waits for the group's blocks only. Priced by workbench.measure.dataflow before the kernel has it.

def head_group(cfg: ModelConfig, launch: plan.Launch, head: int) -> range:
    """The blocks of kv head `head`'s group: the grid cut into n_kv_heads contiguous groups."""
    return plan.block_units(launch.grid, cfg.n_kv_heads, head)


def _head_width(cfg: ModelConfig, buffer: str) -> int | None:
    """Elements of one kv head's share of a row of `buffer` (None: a buffer not laid out by heads, Buffer.heads)."""
    b = plan.BUFFERS[buffer]
    if not b.heads:
        return None
    return (cfg.kv_dim if b.kind == "cache" else b.value_elements(cfg)) // cfg.n_kv_heads


def kv_head_of(cfg: ModelConfig, stage: plan.Stage, unit: int) -> int | None:
    """The kv head a unit works for: the head of the first rows it writes or reads of a buffer laid out by heads
    (None: it touches none, or all of one)."""
    for use in stage.writes + stage.reads:
        width = _head_width(cfg, use.buffer) if use.rows is not None else None
        rows = use.rows(cfg, unit) if width else ()
        if rows:
            lo, hi = rows[0]
            if hi - lo <= width and lo // width == (hi - 1) // width:
                return lo // width
    return None


def split_by_heads(cfg: ModelConfig, stage: plan.Stage) -> plan.Stage:
    """The stage with each unit split by kv heads: unit (h, u) reads only head h's part of the activation laid out
    by heads that unit u reads whole, and only the matching columns of its weight row, and adds its share into
    what u wrote (split-K; the adds in fixed point, so their order does not change the sum). The O-projection
    split this way needs only its own kv head's attention (a stage that reads no such activation whole is
    returned as it is)."""
    whole = [u for u in stage.reads if _head_width(cfg, u.buffer) and plan.BUFFERS[u.buffer].kind == "activation"
             and (u.rows is None or u.rows(cfg, 0) == ((0, plan.BUFFERS[u.buffer].value_elements(cfg)),))]
    weight = [u for u in stage.reads if plan.BUFFERS[u.buffer].kind == "weight" and u.rows is not None]
    if len(whole) != 1 or len(weight) != 1:
        return stage
    act, w = whole[0], weight[0]
    width, n = _head_width(cfg, act.buffer), cfg.n_kv_heads
    inner = stage.units

    def head_rows(c, unit):
        h = unit // inner(c, plan.Launch())
        return ((h * width, (h + 1) * width),)

    def weight_rows(c, unit):
        h, u = divmod(unit, inner(c, plan.Launch()))
        (lo, _), = w.rows(c, u)
        return ((lo + h * width, lo + (h + 1) * width),)

    reads = tuple(dataclasses.replace(u, rows=head_rows) if u is act else
                  dataclasses.replace(u, rows=weight_rows) if u is w else u for u in stage.reads)
    writes = tuple(dataclasses.replace(u, rows=None, atomic=True) for u in stage.writes)
    return dataclasses.replace(stage, reads=reads, writes=writes, units=lambda c, l: n * inner(c, l),
                               unit=f"{stage.unit}'s share of one kv head", deal="heads")


def _head_deal(cfg: ModelConfig, stage: plan.Stage, launch: plan.Launch, pos: int) -> list[tuple[int, ...]]:
    """The "heads" deal: each unit on its kv head's group of blocks, the group's units contiguous by blocks;
    attention's positions split over the first blocks of its head's group."""
    n = stage.units(cfg, launch)
    if reads_cache(stage):
        s, _ = attention_split(cfg, launch, pos)
        return [tuple(head_group(cfg, launch, u)[:s]) for u in range(n)]
    heads = [kv_head_of(cfg, stage, u) for u in range(n)]
    if None in heads:
        raise ValueError(f"{stage.name}: a unit touches no one kv head's rows, so it cannot be dealt by heads")
    out: list = [None] * n
    for h in range(cfg.n_kv_heads):
        mine = [u for u in range(n) if heads[u] == h]
        group = head_group(cfg, launch, h)
        for k, u in enumerate(mine):
            out[u] = (group[k * len(group) // len(mine)],)
    return out


def _rows_by_block(cfg, stage, use, launch, pos, deal=None) -> dict:
    """{block: set of (start, stop) rows} the stage's units on each block touch through `use` (None: all rows)."""
    out: dict = {}
    for u, blocks in enumerate(unit_blocks(cfg, stage, launch, pos, deal)):
        rows = None if use.rows is None else tuple(use.rows(cfg, u))
        for b in blocks:
            if rows is None or out.get(b, ()) is None:
                out[b] = None
            elif rows:
                out.setdefault(b, set()).update(rows)
    return out


@dataclasses.dataclass(frozen=True)
class Handoff:
    consumer: str
    buffer: str
    producer: str
    kind: str                  # "block": a block barrier (each block needs only itself); "counter": each block
    #                            waits for some producer blocks; "grid": every block for every producer block
    fan_in: tuple              # (min, median, max) producer blocks a consumer block waits for
    producers: int             # producer blocks in all
    consumers: int             # consumer blocks


def _merged(rows):
    """Row ranges as sorted disjoint [start, stop] intervals (None: every row)."""
    if rows is None:
        return None
    out: list = []
    for lo, hi in sorted(rows):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _meets(a, b) -> bool:
    """Whether two sorted interval lists share a row (None: every row)."""
    if a is None or b is None:
        return True
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def fan_in(cfg: ModelConfig, consumer: plan.Stage, use: plan.Use, producer: plan.Stage, launch: plan.Launch,
           pos: int = 0) -> dict[int, tuple[int, ...]]:
    """{consumer block: the producer blocks it waits for}: those that wrote a row of `use.buffer` the block's units
    read (the stages as given: a design may deal them otherwise than the plan)."""
    wrote = _rows_by_block(cfg, producer, next(w for w in producer.writes if w.buffer == use.buffer), launch, pos)
    wrote = {b: _merged(rows) for b, rows in wrote.items()}
    need = {c: _merged(want) for c, want in _rows_by_block(cfg, consumer, use, launch, pos).items()}
    return {c: tuple(b for b, rows in wrote.items() if _meets(want, rows)) for c, want in need.items()}


def handoffs(cfg: ModelConfig, launch: plan.Launch = plan.Launch(), pos: int = 0,
             stages: dict | None = None) -> list[Handoff]:
    """For every read of something the same step wrote (schedule.producer), which producer blocks each consumer
    block needs and so the cheapest hand-off that orders them: the dataflow schedule's choice, dependency by
    dependency (the barrier design spends a grid barrier wherever schedule.slots puts one). `stages`: the plan's
    stages as a design deals them (default the plan's own)."""
    stages = stages or {s.name: s for s in plan.STAGES}
    out = []
    for s in plan.STAGES:
        s = stages[s.name]
        layer = 1 if (s.scope == "layer" and cfg.n_layers > 1) else (0 if s.scope == "layer" else -1)
        for use in s.reads:
            if not use.active(cfg) or plan.BUFFERS[use.buffer].kind == "weight":
                continue
            prod = schedule.producer(cfg, use.buffer, s.name, layer)
            if prod is None:
                continue
            p = stages[prod[0]]
            fan = fan_in(cfg, s, use, p, launch, pos)
            wrote = _rows_by_block(cfg, p, next(w for w in p.writes if w.buffer == use.buffer), launch, pos)
            sizes = sorted(len(v) for v in fan.values())
            if all(set(v) <= {c} for c, v in fan.items()):
                kind = "block"
            elif all(len(v) == len(wrote) for v in fan.values()):
                kind = "grid"
            else:
                kind = "counter"
            out.append(Handoff(s.name, use.buffer, p.name, kind,
                               (sizes[0], sizes[len(sizes) // 2], sizes[-1]) if sizes else (0, 0, 0),
                               len(wrote), len(fan)))
    return out


def format_handoffs(rows: list[Handoff]) -> str:
    out = [f"{'consumer':18s} {'reads':10s} {'from':18s} {'hand-off':9s} {'fan-in min/median/max':>22s} "
           f"{'of':>4s} {'blocks':>6s}"]
    for h in rows:
        out.append(f"{h.consumer:18s} {h.buffer:10s} {h.producer:18s} {h.kind:9s} "
                   f"{'/'.join(map(str, h.fan_in)):>22s} {h.producers:4d} {h.consumers:6d}")
    return "\n".join(out)

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

def unit_blocks(cfg: ModelConfig, stage: plan.Stage, launch: plan.Launch, pos: int = 0) -> list[tuple[int, ...]]:
    """[unit] → the blocks that run it (several for a kv head whose positions are split over blocks)."""
    n, grid = stage.units(cfg, launch), launch.grid
    if stage.runs_on == "block0":
        return [(0,)] * n
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


def _rows_by_block(cfg, stage, use, launch, pos) -> dict:
    """{block: set of (start, stop) rows} the stage's units on each block touch through `use` (None: all rows)."""
    out: dict = {}
    for u, blocks in enumerate(unit_blocks(cfg, stage, launch, pos)):
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


def handoffs(cfg: ModelConfig, launch: plan.Launch = plan.Launch(), pos: int = 0) -> list[Handoff]:
    """For every read of something the same step wrote (schedule.producer), which producer blocks each consumer
    block needs and so the cheapest hand-off that orders them: the dataflow schedule's choice, dependency by
    dependency (the barrier design spends a grid barrier wherever schedule.slots puts one)."""
    out = []
    for s in plan.STAGES:
        layer = 1 if (s.scope == "layer" and cfg.n_layers > 1) else (0 if s.scope == "layer" else -1)
        for use in s.reads:
            if not use.active(cfg) or plan.BUFFERS[use.buffer].kind == "weight":
                continue
            prod = schedule.producer(cfg, use.buffer, s.name, layer)
            if prod is None:
                continue
            p = plan.stage(prod[0])
            wrote = _rows_by_block(cfg, p, next(w for w in p.writes if w.buffer == use.buffer), launch, pos)
            need = _rows_by_block(cfg, s, use, launch, pos)
            fan = {c: {b for b, rows in wrote.items() if schedule._overlap(want, rows)} for c, want in need.items()}
            sizes = sorted(len(v) for v in fan.values())
            if all(v <= {c} for c, v in fan.items()):
                kind = "block"
            elif all(len(v) == len(wrote) for v in fan.values()):
                kind = "grid"
            else:
                kind = "counter"
            out.append(Handoff(s.name, use.buffer, p.name, kind,
                               (sizes[0], sizes[len(sizes) // 2], sizes[-1]) if sizes else (0, 0, 0),
                               len(wrote), len(need)))
    return out


def format_handoffs(rows: list[Handoff]) -> str:
    out = [f"{'consumer':18s} {'reads':10s} {'from':18s} {'hand-off':9s} {'fan-in min/median/max':>22s} "
           f"{'of':>4s} {'blocks':>6s}"]
    for h in rows:
        out.append(f"{h.consumer:18s} {h.buffer:10s} {h.producer:18s} {h.kind:9s} "
                   f"{'/'.join(map(str, h.fan_in)):>22s} {h.producers:4d} {h.consumers:6d}")
    return "\n".join(out)

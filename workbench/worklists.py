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

import dataclasses

from . import plan, schedule
from .model.config import ModelConfig

NV_WARP = 32


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


def units_of_block(stage: plan.Stage, n: int, launch: plan.Launch, block: int) -> int:
    """How many of a stage's n units block `block` takes, as the stage's deal gives them (kernels/lib/stream.cuh)."""
    grid = launch.grid
    if stage.runs_on == "block0":
        return n if block == 0 else 0
    if stage.deal == "blocks":
        return len(plan.block_units(n, grid, block))
    warps = launch.consumer_warps
    if stage.deal == "across":                  # unit u on warp u % (grid·warps), warps numbered block-fastest
        lanes = grid * warps
        return sum(len(range(w * grid + block, n, lanes)) for w in range(warps))
    lanes = grid * warps                        # "warps": numbered block by block
    return sum(len(range(block * warps + w, n, lanes)) for w in range(warps))


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
    for name, layer in schedule.execution(cfg):
        st = plan.stage(name)
        n = st.units(cfg, launch)
        per_unit = schedule.stage_weight_bytes(cfg, name) / max(1, n)
        reads_cache = any(plan.BUFFERS[u.buffer].kind == "cache" and u.positions == "0..pos" for u in st.reads)
        for b in range(launch.grid):
            if reads_cache:
                units, positions, cache, merges = _attention(cfg, launch, pos, b)
            else:
                units, positions, cache, merges = units_of_block(st, n, launch, b), 0, 0, 0
            if units:
                lists[b].append(Item(name, layer, slot_of[name, layer], units, round(units * per_unit), cache,
                                     positions, merges))
    return lists

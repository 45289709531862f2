"""The decode step over N ranks, as reference math: every stage of the plan run by every rank on its share of the
weights (shard.Sharding), with the exchanges the ranks' kernels must make, at the points the plan's data flow
puts them:

* a stage that reads a weight split by its input columns (shard.splits_inputs: Wo, Wd) and updates a whole buffer
  it also reads (the residual x) computes a partial sum on each rank, and the update is their sum: an all-reduce;
* the LM head's vocabulary slices are joined (the logits in vocabulary order), and the greedy token is the best
  of the ranks' own (value, index) pairs, the first index on a tie (merge_argmax), as one kernel's argmax is.

tp_forward with N = 1 is reference.forward; for N > 1 it must agree with it to fp64 rounding, which is the test
that the split and the exchanges are right (tests/test_tp.py). It records every exchange (stage, layer, bytes),
which is what a deferred all-reduce has to hide.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import plan, schedule
from ..reference import _IO, KVCache, _integers, store_kv, view
from .shard import Sharding, splits_inputs


@dataclasses.dataclass(frozen=True)
class Exchange:
    stage: str
    layer: int
    kind: str                  # "all-reduce" (a partial sum of the residual) or "gather" (the LM head's slices)
    bytes_per_rank: int        # per token


def reduction(stage: plan.Stage) -> str | None:
    """The buffer whose update is an all-reduce of partials: written and read by the stage, which also reads a weight
    split by its inputs (the residual projections, or a stage fused with one); None for stages that need no
    exchange."""
    reads = {u.buffer for u in stage.reads}
    writes = {u.buffer for u in stage.writes}
    both = sorted(writes & reads)
    return both[0] if both and any(splits_inputs(b) for b in reads) else None


class _RankIO(_IO):
    """One rank's view of a stage: its weight slices, its share of the cache, the replicated and its split
    activations, and zeros in place of the residual base where the stage's output is a partial sum."""

    def __init__(self, w, sh: Sharding, r: int, state: dict, cache: KVCache, positions, tokens, layer, xp, dtype,
                 zero: str | None):
        super().__init__(w, sh.cfg, state, cache, positions, tokens, layer, xp, dtype)
        self.sh, self.r, self.zero = sh, r, zero

    def act(self, buffer):
        v = super().act(buffer)
        return self.xp.zeros_like(v) if buffer == self.zero else v

    def weight(self, name):
        return self.sh.weight(name, super().weight(name), self.r)


def merge_argmax(pairs) -> tuple[float, int]:
    """The ranks' (best value, its vocabulary index) pairs → the overall best, the lowest index on a tie."""
    best = None
    for value, index in pairs:
        if best is None or value > best[0] or (value == best[0] and index < best[1]):
            best = (value, index)
    return best


@dataclasses.dataclass
class TpResult:
    logits: object             # [n, V] (or the rows asked for), joined from the ranks' slices
    tokens: list               # the greedy token of every row, merged from the ranks' own argmaxes
    caches: list               # [KVCache per rank], each [L, Hkv/N, max_seq, hd]
    exchanges: list            # [Exchange] of one step, in the order the step makes them


def tp_forward(source, tokens, ranks: int, positions=None, *, caches: list | None = None, kv_bf16: bool = True,
               dtype=np.float64) -> TpResult:
    """Feed tokens[i] at positions[i] (default 0..n-1), teacher-forced as reference.forward does, with every stage
    split over `ranks` and the exchanges made explicitly."""
    w = view(source, dtype)
    cfg, xp, dtype = w.cfg, w.xp, w.dtype
    sh = Sharding(cfg, ranks)
    tokens = _integers(xp, tokens, "tokens")
    n = int(tokens.size)
    positions = xp.arange(n) if positions is None else _integers(xp, positions, "positions")
    if caches is None:
        if int(positions.min()) > 0:
            raise ValueError("positions after 0 need the ranks' caches of the earlier ones")
        caches = [KVCache.empty(sh.rank_config(r), dtype, xp) for r in range(ranks)]
    state = [{} for _ in range(ranks)]
    exchanges: list[Exchange] = []
    logits = None
    for stage_name, layer in schedule.execution(cfg):
        st = plan.stage(stage_name)
        if st.reference is None:
            continue
        zero = reduction(st)
        outs = []
        for r in range(ranks):
            io = _RankIO(w, sh, r, state[r], caches[r], positions, tokens, layer, xp, dtype, zero)
            outs.append(st.reference(io))
        if zero is not None:                          # the all-reduce: every rank gets the sum of the partials
            total = state[0][zero] + sum(o[zero] for o in outs)
            copies = [u.buffer for u in st.writes if u.same_as == zero]   # h, the MLP norm's copy of x
            for o in outs:
                o.update({b: total for b in (zero, *copies)})
            exchanges.append(Exchange(stage_name, layer, "all-reduce", sh.all_reduce_bytes()))
        if "logits" in {u.buffer for u in st.writes}:   # the vocabulary slices, joined in order
            joined = xp.concatenate([o["logits"] for o in outs], axis=-1)
            exchanges.append(Exchange(stage_name, layer, "gather", 8))   # each rank's (max, index)
            for o in outs:
                o["logits"] = joined
            logits = joined
        for r, res in enumerate(outs):
            for buf, val in res.items():
                if plan.BUFFERS[buf].kind == "cache":
                    val = store_kv(caches[r], buf, layer, positions, val, kv_bf16)
                state[r][buf] = val
    # the greedy token as the ranks find it: each its own slice's best, then the best of those
    picked = []
    lg = logits.get() if hasattr(logits, "get") else np.asarray(logits)
    for row in lg:
        pairs = []
        for r in range(ranks):
            sl = sh.vocab(r)
            i = int(np.argmax(row[sl.start:sl.stop]))
            pairs.append((float(row[sl.start + i]), sl.start + i))
        picked.append(merge_argmax(pairs)[1])
    return TpResult(logits, picked, caches, exchanges)

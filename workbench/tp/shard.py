"""How N ranks split the model (Megatron-style), from the config alone.

Attention is split by heads: rank r holds query heads [r·Hq/N, (r+1)·Hq/N) and the kv heads they read, which is
[r·Hkv/N, (r+1)·Hkv/N) since query head h reads kv head h // (Hq/Hkv); so Wq, Wk, Wv (and Qwen2's biases) are split
by rows, and Wo by the matching columns. The MLP is split by the intermediate dimension: Wg and Wu by rows, Wd by
columns. The LM head is split by vocabulary rows; the embedding, the norms' gains and Qwen3's per-head q/k gains
(the same for every head) are on every rank. A stage that reads a split activation and writes the replicated
residual (the O projection, the down projection) produces a partial sum on each rank: the sum over ranks, an
all-reduce, is the residual update. The LM head's slices are joined by an argmax across ranks.
"""
from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..model.config import ModelConfig

# tensor → (split by its "rows" (outputs) or its "cols" (inputs), the Sharding method giving rank r's range, whether
# that range counts heads of head_dim rows); a product with a tensor split by its inputs is a partial sum on each
# rank (splits_inputs)
SPLITS = {"wq": ("rows", "q_heads", True), "bq": ("rows", "q_heads", True),
          "wk": ("rows", "kv_heads", True), "wv": ("rows", "kv_heads", True),
          "bk": ("rows", "kv_heads", True), "bv": ("rows", "kv_heads", True),
          "wo": ("cols", "q_heads", True), "wg": ("rows", "ffn", False), "wu": ("rows", "ffn", False),
          "wd": ("cols", "ffn", False), "lm_head": ("rows", "vocab", False)}
# on every rank: the embedding, the norms' gains, Qwen3's per-head q/k gains (the same for every head)
WHOLE = frozenset({"embed", "attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"})


def splits_inputs(tensor: str) -> bool:
    """Whether a rank holds only some of the tensor's input columns: its product is that rank's partial sum. The
    plan's weight buffers that are one tensor carry its name (wo, wd); its paired ones (wqkv, wgu) are split by
    rows."""
    return SPLITS.get(tensor, ("rows",))[0] == "cols"


@dataclasses.dataclass(frozen=True)
class Sharding:
    cfg: ModelConfig
    ranks: int

    def __post_init__(self):
        c, n = self.cfg, self.ranks
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"the number of GPUs must be a positive integer, got {n!r}")
        for what, size in (("kv heads", c.n_kv_heads), ("query heads", c.n_heads), ("intermediate size",
                                                                                   c.intermediate)):
            if size % n:
                raise ConfigError(f"{c.name} cannot be split over {n} GPUs: its {size} {what} do not divide by {n}")
        for r in range(n):                    # each share must be a shape a rank's kernel can run
            try:
                self.rank_config(r)
            except ConfigError as e:
                raise ConfigError(f"{c.name} cannot be split over {n} GPUs: a rank's share breaks a kernel "
                                  f"constraint ({str(e).split(': ', 1)[-1]})") from None

    # -- what rank r holds, as [start, stop) ranges --------------------------------------------------------------
    def q_heads(self, r: int) -> range:
        per = self.cfg.n_heads // self.ranks
        return range(r * per, (r + 1) * per)

    def kv_heads(self, r: int) -> range:
        per = self.cfg.n_kv_heads // self.ranks
        return range(r * per, (r + 1) * per)

    def ffn(self, r: int) -> range:
        per = self.cfg.intermediate // self.ranks
        return range(r * per, (r + 1) * per)

    def vocab(self, r: int) -> range:
        """Vocabulary rows of rank r's LM head: as even as the vocabulary allows (the first ranks one row more)."""
        base, extra = divmod(self.cfg.vocab, self.ranks)
        start = r * base + min(r, extra)
        return range(start, start + base + (r < extra))

    def rank_config(self, r: int) -> ModelConfig:
        """The shapes rank r's share of a layer has (its vocabulary slice as `vocab`)."""
        c = self.cfg
        return dataclasses.replace(c, name=f"{c.name}/tp{self.ranks}.{r}", n_heads=c.n_heads // self.ranks,
                                   n_kv_heads=c.n_kv_heads // self.ranks, intermediate=c.intermediate // self.ranks,
                                   vocab=len(self.vocab(r)))

    # -- slicing HF-layout tensors ([out, in]) ---------------------------------------------------------------------
    def weight(self, name: str, tensor, r: int):
        """Rank r's slice of a layer or model tensor named as reference views name them."""
        if name in WHOLE:
            return tensor
        if name not in SPLITS:
            raise KeyError(f"no sharding rule for the tensor {name!r}")
        axis, share, per_head = SPLITS[name]
        rg, unit = getattr(self, share)(r), self.cfg.head_dim if per_head else 1
        part = slice(rg.start * unit, rg.stop * unit)
        return tensor[part] if axis == "rows" else tensor[:, part]

    def all_reduce_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes one rank's partial sum of the residual holds (each all-reduce exchanges one such vector)."""
        return self.cfg.hidden * dtype_bytes

    def describe(self) -> str:
        """What each rank holds and what a token exchanges: the `plan --gpus N` table."""
        c = self.cfg
        lines = [f"{c.name} over {self.ranks} GPUs (Megatron-style: heads, then the MLP's columns and rows, the LM "
                 f"head by vocabulary)",
                 f"{'rank':>4s} {'q heads':>9s} {'kv heads':>9s} {'mlp rows':>13s} {'vocab rows':>15s} {'weights GB':>10s}"]
        for r in range(self.ranks):
            rc = self.rank_config(r)
            q, kv, f, v = self.q_heads(r), self.kv_heads(r), self.ffn(r), self.vocab(r)
            gb = (rc.weight_bytes_per_token() + c.vocab * c.hidden * 2) / 1e9
            lines.append(f"{r:4d} {q.start:4d}–{q.stop - 1:<4d} {kv.start:4d}–{kv.stop - 1:<4d} "
                         f"{f.start:6d}–{f.stop - 1:<6d} {v.start:7d}–{v.stop - 1:<7d} {gb:10.2f}")
        lines.append(f"per token: {2 * c.n_layers} all-reduces of the residual ({self.all_reduce_bytes()} B of fp32 "
                     f"partials per rank each: after every O projection and every down projection) and one "
                     f"exchange of each rank's best (logit, index) for the greedy token")
        return "\n".join(lines)

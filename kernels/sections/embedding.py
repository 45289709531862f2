"""Embedding: the residual stream starts as the token's row of the embedding table.

Contract (once per token):
    in   embed  [V, D]   bf16 table (the kernel reads one row)
         token  int      0 <= token < V
    out  x      [D]      fp32 residual stream
"""
import numpy as np

from ._common import BF16, F32


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    return {"embed": (cfg.vocab, cfg.hidden), "token": (), "x": (cfg.hidden,)}


def bytes_moved(cfg, pos: int) -> int:
    # one bf16 row in, the fp32 residual out (the token id itself is a register)
    return BF16 * cfg.hidden + F32 * cfg.hidden


def reference(embed: np.ndarray, token: int) -> np.ndarray:
    """x = embed[token]. A negative token would silently index from the end in numpy, so it is refused."""
    if embed.ndim != 2:
        raise ValueError(f"embed must be [V, D], got shape {embed.shape}")
    if not 0 <= int(token) < embed.shape[0]:
        raise ValueError(f"token {token} is outside the vocabulary [0, {embed.shape[0]})")
    return embed[int(token)].copy()

"""QKV + RoPE (+ append): normalise the residual, project to queries, keys and values, rotate q and k.

Contract (per layer, at position pos):
    in   x      [D]               fp32 residual stream
         wq     [Hq·hd, D]        bf16 (the kernel streams them as one wqkv [Hq·hd + 2·Hkv·hd, D], rows in rope
         wk     [Hkv·hd, D]             pairs, the attention-norm gain folded in)
         wv     [Hkv·hd, D]
         gain   [D]               attention RMSNorm gain (all ones once folded)
         cos    [hd/2]            rope table row for pos, fp32
         sin    [hd/2]
    out  q      [Hq·hd]           fp32, rotated
         k      [Hkv·hd]          rotated; the kernel stores k and v as bf16 into the KV cache at pos
         v      [Hkv·hd]

The reference returns k and v and leaves the append (and its bf16 rounding) to the caller, so it stays pure.
"""
import numpy as np

from ._common import BF16, F32, check_shape, rmsnorm


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    D, half = cfg.hidden, cfg.head_dim // 2
    return {"x": (D,), "wq": (cfg.q_dim, D), "wk": (cfg.kv_dim, D), "wv": (cfg.kv_dim, D), "gain": (D,),
            "cos": (half,), "sin": (half,), "q": (cfg.q_dim,), "k": (cfg.kv_dim,), "v": (cfg.kv_dim,)}


def bytes_moved(cfg, pos: int) -> int:
    weights = BF16 * cfg.qkv_rows * cfg.hidden                  # gain is folded into these
    rope = F32 * cfg.head_dim                                   # cos and sin rows, hd/2 each
    reads = F32 * cfg.hidden
    writes = F32 * cfg.q_dim + BF16 * 2 * cfg.kv_dim            # q for attention, k and v into the bf16 cache
    return weights + rope + reads + writes


def rope(a: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on every head of a [n_heads·hd] vector, as HF Llama does: each pair (i, i + hd/2) is
    rotated by angle_i, out_i = a_i·cos_i − a_{i+hd/2}·sin_i and out_{i+hd/2} = a_{i+hd/2}·cos_i + a_i·sin_i."""
    half = cos.shape[0]
    heads = a.reshape(-1, 2 * half)
    lo, hi = heads[:, :half], heads[:, half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=1).reshape(-1)


def reference(x, wq, wk, wv, gain, cos, sin, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k, v) = (rope(wq·h), rope(wk·h), wv·h) with h = RMSNorm(x)·gain."""
    D, half = x.shape[0], cos.shape[0]
    check_shape("x", x, D)
    check_shape("gain", gain, D)
    check_shape("sin", sin, half)
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.ndim != 2 or w.shape[1] != D or w.shape[0] % (2 * half):
            raise ValueError(f"{name} has shape {w.shape}: expected [n_heads·{2 * half}, {D}]")
    if wk.shape != wv.shape:
        raise ValueError(f"wk {wk.shape} and wv {wv.shape} must match")
    h = rmsnorm(x, gain, eps)
    q, k, v = wq @ h, wk @ h, wv @ h
    return rope(q, cos, sin), rope(k, cos, sin), v

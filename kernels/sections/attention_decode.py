"""Attention for one new query against every cached position (decode: a single query row per head).

Contract (per layer, at position pos, with n = pos + 1 cached positions):
    in   q        [Hq·hd]            fp32, rotated
         k_cache  [Hkv, max_seq, hd] bf16; positions 0..pos are read (the reference takes the slice [Hkv, n, hd])
         v_cache  [Hkv, max_seq, hd] bf16
    out  o        [Hq·hd]            fp32: per head, softmax(q·Kᵀ/√hd)·V

GQA: query head h reads kv head h // (Hq / Hkv).
"""
import numpy as np

from ._common import BF16, F32, check_shape


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    cache = (cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    return {"q": (cfg.q_dim,), "k_cache": cache, "v_cache": cache, "o": (cfg.q_dim,)}


def bytes_moved(cfg, pos: int) -> int:
    kv = BF16 * 2 * cfg.kv_dim * (pos + 1)                      # every cached key and value, once
    return kv + F32 * cfg.q_dim + F32 * cfg.q_dim               # q in, o out


def reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray) -> np.ndarray:
    if k_cache.ndim != 3 or k_cache.shape[1] == 0:
        raise ValueError(f"k_cache must be [Hkv, n, hd] with n >= 1, got shape {k_cache.shape}")
    n_kv, n, hd = k_cache.shape
    check_shape("v_cache", v_cache, n_kv, n, hd)
    if q.ndim != 1 or q.shape[0] % (n_kv * hd):
        raise ValueError(f"q has shape {q.shape}: expected [Hq·{hd}] with Hq a multiple of Hkv={n_kv}")
    group = q.shape[0] // (n_kv * hd)
    qg = q.reshape(n_kv, group, hd)                             # query heads grouped by the kv head they read
    scores = np.einsum("kgd,knd->kgn", qg, k_cache) * hd ** -0.5    # a Python float: keeps q's dtype
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))     # max-subtracted: softmax is shift-invariant
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("kgn,knd->kgd", p, v_cache).reshape(-1)

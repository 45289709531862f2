"""The CPU reference decode step: one token through the model, section by section, in numpy.

It is composed from the section references in kernels/sections, one call per section of the kernel,
and it can record every intermediate ("taps") to compare against the kernel's. It steps one token at a time like
the kernel does; for long sequences at real model sizes use reference_torch, which computes the same thing batched.

The math, per layer l, for the token at position pos:
    q, k, v   = rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x)       n = RMSNorm with the attention-norm gain
    K[pos], V[pos] = k, v                                    (rounded to bf16: the kernel's cache is bf16)
    x        += Wo · attention(q, K[0..pos], V[0..pos])
    x        += Wd · (silu(Wg·m(x)) ⊙ Wu·m(x))               m = RMSNorm with the MLP-norm gain
and logits = W_lm · RMSNorm(x) with the final-norm gain.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import numpy as np

from kernels.sections import (attention_decode, down_residual, embedding, gate_up_silu, lm_head, o_proj_residual,
                              qkv_rope_append)

from ..model.config import ModelConfig
from ..model.weights import Weights, layer_names, round_bf16, rope_tables

TAP_STAGES = ("x_in", "q", "k", "v", "attn", "x_attn", "h_mlp", "x_out")   # per layer; plus ("logits", -1)


@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer [L, Hkv, max_seq, hd]; position p holds the token fed at p."""
    k: np.ndarray
    v: np.ndarray

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype=np.float32) -> "KVCache":
        shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
        return cls(np.zeros(shape, dtype=dtype), np.zeros(shape, dtype=dtype))


def decode_step(w: Weights, cache: KVCache, token: int, pos: int, *, taps: dict | None = None,
                kv_bf16: bool = True, dtype=np.float32) -> np.ndarray:
    """Feed `token` at position `pos` (the cache must hold positions 0..pos-1); returns the logits [V].

    kv_bf16 rounds k and v to bf16 before they enter the cache, as the kernel does; False keeps them in `dtype`
    (to compare against an fp32 framework). If `taps` is a dict, copies of the intermediates land in it under
    (stage, layer) keys, see TAP_STAGES."""
    cfg = w.cfg
    _check_step(cfg, cache, token, pos, kv_bf16, dtype)
    f = _floats(w, dtype)
    tap = _tapper(taps)
    cos, sin = (t[pos].astype(dtype) for t in _rope(cfg))
    eps = cfg.rms_eps

    x = embedding.reference(f("model.embed_tokens.weight"), token)
    for l in range(cfg.n_layers):
        n = layer_names(l)
        tap("x_in", l, x)
        q, k, v = qkv_rope_append.reference(x, f(n["wq"]), f(n["wk"]), f(n["wv"]), f(n["attn_norm"]), cos, sin, eps)
        if kv_bf16:
            k, v = round_bf16(k).astype(dtype), round_bf16(v).astype(dtype)
        cache.k[l, :, pos] = k.reshape(cfg.n_kv_heads, cfg.head_dim)
        cache.v[l, :, pos] = v.reshape(cfg.n_kv_heads, cfg.head_dim)
        tap("q", l, q)
        tap("k", l, k)
        tap("v", l, v)

        keys = np.asarray(cache.k[l, :, :pos + 1], dtype=dtype)
        values = np.asarray(cache.v[l, :, :pos + 1], dtype=dtype)
        o = attention_decode.reference(q, keys, values)
        tap("attn", l, o)
        x = o_proj_residual.reference(x, f(n["wo"]), o)
        tap("x_attn", l, x)

        h = gate_up_silu.reference(x, f(n["wg"]), f(n["wu"]), f(n["mlp_norm"]), eps)
        tap("h_mlp", l, h)
        x = down_residual.reference(x, f(n["wd"]), h)
        tap("x_out", l, x)

    logits = lm_head.reference(x, f(w.lm_head_name()), f("model.norm.weight"), eps)
    tap("logits", -1, logits)
    return logits


def generate_reference(w: Weights, tokens: list[int], pos0: int = 0, *, cache: KVCache | None = None,
                       kv_bf16: bool = True, dtype=np.float32, progress: bool = False) -> np.ndarray:
    """Teacher-forced run: feeds tokens[i] at position pos0 + i and returns every step's logits [n, V].

    With pos0 > 0 the cache must already hold positions 0..pos0-1 (pass it); a fresh one would make the first steps
    attend to zero keys, a result no model computes."""
    cfg = w.cfg
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("no tokens to feed")
    if pos0 < 0 or pos0 + len(tokens) > cfg.max_seq:
        raise ValueError(f"positions {pos0}..{pos0 + len(tokens) - 1} do not fit max_seq={cfg.max_seq}")
    if cache is None:
        if pos0 > 0:
            raise ValueError(f"pos0={pos0} needs the cache that holds positions 0..{pos0 - 1}")
        cache = KVCache.empty(cfg, dtype)
    steps = range(len(tokens))
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc="reference", leave=False)
    logits = np.empty((len(tokens), cfg.vocab), dtype=dtype)
    for i in steps:
        logits[i] = decode_step(w, cache, tokens[i], pos0 + i, kv_bf16=kv_bf16, dtype=dtype)
    return logits


# -- plumbing ---------------------------------------------------------------------------------------------------

def _check_step(cfg: ModelConfig, cache: KVCache, token, pos, kv_bf16: bool, dtype):
    if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
        raise TypeError(f"token must be an integer, got {token!r}")
    if not 0 <= token < cfg.vocab:
        raise ValueError(f"token {token} is outside the vocabulary [0, {cfg.vocab})")
    if not isinstance(pos, (int, np.integer)) or not 0 <= pos < cfg.max_seq:
        raise ValueError(f"position {pos!r} is outside [0, max_seq={cfg.max_seq})")
    want = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    if cache.k.shape != want or cache.v.shape != want:
        raise ValueError(f"KV cache has shapes {cache.k.shape}, {cache.v.shape}; the config needs {want}")
    # bf16 values fit any float32/float64 cache exactly; unrounded ones need a cache as precise as the math
    if cache.k.dtype not in (np.float32, np.float64) or (not kv_bf16 and not np.can_cast(dtype, cache.k.dtype)):
        raise ValueError(f"a {cache.k.dtype} KV cache would round the {np.dtype(dtype)} keys and values; "
                         f"use KVCache.empty(cfg, dtype)")


# Float copies of the weights, kept per Weights object (weakly, so they go when it goes) and per dtype: converting
# bf16 bits to floats every step would dominate a multi-token run. Weights are treated as immutable.
_float_cache: dict[int, tuple[weakref.ref, dict]] = {}


def _floats(w: Weights, dtype):
    entry = _float_cache.get(id(w))
    if entry is None or entry[0]() is not w:
        key = id(w)
        entry = (weakref.ref(w, lambda _, key=key: _float_cache.pop(key, None)), {})
        _float_cache[key] = entry
    arrays = entry[1]
    dtype = np.dtype(dtype)

    def f(name: str) -> np.ndarray:
        if (name, dtype) not in arrays:
            a = w.f32(name)
            a = a if isinstance(a, np.ndarray) else a.get()     # cupy → host
            arrays[name, dtype] = a.astype(dtype)
        return arrays[name, dtype]
    return f


@functools.lru_cache(maxsize=8)
def _rope(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    return rope_tables(cfg)


def _tapper(taps: dict | None):
    if taps is None:
        return lambda stage, layer, value: None

    def tap(stage: str, layer: int, value: np.ndarray):
        taps[stage, layer] = np.array(value, copy=True)
    return tap

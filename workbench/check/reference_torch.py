"""The reference decode math as one batched, causal, teacher-forced forward in torch.

Stepping the numpy reference token by token is far too slow at real sizes (thousands of positions, a 128k vocab);
this computes the same logits for a whole sequence at once, on a GPU if the tensors live there. It is the math of
workbench/reference.py, not a port of any framework's model: RMSNorm in the working dtype, rotate-half RoPE from
model.rope_tables, and (with kv_bf16) keys and values rounded to bf16 as the kernel's KV cache stores them.

torch is not a dependency of the package; this module needs it installed.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..model.config import ModelConfig
from ..model.weights import Weights, expected_shapes, layer_names, rope_tables

# Attention over a block of query rows materialises scores [Hq, rows, keys]; this caps it at 2^25 elements
# (128 MiB in fp32), so n = 4200 positions with 32 heads runs in blocks of ~250 rows.
_SCORE_ELEMENTS = 1 << 25


def forward(cfg: ModelConfig, tensors: dict[str, torch.Tensor], tokens: torch.Tensor, *, kv_bf16: bool = True,
            dtype: torch.dtype = torch.float32, taps: dict | None = None,
            tap_positions=None) -> torch.Tensor:
    """Logits [n, V] for tokens [n] fed at positions 0..n-1, every position at once (teacher-forced).

    `tensors` are float tensors by HF name, gains included, on one device (see tensors_from_weights); they are
    cast to `dtype` where they are used, so pass them in `dtype` already to avoid copies. Activation memory is
    O(n·max(D, F)) plus one attention block; the logits themselves are n·V.

    If `taps` is a dict, the intermediates of the positions `tap_positions` (default: all) land in it under the
    names of workbench.reference.TAP_STAGES: taps[(stage, layer)] is a tensor [len(tap_positions), size] on the
    tensors' device, row i holding position tap_positions[i], plus taps[("logits", -1)]. Only those rows are kept,
    so tapping a few positions of a long sequence costs nothing like n × layers."""
    tokens = _check_tokens(cfg, tokens)
    missing = [k for k in expected_shapes(cfg) if k not in tensors]
    if missing:
        raise KeyError(f"tensors lack {', '.join(missing[:3])}" + (" and more" if len(missing) > 3 else ""))
    device = tensors["model.embed_tokens.weight"].device
    tokens = tokens.to(device)
    n, eps, hd = tokens.numel(), cfg.rms_eps, cfg.head_dim

    def W(name: str) -> torch.Tensor:
        return tensors[name].to(dtype)

    cos, sin = (torch.from_numpy(t[:n]).to(device=device, dtype=dtype)[:, None, :] for t in rope_tables(cfg))
    lm_name = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"

    tap = _tapper(taps, tap_positions, n, device)
    with _ieee_fp32_matmuls(), torch.no_grad():
        x = W("model.embed_tokens.weight")[tokens]                                          # [n, D]
        for l in range(cfg.n_layers):
            names = layer_names(l)
            tap("x_in", l, x)
            h = rmsnorm(x, W(names["attn_norm"]), eps)
            q = rope((h @ W(names["wq"]).T).view(n, cfg.n_heads, hd), cos, sin)
            k = rope((h @ W(names["wk"]).T).view(n, cfg.n_kv_heads, hd), cos, sin)
            v = (h @ W(names["wv"]).T).view(n, cfg.n_kv_heads, hd)
            if kv_bf16:
                k, v = round_bf16(k), round_bf16(v)
            tap("q", l, q)
            tap("k", l, k)
            tap("v", l, v)
            o = causal_attention(q, k, v)
            del q, k, v
            tap("attn", l, o)
            x = x + o @ W(names["wo"]).T
            del o
            tap("x_attn", l, x)

            h = rmsnorm(x, W(names["mlp_norm"]), eps)
            h = torch.nn.functional.silu(h @ W(names["wg"]).T) * (h @ W(names["wu"]).T)
            tap("h_mlp", l, h)
            x = x + h @ W(names["wd"]).T
            del h
            tap("x_out", l, x)
        logits = rmsnorm(x, W("model.norm.weight"), eps) @ W(lm_name).T
        tap("logits", -1, logits)
        return logits


def rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rope(a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [n, heads, hd] with cos/sin [n, 1, hd/2]: pairs (i, i + hd/2) rotate by angle_i."""
    lo, hi = a.chunk(2, dim=-1)
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)


def round_bf16(a: torch.Tensor) -> torch.Tensor:
    """The value a bf16 store keeps; through fp32 first, exactly like model.round_bf16 (fp64 → bf16 directly could
    round differently from fp64 → fp32 → bf16)."""
    return a.to(torch.float32).to(torch.bfloat16).to(a.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, hd], k and v [n, Hkv, hd] → [n, Hq·hd]; query i attends to keys 0..i. GQA: query head h reads
    kv head h // (Hq / Hkv). Done in blocks of query rows so the scores never exceed _SCORE_ELEMENTS."""
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    q = q.view(n, n_kv, n_heads // n_kv, hd)                     # query heads grouped by the kv head they read
    rows = max(1, min(n, _SCORE_ELEMENTS // (n_heads * n)))
    out = torch.empty(n, n_heads * hd, dtype=q.dtype, device=q.device)
    for start in range(0, n, rows):
        end = min(n, start + rows)                              # queries start..end-1 see keys 0..end-1
        scores = torch.einsum("ckgd,jkd->kgcj", q[start:end], k[:end]) * hd ** -0.5
        query_pos = torch.arange(start, end, device=q.device)[:, None]
        future = torch.arange(end, device=q.device)[None, :] > query_pos
        p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("kgcj,jkd->ckgd", p, v[:end]).reshape(end - start, -1)
    return out


def tensors_from_weights(w: Weights, device="cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Weights (numpy or cupy; bf16 bits or floats) → float tensors by HF name on `device`, for forward()."""
    names = dict.fromkeys([*expected_shapes(w.cfg), *(k for k in ("lm_head.weight",) if k in w.tensors)])
    return {name: _to_torch(w.tensors[name]).to(device=device, dtype=dtype) for name in names}


# -- plumbing ---------------------------------------------------------------------------------------------------

def _tapper(taps: dict | None, positions, n: int, device):
    """taps[(stage, layer)] = rows `positions` of an [n, ...] activation, flattened to [len(positions), size]."""
    if taps is None:
        return lambda stage, layer, value: None
    idx = torch.arange(n) if positions is None else torch.as_tensor(list(positions), dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"tap positions must be in [0, {n}), got {idx.tolist()}")
    idx = idx.to(device)

    def tap(stage: str, layer: int, value: torch.Tensor):
        taps[stage, layer] = value.index_select(0, idx).reshape(idx.numel(), -1)     # a copy: only these rows
    return tap


def _to_torch(a) -> torch.Tensor:
    bf16 = a.dtype == np.uint16                                 # bf16 bits: reinterpret, then widen
    if isinstance(a, np.ndarray):
        if bf16:
            a = a.view(np.int16)                                # torch views int16 as bf16; same bits
        t = torch.from_numpy(a if a.flags.writeable else np.array(a))   # torch wants writable memory; memmaps aren't
    else:                                                       # cupy (or anything with DLPack) stays on its device
        t = torch.from_dlpack(a.view("int16") if bf16 else a)
    return t.view(torch.bfloat16) if bf16 else t


def _check_tokens(cfg: ModelConfig, tokens) -> torch.Tensor:
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 1 or tokens.numel() == 0 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be a non-empty 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.numel() > cfg.max_seq:
        raise ValueError(f"{tokens.numel()} tokens do not fit max_seq={cfg.max_seq}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.vocab:
        raise ValueError(f"token ids span [{lo}, {hi}], outside the vocabulary [0, {cfg.vocab})")
    return tokens.long()


@contextlib.contextmanager
def _ieee_fp32_matmuls():
    """No TF32 inside (fp32 stays fp32 on Ampere and later), the caller's setting restored after. torch refuses to
    read the flag through one API once it was set through the other, so whichever API the caller used is used."""
    try:
        old = torch.get_float32_matmul_precision()             # the legacy API (also what allow_tf32 sets)
    except RuntimeError:
        matmul = torch.backends.cuda.matmul                     # the caller used the fp32_precision API
        old = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = old
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)

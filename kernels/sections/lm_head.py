"""LM head: the final RMSNorm and the projection onto the vocabulary.

Contract (once per token):
    in   x       [D]      fp32 residual stream after the last layer
         w_lm    [V, D]   bf16 (the kernel reads a copy with the final-norm gain folded in, even when tied)
         gain    [D]      final RMSNorm gain (all ones once folded)
    out  logits  [V]      fp32
"""
import numpy as np

from ._common import BF16, F32, check_shape, rmsnorm


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    D, V = cfg.hidden, cfg.vocab
    return {"x": (D,), "w_lm": (V, D), "gain": (D,), "logits": (V,)}


def bytes_moved(cfg, pos: int) -> int:
    D, V = cfg.hidden, cfg.vocab
    return BF16 * V * D + F32 * D + F32 * V                     # weights, x in, logits out


def reference(x: np.ndarray, w_lm: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    D = x.shape[0]
    if w_lm.ndim != 2 or w_lm.shape[1] != D:
        raise ValueError(f"w_lm has shape {w_lm.shape}, expected [V, {D}]")
    check_shape("gain", gain, D)
    return w_lm @ rmsnorm(x, gain, eps)

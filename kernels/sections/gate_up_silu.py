"""Gate/up + SiLU: normalise the residual, project to the MLP width twice, gate one with the other.

Contract (per layer):
    in   x     [D]      fp32 residual stream (after attention)
         wg    [F, D]   bf16 (the kernel streams wgu [2F, D]: gate row j then up row j, mlp-norm gain folded in)
         wu    [F, D]   bf16
         gain  [D]      MLP RMSNorm gain (all ones once folded)
    out  hmlp  [F]      fp32 silu(wg·h) ⊙ (wu·h), h = RMSNorm(x)·gain
"""
import numpy as np

from ._common import BF16, F32, check_shape, rmsnorm, silu


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    D, F = cfg.hidden, cfg.intermediate
    return {"x": (D,), "wg": (F, D), "wu": (F, D), "gain": (D,), "hmlp": (F,)}


def bytes_moved(cfg, pos: int) -> int:
    D, F = cfg.hidden, cfg.intermediate
    return BF16 * 2 * F * D + F32 * D + F32 * F                 # weights, x in, hmlp out


def reference(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    D = x.shape[0]
    check_shape("wu", wu, wg.shape[0], D)
    check_shape("wg", wg, wu.shape[0], D)
    check_shape("gain", gain, D)
    h = rmsnorm(x, gain, eps)
    return silu(wg @ h) * (wu @ h)

"""Down projection + residual: the MLP activation, projected back to the model width, joins the stream.

Contract (per layer):
    in   x     [D]      fp32 residual stream (after attention)
         wd    [D, F]   bf16
         hmlp  [F]      fp32
    out  x'    [D]      x + wd·hmlp, the layer's output
"""
import numpy as np

from ._common import BF16, F32, check_shape


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    D, F = cfg.hidden, cfg.intermediate
    return {"x": (D,), "wd": (D, F), "hmlp": (F,), "x_out": (D,)}


def bytes_moved(cfg, pos: int) -> int:
    D, F = cfg.hidden, cfg.intermediate
    return BF16 * D * F + F32 * F + 2 * F32 * D                 # weights, hmlp, x in and out


def reference(x: np.ndarray, wd: np.ndarray, hmlp: np.ndarray) -> np.ndarray:
    check_shape("wd", wd, x.shape[0], hmlp.shape[0])
    return x + wd @ hmlp

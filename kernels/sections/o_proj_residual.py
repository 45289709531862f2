"""Output projection + residual: the attention output, projected back to the model width, joins the stream.

Contract (per layer):
    in   x   [D]        fp32 residual stream
         wo  [D, Hq·hd] bf16
         o   [Hq·hd]    fp32 attention output
    out  x'  [D]        x + wo·o
"""
import numpy as np

from ._common import BF16, F32, check_shape


def shapes(cfg) -> dict[str, tuple[int, ...]]:
    D = cfg.hidden
    return {"x": (D,), "wo": (D, cfg.q_dim), "o": (cfg.q_dim,), "x_out": (D,)}


def bytes_moved(cfg, pos: int) -> int:
    return BF16 * cfg.hidden * cfg.q_dim + F32 * cfg.q_dim + 2 * F32 * cfg.hidden   # weights, o, x in and out


def reference(x: np.ndarray, wo: np.ndarray, o: np.ndarray) -> np.ndarray:
    check_shape("wo", wo, x.shape[0], o.shape[0])
    return x + wo @ o

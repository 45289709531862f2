"""bf16 weights widened to a float dtype in one pass, rows picked or the matrix transposed on the way.

The reference interpreter sees the kernel's prepared weights through `reference.PreparedView`, which widens one
layer at a time so that an fp64 view of a large model costs one layer's memory. A decode step therefore widens the
whole model again: in the CPU stand-in kernel (tests/kernel_sim.py) and in `decode_step`, that was 87% of a
llama-3.2-1b step. numpy needs a pass per operation (to uint32, shift, gather, cast, transpose: each over the
layer, and a transpose that walks memory by columns); the numba loops here make one pass, the transpose in cache
tiles. Widening is exact and moving a value does not round, so every engine gives the same bits (a signalling NaN
comes out quiet, as numpy's cast makes it). Measured in NOTES.md, round 24.

numba is optional (the dev and cuda extras): without it, or for arrays too small to repay its import, numpy does
the work, gathering the bf16 rows before widening them (half the bytes to move).
"""
from __future__ import annotations

import numpy as np

from .stage_math import xp_of
from .weights import to_f32

# Below this many elements numpy's passes cost less than importing numba (~0.2 s) and loading its cached code: the
# tiny preset's layers stay in numpy, a 1B-class layer (tens of millions) goes to numba.
NUMBA_MIN_ELEMENTS = 1 << 20
# tiles of the transpose: 64 × 64 bf16 in, 64 rows of 64 floats out (32 KB in fp64), within L1 and L2 together
TILE = 64

ENGINES = ("auto", "numba", "numpy")
_KERNELS = None
_LUT: dict = {}


def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def rows(a, index=None, dtype=np.float32, *, engine: str = "auto"):
    """`a` [R, C] (bf16 bits as uint16, or floats) → [len(index), C] C-contiguous in `dtype`, row i being a[index[i]]
    widened (all rows in order when index is None): what `to_f32(a)[index].astype(dtype)` gives."""
    dtype = np.dtype(dtype)
    use = _engine(a, engine)
    if use == "other":                                   # cupy, or weights already in floats
        out = to_f32(a, xp_of(a)).astype(dtype, copy=False)
        return out if index is None else out[index]
    idx = np.arange(a.shape[0], dtype=np.int64) if index is None else np.ascontiguousarray(index, dtype=np.int64)
    if use == "numpy":
        picked = a if index is None else a[idx]
        return _widen_numpy(picked, dtype)
    k, src = _kernels(), np.ascontiguousarray(a)
    if dtype == np.float32:
        out = np.empty((idx.size, a.shape[1]), np.uint32)
        k.rows_bits(src, idx, out)
        return out.view(np.float32)
    out = np.empty((idx.size, a.shape[1]), dtype)
    k.rows_lut(src, idx, _lut(dtype), out)
    return out


def transposed(a, dtype=np.float32, *, engine: str = "auto"):
    """`a` [R, C] → its transpose [C, R], C-contiguous, widened to `dtype`: what
    `np.ascontiguousarray(to_f32(a).astype(dtype).T)` gives."""
    dtype = np.dtype(dtype)
    use = _engine(a, engine)
    if use == "other":
        xp = xp_of(a)
        return xp.ascontiguousarray(to_f32(a, xp).astype(dtype, copy=False).T)
    if use == "numpy":
        return _widen_numpy(np.ascontiguousarray(a.T), dtype)
    k, src = _kernels(), np.ascontiguousarray(a)
    if dtype == np.float32:
        out = np.empty(a.shape[::-1], np.uint32)
        k.transposed_bits(src, out, TILE)
        return out.view(np.float32)
    out = np.empty(a.shape[::-1], dtype)
    k.transposed_lut(src, _lut(dtype), out, TILE)
    return out


def _engine(a, engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    if not isinstance(a, np.ndarray) or a.dtype != np.uint16 or a.ndim != 2:
        if engine == "numba":
            raise TypeError(f"the numba engine widens a 2-D numpy array of bf16 bits (uint16), got "
                            f"{type(a).__name__} of {getattr(a, 'dtype', '?')}")
        return "other"
    if engine == "auto":
        engine = "numba" if a.size >= NUMBA_MIN_ELEMENTS and numba_available() else "numpy"
    elif engine == "numba" and not numba_available():
        raise ImportError("engine 'numba' needs numba (pip install numba; the dev extra has it)")
    return engine


def _widen_numpy(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """bf16 bits → dtype; the shift in place, so one temporary where to_f32 makes two."""
    u = bits.astype(np.uint32)
    u <<= 16
    with np.errstate(invalid="ignore"):                  # quiet as numba's table does, which warns of nothing
        return u.view(np.float32).astype(dtype, copy=False)


def _lut(dtype: np.dtype) -> np.ndarray:
    """Every bf16 value widened to `dtype` by numpy's own cast (so NaN payloads come out as numpy makes them)."""
    if dtype not in _LUT:
        with np.errstate(invalid="ignore"):              # signalling NaNs become quiet ones, as in any cast
            _LUT[dtype] = to_f32(np.arange(1 << 16, dtype=np.uint16)).astype(dtype)
    return _LUT[dtype]


# ---- the loops (plain Python here; compiled by numba on first use, cached on disk) -----------------------------
# Two of each kind: fp32 by a shift, other dtypes through the table. One table loop for all (fp32 as a table of bit
# patterns) gives the same bits, but widened a 1b layer to fp32 in 75-76 ms against the shift's 64-66 (+17%).

def _rows_bits(src, index, out):
    for i in range(index.size):
        s = src[index[i]]
        o = out[i]
        for j in range(s.size):
            o[j] = np.uint32(s[j]) << np.uint32(16)


def _rows_lut(src, index, lut, out):
    for i in range(index.size):
        s = src[index[i]]
        o = out[i]
        for j in range(s.size):
            o[j] = lut[s[j]]


def _transposed_bits(src, out, tile):
    n, m = src.shape
    for i0 in range(0, n, tile):
        i1 = min(i0 + tile, n)
        for j0 in range(0, m, tile):
            for j in range(j0, min(j0 + tile, m)):
                o = out[j]
                for i in range(i0, i1):
                    o[i] = np.uint32(src[i, j]) << np.uint32(16)


def _transposed_lut(src, lut, out, tile):
    n, m = src.shape
    for i0 in range(0, n, tile):
        i1 = min(i0 + tile, n)
        for j0 in range(0, m, tile):
            for j in range(j0, min(j0 + tile, m)):
                o = out[j]
                for i in range(i0, i1):
                    o[i] = lut[src[i, j]]


class _Kernels:
    def __init__(self):
        import numba
        jit = numba.njit(cache=True, nogil=True)
        self.rows_bits, self.rows_lut = jit(_rows_bits), jit(_rows_lut)
        self.transposed_bits, self.transposed_lut = jit(_transposed_bits), jit(_transposed_lut)


def _kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _Kernels()
    return _KERNELS

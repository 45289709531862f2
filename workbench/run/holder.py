"""A long-lived process that holds a model's prepared weights on the GPU and lends them to workers by CUDA IPC, so
that a worker restarted after a hang or a fault has its weights back at once instead of re-reading the checkpoint.

The holder never runs a kernel of ours, so its context stays healthy whatever a worker does. It allocates every
array with its own cudaMalloc (no memory pool: an IPC handle names a whole allocation) and keeps a checksum of each;
after a fault the caller asks `check()`, and a weight a wild write changed is prepared again.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..model.weights import Prepared, load_prepared
from .worker import Worker


@dataclasses.dataclass
class Lent:
    """What a worker needs to map the weights: per array, its IPC handle, shape and dtype; the config."""
    cfg: object
    source: str
    arrays: dict            # name → (handle bytes, shape, dtype str)


def _checksum(a) -> int:
    import cupy
    # summed in 64 bits without a widened copy (the embedding's would be 2 GB of scratch)
    return int(a.view(cupy.uint16 if a.dtype.itemsize == 2 else cupy.uint32).sum(dtype=cupy.uint64))


class _HolderService:
    def __init__(self, buf, header, n_words, words, model: str, weights: str | None, seed: int, max_seq: int | None):
        import cupy
        cupy.cuda.set_allocator(None)                     # one cudaMalloc per array: IPC handles name allocations
        self.spec = (model, weights, seed, max_seq)
        self._load()

    def _load(self):
        import cupy
        model, weights, seed, max_seq = self.spec
        self.p = load_prepared(model, weights, seed=seed, xp=cupy, max_seq=max_seq, progress=False)
        self.sums = {k: _checksum(v) for k, v in self.p.arrays().items()}

    def lend(self) -> Lent:
        import cupy
        rt = cupy.cuda.runtime
        arrays = {k: (rt.ipcGetMemHandle(v.data.ptr), tuple(v.shape), v.dtype.str) for k, v in self.p.arrays().items()}
        return Lent(self.p.cfg, self.p.source, arrays)

    def check(self) -> list[str]:
        """Names of the arrays whose contents changed (a wild write through IPC); they are prepared again."""
        changed = [k for k, v in self.p.arrays().items() if _checksum(v) != self.sums[k]]
        if changed:
            self._load()
        return changed


class WeightHolder:
    """The holder process: `lent = holder.lend()` for a worker to open with `open_lent`."""

    def __init__(self, model: str, weights: str | None = None, seed: int = 0, max_seq: int | None = None):
        self.worker = Worker(_HolderService, model, weights, seed, max_seq, max_tokens=1, start_s=600)
        self.worker.start()
        self._lent = None

    def lend(self) -> Lent:
        if self._lent is None:
            self._lent = self.worker.call("lend")
        return self._lent

    def check(self) -> list[str]:
        changed = self.worker.call("check")
        if changed:
            self._lent = None                             # new allocations, new handles
        return changed

    def close(self):
        self.worker.close()


def open_lent(lent: Lent):
    """The lent weights as a Prepared whose arrays live in the holder's allocations (this process maps them)."""
    import cupy
    rt = cupy.cuda.runtime
    arrays = {}
    for name, (handle, shape, dtype) in lent.arrays.items():
        ptr = rt.ipcOpenMemHandle(handle)
        mem = cupy.cuda.UnownedMemory(ptr, int(np.prod(shape)) * np.dtype(dtype).itemsize, owner=None)
        arrays[name] = cupy.ndarray(shape, np.dtype(dtype), cupy.cuda.MemoryPointer(mem, 0))
    return Prepared(lent.cfg, **arrays, xp=cupy, source=lent.source + " (lent by the weight holder)")

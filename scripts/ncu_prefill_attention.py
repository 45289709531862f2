"""One launch of the prefill attention kernel per layout, for a profiler: a 32k prompt's last chunk (4,096 rows over
32k keys, the most expensive launch of the prompt) on the 1B's shapes, in bf16, for the default bf16 layout and the
wgmma kernel's with one, two and four warpgroups (prefill_gpu.FlashLayout). On its own it only runs them; under
ncu each launch is one profiled kernel:

    ncu -k prefill_attention --metrics METRICS --csv --page raw python scripts/ncu_prefill_attention.py

NOTES.md round 33 gives the metrics it was run with (warp stall reasons, the tensor and SFU pipes, L2 throughput)
and what they said.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from workbench.model.config import get_config  # noqa: E402
from workbench.model.weights import to_bf16  # noqa: E402
from workbench.run import prefill_gpu as G  # noqa: E402
from workbench.run.prefill import PREFILL_CHUNK  # noqa: E402

LAYOUTS = {"frags2": dataclasses.replace(G.FLASH_LAYOUT, frags=2),
           "wg2s4": G.WGMMA_FP32,
           "wg1s4": dataclasses.replace(G.WGMMA_FP32, warpgroups=1),
           "wg4heads": dataclasses.replace(G.WGMMA_FP32, warpgroups=4, stages=2, heads=True)}


def main():
    cfg = get_config("llama-3.2-1b")
    n = 32768
    a = n - PREFILL_CHUNK
    rng = np.random.default_rng(0)
    hd, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q = cp.asarray(rng.standard_normal((n - a, hq * hd)) * 1.5, dtype=cp.float32)
    kb, vb = (to_bf16(cp.asarray(rng.standard_normal((hkv, n, hd)), dtype=cp.float32), cp) for _ in range(2))
    halves = G.PRECISIONS["bf16"]
    for name, layout in LAYOUTS.items():
        kernel = G.flash_kernel(hd, layout, halves)
        G.flash_attention(q, kb, vb, cp.arange(a, n), hq, kernel=kernel, layout=layout, halves=halves, span=(a, n - 1))
        cp.cuda.Device().synchronize()
        print(name, layout, flush=True)


if __name__ == "__main__":
    main()

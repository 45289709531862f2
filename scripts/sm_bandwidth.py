"""One SM's streaming read and how the aggregate grows with the SMs streaming: the `sm_gbps` and `hbm_tbps` the
schedule simulator (workbench.measure.simulate) shares HBM by.

Each block reads its own 16 MiB with the kernel's load pattern (512 threads, 8 16-byte loads in flight a thread,
read-only path), one block an SM; the time is the median of 5 launches after a warm-up, by CUDA events.
    python scripts/sm_bandwidth.py [--json FILE]      (GPU)
"""
from __future__ import annotations

import argparse
import json

SOURCE = r'''
extern "C" __global__ void stream_read(const uint4* __restrict__ a, long long per_block, unsigned* sink) {
    const uint4* p = a + (long long)blockIdx.x * per_block;
    unsigned acc = 0;
    for (long long i = threadIdx.x; i < per_block; i += blockDim.x * 8LL) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const long long j = i + (long long)k * blockDim.x;
            v[k] = j < per_block ? __ldg(p + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;       // keeps the loads; almost never true
}'''
PER_BLOCK = 16 << 20
THREADS = 512


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write {blocks: GB/s} here")
    args = ap.parse_args()
    import cupy as cp
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    fn = cp.RawModule(code=SOURCE).get_function("stream_read")
    buf = cp.ones(sms * PER_BLOCK // 4, dtype=cp.uint32)
    sink = cp.zeros(1, dtype=cp.uint32)
    counts = sorted({1, 2, 4, 8, 16, 32, sms // 2, sms})
    rates = {}
    print(f"{'blocks':>6s} {'GB/s':>9s} {'GB/s a block':>13s}")
    for blocks in counts:
        times = []
        for _ in range(6):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn((blocks,), (THREADS,), (buf, cp.int64(PER_BLOCK // 16), sink))
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        t = sorted(times[1:])[2]
        rates[blocks] = blocks * PER_BLOCK / t / 1e9
        print(f"{blocks:6d} {rates[blocks]:9.1f} {rates[blocks] / blocks:13.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rates, f, indent=1)


if __name__ == "__main__":
    main()

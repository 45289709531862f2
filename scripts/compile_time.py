"""Where the edit loop's compile time goes: NVRTC wall time of the timed and the debug build (the two builds a
reload compiles), alone and both at once in two threads (as the workbench does), for a few option sets.

    python scripts/compile_time.py --model llama-3.2-1b [--repeats 3]

Needs no GPU. Prints a table (medians) and writes compile_time.json under $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from workbench.assemble import BuildOptions, assemble  # noqa: E402
from workbench.compile import nvrtc_options  # noqa: E402
from workbench.config import get_config  # noqa: E402


def nvrtc_seconds(source: str, options: list[str]) -> float:
    from cuda.bindings import nvrtc
    # a unique global: some NVRTC installations cache compiles (a unique comment was not enough), an edit never hits
    source += f"__device__ int wb_compile_nonce_{time.time_ns()};\n"
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"monokernel.cu", 0, [], [])
    try:
        opts = [o.encode() for o in options]
        t0 = time.perf_counter()
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        dt = time.perf_counter() - t0
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"compile failed with {options}")
        return dt
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = get_config(a.model)
    builds = {"timed": assemble(cfg, BuildOptions(timing=True)).source,
              "debug": assemble(cfg, BuildOptions(taps=True)).source}
    option_sets = {"default": nvrtc_options(), "split-compile": nvrtc_options() + ["-split-compile=0"]}
    rows = []
    for oname, opts in option_sets.items():
        for b, src in builds.items():
            t = [nvrtc_seconds(src, opts) for _ in range(a.repeats)]
            rows.append({"options": oname, "build": b, "s": float(np.median(t)), "spread": float(np.ptp(t))})
        both = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(lambda s: nvrtc_seconds(s, opts), builds.values()))
            both.append(time.perf_counter() - t0)
        rows.append({"options": oname, "build": "both, 2 threads", "s": float(np.median(both)),
                     "spread": float(np.ptp(both))})
    print(f"{os.cpu_count()} CPUs, {a.model}")
    print(f"{'options':15s} {'build':16s} {'median s':>9s} {'spread':>7s}")
    for r in rows:
        print(f"{r['options']:15s} {r['build']:16s} {r['s']:9.2f} {r['spread']:7.2f}")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(exist_ok=True)
    (out / "compile_time.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Where the edit loop's compile time goes: NVRTC wall time of the timed and the debug build (the two builds a
reload compiles), alone and both at once in two threads (as the workbench does).

    python scripts/compile_time.py --model llama-3.2-1b [--repeats 3] [--set sampler=greedy --set ptxas_opt=1]

Needs no GPU. Prints a table (medians) and writes compile_time.json under $OUT.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from workbench.compiler.assemble import Assembled, assemble, option_from_text, with_fields  # noqa: E402
from workbench.compiler.compile import compile_cubin  # noqa: E402
from workbench.cli import env_output_folder  # noqa: E402
from workbench.model.config import get_config  # noqa: E402


def compile_seconds(asm: Assembled) -> float:
    """One real NVRTC compile (the workbench's own compile_cubin). A unique global is appended first: some NVRTC
    installations cache compiles (a unique comment was not enough), and an edit never hits such a cache."""
    asm = dataclasses.replace(asm, source=asm.source + f"__device__ int wb_compile_nonce_{time.time_ns()};\n")
    t0 = time.perf_counter()
    compile_cubin(asm)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a BuildOptions or launch field for both builds (repeatable)")
    ap.add_argument("--flag", action="append", default=[], help="an extra NVRTC option for both builds (repeatable)")
    ap.add_argument("--debug-set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a BuildOptions or launch field for the debug build only (repeatable)")
    a = ap.parse_args()
    out = env_output_folder(ap, "OUT", "out")           # before the compiles, not after them
    cfg = get_config(a.model)
    def fields(items):
        return {k: option_from_text(k, v) for k, _, v in (item.partition("=") for item in items)}
    builds = {"timed": assemble(cfg, with_fields(timing=True, **fields(a.set))),
              "debug": assemble(cfg, with_fields(taps=True, **{**fields(a.set), **fields(a.debug_set)}))}
    builds = {k: dataclasses.replace(b, flags=b.flags + tuple(a.flag)) for k, b in builds.items()}
    rows = []
    for b, asm in builds.items():
        t = [compile_seconds(asm) for _ in range(a.repeats)]
        rows.append({"build": b, "s": float(np.median(t)), "spread": float(np.ptp(t))})
    both = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(compile_seconds, builds.values()))
        both.append(time.perf_counter() - t0)
    rows.append({"build": "both, 2 threads", "s": float(np.median(both)), "spread": float(np.ptp(both))})
    print(f"{os.cpu_count()} CPUs, {a.model}", " ".join(a.set + a.flag + [f"debug:{s}" for s in a.debug_set]))
    print(f"{'build':16s} {'median s':>9s} {'spread':>7s}")
    for r in rows:
        print(f"{r['build']:16s} {r['s']:9.2f} {r['spread']:7.2f}")
    tag = "_".join(s.replace("=", "-").lstrip("-") for s in a.set + a.flag + a.debug_set)
    (out / f"compile_time{'_' + tag if tag else ''}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

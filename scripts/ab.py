"""A/B of build variants on one GPU: verify each quickly, then tok/s (median of repeats) at a short and a long
position, plus the per-stage table of each from a timing build.

    python scripts/ab.py --model llama-3.2-1b --variant base: --variant fenced:WB_BAR_FENCES=1 ...

A variant is NAME:DEFINE=VALUE,DEFINE=VALUE or NAME:@section=variant (a kernels/sections/NAME@VARIANT.cuh file, or
NAME@VARIANT.ptx for a variant named ptx..., a stage written in PTX: e.g. ptx:@embedding=ptx) or
NAME:opt.FIELD=VALUE (a BuildOptions or launch field, e.g. opt.attn_min_chunk=64) or NAME:dir=PATH (the kernels/
tree of another commit, e.g. from `git archive`); items mix freely.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import workbench.compiler.assemble as A  # noqa: E402
from workbench import paths, schedule  # noqa: E402
from workbench.cli import env_output_folder  # noqa: E402
from workbench.model.config import get_config  # noqa: E402
from workbench.model.weights import prepare, random_weights  # noqa: E402
from workbench.run.runtime import Monokernel  # noqa: E402
from workbench.measure.bench import format_ab  # noqa: E402
from workbench.measure.timing import (barrier_cost, boundary_table, critical_table,  # noqa: E402
                                      format_barrier, format_boundaries, format_critical, format_table, stage_table)
from workbench.check.verify import verify  # noqa: E402

KERNELS = paths.kernels_dir()                        # this checkout's kernels/


def parse(spec: str):
    name, _, rest = spec.partition(":")
    defines, variants, fields, kdir = [], [], {}, KERNELS
    for item in filter(None, rest.split(",")):
        if item.startswith("dir="):                 # another kernels/ tree, e.g. an older commit's
            kdir = Path(item[4:])
        elif item.startswith("opt."):
            k, _, v = item[4:].partition("=")
            fields[k] = A.option_from_text(k, v)
        elif item.startswith("@"):
            sec, _, var = item[1:].partition("=")
            variants.append((sec, var))
        else:
            k, _, v = item.partition("=")
            defines.append((k, v))
    return name, tuple(defines), tuple(variants), fields, kdir


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--positions", type=int, nargs="+", default=[0, 3700])
    ap.add_argument("--stages", action="store_true", help="also the per-stage table (timing build)")
    ap.add_argument("--stage-positions", type=int, nargs="+", default=[0],
                    help="positions of the per-stage tables (default 0)")
    ap.add_argument("--max-seq", type=int, default=None, help="KV-cache length (for positions past the default)")
    a = ap.parse_args()
    out = env_output_folder(ap, "OUT", "out")           # before the runs, not after them
    cfg = get_config(a.model, max_seq=a.max_seq)
    p = prepare(random_weights(cfg, 7, xp=cp, progress=False), xp=cp, progress=False)
    results = {}
    for spec in a.variant:
        name, defines, variants, fields, kdir = parse(spec)
        paths.set_kernels_dir(kdir)
        fields = {"threads": a.threads, **fields}        # a variant's opt.threads over --threads
        opt = A.with_fields(defines=defines, variants=variants, **fields)
        mk = Monokernel(p, opt, max_steps=4400)
        try:
            rep = verify(mk, prompt_len=6, max_new=10, seed=3)
            row = {"verify": rep.summary(), "passed": rep.passed}
        except Exception as e:            # a probe variant that computes nothing real still gets timed
            row = {"verify": f"{type(e).__name__}: {e}", "passed": False}
        row.update(resources=mk.resources(), compile_s=mk.compile_s)
        for pos in a.positions:
            runs = [mk.generate([1], a.tokens, eos=[], pos0=pos).tok_per_s for _ in range(a.repeats)]
            row[f"tok_s@{pos}"] = float(np.median(runs))
        if a.stages:
            timing = A.with_fields(defines=defines, variants=variants, timing=True, **fields)
            mkt = Monokernel(p, timing, max_steps=4400)
            row["stages"] = ""
            for sp in a.stage_positions:
                r = mkt.generate([1], 48, eos=[], timing_steps=48, pos0=sp)
                row["stages"] += f"-- position {sp}\n" + format_table(stage_table(cfg, r.timing, sp)) + "\n" + \
                    format_boundaries(boundary_table(cfg, r.timing)) + "\n" + \
                    format_critical(critical_table(cfg, r.timing)) + "\n" + \
                    format_barrier(barrier_cost(r.timing)) + "\n"
            if (ahead := schedule.ahead(cfg, opt.launch)) is not None:
                copied = sum(ahead.block_bytes(opt.launch.grid)) * cfg.n_layers
                row["stages"] += (f"(Launch.ahead: {copied / 1e6:.1f} MB a token of {ahead.stage}'s bytes, counted in "
                                  f"its row, were copied during the slots of {ahead.posted_after} and "
                                  f"{ahead.issuer})\n")
            del mkt
        results[name] = row
        print(f"{name:16s} {'PASS' if row['passed'] else 'FAIL'} " +
              " ".join(f"{k}={v:.0f}" for k, v in row.items() if k.startswith("tok_s")) +
              f" regs={row['resources']['registers']} local={row['resources']['local_bytes']}", flush=True)
        if a.stages:
            print(row["stages"], flush=True)
        del mk
    print(format_ab(results, a.positions))
    (out / "ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

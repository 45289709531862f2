"""Failure injection through the editing loop, on a GPU: edits that hang, fault, overflow or break the compiler,
each applied with Workbench.edit + reload (the GPU in a worker process), the report read, the edit undone, and the
next reload checked. Then what isolation costs: reloads and tok/s through the worker against the in-process path.

    python scripts/failure_suite.py [--model llama-3.2-1b] [--only NAME ...] [--json out.json]

Works on a private copy of kernels/. Prints one row per failure: what was injected, what the loop reported (the
kind, the block and stage named), seconds to the report, seconds to the next passing reload.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench import paths  # noqa: E402
from workbench.check.failures import INJECTIONS  # noqa: E402
from workbench.cli import output_file  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--json", type=output_file)
    ap.add_argument("--compile-limit", type=float, default=4.5,
                    help="seconds after which a compile is a hang (fresh compiles of 1b take 1.4-2.5 s)")
    ap.add_argument("--no-overhead", action="store_true")
    a = ap.parse_args(argv)
    from workbench.loop.sections import section_file
    from workbench.loop.session import Workbench
    todo = [i for i in INJECTIONS if not a.only or i.name in a.only]
    work = Path(tempfile.mkdtemp(prefix="wb-failures-"))
    shutil.copytree(paths.kernels_dir(), work / "kernels", ignore=shutil.ignore_patterns(".history"))
    rows, out = [], {"model": a.model}
    with paths.use_kernels_dir(work / "kernels"):
        t0 = time.perf_counter()
        wb = Workbench(a.model, activate=False, history_dir=work / "history", compile_limit_s=a.compile_limit)
        out["setup_s"] = time.perf_counter() - t0
        out["worker_start_s"] = wb.backend.start_s
        print(wb.last.report(), flush=True)
        for inj in todo:
            path = section_file(inj.section)
            original = path.read_text()
            wb.edit(inj.section, inj.apply(original))
            t1 = time.perf_counter()
            rec = wb.reload(trigger="edit", section=inj.section)
            reported = time.perf_counter() - t1
            wb.undo(inj.section, reload=False)
            assert path.read_text() == original
            t2 = time.perf_counter()
            nxt = wb.reload(trigger="undo", section=inj.section)
            recovered = time.perf_counter() - t2
            named = rec.first_failure or rec.error or ""
            row = {"name": inj.name, "section": inj.section, "what": inj.what, "status": rec.status,
                   "expected": inj.expect, "as_expected": inj.expect in ("any", rec.status),
                   "named": inj.named(rec), "block": inj.block,
                   "report_s": reported, "detect_s": rec.detect_s,
                   "next_reload_s": recovered, "next_passed": bool(nxt.passed), "report": named[:400],
                   "blocks": summarize(rec)}
            rows.append(row)
            row["restart_s"] = getattr(wb.backend, "restart_s", None)   # the new worker, measured by the next call
            print(f"{inj.name:22s} {rec.status:22s} reported {reported:5.1f} s (detected {rec.detect_s or 0:4.1f} s); "
                  f"next reload {'PASS' if nxt.passed else 'FAIL'} in {recovered:4.1f} s (new worker with the last "
                  f"good kernels {row['restart_s'] or 0:4.1f} s after the failure)\n    {named[:300]}", flush=True)
        out["rows"] = rows
        if not a.no_overhead:
            out["overhead"] = overhead(wb, a.model, work)
        wb.close()
    shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'injected':22s} {'reported as':22s} {'named':>9s} {'report':>7s} {'next reload':>12s}")
    for r in rows:
        named = ("-" if r["block"] is None else f"block {r['block']}") if r["named"] else "NOT NAMED"
        print(f"{r['name']:22s} {r['status']:22s} {named:>9s} {r['report_s']:6.1f}s {r['next_reload_s']:8.1f}s "
              f"{'PASS' if r['next_passed'] else 'FAIL'}{'' if r['as_expected'] else '  (expected ' + r['expected'] + ')'}")
    if "overhead" in out:
        o = out["overhead"]
        print("overhead (medians of 7 interleaved reloads, no new compile):")
        for key in ("total", "compile", "verify", "time"):
            print(f"  {key:8s} worker {o['worker_' + key]:.3f} s  in process {o['inproc_' + key]:.3f} s  "
                  f"({1e3 * (o['worker_' + key] - o['inproc_' + key]):+.0f} ms)")
        print(f"  the pipe (call wall time here minus service time there, summed per reload): "
              f"{1e3 * o['pipe_per_reload_s']:.1f} ms")
        print(f"overhead: reload median {o['worker_reload_s']:.3f} s in the worker vs {o['inproc_reload_s']:.3f} s "
              f"in process ({1e3 * (o['worker_reload_s'] - o['inproc_reload_s']):+.0f} ms); tok/s {o['worker_tok_s']:.0f} "
              f"vs {o['inproc_tok_s']:.0f}; where-words mapped {o['mapped_tok_s']:.0f} vs on the device "
              f"{o['device_tok_s']:.0f} tok/s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    ok = all(r["as_expected"] and r["named"] and r["next_passed"] for r in rows)
    return 0 if ok else 1


def summarize(rec) -> str:
    if not rec.blocks:
        return ""
    from workbench.run.worker import summarize_blocks
    return summarize_blocks(rec.blocks)


def overhead(wb, model: str, work: Path) -> dict:
    """Reloads (no new compile: the same sources) and tok/s through the worker and in this process; and the
    where-words in mapped host memory against on the device (the kernel's only extra cost of isolation)."""
    import cupy as cp
    import numpy as np

    from workbench.compiler.assemble import BuildOptions
    from workbench.loop.session import Workbench
    from workbench.model.config import get_config
    from workbench.model.weights import prepare, random_weights
    from workbench.run.runtime import Monokernel

    inproc = Workbench(model, activate=False, isolate=False, history_dir=work / "history2")
    kinds = {"worker": wb, "inproc": inproc}
    runs = {k: {"total": [], "compile": [], "verify": [], "time": [], "tok_s": []} for k in kinds}
    pipe = []
    for _ in range(7):                        # interleaved: the two paths see the same machine state
        for k, w in kinds.items():
            if k == "worker":
                w.backend.worker.calls.clear()
            r = w.reload(trigger="manual")
            assert r.passed, r.report()
            for key, v in (("total", r.total_s), ("compile", r.compile_s), ("verify", r.verify_s),
                           ("time", r.time_s), ("tok_s", r.tok_per_s)):
                runs[k][key].append(v)
            if k == "worker":
                pipe.append({c.method: c.overhead_s for c in w.backend.worker.calls})
    inproc.close()
    out = {"runs": runs, "pipe_s": pipe}
    for k in kinds:
        for key, v in runs[k].items():
            out[f"{k}_{key}"] = statistics.median(v)
    out["worker_reload_s"], out["inproc_reload_s"] = out["worker_total"], out["inproc_total"]
    out["pipe_per_reload_s"] = statistics.median(sum(d.values()) for d in pipe)
    cfg = get_config(model)
    p = prepare(random_weights(cfg, 7, xp=cp, progress=False), xp=cp, progress=False)
    ks = {"mapped": Monokernel(p, BuildOptions(), max_steps=300),
          "device": Monokernel(p, BuildOptions(), max_steps=300, where_in_device=True)}
    tps = {k: [] for k in ks}
    for k in ks:
        ks[k].generate([1], 4, eos=[])
    for _ in range(5):
        for k, mk in ks.items():
            tps[k].append(mk.generate([1], 256, eos=[]).tok_per_s)
    out.update({f"{k}_tok_s": float(np.median(v)) for k, v in tps.items()}, where_runs=tps)
    return out


if __name__ == "__main__":
    sys.exit(main())

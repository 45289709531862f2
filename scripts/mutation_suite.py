"""The mutation suite on a GPU: every deliberately wrong edit of workbench/check/mutants.py applied through the
editing loop (Workbench.edit + reload), the verdict read, the edit undone; a table of what was caught, what the
loop named and how long each verdict took, and the score.

    python scripts/mutation_suite.py [--model llama-3.2-1b] [--only NAME ...] [--json out.json]

It works on a private copy of kernels/, so the checkout's files are never touched. Exits 1 unless every mutant is
caught and named.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench import paths  # noqa: E402
from workbench.check.mutants import MUTANTS, by_name, run_suite, table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--json", help="write every outcome here")
    a = ap.parse_args(argv)
    from workbench.loop.session import Workbench
    mutants = [by_name(n) for n in a.only] if a.only else list(MUTANTS)
    work = Path(tempfile.mkdtemp(prefix="wb-mutants-"))
    shutil.copytree(paths.kernels_dir(), work / "kernels", ignore=shutil.ignore_patterns(".history"))
    t0 = time.perf_counter()
    with paths.use_kernels_dir(work / "kernels"):
        wb = Workbench(a.model, activate=False, history_dir=work / "history")
        print(wb.last.report(), flush=True)
        if not wb.last.passed:
            print("the unmutated kernel does not pass: no point in mutating it", file=sys.stderr)
            print(wb.last.stages)
            return 1
        outcomes = run_suite(wb, mutants, log=lambda s: print(s, flush=True))
        after = wb.reload(trigger="manual")
        print("after the suite:", after.report())
        wb.close()
    shutil.rmtree(work, ignore_errors=True)
    print(table(outcomes))
    caught = sum(o.caught for o in outcomes)
    secs = sorted(o.seconds for o in outcomes)
    print(f"{a.model}: {caught}/{len(outcomes)} caught and named; edit → verdict median {secs[len(secs) // 2]:.2f} s "
          f"(min {secs[0]:.2f}, max {secs[-1]:.2f}); suite {time.perf_counter() - t0:.0f} s; unmutated after: "
          f"{'PASS' if after.passed else 'FAIL'}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "model": a.model, "caught": caught, "total": len(outcomes), "after_passed": after.passed,
            "outcomes": [{**dataclasses.asdict(o.mutant), "status": o.status, "named": o.named, "caught": o.caught,
                          "seconds": o.seconds, "compile_s": o.compile_s, "verify_s": o.verify_s,
                          "first_failure": o.first_failure} for o in outcomes]}, indent=1))
    return 0 if caught == len(outcomes) and after.passed else 1


if __name__ == "__main__":
    sys.exit(main())

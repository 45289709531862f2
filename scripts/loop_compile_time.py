"""The editing loop's compile side, on any machine (a CPU is enough): harmless edits through a Workbench in CPU
mode, on a private copy of kernels/, with the timed build compiled beside the verification build (the pipeline)
or before it, and the verification build at each NVRTC -Ofc level asked for. What a GPU adds (verify, time) is
not here: on a CPU the verdict comes once the verification build has compiled.

    python scripts/loop_compile_time.py [--model llama-3.2-1b] [--edits 5] [--levels min mid max] [--no-serial]
                                        [--units]

`--units` adds a mode with the verification build in units (workbench.compiler.units, at -Ofc=min).

Prints a table of medians and writes loop_compile_time.json under $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench import paths  # noqa: E402
from workbench.cli import env_output_folder  # noqa: E402
from workbench.loop.benchmark import EDIT_SECTIONS, medians, timed_edit  # noqa: E402
from workbench.loop.sections import section_file  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--edits", type=int, default=5, help="edits per mode, over the sections in turn")
    ap.add_argument("--levels", nargs="+", default=["min", "mid", "max"], choices=("0", "min", "mid", "max"))
    ap.add_argument("--no-serial", action="store_true", help="leave out the both-builds-first mode")
    ap.add_argument("--units", action="store_true", help="also the verification build in units, one per stage")
    a = ap.parse_args(argv)
    out = env_output_folder(ap, "OUT", "out")           # before the edits, not after them
    from workbench.loop.session import Workbench
    work = Path(tempfile.mkdtemp(prefix="wb-loop-compile-"))
    shutil.copytree(paths.kernels_dir(), work / "kernels", ignore=shutil.ignore_patterns(".history"))
    modes = ([] if a.no_serial else [(False, "min", False)]) + [(True, level, False) for level in a.levels] + \
        ([(True, "min", True)] if a.units else [])
    rows = []
    try:
        with paths.use_kernels_dir(work / "kernels"):
            wb = Workbench(a.model, device="cpu", activate=False, history_dir=work / "history",
                           parallel_compile=True, cpu_reference=False)
            originals = {n: section_file(n).read_text() for n in EDIT_SECTIONS}
            for pipeline, level, units in modes:
                wb.pipeline, wb.verify_fast_compile, wb.verify_units = pipeline, level, units
                wb.reload()                            # the mode's first build
                names = [EDIT_SECTIONS[i % len(EDIT_SECTIONS)] for i in range(a.edits)]
                runs = [timed_edit(wb, n, originals[n] + f"\n// loop_compile_time {i} {time.time_ns()}\n")
                        for i, n in enumerate(names)]
                bad = [r for r in runs if r["status"] != "compiled; no GPU to run"]
                if bad:
                    print(f"an edit did not compile: {bad[0]['error']}", file=sys.stderr)
                    return 1
                rows.append({"pipeline": pipeline, "verify_fast_compile": level + (" units" if units else ""),
                             **medians(runs), "runs": runs})
            wb.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{os.cpu_count()} CPUs, {a.model}, {a.edits} edits per mode (medians, seconds)")
    print(f"{'timed build':24s} {'verify -Ofc':>11s} {'compile':>8s} {'timed':>7s} {'edit→verdict':>13s} "
          f"{'edit→record':>12s}")
    for r in rows:
        timed = "beside" if r["pipeline"] else "first"
        print(f"{timed:24s} {r['verify_fast_compile']:>11s} {r['compile_s']:8.2f} {r['timed_compile_s']:7.2f} "
              f"{r['edit_to_verdict_s']:13.2f} {r['edit_to_record_s']:12.2f}")
    (out / "loop_compile_time.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The mutation suite on a GPU: every mutant (a deliberately wrong edit, declared in the kernel file it edits:
workbench/check/mutants.py) applied through the editing loop (Workbench.edit + reload), the verdict read, the edit
undone; a table of what was caught, what the loop named and how long each verdict took, and the score.

    python scripts/mutation_suite.py [--model llama-3.2-1b] [--only NAME ...] [--json out.json]

Every model's mutants run on --model; a family's own (Qwen3's q/k norm, Qwen2's biases) on its preset
(mutants.FAMILY_MODELS), unless --model is of that family already. It works on a private copy of kernels/, so the
checkout's files are never touched. Exits 1 unless every mutant is caught and named and each model's unmutated
kernel passes after its mutants.
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
from workbench.check.mutants import FAMILY_MODELS, MUTANTS, by_name, for_model  # noqa: E402
from workbench.cli import output_file  # noqa: E402
from workbench.loop.mutation import run_suite, table  # noqa: E402
from workbench.model.config import get_config  # noqa: E402


def groups(model: str, mutants) -> dict[str, list]:
    """{model: its mutants}: those --model compiles on it, each family's other mutants on the family's preset."""
    out = {model: for_model(get_config(model), mutants)}
    for flag, family_model in FAMILY_MODELS.items():
        rest = [m for m in mutants if m.needs == flag and m not in out[model]]
        if rest:
            out.setdefault(family_model, []).extend(rest)
    return out


def run_model(model: str, mutants, log, on_outcome=None, **workbench_kw) -> tuple[list, bool]:
    """The mutants on one model's workbench, on a private copy of the kernels: (outcomes, unmutated passes after)."""
    from workbench.loop.session import Workbench
    work = Path(tempfile.mkdtemp(prefix="wb-mutants-"))
    shutil.copytree(paths.kernels_dir(), work / "kernels", ignore=shutil.ignore_patterns(".history"))
    try:
        with paths.use_kernels_dir(work / "kernels"):
            wb = Workbench(model, activate=False, history_dir=work / "history", **workbench_kw)
            log(f"{model}: {wb.last.report()}")
            if not wb.last.passed:
                log(f"{model}: the unmutated kernel does not pass: no point in mutating it\n{wb.last.stages}")
                wb.close()
                return [], False
            outcomes = run_suite(wb, mutants, log=log, on_outcome=on_outcome)
            after = wb.reload(trigger="manual")
            log(f"{model}: after the suite: {after.report()}")
            wb.close()
            return outcomes, bool(after.passed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--json", type=output_file, help="write every outcome here")
    ap.add_argument("--verify-fast-compile", choices=("0", "min", "mid", "max"),
                    help="NVRTC's -Ofc level for the verification build (default: the workbench's)")
    ap.add_argument("--verify-whole", action="store_true",
                    help="the verification build whole, not in units (the -Ofc levels are the whole build's)")
    a = ap.parse_args(argv)
    kw = {"verify_fast_compile": a.verify_fast_compile} if a.verify_fast_compile else {}
    if a.verify_whole or a.verify_fast_compile:
        kw["verify_units"] = False
    mutants = [by_name(n) for n in a.only] if a.only else list(MUTANTS)
    t0 = time.perf_counter()
    results, all_after, not_run = [], True, []
    planned = groups(a.model, mutants)

    def write(complete: bool, ran: list):
        """The JSON so far: after each mutant (complete False: a suite cut short keeps what it ran), then whole."""
        if not a.json:
            return
        caught = sum(o.caught for _, o in ran)
        Path(a.json).write_text(json.dumps({
            "model": a.model, "complete": complete, "planned": sum(map(len, planned.values())), "caught": caught,
            "total": len(ran),
            "after_passed": all_after if complete else None, "not_run": not_run,
            "outcomes": [{**dataclasses.asdict(o.mutant), "model": model, "status": o.status, "named": o.named,
                          "caught": o.caught, "seconds": o.seconds, "compile_s": o.compile_s,
                          "verify_s": o.verify_s, "record_s": o.record_s, "first_failure": o.first_failure}
                         for model, o in ran]},
            indent=1))

    for model, ms in planned.items():
        if not ms:
            continue
        ran = list(results)

        def done(outcome, model=model, ran=ran):
            ran.append((model, outcome))
            write(False, ran)

        outcomes, after = run_model(model, ms, log=lambda s: print(s, flush=True), on_outcome=done, **kw)
        results += [(model, o) for o in outcomes]
        all_after &= after
        if not outcomes:                   # its unmutated kernel failed: the other models' results still count
            not_run += [(model, m.name) for m in ms]
    outcomes = [o for _, o in results]
    if not outcomes:
        print("no mutant ran", file=sys.stderr)
        return 1
    print(table(outcomes))
    caught = sum(o.caught for o in outcomes)
    secs = sorted(o.seconds for o in outcomes)
    models = ", ".join(sorted({m for m, _ in results}))
    how = ", ".join([f"-Ofc={a.verify_fast_compile}"] * bool(a.verify_fast_compile) + ["whole"] * (a.verify_whole and not a.verify_fast_compile))
    print(f"{models}{' (verification build ' + how + ')' if how else ''}: "
          f"{caught}/{len(outcomes)} caught and named; edit → verdict median {secs[len(secs) // 2]:.2f} s "
          f"(min {secs[0]:.2f}, max {secs[-1]:.2f}); suite {time.perf_counter() - t0:.0f} s; unmutated after: "
          f"{'PASS' if all_after else 'FAIL'}" + (f"; not run (their model failed unmutated): {not_run}" if not_run else ""))
    write(True, results)
    return 0 if caught == len(outcomes) and all_after and not not_run else 1


if __name__ == "__main__":
    sys.exit(main())

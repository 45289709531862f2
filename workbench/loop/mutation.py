"""The mutation suite run through the editing loop: each mutant of workbench.check.mutants applied to its section
with Workbench.edit, the workbench reloaded, the verdict read (caught: rejected, and pinned on the stage the mutant
names), the edit undone. scripts/mutation_suite.py runs it on a GPU and prints `table`."""
from __future__ import annotations

import dataclasses
import math
import time

from ..check.mutants import MUTANTS, Mutant
from .sections import section_file


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str                # the record's status
    named: str | None          # the stage the loop named (None: it passed, or did not run)
    caught: bool               # rejected and named the expected stage
    seconds: float             # edit → verdict (the verification's; the timed build compiles beside it)
    compile_s: float
    verify_s: float
    first_failure: str | None
    record_s: float = float("nan")     # edit → the whole record (the timed build compiled and timed)


def run_suite(wb, mutants=MUTANTS, log=print, on_outcome=None) -> list[Outcome]:
    """Apply each mutant through `wb` (a GPU Workbench, on a copy of the kernels it may edit), reload, read the
    verdict, undo. The workbench must pass before and after. `on_outcome(outcome)` after each mutant: a suite cut
    short (a time limit) keeps what it ran."""
    out = []
    for m in mutants:
        path = section_file(m.section)
        original = path.read_text()
        t0 = time.perf_counter()
        wb.edit(m.section, m.apply(original))
        written = time.perf_counter() - t0
        rec = wb.reload(trigger="edit", section=m.section)
        whole = time.perf_counter() - t0
        dt = written + rec.verdict_s if math.isfinite(rec.verdict_s) else whole
        named = rec.failure.stage if rec.failure is not None else None
        caught = rec.passed is False and named == m.expect
        out.append(Outcome(m, rec.status, named, caught, dt, rec.compile_s, rec.verify_s, rec.first_failure,
                           whole))
        log(f"{'caught' if caught else 'MISSED'} {m.name:26s} {m.section:18s} named {named or '-':18s} "
            f"{dt:5.2f} s  {rec.first_failure or rec.status}")
        wb.undo(m.section, reload=False)
        if path.read_text() != original:
            raise RuntimeError(f"undo did not restore {path}")
        if on_outcome is not None:
            on_outcome(out[-1])
    return out


def table(outcomes: list[Outcome]) -> str:
    lines = [f"{'mutant':26s} {'section':18s} {'breaks':58s} {'named':18s} {'edit→verdict':>12s}"]
    for o in outcomes:
        lines.append(f"{o.mutant.name:26s} {o.mutant.section:18s} {o.mutant.breaks[:58]:58s} "
                     f"{(o.named or '—') + ('' if o.caught else ' ✗'):18s} {o.seconds:10.2f} s")
    caught = sum(o.caught for o in outcomes)
    lines.append(f"score: {caught}/{len(outcomes)} caught and named ({100 * caught / max(len(outcomes), 1):.0f}%)")
    return "\n".join(lines)

"""The tables outside the plan that hold something per stage, keyed by the plan's stage names and held to them: the
prefill's GPU implementations (run/prefill_gpu.IMPLEMENTS, found through each stage's math), the mutants by the
section each edits (check/mutants.MUTANTS, read from the kernel files) and the failure injections likewise
(check/failures.INJECTIONS). Every key is a stage of the plan (a table of edits may also name a library file); every
stage is covered, or declared exempt with the reason in the table's <TABLE>_EXEMPT. A stage added to the plan fails
here, by name, until each table has an entry for it or says why not. `pytest -v` lists each table's stages, one test
apiece named covered or exempt."""
from __future__ import annotations

import pytest

from workbench import plan
from workbench.check import failures, mutants
from workbench.run import prefill_gpu


def _tables() -> dict:
    """{table: (the stages or files it keys, its exemptions {stage: reason}, the library files it may also key)}"""
    return {
        "IMPLEMENTS": ({s.name for s in plan.STAGES if prefill_gpu.implementation(s)}, prefill_gpu.IMPLEMENTS_EXEMPT,
                       ()),
        "MUTANTS": ({m.section for m in mutants.MUTANTS}, mutants.MUTANTS_EXEMPT, plan.LIBRARY),
        "INJECTIONS": ({i.section for i in failures.INJECTIONS}, failures.INJECTIONS_EXEMPT, plan.LIBRARY),
    }


def _coverage(table: str) -> str:
    keys, exempt, _ = _tables()[table]
    covered = [s for s in plan.STAGE_NAMES if s in keys]
    return f"{table} covers {', '.join(covered) or 'no stage'}; exempt: {', '.join(exempt) or 'none'}"


@pytest.mark.parametrize("table", list(_tables()))
def test_every_key_is_a_stage_of_the_plan(table):
    keys, exempt, library = _tables()[table]
    stray = sorted(k for k in keys if k not in plan.STAGE_NAMES and k not in library)
    assert not stray, f"{table}: {stray} not stages of the plan ({', '.join(plan.STAGE_NAMES)})"
    stray = sorted(k for k in exempt if k not in plan.STAGE_NAMES)
    assert not stray, f"{table}_EXEMPT: {stray} not stages of the plan"
    both = sorted(set(exempt) & keys)
    assert not both, f"{table}: {both} both covered and declared exempt"
    blank = sorted(s for s, why in exempt.items() if not (isinstance(why, str) and why.strip()))
    assert not blank, f"{table}_EXEMPT: {blank} without a reason"


def _status(table: str, stage: str) -> str:
    keys, exempt, _ = _tables()[table]
    return "covered" if stage in keys else "exempt" if stage in exempt else "missing"


@pytest.mark.parametrize("table,stage", [(t, s) for t in _tables() for s in plan.STAGE_NAMES],
                         ids=[f"{t}-{s}-{_status(t, s)}" for t in _tables() for s in plan.STAGE_NAMES])
def test_every_stage_has_an_entry_or_a_reason(table, stage):
    assert _status(table, stage) != "missing", (
        f"{table} has no entry for the plan's stage {stage}: add one, or declare it in {table}_EXEMPT with the "
        f"reason ({_coverage(table)})")

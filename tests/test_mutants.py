"""The mutation suite without a GPU: every mutant applies to today's section text exactly where it means to, and
the mutated kernel still compiles (a mutant that failed to compile would be 'caught' for the wrong reason). Running
them and reading the verdicts needs a GPU: scripts/mutation_suite.py."""
from __future__ import annotations

import pytest

from workbench import plan
from workbench.build.assemble import BuildOptions, assemble, section_path
from workbench.build.compile import compile_cubin
from workbench.check.mutants import FAMILY_MODELS, MUTANTS, by_name, for_model
from workbench.model.config import get_config


def test_the_suite_is_large_and_spread_over_every_stage():
    assert len(MUTANTS) >= 30
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    stages = {m.section for m in MUTANTS}
    assert set(plan.STAGE_NAMES) <= stages, set(plan.STAGE_NAMES) - stages
    for m in MUTANTS:
        assert m.section in plan.FILES and m.expect in plan.STAGE_NAMES, m.name


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_and_compiles(m):
    text = section_path(m.section).read_text()
    mutated = m.apply(text)
    assert mutated != text
    opt = BuildOptions(taps=True, fast_compile="min", sampler="full" if m.section == "sampling" else "greedy")
    cfg = get_config("tiny").with_(**({m.needs: True} if m.needs else {}))   # a family's code compiled in
    compile_cubin(assemble(cfg, opt, overrides={m.section: mutated}))


def test_each_familys_mutants_run_on_a_model_of_that_family():
    for m in MUTANTS:
        if m.needs:
            cfg = get_config(FAMILY_MODELS[m.needs])
            assert getattr(cfg, m.needs) and m in for_model(cfg), m.name
            assert m not in for_model(get_config("llama-3.2-1b")), m.name


def test_a_mutant_that_no_longer_applies_says_so():
    m = by_name("rope-sign")
    with pytest.raises(ValueError, match="occurs 0 times"):
        m.apply("// nothing to mutate here\n")

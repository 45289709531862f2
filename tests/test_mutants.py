"""The mutation suite without a GPU: every mutant applies to today's section text exactly where it means to, and
the mutated kernel still compiles (a mutant that failed to compile would be 'caught' for the wrong reason). Running
them and reading the verdicts needs a GPU: scripts/mutation_suite.py."""
from __future__ import annotations

import functools

import pytest

from workbench import plan
from workbench.compiler.assemble import BuildOptions, assemble, section_path
from workbench.compiler.compile import compile_cubin
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
        if m.not_with:                                 # compiled away there: not run on that family
            assert m not in for_model(get_config(FAMILY_MODELS[m.not_with])), m.name


@functools.lru_cache(maxsize=None)
def _section_ptx(model: str, section: str, listed: str, sampler: str, text: str) -> str:
    from workbench.compiler.compile import dump_section
    cfg = get_config(model).with_(max_seq=4352)
    opt = BuildOptions(fast_compile="min", sampler=sampler)
    return dump_section(assemble(cfg, opt, overrides={section: text}), "ptx", listed)


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_a_mutant_changes_the_code_of_every_model_it_runs_on(m):
    """A mutant whose edit compiles to the same PTX would be scored missed for nothing (or hide a verifier gap):
    on each model it runs on (a Llama, and each family's preset), the mutated section's PTX differs."""
    listed = m.expect if m.section in plan.LIBRARY else m.section
    sampler = "full" if m.section == "sampling" else "greedy"
    text = section_path(m.section).read_text()
    for name in ("tiny", *FAMILY_MODELS.values()):
        if m in for_model(get_config(name)):
            assert (_section_ptx(name, m.section, listed, sampler, text)
                    != _section_ptx(name, m.section, listed, sampler, m.apply(text))), (m.name, name)

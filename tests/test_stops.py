"""The stop decision's checks (workbench/check/stops.py) and the repeat check, on the CPU stand-in for the kernel:
a right kernel passes every branch, and a kernel with one rule broken, as each publish mutant breaks it, fails
that rule's check, named at the publish stage, and no other. A run whose second copy differs is pinned on the first
stage whose output differs."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_sim import SimKernel

from workbench.check import mutants
from workbench.check.stops import ABORT_EVERY, verify_repeat, verify_stops
from workbench.check.verify import verify_stages
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights

# the rule each publish mutant breaks, by the check that must fail (stops.py's names)
BROKEN = {"eos-only-first-id": "eos[1]", "max-new-ignored": "max_new", "n-steps-ignored": "n_steps",
          "cache-end-one-early": "end of the cache", "abort-ignored": "host abort", "nan-runs-on": "non-finite logit"}


@pytest.fixture(scope="module")
def tiny_p():
    # a short cache: the end-of-cache run decodes there over the whole context
    return prepare(random_weights(get_config("tiny", max_seq=64), seed=3, progress=False), progress=False)


def test_every_branch_of_a_right_stop_decision_passes(tiny_p):
    checks = verify_stops(SimKernel(tiny_p), seed=2)
    names = [c.buffer for c in checks]
    assert all(c.passed for c in checks), [f"{c.buffer}: {c.note}" for c in checks if not c.passed]
    assert {c.stage for c in checks} == {"publish"}
    eos = max(2, len(tiny_p.cfg.eos_token_ids))
    # every rule, and every position of an EOS list as long as the config's
    for want in ("stop: max_new", "stop: n_steps = 1", "stop: end of the cache", "stop: host abort",
                 "stop: non-finite logit", *(f"stop: eos[{j}] of {eos}" for j in range(eos))):
        assert want in names, names


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_each_broken_rule_fails_its_own_check_only(tiny_p, bug):
    assert mutants.by_name(bug).section == "publish"            # the mutant this stands in for exists
    checks = verify_stops(SimKernel(tiny_p, stop_bug=bug), seed=2)
    failed = [c.buffer for c in checks if not c.passed]
    assert failed and all(BROKEN[bug] in f for f in failed), (bug, failed)
    assert all(c.stage == "publish" and c.rel_l2 == float("inf") for c in checks if not c.passed)


def test_the_weights_a_stop_check_poisons_are_put_back(tiny_p):
    before = tiny_p.embed.copy()
    verify_stops(SimKernel(tiny_p, stop_bug="nan-runs-on"), seed=2)
    assert np.array_equal(tiny_p.embed, before)


def test_the_abort_check_wants_the_step_the_word_is_read_at(tiny_p):
    sim = SimKernel(tiny_p)
    checks = {c.buffer: c for c in verify_stops(sim, seed=2)}
    assert checks["stop: host abort"].passed
    assert f"stopped after {ABORT_EVERY} steps" in checks["stop: host abort"].note


def test_a_kernel_that_stops_one_step_early_fails_the_limits(tiny_p):
    checks = verify_stops(SimKernel(tiny_p, stops_early=True), seed=2)
    failed = {c.buffer for c in checks if not c.passed}
    assert "stop: n_steps = 3" in failed or "stop: n_steps = 4" in failed, failed


def test_a_second_identical_run_passes_the_repeat_check(tiny_p):
    table, results = verify_stages(SimKernel(tiny_p), seed=1)
    rep = [c for c in table.extra if c.buffer == "repeat: bit for bit"]
    assert len(rep) == 1 and rep[0].passed and table.passed


def test_a_run_that_does_not_repeat_is_pinned_on_the_first_stage_that_differs(tiny_p):
    """Order-dependent sums in the MLP's down projection: the second run's x differs in its last bit at layer 1."""
    calls = {"n": 0}

    def hook(stage, layer, step, out):
        if stage == "down_residual" and layer == 1 and step == 1 and calls["n"] >= 1:
            out = {k: v.copy() for k, v in out.items()}
            out["x"] = np.nextafter(out["x"], np.float32(np.inf))      # one ulp: the order of float adds
        return out

    sim = SimKernel(tiny_p, hook=hook)
    first = sim.generate([1, 2, 3], 3, tap_steps=[0, 1, 2, 3, 4], record=[0, 1, 2, 3, 4])
    calls["n"] += 1
    bad = verify_repeat(sim, first, lambda: sim.generate([1, 2, 3], 3, tap_steps=[0, 1, 2, 3, 4],
                                                         record=[0, 1, 2, 3, 4]))
    assert len(bad) == 1 and not bad[0].passed
    assert (bad[0].stage, bad[0].layer, bad[0].step) == ("down_residual", 1, 1)


def test_a_repeat_that_differs_only_in_its_tokens_is_still_caught(tiny_p):
    sim = SimKernel(tiny_p)
    first = sim.generate([1, 2, 3], 3)
    again = sim.generate([1, 2, 3], 3)
    again.tokens = [t + 1 for t in again.tokens]
    bad = verify_repeat(sim, first, lambda: again)
    assert not bad[0].passed and bad[0].stage == "publish"

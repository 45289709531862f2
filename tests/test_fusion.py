"""Fusing two stages into one touches the plan, the section and the stage math only (DESIGN.md, fusing two
stages): gate_up_silu folded into down_residual as one stage, declared here as the walk-through declares it, runs
through the reference interpreter and tensor parallelism unchanged, finds its all-reduce from the weights it reads,
and has a prefill implementation made of its parts'. The kernel's side (one section file) is the walk-through's
second step; what is checked here is that nothing else needs an edit."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workbench import plan, schedule
from workbench.model import stage_math as ref
from workbench.model.config import get_config
from workbench.model.weights import random_weights
from workbench.reference import forward
from workbench.run import prefill_gpu
from workbench.tp.reference import reduction, tp_forward

CFG = get_config("tiny").with_(intermediate=704, max_seq=64)     # 704 splits in two for the tensor-parallel run


def _mlp_residual() -> plan.Stage:
    gate_up, down = plan.stage("gate_up_silu"), plan.stage("down_residual")
    return dataclasses.replace(
        down, name="mlp_residual", doc="x += Wd·(silu(Wg·m(h)) ⊙ Wu·m(h))",
        reads=(plan.Use("h"), *(u for u in gate_up.reads if u.buffer == "wgu"), plan.Use("wd"), plan.Use("x")),
        reference=ref.composed(ref.gate_up_silu_io, ref.down_residual_io, gives=("x",)))


def _clear_caches():
    for f in vars(schedule).values():
        if hasattr(f, "cache_clear"):
            f.cache_clear()


@pytest.fixture
def fused(monkeypatch):
    """The plan with the MLP as one stage, for the length of a test."""
    mlp = _mlp_residual()
    stages = tuple(mlp if s.name == "down_residual" else s for s in plan.STAGES if s.name != "gate_up_silu")
    monkeypatch.setattr(plan, "STAGES", stages)
    monkeypatch.setattr(plan, "STAGE_NAMES", tuple(s.name for s in stages))
    monkeypatch.setattr(plan, "_BY_NAME", {s.name: s for s in stages})
    _clear_caches()
    yield mlp
    monkeypatch.undo()
    _clear_caches()


def _run(n_ranks=None):
    w = random_weights(CFG, 6, progress=False)
    tokens = np.random.default_rng(2).integers(0, CFG.vocab, 7)
    if n_ranks is None:
        return forward(w, tokens, dtype=np.float64)
    return tp_forward(w, tokens, n_ranks, dtype=np.float64)


@pytest.fixture(scope="module")
def unfused():
    """The logits of the plan as it is (module scope: computed before any test patches the plan)."""
    assert "gate_up_silu" in plan.STAGE_NAMES
    return _run()


def test_the_fused_stage_computes_what_its_parts_did(unfused, fused):
    assert [n for n, layer in schedule.execution(CFG) if layer == 0] == [
        "qkv_rope_append", "attention_decode", "o_proj_residual", "mlp_residual"]
    np.testing.assert_array_equal(_run(), unfused)   # the same operations in the same order: the same bits


def test_tensor_parallelism_finds_the_fused_stages_all_reduce(unfused, fused):
    assert reduction(fused) == "x"                   # it reads Wd, split by its input columns
    got = _run(2)
    all_reduces = [e for e in got.exchanges if e.kind == "all-reduce"]
    assert [e.stage for e in all_reduces[:2]] == ["o_proj_residual", "mlp_residual"]
    assert len(all_reduces) == 2 * CFG.n_layers
    np.testing.assert_allclose(got.logits, unfused, rtol=1e-10, atol=1e-10)


def test_the_prefill_runs_the_fused_stage_through_its_parts(fused):
    impl = prefill_gpu.implementation(fused)
    assert impl is not None and impl is not prefill_gpu.IMPLEMENTS[ref.down_residual_io]
    assert prefill_gpu.covers(CFG)

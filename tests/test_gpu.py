"""The monokernel on a real GPU (marked gpu: skipped without one). Small shapes, fresh seeds every run: the seed is
printed so a failure can be replayed."""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import fresh_seed

from workbench.build.assemble import BuildOptions
from workbench.build.compile import CompileError
from workbench.model.config import get_config

pytestmark = pytest.mark.gpu




@pytest.fixture(scope="module")
def tiny():
    import cupy as cp

    from workbench.model.weights import prepare, random_weights
    from workbench.run.runtime import Monokernel
    p = prepare(random_weights(get_config("tiny"), fresh_seed(), xp=cp, progress=False), xp=cp, progress=False)
    return Monokernel(p, BuildOptions(), max_steps=4400)


def test_teacher_forced_logits_match_reference(tiny):
    from workbench.check.verify import verify
    rep = verify(tiny, prompt_len=7, max_new=20, seed=fresh_seed())
    print(rep.summary())
    assert rep.passed, rep.summary()
    assert any(s.token_ok for s in rep.steps), "no generated step could be judged"


def test_positions_past_4096(tiny):
    from workbench.check.verify import verify
    rep = verify(tiny, prompt_len=4093, max_new=6, seed=fresh_seed())
    print(rep.summary())
    assert rep.steps[-1].position >= 4096
    assert rep.passed, rep.summary()


@pytest.mark.parametrize("T,k,p", [(0.9, 0, 1.0), (1.0, 40, 1.0), (0.8, 0, 0.85), (1.4, 120, 0.9)])
def test_sampling_distribution(tiny, T, k, p):
    from workbench.run.runtime import Sampling
    from workbench.check.verify import verify_sampling
    rep = verify_sampling(tiny, Sampling(T, k, p, fresh_seed()), draws=20000, seed=fresh_seed())
    print(rep.summary())
    assert rep.passed, rep.summary()


def test_sampling_reproducible_per_seed(tiny):
    from workbench.run.runtime import Sampling
    s = fresh_seed()
    a = tiny.generate([3, 4, 5], 24, Sampling(1.0, 0, 0.95, s), eos=[]).tokens
    b = tiny.generate([3, 4, 5], 24, Sampling(1.0, 0, 0.95, s), eos=[]).tokens
    c = tiny.generate([3, 4, 5], 24, Sampling(1.0, 0, 0.95, s + 1), eos=[]).tokens
    assert a == b and a != c


def test_streaming_and_eos(tiny):
    first = tiny.generate([7, 8], 6, eos=[]).tokens
    eos = first[-1]
    stop = first.index(eos) + 1               # stops at (and includes) the first EOS token
    seen = []
    toks = list(tiny.stream_tokens([7, 8], 6, eos=[eos], on_token=seen.append))
    assert toks == seen == first[:stop]
    assert tiny.last.steps == 2 + stop - 1


def test_hang_is_reported_and_next_run_works():
    import cupy as cp

    from workbench.model.weights import prepare, random_weights
    from workbench.run.runtime import KernelHang, Monokernel
    p = prepare(random_weights(get_config("tiny"), 5, xp=cp, progress=False), xp=cp, progress=False)
    hung = Monokernel(p, BuildOptions(hang=("gate_up_silu", 1, 2)), max_steps=64)
    t0 = time.perf_counter()
    with pytest.raises(KernelHang, match=r"gate_up_silu.*block 2.*gate_up_silu of layer 1"):
        hung.generate([1, 2], 4, timeout_s=0.5)
    assert time.perf_counter() - t0 < 10
    ok = Monokernel(p, BuildOptions(), max_steps=64)
    assert len(ok.generate([1, 2], 4, eos=[]).tokens) == 4


def test_compile_error_names_section_line(tiny):
    from workbench.build.assemble import section_path
    from workbench.run.runtime import Monokernel
    text = section_path("down_residual").read_text().replace("P->x[r] = wb_ld_cg(P->x + r) + y[0];",
                                                               "P->x[r] = wb_ld_cg(P->x + r) + y[0] + nonsense;")
    line = text.splitlines().index(next(l for l in text.splitlines() if "nonsense" in l)) + 1
    with pytest.raises(CompileError) as e:
        Monokernel(tiny.p, BuildOptions(), overrides={"down_residual": text})
    assert f"kernels/sections/down_residual.cuh:{line}:" in str(e.value)
    assert "nonsense" in str(e.value)


def test_bad_inputs_are_refused(tiny):
    from workbench.run.runtime import Sampling
    V = tiny.cfg.vocab
    with pytest.raises(ValueError, match="vocabulary"):
        tiny.generate([V], 2)
    with pytest.raises(ValueError, match="KV cache"):
        tiny.generate([1], 8, pos0=tiny.cfg.max_seq - 3)
    with pytest.raises(ValueError, match="top_p"):
        tiny.generate([1], 2, Sampling(1.0, 0, 1.5))
    with pytest.raises(ValueError, match="prompt"):
        tiny.generate([], 2)


def test_greedy_only_build_decodes_alike_and_refuses_to_sample(tiny):
    from workbench.run.runtime import Monokernel, Sampling
    greedy = Monokernel(tiny.p, BuildOptions(sampler="greedy"), max_steps=64)
    prompt = np.random.default_rng(fresh_seed()).integers(0, tiny.cfg.vocab, 5).tolist()
    assert greedy.generate(prompt, 12, eos=[]).tokens == tiny.generate(prompt, 12, eos=[]).tokens
    with pytest.raises(ValueError, match="sampler='greedy'"):
        greedy.generate(prompt, 4, Sampling(0.8, 0, 1.0, 1))
    assert len(greedy.generate(prompt, 2, Sampling(0.8, 1, 1.0, 1), eos=[]).tokens) == 2   # top_k=1 is greedy


def test_nan_weights_are_reported_not_sampled(tiny):
    import cupy as cp

    from workbench.run.runtime import NonFiniteLogits
    saved = tiny.p.lm_head.copy()
    try:
        tiny.p.lm_head[:] = 0x7FC0                # bf16 NaN
        with pytest.raises(NonFiniteLogits):
            tiny.generate([1, 2], 3, eos=[])
    finally:
        tiny.p.lm_head[:] = saved
    assert len(tiny.generate([1, 2], 3, eos=[]).tokens) == 3
    del cp

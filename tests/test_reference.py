"""The reference decode step against transformers, against itself batched in torch, and its sampling distribution
against transformers' logits warpers."""
import inspect

import numpy as np
import pytest
import torch

from kernels.sections import sampling
from workbench.check import reference_torch
from workbench.model.config import get_config
from workbench.model.weights import Weights, load_hf, prepare, random_weights, unprepare
from workbench.check.reference import TAP_STAGES, KVCache, decode_step, generate_reference

N_TOKENS = 24


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ per row (per step)."""
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def hf_model(tiny_hf_checkpoint):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


def hf_step_by_step(model, tokens):
    """transformers decoding one token at a time through its KV cache (the path generate() takes)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # transformers 5 renamed past_key_values to cache; pass the one object either way (it is updated in place)
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = []
    with torch.no_grad():
        for i, t in enumerate(tokens):
            out = model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[i]]), use_cache=True,
                        **{arg: cache})
            logits.append(out.logits[0, -1].double().numpy())
    return np.stack(logits)


def test_reference_matches_transformers(tiny_hf_checkpoint, hf_model, rng):
    """Same weights (the bf16 checkpoint, widened), same math: fp64 reference vs transformers in fp32. The gap is
    fp32 rounding in transformers (~1e-6 relative); a wrong rope pair, scale or norm placement would be O(1)."""
    w = load_hf(tiny_hf_checkpoint, progress=False)
    tokens = [int(t) for t in rng.integers(0, w.cfg.vocab, N_TOKENS)]
    ours = generate_reference(w, tokens, kv_bf16=False, dtype=np.float64)

    with torch.no_grad():
        batched = hf_model(torch.tensor([tokens])).logits[0].double().numpy()
    stepped = hf_step_by_step(hf_model, tokens)
    assert ours.shape == batched.shape == (N_TOKENS, w.cfg.vocab)
    assert batched.std() > 0.5                                  # logits that say something, not a flat softmax
    assert rel_err(ours, batched).max() < 1e-5
    assert rel_err(ours, stepped).max() < 1e-5
    assert rel_err(stepped, batched).max() < 1e-5


def test_prepared_weights_stay_within_bf16(tiny_hf_checkpoint, rng):
    """unprepare(prepare(w)) is what the kernel computes with: gains folded into the matrices and the products
    rounded to bf16. Each rounding moves a weight by at most 2^-9 ≈ 0.2% relative (≈ 0.11% RMS), independently, so
    each matvec's output moves by ~0.1%; about eleven rounded matvecs lie between token and logits and their errors
    add roughly in quadrature, plus the bf16 KV cache: measured 0.5–0.9% here. 2e-2 (≈ 10 half-ulps of bf16) leaves
    room for that and still fails a layout slip: a gain folded twice or not at all is ~20% (gains are 1 ± 0.2), a
    swapped rope pair O(1)."""
    w = load_hf(tiny_hf_checkpoint, progress=False)
    kernel_weights = unprepare(prepare(w, progress=False))
    tokens = [int(t) for t in rng.integers(0, w.cfg.vocab, N_TOKENS)]
    exact = generate_reference(w, tokens, kv_bf16=False, dtype=np.float64)
    folded = generate_reference(kernel_weights, tokens, kv_bf16=True, dtype=np.float64)
    err = rel_err(folded, exact)
    assert err.max() < 2e-2
    assert err.min() > 1e-4                                     # the rounding happened: this compares two models


def test_taps(rng):
    cfg = get_config("tiny")
    w = random_weights(cfg, seed=int(rng.integers(1 << 30)), progress=False)
    cache = KVCache.empty(cfg)
    tokens = rng.integers(0, cfg.vocab, 3)
    for pos, t in enumerate(tokens[:-1]):
        decode_step(w, cache, int(t), pos)
    taps = {}
    logits = decode_step(w, cache, int(tokens[-1]), len(tokens) - 1, taps=taps)

    D, F, Q, KV = cfg.hidden, cfg.intermediate, cfg.q_dim, cfg.kv_dim
    size = {"x_in": D, "q": Q, "k": KV, "v": KV, "attn": Q, "x_attn": D, "h_mlp": F, "x_out": D}
    assert set(taps) == {(s, l) for s in TAP_STAGES for l in range(cfg.n_layers)} | {("logits", -1)}
    for (stage, layer), value in taps.items():
        assert value.shape == ((cfg.vocab,) if stage == "logits" else (size[stage],)), stage
        assert value.dtype == np.float32 and np.isfinite(value).all() and np.abs(value).max() > 0
    np.testing.assert_array_equal(taps["logits", -1], logits)
    np.testing.assert_array_equal(taps["x_in", 1], taps["x_out", 0])    # layer l+1 starts where l ended
    # the cache holds what the taps saw, bf16-rounded, at the last position
    np.testing.assert_array_equal(cache.k[1, :, len(tokens) - 1].reshape(-1), taps["k", 1])
    taps["x_in", 0][0] += 1.0                                  # copies, not views of the step's live arrays
    assert not np.array_equal(taps["x_in", 0], taps["x_in", 1])


def test_float32_reference_tracks_float64(rng):
    cfg = get_config("tiny")
    w = random_weights(cfg, seed=int(rng.integers(1 << 30)), progress=False)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 8)]
    a = generate_reference(w, tokens, dtype=np.float32)
    b = generate_reference(w, tokens, dtype=np.float64)
    assert a.dtype == np.float32 and b.dtype == np.float64
    # bf16 rounding of k/v can flip by an ulp between the two, so this is looser than fp32 eps
    assert rel_err(a, b).max() < 1e-3


def test_generate_continues_from_a_cache(rng):
    """Feeding a sequence in two calls (the second from pos0 with the first's cache) equals one call."""
    cfg = get_config("tiny")
    w = random_weights(cfg, seed=int(rng.integers(1 << 30)), progress=False)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 10)]
    whole = generate_reference(w, tokens, dtype=np.float64)
    cache = KVCache.empty(cfg, np.float64)
    first = generate_reference(w, tokens[:6], cache=cache, dtype=np.float64)
    second = generate_reference(w, tokens[6:], pos0=6, cache=cache, dtype=np.float64)
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)


@pytest.mark.parametrize("kv_bf16", [True, False])
def test_torch_batched_equals_numpy_steps(rng, kv_bf16, monkeypatch):
    cfg = get_config("tiny")
    w = random_weights(cfg, seed=int(rng.integers(1 << 30)), progress=False)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 20)]
    steps = generate_reference(w, tokens, kv_bf16=kv_bf16, dtype=np.float64)
    tensors = reference_torch.tensors_from_weights(w, "cpu", torch.float64)
    batched = reference_torch.forward(cfg, tensors, torch.tensor(tokens), kv_bf16=kv_bf16, dtype=torch.float64)
    assert batched.dtype == torch.float64 and batched.shape == (20, cfg.vocab)
    assert rel_err(batched.numpy(), steps).max() < 1e-10
    # attention in blocks of query rows (here 3 rows per block, with a ragged last one) changes nothing
    monkeypatch.setattr(reference_torch, "_SCORE_ELEMENTS", 3 * cfg.n_heads * len(tokens))
    blocked = reference_torch.forward(cfg, tensors, torch.tensor(tokens), kv_bf16=kv_bf16, dtype=torch.float64)
    assert rel_err(blocked.numpy(), steps).max() < 1e-10


def test_torch_reference_on_prepared_weights(rng):
    """The path verify takes at scale: kernel-layout weights, unprepared to floats, through the batched forward."""
    cfg = get_config("tiny")
    w = unprepare(prepare(random_weights(cfg, seed=int(rng.integers(1 << 30)), progress=False), progress=False))
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 12)]
    steps = generate_reference(w, tokens, dtype=np.float64)
    tensors = reference_torch.tensors_from_weights(w, "cpu", torch.float64)
    assert "lm_head.weight" in tensors                          # untied after unprepare: the folded copy is used
    batched = reference_torch.forward(w.cfg, tensors, torch.tensor(tokens), dtype=torch.float64)
    assert rel_err(batched.numpy(), steps).max() < 1e-10
    in_fp32 = reference_torch.forward(w.cfg, reference_torch.tensors_from_weights(w, "cpu"), torch.tensor(tokens))
    assert in_fp32.dtype == torch.float32 and rel_err(in_fp32.double().numpy(), steps).max() < 1e-3


def test_torch_reference_restores_matmul_precision():
    cfg = get_config("tiny")
    tensors = reference_torch.tensors_from_weights(random_weights(cfg, seed=2, progress=False))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        reference_torch.forward(cfg, tensors, torch.tensor([1, 2, 3]))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.gpu
def test_reference_accepts_cupy_weights(rng):
    """Weights generated on the device (as large models are) give the reference the same floats as on the host."""
    import cupy

    cfg = get_config("tiny")
    on_device = random_weights(cfg, seed=int(rng.integers(1 << 30)), xp=cupy, progress=False)
    on_host = Weights(cfg, {k: cupy.asnumpy(v) for k, v in on_device.tensors.items()})
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 4)]
    np.testing.assert_array_equal(generate_reference(on_device, tokens), generate_reference(on_host, tokens))
    if torch.cuda.is_available():                               # the DLPack path needs a CUDA build of torch
        tensors = reference_torch.tensors_from_weights(on_device, "cuda", torch.float64)
        batched = reference_torch.forward(cfg, tensors, torch.tensor(tokens), dtype=torch.float64)
        steps = generate_reference(on_host, tokens, dtype=np.float64)
        assert rel_err(batched.cpu().numpy(), steps).max() < 1e-10


# -- sampling ---------------------------------------------------------------------------------------------------

def hf_probs(logits, temperature, top_k, top_p):
    """The distribution transformers samples from: its warpers in generate()'s order, then softmax."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    scores = torch.from_numpy(logits)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(float(temperature))(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


def with_ties_at_kth(logits, k, extra, rng):
    """Make `extra` more entries equal to the k-th largest logit (at random places below it)."""
    logits = logits.copy()
    order = np.argsort(-logits)
    kth = logits[order[k - 1]]
    logits[rng.choice(order[k:], size=extra, replace=False)] = kth
    return logits


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.8, 40, 0.95), (0.6, 5, 0.5), (2.0, 1, 1.0),
    (1.0, 1003, 1.0), (1.0, 5000, 0.8), (0.9, 0, 0.01), (1.0, 0, 0.0),
])
def test_sampling_probs_match_transformers(rng, temperature, top_k, top_p):
    V = get_config("tiny").vocab
    logits = rng.normal(0.0, 3.0, V)
    ours = sampling.reference_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == np.float64 and ours.shape == (V,)
    np.testing.assert_allclose(ours, hf_probs(logits, temperature, top_k, top_p), rtol=1e-12, atol=1e-15)
    assert np.isclose(ours.sum(), 1.0)
    kept = np.count_nonzero(ours)
    if 0 < top_k < V:
        assert kept <= top_k
    if top_p < 1:
        # the kept set is the smallest high-probability set whose mass (before top-p) reaches top_p
        before = np.sort(sampling.reference_probs(logits, temperature, top_k, 1.0))[::-1]
        assert before[:kept].sum() >= top_p and (kept == 1 or before[:kept - 1].sum() < top_p)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 10, 1.0), (0.5, 3, 1.0), (1.0, 20, 0.999999)])
def test_sampling_keeps_ties_at_the_top_k_threshold(rng, temperature, top_k, top_p):
    V = get_config("tiny").vocab
    logits = with_ties_at_kth(rng.normal(0.0, 2.0, V), top_k, extra=3, rng=rng)
    ours = sampling.reference_probs(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(ours, hf_probs(logits, temperature, top_k, top_p), rtol=1e-12, atol=1e-15)
    assert np.count_nonzero(ours) == top_k + 3


def test_sampling_ties_at_the_top(rng):
    V = get_config("tiny").vocab
    logits = rng.normal(0.0, 1.0, V)
    first, second = sorted(rng.choice(V, size=2, replace=False))
    logits[[first, second]] = logits.max() + 1.0
    greedy = sampling.reference_probs(logits, 0.0, 50, 0.9)
    assert greedy[first] == 1.0 and greedy.sum() == 1.0        # greedy: the first of the maxima, like argmax
    assert np.argmax(hf_probs(logits, 1.0, 0, 1.0)) == first
    ours = sampling.reference_probs(logits, 1.0, 2, 0.9)        # both tied tokens survive top-k=2 and top-p
    np.testing.assert_allclose(ours, hf_probs(logits, 1.0, 2, 0.9), rtol=1e-12, atol=1e-15)
    assert ours[first] == ours[second] == 0.5


# -- bad inputs -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(get_config("tiny"), seed=4, progress=False)


@pytest.mark.parametrize("token, pos, message", [
    (-1, 0, "outside the vocabulary"), (1003, 0, "outside the vocabulary"), (3, 4352, "outside \\[0, max_seq"),
    (3, -1, "outside \\[0, max_seq"),
])
def test_decode_step_rejects_bad_token_or_position(tiny_weights, token, pos, message):
    with pytest.raises(ValueError, match=message):
        decode_step(tiny_weights, KVCache.empty(tiny_weights.cfg), token, pos)


def test_decode_step_rejects_bad_cache_and_types(tiny_weights):
    cfg = tiny_weights.cfg
    with pytest.raises(TypeError, match="token must be an integer"):
        decode_step(tiny_weights, KVCache.empty(cfg), 2.0, 0)
    small = KVCache.empty(cfg.with_(max_seq=16))
    with pytest.raises(ValueError, match="KV cache has shapes"):
        decode_step(tiny_weights, small, 2, 0)
    with pytest.raises(ValueError, match="would round"):
        decode_step(tiny_weights, KVCache.empty(cfg, np.float32), 2, 0, kv_bf16=False, dtype=np.float64)
    with pytest.raises(ValueError, match="would round"):
        decode_step(tiny_weights, KVCache.empty(cfg, np.float16), 2, 0)


def test_generate_reference_rejects_bad_runs(tiny_weights):
    with pytest.raises(ValueError, match="no tokens"):
        generate_reference(tiny_weights, [])
    with pytest.raises(ValueError, match="do not fit max_seq"):
        generate_reference(tiny_weights, [1, 2, 3], pos0=4350)
    with pytest.raises(ValueError, match="needs the cache"):
        generate_reference(tiny_weights, [1, 2], pos0=5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_reference(tiny_weights, [1, 5000])


def test_torch_forward_rejects_bad_tokens(tiny_weights):
    cfg = tiny_weights.cfg
    tensors = reference_torch.tensors_from_weights(tiny_weights)
    for tokens, message in [(torch.tensor([1, 1003]), "outside the vocabulary"), (torch.tensor([[1, 2]]), "1-D"),
                            (torch.tensor([1.0, 2.0]), "integer"), (torch.tensor([], dtype=torch.long), "non-empty"),
                            (torch.zeros(cfg.max_seq + 1, dtype=torch.long), "do not fit max_seq")]:
        with pytest.raises(ValueError, match=message):
            reference_torch.forward(cfg, tensors, tokens)
    with pytest.raises(KeyError, match="model.norm.weight"):
        reference_torch.forward(cfg, {k: v for k, v in tensors.items() if k != "model.norm.weight"},
                                torch.tensor([1]))

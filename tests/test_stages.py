"""Each stage's reference math (workbench.model.stage_math) against an independent implementation (torch and
transformers' own functions), batched over rows at their own positions; the stages bound to the plan's buffers;
the sampler's distribution, uniforms and draw check; the tolerances; and the bytes the plan says each stage moves."""
import warnings

import numpy as np
import pytest
from conftest import NEEDS_TORCH

torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
import torch.nn.functional as F

from workbench import plan, schedule
from workbench.model import stage_math as S
from workbench.model.config import PRESETS, get_config
from workbench.model.weights import expected_shapes, layer_names, rope_tables
from workbench.reference import round_bf16

CFG = get_config("tiny")
T = torch.from_numpy


def randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def rope_at(positions, dtype=np.float64):
    cos, sin = rope_tables(CFG)
    return cos[positions].astype(dtype), sin[positions].astype(dtype)


def hf_heads(a, n_heads):
    """[n, H·hd] → [1, H, n, hd], HF's [batch, heads, seq, hd]."""
    n = a.shape[0]
    return T(a).view(n, n_heads, -1).transpose(0, 1)[None]


def from_hf_heads(t):
    """[1, H, n, hd] → [n, H·hd]."""
    return t[0].transpose(0, 1).reshape(t.shape[2], -1).numpy()


# ---- the math, row by row and batched ---------------------------------------------------------------------------

def test_rmsnorm_matches_torch(rng):
    x, gain = randn(rng, 7, CFG.hidden, scale=3.0), 1 + 0.2 * randn(rng, CFG.hidden)
    want = F.rms_norm(T(x), (CFG.hidden,), T(gain), CFG.rms_eps).numpy()
    np.testing.assert_allclose(S.rmsnorm(x, gain, CFG.rms_eps), want, rtol=1e-13, atol=1e-14)


def test_qkv_rope_append_matches_transformers(rng):
    """Several rows at their own positions (unsorted, far apart) against HF's apply_rotary_pos_emb."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    D, hd, Hq, Hkv = CFG.hidden, CFG.head_dim, CFG.n_heads, CFG.n_kv_heads
    positions = np.array([777, 0, 4351, 3, 64, 2048])
    n = positions.size
    x, gain = randn(rng, n, D), 1 + 0.2 * randn(rng, D)
    wq, wk, wv = (randn(rng, rows, D, scale=D ** -0.5) for rows in (Hq * hd, Hkv * hd, Hkv * hd))
    cos, sin = rope_at(positions)
    q, k, v = S.qkv_rope_append(x, wq, wk, wv, gain, cos, sin, CFG.rms_eps)
    assert q.shape == (n, Hq * hd) and k.shape == v.shape == (n, Hkv * hd)

    h = F.rms_norm(T(x), (D,), T(gain), CFG.rms_eps)

    def both_halves(t):                                         # HF's cos/sin are cat(freqs, freqs): [1, n, hd]
        return T(np.concatenate([t, t], axis=-1))[None]

    q_hf, k_hf = apply_rotary_pos_emb(hf_heads((h @ T(wq).T).numpy(), Hq), hf_heads((h @ T(wk).T).numpy(), Hkv),
                                      both_halves(cos), both_halves(sin))
    np.testing.assert_allclose(q, from_hf_heads(q_hf), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k, from_hf_heads(k_hf), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(v, (h @ T(wv).T).numpy(), rtol=1e-12, atol=1e-12)


def test_rope_rotates_pairs_by_the_angle(rng):
    """Written out for one pair of each row, so the formula in the docstring is what the code does."""
    half, n = CFG.head_dim // 2, 4
    a = randn(rng, n, 3 * CFG.head_dim)                         # three heads, each rotated by its row's angles
    angle = rng.uniform(-np.pi, np.pi, (n, half))
    out = S.rope(a, np.cos(angle), np.sin(angle))
    heads_in, heads_out = a.reshape(n, 3, -1), out.reshape(n, 3, -1)
    for row in range(n):
        i, h = int(rng.integers(half)), int(rng.integers(3))
        c, s = np.cos(angle[row, i]), np.sin(angle[row, i])
        lo, hi = heads_in[row, h, i], heads_in[row, h, i + half]
        assert np.isclose(heads_out[row, h, i], lo * c - hi * s)
        assert np.isclose(heads_out[row, h, i + half], hi * c + lo * s)
    np.testing.assert_allclose(np.hypot(heads_out[..., :half], heads_out[..., half:]),       # a rotation
                               np.hypot(heads_in[..., :half], heads_in[..., half:]))


def sdpa(q, k, v, mask=None, causal=False):
    """torch's attention with GQA: q [n, Hq·hd], k, v [Hkv, n_ctx, hd] → [n, Hq·hd]."""
    Hkv, _, hd = k.shape
    out = F.scaled_dot_product_attention(hf_heads(q, q.shape[1] // hd), T(k)[None], T(v)[None],
                                         attn_mask=None if mask is None else T(mask)[None, None],
                                         is_causal=causal, enable_gqa=True)
    return from_hf_heads(out)


@pytest.mark.parametrize("n", [1, 2, 57])
def test_attention_decode_matches_sdpa_causally(rng, n):
    """Rows 0..n-1 at positions 0..n-1 over a cache of n: exactly causal attention."""
    Hq, Hkv, hd = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    q, k, v = randn(rng, n, Hq * hd), randn(rng, Hkv, n, hd), randn(rng, Hkv, n, hd)
    o = S.attention_decode(q, k, v, np.arange(n))
    np.testing.assert_allclose(o, sdpa(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


def test_attention_decode_rows_at_their_own_positions(rng, monkeypatch):
    """Row i attends to cache positions 0..positions[i] (unsorted positions, repeats, 0 and the last), as a mask
    says, whatever the cache holds past them; blocking the rows (3 per block here, the last one ragged) changes
    nothing."""
    Hq, Hkv, hd, n_ctx = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, 40
    positions = np.array([17, 0, 39, 5, 5, 22, 1, 38, 9, 30, 12])
    n = positions.size
    q, k, v = randn(rng, n, Hq * hd), randn(rng, Hkv, n_ctx, hd), randn(rng, Hkv, n_ctx, hd)
    o = S.attention_decode(q, k, v, positions)
    mask = np.arange(n_ctx)[None, :] <= positions[:, None]
    np.testing.assert_allclose(o, sdpa(q, k, v, mask=mask), rtol=1e-12, atol=1e-12)
    for i in (0, 1, 2):                                         # and one row alone on its own prefix of the cache
        p = positions[i]
        np.testing.assert_allclose(o[i], sdpa(q[i:i + 1], k[:, :p + 1], v[:, :p + 1])[0], rtol=1e-12, atol=1e-12)

    k2, v2 = k.copy(), v.copy()
    k2[:, 18:], v2[:, 18:] = 1e3, -1e3                          # past the rows at positions <= 17
    early = positions <= 17
    o2 = S.attention_decode(q, k2, v2, positions)
    np.testing.assert_array_equal(o2[early], o[early])
    assert (np.abs(o2[~early] - o[~early]) > 1).any()

    monkeypatch.setattr(S, "SCORE_ELEMENTS", 3 * Hq * n_ctx)
    np.testing.assert_allclose(S.attention_decode(q, k, v, positions), o, rtol=1e-13, atol=1e-14)


def test_attention_decode_gqa_grouping(rng):
    """Query head h reads kv head h // group: give each kv head distinct constant values and look."""
    Hq, Hkv, hd, n = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, 5
    q, k = randn(rng, 3, Hq * hd), randn(rng, Hkv, n, hd)
    levels = rng.uniform(1, 2, Hkv)
    v = np.broadcast_to(levels[:, None, None], (Hkv, n, hd)).copy()
    o = S.attention_decode(q, k, v, np.array([4, 0, 2])).reshape(3, Hq, hd)
    np.testing.assert_allclose(o, np.broadcast_to(np.repeat(levels, Hq // Hkv)[None, :, None], (3, Hq, hd)))


def test_residual_stages(rng):
    D, F_, Q, n = CFG.hidden, CFG.intermediate, CFG.q_dim, 5
    x, o, hm = randn(rng, n, D), randn(rng, n, Q), randn(rng, n, F_)
    wo, wd = randn(rng, D, Q), randn(rng, D, F_)
    np.testing.assert_allclose(S.o_proj_residual(x, wo, o), (T(x) + F.linear(T(o), T(wo))).numpy(), rtol=1e-12)
    np.testing.assert_allclose(S.down_residual(x, wd, hm), (T(x) + F.linear(T(hm), T(wd))).numpy(), rtol=1e-12)


def test_gate_up_silu_matches_torch(rng):
    D, F_, n = CFG.hidden, CFG.intermediate, 6
    x, gain = randn(rng, n, D), 1 + 0.2 * randn(rng, D)
    wg, wu = randn(rng, F_, D, scale=D ** -0.5), randn(rng, F_, D, scale=D ** -0.5)
    h = F.rms_norm(T(x), (D,), T(gain), CFG.rms_eps)
    want = F.silu(F.linear(h, T(wg))) * F.linear(h, T(wu))
    np.testing.assert_allclose(S.gate_up_silu(x, wg, wu, gain, CFG.rms_eps), want.numpy(), rtol=1e-12, atol=1e-13)


def test_silu_saturates_without_warnings():
    a = np.array([-1e4, -100.0, 0.5, 100.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # numpy's default would warn on exp overflow
        out = S.silu(a)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, F.silu(torch.from_numpy(a)).numpy(), rtol=1e-6)


def test_lm_head_embedding_and_greedy(rng):
    D, V, n = CFG.hidden, CFG.vocab, 4
    x, gain, w = randn(rng, n, D), 1 + 0.2 * randn(rng, D), randn(rng, V, D, scale=0.1)
    want = F.linear(F.rms_norm(T(x), (D,), T(gain), CFG.rms_eps), T(w))
    np.testing.assert_allclose(S.lm_head(x, w, gain, CFG.rms_eps), want.numpy(), rtol=1e-12, atol=1e-13)

    tokens = rng.integers(0, V, n)
    rows = S.embedding(w, tokens)
    np.testing.assert_array_equal(rows, w[tokens])
    rows[0, 0] += 1                                             # a copy, not a view into the table
    assert rows[0, 0] != w[tokens[0], 0]
    assert S.embedding(w, int(tokens[1])).shape == (1, D)       # one token is a batch of one

    logits = randn(rng, 3, V)
    first, second = sorted(rng.choice(V, size=2, replace=False))
    logits[1, [first, second]] = logits[1].max() + 1.0
    np.testing.assert_array_equal(S.greedy(logits), torch.argmax(T(logits), dim=-1).numpy())
    assert S.greedy(logits)[1] == first                         # the first of tied maxima


# ---- the stages bound to the plan's buffers ---------------------------------------------------------------------

class ArrayIO(S.StageIO):
    """Stage inputs from plain arrays, HF-layout weights of one layer (or of the model for token stages)."""

    def __init__(self, cfg, acts, weights, k, v, positions, tokens, dtype):
        self.cfg, self.acts, self.weights, self.k, self.v = cfg, acts, weights, k, v
        self.positions, self.token, self.dtype, self.eps = positions, tokens, dtype, cfg.rms_eps

    def act(self, buffer):
        return self.acts[buffer]

    def weight(self, name):
        return self.weights[name]

    def cache(self, which):
        return self.k if which == "k" else self.v

    def rope(self):
        cos, sin = rope_tables(self.cfg)
        return cos[self.positions].astype(self.dtype), sin[self.positions].astype(self.dtype)


def random_io(rng, dtype, n=5):
    cfg, layer = CFG, 0
    hf = {v: k for k, v in layer_names(layer).items()}
    hf.update({"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm"})
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name in hf:
            weights[hf[name]] = (1 + 0.2 * randn(rng, *shape) if len(shape) == 1
                                 else randn(rng, *shape, scale=shape[1] ** -0.5)).astype(dtype)
    weights["lm_head"] = weights["embed"]                       # tied in the tiny preset
    acts = {b: randn(rng, n, *plan.BUFFERS[b].value_shape(cfg)).astype(dtype)
            for b in ("x", "h", "q", "o", "hmlp", "logits")}
    n_ctx = 50
    k, v = (randn(rng, cfg.n_kv_heads, n_ctx, cfg.head_dim).astype(dtype) for _ in range(2))
    positions = rng.choice(n_ctx, n, replace=False)
    return ArrayIO(cfg, acts, weights, k, v, positions, rng.integers(0, cfg.vocab, n), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stage_references_give_the_plan_buffers_in_the_input_dtype(rng, dtype):
    """Every stage with a reference returns, for a batch of n rows, buffers the plan says it writes, at the plan's
    shapes (the row appended for the cache), in the dtype it was given."""
    io = random_io(rng, dtype)
    n = io.positions.size
    seen = set()
    for st in plan.STAGES:
        if st.reference is None:
            continue
        out = st.reference(io)
        assert out and all(st.writes_buffer(b) for b in out), (st.name, sorted(out))
        assert set(st.tolerances) <= set(out), st.name
        for buf, val in out.items():
            b = plan.BUFFERS[buf]
            size = schedule.tap_size(CFG, buf)
            want = (n,) if b.kind == "value" else (n, size)
            assert val.shape == want, (st.name, buf)
            if b.kind == "value":
                assert np.issubdtype(val.dtype, np.integer), (st.name, buf)
            else:
                assert val.dtype == dtype, (st.name, buf)
                assert np.isfinite(val).all(), (st.name, buf)
            seen.add(buf)
    assert seen == {"x", "h", "q", "k_cache", "v_cache", "o", "hmlp", "logits", "sampled"}
    assert [s.name for s in plan.STAGES if s.reference is None] == ["publish"]


def test_stage_references_compute_their_math(rng):
    """The bindings hand each function the right inputs: recomputed from the plain functions."""
    io = random_io(rng, np.float64)
    a, w, eps = io.acts, io.weights, CFG.rms_eps
    cos, sin = io.rope()
    q, k, v = S.qkv_rope_append(a["x"], w["wq"], w["wk"], w["wv"], w["attn_norm"], cos, sin, eps)
    want = {
        "embedding": {"x": w["embed"][io.token]},
        "qkv_rope_append": {"q": q, "k_cache": k, "v_cache": v},
        "attention_decode": {"o": S.attention_decode(a["q"], io.k, io.v, io.positions)},
        "o_proj_residual": {"x": a["x"] + a["o"] @ w["wo"].T, "h": a["x"] + a["o"] @ w["wo"].T},
        "gate_up_silu": {"hmlp": S.gate_up_silu(a["h"], w["wg"], w["wu"], w["mlp_norm"], eps)},
        "down_residual": {"x": a["x"] + a["hmlp"] @ w["wd"].T},
        "lm_head": {"logits": S.lm_head(a["x"], w["lm_head"], w["final_norm"], eps)},
        "sampling": {"sampled": np.argmax(a["logits"], axis=-1)},
    }
    for name, outs in want.items():
        got = plan.stage(name).reference(io)
        assert set(got) == set(outs), name
        for buf in outs:
            np.testing.assert_array_equal(got[buf], outs[buf], err_msg=f"{name}.{buf}")


@pytest.mark.parametrize("call, message", [
    (lambda: S.embedding(np.ones((4, 3)), -1), "outside the vocabulary"),
    (lambda: S.embedding(np.ones((4, 3)), [0, 4]), "outside the vocabulary"),
    (lambda: S.embedding(np.ones(4), 1), "embed must be"),
    (lambda: S.qkv_rope_append(np.ones((1, 8)), np.ones((8, 8)), np.ones((4, 8)), np.ones((4, 8)), np.ones(7),
                               np.ones((1, 2)), np.ones((1, 2)), 1e-5), "gain has shape"),
    (lambda: S.qkv_rope_append(np.ones((1, 8)), np.ones((6, 8)), np.ones((4, 8)), np.ones((4, 8)), np.ones(8),
                               np.ones((1, 2)), np.ones((1, 2)), 1e-5), "wq has shape"),
    (lambda: S.qkv_rope_append(np.ones((1, 8)), np.ones((8, 8)), np.ones((4, 8)), np.ones((8, 8)), np.ones(8),
                               np.ones((1, 2)), np.ones((1, 2)), 1e-5), "must match"),
    (lambda: S.attention_decode(np.ones((1, 12)), np.ones((2, 3, 4)), np.ones((2, 3, 4)), [2]), "q has shape"),
    (lambda: S.attention_decode(np.ones((2, 16)), np.ones((2, 3, 4)), np.ones((2, 3, 4)), [2]), "q has shape"),
    (lambda: S.attention_decode(np.ones((1, 16)), np.ones((2, 0, 4)), np.ones((2, 0, 4)), [0]), "n_ctx >= 1"),
    (lambda: S.attention_decode(np.ones((1, 16)), np.ones((2, 3, 4)), np.ones((2, 2, 4)), [1]), "v_cache"),
    (lambda: S.attention_decode(np.ones((1, 16)), np.ones((2, 3, 4)), np.ones((2, 3, 4)), [3]),
     "not in a cache of 3"),
    (lambda: S.o_proj_residual(np.ones((1, 8)), np.ones((8, 5)), np.ones((1, 4))), "wo has shape"),
    (lambda: S.down_residual(np.ones((1, 8)), np.ones((4, 5)), np.ones((1, 5))), "wd has shape"),
    (lambda: S.gate_up_silu(np.ones((1, 8)), np.ones((5, 8)), np.ones((4, 8)), np.ones(8), 1e-5), "wu has shape"),
    (lambda: S.gate_up_silu(np.ones((1, 8)), np.ones((5, 8)), np.ones((5, 8)), np.ones(6), 1e-5),
     "gain has shape"),
    (lambda: S.lm_head(np.ones((1, 8)), np.ones((5, 7)), np.ones(8), 1e-5), "w_lm has shape"),
    (lambda: S.lm_head(np.ones((1, 8)), np.ones((5, 8)), np.ones(7), 1e-5), "gain has shape"),
    (lambda: S.reference_probs(np.array([1.0, np.nan]), 1.0, 0, 1.0), "NaN"),
    (lambda: S.reference_probs(np.array([1.0, np.inf]), 1.0, 0, 1.0), "infinity"),
    (lambda: S.reference_probs(np.ones(3), 1.0, 0, -0.1), "top_p"),
    (lambda: S.reference_probs(np.ones(3), np.nan, 0, 1.0), "temperature"),
    (lambda: S.reference_probs(np.ones((2, 3)), 1.0, 0, 1.0), "vector"),
    (lambda: S.reference_probs(np.ones(0), 1.0, 0, 1.0), "non-empty"),
])
def test_bad_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- sampling ---------------------------------------------------------------------------------------------------

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
    V = CFG.vocab
    logits = rng.normal(0.0, 3.0, V)
    ours = S.reference_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == np.float64 and ours.shape == (V,)
    np.testing.assert_allclose(ours, hf_probs(logits, temperature, top_k, top_p), rtol=1e-12, atol=1e-15)
    assert np.isclose(ours.sum(), 1.0)
    kept = np.count_nonzero(ours)
    if 0 < top_k < V:
        assert kept <= top_k
    if top_p < 1:
        # the kept set is the smallest high-probability set whose mass (before top-p) reaches top_p
        before = np.sort(S.reference_probs(logits, temperature, top_k, 1.0))[::-1]
        assert before[:kept].sum() >= top_p and (kept == 1 or before[:kept - 1].sum() < top_p)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 10, 1.0), (0.5, 3, 1.0), (1.0, 20, 0.999999)])
def test_sampling_keeps_ties_at_the_top_k_threshold(rng, temperature, top_k, top_p):
    logits = with_ties_at_kth(rng.normal(0.0, 2.0, CFG.vocab), top_k, extra=3, rng=rng)
    ours = S.reference_probs(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(ours, hf_probs(logits, temperature, top_k, top_p), rtol=1e-12, atol=1e-15)
    assert np.count_nonzero(ours) == top_k + 3


def test_sampling_ties_at_the_top(rng):
    V = CFG.vocab
    logits = rng.normal(0.0, 1.0, V)
    first, second = sorted(rng.choice(V, size=2, replace=False))
    logits[[first, second]] = logits.max() + 1.0
    greedy = S.reference_probs(logits, 0.0, 50, 0.9)
    assert greedy[first] == 1.0 and greedy.sum() == 1.0        # greedy: the first of the maxima, like argmax
    assert np.argmax(hf_probs(logits, 1.0, 0, 1.0)) == first
    ours = S.reference_probs(logits, 1.0, 2, 0.9)               # both tied tokens survive top-k=2 and top-p
    np.testing.assert_allclose(ours, hf_probs(logits, 1.0, 2, 0.9), rtol=1e-12, atol=1e-15)
    assert ours[first] == ours[second] == 0.5


M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(z):
    """SplitMix64's output function (Steele, Lea, Flood 2014), in wrapping uint64 arithmetic."""
    with np.errstate(over="ignore"):
        z = np.uint64(z) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def test_draw_uniform_is_splitmix64_over_the_counters():
    assert int(splitmix64(0)) == 0xE220A8397B1DCDAF             # SplitMix64's first output from state 0
    for seed, step, draw in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (12345, 678, 3), (2 ** 64 - 1, 2 ** 40, 7)]:
        with np.errstate(over="ignore"):
            z = splitmix64(splitmix64(np.uint64(seed) ^ splitmix64(step)) + np.uint64(draw))
        assert S.draw_uniform(seed, step, draw) == int(z >> np.uint64(11)) / 2.0 ** 53, (seed, step, draw)


def test_draw_uniform_is_a_pure_function_in_0_1():
    u = np.array([[S.draw_uniform(seed, step, draw) for step in range(50) for draw in range(4)]
                  for seed in (1, 2, 3)])
    again = np.array([[S.draw_uniform(seed, step, draw) for step in range(50) for draw in range(4)]
                      for seed in (1, 2, 3)])
    np.testing.assert_array_equal(u, again)                     # the same counters, the same uniform
    assert ((u >= 0) & (u < 1)).all()
    assert len(np.unique(u)) == u.size                          # any counter changed, another uniform
    counts = np.histogram(u, bins=10, range=(0, 1))[0]          # 600 draws, 60 a bin: chi-square, 9 dof
    assert ((counts - 60.0) ** 2 / 60.0).sum() < 27.9           # p = 0.001


def test_check_draw_accepts_the_inverse_cdf_token_and_rejects_its_neighbours(rng):
    V = 200
    probs = rng.dirichlet(np.ones(V))
    probs[17] = 0.0
    probs /= probs.sum()
    cdf = np.cumsum(probs)
    wide = [t for t in range(1, V - 1) if probs[t] > 10 * S.DRAW_SLACK and probs[t - 1] > 0 and probs[t + 1] > 0]
    for t in rng.choice(wide, 10, replace=False):
        lo, hi = cdf[t] - probs[t], cdf[t]
        u = lo + (hi - lo) * rng.uniform(0.2, 0.8)
        assert S.check_draw(probs, u, int(t)) == (True, "")
        for other in (t - 1, t + 1):
            ok, why = S.check_draw(probs, u, int(other))
            assert not ok and f"token {t}'s interval" in why
    # what the kernel does with draw_uniform: the token whose CDF interval holds u
    for step in range(20):
        u = S.draw_uniform(7, step, 0)
        assert S.check_draw(probs, u, int(np.searchsorted(cdf, u, side="right")))[0]
    # just past a boundary the token below is still within DRAW_SLACK, far past it not
    t = wide[0]
    assert S.check_draw(probs, cdf[t] + S.DRAW_SLACK / 2, int(t))[0]
    assert not S.check_draw(probs, cdf[t] + 2 * S.DRAW_SLACK, int(t))[0]
    ok, why = S.check_draw(probs, cdf[16] - probs[16] / 2, 17)
    assert not ok and "probability 0" in why
    for bad in (-1, V):
        ok, why = S.check_draw(probs, 0.5, bad)
        assert not ok and "not in the vocabulary" in why


# ---- tolerances -----------------------------------------------------------------------------------------------

def judge(kernel, exact, tol):
    """passes() of every row of compare()."""
    rel, worst, bad = S.compare(kernel, exact, tol)
    assert rel.shape == worst.shape == bad.shape == (exact.shape[0],)
    return [S.passes(tol, float(r), float(w), int(b)) for r, w, b in zip(rel, worst, bad)]


@pytest.mark.parametrize("tol", [S.FP32, S.ATTENTION], ids=["fp32", "attention"])
def test_fp32_tolerance(rng, tol):
    exact = randn(rng, 3, 4096)
    f32 = exact.astype(np.float32)
    assert all(ok for ok, _ in judge(f32, exact, tol))         # fp32 rounding of the exact values
    noisy = (exact * (1 + 1e-7 * randn(rng, 3, 4096))).astype(np.float32)
    assert all(ok for ok, _ in judge(noisy, exact, tol))
    scaled = f32.copy()
    scaled[1] *= np.float32(1 + 1e-4)                           # one row (step) 1e-4 off
    verdicts = judge(scaled, exact, tol)
    assert [ok for ok, _ in verdicts] == [True, False, True] and "rel err" in verdicts[1][1]
    one = f32.copy()
    one[0, 123] *= 2                                            # one element off by its own size
    assert not judge(one, exact, tol)[0][0]
    small = f32.copy()                                          # 5e-4 rms on one element: rel 8e-6 < 1e-5
    small[2, 7] += np.float32(5e-4 * np.sqrt((exact[2] ** 2).mean()))
    ok, why = judge(small, exact, tol)[2]
    assert not ok and "an element off" in why
    nan = f32.copy()
    nan[0, 5] = np.nan
    ok, why = judge(nan, exact, tol)[0]
    assert not ok and "NaN" in why


def test_bf16_tolerance(rng):
    exact = randn(rng, 2, 4096) * np.exp(rng.uniform(-5, 5, (2, 4096)))      # many binades
    rounded = round_bf16(exact.astype(np.float32))
    rel, worst, bad = S.compare(rounded, exact, S.KV_BF16)
    assert (worst <= 0.5 + 1e-3).all() and (worst > 0.45).all()             # half an ulp at most, and about that
    assert all(ok for ok, _ in judge(rounded, exact, S.KV_BF16))
    truncated = (exact.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    verdicts = judge(truncated, exact, S.KV_BF16)
    assert not any(ok for ok, _ in verdicts) and "bf16 ulp" in verdicts[0][1]
    scaled = round_bf16((exact * (1 + 1e-4)).astype(np.float32))
    assert not any(ok for ok, _ in judge(scaled, exact, S.KV_BF16))
    nan = rounded.copy()
    nan[1, 0] = np.inf
    assert [ok for ok, _ in judge(nan, exact, S.KV_BF16)] == [True, False]
    np.testing.assert_array_equal(S.bf16_ulp(np.array([1.0, 1.5, -0.75, 2.0 ** -130])),
                                  [2.0 ** -7, 2.0 ** -7, 2.0 ** -8, 2.0 ** -133])


def test_exact_tolerance(rng):
    exact = randn(rng, 3, 264).astype(np.float32)
    assert all(ok for ok, _ in judge(exact.copy(), exact, S.EXACT))
    off = exact.copy()
    off[1, 3] = np.nextafter(off[1, 3], np.float32(np.inf))     # one ulp
    off[2, [4, 9]] = 0
    verdicts = judge(off, exact, S.EXACT)
    assert verdicts == [(True, ""), (False, "1 values differ"), (False, "2 values differ")]
    nan = exact.copy()
    nan[0, 0] = np.nan
    assert not judge(nan, exact, S.EXACT)[0][0]


# ---- bytes ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_stage_bytes_over_a_token_are_the_weights_and_the_cache(name):
    """Every stage's bytes, summed over a token's execution, are the weights a token streams (the plan's count and
    the config's, the same), the embedding row, and the K and V attention reads at each layer."""
    cfg = PRESETS[name]
    for pos in (0, 1, 1000, cfg.max_seq - 1):
        total = sum(schedule.stage_bytes(cfg, s, pos) for s, _ in schedule.execution(cfg))
        assert total == cfg.weight_bytes_per_token() + 2 * cfg.hidden + cfg.kv_bytes_per_token(pos), (name, pos)
    for pos in (1, 1000, cfg.max_seq - 1):
        grow = schedule.stage_bytes(cfg, "attention_decode", pos) - schedule.stage_bytes(cfg, "attention_decode", 0)
        assert grow == 2 * 2 * cfg.kv_dim * pos
        for s in plan.STAGE_NAMES:                              # nothing else depends on the position
            if s != "attention_decode":
                assert schedule.stage_bytes(cfg, s, pos) == schedule.stage_bytes(cfg, s, 0), s


def test_stage_bytes_llama_32_1b():
    cfg = get_config("llama-3.2-1b")
    assert schedule.stage_bytes(cfg, "attention_decode", 4095) - schedule.stage_bytes(cfg, "attention_decode", 0) \
        == 2 * 2 * 512 * 4095
    assert schedule.stage_bytes(cfg, "lm_head", 0) == 2 * 128256 * 2048
    assert schedule.stage_bytes(cfg, "qkv_rope_append", 0) == 2 * (2048 + 2 * 512) * 2048
    assert schedule.stage_bytes(cfg, "gate_up_silu", 0) == 2 * 2 * 8192 * 2048
    assert schedule.stage_bytes(cfg, "sampling", 0) == schedule.stage_bytes(cfg, "publish", 0) == 0
    assert cfg.weight_bytes_per_token() == 2_471_493_632

"""Each section's reference against an independent implementation, its shape contract, and its traffic count."""
import importlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.sections import PER_LAYER, PER_TOKEN_FIRST, PER_TOKEN_LAST, SECTIONS
from kernels.sections import (attention_decode, down_residual, embedding, gate_up_silu, lm_head, o_proj_residual,
                              qkv_rope_append, sampling)
from workbench.model.config import PRESETS, get_config
from workbench.model.weights import rope_tables

CFG = get_config("tiny")
T = torch.from_numpy


def randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def test_section_list_is_complete():
    assert SECTIONS == ("embedding", "qkv_rope_append", "attention_decode", "o_proj_residual", "gate_up_silu",
                        "down_residual", "lm_head", "sampling")
    for name in SECTIONS:
        module = importlib.import_module(f"kernels.sections.{name}")
        assert module.__doc__ and "Contract" in module.__doc__
        assert callable(module.shapes) and callable(module.bytes_moved)


def test_qkv_rope_append_matches_torch(rng):
    D, hd, Hq, Hkv = CFG.hidden, CFG.head_dim, CFG.n_heads, CFG.n_kv_heads
    x, gain = randn(rng, D), 1 + 0.2 * randn(rng, D)
    wq, wk, wv = randn(rng, Hq * hd, D, scale=D ** -0.5), randn(rng, Hkv * hd, D), randn(rng, Hkv * hd, D)
    cos, sin = (t[777].astype(np.float64) for t in rope_tables(CFG))
    q, k, v = qkv_rope_append.reference(x, wq, wk, wv, gain, cos, sin, CFG.rms_eps)

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    h = F.rms_norm(T(x), (D,), T(gain), CFG.rms_eps)

    def heads(w, n):                                            # [batch, heads, seq, hd], as HF lays them out
        return (T(w) @ h).view(1, n, 1, hd)

    def both_halves(t):                                         # HF's cos/sin are cat(freqs, freqs)
        return T(np.concatenate([t, t]))[None, None]

    q_hf, k_hf = apply_rotary_pos_emb(heads(wq, Hq), heads(wk, Hkv), both_halves(cos), both_halves(sin))
    np.testing.assert_allclose(q, q_hf.reshape(-1).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k, k_hf.reshape(-1).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(v, (T(wv) @ h).numpy(), rtol=1e-12, atol=1e-12)


def test_rope_rotates_pairs_by_the_angle(rng):
    """Written out for one pair, so the formula in the docstring is what the code does."""
    half = CFG.head_dim // 2
    a = randn(rng, CFG.head_dim)
    angle = rng.uniform(-np.pi, np.pi, half)
    out = qkv_rope_append.rope(a, np.cos(angle), np.sin(angle))
    i = int(rng.integers(half))
    c, s = np.cos(angle[i]), np.sin(angle[i])
    assert np.isclose(out[i], a[i] * c - a[i + half] * s)
    assert np.isclose(out[i + half], a[i + half] * c + a[i] * s)
    np.testing.assert_allclose(np.hypot(out[:half], out[half:]), np.hypot(a[:half], a[half:]))   # a rotation


@pytest.mark.parametrize("n", [1, 2, 57])
def test_attention_decode_matches_torch_sdpa(rng, n):
    Hq, Hkv, hd = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    q, k, v = randn(rng, Hq * hd), randn(rng, Hkv, n, hd), randn(rng, Hkv, n, hd)
    o = attention_decode.reference(q, k, v)
    want = F.scaled_dot_product_attention(T(q).view(1, Hq, 1, hd), T(k)[None], T(v)[None], enable_gqa=True)
    np.testing.assert_allclose(o, want.reshape(-1).numpy(), rtol=1e-12, atol=1e-12)


def test_attention_decode_gqa_grouping(rng):
    """Query head h reads kv head h // group: give each kv head distinct constant values and look."""
    Hq, Hkv, hd, n = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, 5
    q, k = randn(rng, Hq * hd), randn(rng, Hkv, n, hd)
    levels = rng.uniform(1, 2, Hkv)
    v = np.broadcast_to(levels[:, None, None], (Hkv, n, hd)).copy()
    o = attention_decode.reference(q, k, v).reshape(Hq, hd)
    np.testing.assert_allclose(o, np.repeat(levels, Hq // Hkv)[:, None] * np.ones(hd))


def test_residual_sections(rng):
    D, F_, Q = CFG.hidden, CFG.intermediate, CFG.q_dim
    x, o, hm = randn(rng, D), randn(rng, Q), randn(rng, F_)
    wo, wd = randn(rng, D, Q), randn(rng, D, F_)
    np.testing.assert_allclose(o_proj_residual.reference(x, wo, o), x + wo @ o)
    np.testing.assert_allclose(down_residual.reference(x, wd, hm), (T(x) + T(wd) @ T(hm)).numpy())


def test_gate_up_silu_matches_torch(rng):
    D, F_ = CFG.hidden, CFG.intermediate
    x, gain = randn(rng, D), 1 + 0.2 * randn(rng, D)
    wg, wu = randn(rng, F_, D, scale=D ** -0.5), randn(rng, F_, D, scale=D ** -0.5)
    h = F.rms_norm(T(x), (D,), T(gain), CFG.rms_eps)
    want = F.silu(T(wg) @ h) * (T(wu) @ h)
    np.testing.assert_allclose(gate_up_silu.reference(x, wg, wu, gain, CFG.rms_eps), want.numpy(),
                               rtol=1e-12, atol=1e-13)


def test_silu_saturates_without_warnings():
    from kernels.sections._common import silu
    a = np.array([-1e4, -100.0, 0.5, 100.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # numpy's default would warn on exp overflow
        out = silu(a)
    np.testing.assert_allclose(out, F.silu(torch.from_numpy(a)).numpy(), rtol=1e-6)


def test_lm_head_and_embedding(rng):
    D, V = CFG.hidden, CFG.vocab
    x, gain, w = randn(rng, D), 1 + 0.2 * randn(rng, D), randn(rng, V, D, scale=0.1)
    want = T(w) @ F.rms_norm(T(x), (D,), T(gain), CFG.rms_eps)
    np.testing.assert_allclose(lm_head.reference(x, w, gain, CFG.rms_eps), want.numpy(), rtol=1e-12, atol=1e-13)
    token = int(rng.integers(V))
    row = embedding.reference(w, token)
    np.testing.assert_array_equal(row, w[token])
    row[0] += 1                                                 # a copy, not a view into the table
    assert row[0] != w[token, 0]


def random_inputs(rng, dtype):
    """Inputs for every section at the tiny shapes, from shapes(), in one dtype."""
    arrays = {}
    for name in SECTIONS:
        module = importlib.import_module(f"kernels.sections.{name}")
        for key, shape in module.shapes(CFG).items():
            arrays.setdefault(key, (randn(rng, *shape) * (0.1 if len(shape) == 2 else 1)).astype(dtype))
    return arrays


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_references_follow_shapes_and_keep_the_dtype(rng, dtype):
    a, eps, n = random_inputs(rng, dtype), CFG.rms_eps, 9
    cos, sin = (t[5].astype(dtype) for t in rope_tables(CFG))
    outputs = {
        "x": embedding.reference(a["embed"], 3),
        "q k v": qkv_rope_append.reference(a["x"], a["wq"], a["wk"], a["wv"], a["gain"], cos, sin, eps),
        "o": attention_decode.reference(a["q"], a["k_cache"][:, :n], a["v_cache"][:, :n]),
        "x_out": o_proj_residual.reference(a["x"], a["wo"], a["o"]),
        "hmlp": gate_up_silu.reference(a["x"], a["wg"], a["wu"], a["gain"], eps),
        "x_out ": down_residual.reference(a["x"], a["wd"], a["hmlp"]),
        "logits": lm_head.reference(a["x"], a["w_lm"], a["gain"], eps),
    }
    shapes = {}
    for name in SECTIONS:
        shapes.update(importlib.import_module(f"kernels.sections.{name}").shapes(CFG))
    for key, value in outputs.items():
        values = value if isinstance(value, tuple) else (value,)
        for k, v in zip(key.split(), values):
            assert v.shape == shapes[k], k
            assert v.dtype == dtype, k


def test_bytes_moved_cover_the_weights():
    """Every section's traffic, summed over a token, is at least the weights the token must stream."""
    for name, cfg in PRESETS.items():
        for pos in (0, 1000):
            per_token = sum(importlib.import_module(f"kernels.sections.{s}").bytes_moved(cfg, pos)
                            for s in PER_TOKEN_FIRST + PER_TOKEN_LAST)
            per_layer = sum(importlib.import_module(f"kernels.sections.{s}").bytes_moved(cfg, pos)
                            for s in PER_LAYER)
            total = per_token + cfg.n_layers * per_layer
            assert total >= cfg.weight_bytes_per_token() + cfg.kv_bytes_per_token(pos), (name, pos)
            # and not wildly more: activations are a rounding error next to the weights at these sizes
            if name != "tiny" and pos == 0:
                assert total < 1.01 * cfg.weight_bytes_per_token(), name


def test_bytes_moved_llama_32_1b():
    cfg = get_config("llama-3.2-1b")
    assert attention_decode.bytes_moved(cfg, 4095) - attention_decode.bytes_moved(cfg, 0) == 2 * 2 * 512 * 4095
    assert lm_head.bytes_moved(cfg, 0) >= 2 * 128256 * 2048
    total = sum(importlib.import_module(f"kernels.sections.{s}").bytes_moved(cfg, 0) * (16 if s in PER_LAYER else 1)
                for s in SECTIONS)
    assert total >= 2_471_493_632


@pytest.mark.parametrize("call, message", [
    (lambda: embedding.reference(np.ones((4, 3)), -1), "outside the vocabulary"),
    (lambda: embedding.reference(np.ones((4, 3)), 4), "outside the vocabulary"),
    (lambda: qkv_rope_append.reference(np.ones(8), np.ones((8, 8)), np.ones((4, 8)), np.ones((4, 8)), np.ones(7),
                                       np.ones(2), np.ones(2), 1e-5), "gain has shape"),
    (lambda: qkv_rope_append.reference(np.ones(8), np.ones((6, 8)), np.ones((4, 8)), np.ones((4, 8)), np.ones(8),
                                       np.ones(2), np.ones(2), 1e-5), "wq has shape"),
    (lambda: attention_decode.reference(np.ones(12), np.ones((2, 3, 4)), np.ones((2, 3, 4))), "q has shape"),
    (lambda: attention_decode.reference(np.ones(16), np.ones((2, 0, 4)), np.ones((2, 0, 4))), "n >= 1"),
    (lambda: attention_decode.reference(np.ones(16), np.ones((2, 3, 4)), np.ones((2, 2, 4))), "v_cache"),
    (lambda: o_proj_residual.reference(np.ones(8), np.ones((8, 5)), np.ones(4)), "wo has shape"),
    (lambda: down_residual.reference(np.ones(8), np.ones((4, 5)), np.ones(5)), "wd has shape"),
    (lambda: gate_up_silu.reference(np.ones(8), np.ones((5, 8)), np.ones((4, 8)), np.ones(8), 1e-5), "has shape"),
    (lambda: lm_head.reference(np.ones(8), np.ones((5, 7)), np.ones(8), 1e-5), "w_lm has shape"),
    (lambda: sampling.reference_probs(np.array([1.0, np.nan]), 1.0, 0, 1.0), "NaN"),
    (lambda: sampling.reference_probs(np.ones(3), 1.0, 0, -0.1), "top_p"),
    (lambda: sampling.reference_probs(np.ones((2, 3)), 1.0, 0, 1.0), "vector"),
])
def test_bad_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()

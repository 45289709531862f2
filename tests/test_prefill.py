"""The batched prefill on the CPU (numpy; on the GPU the same code runs on CuPy): chunked prompts give the cache
and last logits of the unchunked math, in the kernel's cache layout; positions after an existing context continue
it; check_prefill passes a correct prefill and fails a wrong one; bad input is refused in one line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workbench.check.reference import KVCache, forward
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights, to_f32
from workbench.run.prefill import check_prefill, prefill

# tiny at a short context (the caches are [L, Hkv, max_seq, hd]), and a Qwen3 and a Qwen2 shape (q/k norms, biases)
CFGS = {"tiny": dataclasses.replace(get_config("tiny"), max_seq=96),
        "qwen3": dataclasses.replace(get_config("tiny"), max_seq=96, qk_norm=True),
        "qwen2": dataclasses.replace(get_config("tiny"), max_seq=96, qkv_bias=True)}


@pytest.fixture(scope="module", params=list(CFGS))
def p(request):
    cfg = CFGS[request.param]
    return prepare(random_weights(cfg, 3, progress=False), progress=False)


def caches(cfg):
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    return np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)


def tokens(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab, n)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunks_give_the_unchunked_cache_and_logits(p, chunk):
    cfg = p.cfg
    toks = tokens(cfg, 41)
    k, v = caches(cfg)
    pre = prefill(p, toks, k, v, chunk=chunk, dtype=np.float64)
    assert pre.n == 41 and pre.chunks == -(-41 // chunk)
    ref = KVCache.empty(cfg, np.float64)
    want = forward(p, toks, cache=ref, dtype=np.float64)[-1]
    # fp64 both ways: the chunk boundaries move nothing the bf16 cache can show
    assert np.array_equal(to_f32(k[:, :, :41]), ref.k[:, :, :41].astype(np.float32))
    assert np.array_equal(to_f32(v[:, :, :41]), ref.v[:, :, :41].astype(np.float32))
    assert not k[:, :, 41:].any() and not v[:, :, 41:].any()          # nothing past the prompt is written
    np.testing.assert_allclose(pre.logits, want, rtol=1e-6, atol=1e-6)


def test_a_prefill_continues_a_cached_context(p):
    cfg = p.cfg
    toks = tokens(cfg, 50, seed=1)
    k, v = caches(cfg)
    prefill(p, toks[:30], k, v, chunk=16, dtype=np.float64)
    second = prefill(p, toks[30:], k, v, pos0=30, chunk=16, dtype=np.float64)
    assert second.pos0 == 30 and second.n == 20
    k1, v1 = caches(cfg)
    whole = prefill(p, toks, k1, v1, chunk=16, dtype=np.float64)
    np.testing.assert_allclose(second.logits, whole.logits, rtol=1e-6, atol=1e-6)
    assert np.array_equal(k, k1) and np.array_equal(v, v1)


def test_check_prefill_passes_a_right_one_and_fails_wrong_ones(p):
    cfg = p.cfg
    toks = tokens(cfg, 33, seed=2)
    k, v = caches(cfg)
    pre = prefill(p, toks, k, v, chunk=8)                             # fp32, as on the GPU
    c = check_prefill(p, toks, pre, k, v)
    assert c.passed, c.summary()
    assert "passed" in c.summary() and len(c.k_rel) == cfg.n_layers
    bad_v = v.copy()
    bad_v[1, 0, 20] = 0                                               # one position of one head lost
    assert not check_prefill(p, toks, pre, k, bad_v).passed
    bad_k = k.copy()
    bad_k[0, :, 5], bad_k[0, :, 6] = k[0, :, 6], k[0, :, 5]           # two positions swapped
    assert not check_prefill(p, toks, pre, bad_k, v).passed
    nan = k.copy()
    nan[0, 0, 0, 0] = 0x7FC0
    c = check_prefill(p, toks, pre, nan, v)
    assert not c.passed and "NaN" in c.summary()
    off = dataclasses.replace(pre, logits=pre.logits * (1 + 1e-2))
    assert not check_prefill(p, toks, off, k, v).passed


def test_bad_input_is_refused(p):
    cfg = p.cfg
    k, v = caches(cfg)
    with pytest.raises(ValueError, match="nothing to prefill"):
        prefill(p, [], k, v)
    with pytest.raises(ValueError, match="do not fit the KV cache"):
        prefill(p, tokens(cfg, 10), k, v, pos0=cfg.max_seq - 5)
    with pytest.raises(ValueError, match="bf16 bits"):
        prefill(p, tokens(cfg, 4), k.astype(np.float32), v)
    with pytest.raises(TypeError, match="integers"):
        prefill(p, np.array([1.5, 2.0]), k, v)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prefill(p, [cfg.vocab], k, v)


def test_what_a_prefill_needs_grows_with_the_context_and_the_chunk():
    from workbench.run.prefill import prefill_bytes
    cfg = get_config("llama-3.1-8b")
    cache = 2 * 32 * 8 * 32768 * 128 * 4                       # fp32 keys and values of 32k positions
    tables = 2 * cfg.vocab * cfg.hidden * 4                    # the embedding and the LM head in fp32
    need = prefill_bytes(cfg, 32768, 2048)
    assert cache + tables < need < cache + tables + 4e9            # a chunk's rows and a layer's weights
    # 32k positions more: their fp32 cache, and one layer's more of the bf16 write's temporaries
    assert prefill_bytes(cfg, 65536, 2048) - need == cache + cache // 32
    assert prefill_bytes(cfg, 32768, 4096) > need

"""The batched prefill on the CPU (numpy; on the GPU the same code runs on CuPy): chunked prompts give the cache
and last logits of the unchunked math, in the kernel's cache layout; positions after an existing context continue
it; check_prefill passes a correct prefill and fails a wrong one; bad input is refused in one line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workbench.check.prefill import check_prefill
from workbench.model.config import get_config
from workbench.model.weights import prepare, random_weights, to_bf16, to_f32
from workbench.reference import KVCache, forward
from workbench.run.prefill import prefill, prefill_bytes

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


def test_a_prefill_without_its_logits_writes_the_same_cache_and_runs_no_token_stage(p):
    """prefill(..., logits=False), a time to first token's (the kernel's first step computes the first token): the
    same cache bit for bit, no LM head or sampler run (their timings absent), Prefilled.logits None, which
    check_prefill refuses in one line rather than compare."""
    cfg = p.cfg
    toks = tokens(cfg, 41, seed=2)
    k, v = caches(cfg)
    k1, v1 = caches(cfg)
    with_logits = prefill(p, toks, k, v, chunk=16, dtype=np.float64)
    stages: dict = {}
    without = prefill(p, toks, k1, v1, chunk=16, dtype=np.float64, timings=stages, logits=False)
    assert without.logits is None and with_logits.logits is not None
    assert np.array_equal(k, k1) and np.array_equal(v, v1)
    assert "lm_head" not in stages and "sampling" not in stages and "attention_decode" in stages
    with pytest.raises(ValueError, match="logits=False"):
        check_prefill(p, toks, without, k1, v1)


def test_the_prefill_chooses_the_greedy_first_token_from_its_last_logits(p):
    """prefill(..., token=True), the time to first token's default: the sampler's greedy choice (the first largest)
    of the same last logits a logits=True prefill returns, with the same cache, the logits left unread unless
    asked for too; and the same token wherever the prompt's chunks fall."""
    cfg = p.cfg
    toks = tokens(cfg, 41, seed=4)
    k, v = caches(cfg)
    k1, v1 = caches(cfg)
    full = prefill(p, toks, k, v, chunk=16, dtype=np.float64)
    stages: dict = {}
    first = prefill(p, toks, k1, v1, chunk=16, dtype=np.float64, logits=False, token=True, timings=stages)
    assert first.logits is None and full.token is None
    assert first.token == int(np.argmax(full.logits))
    assert np.array_equal(k, k1) and np.array_equal(v, v1)
    assert "lm_head" in stages and "sampling" in stages
    both = prefill(p, toks, *caches(cfg), chunk=7, dtype=np.float64, token=True)
    assert both.token == first.token
    np.testing.assert_allclose(both.logits, full.logits, rtol=1e-6, atol=1e-6)


def test_no_first_token_is_chosen_from_nan_logits(p):
    """A NaN in the LM head's weights makes the last logits NaN: the prefill names it in one line (a UserError,
    the command line's one-line report) rather than hand the kernel a token argmax took from NaN."""
    from workbench.errors import NonFiniteError, UserError
    cfg = p.cfg
    bad = dataclasses.replace(p, lm_head=p.lm_head.copy())
    bad.lm_head[3, :] = 0x7FC0                         # bf16 bits of a NaN: one vocabulary row
    with pytest.raises(NonFiniteError, match="not finite") as e:
        prefill(bad, tokens(cfg, 9), *caches(cfg), dtype=np.float64, logits=False, token=True)
    assert isinstance(e.value, UserError)


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
    # the first token the prefill chose, judged against fp64's first largest: a random model's top logits are a
    # near tie at this tolerance (not judged), so one vocabulary row is made the clear winner
    best = int(np.argmax(pre.logits))
    lm = to_f32(p.lm_head).copy()
    lm[5] = 4 * np.sign(pre.logits[best]) * lm[best]                 # 4·|the best logit| for token 5
    clear = dataclasses.replace(p, lm_head=to_bf16(lm))
    tie = check_prefill(p, toks, prefill(p, toks, *caches(cfg), chunk=8, token=True), k, v)
    assert tie.passed and tie.token_ok in (None, True) and tie.token == best, tie.summary()
    chosen = prefill(clear, toks, *caches(cfg), chunk=8, token=True)
    c = check_prefill(clear, toks, chosen, k, v)
    assert c.passed and chosen.token == c.want == 5 and c.token_ok, c.summary()
    assert "first token 5, fp64's 5" in c.summary()
    c = check_prefill(clear, toks, dataclasses.replace(chosen, token=best), k, v)
    assert c.token_ok is False and not c.passed and "WRONG" in c.summary(), c.summary()
    off = dataclasses.replace(pre, logits=pre.logits * (1 + 1e-2))
    assert not check_prefill(p, toks, off, k, v).passed
    # the bf16 precision's looser bound (PREFILL_RTOL) is chosen by the prefill's own precision: the same 1e-2 passes
    # there, and a lost position still fails by far
    assert check_prefill(p, toks, dataclasses.replace(off, precision="bf16"), k, v).passed
    assert not check_prefill(p, toks, dataclasses.replace(pre, precision="bf16"), k, bad_v).passed


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
    with pytest.raises(TypeError, match="pos0 must be an integer"):
        prefill(p, tokens(cfg, 4), k, v, pos0=5.0)
    with pytest.raises(ValueError, match="not contiguous"):
        prefill(p, tokens(cfg, 4), k[:, :, :, ::-1], v)
    with pytest.raises(ValueError, match="the prefill has fp32, bf16"):
        prefill(p, tokens(cfg, 4), k, v, precision="fp16")
    # the interpreter has no bf16 activations: asked for bf16 here, it says so rather than run fp32 under its name
    with pytest.raises(ValueError, match="bf16 prefill runs on the NVIDIA GPU path only"):
        prefill(p, tokens(cfg, 4), k, v, precision="bf16")
    assert not k.any() and not v.any()                               # nothing was written by a refused one


def test_what_a_prefill_needs_grows_with_the_context_and_the_chunk():
    from workbench.run.prefill import prefill_bytes
    cfg = get_config("llama-3.1-8b")
    cache = 2 * 32 * 8 * 32768 * 128 * 4                       # fp32 keys and values of 32k positions
    tables = 2 * cfg.vocab * cfg.hidden * 4                    # the embedding and the LM head in fp32
    residual = 2 * 32768 * cfg.hidden * 4                       # every row's residual, and the joined copy
    need = prefill_bytes(cfg, 32768, 2048)
    # beside those: a chunk's rows, a layer's weights and the score block (1 GB in fp32), under 4 GB together
    assert cache + tables + residual < need < cache + tables + residual + 4e9
    # 32k positions more: their fp32 cache and residual, and one layer's more of the bf16 write's temporaries
    assert prefill_bytes(cfg, 65536, 2048) - need == cache + residual + cache // 32
    assert prefill_bytes(cfg, 32768, 4096) > need


def test_a_long_prompt_is_cut_into_chunks_that_fit_the_memory_left():
    """fit_chunk: the default chunk where it fits; halved until it does where memory is short (never below
    MIN_CHUNK); one line naming what is needed and what is free where even that does not fit."""
    from workbench.run.prefill import MIN_CHUNK, PREFILL_CHUNK, fit_chunk, prefill_bytes
    cfg = get_config("llama-3.1-8b")
    n = 131072
    need = lambda c: prefill_bytes(cfg, n, c, np.float32, True, n)
    assert fit_chunk(cfg, n, n, PREFILL_CHUNK, np.float32, True, need(PREFILL_CHUNK)) == (PREFILL_CHUNK, None)
    assert fit_chunk(cfg, n, 100, PREFILL_CHUNK, np.float32, True, 10 ** 12) == (100, None)     # the rows alone
    assert fit_chunk(cfg, n, n, PREFILL_CHUNK, np.float32, True, need(PREFILL_CHUNK) - 1) == (PREFILL_CHUNK // 2, None)
    assert fit_chunk(cfg, n, n, PREFILL_CHUNK, np.float32, True, need(300)) == (256, None)
    c, why = fit_chunk(cfg, n, n, PREFILL_CHUNK, np.float32, True, need(MIN_CHUNK) - 1)
    assert c == MIN_CHUNK and why.startswith(f"prefilling {n} positions of llama-3.1-8b needs ")
    assert f"in chunks of {MIN_CHUNK} rows" in why and "GB are free" in why


def test_the_prefills_kernels_compile_for_every_presets_head_dim():
    """kernels/prefill/attention.cuh and layer.cuh through NVRTC and ptxas for sm_90 (no GPU needed), attention at
    each head_dim a preset has: no local memory (a spill would run the score tiles through it), the static shared
    memory of two stages of both tiles; head_dims the kernel does not take go the interpreter's way."""
    from workbench.compiler.compile import nvrtc_program, resource_usage
    from workbench.model.config import PRESETS
    from workbench.run.prefill_gpu import LAYOUTS, covers, flash_source, flash_supported, layer_source
    dims = sorted({get_config(name).head_dim for name in PRESETS})
    assert 64 in dims and 128 in dims
    for hd, layout in [(hd, None) for hd in dims] + [(hd, lay) for hd in (64, 80, 128) for lay in LAYOUTS]:
        ok, log, _, cubin = nvrtc_program(flash_source(hd, layout), ["--std=c++17", "-arch=sm_90"])
        assert ok, (hd, layout, log)
        (r,) = [r for r in resource_usage(cubin) if r.kernel == "prefill_attention"]
        assert r.stack == 0 and r.registers <= 255 and r.shared <= 48 * 1024, (hd, layout, r)
    ok, log, _, _ = nvrtc_program(flash_source(144), ["--std=c++17", "-arch=sm_90"], cubin=False)
    assert not ok and "head_dim" in log                               # the kernel's own static_assert says why
    ok, log, _, cubin = nvrtc_program(layer_source(), ["--std=c++17", "-arch=sm_90"])
    assert ok, log
    kernels = {r.kernel: r for r in resource_usage(cubin)}
    assert set(kernels) == {"prefill_norm_split", "prefill_split", "prefill_silu_mul_split", "prefill_silu_mul_split_bf16",
                            "prefill_qkv_rope"}
    assert all(r.stack == 0 for r in kernels.values()), kernels
    cfg = get_config("tiny")
    assert not flash_supported(cfg.with_(head_dim=144), np, np.float32)
    assert not flash_supported(cfg, np, np.float32)                    # numpy: the interpreter's path
    assert all(covers(get_config(name)) for name in PRESETS)         # every family's layer stages have theirs


def test_a_layer_stage_the_gpu_path_lacks_sends_the_prefill_the_interpreters_way(monkeypatch):
    """prefill_gpu implements the plan's stages through their math; a plan whose layer stage has no implementation
    there is not half run on that path."""
    from workbench.model import stage_math as ref
    from workbench.run import prefill_gpu as G
    cfg = get_config("tiny")
    monkeypatch.delitem(G.IMPLEMENTS, ref.gate_up_silu_io)
    assert not G.covers(cfg)
    monkeypatch.undo()
    monkeypatch.delitem(G.IMPLEMENTS, ref.lm_head_io)                # a token stage: its reference runs instead
    assert G.covers(cfg)


def test_the_gpu_path_needs_less_memory_than_the_interpreter():
    """It holds no cache of its own and converts no weights: beside the residual, one chunk's activations."""
    cfg = get_config("llama-3.1-8b")
    gpu, interp = prefill_bytes(cfg, 32768, 2048, gpu=True), prefill_bytes(cfg, 32768, 2048)
    residual = 2 * 32768 * cfg.hidden * 4
    assert residual < gpu < residual + 2e9 and gpu < interp / 3
    # a continuation holds the residual of its own rows, whatever was cached before them
    assert prefill_bytes(cfg, 120_000, 2048, gpu=True, rows=32768) == gpu


def test_the_prefill_times_its_stages_when_asked():
    """prefill(..., timings={}): every stage of the plan that has math, the weights' conversion and the cache's
    write, each a positive time, and nothing else; the values are those of the untimed prefill."""
    from workbench import plan
    cfg = CFGS["tiny"]
    p = prepare(random_weights(cfg, 3, progress=False), progress=False)
    toks = np.random.default_rng(4).integers(0, cfg.vocab, 40)
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    caches = [(np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)) for _ in range(2)]
    timings: dict = {}
    plain = prefill(p, toks, *caches[0], chunk=16)
    timed = prefill(p, toks, *caches[1], chunk=16, timings=timings)
    stages = {s.name for s in plan.STAGES if s.reference is not None}
    assert set(timings) == stages | {"(weights to fp32)", "(cache to bf16)"}
    assert all(t > 0 for t in timings.values())
    np.testing.assert_array_equal(timed.logits, plain.logits)
    np.testing.assert_array_equal(caches[1][0], caches[0][0])


def test_the_bf16_attention_issues_half_the_products_and_the_same_layouts():
    """The bf16 precision's attention (one bf16 half of the queries and probabilities, attention.cuh) for sm_90:
    half the tensor-core instructions of the fp32 precision's (the lo products are gone, not only unread), and no
    local memory at the default layout for every head_dim a preset has and between (its launch bounds' reason);
    any other halves refused."""
    from workbench.compiler.compile import disassemble, nvrtc_program, resource_usage
    from workbench.run.prefill_gpu import PRECISIONS, FlashLayout, flash_source
    assert sorted(PRECISIONS.values()) == [1, 2]
    for hd, layout in [(hd, None) for hd in (32, 64, 80, 96, 128)] + [(64, FlashLayout(False, False))]:
        built = {}
        for halves in (1, 2):
            ok, log, _, cubin = nvrtc_program(flash_source(hd, layout, halves), ["--std=c++17", "-arch=sm_90"])
            assert ok, (hd, layout, halves, log)
            (r,) = [r for r in resource_usage(cubin) if r.kernel == "prefill_attention"]
            assert r.stack == 0, (hd, layout, halves, r)
            built[halves] = (r, disassemble(cubin).count("HMMA."))
        (r1, mma1), (r2, mma2) = built[1], built[2]
        assert mma2 > 0 and mma1 * 2 == mma2, (hd, layout, mma1, mma2)
    with pytest.raises(ValueError, match="halves=3"):
        flash_source(64, None, 3)


@pytest.mark.parametrize("mode", ["new arrays", "in place", "first chunk in place"])
def test_the_residual_survives_its_chunks_updated_in_place_or_not(mode):
    """_layers carries the residual from layer to layer: the interpreter's stages return new arrays, the GPU path's
    products add onto the chunk's own rows of it (prefill_gpu.project). Each way, and mixed, every row of every
    chunk must reach the next layer: with each stage adding (layer + 1) to x, every layer's first stage sees
    x + what the layers before it added, in every row, and the last row's "logits" carry all of it."""
    import contextlib

    from workbench import plan, schedule
    from workbench.run.prefill import _layers
    cfg = CFGS["tiny"]
    n, chunk = 23, 8
    start = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    stages = [(name, at) for name, at in schedule.execution(cfg) if plan.stage(name).reference is not None]
    per_layer = {l: sum(1 for _, at in stages if at == l) for l in range(cfg.n_layers)}
    first = {l: next(name for name, at in stages if at == l) for l in range(cfg.n_layers)}
    seen = {}

    def run(name, layer, st, a, b):
        if layer < 0 and "x" not in st:                          # the token stages before the layers: x's rows
            st["x"] = start[a:b].copy()
            return
        if layer < 0:                                            # after them: the last row's "logits"
            st.setdefault("logits", st["x"].copy())
            return
        if name == first[layer]:
            seen[layer, a] = st["x"].copy()
        if mode == "in place" or (mode == "first chunk in place" and a == 0):
            st["x"] += layer + 1
        else:
            st["x"] = st["x"] + (layer + 1)
    got = _layers(cfg, np, n, chunk, run, lambda name: contextlib.nullcontext())
    before = 0
    for l in range(cfg.n_layers):
        rows = np.concatenate([seen[l, a] for a in range(0, n, chunk)])
        np.testing.assert_array_equal(rows, start + before, err_msg=f"layer {l}")
        before += (l + 1) * per_layer[l]
    assert before > 0
    np.testing.assert_array_equal(got["logits"][0], start[-1] + before)


def test_two_fragments_a_warp_load_each_key_and_value_fragment_once_for_both():
    """FlashLayout(frags=2): 32 rows a warp, each ldmatrix of a key or value tile feeding both fragments' products:
    at head_dim 64 (the Llamas') the same tensor-core products per row as one fragment, half the shared-memory
    loads per product, and no spill in the bf16 precision (two blocks an SM, ≤ 255 registers). Its results are the
    default's bit for bit (the GPU tests hold every layout to it)."""
    import dataclasses

    from workbench.compiler.compile import disassemble, nvrtc_program, resource_usage
    from workbench.run.prefill_gpu import FLASH_LAYOUT, flash_source
    built = {}
    for frags in (1, 2):
        layout = dataclasses.replace(FLASH_LAYOUT, frags=frags)
        assert layout.rows == 64 * frags and layout.grid(1000, 32, 8)[1] == -(-1000 // layout.rows)
        ok, log, _, cubin = nvrtc_program(flash_source(64, layout, 1), ["--std=c++17", "-arch=sm_90"])
        assert ok, log
        (r,) = [r for r in resource_usage(cubin) if r.kernel == "prefill_attention"]
        sass = disassemble(cubin)
        built[frags] = (r, sass.count("HMMA."), sass.count("LDSM"))
    (r1, mma1, ld1), (r2, mma2, ld2) = built[1], built[2]
    assert r2.stack == 0 and mma2 == 2 * mma1 and ld2 * mma1 * 2 <= ld1 * mma2 * 1.01, built


def test_the_prefill_runs_two_fragments_a_warp_only_where_they_build_without_a_spill():
    """prefill_gpu.flash_layout: frags=2 at one bf16 half and head_dim 64 (measured faster there), the wgmma kernel
    at head_dim ≤ 64 on sm_90 (in bf16 with the accelerator's tiles and a producer) and in bf16 at head_dim 128 (the
    tiles without one), the default elsewhere; every preset's head_dim builds its chosen layout
    in each precision, for sm_90 and for another GPU, without a spill."""
    from workbench.compiler.compile import nvrtc_program, resource_usage
    from workbench.model.config import PRESETS
    from workbench.run.prefill_gpu import (FLASH_LAYOUT, PRECISIONS, WGMMA_BF16, WGMMA_BF16_WIDE, WGMMA_FP32,
                                           WGMMA_LAYOUTS, flash_layout, flash_options, flash_source)
    assert flash_layout(64, PRECISIONS["bf16"]).frags == 2
    assert flash_layout(64, PRECISIONS["fp32"]) == flash_layout(128, PRECISIONS["bf16"]) == FLASH_LAYOUT
    assert flash_layout(64, PRECISIONS["fp32"], "90") == WGMMA_FP32
    assert flash_layout(64, PRECISIONS["fp32"], "89") == flash_layout(128, PRECISIONS["fp32"], "90") == FLASH_LAYOUT
    assert flash_layout(64, PRECISIONS["bf16"], "90") == WGMMA_BF16 and WGMMA_BF16.tma and WGMMA_BF16.producer
    assert flash_layout(128, PRECISIONS["bf16"], "90") == WGMMA_BF16_WIDE and WGMMA_BF16_WIDE in WGMMA_LAYOUTS
    assert flash_layout(96, PRECISIONS["bf16"], "90") == flash_layout(96, PRECISIONS["bf16"])      # tma: 64-column spans
    for hd in sorted({c.head_dim for c in PRESETS.values()}):
        for halves in PRECISIONS.values():
            assert flash_layout(hd, halves, "89") == flash_layout(hd, halves)      # another GPU: mma.sync's
            for cc in ("90", ""):
                layout = flash_layout(hd, halves, cc)
                ok, log, _, cubin = nvrtc_program(flash_source(hd, layout, halves),
                                                  [*flash_options(layout), *(() if layout.warpgroups
                                                                             else ("-arch=sm_90",))])
                assert ok, log
                (r,) = [r for r in resource_usage(cubin) if r.kernel == "prefill_attention"]
                assert r.stack == 0, (hd, halves, cc, r)


def test_the_wgmma_attention_builds_for_sm90a_without_a_spill():
    """FlashLayout(warpgroups=...): kernels/prefill/attention_wgmma.cuh with its generated products, for sm_90a, at
    every head_dim a preset has (and 80, 96) and both precisions: no local memory, ≤ 255 registers, and in the
    machine code the warpgroup products a key tile needs: Q·Kᵀ in hd/16 steps and P·V in keys/16, each once a bf16
    half, P·V's with B transposed (the value tile is MN-major), twice where the products overlap (the steady
    tile's and the first or last tile's), never serialised by ptxas (C7519/C7520: a product whose registers another
    branch wrote, which would undo the overlap), and where they overlap, the steady tile's softmax (its 32 exps and
    the two rescale factors') between S's wait and the P·V's, where ptxas had scheduled the second wait above them;
    the tiles copied by every thread's cp.async, or with `tma` by the tensor memory accelerator alone; with
    `pingpong`, the named barriers of the two warpgroups' turns, and without it none. A layout the
    kernel does not take is refused, and `tma` at a head_dim off its 64-column spans."""
    from workbench.compiler.compile import disassemble, nvrtc_program, resource_usage
    from workbench.model.config import PRESETS
    from workbench.run.prefill_gpu import WGMMA_LAYOUTS, FlashLayout, flash_options, flash_source
    dims = sorted({get_config(name).head_dim for name in PRESETS} | {80, 96})
    for hd in dims:
        for layout in WGMMA_LAYOUTS:
            if layout.head_dim_problem(hd):                   # the accelerator's tiles: refused in one line
                assert layout.tma and hd % 64 or layout.producer and hd > 64
                with pytest.raises(ValueError, match="head_dim"):
                    flash_source(hd, layout, 2)
                continue
            for halves in (1, 2):
                ok, log, _, cubin = nvrtc_program(flash_source(hd, layout, halves), list(flash_options(layout)))
                assert ok, (hd, layout, halves, log)
                # ptxas serialises the products (C75xx) only where four warpgroups' registers a thread are too few
                # (C7512): 128 past head_dim 64, or the 112 a producer leaves them in fp32
                short = layout.warpgroups == 4 and (hd > 64 or layout.producer and halves == 2)
                assert "C75" not in log or short and "C7512" in log, (hd, layout, log)
                (r,) = [r for r in resource_usage(cubin) if r.kernel == "prefill_attention"]
                # four warpgroups (512 threads) have 128 registers a thread: past head_dim 80 they spill 16-32 B
                spills_ok = layout.warpgroups == 4 and (hd > 80 or layout.producer and halves == 2)
                assert (r.stack == 0 or spills_ok and r.stack <= 32) and r.registers <= 255, (hd, layout, halves, r)
                # the tiles' copies: every thread's cp.async (LDGSTS), or the accelerator's (UTMALDG) and none
                code = disassemble(cubin)
                assert ("UTMALDG" in code, "LDGSTS" in code) == (layout.tma, not layout.tma), (hd, layout)
                # the turns: the two warpgroups' named barriers (256 threads: 0x100). Warpgroup 1's first arrival
                # on warpgroup 0's (8, an immediate), one sync on its own (8 + wg, a register), the hand-on to the
                # other's (9 − wg) after the scores are issued and on a skipped tile: a missing one hangs the kernel
                turns = [ln.split("*/")[-1].strip() for ln in code.splitlines()
                         if ("BAR.ARV" in ln or "BAR.SYNC" in ln) and "0x100" in ln]
                first = [ln for ln in turns if "BAR.ARV 0x8, 0x100" in ln]
                syncs = [ln for ln in turns if "BAR.SYNC" in ln and " R" in ln]
                hand_on = [ln for ln in turns if "BAR.ARV R" in ln]
                counts = (len(first), len(syncs), len(hand_on), len(turns))
                assert counts == ((1, 1, 2, 4) if layout.pingpong else (0, 0, 0, 0)), (hd, layout, turns)
                if hd == 64:
                    sass = [ln for ln in code.splitlines() if "HGMMA" in ln]
                    pv, copies = [ln for ln in sass if "tnspB" in ln], 1 + layout.overlap
                    assert len(pv) == layout.tile_keys // 16 * halves * copies, (layout, halves, sass)
                    assert len(sass) - len(pv) == hd // 16 * halves * copies, (layout, halves, sass)
                    if layout.overlap:      # the steady tile's exps between S's wait and the P·V's, not after both
                        lines = disassemble(cubin).splitlines()
                        (s_wait,) = [i for i, ln in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in ln]
                        pv_wait = min(i for i, ln in enumerate(lines) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ln
                                      and i > s_wait)
                        exps = sum("MUFU.EX2" in ln for ln in lines[s_wait:pv_wait])
                        assert exps == layout.tile_keys // 2 + 2, (layout, halves, exps)
    ok, log, _, _ = nvrtc_program(flash_source(64, WGMMA_LAYOUTS[0], 1), ["--std=c++17", "-arch=sm_90"], cubin=True)
    assert not ok and "wgmma" in log                          # plain sm_90 has no warpgroup products
    for bad in (dict(warpgroups=3), dict(warpgroups=1, frags=2), dict(warpgroups=1, keys=24), dict(keys=64),
                dict(warpgroups=1, heads=True), dict(warpgroups=2, stages=5), dict(overlap=True),
                dict(warpgroups=2, stages=2, overlap=True), dict(tma=True),
                dict(warpgroups=2, producer=True), dict(warpgroups=2, tma=True, producer=True, keys=128),
                dict(warpgroups=1, tma=True, producer=True, min_blocks=3), dict(warpgroups=1, pingpong=True),
                dict(warpgroups=2, stages=4, overlap=True, pingpong=True), dict(pingpong=True)):
        with pytest.raises(ValueError):
            FlashLayout(**bad)


def test_a_workspace_filled_before_these_prefill_kernels_builds_the_prefill_from_the_shipped_ones(tmp_path):
    """A workspace is filled once and never updated: one from before the wgmma attention (no attention_common.cuh
    or attention_wgmma.cuh, a portability layer without the warpgroup products) still builds every prefill kernel,
    from the shipped sources; a complete workspace's own prefill files are the ones used."""
    import shutil

    from workbench import paths
    from workbench.compiler.compile import nvrtc_program
    from workbench.run.prefill_gpu import PRECISIONS, WGMMA_FP32, flash_options, flash_source, layer_source
    old = tmp_path / "old"
    shutil.copytree(paths.template_dir(), old)
    (old / "prefill" / "attention_common.cuh").unlink()
    (old / "prefill" / "attention_wgmma.cuh").unlink()
    port = old / "portability.cuh"
    port.write_text(port.read_text().replace("wb_wgmma_desc", "wb_old_desc"))
    with paths.use_kernels_dir(old):
        layout = WGMMA_FP32
        src = flash_source(64, layout, PRECISIONS["fp32"])
        ok, log, _, _ = nvrtc_program(src, list(flash_options(layout)), cubin=False)
        assert ok, log
        assert "wb_old_desc" not in src and "wb_old_desc" not in layer_source()
    mine = tmp_path / "mine"
    shutil.copytree(paths.template_dir(), mine)
    common = mine / "prefill" / "attention_common.cuh"
    common.write_text(common.read_text() + "\n// this workspace's own\n")
    with paths.use_kernels_dir(mine):
        assert "// this workspace's own" in flash_source(64)
    # one filled after the warpgroup products but before the accelerator's copies: its attention_wgmma.cuh would
    # ignore a tma layout's maps and run cp.async under the tma layout's name, so the shipped kernels are used
    between = tmp_path / "between"
    shutil.copytree(mine, between)
    port = between / "portability.cuh"
    port.write_text(port.read_text().replace("wb_tma_load_3d", "wb_old_tma"))
    with paths.use_kernels_dir(between):
        assert "// this workspace's own" not in flash_source(64) and "wb_old_tma" not in flash_source(64)


def test_the_softmax_exps_without_their_denormal_steps_keep_every_ex2():
    """FlashLayout(exp_ftz=True), in both attention kernels at the layouts the prefill runs: the same MUFU.EX2
    count, none of __expf's range checks against −126 (the compare and conditional multiplies that keep a denormal
    result), and fewer instructions in all; without it, every ex2 keeps its check."""
    from workbench.compiler.compile import disassemble, nvrtc_program
    from workbench.run.prefill_gpu import FLASH_LAYOUT, PRECISIONS, WGMMA_FP32, flash_options, flash_source
    for base, halves in ((dataclasses.replace(FLASH_LAYOUT, frags=2), PRECISIONS["bf16"]),
                         (WGMMA_FP32, PRECISIONS["fp32"])):
        built = {}
        for ftz in (False, True):
            layout = dataclasses.replace(base, exp_ftz=ftz)
            options = [*flash_options(layout), *(() if layout.warpgroups else ("-arch=sm_90",))]
            ok, log, _, cubin = nvrtc_program(flash_source(64, layout, halves), options)
            assert ok, log
            sass = disassemble(cubin)
            built[ftz] = (sum(";" in ln for ln in sass.splitlines()), sass.count("MUFU.EX2"), sass.count("-126"))
        (n0, ex0, checks0), (n1, ex1, checks1) = built[False], built[True]
        assert ex0 == ex1 > 0 and checks0 == ex0 and checks1 == 0 and n1 + 2 * ex0 <= n0, (base, built)


def test_gate_up_in_bf16_is_the_bf16_precisions_alone():
    """prefill(mlp_bf16=True) rounds a product of the bf16 precision: asked of the fp32 one, it says so in one line
    and writes nothing."""
    cfg = get_config("tiny")
    p = prepare(random_weights(cfg, 0, xp=np, progress=False), xp=np, progress=False)
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    k, v = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
    with pytest.raises(ValueError, match="mlp_bf16 rounds gate_up's product in the bf16 precision; this prefill is fp32"):
        prefill(p, [1, 2, 3], k, v, precision="fp32", mlp_bf16=True)
    assert not k.any() and not v.any()

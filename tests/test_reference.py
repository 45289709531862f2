"""The reference interpreter (workbench.reference: the plan's stages run in execution order) against Hugging
Face's LlamaForCausalLM on checkpoints of many shapes, in fp32 and fp64, and against itself: step by step vs
batched, continued from a cache, on the kernel's prepared weights, its taps, its hook, its bf16 cache, its bad
inputs, and on cupy arrays."""
import contextlib
import inspect

import numpy as np
import pytest
from conftest import NEEDS_TORCH

torch = pytest.importorskip("torch", reason=NEEDS_TORCH)

from workbench import plan, schedule
from workbench.model import stage_math as S
from workbench.model.config import get_config
from workbench.model.weights import (Weights, layer_names, load_hf, prepare, random_weights, rope_inv_freq,
                                     unprepare)
from workbench.reference import (HFView, KVCache, PreparedView, decode_step, forward, generate_reference,
                                 round_bf16, view)

N_TOKENS = 20


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ per row (per step)."""
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


# ---- transformers as the judge -----------------------------------------------------------------------------------

def _rmsnorm_in_input_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_with_numpy_cos(self, x, position_ids):
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1).numpy()
    return torch.from_numpy(np.cos(emb)).to(x.dtype), torch.from_numpy(np.sin(emb)).to(x.dtype)


@contextlib.contextmanager
def hf_in_float64(model, cfg):
    """transformers in fp64 everywhere the reference is. As it ships, a float64 Llama still normalises in fp32
    (LlamaRMSNorm casts to float32) and takes cos/sin of its fp32 angles with torch's fp32 cos, where the reference's
    tables (like the kernel's) hold numpy's fp32 cos of the same angles: both faithful, an ulp apart at ~15% of the
    entries, which fp64 logits would see at ~1e-8. Inside this context the norm runs in the input's dtype and cos/sin
    come from numpy on HF's own angles. HF's inverse frequencies are checked to be within two ulps of the reference's
    (workbench.model.weights.rope_inv_freq reproduces them bit for bit for the presets; elsewhere torch's powf, an
    ulp from correctly rounded at an index or two, is an ulp or two off after the reciprocal) and then taken from
    the reference, so that what is compared at 1e-10 is the rest of the step."""
    from transformers.models.llama import modeling_llama as M

    rot = model.model.rotary_emb
    theirs = rot.inv_freq.float().numpy().copy()
    ours = rope_inv_freq(cfg)
    ulps = np.abs(theirs.view(np.int32).astype(np.int64) - ours.view(np.int32).astype(np.int64))
    assert ulps.max() <= 2 and (ulps > 0).sum() <= 2, f"inverse frequencies up to {ulps.max()} ulp from HF's"
    saved = M.LlamaRMSNorm.forward, M.LlamaRotaryEmbedding.forward
    M.LlamaRMSNorm.forward, M.LlamaRotaryEmbedding.forward = _rmsnorm_in_input_dtype, _rotary_with_numpy_cos
    with torch.no_grad():
        rot.inv_freq.copy_(torch.from_numpy(ours))
    try:
        yield
    finally:
        M.LlamaRMSNorm.forward, M.LlamaRotaryEmbedding.forward = saved
        with torch.no_grad():
            rot.inv_freq.copy_(torch.from_numpy(theirs))


def hf_model(folder, dtype):
    from transformers import AutoModelForCausalLM
    # eager in fp32 (softmax in fp32, as HF's eager path does); sdpa in fp64 (eager would softmax in fp32)
    impl = "sdpa" if dtype == torch.float64 else "eager"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=impl).eval()


def hf_logits(folder, cfg, tokens, dtype):
    """transformers' teacher-forced logits [n, V] of tokens at positions 0..n-1, as float64."""
    model = hf_model(folder, dtype)
    ids = torch.tensor(np.asarray(tokens)[None])
    with torch.no_grad(), (hf_in_float64(model, cfg) if dtype == torch.float64 else contextlib.nullcontext()):
        return model(ids).logits[0].double().numpy()


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


def compare_with_transformers(folder, rng):
    """Load through the loader (config.json via from_json, safetensors via load_hf), feed a prompt teacher-forced,
    and hold the reference to transformers: fp64 to 1e-10 (both fp64 throughout, same bf16 weights widened), fp32
    to 1e-5 (fp32 rounding in both, ~1e-6 measured); the unrounded cache (kv_bf16=False) as HF keeps it."""
    cfg = get_config(folder)
    w = load_hf(folder, progress=False)
    assert w.cfg == cfg
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, N_TOKENS)]
    ours64 = forward(w, tokens, kv_bf16=False, dtype=np.float64)
    ours32 = forward(w, tokens, kv_bf16=False, dtype=np.float32)
    assert ours64.dtype == np.float64 and ours32.dtype == np.float32
    assert ours64.shape == ours32.shape == (N_TOKENS, cfg.vocab)
    theirs64 = hf_logits(folder, cfg, tokens, torch.float64)
    theirs32 = hf_logits(folder, cfg, tokens, torch.float32)
    assert theirs64.std() > 0.5                                 # logits that say something, not a flat softmax
    assert rel_err(ours64, theirs64).max() < 1e-10
    assert rel_err(ours32, theirs32).max() < 1e-5
    assert rel_err(ours64, theirs32).max() < 1e-5
    assert rel_err(ours32, ours64).max() > 1e-9                 # the two precisions really differ
    return cfg, w, tokens, ours64


def checkpoint(head_dim, n_heads, n_kv_heads, hidden, intermediate, vocab, n_layers=2, rope="default",
               theta=10000.0, tied=True):
    fields = dict(hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                  num_key_value_heads=n_kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                  vocab_size=vocab, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=theta,
                  tie_word_embeddings=tied, hidden_act="silu", attention_bias=False, mlp_bias=False)
    if rope == "llama3":                                        # all three regimes: kept, smoothed and scaled
        fields["rope_scaling"] = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=16)
    return fields


# head dims 64..128, MHA and GQA (2 query heads per kv head, once 3 kv heads), hidden and intermediate multiples of 8
# but not of 64 (transformers wants hidden a multiple of the heads), prime vocabularies; tied and untied heads, plain
# and llama3 RoPE, several thetas.
CHECKPOINTS = {
    "hd64-mha": checkpoint(64, 4, 4, 200, 456, 613),
    "hd64-gqa": checkpoint(64, 4, 2, 232, 344, 521, rope="llama3", theta=500000.0, tied=False),
    "hd80-mha": checkpoint(80, 2, 2, 168, 520, 997, n_layers=3, theta=1e6, tied=False),
    "hd80-gqa": checkpoint(80, 6, 3, 312, 280, 761, rope="llama3"),
    "hd96-mha": checkpoint(96, 4, 4, 328, 456, 1009, rope="llama3", theta=500000.0),
    "hd96-gqa": checkpoint(96, 4, 2, 200, 584, 883, tied=False),
    "hd112-mha": checkpoint(112, 2, 2, 232, 344, 617, theta=500000.0, tied=False),
    "hd112-gqa": checkpoint(112, 4, 2, 168, 456, 659, rope="llama3", n_layers=3),
    "hd128-mha": checkpoint(128, 2, 2, 296, 520, 613, rope="llama3", tied=False),
    "hd128-gqa": checkpoint(128, 4, 2, 200, 344, 751, theta=1e6),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_reference_matches_transformers(hf_checkpoint, rng, name):
    fields = CHECKPOINTS[name]
    folder = hf_checkpoint(**fields)
    cfg, *_ = compare_with_transformers(folder, rng)
    assert (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.hidden, cfg.intermediate, cfg.vocab, cfg.n_layers) == \
        tuple(fields[k] for k in ("head_dim", "num_attention_heads", "num_key_value_heads", "hidden_size",
                                  "intermediate_size", "vocab_size", "num_hidden_layers"))
    assert cfg.tie_embeddings == fields["tie_word_embeddings"] and cfg.rope_theta == fields["rope_theta"]
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in fields)
    assert cfg.hidden % 64 and cfg.intermediate % 64 and all(cfg.vocab % d for d in range(2, cfg.vocab))


def test_tiny_checkpoint_matches_transformers_step_by_step(tiny_hf_checkpoint, rng):
    """The tiny preset's checkpoint (llama3 RoPE, GQA 3:1), batched and through HF's own KV cache, one token at a
    time; and our decode_step one token at a time."""
    cfg, w, tokens, ours64 = compare_with_transformers(tiny_hf_checkpoint, rng)
    assert cfg == get_config("tiny").with_(name=cfg.name, tie_embeddings=cfg.tie_embeddings)
    model = hf_model(tiny_hf_checkpoint, torch.float32)
    stepped = hf_step_by_step(model, tokens)
    assert rel_err(ours64, stepped).max() < 1e-5
    cache = KVCache.empty(cfg)
    ours_steps = np.stack([decode_step(w, cache, t, i, kv_bf16=False) for i, t in enumerate(tokens)])
    assert ours_steps.dtype == np.float32
    assert rel_err(ours_steps, stepped).max() < 1e-5


# ---- the interpreter against itself --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(get_config("tiny"), seed=4, progress=False)


@pytest.mark.parametrize("kv_bf16", [True, False])
def test_decode_step_equals_the_batched_forward(tiny_weights, rng, kv_bf16):
    w, cfg = tiny_weights, tiny_weights.cfg
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 12)]
    batched_cache, step_cache = KVCache.empty(cfg, np.float64), KVCache.empty(cfg, np.float64)
    batched = forward(w, tokens, cache=batched_cache, kv_bf16=kv_bf16, dtype=np.float64)
    steps = np.stack([decode_step(w, step_cache, t, i, kv_bf16=kv_bf16, dtype=np.float64)
                      for i, t in enumerate(tokens)])
    assert steps.shape == batched.shape == (12, cfg.vocab) and steps.dtype == np.float64
    assert rel_err(steps, batched).max() < 1e-12
    np.testing.assert_allclose(step_cache.k, batched_cache.k, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(step_cache.v, batched_cache.v, rtol=1e-12, atol=1e-13)
    assert not step_cache.k[:, :, len(tokens):].any()           # nothing written past the last position
    np.testing.assert_array_equal(generate_reference(w, tokens, kv_bf16=kv_bf16, dtype=np.float64), batched)


def test_generate_continues_from_a_cache(tiny_weights, rng):
    """Feeding a sequence in two calls (the second from pos0 with the first's cache) equals one call."""
    w, cfg = tiny_weights, tiny_weights.cfg
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 10)]
    whole = generate_reference(w, tokens, dtype=np.float64)
    cache = KVCache.empty(cfg, np.float64)
    first = generate_reference(w, tokens[:6], cache=cache, dtype=np.float64)
    second = generate_reference(w, tokens[6:], pos0=6, cache=cache, dtype=np.float64)
    assert rel_err(np.concatenate([first, second]), whole).max() < 1e-12
    # and one more token by decode_step, from the same cache
    nxt = int(rng.integers(cfg.vocab))
    longer = generate_reference(w, tokens + [nxt], dtype=np.float64)
    assert rel_err(decode_step(w, cache, nxt, 10, dtype=np.float64), longer[-1]) < 1e-12


def test_rows_at_any_positions_and_logit_rows(tiny_weights, rng):
    """forward over rows at given positions (from a cache) and with only some rows through the LM head."""
    w, cfg = tiny_weights, tiny_weights.cfg
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 9)]
    whole = forward(w, tokens, dtype=np.float64)
    cache = KVCache.empty(cfg, np.float64)
    forward(w, tokens[:5], cache=cache, dtype=np.float64)
    rest = forward(w, tokens[5:], np.arange(5, 9), cache=cache, dtype=np.float64)
    assert rel_err(rest, whole[5:]).max() < 1e-12
    some = forward(w, tokens, dtype=np.float64, logit_rows=[8, 2])
    assert some.shape == (2, cfg.vocab)
    assert rel_err(some, whole[[8, 2]]).max() < 1e-12


def test_float32_reference_tracks_float64(tiny_weights, rng):
    w, cfg = tiny_weights, tiny_weights.cfg
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 8)]
    a = generate_reference(w, tokens, dtype=np.float32)
    b = generate_reference(w, tokens, dtype=np.float64)
    assert a.dtype == np.float32 and b.dtype == np.float64
    # bf16 rounding of k/v can flip by an ulp between the two, so this is looser than fp32 eps
    assert rel_err(a, b).max() < 1e-3
    c = generate_reference(w, tokens, dtype=np.float32, kv_bf16=False)
    d = generate_reference(w, tokens, dtype=np.float64, kv_bf16=False)
    assert rel_err(c, d).max() < 1e-5


def test_prepared_view_within_bf16_of_the_checkpoint(tiny_hf_checkpoint, rng):
    """PreparedView over prepare(w) is what the kernel computes with: gains folded into the matrices and the products
    rounded to bf16. Each rounding moves a weight by at most 2^-9 ≈ 0.2% relative (≈ 0.11% RMS), independently, so
    each matvec's output moves by ~0.1%; about eleven rounded matvecs lie between token and logits and their errors
    add roughly in quadrature. 2e-2 (≈ 10 half-ulps of bf16) leaves room for that and still fails a layout slip: a
    gain folded twice or not at all is ~20% (gains are 1 ± 0.2), a swapped rope pair O(1)."""
    w = load_hf(tiny_hf_checkpoint, progress=False)
    p = prepare(w, progress=False)
    tokens = [int(t) for t in rng.integers(0, w.cfg.vocab, N_TOKENS)]
    exact = forward(HFView(w), tokens, kv_bf16=False)
    folded = forward(PreparedView(p), tokens, kv_bf16=False)
    assert exact.dtype == folded.dtype == np.float64
    err = rel_err(folded, exact)
    assert err.max() < 2e-2
    assert err.min() > 1e-4                                     # the rounding happened: this compares two models
    # a Prepared given as it is means its PreparedView; it computes what the unprepared weights do, exactly
    np.testing.assert_array_equal(forward(p, tokens, kv_bf16=False), folded)
    unprepared = forward(unprepare(p), tokens, kv_bf16=False)
    assert rel_err(folded, unprepared).max() < 1e-13
    in_fp32 = forward(PreparedView(p, np.float32), tokens, kv_bf16=False)
    assert in_fp32.dtype == np.float32 and rel_err(in_fp32, folded).max() < 1e-5


def test_views_see_the_weights_in_hf_layout(tiny_weights):
    w, cfg = tiny_weights, tiny_weights.cfg
    p = prepare(w, progress=False)
    hv, pv, uv = HFView(w, np.float32), PreparedView(p, np.float32), HFView(unprepare(p), np.float32)
    for layer in (0, cfg.n_layers - 1):
        for name, hf in layer_names(layer).items():
            assert pv.layer(name, layer).shape == hv.layer(name, layer).shape, name
            np.testing.assert_array_equal(pv.layer(name, layer), uv.layer(name, layer), err_msg=name)
            assert hv.layer(name, layer).dtype == np.float32
            np.testing.assert_array_equal(hv.layer(name, layer), w.f32(hf))
        for name in ("wo", "wd"):                               # no gain folded in: bit-equal to the checkpoint
            np.testing.assert_array_equal(pv.layer(name, layer), hv.layer(name, layer))
        np.testing.assert_array_equal(pv.layer("attn_norm", layer), np.ones(cfg.hidden))
    np.testing.assert_array_equal(pv.model("embed"), hv.model("embed"))
    np.testing.assert_array_equal(pv.model("final_norm"), np.ones(cfg.hidden))
    np.testing.assert_array_equal(hv.model("lm_head"), hv.model("embed"))   # tied
    assert view(hv) is hv and isinstance(view(p), PreparedView) and isinstance(view(w), HFView)
    with pytest.raises(TypeError, match="expected Weights, Prepared or a weight view, got dict"):
        view({"model.embed_tokens.weight": 0})


# ---- taps and the hook ---------------------------------------------------------------------------------------------

def expected_taps(cfg, n):
    """(stage, buffer, layer) → shape of every stage output of every layer: the plan's taps of each stage that has a
    reference, less the cross-block scratch the kernel keeps for itself."""
    out = {}
    for name, layer in schedule.execution(cfg):
        st = plan.stage(name)
        if st.reference is None:
            continue
        for buf in st.taps:
            b = plan.BUFFERS[buf]
            if b.kind == "scratch":
                continue
            out[name, buf, layer] = (n,) if b.kind == "value" else (n, schedule.tap_size(cfg, buf))
    return out


def test_taps_land_under_stage_buffer_layer(tiny_weights, rng):
    w, cfg = tiny_weights, tiny_weights.cfg
    n = 4
    tokens = rng.integers(0, cfg.vocab, n)
    cache, taps = KVCache.empty(cfg, np.float64), {}
    logits = forward(w, tokens, cache=cache, taps=taps)
    want = expected_taps(cfg, n)
    assert {k: v.shape for k, v in taps.items()} == want
    assert ("qkv_rope_append", "q", 0) in taps and ("down_residual", "x", 1) in taps
    assert ("lm_head", "logits", -1) in taps and ("sampling", "sampled", -1) in taps
    for key, value in taps.items():
        if key[1] != "sampled":
            assert value.dtype == np.float64 and np.isfinite(value).all() and np.abs(value).max() > 0, key
    np.testing.assert_array_equal(taps["lm_head", "logits", -1], logits)
    np.testing.assert_array_equal(taps["sampling", "sampled", -1], np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(taps["embedding", "x", -1], HFView(w).model("embed")[tokens])

    # each tap is what the next stage was fed: recompute every stage from the taps before it
    hv = HFView(w)
    for layer in range(cfg.n_layers):
        x_in = taps["embedding", "x", -1] if layer == 0 else taps["down_residual", "x", layer - 1]
        W = {k: hv.layer(k, layer) for k in layer_names(layer)}
        x_attn = S.o_proj_residual(x_in, W["wo"], taps["attention_decode", "o", layer])
        np.testing.assert_array_equal(taps["o_proj_residual", "x", layer], x_attn)
        h = S.gate_up_silu(x_attn, W["wg"], W["wu"], W["mlp_norm"], cfg.rms_eps)
        np.testing.assert_array_equal(taps["gate_up_silu", "hmlp", layer], h)
        np.testing.assert_array_equal(taps["down_residual", "x", layer], S.down_residual(x_attn, W["wd"], h))
        # the cache holds the taps' k and v (bf16-rounded) at the rows' positions
        for buf, c in (("k_cache", cache.k), ("v_cache", cache.v)):
            cached = c[layer][:, :n].transpose(1, 0, 2).reshape(n, -1)
            np.testing.assert_array_equal(cached, taps["qkv_rope_append", buf, layer])
    before = {k: v.copy() for k, v in taps.items()}
    forward(w, rng.integers(0, cfg.vocab, 2), np.array([n, n + 1]), cache=cache)
    for k, v in taps.items():                                   # taps are no views of the cache or the state
        np.testing.assert_array_equal(v, before[k], err_msg=str(k))

    step_taps = {}
    decode_step(w, cache, 7, n + 2, taps=step_taps)             # one step: the same keys, the row dropped
    assert {k: v.shape for k, v in step_taps.items()} == {k: s[1:] for k, s in expected_taps(cfg, 1).items()}


def test_the_hook_changes_a_stage_and_later_stages_see_it(tiny_weights, rng):
    w, cfg = tiny_weights, tiny_weights.cfg
    tokens = rng.integers(0, cfg.vocab, 5)
    clean = {}
    clean_logits = forward(w, tokens, taps=clean)
    calls = []

    def hook(stage, layer, outputs):
        calls.append((stage, layer))
        if (stage, layer) == ("gate_up_silu", 0):
            return {"hmlp": 2.0 * outputs["hmlp"]}
        if (stage, layer) == ("qkv_rope_append", 1):
            return {**outputs, "v_cache": np.zeros_like(outputs["v_cache"])}
        return outputs

    cache, hooked = KVCache.empty(cfg, np.float64), {}
    logits = forward(w, tokens, cache=cache, taps=hooked, hook=hook)
    assert calls == [(s, l) for s, l in schedule.execution(cfg) if plan.stage(s).reference is not None]
    order = list(clean)
    first_changed = order.index(("gate_up_silu", "hmlp", 0))
    for key in order[:first_changed]:                           # before the hooked stage: untouched
        np.testing.assert_array_equal(hooked[key], clean[key], err_msg=str(key))
    np.testing.assert_array_equal(hooked["gate_up_silu", "hmlp", 0], 2.0 * clean["gate_up_silu", "hmlp", 0])
    W = {k: HFView(w).layer(k, 0) for k in ("wd",)}
    np.testing.assert_array_equal(hooked["down_residual", "x", 0],
                                  S.down_residual(hooked["o_proj_residual", "x", 0], W["wd"],
                                                  2.0 * clean["gate_up_silu", "hmlp", 0]))
    for key in order[first_changed + 1:]:                       # after it: every output moved (the greedy
        if key != ("sampling", "sampled", -1):                  # tokens may or may not)
            assert not np.array_equal(hooked[key], clean[key]), key
    # zero values in layer 1's cache: its attention output is exactly zero, and the cache holds the hooked values
    assert not cache.v[1].any()
    np.testing.assert_array_equal(hooked["attention_decode", "o", 1], 0.0)
    assert rel_err(logits, clean_logits).min() > 1e-3


# ---- the bf16 cache ---------------------------------------------------------------------------------------------

def test_round_bf16_is_torchs_round_to_nearest_even(rng):
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-20, 20, 4096))).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]    # ties go to the even neighbour
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    got = round_bf16(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert got[4] == 1.0 and got[5] == 1.0 + 2 ** -6
    assert np.isnan(round_bf16(np.array([np.nan], dtype=np.float32))).all()
    x64 = x.astype(np.float64) * (1 + 1e-9)                     # fp64 values round through fp32, as the kernel does
    np.testing.assert_array_equal(round_bf16(x64), torch.from_numpy(x64).float().to(torch.bfloat16).double().numpy())
    assert round_bf16(x64).dtype == np.float64


def test_kv_bf16_rounds_the_cache_exactly(tiny_weights, rng):
    """What the stage computed (seen by the hook, before the append) is what the cache keeps, rounded to bf16 when
    kv_bf16 (then every cached value is a bf16 value), as it is otherwise."""
    w, cfg = tiny_weights, tiny_weights.cfg
    tokens = rng.integers(0, cfg.vocab, 6)
    for kv_bf16 in (True, False):
        raw = {}

        def hook(stage, layer, outputs):
            if stage == "qkv_rope_append":
                raw[layer] = {b: outputs[b].copy() for b in ("k_cache", "v_cache")}
            return outputs

        cache, taps = KVCache.empty(cfg, np.float64), {}
        forward(w, tokens, cache=cache, taps=taps, kv_bf16=kv_bf16, hook=hook)
        for layer in range(cfg.n_layers):
            for buf, c in (("k_cache", cache.k), ("v_cache", cache.v)):
                cached = c[layer][:, :len(tokens)].transpose(1, 0, 2).reshape(len(tokens), -1)
                want = round_bf16(raw[layer][buf]) if kv_bf16 else raw[layer][buf]
                np.testing.assert_array_equal(cached, want)
                np.testing.assert_array_equal(taps["qkv_rope_append", buf, layer], want)
                assert np.array_equal(round_bf16(cached), cached) == kv_bf16


# ---- bad inputs ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("token, pos, message", [
    (-1, 0, "outside the vocabulary"), (1003, 0, "outside the vocabulary"), (3, 4352, "outside \\[0, max_seq"),
    (3, -1, "outside \\[0, max_seq"),
])
def test_decode_step_rejects_bad_token_or_position(tiny_weights, token, pos, message):
    with pytest.raises(ValueError, match=message):
        decode_step(tiny_weights, KVCache.empty(tiny_weights.cfg), token, pos)


def test_decode_step_rejects_bad_cache_and_types(tiny_weights):
    cfg = tiny_weights.cfg
    for token in (2.0, True, "2"):
        with pytest.raises(TypeError, match="token must be an integer"):
            decode_step(tiny_weights, KVCache.empty(cfg), token, 0)
    small = KVCache.empty(cfg.with_(max_seq=16))
    with pytest.raises(ValueError, match="KV cache has shapes"):
        decode_step(tiny_weights, small, 2, 0)
    with pytest.raises(ValueError, match="would round"):
        decode_step(tiny_weights, KVCache.empty(cfg, np.float32), 2, 0, kv_bf16=False, dtype=np.float64)
    assert decode_step(tiny_weights, KVCache.empty(cfg, np.float32), 2, 0).shape == (cfg.vocab,)  # bf16 fits fp32


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_decode_step_rejects_a_cache_that_would_round_bf16(tiny_weights, dtype):
    with pytest.raises(ValueError, match="would round"):
        decode_step(tiny_weights, KVCache.empty(tiny_weights.cfg, dtype), 2, 0)


def test_generate_reference_rejects_bad_runs(tiny_weights):
    with pytest.raises(ValueError, match="no tokens"):
        generate_reference(tiny_weights, [])
    with pytest.raises(ValueError, match="do not fit max_seq"):
        generate_reference(tiny_weights, [1, 2, 3], pos0=4350)
    with pytest.raises(ValueError, match="do not fit max_seq"):
        generate_reference(tiny_weights, [1], pos0=-1, cache=KVCache.empty(tiny_weights.cfg))
    with pytest.raises(ValueError, match="needs the cache"):
        generate_reference(tiny_weights, [1, 2], pos0=5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_reference(tiny_weights, [1, 5000])


@pytest.mark.parametrize("case", ["fp32 cache for unrounded fp64", "cache of another model"])
def test_generate_reference_rejects_a_bad_cache(tiny_weights, case):
    cfg = tiny_weights.cfg
    if case == "fp32 cache for unrounded fp64":
        cache, kw, message = KVCache.empty(cfg, np.float32), dict(kv_bf16=False, dtype=np.float64), "would round"
    else:
        cache, kw, message = KVCache.empty(cfg.with_(n_layers=1)), {}, "KV cache has shapes"
    with pytest.raises(ValueError, match=message):
        generate_reference(tiny_weights, [1, 2, 3], cache=cache, **kw)


def test_forward_rejects_bad_tokens_and_positions(tiny_weights):
    w, cfg = tiny_weights, tiny_weights.cfg
    for tokens, positions, message in [
            ([], None, "no tokens to feed"),
            ([1, 2], [0], "2 tokens but 1 positions"),
            ([1, 1003], None, "outside the vocabulary"),
            ([-1], None, "outside the vocabulary"),
            (np.zeros(cfg.max_seq + 1, dtype=np.int64), None, "do not fit max_seq"),
            ([1], [-1], "do not fit max_seq"),
            ([1, 2], [3, 4], "need the cache that holds positions 0..2")]:
        with pytest.raises(ValueError, match=message):
            forward(w, tokens, positions)
    missing = Weights(cfg, {k: v for k, v in w.tensors.items() if k != "model.norm.weight"})
    with pytest.raises(KeyError, match="model.norm.weight"):
        forward(missing, [1])


@pytest.mark.parametrize("tokens, positions", [([1.5, 2.0], None), ([1, 2], [0.0, 1.5])])
def test_forward_rejects_non_integer_tokens_and_positions(tiny_weights, tokens, positions):
    with pytest.raises((TypeError, ValueError), match="integer"):
        forward(tiny_weights, tokens, positions)


def test_forward_rejects_repeated_positions(tiny_weights):
    with pytest.raises(ValueError, match="position"):
        forward(tiny_weights, [1, 2], [0, 0])


# ---- on the GPU ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_reference_runs_on_cupy_arrays(rng):
    """Weights generated on the device (as large models are) give the interpreter the same floats as on the host;
    its outputs, taps and cache stay on the device; prepared weights on the device too."""
    import cupy

    cfg = get_config("tiny")
    on_device = random_weights(cfg, seed=int(rng.integers(1 << 30)), xp=cupy, progress=False)
    on_host = Weights(cfg, {k: cupy.asnumpy(v) for k, v in on_device.tensors.items()})
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 6)]
    taps = {}
    dev = forward(on_device, tokens, kv_bf16=False, taps=taps)
    assert isinstance(dev, cupy.ndarray) and dev.dtype == np.float64
    assert all(isinstance(v, cupy.ndarray) for v in taps.values()) and set(taps) == set(expected_taps(cfg, 6))
    host = forward(on_host, tokens, kv_bf16=False)
    assert rel_err(cupy.asnumpy(dev), host).max() < 1e-12
    # the bf16 cache and the fp32 path
    assert rel_err(cupy.asnumpy(forward(on_device, tokens, dtype=np.float32)), forward(on_host, tokens)).max() < 1e-3
    p_dev, p_host = prepare(on_device, progress=False), prepare(on_host, progress=False)
    assert rel_err(cupy.asnumpy(forward(p_dev, tokens, kv_bf16=False)), forward(p_host, tokens, kv_bf16=False)
                   ).max() < 1e-12
    # continued from a device cache, step by step
    cache = KVCache.empty(cfg, np.float64, cupy)
    first = generate_reference(on_device, tokens[:4], cache=cache, kv_bf16=False, dtype=np.float64)
    last = decode_step(on_device, cache, tokens[4], 4, kv_bf16=False, dtype=np.float64)
    assert isinstance(cache.k, cupy.ndarray) and isinstance(last, cupy.ndarray)
    assert rel_err(cupy.asnumpy(cupy.concatenate([first, last[None]])), host[:5]).max() < 1e-12

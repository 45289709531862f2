"""Model families beyond Llama, in the reference: Qwen3 (per-head RMSNorm on q and k before RoPE, each with its
gain) and Qwen2 (biases on the q, k and v projections), each cross-checked against its own transformers class
(Qwen3ForCausalLM, Qwen2ForCausalLM) in fp32 over a teacher-forced run, on save_pretrained checkpoints of awkward
sizes. The kernel runs both (Qwen2's biases are one add per row in the QKV epilogue, Qwen3's norms are finished
by each head's last row pair; verified on the GPU in tests/test_gpu.py). Also Llama's relatives that need no new
step (SmolLM2, Llama 2): presets at their shapes."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import NEEDS_TORCH

torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
from test_reference import N_TOKENS, hf_logits, rel_err

from workbench.model.config import get_config
from workbench.model.stage_math import head_rmsnorm, qkv_rope_append
from workbench.model.weights import expected_shapes, layer_names, load_hf, prepare, random_weights
from workbench.reference import forward


def family(model_type, head_dim, n_heads, n_kv_heads, hidden, intermediate, vocab, n_layers=2, theta=1e6,
           tied=True):
    return dict(model_type=model_type, hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                num_key_value_heads=n_kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                vocab_size=vocab, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=theta,
                tie_word_embeddings=tied, hidden_act="silu", use_sliding_window=False,
                **({"attention_bias": False} if model_type == "qwen3" else {}))


# Qwen3 sets head_dim apart from hidden / heads (0.6B: 16 heads of 128 on a hidden size of 1,024): so do these.
# Qwen2 has none (head_dim = hidden / heads). Hidden and intermediate multiples of 8, not of 64; prime vocabularies.
FAMILIES = {
    "qwen3-hd128-gqa": family("qwen3", 128, 4, 2, 200, 344, 613),
    "qwen3-hd64-mha-untied": family("qwen3", 64, 3, 3, 232, 456, 521, n_layers=3, tied=False),
    "qwen3-hd96-gqa3": family("qwen3", 96, 6, 2, 168, 520, 997, theta=1e4),
    "qwen2-hd64-gqa": family("qwen2", None, 4, 2, 256, 344, 761),
    "qwen2-hd80-mha-untied": family("qwen2", None, 3, 3, 240, 280, 883, tied=False),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reference_matches_the_familys_transformers_class(hf_checkpoint, rng, name):
    fields = {k: v for k, v in FAMILIES[name].items() if v is not None}
    folder = hf_checkpoint(**fields)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[fields["model_type"]]]
    cfg = get_config(folder)
    assert cfg.qk_norm == (fields["model_type"] == "qwen3") and cfg.qkv_bias == (fields["model_type"] == "qwen2")
    assert cfg.tie_embeddings == fields["tie_word_embeddings"]
    w = load_hf(folder, progress=False)
    names = layer_names(cfg.n_layers - 1, cfg)
    assert all(n in w.tensors for n in names.values())
    assert ("q_norm" in names) == cfg.qk_norm and ("bq" in names) == cfg.qkv_bias
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, N_TOKENS)]
    ours32 = forward(w, tokens, kv_bf16=False, dtype=np.float32)
    ours64 = forward(w, tokens, kv_bf16=False, dtype=np.float64)
    theirs32 = hf_logits(folder, cfg, tokens, torch.float32)
    assert theirs32.std() > 0.5                                 # logits that say something
    # fp32 rounding in both (~1e-6 measured for Llama); fp64 ours against fp32 theirs bounds both
    assert rel_err(ours32, theirs32).max() < 1e-5
    assert rel_err(ours64, theirs32).max() < 1e-5


@pytest.mark.parametrize("name", ["qwen3-hd128-gqa", "qwen2-hd64-gqa"])
def test_each_familys_own_step_matters(hf_checkpoint, rng, name):
    """Without its q/k norms (or its biases) the reference is far from transformers: the cross-check above sees
    them, it does not pass by their being negligible."""
    fields = {k: v for k, v in FAMILIES[name].items() if v is not None}
    folder = hf_checkpoint(**fields)
    cfg = get_config(folder)
    w = load_hf(folder, progress=False)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, N_TOKENS)]
    theirs = hf_logits(folder, cfg, tokens, torch.float32)
    plain = cfg.with_(qk_norm=False, qkv_bias=False)
    from workbench.model.weights import Weights
    stripped = Weights(plain, {k: v for k, v in w.tensors.items() if k in expected_shapes(plain)}, w.xp)
    assert rel_err(forward(stripped, tokens, kv_bf16=False, dtype=np.float32), theirs).max() > 1e-2


def test_head_rmsnorm_normalises_each_head_on_its_own(rng):
    a = rng.standard_normal((3, 4 * 16))
    g = 1 + 0.2 * rng.standard_normal(16)
    out = head_rmsnorm(a, g, 16, 1e-6)
    for h in range(4):
        s = a[:, 16 * h:16 * (h + 1)]
        want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6) * g
        np.testing.assert_allclose(out[:, 16 * h:16 * (h + 1)], want, rtol=1e-12)
    with pytest.raises(ValueError, match="q_norm"):
        head_rmsnorm(a, g[:8], 16, 1e-6, "q_norm")


def test_qkv_biases_are_added_before_rope(rng):
    D, hd = 32, 16
    x = rng.standard_normal((2, D))
    wq, wk = rng.standard_normal((2 * hd, D)), rng.standard_normal((hd, D))
    bq, bk, bv = rng.standard_normal(2 * hd), rng.standard_normal(hd), rng.standard_normal(hd)
    cos, sin = np.ones((2, hd // 2)), np.zeros((2, hd // 2))          # rope by angle 0: the identity
    q, k, v = qkv_rope_append(x, wq, wk, wk, np.ones(D), cos, sin, 1e-6, biases=(bq, bk, bv))
    q0, k0, v0 = qkv_rope_append(x, wq, wk, wk, np.ones(D), cos, sin, 1e-6)
    np.testing.assert_allclose(q - q0, np.broadcast_to(bq, q.shape), atol=1e-12)
    np.testing.assert_allclose(v - v0, np.broadcast_to(bv, v.shape), atol=1e-12)


def test_random_weights_of_a_family_have_its_tensors():
    cfg = get_config("tiny").with_(qk_norm=True)
    w = random_weights(cfg, 1, progress=False)
    assert w.tensors[layer_names(0, cfg)["q_norm"]].shape == (cfg.head_dim,)
    cfg2 = get_config("tiny").with_(qkv_bias=True)
    w2 = random_weights(cfg2, 1, progress=False)
    assert w2.tensors[layer_names(1, cfg2)["bv"]].shape == (cfg2.kv_dim,)


def _prepared_and_back(flag: str):
    """tiny with a family's flag: (config, random weights, prepared, unprepared back)."""
    from workbench.model.weights import unprepare
    cfg = get_config("tiny").with_(**{flag: True})
    w = random_weights(cfg, 3, progress=False)
    p = prepare(w, progress=False)
    return cfg, w, p, unprepare(p)


def test_qwen3_gains_are_prepared_as_they_are_and_come_back():
    """prepare() keeps the q/k norm gains apart (they follow a norm of the projection's output: nothing to fold them
    into), q's then k's per layer; unprepare() gives back exactly the checkpoint's; a Llama gets ones."""
    from workbench.model.weights import to_f32
    cfg, w, p, back = _prepared_and_back("qk_norm")
    for i in range(cfg.n_layers):
        n = layer_names(i, cfg)
        for j, k in enumerate(("q_norm", "k_norm")):
            assert np.array_equal(p.qk_gain[i, j], to_f32(w.tensors[n[k]]))
            assert np.array_equal(back.tensors[n[k]], to_f32(w.tensors[n[k]]))
    plain = prepare(random_weights(get_config("tiny"), 3, progress=False), progress=False)
    assert plain.qk_gain.shape == (2, 2, get_config("tiny").head_dim) and (plain.qk_gain == 1).all()


def test_qwen3_builds_and_reads_its_gains():
    """The Qwen3 build compiles the per-head norm in (its gains, the raw heads and their arrival counters are the
    stage's arguments) without local memory; a Llama build compiles it away."""
    from workbench import schedule
    from workbench.compiler.assemble import assemble
    from workbench.compiler.compile import compile_cubin, resource_usage
    cfg = get_config("tiny").with_(qk_norm=True)
    asm = assemble(cfg)
    assert "#define WB_QK_NORM 1" in asm.source and "P->qk_gain + layer * WB_PER_LAYER_QK_GAIN" in asm.source
    assert "P->qk_raw, P->qk_count" in asm.source
    assert "#define WB_QK_NORM 0" in assemble(get_config("tiny")).source
    (r,) = resource_usage(compile_cubin(asm)[0])
    assert r.stack == 0
    extra = schedule.stage_weight_bytes(cfg, "qkv_rope_append") - schedule.stage_weight_bytes(get_config("tiny"), "qkv_rope_append")
    assert extra == 4 * 2 * cfg.head_dim


# Llama's relatives: parameter counts as their model cards and checkpoints give them, exactly
RELATIVES = {"smollm2-135m": 134_515_008, "smollm2-1.7b": 1_711_376_384, "llama-2-7b": 6_738_415_616}


@pytest.mark.parametrize("name", list(RELATIVES))
def test_llamas_relatives_are_their_models(name):
    from workbench.model.config import PRESETS
    cfg = PRESETS[name]
    assert cfg.n_params() == RELATIVES[name]
    assert not (cfg.qk_norm or cfg.qkv_bias) and cfg.rope_scaling is None
    assert cfg.max_seq <= cfg.max_positions


def test_llamas_relatives_shapes_match_transformers(hf_checkpoint, rng):
    """SmolLM2-135M's head layout (9 query heads on 3 kv heads, head_dim 64) at a small width, as a
    LlamaForCausalLM checkpoint (HF wants the width a multiple of the heads: 216 = 9 · 24, heads of 64 apart from
    it): the reference matches it over a teacher-forced run."""
    folder = hf_checkpoint(hidden_size=216, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, intermediate_size=344, vocab_size=613, max_position_embeddings=64,
                           rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    cfg = get_config(folder)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_scaling) == (9, 3, 64, None)
    w = load_hf(folder, progress=False)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, N_TOKENS)]
    assert rel_err(forward(w, tokens, kv_bf16=False, dtype=np.float32), hf_logits(folder, cfg, tokens,
                                                                                    torch.float32)).max() < 1e-5


# parameters published for each model (its model card), billions
PUBLISHED = {"qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen2.5-0.5b": 0.49,
             "qwen2.5-1.5b": 1.54}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_family_presets_have_their_models_shapes(name):
    from workbench.model.config import PRESETS
    cfg = PRESETS[name]
    assert round(cfg.n_params() / 1e9, 2 if PUBLISHED[name] < 1 or name.startswith("qwen2") else 1) == PUBLISHED[name]
    assert cfg.qk_norm == name.startswith("qwen3") and cfg.qkv_bias == name.startswith("qwen2")
    if name.startswith("qwen3"):                     # heads of 128 whatever the width: 0.6b and 4b's q is wider
        assert cfg.head_dim == 128 and (cfg.q_dim != cfg.hidden) == (name in ("qwen3-0.6b", "qwen3-4b"))


def test_qwen2_biases_are_prepared_in_the_kernels_row_order_and_come_back():
    """prepare() puts the biases in Wqkv's rope-pair row order, unscaled (they follow the projection, so the
    attention norm's gain is not folded into them); unprepare() gives back exactly the checkpoint's."""
    from workbench.model.weights import qkv_row_order, to_f32
    cfg, w, p, back = _prepared_and_back("qkv_bias")
    order = qkv_row_order(cfg)
    for i in range(cfg.n_layers):
        n = layer_names(i, cfg)
        b = np.concatenate([to_f32(w.tensors[n[k]]) for k in ("bq", "bk", "bv")])
        assert np.array_equal(p.bqkv[i], b[order])
        assert all(np.array_equal(back.tensors[n[k]], to_f32(w.tensors[n[k]])) for k in ("bq", "bk", "bv"))
    plain = prepare(random_weights(get_config("tiny"), 3, progress=False), progress=False)
    assert plain.bqkv.shape == (2, get_config("tiny").qkv_rows) and not plain.bqkv.any()


def test_qwen2_builds_and_reads_its_biases():
    from workbench import schedule
    from workbench.compiler.assemble import assemble
    from workbench.compiler.compile import compile_cubin, resource_usage
    cfg = get_config("tiny").with_(qkv_bias=True)
    asm = assemble(cfg)
    assert "#define WB_QKV_BIAS 1" in asm.source and "P->bqkv + layer * WB_PER_LAYER_BQKV" in asm.source
    (r,) = resource_usage(compile_cubin(asm)[0])
    assert r.stack == 0
    # the biases' bytes are the model's, and a Llama streams none
    extra = schedule.stage_weight_bytes(cfg, "qkv_rope_append") - schedule.stage_weight_bytes(get_config("tiny"), "qkv_rope_append")
    assert extra == 4 * cfg.qkv_rows

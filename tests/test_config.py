"""ModelConfig: presets, derived sizes, reading HF config.json, and refusing what the kernel cannot run."""
import dataclasses
import json

import pytest
from conftest import needs_torch

from workbench.model.config import PRESETS, ConfigError, ModelConfig, RopeScaling, get_config
from workbench.model.weights import expected_shapes

# config.json of meta-llama/Llama-3.2-1B-Instruct and meta-llama/Llama-3.1-8B-Instruct, as published
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_llama_32_1b_sizes():
    cfg = get_config("llama-3.2-1b")
    assert (cfg.q_dim, cfg.kv_dim, cfg.qkv_rows, cfg.group) == (2048, 512, 3072, 4)
    assert cfg.weight_bytes_per_token() == 2_471_493_632
    assert cfg.n_params() == 1_235_814_400                     # the published parameter count
    assert cfg.kv_bytes_per_token(0) == 2 * 2 * 16 * 512       # k and v, bf16, 16 layers, one position
    assert cfg.kv_bytes_per_token(4095) == 4096 * cfg.kv_bytes_per_token(0)


def test_published_parameter_counts():
    assert get_config("llama-3.2-3b").n_params() == 3_212_749_824
    assert get_config("llama-3.1-8b").n_params() == 8_030_261_248


@pytest.mark.parametrize("name", list(PRESETS))
def test_weight_bytes_agree_with_tensor_shapes(name):
    """The streamed bytes are every matrix once in bf16, the LM head included (the embedding is only read a row at a
    time, so an untied embedding does not count), and in fp32 Qwen2's q/k/v biases and Qwen3's q/k norm gains; the
    other norm gains are folded into the matrices."""
    cfg = get_config(name)
    shapes = expected_shapes(cfg)
    streamed = [shape for name, shape in shapes.items() if len(shape) == 2 and name != "model.embed_tokens.weight"]
    if cfg.tie_embeddings:
        streamed.append((cfg.vocab, cfg.hidden))                # the LM head reads the embedding matrix
    biases = sum(s[0] for n, s in shapes.items() if n.endswith(".bias"))
    qk_gains = sum(s[0] for n, s in shapes.items() if n.endswith(("q_norm.weight", "k_norm.weight")))
    assert (biases > 0) == cfg.qkv_bias and (qk_gains > 0) == cfg.qk_norm
    fp32 = biases + qk_gains
    assert cfg.weight_bytes_per_token() == 2 * sum(rows * cols for rows, cols in streamed) + 4 * fp32
    assert cfg.weight_bytes_per_token(1) * 2 == cfg.weight_bytes_per_token() + 4 * fp32


def test_n_params_matches_transformers():
    torch = needs_torch()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = get_config("tiny")
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict()))
    assert model.num_parameters() == cfg.n_params()


@pytest.mark.parametrize("d, preset", [(LLAMA_32_1B, "llama-3.2-1b"), (LLAMA_31_8B, "llama-3.1-8b")])
def test_from_hf_dict_matches_preset(d, preset):
    cfg = ModelConfig.from_hf_dict(d, name=preset)
    assert cfg == PRESETS[preset]
    assert cfg.max_seq == 8192                                 # capped: 131072 would be a 4 GiB cache at 8B


def test_from_hf_dict_details():
    cfg = ModelConfig.from_hf_dict(LLAMA_31_8B)
    assert cfg.head_dim == 4096 // 32                          # derived when config.json has no head_dim
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert not cfg.tie_embeddings and cfg.eos_token_ids == (128001, 128008, 128009)
    assert ModelConfig.from_hf_dict(LLAMA_32_1B, max_seq=1024).max_seq == 1024
    single_eos = ModelConfig.from_hf_dict({**LLAMA_32_1B, "eos_token_id": 128001})
    assert single_eos.eos_token_ids == (128001,)
    plain = ModelConfig.from_hf_dict({**LLAMA_32_1B, "rope_scaling": None})
    assert plain.rope_scaling is None and plain.rope_theta == 500000.0


def test_transformers_5_rope_parameters_round_trip():
    """transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_scaling + rope_theta."""
    from transformers import LlamaConfig

    for name in ("tiny", "llama-3.2-1b"):
        cfg = get_config(name)
        saved = json.loads(LlamaConfig(**cfg.to_hf_dict()).to_json_string())
        assert ModelConfig.from_hf_dict(saved, name=name) == cfg


def test_from_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    assert get_config(str(tmp_path)).with_(name="llama-3.2-1b") == PRESETS["llama-3.2-1b"]
    assert ModelConfig.from_json(tmp_path / "config.json").hidden == 2048
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path / "elsewhere")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path / "bad")
    with pytest.raises(ConfigError, match="neither a preset"):
        get_config("no-such-model")


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "lacks 'hidden_size'"),
    ({"vocab_size": None}, "lacks 'vocab_size'"),
    ({"num_key_value_heads": 6}, r"num_attention_heads \(32\) must be a multiple of num_key_value_heads \(6\)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not implemented"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not implemented"),
    ({"model_type": "gpt2"}, "not a Llama-family"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"attention_bias": True}, "biases"),
    ({"head_dim": 72}, "multiple of 16"),
    ({"head_dim": 512}, "above 256"),
    ({"intermediate_size": 8190}, "multiple of 8"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive number, got 0.0"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
])
def test_bad_configs_are_refused_with_the_reason(change, message):
    d = {k: v for k, v in {**LLAMA_32_1B, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_sliding_window_caps_max_seq():
    """Mistral 7B v0.1 attends to the last 4096 positions only; up to there that is full attention."""
    mistral = {**LLAMA_31_8B, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768,
               "rope_scaling": None, "rope_theta": 10000.0}
    assert ModelConfig.from_hf_dict(mistral).max_seq == 4096
    assert ModelConfig.from_hf_dict(mistral, max_seq=2048).max_seq == 2048
    with pytest.raises(ConfigError, match="sliding_window 4096"):
        ModelConfig.from_hf_dict(mistral, max_seq=8192)
    # transformers' MistralModel applies its window whatever use_sliding_window says (no MistralConfig field)...
    assert ModelConfig.from_hf_dict({**mistral, "use_sliding_window": False}).max_seq == 4096
    # ...where qwen-style configs carry a window they do not use
    unused = {**mistral, "model_type": "qwen2", "use_sliding_window": False}
    assert ModelConfig.from_hf_dict(unused).max_seq == 8192
    assert ModelConfig.from_hf_dict({**mistral, "sliding_window": None}).max_seq == 8192


def test_defines():
    cfg = get_config("tiny")
    assert cfg.defines() == {
        "WB_D": "264", "WB_LAYERS": "2", "WB_HEADS": "6", "WB_KV_HEADS": "2", "WB_HEAD_DIM": "32",
        "WB_FF": "712", "WB_VOCAB": "1003", "WB_MAX_SEQ": "4352", "WB_RMS_EPS": "1e-05f", "WB_QKV_BIAS": "0",
        "WB_QK_NORM": "0",
    }
    big = get_config("llama-3.2-1b", max_seq=4096).defines()
    assert big["WB_MAX_SEQ"] == "4096" and big["WB_VOCAB"] == "128256" and big["WB_KV_HEADS"] == "8"
    eps = cfg.with_(rms_eps=1e-6).defines()["WB_RMS_EPS"]
    assert eps.endswith("f") and float(eps[:-1]) == 1e-6       # a float literal C++ reads back exactly


def test_presets_are_frozen_and_hashable():
    cfg = get_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 8
    assert hash(cfg) == hash(get_config("tiny"))


def test_max_seq_must_be_positive_and_within_max_position_embeddings(tmp_path):
    assert ModelConfig.from_hf_dict(LLAMA_32_1B, max_seq=131072).max_seq == 131072
    with pytest.raises(ConfigError, match=r"^max_seq 131073 is larger than max_position_embeddings \(131072\) of "
                                          r"config.json$"):
        ModelConfig.from_hf_dict(LLAMA_32_1B, max_seq=131073)
    for bad in (0, -1):                                        # 0 used to mean "the default", silently
        with pytest.raises(ConfigError, match=f"max_seq must be a positive integer, got {bad}"):
            ModelConfig.from_hf_dict(LLAMA_32_1B, max_seq=bad)
        with pytest.raises(ConfigError, match=f"max_seq must be a positive integer, got {bad}"):
            get_config("tiny", max_seq=bad)
    with pytest.raises(ConfigError, match=r"max_seq 200000 is larger than max_position_embeddings \(131072\) of "
                                          r"preset llama-3.2-1b"):
        get_config("llama-3.2-1b", max_seq=200000)
    assert get_config("llama-3.2-1b", max_seq=131072).max_seq == 131072


def test_max_positions_is_kept_but_not_compared():
    cfg = ModelConfig.from_hf_dict(LLAMA_32_1B, name="llama-3.2-1b")
    assert cfg.max_positions == 131072 == PRESETS["llama-3.2-1b"].max_positions
    assert cfg == PRESETS["llama-3.2-1b"] and hash(cfg) == hash(cfg.with_(max_positions=None))


def test_a_file_means_its_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B))
    (tmp_path / "model.safetensors").write_bytes(b"")
    for given in ("config.json", "model.safetensors"):
        assert get_config(str(tmp_path / given)).with_(name="llama-3.2-1b") == PRESETS["llama-3.2-1b"]


def test_config_json_messages_name_the_file_and_key(tmp_path):
    path = tmp_path / "config.json"
    for d, message in [([LLAMA_32_1B], "must hold a JSON object (a Hugging Face model config), not an array"),
                       ({**LLAMA_32_1B, "rms_norm_eps": "abc"}, 'rms_norm_eps must be a positive number, got "abc"'),
                       ({**LLAMA_32_1B, "max_position_embeddings": None},
                        "max_position_embeddings must be a positive integer, got null"),
                       ({**LLAMA_32_1B, "rope_scaling": {"rope_type": "llama3"}}, "lacks 'rope_scaling.factor'")]:
        path.write_text(json.dumps(d))
        with pytest.raises(ConfigError) as e:
            get_config(str(tmp_path))
        assert str(e.value).startswith(str(path)) and str(e.value).endswith(message)


def test_nulls_that_mean_the_default():
    """HF writes null for some keys it derives; those read as absent."""
    cfg = ModelConfig.from_hf_dict({**LLAMA_31_8B, "head_dim": None, "num_key_value_heads": None,
                                    "rope_scaling": None, "bos_token_id": None, "eos_token_id": None})
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.rope_scaling, cfg.bos_token_id, cfg.eos_token_ids) == \
        (128, 32, None, None, ())


def test_fields_set_in_code_are_named_as_fields():
    with pytest.raises(ConfigError, match=r"model config 'tiny': n_heads \(6\) must be a multiple of n_kv_heads "
                                          r"\(4\)"):
        get_config("tiny").with_(n_kv_heads=4)
    with pytest.raises(ConfigError, match="model config 'tiny': rms_eps must be positive, got nan"):
        get_config("tiny").with_(rms_eps=float("nan"))

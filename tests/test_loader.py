"""Loading HF checkpoints, failing clearly on broken ones, and the kernel layout that prepare() produces."""
import dataclasses
import re
import shutil

import numpy as np
import pytest
from conftest import NEEDS_TORCH

torch = pytest.importorskip("torch", reason=NEEDS_TORCH)

from workbench.model import safetensors_io
from workbench.model.config import get_config
from workbench.model.weights import (WeightsError, check_finite, layer_names, load, load_hf, prepare, random_weights,
                                     rope_inv_freq, rope_tables, round_bf16, to_f32, unprepare)


def hf_state_dict_bits(folder) -> dict[str, np.ndarray]:
    """The checkpoint as transformers loads it, bf16 tensors as uint16 bits."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sharded", [False, True])
def test_load_hf_matches_transformers(tiny_hf_checkpoint, tiny_hf_checkpoint_sharded, sharded):
    folder = tiny_hf_checkpoint_sharded if sharded else tiny_hf_checkpoint
    w = load_hf(folder, progress=False)
    assert w.cfg.with_(name="tiny") == get_config("tiny")     # config.json read back from transformers' own format
    reference = hf_state_dict_bits(folder)
    for name, t in w.tensors.items():
        assert t.dtype == np.uint16, name
        np.testing.assert_array_equal(t, reference[name], err_msg=name)
    # tied: transformers has lm_head.weight as the embedding itself, the checkpoint does not store it
    assert set(reference) - set(w.tensors) == {"lm_head.weight"}
    np.testing.assert_array_equal(reference["lm_head.weight"], w.tensors["model.embed_tokens.weight"])


def test_sharded_and_single_file_agree(tiny_hf_checkpoint, tiny_hf_checkpoint_sharded):
    assert len(list(tiny_hf_checkpoint_sharded.glob("*.safetensors"))) > 1
    a, b = load_hf(tiny_hf_checkpoint, progress=False), load_hf(tiny_hf_checkpoint_sharded, progress=False)
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name], err_msg=name)


def rewrite_single_file(src, dst, edit):
    """Copy a single-file checkpoint with its tensors passed through edit(dict) → dict."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    st = safetensors_io.SafetensorsFile(src / "model.safetensors")
    out = edit({k: np.array(st.get(k)) for k in st.keys()})
    # bf16 stays uint16 bits in numpy: every uint16 array is written as BF16
    safetensors_io.write(dst / "model.safetensors", out, bf16={k for k, v in out.items() if v.dtype == np.uint16})
    return dst


def test_rewritten_checkpoint_loads_identically(tiny_hf_checkpoint, tmp_path):
    """The test helper itself (and safetensors_io.write) round-trips: the failures below are the edits'."""
    copy = rewrite_single_file(tiny_hf_checkpoint, tmp_path / "copy", lambda t: t)
    a, b = load_hf(tiny_hf_checkpoint, progress=False), load_hf(copy, progress=False)
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name])


def test_missing_tensor_is_named(tiny_hf_checkpoint, tmp_path):
    gone = layer_names(1)["wv"]
    broken = rewrite_single_file(tiny_hf_checkpoint, tmp_path / "broken",
                                 lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(WeightsError, match=f"missing tensors {gone}"):
        load_hf(broken, progress=False)


def test_wrong_shape_is_named(tiny_hf_checkpoint, tmp_path):
    name = layer_names(0)["wg"]
    broken = rewrite_single_file(tiny_hf_checkpoint, tmp_path / "broken", lambda t: {**t, name: t[name][:-8]})
    with pytest.raises(WeightsError, match=rf"{name} has shape \(704, 264\), config says \(712, 264\)"):
        load_hf(broken, progress=False)


def test_missing_shard_is_named(tiny_hf_checkpoint_sharded, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf_checkpoint_sharded, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightsError, match=f"shard {shard.name} named by the index is missing"):
        load_hf(broken, progress=False)


def test_truncated_file_is_named(tiny_hf_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf_checkpoint, broken)
    path = broken / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor \S+ is truncated"):
        load_hf(broken, progress=False)


def test_not_a_checkpoint(tiny_hf_checkpoint, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_hf_checkpoint / "config.json", empty / "config.json")
    with pytest.raises(WeightsError, match="neither model.safetensors nor"):
        load_hf(empty, progress=False)
    (empty / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(WeightsError, match="too short"):
        load_hf(empty, progress=False)
    (empty / "model.safetensors").write_bytes((40).to_bytes(8, "little") + b"{ not json" + b" " * 30)
    with pytest.raises(WeightsError, match="header is not valid JSON"):
        load_hf(empty, progress=False)


def test_harmless_extras_are_accepted(tiny_hf_checkpoint, tmp_path):
    """An LM head equal to the tied embedding, and the RoPE buffers older transformers saved, are left out: they
    change nothing. (What is refused instead is in test_bad_input.py.)"""
    def extras(t):
        return {**t, "lm_head.weight": t["model.embed_tokens.weight"],
                "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(16, np.float32)}
    copy = rewrite_single_file(tiny_hf_checkpoint, tmp_path / "copy", extras)
    a, b = load_hf(tiny_hf_checkpoint, progress=False), load_hf(copy, progress=False)
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name])


def test_untied_lm_head_is_read(tiny_hf_checkpoint, tmp_path):
    import json

    copy = rewrite_single_file(tiny_hf_checkpoint, tmp_path / "copy",
                               lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"][::-1].copy()})
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    w = load_hf(copy, progress=False)
    np.testing.assert_array_equal(w.tensors["lm_head.weight"], w.tensors["model.embed_tokens.weight"][::-1])


@pytest.mark.parametrize("given", ["config.json", "model.safetensors", "."])
def test_a_file_in_the_folder_means_the_folder(tiny_hf_checkpoint, given):
    """load() given a file of a checkpoint reads the checkpoint (it used to fall back to random weights)."""
    w = load(str(tiny_hf_checkpoint / given), progress=False)
    assert w.source == str(tiny_hf_checkpoint)
    ref = load_hf(tiny_hf_checkpoint, progress=False)
    np.testing.assert_array_equal(w.tensors["model.norm.weight"], ref.tensors["model.norm.weight"])


@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_check_finite_names_the_tensor_count_and_first_index(chunk):
    w = random_weights(get_config("tiny"), seed=3, progress=False)
    check_finite(w, chunk=chunk)                                # random weights are finite
    name = layer_names(1)["wu"]
    t = w.tensors[name] = w.tensors[name].copy()
    t[5, 17], t[5, 18], t[700, 1] = 0x7FC0, 0xFFC1, 0x7F80     # NaN, -NaN, +Inf as bf16 bits
    with pytest.raises(WeightsError, match=rf"^{re.escape(w.source)}: tensor {name} has 2 NaN and 1 infinite values "
                                           rf"\(first at \[5, 17\]\)$"):
        check_finite(w, chunk=chunk)
    f = {"x": np.array([[1.0, 2.0], [np.inf, np.nan]], np.float32)}
    with pytest.raises(WeightsError, match=r"^somewhere: tensor x has 1 NaN and 1 infinite values \(first at "
                                           r"\[1, 0\]\)$"):
        check_finite(dataclasses.replace(w, tensors=f), where={"x": "somewhere"}, chunk=chunk)


def test_checking_values_shows_a_bar_by_bytes(tiny_hf_checkpoint, capsys, monkeypatch):
    """The checkpoint's data is first read (memory-mapped) when its values are checked: 16 GB for llama-3.1-8b,
    seconds from disk, so load_hf shows a bar there, once it has run BAR_DELAY_S; none with progress=False."""
    from workbench.model import weights
    monkeypatch.setattr(weights, "BAR_DELAY_S", 0.0)
    w = load_hf(tiny_hf_checkpoint, progress=False)
    assert "checking values" not in capsys.readouterr().err
    load_hf(tiny_hf_checkpoint, progress=True)
    err = capsys.readouterr().err
    total = sum(t.nbytes for t in w.tensors.values())
    assert "checking values (reading weights)" in err and f"/{total / 1024 ** 2:.2f}M " in err, (total, err)


def test_check_finite_can_be_skipped(tiny_hf_checkpoint, tmp_path):
    name = layer_names(0)["wd"]
    def poison(t):
        t[name] = t[name].copy()
        t[name][1, 2] = 0x7FC0
        return t
    broken = rewrite_single_file(tiny_hf_checkpoint, tmp_path / "broken", poison)
    with pytest.raises(WeightsError, match=rf"tensor {name} has 1 NaN value \(first at \[1, 2\]\)"):
        load_hf(broken, progress=False)
    assert np.isnan(to_f32(load_hf(broken, progress=False, check_values=False).tensors[name])[1, 2])


# -- prepare / unprepare ----------------------------------------------------------------------------------------

def folded_bf16(w):
    """What the kernel should end up with, computed the obvious way: each matrix times its norm gain (along the
    input dimension), rounded to bf16 once; gains then all ones."""
    cfg, f = w.cfg, w.f32
    want = {"model.embed_tokens.weight": f("model.embed_tokens.weight"),
            "model.norm.weight": np.ones(cfg.hidden, np.float32),
            "lm_head.weight": round_bf16(f(w.lm_head_name()) * f("model.norm.weight"))}
    for i in range(cfg.n_layers):
        n = layer_names(i)
        g_attn, g_mlp = f(n["attn_norm"]), f(n["mlp_norm"])
        want.update({n["attn_norm"]: np.ones(cfg.hidden, np.float32), n["mlp_norm"]: np.ones(cfg.hidden, np.float32),
                     n["wq"]: round_bf16(f(n["wq"]) * g_attn), n["wk"]: round_bf16(f(n["wk"]) * g_attn),
                     n["wv"]: round_bf16(f(n["wv"]) * g_attn), n["wo"]: f(n["wo"]),
                     n["wg"]: round_bf16(f(n["wg"]) * g_mlp), n["wu"]: round_bf16(f(n["wu"]) * g_mlp),
                     n["wd"]: f(n["wd"])})
    return want


@pytest.mark.parametrize("source", ["hf", "random"])
def test_unprepare_inverts_prepare(tiny_hf_checkpoint, source):
    w = load_hf(tiny_hf_checkpoint, progress=False) if source == "hf" else random_weights(get_config("tiny"), 11,
                                                                                           progress=False)
    back = unprepare(prepare(w, progress=False))
    want = folded_bf16(w)
    assert back.tensors.keys() == want.keys()
    assert not back.cfg.tie_embeddings                          # the folded LM head is its own matrix
    for name, t in want.items():
        assert back.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(back.tensors[name], t, err_msg=name)


def test_prepared_layout():
    cfg = get_config("tiny")
    w = random_weights(cfg, seed=5, progress=False)
    p = prepare(w, progress=False)
    hd, half, F = cfg.head_dim, cfg.head_dim // 2, cfg.intermediate
    assert p.wqkv.shape == (cfg.n_layers, cfg.qkv_rows, cfg.hidden) and p.wqkv.dtype == np.uint16
    assert p.wgu.shape == (cfg.n_layers, 2 * F, cfg.hidden)
    assert p.rope_cos.shape == (cfg.max_seq, half)
    want = folded_bf16(w)
    for l in range(cfg.n_layers):
        n = layer_names(l)
        qkv = to_f32(p.wqkv[l])
        blocks = [(want[n["wq"]], cfg.n_heads, 0), (want[n["wk"]], cfg.n_kv_heads, cfg.q_dim)]
        for weight, heads, base in blocks:
            for h in range(heads):
                for i in range(half):                           # pair i of head h: rows i and i + hd/2, adjacent
                    np.testing.assert_array_equal(qkv[base + h * hd + 2 * i], weight[h * hd + i])
                    np.testing.assert_array_equal(qkv[base + h * hd + 2 * i + 1], weight[h * hd + i + half])
        np.testing.assert_array_equal(qkv[cfg.q_dim + cfg.kv_dim:], want[n["wv"]])      # v rows keep their order
        gu = to_f32(p.wgu[l])
        np.testing.assert_array_equal(gu[0::2], want[n["wg"]])                          # gate row j, then up row j
        np.testing.assert_array_equal(gu[1::2], want[n["wu"]])


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b"])
def test_rope_tables_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = get_config(name)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**cfg.to_hf_dict()))
    positions = torch.arange(4097)[None]
    cos_hf, sin_hf = (t[0].numpy() for t in rotary(torch.ones(1, dtype=torch.float32), positions))
    half = cfg.head_dim // 2
    # HF returns cat(freqs, freqs): both halves are the same angles
    np.testing.assert_array_equal(cos_hf[:, :half], cos_hf[:, half:])
    cos, sin = rope_tables(cfg)
    assert cos.dtype == np.float32 and cos.shape == (cfg.max_seq, half)
    # both evaluate cos/sin of the same fp32 angles (inv_freq reproduced bit for bit); only the fp32 cos/sin
    # implementations differ, by an ulp or so. An ulp off in inv_freq would show as ~1e-4 at position 4096.
    np.testing.assert_allclose(cos[:4097], cos_hf[:, :half], rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin[:4097], sin_hf[:, :half], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"])
def test_rope_inv_freq_is_bit_exact(name):
    """Every preset's inverse frequencies equal transformers' bit for bit (see rope_inv_freq for why it matters)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = get_config(name)
    np.testing.assert_array_equal(rope_inv_freq(cfg), LlamaRotaryEmbedding(LlamaConfig(**cfg.to_hf_dict())).inv_freq)

"""Bad model configs and checkpoints: each gives one clear error naming the field, tensor or file, and nothing is
accepted silently. Real config.json files and safetensors written into tmp_path (by transformers' save_pretrained
where it fits, by hand where a file must be wrong in one precise way); transformers' own config classes are read at
test time for what a left-out key means.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from workbench import abi, plan, schedule
from workbench.errors import ConfigError, WeightsError
from workbench.model import safetensors_io
from workbench.model.config import (INDEX_MAX, INT32_MAX, MAX_GRID_WARPS, MAX_LAYERS, PRESETS, ModelConfig,
                                    get_config, tap_record_floats)
from workbench.model.weights import layer_names, load_hf, load_prepared, random_weights, to_bf16

REPO = Path(__file__).resolve().parent.parent
TINY = get_config("tiny")
L0 = layer_names(0)


# -- helpers -------------------------------------------------------------------------------------------------------

def write_config(folder: Path, d) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(d if isinstance(d, str) else json.dumps(d))
    return path


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights at the tiny preset's shapes, as float32."""
    w = random_weights(TINY, seed, progress=False)
    return {k: safetensors_io.bf16_to_f32(v) for k, v in w.tensors.items()}


def write_checkpoint(folder: Path, tensors: dict, config: dict | None = None) -> Path:
    """config.json and one model.safetensors; uint16 arrays are written as BF16 bits."""
    write_config(folder, config or TINY.to_hf_dict())
    safetensors_io.write(folder / "model.safetensors", tensors,
                         bf16={k for k, v in tensors.items() if v.dtype == np.uint16})
    return folder


@contextmanager
def no_runtime_warnings():
    """A numpy RuntimeWarning becomes an exception here, so a test that expects one error sees it instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def within(seconds: float, fn):
    """fn() in a thread that must finish in time: a loader that opened a FIFO would wait for a writer forever."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:           # handed back to the test below
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked: something was opened that is not a regular file"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def cli(*argv) -> tuple[int, str]:
    """`python -m workbench ...` in a process of its own: its exit code and stderr."""
    r = subprocess.run([sys.executable, "-m", "workbench", *map(str, argv)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    return r.returncode, r.stderr


def assert_one_error_line(rc: int, err: str, *words: str):
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Warning" not in err, err
    for w in words:
        assert w in err, (w, err)


def config_error(d: dict, max_seq=None) -> str:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict(d, max_seq=max_seq)
    return str(e.value)


@pytest.fixture(scope="module")
def tiny_config(tiny_hf_checkpoint) -> dict:
    """config.json of the tiny Llama as transformers' save_pretrained wrote it."""
    return json.loads((tiny_hf_checkpoint / "config.json").read_text())


# -- 1. partial_rotary_factor --------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, field, shown", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor", "0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor", "0.25"),
    ({"partial_rotary_factor": "0.5"}, "partial_rotary_factor", '"0.5"'),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor", "1.5"),
])
def test_partial_rotary_factor_other_than_one_is_refused(tmp_path, tiny_config, change, field, shown):
    path = write_config(tmp_path / "m", {**tiny_config, **change})
    with pytest.raises(ConfigError) as e:
        get_config(tmp_path / "m")
    assert str(e.value) == (f"{path}: {field} {shown} is not implemented: the kernel's RoPE rotates the whole head "
                            "(only 1.0 is)")


def test_partial_rotary_factor_one_is_accepted(tmp_path, tiny_config):
    for change in ({"partial_rotary_factor": 1.0}, {"partial_rotary_factor": 1},
                   {"rope_parameters": {**tiny_config["rope_parameters"], "partial_rotary_factor": 1.0}}):
        write_config(tmp_path / "m", {**tiny_config, **change})
        assert get_config(tmp_path / "m").with_(name="tiny") == TINY


# -- 2. sliding windows, per family as transformers applies them -------------------------------------------------

def mistral(tiny_config, **change) -> dict:
    d = {k: v for k, v in tiny_config.items() if k not in ("attention_bias", "mlp_bias")}
    return {**d, "model_type": "mistral", "architectures": ["MistralForCausalLM"], **change}


def test_mistral_applies_its_window_whatever_use_sliding_window_says(tiny_config):
    from transformers import MistralConfig

    # transformers keeps Mistral's window with use_sliding_window false: MistralConfig has no such field
    assert MistralConfig(sliding_window=1024, use_sliding_window=False).sliding_window == 1024
    d = mistral(tiny_config, sliding_window=1024, use_sliding_window=False)
    assert config_error(d, max_seq=2048) == ("config.json: sliding_window 1024 is not implemented: max_seq 2048 must "
                                             "be <= 1024")
    assert ModelConfig.from_hf_dict(d).max_seq == 1024          # the default context stops where the window starts


def test_a_window_that_cannot_bind_is_accepted(tiny_config):
    """A window as long as the KV cache never leaves a position out: the kernel's full attention is the same."""
    d = mistral(tiny_config, sliding_window=4352)
    assert ModelConfig.from_hf_dict(d).max_seq == 4352
    assert ModelConfig.from_hf_dict(mistral(tiny_config, sliding_window=2048), max_seq=2048).max_seq == 2048
    assert ModelConfig.from_hf_dict(mistral(tiny_config, sliding_window=None), max_seq=4352).max_seq == 4352


def test_mistral_without_a_window_key_has_transformers_default(tiny_config):
    from transformers import MistralConfig

    default = MistralConfig().sliding_window
    d = mistral(tiny_config, max_position_embeddings=2 * default)
    assert ModelConfig.from_hf_dict(d).max_seq == default
    assert f"sliding_window {default} is not implemented" in config_error(d, max_seq=default + 1)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("use, window_layers", [(False, 0), (True, 0), (True, 1), (True, 2), (True, 28)])
def test_qwen_windows_follow_transformers_layer_types(tiny_config, family, use, window_layers):
    """Qwen2/Qwen3 apply sliding_window only with use_sliding_window, and only to the layers from max_window_layers
    on: whether the kernel refuses a context past the window follows the layer types transformers derives."""
    from transformers import AutoConfig

    d = {k: v for k, v in tiny_config.items() if k not in ("mlp_bias",)}
    d.update(model_type=family, sliding_window=64, use_sliding_window=use, max_window_layers=window_layers)
    hf = AutoConfig.for_model(family, **{k: v for k, v in d.items() if k != "model_type"})
    binds = "sliding_attention" in hf.layer_types
    if binds:
        assert config_error(d, max_seq=128) == "config.json: sliding_window 64 is not implemented: max_seq 128 must " \
                                               "be <= 64"
    else:
        assert ModelConfig.from_hf_dict(d, max_seq=128).max_seq == 128
    assert ModelConfig.from_hf_dict(d, max_seq=64).max_seq == 64


def test_llama_has_no_window(tiny_config):
    """LlamaModel has no sliding window: a sliding_window key in a Llama config changes nothing in transformers."""
    d = {**tiny_config, "sliding_window": 16, "use_sliding_window": True}
    assert ModelConfig.from_hf_dict(d, max_seq=4352).max_seq == 4352


def test_sliding_layer_types_without_use_sliding_window_are_refused(tiny_config):
    d = {**tiny_config, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64,
         "layer_types": ["full_attention", "sliding_attention"]}
    assert config_error(d) == ("config.json: layer_types names sliding_attention layers but use_sliding_window is "
                               "false (transformers cannot run this config either): set use_sliding_window or make "
                               "every layer full_attention")
    bad = {**d, "use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention"]}
    assert "layer_types must be a list of full_attention and sliding_attention" in config_error(bad)


# -- 3. sizes past the kernel's 32-bit indices ---------------------------------------------------------------------

def test_the_index_bounds_are_the_plans():
    """The largest grid-wide stride is abi.MAX_BLOCKS blocks of plan.MAX_WARPS warps (matvec.cuh's grid_nwarps);
    the where-word keeps layer + 1 in abi.WHERE_FIELDS' layer bits; the tap record is schedule.tap_step_floats."""
    assert MAX_GRID_WARPS == abi.MAX_BLOCKS * plan.MAX_WARPS and INDEX_MAX == INT32_MAX - MAX_GRID_WARPS
    assert MAX_LAYERS == 2 ** dict(abi.WHERE_FIELDS)["layer"] - 2
    for cfg in [*PRESETS.values(), TINY.with_(n_layers=7, intermediate=4096, vocab=50000)]:
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        assert tap_record_floats(fields) == schedule.tap_step_floats(cfg, plan.Launch(grid=abi.MAX_BLOCKS)), cfg.name


def test_vocab_at_and_past_the_index_bound(tiny_config):
    assert ModelConfig.from_hf_dict({**tiny_config, "vocab_size": INDEX_MAX}).vocab == INDEX_MAX
    assert config_error({**tiny_config, "vocab_size": 2 ** 31}) == (
        f"config.json: vocab_size (2147483648) is past the kernel's 32-bit indices: at most {INDEX_MAX} (the LM "
        "head's row index and the sampler's token index are int)")


def test_hidden_2_to_the_40_is_one_line_from_build(tmp_path, tiny_config):
    """Used to reach the compiler, which only warned about the truncated constant."""
    path = write_config(tmp_path / "m", {**tiny_config, "hidden_size": 2 ** 40})
    rc, err = cli("build", "--model", tmp_path / "m")
    assert_one_error_line(rc, err, str(path), "hidden_size (1099511627776)", f"at most {INDEX_MAX}")


@pytest.mark.parametrize("change, words", [
    ({"intermediate_size": 2 ** 31}, ["intermediate_size (2147483648)", "the MLP's row index is int"]),
    ({"num_attention_heads": 2 ** 23, "num_key_value_heads": 2 ** 23, "head_dim": 256},
     ["(num_attention_heads + 2 × num_key_value_heads) × head_dim = 6442450944 rows of Wqkv"]),
    ({"num_hidden_layers": MAX_LAYERS + 1}, ["num_hidden_layers (127) is past the 126 layers"]),
    ({"num_hidden_layers": 100, "intermediate_size": 2 ** 25},
     ["a step's tap record", "num_hidden_layers", "intermediate_size", f"at most {INT32_MAX}"]),
])
def test_sizes_past_the_kernels_fields(tiny_config, change, words):
    err = config_error({**tiny_config, **change})
    for w in words:
        assert w in err, (w, err)


def test_max_seq_past_the_index_bound(tiny_config):
    d = {**tiny_config, "max_position_embeddings": 2 ** 32}
    assert ModelConfig.from_hf_dict(d, max_seq=INDEX_MAX).max_seq == INDEX_MAX
    assert f"max_seq ({2 ** 31}) is past the kernel's 32-bit indices: at most {INDEX_MAX} (attention's position " \
           "index is int)" in config_error(d, max_seq=2 ** 31)
    with pytest.raises(ConfigError, match=r"n_layers \(200\) is past the 126 layers"):
        TINY.with_(n_layers=200)


# -- 4. values: past bf16 on conversion or folding, NaN/Inf already in the checkpoint ------------------------------

def test_f32_weight_that_rounds_past_bf16_is_refused(tmp_path):
    t = tiny_tensors()
    t[L0["wo"]][3, 5] = np.float32(3.3999e38)                    # finite in F32, above bf16's largest 3.3895e38
    folder = write_checkpoint(tmp_path / "ckpt", t)
    with no_runtime_warnings(), pytest.raises(WeightsError) as e:
        load_prepared(str(folder), progress=False)
    assert str(e.value) == (
        f"{folder / 'model.safetensors'}: tensor {L0['wo']} holds 3.3999e+38 at [3, 5], which rounds past bf16's "
        "largest finite value (±3.3895314e+38): the kernel's bf16 copy would be infinite; the checkpoint's values are "
        "out of range for bf16 weights: fix or rescale that tensor")


@pytest.mark.parametrize("matrix, gain", [("wq", "attn_norm"), ("wu", "mlp_norm")])
def test_weight_that_overflows_once_its_norm_gain_is_folded_in(tmp_path, matrix, gain):
    t = {k: to_bf16(v) for k, v in tiny_tensors().items()}        # a bf16 checkpoint, as HF stores them
    t[L0[matrix]][7, 9] = to_bf16(np.array([3e38], np.float32))[0]
    t[L0[gain]][9] = to_bf16(np.array([2.0], np.float32))[0]
    folder = write_checkpoint(tmp_path / "ckpt", t)
    with no_runtime_warnings(), pytest.raises(WeightsError) as e:
        load_prepared(str(folder), progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{folder / 'model.safetensors'}: tensor {L0[matrix]} holds 3.0040553e+38 at [7, 9], and its "
                          f"norm gain {L0[gain]} holds 2.0 at [9]: folded into the weight for the kernel, their "
                          "product (inf) is past bf16's largest finite value"), msg


def test_final_norm_gain_folded_into_the_lm_head(tmp_path):
    t = tiny_tensors()
    t["model.embed_tokens.weight"][11, 4] = np.float32(2e38)       # tied: the LM head is the embedding
    t["model.norm.weight"][4] = np.float32(1.6995)                 # 3.399e38: finite in F32, past bf16
    folder = write_checkpoint(tmp_path / "ckpt", t)
    with no_runtime_warnings(), pytest.raises(WeightsError) as e:
        load_prepared(str(folder), progress=False)
    assert "tensor model.embed_tokens.weight holds 2e+38 at [11, 4], and its norm gain model.norm.weight holds " \
           "1.6995 at [4]: folded into the weight for the kernel, their product (3.3989998e+38) is past" in str(e.value)


def test_f64_value_past_float32_is_named_not_called_infinite(tmp_path):
    """It used to become inf with a RuntimeWarning on stderr, then be reported as 'an infinite value' the file does
    not hold."""
    t = tiny_tensors()
    t[L0["wg"]] = t[L0["wg"]].astype(np.float64)
    t[L0["wg"]][1, 2] = 1e300
    folder = write_checkpoint(tmp_path / "ckpt", t)
    with no_runtime_warnings(), pytest.raises(WeightsError) as e:
        load_hf(folder, progress=False)
    assert str(e.value) == (f"{folder / 'model.safetensors'}: tensor {L0['wg']} (F64) holds 1e+300 at [1, 2], past "
                            "float32's range (±3.4028235e+38); the kernel's weights are bf16: store the checkpoint as "
                            "bf16, fp16 or fp32")


@pytest.mark.parametrize("dtype, value, what", [
    (np.float16, np.inf, "1 infinite value"), (np.float32, np.nan, "1 NaN value"),
    (np.float64, -np.inf, "1 infinite value"), ("bf16", np.nan, "1 NaN value"),
])
def test_nan_and_inf_stored_in_the_checkpoint_are_refused_in_every_dtype(tmp_path, dtype, value, what):
    t = tiny_tensors()
    name = L0["wv"]
    t[name][2, 8] = value
    t[name] = to_bf16(t[name]) if dtype == "bf16" else t[name].astype(dtype)
    folder = write_checkpoint(tmp_path / "ckpt", t)
    with no_runtime_warnings(), pytest.raises(WeightsError) as e:
        load_prepared(str(folder), progress=False)
    assert str(e.value) == f"{folder / 'model.safetensors'}: tensor {name} has {what} (first at [2, 8])"


def test_nan_in_a_tied_lm_head_copy_is_reported_as_the_nan(tmp_path):
    """An lm_head.weight stored next to tied embeddings is accepted when it equals them; a NaN in both used to make
    them 'differ' (NaN != NaN), naming the wrong problem."""
    t = tiny_tensors()
    t["model.embed_tokens.weight"][5, 6] = np.nan
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    folder = write_checkpoint(tmp_path / "ckpt", t)
    with pytest.raises(WeightsError, match=r"tensor model\.embed_tokens\.weight has 1 NaN value \(first at \[5, 6\]\)"):
        load_hf(folder, progress=False)


def test_weights_errors_are_one_line_from_the_cli(capfd, monkeypatch, tmp_path):
    """Through `generate` (a GPU is pretended, the weights are read on the host before any would be used): one line,
    rc 2, and nothing else on stderr, in this process or the worker's."""
    from workbench import cli as cli_module

    monkeypatch.setattr(cli_module, "gpu_problem", lambda: None)
    t = tiny_tensors()
    t[L0["wg"]] = t[L0["wg"]].astype(np.float64)
    t[L0["wg"]][1, 2] = 1e300
    folder = write_checkpoint(tmp_path / "ckpt", t)
    rc = cli_module.main(["generate", "--model", str(folder), "--prompt-ids", "1"])
    err = capfd.readouterr().err
    assert_one_error_line(rc, err, f"{folder / 'model.safetensors'}: tensor {L0['wg']} (F64) holds 1e+300")


# -- 5. an index naming a shard outside the folder -----------------------------------------------------------------

def point_entry_at(index: Path, idx: dict, target: str) -> tuple[str, str]:
    """The index's first tensor now names `target` as its shard; returns (tensor, the shard it was in)."""
    name = next(iter(idx["weight_map"]))
    old = idx["weight_map"][name]
    idx["weight_map"][name] = target
    index.write_text(json.dumps(idx))
    return name, old


def test_index_entry_climbing_out_of_the_folder(sharded_copy):
    folder, index, idx = sharded_copy
    name, old = point_entry_at(index, idx, f"../outside/{'x'}.safetensors")
    (folder.parent / "outside").mkdir()
    shutil.copy(folder / old, folder.parent / "outside" / "x.safetensors")     # there, and readable: not read
    with pytest.raises(WeightsError) as e:
        load_hf(folder, progress=False)
    assert str(e.value) == (f"{index}: weight_map entry {name} → '../outside/x.safetensors' is outside the checkpoint "
                            f"folder {folder} (it climbs out with ..); a shard must be a file in it")


def test_index_entry_with_an_absolute_path(sharded_copy):
    folder, index, idx = sharded_copy
    target = str(folder.parent / "elsewhere.safetensors")
    name, old = point_entry_at(index, idx, target)
    shutil.copy(folder / old, target)
    with pytest.raises(WeightsError) as e:
        load_hf(folder, progress=False)
    assert str(e.value) == (f"{index}: weight_map entry {name} → {target!r} is outside the checkpoint folder {folder} "
                            "(an absolute path); a shard must be a file in it")


def test_index_entry_that_is_a_link_out_of_the_folder(sharded_copy):
    folder, index, idx = sharded_copy
    shard = sorted(set(idx["weight_map"].values()))[0]
    outside = folder.parent / "real.safetensors"
    shutil.move(folder / shard, outside)
    (folder / shard).symlink_to(outside)
    with pytest.raises(WeightsError) as e:
        load_hf(folder, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{index}: weight_map entry ") and f"→ {shard!r} is outside the checkpoint folder " \
        f"{folder} (a symbolic link to {outside.resolve()}); a shard must be a file in it" in msg, msg


def test_links_inside_the_folder_and_the_hub_cache_layout_are_followed(tmp_path, tiny_hf_checkpoint_sharded):
    """A shard linked to another file of the folder, and the Hugging Face hub's cache (snapshots/<rev>/ files linking
    into blobs/), which is how every downloaded checkpoint is laid out, still load."""
    reference = load_hf(tiny_hf_checkpoint_sharded, progress=False)
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(tiny_hf_checkpoint_sharded.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    w = load_hf(snapshot, progress=False)
    assert all(np.array_equal(w.tensors[k], reference.tensors[k]) for k in reference.tensors)

    inside = tmp_path / "inside"
    shutil.copytree(tiny_hf_checkpoint_sharded, inside)
    shard = sorted(p.name for p in inside.glob("*.safetensors"))[0]
    (inside / "store").mkdir()
    shutil.move(inside / shard, inside / "store" / shard)
    (inside / shard).symlink_to(Path("store") / shard)
    w = load_hf(inside, progress=False)
    assert all(np.array_equal(w.tensors[k], reference.tensors[k]) for k in reference.tensors)


# -- 6. a shard that is not a regular file -------------------------------------------------------------------------

def test_fifo_as_the_single_file_is_named_as_such_and_never_opened(tmp_path, tiny_hf_checkpoint):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(tiny_hf_checkpoint / "config.json", folder)
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(WeightsError) as e:
        within(20, lambda: load_hf(folder, progress=False))
    assert str(e.value) == (f"{folder / 'model.safetensors'}: not a regular file (a FIFO); the weights must be a "
                            "safetensors file")
    assert "index" not in str(e.value)
    with pytest.raises(WeightsError, match="not a regular file \\(a FIFO\\); a safetensors file is expected"):
        within(20, lambda: safetensors_io.SafetensorsFile(folder / "model.safetensors"))


def test_device_file_as_the_single_file(tmp_path, tiny_hf_checkpoint):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(tiny_hf_checkpoint / "config.json", folder)
    (folder / "model.safetensors").symlink_to(os.devnull)
    with pytest.raises(WeightsError) as e:
        within(20, lambda: load_hf(folder, progress=False))
    assert str(e.value) == (f"{folder / 'model.safetensors'}: not a regular file (a character device); the weights "
                            "must be a safetensors file")


@pytest.mark.parametrize("make, kind", [(os.mkfifo, "a FIFO"), (os.mkdir, "a folder")])
def test_shard_named_by_the_index_that_is_not_a_file(sharded_copy, make, kind):
    folder, index, idx = sharded_copy
    shard = sorted(set(idx["weight_map"].values()))[1]
    (folder / shard).unlink()
    make(folder / shard)
    with pytest.raises(WeightsError) as e:
        within(20, lambda: load_hf(folder, progress=False))
    assert str(e.value) == (f"{folder / shard}: not a regular file ({kind}), named as a shard by {index}; a shard "
                            "must be a safetensors file")


def test_missing_shard_still_says_missing(sharded_copy):
    folder, _, idx = sharded_copy
    shard = sorted(set(idx["weight_map"].values()))[0]
    (folder / shard).unlink()
    with pytest.raises(WeightsError, match=f"shard {shard} named by the index is missing"):
        load_hf(folder, progress=False)


def test_config_json_that_is_a_fifo(tmp_path):
    (tmp_path / "m").mkdir()
    os.mkfifo(tmp_path / "m" / "config.json")
    rc, err = cli("plan", "--model", tmp_path / "m")
    assert_one_error_line(rc, err, f"{tmp_path / 'm' / 'config.json'}: not a regular file (a FIFO)")


# -- 7. what a left-out key means: transformers' class default of the family ----------------------------------------

HF_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def minimal(family: str) -> dict:
    """The keys with no default worth trusting; everything else left out. 32 heads of a 2,048 width: head_dim 64
    unless the class says otherwise, kv heads its default (all of 32, 8 and 32 divide 32)."""
    return dict(model_type=family, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                intermediate_size=512, vocab_size=1000)


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_max_position_embeddings_left_out_is_the_familys_default(tmp_path, family):
    import transformers

    expected = getattr(transformers, HF_CLASSES[family])().max_position_embeddings
    write_config(tmp_path / "m", minimal(family))
    assert get_config(tmp_path / "m").max_positions == expected


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_every_left_out_key_means_what_it_means_to_transformers(family):
    from transformers import AutoConfig

    d = minimal(family)
    hf = AutoConfig.for_model(family, **{k: v for k, v in d.items() if k != "model_type"})
    cfg = ModelConfig.from_hf_dict(d)
    eos = hf.eos_token_id
    assert (cfg.max_positions, cfg.rms_eps, cfg.n_kv_heads, cfg.bos_token_id, cfg.eos_token_ids,
            cfg.rope_theta, cfg.tie_embeddings) == \
        (hf.max_position_embeddings, hf.rms_norm_eps, hf.num_key_value_heads, hf.bos_token_id,
         tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
         hf.rope_parameters["rope_theta"], hf.tie_word_embeddings)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def test_without_model_type_a_default_that_depends_on_the_family_is_refused(tmp_path):
    d = {k: v for k, v in minimal("llama").items() if k != "model_type"}
    path = write_config(tmp_path / "m", {**d, "num_key_value_heads": 8})
    with pytest.raises(ConfigError) as e:
        get_config(tmp_path / "m")
    assert str(e.value) == (f"{path} lacks 'max_position_embeddings', and without model_type naming the family its "
                            "default cannot be told (transformers' defaults: llama 2048, mistral 131072, qwen2 32768, "
                            "qwen3 32768); add max_position_embeddings or model_type")
    assert "lacks 'num_key_value_heads'" in config_error({**d, "max_position_embeddings": 4096})
    # the architectures name the family as well as model_type does
    from transformers import MistralConfig
    named = ModelConfig.from_hf_dict({**d, "architectures": ["MistralForCausalLM"]})
    assert named.max_positions == MistralConfig().max_position_embeddings


def test_without_model_type_a_window_that_could_bind_is_refused():
    """Llama or Mistral (the architectures the kernel runs a config without model_type as) disagree on the window:
    the default context stays inside Mistral's, a longer one asks for the family."""
    d = {k: v for k, v in minimal("llama").items() if k != "model_type"}
    d.update(max_position_embeddings=8192, num_key_value_heads=8)
    assert ModelConfig.from_hf_dict(d).max_seq == 4096
    assert "without model_type, whether a sliding window of 4096 positions applies cannot be told" in \
        config_error(d, max_seq=8192)
    assert ModelConfig.from_hf_dict({**d, "sliding_window": None}).max_seq == 8192


def test_llama3_scaling_without_original_context_takes_max_position_embeddings():
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "rope_theta": 500000.0}
    d = {**minimal("llama"), "max_position_embeddings": 16384, "rope_parameters": dict(rope)}
    hf = LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert ModelConfig.from_hf_dict(d).rope_scaling.original_max_position_embeddings == \
        hf.rope_parameters["original_max_position_embeddings"] == 16384


def test_to_hf_dict_round_trips_unset_token_ids():
    cfg = TINY.with_(bos_token_id=None, eos_token_ids=())
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict(), name="tiny") == cfg


# -- 8. more of the same ------------------------------------------------------------------------------------------

def test_header_dtype_that_is_not_a_string(tmp_path):
    """An unhashable dtype used to escape as a TypeError traceback."""
    path = tmp_path / "model.safetensors"
    header = json.dumps({"model.norm.weight": {"dtype": ["BF16"], "shape": [264], "data_offsets": [0, 528]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(528))
    with pytest.raises(WeightsError) as e:
        safetensors_io.read_header(path)
    assert str(e.value) == f'{path}: tensor model.norm.weight has dtype ["BF16"], not a string'


def test_index_naming_a_tensor_twice(sharded_copy):
    folder, index, idx = sharded_copy
    name, shard = next(iter(idx["weight_map"].items()))
    text = index.read_text()
    index.write_text(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{shard}", ', 1))
    with pytest.raises(WeightsError) as e:
        load_hf(folder, progress=False)
    assert str(e.value) == f"{index}: key '{name}' appears twice in one object (a tensor named twice?)"


def test_index_that_is_not_an_object(sharded_copy):
    folder, index, _ = sharded_copy
    index.write_text("[1, 2]")
    with pytest.raises(WeightsError, match="weight_map must be an object of tensor names to file names"):
        load_hf(folder, progress=False)


@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config: quantised checkpoints are not implemented (bf16, fp16 or fp32 weights only)"),
    ({"rope_theta": 1e39, "rope_parameters": None},
     "rope_theta must be a positive number that float32 holds (the kernel computes in fp32), got 1e+39"),
    ({"rms_norm_eps": 1e-50}, "rms_norm_eps must be a positive number that float32 holds (the kernel computes in "
                              "fp32), got 1e-50"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters holds RoPE parameters per layer type (full_attention): not implemented (one RoPE for every "
     "layer is)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "rope_parameters type 'linear' is not implemented (llama3 and default are)"),
    ({"num_key_value_heads": False}, "num_key_value_heads must be a positive integer, got false"),
    ({"vocab_size": 1003.5}, "vocab_size must be a positive integer, got 1003.5"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
])
def test_more_bad_configs_are_one_line(tmp_path, tiny_config, change, message):
    path = write_config(tmp_path / "m", {**tiny_config, **change})
    rc, err = cli("plan", "--model", tmp_path / "m")
    assert_one_error_line(rc, err)
    assert err == f"error: {path}: {message}\n"


def test_config_json_with_a_key_twice(tmp_path, tiny_config):
    text = json.dumps(tiny_config)
    path = write_config(tmp_path / "m", text.replace("{", '{"vocab_size": 5, ', 1))
    with pytest.raises(ConfigError) as e:
        get_config(tmp_path / "m")
    assert str(e.value) == f"{path}: key 'vocab_size' appears twice in one object; keep one"


def test_rope_settings_that_give_no_finite_angle_are_refused_before_the_kernel():
    from workbench.model.weights import rope_tables

    with no_runtime_warnings(), pytest.raises(ConfigError, match="give RoPE an angle that is not finite in fp32"):
        rope_tables(TINY.with_(rope_theta=1e-40, rope_scaling=None))

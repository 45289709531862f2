"""Every user error is one line, `error: …`, naming the argument, file, key or tensor, with exit code 2 and no
traceback; found before any weight is read or any GPU touched. Each case runs `workbench.cli.main` on real files: HF
checkpoints written by transformers, config.json variants, safetensors files with hand-written headers.

Also here: the text streaming of `generate` (DecodeStream) on a byte-level BPE tokenizer trained in the test.
"""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from conftest import TEXT

from workbench import cli
from workbench.cli import main, stream_text
from workbench.model import safetensors_io
from workbench.model.weights import layer_names


def error_of(capsys, *argv) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def assert_error(capsys, argv, message):
    """main(argv) exits 2 having printed exactly `error: message` and nothing else to stderr."""
    assert error_of(capsys, *argv) == (2, f"error: {message}\n")


@pytest.fixture
def gpu_present(monkeypatch):
    """Pretend a GPU is there, so that the checks that come after the GPU's (reading the weights, which happens on
    the host) run on this machine. Only for cases that fail before anything would reach a GPU."""
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)


# -- arguments: argparse types and ranges, nothing read yet ---------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["generate", "--tokens", "-5"], "argument --tokens: must be a positive integer, got -5"),
    (["generate", "--tokens", "0"], "argument --tokens: must be a positive integer, got 0"),
    (["generate", "--tokens", "ten"], "argument --tokens: 'ten' is not an integer"),
    (["generate", "--temperature", "-0.5"], "argument --temperature: must be a number >= 0 (0 = greedy), got -0.5"),
    (["generate", "--temperature", "nan"], "argument --temperature: must be a number >= 0 (0 = greedy), got nan"),
    (["generate", "--top-p", "1.5"], "argument --top-p: must be in (0, 1] (1 = off), got 1.5"),
    (["generate", "--top-p", "0"], "argument --top-p: must be in (0, 1] (1 = off), got 0"),
    (["generate", "--top-k", "-1"], "argument --top-k: must be a non-negative integer, got -1"),
    (["generate", "--prompt-ids", "1,x"],
     "argument --prompt-ids: '1,x' is not a comma-separated list of token ids ('x' is not a non-negative integer)"),
    (["generate", "--prompt-ids", "1,,2"],
     "argument --prompt-ids: '1,,2' is not a comma-separated list of token ids ('' is not a non-negative integer)"),
    (["generate", "--prompt-ids", "1,²"],
     "argument --prompt-ids: '1,²' is not a comma-separated list of token ids ('²' is not a non-negative integer)"),
    (["generate", "--prompt-ids", "-3"],
     "argument --prompt-ids: '-3' is not a comma-separated list of token ids ('-3' is not a non-negative integer)"),
    (["generate", "--threads", "100"], "argument --threads: must be a multiple of 64 from 64 to 1024, got 100"),
    (["generate", "--threads", "32"], "argument --threads: must be a multiple of 64 from 64 to 1024, got 32"),
    (["generate", "--threads", "2048"], "argument --threads: must be a multiple of 64 from 64 to 1024, got 2048"),
    (["build", "--threads", "100"], "argument --threads: must be a multiple of 64 from 64 to 1024, got 100"),
    # a whole number of warps the builds refuse: it used to pass here, read the weights, then fail as a "bug"
    (["generate", "--threads", "96"], "argument --threads: must be a multiple of 64 from 64 to 1024, got 96"),
    (["generate", "--max-seq", "0"], "argument --max-seq: must be a positive integer, got 0"),
    (["build", "--max-seq", "0"], "argument --max-seq: must be a positive integer, got 0"),
    (["generate", "--weights-seed", "-1"],
     "argument --weights-seed: must be an integer from 0 to 2**64 - 1 (a 64-bit seed), got -1"),
    (["verify", "--prompt-len", "0"], "argument --prompt-len: must be a positive integer, got 0"),
    (["verify", "--rtol", "-1"], "argument --rtol: must be a positive number, got -1"),
    (["verify", "--seeds", "1", "-2"],
     "argument --seeds: must be an integer from 0 to 2**64 - 1 (a 64-bit seed), got -2"),
    (["verify", "--draws", "0"], "argument --draws: must be a positive integer, got 0"),
    (["bench", "--repeats", "0"], "argument --repeats: must be a positive integer, got 0"),
    (["bench", "--tokens", "-1"], "argument --tokens: must be a positive integer, got -1"),
    (["generate", "--prompt", "a", "--prompt-ids", "1"], "argument --prompt-ids: not allowed with argument --prompt"),
    (["build", "--target", "rocm"], "argument --target: invalid choice: 'rocm' (choose from 'cuda', 'hip')"),
    (["build", "--variant", "embedding"], "argument --variant: 'embedding' is not SECTION=VARIANT (e.g. embedding=ptx)"),
    (["build", "--variant", "matvec=ptx"],
     "argument --variant: matvec is not a stage: only a stage's function can be written in PTX"),
    (["build", "--variant", "embedding=nope"], "--variant embedding=nope: kernels/sections/embedding@nope.cuh does not exist"),
    (["frobnicate"],
     "argument command: invalid choice: 'frobnicate' (choose from 'generate', 'verify', 'build', 'sanitize', 'plan', 'bench', 'simulate', "
     "'trace', 'nbclean')"),
    ([], "the following arguments are required: command (see python -m workbench --help)"),
    (["generate", "--bogus"], "unrecognized arguments: --bogus (see python -m workbench --help)"),
])
def test_bad_arguments(capsys, argv, message):
    assert_error(capsys, argv, message)


# -- arguments against the model's config: read the config, nothing else ------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "tiny", "--max-seq", "3000000000"],
     "--max-seq 3000000000 is larger than max_position_embeddings (131072) of preset tiny"),
    (["build", "--model", "tiny", "--max-seq", "3000000000"],          # would compile, with a 3e9-position cache
     "--max-seq 3000000000 is larger than max_position_embeddings (131072) of preset tiny"),
    (["build", "--all-presets", "--max-seq", "200000"],
     "--max-seq 200000 is larger than max_position_embeddings (131072) of preset llama-3.2-1b"),
    (["generate", "--model", "tiny", "--prompt-ids", "1,1003"],
     "--prompt-ids: token id 1003 is outside the vocabulary of tiny (vocab_size 1003: ids 0 to 1002)"),
    (["generate", "--prompt-ids", "128256"],
     "--prompt-ids: token id 128256 is outside the vocabulary of llama-3.2-1b (vocab_size 128256: ids 0 to 128255)"),
    (["generate", "--model", "tiny", "--top-k", "5000"],
     "--top-k 5000 is larger than the vocabulary of tiny (1003); 0 turns top-k off"),
    (["generate", "--model", "tiny", "--tokens", "5000"],
     "a 1-token prompt and --tokens 5000 need 5000 positions, but the KV cache of tiny holds 4352 (--max-seq)"),
    (["generate", "--model", "tiny", "--max-seq", "16", "--prompt-ids", "1,2,3", "--tokens", "15"],
     "a 3-token prompt and --tokens 15 need 17 positions, but the KV cache of tiny holds 16 (--max-seq)"),
    (["verify", "--model", "tiny", "--prompt-len", "4000", "--tokens", "400"],
     "--prompt-len 4000 and --tokens 400 need 4399 positions, but the KV cache of tiny holds 4352 (--max-seq)"),
    (["generate", "--model", "no-such-model"],
     "'no-such-model' is neither a preset (llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, tiny, smollm2-135m, "
     "smollm2-1.7b, llama-2-7b, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen2.5-0.5b, qwen2.5-1.5b) nor a "
     "folder with config.json"),
    (["bench", "--model", "no-such-model"],
     "'no-such-model' is neither a preset (llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, tiny, smollm2-135m, "
     "smollm2-1.7b, llama-2-7b, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen2.5-0.5b, qwen2.5-1.5b) nor a "
     "folder with config.json"),
    (["generate", "--model", "tiny", "--prompt", "hello"],
     "--prompt needs a tokenizer.json in a weights folder (these weights are random) and the tokenizers package; "
     "give --prompt-ids instead"),
    (["build", "--model", "tiny", "--dump", "sass", "--target", "hip"], "--dump sass needs --target cuda"),
    (["build", "--model", "tiny", "--dump", "amdgcn", "--target", "cuda"], "--dump amdgcn needs --target hip"),
    (["build", "--model", "tiny", "--section", "matvec"], "--section goes with --dump ptx|sass|amdgcn"),
])
def test_arguments_that_do_not_fit_the_model(capsys, argv, message):
    assert_error(capsys, argv, message)


def test_weights_folder_that_is_not_there(capsys, tmp_path):
    assert_error(capsys, ["generate", "--model", "tiny", "--weights", tmp_path / "nothing"],
                 f"--weights {tmp_path / 'nothing'}: no such file or folder")


# -- no GPU: the real machine, no monkeypatching -------------------------------------------------------------------

def cuda_failure() -> str | None:
    """CUDA's own account of why there is no GPU here (None where there is one)."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return str(e)
    return None if n else "CuPy sees 0 devices"


@pytest.mark.parametrize("argv", [["generate", "--model", "tiny"], ["verify", "--model", "tiny"],
                                  ["bench", "--model", "tiny", "--no-torch"],
                                  ["generate"]])             # the 1B default: would be 2.5 GB of weights to make
def test_no_gpu_is_one_line_saying_what_runs_without_one(capsys, argv):
    why = cuda_failure()
    if why is None:
        pytest.skip("a GPU is visible here")
    rc, err = error_of(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: `{argv[0]}` needs an NVIDIA GPU, "), err
    for runs in ("`python -m workbench plan`", "`python -m workbench build`", "the notebooks", "`python -m pytest -q`"):
        assert runs in err, err


def test_arguments_are_checked_before_the_gpu(capsys):
    """A bad argument is reported as itself, on a machine with a GPU or without."""
    assert_error(capsys, ["generate", "--model", "tiny", "--prompt-ids", "5000"],
                 "--prompt-ids: token id 5000 is outside the vocabulary of tiny (vocab_size 1003: ids 0 to 1002)")


# -- config.json ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_config(tiny_hf_checkpoint) -> dict:
    return json.loads((tiny_hf_checkpoint / "config.json").read_text())


def config_folder(tmp_path, content) -> tuple:
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return folder, path


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "factor"}}, "{path} lacks 'rope_scaling.factor'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, "{path} lacks 'rope_parameters.factor'"),
    ({"rope_scaling": {**LLAMA3, "factor": "4"}}, '{path}: rope_scaling.factor must be a positive number, got "4"'),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}},
     "{path}: rope_scaling.high_freq_factor (4.0) must be larger than rope_scaling.low_freq_factor (4.0)"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0.5}},
     "{path}: rope_scaling.original_max_position_embeddings must be a positive integer, got 0.5"),
    ({"rope_scaling": "llama3"}, '{path}: rope_scaling must be an object, got "llama3"'),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "{path}: rope_scaling type 'yarn' is not implemented (llama3 and default are)"),
    ({"rms_norm_eps": "abc"}, '{path}: rms_norm_eps must be a positive number, got "abc"'),
    ({"rms_norm_eps": -1e-5}, "{path}: rms_norm_eps must be a positive number, got -1e-05"),
    ({"max_position_embeddings": None}, "{path}: max_position_embeddings must be a positive integer, got null"),
    ({"hidden_size": None}, "{path} lacks 'hidden_size'"),
    ({"hidden_size": "264"}, '{path}: hidden_size must be a positive integer, got "264"'),
    ({"hidden_size": 264.0}, "{path}: hidden_size must be a positive integer, got 264.0"),
    ({"num_hidden_layers": 0}, "{path}: num_hidden_layers must be a positive integer, got 0"),
    ({"num_attention_heads": True}, "{path}: num_attention_heads must be a positive integer, got true"),
    ({"vocab_size": -1003}, "{path}: vocab_size must be a positive integer, got -1003"),
    ({"num_key_value_heads": 4}, "{path}: num_attention_heads (6) must be a multiple of num_key_value_heads (4)"),
    ({"head_dim": 40}, "{path}: head_dim (40) must be a multiple of 16 (8 bf16 per lane, rope pairs)"),
    ({"head_dim": None, "hidden_size": 260}, "{path}: hidden_size (260) is not a multiple of num_attention_heads "
                                             "(6) and there is no head_dim to say what a head is"),
    ({"intermediate_size": 710}, "{path}: intermediate_size (710) must be a multiple of 8 (16-byte weight loads)"),
    ({"tie_word_embeddings": "yes"}, '{path}: tie_word_embeddings must be true or false, got "yes"'),
    ({"rope_parameters": {**LLAMA3, "rope_theta": -1}}, "{path}: rope_parameters.rope_theta must be a positive "
                                                        "number, got -1"),
    ({"rope_theta": "1e4"}, '{path}: rope_theta must be a positive number, got "1e4"'),
    ({"eos_token_id": [2, "x"]}, '{path}: eos_token_id must be a token id or a list of token ids, got [2, "x"]'),
    ({"bos_token_id": 5000}, "{path}: bos_token_id 5000 is outside the vocabulary (vocab_size 1003)"),
    ({"model_type": "gpt2"}, "{path}: model_type 'gpt2' is not a Llama-family decoder this kernel implements"),
    ({"model_type": 7}, "{path}: model_type must be a string, got 7"),
    ({"hidden_act": "gelu"}, "{path}: hidden_act 'gelu': only silu is implemented"),
    ({"attention_bias": True}, "{path}: attention/MLP biases are not implemented (the q/k/v biases of qwen2 are)"),
])
def test_bad_config_json(capsys, tmp_path, tiny_config, change, message):
    d = {k: v for k, v in {**tiny_config, **change}.items() if not (v is None and k in ("hidden_size", "head_dim"))}
    folder, path = config_folder(tmp_path, d)
    assert_error(capsys, ["generate", "--model", folder], message.format(path=path))


@pytest.mark.parametrize("content, message", [
    ("[1, 2, 3]", "{path} must hold a JSON object (a Hugging Face model config), not an array"),
    ('"llama"', "{path} must hold a JSON object (a Hugging Face model config), not a string"),
    ("{not json", "{path} is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
                  "(char 1)"),
])
def test_config_json_that_is_not_a_config(capsys, tmp_path, content, message):
    folder, path = config_folder(tmp_path, content)
    assert_error(capsys, ["build", "--model", folder], message.format(path=path))


def test_folder_without_config_json(capsys, tmp_path):
    assert_error(capsys, ["build", "--model", tmp_path], f"no config.json at {tmp_path / 'config.json'}")


def test_max_seq_past_a_sliding_window(capsys, tmp_path, tiny_config):
    folder, path = config_folder(tmp_path, {**tiny_config, "model_type": "mistral", "sliding_window": 1024})
    assert_error(capsys, ["build", "--model", folder, "--max-seq", "2048"],
                 f"{path}: sliding_window 1024 is not implemented: max_seq 2048 must be <= 1024")


def test_max_seq_past_the_folders_max_position_embeddings(capsys, tiny_hf_checkpoint):
    assert_error(capsys, ["build", "--model", tiny_hf_checkpoint, "--max-seq", "8192"],
                 f"--max-seq 8192 is larger than max_position_embeddings (4352) of "
                 f"{tiny_hf_checkpoint / 'config.json'}")


# -- checkpoints: names, shapes, dtypes and values of the tensors --------------------------------------------------

def rewrite(src, dst, edit):
    """A copy of a single-file checkpoint with its tensors passed through edit(dict) → dict."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    st = safetensors_io.SafetensorsFile(src / "model.safetensors")
    tensors = {k: np.array(st.get(k)) for k in st.keys()}
    out = edit(tensors)
    # bf16 stays uint16 bits in numpy: every uint16 array is written as BF16
    safetensors_io.write(dst / "model.safetensors", out, bf16={k for k, v in out.items() if v.dtype == np.uint16})
    return dst


L0, L1 = layer_names(0), layer_names(1)
EMBED = "model.embed_tokens.weight"
NAN_BF16, INF_BF16 = np.uint16(0x7FC1), np.uint16(0xFF80)         # a NaN, and -Inf


def with_bad_values(t, name, bits, at):
    t = dict(t)
    t[name] = t[name].copy()
    for i in at:
        t[name][i] = bits
    return t


def fused_qkv(t):
    t = dict(t)
    t["model.layers.0.self_attn.qkv_proj.weight"] = np.concatenate([t.pop(L0[k]) for k in ("wq", "wk", "wv")])
    return t


@pytest.mark.parametrize("edit, message", [
    (lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(192, np.uint16)},
     "{file}: tensor model.layers.0.self_attn.q_proj.bias is not used by the kernel: biases are not implemented for this model_type "
     "(qwen2's q/k/v biases are)"),
    (lambda t: {**t, "model.layers.1.self_attn.q_norm.weight": np.ones(32, np.float32),
                "model.layers.1.self_attn.k_norm.weight": np.ones(32, np.float32)},
     "{file}: tensor model.layers.1.self_attn.q_norm.weight is not used by the kernel: per-head q/k norms "
     "are Qwen3's (model_type qwen3), not this config's (and 1 more tensor the kernel does not read)"),
    (lambda t: {**t, "model.layers.0.mlp.down_proj.weight_scale": np.ones(1, np.float32)},
     "{file}: tensor model.layers.0.mlp.down_proj.weight_scale is not used by the kernel: quantised weights are "
     "not implemented (bf16, fp16 or fp32 weights only)"),
    (lambda t: {**t, "model.layers.0.mlp.up_proj.qweight": np.ones((8, 8), np.int32)},
     "{file}: tensor model.layers.0.mlp.up_proj.qweight is not used by the kernel: quantised weights are not "
     "implemented (bf16, fp16 or fp32 weights only)"),
    (fused_qkv,
     "{file}: tensor model.layers.0.self_attn.qkv_proj.weight is not used by the kernel: fused projections are not "
     "implemented (the kernel reads q_proj, k_proj, v_proj, gate_proj and up_proj)"),
    (lambda t: {**t, "model.layers.2.mlp.up_proj.weight": t[L1["wu"]]},
     "{file}: tensor model.layers.2.mlp.up_proj.weight is not used by the kernel: the config has 2 layers "
     "(num_hidden_layers)"),
    (lambda t: {**t, "lm_head.weight": t[EMBED][::-1].copy()},
     "{file}: tensor lm_head.weight is not used by the kernel: the config ties the LM head to the embedding "
     "(tie_word_embeddings) and this one differs from it"),
    (lambda t: {**t, "vision_tower.patch_embed.weight": np.zeros(4, np.float32)},
     "{file}: tensor vision_tower.patch_embed.weight is not used by the kernel: it is not part of a Llama model "
     "with this config"),
    (lambda t: {k: v for k, v in t.items() if k != L1["wv"]}, "{folder}: missing tensors " + L1["wv"]),
    (lambda t: {**t, L0["wg"]: t[L0["wg"]][:-8]},
     "{file}: tensor " + L0["wg"] + " has shape (704, 264), config says (712, 264)"),
    (lambda t: {**t, L0["attn_norm"]: np.ones(264, np.int32)},
     "{file}: tensor " + L0["attn_norm"] + " has dtype I32; weights must be BF16, F16, F32 or F64"),
    (lambda t: with_bad_values(t, L1["wu"], NAN_BF16, [(5, 17), (6, 0), (700, 263)]),
     "{file}: tensor " + L1["wu"] + " has 3 NaN values (first at [5, 17])"),
    (lambda t: with_bad_values(t, L0["mlp_norm"], INF_BF16, [100]),
     "{file}: tensor " + L0["mlp_norm"] + " has 1 infinite value (first at [100])"),
    (lambda t: with_bad_values({**t, "model.norm.weight": safetensors_io.bf16_to_f32(t["model.norm.weight"])},
                               "model.norm.weight", np.float32("nan"), [3, 9]),           # stored as F32
     "{file}: tensor model.norm.weight has 2 NaN values (first at [3])"),
])
def test_bad_checkpoint(capsys, tmp_path, tiny_hf_checkpoint, gpu_present, edit, message):
    folder = rewrite(tiny_hf_checkpoint, tmp_path / "ckpt", edit)
    expected = message.format(file=folder / "model.safetensors", folder=folder)
    assert_error(capsys, ["generate", "--model", folder, "--prompt-ids", "1"], expected)


@pytest.mark.parametrize("given", ["config.json", "model.safetensors"])
def test_a_file_as_model_means_its_folder(capsys, tmp_path, tiny_hf_checkpoint, gpu_present, given):
    """--model folder/config.json reads that folder's weights (it used to run random ones, silently): a bias in
    them is found."""
    folder = rewrite(tiny_hf_checkpoint, tmp_path / "ckpt",
                     lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(192, np.uint16)})
    assert_error(capsys, ["generate", "--model", folder / given],
                 f"{folder / 'model.safetensors'}: tensor model.layers.0.self_attn.q_proj.bias is not used by the "
                 "kernel: biases are not implemented for this model_type (qwen2's q/k/v biases are)")


def test_weights_given_as_a_file(capsys, tmp_path, tiny_hf_checkpoint, gpu_present):
    folder = rewrite(tiny_hf_checkpoint, tmp_path / "ckpt",
                     lambda t: with_bad_values(t, L1["wu"], NAN_BF16, [(5, 17)]))
    assert_error(capsys, ["generate", "--model", "tiny", "--weights", folder / "model.safetensors"],
                 f"{folder / 'model.safetensors'}: tensor {L1['wu']} has 1 NaN value (first at [5, 17])")


def test_folder_with_config_and_no_weights(capsys, tmp_path, tiny_hf_checkpoint, gpu_present):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(tiny_hf_checkpoint / "config.json", folder / "config.json")
    assert_error(capsys, ["generate", "--model", folder],
                 f"{folder}: neither model.safetensors nor model.safetensors.index.json is there")


def test_weights_of_another_model(capsys, tiny_hf_checkpoint, gpu_present):
    assert_error(capsys, ["generate", "--model", "llama-3.2-1b", "--weights", tiny_hf_checkpoint],
                 f"{tiny_hf_checkpoint}: missing tensors model.layers.2.input_layernorm.weight, "
                 "model.layers.2.self_attn.q_proj.weight, model.layers.2.self_attn.k_proj.weight (and 123 more)")


# -- sharded checkpoints -------------------------------------------------------------------------------------------

def test_missing_shard(capsys, sharded_copy, gpu_present):
    folder, _, idx = sharded_copy
    shard = sorted(set(idx["weight_map"].values()))[1]
    (folder / shard).unlink()
    assert_error(capsys, ["generate", "--model", folder], f"{folder}: shard {shard} named by the index is missing")


def test_index_names_a_tensor_its_shard_lacks(capsys, sharded_copy, gpu_present):
    folder, index, idx = sharded_copy
    shards = sorted(set(idx["weight_map"].values()))
    name = next(k for k, v in idx["weight_map"].items() if v == shards[0])
    idx["weight_map"][name] = shards[1]
    index.write_text(json.dumps(idx))
    assert_error(capsys, ["generate", "--model", folder],
                 f"{index}: names tensor {name} in {shards[1]}, which does not hold it")


def test_tensor_in_two_shards(capsys, sharded_copy, gpu_present):
    folder, _, idx = sharded_copy
    shards = sorted(set(idx["weight_map"].values()))
    first = safetensors_io.SafetensorsFile(folder / shards[0])
    name = next(iter(first.keys()))
    second = safetensors_io.SafetensorsFile(folder / shards[1])
    tensors = {k: np.array(second.get(k)) for k in second.keys()} | {name: np.array(first.get(name))}
    safetensors_io.write(folder / shards[1], tensors, bf16=set(tensors))
    assert_error(capsys, ["generate", "--model", folder],
                 f"{folder}: tensor {name} is in both {folder / shards[0]} and {folder / shards[1]}")


def test_index_that_is_not_json(capsys, sharded_copy, gpu_present):
    folder, index, _ = sharded_copy
    index.write_text('{"weight_map": ')
    assert_error(capsys, ["generate", "--model", folder], f"{index}: not a readable safetensors index (Expecting "
                                                          "value: line 1 column 16 (char 15))")


# -- safetensors headers written by hand ---------------------------------------------------------------------------

def raw_file(path, header, data: bytes = b"", length: int | None = None):
    """A safetensors file with exactly this header (a dict, or raw bytes) and data."""
    hj = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hj) if length is None else length) + hj + data)
    return path


def norm(offsets, dtype="BF16", shape=(264,)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data, message", [
    ({"model.norm.weight": norm([-528, 0])}, bytes(528),
     "tensor model.norm.weight has data_offsets [-528, 0]: they must be non-negative and in order"),
    ({"model.norm.weight": norm([528, 0])}, bytes(528),
     "tensor model.norm.weight has data_offsets [528, 0]: they must be non-negative and in order"),
    ({"model.layers.0.input_layernorm.weight": norm([0, 528]), "model.norm.weight": norm([264, 792])}, bytes(792),
     "tensors model.layers.0.input_layernorm.weight and model.norm.weight overlap (data_offsets [0, 528] and "
     "[264, 792])"),
    ({"model.norm.weight": norm([0, 528])}, bytes(100),
     "tensor model.norm.weight is truncated: its data_offsets end at byte 528 but the file holds 100 bytes of data"),
    ({"model.norm.weight": norm([0, 264])}, bytes(528),
     "tensor model.norm.weight has data_offsets [0, 264] (264 bytes) but BF16 [264] takes 528 bytes"),
    ({"model.norm.weight": norm([0, 264], dtype="Q4")}, bytes(528), "tensor model.norm.weight has unknown dtype 'Q4'"),
    ({"model.norm.weight": norm([0, 528], shape=(-264,))}, bytes(528),
     "tensor model.norm.weight has shape [-264], not a list of non-negative integers"),
    ({"model.norm.weight": {**norm([0, 528]), "data_offsets": [0, "528"]}}, bytes(528),
     'tensor model.norm.weight has data_offsets [0, "528"], not two integers'),
    ({"model.norm.weight": {"dtype": "BF16", "shape": [264]}}, bytes(528),
     "tensor model.norm.weight lacks dtype, shape or data_offsets in the header"),
    (b'{"model.norm.weight": {"dtype": "BF16", "shape": [264], "data_offsets": [0, 528]}, '
     b'"model.norm.weight": {"dtype": "BF16", "shape": [264], "data_offsets": [0, 528]}}', bytes(528),
     "tensor model.norm.weight appears twice in the header"),
    (b"[1, 2]", b"", "header is not a JSON object"),
    (b"{ not json", b"", "header is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
                         "column 3 (char 2))"),
    ({"__metadata__": [1], "model.norm.weight": norm([0, 528])}, bytes(528), "__metadata__ is not a JSON object"),
])
def test_corrupt_safetensors_header(capsys, tmp_path, tiny_hf_checkpoint, gpu_present, header, data, message):
    """The loader used to accept negative and overlapping offsets and read the norm gain out of the header's own
    bytes (1e31): the safetensors library refuses both files, and so does the workbench now."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(tiny_hf_checkpoint / "config.json", folder / "config.json")
    path = raw_file(folder / "model.safetensors", header, data)
    assert_error(capsys, ["generate", "--model", folder], f"{path}: {message}")


@pytest.mark.parametrize("content, message", [
    (b"\x05\x00", "too short to be a safetensors file"),
    (struct.pack("<Q", 10 ** 12) + b"{}", "header length 1000000000000 is not plausible for a file of 10 bytes; "
                                          "not a safetensors file?"),
    (struct.pack("<Q", 0), "header length 0 is not plausible for a file of 8 bytes; not a safetensors file?"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "header is not valid JSON ('utf-8' codec can't decode byte 0xff in "
                                            "position 0: invalid start byte)"),
])
def test_not_a_safetensors_file(capsys, tmp_path, tiny_hf_checkpoint, gpu_present, content, message):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(tiny_hf_checkpoint / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(content)
    assert_error(capsys, ["generate", "--model", folder], f"{folder / 'model.safetensors'}: {message}")


def test_header_reads_match_the_safetensors_library(tmp_path):
    """The two corrupt files of the report, which the safetensors library refuses: so does read_header."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    cases = {"negative": ({"a": norm([-528, 0], "F16")}, bytes(528)),
             "overlap": ({"a": norm([0, 528], "F16"), "b": norm([264, 792], "F16")}, bytes(792))}
    for name, (header, data) in cases.items():
        path = raw_file(tmp_path / f"{name}.safetensors", header, data)
        with pytest.raises((SafetensorError, ValueError, OverflowError)):
            load_file(path)
        with pytest.raises(safetensors_io.WeightsError):
            safetensors_io.read_header(path)


# -- the tokenizer -------------------------------------------------------------------------------------------------

def test_tokenizer_json_that_cannot_be_read(capsys, tmp_path, tiny_hf_checkpoint):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint, folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    rc, err = error_of(capsys, "generate", "--model", folder, "--prompt", "hello")
    assert rc == 2 and err.startswith(f"error: {folder / 'tokenizer.json'}: not a tokenizer the tokenizers package "
                                      "can read (") and err.count("\n") == 1, err


@pytest.mark.parametrize("vocab", [280, 260])
def test_a_text_prompt_goes_through_the_trained_tokenizer_before_the_gpu(capsys, tmp_path, hf_checkpoint, byte_bpe,
                                                                       vocab):
    """`generate --prompt` on a checkpoint with a tokenizer.json (a byte-level BPE trained by the fixture, 280
    tokens): everything up to the GPU runs on this machine. At the tokenizer's own vocabulary the prompt is read,
    encoded and checked, and what stops it is the missing GPU; at a vocabulary smaller than the tokenizer's, the
    prompt's encoding has ids past it, and that is what is said, naming the first."""
    fields = {**cli.get_config("tiny").to_hf_dict(), "vocab_size": vocab}
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint(**fields), folder)
    byte_bpe.save(str(folder / "tokenizer.json"))
    prompt = "naïve 😀 日本"
    ids = byte_bpe.encode(prompt).ids
    capsys.readouterr()                                 # what building the checkpoint printed
    rc, err = error_of(capsys, "generate", "--model", folder, "--prompt", prompt)
    if vocab >= byte_bpe.get_vocab_size():
        assert rc == 2 and err.startswith(f"error: `generate` {cli.NO_GPU}") and err.count("\n") == 1, err
    else:
        first = next(t for t in ids if t >= vocab)
        assert (rc, err) == (2, f"error: --prompt: token id {first} is outside the vocabulary of ckpt (vocab_size "
                                f"{vocab}: ids 0 to {vocab - 1})\n")


# -- the one error path itself -------------------------------------------------------------------------------------

def test_an_internal_error_keeps_its_traceback_and_says_it_is_a_bug(capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("an invariant broke")
    monkeypatch.setitem(cli.COMMANDS, "build", (broken, lambda args: None, False))
    rc, err = error_of(capsys, "build", "--model", "tiny")
    assert rc == 1
    assert err.startswith("Traceback (most recent call last):") and "RuntimeError: an invariant broke" in err
    assert err.splitlines()[-1] == "this is a bug in the workbench: please report it, with the traceback above and " \
                                   "the command line"


def test_user_errors_stay_value_errors():
    """Code that caught ValueError before the hierarchy existed still catches every user error."""
    from workbench.errors import ConfigError as E1, UserError, WeightsError as E2
    from workbench.model.config import ConfigError
    from workbench.model.weights import WeightsError
    assert ConfigError is E1 and WeightsError is E2 is safetensors_io.WeightsError
    assert issubclass(ConfigError, UserError) and issubclass(WeightsError, UserError)
    assert issubclass(UserError, ValueError)


# -- streaming text (DecodeStream) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["naïve 😀 日本語", TEXT[0], TEXT[1] + " " + TEXT[2]])
def test_streamed_pieces_are_the_decoded_text(byte_bpe, text):
    ids = byte_bpe.encode(text).ids
    naive = [byte_bpe.decode(ids[:i + 1])[len(byte_bpe.decode(ids[:i])):] for i in range(len(ids))]
    assert any("\ufffd" in p for p in naive)           # the old way: this tokenizer does split characters
    pieces = list(stream_text(byte_bpe, ids))
    assert "".join(pieces) == byte_bpe.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces), pieces


def test_streaming_after_a_prompt(byte_bpe):
    """Primed with the prompt, the pieces continue its text; a prompt that ends inside a character has that
    character completed by the first piece, whole."""
    text = "naïve 😀 日本語"
    ids = byte_bpe.encode(text).ids
    for cut in range(1, len(ids)):
        streamed = "".join(stream_text(byte_bpe, ids[cut:], prompt=ids[:cut]))
        prompt_text = byte_bpe.decode(ids[:cut])
        assert "\ufffd" not in streamed and text.endswith(streamed)
        if "\ufffd" not in prompt_text:
            assert prompt_text + streamed == text


def test_streaming_stopped_inside_a_character_keeps_the_bytes(byte_bpe):
    """Generation can stop between the bytes of one character: what is pending then comes out (as U+FFFD, as a
    whole decode would show it) rather than vanishing."""
    ids = byte_bpe.encode("naïve 😀").ids
    cut = next(i for i in range(len(ids), 0, -1) if byte_bpe.decode(ids[:i]).endswith("\ufffd"))
    pieces = list(stream_text(byte_bpe, ids[:cut]))
    assert "".join(pieces) == byte_bpe.decode(ids[:cut])
    assert "\ufffd" in pieces[-1] and not any("\ufffd" in p for p in pieces[:-1])


def test_prompt_text_outside_the_models_vocabulary(capsys, tmp_path, tiny_config, byte_bpe):
    """--prompt is encoded, and its ids checked against the config, before anything is loaded."""
    folder, _ = config_folder(tmp_path, {**tiny_config, "vocab_size": 8})
    byte_bpe.save(str(folder / "tokenizer.json"))
    first = next(t for t in byte_bpe.encode("naïve").ids if t >= 8)
    assert_error(capsys, ["generate", "--model", folder, "--prompt", "naïve"],
                 f"--prompt: token id {first} is outside the vocabulary of model (vocab_size 8: ids 0 to 7)")


def test_generate_streams_text(capsys, monkeypatch, tmp_path, tiny_hf_checkpoint, byte_bpe, gpu_present):
    """cmd_generate prints what stream_text makes of the kernel's tokens: the text, whole characters only. The
    weights and the kernel are stand-ins (no GPU here); the tokenizer, the prompt and the printing are real."""
    import types

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoint, folder)
    byte_bpe.save(str(folder / "tokenizer.json"))
    out_ids = byte_bpe.encode(" naïve 😀 日本語").ids
    seen = {}

    class Kernel:
        def stream_tokens(self, prompt, max_new, sampling, eos=None, **limits):
            seen["prompt"], seen["max_new"] = prompt, max_new
            yield from out_ids
            self.last = types.SimpleNamespace(tokens=out_ids, steps=len(prompt) + len(out_ids) - 1, kernel_ms=1.0,
                                              tok_per_s=1000.0 * (len(prompt) + len(out_ids) - 1))

    cfg = cli.get_config(str(folder))
    monkeypatch.setattr(cli, "_load", lambda args: types.SimpleNamespace(cfg=cfg))
    monkeypatch.setattr(cli, "_kernel", lambda args, p, **kw: Kernel())
    # in this process: the stand-ins are this process's (a worker would load the real ones)
    assert main(["generate", "--in-process", "--model", str(folder), "--prompt", "café", "--no-prefill",
                 "--tokens", str(len(out_ids))]) == 0
    out = capsys.readouterr().out
    assert seen == {"prompt": byte_bpe.encode("café").ids, "max_new": len(out_ids)}
    assert out.splitlines()[0] == " naïve 😀 日本語"


@pytest.mark.parametrize("text, errors", [
    ("========= ERROR SUMMARY: 0 errors\n", 0),
    ("========= ERROR SUMMARY: 3 errors\n", 3),
    ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0),   # as the H200 printed it
    ("========= RACECHECK SUMMARY: 5 hazards displayed (2 errors, 3 warnings)\n", 2),
    ("========= COMPUTE-SANITIZER\nTraceback ...\n", None),
])
def test_sanitizer_summaries_are_read(text, errors):
    assert cli.sanitizer_errors(text) == errors


def test_the_sanitizers_own_summary_is_shown():
    text = "x\n========= RACECHECK SUMMARY: 7 hazards displayed (0 errors, 7 warnings)\n"
    assert cli.sanitizer_summary(text) == "7 hazards displayed (0 errors, 7 warnings)"
    assert cli.sanitizer_summary("========= ERROR SUMMARY: 0 errors\n") == "0 errors"
    assert cli.sanitizer_summary("nothing") == ""


def test_a_kernel_that_stops_itself_is_one_line(capsys, monkeypatch, tiny_hf_checkpoint, gpu_present):
    """A hang the kernel caught (its barrier timed out) or NaN logits, in this process: one line, exit code 1, no
    traceback and no 'bug' (through the worker it is a WorkerFailure, one line too)."""
    import types

    from workbench.run.runtime import KernelHang

    class Kernel:
        def stream_tokens(self, *a, **kw):
            raise KernelHang("grid barrier timed out after the down_residual stage of layer 3 at step 0: block 7 "
                             "waited,\n 1 block(s) never arrived")
            yield

    cfg = cli.get_config(str(tiny_hf_checkpoint))
    monkeypatch.setattr(cli, "_load", lambda args: types.SimpleNamespace(cfg=cfg))
    monkeypatch.setattr(cli, "_kernel", lambda args, p, **kw: Kernel())
    assert error_of(capsys, "generate", "--in-process", "--model", tiny_hf_checkpoint, "--prompt-ids", "1") == \
        (1, "error: the kernel stopped: grid barrier timed out after the down_residual stage of layer 3 at step 0: "
            "block 7 waited, 1 block(s) never arrived\n")


def test_bench_positions_past_what_the_model_was_trained_for(capsys):
    assert_error(capsys, ["bench", "--model", "tiny", "--positions", "128", "131000"],
                 "position 131000 and --tokens 128 need 131264 positions, past the 131072 of max_position_embeddings "
                 "of tiny")


def test_sanitize_runs_each_tool_on_generate_and_says_why_a_run_ended(tmp_path, capsys, gpu_present):
    """The command lines `sanitize` gives compute-sanitizer (racecheck limited to the monokernel, the others on every
    kernel), and what it prints when the program under a tool fails: the tool's lines, then the program's last. A
    stand-in executable plays compute-sanitizer (the real one needs a GPU): it logs its arguments and answers as the
    real one did on the H200 when the program died early."""
    log = tmp_path / "argv.txt"
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {log}
echo "random weights:  71%|#######   | 104/146"
echo "========= COMPUTE-SANITIZER"
echo "========= Error: process didn't terminate successfully"
echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
exit 9
""")
    fake.chmod(0o755)
    assert main(["sanitize", "--model", "tiny", "--tool", "racecheck", "--tokens", "1", "--prompt-ids", "5",
                 "--sanitizer", str(fake)]) == 1
    out = capsys.readouterr().out
    assert "racecheck  tiny: 0 errors" in out and "exit code 9" in out
    assert "========= Error: process didn't terminate successfully" in out
    assert out.index("the program under the tool ended with:") < out.index("random weights:  71%")
    argv = log.read_text().split()
    assert argv[:2] == ["--tool", "racecheck"] and "--kernel-name" in argv and "kns=wb_generate" in argv
    assert argv[argv.index("--prompt-ids") + 1] == "5" and argv[argv.index("--tokens") + 1] == "1"
    assert "--no-prefill" in argv                      # the prompt through the monokernel, the kernel under test
    log.unlink()
    main(["sanitize", "--model", "tiny", "--tool", "memcheck", "--sanitizer", str(fake)])
    assert "--kernel-name" not in log.read_text()          # memcheck watches every kernel


@pytest.mark.parametrize("text, n", [
    ("", 0),
    ("========= COMPUTE-SANITIZER\n", 0),
    ("========= COMPUTE-SANITIZER\nrandom weights:  71%|#######   | 104/146\r\n", 0),
    ("========= COMPUTE-SANITIZER\n17 4", 1),           # the 4 may be the start of 42: not counted yet
    ("========= COMPUTE-SANITIZER\n17 42 9 ", 3),
    ("17 42 9 \ntime to first token 12.0 ms: ...\n3 tokens, 3 decode steps", 3),
    ("random weights: 100%|##########| 146/146\r                 \r17 42 ", 2),      # after the bar, on its line
    ("Warning: 3 things\n5 6 7 8 ", 4),
])
def test_the_sanitize_bar_counts_the_streamed_tokens(text, n):
    from workbench.cli import streamed_tokens
    assert streamed_tokens(text) == n


def test_generate_prefills_the_prompt_and_continues_after_it(capsys, monkeypatch, tiny_hf_checkpoint, gpu_present):
    """By default (no --prefill given, greedy), the whole prompt goes through the batched prefill (the real one, on
    the CPU's copy of the weights), whose last logits' first largest is the first token, printed before the kernel
    runs; the kernel is fed that token at the position after the prompt. With --first-token kernel (sampling's
    way), all but the prompt's last token are prefilled and the kernel is fed the last. --check-prefill compares
    the cache, the logits and the token with the fp64 math. The kernel is a stand-in that holds the cache (no GPU
    here)."""
    import types

    from workbench.model.weights import load_prepared
    from workbench.run.prefill import prefill

    cfg = cli.get_config(str(tiny_hf_checkpoint))
    p = load_prepared(str(tiny_hf_checkpoint), str(tiny_hf_checkpoint), xp=np, progress=False)
    seen = {}

    class Kernel:
        shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
        k_cache, v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)

        def prefill(self, tokens, precision, logits=True, token=False):
            seen["precision"] = precision
            seen.setdefault("prefilled", []).append(list(tokens))
            seen.setdefault("logits", []).append((logits, token))
            pre = prefill(p, tokens, self.k_cache, self.v_cache, chunk=5, precision=precision, logits=logits,
                          token=token)
            seen["token"] = pre.token
            return pre

        def stream_tokens(self, prompt, max_new, sampling, pos0=0, **kw):
            seen.setdefault("streams", []).append((list(prompt), max_new, pos0))
            seen.update(cached=int((self.k_cache[0, 0, :, 0] != 0).sum()))
            yield from [3, 4][:max_new]
            self.last = types.SimpleNamespace(tokens=[3, 4][:max_new], steps=max_new, kernel_ms=1.0, tok_per_s=2000.0)

    monkeypatch.setattr(cli, "_load", lambda args: p)
    monkeypatch.setattr(cli, "_kernel", lambda args, p, **kw: Kernel())
    checkpoint = ["generate", "--in-process", "--model", str(tiny_hf_checkpoint), "--prompt-random", "23"]
    assert main([*checkpoint, "--tokens", "3", "--check-prefill"]) == 0
    out = capsys.readouterr().out
    ids = np.random.default_rng(0).integers(0, cfg.vocab, 23).tolist()
    # a warm-up prefill of the prompt's first chunk (here all 23: fewer than a chunk) and one kernel step at 0,
    # untimed and said so; then the timed prefill, and the kernel from its token after the prompt for the other 2
    assert seen["prefilled"] == [ids, ids] and seen["precision"] == "fp32" and seen["cached"] >= 21
    assert seen["streams"] == [(ids[:1], 1, 0), ([seen["token"]], 2, 23)]
    assert out.split()[0] == str(seen["token"]) and f"{seen['token']} 3 4" in out
    assert "23 prompt tokens prefilled (fp32 products) in" in out and "(5 chunks)" in out
    assert "the first token their last logits' first largest" in out
    assert "an untimed warm-up prefill of its first 23 tokens and one kernel step" in out
    assert "prefill passed" in out and f"first token {seen['token']}, fp64's" in out
    assert seen["logits"] == [(True, True), (True, True)]               # --check-prefill compares the logits
    assert "2 tokens after the first, 2 decode steps" in out
    seen.clear()
    assert main([*checkpoint, "--tokens", "1"]) == 0                    # the prefill's token alone: no kernel run
    out = capsys.readouterr().out
    assert seen["logits"] == [(False, True), (False, True)] and seen["streams"] == [(ids[:1], 1, 0)]
    assert out.split()[0] == str(seen["token"]) and "prefill passed" not in out and "decode steps" not in out
    seen.clear()
    assert main([*checkpoint, "--tokens", "2", "--first-token", "kernel"]) == 0
    # the kernel's first step chooses: all but the last token prefilled, the last fed at the position after them,
    # and the prefill leaves the last row's logits to it
    assert seen["prefilled"] == [ids[:22], ids[:22]] and seen["logits"] == [(False, False), (False, False)]
    assert seen["streams"][1] == (ids[-1:], 2, 22) and "22 prompt tokens prefilled" in capsys.readouterr().out
    assert_error(capsys, ["generate", "--model", str(tiny_hf_checkpoint), "--check-prefill", "--no-prefill",
                          "--prompt-ids", "5,6"],
                 "--check-prefill checks a prefill: leave out --no-prefill")
    assert_error(capsys, ["generate", "--model", str(tiny_hf_checkpoint), "--first-token", "prefill",
                          "--temperature", "0.8", "--prompt-ids", "5,6"],
                 "--first-token prefill chooses greedily (its last logits' first largest); a sampled first token is "
                 "the kernel's own draw: leave out --first-token, or give --temperature 0")
    assert_error(capsys, ["generate", "--model", str(tiny_hf_checkpoint), "--first-token", "kernel", "--no-prefill",
                          "--prompt-ids", "5,6"],
                 "--first-token kernel has no effect: nothing is prefilled")


def test_bench_first_token_needs_ttft(capsys):
    assert_error(capsys, ["bench", "--model", "tiny", "--first-token", "kernel"],
                 "--first-token kernel has no effect without --ttft")


@pytest.mark.parametrize("argv, message", [
    (["verify", "--model", "tiny", "--prefill-len", "1"],
     "--prefill-len needs at least 2 tokens (the last one is the kernel's)"),
    (["verify", "--model", "llama-3.2-1b", "--prefill-len", "8190", "--tokens", "8"],
     "--prefill-len 8190 and --tokens 8 need 8197 positions, but the KV cache of llama-3.2-1b holds 8192 "
     "(--max-seq)"),
    (["verify", "--model", "tiny", "--max-seq", "max", "--prefill-len", "100"] + ["--max-seq", "0"],
     "argument --max-seq: must be a positive integer, got 0"),
])
def test_verify_after_a_prefill_refuses_what_cannot_run(capsys, argv, message):
    assert_error(capsys, argv, message)


@pytest.mark.parametrize("extra,after", [([], {"fp32": None, "bf16": None}), (["--rtol", "1e-2"], {"fp32": 1e-2,
                                                                                                  "bf16": 1e-2})])
def test_verify_holds_the_decode_after_a_prefill_to_its_precisions_bound(monkeypatch, capsys, extra, after):
    """`verify --prefill-len N --prefill-precision P`: the decode after the prefill reads the cache it wrote, so
    verify_after_prefill chooses P's bound (check.prefill.PREFILL_RTOL: 5e-3 for fp32, 2e-2 for bf16) unless
    --rtol is given, while the plain end-to-end check keeps the decode's own 5e-3. (The command line had filled in
    5e-3 everywhere, holding a bf16 prefill's decode to fp32's tolerance.) The GPU parts are stand-ins that
    record what they were asked."""
    import types

    from workbench.check.verify import DEFAULT_RTOL
    seen = {}
    ok = types.SimpleNamespace(passed=True, summary=lambda: "ok", text=lambda: "ok")
    monkeypatch.setattr(cli, "_load", lambda args: types.SimpleNamespace(cfg=cli.get_config("tiny")))
    monkeypatch.setattr(cli, "Monokernel", lambda *a, **k: None)
    monkeypatch.setattr(cli, "_kernel", lambda *a, **k: None)
    monkeypatch.setattr(cli, "verify_stages", lambda *a, **k: (ok, None))
    monkeypatch.setattr(cli, "verify_stops", lambda *a, **k: [])
    def end_to_end(mk, rtol, **k):
        seen["end_to_end"] = rtol
        return ok

    def after_prefill(mk, rtol, precision, first, **k):
        seen[precision] = rtol
        seen.setdefault("first", []).append(first)
        return ok, ok
    monkeypatch.setattr(cli, "verify", end_to_end)
    monkeypatch.setattr(cli, "verify_after_prefill", after_prefill)
    for precision in ("fp32", "bf16"):
        args = cli._parser().parse_args(["verify", "--model", "tiny", "--prefill-len", "9",
                                         "--prefill-precision", precision, *extra])
        cli._check_verify(args)
        assert cli.cmd_verify(args) == 0
        assert seen[precision] == after[precision]
    assert seen["end_to_end"] == (float(extra[1]) if extra else DEFAULT_RTOL)
    assert seen["first"] == ["prefill", "kernel"] * 2           # both ways to the first token, each precision

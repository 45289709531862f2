"""Shared test set-up: the `gpu` marker, a per-test random generator, and a tiny random Hugging Face checkpoint.

Tests marked `gpu` run only where cupy can see a CUDA device; everywhere else they are skipped with the reason.
"""
from __future__ import annotations

import functools
import os
import zlib

import numpy as np
import pytest

from workbench.model.config import get_config


# torch is no dependency of any extra (pyproject.toml), so the README's install leaves it out: what compares with it
# (or with transformers' models, which need it) skips, one line per module or test, rather than failing to import
NEEDS_TORCH = "needs torch, which no extra installs: pip install torch==2.13.0 (its CPU build), as the README says"


def needs_torch():
    """torch, or a skip saying how to get it: for the fixtures and tests that build transformers' models."""
    return pytest.importorskip("torch", reason=NEEDS_TORCH)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU through cupy (skipped without one)")


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                                      # no cupy, no driver, no libcuda: all mean "no GPU"
        return f"no CUDA device ({type(e).__name__}: {str(e)[:120]})"
    return None if n > 0 else "no CUDA device (cupy sees 0)"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]   # not keywords: a param id can be "gpu"
    if gpu_items and (reason := gpu_unavailable_reason()):
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def rng(request):
    """A generator seeded from the test's own id: reproducible, and different for every test (and parameter)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _build_llama(hf_config: dict, seed: int = 0):
    """The HF model of these config fields (a LlamaForCausalLM unless `model_type` says another family, e.g.
    qwen3 or qwen2), re-initialised so that every layer does something: projections with std 1/sqrt(fan_in),
    biases with std 0.1, norm gains 1 + 0.2·N(0, 1), embeddings with std 0.1 (HF's default init, std 0.02
    everywhere and unit gains, leaves the residual stream nearly untouched by the layers)."""
    torch = needs_torch()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = dict(hf_config)
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif p.ndim == 1:                                   # RMSNorm gains (q/k norms too)
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:                                               # nn.Linear weight [out, in]
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


def _build_tiny_llama(seed: int = 0):
    """LlamaForCausalLM at the 'tiny' preset's shapes, re-initialised as _build_llama does."""
    return _build_llama(get_config("tiny").to_hf_dict(), seed)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A folder with config.json and a single model.safetensors of a random tiny Llama, stored in bf16 as HF
    checkpoints normally are."""
    torch = needs_torch()

    path = tmp_path_factory.mktemp("tiny_hf")
    # safetensors is save_pretrained's default format (in transformers 5 the only one)
    _build_tiny_llama().to(torch.bfloat16).save_pretrained(path)
    assert (path / "model.safetensors").exists()
    return path


@pytest.fixture(scope="session")
def tiny_hf_checkpoint_sharded(tmp_path_factory):
    """The same weights as tiny_hf_checkpoint, split into several shards with a model.safetensors.index.json."""
    torch = needs_torch()

    path = tmp_path_factory.mktemp("tiny_hf_sharded")
    _build_tiny_llama().to(torch.bfloat16).save_pretrained(path, max_shard_size="1MB")
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture
def sharded_copy(tmp_path, tiny_hf_checkpoint_sharded):
    """A private copy of the sharded checkpoint, to break: (folder, its index's path, the index as a dict)."""
    import json
    import shutil
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_hf_checkpoint_sharded, folder)
    index = folder / "model.safetensors.index.json"
    return folder, index, json.loads(index.read_text())


def fresh_seed() -> int:
    """A new seed for every check (printed, so a failure can be replayed)."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"seed {s}")
    return s


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A factory: hf_checkpoint(seed=0, **config fields) → a folder holding config.json and model.safetensors
    of a random model of those shapes (Llama unless model_type names another family) (re-initialised as _build_llama does), stored in bf16. Each distinct set of
    fields is built once per session."""
    import json

    torch = needs_torch()

    made: dict = {}

    def make(seed: int = 0, **fields):
        key = json.dumps([seed, fields], sort_keys=True)
        if key not in made:
            path = tmp_path_factory.mktemp("hf_llama")
            _build_llama(fields, seed).to(torch.bfloat16).save_pretrained(path)
            made[key] = path
        return made[key]

    return make


TEXT = ["naïve 😀 日本語, café façade: ünïcödé ∑ ∫ 🎉🎉",
        "The quick brown fox jumps over the lazy dog. Ça va? Größe, Straße, naïveté.",
        "日本語のテキスト、中文字符、한국어 텍스트 and emoji 😀🙃🎉 side by side"] * 4


@pytest.fixture(scope="session")
def byte_bpe():
    """A byte-level BPE tokenizer (GPT-2 / Llama 3 style) trained here, with few merges (280 tokens, 256 of them
    bytes) so that multi-byte characters stay split across tokens: what decoding token by token gets wrong."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(TEXT, trainer)
    return tok


# the recorded timing trace at position 0 (fixtures/) and the simulator's costs fitted on it: what the schedule
# simulator's tests price designs with (tests/test_simulate.py, tests/test_dataflow.py)
@pytest.fixture(scope="session")
def recorded():
    from workbench.measure import trace
    return trace.load_recorded(0)


@pytest.fixture(scope="session")
def costs(recorded):
    from workbench.measure import simulate
    return simulate.calibrate([recorded], hbm_tbps=recorded.roofline_tbps, sm_gbps=simulate.SM_GBPS)

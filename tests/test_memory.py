"""What a model at a context needs of the GPU's memory, by part, and the one line that says so when it does not
fit: from the plan's buffers, checked against their shapes here (no GPU needed)."""
from __future__ import annotations

import pytest

from workbench import plan, schedule
from workbench.cli import main
from workbench.model.config import get_config


def test_memory_is_the_plans_buffers_by_kind():
    cfg = get_config("llama-3.1-8b", max_seq=131072)
    m = schedule.memory_bytes(cfg)
    assert m["cache"] == 2 * 32 * 8 * 131072 * 128 * 2               # bf16 keys and values
    # what a token streams, the embedding table, and the fp32 biases and q/k gains (zeros and ones on Llama)
    embed = cfg.vocab * cfg.hidden * 2
    fp32 = 4 * cfg.n_layers * (cfg.qkv_rows + 2 * cfg.head_dim)
    assert m["weight"] == cfg.weight_bytes_per_token() + embed + fp32
    assert sum(m.values()) == sum(b.nbytes(cfg, plan.Launch()) for b in plan.BUFFERS.values())


def test_the_longest_context_that_fits_is_the_largest_that_does():
    cfg = get_config("llama-3.1-8b", max_seq=131072)
    free = 30_000_000_000
    n = schedule.longest_context(cfg, free)
    total = lambda k: sum(schedule.memory_bytes(get_config("llama-3.1-8b", max_seq=k)).values())   # noqa: E731
    assert 0 < n < 131072 and total(n) <= free < total(n + 1)
    assert schedule.longest_context(cfg, 10**15) == 131072                 # capped at max_position_embeddings
    assert schedule.longest_context(cfg, 1000) == 0


def test_a_context_too_long_for_the_gpu_is_one_line_with_what_it_needs():
    cfg = get_config("llama-3.1-8b", max_seq=131072)
    assert schedule.memory_problem(cfg, 10**12) is None
    line = schedule.memory_problem(cfg, 30_000_000_000)
    n = schedule.longest_context(cfg, 30_000_000_000)
    assert line == (f"llama-3.1-8b with a 131072-position context needs 33.31 GB of GPU memory (16.13 GB weights, "
                    f"17.18 GB KV cache, 0.00 GB activations and scratch); the GPU has 30.00 GB free: --max-seq {n} "
                    f"is the longest context that fits")
    beside = schedule.memory_problem(cfg, 10_000_000_000, weights_resident=True)
    assert "free beside the weights" in beside and "weights," not in beside
    assert "not even a one-position context fits" in schedule.memory_problem(cfg, 1000)


def test_max_seq_max_is_the_models_trained_length(capsys):
    from workbench import cli
    args = cli._parser().parse_args(["build", "--model", "llama-3.2-1b", "--max-seq", "max"])
    assert args.max_seq == "max" and cli._longest("llama-3.2-1b") == 131072
    assert main(["generate", "--model", "tiny", "--max-seq", "lots"]) == 2
    assert "--max-seq" in capsys.readouterr().err


def test_generate_says_what_a_context_needs_before_loading_anything(capsys, monkeypatch):
    """The check runs on the GPU's free memory before the weights are read (a stand-in free figure here: no GPU)."""
    cupy = pytest.importorskip("cupy")
    from workbench import cli
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (20_000_000_000, 80_000_000_000))
    loaded = []
    monkeypatch.setattr("workbench.model.weights.load_prepared", lambda *a, **k: loaded.append(a))
    assert main(["generate", "--in-process", "--model", "llama-3.1-8b", "--max-seq", "max"]) == 2
    err = capsys.readouterr().err
    n = schedule.longest_context(get_config("llama-3.1-8b", max_seq=131072), 20_000_000_000)
    assert err.startswith("error: llama-3.1-8b with a 131072-position context needs 33.31 GB")
    assert f"the GPU has 20.00 GB free: --max-seq {n} is the longest context that fits" in err
    assert err.count("\n") == 1 and not loaded

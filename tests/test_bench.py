"""The bench's table without a GPU: its default positions, and both rooflines in every row of the table."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_torch

from workbench.measure.bench import Row, bench_positions, cache_positions, format_rows


def test_default_positions_reach_16k_and_32k_for_the_1b():
    assert bench_positions("llama-3.2-1b") == (128, 4096, 16384, 32768)
    assert bench_positions("llama-3.1-8b") == (128, 4096, 16384)


def test_the_cache_holds_the_furthest_run_and_the_longest_prompt():
    assert cache_positions((128, 4096), 128) == 4096 + 256 + 8            # no --ttft: the decode runs alone
    assert cache_positions((128,), 32, (1024, 32768)) == 32768 + 8
    assert cache_positions((16384,), 128, (4096,)) == 16384 + 256 + 8


def test_the_table_shows_both_rooflines():
    import dataclasses
    rows = [dataclasses.asdict(Row("monokernel", 32768, 1250.0, 800.0, (790.0, 805.0), 71.3, "", 44.6))]
    out = {"model": "llama-3.2-1b", "device": "H200", "tokens": 128, "repeats": 5, "roofline_tbps": 4.45,
           "rows": rows}
    text = format_rows(out)
    header, legend, line = text.splitlines()[1:4]
    assert " %roof " in header and " %w roof " in header
    assert "weights + KV-cache" in legend
    assert line.split()[:2] == ["monokernel", "32768"] and line.split()[-2:] == ["71.3", "44.6"]


@pytest.mark.parametrize("family", ["llama", "qk_norm", "qkv_bias"])
def test_the_torch_baseline_does_the_kernels_math(family):
    """The gpt-fast-style model the bench times against (uncompiled, on the CPU, in bf16 as the bench runs it)
    gives the reference's logits token by token, with the family's own step (Qwen3's q/k norms, Qwen2's biases);
    without that step it would be far off, so a baseline that skipped it would be caught here, not flattered."""
    torch = needs_torch()

    from workbench.reference import forward
    from workbench.measure.baselines import gpt_fast_model, tensors_from_weights
    from workbench.model.config import get_config
    from workbench.model.weights import random_weights
    cfg = get_config("tiny").with_(**({} if family == "llama" else {family: True}))
    w = random_weights(cfg, 5, progress=False)
    tokens = [3, 17, 250, 9, 600, 41]
    ref = forward(w, tokens, dtype=np.float64)
    model = gpt_fast_model(cfg, tensors_from_weights(w, "cpu", torch.bfloat16), "cpu", 16)
    with torch.no_grad():
        ours = np.stack([model(torch.tensor([[t]]), torch.tensor([i]))[0, -1].float().numpy()
                         for i, t in enumerate(tokens)])
    # bf16 weights, activations and cache against fp64: a few 1e-3 of the logits' spread, measured ~1e-2 at worst
    err = np.abs(ours - ref).max(axis=1) / ref.std(axis=1)
    assert err.max() < 0.05, err
    if family != "llama":
        plain = forward(w.__class__(cfg.with_(**{family: False}), w.tensors, w.xp), tokens, dtype=np.float64)
        assert (np.abs(plain - ref).max(axis=1) / ref.std(axis=1)).max() > 0.2


@pytest.mark.parametrize("family", ["llama", "qk_norm", "qkv_bias"])
def test_the_hf_baseline_is_the_familys_own_model(family):
    """HF generate() in the bench runs the family's transformers class (not a Llama for every model): on the CPU in
    fp32 its logits are the reference's over a teacher-forced run."""
    torch = needs_torch()

    from workbench.reference import forward
    from workbench.measure.baselines import tensors_from_weights
    from workbench.measure.bench import hf_model
    from workbench.model.config import get_config
    from workbench.model.weights import random_weights
    cfg = get_config("tiny").with_(**({} if family == "llama" else {family: True}))
    w = random_weights(cfg, 3, progress=False)
    model = hf_model(cfg, tensors_from_weights(w, "cpu", torch.float32), "cpu", torch.float32)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qk_norm": "Qwen3ForCausalLM",
                                    "qkv_bias": "Qwen2ForCausalLM"}[family]
    tokens = [3, 17, 250, 9, 600]
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0].double().numpy()
    ours = forward(w, tokens, kv_bf16=False, dtype=np.float64)
    assert (np.abs(theirs - ours).max(axis=1) / ours.std(axis=1)).max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qk_norm"])
def test_the_ttft_baseline_computes_what_the_prefill_computes(family):
    """bench --ttft times HF's prefill against ours: on the CPU in fp32 the two give the same first-token logits
    (HF's of the whole prompt's last position; ours of the prefilled tokens' last, the kernel feeding none)."""
    torch = needs_torch()

    from workbench.measure.baselines import tensors_from_weights
    from workbench.measure.bench import hf_model, hf_prefill, ttft_hf
    from workbench.model.config import get_config
    from workbench.model.weights import prepare, random_weights
    from workbench.run.prefill import prefill
    cfg = get_config("tiny").with_(max_seq=64, **({} if family == "llama" else {family: True}))
    w = random_weights(cfg, 4, progress=False)
    model = hf_model(cfg, tensors_from_weights(w, "cpu", torch.float32), "cpu", torch.float32, attn="sdpa")
    assert model.config._attn_implementation == "sdpa"
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, 40).tolist()
    theirs = hf_prefill(model, torch.tensor([prompt])).double().numpy()
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    ours = prefill(prepare(w, progress=False), prompt, np.zeros(shape, np.uint16), np.zeros(shape, np.uint16),
                   chunk=16).logits
    from workbench.reference import forward
    exact = forward(w, prompt, kv_bf16=False, dtype=np.float64)[-1]     # HF keeps fp32 keys and values
    assert np.abs(theirs - exact).max() / exact.std() < 1e-4
    # ours rounds its keys and values to bf16, as the kernel's cache holds them: a few 1e-3 of the spread per
    # layer, measured 2.5e-2 at worst on these random weights
    assert np.abs(ours - exact).max() / exact.std() < 5e-2
    assert ttft_hf(model, torch.tensor([prompt])) > 0


def test_the_ttft_table_follows_the_decode_table():
    import dataclasses

    from workbench.measure.bench import TTFT_HF, TTFT_MONOKERNEL, TtftRow, ttft_speedups
    rows = [TtftRow(f"{TTFT_MONOKERNEL} fp32", 4096, 61.0, (60.0, 63.0), "prefill 55.0 ms in 2 chunks"),
            TtftRow(f"{TTFT_MONOKERNEL} bf16", 4096, 35.0, (34.0, 36.0), "prefill 29.0 ms in 2 chunks"),
            TtftRow(f"{TTFT_MONOKERNEL} bf16", 1024, 9.0, (9.0, 9.5), "prefill 7.0 ms in 1 chunk"),
            TtftRow(TTFT_HF, 4096, 70.0, (69.0, 71.0))]
    out = {"model": "llama-3.2-1b", "device": "H200", "tokens": 128, "repeats": 5, "roofline_tbps": 4.45,
           "rows": [], "ttft": ttft_speedups([dataclasses.asdict(r) for r in rows])}
    lines = format_rows(out).splitlines()
    i = lines.index("time to first token (the prompt, then the first new token)")
    fp32, bf16, alone, hf = lines[i + 2:i + 6]
    # ours ÷ HF's speed on our rows, at the same prompt only; none where HF did not run
    assert fp32.startswith(f"{TTFT_MONOKERNEL} fp32") and fp32.split()[4:8] == ["4096", "61.0", "60.0–63.0", "1.15"]
    assert fp32.endswith("prefill 55.0 ms in 2 chunks")
    assert bf16.split()[4:8] == ["4096", "35.0", "34.0–36.0", "2.00"]
    assert alone.split()[4:8] == ["1024", "9.0", "9.0–9.5", "prefill"]
    assert hf.startswith(TTFT_HF) and hf.split()[-2:] == ["70.0", "69.0–71.0"]


@pytest.mark.parametrize("argv", [["--ttft"], ["--positions", "128", "--ttft", "1024", "32768"], []])
def test_the_benchs_worker_has_room_for_every_step_its_kernel_runs(argv):
    """The bench's kernel runs to its furthest position or its longest prompt (cache_positions), past the model's
    default context; the worker's mapped block, sized before the kernel exists, must stream that many steps (a
    32k prompt once stopped the bench with 'the mapped block has 17429 words, 33820 needed')."""
    from workbench import abi
    from workbench.cli import _check_bench, _parser, worker_tokens
    args = _parser().parse_args(["bench", "--model", "llama-3.2-1b", "--tokens", "32", *argv])
    _check_bench(args)
    steps = args.cache_positions                      # run_bench's Monokernel(max_steps=...)
    assert steps == cache_positions(args.positions or bench_positions("llama-3.2-1b"), 32, args.ttft)
    assert abi.mapped_words(worker_tokens(args)) >= abi.mapped_words(steps + 1)


def test_a_path_above_the_roofline_gets_a_footnote_and_only_then():
    import dataclasses
    from workbench.measure.bench import ROOFLINE
    roof = dataclasses.asdict(Row(ROOFLINE, 128, 570.0, 1754.0, (1754.0, 1754.0), 100.00000000000001, "", 100.0))
    out = {"model": "llama-3.2-1b", "device": "H200", "tokens": 128, "repeats": 5, "roofline_tbps": 4.4}
    fast = dataclasses.asdict(Row("monokernel", 128, 565.0, 1770.0, (1765.0, 1772.0), 100.9, "", 100.9))
    slow = dataclasses.asdict(Row("monokernel", 128, 875.0, 1142.0, (1141.0, 1143.0), 65.3, "", 65.3))
    assert "above 100% of the roofline" in format_rows({**out, "rows": [roof, fast]})
    assert "above 100%" not in format_rows({**out, "rows": [roof, slow]})       # the roofline's own 100.0 is not


def test_the_first_step_after_a_prefill_is_split_into_host_and_kernel():
    """bench --ttft's note: what the first step adds to the prefill, split into the host's preparation, the
    kernel's events and the rest, from the call's own marks; a call that never marked its preparation gives NaN,
    not a number that looks measured."""
    from types import SimpleNamespace
    from workbench.measure.bench import first_step_split
    res = SimpleNamespace(host_ms={"checked": 0.1, "prepared": 0.4, "launched": 0.45, "first token": 1.7,
                                   "collected": 1.9, "status read": 2.2}, kernel_ms=1.1)
    s = first_step_split(0.0250, 0.0225, res)
    assert s["first step"] == pytest.approx(2.5) and s["host prepare"] == 0.4 and s["kernel"] == 1.1
    assert s["rest"] == pytest.approx(1.0) and s["checks"] == 0.1
    assert (s["launch call"], s["to the token seen"], s["read back"]) == pytest.approx((0.05, 1.25, 0.2))
    assert (s["status read"], s["outside the call"]) == pytest.approx((0.3, 0.3))
    s = first_step_split(0.0250, 0.0225, SimpleNamespace(host_ms={}, kernel_ms=1.1))
    assert math.isnan(s["host prepare"]) and math.isnan(s["rest"]) and math.isnan(s["read back"])

"""Where the prefill's time goes, kernel by kernel, beside HF transformers' prefill of the same prompt in the same
run: both run under torch.profiler (CUPTI sees every kernel of the process, CuPy's and cuBLAS's too), and the GPU
time of each kernel is summed over the prompt. Wall times are taken unprofiled, after a warm-up.

    python scripts/prefill_profile.py --model llama-3.2-1b --prompt 4096 [--precision bf16 fp32] [--chunk 2048 4096]
                                      [--host] [--mlp-bf16] [--check] [--json FILE]

The table gives each kernel's share of our GPU time, grouped by what it serves (the products, the attention, the
row-wise kernels, copies), then the same for HF; a gap between the wall time and the kernels' sum is time the GPU
waited on the host, and the idle time between kernels is summed by the kernel that came after it (--host: the
host's own time by function).
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from workbench.cli import output_file  # noqa: E402
from workbench.run.prefill import PREFILL_CHUNK  # noqa: E402


def group(name: str) -> str:
    """What a kernel serves, from its name."""
    n = name.lower()
    if "prefill_attention" in n or "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if re.search(r"gemm|cutlass|sm90_|sm80_|xmma|ampere|hopper|cublas|nvjet", n):
        return "products"
    if n.startswith("prefill_"):
        return "row kernels (ours)"
    if "copy" in n or "memcpy" in n or "memset" in n or "fill" in n:
        return "copies"
    return "other"


def profile(fn, reps: int) -> dict:
    """GPU µs per call of every kernel fn launches, summed by name, over `reps` calls; and the GPU's idle time
    between two of one call's kernels, summed by the kernel after the gap. Each call is profiled on its own, so
    the host's time between two calls is no call's idle time (round 37's profile, one profiler run for all calls,
    counted it before each later call's first copy: part of the 2.1 ms it put before "Memcpy HtoD")."""
    import torch
    from torch.profiler import ProfilerActivity, profile as prof
    out: dict = {}
    idle: dict = {}
    for _ in range(reps):
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            fn()
            torch.cuda.synchronize()
        spans = []
        for e in p.events():
            dev = getattr(e, "device_type", None)
            if dev is not None and str(dev).endswith("CUDA") and e.device_time_total > 0:
                key = e.name[:90]
                c, us = out.get(key, (0, 0.0))
                out[key] = (c + 1, us + e.device_time_total)
                spans.append((e.time_range.start, e.time_range.end, key))
        spans.sort()
        end = spans[0][1] if spans else 0
        for a, b, name in spans[1:]:
            if a - end > 2.0:
                c, us = idle.get(name, (0, 0.0))
                idle[name] = (c + 1, us + a - end)
            end = max(end, b)
    kernels = {k: (c / reps, us / reps) for k, (c, us) in out.items()}
    return kernels, {k: (c / reps, us / reps) for k, (c, us) in idle.items()}


def host_profile(fn) -> str:
    """The host's own time in one call, by function (cProfile, cumulative), to find what keeps the GPU waiting."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(22)
    return buf.getvalue()


def wall(fn, reps: int) -> list:
    import torch
    fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ms.append(1e3 * (time.perf_counter() - t0))
    return ms


def table(title: str, prof: tuple, wall_ms: list) -> list[str]:
    kernels, idle = prof
    total = sum(us for _, us in kernels.values()) / 1e3
    lines = [f"\n{title}: wall {np.median(wall_ms):.2f} ms (min {min(wall_ms):.2f}), kernels {total:.2f} ms",
             f"{'group':22s} {'ms':>8s} {'share':>6s}"]
    groups: dict = {}
    for name, (_, us) in kernels.items():
        groups[group(name)] = groups.get(group(name), 0.0) + us / 1e3
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"{g:22s} {ms:8.2f} {100 * ms / max(total, 1e-9):5.1f}%")
    lines.append(f"{'kernel':90s} {'calls':>6s} {'ms':>8s}")
    for name, (calls, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:18]:
        lines.append(f"{name:90s} {calls:6.0f} {us / 1e3:8.3f}")
    lines.append(f"GPU idle between kernels {sum(us for _, us in idle.values()) / 1e3:.2f} ms, by the kernel it "
                 f"waited for (gaps over 2 µs):")
    for name, (calls, us) in sorted(idle.items(), key=lambda kv: -kv[1][1])[:10]:
        lines.append(f"{name:90s} {calls:6.0f} {us / 1e3:8.3f}")
    return lines


def as_json(wall_ms: list, prof: tuple) -> dict:
    kernels, idle = prof
    return {"wall_ms": wall_ms, "kernels": {x: list(v) for x, v in kernels.items()},
            "idle": {x: list(v) for x, v in idle.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--prompt", type=int, nargs="+", default=[4096])
    ap.add_argument("--precision", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, nargs="+", default=[PREFILL_CHUNK], help="rows a chunk (each is timed)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--host", action="store_true", help="also the host's time by function in one prefill")
    ap.add_argument("--mlp-bf16", action="store_true",
                    help="in bf16, also gate_up's product rounded to bf16 (prefill's mlp_bf16), timed and checked")
    ap.add_argument("--check", action="store_true",
                    help="each prefill's cache and last logits against fp64 too (check_prefill, its worst errors)")
    ap.add_argument("--json", type=output_file, help="the report's JSON, checked before anything runs")
    a = ap.parse_args()

    import cupy as cp
    import torch
    from workbench.check.prefill import check_prefill
    from workbench.measure.baselines import tensors_from_weights
    from workbench.measure.bench import hf_model, hf_prefill
    from workbench.model.config import get_config
    from workbench.model.weights import prepare, random_weights
    from workbench.run.runtime import Monokernel

    cfg = get_config(a.model)
    cfg = cfg.with_(max_seq=max(cfg.max_seq, max(a.prompt) + 8))
    w = random_weights(cfg, 0, xp=cp, progress=False)
    p = prepare(w, xp=cp, progress=False)
    mk = Monokernel(p, max_steps=cfg.max_seq)
    rng = np.random.default_rng(2)
    report, lines = {}, [f"{cfg.name} on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}"]
    hfm = None
    if not a.no_hf:
        hfm = hf_model(cfg, tensors_from_weights(w, torch.device("cuda"), torch.bfloat16), "cuda", torch.bfloat16,
                       attn="sdpa")
    for n in a.prompt:
        prompt = rng.integers(0, cfg.vocab, n).tolist()
        runs = [(precision, chunk, mlp) for precision, chunk in itertools.product(a.precision, a.chunk)
                for mlp in (False, True) if not mlp or (a.mlp_bf16 and precision == "bf16")]
        for precision, chunk, mlp in runs:
            def ours():                                  # to the first token, as HF's (its last logits, argmax)
                mk.prefill(prompt, precision=precision, chunk=chunk, logits=False, token=True, mlp_bf16=mlp)
            ms = wall(ours, a.reps)
            k = profile(ours, a.reps)
            name = f"{precision}{', gate_up in bf16' if mlp else ''}"
            lines += table(f"ours, {name}, prompt {n}, chunks of {chunk}", k, ms)
            report[f"ours {precision}{' mlp_bf16' if mlp else ''} {n} {chunk}"] = entry = as_json(ms, k)
            if a.check:
                pre = mk.prefill(prompt, precision=precision, chunk=chunk, mlp_bf16=mlp)
                c = check_prefill(p, prompt, pre, mk.k_cache, mk.v_cache)
                lines.append(c.summary())
                entry["check"] = c.summary()
            if a.host:
                lines.append(host_profile(ours))
        if hfm is not None:
            ids = torch.tensor([prompt], device="cuda")

            def hf():
                hf_prefill(hfm, ids).argmax()
            ms = wall(hf, a.reps)
            k = profile(hf, a.reps)
            lines += table(f"HF sdpa bf16, prompt {n}", k, ms)
            report[f"hf {n}"] = as_json(ms, k)
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

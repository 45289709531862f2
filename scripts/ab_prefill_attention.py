"""A/B of the prefill attention kernel's layouts (workbench.run.prefill_gpu.FlashLayout) and precisions on one
GPU, in one run: a whole prompt's causal attention, chunk by chunk as the prefill runs it, for one layer of a
model's shapes, every layout (prefill_gpu.LAYOUTS) at each precision timed (median of repeats, CUDA events) and held
to the same precision's per-head output bit for bit, with its relative error against the fp32 per-head output (the
bf16 precision: one bf16 half of the queries and probabilities, half the products). On an H100 or H200 the wgmma
kernel's layouts (prefill_gpu.WGMMA_LAYOUTS) run too.

    python scripts/ab_prefill_attention.py --model llama-3.2-1b --prompt 4096 32768 [--match NAME ...]
        [--precision fp32 bf16] [--json FILE]

The table gives ms per layer and for all layers (× n_layers), and the tensor-core rate counted as the work a
bf16 attention does (4·rows·keys·hd per head, causal), so a layout that does the same work faster shows higher;
the fp32 precision issues twice those mma FLOPs (queries and probabilities split in hi + lo), the bf16 one those.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from workbench.cli import output_file  # noqa: E402
from workbench.model.config import get_config  # noqa: E402
from workbench.model.weights import to_bf16  # noqa: E402
from workbench.run import prefill_gpu as G  # noqa: E402
from workbench.run.prefill import PREFILL_CHUNK  # noqa: E402



def layout_name(layout) -> str:
    on = [f.name.replace("_", "-") + ("" if getattr(layout, f.name) is True else f"={getattr(layout, f.name)}")
          for f in dataclasses.fields(layout) if getattr(layout, f.name)]
    return "+".join(on) or "per-head"


def wgmma_layouts():
    """The wgmma kernel's layouts where this GPU runs sm_90a's code (compute capability 9.0): another order of
    sums, so their rows say "no" under same bits and give their error against the fp32 per-head output."""
    return G.WGMMA_LAYOUTS if cp.cuda.Device().compute_capability == "90" else ()


def runs(match=(), precisions=tuple(G.PRECISIONS)) -> dict:
    """(layout, halves) a row times: every layout at each of `precisions` (or those whose name holds one of
    `match`), the per-head layout first (the others' bits are compared with the first of their precision, and every
    row's error with the first precision's per-head output: fp32's, unless only bf16 runs)."""
    return {f"{precision}, {layout_name(layout)}": (layout, halves)
            for precision, halves in G.PRECISIONS.items() if precision in precisions
            for layout in (*G.LAYOUTS, dataclasses.replace(G.FLASH_LAYOUT, min_blocks=4),
                           dataclasses.replace(G.FLASH_LAYOUT, frags=2),
                           dataclasses.replace(G.FLASH_LAYOUT, frags=2, exp_ftz=True), *wgmma_layouts())
            if layout == G.LAYOUTS[0] or not match or any(m in layout_name(layout) for m in match)}


def one_prompt(cfg, n: int, chunk: int, repeats: int, rng, match=(), precisions=tuple(G.PRECISIONS)) -> dict:
    hd, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q = cp.asarray(rng.standard_normal((n, hq * hd)) * 1.5, dtype=cp.float32)
    kb, vb = (to_bf16(cp.asarray(rng.standard_normal((hkv, n, hd)), dtype=cp.float32), cp) for _ in range(2))
    chunks = [(c, min(c + chunk, n)) for c in range(0, n, chunk)]
    base, base_halves, ref, rows = None, None, None, {}
    todo = {}
    for name, (layout, halves) in runs(match, precisions).items():      # a layout this model's shapes refuse: a line
        if problem := layout.head_dim_problem(hd) or layout.group_problem(hq, hkv):
            print(f"{name}: not run ({problem})", flush=True)
        else:
            todo[name] = (layout, halves)
    try:                          # in parallel; a failure there is met again, and reported, where it is built
        G.compile_ahead([(hd, layout, halves) for layout, halves in todo.values()])
    except Exception as e:          # noqa: BLE001 (the A/B goes on one build at a time)
        print(f"compiling ahead failed, building one at a time: {type(e).__name__}: {e}", flush=True)
    for name, (layout, halves) in todo.items():
        kernel = G.flash_kernel(hd, layout, halves)

        def run():                                                     # no read back between launches
            return [G.flash_attention(q[a:b], kb, vb, cp.arange(a, b), hq, kernel=kernel, layout=layout,
                                      halves=halves, span=(a, b - 1)) for a, b in chunks]
        try:
            out = cp.concatenate(run())                                # compiled and warm
        except (cp.cuda.driver.CUDADriverError, ValueError) as e:       # a layout not for this GPU or model: its row
            print(f"{name}: {e} (grid {layout.grid(n, hq, hkv)}, {layout.threads} threads, "
                  f"{layout.shared_bytes(hd, halves)} B dynamic shared memory)", flush=True)
            continue
        if base is None or halves != base_halves:
            base, base_halves = out, halves
        ref = out if ref is None else ref                              # the first precision's per-head layout's
        same = bool(((out == base) | (cp.isnan(out) & cp.isnan(base))).all())
        rel = float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref))
        times = []
        for _ in range(repeats):
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record()
            run()
            t1.record()
            t1.synchronize()
            times.append(cp.cuda.get_elapsed_time(t0, t1))
        ms = float(np.median(times))
        flops = 4.0 * hd * hq * n * (n + 1) / 2                         # QKᵀ and PV, causal
        rows[name] = {"ms_layer": ms, "ms_all_layers": ms * cfg.n_layers, "tflops_bf16_work": flops / ms / 1e9,
                      "halves": halves, "bit_identical_to_per_head": same, "rel_err_vs_per_head": rel,
                      "runs_ms": times}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", nargs="*", default=["llama-3.2-1b"])
    ap.add_argument("--prompt", type=int, nargs="*", default=[4096, 32768])
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=output_file)
    ap.add_argument("--match", nargs="*", default=(),
                    help="only the layouts whose name holds one of these (e.g. warpgroups frags=2), and the per-head")
    ap.add_argument("--precision", nargs="*", choices=list(G.PRECISIONS), default=list(G.PRECISIONS),
                    help="the precisions timed (default: all; the error column is against the first one's per-head)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    report = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "chunk": a.chunk, "rows": []}
    print("| model | prompt | layout | ms / layer | ms, all layers | TFLOPS (bf16 work) | same bits | rel. err |")
    print("|---|---|---|---|---|---|---|---|")
    for m in a.model:
        cfg = get_config(m)
        for n in a.prompt:
            for name, r in one_prompt(cfg, n, a.chunk, a.repeats, rng, a.match, tuple(a.precision)).items():
                report["rows"].append({"model": m, "prompt": n, "layout": name, **r})
                print(f"| {m} | {n:,} | {name} | {r['ms_layer']:.2f} | {r['ms_all_layers']:.1f} | "
                      f"{r['tflops_bf16_work']:.0f} | {'yes' if r['bit_identical_to_per_head'] else 'no'} | "
                      f"{r['rel_err_vs_per_head']:.1e} |",
                      flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

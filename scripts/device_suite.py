"""Everything the GPU must show, in one process: build, verify (tiny and real shapes, positions past 4,096),
sampling statistics, hang safety, throughput against the bandwidth roofline and torch.compile.

    python scripts/device_suite.py [--out DIR] [--quick] [--skip-torch]

Prints a table last and writes suite.json (and the log) under --out (default: $OUT or ./out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from workbench.build.assemble import BuildOptions  # noqa: E402
from workbench.model.config import get_config  # noqa: E402
from workbench.model.weights import prepare, random_weights  # noqa: E402
from workbench.run.runtime import KernelHang, Monokernel, Sampling  # noqa: E402
from workbench.check.verify import verify, verify_sampling  # noqa: E402

R: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "sms": cp.cuda.Device().attributes["MultiProcessorCount"], "sections": {}}


def log(*a):
    print(*a, flush=True)


def gpu_state() -> str:
    """Clocks, power and throttle reasons: a slow run on a throttled card is not the kernel's fault."""
    try:
        import pynvml as nv
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        return (f"sm {nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)} MHz, mem {nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)} MHz, "
                f"{nv.nvmlDeviceGetPowerUsage(h) / 1000:.0f} W, {nv.nvmlDeviceGetTemperature(h, 0)} C, "
                f"throttle 0x{nv.nvmlDeviceGetCurrentClocksThrottleReasons(h):x}")
    except Exception as e:
        return f"(no NVML: {e})"


def section(name):
    def deco(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            log(f"\n=== {name}")
            try:
                out = fn(*a, **kw)
                out = out or {}
                R["sections"][name] = {"ok": out.get("passed", True) is not False,
                                       "s": round(time.perf_counter() - t0, 1), **out}
            except Exception as e:
                traceback.print_exc()
                R["sections"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            return R["sections"][name]
        return run
    return deco


def kernel(name, seed=1, max_steps=4200, **opt):
    cfg = get_config(name)
    p = prepare(random_weights(cfg, seed, xp=cp, progress=False), xp=cp, progress=False)
    mk = Monokernel(p, BuildOptions(**opt), max_steps=max_steps)
    log(f"{name}: compiled in {mk.compile_s:.2f} s, resources {mk.resources()}")
    return mk


@section("verify")
def do_verify(name, seeds, long_prompt, quick=False):
    mk = kernel(name, seed=seeds[0] + 100)
    out = {"resources": mk.resources(), "compile_s": mk.compile_s, "runs": []}
    for s in seeds:
        rep = verify(mk, prompt_len=8, max_new=24, seed=s)
        log(rep.summary())
        out["runs"].append({"seed": s, "passed": rep.passed, "worst_rel": rep.worst.rel_err, "summary": rep.summary()})
    rep = verify(mk, prompt_len=long_prompt, max_new=8, seed=seeds[-1] + 7)
    log(rep.summary())
    out["runs"].append({"seed": seeds[-1] + 7, "passed": rep.passed, "worst_rel": rep.worst.rel_err,
                        "summary": rep.summary(), "max_position": rep.steps[-1].position})
    out["passed"] = all(r["passed"] for r in out["runs"])
    if not quick:
        samp = []
        for s in (Sampling(0.8, 0, 1.0, 11), Sampling(1.0, 50, 1.0, 12), Sampling(0.7, 0, 0.9, 13),
                  Sampling(1.5, 200, 0.95, 14)):
            t_s = time.perf_counter()
            r = verify_sampling(mk, s, draws=20000 if mk.cfg.vocab < 10000 else 10000, seed=s.seed)
            log(f"  ({time.perf_counter() - t_s:.1f} s)")
            log(r.summary())
            samp.append({"summary": r.summary(), "passed": r.passed, "p": r.p_value})
        # reproducibility: the same seed twice gives the same stream, another seed another one
        a = mk.generate([1, 2, 3], 32, Sampling(1.0, 0, 0.95, 5), eos=[]).tokens
        b = mk.generate([1, 2, 3], 32, Sampling(1.0, 0, 0.95, 5), eos=[]).tokens
        c = mk.generate([1, 2, 3], 32, Sampling(1.0, 0, 0.95, 6), eos=[]).tokens
        log(f"reproducible: {a == b}, seed changes stream: {a != c}")
        out["sampling"] = samp
        out["reproducible"] = a == b and a != c
        out["passed"] &= all(s["passed"] for s in samp) and out["reproducible"]
    del mk
    return out


@section("hang")
def do_hang():
    mk = kernel("tiny", hang=("attention_decode", 1, 3), max_steps=64)
    t0 = time.perf_counter()
    try:
        mk.generate([1, 2, 3], 8, timeout_s=1.0)
        msg, ok = "no error raised", False
    except KernelHang as e:
        msg = str(e)
        ok = "after the attention_decode stage of layer 1" in msg and \
            "the first being block 3, last seen in attention_decode of layer 1" in msg
    dt = time.perf_counter() - t0
    log(f"hang reported in {dt:.2f} s: {msg}")
    mk2 = kernel("tiny", max_steps=64)
    rep = verify(mk2, prompt_len=8, max_new=16, seed=3)
    log("next run:", rep.summary())
    return {"message": msg, "seconds": dt, "passed": ok and rep.passed}


@section("throughput")
def do_throughput(name, skip_torch, n_tokens=256):
    cfg = get_config(name)
    p = prepare(random_weights(cfg, 7, xp=cp, progress=False), xp=cp, progress=False)
    mk = Monokernel(p, BuildOptions(), max_steps=4200)
    wbytes = cfg.weight_bytes_per_token()
    roof = __import__("workbench.measure.baselines", fromlist=["x"]).stream_read_tbps(wbytes)
    roof_tps = roof["tbps"] * 1e12 / wbytes
    out = {"weight_bytes": wbytes, "roofline_tbps": roof["tbps"], "roofline_tok_s": roof_tps, "rows": []}
    log(f"streaming read {roof['tbps']:.2f} TB/s → roofline {roof_tps:.0f} tok/s")
    for pos0 in (0, 3700, 0, 3700):
        runs = []
        for _ in range(3):
            r = mk.generate([1], n_tokens, eos=[], pos0=pos0)
            runs.append(r.tok_per_s)
            log(f"  pos0={pos0}: {r.tok_per_s:.0f} tok/s, {gpu_state()}")
        tps = float(np.median(runs))
        out["rows"].append({"path": "monokernel", "pos0": pos0, "tok_s": tps, "spread": [min(runs), max(runs)],
                            "pct_roofline": 100 * tps / roof_tps})
        log(f"monokernel pos0={pos0}: {tps:.0f} tok/s ({100 * tps / roof_tps:.1f}% of roofline) runs {runs}")
    # where the time goes: the same kernel built with %globaltimer stamps
    from workbench.measure.timing import barrier_cost, format_table, stage_table
    mkt = Monokernel(p, BuildOptions(timing=True), max_steps=4200)
    for pos0 in (0, 3700):
        r = mkt.generate([1], 64, eos=[], pos0=pos0, timing_steps=64)
        table = format_table(stage_table(cfg, r.timing, pos0), roof["tbps"])
        bc = barrier_cost(r.timing)
        log(f"timing build pos0={pos0}: {r.tok_per_s:.0f} tok/s\n{table}\nbarrier: last arrival → first departure "
            f"{bc['first_out_ns'] / 1e3:.2f} µs, → last departure {bc['last_out_ns'] / 1e3:.2f} µs, "
            f"{bc['barriers_per_token']} per token")
        out[f"barrier_pos{pos0}"] = bc
        out[f"stages_pos{pos0}"] = table
        np.save(Path(os.environ.get("OUT", "out")) / f"timing_1b_pos{pos0}.npy", r.timing)
    del mkt
    if not skip_torch:
        import torch

        from workbench.measure.baselines import gpt_fast_model, gpt_fast_tok_per_s
        from workbench.model.weights import unprepare
        w = random_weights(cfg, 7, xp=cp, progress=False)
        from workbench.check.reference_torch import tensors_from_weights
        t = tensors_from_weights(w, torch.device("cuda"), torch.bfloat16)
        model = gpt_fast_model(cfg, t, torch.device("cuda"), 4352)
        del w, t
        for pos0 in (0, 3700):
            r = gpt_fast_tok_per_s(model, pos0=pos0, n_tokens=n_tokens)
            out["rows"].append({"path": "torch.compile reduce-overhead", "pos0": pos0, "tok_s": r["tok_per_s"],
                                "pct_roofline": 100 * r["tok_per_s"] / roof_tps, "compile_s": r["compile_s"]})
            log(f"torch.compile pos0={pos0}: {r['tok_per_s']:.0f} tok/s")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--only", nargs="*", default=["tiny", "1b", "hang", "throughput", "pytest"])
    ap.add_argument("--bench-models", nargs="*", default=["llama-3.2-1b"])
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if "tiny" in a.only:
        R["sections"]["tiny"] = do_verify("tiny", [1, 2], 4090, quick=a.quick)
        R["sections"].pop("verify")
    if "hang" in a.only:
        do_hang()
    if "1b" in a.only:
        R["sections"]["llama-3.2-1b"] = do_verify("llama-3.2-1b", [1, 2], 4090, quick=a.quick)
        R["sections"].pop("verify")
    if "throughput" in a.only:
        do_throughput("llama-3.2-1b", a.skip_torch)
    if "loop" in a.only:
        from workbench.loop.session import loop_benchmark
        log("\n=== edit → reload → verify → time loop (llama-3.2-1b)")
        try:
            lb = loop_benchmark("llama-3.2-1b")
            log(json.dumps(lb, indent=1, default=str)[:4000])
            R["sections"]["loop"] = {"ok": True, **{k: v for k, v in lb.items() if not isinstance(v, (list, dict))}}
            Path(a.out, "loop.json").write_text(json.dumps(lb, indent=1, default=str))
        except Exception as e:
            traceback.print_exc()
            R["sections"]["loop"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if "bench" in a.only:
        from workbench.measure.bench import format_rows, run_bench
        log("\n=== bench")
        for model in a.bench_models:
            try:
                b = run_bench(model, tokens=128, repeats=5, torch_paths=not a.skip_torch,
                              hf=not a.skip_hf and model == "llama-3.2-1b", log=log)
                log(format_rows(b))
                Path(a.out, f"bench_{model}.json").write_text(json.dumps(b, indent=1, default=str))
                R["sections"][f"bench-{model}"] = {"ok": "error" not in b, "table": format_rows(b)}
            except Exception as e:
                traceback.print_exc()
                R["sections"][f"bench-{model}"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if "pytest" in a.only:
        import subprocess
        log("\n=== GPU test suite")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py",
                            "tests/test_gpu_session.py"],
                           cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
        log(r.stdout[-3000:], r.stderr[-2000:])
        R["sections"]["pytest-gpu"] = {"ok": r.returncode == 0, "tail": r.stdout.strip().splitlines()[-1:]}
    Path(a.out, "suite.json").write_text(json.dumps(R, indent=1, default=str))
    log("\n=== summary")
    for k, v in R["sections"].items():
        log(f"{k:14s} {'ok ' if v.get('ok', True) and v.get('passed', True) else 'FAIL'} "
            f"{v.get('error', '')[:300]}")
    for row in R["sections"].get("throughput", {}).get("rows", []):
        log(f"  {row['path']:32s} pos0={row['pos0']:5d} {row['tok_s']:8.0f} tok/s {row['pct_roofline']:5.1f}% roofline")


if __name__ == "__main__":
    main()

"""`python -m workbench bench`: the monokernel against PyTorch, in one process, on one GPU, same weights.

Rows, at each starting position (128, 4,096 and 16,384, and 32,768 for llama-3.2-1b, unless --positions says), each
the median of `repeats` timed runs of `tokens` greedy decode steps (spread = min–max):
* monokernel — one launch per run, CUDA-event time of the launch;
* gpt-fast-style model under torch.compile(mode="reduce-overhead") with gpt-fast's inductor settings (CUDA graphs);
* HF transformers generate() with a static cache: decode time isolated as the difference between generating
  2·tokens and tokens new tokens after the same prompt (prefill cancels out);
* the streaming-read roofline: a tuned read of the model's weight bytes; tok/s at the roofline = TB/s / bytes per token,
  the bytes being the weights and the KV cache read at the position (`%roof`); `%w roof` is against the weights
  alone, the figure that ignores attention's reads.
Verification (teacher-forced, against the reference) runs first; a failing kernel is reported and not timed.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import time

import numpy as np

from ..check.verify import verify
from ..compiler.assemble import with_fields
from ..model.config import get_config
from ..model.weights import prepare, random_weights
from ..run.prefill import prefill_part
from ..run.prefill_gpu import PRECISIONS
from ..run.runtime import Monokernel
from .timing import signed
from .baselines import gpt_fast_model, gpt_fast_tok_per_s, stream_read_tbps, tensors_from_weights


ROOFLINE = "roofline (streaming read)"
# under a bench table where a path beats the roofline: the roofline row is the streaming read's median launch
BENCH_ROOF_NOTE = ("(above 100% of the roofline: the roofline is the median of separate launches of a streaming "
                   "read, timed whole, an estimate; a path within its spread can land above it)")


@dataclasses.dataclass
class Row:
    path: str
    position: int
    us_per_token: float
    tok_s: float
    spread: tuple
    pct_roofline: float
    note: str = ""
    pct_weights_roofline: float = float("nan")


def bench_positions(model: str) -> tuple[int, ...]:
    """The starting positions the bench times by default: short, the 4k agents start from, long; 32k for the 1B."""
    return (128, 4096, 16384, 32768) if model == "llama-3.2-1b" else (128, 4096, 16384)


def cache_positions(positions, tokens: int, ttft=()) -> int:
    """The KV cache the bench runs in: its furthest decode run (2·tokens past a position: HF's generate times n and
    2n), and its longest prompt, each with a few positions to spare."""
    return max([max(positions) + 2 * tokens + 8, *(n + 8 for n in ttft)])


def ttft_lengths(model: str) -> tuple[int, ...]:
    """The prompt lengths `bench --ttft` times by default: 1k to 32k for the 1B, the agents' 4k otherwise."""
    return (1024, 4096, 16384, 32768) if model == "llama-3.2-1b" else (4096,)


TTFT_MONOKERNEL = "monokernel, prefill in"         # then the precision of its products
TTFT_HF = "HF transformers prefill (sdpa)"


def ttft_path(precision: str, first: str) -> str:
    """A time to first token row's path: the products' precision, and who chose the token where not the prefill."""
    return f"{TTFT_MONOKERNEL} {precision}" + ("" if first == "prefill" else f", first token by the {first}")


@dataclasses.dataclass
class TtftRow:
    path: str
    prompt: int                # tokens
    ms: float                  # time to first token, median
    spread: tuple
    note: str = ""


def ttft_speedups(rows: list[dict]) -> list[dict]:
    """Each of our time-to-first-token rows gets hf_speedup, HF's time ÷ ours at the same prompt (above 1: ours is
    faster), where HF ran."""
    hf_ms = {r["prompt"]: r["ms"] for r in rows if r["path"] == TTFT_HF}
    for r in rows:
        if r["path"].startswith(TTFT_MONOKERNEL) and r["prompt"] in hf_ms:
            r["hf_speedup"] = hf_ms[r["prompt"]] / r["ms"]
    return rows


def ttft_monokernel(mk, prompt: list[int], precision: str = "fp32", first: str = "prefill",
                    **generate_kw) -> tuple[float, object, dict]:
    """Seconds from the prompt to the first new token (greedy), as `first` (prefill.FIRST_TOKEN) chooses it:
    "prefill", the whole prompt prefilled (batched, its products in `precision`) and the first token its last
    logits' first largest, read back; "kernel", the prompt but its last token prefilled, then the kernel's first
    step from that token (one launch, its first token published). `generate_kw`: generate's (e.g. timeout_s). →
    (seconds, the prefill's Prefilled, first_step_split of the kernel's step; {} where the prefill chose)."""
    import cupy as cp
    part = prefill_part(prompt, first)
    t0 = time.perf_counter()
    if first == "prefill":
        pre = mk.prefill(part, precision=precision, logits=False, token=True)       # its token read back
        return time.perf_counter() - t0, pre, {}
    pre = mk.prefill(part, precision=precision, logits=False)           # the kernel's first step computes them
    res = mk.generate(prompt[-1:], 1, eos=[], pos0=len(prompt) - 1, **generate_kw)
    cp.cuda.Device().synchronize()
    secs = time.perf_counter() - t0
    return secs, pre, first_step_split(secs, pre.seconds, res)


def first_step_split(secs: float, prefill_s: float, res) -> dict:
    """Where a time to first token went after the prefill, ms: the whole first step (the call's wall time after
    the prefill's), the host's preparation before the launch (the arguments' checks, inputs, resets, poisoning, one
    synchronisation), the kernel (CUDA events, launch to end) and the rest (the launch call, the watch that sees
    the token, the read back, the status read, and what lies outside the call); and the host marks
    (Result.host_ms): the checks, the launch call, from its return to the token seen (the kernel's step inside it),
    from then to the results read back, the status words read, and the step's time outside the call (after the
    prefill's timer, before and after generate's)."""
    nan = float("nan")
    mark = res.host_ms
    step = 1e3 * (secs - prefill_s)
    prep, kernel = mark.get("prepared", nan), res.kernel_ms
    return {"first step": step, "host prepare": prep, "kernel": kernel, "rest": step - prep - kernel,
            "checks": mark.get("checked", nan),
            "launch call": mark.get("launched", nan) - prep,
            "to the token seen": mark.get("first token", nan) - mark.get("launched", nan),
            "read back": mark.get("collected", nan) - mark.get("first token", nan),
            "status read": mark.get("status read", nan) - mark.get("collected", nan),
            "outside the call": step - mark.get("status read", nan)}


def measure_ttft(mk, prompt: list[int], repeats: int, precision: str = "fp32", first: str = "prefill",
                 **generate_kw) -> tuple[list, object, dict, dict]:
    """ttft_monokernel `repeats` times after one warm-up run (CuPy's kernels, cuBLAS) → (seconds of each run, the
    last run's Prefilled, the seconds by stage of one more prefill synchronised after each stage, the median run's
    first_step_split)."""
    ttft_monokernel(mk, prompt, precision, first, **generate_kw)
    runs = [ttft_monokernel(mk, prompt, precision, first, **generate_kw) for _ in range(max(1, repeats))]
    stages: dict = {}
    # what the timed runs ran: with the token stages or without
    mk.prefill(prefill_part(prompt, first), timings=stages, precision=precision, logits=False,
               token=first == "prefill")
    median = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    return [r[0] for r in runs], runs[-1][1], dict(sorted(stages.items(), key=lambda kv: -kv[1])), median[2]


def hf_prefill(model, prompt_ids):
    """HF transformers' prefill of a prompt [1, n]: the last position's logits [V] (the first new token's)."""
    import torch
    with torch.no_grad():
        return model(prompt_ids, use_cache=False, logits_to_keep=1).logits[0, -1]


def ttft_hf(model, prompt_ids) -> float:
    """Seconds of HF transformers' prefill of the prompt to the first new token (sdpa, bf16), no cache kept."""
    import torch
    sync = torch.cuda.synchronize if prompt_ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    hf_prefill(model, prompt_ids).argmax()
    sync()
    return time.perf_counter() - t0


def run_bench(model: str = "llama-3.2-1b", *, tokens: int = 128, repeats: int = 5, positions=None,
              torch_paths: bool = True, hf: bool = True, verify_first: bool = True, seed: int = 0,
              ttft=(), compiled: bool = True, options=(), first_token=("prefill",), log=print) -> dict:
    """`options`: (field, value) pairs of the kernel's options, a BuildOptions field or a launch's (with_fields; e.g.
    ("early", "o_proj_residual")). `first_token`: the ways to the first token each `ttft` prompt is timed
    (prefill.FIRST_TOKEN)."""
    import cupy as cp

    cfg = get_config(model)
    positions = tuple(positions or bench_positions(model))
    ttft = tuple(ttft)
    max_pos = cache_positions(positions, tokens, ttft)
    if max_pos > cfg.max_seq:
        cfg = cfg.with_(max_seq=max_pos)
    w = random_weights(cfg, seed, xp=cp, progress=False)
    p = prepare(w, xp=cp, progress=False)
    out = {"model": cfg.name, "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "tokens": tokens, "repeats": repeats, "rows": []}
    mk = Monokernel(p, with_fields(**dict(options)), max_steps=max_pos)
    out["kernel"] = mk.resources()
    out["options"] = {k: str(v) for k, v in dict(options).items()}
    if verify_first:
        rep = verify(mk, prompt_len=8, max_new=16, seed=seed + 1)
        log(rep.summary())
        out["verify"] = rep.summary()
        if not rep.passed:
            out["error"] = "verification failed: not timed"
            return out

    wbytes = cfg.weight_bytes_per_token()
    roof = stream_read_tbps(wbytes)
    out["roofline_tbps"], out["roofline_spread"] = roof["tbps"], roof["spread"]
    log(f"streaming read: {roof['tbps']:.2f} TB/s")

    def roof_tps(pos):
        return roof["tbps"] * 1e12 / (wbytes + cfg.kv_bytes_per_token(pos + tokens // 2))

    def add(path, pos, tps, spread, note=""):
        row = Row(path, pos, 1e6 / tps, tps, spread, 100 * tps / roof_tps(pos), note,
                  100 * tps / (roof["tbps"] * 1e12 / wbytes))
        out["rows"].append(dataclasses.asdict(row))
        log(f"{path:34s} pos {pos:5d}: {row.us_per_token:7.1f} µs/token {tps:7.0f} tok/s "
            f"[{spread[0]:.0f}–{spread[1]:.0f}] {row.pct_roofline:5.1f}% of roofline {note}")

    for pos in positions:
        add(ROOFLINE, pos, roof_tps(pos), (roof_tps(pos), roof_tps(pos)))
        mk.generate([1], 4, eos=[], pos0=pos)                              # warm
        runs = [mk.generate([1], tokens, eos=[], pos0=pos).tok_per_s for _ in range(repeats)]
        add("monokernel", pos, float(np.median(runs)), (float(min(runs)), float(max(runs))))

    out["ttft"] = []

    def add_ttft(path, n, secs, note=""):
        ms = [1e3 * x for x in secs]
        row = TtftRow(path, n, float(np.median(ms)), (min(ms), max(ms)), note)
        out["ttft"].append(dataclasses.asdict(row))
        log(f"time to first token {path:28s} prompt {n:6d}: {row.ms:8.1f} ms [{min(ms):.1f}–{max(ms):.1f}] {note}")
    rng = np.random.default_rng(seed + 2)
    prompts = {n: rng.integers(0, cfg.vocab, n).tolist() for n in ttft}
    for n, prompt in prompts.items():
        # each precision of the products and each way to the first token, in the same run
        for precision, by in itertools.product(PRECISIONS, first_token):
            secs, pre, stages, first = measure_ttft(mk, prompt, max(2, repeats // 2), precision, by)
            add_ttft(ttft_path(precision, by), n, secs,
                     f"prefill {1e3 * pre.seconds:.1f} ms in {pre.chunks} chunks" + (
                         ", then the first step " + ", ".join(f"{k} {v:.2f}" for k, v in first.items()) + " ms"
                         if first else ", its last logits' first largest read back"))
            key = precision if by == "prefill" else f"{precision}, {by}"
            out.setdefault("ttft_stages", {}).setdefault(str(n), {})[key] = {k: 1e3 * v for k, v in stages.items()}
            if first:
                out.setdefault("ttft_first_step", {}).setdefault(str(n), {})[key] = first
            log(f"  prefill ({precision}) of {pre.n} tokens by stage (ms, synchronised): "
                + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in stages.items()))

    if torch_paths:
        import torch
        t = tensors_from_weights(w, torch.device("cuda"), torch.bfloat16)
        # our kernel is done: its weights, cache and the prefill's pooled activations go back before PyTorch's
        # models are built (the 8B's two copies beside ours ran an 80 GB card out of memory)
        del mk, p, w
        gc.collect()                                 # the kernel's objects may hold each other
        cp.get_default_memory_pool().free_all_blocks()
        gf = gpt_fast_model(cfg, t, torch.device("cuda"), max_pos) if compiled else None
        n_runs = max(2, repeats // 2)
        from tqdm import tqdm
        # the first run compiles (minutes, each new position recompiles a little): a bar, on a terminal only
        bar = tqdm(total=len(positions) * n_runs if compiled else 0, desc="torch.compile (its first run compiles)",
                   unit="run", leave=False, disable=None)
        for pos in positions if compiled else ():
            runs = []
            for i in range(n_runs):
                runs.append(gpt_fast_tok_per_s(gf, pos0=pos, n_tokens=tokens, inductor_flags=True, warm=3 if i else 8))
                bar.update()
            tps = [r["tok_per_s"] for r in runs]
            add("torch.compile reduce-overhead", pos, float(np.median(tps)), (min(tps), max(tps)),
                f"compile {runs[0]['compile_s']:.0f} s")
        bar.close()
        del gf
        torch.cuda.empty_cache()
        if hf:
            for pos in positions:
                tps, spread, note = hf_static_tok_s(cfg, t, pos, tokens)
                add("HF generate() static cache", pos, tps, spread, note)
        if prompts:
            hfm = hf_model(cfg, t, "cuda", torch.bfloat16, attn="sdpa")
            for n, prompt in prompts.items():
                ids = torch.tensor([prompt], device="cuda")
                ttft_hf(hfm, ids)                                             # warm
                add_ttft(TTFT_HF, n, [ttft_hf(hfm, ids) for _ in range(max(2, repeats // 2))])
            del hfm
            torch.cuda.empty_cache()
        del t
    ttft_speedups(out["ttft"])
    mono = {r["position"]: r["tok_s"] for r in out["rows"] if r["path"] == "monokernel"}
    for r in out["rows"]:
        if r["path"] not in ("monokernel",) and not r["path"].startswith("roofline"):
            r["monokernel_speedup"] = mono[r["position"]] / r["tok_s"]
    return out


def hf_model(cfg, tensors: dict, device, dtype, attn: str | None = None):
    """The family's transformers model (LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM) at `cfg`'s shapes,
    on these HF-named tensors; every tensor must find its place (a tied LM head is the embedding). `attn`: the
    attention implementation ("sdpa", "eager"; default transformers' choice)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = cfg.to_hf_dict()
    hfc = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hfc, **({"attn_implementation": attn} if attn else {}))
        model = model.to(dtype).eval()
    sd = dict(tensors)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    wrong = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")] + list(unexpected)
    if wrong:
        raise ValueError(f"{type(model).__name__} and the weights disagree on {', '.join(sorted(wrong)[:6])}")
    return model


def hf_static_tok_s(cfg, tensors, pos: int, tokens: int):
    """Decode tok/s of HF generate() with a static cache, prefill cancelled by differencing two lengths."""
    import torch
    model = hf_model(cfg, tensors, "cuda", torch.bfloat16)
    prompt = torch.randint(0, cfg.vocab, (1, max(pos, 1)), device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    gen(tokens)                                                  # compile / warm
    diffs = []
    for _ in range(2):
        a, b = gen(tokens), gen(2 * tokens)
        diffs.append(tokens / max(b - a, 1e-9))
    del model
    torch.cuda.empty_cache()
    return float(np.median(diffs)), (min(diffs), max(diffs)), "decode = t(2n) − t(n)"


def format_rows(out: dict) -> str:
    lines = [f"{out['model']} on {out['device']}, {out['tokens']} tokens × {out['repeats']} runs; "
             f"roofline {out.get('roofline_tbps', float('nan')):.2f} TB/s",
             f"{'path':34s} {'pos':>6s} {'µs/tok':>8s} {'tok/s':>8s} {'spread':>15s} {'%roof':>6s} "
             f"{'%w roof':>7s} {'mono ×':>7s}",
             "(%roof: of the weights + KV-cache bytes read at the position; %w roof: of the weights' alone)"]
    for r in out["rows"]:
        sp = f"{r['spread'][0]:.0f}–{r['spread'][1]:.0f}"
        x = f"{r['monokernel_speedup']:.2f}" if "monokernel_speedup" in r else ""
        lines.append(f"{r['path']:34s} {r['position']:6d} {r['us_per_token']:8.1f} {r['tok_s']:8.0f} {sp:>15s} "
                     f"{r['pct_roofline']:6.1f} {r.get('pct_weights_roofline', float('nan')):7.1f} {x:>7s}")
    if any(r["path"] != ROOFLINE and round(max(r["pct_roofline"], r.get("pct_weights_roofline", 0) or 0), 1) > 100
           for r in out["rows"]):
        lines.append(BENCH_ROOF_NOTE)
    if out.get("ttft"):
        lines += ["", "time to first token (the prompt, then the first new token)",
                  f"{'path':34s} {'prompt':>6s} {'ms':>9s} {'spread':>17s} {'× HF':>7s}"]
        for r in out["ttft"]:
            sp = f"{r['spread'][0]:.1f}–{r['spread'][1]:.1f}"
            x = f"{r['hf_speedup']:.2f}" if "hf_speedup" in r else ""
            lines.append(f"{r['path']:34s} {r['prompt']:6d} {r['ms']:9.1f} {sp:>17s} {x:>7s}  {r['note']}")
    return "\n".join(lines)


def format_ab(results: dict, positions) -> str:
    """scripts/ab.py's summary: one line per variant ({name: its row}: passed, tok_s@POS, resources), its tok/s at
    each position and the change against the first variant, in columns that line up."""
    names = list(results)
    base = results[names[0]] if names else {}
    w = max([8] + [len(n) for n in names])
    head = f"{'variant':{w}s} {'verify':6s}" + "".join(f" {f'tok/s @{p}':>12s} {'vs first':>8s}" for p in positions)
    lines = [head + f" {'regs':>5s} {'local B':>7s}"]
    for name in names:
        row = results[name]
        line = f"{name:{w}s} {'PASS' if row.get('passed') else 'FAIL':6s}"
        for p in positions:
            v, b = row.get(f"tok_s@{p}"), base.get(f"tok_s@{p}")
            line += f" {f'{v:,.0f}' if v else '—':>12s}"
            line += f" {signed(100 * (v / b - 1), 1, '%') if v and b else '—':>8s}"
        res = row.get("resources") or {}
        line += f" {res.get('registers', '—')!s:>5s} {res.get('local_bytes', '—')!s:>7s}"
        lines.append(line)
    return "\n".join(lines)


def main(model: str, tokens: int, repeats: int, json_path: str | None, no_torch: bool, no_hf: bool,
         positions=None, ttft=(), no_compile: bool = False, options=(), first_token=("prefill",)) -> int:
    out = run_bench(model, tokens=tokens, repeats=repeats, torch_paths=not no_torch, hf=not no_hf,
                    positions=positions, ttft=ttft, compiled=not no_compile, options=options,
                    first_token=first_token)
    print(format_rows(out))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if "error" in out else 0

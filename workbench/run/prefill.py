"""The prompt as matrix products (issue: time to first token). Every prompt token goes through each stage at once,
layer by layer: the plan's own stage math (workbench.check.reference.run_stage, one row per token) on whatever
array module holds the prepared weights, so on the GPU every projection is one CuPy matrix product (cuBLAS, TF32).
Attention is causal over everything cached before a row: on an NVIDIA GPU one flash-style kernel on the tensor
cores (kernels/prefill/attention.cuh, whose scores never leave the registers), elsewhere the reference's blocked
attention. Rows go in chunks, which bound the activations' memory for long prompts. The keys and values land in
the monokernel's cache ([L, Hkv, max_seq, hd], bf16 bits), so the kernel continues at the position after the
prompt and never replays it.

    pre = prefill(p, prompt[:-1], k_cache, v_cache)     # positions 0 .. n-2 cached
    mk.generate(prompt[-1:], max_new, pos0=len(prompt) - 1)

The last prompt token is left to the kernel: its first step samples the first new token with the kernel's own
sampler, so a prefilled run and a replayed one choose alike. check_prefill compares the cache and the last
logits with an unchunked fp64 run of the same math on the same weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time

import numpy as np

from .. import plan
from ..model.weights import Prepared, to_bf16, to_f32

# Rows per chunk: each projection is a [rows, K] × [K, N] product, large enough to run cuBLAS near its peak, and a
# chunk's activations stay a few hundred MB for the 8B.
PREFILL_CHUNK = 2048


@dataclasses.dataclass
class Prefilled:
    n: int                     # tokens prefilled, at positions pos0 .. pos0 + n - 1
    pos0: int
    logits: np.ndarray         # [V] float32, of the last prefilled token (what the next position would be fed by)
    seconds: float             # wall time, the GPU synchronised
    chunks: int


def prefill_bytes(cfg, n_ctx: int, chunk: int, dtype=np.float32) -> int:
    """Device memory a prefill needs beside the weights and the kernel's cache: the math's own cache of the
    context, in `dtype`; the residual of every prompt row (and its copy as the chunks are joined after a layer);
    one chunk's activations (a few live at once); one layer's weights in `dtype` (the view converts a layer at a
    time); and attention's score block (stages.SCORE_ELEMENTS: the product's output, softmaxed in place, and the
    product's workspace)."""
    from ..check.stages import SCORE_ELEMENTS
    item = np.dtype(dtype).itemsize
    cache = 2 * cfg.n_layers * cfg.n_kv_heads * n_ctx * cfg.head_dim * item
    residual = 2 * n_ctx * cfg.hidden * item
    rows = 4 * chunk * (cfg.qkv_rows + 2 * cfg.intermediate + 4 * cfg.hidden) * item
    layer = (cfg.qkv_rows * cfg.hidden + cfg.hidden * cfg.q_dim + 3 * cfg.intermediate * cfg.hidden) * item
    tables = 2 * cfg.vocab * cfg.hidden * item          # the embedding and the LM head, converted whole
    one_layer = 2 * cfg.n_kv_heads * n_ctx * cfg.head_dim * 4   # the bf16 write's temporaries, a layer at a time
    return cache + residual + rows + layer + tables + one_layer + 2 * SCORE_ELEMENTS * item


def _memory_problem(cfg, n_ctx, chunk, dtype, xp) -> str | None:
    if not hasattr(xp, "cuda"):
        return None
    from .runtime import free_device_bytes
    free = free_device_bytes(xp)
    need = prefill_bytes(cfg, n_ctx, chunk, dtype)
    if need <= free:
        return None
    return (f"prefilling {n_ctx} positions of {cfg.name} needs {need / 1e9:.2f} GB of GPU memory beside the weights "
            f"and the kernel's cache, and {free / 1e9:.2f} GB are free: a shorter prompt or a smaller chunk")


# ---- attention on the tensor cores (kernels/prefill/attention.cuh) -------------------------------------------------

FLASH_THREADS = 128          # four warps of 16 query rows, and so 64 rows a block: the kernel's static_asserts
FLASH_ROWS = 64              # hold both to its tile


def flash_source(head_dim: int) -> str:
    """The prefill attention kernel's source for one head_dim: the portability layer, then the kernel, both from
    the kernels in use, or both from the shipped ones for a workspace copied before the kernel existed."""
    from .. import paths
    k = paths.kernels_dir()
    if not (k / "prefill" / "attention.cuh").is_file():
        k = paths.template_dir()
    return (f"#define WB_HD {head_dim}\n#define WB_THREADS {FLASH_THREADS}\n#define WB_PA_ROWS {FLASH_ROWS}\n"
            + (k / "portability.cuh").read_text() + (k / "prefill" / "attention.cuh").read_text())


def flash_supported(cfg, xp, dtype) -> bool:
    """The kernel takes fp32 rows on an NVIDIA GPU, head_dim a multiple of 16 up to 128; else the reference's
    attention runs (cuBLAS products, fused softmax)."""
    if not (hasattr(xp, "cuda") and np.dtype(dtype) == np.float32 and cfg.head_dim % 16 == 0 and cfg.head_dim <= 128):
        return False
    # bf16 mma.sync is sm_80's and later; the portability header has it on NVIDIA only
    return not xp.cuda.runtime.is_hip and int(xp.cuda.Device().compute_capability) >= 80


_FLASH: dict = {}


def _flash_kernel(head_dim: int):
    import cupy
    src = flash_source(head_dim)
    if _FLASH.get(head_dim, (None,))[0] != src:            # an edited kernel file is compiled again
        _FLASH[head_dim] = (src, cupy.RawModule(code=src, options=("--std=c++17",)).get_function("prefill_attention"))
    return _FLASH[head_dim][1]


def flash_attention(q, k_layer, v_layer, positions, n_heads: int, kernel=None):
    """o [n, Hq·hd] of queries q [n, Hq·hd] (fp32, RoPE applied) over one layer's cache k_layer, v_layer
    [Hkv, n_ctx, hd] (fp32 holding bf16 values), row i over keys 0..positions[i]: what stages.attention_decode
    computes, in one kernel (kernels/prefill/attention.cuh, which argues its precision). `kernel`: the compiled
    one for this head_dim, if the caller holds it (else it is looked up from the source on disk)."""
    import cupy
    n_kv, n_ctx, hd = k_layer.shape
    n = q.shape[0]
    if q.shape != (n, n_heads * hd) or n_heads % n_kv or v_layer.shape != k_layer.shape:
        raise ValueError(f"q {q.shape}, k {k_layer.shape}, v {v_layer.shape}: expected q [n, {n_heads}·hd] over "
                         f"[Hkv, n_ctx, hd] caches, Hkv dividing {n_heads}")
    if any(a.dtype != cupy.float32 for a in (q, k_layer, v_layer)):
        raise TypeError("the prefill's attention kernel takes float32 queries, keys and values")
    q, k_layer, v_layer = (cupy.ascontiguousarray(a) for a in (q, k_layer, v_layer))
    pos = cupy.ascontiguousarray(cupy.asarray(positions, dtype=cupy.int64).reshape(-1))
    if pos.size != n:
        raise ValueError(f"{n} query rows but {pos.size} positions")
    if n and int(pos.max()) >= n_ctx:
        raise ValueError(f"position {int(pos.max())} is not in a cache of {n_ctx} positions")
    out = cupy.empty_like(q)
    if n == 0:
        return out
    (kernel or _flash_kernel(hd))(((n + FLASH_ROWS - 1) // FLASH_ROWS, n_heads), (FLASH_THREADS,),
                      (q, k_layer, v_layer, pos, out, np.int32(n), np.int32(n_ctx), np.int32(n_heads),
                       np.int32(n_heads // n_kv), np.float32(hd ** -0.5)))
    return out


@contextlib.contextmanager
def _tf32(xp, on: bool):
    """fp32 matrix products on the tensor cores in TF32 while the prefill runs, the process's setting restored
    after (CuPy's is global, and verification's own products must stay fp32). The weights are bf16 values, which
    TF32's 10-bit mantissa holds exactly; only the activations are rounded, to 2⁻¹¹, before each product (fp32
    accumulation), against the 2⁻⁸ at most (2⁻⁹ typically) of the bf16 cache every key and value is rounded to
    anyway."""
    if not on or not hasattr(xp, "cuda"):
        yield
        return
    from cupy._core import _routines_linalg as L
    before = L.get_compute_type(np.float32)
    L.set_compute_type(np.float32, L.COMPUTE_TYPE_TF32)
    try:
        yield
    finally:
        L.set_compute_type(np.float32, before)


def _sync(xp):
    if hasattr(xp, "cuda"):
        xp.cuda.get_current_stream().synchronize()


def prefill(p: Prepared, tokens, k_cache, v_cache, *, pos0: int = 0, chunk: int = PREFILL_CHUNK,
            dtype=np.float32, tf32: bool = True, flash: bool = True, timings: dict | None = None) -> Prefilled:
    """Feed `tokens` at positions pos0.. through every layer, chunk by chunk, writing their keys and values into
    k_cache / v_cache (the kernel's: bf16 bits [L, Hkv, max_seq, hd], positions < pos0 already filled). Returns the
    last token's logits. On the GPU the fp32 products run in TF32 unless tf32=False (see _tf32), and attention in
    the prefill's kernel unless flash=False or the shapes are not its (flash_supported). `timings`, a dict, gets
    the seconds of each stage over all layers and chunks, of converting the weights and of writing the cache (the
    GPU synchronised around each, which costs a little). Raises ValueError for an empty prompt, tokens outside
    the vocabulary, or positions past the cache."""
    from ..check.reference import KVCache, run_stage, view
    cfg, xp = p.cfg, p.xp
    tokens = xp.asarray(tokens).reshape(-1)
    n = int(tokens.size)
    if n == 0:
        raise ValueError("nothing to prefill: the prompt has no tokens before its last")
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got {tokens.dtype}")
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    want = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(c.shape) != want or c.dtype != xp.uint16:
            raise ValueError(f"{name} is {c.dtype} {tuple(c.shape)}; the kernel's cache is bf16 bits (uint16) {want}")
    end = pos0 + n
    if pos0 < 0 or end > cfg.max_seq:
        raise ValueError(f"positions {pos0}..{end - 1} do not fit the KV cache of {cfg.max_seq} positions")
    problem = _memory_problem(cfg, end, min(chunk, n), dtype, xp)
    if problem:
        from ..errors import GpuMemoryError
        raise GpuMemoryError(problem)
    t0 = time.perf_counter()
    # the math's cache holds the context only (not max_seq), in the compute precision; bf16 values, as the
    # kernel's are (run_stage rounds what it stores)
    ctx = dataclasses.replace(p, cfg=dataclasses.replace(cfg, max_seq=end))
    work = KVCache.empty(ctx.cfg, dtype, xp)
    if pos0:
        work.k[:, :, :pos0] = to_f32(k_cache[:, :, :pos0], xp)
        work.v[:, :, :pos0] = to_f32(v_cache[:, :, :pos0], xp)
    w = view(ctx, dtype)
    positions = xp.arange(pos0, end)
    bounds = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    state: dict = {}
    from ..check.stages import attention_decode_io
    # the stage whose math the kernel computes is the one the plan gives stages.attention_decode's binding; its
    # source is read (and compiled when it changed) once per prefill, not per layer and chunk
    attend = _flash_kernel(cfg.head_dim) if flash and flash_supported(cfg, xp, dtype) else None

    @contextlib.contextmanager
    def clock(what: str):
        if timings is None:
            yield
            return
        _sync(xp)
        t = time.perf_counter()
        yield
        _sync(xp)
        timings[what] = timings.get(what, 0.0) + time.perf_counter() - t
    with _tf32(xp, tf32 and np.dtype(dtype) == np.float32):
        # layer by layer over every chunk, so each layer's weights are converted once; within a layer the chunks
        # go in order, so each chunk's attention finds every earlier chunk's keys and values of that layer cached
        for layer, stages in itertools.groupby(plan.execution(cfg), key=lambda e: e[1]):
            names = [name for name, _ in stages if plan.stage(name).reference is not None]
            if layer < 0 and "x" in state:                  # after the layers: the LM head on the last row only
                last = {"x": state["x"][n - 1:]}
                for name in names:
                    with clock(name):
                        run_stage(w, name, layer, last, work, positions[n - 1:], tokens[n - 1:], True)
                logits = last["logits"][0]
                continue
            if layer >= 0:
                with clock("(weights to fp32)"):
                    w.layer("wo", layer)                        # the view converts the whole layer on first use
            x_next = None
            for a, b in bounds:
                st = {"x": state["x"][a:b]} if "x" in state else {}
                for name in names:
                    with clock(name):
                        if attend is not None and plan.stage(name).reference is attention_decode_io:
                            st["o"] = flash_attention(st["q"], work.k[layer], work.v[layer], positions[a:b],
                                                      cfg.n_heads, kernel=attend)
                        else:
                            run_stage(w, name, layer, st, work, positions[a:b], tokens[a:b], True)
                if x_next is None:
                    x_next = xp.empty((n, st["x"].shape[1]), dtype=st["x"].dtype)
                x_next[a:b] = st["x"]
                del st                                  # only the residual outlives its chunk
            state = {"x": x_next}
    chunks = len(bounds)
    with clock("(cache to bf16)"):
        for layer in range(cfg.n_layers):        # a layer at a time: the conversion's temporaries stay small
            k_cache[layer, :, pos0:end] = to_bf16(work.k[layer, :, pos0:end], xp)
            v_cache[layer, :, pos0:end] = to_bf16(work.v[layer, :, pos0:end], xp)
    _sync(xp)
    seconds = time.perf_counter() - t0
    logits = logits.get() if hasattr(logits, "get") else np.asarray(logits)
    return Prefilled(n, pos0, logits.astype(np.float32), seconds, chunks)


@dataclasses.dataclass
class PrefillCheck:
    """The prefill's cache and last logits against an unchunked fp64 run of the same math."""
    k_rel: list                # [L] relative L2 error of each layer's keys (the prefilled positions)
    v_rel: list
    logits_rel: float
    finite: bool
    rtol: float

    @property
    def passed(self) -> bool:
        worst = max(self.k_rel + self.v_rel + [self.logits_rel])
        return self.finite and worst <= self.rtol

    def summary(self) -> str:
        if not self.finite:
            return "prefill: FAILED: NaN or inf in the cache or the logits"
        lk, lv = int(np.argmax(self.k_rel)), int(np.argmax(self.v_rel))
        verdict = "passed" if self.passed else "FAILED"
        return (f"prefill {verdict}: worst rel err keys {self.k_rel[lk]:.1e} (layer {lk}), values {self.v_rel[lv]:.1e} "
                f"(layer {lv}), last logits {self.logits_rel:.1e} (tol {self.rtol:.0e})")


def check_prefill(p: Prepared, tokens, pre: Prefilled, k_cache, v_cache, rtol: float | None = None) -> PrefillCheck:
    """Compare what prefill wrote (positions 0 .. pre.n - 1, from pos0 = 0) and its last logits with one unchunked
    fp64 forward of the same tokens on the same weights. The tolerance is the end-to-end one (verify.DEFAULT_RTOL):
    the prefill computes in fp32 and rounds every layer's keys and values to bf16, as the decode path does, and a
    rounding that falls the other way in one layer moves every later one a little; a wrong stage, chunk or layout
    is off by far more (a wrong row is off by its own size)."""
    from ..check.reference import KVCache, forward
    from ..check.verify import DEFAULT_RTOL
    if pre.pos0 != 0:
        raise ValueError("check_prefill checks a prefill from position 0")
    rtol = DEFAULT_RTOL if rtol is None else rtol
    cfg, xp = p.cfg, p.xp
    ctx = dataclasses.replace(p, cfg=dataclasses.replace(cfg, max_seq=pre.n))
    ref = KVCache.empty(ctx.cfg, np.float64, xp)
    want = forward(ctx, xp.asarray(tokens).reshape(-1)[:pre.n], cache=ref, kv_bf16=True, dtype=np.float64,
                   logit_rows=[pre.n - 1])[0]

    def rel(a, b, m=xp):
        a, b = a.astype(m.float64), b.astype(m.float64)
        return float(m.linalg.norm(a - b) / max(float(m.linalg.norm(b)), 1e-300))
    k = to_f32(k_cache[:, :, :pre.n], xp)
    v = to_f32(v_cache[:, :, :pre.n], xp)
    finite = bool(xp.isfinite(k).all()) and bool(xp.isfinite(v).all()) and bool(np.isfinite(pre.logits).all())
    k_rel = [rel(k[l], ref.k[l]) if finite else math.inf for l in range(cfg.n_layers)]
    v_rel = [rel(v[l], ref.v[l]) if finite else math.inf for l in range(cfg.n_layers)]
    want = want.get() if hasattr(want, "get") else np.asarray(want)
    logits_rel = rel(np.asarray(pre.logits), want, np) if finite else math.inf
    return PrefillCheck(k_rel, v_rel, logits_rel, finite, rtol)

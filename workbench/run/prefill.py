"""The prompt as matrix products (issue: time to first token). Every prompt token goes through each stage at once,
layer by layer, in the plan's order. On an NVIDIA GPU each stage runs on the prefill's own path
(workbench.run.prefill_gpu): bf16 products on the tensor cores between fused row-wise kernels, with causal
attention in one flash-style kernel, straight from and into the monokernel's bf16 cache. Elsewhere (the CPU, AMD,
fp64, or a plan with a layer stage that path lacks) the plan's own stage math runs (workbench.reference.run_stage,
one row per token) on whatever array module holds the prepared weights. Rows go in chunks, which bound
the activations' memory for long prompts. The keys and values land in the monokernel's cache ([L, Hkv, max_seq,
hd], bf16 bits), so the kernel continues at the position after the prompt and never replays it.

    pre = prefill(p, prompt, k_cache, v_cache, token=True, logits=False)   # positions 0 .. n-1 cached
    mk.generate([pre.token], max_new - 1, pos0=len(prompt))                  # pre.token is the first new token

or, with a sampler that draws (FIRST_TOKEN "kernel"), the last prompt token left to the kernel, whose first step
samples the first new token with the kernel's own sampler and its own draws:

    pre = prefill(p, prompt[:-1], k_cache, v_cache, logits=False)           # positions 0 .. n-2 cached
    mk.generate(prompt[-1:], max_new, pos0=len(prompt) - 1)

The greedy first token is the first largest of the prefill's last logits, the sampler's greedy mode
(stage_math.greedy) on the LM head's output for that row: the decode step's own math, at the prefill's precision.
It saves the time to first token a whole kernel step and its launch (one H100, 4k prompt: 2.49 ms of 23.9) and
is what HF's time to first token is too (its prefill's last logits, argmax). workbench.check.prefill compares
the cache, the last logits and that token with an unchunked fp64 run of the same math on the same weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import time

import numpy as np

from .. import plan, schedule
from ..errors import GpuMemoryError, NonFiniteError
from ..model import stage_math as S
from ..model.weights import Prepared, to_bf16, to_f32
from ..reference import KVCache, run_stage, view
from . import prefill_gpu as G

# Rows per chunk: each projection is a [rows, K] × [K, N] product, large enough to run cuBLAS near its peak, and a
# chunk's activations stay under a GB for the 8B (fit_chunk halves it where the GPU's memory is short). 4,096
# against 2,048: a 4k prompt in one chunk, half the launches and one attention grid, 22.69 → 21.73 ms on the 1B in
# bf16 (one H100, scripts/prefill_profile.py), 32k unchanged (449 ms both).
PREFILL_CHUNK = 4096

# Who chooses the first new token after a prefill: "prefill", its last logits' first largest (greedy only: the
# kernel's draws are keyed by its own steps); "kernel", the kernel's first step from the prompt's last token.
FIRST_TOKEN = ("prefill", "kernel")


def prefill_part(prompt, first: str):
    """What the prefill takes of a prompt when `first` (FIRST_TOKEN) chooses the first new token: the whole prompt
    for the prefill's own choice, all but its last token for the kernel's first step; ValueError for another."""
    if first not in FIRST_TOKEN:
        raise ValueError(f"first token by {first!r}: one of {', '.join(FIRST_TOKEN)}")
    return prompt if first == "prefill" else prompt[:-1]


@dataclasses.dataclass
class Prefilled:
    n: int                     # tokens prefilled, at positions pos0 .. pos0 + n - 1
    pos0: int
    logits: np.ndarray | None  # [V] float32, of the last prefilled token (what the next position would be fed by);
    #                            None where prefill(..., logits=False) left the LM head to the kernel's first step
    seconds: float             # wall time of the call, the GPU synchronised
    chunks: int
    precision: str = "fp32"    # of the products (prefill_gpu.PRECISIONS)
    token: int | None = None   # the first largest of the last logits (prefill(..., token=True)): the greedy next token


def prefill_bytes(cfg, n_ctx: int, chunk: int, dtype=np.float32, gpu: bool = False, rows: int | None = None) -> int:
    """Device memory a prefill of `rows` prompt rows (all n_ctx of the context unless given: the rest were cached
    before) needs beside the weights and the kernel's cache. Both paths: the residual of every prompt row, twice (a
    layer's input and its output). The GPU path (prefill_gpu) beside it: one chunk's
    activations (the products' fp32 outputs, their split bf16 inputs, the residual's copies; a few live at once),
    and nothing else, since it reads the weights and writes the cache as they are. The interpreter's instead: its
    own cache of the context in `dtype`, one chunk's activations, one layer's weights in `dtype` (the view converts
    a layer at a time), the embedding and the LM head converted whole, the bf16 write's temporaries, and
    attention's score block (stage_math.SCORE_ELEMENTS: the product's output, softmaxed in place, and the product's
    workspace)."""
    rows = n_ctx if rows is None else rows
    if gpu:
        return 2 * rows * cfg.hidden * 4 + 2 * chunk * (4 * cfg.qkv_rows + 8 * cfg.q_dim + 12 * cfg.intermediate
                                                         + 16 * cfg.hidden)
    item = np.dtype(dtype).itemsize
    residual = 2 * rows * cfg.hidden * item
    cache = 2 * cfg.n_layers * cfg.n_kv_heads * n_ctx * cfg.head_dim * item
    activations = 4 * chunk * (cfg.qkv_rows + 2 * cfg.intermediate + 4 * cfg.hidden) * item
    layer = (cfg.qkv_rows * cfg.hidden + cfg.hidden * cfg.q_dim + 3 * cfg.intermediate * cfg.hidden) * item
    tables = 2 * cfg.vocab * cfg.hidden * item          # the embedding and the LM head, converted whole
    one_layer = 2 * cfg.n_kv_heads * n_ctx * cfg.head_dim * 4   # the bf16 write's temporaries, a layer at a time
    return cache + residual + activations + layer + tables + one_layer + 2 * S.SCORE_ELEMENTS * item


def free_device_bytes(cp) -> int:
    """What the current GPU can still give this process: the driver's free memory and CuPy's cached free blocks."""
    return cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()


# the fewest rows a chunk is cut to where memory is short: below this the products run far from cuBLAS's peak, and
# the residual of every prompt row (which no chunk size shrinks) is most of what a long prompt needs anyway
MIN_CHUNK = 128


def fit_chunk(cfg, n_ctx: int, rows: int, chunk: int, dtype, gpu: bool, free: int) -> tuple[int, str | None]:
    """The chunk the prefill runs with in `free` bytes: `chunk` (at most the rows) if it fits, else halved until it
    does, down to MIN_CHUNK → (chunk, None); or (chunk, why not) when even MIN_CHUNK does not fit."""
    c = max(1, min(chunk, rows))
    while prefill_bytes(cfg, n_ctx, c, dtype, gpu, rows) > free and c > MIN_CHUNK:
        c = max(MIN_CHUNK, c // 2)
    need = prefill_bytes(cfg, n_ctx, c, dtype, gpu, rows)
    if need <= free:
        return c, None
    return c, (f"prefilling {n_ctx} positions of {cfg.name} needs {need / 1e9:.2f} GB of GPU memory beside the "
               f"weights and the kernel's cache (in chunks of {c} rows), and {free / 1e9:.2f} GB are free: a shorter "
               f"prompt, or a shorter --max-seq (the kernel's cache)")


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
            dtype=np.float32, tf32: bool = True, gpu: bool = True, timings: dict | None = None,
            precision: str = "fp32", logits: bool = True, token: bool = False, mlp_bf16: bool = False) -> Prefilled:
    """Feed `tokens` at positions pos0.. through every layer, chunk by chunk, writing their keys and values into
    k_cache / v_cache (the kernel's: bf16 bits [L, Hkv, max_seq, hd], positions < pos0 already filled). Returns the
    last token's logits. On an NVIDIA GPU the prefill's own path runs (prefill_gpu) unless gpu=False; otherwise
    the interpreter's, whose fp32 products run in TF32 on a GPU unless tf32=False (see _tf32). `timings`, a dict,
    gets the seconds of each stage over all layers and chunks (and on the interpreter's path, of converting the
    weights and of writing the cache), the GPU synchronised around each, which costs a little. `precision`: of the
    prefill's own path's products (prefill_gpu.PRECISIONS); "bf16" runs on that path only. `logits=False`: the
    LM head and the sampler are not run on the last row (Prefilled.logits None), for a caller whose kernel step
    computes the first token itself (a time to first token; a check needs them). `token=True`: the token stages
    run and Prefilled.token is the greedy next token, read back alone (the logits stay on the GPU unless `logits`).
    Raises ValueError for an empty prompt, tokens outside the vocabulary, positions past the cache, or a precision
    the path taken does not have; NonFiniteError where the token is asked for and the last logits are not finite
    (no token is chosen from NaN). `mlp_bf16` (the bf16 precision only): gate_up's product is rounded to bf16
    before silu·up, as HF's bf16 prefill rounds every product, which halves that product's output bytes and the
    next kernel's read; an option being measured (NOTES.md round 37), not a precision with an argued bound."""
    # from the call: the prompt's conversion to the GPU and the checks grow with its length (at 32k, 2 ms that a
    # time to first token had put on the kernel's first step)
    t0 = time.perf_counter()
    cfg, xp = p.cfg, p.xp
    if precision not in G.PRECISIONS:
        raise ValueError(f"precision {precision!r}: the prefill has {', '.join(G.PRECISIONS)}")
    # a prompt from the host (a list, a numpy array) is checked there, before it travels: on the GPU the check is
    # a read back, a wait for the copy and the reductions before the first layer's kernels can be queued
    on_host = not hasattr(tokens, "__cuda_array_interface__")
    host = np.asarray(tokens).reshape(-1) if on_host else None
    tokens = xp.asarray(tokens if host is None else host).reshape(-1)
    n = int(tokens.size)
    if n == 0:
        raise ValueError("nothing to prefill: the prompt has no tokens before its last")
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got {tokens.dtype}")
    if host is not None:
        G.check_tokens(host, cfg.vocab)
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    try:
        pos0 = operator.index(pos0)              # a float 5.0 would become positions no kernel should index with
    except TypeError:
        raise TypeError(f"pos0 must be an integer, got {pos0!r}") from None
    want = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(c.shape) != want or c.dtype != xp.uint16:
            raise ValueError(f"{name} is {c.dtype} {tuple(c.shape)}; the kernel's cache is bf16 bits (uint16) {want}")
        if not c.flags.c_contiguous:
            raise ValueError(f"{name} is not contiguous: the kernel's cache is one block [L, Hkv, max_seq, hd]")
    end = pos0 + n
    if pos0 < 0 or end > cfg.max_seq:
        raise ValueError(f"positions {pos0}..{end - 1} do not fit the KV cache of {cfg.max_seq} positions")
    gpu = gpu and G.flash_supported(cfg, xp, dtype) and G.covers(cfg)
    if mlp_bf16 and precision != "bf16":
        raise ValueError(f"mlp_bf16 rounds gate_up's product in the bf16 precision; this prefill is {precision}")
    if precision != "fp32" and not gpu:
        # the interpreter computes in `dtype` throughout: it has no bf16 activations to round, and would pass
        # what a user asked for as bf16 off as fp32
        raise ValueError(f"the {precision} prefill runs on the NVIDIA GPU path only (bf16 products through "
                         f"cuBLAS); here the prefill interprets the plan's math in {np.dtype(dtype).name}")
    if hasattr(xp, "cuda"):                  # chunks cut to the GPU's memory: a long prompt runs in smaller ones
        chunk, problem = fit_chunk(cfg, end, n, chunk, dtype, gpu, free_device_bytes(xp))
        if problem:
            raise GpuMemoryError(problem)
    positions = xp.arange(pos0, end, dtype=xp.int64)
    clock = _clock(xp, timings)
    last_row = logits or token
    if gpu:
        if host is None:
            G.check_tokens(tokens, cfg.vocab)
        out = _prefill_gpu(p, tokens, positions, k_cache, v_cache, chunk, clock, G.PRECISIONS[precision], pos0,
                           last_row, mlp_bf16)
    else:
        with _tf32(xp, tf32 and np.dtype(dtype) == np.float32):
            out = _prefill_interpreted(p, tokens, positions, k_cache, v_cache, chunk, dtype, clock, last_row)
    chosen = _first_token(xp, out) if token else None        # the read back waits for the whole prefill
    _sync(xp)
    seconds = time.perf_counter() - t0
    host = None
    if logits:
        lg = out["logits"][0]
        host = (lg.get() if hasattr(lg, "get") else np.asarray(lg)).astype(np.float32)
    return Prefilled(n, pos0, host, seconds, len(range(0, n, chunk)), precision, chosen)


def _first_token(xp, last: dict) -> int:
    """The plan's sampler stage's choice for the last row (its reference: the greedy first largest), read back
    with the logits' finiteness in one copy; NonFiniteError if any logit is NaN or infinite, as the kernel's
    sampler stops on one."""
    logits = last["logits"][0]
    both = xp.stack([xp.asarray(last["sampled"]).reshape(-1)[0].astype(xp.int64),
                     xp.isfinite(logits).all().astype(xp.int64)])
    tok, finite = (int(v) for v in (both.get() if hasattr(both, "get") else both))
    if not finite:
        raise NonFiniteError("the prefill's last logits are not finite (NaN or inf): no first token is chosen "
                                 "from them; check_prefill names the layer whose cache went wrong")
    return tok


def _clock(xp, timings):
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
    return clock


def _layers(cfg, xp, n: int, chunk: int, run, clock, before_layer=None, last_row: bool = True):
    """The plan's stages layer by layer over every chunk of rows, so each layer's weights are read (or converted)
    once; within a layer the chunks go in order, so each chunk's attention finds every earlier chunk's keys and
    values of that layer cached. run(name, layer, state, a, b) runs one stage on rows a..b−1, updating state;
    only the residual outlives its chunk. After the layers, the token stages run on the last row alone. Returns
    the last row's state (its logits, the sampler's choice); with last_row=False the token stages do not run and
    None is returned (the kernel's first step computes the first token from the last row again)."""
    bounds = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    state: dict = {}
    for layer, stages in itertools.groupby(schedule.execution(cfg), key=lambda e: e[1]):
        names = [name for name, _ in stages if plan.stage(name).reference is not None]
        if layer < 0 and "x" in state:                  # after the layers: the LM head on the last row only
            if not last_row:
                return None
            last = {"x": state["x"][n - 1:]}
            for name in names:
                with clock(name):
                    run(name, layer, last, n - 1, n)
            return last
        if layer >= 0 and before_layer is not None:
            before_layer(layer)
        x_next = None
        for a, b in bounds:
            st = {"x": state["x"][a:b]} if "x" in state else {}
            for name in names:
                with clock(name):
                    run(name, layer, st, a, b)
            if x_next is None:               # the GPU path adds onto the residual in its own rows (prefill_gpu.project)
                in_place = "x" in state and _same(st["x"], state["x"][a:b])
                x_next = state["x"] if in_place else xp.empty((n, st["x"].shape[1]), dtype=st["x"].dtype)
            if not _same(st["x"], x_next[a:b]):
                x_next[a:b] = st["x"]
            del st
        state = {"x": x_next}
    raise ValueError("the plan has no LM head after its layers")


def _same(a, b) -> bool:
    """Whether two arrays are one view of the same memory."""
    def where(x):
        return x.data.ptr if hasattr(x.data, "ptr") else x.__array_interface__["data"][0]
    return a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype and where(a) == where(b)


def _prefill_gpu(p: Prepared, tokens, positions, k_cache, v_cache, chunk: int, clock, halves: int, pos0: int,
                 last_row: bool = True, mlp_bf16: bool = False):
    """The prefill's own path (prefill_gpu): each stage's implementation found through its math; a token stage
    without one (the sampler) runs its reference's math on the last row's logits."""
    layer_kernels = G.module(G.layer_source())
    import cupy
    # the kernel and the grid it is launched with, together
    layout = G.flash_layout(p.cfg.head_dim, halves, cupy.cuda.Device().compute_capability)
    # the attention's queries and probabilities in the products' halves: one precision for the whole prefill
    attend = (G.flash_kernel(p.cfg.head_dim, layout, halves), layout)
    w = view(p, np.float32)                             # converts nothing until a stage without one reads weights
    # what each stage may write, from the plan: an implementation's outputs are checked against it
    declared = {s.name: {u.buffer for u in s.writes if u.active(p.cfg)} for s in plan.STAGES}

    def run(name, layer, st, a, b):
        impl = G.implementation(plan.stage(name))
        if impl is None:
            run_stage(w, name, layer, st, None, positions[a:b], tokens[a:b], True)
            return
        out = impl(G.PrefillIO(p, layer, positions[a:b], tokens[a:b], k_cache, v_cache, layer_kernels, attend,
                               halves, (pos0 + a, pos0 + b - 1), mlp_bf16), st)
        undeclared = set(out) - declared[name]
        if undeclared:                            # the plan says what a stage writes, on this path too
            raise RuntimeError(f"the prefill's {name} wrote {sorted(undeclared)}, which the plan's {name} does not")
        st.update(out)
    return _layers(p.cfg, p.xp, int(tokens.size), chunk, run, clock, last_row=last_row)


def _prefill_interpreted(p: Prepared, tokens, positions, k_cache, v_cache, chunk: int, dtype, clock,
                         last_row: bool = True):
    """The plan's own stage math (run_stage) on a weight view in `dtype`, over its own cache of the context in
    `dtype` (bf16 values, as the kernel's are: run_stage rounds what it stores), written into the kernel's cache
    at the end."""
    cfg, xp = p.cfg, p.xp
    pos0, end = int(positions[0]), int(positions[-1]) + 1
    ctx = dataclasses.replace(p, cfg=dataclasses.replace(cfg, max_seq=end))
    work = KVCache.empty(ctx.cfg, dtype, xp)
    if pos0:
        work.k[:, :, :pos0] = to_f32(k_cache[:, :, :pos0], xp)
        work.v[:, :, :pos0] = to_f32(v_cache[:, :, :pos0], xp)
    w = view(ctx, dtype)

    def convert(layer):
        with clock("(weights to fp32)"):
            w.layer("wo", layer)                        # the view converts the whole layer on first use

    def run(name, layer, st, a, b):
        run_stage(w, name, layer, st, work, positions[a:b], tokens[a:b], True)
    out = _layers(cfg, xp, int(tokens.size), chunk, run, clock, before_layer=convert, last_row=last_row)
    with clock("(cache to bf16)"):
        for layer in range(cfg.n_layers):        # a layer at a time: the conversion's temporaries stay small
            k_cache[layer, :, pos0:end] = to_bf16(work.k[layer, :, pos0:end], xp)
            v_cache[layer, :, pos0:end] = to_bf16(work.v[layer, :, pos0:end], xp)
    return out

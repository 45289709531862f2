"""What each stage of the plan computes, as reference math, and how close the kernel must come to it.

Each function is plain array code that works on numpy or cupy arrays alike (the module is taken from the
arguments), in whatever float dtype it is given, over a leading batch axis of positions (one row per decode step,
or a whole teacher-forced sequence). Weights are in Hugging Face's layout ([out, in]); the kernel's prepared
layout (folded gains, paired rows) is mapped back to it by the caller (workbench.reference).

The `*_io` functions bind that math to the plan's buffers: each takes a `StageIO` (where the stage's inputs come
from: the kernel's own taps when checking the kernel stage by stage, or the running state of the reference
interpreter) and returns the stage's outputs by buffer name; the plan names each stage's one (plan.Stage.reference),
with the tolerances its outputs are held to (the `Tolerance` constants here, each with its argument).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


def xp_of(*arrays):
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            import cupy
            return cupy
    return np


def check_shape(name: str, a, *shape: int):
    """numpy would broadcast or silently truncate many mismatches; the references refuse them by name."""
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {shape}")


# ---- the math -------------------------------------------------------------------------------------------------

def rmsnorm(x, gain, eps: float):
    """x / sqrt(mean(x²) + eps) · gain over the last axis, in x's dtype (eps stays a Python float)."""
    xp = xp_of(x)
    return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + float(eps))) * gain


def silu(a):
    """a·sigmoid(a). exp(-a) overflows to inf for very negative a, which correctly gives -0: not worth a warning."""
    xp = xp_of(a)
    with np.errstate(over="ignore"):
        return a / (1.0 + xp.exp(-a))


def rope(a, cos, sin):
    """Rotate-half RoPE on every head of [..., n_heads·hd] with cos/sin [..., hd/2], as HF Llama does: each pair
    (i, i + hd/2) is rotated by angle_i, out_i = a_i·cos_i − a_{i+hd/2}·sin_i, out_{i+hd/2} = a_{i+hd/2}·cos_i +
    a_i·sin_i."""
    xp = xp_of(a)
    half = cos.shape[-1]
    heads = a.reshape(*a.shape[:-1], -1, 2 * half)
    lo, hi = heads[..., :half], heads[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return xp.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1).reshape(a.shape)


def embedding(embed, token):
    """x = embed[token] for each token of the batch. A negative token would silently index from the end in numpy,
    so it is refused."""
    xp = xp_of(embed)
    token = xp.asarray(token).reshape(-1)
    if embed.ndim != 2:
        raise ValueError(f"embed must be [V, D], got shape {embed.shape}")
    if token.size and (int(token.min()) < 0 or int(token.max()) >= embed.shape[0]):
        raise ValueError(f"token ids outside the vocabulary [0, {embed.shape[0]})")
    return embed[token]


def qkv_rope_append(x, wq, wk, wv, gain, cos, sin, eps: float, *, biases=None, qk_gains=None):
    """(q, k, v) = (rope(Wq·h), rope(Wk·h), Wv·h) with h = RMSNorm(x)·gain. Qwen2: `biases` (bq, bk, bv) added to
    the three projections; Qwen3: `qk_gains` (gq, gk), each head of q and of k RMS-normalised over its head_dim
    with that gain before RoPE. The append to the cache (and its rounding to bf16) is the caller's: the reference
    stays pure."""
    D, half = x.shape[-1], cos.shape[-1]
    check_shape("gain", gain, D)
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        if w.ndim != 2 or w.shape[1] != D or w.shape[0] % (2 * half):
            raise ValueError(f"{name} has shape {w.shape}: expected [n_heads·{2 * half}, {D}]")
    if wk.shape != wv.shape:
        raise ValueError(f"wk {wk.shape} and wv {wv.shape} must match")
    h = rmsnorm(x, gain, eps)
    q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
    if biases is not None:
        for name, b, w in zip(("bq", "bk", "bv"), biases, (wq, wk, wv)):
            check_shape(name, b, w.shape[0])
        q, k, v = q + biases[0], k + biases[1], v + biases[2]
    if qk_gains is not None:
        q, k = (head_rmsnorm(a, g, 2 * half, eps, name) for a, g, name in zip((q, k), qk_gains, ("q_norm", "k_norm")))
    return rope(q, cos, sin), rope(k, cos, sin), v


def head_rmsnorm(a, gain, head_dim: int, eps: float, name: str = "gain"):
    """Each head_dim slice of a's last axis RMS-normalised on its own, times `gain` [head_dim] (Qwen3's q/k norm)."""
    check_shape(name, gain, head_dim)
    heads = a.reshape(*a.shape[:-1], -1, head_dim)
    return rmsnorm(heads, gain, eps).reshape(a.shape)


# Attention over a block of query rows materialises scores [Hkv, G·rows, keys]; this caps it at 2^27 elements
# (512 MB in fp32), so a 32k prompt with 32 heads runs in blocks of 128 rows: large enough that each block's two
# batched products run near cuBLAS's peak, small enough that the rows' causal prefixes waste little.
SCORE_ELEMENTS = 1 << 27


def attention_decode(q, k_cache, v_cache, positions):
    """o = softmax(q·Kᵀ/√hd)·V per query head, query i attending to the cached positions 0..positions[i].
    q [n, Hq·hd]; k_cache, v_cache [Hkv, n_ctx, hd] (n_ctx > max(positions)); GQA: query head h reads kv head
    h // (Hq / Hkv). Returns [n, Hq·hd]."""
    xp = xp_of(q, k_cache)
    if k_cache.ndim != 3 or k_cache.shape[1] == 0:
        raise ValueError(f"k_cache must be [Hkv, n_ctx, hd] with n_ctx >= 1, got shape {k_cache.shape}")
    n_kv, n_ctx, hd = k_cache.shape
    check_shape("v_cache", v_cache, n_kv, n_ctx, hd)
    positions = xp.asarray(positions).reshape(-1)
    if q.ndim != 2 or q.shape[0] != positions.size or q.shape[1] % (n_kv * hd):
        raise ValueError(f"q has shape {q.shape}: expected [{positions.size}, Hq·{hd}] with Hq a multiple of {n_kv}")
    if positions.size and int(positions.max()) >= n_ctx:
        raise ValueError(f"position {int(positions.max())} is not in a cache of {n_ctx} positions")
    n = q.shape[0]
    group = q.shape[1] // (n_kv * hd)
    qg = q.reshape(n, n_kv, group, hd)
    out = xp.empty((n, n_kv * group * hd), dtype=q.dtype)
    rows = max(1, min(n, SCORE_ELEMENTS // max(1, n_kv * group * n_ctx)))
    for start in range(0, n, rows):
        end = min(n, start + rows)
        r = end - start
        ctx = int(positions[start:end].max()) + 1
        # each kv head's queries (its group's heads × the block's rows) as one matrix: one batched product each way
        qb = qg[start:end].transpose(1, 2, 0, 3).reshape(n_kv, group * r, hd)
        scores = qb @ k_cache[:, :ctx].transpose(0, 2, 1)                   # [Hkv, G·r, ctx]
        p = causal_softmax(scores.reshape(n_kv * group, r, ctx), positions[start:end], hd ** -0.5)
        o = p.reshape(n_kv, group * r, ctx) @ v_cache[:, :ctx]               # [Hkv, G·r, hd]
        out[start:end] = o.reshape(n_kv, group, r, hd).transpose(2, 0, 1, 3).reshape(r, -1)
    return out


def causal_softmax(scores, last, scale: float):
    """softmax(scale·scores) over the last axis of [B, rows, ctx], row i over its keys 0..last[i] only (0 past
    them), max-subtracted (shift-invariant). On the GPU one fused pass (_causal_softmax_gpu) in place of the five
    whole-array passes the array code makes, which dominated a long prefill; a NaN anywhere in a row's prefix
    makes that row's prefix NaN either way, and its masked keys stay 0."""
    xp = xp_of(scores)
    if xp is not np:
        return _causal_softmax_gpu(scores, last, scale)
    ctx = scores.shape[-1]
    future = np.arange(ctx)[None, :] > np.asarray(last)[:, None]             # [rows, ctx]
    s = np.where(future[None], -np.inf, scores * scale)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p[:, future] = 0                                   # a NaN row's masked keys too, as the GPU's kernel leaves them
    return p


_SOFTMAX_SRC = r"""
template <typename T> __device__ __forceinline__ T wb_exp(T x);
template <> __device__ __forceinline__ float wb_exp<float>(float x) { return expf(x); }
template <> __device__ __forceinline__ double wb_exp<double>(double x) { return exp(x); }
template <typename T> __device__ __forceinline__ T wb_neg_inf();      // NVRTC has no <math.h>, so no INFINITY
template <> __device__ __forceinline__ float wb_neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double wb_neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ull);
}

// x, reduced over the block by op (a NaN survives: fmax drops it, so the max uses a comparison that keeps it)
template <typename T, bool MAX>
__device__ T block_reduce(T x, T* red) {
    for (int o = 16; o; o >>= 1) {
        T y = __shfl_xor_sync(0xffffffffu, x, o);
        x = MAX ? ((y > x || y != y) ? y : x) : x + y;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    if (threadIdx.x < 32) {
        x = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : (MAX ? wb_neg_inf<T>() : T(0));
        for (int o = 16; o; o >>= 1) {
            T y = __shfl_xor_sync(0xffffffffu, x, o);
            x = MAX ? ((y > x || y != y) ? y : x) : x + y;
        }
        if (threadIdx.x == 0) red[0] = x;
    }
    __syncthreads();
    x = red[0];
    __syncthreads();
    return x;
}

// one block per row of s [B·rows, ctx], in place; the row's query attends to keys 0..last[row % rows]
template <typename T>
__global__ void causal_softmax(T* s, const long long* last, int rows, int ctx, T scale) {
    __shared__ T red[32];
    T* r = s + (long long)blockIdx.x * ctx;
    const int n = (int)last[blockIdx.x % rows] + 1;
    T m = wb_neg_inf<T>();
    for (int j = threadIdx.x; j < n; j += blockDim.x) { T y = r[j] * scale; m = (y > m || y != y) ? y : m; }
    m = block_reduce<T, true>(m, red);
    T sum = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) sum += wb_exp(r[j] * scale - m);
    sum = block_reduce<T, false>(sum, red);
    const T inv = T(1) / sum;
    for (int j = threadIdx.x; j < ctx; j += blockDim.x) r[j] = j < n ? wb_exp(r[j] * scale - m) * inv : T(0);
}
"""


def _softmax_kernel(dtype):
    import cupy
    name = f"causal_softmax<{'float' if dtype == np.float32 else 'double'}>"
    if name not in _SOFTMAX_KERNELS:
        mod = cupy.RawModule(code=_SOFTMAX_SRC, options=("--std=c++17",), name_expressions=[name])
        _SOFTMAX_KERNELS[name] = mod.get_function(name)
    return _SOFTMAX_KERNELS[name]


_SOFTMAX_KERNELS: dict = {}


def _causal_softmax_gpu(scores, last, scale: float):
    import cupy
    if scores.dtype not in (np.float32, np.float64):
        raise TypeError(f"causal softmax on the GPU takes float32 or float64 scores, got {scores.dtype}")
    B, rows, ctx = scores.shape
    s = cupy.ascontiguousarray(scores)
    last = cupy.ascontiguousarray(cupy.asarray(last, dtype=cupy.int64).reshape(-1))
    if last.size != rows:
        raise ValueError(f"{last.size} positions for {rows} rows")
    _softmax_kernel(s.dtype)((B * rows,), (256,), (s, last, np.int32(rows), np.int32(ctx), s.dtype.type(scale)))
    return s


def o_proj_residual(x, wo, o):
    """x + Wo·o."""
    check_shape("wo", wo, x.shape[-1], o.shape[-1])
    return x + o @ wo.T


def gate_up_silu(x, wg, wu, gain, eps: float):
    """silu(Wg·h) ⊙ (Wu·h), h = RMSNorm(x)·gain."""
    D = x.shape[-1]
    check_shape("wu", wu, wg.shape[0], D)
    check_shape("gain", gain, D)
    h = rmsnorm(x, gain, eps)
    return silu(h @ wg.T) * (h @ wu.T)


def down_residual(x, wd, hmlp):
    """x + Wd·hmlp."""
    check_shape("wd", wd, x.shape[-1], hmlp.shape[-1])
    return x + hmlp @ wd.T


def lm_head(x, w_lm, gain, eps: float):
    """W_lm · RMSNorm(x)·gain."""
    D = x.shape[-1]
    if w_lm.ndim != 2 or w_lm.shape[1] != D:
        raise ValueError(f"w_lm has shape {w_lm.shape}, expected [V, {D}]")
    check_shape("gain", gain, D)
    return rmsnorm(x, gain, eps) @ w_lm.T


def greedy(logits):
    """The first of the largest logits (what argmax decoding picks)."""
    return xp_of(logits).argmax(logits, axis=-1)


# ---- sampling ---------------------------------------------------------------------------------------------------

def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max())                                     # -inf entries become exact zeros
    return e / e.sum()


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution `transformers` samples from with TemperatureLogitsWarper → TopKLogitsWarper →
    TopPLogitsWarper → softmax, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty vector, got shape {logits.shape}")
    if not np.isfinite(logits).all():
        raise ValueError("logits contain NaN or infinity")
    if np.isnan(temperature) or np.isnan(top_p) or top_p < 0:
        raise ValueError(f"need a temperature and 0 <= top_p, got temperature={temperature}, top_p={top_p}")
    V = logits.size
    if temperature <= 0:                                        # greedy: the first of the maximal logits
        probs = np.zeros(V)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    scores = logits / temperature
    if 0 < top_k < V:
        # remove what is strictly below the k-th largest: ties with it stay, so more than k tokens can survive
        kth = np.partition(scores, V - top_k)[V - top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1:
        # HF sorts ascending and removes the low tail whose cumulative probability is <= 1 - top_p: what is left is
        # the smallest high-probability set whose mass reaches top_p. The top token always stays. Ties at the cut
        # are ordered by a stable sort (lower token index removed first), which is what torch.sort does on CPU.
        order = np.argsort(scores, kind="stable")
        cumulative = np.cumsum(softmax(scores[order]))
        remove = cumulative <= 1 - top_p
        remove[-1] = False
        scores[order[remove]] = -np.inf
    return softmax(scores)


_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_uniform(seed: int, step: int, draw: int) -> float:
    """The kernel's uniform in [0, 1) for (seed, step, draw): splitmix64 twice over the counters, top 53 bits. The
    sampler's randomness is a pure function of these, so every draw can be checked exactly."""
    z = _splitmix64((_splitmix64((seed & _M64) ^ _splitmix64(step & _M64)) + draw) & _M64)
    return (z >> 11) * (1.0 / 9007199254740992.0)


# The kernel draws by inverse CDF over the kept tokens in index order with masses in 2^-40 fixed point of
# exp(logit/T − max) in fp32: the CDF it walks differs from the exact one by the fp32 rounding of logit/T (≈ 6e-8
# relative, times |logit/T| ≤ ~30 in the exponent: ≤ 2e-6 per mass) and the truncation of each mass (2^-40 of the
# top one). A draw is right when it lands in the token's exact CDF interval widened by DRAW_SLACK on each side;
# an error in the kept set or in the masses moves the intervals of every later token by that token's probability.
DRAW_SLACK = 1e-5


def check_draw(probs: np.ndarray, u: float, token: int) -> tuple[bool, str]:
    """Whether `token` is the inverse-CDF draw of `u` from `probs` (index order), up to DRAW_SLACK."""
    if not 0 <= token < probs.size:
        return False, f"token {token} is not in the vocabulary"
    cdf = np.cumsum(probs)
    hi = float(cdf[token])
    lo = hi - float(probs[token])
    want = int(np.searchsorted(cdf, u, side="right"))
    want = min(want, probs.size - 1)
    if probs[token] <= 0:
        return False, f"token {token} has probability 0 (the draw u={u:.6f} should give {want})"
    if lo - DRAW_SLACK <= u < hi + DRAW_SLACK:
        return True, ""
    return False, f"u={u:.6f} falls in token {want}'s interval, the kernel drew {token} ([{lo:.6f}, {hi:.6f}))"


# ---- tolerances -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far the kernel's output of a stage may be from the exact value on the same inputs.

    fp32 outputs: the relative L2 error ‖kernel − exact‖/‖exact‖ at most `rtol`, and every element within
    `elem` × rms(exact) (a single wrong element of a long vector barely moves the L2 norm). bf16 outputs (`bf16`):
    every element within (1/2 + `ulp_slack`) bf16 ulp of the exact value plus `elem` × rms(exact), i.e. correctly
    rounded from a value no further from the exact one than fp32 arithmetic puts it. `exact`: bit-equal."""
    rtol: float = 0.0
    elem: float = 0.0
    bf16: bool = False
    ulp_slack: float = 0.0
    exact: bool = False
    why: str = ""


# Why 1e-5 for fp32 outputs. The kernel and the reference see the same inputs (the kernel's own taps) and the same
# weights (the kernel's bf16 values, exact in fp64); the reference computes in fp64, so its own error is ~1e-16 and
# what is measured is the kernel's. The kernel accumulates in fp32: a dot product of K terms in a tree/sequential
# mix has a relative error of order √K·2⁻²⁴ of Σ|w·x| — at K = 14,336 (8b's down projection) about 7e-6 of the
# terms' scale, and the terms' scale is that of the result for random or trained weights (no systematic
# cancellation). rsqrtf (≤ 2 ulp) in the norms adds 2.4e-7, __expf (≈ 2 ulp plus |x|·2⁻²⁴ for the argument's
# rounding) in softmax and SiLU at most ~2e-6 for |x| ≤ 30. Measured on the H200 the worst stage sits near 1e-6
# (NOTES.md): 1e-5 leaves a factor of ten and still fails a 1e-4 error in any stage by a factor of ten.
# Why elem = 2e-4 of the rms: an element of a dot product carries an error of ~√K·2⁻²⁴·rms(terms)·(a few, for the
# worst of thousands of rows) ≈ 3e-5 of the output's rms at K = 14,336; one element wrong by its own size (a lost
# tail row, a stale value) is ~1 rms off.
FP32 = Tolerance(rtol=1e-5, elem=2e-4, why="fp32 arithmetic on the kernel's own inputs, reference in fp64")
# Attention at long positions sums up to 4k+ exp-weighted terms per head, spread over splits, warps and lanes
# (short chains of ≤ ~64 sequential adds each) and merges partials with __expf rescaling: same bound.
ATTENTION = Tolerance(rtol=1e-5, elem=2e-4, why="fp32 online softmax with __expf on the kernel's own q and cache")
# k and v go to the cache as bf16: the kernel rounds its fp32 value to nearest, so an element is within half a bf16
# ulp of that fp32 value, which is itself within the fp32 error of the exact one. That error is absolute, of the
# order of the terms of the dot product (~1e-7 of the row's rms measured on the H200, NOTES.md), not relative to the
# element: an element near zero has a tiny ulp, and its fp32 error can be many of them (seen: 15). So the bound is
# 1/2 ulp + 0.01 ulp + 1e-5 × rms: a truncation (up to 1 ulp), a double rounding through another format, or a scale
# error of 1e-4 (≈ 0.03 ulp, which pushes the elements that sat near a rounding boundary past it: ~3% of them)
# all put many elements beyond it.
KV_BF16 = Tolerance(bf16=True, ulp_slack=0.01, elem=1e-5, why="fp32 result rounded to nearest bf16")
EXACT = Tolerance(exact=True, why="a copy or a choice: bit-equal")



def bf16_ulp(a):
    """Spacing of bf16 values at the magnitude of a (8 significant bits): 2^(floor(log2|a|) − 7)."""
    xp = xp_of(a)
    mag = xp.maximum(xp.abs(a), 2.0 ** -126)
    return xp.exp2(xp.floor(xp.log2(mag)) - 7)


def compare(kernel, exact, tol: Tolerance):
    """Per-row (step) metrics of kernel vs exact [n, size], on the arrays' device: (rel_l2 [n], worst element in
    units of the tolerance's scale [n], non-finite count [n]). For bf16 the second is the worst distance in bf16 ulps
    of the exact value; for exact, the count of differing elements."""
    xp = xp_of(kernel, exact)
    k = kernel.astype(xp.float64)
    r = exact.astype(xp.float64)
    finite = xp.isfinite(k)
    bad = (~finite).sum(axis=-1)
    kz = xp.where(finite, k, 0.0)
    d = xp.abs(kz - r)
    rel = xp.sqrt((d * d).sum(axis=-1)) / xp.maximum(xp.sqrt((r * r).sum(axis=-1)), 1e-300)
    if tol.exact:
        worst = (d > 0).sum(axis=-1).astype(xp.float64)
    elif tol.bf16:                              # in ulps, after the fp32 error the value may carry
        rms = xp.sqrt((r * r).mean(axis=-1, keepdims=True))
        worst = (xp.maximum(d - tol.elem * rms, 0.0) / bf16_ulp(r)).max(axis=-1)
    else:
        rms = xp.sqrt((r * r).mean(axis=-1))
        worst = d.max(axis=-1) / xp.maximum(rms, 1e-300)
    return rel, worst, bad


def passes(tol: Tolerance, rel: float, worst: float, bad: int) -> tuple[bool, str]:
    if bad:
        return False, f"{bad} values NaN/inf (not written?)"
    if tol.exact:
        return (worst == 0), ("" if worst == 0 else f"{int(worst)} values differ")
    if tol.bf16:
        lim = 0.5 + tol.ulp_slack
        return worst <= lim, ("" if worst <= lim else f"an element {worst:.3g} bf16 ulp from the exact value "
                                                      f"(correct rounding: ≤ {lim:g})")
    if not math.isfinite(rel) or rel > tol.rtol:
        return False, f"rel err {rel:.2g} > {tol.rtol:.0e}"
    if worst > tol.elem:
        return False, f"an element off by {worst:.2g} of the rms (> {tol.elem:.0e}); rel err {rel:.2g}"
    return True, ""


# ---- binding the math to the plan's stages ------------------------------------------------------------------------

class StageIO:
    """Where a stage's inputs come from, for a batch of n steps at `positions` of one layer (-1: token stage).
    act(buffer) → [n, size]; weight(name) → an HF-layout tensor of this layer (names of model.weights.layer_names:
    wq, wk, wv, wo, wg, wu, wd, attn_norm, mlp_norm) or of the model (embed, lm_head, final_norm); cache("k"|"v") →
    [Hkv, n_ctx, hd] of this layer; rope() → (cos, sin) [n, hd/2]; token → [n] ints; eps; x_frac_bits: the fixed
    point the kernel holds the residual stream in (plan.X_FRAC_BITS; None: plain floats, as the interpreter has it)."""
    cfg = None
    positions = None
    token = None
    eps = 0.0
    x_frac_bits = None

    def act(self, buffer: str):
        raise NotImplementedError

    def weight(self, name: str):
        raise NotImplementedError

    def cache(self, which: str):
        raise NotImplementedError

    def rope(self):
        raise NotImplementedError


def residual_fixed(a, frac_bits: int):
    """A value as the residual stream holds it: the nearest multiple of 2^-frac_bits, ties to even, as the kernel's
    cvt.rni. Exact in fp32 and fp64 arithmetic alike: scaling by a power of two and rounding to an integer of at
    most the format's significant bits lose nothing. At 2^-32 it differs from `a` only where |a| < 2^-25."""
    xp = xp_of(a)
    one = a.dtype.type(2.0 ** frac_bits)
    return xp.round(a * one) / one


def embedding_io(io: StageIO) -> dict:
    """The row, as the kernel's x holds it where it has a fixed point: bit-equal is still the tolerance."""
    x = embedding(io.weight("embed"), io.token)
    return {"x": x if io.x_frac_bits is None else residual_fixed(x, io.x_frac_bits)}


def qkv_rope_append_io(io: StageIO) -> dict:
    cos, sin = io.rope()
    c = io.cfg
    biases = tuple(io.weight(b) for b in ("bq", "bk", "bv")) if c.qkv_bias else None
    qk_gains = (io.weight("q_norm"), io.weight("k_norm")) if c.qk_norm else None
    q, k, v = qkv_rope_append(io.act("x"), io.weight("wq"), io.weight("wk"), io.weight("wv"),
                              io.weight("attn_norm"), cos, sin, io.eps, biases=biases, qk_gains=qk_gains)
    return {"q": q, "k_cache": k, "v_cache": v}


def attention_decode_io(io: StageIO) -> dict:
    return {"o": attention_decode(io.act("q"), io.cache("k"), io.cache("v"), io.positions)}


def o_proj_residual_io(io: StageIO) -> dict:
    x = o_proj_residual(io.act("x"), io.weight("wo"), io.act("o"))
    return {"x": x, "h": x}


def gate_up_silu_io(io: StageIO) -> dict:
    return {"hmlp": gate_up_silu(io.act("h"), io.weight("wg"), io.weight("wu"), io.weight("mlp_norm"), io.eps)}


def down_residual_io(io: StageIO) -> dict:
    return {"x": down_residual(io.act("x"), io.weight("wd"), io.act("hmlp"))}


def lm_head_io(io: StageIO) -> dict:
    return {"logits": lm_head(io.act("x"), io.weight("lm_head"), io.weight("final_norm"), io.eps)}


class _Within:
    """A fused stage's view for one of its parts: what the earlier parts wrote, else the stage's own inputs (every
    other attribute is the stage's: not a StageIO subclass, whose class defaults would shadow them)."""

    def __init__(self, io: StageIO, written: dict):
        self._io, self._written = io, written

    def __getattr__(self, name):
        return getattr(self._io, name)

    def act(self, buffer):
        return self._written[buffer] if buffer in self._written else self._io.act(buffer)



def composed(*parts, gives: tuple[str, ...]):
    """The math of a stage made of others (a fusion: say gate_up_silu_io then down_residual_io, giving "x"): each
    part reads what the earlier ones wrote, and the stage gives only `gives`, its buffers in the plan (what passes
    between the parts, hmlp there, is no buffer of the fused stage). `parts` and `gives` stay readable, so a path
    that implements the parts one by one (the prefill's GPU path) runs the fused stage without an entry of its own
    (DESIGN.md, fusing two stages)."""
    def math(io: StageIO) -> dict:
        written: dict = {}
        for part in parts:
            written.update(part(_Within(io, written)))
        return {b: written[b] for b in gives}
    math.parts, math.gives = parts, tuple(gives)
    math.__name__ = "+".join(p.__name__ for p in parts)
    return math


def sampling_io(io: StageIO) -> dict:
    """The greedy choice; the sampler's other modes are checked draw by draw (check_draw)."""
    return {"sampled": greedy(io.act("logits"))}


# ---- contracts: what a stage promises beyond values a tolerance can hold -----------------------------------------
# Each takes a ContractIO (workbench.check.stage_check: this stage's taps, its inputs' taps, the runs) and returns
# [(what, run, step, ok, note)]. They name buffers, never other stages: the plan says who produces what.

def partials_contract(io) -> list:
    """The LM head's per-block partials: each (max, arg) is a logit and its index, and together they give the
    first largest logit (what the greedy sampler takes)."""
    L, M, A = io.own("logits"), io.own("blk_max"), io.own("blk_arg")
    out = []
    for i, (ri, s) in enumerate(io.rows):
        lg, m, a = L[i], M[i], A[i]
        have = np.isfinite(m)
        ok, note = True, ""
        if not np.isfinite(lg).all():
            ok, note = False, "logits not finite"
        elif not have.any():
            ok, note = False, "no block left a partial"
        else:
            idx = a[have].astype(np.int64)
            if (idx < 0).any() or (idx >= lg.size).any():
                ok, note = False, "a partial's index is outside the vocabulary"
            elif not np.array_equal(lg[idx], m[have]):
                k = int(np.flatnonzero(lg[idx] != m[have])[0])
                ok, note = False, f"a partial ({m[have][k]:.6g} at {idx[k]}) is not that logit ({lg[idx[k]]:.6g})"
            elif m[have].max() != lg.max():
                ok, note = False, f"the partials' largest {m[have].max():.6g} is not the largest logit {lg.max():.6g}"
            elif idx[m[have] == m[have].max()].min() != int(np.argmax(lg)):
                ok, note = False, (f"the partials say {idx[m[have] == m[have].max()].min()}, the first largest "
                                   f"logit is {int(np.argmax(lg))}")
        out.append(("blk_max/blk_arg partials", ri, s, ok, note))
    return out


def sampler_contract(io) -> list:
    """Greedy: the first largest of the kernel's own logits. With a temperature: every recorded draw is its
    u's exact inverse-CDF token of the reference distribution (check_draw), and the token is draw 0."""
    lgs, sampled = io.input("logits"), io.own("sampled")[:, 0]
    out = []
    for i, (ri, s) in enumerate(io.rows):
        r, samp, lg = io.runs[ri], io.draws.get(ri), lgs[i]
        if samp is None or samp.greedy:
            want = int(np.argmax(lg)) if np.isfinite(lg).all() else -1
            out.append(("sampled", ri, s, int(sampled[i]) == want,
                        f"sampled {int(sampled[i])}, the first largest logit is {want}"))
        elif r.draws is not None and s in r.recorded_steps:
            probs = reference_probs(lg.astype(np.float64), samp.temperature, samp.top_k, samp.top_p)
            row = r.draws[r.recorded_steps.index(s)]
            bad = None
            for d, tok in enumerate(row):
                good, why = check_draw(probs, draw_uniform(samp.seed, s, d), int(tok))
                if not good:
                    bad = f"draw {d} of {len(row)}: {why}"
                    break
            out.append((f"draws (T={samp.temperature}, top-k {samp.top_k}, top-p {samp.top_p})", ri, s,
                        bad is None, bad or ""))
            out.append(("sampled is draw 0", ri, s, int(sampled[i]) == int(row[0]),
                        f"sampled {int(sampled[i])}, draw 0 is {int(row[0])}"))
    return out


def publish_contract(io) -> list:
    """The token fed at each step (what the stage reading `token` embedded) is the prompt's while it lasts, else
    the one sampled; the stream holds the sampled tokens, as many as asked."""
    sampled = io.input("sampled")[:, 0]
    fed_x = io.reader_tap("token")
    out = []
    for i, (ri, s) in enumerate(io.rows):
        want = io.runs[ri].fed[s]
        if not np.array_equal(fed_x[i], io.embed_row(want)):
            other = io.embedded_token(fed_x[i])
            if other is not None and other != want:            # decided by the previous step's publish
                out.append(("token fed", ri, max(s - 1, 0), False, f"fed token {other} at step {s}, expected {want}"))
    for ri, r in enumerate(io.runs):
        if r.eos:
            continue                                   # a run that may stop at an EOS token has no fixed length
        n_steps = len(r.prompt) + r.max_new - 1
        if len(r.tokens) != r.max_new or r.steps != n_steps:
            out.append(("stream length", ri, max(r.steps - 1, 0), False,
                        f"{len(r.tokens)} tokens in {r.steps} steps, expected {r.max_new} in {n_steps}"))
        for g, tok in enumerate(r.tokens):
            s = len(r.prompt) - 1 + g
            if (ri, s) in io.rows and int(sampled[io.rows.index((ri, s))]) != tok:
                out.append(("token streamed", ri, s, False,
                            f"streamed {tok} at step {s}, sampled {int(sampled[io.rows.index((ri, s))])}"))
    return out

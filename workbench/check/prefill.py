"""The batched prefill (workbench.run.prefill) checked: what it wrote into the kernel's cache, its last logits and
the first token it chose from them against one unchunked fp64 run of the same math on the same weights
(`check_prefill`), and the kernel continued from its cache end to end against the reference over the whole
sequence (`verify_after_prefill`)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..model.weights import Prepared, to_f32
from ..reference import KVCache, forward
from ..run.prefill import Prefilled, prefill_part
from ..run.runtime import Monokernel, Result, Sampling
from .verify import DEFAULT_RTOL, VerifyReport, decisive_first_largest, end_to_end, recorded_steps


# The bound of each precision of the prefill's products (run.prefill_gpu.PRECISIONS argues both): fp32's is the
# end-to-end one; bf16 rounds every activation of every product once more, ~6e-3 over the 1B's layers and ~9e-3
# over the 8B's, and its bound is twice that.
PREFILL_RTOL = {"fp32": DEFAULT_RTOL, "bf16": 2e-2}


@dataclasses.dataclass
class PrefillCheck:
    """The prefill's cache and last logits against an unchunked fp64 run of the same math."""
    k_rel: list                # [L] relative L2 error of each layer's keys (the prefilled positions)
    v_rel: list
    logits_rel: float
    finite: bool
    rtol: float
    token: int | None = None           # the prefill's first token (Prefilled.token), where it chose one
    want: int | None = None            # the fp64 logits' first largest
    token_ok: bool | None = None       # None where the fp64 margin is too small to judge (end_to_end's rule)

    @property
    def passed(self) -> bool:
        return (self.finite and max(self.k_rel + self.v_rel + [self.logits_rel]) <= self.rtol
                and self.token_ok is not False)

    def summary(self) -> str:
        if not self.finite:
            return "prefill: FAILED: NaN or inf in the cache or the logits"
        lk, lv = int(np.argmax(self.k_rel)), int(np.argmax(self.v_rel))
        verdict = "passed" if self.passed else "FAILED"
        chose = "" if self.token is None else (
            f"; first token {self.token}, fp64's {self.want}" + (" (a near tie, not judged)" if self.token_ok is None
                                                                 else "" if self.token_ok else ": WRONG"))
        return (f"prefill {verdict}: worst rel err keys {self.k_rel[lk]:.1e} (layer {lk}), values {self.v_rel[lv]:.1e} "
                f"(layer {lv}), last logits {self.logits_rel:.1e} (tol {self.rtol:.0e}){chose}")


def check_prefill(p: Prepared, tokens, pre: Prefilled, k_cache, v_cache, rtol: float | None = None) -> PrefillCheck:
    """Compare what prefill wrote (positions 0 .. pre.n - 1, from pos0 = 0) and its last logits with one unchunked
    fp64 forward of the same tokens on the same weights. The tolerance is the end-to-end one (verify.DEFAULT_RTOL):
    the prefill computes in fp32 and rounds every layer's keys and values to bf16, as the decode path does, and a
    rounding that falls the other way in one layer moves every later one a little; a wrong stage, chunk or layout
    is off by far more (a wrong row is off by its own size). A prefill in the bf16 precision is held to its own
    bound (PREFILL_RTOL)."""
    if pre.pos0 != 0:
        raise ValueError("check_prefill checks a prefill from position 0")
    if pre.logits is None:
        raise ValueError("this prefill left its last logits to the kernel (prefill(..., logits=False)): run it with "
                         "logits=True to check them")
    rtol = PREFILL_RTOL[pre.precision] if rtol is None else rtol
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
    # the token the prefill chose, judged as end_to_end judges a greedy step (None at a near tie)
    decisive = decisive_first_largest(want, rtol)[0] if pre.token is not None else None
    token_ok = None if decisive is None else pre.token == decisive
    return PrefillCheck(k_rel, v_rel, logits_rel, finite, rtol, pre.token, int(np.argmax(want)), token_ok)


def verify_after_prefill(mk: Monokernel, *, prompt_len: int, max_new: int = 16, seed: int = 0,
                         rtol: float | None = None, chunk: int | None = None, precision: str = "fp32",
                         first: str = "prefill"):
    """A random prompt prefilled into the kernel's cache (run.prefill) in `precision`, checked against the fp64
    math; then the kernel, greedy, its recorded logits against the reference teacher-forced over the whole
    sequence → (PrefillCheck, VerifyReport). `first` (run.prefill.FIRST_TOKEN): "prefill", the whole prompt
    prefilled and its first token checked against fp64's too, the kernel going on from that token after the
    prompt; "kernel", all but the last token prefilled and the kernel going on from the last. The decode reads
    the cache the prefill wrote, so its tolerance is the precision's bound unless `rtol` is given."""
    if prompt_len < 2:
        raise ValueError("a prefill needs a prompt of at least 2 tokens (the last may be the kernel's)")
    rtol = PREFILL_RTOL[precision] if rtol is None else rtol
    cfg = mk.cfg
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab, prompt_len).tolist()
    prefix, by_prefill = prefill_part(prompt, first), first == "prefill"
    pre = mk.prefill(prefix, chunk=chunk, precision=precision, token=by_prefill)
    pc = check_prefill(mk.p, prefix, pre, mk.k_cache, mk.v_cache)
    record = recorded_steps(max_new, mk.max_record)
    fed = [pre.token] if by_prefill else prompt[-1:]
    res: Result = mk.generate(fed, max_new, Sampling(), eos=[], pos0=len(prefix), record=record)
    checks = end_to_end(mk.p, res, 1, rtol, context=prefix)
    return pc, VerifyReport(cfg.name, seed, prompt_len, len(res.tokens), rtol, checks, res.tok_per_s)

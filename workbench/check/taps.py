"""Stage-by-stage verification: the kernel's debug taps against the reference's, as a stages × layers table.

A debug build (BuildOptions(taps=True)) copies every stage's output of chosen decode steps into tap buffers; the
reference computes the same intermediates under the same names (workbench.reference.TAP_STAGES, plus the logits).
`compare_taps` puts the two side by side and names the first stage, in the order the kernel executes them, whose
output left its tolerance: the stage to look at after an edit.

    ref = TapReference(prepared)                       # caches the reference weights (GPU: fp32 torch tensors)
    res = mk.generate(prompt, n, eos=[], record=steps, tap_steps=steps)
    table = compare_taps(kernel_taps(res), ref.taps(prompt + res.tokens[:-1], steps), mk.cfg)
    print(table)                                       # or table.to_dict() for a dashboard
    table.first_failure                                # e.g. q at layer 0 (qkv_rope_append), step 4: ...

Keys everywhere are (tap, layer, step): tap one of TAP_NAMES or "logits" (layer -1); step i is the decode step that
fed tokens[i] at position i (the reference starts at position 0, so run the kernel with pos0=0).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..build.assemble import TAPS
from ..model.config import ModelConfig
from ..model.weights import Prepared, Weights, unprepare

TAP_NAMES = tuple(name for name, _ in TAPS)          # per layer, in the order a layer produces them
TAP_STAGE = dict(TAPS) | {"logits": "lm_head"}       # the section that produces each tap

# ---- tolerances -----------------------------------------------------------------------------------------------
# Kernel and reference use the same bf16 weights (unprepare(prepared): folded gains, unit norms) and fp32
# arithmetic. They differ only in summation order and the kernel's fast intrinsics (rsqrtf ≤ 2 ulp, __expf a few
# ulp), i.e. ~1e-6 relative per stage, and in one place where that noise can become visible: k and v are rounded
# to bf16 into the KV cache, and when the fp32 value of an element lies within that noise of a bf16 rounding
# boundary, the two sides round it to neighbouring bf16 values (a "flip": one element changes by one bf16 ulp,
# 2^-8 to 2^-7 of its size). Every stage that reads the cache (attention) and everything after it inherits those
# flips, and they grow through the layers: measured ≤ 1.2e-3 relative on the logits of llama-3.2-1b (NOTES.md).
#
# So the taps fall into three tiers, by whether a flip can have reached them:
#
# 1. Layer 0 before attention: x_in is the embedding row (a copy of bf16 values: exact, so 1e-6 only absorbs
#    nothing), q = rope(Wq·rmsnorm(x)) on identical inputs: dot products of D terms in a different order,
#    ~√D·2^-24 ≈ 3e-6 relative at D = 2048 in the worst realistic case, plus rsqrtf. 1e-5 leaves ~3× room and
#    still catches anything structural: a wrong rope sign or pair, an off-by-one position (rope of the wrong angle),
#    a missing norm are all O(0.1–1).
# 2. k and v of layer 0: as q before rounding, so every element must be within one bf16 ulp of the reference, and
#    only rarely off by that ulp: the flip probability per element is ~(fp32 noise)/(bf16 ulp) ≈ 1e-6/4e-3, well
#    under 1e-3; we allow 2% of the elements (or one, for short vectors). Truncating instead of rounding, or an
#    fp32 → bf16 conversion of the wrong value, moves ~50% of the elements and fails; rtol 2^-8 is a backstop.
# 3. Everything that reads the cache and what follows (attention of layer 0 onward, every tap of later layers,
#    the logits): 5e-3 relative, the tolerance verify() applies to the logits (workbench/verify.py has the full
#    argument), ~4× what the flips produce at 1B; k and v of later layers get 1e-2, since on top of the inherited
#    error their own rounding can flip many elements at once (each by up to 2^-7). Real bugs there are O(0.1–1):
#    a missing residual, a wrong attention scale, a skipped or extra cache position at short positions.
RTOL_PROPAGATED = 5e-3
RTOL_KV_PROPAGATED = 1e-2


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float                          # relative L2 error ‖kernel − ref‖ / ‖ref‖, per step
    bf16_ulps: float | None = None       # every element within this many bf16 ulps of the reference
    max_flip_frac: float | None = None   # at most this fraction of elements off by (up to) one bf16 ulp
    tier: str = ""


EXACT = Tolerance(1e-6, tier="exact copy")
FP32 = Tolerance(1e-5, tier="fp32, identical inputs")
KV_FIRST = Tolerance(2.0 ** -8, bf16_ulps=1.0, max_flip_frac=0.02, tier="bf16 rounding of identical inputs")
PROPAGATED = Tolerance(RTOL_PROPAGATED, tier="after the bf16 KV cache")
KV_PROPAGATED = Tolerance(RTOL_KV_PROPAGATED, tier="bf16 rounding after the bf16 KV cache")


def tolerance(tap: str, layer: int) -> Tolerance:
    """The tolerance a tap is held to (see the tiers above)."""
    if layer == 0 and tap == "x_in":
        return EXACT
    if layer == 0 and tap == "q":
        return FP32
    if layer == 0 and tap in ("k", "v"):
        return KV_FIRST
    return KV_PROPAGATED if tap in ("k", "v") else PROPAGATED


def decode_order(n_layers: int) -> list[tuple[str, int]]:
    """(tap, layer) in the order one decode step produces them: layer 0 x_in, q, k, v, attn, x_attn, h_mlp, x_out,
    layer 1 ..., then the logits."""
    return [(t, l) for l in range(n_layers) for t in TAP_NAMES] + [("logits", -1)]


def stage_of(tap: str, layer: int) -> str:
    """The section whose output a tap is (x_in of a later layer is the previous layer's down_residual output)."""
    if tap == "x_in" and layer > 0:
        return "down_residual"
    return TAP_STAGE[tap]


# ---- comparison -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TapCheck:
    """One tap of one layer at one step."""
    tap: str
    layer: int
    step: int
    rel_l2: float
    max_abs: float
    passed: bool
    note: str = ""
    rtol: float = math.nan


@dataclasses.dataclass
class Failure:
    """Where the kernel first left its tolerance: a tap, its layer and the first step it failed at."""
    tap: str
    layer: int
    step: int
    stage: str
    rel_l2: float
    max_abs: float
    rtol: float
    note: str = ""

    @property
    def where(self) -> tuple[str, int]:
        return self.tap, self.layer

    def __str__(self) -> str:
        at = f" at layer {self.layer}" if self.layer >= 0 else ""
        why = self.note or f"rel err {self.rel_l2:.2g} > {self.rtol:.0e}, max |Δ| {self.max_abs:.2g}"
        return f"{self.tap}{at} ({self.stage}), step {self.step}: {why}"


@dataclasses.dataclass
class StageCell:
    """One tap of one layer, worst over the compared steps."""
    tap: str
    layer: int
    stage: str
    tol: Tolerance
    rel_l2: float
    max_abs: float
    worst_step: int
    passed: bool
    failed_steps: list
    note: str = ""


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if math.isinf(v):
        return "inf"
    return f"{v:.1e}"


@dataclasses.dataclass
class StageTable:
    """Stages × layers of the kernel's taps against the reference's."""
    model: str
    n_layers: int
    steps: list
    checks: list                  # TapCheck per (step, layer, tap), in execution order
    cells: dict                   # (tap, layer) → StageCell, in decode order

    @property
    def passed(self) -> bool:
        return bool(self.cells) and all(c.passed for c in self.cells.values())

    @property
    def first_failure(self) -> Failure | None:
        """The first failing tap in execution order: the earliest step with a failure, and in it the first stage
        and layer in decode order (later stages and layers fail as a consequence)."""
        for c in self.checks:
            if not c.passed:
                return Failure(c.tap, c.layer, c.step, stage_of(c.tap, c.layer), c.rel_l2, c.max_abs, c.rtol, c.note)
        return None

    def cell(self, tap: str, layer: int = -1) -> StageCell:
        return self.cells[tap, layer]

    def summary(self) -> str:
        steps = ", ".join(map(str, self.steps))
        if self.passed:
            worst = max(self.cells.values(), key=lambda c: c.rel_l2 / c.tol.rtol)
            return (f"PASS {self.model}: {len(TAP_NAMES)} taps × {self.n_layers} layers + logits within tolerance at "
                    f"steps {steps}; closest to its limit: {worst.tap}"
                    f"{f' at layer {worst.layer}' if worst.layer >= 0 else ''} "
                    f"{worst.rel_l2:.1e} of {worst.tol.rtol:.0e}")
        n_bad = sum(not c.passed for c in self.cells.values())
        return f"FAIL {self.model}: first divergence {self.first_failure}; {n_bad} of {len(self.cells)} cells fail"

    def text(self) -> str:
        """The table as text: relative L2 error per tap (rows) and layer (columns), worst over the steps;
        ✗ marks a cell beyond its tolerance."""
        L = self.n_layers
        head = f"{'tap':7s} {'section':16s} {'tol L0/L≥1':>12s} " + " ".join(f"{f'L{l}':>8s}" for l in range(L))
        out = [f"relative L2 error, worst over steps {', '.join(map(str, self.steps))} (✗: beyond tolerance)", head]
        for tap in TAP_NAMES:
            c0, c1 = self.cells.get((tap, 0)), self.cells.get((tap, min(1, L - 1)))
            tol = f"{c0.tol.rtol:.0e}/{c1.tol.rtol:.0e}" if c0 and c1 else ""
            cols = []
            for l in range(L):
                c = self.cells.get((tap, l))
                cols.append(f"{'':>8s}" if c is None else f"{_fmt(c.rel_l2):>7s}{' ' if c.passed else '✗'}")
            out.append(f"{tap:7s} {TAP_STAGE[tap]:16s} {tol:>12s} " + " ".join(cols))
        c = self.cells.get(("logits", -1))
        if c is not None:
            out.append(f"{'logits':7s} {'lm_head':16s} {f'{c.tol.rtol:.0e}':>12s} "
                       f"{_fmt(c.rel_l2):>7s}{' ' if c.passed else '✗'}")
        out.append(self.summary())
        return "\n".join(out)

    __str__ = text

    def to_dict(self, json_safe: bool = False) -> dict:
        """Plain Python (lists, dicts, floats, str) for dashboards. json_safe: NaN/inf become None."""
        def num(v):
            v = float(v)
            return None if json_safe and not math.isfinite(v) else v

        def ff():
            f = self.first_failure
            if f is None:
                return None
            return {"tap": f.tap, "layer": f.layer, "step": f.step, "stage": f.stage, "rel_l2": num(f.rel_l2),
                    "max_abs": num(f.max_abs), "rtol": f.rtol, "note": f.note, "text": str(f)}
        taps = list(TAP_NAMES)
        L = self.n_layers

        def grid(attr):
            return [[num(getattr(self.cells[t, l], attr)) if (t, l) in self.cells else None for l in range(L)]
                    for t in taps]
        logits = self.cells.get(("logits", -1))
        return {
            "model": self.model, "passed": self.passed, "steps": list(self.steps), "layers": L, "taps": taps,
            "sections": [TAP_STAGE[t] for t in taps],
            "rel_l2": grid("rel_l2"), "max_abs": grid("max_abs"),
            "rtol": [[self.cells[t, l].tol.rtol if (t, l) in self.cells else None for l in range(L)] for t in taps],
            "pass": [[self.cells[t, l].passed if (t, l) in self.cells else None for l in range(L)] for t in taps],
            "logits": None if logits is None else {"rel_l2": num(logits.rel_l2), "max_abs": num(logits.max_abs),
                                                   "rtol": logits.tol.rtol, "passed": logits.passed},
            "cells": [{"tap": c.tap, "layer": c.layer, "stage": c.stage, "rel_l2": num(c.rel_l2),
                       "max_abs": num(c.max_abs), "rtol": c.tol.rtol, "tier": c.tol.tier, "passed": c.passed,
                       "worst_step": c.worst_step, "failed_steps": list(c.failed_steps), "note": c.note}
                      for c in self.cells.values()],
            "first_failure": ff(),
            "summary": self.summary(),
        }


def _bf16_ulp(a: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values at the magnitude of a (8 significant bits): 2^(floor(log2|a|) − 7)."""
    mag = np.maximum(np.abs(a), 2.0 ** -126)
    return np.exp2(np.floor(np.log2(mag)) - 7)


def check_tap(kernel: np.ndarray | None, ref: np.ndarray, tol: Tolerance) -> tuple[float, float, bool, str]:
    """(relative L2 error, max abs error, passed, note) of one tap at one step."""
    if kernel is None:
        return math.nan, math.nan, False, "not recorded by the kernel"
    k = np.asarray(kernel, dtype=np.float64).reshape(-1)
    r = np.asarray(ref, dtype=np.float64).reshape(-1)
    if k.shape != r.shape:
        return math.nan, math.nan, False, f"{k.size} values, the reference has {r.size}"
    if not np.isfinite(r).all():
        return math.nan, math.nan, False, "the reference is not finite"
    bad = ~np.isfinite(k)
    if bad.any():
        what = "NaN (not written?)" if np.isnan(k).all() else f"{int(bad.sum())} of {k.size} values NaN/inf"
        return math.inf, math.inf, False, what
    d = np.abs(k - r)
    rel = float(np.linalg.norm(k - r) / max(float(np.linalg.norm(r)), 1e-30))
    max_abs = float(d.max()) if d.size else 0.0
    ok, note = rel <= tol.rtol, ""
    if tol.bf16_ulps is not None:
        ulp = _bf16_ulp(np.maximum(np.abs(k), np.abs(r)))
        beyond = int((d > tol.bf16_ulps * ulp * (1 + 1e-6)).sum())
        flips = int((d > 0).sum())
        allowed = max(1, int(tol.max_flip_frac * k.size)) if tol.max_flip_frac is not None else k.size
        if beyond:
            ok, note = False, f"{beyond} of {k.size} values off by more than {tol.bf16_ulps:g} bf16 ulp"
        elif flips > allowed:
            ok, note = False, f"{flips} of {k.size} values differ by one bf16 ulp (expected ≤ {allowed})"
    return rel, max_abs, ok, note


def compare_taps(kernel_taps: dict, ref_taps: dict, cfg: ModelConfig, steps=None,
                 tolerances=None) -> StageTable:
    """Compare {(tap, layer, step): array} of the kernel with the reference's, over the steps in `steps` (default:
    every step the reference has). A tap the kernel lacks, or one holding NaN/inf (the runtime poisons unwritten
    taps with NaN), fails. `tolerances`: a function (tap, layer) → Tolerance replacing `tolerance`."""
    tol_of = tolerances or tolerance
    steps = sorted({s for (_, _, s) in ref_taps} if steps is None else set(steps))
    order = decode_order(cfg.n_layers)
    checks, per_cell = [], {key: [] for key in order}
    for step in steps:
        for tap, layer in order:
            if (tap, layer, step) not in ref_taps:
                continue
            tol = tol_of(tap, layer)
            rel, mx, ok, note = check_tap(kernel_taps.get((tap, layer, step)), ref_taps[tap, layer, step], tol)
            c = TapCheck(tap, layer, step, rel, mx, ok, note, tol.rtol)
            checks.append(c)
            per_cell[tap, layer].append(c)
    cells = {}
    for (tap, layer), cs in per_cell.items():
        if not cs:
            continue

        def badness(c):
            return (not c.passed, math.inf if math.isnan(c.rel_l2) else c.rel_l2)
        worst = max(cs, key=badness)
        failed = [c.step for c in cs if not c.passed]
        cells[tap, layer] = StageCell(tap, layer, stage_of(tap, layer), tol_of(tap, layer), worst.rel_l2,
                                      max(c.max_abs for c in cs), worst.step, not failed, failed,
                                      next((c.note for c in cs if c.note), ""))
    return StageTable(cfg.name, cfg.n_layers, steps, checks, cells)


def kernel_taps(result) -> dict:
    """{(tap, layer, step): array} of a runtime Result: its taps plus its recorded logits as ("logits", -1, step)."""
    out = dict(result.taps or {})
    if result.logits is not None:
        for i, step in enumerate(result.recorded_steps):
            out["logits", -1, step] = result.logits[i]
    return out


# ---- the reference side ---------------------------------------------------------------------------------------

def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def _is_cupy(a) -> bool:
    return type(a).__module__.startswith("cupy")


def _host_prepared(p: Prepared) -> Prepared:
    """A copy of prepared weights on the host (unprepare cannot move cupy arrays to numpy implicitly)."""
    import cupy
    arrays = {k: cupy.asnumpy(v) for k, v in p.arrays().items()}
    return Prepared(p.cfg, **arrays, xp=np, source=p.source)


class TapReference:
    """The reference side of the comparison for one model, with its weights converted once.

    source: Prepared weights (what the kernel runs: the reference uses unprepare(prepared), the kernel's own bf16
    values), or Weights (any HF-layout weights). backend: "numpy" (workbench.reference.decode_step, step by step;
    fine for small models), "torch" (reference_torch.forward with taps, all positions at once; on the GPU when the
    weights are there and torch sees CUDA), or "auto" (torch for weights on the GPU, numpy otherwise).
    The last result is cached by (tokens, steps): a reload whose kernel fed the same tokens costs nothing here."""

    def __init__(self, source, *, backend: str = "auto", dtype=np.float32, device=None):
        if backend not in ("auto", "numpy", "torch"):
            raise ValueError(f"backend must be auto, numpy or torch, got {backend!r}")
        on_gpu = (isinstance(source, Prepared) and _is_cupy(source.embed)) or \
                 (isinstance(source, Weights) and source.xp is not np)
        if backend == "auto":
            backend = "torch" if on_gpu and _have_torch() else "numpy"
        self.source, self.backend, self.dtype = source, backend, np.dtype(dtype)
        self.device = device
        self._w = self._tensors = None
        self._last = None
        self.cfg = source.cfg

    # numpy: float Weights on the host
    def _weights_np(self) -> Weights:
        if self._w is None:
            s = self.source
            if isinstance(s, Prepared):
                self._w = unprepare(_host_prepared(s) if _is_cupy(s.embed) else s, xp=np)
            elif s.xp is not np:
                self._w = Weights(s.cfg, {k: s.xp.asnumpy(v) for k, v in s.tensors.items()}, np, s.source)
            else:
                self._w = s
        return self._w

    # torch: float tensors on the device, and the config they compute (unprepare unties the LM head)
    def _torch(self):
        if self._tensors is None:
            import torch

            from .reference_torch import tensors_from_weights
            s = self.source
            w = unprepare(s, xp=s.xp) if isinstance(s, Prepared) else s
            dev = self.device
            if dev is None:
                if _is_cupy(next(iter(w.tensors.values()))) and torch.cuda.is_available():
                    import cupy
                    dev = torch.device("cuda", cupy.cuda.Device().id)
                else:
                    dev = torch.device("cpu")
            if dev.type == "cpu" and _is_cupy(next(iter(w.tensors.values()))):
                w = Weights(w.cfg, {k: w.xp.asnumpy(v) for k, v in w.tensors.items()}, np, w.source)
            tdtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}[self.dtype]
            self._tensors = (w.cfg, tensors_from_weights(w, dev, tdtype), dev, tdtype)
            self.device = dev
        return self._tensors

    def prepare(self):
        """Convert the weights now (first use otherwise pays for it)."""
        self._weights_np() if self.backend == "numpy" else self._torch()
        return self

    def taps(self, tokens, steps) -> dict:
        """{(tap, layer, step): array} for the steps `steps` of feeding tokens[i] at position i, plus
        ("logits", -1, step). Arrays are numpy, in the reference's dtype."""
        tokens = [int(t) for t in tokens]
        steps = sorted(set(int(s) for s in steps))
        if not steps:
            return {}
        if steps[0] < 0 or steps[-1] >= len(tokens):
            raise ValueError(f"steps must be in [0, {len(tokens)}) (one token fed per step), got {steps}")
        key = (tuple(tokens[:steps[-1] + 1]), tuple(steps))
        if self._last is not None and self._last[0] == key:
            return dict(self._last[1])
        out = self._taps_numpy(tokens, steps) if self.backend == "numpy" else self._taps_torch(tokens, steps)
        self._last = (key, out)
        return dict(out)

    def _taps_numpy(self, tokens, steps) -> dict:
        from .reference import KVCache, decode_step
        w = self._weights_np()
        cache = KVCache.empty(w.cfg, self.dtype)
        want, out = set(steps), {}
        for i in range(steps[-1] + 1):
            t = {} if i in want else None
            decode_step(w, cache, tokens[i], i, taps=t, dtype=self.dtype)
            if t is not None:
                out.update({(name, layer, i): v for (name, layer), v in t.items()})
        return out

    def _taps_torch(self, tokens, steps) -> dict:
        import torch

        from .reference_torch import forward
        cfg, tensors, dev, tdtype = self._torch()
        t = {}
        forward(cfg, tensors, torch.tensor(tokens[:steps[-1] + 1], dtype=torch.long, device=dev), kv_bf16=True,
                dtype=tdtype, taps=t, tap_positions=steps)
        keys = list(t)
        flat = torch.cat([t[k].reshape(-1) for k in keys]).cpu().numpy()      # one transfer
        out, off = {}, 0
        for k in keys:
            rows = t[k].shape[0]
            size = t[k].shape[1]
            block = flat[off:off + rows * size].reshape(rows, size)
            off += rows * size
            for i, step in enumerate(steps):
                out[k[0], k[1], step] = block[i]
        return out


def reference_taps(source, tokens, steps, *, backend: str = "auto", dtype=np.float32) -> dict:
    """Reference taps {(tap, layer, step): array} (logits as ("logits", -1, step)) of feeding tokens[i] at position i,
    for the chosen steps. source: Prepared (the kernel's weights; numpy or cupy), Weights, or a TapReference (which
    keeps its converted weights between calls). See TapReference for the backends."""
    ref = source if isinstance(source, TapReference) else TapReference(source, backend=backend, dtype=dtype)
    return ref.taps(tokens, steps)

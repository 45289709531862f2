"""Stage-local verification: every stage of every layer, checked on its own inputs as the kernel computed them.

A taps build (BuildOptions(taps=True)) copies what each stage wrote (plan.Stage.taps) at chosen steps. For a
stage at a layer and step, its inputs are the taps of the stages that produced them (schedule.producer: the latest
writer before it in the step), the kernel's own bf16 KV cache, its prepared weights and rope tables; its reference
(plan.Stage.reference) runs on those in fp64, and its own taps are held to the stage's tolerances
(plan.Stage.tolerances: fp32-level, argued in workbench.model.stage_math). A wrong stage therefore fails by itself, at
its own layer and step, whatever its depth, and the stages after it pass on its (wrong) output.

What is checked beyond the taps:
* lm_head's per-block partials (blk_max, blk_arg) against its logits: each pair is a logit and its index, the
  largest is the largest logit, ties to the lowest index (what the sampler relies on);
* sampling: the greedy choice is the first largest logit; with a temperature, every recorded draw lands in its
  token's exact CDF interval (stages.check_draw) of the reference distribution of the kernel's own logits;
* publish: the token the kernel fed at each step (its embedding's input) is the prompt's while forced, else the one
  it sampled and streamed, and the streamed tokens are the sampled ones.

Everything is computed where the taps are (on the GPU for a GPU run, through cupy) and only the per-step metrics
come back to the host.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .. import plan, schedule
from ..model import stage_math as S
from ..model.config import ModelConfig
from ..model.weights import to_f32
from ..reference import PreparedView


@dataclasses.dataclass
class Check:
    """One output of one stage at one layer and step."""
    stage: str
    buffer: str
    layer: int
    step: int                # the run's step
    position: int
    run: int                 # which of the runs checked together
    rel_l2: float
    worst: float             # the tolerance's element measure (rms units, bf16 ulps, count of differing values)
    passed: bool
    note: str = ""


@dataclasses.dataclass
class Failure:
    """Where the kernel first left its tolerance: a stage's output at a layer, and the first step it failed at."""
    stage: str
    buffer: str
    layer: int
    step: int
    position: int
    rel_l2: float
    note: str

    @property
    def where(self) -> tuple[str, int]:
        return self.stage, self.layer

    def __str__(self) -> str:
        at = f" at layer {self.layer}" if self.layer >= 0 else ""
        return f"{self.stage}: {self.buffer}{at}, step {self.step} (position {self.position}): {self.note}"


@dataclasses.dataclass
class Cell:
    """One output of one stage at one layer, worst over the checked steps."""
    stage: str
    buffer: str
    layer: int
    tol: S.Tolerance
    rel_l2: float
    worst: float
    passed: bool
    failed: int              # how many steps failed
    steps: int
    note: str = ""

    @property
    def margin(self) -> float:
        """How close to its limit (1 = at the limit), for the 'closest to its limit' line."""
        t = self.tol
        if t.exact:
            return 0.0 if self.worst == 0 else math.inf
        if t.bf16:                     # correct rounding is up to ½ ulp away: only the excess counts
            return max(0.0, self.worst - 0.5) / t.ulp_slack
        return max(self.rel_l2 / t.rtol if t.rtol else 0.0, self.worst / t.elem if t.elem else 0.0)


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    return "inf" if math.isinf(v) else f"{v:.1e}"


@dataclasses.dataclass
class StageTable:
    """Stages × layers: every stage output's worst error over the checked steps, against its tolerance."""
    model: str
    n_layers: int
    checks: list
    cells: dict                    # (stage, buffer, layer) → Cell, in execution order
    positions: list                # positions checked
    extra: list = dataclasses.field(default_factory=list)   # Checks of the contracts beyond the taps
    seconds: dict = dataclasses.field(default_factory=dict)  # where the verification's time went

    @property
    def passed(self) -> bool:
        return bool(self.cells) and all(c.passed for c in self.cells.values()) and all(c.passed for c in self.extra)

    @property
    def first_failure(self) -> Failure | None:
        """The first failing check in time: the earliest (run, step), and in it the first stage in execution
        order. With stage-local inputs each failing stage is wrong by itself; the first is where to look."""
        bad = [c for c in self.checks + self.extra if not c.passed]
        if not bad:
            return None
        order = {k: i for i, k in enumerate(self.cells)}
        c = min(bad, key=lambda c: (c.run, c.step, order.get((c.stage, c.buffer, c.layer), 1 << 30)))
        return Failure(c.stage, c.buffer, c.layer, c.step, c.position, c.rel_l2, c.note)

    def summary(self) -> str:
        where = f"{len(self.positions)} positions ({_span(self.positions)})"
        if self.passed:
            worst = max(self.cells.values(), key=lambda c: c.margin)
            at = f" at layer {worst.layer}" if worst.layer >= 0 else ""
            return (f"PASS {self.model}: {len(self.cells)} stage outputs × {where}, each on its own inputs; closest "
                    f"to its limit: {worst.stage}.{worst.buffer}{at} at {worst.margin:.2f} of it")
        n_bad = sum(not c.passed for c in self.cells.values()) + sum(not c.passed for c in self.extra)
        return f"FAIL {self.model}: {self.first_failure}; {n_bad} check(s) fail"

    def text(self) -> str:
        """Rows: stage outputs; columns: layers; each the worst relative L2 error over the steps (✗: beyond)."""
        L = self.n_layers
        head = f"{'stage output':28s} {'tolerance':>10s} " + " ".join(f"{f'L{l}':>8s}" for l in range(L))
        where = f"{len(set(self.positions))} positions ({_span(self.positions)})"
        out = [f"error on its own inputs, worst over {where} (✗: beyond tolerance)", head]
        rows = dict.fromkeys((c.stage, c.buffer) for c in self.cells.values())
        for st, buf in rows:
            tol = self.cells[next(k for k in self.cells if k[:2] == (st, buf))].tol
            t = "exact" if tol.exact else ("½ ulp" if tol.bf16 else f"{tol.rtol:.0e}")
            cols = []
            for l in ([-1] if (st, buf, -1) in self.cells else range(L)):
                c = self.cells.get((st, buf, l))
                v = c.worst if tol.bf16 else c.rel_l2
                cols.append(f"{_fmt(v):>7s}{' ' if c.passed else '✗'}")
            out.append(f"{st + '.' + buf:28s} {t:>10s} " + " ".join(cols))
        groups: dict = {}
        for c in self.extra:                        # one line per contract: how many steps, the first failure
            groups.setdefault((c.stage, c.buffer), []).append(c)
        for (st, what), cs in groups.items():
            bad = [c for c in cs if not c.passed]
            state = f"ok at {len(cs)} step(s)" if not bad else f"✗ {len(bad)} of {len(cs)}: {bad[0].note}"
            out.append(f"{st + ': ' + what:28s} {'exact':>10s} {state}")
        out.append(self.summary())
        return "\n".join(out)

    __str__ = text

    def to_dict(self, json_safe: bool = False) -> dict:
        def num(v):
            v = float(v)
            return None if json_safe and not math.isfinite(v) else v
        f = self.first_failure
        return {"model": self.model, "passed": self.passed, "layers": self.n_layers, "positions": list(self.positions),
                "cells": [{"stage": c.stage, "buffer": c.buffer, "layer": c.layer, "rel_l2": num(c.rel_l2),
                           "worst": num(c.worst), "passed": c.passed, "failed_steps": c.failed, "steps": c.steps,
                           "tolerance": c.tol.why, "note": c.note} for c in self.cells.values()],
                "extra": [{"check": f"{c.stage}: {c.buffer}", "passed": c.passed, "note": c.note} for c in self.extra],
                "first_failure": None if f is None else {"stage": f.stage, "buffer": f.buffer, "layer": f.layer,
                                                         "step": f.step, "position": f.position, "text": str(f)},
                "summary": self.summary()}


def _span(positions) -> str:
    p = sorted(set(positions))
    return f"{p[0]}–{p[-1]}" if p else "none"


# ---- the check --------------------------------------------------------------------------------------------------

class _KernelIO(S.StageIO):
    """A stage's inputs as the kernel had them, for a batch of tapped steps (possibly of several runs)."""

    def __init__(self, ctx: "_Batch", stage: str, layer: int):
        self.ctx, self.stage_name, self.layer = ctx, stage, layer
        self.cfg, self.eps = ctx.cfg, ctx.cfg.rms_eps
        self.positions, self.token = ctx.positions, ctx.tokens
        self.x_frac_bits = plan.X_FRAC_BITS if plan.BUFFERS["x"].dtype == "fixed" else None

    def act(self, buffer):
        prod = schedule.producer(self.cfg, buffer, self.stage_name, self.layer)
        if prod is None:
            raise KeyError(f"{self.stage_name} reads {buffer}, which nothing before it in the step writes")
        return self.ctx.tap(prod[0], buffer, prod[1])

    def weight(self, name):
        return self.ctx.w.layer(name, self.layer) if self.layer >= 0 else self.ctx.w.model(name)

    def cache(self, which):
        return self.ctx.cache(which, self.layer)

    def rope(self):
        xp, p = self.ctx.xp, self.ctx.prepared
        return p.rope_cos[self.positions].astype(xp.float64), p.rope_sin[self.positions].astype(xp.float64)


class _Batch:
    def __init__(self, mk, runs, prepared):
        self.mk, self.runs, self.cfg, self.prepared = mk, runs, prepared.cfg, prepared
        self.xp = xp = prepared.xp
        self.launch = getattr(mk, "launch", plan.Launch())
        self.rows = [(ri, s) for ri, r in enumerate(runs) for s in r.tap_steps]
        self.positions = xp.asarray([runs[ri].pos0 + s for ri, s in self.rows], dtype=xp.int64)
        self.tokens = xp.asarray([runs[ri].fed[s] for ri, s in self.rows], dtype=xp.int64)
        self.taps = xp.concatenate([r.taps for r in runs], axis=0) if runs else None
        self.w = PreparedView(prepared, np.float64)
        self._cache_layer = None

    def tap(self, stage, buffer, layer):
        t = schedule.tap(self.cfg, stage, buffer, self.launch)
        off = t.at(max(layer, 0))
        return self.taps[:, off:off + t.size].astype(self.xp.float64)

    def cache(self, which, layer):
        xp = self.xp
        key = (which, layer)
        if self._cache_layer != key:
            src = self.mk.k_cache if which == "k" else self.mk.v_cache
            n = int(self.positions.max()) + 1
            self._cache_val = to_f32(src[layer, :, :n], xp).astype(xp.float64)
            self._cache_layer = key
        return self._cache_val


def _embedded_token(b: _Batch, x: np.ndarray) -> int | None:
    """The token whose embedding row x is exactly (the kernel's x is a copy of a bf16 row), if any."""
    xp = b.xp
    bits = (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if not np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), np.asarray(x, np.float32)):
        return None
    hit = xp.flatnonzero((b.prepared.embed == xp.asarray(bits)[None, :]).all(axis=1))
    return int(hit[0]) if hit.size else None


def check_stages(mk, runs: list, prepared=None, *, draws: dict | None = None, stopped: dict | None = None) -> StageTable:
    """Check every tapped step of `runs` (Results of taps builds of the Monokernel `mk`, all on its weights, in the
    order they ran; their cache rows must not overlap, so that the cache after the last still holds what each
    read) stage by stage. `draws`: {run index: Sampling} for runs made with a temperature, whose recorded draws are
    checked exactly. `stopped`: {run index: (steps it ran, why)} for runs the kernel stopped itself (NaN logits);
    the stop is a failure of its own, after whatever stage went wrong first."""
    t0 = time.perf_counter()
    prepared = prepared or mk.p
    cfg: ModelConfig = prepared.cfg
    b = _Batch(mk, runs, prepared)
    xp = b.xp
    pending: dict = {}                                   # (stage, buffer) → [(layer, kernel, exact)]
    for stage_name, layer in schedule.execution(cfg):
        st = plan.stage(stage_name)
        if st.reference is None or not st.taps:
            continue
        res = st.reference(_KernelIO(b, stage_name, layer))
        for buf in st.taps:
            if buf in st.tolerances:                     # else a contract, checked below (partials, the choice)
                pending.setdefault((stage_name, buf), []).append((layer, b.tap(stage_name, buf, layer), res[buf]))
    # one comparison per stage output over all its layers (a few kernels each, not a few per layer)
    metrics, keys = [], []
    n = len(b.rows)
    for (stage_name, buf), items in pending.items():
        tol = plan.stage(stage_name).tolerances[buf]
        kern = xp.concatenate([k for _, k, _ in items])
        exact = xp.concatenate([e.astype(xp.float64) for _, _, e in items])
        m = xp.stack(S.compare(kern, exact, tol))        # [3, layers · rows]
        for i, (layer, _, _) in enumerate(items):
            metrics.append(m[:, i * n:(i + 1) * n])
            keys.append((stage_name, buf, layer, tol))
    order = {k: i for i, k in enumerate(schedule.execution(cfg))}
    idx = sorted(range(len(keys)), key=lambda i: order[keys[i][0], keys[i][2]])
    keys = [keys[i] for i in idx]
    metrics = [metrics[i] for i in idx]
    host = xp.stack(metrics).get() if hasattr(xp, "cuda") else np.stack(metrics)     # [checks, 3, rows]
    t1 = time.perf_counter()
    checks, cells = [], {}
    for (stage_name, buf, layer, tol), m in zip(keys, host):
        per = []
        for i, (ri, s) in enumerate(b.rows):
            rel, worst, bad = float(m[0, i]), float(m[1, i]), int(m[2, i])
            ok, note = S.passes(tol, rel, worst, bad)
            per.append(Check(stage_name, buf, layer, s, runs[ri].pos0 + s, ri, rel, worst, ok, note))
        checks += per
        worst = max(per, key=lambda c: (not c.passed, c.rel_l2 if math.isfinite(c.rel_l2) else math.inf))
        fails = [c for c in per if not c.passed]
        cells[stage_name, buf, layer] = Cell(stage_name, buf, layer, tol, max(c.rel_l2 for c in per),
                                             max(c.worst for c in per), not fails, len(fails), len(per),
                                             fails[0].note if fails else "")
    extra = _contracts(b, draws or {})
    for ri, (ran, why) in (stopped or {}).items():
        last = plan.STAGE_NAMES[-1]
        extra.append(Check(last, "run stopped", -1, max(ran - 1, 0), runs[ri].pos0 + max(ran - 1, 0), ri, math.inf,
                           0.0, False, why))
    t2 = time.perf_counter()
    return StageTable(cfg.name, cfg.n_layers, checks, cells, sorted(int(p) for p in b.positions.tolist()), extra,
                      {"references": t1 - t0, "contracts": t2 - t1})


class _ContractIO:
    """What a stage's contracts see (model.stage_math.*_contract): host arrays [rows, size] of its own taps and its
    inputs' taps, the runs, the rows (run, step) checked, the sampling of each run, and the embedding table."""

    def __init__(self, b: "_Batch", stage: str, draws: dict):
        self.b, self.stage, self.draws = b, stage, draws
        self.cfg, self.runs, self.rows = b.cfg, b.runs, b.rows

    @staticmethod
    def _host(a):
        return a.get() if hasattr(a, "get") else np.asarray(a)

    def own(self, buffer):
        return self._host(self.b.tap(self.stage, buffer, -1))

    def input(self, buffer):
        prod = schedule.producer(self.cfg, buffer, self.stage, -1)
        return self._host(self.b.tap(prod[0], buffer, prod[1]))

    def reader_tap(self, buffer):
        """The first tap of the stage that reads `buffer` (for the token: what the embedding made of it)."""
        reader = next(s for s in plan.STAGES if s.reads_buffer(buffer) and s.taps)
        return self._host(self.b.tap(reader.name, reader.taps[0], -1))

    def embed_row(self, token):
        cache = self.b.__dict__.setdefault("_embed_rows", {})
        if token not in cache:
            cache[token] = self._host(self.b.w.model("embed")[int(token)])
        return cache[token]

    def embedded_token(self, x):
        return _embedded_token(self.b, x)


def _contracts(b: _Batch, draws: dict) -> list:
    """Every stage's contracts (plan.Stage.contracts), as Checks."""
    out = []
    for st in plan.STAGES:
        io = _ContractIO(b, st.name, draws)
        for contract in st.contracts:
            for what, ri, s, ok, note in contract(io):
                out.append(Check(st.name, what, -1, s, b.runs[ri].pos0 + s, ri, 0.0 if ok else math.inf, 0.0, ok, note))
    return out

"""The reference: the plan's decode step interpreted stage by stage on numpy or cupy arrays.

`forward` runs the stages of workbench/plan.py in their execution order, each through its reference in
workbench/model/stage_math.py, over a batch of tokens at given positions (a whole teacher-forced sequence at once, or
one decode step), keeping a KV cache. It is the same list of stages the kernel is generated from, so the reference
cannot drift from the kernel's decode step: a stage added to the plan is computed here too.

Weights are seen in Hugging Face's layout through a view: `HFView` over `Weights` (a checkpoint, gains and all;
what the HF cross-check uses) or `PreparedView` over the kernel's own `Prepared` weights (folded gains, unit norms:
exactly what the kernel computes with), converted layer by layer to the working dtype so that fp64 references of
large models fit in memory.

The math, per layer l, for the token at position pos:
    q, k, v   = rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x)       n = RMSNorm with the attention-norm gain
    K[pos], V[pos] = k, v                                    (rounded to bf16: the kernel's cache is bf16)
    x        += Wo · attention(q, K[0..pos], V[0..pos])
    x        += Wd · (silu(Wg·m(x)) ⊙ Wu·m(x))               m = RMSNorm with the MLP-norm gain
and logits = W_lm · RMSNorm(x) with the final-norm gain.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import plan, schedule
from .model import stage_math as S
from .model import widen
from .model.config import ModelConfig
from .model.weights import Prepared, Weights, layer_names, qkv_row_order, rope_tables, to_f32


def round_bf16(a):
    """The value a bf16 store keeps (round to nearest even), in a's dtype, via fp32 as the kernel rounds."""
    xp = S.xp_of(a)
    u = xp.ascontiguousarray(a.astype(xp.float32)).view(xp.uint32)
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16) << 16
    out = r.astype(xp.uint32).view(xp.float32)
    return xp.where(xp.isnan(a), xp.nan, out).astype(a.dtype)


# ---- weights in HF layout --------------------------------------------------------------------------------------

class HFView:
    """HF-layout float weights of a `Weights` (numpy or cupy, bf16 bits or floats), converted once per dtype."""

    def __init__(self, w: Weights, dtype=np.float64):
        self.cfg, self.w, self.xp, self.dtype = w.cfg, w, w.xp, np.dtype(dtype)
        self._cache: dict = {}

    def _get(self, name: str):
        if name not in self._cache:
            self._cache[name] = to_f32(self.w.tensors[name], self.xp).astype(self.dtype)
        return self._cache[name]

    def layer(self, name: str, layer: int):
        return self._get(layer_names(layer, self.cfg)[name])

    def model(self, name: str):
        return self._get({"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                          "lm_head": self.w.lm_head_name()}[name])


class PreparedView:
    """The kernel's prepared weights seen in HF layout (rope pairs put back, gate and up apart, gains 1 since they
    are folded), in `dtype`. Layer tensors are made on first use and only one layer is kept, so an fp64 view of an
    8B model costs one layer's memory."""

    def __init__(self, p: Prepared, dtype=np.float64):
        self.cfg, self.p, self.xp, self.dtype = p.cfg, p, p.xp, np.dtype(dtype)
        self._layer, self._tensors = None, {}
        self._model: dict = {}
        self._inv = self.xp.asarray(np.argsort(qkv_row_order(self.cfg)))

    def layer(self, name: str, layer: int):
        if layer != self._layer:
            c, xp, dt = self.cfg, self.xp, self.dtype
            # every decode step widens every layer again: in one pass each (model.widen), rows picked on the way
            qkv = widen.rows(self.p.wqkv[layer], self._inv, dt)
            gu = self.p.wgu[layer]
            pairs = xp.arange(c.intermediate, dtype=xp.int64) * 2            # gate row j, then up row j
            ones = xp.ones(c.hidden, dtype=self.dtype)
            self._tensors = {"wq": qkv[:c.q_dim], "wk": qkv[c.q_dim:c.q_dim + c.kv_dim], "wv": qkv[c.q_dim + c.kv_dim:],
                             # gate and up apart once per layer, not in every product that reads them strided
                             "wo": widen.rows(self.p.wo[layer], None, dt), "wg": widen.rows(gu, pairs, dt),
                             "wu": widen.rows(gu, pairs + 1, dt),
                             "wd": widen.transposed(self.p.wd[layer], dt),   # stored [F, D]
                             "attn_norm": ones, "mlp_norm": ones}
            if c.qkv_bias:                              # fp32 already, in wqkv's row order
                b = xp.asarray(self.p.bqkv[layer], dtype=self.dtype)[self._inv]
                self._tensors.update(bq=b[:c.q_dim], bk=b[c.q_dim:c.q_dim + c.kv_dim], bv=b[c.q_dim + c.kv_dim:])
            if c.qk_norm:                               # fp32 already: applied, not folded
                g = xp.asarray(self.p.qk_gain[layer], dtype=self.dtype)
                self._tensors.update(q_norm=g[0], k_norm=g[1])
            self._layer = layer
        return self._tensors[name]

    def model(self, name: str):
        if name not in self._model:
            self._model[name] = (self.xp.ones(self.cfg.hidden, dtype=self.dtype) if name == "final_norm"
                                 else widen.rows({"embed": self.p.embed, "lm_head": self.p.lm_head}[name], None,
                                                 self.dtype))
        return self._model[name]


def view(source, dtype=np.float64):
    """A weight view of Weights or Prepared (or a view, returned as it is)."""
    if isinstance(source, (HFView, PreparedView)):
        return source
    if isinstance(source, Prepared):
        return PreparedView(source, dtype)
    if isinstance(source, Weights):
        return HFView(source, dtype)
    raise TypeError(f"expected Weights, Prepared or a weight view, got {type(source).__name__}")


@functools.lru_cache(maxsize=8)
def _rope_np(cfg: ModelConfig):
    return rope_tables(cfg)


# ---- the interpreter ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer [L, Hkv, max_seq, hd]; position p holds the token fed at p."""
    k: object
    v: object

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype=np.float32, xp=np) -> "KVCache":
        shape = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
        return cls(xp.zeros(shape, dtype=dtype), xp.zeros(shape, dtype=dtype))


class _IO(S.StageIO):
    def __init__(self, w, cfg, state, cache, positions, tokens, layer, xp, dtype):
        self.w, self.cfg, self.state, self._cache = w, cfg, state, cache
        self.positions, self.token, self.layer, self.xp, self.dtype = positions, tokens, layer, xp, dtype
        self.eps = cfg.rms_eps

    def act(self, buffer):
        return self.state[buffer]

    def weight(self, name):
        return self.w.layer(name, self.layer) if self.layer >= 0 else self.w.model(name)

    def cache(self, which):
        c = self._cache.k if which == "k" else self._cache.v
        return c[self.layer, :, :int(self.positions.max()) + 1]

    def rope(self):
        cos, sin = _rope_np(self.cfg)
        p = self.positions.get() if hasattr(self.positions, "get") else np.asarray(self.positions)
        return (self.xp.asarray(cos[p]).astype(self.dtype), self.xp.asarray(sin[p]).astype(self.dtype))


def forward(source, tokens, positions=None, *, cache: KVCache | None = None, kv_bf16: bool = True,
            dtype=np.float64, taps: dict | None = None, logit_rows=None, hook=None):
    """Logits [n, V] (or [len(logit_rows), V]) of feeding tokens[i] at positions[i] (default 0..n-1), every row at
    once: teacher-forced. `cache` must hold every earlier position a row attends to (a fresh one is made for a
    sequence from 0); the rows' keys and values are written into it at their positions (rounded to bf16 when
    kv_bf16, as the kernel's cache is). If `taps` is a dict, every stage output lands in it as
    taps[(stage, buffer, layer)] = [n, size] (for the cache: the row written). `logit_rows`: only these rows
    through the LM head (a long sequence's logits are n·V). `hook(stage, layer, outputs) → outputs` may change a
    stage's outputs before the stages after it read them (tests make a deliberately wrong stage so)."""
    w = view(source, dtype)
    cfg, xp, dtype = w.cfg, w.xp, w.dtype
    tokens = _integers(xp, tokens, "tokens")
    n = int(tokens.size)
    if n == 0:
        raise ValueError("no tokens to feed")
    positions = xp.arange(n) if positions is None else _integers(xp, positions, "positions")
    if positions.size != n:
        raise ValueError(f"{n} tokens but {positions.size} positions")
    if int(xp.unique(positions).size) != n:
        raise ValueError("two rows at the same position: each position holds one token's keys and values")
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= cfg.max_seq:
        raise ValueError(f"positions {lo}..{hi} do not fit max_seq={cfg.max_seq}")
    if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab:
        raise ValueError(f"token ids span [{int(tokens.min())}, {int(tokens.max())}], outside the vocabulary "
                         f"[0, {cfg.vocab})")
    if cache is None:
        if lo > 0:
            raise ValueError(f"positions from {lo} need the cache that holds positions 0..{lo - 1}")
        cache = KVCache.empty(cfg, dtype, xp)
    check_cache(cfg, cache, kv_bf16, dtype)
    state: dict = {}
    out = None
    no_logits = logit_rows is not None and len(logit_rows) == 0
    for stage_name, layer in schedule.execution(cfg):
        st = plan.stage(stage_name)
        if st.reference is None:
            continue
        if no_logits and "logits" in {u.buffer for u in st.reads + st.writes}:
            continue                        # no row wanted: the LM head (and what reads it) has nothing to do
        if stage_name == "lm_head" and logit_rows is not None:
            sel = xp.asarray(list(logit_rows), dtype=xp.int64)
            res = run_stage(w, stage_name, layer, {"x": state["x"][sel]}, cache, positions[sel], tokens[sel],
                            kv_bf16, hook)
            state.update(res)
        else:
            res = run_stage(w, stage_name, layer, state, cache, positions, tokens, kv_bf16, hook)
        if taps is not None:
            taps.update(((stage_name, buf, layer), val) for buf, val in res.items())
        if stage_name == "lm_head":
            out = res["logits"]
    return out


def run_stage(w, stage_name: str, layer: int, state: dict, cache: KVCache, positions, tokens, kv_bf16: bool,
              hook=None) -> dict:
    """One stage of the plan on the rows of `state` (fed tokens at positions): its reference math on a weight
    view, its keys and values stored into the cache, its outputs put into state and returned by buffer."""
    res = plan.stage(stage_name).reference(_IO(w, w.cfg, state, cache, positions, tokens, layer, w.xp, w.dtype))
    if hook is not None:
        res = hook(stage_name, layer, res)
    for buf, val in list(res.items()):
        if plan.BUFFERS[buf].kind == "cache":
            res[buf] = store_kv(cache, buf, layer, positions, val, kv_bf16)
        state[buf] = res[buf]
    return res


def store_kv(cache: KVCache, buf: str, layer: int, positions, val, kv_bf16: bool):
    """A stage's rows of k or v ([n, Hkv·hd], Hkv the cache's: a rank's share too) into the cache at their
    positions, rounded to bf16 when kv_bf16 as the kernel's cache holds them → the rows as stored."""
    val = round_bf16(val) if kv_bf16 else val
    c = (cache.k if buf == "k_cache" else cache.v)[layer]                  # [Hkv, max_seq, hd], a view
    c[:, positions] = val.reshape(val.shape[0], c.shape[0], c.shape[2]).transpose(1, 0, 2)
    return val


def _integers(xp, a, what: str):
    """A 1-D int64 array of `a`, which must hold integers (a float 1.5 would otherwise be fed as 1)."""
    arr = xp.asarray(a).reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {arr.dtype} values")
    return arr.astype(xp.int64)


def check_cache(cfg: ModelConfig, cache: KVCache, kv_bf16: bool, dtype):
    """The cache must have the model's shape, and hold what is stored in it without rounding it: bf16 values fit
    float32 and float64 exactly; unrounded ones need a cache as precise as the math."""
    want = (cfg.n_layers, cfg.n_kv_heads, cfg.max_seq, cfg.head_dim)
    if tuple(cache.k.shape) != want or tuple(cache.v.shape) != want:
        raise ValueError(f"KV cache has shapes {tuple(cache.k.shape)}, {tuple(cache.v.shape)}; the config needs {want}")
    kd = np.dtype(cache.k.dtype)
    if kd not in (np.float32, np.float64) or (not kv_bf16 and not np.can_cast(dtype, kd)):
        raise ValueError(f"a {kd} KV cache would round the {np.dtype(dtype)} keys and values; "
                         f"use KVCache.empty(cfg, dtype)")


def decode_step(source, cache: KVCache, token: int, pos: int, *, taps: dict | None = None, kv_bf16: bool = True,
                dtype=np.float32):
    """Feed one token at `pos` (the cache must hold positions 0..pos-1); returns the logits [V]."""
    if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
        raise TypeError(f"token must be an integer, got {token!r}")
    cfg = source.cfg
    if not 0 <= token < cfg.vocab:
        raise ValueError(f"token {token} is outside the vocabulary [0, {cfg.vocab})")
    if not isinstance(pos, (int, np.integer)) or not 0 <= pos < cfg.max_seq:
        raise ValueError(f"position {pos!r} is outside [0, max_seq={cfg.max_seq})")
    check_cache(cfg, cache, kv_bf16, dtype)
    t = {} if taps is not None else None
    logits = forward(source, [token], [pos], cache=cache, kv_bf16=kv_bf16, dtype=dtype, taps=t)
    if taps is not None:
        taps.update({k: v[0] for k, v in t.items()})
    return logits[0]


def generate_reference(source, tokens: list[int], pos0: int = 0, *, cache: KVCache | None = None,
                       kv_bf16: bool = True, dtype=np.float32):
    """Teacher-forced run: feeds tokens[i] at position pos0 + i and returns every step's logits [n, V]."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("no tokens to feed")
    cfg = source.cfg
    if pos0 < 0 or pos0 + len(tokens) > cfg.max_seq:
        raise ValueError(f"positions {pos0}..{pos0 + len(tokens) - 1} do not fit max_seq={cfg.max_seq}")
    if cache is None and pos0 > 0:
        raise ValueError(f"pos0={pos0} needs the cache that holds positions 0..{pos0 - 1}")
    xp = view(source, dtype).xp
    return forward(source, tokens, xp.arange(pos0, pos0 + len(tokens)), cache=cache, kv_bf16=kv_bf16, dtype=dtype)

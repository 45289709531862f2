"""The decode step, declared once.

One token's decode is the list `STAGES` below, in decode order. Each stage says what it computes (`math`), which
buffers it reads and writes (with shapes, through `BUFFERS`), which of those are weights, how its work divides into
units and which rows of each input a unit needs (the grain of its dependencies), its shared memory, what the
debug build taps, and which reference function checks it. Everything that used to restate the step derives from
here:

* the generated C++ header (`workbench.build.header`): stage, tap, slot and status constants, the where-word
  layout, the shared-memory layout, the Params struct, and the decode loop itself, one call per stage;
* buffer allocation and the Params the runtime fills (`workbench.run.runtime`);
* the taps and stage-local verification (`workbench.check`), the timing slots and bytes per stage
  (`workbench.measure`), and the stage order of the dashboards and tables (`workbench.ui`).

Adding or fusing a stage means editing this list and that stage's files (its section in kernels/sections/ and
its reference in workbench/check/stages.py), nothing else.

Shapes come from the model config (`ModelConfig`); a few scratch buffers also depend on the launch (`Launch`: the
grid, one block per SM). Names of buffers are the names of the kernel's Params fields and of the prepared weights.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from .check import stages as ref
from .model.config import ModelConfig

# ---- the launch: what a few shapes depend on besides the model ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """One block per SM, all resident (cooperative launch), `threads` per block. With `stream`, the block's last
    warp is the weight streamer (see `streams`) and the stages run on the others."""
    grid: int = 132
    threads: int = 512
    attn_min_chunk: int = 0         # fewest cache positions per attention split (0: one step per reading warp)
    attn_single: int = 2            # a block takes a kv head's whole context alone up to this many chunks
    attn_kv_bytes: int = 131072     # shared memory for attention's rings of K/V steps (one ring per warp); 0: none
    attn_bufs: int = 3              # steps in a warp's ring: all but one in flight while the warp reads one
    stream: bool = False
    register_stages: tuple = ()     # in a stream build, stages that still read their weights straight to registers
    # stages whose first weight loads go out before the grid barrier they follow (H200, 1b: +3.7% at position 128,
    # NOTES.md round 16)
    early: tuple = ("qkv_rope_append", "o_proj_residual", "gate_up_silu", "lm_head")
    # the residual stream's fixed-point parts (X_FRAC_BITS): block b of the MLP's down projection adds into part
    # b % x_parts, so no address takes more than grid / x_parts atomic adds. On the H200, 132 blocks adding D
    # columns then a grid barrier and a read of all of x: 4 parts cost 1.65 us a round at D = 2048 where one part
    # cost 3.65 and today's float adds 2.09; 2.53 against 3.57 and 1.89 at D = 4096 (NOTES.md, determinism)
    x_parts: int = 4

    def max_splits(self, cfg: ModelConfig) -> int:
        """Attention splits each kv head's positions over at most this many blocks (≈ one block per SM)."""
        return max(1, self.grid // cfg.n_kv_heads)

    def attn_chunk(self, cfg: ModelConfig) -> int:
        """The fewest cache positions an attention split takes (WB_ATTN_MIN_CHUNK): attn_min_chunk, or by default
        one step for each reading warp, since a split with less leaves warps idle and still pays for its merge.
        Without rings (AMD), 32 positions, as measured on the CUDA-core path."""
        if self.attn_min_chunk:
            return self.attn_min_chunk
        warps = self.attn_warps(cfg)
        return warps * ATTN_STEP if warps else 32

    def attn_single_positions(self, cfg: ModelConfig) -> int:
        """Up to this many positions (WB_ATTN_SINGLE) one block takes a kv head's context alone and writes o
        itself. Splitting pays a merge (partials out, an arrival counter, the last block's reads of every partial:
        ~1 µs a layer); at 129–256 positions on the 1B one block with two steps a warp was 2% faster than two
        splits of one step (NOTES.md, round 15). Past it, the positions split into chunks of attn_chunk."""
        return self.attn_single * self.attn_chunk(cfg)

    def attn_warps(self, cfg: ModelConfig) -> int:
        """Warps of a block that read K/V in attention (WB_ATTN_WARPS), each through its own ring of attn_bufs steps
        of ATTN_STEP positions (K and V rows of hd bf16, padded by 8 bf16 against bank conflicts): as many as
        attn_kv_bytes holds, at most the block's. A stream build gives attention one warp's ring at most: its weight
        ring takes the shared memory beside the stages'."""
        return min(1 if self.stream else self.consumer_warps, self.attn_kv_bytes // self.attn_ring_bytes(cfg))

    def attn_ring_bytes(self, cfg: ModelConfig) -> int:
        """One warp's ring: attn_bufs steps, each ATTN_STEP K rows then ATTN_STEP V rows of attn_row(cfg) bf16."""
        return self.attn_bufs * ATTN_STEP * 2 * attn_row(cfg) * 2

    @property
    def consumer_warps(self) -> int:
        """The warps that run the stages (NVIDIA's 32-lane warps: streaming is an sm_90 build)."""
        return self.threads // NV_WARP - (1 if self.stream else 0)

    @property
    def stage_threads(self) -> int:
        """The threads that run a stage (wb_ntid() in the kernel): the block's, less the streaming warp."""
        return self.consumer_warps * NV_WARP


ATTN_STEP = 16                      # cache positions a warp takes at a time in attention: an mma's 16 rows
ATTN_PAD = 8                        # bf16 after each K/V row in shared memory: 8 rows' 16-byte loads hit distinct banks


def attn_row(cfg: ModelConfig) -> int:
    """bf16 a K or V row takes in attention's rings (WB_ATTN_KS): head_dim, padded."""
    return cfg.head_dim + ATTN_PAD


def attn_query_words(cfg: ModelConfig) -> int:
    """The queries as the tensor cores take them (NVIDIA): per 16 dims of head_dim, 32 lanes × 6 words (two bf16
    pairs, each split in three parts)."""
    return cfg.head_dim // 16 * 6 * NV_WARP
NV_WARP = 32                        # lanes of an NVIDIA warp (WB_WARP there, and in a stage's PTX body)
MAX_WARPS = 32                      # warps in a 1024-thread block at the narrowest warp (32 lanes, NVIDIA)

# ---- buffers --------------------------------------------------------------------------------------------------
DTYPES = {"f32": ("float", 4), "bf16": ("bf16", 2), "i32": ("int", 4), "u32": ("u32", 4), "u64": ("u64", 8),
          "fixed": ("fx64", 8)}

# The residual stream x is held in fixed point, value = Σ_parts x[part] · 2^-X_FRAC_BITS in int64, because its sum
# over the blocks of the MLP's down projection is made of atomic adds whose order varies from run to run: integer
# addition gives the same bits in any order, float addition does not (runs that did not repeat, seeded or A/B).
# 2^-32 is finer than fp32 for every |x| ≥ 2^-9, and its rounding (≤ 2^-33 a term, ≤ grid + 1 terms) is ~1e-8 of
# an x whose rms is ~1: far inside the stages' fp32 tolerances, which are relative to the rms. Range: a value
# written whole (embedding, o_proj) must be below 2^X_VALUE_BITS in magnitude, a block's partial sum below
# 2^X_VALUE_BITS / grid, so a total stays below 2^(X_VALUE_BITS + 1), i.e. 2^61 in the integer, and cannot wrap.
# A value past its bound (NaN and inf included) poisons the element instead: INT64_MIN in part 0, after which the
# rest of the adds (< 2^61 together) leave the total at least 2^63 − 2^61 in magnitude; a reader takes any total
# of magnitude 2^62 or more as NaN. No trained model's residual comes near 2^28 (they stay below ~1e4).
X_FRAC_BITS = 32
X_VALUE_BITS = 28
X_NAN_BITS = 62


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer of the decode step. `shape` is the whole buffer; for weights and the cache with `per_layer`, the
    leading axis is the layer and each layer's stage is handed its slice."""
    name: str
    dtype: str
    shape: Callable[[ModelConfig, Launch], tuple]
    kind: str                       # weight | table | activation | cache | scratch | value
    doc: str
    per_layer: bool = False

    def layer_shape(self, cfg: ModelConfig, launch: Launch = Launch()) -> tuple:
        s = self.shape(cfg, launch)
        return s[1:] if self.per_layer else s

    def elements(self, cfg: ModelConfig, launch: Launch = Launch()) -> int:
        n = 1
        for d in self.shape(cfg, launch):
            n *= d
        return n

    def value_shape(self, cfg: ModelConfig, launch: Launch = Launch()) -> tuple:
        """The shape of the value a layer's slice holds: a fixed-point buffer's parts [parts, n] hold one [n]."""
        s = self.layer_shape(cfg, launch)
        return s[1:] if self.dtype == "fixed" else s

    def value_elements(self, cfg: ModelConfig, launch: Launch = Launch()) -> int:
        n = self.elements(cfg, launch)
        return n // self.shape(cfg, launch)[0] if self.dtype == "fixed" else n

    def nbytes(self, cfg: ModelConfig, launch: Launch = Launch()) -> int:
        return self.elements(cfg, launch) * DTYPES[self.dtype][1]

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype][0]


def _b(name, dtype, shape, kind, doc, per_layer=False):
    return Buffer(name, dtype, shape, kind, doc, per_layer)


BUFFERS: dict[str, Buffer] = {b.name: b for b in [
    # weights, in the layout prepare() gives them (workbench.model.weights.Prepared)
    _b("embed", "bf16", lambda c, l: (c.vocab, c.hidden), "weight", "token embeddings [V, D]"),
    _b("wqkv", "bf16", lambda c, l: (c.n_layers, c.qkv_rows, c.hidden), "weight",
       "Wq, Wk, Wv stacked [L, Q+2KV, D]: rope pairs side by side, attention-norm gain folded in", True),
    _b("bqkv", "f32", lambda c, l: (c.n_layers, c.qkv_rows), "weight",
       "q, k, v biases [L, Q+2KV] in Wqkv's row order (Qwen2); zeros, and never read, for a model without", True),
    _b("qk_gain", "f32", lambda c, l: (c.n_layers, 2, c.head_dim), "weight",
       "per-head q norm gain, then k norm gain [L, 2, hd] (Qwen3); ones, and never read, for a model without", True),
    _b("wo", "bf16", lambda c, l: (c.n_layers, c.hidden, c.q_dim), "weight", "attention output [L, D, Q]", True),
    _b("wgu", "bf16", lambda c, l: (c.n_layers, 2 * c.intermediate, c.hidden), "weight",
       "gate row j then up row j [L, 2F, D], MLP-norm gain folded in", True),
    _b("wd", "bf16", lambda c, l: (c.n_layers, c.intermediate, c.hidden), "weight",
       "down projection, transposed [L, F, D]: row j is Wd's column j, what hmlp[j] scales", True),
    _b("lm_head", "bf16", lambda c, l: (c.vocab, c.hidden), "weight", "LM head [V, D], final-norm gain folded in"),
    # tables
    _b("rope_cos", "f32", lambda c, l: (c.max_seq, c.head_dim // 2), "table", "cos(pos·θ_i) [max_seq, hd/2]"),
    _b("rope_sin", "f32", lambda c, l: (c.max_seq, c.head_dim // 2), "table", "sin(pos·θ_i) [max_seq, hd/2]"),
    # the activations of one step
    _b("x", "fixed", lambda c, l: (l.x_parts, c.hidden), "activation",
       "the residual stream [parts, D] in fixed point (X_FRAC_BITS): x = Σ_parts x[part], the same in any order"),
    _b("h", "f32", lambda c, l: (c.hidden,), "activation",
       "the residual after attention [D], read by the MLP's norm: x's value after o_proj, in a buffer of its own "
       "so that down's adds into x cannot reach a block still reading it"),
    _b("q", "f32", lambda c, l: (c.q_dim,), "activation", "queries, rotated [Hq·hd]"),
    _b("o", "f32", lambda c, l: (c.q_dim,), "activation", "attention output [Hq·hd]"),
    _b("hmlp", "f32", lambda c, l: (c.intermediate,), "activation", "silu(gate) ⊙ up [F]"),
    _b("logits", "f32", lambda c, l: (c.vocab,), "activation", "next-token logits [V]"),
    # state that outlives the step
    _b("k_cache", "bf16", lambda c, l: (c.n_layers, c.n_kv_heads, c.max_seq, c.head_dim), "cache",
       "keys [L, Hkv, max_seq, hd]: position p holds the key of the token fed at p", True),
    _b("v_cache", "bf16", lambda c, l: (c.n_layers, c.n_kv_heads, c.max_seq, c.head_dim), "cache",
       "values [L, Hkv, max_seq, hd]", True),
    # cross-block scratch: contracts between the blocks of one stage, or between two stages
    _b("attn_part", "f32", lambda c, l: (c.n_heads, l.max_splits(c), c.head_dim + 2), "scratch",
       "per (query head, split): max, sum, unnormalised output, merged by the last split's block"),
    _b("attn_count", "u32", lambda c, l: (c.n_kv_heads,), "scratch", "splits of each kv head done"),
    _b("qk_raw", "f32", lambda c, l: (c.q_dim + c.kv_dim,), "scratch",
       "q heads then k heads before their per-head norm and RoPE (Qwen3), finished by each head's last row pair"),
    _b("qk_count", "u32", lambda c, l: (c.n_heads + c.n_kv_heads,), "scratch", "row pairs of each q and k head done"),
    _b("blk_max", "f32", lambda c, l: (l.grid,), "scratch", "each block's largest logit (lm_head → sampling)"),
    _b("blk_arg", "i32", lambda c, l: (l.grid,), "scratch", "the index of that logit, lowest on ties"),
    # values one block hands on in registers (no Params field)
    _b("token", "i32", lambda c, l: (), "value", "the token fed at this step"),
    _b("sampled", "i32", lambda c, l: (), "value", "the token the sampler chose"),
]}


# ---- stages ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Use:
    """Part of a buffer a stage reads or writes. `rows(cfg, unit)` gives the rows (flat element ranges of the
    buffer's per-layer slice, as (start, stop) pairs) that one work unit touches; None means all of it. For the
    cache, `positions` says which positions: "pos" (the one being appended) or "0..pos"."""
    buffer: str
    rows: Callable | None = None
    positions: str | None = None
    when: Callable | None = None        # cfg → whether the stage reads it for this model (None: always)
    same_as: str | None = None          # a write: the same value as the stage's write of that buffer (a copy)
    atomic: bool = False                # a write: every unit adds into the whole buffer atomically (no unit
    #                                     reads it, so no unit's rows need to be its own)
    local: bool = False                 # a read: unit u needs only what unit u of the writer wrote, and both
    #                                     stages deal units to blocks alike (deal="blocks"): a block barrier orders them

    def active(self, cfg: ModelConfig) -> bool:
        return self.when is None or bool(self.when(cfg))


DEALS = ("warps", "across", "blocks")  # Stage.deal's values, in the order of the kernel's WbDeal


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    scope: str                          # "layer": once per layer; "token": once per step
    math: str                           # what it computes, one line
    reads: tuple
    writes: tuple
    units: Callable                     # (cfg, launch) → how many work units the stage divides into
    unit: str                           # what one unit is
    runs_on: str = "grid"               # "grid": every block takes units; "block0": one block does it all
    deal: str = "warps"                 # "warps": units round-robin over the grid's warps, numbered block by
    #                                     block; "across": the same, numbered block-fastest (a stage with fewer
    #                                     units than warps); "blocks": block b owns the contiguous units
    #                                     block_units(n, grid, b), its warps share them (WB_DEAL_<STAGE> in C++)
    taps: tuple = ()                    # written buffers the taps build copies out after the stage
    smem: Callable | None = None        # (cfg, launch) → {region: floats}, laid out from 0 in this order
    extra_args: tuple = ()              # C++ arguments after the buffers (e.g. "s.pos", "smem")
    doc: str = ""
    paths: Callable | None = None       # (cfg, launch, thorough) → positions where the section's code path changes
    reference: Callable | None = None   # its math on a check.stages.StageIO → {buffer: value}
    tolerances: dict = dataclasses.field(default_factory=dict)   # {written buffer: check.stages.Tolerance}
    contracts: tuple = ()               # checks beyond tolerances (check.stages.*_contract)
    streamed: bool = True               # a stream build feeds its weights through the ring (False: the section
    #                                     reads them itself, not as dot products of whole rows)

    def reads_buffer(self, name: str) -> bool:
        return any(u.buffer == name for u in self.reads)

    def writes_buffer(self, name: str) -> bool:
        return any(u.buffer == name for u in self.writes)


def _act(c: ModelConfig) -> int:
    return _pad4(max(c.hidden, c.q_dim, c.intermediate))


def _pad4(n: int) -> int:
    """Regions start on 16 bytes (float4 accesses)."""
    return -(-n // 4) * 4


RED = 2 * MAX_WARPS                     # block reductions: one float and one int per warp


def _qkv_rows(c: ModelConfig, u: int):
    """Rows a QKV row pair writes, as (buffer, start, stop) in the q / k / v layouts (heads of hd)."""
    pair = 2 * u
    if pair < c.q_dim:
        return "q", pair // c.head_dim
    if pair < c.q_dim + c.kv_dim:
        return "k", (pair - c.q_dim) // c.head_dim
    return "v", (pair - c.q_dim - c.kv_dim) // c.head_dim


def _head_rows(c: ModelConfig, head: int, heads: int = 1):
    return ((head * c.head_dim, (head + heads) * c.head_dim),)


def _qkv_write(part: str):
    def rows(c: ModelConfig, u: int):
        which, head = _qkv_rows(c, u)
        return _head_rows(c, head) if which == part else ()
    return rows


def attention_paths(c: ModelConfig, l: Launch, thorough: bool = False) -> list[int]:
    """Positions on both sides of every change of attention's code path: one block alone (direct write) to
    splits (partials merged by the last block), every further split when thorough, the saturation at max_splits (beyond it the
    chunks grow), a chunk of one step of 16 positions and of a step and one, a chunk that gives every reading warp
    one step and one more, a warp's ring refilled and coming round to its first buffer again, a long position
    (≥ 4,096), and the context's last two positions (the cache's end, wherever --max-seq put it)."""
    chunk, S, single = l.attn_chunk(c), l.max_splits(c), l.attn_single_positions(c)
    n = {1, 2, 3, 4, ATTN_STEP, ATTN_STEP + 1}
    if S > 1:
        n |= {single, single + 1, single + 2, chunk * S, chunk * S + 1}
    if thorough:
        n |= {chunk * m + d for m in range(2, S) for d in (0, 1)}
    # a block's chunk: every reading warp one step, one step more, the first refill of a ring, the ring round
    every = max(1, l.attn_warps(c)) * ATTN_STEP
    n |= {S * every, S * (every + 1), S * (every * (l.attn_bufs - 1) + 1), S * (every * l.attn_bufs + 1)}
    n |= {4096, 4097, 4098, c.max_seq - 1, c.max_seq}
    return sorted(p - 1 for p in n if 1 <= p <= c.max_seq)


def down_phases(c: ModelConfig, l: Launch) -> int:
    """The down projection's row phases: a block's threads cover D in 8-byte column groups (4 columns a thread),
    and as many such covers as fit take every phase-th row of the block's Wdᵀ rows (DOWN_PHASES in the kernel)."""
    return max(1, l.stage_threads // (c.hidden // 4))


def block_units(n: int, grid: int, block: int) -> range:
    """The units a stage that deals by blocks gives block `block` (wb_block_units in kernels/lib/stream.cuh)."""
    return range(block * n // grid, (block + 1) * n // grid)


SAMPLER_SCRATCH_FLOATS = (256 + 1024) * 2 + 4    # SampScratch: u64 hist[256], u64 chunk[1024], two u32, one u64

STAGES: tuple[Stage, ...] = (
    Stage("embedding", "token", "x = embed[token]",
          reads=(Use("token"), Use("embed", positions="token")), writes=(Use("x"),),
          units=lambda c, l: 1, unit="the whole row", runs_on="block0", taps=("x",),
          reference=ref.embedding_io, tolerances={"x": ref.EXACT}),
    Stage("qkv_rope_append", "layer", "q, k, v = rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x); K[pos], V[pos] = k, v",
          reads=(Use("x"), Use("wqkv", rows=lambda c, u: ((2 * u * c.hidden, (2 * u + 2) * c.hidden),)),
                 Use("bqkv", when=lambda c: c.qkv_bias), Use("qk_gain", when=lambda c: c.qk_norm),
                 Use("rope_cos", positions="pos"), Use("rope_sin", positions="pos")),
          writes=(Use("q", rows=_qkv_write("q")), Use("k_cache", rows=_qkv_write("k"), positions="pos"),
                  Use("v_cache", rows=_qkv_write("v"), positions="pos"),
                  Use("qk_raw", when=lambda c: c.qk_norm), Use("qk_count", when=lambda c: c.qk_norm)),
          units=lambda c, l: c.qkv_rows // 2, unit="a row pair (a rope pair of q or k, two dims of v)", deal="across",
          taps=("q", "k_cache", "v_cache"),
          smem=lambda c, l: {"act": _act(c), "red": RED}, extra_args=("layer", "s.pos", "smem"),
          doc="n = RMSNorm without its gain (folded into Wqkv); + bqkv before RoPE for a model with biases (Qwen2); "
              "each q and k head RMS-normalised with its gain before RoPE (Qwen3: qk_gain)",
          reference=ref.qkv_rope_append_io,
          tolerances={"q": ref.FP32, "k_cache": ref.KV_BF16, "v_cache": ref.KV_BF16}),
    Stage("attention_decode", "layer", "o = softmax(q·Kᵀ/√hd)·V over positions 0..pos, per query head",
          reads=(Use("q", rows=lambda c, h: _head_rows(c, h * c.group, c.group)),
                 Use("k_cache", rows=lambda c, h: _head_rows(c, h), positions="0..pos"),
                 Use("v_cache", rows=lambda c, h: _head_rows(c, h), positions="0..pos")),
          writes=(Use("o", rows=lambda c, h: _head_rows(c, h * c.group, c.group)), Use("attn_part"),
                  Use("attn_count")),
          units=lambda c, l: c.n_kv_heads, unit="a kv head (its positions split over up to max_splits blocks)",
          taps=("o",),
          smem=lambda c, l: {"q": _pad4(max(c.group * c.head_dim, attn_query_words(c))),
                             "warps": _pad4(l.threads // 32 * c.group * (c.head_dim + 2)),
                             "kv": l.attn_warps(c) * l.attn_ring_bytes(c) // 4,
                             "src": 4 * l.attn_warps(c)},             # two pointers a reading warp
          extra_args=("layer", "s.pos", "P->attn_max_splits", "smem"), paths=attention_paths,
          reference=ref.attention_decode_io, tolerances={"o": ref.ATTENTION}),
    Stage("o_proj_residual", "layer", "h = x += Wo·o",
          reads=(Use("o"), Use("wo", rows=lambda c, r: ((r * c.q_dim, (r + 1) * c.q_dim),)),
                 Use("x", rows=lambda c, r: ((r, r + 1),))),
          writes=(Use("x", rows=lambda c, r: ((r, r + 1),)), Use("h", rows=lambda c, r: ((r, r + 1),), same_as="x")),
          units=lambda c, l: c.hidden, unit="an output row", taps=("x", "h"),
          smem=lambda c, l: {"act": _act(c)}, extra_args=("layer", "smem"),
          reference=ref.o_proj_residual_io, tolerances={"x": ref.FP32, "h": ref.FP32}),
    Stage("gate_up_silu", "layer", "hmlp = silu(Wg·m(h)) ⊙ Wu·m(h)",
          reads=(Use("h"), Use("wgu", rows=lambda c, j: ((2 * j * c.hidden, (2 * j + 2) * c.hidden),))),
          writes=(Use("hmlp", rows=lambda c, j: ((j, j + 1),)),),
          units=lambda c, l: c.intermediate, unit="a gate/up row pair", taps=("hmlp",), deal="blocks",
          smem=lambda c, l: {"act": _act(c), "red": RED}, extra_args=("layer", "smem"),
          doc="m = RMSNorm without its gain (folded into Wgu)", reference=ref.gate_up_silu_io,
          tolerances={"hmlp": ref.FP32}),
    # The MLP runs between two grid barriers: block b's down part reads only the hmlp rows its own gate_up part
    # wrote (both deal units by blocks), so a block barrier orders them; its partial sums go into x by atomic adds,
    # in fixed point so that their order does not change the sum.
    Stage("down_residual", "layer", "x += Wd·hmlp",
          reads=(Use("hmlp", rows=lambda c, j: ((j, j + 1),), local=True),
                 Use("wd", rows=lambda c, j: ((j * c.hidden, (j + 1) * c.hidden),)), Use("x")),
          writes=(Use("x", atomic=True),),
          units=lambda c, l: c.intermediate, unit="hmlp[j]·Wd[:, j] (a row of the transpose) added to all of x",
          taps=("x",), deal="blocks", streamed=False,
          smem=lambda c, l: {"hmlp": _pad4(-(-c.intermediate // l.grid)), "sum": down_phases(c, l) * c.hidden},
          extra_args=("layer", "smem"),
          doc="each block's partial sums added into x's part block % x_parts atomically, in fixed point: the same "
              "sum whatever order the blocks' additions arrive in",
          reference=ref.down_residual_io, tolerances={"x": ref.FP32}),
    Stage("lm_head", "token", "logits = W_lm·n(x); each block's best (value, index)",
          reads=(Use("x"), Use("lm_head", rows=lambda c, v: ((v * c.hidden, (v + 1) * c.hidden),))),
          writes=(Use("logits", rows=lambda c, v: ((v, v + 1),)), Use("blk_max"), Use("blk_arg")),
          units=lambda c, l: c.vocab, unit="a vocabulary row", taps=("logits", "blk_max", "blk_arg"),
          smem=lambda c, l: {"act": _act(c), "red": RED}, extra_args=("smem",),
          doc="n = RMSNorm without its gain (folded into W_lm); the greedy argmax is fused into the partials",
          reference=ref.lm_head_io, tolerances={"logits": ref.FP32}, contracts=(ref.partials_contract,)),
    Stage("sampling", "token", "sampled = argmax(logits), or a draw from softmax(logits/T) cut by top-k, top-p",
          reads=(Use("logits"), Use("blk_max"), Use("blk_arg")), writes=(Use("sampled"),),
          units=lambda c, l: 1, unit="the whole step", runs_on="block0", taps=("sampled",),
          smem=lambda c, l: {"scratch": SAMPLER_SCRATCH_FLOATS}, extra_args=("P", "s.step", "smem"),
          doc="P: the sampling settings; the draws of recorded steps go to P->draws", reference=ref.sampling_io,
          contracts=(ref.sampler_contract,)),
    Stage("publish", "token", "token = prompt[step + 1] while forced, else sampled: streamed; EOS, limits, abort",
          reads=(Use("sampled"),), writes=(Use("token"),),
          units=lambda c, l: 1, unit="the whole step", runs_on="block0", extra_args=("P", "s.step"),
          doc="P: the prompt, the host's mapped words, the limits; recorded steps' logits to P->logits_hist",
          contracts=(ref.publish_contract,)),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
_BY_NAME = {s.name: s for s in STAGES}


def stage(name: str) -> Stage:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no stage {name!r} in the plan (stages: {', '.join(STAGE_NAMES)})") from None


LAYER_STAGES = tuple(s.name for s in STAGES if s.scope == "layer")
TOKEN_STAGES = tuple(s.name for s in STAGES if s.scope == "token")

# The kernel's library headers (not stages: the building blocks the sections share), pasted before the sections in
# this order; the sections follow in decode order, then the generated decode step, then kernels/monokernel.cuh.
LIBRARY = ("grid_sync", "stream", "residual", "matvec", "instrument")
FILES = LIBRARY + STAGE_NAMES + ("monokernel",)


# ---- what runs where, and where the grid must synchronise -----------------------------------------------------

def _first_layer_index() -> int:
    return next(i for i, s in enumerate(STAGES) if s.scope == "layer")


def execution(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(stage, layer) in the order one step executes them; layer -1 for the token stages. The layer stages form
    one contiguous run of the plan, repeated for every layer."""
    return list(_execution(cfg.n_layers))


@functools.lru_cache(maxsize=64)
def _execution(n_layers: int) -> tuple:
    first = _first_layer_index()
    last = max(i for i, s in enumerate(STAGES) if s.scope == "layer")
    if any(s.scope != "layer" for s in STAGES[first:last + 1]):
        raise ValueError("the plan's layer stages must be contiguous")
    out = [(s.name, -1) for s in STAGES[:first]]
    for layer in range(n_layers):
        out += [(s.name, layer) for s in STAGES[first:last + 1]]
    return tuple(out + [(s.name, -1) for s in STAGES[last + 1:]])


def conflicts(a: Stage, b: Stage) -> set:
    """Buffers through which stage b, running after stage a, depends on it: b reads or overwrites what a wrote, or
    overwrites what a read. Two stages of the one block need no barrier between them (a block barrier orders them),
    so they conflict in nothing."""
    if a.runs_on == "block0" and b.runs_on == "block0":
        return set()
    wa, ra = {u.buffer for u in a.writes}, {u.buffer for u in a.reads}
    wb, rb = {u.buffer for u in b.writes}, {u.buffer for u in b.reads}
    return ((wa & (rb - local_reads(a, b))) | (wa & wb)) | (ra & wb)


def local_reads(a: Stage, b: Stage) -> set:
    """Buffers stage b reads from stage a unit by unit within each block (Use.local, both dealing by blocks): a
    block barrier between them is enough. `local_problem` checks the claim against the rows for a config."""
    if a.deal != "blocks" or b.deal != "blocks":
        return set()
    return {u.buffer for u in b.reads if u.local and a.writes_buffer(u.buffer)}


def local_problem(cfg: ModelConfig, launch: Launch = Launch()) -> str | None:
    """Why a read the plan declares local is not (None: every one is): the reader and the writer must deal the
    same number of units by blocks, and unit u may read only rows that the writer's unit u wrote."""
    for b in STAGES:
        for u in b.reads:
            if not u.local:
                continue
            layer = (1 if cfg.n_layers > 1 else 0) if b.scope == "layer" else -1
            made = producer(cfg, u.buffer, b.name, layer)
            writer = stage(made[0]) if made is not None else None
            if writer is None or u.buffer not in local_reads(writer, b):
                return f"{b.name} reads {u.buffer} locally, but no stage that deals by blocks writes it"
            n = b.units(cfg, launch)
            if writer.units(cfg, launch) != n:
                return (f"{b.name} reads {u.buffer} locally over {n} units, {writer.name} writes it over "
                        f"{writer.units(cfg, launch)}: block b's units differ")
            w = next(x for x in writer.writes if x.buffer == u.buffer)
            for unit in range(n):
                want, have = u.rows(cfg, unit), w.rows(cfg, unit)
                if any(not any(h0 <= lo and hi <= h1 for h0, h1 in have) for lo, hi in want):
                    return (f"{b.name}'s unit {unit} reads rows {want} of {u.buffer}; {writer.name}'s unit {unit} "
                            f"wrote {have}")
    return None


def block_barrier_before(cfg: ModelConfig, stage_name: str) -> bool:
    """Whether a block barrier goes before the stage: the stage before it runs in the same slot (no grid barrier
    between them) and one of the two is a grid stage. Its warps may read what other warps of the block just wrote
    (a local read) or reuse the shared memory they still read; a block barrier orders both."""
    seq = list(_execution(cfg.n_layers))
    i = next(k for k, (name, _) in enumerate(seq) if name == stage_name)
    if i == 0:
        return False
    prev = seq[i - 1]
    if barrier_slot(cfg, prev[0], prev[1]) is not None:
        return False
    return stage(prev[0]).runs_on == "grid" or stage(stage_name).runs_on == "grid"


def _barriers(seq) -> list[bool]:
    """barrier[i]: a grid barrier follows seq[i]. Greedy: a barrier goes in just before the first stage that
    conflicts with a stage run since the last barrier, which places the fewest barriers that respect every
    dependency of the declared reads and writes."""
    after = [False] * len(seq)
    pending = []
    for i, (name, _) in enumerate(seq):
        s = stage(name)
        if any(conflicts(p, s) for p in pending):
            after[i - 1] = True
            pending = []
        pending.append(s)
    return after


@dataclasses.dataclass(frozen=True)
class Slot:
    """One grid barrier of a step and the stages that run between the previous barrier and it."""
    index: int
    stages: tuple                       # ((stage, layer), ...) in execution order
    label: str                          # e.g. "gate_up_silu", or "sampling+publish+embedding"
    layer: int                          # of the stage that ends at this barrier

    @property
    def stage(self) -> str:
        """The stage that ends at this barrier."""
        return self.stages[-1][0]


@functools.lru_cache(maxsize=64)
def _slots(n_layers: int) -> tuple:
    seq = list(_execution(n_layers))
    n = len(seq)
    # a barrier after a step's last stage is decided by the next step's first: look at consecutive steps
    first_step = _barriers(seq + seq)[:n]
    steady = _barriers(seq * 3)[n:2 * n]        # what the previous step left running decides too
    if first_step != steady:
        raise ValueError("the plan needs different barriers at step 0 than later: the generated loop assumes not")
    if not any(steady):
        raise ValueError("the plan has no grid barrier")
    last = max(i for i in range(n) if steady[i])
    carried = tuple(seq[last + 1:])             # run after the step's last barrier: they open the next slot 0
    out, current = [], []
    for i in range(n):
        current.append(seq[i])
        if steady[i]:
            st = (carried if not out else ()) + tuple(current)
            out.append(Slot(len(out), st, "+".join(dict.fromkeys(s for s, _ in st)), seq[i][1]))
            current = []
    return tuple(out)


def slots(cfg: ModelConfig) -> tuple:
    """The grid barriers of one step, in order. Slot 0 also holds the stages the previous step ran after its last
    barrier (at step 0 there are none: it holds only its own)."""
    return _slots(cfg.n_layers)


def n_slots(cfg: ModelConfig) -> int:
    return len(slots(cfg))


def barrier_slot(cfg: ModelConfig, stage_name: str, layer: int) -> int | None:
    """The index of the barrier that follows this stage, or None when none does."""
    for s in slots(cfg):
        if s.stages[-1] == (stage_name, layer):
            return s.index
    return None


# ---- taps: what the debug build copies out, per step ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tap:
    """A buffer as a stage left it (for the cache: the row appended at pos), at every layer for layer stages."""
    stage: str
    buffer: str
    size: int                       # floats per layer (or per step for token stages)
    offset: int                     # of layer 0, in floats from the start of the step's record
    layers: int                     # 1 for token stages

    def at(self, layer: int) -> int:
        return self.offset + (layer if self.layers > 1 else 0) * self.size


def tap_size(cfg: ModelConfig, buffer: str, launch: Launch = Launch()) -> int:
    b = BUFFERS[buffer]
    if b.kind == "cache":
        return cfg.kv_dim                   # the row appended at pos: [Hkv, hd]
    if b.kind == "value":
        return 1
    return b.value_elements(cfg, launch)            # a fixed-point buffer is tapped as the value it holds


def taps(cfg: ModelConfig, launch: Launch = Launch()) -> tuple:
    out, off = [], 0
    for s in STAGES:
        layers = cfg.n_layers if s.scope == "layer" else 1
        for buf in s.taps:
            n = tap_size(cfg, buf, launch)
            out.append(Tap(s.name, buf, n, off, layers))
            off += n * layers
    return tuple(out)


def tap_step_floats(cfg: ModelConfig, launch: Launch = Launch()) -> int:
    t = taps(cfg, launch)
    return t[-1].offset + t[-1].size * t[-1].layers if t else 0


def tap(cfg: ModelConfig, stage_name: str, buffer: str, launch: Launch = Launch()) -> Tap:
    for t in taps(cfg, launch):
        if t.stage == stage_name and t.buffer == buffer:
            return t
    raise KeyError(f"stage {stage_name} taps no {buffer}")


def producer(cfg: ModelConfig, buffer: str, stage_name: str, layer: int) -> tuple[str, int] | None:
    """The (stage, layer) whose write of `buffer` the given stage reads: the latest writer before it in the step's
    execution order (an earlier step's, for what the step reads before anything wrote it: None)."""
    order = execution(cfg)
    i = order.index((stage_name, layer))
    for s, l in reversed(order[:i]):
        if stage(s).writes_buffer(buffer):
            return s, l
    return None


# ---- shared memory ---------------------------------------------------------------------------------------------

def smem_regions(cfg: ModelConfig, launch: Launch = Launch()) -> dict[str, dict[str, tuple[int, int]]]:
    """{stage: {region: (offset, floats)}}: each stage lays its regions out from 0 (stages never overlap in time
    within a block), 16-byte aligned."""
    out = {}
    for s in STAGES:
        regions, off = {}, 0
        for name, n in (s.smem(cfg, launch) if s.smem else {}).items():
            regions[name] = (off, _pad4(n))
            off += _pad4(n)
        out[s.name] = regions
    return out


EARLY_LOADS = 8                     # 16-byte loads a thread issues before the barrier it owes (matvec.cuh's first
#                                     chunk: WB_UNROLL_1 loads of a row, or WB_UNROLL_2 of each of a row pair)


def early_region(cfg: ModelConfig, launch: Launch = Launch()) -> tuple[int, int]:
    """(offset, floats) of the shared memory where an early stage's first loads land (Launch.early): one chunk of
    EARLY_LOADS 16-byte pieces a thread, after the regions of every early stage (which run while it fills), over
    what the other stages use (a block's own previous stage is over when it arrives at the barrier). Only a stage
    that owes a wait loads early (matvec.cuh): the others' regions may lie under it."""
    if not launch.early or launch.stream:
        return 0, 0
    regions = smem_regions(cfg, launch)
    off = max(sum(n for _, n in regions[name].values()) for name in launch.early)
    return off, launch.stage_threads * EARLY_LOADS * 4


def smem_floats(cfg: ModelConfig, launch: Launch = Launch()) -> int:
    """The largest stage's layout, or the early region's end (the stream's partials and ring follow)."""
    stages = max((sum(n for _, n in r.values()) for r in smem_regions(cfg, launch).values()), default=0)
    return max(stages, sum(early_region(cfg, launch)))


def smem_bytes(cfg: ModelConfig, launch: Launch = Launch()) -> int:
    """The dynamic shared memory a block is launched with: the largest stage's layout, then with streaming the
    partial sums and the weight ring."""
    if not launch.stream:
        return 4 * smem_floats(cfg, launch)
    return ring_offset(cfg, launch) + RING_ALIGN + ring_slots(cfg, launch) * launch.consumer_warps * SLOT_BYTES


# ---- the weight stream: what the block's streamer copies into its shared-memory ring ------------------------
# Every stage that reads a weight matrix row by row (a Use of a weight with `rows`) is a stream: each block takes
# the contiguous units [b·n/G, (b+1)·n/G) of it, and those units' rows, cut into pieces of at most SLOT_BYTES, are
# the block's items, in address order. The streamer (the block's last warp) copies the items of every stream of
# the step, in decode order, a page of one item per consumer warp at a time, into a ring of RING_SLOTS pages as fast
# as pages free up, never waiting on an activation. The consumer side (kernels/lib/stream.cuh, matvec.cuh) walks
# the same pages in the same order: both derive them from this table and the section's own unit count.
SLOT_BYTES = 4096                   # one bulk copy: a row of up to 2,048 bf16, or a piece of a longer row
SMEM_LIMIT = 232448                 # shared memory a block may have on sm_90 (227 KB, opt-in)
STATIC_SMEM = 4096                  # kept free for the kernel's static __shared__ (2.4 KB today: barrier words, mbarriers, stamps)
MAX_RING_SLOTS = 4                  # pages in the ring
RING_ALIGN = 128                    # the ring's slots start on this boundary of shared memory (stream.cuh)


def pieces(k: int, slot_bytes: int = SLOT_BYTES) -> int:
    """How many pieces a row of k bf16 is cut into: the fewest, each within a slot, that split the row evenly into
    whole 16-byte loads. kernels/lib/stream.cuh has the same rule (wb_pieces), checked against this by the header."""
    n = max(1, -(-2 * k // slot_bytes))
    while k % n or (k // n) % 8:
        n += 1
    return n


@dataclasses.dataclass(frozen=True)
class Stream:
    stage: str
    buffer: str
    units: int                      # the stage's units
    rows: int                       # rows of the matrix per unit
    k: int                          # elements per row
    scope: str                      # "layer" or "token", as the stage

    @property
    def pieces(self) -> int:
        return pieces(self.k)

    @property
    def piece(self) -> int:
        """Elements per item."""
        return self.k // self.pieces

    def items(self, launch: "Launch", block: int) -> int:
        return len(block_units(self.units, launch.grid, block)) * self.rows * self.pieces

    def max_items(self, launch: "Launch") -> int:
        return max(self.items(launch, b) for b in range(launch.grid))

    @property
    def combines(self) -> bool:
        """Whether a unit spans several items (so several warps): their partial sums meet in shared memory."""
        return self.rows * self.pieces > 1


def _weight_read(s: Stage) -> Use | None:
    """The stage's read of a weight by units of rows (None: it reads none that way). One at most: a stage's
    weight stream is one matrix."""
    found = [u for u in s.reads if BUFFERS[u.buffer].kind == "weight" and u.rows is not None]
    if len(found) > 1:
        raise ValueError(f"stage {s.name} reads {len(found)} weights by units ({', '.join(u.buffer for u in found)}): "
                         f"a stage streams one")
    return found[0] if found else None


def weight_units(cfg: ModelConfig, s: Stage, launch: "Launch" = None) -> Stream | None:
    """How the stage reads its weight: its units, each `rows` whole adjacent rows of k elements, unit u at u·rows
    (None: a stage with no weight read by units)."""
    launch = launch or Launch()
    u = _weight_read(s)
    if u is None:
        return None
    k = BUFFERS[u.buffer].layer_shape(cfg, launch)[-1]
    n = s.units(cfg, launch)
    (lo, hi), = u.rows(cfg, 0)
    per = hi - lo
    if lo != 0 or per % k or any(u.rows(cfg, x) != ((x * per, (x + 1) * per),) for x in (1, n - 1)):
        raise ValueError(f"stage {s.name}: a unit of {u.buffer} must be whole adjacent rows, unit u at u·rows")
    return Stream(s.name, u.buffer, n, per // k, k, s.scope)


def streams(cfg: ModelConfig, launch: "Launch" = None) -> tuple[Stream, ...]:
    """The weight streams of one step, in the plan's stage order (a layer stage's stream repeats per layer)."""
    launch = launch or Launch()
    chosen = (weight_units(cfg, s, launch) for s in STAGES if s.name not in launch.register_stages and s.streamed)
    return tuple(x for x in chosen if x is not None)


def early_problem(cfg: ModelConfig | None, names) -> str | None:
    """Why `names` cannot load early (None: they can; cfg None: what holds for every model). An early stage's warps issue the first loads of their
    weight units before waiting at the grid barrier in front of it (the barrier split into its arrival and its
    wait, the wait owed to the stage's prologue): so a grid stage that reads a weight by units, after a grid
    barrier. The step's first barrier is never split: the stop test reads what it publishes."""
    for n in names:
        if n not in STAGE_NAMES:
            return f"{n}: not a stage (stages: {', '.join(STAGE_NAMES)})"
        s = stage(n)
        if _weight_read(s) is None or s.runs_on != "grid":
            return f"{n} reads no weight by units on every block: there is nothing to load early"
        if cfg is not None and not any(early_barrier(cfg, Launch(early=(n,)), name, layer)
                                       for name, layer in _execution(cfg.n_layers)):
            return f"{n}: no grid barrier goes before it (the stage before it runs in the same slot)"
    return None


def early_barrier(cfg: ModelConfig, launch: "Launch", stage_name: str, layer: int) -> bool:
    """Whether the grid barrier after (stage, layer) is only arrived at, its wait owed to the next stage in the
    step's order (which loads weights first, Launch.early). False where no barrier follows, and for slot 0."""
    b = barrier_slot(cfg, stage_name, layer)
    if b is None or b == 0 or not launch.early:
        return False
    seq = _execution(cfg.n_layers)
    i = seq.index((stage_name, layer))
    return seq[(i + 1) % len(seq)][0] in launch.early


def stream_stage(cfg: ModelConfig, stage_name: str, launch: "Launch" = None) -> Stream | None:
    return next((x for x in streams(cfg, launch) if x.stage == stage_name), None)


def register_stages_problem(cfg: ModelConfig, names) -> str | None:
    """Why `names` cannot be a stream build's register stages (None: they can): each a stage with a stream."""
    streamed = {x.stage for x in streams(cfg)}
    bad = [n for n in names if n not in streamed]
    if bad:
        return f"{', '.join(bad)}: not a stage that streams weights (those are: {', '.join(sorted(streamed))})"
    if streamed and streamed <= set(names):
        return "every streaming stage is named: that is the register path (stream=False), with a warp less"
    return None


def partial_floats(cfg: ModelConfig, launch: "Launch" = None) -> int:
    """One float per item of the largest stream whose units span several items (0 without streaming)."""
    launch = launch or Launch()
    if not launch.stream:
        return 0
    return _pad4(max((x.max_items(launch) for x in streams(cfg, launch) if x.combines), default=0))


def ring_slots(cfg: ModelConfig, launch: "Launch" = None) -> int:
    """Pages in the ring (a page: a slot per consumer warp): as many as fit beside the stages' shared memory,
    up to MAX_RING_SLOTS."""
    launch = launch or Launch()
    if not launch.stream:
        return 0
    free = SMEM_LIMIT - STATIC_SMEM - ring_offset(cfg, launch) - RING_ALIGN
    n = min(MAX_RING_SLOTS, free // (launch.consumer_warps * SLOT_BYTES))
    if n < 1:
        raise ValueError(f"{launch.threads} threads leave no room for the weight ring: {launch.consumer_warps} "
                         f"consumer warps need {launch.consumer_warps * SLOT_BYTES} B beside the stages' "
                         f"{ring_offset(cfg, launch)} B (fewer threads, or stream=False)")
    return n


def ring_offset(cfg: ModelConfig, launch: "Launch" = None) -> int:
    """Byte offset of the ring in dynamic shared memory: after the stages' regions and the partials, 128-aligned."""
    launch = launch or Launch()
    n = 4 * (smem_floats(cfg, launch) + partial_floats(cfg, launch))
    return -(-n // 128) * 128


# ---- bytes: what each stage must move from memory --------------------------------------------------------------

def stage_weight_bytes(cfg: ModelConfig, stage_name: str) -> int:
    """Weight bytes one execution of the stage streams (one layer's slice for a layer stage)."""
    s = stage(stage_name)
    total = 0
    for u in s.reads:
        b = BUFFERS[u.buffer]
        if b.kind != "weight" or not u.active(cfg):
            continue
        if b.per_layer:
            total += b.nbytes(cfg) // cfg.n_layers
        elif u.positions == "token":                    # one row, the token's
            total += b.nbytes(cfg) // b.shape(cfg, Launch())[0]
        else:
            total += b.nbytes(cfg)
    return total


def stage_bytes(cfg: ModelConfig, stage_name: str, pos: int) -> int:
    """Bytes one execution of the stage cannot avoid moving from memory: its weights, and for attention the K and
    V of positions 0..pos (activations live in L2 and are not counted)."""
    s = stage(stage_name)
    total = stage_weight_bytes(cfg, stage_name)
    for u in s.reads:
        b = BUFFERS[u.buffer]
        if b.kind == "cache" and u.positions == "0..pos":
            total += 2 * cfg.kv_dim * (pos + 1)
    return total


def memory_bytes(cfg: ModelConfig, launch: Launch = Launch()) -> dict[str, int]:
    """Device bytes of every buffer the plan declares, by kind (weight, table, cache, activation, scratch): what
    the prepared weights and a Monokernel hold (its few control words aside)."""
    out: dict[str, int] = {}
    for b in BUFFERS.values():
        out[b.kind] = out.get(b.kind, 0) + b.nbytes(cfg, launch)
    return out


def longest_context(cfg: ModelConfig, free_bytes: int, launch: Launch = Launch(), *, weights: bool = True) -> int:
    """The largest max_seq (≤ max_position_embeddings) whose buffers fit `free_bytes` (with the weights, or with
    them already resident); 0 if not even one position fits."""
    limit = cfg.max_positions or cfg.max_seq

    def need(n):
        m = memory_bytes(dataclasses.replace(cfg, max_seq=n), launch)
        return sum(v for k, v in m.items() if weights or k not in ("weight", "table"))
    lo, hi = 0, limit
    while lo < hi:                      # the largest n with need(n) <= free: need grows with n
        mid = (lo + hi + 1) // 2
        if need(mid) <= free_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def memory_problem(cfg: ModelConfig, free_bytes: int, launch: Launch = Launch(), *,
                   weights_resident: bool = False) -> str | None:
    """None if the model's buffers at cfg.max_seq fit `free_bytes` of device memory (the weights counted unless
    already resident); else one line: what the context needs, by part, and the longest that fits."""
    m = memory_bytes(cfg, launch)
    parts = {"weights": m.get("weight", 0) + m.get("table", 0), "KV cache": m.get("cache", 0),
             "activations and scratch": m.get("activation", 0) + m.get("scratch", 0)}
    if weights_resident:
        parts.pop("weights")
    need = sum(parts.values())
    if need <= free_bytes:
        return None
    fits = longest_context(cfg, free_bytes, launch, weights=not weights_resident)
    gb = lambda b: f"{b / 1e9:.2f} GB"                      # noqa: E731
    what = ", ".join(f"{gb(v)} {k}" for k, v in parts.items())
    where = "free beside the weights" if weights_resident else "free"
    advice = (f"--max-seq {fits} is the longest context that fits" if fits else
              "not even a one-position context fits")
    return (f"{cfg.name} with a {cfg.max_seq}-position context needs {gb(need)} of GPU memory ({what}); the GPU has "
            f"{gb(free_bytes)} {where}: {advice}")


def weight_bytes_per_token(cfg: ModelConfig) -> int:
    """Every layer's weights plus the LM head (the embedding row is negligible): what a token must stream."""
    return sum(stage_weight_bytes(cfg, s) * (cfg.n_layers if stage(s).scope == "layer" else 1)
               for s in STAGE_NAMES if s != "embedding")


# ---- dependencies: which producer units a consumer unit waits for -----------------------------------------------

def _overlap(a, b) -> bool:
    if a is None or b is None:
        return True
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def dependencies(cfg: ModelConfig, launch: Launch = Launch()) -> dict:
    """{(consumer stage, buffer): (producer stage, [n_producer_units each consumer unit waits for])} for every
    activation or cache read whose producer is in the same step. This is what per-unit dependency counters would
    count (a consumer unit may start once that many of its producer's units have published)."""
    out = {}
    for s in STAGES:
        l = 1 if (s.scope == "layer" and cfg.n_layers > 1) else (0 if s.scope == "layer" else -1)
        for u in s.reads:
            b = BUFFERS[u.buffer]
            if b.kind not in ("activation", "cache", "scratch", "value"):
                continue
            prod = producer(cfg, u.buffer, s.name, l)
            if prod is None:
                continue
            p = stage(prod[0])
            pw = next(w for w in p.writes if w.buffer == u.buffer)
            n_p = p.units(cfg, launch)
            n_c = s.units(cfg, launch)
            counts = []
            for cu in range(n_c):
                want = u.rows(cfg, cu) if u.rows is not None else None
                counts.append(sum(1 for pu in range(n_p)
                                  if _overlap(want, pw.rows(cfg, pu) if pw.rows is not None else None)
                                  and (pw.rows is None or pw.rows(cfg, pu) != ())))
            out[s.name, u.buffer] = (prod[0], counts)
    return out


# ---- control: status words, error codes, the where word, the mapped host block ----------------------------------
# The kernel publishes a stop's reason and place in `status` (mapped host memory: readable while it runs and after
# it is gone); the host reads the same names.
STATUS_WORDS = ("code", "stage", "layer", "step", "block", "epoch", "missing_block", "missing_where", "n_missing",
                "stream_want", "stream_got")   # a stream error: the item the section asked for and the ring's (where-words)
STATUS_LEN = 16
ERRORS = ("ok", "hang", "aborted", "bad_token", "stream", "unwaited")
# dev_flags[] (device memory, cheap to poll): the stop's reason (an ERRORS code: every block stops at its next
# barrier), the previous step's decision that generation is done, and whether a barrier's hang report is taken.
DEV_FLAGS = ("stop", "done", "reported")
# Where each block is: written at every stage entry (waiting 0) and on arriving at the barrier after it (waiting 1),
# read when diagnosing a hang: by the kernel's own barrier report, and by the host, which keeps the words in mapped
# memory that outlives the process running the kernel. (field, bits), low bits first; the layer is stored + 1 so
# that -1 (a token stage) is 0.
WHERE_FIELDS = (("stage", 5), ("layer", 7), ("step", 19), ("waiting", 1))
MAX_BLOCKS = 1024                   # where-words the mapped block holds (one per block of the grid)
# The mapped host block, in 32-bit words: status, the host's abort flag, the count of published tokens, the heartbeat
# (steps done), each block's where-word, then the tokens.
MAPPED = (("status", STATUS_LEN), ("host_abort", 1), ("n_out", 1), ("progress", 1),
          ("where", MAX_BLOCKS), ("tokens_out", None))


def mapped_offset(name: str) -> int:
    off = 0
    for n, size in MAPPED:
        if n == name:
            return off
        off += size
    raise KeyError(name)


def mapped_words(max_tokens: int) -> int:
    """Words of a mapped block that can stream `max_tokens` tokens."""
    return mapped_offset("tokens_out") + max_tokens


def where_layout() -> list[tuple[str, int, int]]:
    """(field, shift, bits) of the where word, low bits first."""
    out, shift = [], 0
    for name, bits in WHERE_FIELDS:
        out.append((name, shift, bits))
        shift += bits
    return out


def where(stage_index: int, layer: int, step: int, waiting: bool = False) -> int:
    v = 0
    for (_, shift, bits), val in zip(where_layout(), (stage_index, layer + 1, step, int(waiting))):
        v |= (val & ((1 << bits) - 1)) << shift
    return v


def decode_where(w: int) -> tuple[str, int, int, bool] | None:
    """(stage, layer, step, waiting at the barrier after it) of a where word (read as signed or unsigned 32 bits),
    None for "unknown" (-1)."""
    if w == -1:
        return None
    w &= 0xFFFFFFFF
    st, layer, step, waiting = ((w >> shift) & ((1 << bits) - 1) for _, shift, bits in where_layout())
    return stage_name(st), layer - 1, step, bool(waiting)


def stage_name(index: int) -> str:
    """The stage of a Stage enum value the kernel reported ("stage N" for one the plan does not have)."""
    return STAGE_NAMES[index] if 0 <= index < len(STAGE_NAMES) else f"stage {index}"


def place(stage: str, layer: int, step: int) -> str:
    """Where in the decode step: "attention_decode of layer 3 at step 7" (a token stage has no layer)."""
    return stage + (f" of layer {layer}" if layer >= 0 else "") + f" at step {step}"


def describe_where(w: int) -> str:
    d = decode_where(int(w))
    if d is None:
        return "unknown"
    st, layer, step, waiting = d
    return ("waiting after " if waiting else "") + place(st, layer, step)


# Kernel parameters that are not buffers of the step: the synchronisation words, the host's mapped memory, the
# inputs of a launch, recording and instrumentation. (field, C type)
CONTROL = (
    ("bar_count", "u32*"), ("arrive", "u32*"), ("where", "u32*"), ("dev_flags", "int*"), ("status", "int*"),
    ("host_abort", "const int*"), ("tokens_out", "int*"), ("n_out", "int*"), ("progress", "int*"),
    ("tokens_in", "const int*"), ("eos", "const int*"), ("draws", "int*"), ("timing", "u64*"),
    ("taps", "float*"), ("tap_slot", "const int*"), ("logits_hist", "float*"), ("rec_slot", "const int*"),
    ("seed", "u64"), ("timeout_ns", "u64"),
    ("n_in", "int"), ("n_steps", "int"), ("max_new", "int"), ("pos0", "int"), ("n_eos", "int"), ("top_k", "int"),
    ("n_draws", "int"), ("attn_max_splits", "int"), ("timing_steps", "int"),
    ("temperature", "float"), ("top_p", "float"),
)


def params_fields() -> list[tuple[str, str]]:
    """(field, C type) of the kernel's Params: every buffer of the step (weights and tables const), then CONTROL."""
    out = []
    for b in BUFFERS.values():
        if b.kind == "value":
            continue
        const = "const " if b.kind in ("weight", "table") else ""
        out.append((b.name, f"{const}{b.ctype}*"))
    return out + list(CONTROL)


def describe(cfg: ModelConfig, launch: Launch = Launch()) -> str:
    """The plan as text: the decode step, stage by stage, with its buffers, weights and bytes."""
    lines = [f"decode step of {cfg.name}: {len(STAGES)} stages, {n_slots(cfg)} grid barriers per token"]
    for s in STAGES:
        wb = stage_weight_bytes(cfg, s.name)
        reads = ", ".join(u.buffer + (f"[{u.positions}]" if u.positions else "") for u in s.reads if u.active(cfg))
        writes = ", ".join(u.buffer + (f"[{u.positions}]" if u.positions else "") for u in s.writes if u.active(cfg))
        lines.append(f"  {s.name:16s} {s.scope:5s} {s.math}")
        lines.append(f"  {'':16s}       reads {reads} → writes {writes}; {s.units(cfg, launch):,} units "
                     f"({s.unit}); {wb / 1e6:.1f} MB of weights" + (f"; taps {', '.join(s.taps)}" if s.taps else ""))
    return "\n".join(lines)

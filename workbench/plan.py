"""The decode step, declared once: the launch (`Launch`), the buffers (`BUFFERS`) and the stages (`STAGES`).

One token's decode is the list `STAGES`, in decode order. Each stage says what it computes (`math`), which buffers
it reads and writes (with shapes, through `BUFFERS`), which of those are weights, how its work divides into units and
which rows of each input a unit needs (the grain of its dependencies), its shared memory, what the debug build taps,
and which reference function checks it (workbench/model/stage_math.py). This module is only the declaration and
imports only the model layer; what follows from it lives beside it:

* `workbench.schedule`: the execution order, barriers and slots, taps, shared-memory layout, the weight stream,
  bytes per stage, dependencies;
* `workbench.abi`: what host and kernel share: status words, where-words, the mapped host block, the Params fields;
* `workbench.compiler`: the generated header and decode step, assembly, compiles.

Shapes come from the model config (`ModelConfig`); a few scratch buffers also depend on the launch (`Launch`: the
grid, one block per SM). Names of buffers are the names of the kernel's Params fields and of the prepared weights.
See DESIGN.md for the layers and their invariants.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .model import stage_math as ref
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
    stream_attn_warps: int = 1      # in a stream build, attention's warps that read K/V through rings of their own
    #                                 (at most attn_kv_bytes' worth): the weight ring takes the shared memory left
    slot_bytes: int = 4096          # a stream build's ring slot, one bulk copy's most: a page is a slot per consumer
    #                                 warp, and the streamer's meter (WB_STREAM_INFLIGHT) counts pages, so a smaller
    #                                 slot meters the bytes in flight more finely (rows longer than a slot are cut)
    # stages whose first weight loads go out before the grid barrier they follow (H200, 1b: +3.7% at position 128;
    # DESIGN.md, "Early loads and owed waits")
    early: tuple = ("qkv_rope_append", "o_proj_residual", "gate_up_silu", "lm_head")
    # 16-byte pieces a thread of an early stage loads before that wait (schedule.early_region): 8 is the row loop's
    # first chunk (WB_UNROLL_1 loads of a row, or WB_UNROLL_2 of each row of a pair); 16 is two chunks, a row pair's
    # whole unit at K = 2,048 (the 1B's qkv and gate_up), in twice the shared memory. A stage takes whole chunks,
    # at most its unit's.
    early_loads: int = 8
    # the residual stream's fixed-point parts (X_FRAC_BITS): block b of the MLP's down projection adds into part
    # b % x_parts, so no address takes more than grid / x_parts atomic adds. On the H200, 132 blocks adding D
    # columns then a grid barrier and a read of all of x: 4 parts cost 1.65 us a round at D = 2048 where one part
    # cost 3.65 and float adds 2.09; 2.53 against 3.57 and 1.89 at D = 4096 (scripts/residual_adds_probe.py)
    x_parts: int = 4
    # stages whose block's first units (one for each warp, as many warps as ahead_bytes holds) the bulk-copy engine
    # brings into shared memory while the block runs the slot before them (schedule.ahead, kernels/lib/matvec.cuh):
    # bytes in flight that the register path has no registers for, during a slot whose own reads are few
    ahead: tuple = ()
    ahead_bytes: int = 131072

    def __post_init__(self):
        # at most a CUDA block's 1024 threads, which the reduction scratch is sized for (WB_MAX_WARPS)
        if not (isinstance(self.threads, int) and 64 <= self.threads <= 1024 and self.threads % 64 == 0):
            raise ValueError(f"threads must be a multiple of 64 from 64 to 1024, got {self.threads!r}")
        for name in ("early", "register_stages", "ahead"):
            if not (isinstance(v := getattr(self, name), tuple) and all(isinstance(n, str) for n in v)):
                raise ValueError(f"{name} must be a tuple of stage names, got {v!r}")
        if self.register_stages and not self.stream:
            raise ValueError("register_stages (stream_register) names stages of a stream build: set stream too")
        if not (isinstance(self.attn_kv_bytes, int) and self.attn_kv_bytes >= 0):
            raise ValueError(f"attn_kv_bytes must be a number of bytes, 0 or more, got {self.attn_kv_bytes!r}")
        if not (isinstance(self.attn_min_chunk, int) and self.attn_min_chunk >= 0):
            raise ValueError(f"attn_min_chunk must be 0 (one step per reading warp) or a number of positions, got "
                             f"{self.attn_min_chunk!r}")
        if not (isinstance(self.attn_single, int) and self.attn_single >= 1):
            raise ValueError(f"attn_single must be a number of chunks, 1 or more, got {self.attn_single!r}")
        if not (isinstance(self.slot_bytes, int) and 512 <= self.slot_bytes <= 4096 and self.slot_bytes % 16 == 0):
            raise ValueError(f"slot_bytes must be a number of bytes from 512 to 4096, a multiple of 16, got "
                             f"{self.slot_bytes!r}")
        if not (isinstance(self.stream_attn_warps, int) and self.stream_attn_warps >= 1):
            raise ValueError(f"stream_attn_warps must be a number of warps, 1 or more, got {self.stream_attn_warps!r}")
        if not (isinstance(self.attn_bufs, int) and self.attn_bufs >= 2):
            raise ValueError(f"attn_bufs must be at least 2 (one step read while the next lands), got "
                             f"{self.attn_bufs!r}")
        if not (isinstance(self.grid, int) and self.grid >= 1):
            raise ValueError(f"grid must be a positive number of blocks, got {self.grid!r}")
        if not (isinstance(self.ahead_bytes, int) and self.ahead_bytes >= 0 and self.ahead_bytes % 16 == 0):
            raise ValueError(f"ahead_bytes must be a number of bytes, 0 or more, a multiple of 16, got "
                             f"{self.ahead_bytes!r}")
        if not (isinstance(self.early_loads, int) and 8 <= self.early_loads <= 64 and self.early_loads % 8 == 0):
            raise ValueError(f"early_loads must be a number of 16-byte pieces a thread, a multiple of 8 from 8 to 64, "
                             f"got {self.early_loads!r}")
        if not (isinstance(self.x_parts, int) and 1 <= self.x_parts <= self.grid):
            raise ValueError(f"x_parts must be a number of parts from 1 to the grid's {self.grid} blocks, got "
                             f"{self.x_parts!r}")

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
        splits of one step (H200). Past it, the positions split into chunks of attn_chunk."""
        return self.attn_single * self.attn_chunk(cfg)

    def attn_warps(self, cfg: ModelConfig) -> int:
        """Warps of a block that read K/V in attention (WB_ATTN_WARPS), each through its own ring of attn_bufs steps
        of ATTN_STEP positions (K and V rows of hd bf16, padded by 8 bf16 against bank conflicts): as many as
        attn_kv_bytes holds, at most the block's. A stream build gives attention stream_attn_warps' rings at most
        (one by default): its weight ring takes the shared memory beside the stages'."""
        most = min(self.stream_attn_warps, self.consumer_warps) if self.stream else self.consumer_warps
        return min(most, self.attn_kv_bytes // self.attn_ring_bytes(cfg))

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
    heads: bool = False             # its row is heads of head_dim: the query heads (q, o), or per position the kv
    #                                 heads (the cache); a kv head's share of the row is row / n_kv_heads

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


def _b(name, dtype, shape, kind, doc, per_layer=False, heads=False):
    return Buffer(name, dtype, shape, kind, doc, per_layer, heads)


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
    _b("q", "f32", lambda c, l: (c.q_dim,), "activation", "queries, rotated [Hq·hd]", heads=True),
    _b("o", "f32", lambda c, l: (c.q_dim,), "activation", "attention output [Hq·hd]", heads=True),
    _b("hmlp", "f32", lambda c, l: (c.intermediate,), "activation", "silu(gate) ⊙ up [F]"),
    _b("logits", "f32", lambda c, l: (c.vocab,), "activation", "next-token logits [V]"),
    # state that outlives the step
    _b("k_cache", "bf16", lambda c, l: (c.n_layers, c.n_kv_heads, c.max_seq, c.head_dim), "cache",
       "keys [L, Hkv, max_seq, hd]: position p holds the key of the token fed at p", True, True),
    _b("v_cache", "bf16", lambda c, l: (c.n_layers, c.n_kv_heads, c.max_seq, c.head_dim), "cache",
       "values [L, Hkv, max_seq, hd]", True, True),
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
    reference: Callable | None = None   # its math on a model.stage_math.StageIO → {buffer: value}
    tolerances: dict = dataclasses.field(default_factory=dict)   # {written buffer: model.stage_math.Tolerance}
    contracts: tuple = ()               # checks beyond tolerances (model.stage_math.*_contract)
    streamed: bool = True               # a stream build feeds its weights through the ring (False: the section
    #                                     reads them itself, not as dot products of whole rows)

    def reads_buffer(self, name: str) -> bool:
        return any(u.buffer == name for u in self.reads)

    def writes_buffer(self, name: str) -> bool:
        return any(u.buffer == name for u in self.writes)


def _act(c: ModelConfig) -> int:
    return pad4(max(c.hidden, c.q_dim, c.intermediate))


def pad4(n: int) -> int:
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
          smem=lambda c, l: {"q": pad4(max(c.group * c.head_dim, attn_query_words(c))),
                             "warps": pad4(l.threads // 32 * c.group * (c.head_dim + 2)),
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
          smem=lambda c, l: {"hmlp": pad4(-(-c.intermediate // l.grid)), "sum": down_phases(c, l) * c.hidden},
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

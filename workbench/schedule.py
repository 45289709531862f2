"""What the plan's declaration implies, derived and never restated: the order one step executes the stages in,
where the grid must synchronise (slots), what the debug build taps, each stage's shared memory, the weight stream,
the bytes each stage moves, and which producer units a consumer unit waits for. Everything here is a function of
`workbench.plan` and the model config (DESIGN.md: the layers).
"""
from __future__ import annotations

import dataclasses
import functools

from . import plan
from .model.config import ModelConfig

# ---- what runs where, and where the grid must synchronise -----------------------------------------------------

def execution(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(stage, layer) in the order one step executes them; layer -1 for the token stages. The layer stages form
    one contiguous run of the plan, repeated for every layer."""
    return list(_execution(cfg.n_layers))


@functools.lru_cache(maxsize=64)
def _execution(n_layers: int) -> tuple:
    first = next(i for i, s in enumerate(plan.STAGES) if s.scope == "layer")
    last = max(i for i, s in enumerate(plan.STAGES) if s.scope == "layer")
    if any(s.scope != "layer" for s in plan.STAGES[first:last + 1]):
        raise ValueError("the plan's layer stages must be contiguous")
    out = [(s.name, -1) for s in plan.STAGES[:first]]
    for layer in range(n_layers):
        out += [(s.name, layer) for s in plan.STAGES[first:last + 1]]
    return tuple(out + [(s.name, -1) for s in plan.STAGES[last + 1:]])


def conflicts(a: plan.Stage, b: plan.Stage) -> set:
    """Buffers through which stage b, running after stage a, depends on it: b reads or overwrites what a wrote, or
    overwrites what a read. Two stages of the one block need no barrier between them (a block barrier orders them),
    so they conflict in nothing."""
    if a.runs_on == "block0" and b.runs_on == "block0":
        return set()
    wa, ra = {u.buffer for u in a.writes}, {u.buffer for u in a.reads}
    wb, rb = {u.buffer for u in b.writes}, {u.buffer for u in b.reads}
    return ((wa & (rb - local_reads(a, b))) | (wa & wb)) | (ra & wb)


def local_reads(a: plan.Stage, b: plan.Stage) -> set:
    """Buffers stage b reads from stage a unit by unit within each block (Use.local, both dealing by blocks): a
    block barrier between them is enough. `local_problem` checks the claim against the rows for a config."""
    if a.deal != "blocks" or b.deal != "blocks":
        return set()
    return {u.buffer for u in b.reads if u.local and a.writes_buffer(u.buffer)}


def local_problem(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> str | None:
    """Why a read the plan declares local is not (None: every one is): the reader and the writer must deal the
    same number of units by blocks, and unit u may read only rows that the writer's unit u wrote."""
    for b in plan.STAGES:
        for u in b.reads:
            if not u.local:
                continue
            layer = (1 if cfg.n_layers > 1 else 0) if b.scope == "layer" else -1
            made = producer(cfg, u.buffer, b.name, layer)
            writer = plan.stage(made[0]) if made is not None else None
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
    return plan.stage(prev[0]).runs_on == "grid" or plan.stage(stage_name).runs_on == "grid"


def _barriers(seq) -> list[bool]:
    """barrier[i]: a grid barrier follows seq[i]. Greedy: a barrier goes in just before the first stage that
    conflicts with a stage run since the last barrier, which places the fewest barriers that respect every
    dependency of the declared reads and writes."""
    after = [False] * len(seq)
    pending = []
    for i, (name, _) in enumerate(seq):
        s = plan.stage(name)
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
    return next((s.index for s in slots(cfg) if s.stages[-1] == (stage_name, layer)), None)


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


def tap_size(cfg: ModelConfig, buffer: str, launch: plan.Launch = plan.Launch()) -> int:
    b = plan.BUFFERS[buffer]
    if b.kind == "cache":
        return cfg.kv_dim                   # the row appended at pos: [Hkv, hd]
    return 1 if b.kind == "value" else b.value_elements(cfg, launch)   # a fixed-point buffer: the value it holds


def taps(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> tuple:
    out, off = [], 0
    for s in plan.STAGES:
        layers = cfg.n_layers if s.scope == "layer" else 1
        for buf in s.taps:
            n = tap_size(cfg, buf, launch)
            out.append(Tap(s.name, buf, n, off, layers))
            off += n * layers
    return tuple(out)


def tap_step_floats(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> int:
    t = taps(cfg, launch)
    return t[-1].offset + t[-1].size * t[-1].layers if t else 0


def tap(cfg: ModelConfig, stage_name: str, buffer: str, launch: plan.Launch = plan.Launch()) -> Tap:
    for t in taps(cfg, launch):
        if t.stage == stage_name and t.buffer == buffer:
            return t
    raise KeyError(f"stage {stage_name} taps no {buffer}")


def producer(cfg: ModelConfig, buffer: str, stage_name: str, layer: int) -> tuple[str, int] | None:
    """The (stage, layer) whose write of `buffer` the given stage reads: the latest writer before it in the step's
    execution order (an earlier step's, for what the step reads before anything wrote it: None)."""
    order = execution(cfg)
    before = order[:order.index((stage_name, layer))]
    return next(((s, l) for s, l in reversed(before) if plan.stage(s).writes_buffer(buffer)), None)


# ---- shared memory ---------------------------------------------------------------------------------------------

def smem_regions(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> dict[str, dict[str, tuple[int, int]]]:
    """{stage: {region: (offset, floats)}}: each stage lays its regions out from 0 (stages never overlap in time
    within a block), 16-byte aligned."""
    out = {}
    for s in plan.STAGES:
        regions, off = {}, 0
        for name, n in (s.smem(cfg, launch) if s.smem else {}).items():
            regions[name] = (off, plan.pad4(n))
            off += plan.pad4(n)
        out[s.name] = regions
    return out


def early_region(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> tuple[int, int]:
    """(offset, floats) of the shared memory where an early stage's first loads land (Launch.early): the
    Launch.early_loads 16-byte pieces of a thread, after the regions of every early stage (which run while it fills), over
    what the other stages use (a block's own previous stage is over when it arrives at the barrier). Only a stage
    that owes a wait loads early (matvec.cuh): the others' regions may lie under it."""
    if not launch.early or launch.stream:
        return 0, 0
    regions = smem_regions(cfg, launch)
    off = max(sum(n for _, n in regions[name].values()) for name in launch.early)
    n = launch.stage_threads * launch.early_loads * 4
    if 4 * (off + n) > SMEM_LIMIT - STATIC_SMEM:
        raise ValueError(f"early_loads={launch.early_loads}: the early region ({4 * n:,} B, {launch.early_loads} pieces "
                         f"of 16 B for each of {launch.stage_threads} threads) does not fit above the early stages' "
                         f"regions ({4 * off:,} B) in the {SMEM_LIMIT - STATIC_SMEM:,} B a block may have: lower "
                         f"early_loads (or threads)")
    return off, n


@dataclasses.dataclass(frozen=True)
class Ahead:
    """A stage's first units copied ahead (Launch.ahead): for each of a block's first `warps` warps, its first unit's
    rows (a block's units are contiguous rows: the stage deals by blocks), brought into shared memory by the
    bulk-copy engine while the block runs the slot before the stage. The decode step posts the copy at the barrier
    after `posted_after` (every thread fences its last use of the region before the arrival); the first
    weight stage of the next slot, `issuer`, sends it after its own first loads, which are needed sooner; the stage
    reads those units from shared memory, and its own first loads go to each warp's next unit."""
    stage: str
    issuer: str
    posted_after: str
    buffer: str
    k: int                          # elements a row
    rows: int                       # rows a unit
    units: int                      # the stage's units (the whole grid's)
    warps: int                      # a block's warps whose first unit is copied
    offset: int                     # floats, into the block's dynamic shared memory
    floats: int

    @property
    def unit_bytes(self) -> int:
        return self.rows * self.k * 2

    def block_bytes(self, grid: int) -> list[int]:
        """Bytes each block copies a layer: its first units, one for each of its first `warps` warps."""
        return [min(len(plan.block_units(self.units, grid, b)), self.warps) * self.unit_bytes for b in range(grid)]


def ahead(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> Ahead | None:
    """Where Launch.ahead's copy comes from, goes and is issued (None: no stage is copied ahead). The region lies
    above every region in use from the post to the stage's own (the issuer's slot, the stage and the stages before it
    in its slot, the early loads' region), and under the attention's and other stages' that are over by the post."""
    if not launch.ahead:
        return None
    if len(launch.ahead) > 1:
        raise ValueError(f"ahead copies one stage's units (one shared-memory region), got {'+'.join(launch.ahead)}")
    name = launch.ahead[0]
    if name not in plan.STAGE_NAMES:
        raise ValueError(f"ahead: unknown stage {name!r}; stages: {', '.join(plan.STAGE_NAMES)}")
    if launch.stream:
        raise ValueError("ahead is for the register path: a stream build's ring already brings every stage's weights "
                         "ahead")
    st = plan.stage(name)
    w = weight_units(cfg, st, launch)
    if st.scope != "layer" or w is None or st.deal != "blocks" or not st.streamed:
        raise ValueError(f"ahead: {name} is not a layer stage that reads a weight as dot products of whole rows "
                         f"(for_warp_units, which reads the copy) by units dealt by blocks (a block's units must be "
                         f"contiguous rows, one bulk copy's source)")
    sl = slots(cfg)
    i = next(k for k, x in enumerate(sl) if (name, 1) in x.stages)
    if i < 2 or sl[i - 1].stages[0][1] != 1 or sl[i - 2].stages[-1][1] != 1:
        raise ValueError(f"ahead: the two slots before {name}'s must be its own layer's, to post and issue the copy")
    live = [n for n, _ in sl[i - 1].stages] + [n for n, _ in sl[i].stages[:sl[i].stages.index((name, 1)) + 1]]
    regions = smem_regions(cfg, launch)
    off = max([sum(n for _, n in regions[s].values()) for s in live] + [sum(early_region(cfg, launch))])
    unit = w.rows * w.k * 2
    room = min(launch.ahead_bytes, SMEM_LIMIT - STATIC_SMEM - 4 * off)
    warps = min(launch.consumer_warps, room // unit)
    if warps < 1:
        raise ValueError(f"ahead: {launch.ahead_bytes} B (ahead_bytes, and what shared memory has left above "
                         f"{4 * off} B) hold no unit of {name} ({unit} B): raise ahead_bytes")
    return Ahead(name, sl[i - 1].stages[0][0], sl[i - 2].stage, w.buffer, w.k, w.rows, w.units, warps, off,
                 warps * unit // 4)


def smem_floats(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> int:
    """The largest stage's layout, or the early region's end, or the region copied ahead's (the stream's partials
    and ring follow)."""
    stages = max((sum(n for _, n in r.values()) for r in smem_regions(cfg, launch).values()), default=0)
    a = ahead(cfg, launch)
    return max(stages, sum(early_region(cfg, launch)), a.offset + a.floats if a else 0)


def smem_bytes(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> int:
    """The dynamic shared memory a block is launched with: the largest stage's layout, then with streaming the
    partial sums and the weight ring."""
    if not launch.stream:
        return 4 * smem_floats(cfg, launch)
    return ring_offset(cfg, launch) + RING_ALIGN + ring_slots(cfg, launch) * launch.consumer_warps * launch.slot_bytes


# ---- the weight stream: what the block's streamer copies into its shared-memory ring ------------------------
# Every stage that reads a weight matrix row by row (a Use of a weight with `rows`) is a stream: each block takes
# the contiguous units [b·n/G, (b+1)·n/G) of it, and those units' rows, cut into pieces of at most SLOT_BYTES, are
# the block's items, in address order. The streamer (the block's last warp) copies the items of every stream of
# the step, in decode order, a page of one item per consumer warp at a time, into a ring of RING_SLOTS pages as fast
# as pages free up, never waiting on an activation. The consumer side (kernels/lib/stream.cuh, matvec.cuh) walks
# the same pages in the same order: both derive them from this table and the section's own unit count.
SLOT_BYTES = plan.Launch.slot_bytes  # the default slot (Launch.slot_bytes): a row of up to 2,048 bf16, or a piece
SMEM_LIMIT = 232448                 # shared memory a block may have on sm_90 (227 KB, opt-in)
STATIC_SMEM = 4096                  # kept free for the kernel's static __shared__ (2.4 KB today: barrier words, mbarriers, stamps)
MAX_RING_SLOTS = 4                  # pages in the ring at the default slot (more of smaller slots: the same bytes)
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
    slot_bytes: int = SLOT_BYTES    # the launch's ring slot (Launch.slot_bytes)

    @property
    def pieces(self) -> int:
        return pieces(self.k, self.slot_bytes)

    @property
    def piece(self) -> int:
        """Elements per item."""
        return self.k // self.pieces

    def items(self, launch: "plan.Launch", block: int) -> int:
        return len(plan.block_units(self.units, launch.grid, block)) * self.rows * self.pieces

    def max_items(self, launch: "plan.Launch") -> int:
        return max(self.items(launch, b) for b in range(launch.grid))

    @property
    def combines(self) -> bool:
        """Whether a unit spans several items (so several warps): their partial sums meet in shared memory."""
        return self.rows * self.pieces > 1


def reads_no_weight(name: str) -> bool:
    """Whether a stage reads no weight at all (attention: its loads are the cache's, latency-bound and its own)."""
    return not any(plan.BUFFERS[u.buffer].kind == "weight" for u in plan.stage(name).reads)


def _weight_read(s: plan.Stage) -> plan.Use | None:
    """The stage's read of a weight by units of rows (None: it reads none that way). One at most: a stage's
    weight stream is one matrix."""
    found = [u for u in s.reads if plan.BUFFERS[u.buffer].kind == "weight" and u.rows is not None]
    if len(found) > 1:
        raise ValueError(f"stage {s.name} reads {len(found)} weights by units ({', '.join(u.buffer for u in found)}): "
                         f"a stage streams one")
    return found[0] if found else None


def weight_units(cfg: ModelConfig, s: plan.Stage, launch: "plan.Launch" = None) -> Stream | None:
    """How the stage reads its weight: its units, each `rows` whole adjacent rows of k elements, unit u at u·rows
    (None: a stage with no weight read by units)."""
    launch = launch or plan.Launch()
    u = _weight_read(s)
    if u is None:
        return None
    k = plan.BUFFERS[u.buffer].layer_shape(cfg, launch)[-1]
    n = s.units(cfg, launch)
    (lo, hi), = u.rows(cfg, 0)
    per = hi - lo
    if lo != 0 or per % k or any(u.rows(cfg, x) != ((x * per, (x + 1) * per),) for x in (1, n - 1)):
        raise ValueError(f"stage {s.name}: a unit of {u.buffer} must be whole adjacent rows, unit u at u·rows")
    return Stream(s.name, u.buffer, n, per // k, k, s.scope, launch.slot_bytes)


def streams(cfg: ModelConfig, launch: "plan.Launch" = None) -> tuple[Stream, ...]:
    """The weight streams of one step, in the plan's stage order (a layer stage's stream repeats per layer)."""
    launch = launch or plan.Launch()
    chosen = (weight_units(cfg, s, launch) for s in plan.STAGES if s.name not in launch.register_stages and s.streamed)
    return tuple(x for x in chosen if x is not None)


def early_problem(cfg: ModelConfig | None, names) -> str | None:
    """Why `names` cannot load early (None: they can; cfg None: what holds for every model). An early stage's warps issue the first loads of their
    weight units before waiting at the grid barrier in front of it (the barrier split into its arrival and its
    wait, the wait owed to the stage's prologue): so a grid stage that reads a weight by units, after a grid
    barrier. The step's first barrier is never split: the stop test reads what it publishes."""
    for n in names:
        if n not in plan.STAGE_NAMES:
            return f"{n}: not a stage (stages: {', '.join(plan.STAGE_NAMES)})"
        s = plan.stage(n)
        if _weight_read(s) is None or s.runs_on != "grid":
            return f"{n} reads no weight by units on every block: there is nothing to load early"
        if cfg is not None and not any(early_barrier(cfg, plan.Launch(early=(n,)), name, layer)
                                       for name, layer in _execution(cfg.n_layers)):
            return f"{n}: no grid barrier goes before it (the stage before it runs in the same slot)"
    return None


def early_barrier(cfg: ModelConfig, launch: "plan.Launch", stage_name: str, layer: int) -> bool:
    """Whether the grid barrier after (stage, layer) is only arrived at, its wait owed to the next stage in the
    step's order (which loads weights first, Launch.early). False where no barrier follows, and for slot 0."""
    b = barrier_slot(cfg, stage_name, layer)
    if b is None or b == 0 or not launch.early:
        return False
    seq = _execution(cfg.n_layers)
    i = seq.index((stage_name, layer))
    return seq[(i + 1) % len(seq)][0] in launch.early


def stream_stage(cfg: ModelConfig, stage_name: str, launch: "plan.Launch" = None) -> Stream | None:
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


def partial_floats(cfg: ModelConfig, launch: "plan.Launch" = None) -> int:
    """One float per item of the largest stream whose units span several items (0 without streaming)."""
    launch = launch or plan.Launch()
    if not launch.stream:
        return 0
    return plan.pad4(max((x.max_items(launch) for x in streams(cfg, launch) if x.combines), default=0))


def ring_slots(cfg: ModelConfig, launch: "plan.Launch" = None) -> int:
    """Pages in the ring (a page: a slot per consumer warp): as many as fit beside the stages' shared memory,
    up to MAX_RING_SLOTS pages' bytes at the default slot."""
    launch = launch or plan.Launch()
    if not launch.stream:
        return 0
    free = SMEM_LIMIT - STATIC_SMEM - ring_offset(cfg, launch) - RING_ALIGN
    page = launch.consumer_warps * launch.slot_bytes
    n = min(MAX_RING_SLOTS * SLOT_BYTES // launch.slot_bytes, free // page)
    if n < 1:
        raise ValueError(f"{launch.threads} threads leave no room for the weight ring: {launch.consumer_warps} "
                         f"consumer warps need {page} B beside the stages' "
                         f"{ring_offset(cfg, launch)} B (fewer threads, or stream=False)")
    return n


def ring_offset(cfg: ModelConfig, launch: "plan.Launch" = None) -> int:
    """Byte offset of the ring in dynamic shared memory: after the stages' regions and the partials, 128-aligned."""
    launch = launch or plan.Launch()
    n = 4 * (smem_floats(cfg, launch) + partial_floats(cfg, launch))
    return -(-n // 128) * 128


# ---- bytes: what each stage must move from memory --------------------------------------------------------------

def stage_weight_bytes(cfg: ModelConfig, stage_name: str) -> int:
    """Weight bytes one execution of the stage streams (one layer's slice for a layer stage). A token's total is
    ModelConfig.weight_bytes_per_token, which needs no plan; these, summed over a token's execution less the
    embedding's row, are the same bytes (tests/test_plan.py)."""
    s = plan.stage(stage_name)
    total = 0
    for u in s.reads:
        b = plan.BUFFERS[u.buffer]
        if b.kind != "weight" or not u.active(cfg):
            continue
        if b.per_layer:
            total += b.nbytes(cfg) // cfg.n_layers
        elif u.positions == "token":                    # one row, the token's
            total += b.nbytes(cfg) // b.shape(cfg, plan.Launch())[0]
        else:
            total += b.nbytes(cfg)
    return total


def stage_bytes(cfg: ModelConfig, stage_name: str, pos: int) -> int:
    """Bytes one execution of the stage cannot avoid moving from memory: its weights, and for attention the K and
    V of positions 0..pos (activations live in L2 and are not counted)."""
    s = plan.stage(stage_name)
    total = stage_weight_bytes(cfg, stage_name)
    for u in s.reads:
        b = plan.BUFFERS[u.buffer]
        if b.kind == "cache" and u.positions == "0..pos":        # one layer's slice, positions 0..pos
            total += b.nbytes(cfg) // (cfg.n_layers * cfg.max_seq) * (pos + 1)
    return total


def memory_bytes(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> dict[str, int]:
    """Device bytes of every buffer the plan declares, by kind (weight, table, cache, activation, scratch): what
    the prepared weights and a Monokernel hold (its few control words aside)."""
    out: dict[str, int] = {}
    for b in plan.BUFFERS.values():
        out[b.kind] = out.get(b.kind, 0) + b.nbytes(cfg, launch)
    return out


def longest_context(cfg: ModelConfig, free_bytes: int, launch: plan.Launch = plan.Launch(), *, weights: bool = True) -> int:
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


def memory_problem(cfg: ModelConfig, free_bytes: int, launch: plan.Launch = plan.Launch(), *,
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
    advice = f"--max-seq {fits} is the longest context that fits" if fits else "not even a one-position context fits"
    return (f"{cfg.name} with a {cfg.max_seq}-position context needs {gb(need)} of GPU memory ({what}); the GPU has "
            f"{gb(free_bytes)} {where}: {advice}")


# ---- dependencies: which producer units a consumer unit waits for -----------------------------------------------

def _overlap(a, b) -> bool:
    return a is None or b is None or any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def dependencies(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> dict:
    """{(consumer stage, buffer): (producer stage, [n_producer_units each consumer unit waits for])} for every
    activation or cache read whose producer is in the same step. This is what per-unit dependency counters would
    count (a consumer unit may start once that many of its producer's units have published)."""
    out = {}
    for s in plan.STAGES:
        l = 1 if (s.scope == "layer" and cfg.n_layers > 1) else (0 if s.scope == "layer" else -1)
        for u in s.reads:
            b = plan.BUFFERS[u.buffer]
            if b.kind not in ("activation", "cache", "scratch", "value"):
                continue
            prod = producer(cfg, u.buffer, s.name, l)
            if prod is None:
                continue
            p = plan.stage(prod[0])
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


def _count(n: int, noun: str) -> str:
    """"1 unit", "1,003 units": the nouns describe() counts all take an s."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def describe(cfg: ModelConfig, launch: plan.Launch = plan.Launch()) -> str:
    """The plan as text: the decode step, stage by stage, with its buffers, weights and bytes."""
    lines = [f"decode step of {cfg.name}: {_count(len(plan.STAGES), 'stage')}, {_count(n_slots(cfg), 'grid barrier')} "
             "per token"]
    for s in plan.STAGES:
        wb = stage_weight_bytes(cfg, s.name)
        reads = ", ".join(u.buffer + (f"[{u.positions}]" if u.positions else "") for u in s.reads if u.active(cfg))
        writes = ", ".join(u.buffer + (f"[{u.positions}]" if u.positions else "") for u in s.writes if u.active(cfg))
        lines.append(f"  {s.name:16s} {s.scope:5s} {s.math}")
        lines.append(f"  {'':16s}       reads {reads} → writes {writes}; {_count(s.units(cfg, launch), 'unit')} "
                     f"({s.unit}); {wb / 1e6:.1f} MB of weights" + (f"; taps {', '.join(s.taps)}" if s.taps else ""))
    return "\n".join(lines)

"""The C++ the plan generates: constants and layouts before the sections, the decode step after them.

`plan_header` is pasted right after kernels/portability.cuh: shapes (from the model config), build switches, the
Params struct, the stage / error / status / where / tap / slot / shared-memory constants and the per-step state
`WbStep`. The kernel side checks what it relies on with static_asserts against these names, so a layout that no
longer fits what a section needs fails to compile at the section's own line.

`decode_step` is pasted after the sections: the decode step as one C++ function, one statement per stage in plan
order, each showing what it computes, what it reads and (after `/* → */`) what it writes, followed by the grid
barrier where the plan's reads and writes need one, and in a taps build the copies of what the stage wrote.

The default model's decode step is also kept in the repository as text (`step_file`, docs/), to be read without
running anything and so that a change of the plan shows as a diff of the step it generates. The build never reads
that copy; `python -m workbench plan --decode-step --write` rewrites it, and tests/test_decode_step_file.py fails
while it is stale.
"""
from __future__ import annotations

import ctypes
import struct
from pathlib import Path

from .. import abi, paths, plan, schedule
from ..model.config import DEFAULT_MODEL, ModelConfig, get_config

_CTYPES = {"u64": ctypes.c_uint64, "int": ctypes.c_int32, "float": ctypes.c_float}


class Params(ctypes.Structure):
    """The kernel's parameter block as the host fills it (one 64-bit word per pointer)."""
    _fields_ = [(n, ctypes.c_uint64 if t.endswith("*") else _CTYPES[t]) for n, t in abi.params_fields()]


def _upper(name: str) -> str:
    return name.upper().replace(".", "_")


def params_struct() -> str:
    body = "\n".join(f"    {t} {n};" for n, t in abi.params_fields())
    return (f"struct Params {{\n{body}\n}};\n"
            f"static_assert(sizeof(Params) == {ctypes.sizeof(Params)}, \"Params: the host's layout\");\n")


def plan_header(cfg: ModelConfig, launch: plan.Launch) -> str:
    """Everything the sections may name that the plan or the config decides."""
    out = ["// ---- generated from the model config and workbench/plan.py: edit those, not this text ----"]
    out.append(params_struct())
    out.append("enum Stage { " + ", ".join(f"ST_{_upper(s)}" for s in plan.STAGE_NAMES) + ", WB_N_STAGES };")
    out.append("enum WbError { " + ", ".join(f"WB_{'OK' if e == 'ok' else 'ERR_' + _upper(e)} = {i}"
                                            for i, e in enumerate(abi.ERRORS)) + " };")
    out.append("enum WbDevFlag { " + ", ".join(f"WB_FLAG_{_upper(f)} = {i}" for i, f in enumerate(abi.DEV_FLAGS))
               + f", WB_DEV_FLAGS = {len(abi.DEV_FLAGS)} }};")
    out.append("// status[] (mapped host memory): a stop's reason and place, read by the host after `code`")
    out.append("enum WbStatus { " + ", ".join(f"WB_STATUS_{_upper(w)} = {i}" for i, w in enumerate(abi.STATUS_WORDS))
               + f", WB_STATUS_WORDS = {abi.STATUS_LEN} }};")
    out.append("enum WbWaitedOn { " + ", ".join(f"WB_WAITED_ON_{_upper(w)} = {i}" for i, w in enumerate(abi.WAITED_ON))
               + " };")
    shift = abi.where_layout()
    enc = " | ".join(f"((u32)({'layer + 1' if n == 'layer' else n}) & {(1 << b) - 1}u) << {sh}" for n, sh, b in shift)
    out.append("// where a block is (its stage, layer + 1, step, waiting at the barrier after it): written at every stage")
    out.append("// entry and barrier arrival, into mapped host memory (P->where), which outlives the process")
    out.append(f"__device__ __forceinline__ u32 wb_where(int stage, int layer, int step, int waiting = 0) "
               f"{{ return {enc}; }}")
    out.append(f"constexpr u32 WB_WHERE_WAITING = 1u << {dict((n, sh) for n, sh, _ in shift)['waiting']};")
    for n, sh, b in shift[:3]:
        val = f"(int)((w >> {sh}) & {(1 << b) - 1}u)" + (" - 1" if n == "layer" else "")
        out.append(f"__device__ __forceinline__ int wb_where_{n}(u32 w) {{ return {val}; }}")
    out.append(f"constexpr int WB_SLOTS = {schedule.n_slots(cfg)};           // grid barriers per step")
    out.append(f"constexpr int WB_BLOCKS = {launch.grid};         // the grid the build is specialised to (one block an SM)")
    out += residual_constants(launch)
    out.append("// how each stage deals its units (plan.Stage.deal): a section passes its WB_DEAL_<STAGE> to for_warp_units")
    out.append("enum WbDeal { " + ", ".join(f"WB_DEAL_{d.upper()} = {i}" for i, d in enumerate(plan.DEALS)) + " };")
    for st in plan.STAGES:
        out.append(f"constexpr WbDeal WB_DEAL_{_upper(st.name)} = WB_DEAL_{st.deal.upper()};")
    # taps
    out.append(f"constexpr int WB_TAP_STEP_FLOATS = {schedule.tap_step_floats(cfg, launch)};   // one step's tap record")
    for t in schedule.taps(cfg, launch):
        out.append(f"constexpr int WB_TAP_{_upper(t.stage)}_{_upper(t.buffer)} = {t.offset}, "
                   f"WB_TAP_{_upper(t.stage)}_{_upper(t.buffer)}_N = {t.size};")
    # shared memory
    for st, regs in schedule.smem_regions(cfg, launch).items():
        for r, (off, n) in regs.items():
            out.append(f"constexpr int WB_SMEM_{_upper(st)}_{_upper(r)} = {off}, "
                       f"WB_SMEM_{_upper(st)}_{_upper(r)}_FLOATS = {n};")
    off, n = schedule.early_region(cfg, launch)
    out.append(f"constexpr int WB_SMEM_EARLY = {off}, WB_SMEM_EARLY_FLOATS = {n};   // early stages' first loads "
               f"(Launch.early)")
    a = schedule.ahead(cfg, launch)
    out.append("// Launch.ahead (schedule.ahead): a stage's first units copied into shared memory during the slot before it")
    out.append(f"constexpr int WB_AHEAD_K = {a.k if a else 0}, WB_AHEAD_ROWS = {a.rows if a else 0}, "
               f"WB_AHEAD_UNITS = {a.units if a else 0}, WB_AHEAD_WARPS = {a.warps if a else 0};   "
               f"// {a.stage if a else 'none'}: its units' elements a row, rows, units; warps served")
    out.append(f"constexpr int WB_SMEM_AHEAD = {a.offset if a else 0}, WB_SMEM_AHEAD_FLOATS = {a.floats if a else 0};")
    out.append(f"constexpr int WB_SMEM_FLOATS = {schedule.smem_floats(cfg, launch)};   // the largest stage's layout")
    out.append(f"constexpr int WB_ATTN_WARPS = {launch.attn_warps(cfg)}, WB_ATTN_BUFS = {launch.attn_bufs}, "
               f"WB_ATTN_STEP = {plan.ATTN_STEP}, WB_ATTN_KS = {plan.attn_row(cfg)};   "
               f"// attention's rings: warps with one, steps a ring, positions a step, bf16 a K/V row")
    out.append(f"constexpr int WB_ATTN_MIN_CHUNK = {launch.attn_chunk(cfg)}, "
               f"WB_ATTN_SINGLE = {launch.attn_single_positions(cfg)};   "
               f"// attention's fewest positions a split, and up to how many one block takes alone")
    out += stream_constants(cfg, launch)
    if launch.early and not launch.stream:          # a stream build's ring fills during the owed wait instead
        out.append("// Launch.early: a weight stage's first loads go out before the barrier it owes (matvec.cuh)")
        out += ["#ifndef WB_EARLY_LOADS", "#define WB_EARLY_LOADS 1", "#endif"]
    # per-layer slices
    for b in plan.BUFFERS.values():
        if b.per_layer:
            n = b.elements(cfg, launch) // cfg.n_layers
            out.append(f"constexpr long long WB_PER_LAYER_{_upper(b.name)} = {n}LL;")
    values = [b.name for b in plan.BUFFERS.values() if b.kind == "value"]
    out.append("// what one step carries from stage to stage: its number and position in registers, its values (only block")
    out.append("// 0's thread 0 uses them) in block 0's shared memory")
    # held in registers across the whole step, the values took two of every thread's 128 and the 8B and Qwen3
    # builds spilled them (8 B of stack); in shared memory they cost one load where a stage reads one
    out.append("struct WbStep { int step; int pos; " + " ".join(f"int& {v};" for v in values) + " };")
    out.append(f"constexpr int WB_STEP_VALUES = {len(values)};")
    return "\n".join(out) + "\n"


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def residual_constants(launch: plan.Launch) -> list[str]:
    """The residual stream's fixed point (plan.X_FRAC_BITS, kernels/lib/residual.cuh): its parts and bit counts,
    and its float constants as fp32 bit patterns (integers: what a stage written in PTX can name)."""
    one, value = 2.0 ** plan.X_FRAC_BITS, 2.0 ** plan.X_VALUE_BITS
    return [
        f"constexpr int WB_X_PARTS = {launch.x_parts}, WB_X_FRAC_BITS = {plan.X_FRAC_BITS}, "
        f"WB_X_VALUE_BITS = {plan.X_VALUE_BITS}, WB_X_NAN_BITS = {plan.X_NAN_BITS};   // x = Σ parts · 2^-FRAC",
        f"constexpr u32 WB_X_ONE_BITS = {_f32_bits(one)}u, WB_X_ULP_BITS = {_f32_bits(1 / one)}u, "
        f"WB_X_VALUE_LIMIT_BITS = {_f32_bits(value)}u, WB_X_PARTIAL_LIMIT_BITS = {_f32_bits(value / launch.grid)}u;"
        "   // fp32 bits of 2^FRAC, 2^-FRAC, a whole value's bound, a block's partial's (2^VALUE / grid)",
    ]


def stream_constants(cfg: ModelConfig, launch: plan.Launch) -> list[str]:
    """The weight ring's geometry (schedule.ring_slots, schedule.ring_offset): zeros in a build without streaming."""
    on = launch.stream
    step_shift = next(sh for n, sh, _ in abi.where_layout() if n == "step")
    return [
        "// the weight stream (schedule.streams): the block's last warp copies weight rows into a ring of pages, a slot",
        "// per consumer warp each; a page's tag is a where-word with its first item's index in place of the step",
        f"constexpr int WB_CONSUMER_WARPS = {launch.consumer_warps if on else 0};",
        f"constexpr int WB_RING_SLOTS = {schedule.ring_slots(cfg, launch)}, WB_SLOT_BYTES = {launch.slot_bytes}, "
        f"WB_RING_OFFSET = {schedule.ring_offset(cfg, launch) if on else 0}, WB_RING_ALIGN = {schedule.RING_ALIGN};"
        "   // pages; bytes",
        f"constexpr int WB_SMEM_PARTIALS = {schedule.smem_floats(cfg, launch)}, "
        f"WB_SMEM_PARTIALS_FLOATS = {schedule.partial_floats(cfg, launch)};   // a float per item of a combining stream",
        f"constexpr int WB_TAG_ITEM_SHIFT = {step_shift};",
        f"constexpr u32 WB_TAG_STAGE_LAYER = (1u << {step_shift}) - 1u;",
        "// the stages whose weights come through the ring, one bit per stage (the others read straight to registers)",
        "constexpr unsigned long long WB_STREAMED_STAGES = "
        f"{_stage_mask(x.stage for x in schedule.streams(cfg, launch)) if on else 0}ull;",
        f"constexpr bool WB_STREAM_REGISTER_STAGES = {str(bool(on and launch.register_stages)).lower()};"
        "   // any: only then is the register path compiled into the stream build's stages",
        f"constexpr u32 WB_GRID_ENTRIES_A_STEP = {len(grid_entries(cfg))};"
        "   // the stages of a step every block enters (WB_STREAM_LEAD counts them)",
    ]


def grid_entries(cfg) -> list[tuple[str, int]]:
    """(stage, layer) of the step's stages every block enters (WB_GRID), in order: what the consumers' entry count
    of a stream build counts (stream.cuh, WB_STREAM_LEAD); block 0's own stages are not among them."""
    return [(name, layer) for name, layer in schedule.execution(cfg) if plan.stage(name).runs_on == "grid"]


def after_quiet(cfg, stream: schedule.Stream) -> bool:
    """Whether the grid entry before a stream's stage reads no weight (attention: its loads are the cache's, its
    own and latency-bound), in every layer: then, with WB_STREAM_EXIT, the stream's pages wait until the consumers
    have left that stage (stream.cuh)."""
    entries = grid_entries(cfg)
    layers = range(cfg.n_layers) if stream.scope == "layer" else (-1,)
    quiet = set()
    for layer in layers:
        i = entries.index((stream.stage, layer))
        quiet.add(i > 0 and schedule.reads_no_weight(entries[i - 1][0]))
    if len(quiet) != 1:
        raise ValueError(f"the stage before {stream.stage} reads weights in some layers and not in others: the "
                         f"generated stream step cannot say which")
    return quiet.pop()


def _stage_mask(names) -> str:
    return hex(sum({1 << plan.STAGE_NAMES.index(n) for n in names}))


def stream_step(cfg: ModelConfig, launch: plan.Launch) -> str:
    """The streaming warp's step: one call per weight stream, in the order the decode step reads them."""
    if not launch.stream:
        return ""
    st = schedule.streams(cfg, launch)
    first = next(i for i, s in enumerate(plan.STAGES) if s.scope == "layer")
    before = [x for x in st if x.scope == "token" and plan.STAGE_NAMES.index(x.stage) < first]
    layer = [x for x in st if x.scope == "layer"]
    after = [x for x in st if x.scope == "token" and plan.STAGE_NAMES.index(x.stage) > first]

    entries = grid_entries(cfg)
    per_layer = sum(1 for _, l in entries if l == 0)

    def entry(x: schedule.Stream) -> str:
        """Where the stream's stage is among the step's grid entries (a layer's: from its layer's first)."""
        if x.scope == "layer":
            return f"{entries.index((x.stage, 0))} + layer * {per_layer}"
        return str(entries.index((x.stage, -1)))

    def call(x: schedule.Stream, indent: str) -> str:
        b = plan.BUFFERS[x.buffer]
        src = f"P->{x.buffer} + layer * WB_PER_LAYER_{_upper(x.buffer)}" if b.per_layer else f"P->{x.buffer}"
        lay = "layer" if x.scope == "layer" else "-1"
        quiet = str(after_quiet(cfg, x)).lower()
        return (f"{indent}if (st.stream<{x.k}, {x.rows}>(ST_{_upper(x.stage)}, {lay}, {src}, {x.units}, {entry(x)}, "
                f"{quiet})) return true;   // {x.units:,} units of {x.rows} row(s) of {x.k}, {x.pieces} piece(s) a row")

    out = ["// ---- the weight stream of one step, generated from workbench/plan.py (schedule.streams) ----",
           "#if WB_STREAMING"]
    for x in st:
        out.append(f"static_assert(wb_pieces({x.k}) == {x.pieces}, \"stream.cuh's wb_pieces and schedule.pieces agree\");")
    out.append("__device__ bool wb_stream_step(const Params* P, WbStreamer& st) {")
    out += [call(x, "    ") for x in before]
    if layer:
        out.append("    for (int layer = 0; layer < WB_LAYERS; ++layer) {")
        out += [call(x, "        ") for x in layer]
        out.append("    }")
    out += [call(x, "    ") for x in after]
    out += ["    return false;", "}", "#endif"]
    return "\n".join(out) + "\n"


def _arg(use: plan.Use, layer: str) -> str:
    b = plan.BUFFERS[use.buffer]
    if b.kind == "value":
        return f"s.{b.name}"
    return f"P->{b.name} + {layer} * WB_PER_LAYER_{_upper(b.name)}" if b.per_layer else f"P->{b.name}"


def stage_call(st: plan.Stage, layer: str = "layer") -> str:
    """`stage_<name>(inputs..., extra..., /* → */ outputs...)`, a written value as the call's result. A buffer that
    is read and written (the residual stream) is passed once, among the outputs, marked `+=`."""
    written = {u.buffer for u in st.writes}
    ins = [_arg(u, layer) for u in st.reads if u.buffer not in written]
    outs, result = [], None
    for u in st.writes:
        b = plan.BUFFERS[u.buffer]
        if b.kind == "value":
            result = f"s.{b.name}"
            continue
        outs.append(_arg(u, layer) + (" /* += */" if st.reads_buffer(u.buffer) else ""))
    args = ins + list(st.extra_args)
    call = f"stage_{st.name}(" + ", ".join(args) + (", /* → */ " if outs and args else "/* → */ " if outs else "") \
        + ", ".join(outs) + ")"
    return f"wb_set_value({result}, {call})" if result else call


def _tap_lines(cfg: ModelConfig, launch: plan.Launch, st: plan.Stage, layer: str, local: bool = False) -> list[str]:
    """The copies of what the stage wrote. `local`: no grid barrier follows the stage, so every block copies the
    rows of its own units (a stage that deals by blocks, each unit whole rows of the buffer)."""
    out = []
    names = plan.STAGE_NAMES
    nxt = plan.stage(names[(names.index(st.name) + 1) % len(names)])
    for buf in st.taps:
        name = f"WB_TAP_{_upper(st.name)}_{_upper(buf)}"
        if local:
            w = next(u for u in st.writes if u.buffer == buf)
            n = st.units(cfg, launch)
            first = w.rows(cfg, 0) if w.rows is not None else ()
            per = first[0][1] - first[0][0] if len(first) == 1 else 0
            if st.deal != "blocks" or per <= 0 or any(w.rows(cfg, u) != ((u * per, (u + 1) * per),) for u in range(n)):
                raise ValueError(f"stage {st.name} taps {buf} with no grid barrier after it, so each block copies its "
                                 f"own units' rows: it must deal by blocks and unit u write rows [u·k, (u+1)·k)")
            out.append(f"wb_tap_f32_units(P, s.step, {name}, {layer}, {_arg(plan.Use(buf), layer)}, {n}, {per});")
            continue
        if nxt is not None and nxt.writes_buffer(buf) and st.runs_on == "grid":
            raise ValueError(f"stage {st.name} taps {buf}, which the next stage {nxt.name} overwrites while block 0 "
                             f"copies it: tap it elsewhere")
        b = plan.BUFFERS[buf]
        lay = layer if st.scope == "layer" else "0"
        if b.kind == "cache":
            out.append(f"wb_tap_kv(P, s.step, s.pos, {name}, {lay}, {_arg(plan.Use(buf), layer)});")
        elif b.kind == "value":
            out.append(f"wb_tap_value(P, s.step, {name}, s.{buf});")
        else:
            fn = {"i32": "wb_tap_int", "fixed": "wb_tap_fixed"}.get(b.dtype, "wb_tap_f32")
            out.append(f"{fn}(P, s.step, {name}, {lay}, {_arg(plan.Use(buf), layer)}, {name}_N);")
    return out


def _next_slot_writes(cfg: ModelConfig, slot: int, buffers) -> bool:
    """Whether a stage of the slot after barrier `slot` writes one of `buffers`: block 0 copies them after the
    barrier while the other blocks run that slot, so the debug build needs a barrier of its own there."""
    slots = schedule.slots(cfg)
    after = slots[(slot + 1) % len(slots)]
    return any(plan.stage(name).writes_buffer(b) for name, _ in after.stages for b in buffers
               if plan.stage(name).runs_on == "grid")


def _barrier(cfg: ModelConfig, launch: plan.Launch, st: plan.Stage, layer: str, slot: str) -> str:
    """The grid barrier after a stage: whole (WB_SYNC), or only its arrival (WB_ARRIVE) where the next stage
    loads weights before it waits (schedule.early_barrier); the last layer's may differ from the others'."""
    layers = range(cfg.n_layers) if st.scope == "layer" else (-1,)
    split = [schedule.early_barrier(cfg, launch, st.name, l) for l in layers]
    macro = {True: "WB_ARRIVE", False: "WB_SYNC"}
    call = lambda m: f"{m}(ST_{_upper(st.name)}, {layer}, {slot});"
    if len(set(split)) == 1:
        return call(macro[split[0]])
    if len(set(split[:-1])) == 1:
        return (f"if (layer + 1 < WB_LAYERS) {call(macro[split[0]])} else {call(macro[split[-1]])}"
                f"   // the next stage: the next layer's, or the first after the layers")
    raise ValueError(f"the barrier after {st.name} is split in some layers and not others: the generated loop "
                     f"cannot say which")


def decode_step(cfg: ModelConfig, launch: plan.Launch) -> str:
    """The decode step: `wb_decode_step(P, s, smem)` runs one step and returns true when the kernel must stop."""
    slots = schedule.slots(cfg)
    first = next(i for i, st in enumerate(plan.STAGES) if st.scope == "layer")
    last = max(i for i, st in enumerate(plan.STAGES) if st.scope == "layer")
    per_layer = sum(1 for sl in slots if sl.layer == 0)        # barriers in one layer

    def emit(st: plan.Stage, indent: str) -> list[str]:
        layer = "layer" if st.scope == "layer" else "-1"
        lines = [f"{indent}// {st.math}" + (f"  ({st.doc})" if st.doc else "")]
        macro = "WB_BLOCK0" if st.runs_on == "block0" else "WB_GRID"
        if schedule.block_barrier_before(cfg, st.name):
            lines.append(f"{indent}wb_syncthreads();   // a block barrier: one slot, no grid barrier before this "
                         f"stage (it may read what this block's warps just wrote: a local read)")
        lines.append(f"{indent}{macro}(ST_{_upper(st.name)}, {layer}, {stage_call(st)});")
        if ahead and st.name == ahead.issuer:
            lines.append(f"{indent}wb_ahead_issue();   // {ahead.stage}'s copy, if the section's first loads did not "
                         f"send it")
        if st.name in launch.early:
            lines.append(f"{indent}WB_WAIT_OWED(ST_{_upper(st.name)}, {layer});   // its prologue waited at the "
                         f"barrier before it, after its first loads (Launch.early)")
        b = schedule.barrier_slot(cfg, st.name, 0 if st.scope == "layer" else -1)
        if b is not None:
            slot = f"{b} + {per_layer} * layer" if st.scope == "layer" else str(b)
            if ahead and st.name == ahead.posted_after:
                lines.append(f"{indent}wb_ahead_post<WB_AHEAD_K, WB_AHEAD_ROWS>({_arg(plan.Use(ahead.buffer), layer)}, "
                             f"WB_AHEAD_UNITS);   // {ahead.stage}'s first units into shared memory (Launch.ahead), "
                             f"sent after the barrier, behind {ahead.issuer}'s first loads")
            lines.append(indent + _barrier(cfg, launch, st, layer, slot))
        local = b is None and st.runs_on == "grid"
        taps = _tap_lines(cfg, launch, st, "layer", local=local)
        if taps:
            lines.append(f"{indent}{'WB_TAP_LOCAL_COPIES' if local else 'WB_TAP_COPIES'}(" + " ".join(taps) + ");")
            layers = range(cfg.n_layers) if st.scope == "layer" else (-1,)
            after = [schedule.barrier_slot(cfg, st.name, l) for l in layers]
            if b is not None and st.runs_on == "grid" and any(_next_slot_writes(cfg, a, st.taps) for a in after):
                lines.append(f"{indent}WB_TAP_SYNC(ST_{_upper(st.name)}, {layer});   // the next slot writes what "
                             f"block 0 just copied")
        if b == len(slots) - 1:
            lines.append(f"{indent}wb_flush_stamps(P, s.step);   // the step's last barrier: its stamps are complete")
        if b == 0:
            lines.append(f"{indent}if (wb_done(P)) return true;   // the previous step's publish said stop")
        return lines

    ahead = schedule.ahead(cfg, launch)
    if (why := schedule.local_problem(cfg, launch)) is not None:
        raise ValueError(f"the plan's local reads do not hold for {cfg.name}: {why}")
    if schedule.barrier_slot(cfg, plan.STAGES[0].name, -1) != 0:
        raise ValueError("the plan's first stage must end the step's first slot (the stop test follows it)")
    out = ["// ---- the decode step, generated from workbench/plan.py: edit the plan, not this text ----",
           "// One statement per stage: what it computes, then the call (inputs, then after /* → */ what it writes).",
           "// WB_GRID: every block takes a share; WB_BLOCK0: block 0 alone. WB_SYNC: a grid barrier where the plan's",
           "// reads and writes need one (slot k of the step); wb_syncthreads() between two stages of one slot.",
           "// WB_TAP_COPIES: what the debug build copies out (block 0, after the barrier; WB_TAP_SYNC then waits",
           "// for it where the next slot overwrites it); WB_TAP_LOCAL_COPIES: each block its own units' rows.",
           "__device__ __forceinline__ bool wb_decode_step(const Params* P, WbStep& s, float* smem) {"]
    out += [line for st in plan.STAGES[:first] for line in emit(st, "    ")]
    out.append("    for (int layer = 0; layer < WB_LAYERS; ++layer) {")
    out += [line for st in plan.STAGES[first:last + 1] for line in emit(st, "        ")]
    out.append("    }")
    out += [line for st in plan.STAGES[last + 1:] for line in emit(st, "    ")]
    out += ["    return false;", "}"]
    return "\n".join(out) + "\n"


# ---- the decode step kept in the repository as text --------------------------------------------------------------

# Every other preset's step differs from the default model's only in its numbers (shapes, barrier slots): Qwen3's
# q/k norms and Qwen2's biases are arguments every model's call passes. tests/test_decode_step_file.py checks that
# this still holds; a family whose step came to differ in its text would get a file of its own, its model added here.
STEP_FILE_MODELS = (DEFAULT_MODEL,)
STEP_FILE_COMMAND = "python -m workbench plan --decode-step --write"


def step_file(model: str) -> Path:
    """Where the repository keeps a model's decode step as text (a source checkout's docs/)."""
    return paths.ROOT / "docs" / f"decode_step.{model}.cuh"


def step_file_text(model: str) -> str:
    """The text of `step_file(model)`: a few lines saying what it is, then `decode_step` at the preset's shapes and
    the default launch, as `plan --decode-step` prints it."""
    return (f"// Generated by `{STEP_FILE_COMMAND}` from workbench/plan.py: edit the plan, not this file.\n"
            f"// The decode step of {model} (the preset's shapes, the default launch) as the kernel build generates "
            f"it\n// (workbench/compiler/header.py, decode_step) and pastes it after the sections; the build makes its "
            f"own\n// copy and never reads this one, which is here to be read and to show a change of the plan as a "
            f"diff.\n\n" + decode_step(get_config(model), plan.Launch()))


def stale_step_files() -> list[Path]:
    """The step files whose text is not what the plan generates today (missing ones included)."""
    return [step_file(m) for m in STEP_FILE_MODELS
            if not step_file(m).is_file() or step_file(m).read_text(encoding="utf-8") != step_file_text(m)]


def write_step_files() -> list[tuple[Path, bool]]:
    """Rewrite every step file from the plan: (path, whether its text changed) for each."""
    out = []
    for m in STEP_FILE_MODELS:
        path, text = step_file(m), step_file_text(m)
        changed = not path.is_file() or path.read_text(encoding="utf-8") != text
        if changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        out.append((path, changed))
    return out

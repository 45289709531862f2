"""What the host and the kernel share, word for word: the status words and error codes a stop publishes, the
where-word every block keeps, the mapped host block, and the fields of the kernel's Params (the plan's buffers,
then the control words). The generated header (workbench.compiler.header) and the runtime (workbench.run) read
both sides from here.
"""
from __future__ import annotations

from . import plan

# ---- control: status words, error codes, the where word, the mapped host block ----------------------------------
# The kernel publishes a stop's reason and place in `status` (mapped host memory: readable while it runs and after
# it is gone); the host reads the same names.
STATUS_WORDS = ("code", "stage", "layer", "step", "block", "epoch", "missing_block", "missing_where", "n_missing",
                "stream_want", "stream_got",   # a stream error: the item the section asked for and the ring's (where-words)
                "waited_on", "unit")           # a hang: what the block waited for (WAITED_ON), the unit that waited
STATUS_LEN = 16
# what a hang's reporter waited for: the grid barrier (its missing blocks in missing_*), or the units of a stage
# copied ahead into its shared memory (Launch.ahead) that never landed (`unit`: the unit that waited, -1 the kernel's
# end)
WAITED_ON = ("grid_barrier", "copy_ahead")
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
    """The where word of a block (its fields do not overlap: their sum is their bitwise or)."""
    return sum((val & ((1 << bits) - 1)) << shift
               for (_, shift, bits), val in zip(where_layout(), (stage_index, layer + 1, step, int(waiting))))


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
    return plan.STAGE_NAMES[index] if 0 <= index < len(plan.STAGE_NAMES) else f"stage {index}"


def place(stage: str, layer: int, step: int) -> str:
    """Where in the decode step: "attention_decode of layer 3 at step 7" (a token stage has no layer)."""
    return stage + (f" of layer {layer}" if layer >= 0 else "") + f" at step {step}"


def describe_where(w: int) -> str:
    d = decode_where(int(w))
    if d is None:
        return "unknown"
    st, layer, step, waiting = d
    return ("waiting after " if waiting else "") + place(st, layer, step)


def describe_hang(status: dict) -> str:
    """The kernel's hang report (its status words, by name) as one line: the wait that timed out, where, and what it
    waited for."""
    stage, layer, step, block = (status[k] for k in ("stage", "layer", "step", "block"))
    name = stage_name(stage)
    if status.get("waited_on") == WAITED_ON.index("copy_ahead"):
        unit = status["unit"]
        if unit < 0:            # the kernel's end: the where-word is the last stage entered, not the copied one
            return (f"at the kernel's end ({place(name, layer, step)}), block {block}: the last units it copied ahead "
                    f"into shared memory (Launch.ahead) never landed: the bulk copy (wb_ahead_issue, "
                    f"kernels/lib/matvec.cuh) did not complete")
        return (f"{place(name, layer, step)}, block {block}: its unit {unit} of {name} copied ahead into shared memory "
                f"(Launch.ahead) never landed: the bulk copy (wb_ahead_issue, kernels/lib/matvec.cuh) was not sent, "
                f"or its bytes did not all come")
    return (f"grid barrier timed out after the {name} stage" + (f" of layer {layer}" if layer >= 0 else "") +
            f" at step {step}: block {block} waited, {status['n_missing']} block(s) never arrived, the first being "
            f"block {status['missing_block']}, last seen in {describe_where(status['missing_where'])}")


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
    return [(b.name, f"{'const ' if b.kind in ('weight', 'table') else ''}{b.ctype}*")
            for b in plan.BUFFERS.values() if b.kind != "value"] + list(CONTROL)

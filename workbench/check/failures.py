"""Failure injections: edits of the kernel's sections that hang, fault, overflow or break the compiler, which the
loop must report (a record with the failure's kind, every block's last state for a hang or a fault) while the
notebook lives on, and recover from on the next good edit. `scripts/failure_suite.py` runs them all through the
editing loop on a GPU; `tests/test_failure_suite.py` checks without one that each applies and builds as meant;
the GPU tests run one hang and one fault through a Workbench.
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Injection:
    name: str
    section: str
    what: str
    find: str
    replace: str
    expect: str                # the record status expected
    block: int | None = None   # the block the report must name (None: no block to name, a compile-time failure)
    alone: bool = False        # every other block must be shown waiting at a barrier, none inside a stage

    def apply(self, text: str) -> str:
        if text.count(self.find) != 1:
            raise ValueError(f"injection {self.name}: the text to replace is not in {self.section} exactly once")
        return text.replace(self.find, self.replace)

    def named(self, rec) -> bool:
        """Whether a reload record names this failure where it is: its block, stopped inside its section or named
        by the kernel's barrier report; a compile error at the section's file."""
        if self.block is None:
            return self.expect != "compile error" or f"{self.section}.cuh" in (rec.error or "")
        if self.alone:     # a block shown moving on is not waiting either: the picture must be still
            held = [b for b in rec.blocks or () if not b.waiting]
            return [b.block for b in held] == [self.block] and not held[0].moved
        stuck = [b.block for b in rec.blocks or () if b.stage == self.section and not b.waiting and not b.moved]
        return self.block in stuck or re.search(rf"\bblock {self.block}\b", rec.error or "") is not None


def _after_act(section: str, code: str, region: str = "act") -> tuple[str, str]:
    """(find, replace) that put `code` right after the section's `float* act = ...` line (or another region's):
    where every weight stage has its shared-memory pointer and nothing has run yet."""
    line = f"    float* {region} = smem + WB_SMEM_{section.upper()}_{region.upper()};"
    return line, f"{line}\n{code}"


_GRID_SYNC = "bool grid_sync(const Params* __restrict__ P, u32 where, int slot, int early = 0) {"   # its first line

INJECTIONS = (
    Injection("spin-on-flag", "o_proj_residual", "block 3 spins on a flag nobody sets, outside any barrier",
              *_after_act("o_proj_residual",
                          "    if (wb_bid() == 3) { volatile int* never = (volatile int*)act; if (wb_tid() == 0) "
                          "*never = 0;\n                         while (*never == 0) { } }"), "hang", 3),
    # o_proj loads early by default: the other blocks enter it, issue their first loads and wait at the barrier
    # after attention inside it; the picture must show them waiting there, and block 4 alone inside its stage
    Injection("spin-in-attention", "attention_decode", "block 4 spins in attention while the others wait inside o_proj",
              "    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);",
              "    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);\n"
              "    if (wb_bid() == 4) { volatile u32* never = qf; if (wb_tid() == 0) *never = 0;\n"
              "                         while (*never == 0) { } }", "hang", 4, alone=True),
    Injection("barrier-skipped", "grid_sync", "block 5 skips the barrier after qkv_rope_append of layer 1",
              _GRID_SYNC + "\n    wb_syncthreads();",
              _GRID_SYNC + "\n    if (wb_bid() == 5 && wb_where_stage(where) == ST_QKV_ROPE_APPEND && "
              "wb_where_layer(where) == 1) return false;\n    wb_syncthreads();", "hang", 5),
    Injection("trap", "gate_up_silu", "block 7 executes a trap",
              *_after_act("gate_up_silu", "    if (wb_bid() == 7 && wb_tid() == 0) __trap();"), "fault", 7),
    # through a null pointer, not far past a buffer: a far address can land in another allocation and not fault
    Injection("illegal-address", "down_residual", "block 9 writes through a null pointer",
              *_after_act("down_residual", "    if (wb_bid() == 9 && wb_tid() == 0) { volatile fx64* null = x + "
                                           "(0 - (long long)(size_t)x / 8); *null = 1; }", "sum"), "fault", 9),
    Injection("shared-out-of-bounds", "lm_head", "block 11 writes 16 MB past its shared memory",
              *_after_act("lm_head",
                          "    if (wb_bid() == 11 && wb_tid() == 0) ((volatile float*)smem)[1 << 22] = 1.f;"),
              "fault", 11),
    Injection("sampler-loops", "sampling", "the sampler never returns (block 0 spins)",
              "    // max logit and greedy argmax from the LM head's per-block partials",
              "    if (wb_tid() == 0) { volatile int spin = 1; while (spin) { } }\n"
              "    // max logit and greedy argmax from the LM head's per-block partials", "hang", 0),
    Injection("too-much-shared", "attention_decode", "asks for 256 KB of static shared memory",
              "    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);",
              "    __shared__ float huge[64 * 1024];\n    huge[wb_tid()] = 1.f;\n"
              "    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);\n    if (huge[(wb_tid() * 7) % 1024] == 2.f) o[0] = 0.f;",
              "compile error"),
    # 2^24 copies of a statement, by the preprocessor: the compiler front end alone takes minutes (a large
    # `#pragma unroll` is not enough: NVVM declines to unroll past its own limit and compiles in seconds)
    Injection("compiler-hangs", "embedding", "16 million copies of a statement (the compiler runs for minutes)",
              "    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x_store(x, i, bf16_to_f32(row[i]));",
              "#define WB_X0(s) s\n"
              + "".join(f"#define WB_X{i}(s) WB_X{i - 1}(s) WB_X{i - 1}(s)\n" for i in range(1, 25)) +
              "    float acc = 0.f;\n    WB_X24(acc = acc * 0.999f + (float)token;)\n"
              "    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x_store(x, i, bf16_to_f32(row[i]) + acc * 0.f);",
              "compiler hang or crash"),
)

# the plan's stages whose section no injection edits, and why (tests/test_stage_tables.py: every stage of the plan
# has an injection into its section or an entry here)
INJECTIONS_EXEMPT = {
    "qkv_rope_append": "a grid stage like o_proj_residual and gate_up_silu, whose injections (a hang, a fault) show "
                       "how one in such a stage is reported; barrier-skipped hangs at the barrier after it",
    "publish": "block 0 alone after the sampler, as sampling is: sampler-loops shows how a hang there is reported",
}


def by_name(name: str) -> Injection:
    return next(i for i in INJECTIONS if i.name == name)

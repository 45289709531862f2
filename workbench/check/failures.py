"""Failure injections: edits of the kernel's sections that hang, fault, overflow or break the compiler, which the
loop must report (a record with the failure's kind, every block's last state for a hang or a fault) while the
notebook lives on, and recover from on the next good edit. Each is declared in the file it edits, an `inject`
entry of its wb:checks block (the format: workbench.check.mutants). `scripts/failure_suite.py` runs them all
through the editing loop on a GPU; `tests/test_failure_suite.py` checks without one that each applies and builds
as meant; the GPU tests run one hang and one fault through a Workbench.
"""
from __future__ import annotations

import dataclasses
import re

from .mutants import DECLARED, replace_in_code


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
        return replace_in_code(text, self.find, self.replace, 1, f"injection {self.name} of {self.section}")

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


INJECTIONS: tuple[Injection, ...] = tuple(Injection(**f) for kind, f in DECLARED if kind == "inject")

# the plan's stages whose section no injection edits, and why (tests/test_stage_tables.py: every stage of the plan
# has an injection into its section or an entry here)
INJECTIONS_EXEMPT = {
    "qkv_rope_append": "a grid stage like o_proj_residual and gate_up_silu, whose injections (a hang, a fault) show "
                       "how one in such a stage is reported; barrier-skipped hangs at the barrier after it",
    "publish": "block 0 alone after the sampler, as sampling is: sampler-loops shows how a hang there is reported",
}


def by_name(name: str) -> Injection:
    return next(i for i in INJECTIONS if i.name == name)

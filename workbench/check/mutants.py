"""The mutation suite: deliberately wrong edits of the kernel's files, each of which the loop must reject and pin
on the right stage. A verifier is proven by the mutants it catches.

Every mutant, and every failure injection (workbench.check.failures), is declared in the file it edits, in one
block comment that ends the file:

    /* wb:checks
    mutant silu-1e-4: the gate's sigmoid argument 1e-4 off
    -    gu[0] / (1.f + wb_exp(-gu[0])) * gu[1]
    +    gu[0] / (1.f + wb_exp(-gu[0] * 1.0001f)) * gu[1]

    mutant eps-x10 [expect=qkv_rope_append, count=2]: RMSNorm's eps ten times too large
    -/ (float)n + WB_RMS_EPS);
    +/ (float)n + 10.f * WB_RMS_EPS);

    inject trap [expect=fault, block=7]: block 7 executes a trap
    -    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
    +    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
    +    if (wb_bid() == 7 && wb_tid() == 0) __trap();
    */

Entries are separated by blank lines. The header is `mutant|inject NAME [k=v, k=v, flag]: description`: the
bracket is optional, its items are separated by ", ", a value may hold spaces, and a bare word is a flag (true).
The `-` lines are the text to find and the `+` lines its replacement: the prefix character is stripped and the rest
kept verbatim, the lines joined with newlines (no trailing one); no `+` line is an empty replacement.

A mutant's keys: `expect`, the stage whose verdict must fail first (default: the file's own stage; required in a
library file: the first stage in decode order that runs the edited code); `count`, how many times the text occurs,
all replaced (default 1); `needs`, the ModelConfig flag of the family whose code it mutates (it runs on a model of
that family, FAMILY_MODELS, since any other compiles that code away); `not_with`, a flag under which the mutated
code is compiled away. An injection's: `expect` (the record status), `block`, `alone` (see Injection).

The file's code is everything before the `/* wb:checks` line. The text is counted and replaced there only, and the
block is left as it is: a comment at the end, it changes neither the compiled code nor the lines that compiler
messages name. A malformed entry, an unknown key, a name used twice (in any file) or a `*/` inside an entry is a
SourceError naming the file and line.

MUTANTS and INJECTIONS are read from the kernel sources as shipped (paths.template_dir()): the base file of each of
plan.FILES in that order, entries in file order. A mutant of the sampling section is run with a temperature, which
the loop does when that section is the one edited. workbench.loop.mutation applies the mutants (GPU) one by one
through the real edit path (Workbench.edit + reload), records what the loop named and how long the verdict took,
and undoes each; `scripts/mutation_suite.py` runs it and prints the table. Without a GPU, `tests/test_mutants.py`
checks that every mutant applies and compiles.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

from .. import paths, plan
from ..compiler.assemble import read_source, section_path
from ..errors import SourceError

_MARK = re.compile(r"^/\* wb:checks\r?$", re.M)
_HEADER = re.compile(r"(mutant|inject) ([\w.-]+)(?: \[([^\]]*)\])?: (\S.*)")
# by kind: the field its description fills, and the keys its bracket may set with their types
KINDS = {"mutant": ("breaks", {"expect": str, "count": int, "needs": str, "not_with": str}),
         "inject": ("what", {"expect": str, "block": int, "alone": bool})}


def replace_in_code(text: str, find: str, replace: str, count: int, what: str) -> str:
    """`text` with the occurrences of `find` in its code (before the wb:checks block) replaced, the block kept as it
    is; ValueError naming `what` unless there are exactly `count` of them."""
    m = _MARK.search(text)
    code, checks = (text, "") if m is None else (text[:m.start()], text[m.start():])
    n = code.count(find)
    if n != count:
        raise ValueError(f"{what}: {find!r} occurs {n} times in its code, expected {count}")
    return code.replace(find, replace) + checks


def parse(text: str, section: str, where: str, seen: dict | None = None) -> list[tuple[str, dict]]:
    """(kind, the fields of its dataclass) of each entry of a file's wb:checks block, in order; `where` names the
    file in errors, `seen` ({name: where:line}) the names taken by entries already read."""
    seen = {} if seen is None else seen
    m = _MARK.search(text)
    if m is None:
        return []
    first = text.count("\n", 0, m.start()) + 1
    lines = text[m.start():].splitlines()

    def fail(i: int, why: str):
        raise SourceError(f"{where}:{first + i}: {why}")

    end = next((i for i, line in enumerate(lines) if line == "*/"), None)
    if end is None:
        fail(0, "the wb:checks block has no closing `*/` line")
    after = next((i for i in range(end + 1, len(lines)) if lines[i].strip()), None)
    if after is not None:
        fail(after, "text after the wb:checks block: the block must end the file")
    out = []
    for blank, rows in itertools.groupby(range(1, end), key=lambda k: not lines[k].strip()):
        if not blank:
            i, *rest = rows
            out.append(_entry(lines, i, i + 1 + len(rest), section, fail, seen, f"{where}:{first + i}"))
    return out


def _entry(lines: list[str], i: int, j: int, section: str, fail, seen: dict, at: str) -> tuple[str, dict]:
    """The entry of lines[i:j]: a header, then its `-` lines, then its `+` lines."""
    for k in range(i, j):
        if "*/" in lines[k]:
            fail(k, "`*/` inside an entry would end the comment")
    h = _HEADER.fullmatch(lines[i])
    if not h:
        fail(i, "not an entry's header: `mutant|inject NAME [k=v, ...]: description`")
    kind, name, bracket, text = h.groups()
    if name in seen:
        fail(i, f"{kind} {name}: the name is taken (at {seen[name]})")
    seen[name] = at
    described, keys = KINDS[kind]
    fields = {"name": name, "section": section, described: text}
    for item in (bracket.split(", ") if bracket is not None else ()):
        key, eq, value = item.partition("=")
        kind_of = keys.get(key)
        if kind_of is None or key in fields:
            fail(i, f"{kind} {name}: {'unknown' if kind_of is None else 'repeated'} key {key!r} (keys: "
                    f"{', '.join(keys)})")
        if kind_of is bool and eq:
            fail(i, f"{kind} {name}: {key} is a flag, without a value")
        if kind_of is not bool and not value:
            fail(i, f"{kind} {name}: {key} needs a value ({key}=...)")
        if kind_of is int and not value.isdigit():
            fail(i, f"{kind} {name}: {item} is not a whole number")
        fields[key] = True if kind_of is bool else kind_of(value)
    find, replace = [], []
    for k in range(i + 1, j):
        sign, rest = lines[k][:1], lines[k][1:]
        if sign == "-" and not replace:
            find.append(rest)
        elif sign == "+":
            replace.append(rest)
        else:
            fail(k, f"{kind} {name}: not a `-` line (the text to find) or a `+` line (its replacement), the `-` "
                    f"lines first")
    if not find:
        fail(i, f"{kind} {name}: no `-` line (the text to find)")
    fields.update(find="\n".join(find), replace="\n".join(replace))
    if "expect" not in fields:
        if kind == "inject" or section not in plan.STAGE_NAMES:
            fail(i, f"{kind} {name}: expect= is required" + (" (the record status)" if kind == "inject" else
                                                            " in a library file (the stage that must be named)"))
        fields["expect"] = section
    return kind, fields


def declared(kernels: Path | None = None) -> list[tuple[str, dict]]:
    """Every entry of the wb:checks blocks of the kernel files in `kernels` (default: the shipped sources), the
    base file of each of plan.FILES in that order."""
    k = kernels or paths.template_dir()
    seen, out = {}, []
    for name in plan.FILES:
        path = section_path(name, kernels=k)
        where = f"kernels/{path.relative_to(k).as_posix()}"
        out += parse(read_source(path), name, where, seen)
    return out


DECLARED = declared()


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    section: str               # the file edited (plan.FILES)
    breaks: str                # what it breaks, in words
    find: str
    replace: str
    expect: str                # the stage the verdict must name
    count: int = 1             # occurrences of `find` replaced (all of them)
    needs: str | None = None   # the ModelConfig flag of the family whose code it mutates (None: every model's)
    not_with: str | None = None  # a flag under which the mutated code is compiled away (that family's own step
                                 # does the work instead)

    def apply(self, text: str) -> str:
        return replace_in_code(text, self.find, self.replace, self.count, f"mutant {self.name} of {self.section}")


MUTANTS: tuple[Mutant, ...] = tuple(Mutant(**f) for kind, f in DECLARED if kind == "mutant")

# the plan's stages whose section no mutant edits, and why (tests/test_stage_tables.py: every stage of the plan has
# a mutant of its section or an entry here): none
MUTANTS_EXEMPT: dict[str, str] = {}

# the model each family's mutants run on: random weights at its real shapes
FAMILY_MODELS = {"qk_norm": "qwen3-0.6b", "qkv_bias": "qwen2.5-0.5b"}


def for_model(cfg, mutants=MUTANTS) -> list[Mutant]:
    """The mutants whose code this model compiles: every model's (less those its family's step replaces), and its
    own family's."""
    return [m for m in mutants if (m.needs is None or getattr(cfg, m.needs))
            and not (m.not_with and getattr(cfg, m.not_with))]


def by_name(name: str) -> Mutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"no mutant {name!r}")

"""Assembling the monokernel: the plan and the kernel files → one self-contained source with `#line` markers.

CuPy keys its compile cache on the source text, not on included headers, so nothing is `#include`d: every file is
pasted in, each preceded by `#line 1 "kernels/..."`, and compiler messages point at the file's own line. The order:

    #defines (shapes from the model config, build switches) · kernels/portability.cuh · the plan's generated header
    · the library (kernels/lib/: grid_sync, matvec, instrument) · the stage sections in decode order
    (kernels/sections/) · the plan's generated decode step · kernels/monokernel.cuh

Shapes arrive only as the `#define`s of the config; stage, tap, slot, status and shared-memory constants, the
Params struct and the decode loop only from the plan (workbench.compiler.header).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from .. import paths, plan, schedule
from ..errors import SourceError
from ..model.config import ModelConfig
from .header import Params, decode_step, plan_header, stream_step  # noqa: F401  (Params: the host's mirror, used from here)
from .numba_sections import declarations, is_numba_variant
from .ptx import PtxBody, constants as ptx_constants, cpp_params, header_constants, is_ptx_variant, ptx_stub


def threads_problem(n) -> str | None:
    """Why `n` cannot be the threads of a block (None: it can): the launch's own rule (plan.Launch), which the
    command line checks before anything is read."""
    try:
        plan.Launch(threads=n)
    except ValueError as e:
        return str(e).removeprefix("threads ")
    return None


DEFAULT_EARLY = plan.Launch().early


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    launch: plan.Launch = plan.Launch()  # threads, grid, attention's rings, stream, early stages: what the plan's
                                         # shapes depend on. The build runs effective_launch(): the early stages
                                         # left at the default leave out what cannot load early in the build; a
                                         # stage named on purpose that cannot is an error
    timing: bool = False         # WB_TIMING: per-stage %globaltimer stamps
    taps: bool = False           # WB_TAPS: copy every stage's output of chosen steps into tap buffers
    hang: tuple | None = None    # (stage, layer, block): fault injection for hang-safety tests
    variants: tuple = ()         # ((section, variant), ...): alternative section files, see section_path
    defines: tuple = ()          # ((NAME, value), ...): extra compile-time knobs (e.g. WB_BAR_FENCES)
    ptxas_opt: int = 3           # ptxas -O level (NVIDIA)
    fast_compile: str = "0"      # NVRTC -Ofc level: "0" (off), "min", "mid", "max": compile speed over code speed
    sampler: str = "full"        # "full": temperature, top-k, top-p; "greedy": argmax only (less code to compile)
    units: bool = False          # NVIDIA: built as one unit per stage, each cached, then linked (workbench/compiler/
                                 # units.py): an edit recompiles one stage; the kernel runs slower (verification only)
    smem_carveout: int = -1      # NVIDIA: the share of each SM's L1 asked for as shared memory, in percent (-1: the
                                 # driver's choice, the smallest that fits). No code changes: an experiment's knob, for
                                 # what the L1 left beside a large ring is worth (100: the L1 a stream build leaves)

    def __post_init__(self):
        if not isinstance(self.launch, plan.Launch):
            raise ValueError(f"launch must be a plan.Launch, got {self.launch!r}")
        if self.sampler not in ("full", "greedy"):
            raise ValueError(f"sampler must be 'full' or 'greedy', got {self.sampler!r}")
        if self.fast_compile not in ("0", "min", "mid", "max"):
            raise ValueError(f"fast_compile must be 0, min, mid or max, got {self.fast_compile!r}")
        if self.ptxas_opt not in (0, 1, 2, 3):
            raise ValueError(f"ptxas_opt must be 0 to 3, got {self.ptxas_opt!r}")
        if not (isinstance(self.smem_carveout, int) and -1 <= self.smem_carveout <= 100):
            raise ValueError(f"smem_carveout must be a percent from 0 to 100, or -1 (the driver's choice), got "
                             f"{self.smem_carveout!r}")
        early = self.launch.early
        if (why := schedule.early_problem(None, early)) is not None:
            raise ValueError(f"early: {why}")
        if early != DEFAULT_EARLY and (ptx := [n for n in early if self._ptx_body(n)]):
            raise ValueError(f"early: {', '.join(ptx)}: a PTX body reads its weights itself, so it never waits at "
                             f"the barrier before it (for_warp_units does that); build without early={ptx[0]}")

    def for_target(self, target: str) -> "BuildOptions":
        """These options as the AMD build takes them: a gfx942 workgroup has 64 KiB of LDS and no matrix product
        of the kind attention's rings feed (mma.sync), so attention reads its cache straight to registers there
        and gets no ring; nor does it load early or copy ahead (no asynchronous copy to shared memory there, and no
        room)."""
        if target != "hip":
            return self
        return dataclasses.replace(self, launch=dataclasses.replace(self.launch, attn_kv_bytes=0, early=(), ahead=()))

    def _ptx_body(self, name: str) -> bool:
        return is_ptx_variant(dict(self.variants).get(name))

    def effective_launch(self) -> plan.Launch:
        """The launch this build runs: `launch`, except that early stages left at the default leave out a stage
        whose section is a PTX body (its weights do not pass through for_warp_units, whose prologue waits)."""
        if self.launch.early != DEFAULT_EARLY:
            return self.launch
        return dataclasses.replace(self.launch, early=tuple(n for n in self.launch.early if not self._ptx_body(n)))


def stage_names(text: str) -> tuple:
    """Stage names joined by '+' (an option's text, as `stream_register` and `early` take them)."""
    return tuple(filter(None, text.split("+")))


# The names the text forms (the command line, the scripts, the loop's settings) give the launch's fields: its own,
# and `stream_register` for register_stages; the stage sets as names joined by '+' (see stage_names).
LAUNCH_NAMES = {**{f.name: f.name for f in dataclasses.fields(plan.Launch) if f.name != "register_stages"},
                "stream_register": "register_stages"}
STAGE_SETS = ("early", "stream_register", "ahead")


def _stage_set(v):
    return stage_names(v) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v


def with_fields(opt: BuildOptions | None = None, /, **fields) -> BuildOptions:
    """`opt` (by default BuildOptions()) with `fields` set by the names the text forms use: a BuildOptions field, or
    a launch's by its LAUNCH_NAMES name, which goes to the launch (`threads=256`, `early="o_proj_residual+lm_head"`:
    a stage set as '+' text or a tuple of names)."""
    opt = BuildOptions() if opt is None else opt
    own_names = [f.name for f in dataclasses.fields(BuildOptions)]
    if unknown := [k for k in fields if k not in own_names and k not in LAUNCH_NAMES]:
        raise ValueError(f"{unknown[0]!r} is neither a BuildOptions field nor a launch's (those are: "
                         f"{', '.join([*own_names, *LAUNCH_NAMES])})")
    own = {k: v for k, v in fields.items() if k in own_names}
    launch = {LAUNCH_NAMES[k]: _stage_set(v) if k in STAGE_SETS else v for k, v in fields.items() if k in LAUNCH_NAMES}
    if launch:
        own["launch"] = dataclasses.replace(own.get("launch", opt.launch), **launch)
    return dataclasses.replace(opt, **own) if own else opt


def option_from_text(field: str, text: str):
    """The value of an option written on a command line (`opt.sampler=greedy`, `--set ptxas_opt=1`, `--set
    early=o_proj_residual`): a BuildOptions field or a launch's (LAUNCH_NAMES), as with_fields takes it."""
    kinds = {f.name: type(f.default) for f in dataclasses.fields(BuildOptions)}
    kinds.update({k: str if k in STAGE_SETS else type(getattr(plan.Launch(), v)) for k, v in LAUNCH_NAMES.items()})
    kind = kinds.get(field)
    if kind not in (int, bool, str):
        settable = ", ".join(k for k, t in kinds.items() if t in (int, bool, str))
        raise ValueError(f"{field!r} is not a BuildOptions field that text can set (those are: {settable})")
    if kind is str:
        return text
    try:
        return kind(int(text))
    except ValueError:
        raise ValueError(f"{field} takes an integer, got {text!r}") from None


# The files a user edits, by name: the library, the stages (plan.FILES), and the kernel entry.
FILES = plan.FILES


def section_path(name: str, variant: str | None = None, *, kernels: Path | None = None) -> Path:
    """The file of a kernel section: kernels/lib/NAME.cuh for the library, kernels/sections/NAME.cuh for a stage,
    kernels/monokernel.cuh for the kernel entry; NAME@VARIANT.cuh beside it for a named variant, NAME@VARIANT.ptx
    for a stage's variant written in PTX (a variant named ptx..., see workbench.compiler.ptx). `kernels`: the
    kernels folder (default: the workspace, paths.kernels_dir())."""
    if name not in FILES:
        raise ValueError(f"unknown section {name!r}; sections: {', '.join(FILES)}")
    k = kernels or paths.kernels_dir()
    if name == "monokernel":
        if variant:
            raise ValueError("kernels/monokernel.cuh has no variants")
        return k / "monokernel.cuh"
    folder = k / "lib" if name in plan.LIBRARY else k / "sections"
    if is_numba_variant(variant) and name not in plan.STAGE_NAMES:
        raise ValueError(f"{name} is not a stage: only a stage's section can call device functions written in Python")
    if is_ptx_variant(variant):
        if name not in plan.STAGE_NAMES:
            raise ValueError(f"{name} is not a stage: only a stage's function can be written in PTX")
        return folder / f"{name}@{variant}.ptx"
    return folder / (f"{name}@{variant}.cuh" if variant else f"{name}.cuh")


def numba_path(name: str, variant: str, *, kernels: Path | None = None) -> Path:
    """The .py file of a numba variant: beside its .cuh (workbench.compiler.numba_sections)."""
    return section_path(name, variant, kernels=kernels).with_suffix(".py")


def defines(cfg: ModelConfig, opt: BuildOptions) -> dict[str, str]:
    """The #defines at the top of the source: the config's shapes and the build's switches."""
    d = dict(cfg.defines())
    d.update(WB_THREADS=str(opt.launch.threads), WB_TIMING=str(int(opt.timing)), WB_TAPS=str(int(opt.taps)),
             WB_SAMPLER_FULL=str(int(opt.sampler == "full")), WB_STREAM=str(int(opt.launch.stream)))
    d.update({k: str(v) for k, v in opt.defines})
    if opt.hang:
        stage, layer, block = opt.hang
        d.update(WB_HANG_STAGE=f"ST_{stage.upper()}", WB_HANG_LAYER=str(layer), WB_HANG_BLOCK=str(block))
    return d


@dataclasses.dataclass
class Assembled:
    source: str
    # (first line in source, display path, text as pasted) per piece, for mapping messages back
    pieces: list
    key: str
    flags: tuple = ()      # compiler options the build asks for beyond the common ones (NVRTC)
    ptx_bodies: tuple = ()  # PtxBody per stage whose variant is written in PTX (spliced in before ptxas)
    numba: tuple = ()       # NumbaSource per stage whose variant has device functions in Python (numba_sections)
    ptxas_opt: int = 3
    units: int = 0          # the block's threads when built in units (workbench/compiler/units.py), else 0

    def text_of(self, path: str) -> str | None:
        """The text that was compiled for a section file (an unsaved edit included)."""
        for _, p, text in self.pieces:
            if p == path:
                return text
        for b in self.ptx_bodies + self.numba:
            if b.display == path:
                return b.text
        return None

    def locate(self, line: int) -> tuple[str, int]:
        """Where a line of the assembled source came from."""
        best = ("<generated>", line)
        for start, path, _ in self.pieces:
            if line >= start:
                best = (path, 1 + line - start)
        return best


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(paths.kernels_dir().parent).as_posix()
    except ValueError:
        return path.as_posix()


def decode_source(data: bytes, shown: str, consequence: str = "") -> str:
    """`data`, the bytes of the kernel source `shown`, as text, exactly (no newline translation). Bytes that are not
    UTF-8, or a NUL (where NVRTC would stop reading), are a SourceError naming the file, the byte offset and the
    line, `consequence` (e.g. "nothing was written") said after them."""
    then = f"; {consequence}" if consequence else ""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SourceError(f"{shown} is not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} (line {line}: "
                          f"{e.reason}){then}: kernel sources are read as UTF-8 only, convert it (from Latin-1: "
                          f"iconv -f latin1 -t utf-8)", path=shown) from None
    if (at := data.find(b"\0")) >= 0:
        line = data.count(b"\n", 0, at) + 1
        raise SourceError(f"{shown} holds a NUL byte at offset {at} (line {line}){then}: kernel sources are text, "
                          f"remove it", path=shown)
    return text


def read_source(path: Path) -> str:
    """A kernel source file's text as the compiler is given it: checked by decode_source, with universal newlines
    (as read_text gave it: a CRLF file assembles as an LF one, `#pragma once` lines and the PTX parser included)."""
    text = decode_source(path.read_bytes(), _display(path))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _clean(text: str, path: Path) -> str:
    if re.search(r"^\s*#\s*include\b", text, re.M):
        raise ValueError(f"{_display(path)}: sections are pasted, not included: remove the #include "
                         "(the assembly already provides portability.cuh and the earlier sections)")
    return re.sub(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", "", text, flags=re.M)


def assemble(cfg: ModelConfig, opt: BuildOptions = BuildOptions(), overrides: dict[str, str] | None = None) -> Assembled:
    """The full kernel source. `overrides` maps a section name to replacement text (an edit not yet on disk)."""
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(FILES))
    if unknown:
        raise ValueError(f"overrides for unknown sections {', '.join(unknown)}; sections: {', '.join(FILES)}")
    variants = dict(opt.variants)
    head = ["// monokernel — generated by workbench.compiler.assemble; edit the kernel files and the plan, not this text",
            *(f"#define {k} {v}" for k, v in defines(cfg, opt).items())]
    out, pieces = list(head), []

    def paste(display: str, text: str, where: Path | None = None):
        pieces.append((len(out) + 2, display, text))
        out.append(f'#line 1 "{display}"')
        out.extend(_clean(text, where or Path(display)).splitlines())

    kernels = paths.require_sources()
    build_defines = defines(cfg, opt)
    bodies = []
    # a numba variant's functions, declared before the first stage: every unit of the units build has them
    numba = tuple(declarations(name, _display(numba_path(name, v)), read_source(numba_path(name, v)))
                  for name, v in variants.items() if is_numba_variant(v) and _numba_file(name, v))
    if numba and bodies_requested(variants):
        raise ValueError("a build takes stages written in PTX or numba variants, not both: build them apart")
    paste(_display(kernels / "portability.cuh"), read_source(kernels / "portability.cuh"))
    launch = opt.effective_launch()
    if (why := schedule.register_stages_problem(cfg, launch.register_stages)) is not None:
        raise ValueError(f"stream_register: {why}")
    # a default early stage with no grid barrier before it in this model (qkv when there is one layer) loads as
    # any stage does; one named on purpose is an error
    if opt.launch.early != DEFAULT_EARLY and (why := schedule.early_problem(cfg, launch.early)) is not None:
        raise ValueError(f"early: {why}")
    header = plan_header(cfg, launch)
    paste("<generated: plan header>", header)
    body_constants = {**build_defines, **header_constants(header)}
    for name in plan.LIBRARY + plan.STAGE_NAMES + ("<decode step>", "monokernel"):
        if name == plan.STAGE_NAMES[0] and numba:
            paste("<generated: numba prototypes>", "\n".join(d.prototype() for n in numba for d in n.functions))
        if name == "<decode step>":
            paste("<generated: decode step>", decode_step(cfg, launch) + stream_step(cfg, launch))
            continue
        path = section_path(name, variants.get(name))
        if is_ptx_variant(variants.get(name)):
            # the C++ section declares the function (and is compiled); the .ptx file is its body
            if name not in overrides and not path.exists():
                raise FileNotFoundError(f"section {name!r}: {_display(path)} does not exist")
            if launch.stream and schedule.stream_stage(cfg, name, launch) is not None:
                raise ValueError(f"section {name!r}: in a stream build its weights arrive through the ring "
                                 f"(kernels/lib/stream.cuh), which a PTX body would have to take them from; build "
                                 f"{_display(path)} without stream")
            cpp = section_path(name)
            cpp_text = read_source(cpp)
            bodies.append(PtxBody(name, _display(path), overrides[name] if name in overrides else read_source(path),
                                  cpp_params(cpp_text, f"stage_{name}"),
                                  ptx_constants(body_constants, launch.stage_threads)))
            # the C++ section compiles (its helpers stay; its errors still show) with its stage renamed away, and
            # the stage becomes a stub that uses every parameter, so that the compiler keeps all of them in the
            # function whose body the .ptx replaces (it drops those a body leaves unused)
            paste(_display(cpp), f"#define stage_{name} stage_{name}_in_cpp\n" + cpp_text, cpp)
            paste(f"<generated: {name} in PTX>", ptx_stub(cpp_text, name))
            continue
        if name in overrides:
            paste(_display(path), overrides[name], path)
            continue
        if not path.exists():
            raise FileNotFoundError(f"section {name!r}: {_display(path)} does not exist")
        paste(_display(path), read_source(path), path)
    source = "\n".join(out) + "\n"
    flags = (() if opt.ptxas_opt == 3 else (f"--ptxas-options=-O{opt.ptxas_opt}",)) + \
        (() if opt.fast_compile == "0" else (f"-Ofc={opt.fast_compile}",))
    units = launch.threads if opt.units and units_problem(bool(bodies), launch.stream) is None else 0
    key = hashlib.sha256((source + " ".join(flags) + "".join(b.display + b.text for b in [*bodies, *numba])
                          + (" units" if units else "")).encode()).hexdigest()[:16]
    return Assembled(source, pieces, key, flags, tuple(bodies), numba, opt.ptxas_opt, units)


def bodies_requested(variants: dict) -> bool:
    return any(is_ptx_variant(v) for v in variants.values())


def _numba_file(name: str, variant: str) -> bool:
    """A numba variant's .py exists (FileNotFoundError naming it otherwise)."""
    py = numba_path(name, variant)
    if not py.exists():
        raise FileNotFoundError(f"section {name!r}: {_display(py)} does not exist (a numba variant is "
                                f"{name}@{variant}.cuh and its device functions in {name}@{variant}.py)")
    return True


def units_problem(ptx_bodies: bool, stream: bool) -> str | None:
    """Why a build cannot be split into units (workbench.compiler.units), or None."""
    if ptx_bodies:
        return "a stage is written in PTX (its body is spliced into the whole module's PTX)"
    if stream:
        return "a stream build (its streamer and its stages share the ring's state across the stages)"
    return None


def smem_bytes(cfg: ModelConfig, opt: BuildOptions = BuildOptions()) -> int:
    """The dynamic shared memory the build is launched with (the plan's largest stage layout)."""
    return schedule.smem_bytes(cfg, opt.effective_launch())

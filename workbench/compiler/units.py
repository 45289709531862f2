"""The verification build in units (NVIDIA): one relocatable unit per stage and one for the decode step, each
compiled on its own and cached by its text, then linked. An edit of one section then recompiles that section's
unit, and only it (NVRTC and ptxas on one stage, not on the whole kernel), while the link takes milliseconds.

The price is the calling convention: a stage called across units saves the registers it uses, which the H200
measured at 1.8× slower for the whole kernel. That is why only the verification build is ever built this way.
Its values are what verification reads, and the code is the same code; its speed is never shown.

How the one source becomes units (`split`):
- Each unit is the build's defines, the portability layer, the plan header and the library, followed by one
  stage's section.
- The decode-step unit holds the generated step, the kernel entry, and a prototype of every stage.
- The library's out-of-line functions are compiled into each unit as a private copy, since each unit defines
  them.
- The library's block-shared variables (the barrier's epoch, the where-word) are defined in the decode-step unit
  and declared `extern` in the others, so every unit sees the one variable of its block.
- Line counts are kept, so a compiler message still names the section file and its line.

A build with stages written in PTX, or a stream build, is not split (assemble.units_problem). Nor is any build
on a machine without nvJitLink. In those cases the whole build is compiled instead, as it always was.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .. import plan
from .assemble import Assembled
from .nvrtc import NVRTC_OPTIONS, CompileError, compile_error, nvrtc_program, resource_messages
from .ptx import stage_signature

DECODE_UNIT = "<decode step>"
_MARK = re.compile(r'^#line 1 "(.*)"$')


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str                  # a stage, or DECODE_UNIT
    asm: Assembled             # its source and pieces: messages map to the section files as the whole build's do


def _prototype(stage: str, text: str) -> str:
    ret, params = stage_signature(text, stage, "the decode step's unit declares it")
    return f"WB_SECTION {ret} stage_{stage}({params});"


def _private_library(lines: list[str]) -> list[str]:
    """The portability layer, the plan header and the library as a stage's unit takes them: out-of-line functions
    private to the unit, block-shared variables declared, not defined (the decode step's unit defines them)."""
    out = [re.sub(r"^__device__\s+__noinline__\b", "static __device__ __noinline__", line) for line in lines]
    return [re.sub(r"^__shared__\s+", "extern __shared__ ", line) for line in out]


_SECTION = re.compile(r"(?:^|/)sections/(\w+?)(?:@[\w.-]+)?\.cuh$")


def split(asm: Assembled) -> list[Unit]:
    """The build's units: the decode step's first, then one per stage, in the plan's order."""
    lines = asm.source.split("\n")
    marks = [i for i, line in enumerate(lines) if _MARK.match(line)]
    head = lines[:marks[0]]
    originals = {display: text for _, display, text in asm.pieces}
    parts = []                                         # (display, cleaned lines) as the whole build has them
    for k, i in enumerate(marks):
        j = marks[k + 1] if k + 1 < len(marks) else len(lines)
        parts.append((_MARK.match(lines[i])[1], lines[i + 1:j]))
    stage_of = {d: m[1] for d, _ in parts if (m := _SECTION.search(d)) and m[1] in plan.STAGE_NAMES}
    at = [k for k, (display, _) in enumerate(parts) if display in stage_of]
    if [stage_of[parts[k][0]] for k in at] != list(plan.STAGE_NAMES) or at != list(range(at[0], at[0] + len(at))):
        raise ValueError("the assembled source does not hold the plan's stages in order, one piece each")
    common, stages, tail = parts[:at[0]], parts[at[0]:at[-1] + 1], parts[at[-1] + 1:]
    protos = "\n".join(_prototype(stage_of[d], "\n".join(body)) for d, body in stages)

    def unit(name: str, pieces: list) -> Unit:
        out, kept = list(head), []
        for display, body in pieces:
            kept.append((len(out) + 2, display, originals.get(display, "\n".join(body))))
            out.append(f'#line 1 "{display}"')
            out.extend(body)
        source = "\n".join(out) + "\n"
        key = hashlib.sha256((source + " ".join(asm.flags) + " units").encode()).hexdigest()[:16]
        return Unit(name, Assembled(source, kept, key, asm.flags, ptxas_opt=asm.ptxas_opt))

    private = [(d, _private_library(body)) for d, body in common]
    units = [unit(DECODE_UNIT, common + [("<generated: stage prototypes>", protos.splitlines())] + tail)]
    units += [unit(stage_of[d], private + [(d, body)]) for d, body in stages]
    return units


# ---- compiling and linking -------------------------------------------------------------------------------------

_CACHE: collections.OrderedDict = collections.OrderedDict()     # (unit key, arch, registers) → relocatable cubin
_CACHE_SIZE = 256
_LOCK = threading.Lock()


@dataclasses.dataclass
class Linked:
    cubin: bytes
    compiled: list             # the units compiled for this build (the others came from the cache)
    seconds: dict              # unit → its compile's seconds, for those compiled


def units_linkable() -> bool:
    return nvjitlink_problem() is None


@functools.lru_cache(maxsize=1)
def nvjitlink_problem() -> str | None:
    """Why units cannot be linked here (no nvJitLink), or None."""
    try:
        from cuda.bindings import nvjitlink
        nvjitlink.version()
    except Exception as e:                    # no cuda-bindings, or its library is not installed
        return f"nvJitLink is not available: {' '.join(str(e).split())[:200]}"
    return None


def link(units: list[Unit], arch: str = "sm_90", threads: int = 512, whole=None, ptx: list = ()) -> Linked:
    """Every unit compiled (the cached ones taken from the cache; the others in parallel), then linked into one
    cubin. A compile error is raised (CompileError) at its section's line, as the whole build's would be; so is
    the link's, where it is a resource of the kernel as a whole (too much static shared memory): at the sections'
    declarations in `whole`, the Assembled the units were split from. `ptx`: (name, PTX text) of functions compiled
    elsewhere (a numba section's), which nvJitLink assembles and links with the units."""
    from cuda.bindings import nvjitlink
    # each unit's functions get what the kernel's launch bounds give a thread: one block of `threads` per SM
    registers = min(255, 65536 // threads)
    keys = [(u.asm.key, arch, registers) for u in units]
    with _LOCK:
        have = {k: _CACHE[k] for k in keys if k in _CACHE}
    todo = [(u, k) for u, k in zip(units, keys) if k not in have]
    seconds = {}

    def build(item):
        u, k = item
        t0 = time.perf_counter()
        ok, log, _, cubin = nvrtc_program(u.asm.source, [f"--gpu-architecture={arch}", "-rdc=true",
                                                         f"--maxrregcount={registers}", *NVRTC_OPTIONS, *u.asm.flags])
        if not ok:
            raise compile_error(log, u.asm)
        seconds[u.name] = time.perf_counter() - t0
        return k, cubin
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), 16))) as pool:
        have.update(pool.map(build, todo))
    with _LOCK:
        for k in keys:
            _CACHE[k] = have[k]
            _CACHE.move_to_end(k)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    options = [f"-arch={arch}", *(["-lineinfo"] if ptx else [])]      # the PTX keeps its .py lines
    handle = nvjitlink.create(len(options), options)
    try:
        for u, k in zip(units, keys):
            nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, have[k], len(have[k]), u.name)
        for name, text in ptx:
            data = text.encode()
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError:
            log = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, log)
            text = log.decode(errors="replace").rstrip("\x00 ")
            where = "<link of the verification build's units>"
            raise CompileError(resource_messages(text, whole, where) + [(where, 0, "error", text.strip()[:2000], "")],
                               text) from None
        out = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, out)
    finally:
        nvjitlink.destroy(handle)
    return Linked(bytes(out), [u.name for u, _ in todo], seconds)

"""Compiling the assembled source, with or without a GPU.

On a GPU machine the runtime compiles through `cupy.RawModule` (NVRTC). `compile_cubin` runs the same NVRTC with
the same options through `cuda.bindings.nvrtc`, which needs no driver, so a CPU-only machine (and CI) can build for
sm_90 and read registers, spills and shared memory off the cubin with cuobjdump. Compiler messages are mapped back
through the `#line` markers to the section file and line, with the offending source line shown.

The same source also builds for AMD (gfx942) with clang's HIP front end (`compile_hip`, no ROCm needed: clang-19
with -nogpulib -nogpuinc, kernels/portability.cuh supplies the rest); `amdgpu_resources` reads VGPRs, SGPRs, AGPRs,
LDS and scratch off its assembly. `dump_section` prints the machine code (PTX, SASS or AMDGCN) that debug line info
attributes to one section file, including what was inlined into it.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import paths
from .assemble import Assembled
from .nvrtc import NVRTC_OPTIONS, CompileError, compile_error, nvrtc_program, parse_log
from . import numba_sections
from .ptx import ptxas_messages, splice
from .units import link, split, units_linkable

# The archs a build is made for and read back (registers, spills, shared memory), each tried. Before sm_80 ptxas
# refuses the kernel's cp.async; sm_80 to sm_89 compile, but cuobjdump lists their resources in a form that
# resource_usage does not read. clang-19 knows no gfx950, and gfx1100 lacks s_memrealtime (the timing clock).
CUDA_ARCHS = ("sm_90", "sm_90a", "sm_100", "sm_100a", "sm_103", "sm_103a", "sm_110", "sm_120", "sm_120a", "sm_121")
HIP_ARCHS = ("gfx908", "gfx90a", "gfx940", "gfx941", "gfx942")


def compile_nvidia(asm: Assembled, arch: str = "sm_90", ptx_only: bool = False) -> tuple[bytes, str, str]:
    """One NVRTC compile without a driver → (cubin, PTX text, log); the cubin is made from exactly that PTX
    (`ptx_only`: no cubin, b""; NVRTC stops at PTX). Raises CompileError with mapped messages."""
    numba = compile_numba(asm, arch)
    if asm.units and not ptx_only and units_linkable():        # else the whole build, as below
        ptx = [(f"{c.source.display}:{name}", text) for c in numba for name, text in c.ptx.items()]
        return link(split(asm), arch, asm.units, whole=asm, ptx=ptx).cubin, "", ""
    # a build with PTX sections or numba functions: NVRTC stops at PTX (a virtual architecture: its own ptxas would
    # assemble a module about to change), and ptxas runs once, on the spliced module
    virtual = bool(asm.ptx_bodies or numba) or ptx_only
    target = arch.replace("sm_", "compute_") if virtual else arch
    flags = [f for f in asm.flags if not f.startswith("--ptxas-options")] if virtual else list(asm.flags)
    ok, log, ptx, cubin = nvrtc_program(asm.source, [f"--gpu-architecture={target}", *NVRTC_OPTIONS, *flags],
                                        cubin=not virtual)
    if not ok:
        raise compile_error(log, asm)
    if asm.ptx_bodies or numba:            # stages written in PTX, functions in Python: in place, then ptxas
        ptx, spans = spliced_ptx(ptx, asm) if asm.ptx_bodies else numba_sections.splice(ptx, numba)
        if not ptx_only:
            cubin, more = ptxas(ptx, asm, spans, arch)
            log += more
    return cubin, ptx, log


def compile_numba(asm: Assembled, arch: str) -> list:
    """The build's numba sections compiled for `arch` (numba_sections.Compiled each); a Python or typing error is
    raised as a CompileError at the .py file's line."""
    try:
        return [numba_sections.compile_source(n, arch) for n in asm.numba]
    except numba_sections.NumbaError as e:
        raise CompileError(e.messages, str(e)) from None


def spliced_ptx(ptx: str, asm: Assembled) -> tuple[str, list]:
    """The module's PTX with the build's PTX sections in place → (ptx, spans: where each section's lines are)."""
    try:
        return splice(ptx, asm.ptx_bodies)
    except ValueError as e:
        raise CompileError([(asm.ptx_bodies[0].display, 0, "error", str(e), "")], str(e)) from None


def ptxas(ptx: str, asm: Assembled, spans: list, arch: str = "sm_90") -> tuple[bytes, str]:
    """Spliced PTX → (cubin, log) with ptxas at the build's -O level and with line info, as NVRTC runs it; a message
    about a line of a PTX section is raised (CompileError) at that line of its .ptx file."""
    with tempfile.TemporaryDirectory(prefix="wb-ptxas-") as d:
        src, out = Path(d) / "monokernel.ptx", Path(d) / "monokernel.cubin"
        src.write_text(ptx)
        # the build's fast-compile level as NVRTC passes it on, which stands in for an -O level (ptxas takes one)
        level = [f for f in asm.flags if f.startswith("-Ofc=")] or [f"-O{asm.ptxas_opt}"]
        r = subprocess.run([cuda_tool("ptxas"), f"-arch={arch}", *level, "-lineinfo", str(src), "-o", str(out)],
                           capture_output=True, text=True)
        log = r.stdout + r.stderr
        if r.returncode != 0:
            msgs = ptxas_messages(log, spans, asm.ptx_bodies + asm.numba) or [("ptxas", 0, "error", log.strip(), "")]
            raise CompileError(msgs, log)
        return out.read_bytes(), log


def compile_cubin(asm: Assembled, arch: str = "sm_90") -> tuple[bytes, str]:
    """NVRTC without a driver → (cubin, log). Raises CompileError with mapped messages."""
    cubin, _, log = compile_nvidia(asm, arch)
    return cubin, log


def compile_ptx(asm: Assembled, arch: str = "sm_90") -> tuple[str, str]:
    """The PTX NVRTC makes of the source with the same options (line info included) → (ptx text, log); NVRTC stops
    there (no ptxas), and PTX sections are spliced in."""
    _, ptx, log = compile_nvidia(asm, arch, ptx_only=True)
    return ptx, log


def cuda_tool(name: str) -> str:
    """nvdisasm/cuobjdump/ptxas from the PyPI wheels, else from PATH."""
    for base in map(Path, sys.path):
        p = base / "nvidia" / "cu13" / "bin" / name
        if p.is_file():
            return str(p)
    found = shutil.which(name)
    if not found:
        # nvdisasm and cuobjdump come with the cuda extra; ptxas only with the toolkit or its own wheel
        how = "pip install nvidia-cuda-nvcc" if name == "ptxas" else paths.pip_install("cuda")
        raise FileNotFoundError(f"{name} not found: install the CUDA toolkit, or {how}")
    return found


@dataclasses.dataclass
class Resources:
    kernel: str
    registers: int
    stack: int           # local memory per thread (spills and local arrays), bytes
    shared: int          # static shared memory, bytes
    constant: int

    @property
    def spills(self) -> bool:
        return self.stack > 0


def resource_usage(cubin: bytes) -> list[Resources]:
    """Per-kernel registers, local memory (spills), shared memory, read off the cubin by cuobjdump."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin if cubin.endswith(b"\0") else cubin + b"\0")
        out = subprocess.run([cuda_tool("cuobjdump"), "--dump-resource-usage", str(p)], capture_output=True,
                             text=True, check=True).stdout
    res = []
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)(?: CONSTANT\[0\]:(\d+))?", out):
        if m[6] is None:            # a device function (listed by fast-compile builds): no parameter bank, no figures
            continue
        res.append(Resources(m[1], int(m[2]), max(int(m[3]), int(m[5])), int(m[4]), int(m[6])))
    if not res:
        raise RuntimeError(f"could not read cuobjdump's resource usage:\n{out}")
    return res


def disassemble(cubin: bytes, inline: bool = False, ptx_lines: bool = False) -> str:
    """SASS of the cubin (nvdisasm), with `//## File ...` line comments: source lines; with `inline` also the
    chain of inlined calls (one `//##` line per frame, innermost first); with `ptx_lines` the line of the PTX each
    instruction came from instead (`//## File ".nv_debug_ptx_txt", line N`: line N of the PTX NVRTC returned)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin if cubin.endswith(b"\0") else cubin + b"\0")
        flag = "-gp" if ptx_lines else "-gi" if inline else "-g"
        return subprocess.run([cuda_tool("nvdisasm"), "-c", flag, str(p)], capture_output=True, text=True,
                              check=True).stdout


# ---- AMD: clang's HIP front end --------------------------------------------------------------------------------
# Device code only, no ROCm: nothing of HIP is predefined (-nogpuinc) nor linked (-nogpulib); portability.cuh
# supplies the keywords, types and builtins the sections use.
HIP_OPTIONS = ("-x", "hip", "-std=c++17", "-nogpulib", "-nogpuinc", "--cuda-device-only", "-O3",
               "-fno-color-diagnostics")
CLANG_NAMES = ("clang-19", "clang-20", "clang-21", "clang")
HIP_INSTALL = "apt-get install clang-19 lld-19 llvm-19 (on Debian or Ubuntu)"


def clang_path() -> str:
    """The clang for the HIP path: $WB_CLANG, else the first of CLANG_NAMES on PATH."""
    if env := os.environ.get("WB_CLANG"):
        found = shutil.which(env)
        if not found:
            raise FileNotFoundError(f"WB_CLANG={env!r} is not an executable")
        return found
    for found in map(shutil.which, CLANG_NAMES):
        if found:
            return found
    raise FileNotFoundError("clang not found (the AMD build needs clang >= 17 with the AMDGPU target, lld to link "
                            f"and LLVM's tools to read the code): {HIP_INSTALL}")


def llvm_tool(name: str) -> str:
    """An LLVM tool of the same release as clang_path() (llvm-objdump, llvm-symbolizer): beside the real clang
    binary, else NAME-<major> or NAME on PATH."""
    beside = Path(os.path.realpath(clang_path())).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    m = re.search(r"-(\d+)$", Path(clang_path()).name)
    for found in map(shutil.which, ([f"{name}-{m[1]}"] if m else []) + [name]):
        if found:
            return found
    raise FileNotFoundError(f"{name} not found: {HIP_INSTALL}")


def _clang(asm: Assembled, arch: str, args: list[str], out_name: str) -> tuple[bytes, str]:
    if asm.ptx_bodies:
        b = asm.ptx_bodies[0]
        raise CompileError([(b.display, 0, "error", "a section written in PTX is NVIDIA's: build the AMD target "
                             f"without the variant (its C++ section, or an AMDGCN variant such as "
                             f"{b.section}@gcn.cuh)", "")], "")
    if asm.numba:
        n = asm.numba[0]
        raise CompileError([(n.display, 0, "error", "device functions in Python are compiled by numba-cuda, to PTX: "
                             f"build the AMD target without the variant (its C++ section, {n.section}.cuh)", "")], "")
    with tempfile.TemporaryDirectory() as d:
        # relative names, run in the temporary folder: the #line paths stay repo-relative in messages and debug info
        Path(d, "monokernel.hip").write_text(asm.source)
        r = subprocess.run([clang_path(), *HIP_OPTIONS, f"--offload-arch={arch}", *args, "monokernel.hip", "-o",
                            out_name], cwd=d, capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError(parse_log(r.stderr, asm), r.stderr or f"clang exited {r.returncode}")
        return Path(d, out_name).read_bytes(), r.stderr


def compile_hip(asm: Assembled, arch: str = "gfx942", debug: bool = False) -> tuple[str, str]:
    """clang -x hip for an AMD GPU, device code only → (AMDGCN assembly text, log). `debug` adds line tables
    (`.loc`/`.file`; the code is the same). Raises CompileError with the messages mapped to section files."""
    text, log = _clang(asm, arch, ["-S", *(["-gline-tables-only"] if debug else [])], "monokernel.s")
    return text.decode(errors="replace"), log


def hip_code_object(asm: Assembled, arch: str = "gfx942", debug: bool = True) -> tuple[bytes, str]:
    """The linked AMDGPU code object (ELF, what hipModuleLoad takes; needs lld) → (bytes, log)."""
    return _clang(asm, arch, ["--no-gpu-bundle-output", *(["-gline-tables-only"] if debug else [])],
                  "monokernel.hsaco")


@dataclasses.dataclass
class AmdResources:
    kernel: str
    vgprs: int           # architectural VGPRs per lane
    sgprs: int
    agprs: int           # accumulation VGPRs (MFMA); gfx90a+ allocate them from the same file as the VGPRs
    lds: int             # static LDS (group segment), bytes; dynamic LDS comes on top at launch
    scratch: int         # private segment per lane (spills, local arrays, stack), bytes
    vgpr_spills: int = 0
    sgpr_spills: int = 0  # SGPRs spill into VGPR lanes (v_writelane), not to memory
    wavefront: int = 64
    max_threads: int = 0

    # the names Resources uses, so callers can treat both targets alike
    @property
    def registers(self) -> int:
        return self.vgprs

    @property
    def stack(self) -> int:
        return self.scratch

    @property
    def shared(self) -> int:
        return self.lds

    @property
    def spills(self) -> bool:
        return self.scratch > 0 or self.vgpr_spills > 0


_AMD_KEYS = {"vgpr_count": "vgprs", "sgpr_count": "sgprs", "agpr_count": "agprs", "group_segment_fixed_size": "lds",
             "private_segment_fixed_size": "scratch", "vgpr_spill_count": "vgpr_spills",
             "sgpr_spill_count": "sgpr_spills", "wavefront_size": "wavefront", "max_flat_workgroup_size": "max_threads"}


def amdgpu_resources(asm_text: str) -> list[AmdResources]:
    """Per-kernel VGPRs, SGPRs, AGPRs, LDS and scratch from AMDGCN assembly: the `amdhsa.kernels` metadata, else
    the `; Kernel info:` comments (`; NumVgprs:` ...)."""
    res = []
    meta = re.search(r"^\s*\.amdgpu_metadata\s*$(.*?)^\s*\.end_amdgpu_metadata", asm_text, re.M | re.S)
    if meta:
        kernels = re.search(r"^amdhsa\.kernels:\s*$(.*?)(?=^\S)", meta[1] + "\nend:\n", re.M | re.S)
        for block in re.split(r"^  - ", kernels[1] if kernels else "", flags=re.M)[1:]:
            # the kernel's own keys sit at four spaces (the first one on the `  - ` line); deeper ones are args
            kv = dict(re.findall(r"^    \.([\w]+):\s+(\S+)\s*$", "    " + block, re.M))
            if "name" not in kv:
                continue
            f = {_AMD_KEYS[k]: int(v) for k, v in kv.items() if k in _AMD_KEYS and re.fullmatch(r"\d+", v)}
            res.append(AmdResources(kernel=kv["name"], **{"vgprs": 0, "sgprs": 0, "agprs": 0, "lds": 0,
                                                         "scratch": 0, **f}))
    if not res:
        names = re.findall(r"^\s*\.amdhsa_kernel\s+(\S+)", asm_text, re.M)
        infos = re.split(r"^; Kernel info:", asm_text, flags=re.M)[1:]
        for name, info in zip(names, infos):
            def num(key, default=0):
                m = re.search(rf"^; {key}:\s*(\d+)", info, re.M)
                return int(m[1]) if m else default
            lds = re.search(r"^; LDSByteSize:\s*(\d+)", info, re.M)
            res.append(AmdResources(name, num("NumVgprs"), num("NumSgprs"), num("NumAgprs"),
                                    int(lds[1]) if lds else 0, num("ScratchSize")))
    if not res:
        raise RuntimeError("no AMDGPU kernel metadata (amdhsa.kernels) or '; Kernel info:' comments in the assembly")
    return res


# ---- machine code by section: debug line info → section files ---------------------------------------------------
# A listing is [(text, chain)] for each line of code, the chain being the source frames ((file, line), innermost
# first: the code's own line, then the call it was inlined into, and so on up to the kernel). A line of code
# belongs to a section when the section's file is anywhere in its chain: stage_qkv_rope_append's listing includes
# the matvec and portability helpers inlined into it.
DUMP_KINDS = ("ptx", "sass", "amdgcn")
DUMP_COMMENT = {"ptx": "//", "sass": "//", "amdgcn": ";"}


def ptx_line_chains(ptx: str) -> list:
    """The source frames of every line of the PTX (index 0 = line 1; () where none), from
    `.loc F L C[, function_name X, inlined_at F2 L2 C2]` and `.file`. PTX names one level of inlining per `.loc`;
    the chain is followed up through the call site's own most recent `.loc`."""
    files = {int(m[1]): m[2] for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', ptx, re.M)}
    loc_re = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)(?:.*?inlined_at\s+(\d+)\s+(\d+)\s+(\d+))?")
    parent: dict = {}     # a location → the call site it was last seen inlined at
    out, chain, done = [], (), False
    for line in ptx.splitlines():
        s = line.strip()
        if done or s.startswith(".section"):
            done = True     # DWARF sections follow the code
            out.append(())
            continue
        m = loc_re.match(line)
        if m:
            here = (int(m[1]), int(m[2]), int(m[3]))
            up = (int(m[4]), int(m[5]), int(m[6])) if m[4] else None
            parent[here] = up
            frames, seen = [here], {here}
            while up is not None and up not in seen and len(frames) < 64:
                frames.append(up)
                seen.add(up)
                up = parent.get(up)
            chain = tuple((files.get(f, f"<file {f}>"), n) for f, n, _ in frames)
            out.append(())
            continue
        if re.match(r"^\.(visible|weak|extern|func|entry)\b", line) or line.startswith("}"):
            chain = ()      # a function's header and its closing brace belong to no source line
        out.append(chain if s and not s.startswith("//") and not s.startswith(".file") else ())
    return out


def listing_ptx(ptx: str) -> list:
    """PTX lines with their source frames."""
    return [(line.rstrip(), c) for line, c in zip(ptx.splitlines(), ptx_line_chains(ptx)) if c]


def listing_sass(sass: str, ptx: str | None = None) -> list:
    """SASS instructions with their source frames: through the PTX line of each instruction (`nvdisasm -gp` with
    the PTX the cubin was made from: exact, as the PTX's inlining info is), else from `nvdisasm -gi` (whose
    inline chains ptxas gets wrong inside non-inlined device functions)."""
    frame_re = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')
    chains = ptx_line_chains(ptx) if ptx is not None else None
    out, chain, block = [], (), []
    for line in sass.splitlines():
        m = frame_re.match(line)
        if m:
            if chains is not None and m[1] == ".nv_debug_ptx_txt":
                block = [("ptx", int(m[2]))]
            else:
                block.append((m[1], int(m[2])))
            continue
        if block:
            if block[0][0] == "ptx":
                n = block[0][1]
                chain = chains[n - 1] if 0 < n <= len(chains) else ()
            else:
                chain = tuple(block)
            block = []
        if re.match(r"^\s*/\*[0-9a-f]{4,}\*/", line) and chain:
            out.append((line.rstrip(), chain))
    return out


def listing_amdgcn_asm(asm_text: str) -> list:
    """AMDGCN lines of `compile_hip(debug=True)` with their innermost frame only (`.loc` names no inlining)."""
    files = {int(m[1]): f"{m[2]}/{m[3]}" if m[3] is not None else m[2]
             for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]*)"(?:\s+"([^"]*)")?', asm_text, re.M)}
    out, chain = [], ()
    for line in asm_text.splitlines():
        s = line.strip()
        m = re.match(r"\.loc\s+(\d+)\s+(\d+)", s)
        if m:
            chain = ((files.get(int(m[1]), m[1]), int(m[2])),)
            continue
        if s.startswith((".Lfunc_end", ".section", ".end_amdgpu_metadata")):
            chain = ()
        if not s or s.startswith((";", ".", "//")) or not chain:
            continue
        out.append(("\t" + s, chain))
    return out


def listing_amdgcn(code_object: bytes) -> list:
    """AMDGCN instructions of a linked code object (llvm-objdump) with their full inline chains (llvm-symbolizer
    --inlining on each address)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.hsaco"
        p.write_bytes(code_object)
        dis = subprocess.run([llvm_tool("llvm-objdump"), "-d", "--no-show-raw-insn", str(p)], capture_output=True,
                             text=True, check=True).stdout
        insns, base = [], 0
        for line in dis.splitlines():
            m = re.match(r"^([0-9a-fA-F]+) <[^>]+>:$", line)
            if m:
                base = int(m[1], 16)
                continue
            m = re.match(r"^\s+(\S.*?)\s*// ([0-9A-Fa-f]+):", line)
            if m:
                insns.append((int(m[2], 16), base, m[1]))     # offsets from the function, as branch targets show
        addrs = "".join(f"0x{a:x}\n" for a, _, _ in insns)
        sym = subprocess.run([llvm_tool("llvm-symbolizer"), f"--obj={p}", "--inlining", "--functions=none"],
                             input=addrs, capture_output=True, text=True, check=True).stdout
    blocks = sym.strip("\n").split("\n\n") if insns else []
    if len(blocks) != len(insns):
        raise RuntimeError(f"llvm-symbolizer answered {len(blocks)} addresses for {len(insns)} instructions")
    out = []
    for (addr, base, text), block in zip(insns, blocks):
        chain = []
        for fr in block.splitlines():
            m = re.match(r"^(.*):(\d+):\d+$", fr.strip())
            if m and m[1] != "??":
                chain.append((m[1], int(m[2])))
        if chain:
            out.append((f"\t/*{addr - base:04x}*/ {text}", tuple(chain)))
    return out


def _same_file(debug_path: str, display: str) -> bool:
    """A path from debug info (absolute, or joined to the compile folder) names this repo-relative display path."""
    d, p = debug_path.replace("\\", "/"), display.replace("\\", "/")
    return d == p or d.endswith("/" + p)


def section_file(asm: Assembled, section: str) -> str:
    """The display path of a section of the assembled source: 'qkv_rope_append' (or a variant's full name
    'name@variant'), 'monokernel', 'portability', or a path as shown in messages. A stage written in PTX is its
    .ptx file (the C++ section only declares it)."""
    paths = _displays(asm)
    for p in paths:
        stem = Path(p).stem
        if section in (p, stem, stem.split("@")[0]):
            return p
    names = sorted({Path(p).stem for p in paths if not p.startswith("<")})
    raise ValueError(f"no section {section!r} in the assembled source (sections: {', '.join(names)})")


def _displays(asm: Assembled) -> list[str]:
    """The files of the build: its PTX sections and numba files first (a stage's name picks the code that is its
    own, not the C++ that calls it), then the pieces of the C++ source."""
    return [b.display for b in asm.ptx_bodies + asm.numba] + [p for _, p, _ in asm.pieces]


def lines_by_source(asm: Assembled, listing: list, path: str) -> dict[int, list[str]]:
    """{line of `path`: [lines of code]} for the code whose chain passes through `path`, keyed by its innermost frame
    in that file: the section's own statement that the code implements (a lambda's body line rather than the call
    that runs the lambda)."""
    out: dict[int, list[str]] = {}
    for text, chain in listing:
        hits = [n for f, n in chain if _same_file(f, path)]
        if hits:
            out.setdefault(hits[0], []).append(text)
    return out


def format_listing(asm: Assembled, listing: list, path: str | None = None, comment: str = "//") -> str:
    """The code whose chain passes through `path` (everything when None), each run of lines from one place headed by
    `outer.cuh:L > inner.cuh:L: source text of the innermost line`, counted from the section's own frame down."""
    out, last, displays = [], None, _displays(asm)
    for text, chain in listing:
        frames = [(next((p for p in displays if _same_file(f, p)), f), n) for f, n in chain]
        if path is not None:
            idx = [i for i, (f, _) in enumerate(frames) if f == path or _same_file(f, path)]
            if not idx:
                continue
            frames = frames[:idx[-1] + 1]
        key = tuple(frames)
        if key != last:
            f0, n0 = frames[0]
            src_lines = (asm.text_of(f0) or "").splitlines()
            src = src_lines[n0 - 1].strip() if 0 < n0 <= len(src_lines) else ""
            where = " > ".join(f"{Path(f).name}:{n}" for f, n in reversed(frames))
            out.append(f"{comment} {where}" + (f"    {src}" if src else ""))
            last = key
        out.append(text)
    return "\n".join(out) + ("\n" if out else "")


def machine_listing(asm: Assembled, kind: str, arch: str | None = None) -> list:
    """Compile for `kind` (ptx, sass: NVIDIA; amdgcn: AMD) and return its listing with source frames."""
    if kind == "ptx":
        return listing_ptx(compile_ptx(asm, arch or "sm_90")[0])
    if kind == "sass":
        cubin, ptx, _ = compile_nvidia(asm, arch or "sm_90")
        return listing_sass(disassemble(cubin, ptx_lines=True), ptx) or listing_sass(disassemble(cubin, inline=True))
    if kind == "amdgcn":
        try:
            obj, _ = hip_code_object(asm, arch or "gfx942", debug=True)
            return listing_amdgcn(obj)
        except CompileError as e:
            if e.messages:
                raise                   # the source is wrong; else it is the link (no lld): fall back
        except (FileNotFoundError, subprocess.CalledProcessError, RuntimeError):
            pass                        # no llvm-objdump / llvm-symbolizer, or an answer that did not line up
        # the assembly's own .loc lines: the innermost frame only, so inlined helpers count for their own file
        return listing_amdgcn_asm(compile_hip(asm, arch or "gfx942", debug=True)[0])
    raise ValueError(f"unknown dump kind {kind!r} (one of {', '.join(DUMP_KINDS)})")


def dump_section(asm: Assembled, kind: str, section: str | None = None, arch: str | None = None) -> str:
    """The PTX, SASS or AMDGCN of one section (its lines, and what was inlined into them), or of the whole kernel."""
    path = section_file(asm, section) if section else None
    return format_listing(asm, machine_listing(asm, kind, arch), path, DUMP_COMMENT[kind])

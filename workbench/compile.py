"""Compiling the assembled source, with or without a GPU.

On a GPU machine the runtime compiles through `cupy.RawModule` (NVRTC). `compile_cubin` runs the same NVRTC with
the same options through `cuda.bindings.nvrtc`, which needs no driver, so a CPU-only machine (and CI) can build for
sm_90 and read registers, spills and shared memory off the cubin with cuobjdump. Compiler messages are mapped back
through the `#line` markers to the section file and line, with the offending source line shown.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .assemble import Assembled

NVRTC_OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization", "-lineinfo")


class CompileError(RuntimeError):
    """A kernel that did not compile; `.messages` are (file, line, severity, text, source line)."""

    def __init__(self, messages: list, log: str):
        self.messages, self.log = messages, log
        lines = [f"{f}:{n}: {sev}: {txt}" + (f"\n    {src.strip()}" if src else "") for f, n, sev, txt, src in messages
                 if sev == "error"] or [log.strip()]
        super().__init__("kernel did not compile:\n" + "\n".join(lines))


_MSG = re.compile(r'^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): (?P<sev>error|warning|catastrophic error)[^:]*: (?P<text>.*)$')


def parse_log(log: str, asm: Assembled | None = None) -> list:
    """NVRTC messages → (file, line, severity, text, source line); files are repo-relative thanks to #line, and the
    source line is taken from the text that was compiled (an unsaved edit), else from the file."""
    root = Path(__file__).resolve().parent.parent
    out = []
    for line in log.splitlines():
        m = _MSG.match(line.strip())
        if not m:
            continue
        f, n = m["file"], int(m["line"])
        text = asm.text_of(f) if asm else None
        if text is None and (root / f).is_file():
            text = (root / f).read_text()
        lines = (text or "").splitlines()
        src = lines[n - 1] if 0 < n <= len(lines) else ""
        out.append((f, n, "error" if "error" in m["sev"] else "warning", m["text"], src))
    return out


def nvrtc_options(arch: str = "sm_90") -> list[str]:
    return [f"--gpu-architecture={arch}", *NVRTC_OPTIONS]


def compile_cubin(asm: Assembled, arch: str = "sm_90") -> tuple[bytes, str]:
    """NVRTC without a driver → (cubin, log). Raises CompileError with mapped messages."""
    from cuda.bindings import nvrtc

    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC call failed: {err}")
        return res[1] if isinstance(res, tuple) and len(res) == 2 else res

    prog = check(nvrtc.nvrtcCreateProgram(asm.source.encode(), b"monokernel.cu", 0, [], []))
    opts = [o.encode() for o in nvrtc_options(arch)]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    size = check(nvrtc.nvrtcGetProgramLogSize(prog))
    buf = b" " * size
    check(nvrtc.nvrtcGetProgramLog(prog, buf))
    log = buf.decode(errors="replace").rstrip("\x00 ")
    if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(parse_log(log, asm), log)
    n = check(nvrtc.nvrtcGetCUBINSize(prog))
    cubin = b" " * n
    check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log


def cuda_tool(name: str) -> str:
    """nvdisasm/cuobjdump from the PyPI wheels, else from PATH."""
    for base in map(Path, sys.path):
        p = base / "nvidia" / "cu13" / "bin" / name
        if p.is_file():
            return str(p)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: pip install nvidia-cuda-{name}")
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
        res.append(Resources(m[1], int(m[2]), max(int(m[3]), int(m[5])), int(m[4]), int(m[6] or 0)))
    if not res:
        raise RuntimeError(f"could not read cuobjdump's resource usage:\n{out}")
    return res


def disassemble(cubin: bytes) -> str:
    """SASS of the cubin (nvdisasm)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin if cubin.endswith(b"\0") else cubin + b"\0")
        return subprocess.run([cuda_tool("nvdisasm"), "-c", "-g", str(p)], capture_output=True, text=True,
                              check=True).stdout

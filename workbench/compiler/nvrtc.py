"""NVRTC without a driver, and compiler messages mapped back to the section files: what the whole build
(workbench.compiler.compile) and the units build (workbench.compiler.units) both compile with.

`nvrtc_program` runs one NVRTC program through cuda-bindings (CuPy's binding where that is missing). A log becomes
a `CompileError` whose messages name the section file and line (through the `#line` markers of the assembled
source) with the offending source line; ptxas's "too much shared data", which names only the kernel, is pointed
at the sections' static `__shared__` arrays.
"""
from __future__ import annotations

import re

from .. import paths
from ..paths import ROOT
from .assemble import Assembled

NVRTC_OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization", "-lineinfo")


class CompileError(RuntimeError):
    """A kernel that did not compile; `.messages` are (file, line, severity, text, source line)."""

    def __init__(self, messages: list, log: str):
        self.messages, self.log = messages, log
        lines = [f"{f}{f':{n}' if n else ''}: {sev}: {txt}" + (f"\n    {src.strip()}" if src else "")
                 for f, n, sev, txt, src in messages if sev == "error"] or [log.strip()]
        super().__init__("kernel did not compile:\n" + "\n".join(lines))


_MSG = re.compile(r'^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): (?P<sev>error|warning|catastrophic error)[^:]*: (?P<text>.*)$')
# clang: `file:line:col: error: text` (the file may itself contain ': ', as "<generated: Params, Stage>" does)
_CLANG_MSG = re.compile(r'^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<sev>fatal error|error|warning): (?P<text>.*)$')


def parse_log(log: str, asm: Assembled | None = None) -> list:
    """NVRTC or clang messages → (file, line, severity, text, source line); files are repo-relative thanks to
    #line, and the source line is taken from the text that was compiled (an unsaved edit), else from the file."""
    out = []
    for line in log.splitlines():
        m = _MSG.match(line.strip()) or _CLANG_MSG.match(line.strip())
        if not m:
            continue
        f, n = m["file"], int(m["line"])
        text = asm.text_of(f) if asm else None
        if text is None and (ROOT / f).is_file():
            text = (ROOT / f).read_text()
        lines = (text or "").splitlines()
        src = lines[n - 1] if 0 < n <= len(lines) else ""
        out.append((f, n, "error" if "error" in m["sev"] else "warning", m["text"], src))
    return out


_SHARED_ARRAY = re.compile(r"__shared__[^;()]*\[")
# ptxas's own words, and nvJitLink's when it links the units (workbench/compiler/units.py): "error   : Entry ..."
_PTXAS_SHARED = re.compile(r"(?:ptxas )?error\s*: (?P<text>Entry function .* uses too much shared data.*)$", re.M)


def resource_messages(log: str, asm: Assembled | None, where: str = "ptxas") -> list:
    """ptxas's "uses too much shared data" names the kernel, not a line: point at every static `__shared__` array
    in the sections (the dynamic shared memory is the plan's, sized by the header), so that the report lands at
    the user's declaration. `where`: who said it (ptxas, or the link of the units)."""
    m = _PTXAS_SHARED.search(log)
    if not m or asm is None:
        return []
    out = [(where, 0, "error", m["text"].strip(), "")]
    # the sections first: they are what a user edits; the library's own arrays (timing stamps) after
    for _, path, text in sorted(asm.pieces, key=lambda piece: not piece[1].startswith("kernels/sections/")):
        # not in a block comment (the wb:checks block of workbench.check.mutants quotes declarations): its lines kept
        code = re.sub(r"/\*.*?\*/", lambda c: "\n" * c[0].count("\n"), text, flags=re.S)
        for n, (line, shown) in enumerate(zip(code.splitlines(), text.splitlines()), 1):
            if _SHARED_ARRAY.search(line.split("//")[0]) and "extern" not in line:
                out.append((path, n, "error", "static shared memory declared here counts against that limit",
                            shown))
    return out


def compile_error(log: str, asm: Assembled | None) -> CompileError:
    """An NVRTC log as a CompileError: its messages at the sections' lines, ptxas's resource errors included."""
    return CompileError(parse_log(log, asm) + resource_messages(log, asm), log)


def nvrtc_program(source: str, options: list[str], cubin: bool = True) -> tuple[bool, str, str, bytes]:
    """One NVRTC program, no driver needed → (compiled, log, PTX, cubin or b""): through cuda-bindings, else through
    CuPy's own binding (a GPU machine may have CuPy alone)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return _nvrtc_cupy(source, options, cubin)

    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC call failed: {err}")
        return res[1] if isinstance(res, tuple) and len(res) == 2 else res

    def get(size_fn, fn, prog):
        # a fresh, writable buffer: NVRTC writes into it. (Never `b" " * n`: for n == 1 CPython hands back its
        # cached one-byte object, and NVRTC's write then changes b" " for the whole process.)
        out = bytearray(check(size_fn(prog)))
        check(fn(prog, out))
        return bytes(out)

    prog = check(nvrtc.nvrtcCreateProgram(source.encode(), b"monokernel.cu", 0, [], []))
    try:
        opts = [o.encode() for o in options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = get(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog).decode(errors="replace").rstrip("\x00 ")
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return False, log, "", b""
        binary = get(nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, prog) if cubin else b""
        ptx = get(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, prog).decode(errors="replace").rstrip("\x00")
        return True, log, ptx, binary
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_cupy(source: str, options: list[str], cubin: bool = True) -> tuple[bool, str, str, bytes]:
    """NVRTC through CuPy's binding: PTX only (its getCUBIN drops the image's last byte, which cuobjdump then
    refuses), which is what a build with PTX sections asks of NVRTC."""
    if cubin:
        raise FileNotFoundError("a cubin from NVRTC without a driver needs cuda-bindings, of the cuda extra: "
                                + paths.pip_install("cuda"))
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        raise FileNotFoundError("NVRTC needs cuda-bindings or CuPy, of the cuda extra: "
                                + paths.pip_install("cuda")) from None
    prog = nvrtc.createProgram(source, "monokernel.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError:
            return False, nvrtc.getProgramLog(prog).rstrip("\x00 "), "", b""
        ptx = nvrtc.getPTX(prog)
        ptx = (ptx.decode(errors="replace") if isinstance(ptx, bytes) else ptx).rstrip("\x00")
        return True, nvrtc.getProgramLog(prog).rstrip("\x00 "), ptx, b""
    finally:
        nvrtc.destroyProgram(prog)

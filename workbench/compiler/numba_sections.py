"""Sections with device functions written in Python (NVIDIA): numba-cuda compiles them to PTX, no GPU needed.

A variant whose name starts with `numba` (`--variant gate_up_silu=numba`) is two files side by side:

* `kernels/sections/NAME@VARIANT.cuh`, the stage in C++, as any variant; it calls the Python functions by name;
* `kernels/sections/NAME@VARIANT.py`, the device functions, each declared once with its C signature:

      from workbench.compiler.numba_sections import export

      @export("float(float, float)")
      def wb_silu_mul(g, u):
          return g / (float32(1.0) + math.exp(-g)) * u

Helpers the exported functions call are `@cuda.jit(device=True)` functions of the same file, compiled for the
build's arch. The declarations are read off the file's syntax (no import, no numba) when the source is assembled:
each becomes an `extern "C" __device__` prototype pasted before the stages, so NVRTC checks every call of the C++
against it. At compile time each function goes through `numba.cuda.compile_ptx(device=True, abi="c", cc=<the build's arch>,
lineinfo=True)`, and the type numba infers for its result must be the declared one.

Linking. The whole build splices each function's PTX into the module NVRTC made (in place of the `.extern .func`
the prototype left) and runs ptxas once, as the stages written in PTX do, rather than linking relocatable code with
nvJitLink: a relocatable (-rdc) build of the whole kernel keeps every stage out of line (the kernel's code and
its register count are no longer the whole build's), where the spliced module is the all-C++ module plus the
Python function, which ptxas assembles beside its caller (gate_up_silu's example: the all-C++ build's registers,
no stack). The verification build in units (units.py) adds the
PTX to its nvJitLink link as one more input. Either way the function's line info names the .py file, so ptxas's
messages and the PTX and SASS dumps point at its lines.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import linecache
import re
import threading
import time
import types

from .. import paths
from .ptx import Span

PREFIX = "numba"
INSTALL = "numba and numba-cuda, of the cuda extra"


def is_numba_variant(variant: str | None) -> bool:
    return bool(variant) and variant.startswith(PREFIX)


def export(signature: str):
    """Declares a device function of a numba section with its C signature, `"ret(arg, ...)"` in the C types of
    C_TYPES; the workbench reads the declaration off the file, so this marks the function and leaves it as it is."""
    def mark(fn):
        fn.__wb_signature__ = signature
        return fn
    return mark


# C type → numba type name (numba.types); the C ABI passes these by value, pointers as 64-bit addresses. No bool:
# C++ passes one byte, which numba's boolean is not bound to be. No void: numba's C ABI gives a function that
# returns nothing a 64-bit result all the same, which a `void` prototype would not match (return a value instead).
C_TYPES = {"float": "float32", "double": "float64", "int": "int32", "unsigned": "uint32", "unsigned int": "uint32",
           "long long": "int64", "unsigned long long": "uint64"}


@dataclasses.dataclass(frozen=True)
class Declared:
    name: str
    ret: str                     # C types, as written (spaces normalised)
    args: tuple
    line: int                    # the `def` line in the .py

    def prototype(self) -> str:
        return f'extern "C" __device__ {self.ret} {self.name}({", ".join(self.args)});'


@dataclasses.dataclass(frozen=True)
class NumbaSource:
    section: str                 # the stage, e.g. "gate_up_silu"
    display: str                 # the .py file, repo-relative
    text: str
    functions: tuple             # Declared, in the file's order


class NumbaError(ValueError):
    """A numba section that did not compile; `.messages` are as CompileError's: (file, line, severity, text, src)."""

    def __init__(self, display: str, line: int, text: str, source: str = ""):
        self.messages = [(display, line, "error", text, source)]
        super().__init__(f"{display}:{line}: error: {text}")


def _ctype(text: str, display: str, line: int, src: str) -> str:
    """A C type as the prototype gives it (`const float*`), checked to be one of C_TYPES or a pointer to one."""
    t = " ".join(text.replace("*", " * ").split()).replace(" *", "*")
    if _base(t) not in C_TYPES:
        raise NumbaError(display, line, f"C type {text.strip()!r} is not one a numba section passes (those are: "
                         f"{', '.join(C_TYPES)}, and pointers to them)", src)
    return t


def _base(ctype: str) -> str:
    return " ".join(re.sub(r"\bconst\b", " ", ctype).rstrip("* ").split())


def declarations(section: str, display: str, text: str) -> NumbaSource:
    """The functions a numba section declares (`@export("ret(args)")`), read off its syntax; NumbaError at the
    file's line for a syntax error, a malformed signature, or a file that declares nothing."""
    lines = text.splitlines()
    try:
        tree = ast.parse(text, filename=display)
    except SyntaxError as e:
        n = e.lineno or 1
        raise NumbaError(display, n, f"invalid Python: {e.msg}", lines[n - 1] if 0 < n <= len(lines) else "") from None
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and getattr(dec.func, "id", getattr(dec.func, "attr", "")) == "export"):
                continue
            src = lines[dec.lineno - 1]
            if len(dec.args) != 1 or not isinstance(dec.args[0], ast.Constant) or not isinstance(dec.args[0].value, str):
                raise NumbaError(display, dec.lineno, "export takes one string, the C signature: "
                                 "@export(\"float(float, float)\")", src)
            m = re.fullmatch(r"\s*([\w\s*]+?)\s*\(([^()]*)\)\s*", dec.args[0].value)
            if not m:
                raise NumbaError(display, dec.lineno, f"{dec.args[0].value!r} is not a C signature "
                                 "\"ret(arg, ...)\"", src)
            args = [a for a in m[2].split(",") if a.strip() and a.strip() != "void"]
            ctypes = [_ctype(a, display, dec.lineno, src) for a in args]
            if len(ctypes) != len(node.args.args):
                raise NumbaError(display, dec.lineno, f"{node.name} takes {len(node.args.args)} arguments, its "
                                 f"signature declares {len(ctypes)}", src)
            out.append(Declared(node.name, _ctype(m[1], display, dec.lineno, src), tuple(ctypes), node.lineno))
    if not out:
        raise NumbaError(display, 1, "no device function is declared: mark each one the C++ section calls with "
                         "@export(\"ret(args)\") (from workbench.compiler.numba_sections import export)")
    return NumbaSource(section, display, text, tuple(out))


def _numpy_names_numba_cuda_needs():
    """numba-cuda (0.30.4 and before) overloads np.row_stack when its typing registries load, at the first compile;
    NumPy 2.5 removed that alias of vstack (deprecated since 2.0), so every compile died with an AttributeError
    inside numba. The alias is put back, as vstack, before numba-cuda looks."""
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def numba_problem() -> str | None:
    """Why numba sections cannot be compiled here, or None."""
    _numpy_names_numba_cuda_needs()
    try:
        import numba  # noqa: F401
        from numba import cuda  # noqa: F401
    except ImportError as e:
        return f"a numba section needs {INSTALL} ({e.name or e} is missing): {paths.pip_install('cuda')}"
    return None


def _numba_type(ctype: str):
    from numba import types as nt
    t = getattr(nt, C_TYPES[_base(ctype)])
    for _ in range(ctype.count("*")):
        t = nt.CPointer(t)
    return t


@dataclasses.dataclass(frozen=True)
class Compiled:
    source: NumbaSource
    ptx: dict                    # function name → its PTX module (numba's, whole: .version, .target, the .func)
    seconds: float               # this compile's (0 when it came from the cache)


_CACHE: dict = {}                # (display, text, cc) → {name: ptx}
_LOCK = threading.Lock()


def _where(e: Exception, display: str) -> int:
    """The .py line an exception raised while running or typing the file points at: numba's message names it
    (`File "kernels/...py", line N:`), else the innermost traceback frame in the file."""
    found = re.findall(rf'File "{re.escape(display)}", line (\d+)', str(e))
    if found:
        return int(found[-1])
    if getattr(getattr(e, "loc", None), "filename", None) == display:
        return e.loc.line
    # numba-cuda's type inference wraps only its own TypingError with the statement's location, and a typing
    # template of numba's raises numba's: the location is then a local `loc` of the frame that ran the constraint
    tb, n = e.__traceback__, 0
    while tb is not None:
        loc = tb.tb_frame.f_locals.get("loc")
        if getattr(loc, "filename", None) == display and isinstance(getattr(loc, "line", None), int):
            n = loc.line
        elif tb.tb_frame.f_code.co_filename == display:
            n = tb.tb_lineno
        tb = tb.tb_next
    return n


def _first_words(e: Exception) -> str:
    """numba's message without its source excerpt and its help text: the first lines that say what is wrong."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    keep = []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith(("File ", "During:", "For more information", "<source", "raised from", "There are")):
            break
        keep.append(s)
    said = re.sub(r"^Failed in \w+ mode pipeline \(step: [^)]*\)\s*", "", " ".join(keep))
    return said[:400] or type(e).__name__


def compile_source(src: NumbaSource, arch: str = "sm_90") -> Compiled:
    """Each declared function of `src` → PTX for `arch` (cached by the file's text and the arch); NumbaError at the
    .py line for a Python or typing error, or a result type other than the declared one."""
    if (why := numba_problem()) is not None:
        raise FileNotFoundError(why)
    m = re.fullmatch(r"sm_(\d+)(\d)[af]?", arch)
    if not m:
        raise ValueError(f"a numba section compiles for NVIDIA archs (sm_90, sm_100a, ...), not {arch!r}")
    cc = (int(m[1]), int(m[2]))
    key = (src.display, src.text, cc)
    with _LOCK:
        if key in _CACHE:
            return Compiled(src, _CACHE[key], 0.0)
    t0 = time.perf_counter()
    lines = src.text.splitlines()

    def at(n: int, text: str):
        return NumbaError(src.display, n, text, lines[n - 1] if 0 < n <= len(lines) else "")
    # the file runs under its repo-relative name, which numba's line info and messages then carry; linecache
    # holds its text (an unsaved edit included) so numba finds the source of each function
    linecache.cache[src.display] = (len(src.text), None, [line + "\n" for line in lines], src.display)
    module = types.ModuleType(f"wb_numba_{src.section}")
    module.__file__ = src.display
    try:
        exec(compile(src.text, src.display, "exec"), module.__dict__)
    except Exception as e:
        raise at(_where(e, src.display), f"running the file: {type(e).__name__}: {e}") from None
    out = {}
    with _COMPILING, _for_target(cc):
        _compile_each(src, module, cc, at, out)
    with _LOCK:
        _CACHE[key] = out
    return Compiled(src, out, time.perf_counter() - t0)


_COMPILING = threading.Lock()        # _for_target changes numba for the process while it compiles


@contextlib.contextmanager
def _for_target(cc: tuple):
    """numba-cuda compiles a helper that an exported function calls (a `@cuda.jit(device=True)` function) for the
    current device's compute capability, which asks the driver: on a machine without a GPU that fails, and on one
    with a GPU it is that GPU's, not the build's. Here it is the build's."""
    import numba.cuda.dispatcher as dispatcher
    real = getattr(dispatcher, "get_current_device", None)
    if real is None:                 # a numba-cuda that asks elsewhere: as it is
        yield
        return
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def _compile_each(src: NumbaSource, module, cc: tuple, at, out: dict):
    import warnings
    _numpy_names_numba_cuda_needs()
    from numba import cuda
    from numba.core.errors import NumbaError as NumbaCoreError
    for d in src.functions:
        fn = module.__dict__.get(d.name)
        if not callable(fn):
            raise at(d.line, f"{d.name} is declared but the file does not define it as a function")
        sig = tuple(_numba_type(a) for a in d.args)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # numba's performance and debug-info notes
                ptx, ret = cuda.compile_ptx(fn, sig, device=True, abi="c", cc=cc, lineinfo=True)
        except NumbaCoreError as e:
            raise at(_where(e, src.display) or d.line, f"numba: {_first_words(e)}") from None
        except (ImportError, OSError) as e:     # no libnvvm or libdevice (the cu13 extra: the nvidia-nvvm wheel)
            raise FileNotFoundError(f"numba-cuda cannot compile here: {' '.join(str(e).split())[:200]}: "
                                    f"{paths.pip_install('cuda')}") from None
        except Exception as e:                  # a fault inside numba-cuda itself: the user's code fails as NumbaError
            raise FileNotFoundError(f"numba-cuda {_version('numba-cuda')} failed inside its own code compiling "
                                    f"{d.name} ({type(e).__name__}: {' '.join(str(e).split())[:160]}) with NumPy "
                                    f"{_version('numpy')}: not this section's error; a numba-cuda release that "
                                    f"supports this NumPy, or a NumPy it supports, compiles it") from None
        if ret != _numba_type(d.ret):
            raise at(d.line, f"{d.name} returns {ret} where its declaration says {d.ret} ({_numba_type(d.ret)}): "
                     f"change the declaration or convert the result (e.g. float32(...))")
        out[d.name] = ptx


# ---- the whole build: the functions spliced into the module's PTX -----------------------------------------------

_TOP = re.compile(r"^(?:\.(?:visible|weak|extern)\s+)*\.(?:func|global|const|shared)\b")


def _items(ptx: str) -> list:
    """The top-level definitions of numba's module → [(name, lines)]: its functions (the exported one, and helpers
    numba kept out of line), declarations and globals; not its header (.version, .target, .address_size), its
    .file lines or its debug sections."""
    lines, out, i = ptx.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(".section"):
            break                                     # DWARF sections follow the code
        if not _TOP.match(line):
            i += 1
            continue
        j, depth, opened = i, 0, False
        while j < len(lines):                         # to the `;` of a declaration, or the `}` closing a body
            depth += lines[j].count("{") - lines[j].count("}")
            opened |= "{" in lines[j]
            if (opened and depth == 0) or (not opened and lines[j].rstrip().endswith(";")):
                break
            j += 1
        head = " ".join(lines[i:j + 1])
        m = re.search(r"([A-Za-z_$][\w$]*)\s*(?:\(|\[|;|=)", re.sub(r"\(\s*\.param[^)]*\)", "", head, count=1))
        out.append((m[1] if m else head, lines[i:j + 1]))
        i = j + 1
    return out


def splice(ptx: str, compiled: list) -> tuple[str, list]:
    """The module's PTX with each numba module's definitions in place of the first `.extern .func` NVRTC declared
    for one of its functions → (ptx, spans: ptx.Span per module, each line mapped to the .py line of the `.loc`
    before it). A helper that two exported functions share (each module has its copy) is defined once."""
    lines = ptx.splitlines()
    file_lines = [i for i, l in enumerate(lines) if re.match(r"\s*\.file\s+\d+", l)]
    next_file = max((int(lines[i].split()[1]) for i in file_lines), default=0) + 1
    edits, added, defined = [], [], set()     # (first line, last line, new lines, display); .file lines; names
    for c in compiled:
        index = next_file
        if file_lines:
            added.append(f'\t.file\t{index} "{c.source.display}"')
            next_file += 1
        for name, module in c.ptx.items():
            start = next((i for i, l in enumerate(lines) if re.match(rf"^\.extern\s+\.func\b.*\b{re.escape(name)}\b",
                                                                      l)), None)
            if start is None:
                continue            # declared, never called: NVRTC declares nothing, and nothing is spliced
            end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(";"))
            body = []
            for item, text in _items(module):
                is_declaration = text[0].startswith(".extern")
                if item in defined or (is_declaration and re.search(rf"\b{re.escape(item)}\b", ptx[:ptx.find(
                        ".entry")] if ".entry" in ptx else ptx) and item != name):
                    continue        # defined already, or declared by the module already (vprintf, say)
                defined.add(item)
                body += [*text, ""]
            # numba's module has one file, 1: its .loc lines name the index the module gives it (or go, where the
            # module has no line info)
            body = [re.sub(r"^(\s*\.loc\s+)1\b", rf"\g<1>{index}", l) if file_lines else l for l in body
                    if file_lines or not l.strip().startswith(".loc")]
            edits.append((start, end, body, c.source.display))
    at = file_lines[-1] + 1 if file_lines else len(lines)
    marks = sorted(edits + ([(at, at - 1, added, None)] if added else []), key=lambda e: e[0])
    out, spans, cursor = [], [], 0
    for start, end, new, display in marks:
        out += lines[cursor:start]
        if display is not None:
            source, line = [], 0
            for l in new:
                if (m := re.match(r"^\s*\.loc\s+\d+\s+(\d+)", l)):
                    line = int(m[1])
                source.append(line)
            spans.append(Span(len(out) + 1, tuple(source), display))
        out += new
        cursor = end + 1
    out += lines[cursor:]
    return "\n".join(out) + "\n", spans

"""Sections written in PTX (NVIDIA): a variant of a stage whose function body is hand-written PTX.

A variant whose name starts with `ptx` (`kernels/sections/NAME@ptx.ptx`, `NAME@ptx_fast.ptx`, ...) holds the body of
`stage_NAME`: what goes between the braces of its `.func` — register declarations, instructions, `ret;`. The
C++ section stays the declaration: it is compiled (its helpers stay, its errors show) with its stage renamed away,
and a stub of the same declaration takes the stage's place (ptx_stub), so the call, the argument passing and every
other section are the compiler's. In the PTX NVRTC makes of the module, the stub's body is replaced by the file's
before ptxas turns the module into machine code.

Inside the body:
* `[name]` is the stage's parameter `name`, as the C++ declaration names it (`ld.param.u64 %rd1, [embed];`);
* the build's constants are there by their C++ names: the config's shapes and the build's switches (`WB_D`,
  `WB_THREADS`, ..., see assemble.defines), the plan header's integer constants (a stage's shared-memory regions,
  `WB_SMEM_<STAGE>_<REGION>` in floats), WB_STAGE_THREADS, the threads that run a stage (the block's, less the
  streaming warp of a stream build), and WB_WARP; ptxas takes constant expressions (`WB_HEADS*WB_HEAD_DIM*2`);
* `//` comments are taken out before ptxas sees the body (ptxas takes only ASCII).

An assembler message about a line of the body is reported at that line of the .ptx file.
"""
from __future__ import annotations

import dataclasses
import os
import re

from ..plan import NV_WARP

PREFIX = "ptx"


def is_ptx_variant(variant: str | None) -> bool:
    return bool(variant) and variant.startswith(PREFIX)


@dataclasses.dataclass(frozen=True)
class PtxBody:
    section: str                 # the stage, e.g. "embedding"
    display: str                 # the .ptx file, repo-relative
    text: str                    # the body as written (an unsaved edit included)
    params: tuple                # the C++ parameter names of stage_<section>, in order
    constants: tuple             # ((NAME, value), ...) the body may use by name


def cpp_params(source: str, function: str) -> tuple[str, ...]:
    """The parameter names of `function`'s definition in C++ `source`, in order."""
    m = re.search(rf"\b{re.escape(function)}\s*\(([^)]*)\)\s*\{{", source)
    if not m:
        raise ValueError(f"no definition of {function}(...) {{ in its C++ section: a PTX body replaces the body of "
                         "that function, so the C++ section must define it")
    idents = [re.findall(r"[A-Za-z_]\w*", p.split("=")[0]) for p in m[1].split(",")]
    return tuple(ident[-1] for ident in idents if ident)


def stage_signature(source: str, section: str, why: str) -> tuple[str, str]:
    """(return type, parameter list) of `WB_SECTION ... stage_<section>(...) {` in a C++ section; ValueError
    naming `why` (what needs the definition) when the section does not define it so."""
    fn = f"stage_{section}"
    m = re.search(rf"WB_SECTION\s+(?P<ret>[^;{{}}()]*?)\s*\b{re.escape(fn)}\s*\((?P<params>[^)]*)\)\s*\{{", source)
    if not m:
        raise ValueError(f"no `WB_SECTION ... {fn}(...) {{` in its C++ section: {why}")
    return m["ret"].strip(), " ".join(m["params"].split())


def ptx_stub(source: str, section: str) -> str:
    """What NVRTC compiles for a stage written in PTX: `stage_<section>_ptx`, out of line, with the declaration's
    parameters and a body that uses each (an empty asm), which the .ptx body replaces; and `stage_<section>` itself,
    inlined into the decode step, passing its arguments through an opaque move. The compiler would otherwise drop
    a parameter the body leaves unused, or one every call passes the same value for (the shared-memory pointer)."""
    fn = f"stage_{section}"
    ret, params = stage_signature(source, section, "a PTX body replaces that function's")
    names = cpp_params(source, fn)
    back = "" if ret == "void" else "return "
    return "\n".join([
        f"#undef {fn}",
        f"WB_SECTION {ret} {fn}_ptx({params}) {{",
        *(f"    wb_keep({n});" for n in names),
        *([] if ret == "void" else ["    return {};"]),
        "}",
        f"__device__ __forceinline__ {ret} {fn}({params}) {{",
        f"    {back}{fn}_ptx({', '.join(f'wb_opaque({n})' for n in names)});",
        "}", ""])


def header_constants(header: str) -> dict:
    """The integer constants the generated plan header declares (`constexpr int A = 1, B = 2;`): shared-memory
    offsets and sizes (WB_SMEM_*), tap offsets, ... by name, for a PTX body to use as the C++ sections do."""
    out = {}
    for decl in re.findall(r"constexpr\s+(?:unsigned\s+)?(?:int|long long|u32|u64)\s+([^;]+);", header):
        for item in decl.split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(-?\d+)[uUlL]*\s*", item)
            if m:                              # a whole initializer that is one integer (a suffix dropped)
                out[m[1]] = m[2]
    return out


def constants(defines: dict, stage_threads: int) -> tuple:
    """What a body may write by name: every #define of the build and the plan header's integer constants,
    WB_STAGE_THREADS (plan.Launch's) and WB_WARP (the lanes of a warp, as the C++ sections name them)."""
    return (*defines.items(), ("WB_STAGE_THREADS", str(stage_threads)), ("WB_WARP", str(NV_WARP)))


@dataclasses.dataclass(frozen=True)
class Span:
    """Lines first, first + 1, ... of the spliced module (1-based) came from lines `source[i]` of `display` (0: a
    line the splice added, the `.loc` that attributes the next instruction to its line)."""
    first: int
    source: tuple
    display: str

    def line_of(self, n: int) -> int | None:
        """The file's line for module line n. An added `.loc` counts as the line before it: ptxas reports a
        statement left without its `;` where the next line, the `.loc`, runs into it."""
        k = n - self.first
        if not 0 <= k < len(self.source):
            return None
        back = [x for x in self.source[:k + 1] if x]
        return back[-1] if back else next((x for x in self.source[k:] if x), None)


_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?[a-z]")       # not a directive, a label, a brace or blank
_FLOAT = re.compile(r"^[0-9.]+(?:e[+-]?[0-9]+)?f$", re.I)     # 1e-05f: a C++ float literal, written without its f


def _find_function(lines: list[str], fn: str) -> int | None:
    """The line that opens the definition of C++ function `fn` (mangled _Z<len><name>...), not a declaration."""
    pat = re.compile(rf"^(?:\.weak\s+|\.visible\s+)*\.func\s+(?:\([^)]*\)\s*)?_Z{len(fn)}{re.escape(fn)}\w*\s*\(")
    for i, line in enumerate(lines):
        if pat.match(line):
            for j in range(i, len(lines)):
                if lines[j].strip() == "{":
                    return i
                if lines[j].rstrip().endswith(";"):          # a prototype: `.func ... (...);`
                    break
    return None


def _expand(body: PtxBody, params_in_ptx: list[str], file_index: int | None) -> tuple[list[str], tuple]:
    """The body's lines as the module gets them, each instruction after a `.loc` naming its line of the file (so
    that line info, and the SASS listing, point at the .ptx; none when the module has no line info), and the
    file's line of each."""
    if len(params_in_ptx) != len(body.params):
        raise ValueError(f"{body.display}: stage_{body.section} has {len(body.params)} parameters in C++ and "
                         f"{len(params_in_ptx)} in the PTX NVRTC made of it")
    names = dict(zip(body.params, params_in_ptx))
    values = {k: v[:-1] if _FLOAT.match(v) else v for k, v in body.constants}
    out, source = [], []
    for k, line in enumerate(body.text.splitlines(), 1):
        # comments go (ptxas takes only ASCII, and a comment may say "→")
        code = line.partition("//")[0].rstrip()
        code = re.sub(r"\[\s*([A-Za-z_]\w*)\s*\]", lambda m: f"[{names.get(m[1], m[1])}]", code)
        code = re.sub(r"(?<![$%\w])WB_[A-Z0-9_]+\b", lambda m: values.get(m[0], m[0]),
                      code)                        # a constant, not a label ($...) or a register (%...)
        if file_index is not None and _INSTRUCTION.match(code):
            out.append(f"\t.loc\t{file_index} {k} 0")
            source.append(0)
        out.append(code)
        source.append(k)
    return out, tuple(source)


def splice(ptx: str, bodies) -> tuple[str, list[Span]]:
    """The module's PTX with each body in place of its function's, and where each body's lines now are."""
    lines = ptx.splitlines()
    file_lines = [i for i, l in enumerate(lines) if re.match(r"\s*\.file\s+\d+", l)]
    next_file = max((int(lines[i].split()[1]) for i in file_lines), default=0) + 1
    edits = []                                     # (open brace, close brace, new lines, source, display)
    added = []                                     # the .file directives of the bodies
    for body in bodies:
        fn = f"stage_{body.section}_ptx"              # ptx_stub's
        start = _find_function(lines, fn)
        if start is None:
            raise ValueError(f"{body.display}: no .func for {fn} in the module's PTX (is the C++ section's function "
                             "out of line, WB_SECTION?)")
        mangled = re.search(r"(_Z\d+\w+)\s*\(", lines[start])[1]
        open_brace = next(i for i in range(start, len(lines)) if lines[i].strip() == "{")
        params = re.findall(rf"\.param\s+\S+\s+({re.escape(mangled)}_param_\d+)", "\n".join(lines[start:open_brace]))
        close = next(i for i in range(open_brace + 1, len(lines)) if lines[i] == "}")
        new, source = _expand(body, params, next_file if file_lines else None)
        edits.append((open_brace, close, new, source, body.display))
        if file_lines:
            added.append(f'\t.file\t{next_file} "{os.path.abspath(body.display)}"')
            next_file += 1
    # the new .file lines go after the module's own; then the bodies, top to bottom, counting where each lands
    at = file_lines[-1] + 1 if file_lines else len(lines)
    marks = sorted(edits + [(at - 1, at, added, None, None)] if added else edits, key=lambda e: e[0])
    out, spans, cursor = [], [], 0
    for open_brace, close, new, source, display in marks:
        out += lines[cursor:open_brace + 1]
        if display is not None:
            spans.append(Span(len(out) + 1, source, display))
            out += new
            cursor = close
        else:                                       # the .file insertion point: nothing replaced
            out += new
            cursor = open_brace + 1
    out += lines[cursor:]
    return "\n".join(out) + "\n", spans


_PTXAS = (re.compile(r"line (?P<line>\d+); (?P<sev>error|warning|fatal)\s*: (?P<text>.*)$"),
          re.compile(r"(?P<sev>fatal)\s*: (?P<text>.*) on line (?P<line>\d+)"))


def ptxas_messages(log: str, spans: list[Span], bodies) -> list:
    """ptxas's messages as (file, line, severity, text, source line): inside a body, at the .ptx file's line;
    elsewhere (a body that broke what follows it, say) at the module's PTX line."""
    texts = {b.display: b.text.splitlines() for b in bodies}
    out = []
    for raw in log.splitlines():
        m = _PTXAS[0].search(raw) or _PTXAS[1].search(raw)
        if not m:
            continue
        n, sev = int(m["line"]), "warning" if m["sev"] == "warning" else "error"
        span = next((s for s in spans if s.line_of(n)), None)
        if span is None:
            out.append(("<spliced module PTX>", n, sev, m["text"].strip(), ""))
            continue
        k = span.line_of(n)
        out.append((span.display, k, sev, m["text"].strip(), texts[span.display][k - 1]))
    return out

"""Sections written in PTX (NVIDIA): a variant of a stage whose function body is hand-written PTX.

A variant whose name starts with `ptx` (`kernels/sections/NAME@ptx.ptx`, `NAME@ptx_fast.ptx`, ...) holds the body of
`stage_NAME`: what goes between the braces of its `.func` — register declarations, instructions, `ret;`. The
C++ section stays the declaration: it is compiled as usual (so the call, the argument passing and every other
section are the compiler's), and in the PTX NVRTC makes of the module, that one function's body is replaced by the
file's before ptxas turns the module into machine code.

Inside the body:
* `[name]` is the stage's parameter `name`, as the C++ declaration names it (`ld.param.u64 %rd1, [embed];`);
* the build's constants are there by their C++ names: the config's shapes and the build's switches (`WB_D`,
  `WB_THREADS`, ..., see assemble.defines), and WB_STAGE_THREADS, the threads that run a stage (the block's,
  less the streaming warp of a stream build);
* `//` comments are taken out before ptxas sees the body (ptxas takes only ASCII).

An assembler message about a line of the body is reported at that line of the .ptx file.
"""
from __future__ import annotations

import dataclasses
import os
import re

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
    names = []
    for p in m[1].split(","):
        ident = re.findall(r"[A-Za-z_]\w*", p.split("=")[0])
        if ident:
            names.append(ident[-1])
    return tuple(names)


def constants(defines: dict, threads: int, stream: bool) -> tuple:
    """What a body may write by name: every #define of the build, and WB_STAGE_THREADS."""
    return (*((k, v) for k, v in defines.items()), ("WB_STAGE_THREADS", str(threads - 32 if stream else threads)))


@dataclasses.dataclass(frozen=True)
class Span:
    """Lines first, first + 1, ... of the spliced module (1-based) came from lines `source[i]` of `display` (0: a
    line the splice added, the `.loc` that attributes the next instruction to its line)."""
    first: int
    source: tuple
    display: str

    def line_of(self, n: int) -> int | None:
        k = n - self.first
        return self.source[k] if 0 <= k < len(self.source) and self.source[k] else None


_FUNC = r"^(?:\.weak\s+|\.visible\s+)*\.func\s+(?:\([^)]*\)\s*)?(?P<name>_Z\d+{fn}\w*)\s*\("
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?[a-z]")       # not a directive, a label, a brace or blank


def _expand(body: PtxBody, params_in_ptx: list[str], file_index: int) -> tuple[list[str], tuple]:
    """The body's lines as the module gets them, each instruction after a `.loc` naming its line of the file (so
    that line info, and the SASS listing, point at the .ptx), and the file's line of each."""
    if len(params_in_ptx) != len(body.params):
        raise ValueError(f"{body.display}: stage_{body.section} has {len(body.params)} parameters in C++ and "
                         f"{len(params_in_ptx)} in the PTX NVRTC made of it")
    names = dict(zip(body.params, params_in_ptx))
    values = dict(body.constants)
    out, source = [], []
    for k, line in enumerate(body.text.splitlines(), 1):
        # comments go (ptxas takes only ASCII, and a comment may say "→")
        code = line.partition("//")[0].rstrip()
        code = re.sub(r"\[\s*([A-Za-z_]\w*)\s*\]", lambda m: f"[{names.get(m[1], m[1])}]", code)
        code = re.sub(r"(?<![$%\w])WB_[A-Z0-9_]+\b", lambda m: values[m[0]].rstrip("f") if m[0] in values else m[0],
                      code)                        # a constant, not a label ($...) or a register (%...)
        if _INSTRUCTION.match(code):
            out.append(f"\t.loc\t{file_index} {k} 0")
            source.append(0)
        out.append(code)
        source.append(k)
    return out, tuple(source)


def splice(ptx: str, bodies) -> tuple[str, list[Span]]:
    """The module's PTX with each body in place of its function's, and where each body's lines now are."""
    lines = ptx.splitlines()
    files = [int(m[1]) for m in (re.match(r"\s*\.file\s+(\d+)", l) for l in lines) if m]
    next_file = max(files, default=0) + 1
    added = []
    spans = []
    for body in bodies:
        fn = f"stage_{body.section}"
        pat = re.compile(_FUNC.format(fn=re.escape(fn)))
        start = next((i for i, l in enumerate(lines) if pat.match(l)), None)
        if start is None:
            raise ValueError(f"{body.display}: no .func for {fn} in the module's PTX (is the C++ section's function "
                             "out of line, WB_SECTION?)")
        mangled = pat.match(lines[start])["name"]
        open_brace = next(i for i in range(start, len(lines)) if lines[i].strip() == "{")
        params = re.findall(rf"\.param\s+\S+\s+({re.escape(mangled)}_param_\d+)", "\n".join(lines[start:open_brace]))
        close = next(i for i in range(open_brace + 1, len(lines)) if lines[i] == "}")
        new, source = _expand(body, params, next_file)
        lines[open_brace + 1:close] = new
        shift = len(new) - (close - open_brace - 1)
        spans = [s if s.first <= open_brace + 1 else Span(s.first + shift, s.source, s.display) for s in spans]
        spans.append(Span(open_brace + 2, source, body.display))
        added.append(f'\t.file\t{next_file} "{os.path.abspath(body.display)}"')
        next_file += 1
    if added:
        last_file = max((i for i, l in enumerate(lines) if re.match(r"\s*\.file\s+\d+", l)), default=None)
        if last_file is None:                  # no line info in the module: no .loc either
            lines = [l for l in lines if not re.match(r"\s*\.loc\s", l)]
        else:
            lines[last_file + 1:last_file + 1] = added
    return "\n".join(lines) + "\n", spans


_PTXAS = (re.compile(r"line (?P<line>\d+); (?P<sev>error|warning)\s*: (?P<text>.*)$"),
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

"""The package's layers and the imports between them, function-local imports counted: a table of layer → layer
edges (how many import statements each), every cycle between layers, every import that goes up the layers, and the
function-local imports of the package's own modules. A layer is a subpackage (workbench/check/, ...) or a top-level
module (plan.py, ...). tests/test_layers.py holds the package to the same analysis.

    python scripts/import_graph.py            # the table, the cycles, the upward imports; exit 1 on either
    python scripts/import_graph.py --local    # also every function-local import of the package's own modules
    python scripts/import_graph.py --dot F    # also a Graphviz drawing of the layers
"""
from __future__ import annotations

import argparse
import ast
import functools
import io
import re
import sys
import textwrap
import tokenize
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

PKG = Path(__file__).resolve().parent.parent / "workbench"

# The layers, bottom to top: a layer imports only the layers below it (and those of its own rung). `tp` (how N GPUs
# split a layer, over the reference's math) sits above the reference and below everything that runs a kernel;
# `__main__` and the package's own __init__ (`workbench`: %load_ext) are the entry points, on top. `nbclean` (the
# notebooks saved without outputs) serves the notebooks' front end, beside the ui.
LAYERS = (("errors", "paths"), ("model",), ("plan",), ("schedule", "abi", "worklists"), ("reference",), ("tp",), ("compiler",),
          ("run",), ("check",), ("measure",), ("loop",), ("ui", "nbclean"), ("cli",), ("__main__", "workbench"))
RANK = {layer: i for i, rung in enumerate(LAYERS) for layer in rung}


class Import(NamedTuple):
    target: str                # the module imported (workbench.x.y), or the package a name is taken from
    line: int                  # the statement's first and last lines
    end: int
    local: bool                # inside a function: run when the function is, not when the module is imported


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PKG.parent / rel.with_suffix(".py")).is_file() or (PKG.parent / rel / "__init__.py").is_file()


def imports(path: Path) -> tuple[Import, ...]:
    """An Import for every import of the package's own modules in one file."""
    return _imports(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _imports(path: Path, _mtime) -> tuple[Import, ...]:
    return tuple(_read_imports(path))


def _read_imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    local.add(id(inner))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("workbench"):
                continue
            # `from . import x` and `from .m import x` name module x where there is one, else an attribute of m
            for n in dict.fromkeys(target + "." + a.name if _is_module(target + "." + a.name) else target
                                   for a in node.names):
                yield Import(n, node.lineno, node.end_lineno, id(node) in local)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("workbench"):
                    yield Import(a.name, node.lineno, node.end_lineno, id(node) in local)


def third_party(path: Path) -> frozenset[str]:
    """The top-level names of what one file imports at import time (not in a function) from outside the package and
    the standard library."""
    return _third_party(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _third_party(path: Path, _mtime) -> frozenset[str]:
    tree = ast.parse(path.read_text(), str(path))
    local = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             for inner in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in local:
            continue
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return frozenset(n for n in out if n not in sys.stdlib_module_names and n not in ("__future__", "workbench"))


@functools.lru_cache(maxsize=1)
def required() -> frozenset[str]:
    """The package's own dependencies (pyproject.toml's [project] dependencies), by import name: always there."""
    text = (PKG.parent / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)[1]
    return frozenset(re.split(r"[<>=!~\[; ]", d.strip().strip("\"'"))[0].replace("-", "_")
                     for d in re.findall(r"[\"'][^\"']+[\"']", deps))


def module_path(module: str) -> Path:
    rel = Path(*module.split("."))
    f = PKG.parent / rel.with_suffix(".py")
    return f if f.is_file() else PKG.parent / rel / "__init__.py"


def deferred(module: str, _seen=None) -> set[str]:
    """The optional dependencies (neither the standard library nor the package's own dependencies) that importing
    `module` imports: its own and, through its module-level imports, every package module's it loads."""
    seen = set() if _seen is None else _seen
    if module in seen or not module_path(module).is_file():
        return set()
    seen.add(module)
    path = module_path(module)
    out = set(third_party(path) - required())
    parts = module.split(".")
    for i in range(2, len(parts)):                    # importing a.b.c runs a.b's __init__ first
        out |= deferred(".".join(parts[:i]), seen)
    for imp in imports(path):
        if not imp.local:
            out |= deferred(imp.target, seen)
    return out


def upward(edges) -> list:
    """(from layer, to layer, file, line, local) of every import that goes up the layers, or to a layer LAYERS
    does not place."""
    return [(a, b, f, line, loc) for (a, b), sites in sorted(edges.items()) for f, line, loc in sites
            if a not in RANK or b not in RANK or RANK[b] > RANK[a]]


def module_graph():
    """Every package module and its imports of the package's own modules, function-local ones included:
    ({module}, {(from module, to module): [(file, line, local)]})."""
    modules, edges = set(), defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        src = module_name(path)
        modules.add(src)
        for imp in imports(path):
            if imp.target != src and imp.target != "workbench":
                edges[(src, imp.target)].append((path.relative_to(PKG.parent), imp.line, imp.local))
    return modules, edges


def comment(path: Path, line: int, end: int) -> str:
    """The comments on lines line..end of a file (one statement's), joined."""
    src = textwrap.dedent("\n".join(path.read_text().splitlines()[line - 1:end])) + "\n"
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    return " ".join(tok.string.lstrip("#").strip() for tok in tokens if tok.type == tokenize.COMMENT)


def local_import_problems() -> list[str]:
    """Every function-local import of a package module that has no reason to be one: a module that imports no
    optional dependency at import time belongs at the top; one that does must say which, in a comment on the
    import (`# cupy: ...`)."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent)
        for imp in sorted(imports(path), key=lambda imp: imp.line):
            if not imp.local:
                continue
            heavy = deferred(imp.target)
            text = " ".join(path.read_text().splitlines()[imp.line - 1].split())
            if not heavy:
                out.append(f"{rel}:{imp.line}: `{text}` inside a function, but {imp.target} imports no optional "
                           f"dependency: import it at the top of the module")
                continue
            said = comment(path, imp.line, imp.end).lower()
            names = {n for d in heavy for n in (d, d.split("_")[0])}
            if not any(re.search(rf"\b{re.escape(n.lower())}\b", said) for n in names):
                out.append(f"{rel}:{imp.line}: `{text}` inside a function defers {', '.join(sorted(heavy))}: say so "
                           f"in a comment on the import (`# {sorted(heavy)[0]}: ...`)")
    return out


def graph():
    edges = defaultdict(list)               # (from layer, to layer) -> [(file, line, local)]
    layers = set()
    for path in sorted(PKG.rglob("*.py")):
        src = layer_of(module_name(path))
        layers.add(src)
        for target, line, _, local in imports(path):
            dst = layer_of(target)
            if dst in ("__init__", "workbench") or dst == src:
                continue
            edges[(src, dst)].append((path.relative_to(PKG.parent), line, local))
    return layers, edges


def cycles(layers, edges):
    """The strongly connected components with more than one layer (Tarjan)."""
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(layers):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dot", help="write a Graphviz drawing of the layers here")
    ap.add_argument("--local", action="store_true", help="list the function-local imports of the package")
    a = ap.parse_args()
    layers, edges = graph()
    print(f"{len(layers)} layers, {len(edges)} edges between them "
          f"({sum(len(v) for v in edges.values())} import statements, "
          f"{sum(1 for v in edges.values() for _, _, loc in v if loc)} of them function-local)")
    for (a_, b), sites in sorted(edges.items()):
        n_local = sum(1 for *_, loc in sites if loc)
        print(f"  {a_:>9} → {b:<9} {len(sites):3d}" + (f"  ({n_local} function-local)" if n_local else ""))
    found = cycles(layers, edges)
    for comp in found:
        print("cycle between layers: " + ", ".join(comp))
        inside = set(comp)
        for (a_, b), sites in sorted(edges.items()):
            if a_ in inside and b in inside:
                for f, line, loc in sites:
                    print(f"    {a_} → {b}: {f}:{line}" + (" (function-local)" if loc else ""))
    up = upward(edges)
    for a_, b, f, line, loc in up:
        where = "a layer LAYERS does not place" if a_ not in RANK or b not in RANK else "upward"
        print(f"{where}: {a_} → {b}: {f}:{line}" + (" (function-local)" if loc else ""))
    if a.local:
        for (a_, b), sites in sorted(edges.items()):
            for f, line, loc in sites:
                if loc:
                    print(f"  local: {f}:{line} ({a_} → {b})")
        for problem in local_import_problems():
            print(f"  {problem}")
    if a.dot:
        lines = ["digraph layers {", "  rankdir=BT;"]
        lines += [f'  "{a_}" -> "{b}" [label="{len(s)}"];' for (a_, b), s in sorted(edges.items())]
        Path(a.dot).write_text("\n".join(lines + ["}"]) + "\n")
    print(f"{len(found)} cycles between layers, {len(up)} upward imports")
    return 1 if found or up else 0


if __name__ == "__main__":
    sys.exit(main())

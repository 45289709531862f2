"""The package's layers and the imports between them, function-local imports counted: a table of layer → layer
edges (how many import statements each), every cycle between layers, and the function-local imports of the
package's own modules. A layer is a subpackage (workbench/check/, ...) or a top-level module (plan.py, ...).

    python scripts/import_graph.py            # the table, the cycles; exit 1 when there is a cycle
    python scripts/import_graph.py --dot F    # also a Graphviz drawing of the layers
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "workbench"


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path):
    """(target module, line, function-local) of every import of the package's own modules in one file."""
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
            names = [target + "." + a.name for a in node.names]
            # `from . import x` names a module; `from .m import f` names m
            for n in (names if not node.module else [target]):
                yield n, node.lineno, id(node) in local
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("workbench"):
                    yield a.name, node.lineno, id(node) in local


def graph():
    edges = defaultdict(list)               # (from layer, to layer) -> [(file, line, local)]
    layers = set()
    for path in sorted(PKG.rglob("*.py")):
        src = layer_of(module_name(path))
        layers.add(src)
        for target, line, local in imports(path):
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
        print(f"  {a_:>8} → {b:<8} {len(sites):3d}" + (f"  ({n_local} function-local)" if n_local else ""))
    found = cycles(layers, edges)
    for comp in found:
        print("cycle between layers: " + ", ".join(comp))
        inside = set(comp)
        for (a_, b), sites in sorted(edges.items()):
            if a_ in inside and b in inside:
                for f, line, loc in sites:
                    print(f"    {a_} → {b}: {f}:{line}" + (" (function-local)" if loc else ""))
    if a.local:
        for (a_, b), sites in sorted(edges.items()):
            for f, line, loc in sites:
                if loc:
                    print(f"  local: {f}:{line} ({a_} → {b})")
    if a.dot:
        lines = ["digraph layers {", "  rankdir=BT;"]
        lines += [f'  "{a_}" -> "{b}" [label="{len(s)}"];' for (a_, b), s in sorted(edges.items())]
        Path(a.dot).write_text("\n".join(lines + ["}"]) + "\n")
    print(f"{len(found)} cycles between layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

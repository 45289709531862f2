"""The package's layers (scripts/import_graph.py has the order, bottom to top): no cycle between them, every import
going down, the plan a leaf above the model, and a function-local import of a package module only where it defers an
optional dependency, saying which. Each failure names the file and line of the import at fault."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("import_graph",
                                               Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py")
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)


def _sites(edges, pairs) -> str:
    return "\n".join(f"  {f}:{line}: {a} → {b}" + (" (function-local)" if loc else "")
                     for (a, b), sites in sorted(edges.items()) if (a, b) in pairs for f, line, loc in sites)


def test_no_cycle_between_layers():
    layers, edges = G.graph()
    found = G.cycles(layers, edges)
    inside = {(a, b) for comp in found for a in comp for b in comp}
    assert not found, "cycles between layers: " + "; ".join(", ".join(c) for c in found) + "\n" + _sites(edges, inside)


def test_no_cycle_between_modules():
    modules, edges = G.module_graph()
    found = G.cycles(modules, edges)
    inside = {(a, b) for comp in found for a in comp for b in comp}
    assert not found, "cycles between modules: " + "; ".join(", ".join(c) for c in found) + "\n" + _sites(edges, inside)


def test_every_layer_has_its_place():
    layers, _ = G.graph()
    unplaced = sorted(layers - set(G.RANK))
    assert not unplaced, f"layers that scripts/import_graph.py's LAYERS does not place: {unplaced}"


def test_every_import_goes_down_the_layers():
    _, edges = G.graph()
    up = G.upward(edges)
    assert not up, "imports up the layers (" + " < ".join("/".join(r) for r in G.LAYERS) + "):\n" + "\n".join(
        f"  {f}:{line}: {a} → {b}" + (" (function-local)" if loc else "") for a, b, f, line, loc in up)


def test_the_plan_imports_only_the_model_and_errors():
    _, edges = G.graph()
    other = {(a, b) for a, b in edges if a == "plan" and b not in ("model", "errors")}
    assert not other, "the plan imports beyond model/ and errors:\n" + _sites(edges, other)


def test_function_local_imports_name_the_dependency_they_defer():
    problems = G.local_import_problems()
    if problems:
        pytest.fail("function-local imports of the package's own modules:\n" + "\n".join(f"  {p}" for p in problems),
                    pytrace=False)


def test_the_analysis_sees_what_it_checks(tmp_path):
    """The checks above are only as good as their reading of an import: relative and absolute, `from . import m`,
    a statement over several lines and its comment, and what a module defers through the modules it imports."""
    layers, edges = G.graph()
    assert {"errors", "model", "plan", "reference", "compiler", "run", "check", "loop", "cli"} <= layers
    assert ("cli", "check") in edges and ("loop", "run") in edges
    modules, medges = G.module_graph()
    assert ("workbench.loop.magic", "workbench.loop.session") in medges        # `from . import sections, session`
    assert ("workbench.cli", "workbench.compiler.compile") in medges           # `from .compiler import compile as C`
    assert G.deferred("workbench.loop.magic") == {"IPython"}
    assert not G.deferred("workbench.plan") and "numpy" not in G.deferred("workbench.reference")
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from .a import (b,  # cupy: only on a GPU\n                   c)\n")
    assert G.comment(f, 2, 3) == "cupy: only on a GPU"

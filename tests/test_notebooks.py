"""Every notebook in notebooks/ runs top to bottom, headless (nbclient + ipykernel), and is kept without outputs.

Without a GPU the notebooks replay the recorded H200 traces and run the CPU reference; with one they run the kernel.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "editing.ipynb", "timing.ipynb", "variants.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_are_cleared_in_git(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
                f"{path.name} cell {i} keeps outputs: clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "agg")
    env["IPYTHONDIR"] = str(tmp_path / "ipython")          # no user startup files, nothing written to ~
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    sections = ROOT / "kernels" / "sections"
    before = set(sections.glob("*@*.cuh"))
    try:
        client.execute(env=env)                            # in notebooks/, as JupyterLab runs it
    finally:
        # a notebook that edits sections works on variants it removes again; whatever it left is removed here
        left = [p for p in set(sections.glob("*@notebook*.cuh")) - before]
        for p in left:
            p.unlink(missing_ok=True)
    assert not left, f"{path.name} left section variants behind: {[p.name for p in left]}"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[0]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "every code cell ran"

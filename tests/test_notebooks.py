"""Every notebook in notebooks/ runs top to bottom, headless (nbclient + ipykernel), and is kept without outputs: the
tests run them in memory and never write them; JupyterLab saves them clean through jupyter_config/'s pre-save hook;
a clone may also set up git's clean filter (workbench/nbclean.py).

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
    assert {"quickstart.ipynb", "editing.ipynb", "timing.ipynb", "variants.ipynb", "assembly.ipynb",
            "python_sections.ipynb"} <= names


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
    committed = path.read_text(encoding="utf-8")
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "agg")
    env["IPYTHONDIR"] = str(tmp_path / "ipython")          # no user startup files, nothing written to ~
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    sections = ROOT / "kernels" / "sections"
    before = set(sections.glob("*@*"))
    try:
        client.execute(env=env)                            # in notebooks/, as JupyterLab runs it
    finally:
        # a notebook that edits sections works on variants it removes again (notebook_demo, or numba_notebook: a
        # numba variant's name starts with numba), .cuh and .py; whatever it left is removed here
        left = [p for p in set(sections.glob("*@*notebook*")) - before]
        for p in left:
            p.unlink(missing_ok=True)
    assert not left, f"{path.name} left section variants behind: {[p.name for p in left]}"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[0]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "every code cell ran"
    # the run happened in memory: the file is untouched, and the run saved clean would be the file again
    from workbench import nbclean
    assert path.read_text(encoding="utf-8") == committed, f"running {path.name} changed the file"
    assert nbclean.clean_text(nbformat.writes(nb)) == committed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_are_in_the_layout_a_clean_save_writes(path):
    """Clean and in nbformat's layout with every cell's id (JupyterLab adds a missing one): a notebook run and
    saved clean is byte for byte the committed file, so running it leaves nothing for git."""
    from workbench import nbclean
    text = path.read_text(encoding="utf-8")
    assert nbclean.clean_text(text) == text, f"{path.name}: run `python -m workbench.nbclean {path.name}`"
    assert all(c.get("id") for c in json.loads(text)["cells"]), f"{path.name}: a cell without an id"
    nbformat = pytest.importorskip("nbformat")
    assert nbformat.writes(nbformat.reads(text, as_version=4)) + "\n" == text


def _ran(path) -> dict:
    """The notebook as a run leaves it: outputs, counts, timings, widget state, the kernel's language version."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
            cell["execution_count"] = i + 1
            cell["metadata"]["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
        cell["metadata"]["scrolled"] = True
    nb["metadata"]["language_info"] = {"name": "python", "version": "3.11.9", "mimetype": "text/x-python"}
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_run_cleaned_is_the_committed_file(path):
    from workbench import nbclean
    nb = _ran(path)
    assert nbclean.dumps(nb) != path.read_text(encoding="utf-8")
    assert nbclean.dumps(nbclean.clean(nb)) == path.read_text(encoding="utf-8")


def test_jupyter_saves_the_repositorys_notebooks_clean(tmp_path, monkeypatch):
    """The pre-save hook in jupyter_config/ (JUPYTER_CONFIG_PATH=jupyter_config jupyter lab): a notebook of
    notebooks/ saved after a run is written as committed; a notebook elsewhere keeps its outputs."""
    pytest.importorskip("jupyter_server")
    nbformat = pytest.importorskip("nbformat")
    from jupyter_server.services.contents.filemanager import FileContentsManager
    from traitlets.config.loader import PyFileConfigLoader

    from workbench import nbclean
    config = PyFileConfigLoader("jupyter_server_config.py", path=str(ROOT / "jupyter_config")).load_config()
    hook = config.ContentsManager.pre_save_hook
    assert hook == "workbench.nbclean.pre_save_hook"
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(nbclean, "notebooks_dir", lambda: tmp_path / "notebooks")
    cm = FileContentsManager(root_dir=str(tmp_path), pre_save_hook=hook)
    src = NOTEBOOKS[0]
    for folder in ("notebooks", "elsewhere"):
        nb = nbformat.from_dict(_ran(src))
        cm.save({"type": "notebook", "format": "json", "content": nb}, f"{folder}/{src.name}")
    assert (tmp_path / "notebooks" / src.name).read_text(encoding="utf-8") == src.read_text(encoding="utf-8")
    kept = json.loads((tmp_path / "elsewhere" / src.name).read_text(encoding="utf-8"))
    assert any(c.get("outputs") for c in kept["cells"])


def test_git_is_told_to_clean_the_notebooks():
    """.gitattributes names the clean filter (set up per clone: workbench/nbclean.py), and the filter, run as git
    runs it (stdin → stdout), gives the committed file for a notebook that was run."""
    import subprocess
    import sys
    assert "notebooks/*.ipynb filter=nbclean" in (ROOT / ".gitattributes").read_text().splitlines()
    src = NOTEBOOKS[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-m", "workbench", "nbclean"], input=json.dumps(_ran(src)), text=True,
                         capture_output=True, check=True, env=env, encoding="utf-8").stdout
    assert out == src.read_text(encoding="utf-8")

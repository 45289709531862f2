"""Notebooks kept without outputs, so that running them never leaves a change for git.

The committed notebooks (notebooks/*.ipynb) hold no outputs, no execution counts and none of the metadata a run or
a front end adds; they are stored in nbformat's own layout (what JupyterLab writes), so that a notebook that was run
and then cleaned is byte for byte the committed file. Three ways a run stays out of git, none of which needs a git
setting to be safe:

* the tests run the notebooks in memory (nbclient) and never write them back (tests/test_notebooks.py);
* `pre_save_hook`, for JupyterLab: a notebook of this repository's notebooks/ is cleaned as it is saved, so the
  file on disk stays the committed one (the outputs stay in the open tab until it is closed). jupyter_config/
  holds the setting; JupyterLab reads it with JUPYTER_CONFIG_PATH pointing there:
  `JUPYTER_CONFIG_PATH=jupyter_config jupyter lab`;
* a git clean filter, for a clone that sets it up once: `git config filter.nbclean.clean "python -m
  workbench nbclean"` (.gitattributes names the filter; git ignores it until it is configured).

`python -m workbench nbclean` cleans a notebook from stdin to stdout; `python -m workbench nbclean FILE...`
cleans the files in place (`python -m workbench.nbclean` does the same).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .paths import ROOT

# cell metadata a run or a front end adds (JupyterLab's execution timings, collapsed or scrolled outputs)
RUN_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime", "trusted")
# notebook metadata kept: which kernel runs it, and its language's name (not the version of whoever ran it last)
KEPT_METADATA = ("kernelspec",)


def clean(nb: dict) -> dict:
    """The notebook (a JSON object, or an nbformat node) without outputs, execution counts or run metadata; in
    place, and returned."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        meta = cell.get("metadata", {})
        for key in RUN_CELL_METADATA:
            meta.pop(key, None)
    meta = nb.get("metadata", {})
    lang = (meta.get("language_info") or {}).get("name")
    for key in list(meta):
        if key not in KEPT_METADATA:
            del meta[key]
    if lang:
        meta["language_info"] = {"name": lang}
    return nb


def dumps(nb: dict) -> str:
    """nbformat's own layout, as JupyterLab saves a notebook (sources as lists of lines, one-space indent, sorted
    keys, a final newline)."""
    cells = [{**c, "source": c["source"].splitlines(True)} if isinstance(c.get("source"), str) else c
             for c in nb.get("cells", [])]
    return json.dumps({**nb, "cells": cells}, indent=1, sort_keys=True, ensure_ascii=False,
                      separators=(",", ": ")) + "\n"


def clean_text(text: str) -> str:
    return dumps(clean(json.loads(text)))


def notebooks_dir() -> Path:
    return ROOT / "notebooks"


def pre_save_hook(model: dict, path: str, contents_manager=None, **kw):
    """jupyter_server's FileContentsManager.pre_save_hook: a notebook of this repository's notebooks/ is saved
    clean (see the module's docstring). Others are left alone."""
    if model.get("type") != "notebook" or not model.get("content"):
        return
    root = Path(getattr(contents_manager, "root_dir", "") or ".")
    target = (root / path.lstrip("/")).resolve()
    if target.parent == notebooks_dir().resolve():
        clean(model["content"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:                                   # a git clean filter: stdin → stdout
        sys.stdout.write(clean_text(sys.stdin.read()))
        return 0
    for name in argv:
        p = Path(name)
        text = p.read_text(encoding="utf-8")
        out = clean_text(text)
        if out != text:
            p.write_text(out, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

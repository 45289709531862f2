"""Where things are: the kernel sources a user edits (the workspace), their edit history, the recorded fixtures.

The workspace is the folder whose `portability.cuh`, `monokernel.cuh` and `sections/` are assembled and edited.
Everything that reads or writes section files asks `kernels_dir()` at the time it does so (never a copy taken at
import), so a test or a notebook can point the whole workbench at a private copy with `use_kernels_dir`.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent      # the repository root in a source checkout or editable install
FIXTURES = ROOT / "fixtures"
ENV_KERNELS = "MONOKERNEL_WORKSPACE"                 # a folder holding portability.cuh, monokernel.cuh, sections/

_override: Path | None = None


def kernels_dir() -> Path:
    """The kernel sources in use: `use_kernels_dir`'s folder, else $MONOKERNEL_WORKSPACE, else the repository's
    kernels/."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_KERNELS)
    if env:
        return Path(env).expanduser().resolve()
    return ROOT / "kernels"


def sections_dir() -> Path:
    return kernels_dir() / "sections"


def history_dir() -> Path:
    """Earlier versions of every edited section (git-ignored in the repository)."""
    return kernels_dir() / ".history"


def set_kernels_dir(path: str | Path | None):
    """Point the workbench at another kernel folder (None: back to the default)."""
    global _override
    _override = None if path is None else Path(path).expanduser().resolve()


@contextlib.contextmanager
def use_kernels_dir(path: str | Path):
    """`with use_kernels_dir(copy):` — assemble, edit and undo in `copy`, then back to what was in force."""
    global _override
    old = _override
    set_kernels_dir(path)
    try:
        yield kernels_dir()
    finally:
        _override = old

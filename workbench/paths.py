"""Where things are: the kernel sources a user edits (the workspace), their edit history, the recorded fixtures.

The workspace is the folder whose `portability.cuh`, `monokernel.cuh` and `sections/` are assembled and edited, and
which keeps the edit history (`.history/`). It is, first match wins:

1. the folder given to `set_kernels_dir` / `use_kernels_dir`;
2. $MONOKERNEL_WORKSPACE;
3. in a source checkout or an editable install: the repository's kernels/, edited in place;
4. in an installed wheel: a per-user folder, $XDG_DATA_HOME/monokernel-workbench/kernels (XDG_DATA_HOME defaults to
   ~/.local/share).

The wheel ships the kernel sources as read-only data (`TEMPLATE`, workbench/_kernels); a workspace of (2) or (4) that
does not exist yet, or is empty, is filled from them on first use, with one line on stderr saying where. Nothing is
ever written inside the installed package.

Everything that reads or writes section files asks `kernels_dir()` at the time it does so (never a copy taken at
import), so a test or a notebook can point the whole workbench at a private copy with `use_kernels_dir`.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent                                # the repository root in a source checkout or editable install
FIXTURES = ROOT / "fixtures"
ENV_KERNELS = "MONOKERNEL_WORKSPACE"                 # a folder holding portability.cuh, monokernel.cuh, sections/
TEMPLATE = PACKAGE / "_kernels"                      # in a wheel: the shipped kernel sources (kernels/ of the repo)
APP = "monokernel-workbench"                         # the distribution's name, also the per-user data folder's

_override: Path | None = None
_filled: set[Path] = set()                           # workspaces already checked (or filled) in this process


def source_checkout() -> bool:
    """True when the package runs from the repository (a checkout, or an editable install of it)."""
    return (ROOT / "pyproject.toml").is_file() and (ROOT / "kernels").is_dir()


def template_dir() -> Path:
    """The pristine kernel sources: the ones shipped in the wheel, else the repository's kernels/."""
    return TEMPLATE if TEMPLATE.is_dir() else ROOT / "kernels"


def user_workspace() -> Path:
    """The per-user workspace of an installed wheel: $XDG_DATA_HOME/monokernel-workbench/kernels."""
    data = os.environ.get("XDG_DATA_HOME", "")
    base = Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share"   # XDG: relative means unset
    return (base / APP / "kernels").resolve()


def kernels_dir() -> Path:
    """The kernel sources in use: `use_kernels_dir`'s folder, else $MONOKERNEL_WORKSPACE, else the repository's
    kernels/ (source checkout, editable install), else the per-user workspace (installed wheel)."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_KERNELS)
    if env:
        return _fill(Path(env).expanduser().resolve())
    if source_checkout():
        return ROOT / "kernels"
    return _fill(user_workspace())


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


def _only_sources(folder: str, names: list[str]) -> set[str]:
    """copytree's ignore: the .cuh and .ptx files and their folders, not the history, caches or Python files."""
    def source(name: str) -> bool:
        return name.endswith((".cuh", ".ptx")) or os.path.isdir(os.path.join(folder, name))
    return {n for n in names if n in (".history", "__pycache__") or not source(n)}


def _fill(workspace: Path) -> Path:
    """`workspace`, first filled from `template_dir()` when it does not exist or is empty. The copy is made next to
    it and renamed into place, so a concurrent first use sees either nothing or every file; a folder that holds
    anything is never written to."""
    if workspace in _filled:
        return workspace
    if not workspace.is_dir() or not any(workspace.iterdir()):
        workspace.parent.mkdir(parents=True, exist_ok=True)
        part = workspace.with_name(f".{workspace.name}.{os.getpid()}.part")
        shutil.rmtree(part, ignore_errors=True)
        try:
            # copyfile: the shipped files may be read-only, the workspace's must be editable
            shutil.copytree(template_dir(), part, ignore=_only_sources, copy_function=shutil.copyfile)
            for folder in (part, *(d for d in part.rglob("*") if d.is_dir())):
                folder.chmod(folder.stat().st_mode | stat.S_IWUSR)  # and its folders too (copytree copies modes)
            with contextlib.suppress(OSError):
                workspace.rmdir()                                   # an empty folder: replaced by the copy
            try:
                part.rename(workspace)
            except OSError:
                if not (workspace.is_dir() and any(workspace.iterdir())):   # nor another process's copy
                    raise
            else:
                print(f"{APP}: kernel sources copied to {workspace}; edit them there "
                      f"(${ENV_KERNELS} or paths.set_kernels_dir picks another folder)", file=sys.stderr)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    _filled.add(workspace)
    return workspace

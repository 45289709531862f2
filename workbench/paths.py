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

A workspace that cannot be one is a SourceError naming where it came from and what to do: a regular file, a folder
no file can be created in (found by creating one, as permission bits say nothing for root or a read-only mount), or
a folder of other files (left alone: `kernels_dir` still names it, and `require_sources`, which everything that
reads or writes the sources asks, refuses it).

Everything that reads or writes section files asks `kernels_dir()` at the time it does so (never a copy taken at
import), so a test or a notebook can point the whole workbench at a private copy with `use_kernels_dir`.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from .errors import SourceError

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


def pip_install(extra: str) -> str:
    """The command that installs one of the distribution's extras (pyproject.toml), as this installation needs it
    said: an editable install of the checkout it runs from, else the distribution by name."""
    if source_checkout():
        return f"pip install -e '.[{extra}]' (in {ROOT})"
    return f"pip install '{APP}[{extra}]'"


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
    kernels/ (source checkout, editable install), else the per-user workspace (installed wheel). SourceError when
    the workspace of the last two is a file, cannot be filled, or is not writable (see _fill)."""
    if _override is not None:
        return _override
    if env := os.environ.get(ENV_KERNELS):
        return _fill(Path(env).expanduser().resolve())
    return ROOT / "kernels" if source_checkout() else _fill(user_workspace())


def require_sources() -> Path:
    """`kernels_dir()`, refused (SourceError) when it lacks the kernel sources (portability.cuh, monokernel.cuh,
    sections/): a folder of other files is never written to or assembled from, and the error says so instead of a
    missing-file traceback."""
    k = kernels_dir()
    missing = [n for n in ("portability.cuh", "monokernel.cuh") if not (k / n).is_file()]
    missing += [] if (k / "sections").is_dir() else ["sections/"]
    if missing:
        named, other = _origin(k)
        if len(missing) == 3:
            raise SourceError(f"{named} holds no kernel sources (no portability.cuh, monokernel.cuh or sections/; its "
                              f"other files are left alone): {other}", path=k)
        raise SourceError(f"{named} lacks {', '.join(missing)} of the kernel sources: put them back, or {other}",
                          path=k)
    return k


def _origin(workspace: Path) -> tuple[str, str]:
    """How an error names `workspace` (by what chose it), and how to choose another."""
    if _override is not None:
        return (f"the kernels folder {workspace} (set_kernels_dir / use_kernels_dir)",
                "give set_kernels_dir a folder holding the kernel sources")
    if env := os.environ.get(ENV_KERNELS):
        shown = env if Path(env) == workspace else f"{env} ({workspace})"
        return (f"{ENV_KERNELS}={shown}",
                f"set {ENV_KERNELS} to a folder holding the kernel sources, or to a new or empty folder (it gets a "
                f"copy of them)")
    if source_checkout():
        return (f"the repository's kernels folder {workspace}",
                f"restore it from the repository, or set {ENV_KERNELS} to a new or empty folder (it gets a copy of "
                f"the kernel sources)")
    return (f"the per-user workspace {workspace}",
            f"move it aside (a fresh copy of the kernel sources is made there), or set {ENV_KERNELS} to another "
            f"folder")


def file_in_the_way(folder: Path) -> Path | None:
    """The nearest of `folder` and its parents that exists and is not a folder (making `folder` would fail on it)."""
    for p in (folder, *folder.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _why(e: OSError) -> str:
    return f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e))


def write_problem(folder: Path) -> str | None:
    """Why no file can be created in `folder`, None if one can: a real attempt, since the mode bits say nothing for
    root, a read-only mount or an ACL."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.")
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return None


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
    """copytree's ignore: the .cuh and .ptx files, a numba variant's .py (NAME@numba....py) and their folders, not
    the history, caches or the template's own Python files (its package's)."""
    def source(name: str) -> bool:
        return (name.endswith((".cuh", ".ptx")) or re.fullmatch(r"\w+@numba[\w.-]*\.py", name) is not None
                or os.path.isdir(os.path.join(folder, name)))
    return {n for n in names if n in (".history", "__pycache__") or not source(n)}


def _fill(workspace: Path) -> Path:
    """`workspace`, first filled from `template_dir()` when it does not exist or is empty. The copy is made next to
    it and renamed into place, so a concurrent first use sees either nothing or every file; a folder that holds
    anything is never written to (but for a probe file, created and removed, that proves it writable). A regular
    file, a place the copy cannot be made, or a folder no file can be created in is a SourceError."""
    if workspace in _filled:
        return workspace
    named, other = _origin(workspace)
    try:
        if workspace.exists() and not workspace.is_dir():
            raise SourceError(f"{named} is a file, not a folder: {other}", path=workspace)
        _copy_if_empty(workspace)
    except OSError as e:
        blocker = file_in_the_way(workspace)
        why = f"{blocker} is a file, not a folder" if blocker is not None else _why(e)
        raise SourceError(f"{named}: the kernel sources cannot be copied there ({why}): {other}",
                          path=blocker or workspace) from None
    if (why := write_problem(workspace)) is not None:
        raise SourceError(f"{named} is not writable ({why}): edits and their history are written there; make it "
                          f"writable, or {other}", path=workspace)
    _filled.add(workspace)
    return workspace


def _copy_if_empty(workspace: Path):
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

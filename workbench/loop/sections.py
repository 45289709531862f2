"""Section files: atomic writes with an undo history.

Every edit of a kernel file goes through `write_section`, which saves the version it replaces under
kernels/.history/NAME[@VARIANT]/<timestamp>.cuh first; `undo_section` walks back. The files are the workspace's
(workbench.paths.kernels_dir()), so a test or a notebook can edit a private copy.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from .. import paths
from ..build.assemble import section_path

_VARIANT_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_last_ns = 0
_ns_lock = threading.Lock()


def history_root() -> Path:
    """kernels/.history (git-ignored): earlier versions of every edited section."""
    return paths.history_dir()


def section_file(section: str, variant: str | None = None) -> Path:
    """The file of a section (or of one of its variants): kernels/lib/ for the library, kernels/sections/ for the
    stages of the plan, kernels/monokernel.cuh for the kernel entry."""
    if variant is not None and (not _VARIANT_RE.match(variant) or variant in (".", "..")):
        raise ValueError(f"variant names are letters, digits, '_', '-', '.': got {variant!r}")
    return section_path(section, variant)


def display_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(paths.kernels_dir().parent.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _stamp() -> str:
    """A fixed-width, strictly increasing time stamp: names sort in the order they were made."""
    global _last_ns
    with _ns_lock:
        ns = max(time.time_ns(), _last_ns + 1)
        _last_ns = ns
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(ns // 10**9)) + f".{ns % 10**9:09d}"


def _history_dir(section: str, variant: str | None, root: Path | None) -> Path:
    return (root or history_root()) / (f"{section}@{variant}" if variant else section)


def _atomic_write(path: Path, text: str):
    """Write through a temporary file in the same folder and os.replace: readers (the compiler, the watcher,
    JupyterLab) see the old file or the new one, never half of one; on any error the old file is untouched."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, (path.stat().st_mode & 0o777) if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _new_entry(folder: Path, suffix: str, content: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        p = folder / f"{_stamp()}{suffix}"
        try:
            with open(p, "x", encoding="utf-8", newline="") as f:
                f.write(content)
            return p
        except FileExistsError:
            continue


def write_section(section: str, text: str, variant: str | None = None, *,
                  history_dir: Path | None = None) -> Path | None:
    """Replace a section file (atomically) with `text`, first saving the current version under
    kernels/.history/NAME[@VARIANT]/<timestamp>.cuh (a new file: <timestamp>.absent, so undo removes it again).
    Returns the history entry, or None when `text` equals the file (nothing written)."""
    if not isinstance(text, str):
        raise TypeError(f"section text must be str, got {type(text).__name__}")
    path = section_file(section, variant)
    old = path.read_text(encoding="utf-8") if path.exists() else None
    if old == text:
        return None
    folder = _history_dir(section, variant, history_dir)
    entry = _new_entry(folder, ".absent" if old is None else ".cuh", old or "")
    try:
        _atomic_write(path, text)
    except BaseException:
        entry.unlink(missing_ok=True)        # nothing changed: no history entry either
        raise
    return entry


def section_history(section: str, variant: str | None = None, *, history_dir: Path | None = None) -> list[Path]:
    """The undo stack of a section, oldest first (entries undone are kept as *.undone.cuh, not listed)."""
    folder = _history_dir(section, variant, history_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if (p.suffix == ".cuh" and not p.name.endswith(".undone.cuh")) or p.suffix == ".absent")


def undo_section(section: str, variant: str | None = None, *, history_dir: Path | None = None) -> Path:
    """Put back the version saved by the last write_section (removing a variant file that write created). The text
    being replaced is kept as <timestamp>.undone.cuh beside the history, so an undo loses nothing either.
    Returns the history entry that was restored (and removed from the stack)."""
    path = section_file(section, variant)
    stack = section_history(section, variant, history_dir=history_dir)
    if not stack:
        where = display_path(_history_dir(section, variant, history_dir))
        raise LookupError(f"no earlier version of {display_path(path)} in {where}")
    entry = stack[-1]
    if path.exists():
        _new_entry(entry.parent, ".undone.cuh", path.read_text(encoding="utf-8"))
    if entry.suffix == ".absent":
        path.unlink(missing_ok=True)
    else:
        _atomic_write(path, entry.read_text(encoding="utf-8"))
    entry.unlink()
    return entry



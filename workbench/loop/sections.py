"""Section files: atomic, serialised writes with an undo history.

Every edit of a kernel file goes through `write_section`, which saves the version it replaces under
kernels/.history/NAME[@VARIANT]/<timestamp>.cuh first; `undo_section` walks back. The files are the workspace's
(workbench.paths.kernels_dir()), so a test or a notebook can edit a private copy.

No version is lost between writers: every write and undo of one kernels folder holds that folder's edit lock (an
flock on kernels/.history/.lock), whichever thread, Workbench or process makes it, so each one reads, saves and
replaces the file with no other in between, and every version that was ever on disk is either still there or in the
history. A writer that says which text its edit was based on (`base=`) is refused, not merged, when the file has
changed since: its text is kept as <timestamp>.refused.cuh beside the history and the error names that file.

Files are bytes: read and written with no newline translation (a CRLF file stays CRLF, undo gives back the very
bytes), and compared exactly. They must be UTF-8 text: a file on disk, a history entry or an edit's text that is not
UTF-8 or holds a NUL byte is refused with a SourceError naming it and the offset, before anything is written.

`texts_of` reads back the section texts a build was assembled from: what the loop keeps to rebuild it exactly.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from .. import paths, plan
from ..compiler.assemble import decode_source, numba_path, section_path
from ..compiler.numba_sections import is_numba_variant
from ..errors import SourceError

try:
    import fcntl
except ImportError:             # not POSIX: the threads of one process are still serialised (_fallback)
    fcntl = None

_VARIANT_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_last_ns = 0
_ns_lock = threading.Lock()
_fallback = threading.Lock()
LOCK_NAME = ".lock"             # in the kernels folder's .history/: one per kernels folder, whatever history_dir is


def section_file(section: str, variant: str | None = None, *, python: bool = False) -> Path:
    """The file of a section (or of one of its variants): kernels/lib/ for the library, kernels/sections/ for the
    stages of the plan, kernels/monokernel.cuh for the kernel entry. `python`: a numba variant's .py (its device
    functions, workbench.compiler.numba_sections) rather than its .cuh."""
    if variant is not None and (not _VARIANT_RE.match(variant) or variant in (".", "..")):
        raise ValueError(f"variant names are letters, digits, '_', '-', '.': got {variant!r}")
    if python:
        if not is_numba_variant(variant):
            raise ValueError(f"python=True edits a numba variant's .py: {section}@{variant} is not one (a variant "
                             "named numba...)")
        return numba_path(section, variant)
    return section_path(section, variant)


def display_path(path: Path) -> str:
    """kernels/... for a file of the kernels folder; any other path (a history_dir elsewhere) in full, since relative
    to the kernels folder's parent it would name nothing the user gave."""
    k = paths.kernels_dir().resolve()
    try:
        path.resolve().relative_to(k)
        return path.resolve().relative_to(k.parent).as_posix()
    except ValueError:
        return path.as_posix()


def _stamp() -> str:
    """A fixed-width, strictly increasing time stamp: names sort in the order they were made."""
    global _last_ns
    with _ns_lock:
        ns = max(time.time_ns(), _last_ns + 1)
        _last_ns = ns
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(ns // 10**9)) + f".{ns % 10**9:09d}"


def _history_dir(section: str, variant: str | None, root: Path | None, python: bool = False) -> Path:
    """The section's folder of earlier versions under `root`, by default kernels/.history (git-ignored); a numba
    variant's .py has its own (NAME@VARIANT.py)."""
    return (root or paths.history_dir()) / (_name(section, variant) + (".py" if python else ""))


def checked_history_dir(history_dir: str | Path | None) -> Path | None:
    """`history_dir` as a Workbench keeps it (None: kernels/.history), made absolute so that a later change of the
    working directory does not move the history; SourceError when a file stands where the folder would be."""
    if history_dir is None:
        return None
    folder = Path(history_dir).expanduser().absolute()
    if (blocker := paths.file_in_the_way(folder)) is not None:
        named = "it" if blocker == folder else f"{blocker}"
        raise SourceError(f"history_dir={history_dir}: {named} is a file, not a folder: give history_dir a folder "
                          f"for the edit history (it is created if missing), or leave it out to keep the history in "
                          f"kernels/.history", path=blocker)
    return folder


def _folder(folder: Path) -> Path:
    """`folder` (of the edit history), created if missing; a file in its way, or a folder that cannot be made, is a
    SourceError saying which, before anything is written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = paths.file_in_the_way(folder)
        why, fix = ((f"{blocker} is a file, not a folder", "move that file aside") if blocker is not None else
                    (e.strerror or str(e), "make its folder writable"))
        raise SourceError(f"the edit history cannot be kept in {display_path(folder)}: {why}; nothing was written: "
                          f"{fix} (a Workbench's history_dir picks another folder)", path=blocker or folder) from None
    return folder


@contextlib.contextmanager
def edit_lock():
    """Hold the kernels folder's edit lock: an exclusive flock on kernels/.history/.lock, which serialises threads
    (each call opens its own descriptor, and flock locks of two descriptors exclude each other even in one
    process), Workbench objects and processes alike. Released when the descriptor closes, so a writer that dies
    holding it cannot block the others."""
    lock = _folder(paths.require_sources() / ".history") / LOCK_NAME
    if fcntl is None:
        with _fallback:
            yield
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes | str):
    """Write through a temporary file in the same folder and os.replace: readers (the compiler, the watcher,
    JupyterLab) see the old file or the new one, never half of one; on any error the old file is untouched. Bytes
    go down as given (str: as UTF-8, no newline translation)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, (path.stat().st_mode & 0o777) if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _new_entry(folder: Path, suffix: str, content: bytes) -> Path:
    _folder(folder)
    while True:
        p = folder / f"{_stamp()}{suffix}"
        with contextlib.suppress(FileExistsError):   # another process's entry of the same nanosecond: next stamp
            with open(p, "xb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())                 # on disk before the file it saves is replaced
            return p


def _name(section: str, variant: str | None) -> str:
    return f"{section}@{variant}" if variant else section


def _line_col(text: str, at: int) -> str:
    line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
    return f"line {line}, column {column}"


def _encode(text: str, path: Path, section: str, variant: str | None) -> bytes:
    """The bytes an edit writes: `text` as UTF-8, exactly (its line endings are the file's). Text with a NUL, or
    with a lone surrogate (bytes decoded with errors="surrogateescape"), is refused before anything is written."""
    where = f"section {_name(section, variant)}: the text for {display_path(path)}"
    if (at := text.find("\0")) >= 0:
        raise SourceError(f"{where} holds a NUL character at position {at} ({_line_col(text, at)}); nothing was "
                          f"written: kernel sources are text, remove it", path=path)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SourceError(f"{where} is not UTF-8 text: {text[e.start]!r} at position {e.start} "
                          f"({_line_col(text, e.start)}) is a lone surrogate (bytes decoded with errors="
                          f"'surrogateescape'?); nothing was written: decode the source with its real encoding",
                          path=path) from None


def _on_disk(path: Path) -> tuple[bytes | None, str | None]:
    """The file's bytes and its text (None, None: no file); SourceError when it is not UTF-8 or holds a NUL."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    return data, decode_source(data, display_path(path), "nothing was written")


def write_section(section: str, text: str, variant: str | None = None, *, history_dir: Path | None = None,
                  base: str | None = None, python: bool = False) -> Path | None:
    """Replace a section file (atomically) with `text`, first saving the current version under
    kernels/.history/NAME[@VARIANT]/<timestamp>.cuh (a new file: <timestamp>.absent, so undo removes it again).
    Returns the history entry, or None when `text` equals the file byte for byte (nothing written).

    The text is written as UTF-8 exactly as given, line endings included; a NUL or a character UTF-8 cannot hold is
    refused before anything is written, as is a file on disk that is not UTF-8 text (SourceError, naming the file and
    the offset). Writers are serialised (edit_lock), across threads, Workbench objects and processes.

    base: the text this edit was made from (None: no check). When the file no longer holds exactly that (a missing
    file counts as ""), another writer changed it meanwhile and the edit is REFUSED, not merged: nothing is written,
    the text is kept as <timestamp>.refused.cuh in the section's history folder (not on the undo stack), and the
    SourceError names that file (`.kept`) so the change can be carried over by hand.

    python: the numba variant's .py instead of its .cuh (its history kept apart, in NAME@VARIANT.py)."""
    if not isinstance(text, str):
        raise TypeError(f"section text must be str, got {type(text).__name__}")
    if base is not None and not isinstance(base, str):
        raise TypeError(f"base must be the str the edit was made from, got {type(base).__name__}")
    path = section_file(section, variant, python=python)
    data = _encode(text, path, section, variant)
    folder = _history_dir(section, variant, history_dir, python)
    with edit_lock():
        old, old_text = _on_disk(path)
        if old == data:
            return None
        if base is not None and base != (old_text or ""):
            kept = _new_entry(folder, ".refused.cuh", data)
            raise SourceError(f"{display_path(path)} changed since the text your edit is based on was read (another "
                              f"Workbench, process or editor wrote it): your edit was not written and is kept in "
                              f"{display_path(kept)}; the workbench refuses rather than merges: carry your change "
                              f"into the current file and edit again", path=path, kept=kept)
        entry = _new_entry(folder, ".absent" if old is None else ".cuh", old or b"")
        try:
            _atomic_write(path, data)
        except BaseException:
            entry.unlink(missing_ok=True)        # nothing changed: no history entry either
            raise
        return entry


def section_history(section: str, variant: str | None = None, *, history_dir: Path | None = None,
                    python: bool = False) -> list[Path]:
    """The undo stack of a section, oldest first (entries undone are kept as *.undone.cuh, refused edits as
    *.refused.cuh; neither is listed). `python`: of a numba variant's .py."""
    folder = _history_dir(section, variant, history_dir, python)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if (p.suffix == ".cuh" and not p.name.endswith((".undone.cuh", ".refused.cuh")))
                  or p.suffix == ".absent")


def undo_section(section: str, variant: str | None = None, *, history_dir: Path | None = None,
                 python: bool = False) -> Path:
    """Put back the version saved by the last write_section (removing a variant file that write created), byte for
    byte. The text being replaced is kept as <timestamp>.undone.cuh beside the history, so an undo loses nothing
    either. A history entry or a file on disk that is not UTF-8 text is refused (SourceError), nothing changed.
    Returns the history entry that was restored (and removed from the stack). `python`: a numba variant's .py."""
    path = section_file(section, variant, python=python)
    with edit_lock():
        stack = section_history(section, variant, history_dir=history_dir, python=python)
        if not stack:
            where = display_path(_history_dir(section, variant, history_dir, python))
            raise LookupError(f"no earlier version of {display_path(path)} in {where}")
        entry = stack[-1]
        restored = None if entry.suffix == ".absent" else entry.read_bytes()
        if restored is not None:
            decode_source(restored, f"{display_path(entry)} (the version of {display_path(path)} to restore)",
                          "nothing was restored")
        current, _ = _on_disk(path)
        if current is not None:
            _new_entry(entry.parent, ".undone.cuh", current)
        if restored is None:
            path.unlink(missing_ok=True)
        else:
            _atomic_write(path, restored)
        entry.unlink()
        return entry


def texts_of(asm) -> dict:
    """{section: text} of an assembled source: enough overrides to rebuild exactly it (portability.cuh aside). A
    stage written in PTX is its .ptx body (what an override of it replaces; its C++ declaration is read from disk)."""
    out = {}
    for _, path, text in asm.pieces:
        stem = Path(path).stem.split("@")[0]
        if not path.startswith("<") and stem in plan.FILES:
            out[stem] = text
    out.update((b.section, b.text) for b in asm.ptx_bodies)
    return out

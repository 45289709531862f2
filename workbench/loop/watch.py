"""Watching the kernel sources: a polling thread (no dependency) that calls back when files change.

It stats kernels/sections/*.cuh (*.ptx, *@numba*.py), kernels/monokernel.cuh and kernels/portability.cuh every
`interval_s`; a file whose mtime or size moved is read and hashed, and only a changed hash counts (JupyterLab
re-saving the same text, or touching a file, does nothing). Changes are debounced: the callback runs once the last change is `debounce_s` old,
with every path that changed meanwhile, so an editor that writes a file in several steps causes one reload.
The Workbench starts and stops it (Workbench.watch / unwatch) and filters the paths down to its build's files.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .. import paths


def watched_files() -> list[Path]:
    """The kernel sources as they are now: every stage section and library file (variants included) plus
    monokernel.cuh and portability.cuh, the stages written in PTX and the device functions in Python
    (NAME@numba....py). Hidden files (editors' and atomic writes' temporaries) are left out."""
    k = paths.kernels_dir()
    files = [p for folder in (paths.sections_dir(), k / "lib") for pattern in ("*.cuh", "*.ptx", "*@numba*.py")
             for p in folder.glob(pattern) if not p.name.startswith((".", "~")) and "~" not in p.name]
    files += [paths.kernels_dir() / "monokernel.cuh", paths.kernels_dir() / "portability.cuh"]
    return sorted(p for p in files if p.is_file())


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha1(path.read_bytes()).hexdigest()
    except OSError:
        return None


class Watcher:
    """Calls callback(changed_paths) from a daemon thread when watched files change (see the module docstring).

    files: a function returning the paths to watch (default watched_files, evaluated on every poll so new variant
    files are seen). The callback's exceptions are caught, printed once each, and kept in `last_error`."""

    def __init__(self, callback: Callable[[list[Path]], object], files: Callable[[], list[Path]] | None = None, *,
                 interval_s: float = 0.2, debounce_s: float = 0.3):
        self.callback = callback
        self.files = files or watched_files
        self.interval_s, self.debounce_s = interval_s, debounce_s
        self._lock = threading.RLock()                 # paused() then sync() in one thread
        self._known: dict[Path, tuple] = {}            # path → (mtime_ns, size, digest)
        self._pending: dict[Path, float] = {}          # path → when the change was seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None
        self.fired = 0
        self.sync()

    def _stat(self, p: Path):
        try:
            st = p.stat()
            return st.st_mtime_ns, st.st_size
        except OSError:
            return None

    def sync(self):
        """Take the current state as known, dropping pending changes (after writes of our own)."""
        with self._lock:
            self._known = {p: (*st, _digest(p)) for p in self.files() if (st := self._stat(p)) is not None}
            self._pending.clear()

    @contextlib.contextmanager
    def paused(self):
        """No scan runs inside this block (write, then sync(), inside it)."""
        with self._lock:
            yield

    def _scan(self, now: float):
        current = set(self.files())
        for p in current | set(self._known):
            st = self._stat(p) if p in current else None
            old = self._known.get(p)
            if st is None:
                if old is not None:                         # deleted
                    del self._known[p]
                    self._pending[p] = now
                continue
            if old is not None and old[:2] == st:
                continue
            d = _digest(p)
            self._known[p] = (*st, d)
            if old is None or old[2] != d:
                self._pending[p] = now

    def poll_once(self, now: float | None = None) -> list[Path] | None:
        """One scan; returns (and hands to the callback) the changed paths once they have settled, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._scan(now)
            if not self._pending or now - max(self._pending.values()) < self.debounce_s:
                return None
            changed = sorted(self._pending)
            self._pending.clear()
        self.fired += 1
        try:
            self.callback(changed)
        except Exception as e:                              # keep watching
            self.last_error = e
            print(f"workbench watcher: reload after {', '.join(p.name for p in changed)} failed: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
        return changed

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception as e:                          # a scan error (a folder gone): report, keep going
                self.last_error = e

    def start(self):
        if self.running:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="workbench-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0):
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

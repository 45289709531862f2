"""A worker process owns the GPU, so that a hang or a fault in an edited section never takes the caller down.

The caller (a notebook, the command line) keeps what must survive: the section files, the history, the records, the
dashboards. The worker runs a *service* (an object whose methods do the GPU work: build, verify, time, generate) and
answers calls over a pipe. Beside the pipe the two share one block of memory (multiprocessing.shared_memory):

    words 0..15    the worker's own: what it is doing (the phase), the grid of the kernel it runs, that kernel's
                   barrier timeout
    words 16..     the kernel's mapped block (workbench.abi.MAPPED): status, the host's abort flag, the token count,
                   the step heartbeat, every block's where-word, the tokens; the worker registers it as mapped host
                   memory, so the kernel writes it directly and the caller reads it while the kernel runs and after
                   the worker is gone

`Worker.call` waits for the answer while it watches: a kernel whose step heartbeat and where-words stop moving for
`hang_s` is a hang (the abort flag is raised; if the kernel has not stopped `grace_s` later the worker is killed,
which is the only way to stop a kernel spinning outside every bounded wait); a compile that runs past its limit is a
compiler hang; a sticky CUDA error (illegal address, trap, misaligned access) is a fault, after which the worker's
context is unusable and it exits; a worker that dies (a crash inside NVRTC or ptxas) is a crash. Each is raised as a
`WorkerFailure` naming what happened, with the state of every block (its last stage, layer, step, and whether it
was waiting at a barrier or stopped moving) read from the shared block; the caller starts a new worker. An interrupt
(Ctrl-C, Jupyter's stop button) raises the abort flag first, so a running generation stops cleanly and the worker
lives on.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing import get_context, shared_memory

import numpy as np

from .. import abi, errors
from ..compiler.compile import CompileError
from . import runtime as R
from .runtime import KernelHang

W_PHASE, W_GRID, W_TIMEOUT_MS = 0, 1, 2
HEADER = 16                              # worker words before the kernel's mapped block
PHASES = ("idle", "starting", "loading", "compiling", "running", "checking")
# CUDA errors after which a context cannot be used again (cudaError_t): the worker reports and exits
STICKY = {700: "cudaErrorIllegalAddress", 701: "cudaErrorLaunchOutOfResources", 702: "cudaErrorLaunchTimeout",
          710: "cudaErrorAssert", 714: "cudaErrorHardwareStackError", 715: "cudaErrorIllegalInstruction",
          716: "cudaErrorMisalignedAddress", 717: "cudaErrorInvalidAddressSpace", 718: "cudaErrorInvalidPc",
          719: "cudaErrorLaunchFailure (a trap or an unspecified fault)"}
NOT_STICKY = {701}                       # too many resources for the launch: refused, the context is fine


class WorkerFailure(RuntimeError):
    """The worker hung, faulted or died. `kind`: hang | fault | crash | compiler; `blocks`: [BlockState]."""

    def __init__(self, kind: str, message: str, blocks=None, status=None, seconds: float = float("nan")):
        super().__init__(f"{message}. {summarize_blocks(blocks or [])}")
        self.kind, self.blocks, self.status, self.seconds = kind, blocks or [], status or {}, seconds
        self.message = message             # what happened, without the blocks' summary

    killed = True                      # the worker was replaced (False: the kernel stopped when asked; it lives on)

    def __reduce__(self):
        return (WorkerFailure, (self.kind, self.message, self.blocks, self.status, self.seconds))


@dataclasses.dataclass
class CallTime:
    """One call: `wall_s` here, from sending it to its answer; `service_s` in the worker, inside the method."""
    method: str
    wall_s: float
    service_s: float

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.service_s


class RemoteError(RuntimeError):
    """An exception of the worker's that has no class here (its type name and message kept)."""

    def __init__(self, type_name: str, message: str, tb: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.tb = type_name, tb


@dataclasses.dataclass
class BlockState:
    """Where one block of the grid was when the kernel was last seen."""
    block: int
    stage: str | None
    layer: int
    step: int
    waiting: bool           # arrived at the barrier after that stage, waiting for the others
    moved: bool             # its where-word changed in the last watch interval

    @property
    def where(self) -> str:
        if self.stage is None:
            return "never started"
        return ("waiting after " if self.waiting else "in ") + abi.place(self.stage, self.layer, self.step)

    def __str__(self) -> str:
        return f"block {self.block}: {self.where}" + ("" if self.moved or self.stage is None else " (stopped moving)")


def block_states(where_words: np.ndarray, previous: np.ndarray | None, grid: int) -> list[BlockState]:
    out = []
    for b in range(grid):
        w = int(where_words[b]) & 0xFFFFFFFF
        d = abi.decode_where(w) if w else None
        moved = previous is not None and b < len(previous) and int(previous[b]) != int(where_words[b])
        out.append(BlockState(b, *(d or (None, -1, -1, False)), moved))
    return out


def summarize_blocks(blocks: list[BlockState], limit: int = 6) -> str:
    """The blocks grouped by where they are: the odd ones out (not waiting while the rest wait) first."""
    if not blocks:
        return "no block state"
    groups: dict = {}
    for b in blocks:
        groups.setdefault((b.stage, b.layer, b.step, b.waiting), []).append(b.block)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][3], len(kv[1])))      # not-waiting, fewest first
    parts = []
    for (stage, layer, step, waiting), bs in ordered[:limit]:
        where = BlockState(bs[0], stage, layer, step, waiting, True).where
        names = ", ".join(map(str, bs[:8])) + (f" … ({len(bs)})" if len(bs) > 8 else "")
        parts.append(f"block{'s' if len(bs) > 1 else ''} {names}: {where}")
    return "; ".join(parts)


def _describe(e: BaseException) -> tuple:
    """A picklable account of an exception raised in the worker."""
    if isinstance(e, CompileError):
        return ("CompileError", str(e), {"messages": e.messages, "log": e.log})
    code = getattr(e, "status", None)
    extra = {"code": code} if isinstance(code, int) else {}
    if getattr(e, "where", None) is not None:
        extra["where"] = tuple(e.where)
    if hasattr(e, "result"):
        with contextlib.suppress(Exception):
            pickle.dumps(e.result)
            extra["result"] = e.result
    return (type(e).__name__, str(e), extra, traceback.format_exc())


def _rebuild(desc: tuple) -> BaseException:
    """The exception of `_describe` on this side: the workbench's own classes come back as themselves."""
    name, message, extra = desc[0], desc[1], desc[2]
    if name == "CompileError":
        return CompileError(extra["messages"], extra["log"])
    mine = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.UserError)]
    cls = {c.__name__: c for c in (*mine, R.KernelError, R.KernelHang, R.KernelAborted, R.NonFiniteLogits, R.StreamMismatch,
                                   ValueError, TypeError, KeyError, FileNotFoundError)}.get(name)
    e = cls(message) if cls is not None else RemoteError(name, message, desc[3] if len(desc) > 3 else "")
    if "result" in extra:
        e.result = extra["result"]
    if "where" in extra:
        e.where = extra["where"]
    return e


def _sticky(e: BaseException) -> int | None:
    code = getattr(e, "status", None)
    if isinstance(code, int) and code in STICKY and code not in NOT_STICKY:
        return code
    return next((c for c, name in STICKY.items() if c not in NOT_STICKY and name.split()[0] in str(e)), None)


# ---- the worker's side ------------------------------------------------------------------------------------------

def _thread_locked_progress_bars():
    """tqdm guards its bars with a multiprocessing RLock: in a spawned process that is a named POSIX semaphore,
    registered with the resource tracker the caller shares, and removed only by an exit handler. A worker killed
    for a hang runs none, and the tracker then warns of a leaked semaphore when the caller exits. The worker starts
    no processes, so a thread lock is all its bars need, and then no named semaphore exists to leak."""
    try:
        import threading

        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _exit(code: int):
    """os._exit, after what a multiprocessing child runs on its way out (its finalizers: they unlink any named
    semaphore made here), which os._exit would skip; the rest of the interpreter's unwinding is skipped on
    purpose (see the end of _child)."""
    with contextlib.suppress(Exception):                 # exiting regardless
        from multiprocessing import util
        util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child(conn, shm_name: str, n_words: int, factory, args: tuple, kwargs: dict):
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # the caller decides what an interrupt means
    _thread_locked_progress_bars()
    shm = shared_memory.SharedMemory(name=shm_name)
    words = np.frombuffer(shm.buf, dtype=np.int32, count=n_words)
    words[W_PHASE] = PHASES.index("starting")
    service = None
    try:
        service = factory(shm.buf, HEADER, n_words - HEADER, words, *args, **kwargs)
        conn.send(("ready", None))
    except BaseException as e:                            # noqa: BLE001 - reported to the caller
        conn.send(("error", _describe(e)))
        _exit(2)
    while True:
        words[W_PHASE] = PHASES.index("idle")
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        method, a, kw = msg
        try:
            t0 = time.perf_counter()
            result = getattr(service, method)(*a, **kw)
            conn.send(("ok", (result, time.perf_counter() - t0)))
        except BaseException as e:                        # noqa: BLE001 - reported to the caller
            code = _sticky(e)
            conn.send(("fault" if code else "error", _describe(e) + ((code,) if code else ())))
            if code:
                _exit(3)                                  # the context is gone: a new worker takes over
    close = getattr(service, "close", None)
    if close:
        close()
    # Exit without unwinding: the caller owns the block (and unlinks it), and views of it may live on in this
    # process's caches, which would make closing it here fail noisily at exit.
    _exit(0)


def phase_setter(words: np.ndarray):
    """For a service in the worker: `set(phase, timeout_s, grid)` tells the watching caller what runs now (and, for
    a kernel, how long its own barriers wait before they report a hang, the caller waiting longer than that, and how
    many blocks it has: the where-words to read)."""
    def set_phase(phase: str, timeout_s: float | None = None, grid: int | None = None):
        if timeout_s is not None:
            words[W_TIMEOUT_MS] = int(1000 * timeout_s)
        if grid is not None:
            words[W_GRID] = grid
        words[W_PHASE] = PHASES.index(phase)
    return set_phase


# ---- the caller's side ------------------------------------------------------------------------------------------

class Worker:
    """One worker process running `factory(buf, header, n_words, worker_words, *args)` (see the module docstring).

    hang_s: no movement of a running kernel for this long is a hang (or, if the blocks waiting at a barrier froze
    too, a fault). grace_s: after raising the abort flag, how long the kernel has to stop before the worker is
    killed. compile_s: a call in the compiling phase longer than this is a compiler hang. max_tokens: the mapped
    block's room for streamed tokens."""

    def __init__(self, factory, *args, hang_s: float = 2.0, grace_s: float = 0.75, compile_s: float = 30.0,
                 start_s: float = 120.0, max_tokens: int = 1 << 16, **kwargs):
        self.factory, self.args, self.kwargs = factory, args, kwargs
        self.hang_s, self.grace_s, self.compile_s, self.start_s = hang_s, grace_s, compile_s, start_s
        self.n_words = HEADER + abi.mapped_words(max_tokens)
        self.shm = shared_memory.SharedMemory(create=True, size=4 * self.n_words)
        self.words = np.frombuffer(self.shm.buf, dtype=np.int32, count=self.n_words)
        self.words[:] = 0
        self.proc = self.conn = None
        self._starting = False
        self.starts = 0
        self.calls: collections.deque[CallTime] = collections.deque(maxlen=32)   # the last calls, timed both sides

    # -- the shared block --
    @property
    def mapped(self) -> np.ndarray:
        """A snapshot of the kernel's mapped block (abi.MAPPED): a copy, so that no view outlives the block."""
        return self.words[HEADER:].copy()

    @property
    def grid(self) -> int:
        """Blocks of the kernel the worker runs (or last ran); 0 before any."""
        return int(self.words[W_GRID])

    def where_words(self) -> np.ndarray:
        o = HEADER + abi.mapped_offset("where")
        return self.words[o:o + self.grid].copy()

    def status(self) -> dict:
        o = HEADER + abi.mapped_offset("status")
        return {name: int(self.words[o + i]) for i, name in enumerate(abi.STATUS_WORDS)}

    def progress(self) -> int:
        return int(self.words[HEADER + abi.mapped_offset("progress")])

    def abort(self):
        """Ask a running kernel to stop at its next bounded wait (the host abort flag it polls)."""
        self.words[HEADER + abi.mapped_offset("host_abort")] = 1

    @property
    def phase(self) -> str:
        p = int(self.words[W_PHASE])
        return PHASES[p] if 0 <= p < len(PHASES) else f"phase {p}"

    # -- lifetime --
    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def start(self) -> float:
        """Start (or restart) the worker; returns the seconds it took to be ready."""
        t0 = time.perf_counter()
        self.spawn()
        self.wait_ready()
        return time.perf_counter() - t0

    def spawn(self):
        """Start a new worker process without waiting for it: it loads while the caller goes on (`wait_ready`, or
        the next call, waits for it)."""
        self.kill()
        self.words[:] = 0
        ctx = get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, self.shm.name, self.n_words, self.factory, self.args,
                                                     self.kwargs), daemon=True, name="workbench-gpu-worker")
        self.proc.start()
        child.close()
        self.starts += 1
        self._starting = True

    def wait_ready(self):
        if not self._starting:
            return
        self._starting = False
        deadline = time.monotonic() + self.start_s
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise WorkerFailure("crash", f"the GPU worker died while starting (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerFailure("hang", f"the GPU worker did not start within {self.start_s:.0f} s")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise WorkerFailure("crash", f"the GPU worker died while starting (exit code {self.proc.exitcode})")
        if kind != "ready":
            self.kill()
            raise _rebuild(payload)

    def kill(self):
        self._starting = False
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.proc = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(None)
                self.proc.join(5)
        self.kill()
        if self.shm is None:
            return
        self.words = None                                  # the view must go before the mapping can
        with contextlib.suppress(BufferError):             # a view still alive somewhere: the unlink frees it
            self.shm.close()
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()
        self.shm = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- calls --
    def call(self, method: str, *args, on_poll=None, **kwargs):
        """Run `service.method(*args, **kwargs)` in the worker and return its result, watching it (see the class).
        `on_poll(worker)` is called about every 20 ms while waiting (to stream tokens from the mapped block)."""
        if not self.alive:
            self.spawn()
        self.wait_ready()
        t0 = time.perf_counter()
        self.conn.send((method, args, kwargs))
        last_where, last_prog, last_move = None, -1, time.monotonic()
        compile_since = aborted_at = None
        hang_s = self.hang_s
        try:
            while True:
                msg = None
                if self.conn.poll(0.02):
                    try:
                        msg = self.conn.recv()
                    except (EOFError, OSError):
                        msg = None                        # it died: below
                if msg is not None:
                    kind, payload = msg
                    if kind == "ok":
                        result, inner = payload
                        name = args[1] if method == "at" and len(args) > 1 else method
                        self.calls.append(CallTime(name, time.perf_counter() - t0, inner))
                        return result
                    if kind == "fault":
                        if self.proc is not None:
                            self.proc.join(5)
                        code = payload[-1]
                        raise self._failure("fault", f"the kernel faulted: {STICKY.get(code, code)} "
                                                     f"({payload[1]})", t0)
                    e = _rebuild(payload)
                    if isinstance(e, KernelHang):         # its own barrier timed out and named the straggler
                        raise self._failure("hang", str(e), t0, kill=False) from None
                    if aborted_at is not None:            # we stopped it for want of progress: a hang it survived
                        raise self._failure("hang", f"no progress for {hang_s:.1f} s; the kernel stopped when "
                                                    f"asked ({e})", t0, kill=False)
                    raise e
                if on_poll is not None:
                    on_poll(self)
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    phase = self.phase
                    raise self._failure("crash" if phase != "compiling" else "compiler",
                                        f"the GPU worker died ({how}) while {phase}", t0)
                now = time.monotonic()
                phase = self.phase
                if phase == "compiling":
                    compile_since = compile_since or now
                    if now - compile_since > self.compile_s:
                        self.kill()
                        raise self._failure("compiler", f"the compiler ran past {self.compile_s:.0f} s", t0)
                    last_move = now
                    continue
                compile_since = None
                if phase != "running":
                    last_move = now
                    continue
                w, prog = self.where_words(), self.progress()
                if last_where is None or prog != last_prog or not np.array_equal(w, last_where):
                    self._prev_where = last_where
                    last_where, last_prog, last_move = w, prog, now
                    continue
                # a kernel's own barriers report a cooperative hang (naming the straggler) after their timeout:
                # leave them the time to
                hang_s = max(self.hang_s, self.words[W_TIMEOUT_MS] / 1000 + 1.0)
                status = self.status()
                reported = status.get("code", 0) == abi.ERRORS.index("hang")
                if aborted_at is None and (reported or now - last_move > hang_s):
                    # A grid frozen whole, even the blocks waiting at a barrier past their own timeout, with no
                    # report from them, is a fault: measured on the H200, a trap, an illegal address and an
                    # out-of-bounds shared store each halted every block at once, and no CUDA error reached the
                    # process in 15 s. Every hang (a spin, a skipped barrier, a sampler that never returns) left
                    # the waiting blocks' timeouts running, and they report it themselves.
                    if not reported and status.get("code", 0) == 0 and any(
                            (d := abi.decode_where(int(x))) is not None and d[3] for x in w):
                        raise self._failure("fault", f"the whole grid halted at once: blocks waiting at a barrier "
                                                     f"stopped for {now - last_move:.1f} s without their own "
                                                     f"timeout ({self.words[W_TIMEOUT_MS] / 1000:.1f} s) firing, "
                                                     f"as at a trap or a bad address (no CUDA error comes back "
                                                     f"from those for seconds, so the worker was killed). The "
                                                     f"block still inside its stage is the one that faulted", t0,
                                            status=status)
                    self.abort()                      # a reported hang stops at once if its straggler can
                    aborted_at = now
                elif aborted_at is not None and now - aborted_at > self.grace_s:
                    raise self._failure("hang", (f"no progress for {hang_s:.1f} s" if not reported else
                                                 "a barrier timed out") + " and the kernel did not stop when "
                                        "asked", t0, status=status)
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def _interrupted(self):
        """An interrupt while waiting: ask the kernel to stop; if it does, the worker answers and lives on."""
        self.abort()
        deadline = time.monotonic() + max(self.grace_s, 2.0)
        while time.monotonic() < deadline:
            if self.conn.poll(0.02):
                self.conn.recv()                          # the aborted call's answer: dropped
                return
            if not self.proc.is_alive():
                break
        self.kill()                                       # it would not stop: a new worker next time

    def _failure(self, kind, message, t0, status=None, kill: bool = True) -> WorkerFailure:
        blocks = self.blocks()
        status = status or self.status()
        if status.get("code") == abi.ERRORS.index("hang"):   # the kernel's own barrier report came first
            message += f"; the kernel's report: {abi.describe_hang(status)}"
        f = WorkerFailure(kind, message, blocks, status, time.perf_counter() - t0)
        f.killed = kill
        if kill:
            self.kill()
        return f

    def blocks(self) -> list[BlockState]:
        """Every block's last state as the shared block holds it now."""
        return block_states(self.where_words(), getattr(self, "_prev_where", None), self.grid)

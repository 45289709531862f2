"""The editing loop: edit a section, hot-reload it, verify every stage on its own inputs, watch per-stage timing.

    from workbench.loop.session import Workbench
    wb = Workbench("llama-3.2-1b")          # random weights on the GPU; registers itself as the active workbench
    wb.edit("lm_head", new_text)            # atomic write; the previous version goes to kernels/.history/
    rec = wb.reload()                       # assemble → compile → verify per stage → time → ReloadRecord
    print(rec.report()); print(rec.stages)  # one-line outcome; the stage outputs × layers table
    wb.undo("lm_head")                      # back to the previous version (and reload)
    wb.use_variant("qkv_rope_append", "split")   # build with kernels/sections/qkv_rope_append@split.cuh
    wb.compare({}, {"qkv_rope_append": "split"}) # A/B: both built, verified and timed, interleaved
    wb.watch()                              # reload whenever a section file is saved (e.g. from JupyterLab)
    wb.on_record.append(callback)           # dashboards: called with every ReloadRecord

One reload:
1. assemble + compile two builds from the files on disk (plus `overrides`): a debug build with taps (verification)
   and a timing build (%globaltimer stamps: its tok/s is what the record reports). A compile error leaves the last
   good kernels loaded and runnable; the record carries the messages (file, line, source line).
2. verify (workbench.check.verify): every stage of every layer, on its own inputs, over the runs that take every
   code path the plan declares (split thresholds, a long position, every sampler mode when `sampling` is the
   section at hand), then end to end.
3. time: a greedy run of the timing build from the verification's first prompt → tok/s and the per-stage table;
   its tokens must be the verified build's (the build that is timed is the build that was verified).

Where the builds run is a backend (workbench.loop.backends): the GPU, or, without one, compile-only builds and the
CPU reference (the record then says nothing was verified).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .. import paths, plan
from ..check.stage_check import Failure
from ..compiler.assemble import BuildOptions, numba_path, section_path, with_fields
from ..compiler.compile import CompileError
from ..compiler.numba_sections import is_numba_variant
from ..measure.timing import format_table
from ..model.config import get_config
from ..model.weights import load_prepared
from ..run.runtime import KernelError, Sampling
from ..run.worker import WorkerFailure
from .backends import CpuBackend, GpuBackend, WorkerBackend
from .records import (ASSEMBLE_ERROR, COMPILE_ERROR, NO_GPU, OK, RUN_ERROR, VERIFY_FAILED, WORKER_FAILURES, ABRecord,
                      ReloadRecord, format_compile_error)
from .sections import (checked_history_dir, display_path, section_file, section_history,  # noqa: F401 (the loop's API)
                       undo_section, write_section)
from .watch import Watcher

# ---- the active workbench (what the %%section magic talks to) ----------------------------------------------------
_ACTIVE: "Workbench | None" = None


# an edit of these runs every branch of the step's stop decision too (workbench.check.stops): a dozen short runs,
# which the other sections' edits cannot change
STOP_SECTIONS = ("publish", "monokernel")


def active() -> "Workbench | None":
    """The Workbench created last (with activate=True), or None."""
    return _ACTIVE


HOW_TO_CREATE = ("create one first, e.g.\n"
                 "    from workbench.loop.session import Workbench\n"
                 "    wb = Workbench(\"llama-3.2-1b\")   # or \"tiny\"; device=\"cpu\" for no GPU\n"
                 "(it registers itself as the active workbench)")


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def norm_variants(v) -> dict:
    """{section: variant} from a dict or ((section, variant), ...); None/"" variants mean the base file."""
    items = v.items() if isinstance(v, dict) else (v or ())
    out = {}
    for s, name in items:
        section_file(s, name or None)                 # validates both names
        if name:
            out[s] = name
    return out


# Tokens the timed build must reproduce only where the verified run's choice was clear: the two builds do the same
# arithmetic, but the verification build is compiled with NVRTC's -Ofc=min, which may contract a multiply-add
# differently and move a logit by an ulp.
CROSS_CHECK_MARGIN = 1e-3


class Workbench:
    """A model, its kernel builds, and the history of reloads. See the module docstring.

    model: preset name or HF folder; weights: HF folder (default: the model folder, else random weights with
    `seed`). device: "auto" (GPU when cupy sees one), "gpu" or "cpu". variants: {section: variant} to build with.
    time_steps: greedy steps of the timing run. parallel_compile: compile the two builds in two threads (default:
    when the machine has ≥ 4 cores). cpu_reference: in CPU mode, also run the CPU reference on every reload
    (default: for models under 0.5 GB). history_dir: where edits keep earlier versions (default kernels/.history).
    watch: start the file watcher. activate: become the workbench the %%section magic uses. build: reload once now
    (record trigger "initial"). build_options: further options for every build, BuildOptions fields or launch
    fields by the names with_fields takes (e.g. {"attn_min_chunk": 64}, {"early": "o_proj_residual"}).
    verify_fast_compile: NVRTC's fast-compile level (-Ofc) for the verification (taps) build: "min" (default)
    halves its compile and with it the loop's, at no cost to what verification sees (values, compared with
    tolerances); its speed, a quarter lower, is never measured. "0" compiles it like the timed build, which always
    is. isolate: run the GPU side in a worker process (default), so that a hang or a fault is
    reported and the worker replaced while this process lives on; hang_s: how long a kernel may show no progress
    before it counts as hung (its own barriers time out after half of that and name the straggler);
    compile_limit_s: a compile running longer than this is a compiler hang, and its worker is replaced (default:
    four times the last compile, at least 10 s). pipeline: compile the timed build in the background while the
    verification build is verified, so that the verdict (on_verdict, ReloadRecord.verdict_s) does not wait for the
    slower build (default); False compiles both before verifying. verify_units: build the verification build in
    units (workbench.compiler.units: one per stage, cached, linked), so that an edit recompiles only its section's
    (default; on the H200 edit → verdict 0.42 s against 1.57 s whole, every mutant still caught). The PTX and
    stream builds stay whole, as does any build where nvJitLink is missing; False builds it whole always."""

    def __init__(self, model: str = "llama-3.2-1b", *, weights: str | None = None, seed: int = 0,
                 max_seq: int | None = None, device: str = "auto", threads: int = 512, variants=None,
                 overrides: dict | None = None, verify_seed: int = 0, time_steps: int = 32, timeout_s: float = 5.0,
                 parallel_compile: bool | None = None, cpu_reference: bool | None = None,
                 history_dir: str | Path | None = None, watch: bool = False, activate: bool = True,
                 build: bool = True, progress: bool = False, build_options: dict | None = None,
                 verify_fast_compile: str = "min", isolate: bool = True, hang_s: float = 2.0,
                 compile_limit_s: float | None = None, pipeline: bool = True, verify_units: bool = True):
        global _ACTIVE
        if device not in ("auto", "gpu", "cpu"):
            raise ValueError(f"device must be auto, gpu or cpu, got {device!r}")
        Sampling.check_seed(seed, "seed")                   # refused here, not masked or failed on in a worker
        Sampling.check_seed(verify_seed, "verify_seed")
        if device == "auto":
            device = "gpu" if gpu_available() else "cpu"
        self.model, self.weights_path, self.seed = model, weights, seed
        self.cfg = get_config(model, max_seq=max_seq)
        self.threads = threads
        self.build_options = dict(build_options or {})      # more options for every build (with_fields)
        self.verify_fast_compile = verify_fast_compile
        self.verify_units = verify_units
        self.variants = norm_variants(variants)
        self.overrides: dict[str, str] = dict(overrides or {})
        self.verify_seed = verify_seed
        self.time_steps, self.timeout_s = time_steps, timeout_s
        self.history_dir = checked_history_dir(history_dir)     # a file there is refused now, not at the first edit
        self.progress = progress
        self.history: list[ReloadRecord] = []
        self.on_record: list[Callable[[ReloadRecord], None]] = []
        # called with the record as soon as verification has its verdict, while the timed build may still compile
        self.on_verdict: list[Callable[[ReloadRecord], None]] = []
        self.pipeline = pipeline
        self._lock = threading.RLock()
        self._reload_section: str | None = None           # the section the current reload is for, if any
        self._watcher = None
        if device == "gpu" and isolate:
            # the GPU in a worker process: a hang or a fault in an edit cannot take this process down
            self.backend = WorkerBackend(self.cfg, model=model, weights=weights, seed=seed, max_seq=self.cfg.max_seq,
                                         parallel=parallel_compile, timeout_s=min(timeout_s, hang_s / 2),
                                         verify_seed=verify_seed, hang_s=hang_s, compile_s=compile_limit_s)
        elif device == "gpu":
            import cupy
            self.backend = GpuBackend(self.cfg, loader=lambda: self._load(cupy), parallel=parallel_compile,
                                      timeout_s=timeout_s, verify_seed=verify_seed)
        else:
            import numpy
            self.backend = CpuBackend(self.cfg, loader=lambda: self._load(numpy), parallel=parallel_compile,
                                      cpu_reference=cpu_reference, verify_seed=verify_seed)
        if activate:
            _ACTIVE = self
        if build:
            self.reload(trigger="initial")
        if watch:
            self.watch()

    @property
    def device(self) -> str:
        return self.backend.device

    @property
    def parallel_compile(self) -> bool:
        return self.backend.parallel

    @parallel_compile.setter
    def parallel_compile(self, v: bool):
        self.backend.parallel = bool(v)

    # -- model and builds ------------------------------------------------------------------------------------------
    def _load(self, xp):
        """The prepared weights, where the backend runs (cupy on the GPU, numpy on the CPU)."""
        return load_prepared(self.model, self.weights_path, seed=self.seed, xp=xp, max_seq=self.cfg.max_seq,
                             progress=self.progress)

    @property
    def p(self):
        """The prepared weights (on the GPU in GPU mode; loaded on first use in CPU mode)."""
        return self.backend.p if self.device == "gpu" else self.backend.prepared

    @property
    def debug(self):
        """The debug build (taps) on the GPU, or None."""
        return getattr(self.backend, "kernels", {}).get("debug")

    @property
    def timed(self):
        """The timing build on the GPU, or None."""
        return getattr(self.backend, "kernels", {}).get("timed")

    stamps = None                       # the last timed run's stamps (Timing.stamps), for the dashboards

    @property
    def last(self) -> ReloadRecord | None:
        return self.history[-1] if self.history else None

    def options(self, which: str, variants=None) -> BuildOptions:
        v = self.variants if variants is None else norm_variants(variants)
        fast = {"fast_compile": self.verify_fast_compile, "units": self.verify_units} if which == "debug" else {}
        return with_fields(**{"sampler": self._sampler(v), **fast, **self.build_options, "threads": self.threads,
                              "taps": which == "debug", "timing": which == "timed",
                              "variants": tuple(sorted(v.items()))})

    def _builds(self, variants=None) -> dict:
        return {name: self.options(name, variants) for name in ("debug", "timed")}

    def _sampler(self, variants: dict) -> str:
        """The loop runs greedy decoding only (verification and timing), so its builds leave out the temperature /
        top-k / top-p sampler: a fifth of the compile time. They keep it while the sampling section is the one
        being edited, overridden or swapped for a variant, so an edit there is compiled and every sampler mode
        verified (build_options can force either)."""
        touched = self._reload_section == "sampling" or "sampling" in self.overrides or "sampling" in variants
        return "full" if touched else "greedy"

    def build_files(self) -> set[Path]:
        """The files the current builds read (the watcher reloads when one of them changes)."""
        files = [paths.kernels_dir() / "portability.cuh"]
        files += [section_path(s, self.variants.get(s)) for s in plan.FILES if s not in self.overrides]
        files += [numba_path(s, v) for s, v in self.variants.items() if is_numba_variant(v)]
        return {f.resolve() for f in files}

    # -- the loop ------------------------------------------------------------------------------------------------
    def reload(self, *, trigger: str = "manual", section: str | None = None, variant: str | None = None,
               verify: bool = True, timing: bool = True) -> ReloadRecord:
        """assemble → compile → verify per stage → time → record (appended to history, sent to on_record)."""
        with self._lock:
            t0 = time.perf_counter()
            rec = ReloadRecord(time.time(), trigger, section, variant, tuple(sorted(self.variants.items())))
            self._reload_section = section
            builds = self._builds()
            rec.sampler = builds["timed"].sampler
            # the timed build compiles beside verification (it takes longest, and the verdict needs only the
            # verification build); it must have compiled before anything is timed or the round counts as good
            defer = ("timed",) if self.pipeline and timing else ()
            try:
                rec.compile_s = self.backend.build(builds, self.overrides, defer)
            except WorkerFailure as f:
                self._failed(rec, f)
            except CompileError as e:
                rec.status, rec.error, rec.messages = COMPILE_ERROR, format_compile_error(e), list(e.messages)
            except (ValueError, FileNotFoundError, OSError) as e:      # #include refused, missing variant file ...
                rec.status, rec.error = ASSEMBLE_ERROR, f"{type(e).__name__}: {e}"
            except Exception as e:                                      # not resident, driver errors
                rec.status, rec.error = RUN_ERROR, f"{type(e).__name__}: {e}"
            if rec.status != OK:
                rec.compile_s = time.perf_counter() - t0
            else:
                rec.key = self.backend.key("debug")
                if self.device == "cpu":
                    rec.status = NO_GPU
                try:
                    v = self._verify_into(rec, section == "sampling", section in STOP_SECTIONS) if verify else None
                    if verify:
                        rec.verdict_s = time.perf_counter() - t0
                        self._tell(self.on_verdict, rec)
                    timed_in = self._finish_into(rec)
                    if timed_in and timing and self.device == "gpu":
                        self._time_into(rec, v)
                except WorkerFailure as f:
                    self._failed(rec, f)
                else:
                    if hasattr(self.backend, "mark_good") and timed_in:     # a round put back is not good
                        self.backend.mark_good()
            rec.total_s = time.perf_counter() - t0
            self.history.append(rec)
            self._tell(self.on_record, rec)
            return rec

    def _failed(self, rec: ReloadRecord, f):
        """The worker hung, faulted or died: the record says so, with every block's state; a new worker already
        holds the last good kernels (WorkerBackend.recover)."""
        rec.status, rec.passed, rec.error = WORKER_FAILURES[f.kind], False, str(f)
        rec.first_failure = f.message
        rec.blocks, rec.detect_s = f.blocks, f.seconds
        rec.restart_s = getattr(self.backend, "restart_s", None)

    def _finish_into(self, rec: ReloadRecord) -> bool:
        """The timed build, compiled in the background, in place → whether it compiled. If it did not, the round
        is a compile error and every build goes back to the last good one (the verdict already given stands for
        the verification build only)."""
        verified = ("" if rec.passed is None else "; its verification had passed" if rec.passed else
                    f"; its verification had failed: {rec.first_failure}")
        try:
            rec.timed_compile_s = self.backend.finish()
        except WorkerFailure:
            raise
        except CompileError as e:
            rec.status, rec.messages = COMPILE_ERROR, list(e.messages)
            rec.error = (f"the timed build did not compile (the verification build did{verified}); both builds "
                         f"are back to the last good ones\n" + format_compile_error(e))
            return False
        except Exception as e:                 # assembly refused, not resident, driver errors: as build's would be
            rec.status = ASSEMBLE_ERROR if isinstance(e, (ValueError, FileNotFoundError, OSError)) else RUN_ERROR
            rec.error = (f"the timed build failed (the verification build compiled{verified}); both builds are back "
                         f"to the last good ones: {type(e).__name__}: {e}")
            return False
        rec.resources = self.backend.resources("timed")
        return True

    @staticmethod
    def _tell(callbacks: list, rec: ReloadRecord):
        for cb in list(callbacks):
            try:
                cb(rec)
            except Exception as e:               # a dashboard's bug must not break the loop
                print(f"workbench: callback {getattr(cb, '__name__', cb)!r} failed: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)

    def verify(self, sampling: bool = False, stops: bool = False):
        """Verify the debug build now (stage by stage, a repeat of the first run, every branch of the stop decision
        with `stops`, then end to end) → backends.Verdict."""
        with self._lock:
            return self.backend.verify(sampling=sampling, stops=stops)

    def _verify_into(self, rec: ReloadRecord, sampling: bool, stops: bool = False):
        t0 = time.perf_counter()
        try:
            v = self.backend.verify(sampling=sampling, stops=stops)
        except KernelError as e:
            rec.status, rec.passed, rec.error = RUN_ERROR, False, f"{type(e).__name__}: {e}"
            rec.first_failure = f"the debug run stopped: {e}"
            rec.verify_s = time.perf_counter() - t0
            where = getattr(e, "where", None)
            if where is not None:                       # the kernel named the stage itself (a weight-stream report)
                rec.failure = Failure(where[0], "-", where[1], where[2], -1, float("nan"), str(e))
            return None
        rec.verify_s = v.seconds
        if self.device == "cpu":
            return v
        rec.stages, rec.failure, rec.tokens_ok, rec.end_to_end = v.table, v.failure, v.tokens_ok, v.end_to_end
        rec.passed, rec.first_failure = v.passed, v.first_failure
        if not v.passed:
            rec.status = VERIFY_FAILED
        return v

    def time_run(self, steps: int | None = None, prompt=None):
        """A greedy run of the timing build → backends.Timing."""
        with self._lock:
            return self.backend.time(steps or self.time_steps, prompt)

    def time_to_first_token(self, prompt_len: int = 4096, repeats: int = 3, first: str = "prefill"):
        """Time to first token of a random prompt of `prompt_len` tokens, reported apart from decode tok/s: the
        batched prefill (workbench.run.prefill) into the timed build's cache and its last logits' first largest,
        or with first="kernel" the timed build's first step from the prompt's last token; the median of
        `repeats` runs and the prefill's milliseconds by stage (backends.FirstToken). None without a GPU."""
        with self._lock:
            return self.backend.ttft(prompt_len, repeats, first)

    def _time_into(self, rec: ReloadRecord, v):
        t0 = time.perf_counter()
        try:
            tm = self.backend.time(self.time_steps, v.prompt if v is not None else None)
            rec.tok_per_s, rec.timing = tm.tok_per_s, tm.rows
            self.stamps = tm.stamps                     # the latest run's only (a record keeps its table)
            rec.timing_text = format_table(tm.rows, tok_s=tm.tok_per_s) if tm.rows else None
            if v is not None and v.tokens and rec.status == OK:
                # the build that is timed must compute what the verified build computed
                for i, (a, b) in enumerate(zip(v.tokens, tm.tokens)):
                    if a != b and (i >= len(v.margins) or v.margins[i] > CROSS_CHECK_MARGIN):
                        rec.status, rec.passed = VERIFY_FAILED, False
                        rec.first_failure = (f"the timed build generates token {b} at step {i} where the verified "
                                             f"(taps) build generates {a}: the two builds compute different things")
                        break
        except KernelError as e:
            if rec.status == OK:
                rec.status = RUN_ERROR
            rec.error = (rec.error + "; " if rec.error else "") + f"timing run: {type(e).__name__}: {e}"
        rec.time_s = time.perf_counter() - t0

    # -- editing ---------------------------------------------------------------------------------------------------
    def edit(self, section: str, text: str, variant: str | None = None, *, base: str | None = None,
             python: bool = False) -> Path | None:
        """Write a section (atomically, byte for byte; the previous version saved for undo). Does not reload: call
        reload(), or let the watcher do it. Returns the history entry (None: the text was already there).

        Edits of one kernels folder are serialised across Workbench objects and processes (sections.edit_lock), so
        none is lost. base: the text the edit was made from; if the file has changed since (another Workbench,
        process or editor), the edit is refused, not merged: a SourceError names the file and where the refused
        text was kept (sections.write_section). A NUL or a file on disk that is not UTF-8 is refused too.
        python: the numba variant's .py (its device functions) rather than its .cuh."""
        with self._lock, self._watch_paused():
            entry = write_section(section, text, variant, history_dir=self.history_dir, base=base, python=python)
            self._watch_sync()
            return entry

    def undo(self, section: str, variant: str | None = None, *, reload: bool = True,
             python: bool = False) -> ReloadRecord | None:
        """Restore the section's previous version, byte for byte (the replaced text kept as *.undone.cuh); then
        reload (unless reload=False). LookupError when there is none; SourceError for a file that is not UTF-8.
        python: the numba variant's .py."""
        with self._lock:
            with self._watch_paused():
                undo_section(section, variant, history_dir=self.history_dir, python=python)
                self._watch_sync()
            return self.reload(trigger="undo", section=section, variant=variant) if reload else None

    def section_history(self, section: str, variant: str | None = None, *, python: bool = False) -> list[Path]:
        """The section's undo stack in this workbench's history folder, oldest first (python: a numba variant's
        .py)."""
        return section_history(section, variant, history_dir=self.history_dir, python=python)

    def use_variant(self, section: str, variant: str | None, *, reload: bool = True) -> ReloadRecord | None:
        """Build `section` from its NAME@VARIANT.cuh file (NAME@VARIANT.ptx for a variant named ptx..., its body in
        PTX; None: the base file); then reload."""
        section_file(section, variant)
        with self._lock:
            if variant:
                self.variants[section] = variant
            else:
                self.variants.pop(section, None)
            return self.reload(trigger="variant", section=section, variant=variant) if reload else None

    # -- A/B -------------------------------------------------------------------------------------------------------
    def compare(self, a_variants=None, b_variants=None, *, tokens: int = 128, repeats: int = 5,
                verify: bool = True) -> ABRecord:
        """Build the two variant selections ({section: variant} or pairs; {} is the base files), verify each with
        the debug build, and time both (timing builds, `repeats` interleaved runs of `tokens` greedy steps, median
        tok/s). The workbench's own builds are left as they were."""
        a, b = norm_variants(a_variants), norm_variants(b_variants)
        with self._lock:
            out = self.backend.ab(self._builds(a), self._builds(b), self.overrides, tokens=tokens, repeats=repeats,
                                  verify=verify)
        oa, ob = out["a"], out["b"]
        if self.device != "gpu":
            return ABRecord(tuple(sorted(a.items())), tuple(sorted(b.items())), None, None, [], [], None, None,
                            None, None, None, None, oa["error"] or NO_GPU, ob["error"] or NO_GPU)
        return ABRecord(tuple(sorted(a.items())), tuple(sorted(b.items())), oa["tok_s"], ob["tok_s"], oa["runs"],
                        ob["runs"], oa["passed"], ob["passed"], oa["failure"], ob["failure"], oa["rows"], ob["rows"],
                        oa["error"], ob["error"], oa["stages"], ob["stages"])

    # -- watching --------------------------------------------------------------------------------------------------
    def watch(self, interval_s: float = 0.2, debounce_s: float = 0.3):
        """Reload whenever a file of the current build changes on disk (saved from JupyterLab's editor, say)."""
        if self.watching:
            return self._watcher
        self._watcher = Watcher(self._on_files_changed, interval_s=interval_s, debounce_s=debounce_s)
        self._watcher.start()
        return self._watcher

    def unwatch(self):
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    @property
    def watching(self) -> bool:
        return self._watcher is not None and self._watcher.running

    def _watch_paused(self):
        return self._watcher.paused() if self._watcher is not None else contextlib.nullcontext()

    def _watch_sync(self):
        if self._watcher is not None:
            self._watcher.sync()

    def _on_files_changed(self, changed: list[Path]):
        used = self.build_files()
        hit = [p for p in changed if Path(p).resolve() in used]
        if not hit:
            return None
        # one file: the reload names its section (and variant, NAME@VARIANT); several: a reload of everything
        section, _, variant = Path(hit[0]).stem.partition("@") if len(hit) == 1 else (None, "", None)
        return self.reload(trigger="watch", section=section, variant=variant or None)

    # -- lifetime --------------------------------------------------------------------------------------------------
    def close(self):
        """Stop watching, drop the kernels, and stop being the active workbench."""
        global _ACTIVE
        self.unwatch()
        self.backend.close()
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        last = self.last.status if self.last else "not built"
        v = ", ".join(f"{s}@{x}" for s, x in sorted(self.variants.items())) or "base sections"
        return f"<Workbench {self.cfg.name} on {self.device}, {v}, {len(self.history)} reloads, last: {last}>"


__all__ = ["Workbench", "active", "write_section", "undo_section", "section_history", "section_file",
           "display_path", "ReloadRecord", "ABRecord", "OK", "VERIFY_FAILED", "COMPILE_ERROR", "ASSEMBLE_ERROR",
           "RUN_ERROR", "NO_GPU"]

"""The editing loop: edit a section, hot-reload it, verify every stage, watch per-stage timing.

    from workbench.loop.session import Workbench
    wb = Workbench("llama-3.2-1b")          # random weights on the GPU; registers itself as the active workbench
    wb.edit("lm_head", new_text)            # atomic write; the previous version goes to kernels/.history/
    rec = wb.reload()                       # assemble → compile → verify per stage → time → ReloadRecord
    print(rec.report()); print(rec.stages)  # one-line outcome; the stages × layers table
    wb.undo("lm_head")                      # back to the previous version (and reload)
    wb.use_variant("qkv_rope_append", "split")   # build with kernels/sections/qkv_rope_append@split.cuh
    wb.compare({}, {"qkv_rope_append": "split"}) # A/B: both built, verified and timed, interleaved
    wb.watch()                              # reload whenever a section file is saved (e.g. from JupyterLab)
    wb.on_record.append(callback)           # dashboards: called with every ReloadRecord

One reload:
1. assemble + compile two builds from the files on disk (plus `overrides`): a debug build with taps (verification)
   and a timing build (%globaltimer stamps: its tok/s is what the record reports; loop_benchmark measures how far
   that is from a plain build's).
   They compile in parallel threads (NVRTC releases the GIL). A compile error leaves the last good kernels loaded
   and runnable; the record carries the messages (file, line, source line).
2. verify: a short random prompt, a few greedy tokens; every stage of every layer of the last steps is tapped and
   compared with the reference (workbench.taps: same names, per-tap tolerances, first failing stage).
3. time: a short greedy run of the timing build → tok/s and the per-stage table (workbench.timing).

Without a GPU (device="cpu", or none visible) the loop compiles both builds to sm_90 cubins with NVRTC
(workbench.compile.compile_cubin: errors, registers, spills) and runs the CPU reference for the verification tokens;
the record's status is "compiled; no GPU to run". That is what notebooks do on a CPU.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .. import paths
from ..build import assemble as _asm
from ..build.assemble import SECTIONS, BuildOptions
from ..build.compile import CompileError
from ..model.config import get_config

# ---- the active workbench (what the %%section magic talks to) ----------------------------------------------------
_ACTIVE: "Workbench | None" = None


def active() -> "Workbench | None":
    """The Workbench created last (with activate=True), or None."""
    return _ACTIVE


HOW_TO_CREATE = ("create one first, e.g.\n"
                 "    import workbench.loop.session\n"
                 "    wb = workbench.session.Workbench(\"llama-3.2-1b\")   # or \"tiny\"; device=\"cpu\" for no GPU\n"
                 "(it registers itself as the active workbench)")

# ---- section files: atomic writes with history --------------------------------------------------------------------
_VARIANT_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_last_ns = 0
_ns_lock = threading.Lock()


def history_root() -> Path:
    """kernels/.history (git-ignored): earlier versions of every edited section."""
    return paths.history_dir()


def section_file(section: str, variant: str | None = None) -> Path:
    """The file of a section (or of one of its variants); 'monokernel' is kernels/monokernel.cuh."""
    if section == "monokernel":
        if variant:
            raise ValueError("kernels/monokernel.cuh has no variants (assemble reads that one file)")
        return paths.kernels_dir() / "monokernel.cuh"
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}; sections: {', '.join(SECTIONS)}, monokernel")
    if variant is not None and (not _VARIANT_RE.match(variant) or variant in (".", "..")):
        raise ValueError(f"variant names are letters, digits, '_', '-', '.': got {variant!r}")
    return _asm.section_path(section, variant)


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


def format_compile_error(e: CompileError, limit: int = 12) -> str:
    """file:line: error: text, each followed by the numbered source line; warnings left out."""
    out = []
    for f, n, sev, text, src in e.messages:
        if sev != "error":
            continue
        out.append(f"{f}:{n}: error: {text}")
        if src:
            out.append(f"  {n:5d} | {src.rstrip()}")
    if not out:
        return str(e)
    more = len(out) // 2 - limit
    return "\n".join(out[:2 * limit]) + (f"\n  ... and {more} more errors" if more > 0 else "")


# ---- records --------------------------------------------------------------------------------------------------
OK, VERIFY_FAILED, COMPILE_ERROR, ASSEMBLE_ERROR, RUN_ERROR, NO_GPU = (
    "ok", "verify failed", "compile error", "assemble error", "run error", "compiled; no GPU to run")


@dataclasses.dataclass
class ReloadRecord:
    """What one reload did. Times in seconds; nan where the step did not run."""
    time: float                           # wall clock at the start (time.time())
    trigger: str                          # initial | manual | edit | magic | undo | watch | variant
    section: str | None                   # the section whose edit triggered it, if known
    variant: str | None
    variants: tuple                       # ((section, variant), ...) in force
    status: str = OK                      # OK, VERIFY_FAILED, COMPILE_ERROR, ASSEMBLE_ERROR, RUN_ERROR or NO_GPU
    compile_s: float = math.nan
    verify_s: float = math.nan
    time_s: float = math.nan
    total_s: float = math.nan
    passed: bool | None = None            # None: not verified (no GPU, or no kernel)
    first_failure: str | None = None      # one line: "q at layer 0 (qkv_rope_append), step 3: rel err ..."
    failure: object = None                # workbench.taps.Failure, structured
    tok_per_s: float | None = None
    error: str | None = None              # compile error (file:line + source line) or the run error
    messages: list = dataclasses.field(default_factory=list)   # CompileError.messages
    stages: object = None                 # workbench.taps.StageTable
    timing: list | None = None            # [workbench.timing.StageRow]
    timing_text: str | None = None
    key: str | None = None                # assembled source key of the debug build
    resources: dict | None = None
    tokens_ok: bool | None = None         # greedy tokens equal the reference's argmax where judgeable
    sampler: str | None = None            # the builds' sampler: "greedy" (argmax only) or "full"

    @property
    def ok(self) -> bool:
        return self.status in (OK, NO_GPU)

    def report(self) -> str:
        """A short human-readable account: one line, plus the errors."""
        what = self.section + (f"@{self.variant}" if self.variant else "") if self.section else "reload"
        if self.status in (COMPILE_ERROR, ASSEMBLE_ERROR):
            return (f"✗ {what}: {self.status} after {self.compile_s:.2f} s; the last good kernel stays loaded\n"
                    f"{self.error}")
        parts = [f"compiled {self.compile_s:.2f} s"]
        if self.status == NO_GPU:
            r = self.resources or {}
            if r:
                parts.append(f"{r.get('registers')} registers, {r.get('local_bytes', 0)} B local")
            if not math.isnan(self.verify_s):
                parts.append(f"CPU reference {self.verify_s:.2f} s")
            return f"✓ {what}: " + ", ".join(parts) + " (no GPU to run)"
        if self.stages is not None:
            parts.append(f"verified {self.verify_s:.2f} s")
        if self.tok_per_s:
            parts.append(f"{self.tok_per_s:,.0f} tok/s (timed {self.time_s:.2f} s)")
        parts.append(f"total {self.total_s:.2f} s")
        line = ", ".join(parts)
        if self.status == OK:
            return f"✓ {what}: {line}; all stages within tolerance"
        if self.status == VERIFY_FAILED:
            return f"✗ {what}: VERIFY FAILED: first divergence {self.first_failure}\n  {line}; table: wb.last.stages"
        return f"✗ {what}: {self.status}: {self.error}\n  {line}"

    def to_dict(self) -> dict:
        """Plain Python for dashboards and JSON (NaN/inf become None)."""
        def num(v):
            return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
        d = {k: getattr(self, k) for k in ("time", "trigger", "section", "variant", "status", "passed",
                                           "first_failure", "error", "key", "tokens_ok", "sampler")}
        d.update({k: num(getattr(self, k)) for k in ("compile_s", "verify_s", "time_s", "total_s", "tok_per_s")})
        d["variants"] = [list(v) for v in self.variants]
        d["messages"] = [list(m) for m in self.messages]
        d["resources"] = dict(self.resources) if self.resources else None
        d["stages"] = self.stages.to_dict(json_safe=True) if self.stages is not None else None
        d["timing"] = _rows(self.timing)
        d["timing_text"] = self.timing_text
        d["report"] = self.report()
        return d


@dataclasses.dataclass
class ABRecord:
    """compare(): two variant selections built, verified and timed side by side (runs interleaved)."""
    a: tuple
    b: tuple
    a_tok_s: float | None
    b_tok_s: float | None
    a_runs: list
    b_runs: list
    a_passed: bool | None
    b_passed: bool | None
    a_failure: str | None
    b_failure: str | None
    a_timing: list | None
    b_timing: list | None
    a_error: str | None = None
    b_error: str | None = None
    a_stages: object = None
    b_stages: object = None

    @property
    def speedup(self) -> float | None:
        return self.b_tok_s / self.a_tok_s if self.a_tok_s and self.b_tok_s else None

    def stage_deltas(self) -> list[tuple[str, float, float]]:
        """(stage, µs/token of A, µs/token of B)."""
        if not self.a_timing or not self.b_timing:
            return []
        b = {r.stage: r.us_per_token for r in self.b_timing}
        return [(r.stage, r.us_per_token, b.get(r.stage, math.nan)) for r in self.a_timing]

    def report(self) -> str:
        def name(v):
            return ", ".join(f"{s}@{x}" for s, x in v) or "base"
        lines = []
        for tag, v, tps, ok, fail, err in (("A", self.a, self.a_tok_s, self.a_passed, self.a_failure, self.a_error),
                                          ("B", self.b, self.b_tok_s, self.b_passed, self.b_failure, self.b_error)):
            state = err or ("verified" if ok else f"VERIFY FAILED: {fail}" if ok is False else "not verified")
            lines.append(f"{tag} ({name(v)}): " + (f"{tps:,.0f} tok/s, " if tps else "") + state)
        if self.speedup:
            lines.append(f"B/A: {self.speedup:.3f}× ({100 * (self.speedup - 1):+.1f}%)")
        for stage, ua, ub in self.stage_deltas():
            lines.append(f"  {stage:18s} {ua:8.1f} → {ub:8.1f} µs/token ({ub - ua:+.1f})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        rows = _rows
        return {"a": [list(v) for v in self.a], "b": [list(v) for v in self.b], "a_tok_s": self.a_tok_s,
                "b_tok_s": self.b_tok_s, "a_runs": list(self.a_runs), "b_runs": list(self.b_runs),
                "speedup": self.speedup, "a_passed": self.a_passed, "b_passed": self.b_passed,
                "a_failure": self.a_failure, "b_failure": self.b_failure, "a_error": self.a_error,
                "b_error": self.b_error, "a_timing": rows(self.a_timing), "b_timing": rows(self.b_timing),
                "a_stages": self.a_stages.to_dict(json_safe=True) if self.a_stages is not None else None,
                "b_stages": self.b_stages.to_dict(json_safe=True) if self.b_stages is not None else None,
                "report": self.report()}


def _rows(timing) -> list | None:
    """[StageRow] → plain dicts."""
    return [{**dataclasses.asdict(r), "spread": list(r.spread)} for r in timing] if timing else None


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _norm_variants(v) -> dict:
    """{section: variant} from a dict or ((section, variant), ...); None/"" variants mean the base file."""
    items = v.items() if isinstance(v, dict) else (v or ())
    out = {}
    for s, name in items:
        section_file(s, name or None)                 # validates both names
        if name:
            out[s] = name
    return out


def _texts_of(asm) -> dict:
    """{section: text} of an assembled source: enough overrides to rebuild exactly it (portability.cuh aside)."""
    out = {}
    for _, path, text in asm.pieces:
        if path.startswith("<"):
            continue
        stem = Path(path).stem.split("@")[0]
        if stem in SECTIONS or stem == "monokernel":
            out[stem] = text
    return out


# ---- the workbench ----------------------------------------------------------------------------------------------

class Workbench:
    """A model, its kernel builds, and the history of reloads. See the module docstring.

    model: preset name or HF folder; weights: HF folder (default: the model folder, else random weights with
    `seed`). device: "auto" (GPU when cupy sees one), "gpu" or "cpu". variants: {section: variant} to build with.
    verify_prompt, verify_tokens: the verification run (random prompt of that many tokens, then that many greedy
    tokens; the steps that produce those tokens are tapped). time_steps: greedy steps of the timing run.
    parallel_compile: compile the two builds in two threads (default: when the machine has ≥ 4 cores).
    cpu_reference: in CPU mode, also run the CPU reference on every reload (default: for models under 0.5 GB).
    history_dir: where edits keep earlier versions (default kernels/.history). watch: start the file watcher.
    activate: become the workbench the %%section magic uses. build: reload once now (record trigger "initial").
    build_options: further BuildOptions fields for every build (e.g. {"attn_min_chunk": 64}).
    verify_fast_compile: NVRTC's fast-compile level (-Ofc) for the verification (taps) build: "min" (default) halves
    its compile and with it the loop's, at no cost to what verification sees (values, compared with tolerances);
    its speed, a quarter lower, is never measured. "0" compiles it like the timed build, which always is."""

    def __init__(self, model: str = "llama-3.2-1b", *, weights: str | None = None, seed: int = 0,
                 max_seq: int | None = None, device: str = "auto", threads: int = 512, variants=None,
                 overrides: dict | None = None, verify_prompt: int = 4, verify_tokens: int = 4,
                 verify_seed: int = 0, time_steps: int = 32, timeout_s: float = 5.0,
                 parallel_compile: bool | None = None, cpu_reference: bool | None = None,
                 history_dir: str | Path | None = None, watch: bool = False, activate: bool = True,
                 build: bool = True, progress: bool = False, build_options: dict | None = None,
                 verify_fast_compile: str = "min"):
        global _ACTIVE
        if device not in ("auto", "gpu", "cpu"):
            raise ValueError(f"device must be auto, gpu or cpu, got {device!r}")
        if device == "auto":
            device = "gpu" if _gpu_available() else "cpu"
        self.device = device
        self.model, self.weights_path, self.seed = model, weights, seed
        self.cfg = get_config(model, max_seq=max_seq)
        self.threads = threads
        self.build_options = dict(build_options or {})      # more BuildOptions fields for every build
        self.verify_fast_compile = verify_fast_compile
        self.variants = _norm_variants(variants)
        self.overrides: dict[str, str] = dict(overrides or {})
        self.verify_prompt, self.verify_tokens, self.verify_seed = verify_prompt, verify_tokens, verify_seed
        if verify_prompt < 1 or verify_tokens < 1:
            raise ValueError("verify_prompt and verify_tokens must be ≥ 1")
        self.time_steps, self.timeout_s = time_steps, timeout_s
        self.parallel_compile = (os.cpu_count() or 1) >= 4 if parallel_compile is None else parallel_compile
        self.cpu_reference = (self.cfg.weight_bytes_per_token() < 5e8) if cpu_reference is None else cpu_reference
        self.history_dir = Path(history_dir) if history_dir is not None else None
        self.progress = progress
        self.history: list[ReloadRecord] = []
        self.on_record: list[Callable[[ReloadRecord], None]] = []
        self.last_reference: dict | None = None           # CPU mode: the reference taps of the verification run
        self._lock = threading.RLock()
        self._kernels: dict = {}                           # "debug" / "timed" → Monokernel (GPU)
        self.cubins: dict = {}                             # "debug" / "timed" → (key, cubin, resources) (CPU)
        self._compiled: dict = {}                          # CPU: source key → (cubin, resources)
        self._p = None
        self._ref = None
        self._reload_section: str | None = None           # the section the current reload is for, if any
        self._watcher = None
        self._dev_id = None
        if device == "gpu":
            import cupy
            self._dev_id = cupy.cuda.Device().id
            self._load_weights()
            self.reference.prepare()                      # torch tensors now, not inside the first reload
        if activate:
            _ACTIVE = self
        if build:
            self.reload(trigger="initial")
        if watch:
            self.watch()

    # -- model and builds ------------------------------------------------------------------------------------------
    def _load_weights(self):
        from ..model.weights import load, prepare
        if self.device == "gpu":
            import cupy
            xp = cupy
        else:
            xp = np
        w = load(self.model, self.weights_path, seed=self.seed, xp=xp, max_seq=self.cfg.max_seq,
                 progress=self.progress)
        self._p = prepare(w, xp=xp, progress=self.progress)
        del w

    @property
    def p(self):
        """The prepared weights (on the GPU in GPU mode; loaded on first use in CPU mode)."""
        if self._p is None:
            self._load_weights()
        return self._p

    @property
    def reference(self):
        """The TapReference the verification compares against (weights converted once)."""
        if self._ref is None:
            from ..check.taps import TapReference
            self._ref = TapReference(self.p)
        return self._ref

    @property
    def debug(self):
        """The debug build (taps) on the GPU, or None."""
        return self._kernels.get("debug")

    @property
    def timed(self):
        """The timing build on the GPU, or None."""
        return self._kernels.get("timed")

    @property
    def last(self) -> ReloadRecord | None:
        return self.history[-1] if self.history else None

    def options(self, which: str, variants=None) -> BuildOptions:
        v = self.variants if variants is None else _norm_variants(variants)
        fast = {"fast_compile": self.verify_fast_compile} if which == "debug" else {}
        return BuildOptions(**{"sampler": self._sampler(v), **fast, **self.build_options, "threads": self.threads,
                               "taps": which == "debug", "timing": which == "timed",
                               "variants": tuple(sorted(v.items()))})

    def _sampler(self, variants: dict) -> str:
        """The loop runs greedy decoding only (verification and timing), so its builds leave out the temperature /
        top-k / top-p sampler: a fifth of the compile time. They keep it while the sampling section is the one
        being edited, overridden or swapped for a variant, so an edit there is compiled (build_options can force
        either)."""
        touched = self._reload_section == "sampling" or "sampling" in self.overrides or "sampling" in variants
        return "full" if touched else "greedy"

    def build_files(self) -> set[Path]:
        """The files the current builds read (the watcher reloads when one of them changes)."""
        files = {paths.kernels_dir() / "portability.cuh"}
        if "monokernel" not in self.overrides:
            files.add(paths.kernels_dir() / "monokernel.cuh")
        for s in SECTIONS:
            if s not in self.overrides:
                files.add(_asm.section_path(s, self.variants.get(s)))
        return {f.resolve() for f in files}

    def _map(self, fn, items):
        """fn over items, in threads when parallel_compile; returns [(result, exception)]."""
        def safe(x):
            try:
                return fn(x), None
            except BaseException as e:            # noqa: BLE001 - reported per build
                return None, e
        if self.parallel_compile and len(items) > 1:
            with concurrent.futures.ThreadPoolExecutor(len(items)) as ex:
                return list(ex.map(safe, items))
        return [safe(x) for x in items]

    def _gpu_ctx(self):
        if self.device != "gpu":
            return contextlib.nullcontext()
        import cupy
        return cupy.cuda.Device(self._dev_id)

    def _build_gpu(self, names=("debug", "timed")) -> float:
        """Compile the builds; all or nothing: if one fails, the others go back to what they were."""
        from ..run.runtime import Monokernel
        overrides = dict(self.overrides)
        before = {n: (mk.opt, _texts_of(mk.asm)) for n, mk in self._kernels.items()}

        def one(name):
            with self._gpu_ctx():
                opt = self.options(name)
                mk = self._kernels.get(name)
                t0 = time.perf_counter()
                if mk is None:
                    steps = self.verify_prompt + self.verify_tokens - 1 if name == "debug" else self.time_steps + 8
                    mk = Monokernel(self.p, opt, overrides=overrides, max_steps=max(64, steps),
                                    max_record=max(64, self.verify_tokens))
                    return name, mk, time.perf_counter() - t0
                mk.reload(opt, overrides)
                return name, mk, time.perf_counter() - t0
        t0 = time.perf_counter()
        results = self._map(one, list(names))
        if self.parallel_compile and any(e is not None and not isinstance(e, CompileError) for _, e in results):
            # not a compile error: in case it came from building in threads, once more one after the other
            results = [(r, None) if e is None else self._map(one, [n])[0]
                       for n, (r, e) in zip(names, results, strict=True)]
        wall = time.perf_counter() - t0
        errors = [e for _, e in results if e is not None]
        if errors:
            for res, e in results:
                if e is None and res[0] in before:        # compiled, but its sibling did not: put it back
                    opt, texts = before[res[0]]
                    with contextlib.suppress(Exception), self._gpu_ctx():
                        res[1].reload(opt, texts)
            raise errors[0]
        for name, mk, _ in (r for r, _ in results):
            self._kernels[name] = mk
        return wall

    def _build_cpu(self, names=("debug", "timed")) -> float:
        from ..build.compile import compile_cubin, resource_usage

        def one(name):
            asm = _asm.assemble(self.cfg, self.options(name), self.overrides)
            hit = self._compiled.get(asm.key)
            if hit is None:
                cubin, _ = compile_cubin(asm)
                try:
                    r = resource_usage(cubin)[0]
                    res = dict(registers=r.registers, local_bytes=r.stack, static_shared=r.shared,
                               threads=self.threads)
                except Exception:                 # cuobjdump missing: resources are a nicety here
                    res = {}
                hit = self._compiled[asm.key] = (cubin, res)
                while len(self._compiled) > 16:
                    self._compiled.pop(next(iter(self._compiled)))
            return name, asm.key, hit
        t0 = time.perf_counter()
        results = self._map(one, list(names))
        wall = time.perf_counter() - t0
        errors = [e for _, e in results if e is not None]
        if errors:
            raise errors[0]
        for name, key, (cubin, res) in (r for r, _ in results):
            self.cubins[name] = (key, cubin, res)
        return wall

    # -- the loop ------------------------------------------------------------------------------------------------
    def reload(self, *, trigger: str = "manual", section: str | None = None, variant: str | None = None,
               verify: bool = True, timing: bool = True) -> ReloadRecord:
        """assemble → compile → verify per stage → time → record (appended to history, sent to on_record)."""
        with self._lock, self._gpu_ctx():
            t0 = time.perf_counter()
            rec = ReloadRecord(time.time(), trigger, section, variant, tuple(sorted(self.variants.items())))
            self._reload_section = section
            rec.sampler = self.build_options.get("sampler", self._sampler(self.variants))
            try:
                rec.compile_s = self._build_gpu() if self.device == "gpu" else self._build_cpu()
            except CompileError as e:
                rec.status, rec.error, rec.messages = COMPILE_ERROR, format_compile_error(e), list(e.messages)
                rec.compile_s = time.perf_counter() - t0
            except (ValueError, FileNotFoundError, OSError) as e:      # #include refused, missing variant file ...
                rec.status, rec.error = ASSEMBLE_ERROR, f"{type(e).__name__}: {e}"
                rec.compile_s = time.perf_counter() - t0
            except Exception as e:                                      # not resident, driver errors
                rec.status, rec.error = RUN_ERROR, f"{type(e).__name__}: {e}"
                rec.compile_s = time.perf_counter() - t0
            if rec.status == OK:
                if self.device == "gpu":
                    rec.key, rec.resources = self.debug.asm.key, self.timed.resources()   # the timed kernel's
                    if verify:
                        self._verify_into(rec)
                    if timing:
                        self._time_into(rec)
                else:
                    rec.status = NO_GPU
                    rec.key, rec.resources = self.cubins["debug"][0], self.cubins["timed"][2]
                    if verify and self.cpu_reference:
                        t1 = time.perf_counter()
                        self.last_reference = self.reference.taps(*self._verify_tokens_cpu())
                        rec.verify_s = time.perf_counter() - t1
            rec.total_s = time.perf_counter() - t0
            self._record(rec)
            return rec

    def _record(self, rec: ReloadRecord):
        self.history.append(rec)
        for cb in list(self.on_record):
            try:
                cb(rec)
            except Exception as e:               # a dashboard's bug must not break the loop
                print(f"workbench: on_record callback {getattr(cb, '__name__', cb)!r} failed: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)

    def _verify_plan(self):
        rng = np.random.default_rng(self.verify_seed)
        prompt = rng.integers(0, self.cfg.vocab, self.verify_prompt).tolist()
        n_steps = self.verify_prompt + self.verify_tokens - 1
        steps = list(range(self.verify_prompt - 1, n_steps))        # the steps that choose a generated token
        return prompt, steps

    def _verify_tokens_cpu(self):
        prompt, steps = self._verify_plan()
        rng = np.random.default_rng(self.verify_seed + 1)           # teacher-forced stand-ins for generated tokens
        fed = prompt + rng.integers(0, self.cfg.vocab, len(steps) - 1).tolist()
        return fed, steps

    def verify(self, mk=None):
        """Run the verification on the debug build (or `mk`, a taps build): → (StageTable, tokens_ok, note)."""
        from ..run.runtime import Sampling
        from ..check.taps import compare_taps, kernel_taps
        from ..check.verify import DEFAULT_RTOL
        mk = mk or self.debug
        prompt, steps = self._verify_plan()
        with self._gpu_ctx():
            res = mk.generate(prompt, self.verify_tokens, Sampling(), eos=[], record=steps, tap_steps=steps,
                              timeout_s=self.timeout_s)
        fed = prompt + res.tokens[:-1]
        ref = self.reference.taps(fed, steps)
        table = compare_taps(kernel_taps(res), ref, self.cfg)
        tokens_ok, note = None, None
        for i, step in enumerate(steps):
            r = np.asarray(ref["logits", -1, step], np.float64)
            top2 = np.sort(r)[-2:]
            if top2[1] - top2[0] > 2 * DEFAULT_RTOL * float(np.abs(r).max()):
                chosen, want = res.tokens[i], int(np.argmax(r))
                if chosen != want:
                    tokens_ok, note = False, (f"sampling at step {step}: greedy token {chosen}, the reference's "
                                              f"argmax is {want} (margin {top2[1] - top2[0]:.3g})")
                    break
                tokens_ok = True
        return table, tokens_ok, note

    def _verify_into(self, rec: ReloadRecord):
        from ..run.runtime import KernelError
        t0 = time.perf_counter()
        try:
            table, rec.tokens_ok, note = self.verify()
        except KernelError as e:
            rec.status, rec.passed, rec.error = RUN_ERROR, False, f"{type(e).__name__}: {e}"
            rec.first_failure = f"the debug run stopped: {e}"
            rec.verify_s = time.perf_counter() - t0
            return
        rec.verify_s = time.perf_counter() - t0
        rec.stages = table
        rec.failure = table.first_failure
        rec.passed = table.passed and rec.tokens_ok is not False
        if not table.passed:
            rec.first_failure = str(rec.failure)
        elif rec.tokens_ok is False:
            rec.first_failure = note
        if not rec.passed:
            rec.status = VERIFY_FAILED

    def time_run(self, mk=None, steps: int | None = None):
        """A greedy run of the timing build (or `mk`) → (Result, [StageRow] or None)."""
        from ..measure.timing import stage_table
        mk = mk or self.timed
        n = steps or self.time_steps
        tok = self.cfg.bos_token_id if self.cfg.bos_token_id is not None else 1
        with self._gpu_ctx():
            mk.generate([tok], 2, eos=[], timeout_s=self.timeout_s)          # first launch after a load: warm up
            res = mk.generate([tok], n, eos=[], timing_steps=n, timeout_s=self.timeout_s)
        rows = stage_table(self.cfg, res.timing, 0) if res.timing is not None and res.timing.shape[0] > 1 else None
        return res, rows

    def _time_into(self, rec: ReloadRecord):
        from ..run.runtime import KernelError
        from ..measure.timing import format_table
        t0 = time.perf_counter()
        try:
            res, rows = self.time_run()
            rec.tok_per_s = res.tok_per_s
            rec.timing = rows
            rec.timing_text = format_table(rows) if rows else None
        except KernelError as e:
            if rec.status == OK:
                rec.status = RUN_ERROR
            rec.error = (rec.error + "; " if rec.error else "") + f"timing run: {type(e).__name__}: {e}"
        rec.time_s = time.perf_counter() - t0

    # -- editing ---------------------------------------------------------------------------------------------------
    def edit(self, section: str, text: str, variant: str | None = None) -> Path | None:
        """Write a section (atomically; the previous version saved for undo). Does not reload: call reload(), or
        let the watcher do it. Returns the history entry (None: the text was already there)."""
        with self._lock, self._watch_paused():
            entry = write_section(section, text, variant, history_dir=self.history_dir)
            self._watch_sync()
            return entry

    def undo(self, section: str, variant: str | None = None, *, reload: bool = True) -> ReloadRecord | None:
        """Restore the section's previous version; then reload (unless reload=False)."""
        with self._lock:
            with self._watch_paused():
                undo_section(section, variant, history_dir=self.history_dir)
                self._watch_sync()
            return self.reload(trigger="undo", section=section, variant=variant) if reload else None

    def section_history(self, section: str, variant: str | None = None) -> list[Path]:
        return section_history(section, variant, history_dir=self.history_dir)

    def use_variant(self, section: str, variant: str | None, *, reload: bool = True) -> ReloadRecord | None:
        """Build `section` from kernels/sections/SECTION@VARIANT.cuh (None: the base file); then reload."""
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
        from ..run.runtime import KernelError, Monokernel
        from ..measure.timing import stage_table
        a, b = _norm_variants(a_variants), _norm_variants(b_variants)
        out = {"a": {}, "b": {}}
        with self._lock, self._gpu_ctx():
            if self.device != "gpu":
                for tag, v in (("a", a), ("b", b)):
                    try:
                        for which in ("debug", "timed"):
                            from ..build.compile import compile_cubin
                            compile_cubin(_asm.assemble(self.cfg, self.options(which, v), self.overrides))
                        out[tag]["error"] = None
                    except (CompileError, ValueError, FileNotFoundError) as e:
                        out[tag]["error"] = format_compile_error(e) if isinstance(e, CompileError) else str(e)
                return ABRecord(tuple(sorted(a.items())), tuple(sorted(b.items())), None, None, [], [], None, None,
                                None, None, None, None, out["a"]["error"] or NO_GPU, out["b"]["error"] or NO_GPU)
            kernels = {}
            for tag, v in (("a", a), ("b", b)):
                o = out[tag]
                o["error"] = o["failure"] = o["passed"] = o["stages"] = None
                try:
                    kernels[tag] = Monokernel(self.p, self.options("timed", v), overrides=dict(self.overrides),
                                              max_steps=tokens + 8)
                    if verify:
                        dbg = Monokernel(self.p, self.options("debug", v), overrides=dict(self.overrides),
                                         max_steps=max(64, self.verify_prompt + self.verify_tokens))
                        table, tokens_ok, note = self.verify(dbg)
                        del dbg
                        o["stages"] = table
                        o["passed"] = table.passed and tokens_ok is not False
                        o["failure"] = str(table.first_failure) if not table.passed else note
                except CompileError as e:
                    o["error"] = "compile error:\n" + format_compile_error(e)
                except (KernelError, ValueError, FileNotFoundError) as e:
                    o["error"] = f"{type(e).__name__}: {e}"
            runs = {"a": [], "b": []}
            timing = {}
            tok = self.cfg.bos_token_id if self.cfg.bos_token_id is not None else 1
            for tag, mk in kernels.items():
                try:
                    mk.generate([tok], 2, eos=[], timeout_s=self.timeout_s)
                except KernelError as e:
                    out[tag]["error"] = f"{type(e).__name__}: {e}"
            live = {t: mk for t, mk in kernels.items() if not out[t]["error"]}
            for _ in range(repeats):
                for tag, mk in live.items():
                    res = mk.generate([tok], tokens, eos=[], timing_steps=tokens, timeout_s=self.timeout_s)
                    runs[tag].append(res.tok_per_s)
                    timing[tag] = res.timing
            med = {t: float(np.median(r)) if r else None for t, r in runs.items()}
            rows = {t: stage_table(self.cfg, timing[t], 0) if t in timing else None for t in ("a", "b")}
            kernels.clear()
            return ABRecord(tuple(sorted(a.items())), tuple(sorted(b.items())), med["a"], med["b"], runs["a"],
                            runs["b"], out["a"].get("passed"), out["b"].get("passed"), out["a"].get("failure"),
                            out["b"].get("failure"), rows["a"], rows["b"], out["a"].get("error"),
                            out["b"].get("error"), out["a"].get("stages"), out["b"].get("stages"))

    # -- watching --------------------------------------------------------------------------------------------------
    def watch(self, interval_s: float = 0.2, debounce_s: float = 0.3):
        """Reload whenever a file of the current build changes on disk (saved from JupyterLab's editor, say)."""
        from .watch import Watcher
        if self._watcher is not None and self._watcher.running:
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

    def _on_files_changed(self, paths: list[Path]):
        used = self.build_files()
        hit = [p for p in paths if Path(p).resolve() in used]
        if not hit:
            return None
        section = variant = None
        if len(hit) == 1:
            stem = Path(hit[0]).stem
            section, _, variant = stem.partition("@")
            variant = variant or None
        return self.reload(trigger="watch", section=section, variant=variant)

    # -- lifetime --------------------------------------------------------------------------------------------------
    def close(self):
        """Stop watching, drop the kernels, and stop being the active workbench."""
        global _ACTIVE
        self.unwatch()
        self._kernels.clear()
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


# ---- the GPU run script's measurement of the loop ------------------------------------------------------------------

def wrong_rope(text: str) -> str:
    """qkv_rope_append.cuh with the sign of the sin term flipped (a rotation by −angle): a deliberate bug that the
    taps must name as q at layer 0."""
    out = text.replace("r[0] * c - r[1] * s", "r[0] * c + r[1] * s").replace("r[1] * c + r[0] * s",
                                                                             "r[1] * c - r[0] * s")
    if out == text:
        raise ValueError("could not find the rope rotation (r[0] * c - r[1] * s) in qkv_rope_append.cuh")
    return out


def loop_benchmark(model: str = "llama-3.2-1b", *, section: str = "lm_head", edits: int = 3,
                   overhead_tokens: int = 256, overhead_repeats: int = 5, **workbench_kw) -> dict:
    """Measure the editing loop on a GPU: a harmless edit (a comment appended to `section`, `edits` times with
    different text, so every compile is a real one) → reload (compile, verify, time); a deliberately wrong edit
    (wrong_rope, as a variant) → the first failing stage; and the tok/s of the plain build against the timing build
    and the taps build (instrumentation overhead). Restores every file it touched; its edit history goes to a
    temporary folder. Returns a dict (JSON-ready)."""
    from ..run.runtime import Monokernel
    out: dict = {"model": model}
    hist = Path(tempfile.mkdtemp(prefix="wb-loop-history-"))
    path = section_file(section)
    original = path.read_bytes()
    rope_path = section_file("qkv_rope_append")
    rope_original = rope_path.read_bytes()
    variant = "loop_benchmark_wrong_rope"
    wrong_path = section_file("qkv_rope_append", variant)
    if wrong_path.exists():
        raise FileExistsError(f"{display_path(wrong_path)} exists already; remove it first")
    wb = None
    try:
        t0 = time.perf_counter()
        wb = Workbench(model, history_dir=hist, activate=False, watch=False, **workbench_kw)
        out["setup_s"] = time.perf_counter() - t0
        out["initial"] = _brief(wb.last)
        out["parallel_compile"] = wb.parallel_compile
        runs = []
        for i in range(edits):
            text = original.decode() + f"\n// loop_benchmark: harmless edit {i} at {time.time_ns()}\n"
            t1 = time.perf_counter()
            wb.edit(section, text)
            rec = wb.reload(trigger="edit", section=section)
            b = _brief(rec)
            b["edit_to_record_s"] = time.perf_counter() - t1
            runs.append(b)
        out["edit_runs"] = runs
        out["edit"] = {k: float(np.median([r[k] for r in runs if r[k] is not None] or [math.nan]))
                       for k in ("compile_s", "verify_s", "time_s", "total_s", "edit_to_record_s")}
        out["edit"]["all_passed"] = all(r["passed"] for r in runs)
        if runs:
            out["stages_text"] = wb.last.stages.text() if wb.last.stages is not None else None
            out["timing_text"] = wb.last.timing_text
        # the same, compiling the two builds the other way (in parallel threads, or one after the other)
        wb.parallel_compile = not wb.parallel_compile
        wb.edit(section, original.decode() + f"\n// loop_benchmark: harmless edit at {time.time_ns()}\n")
        out["edit_other_compile_mode"] = {**_brief(wb.reload(trigger="edit", section=section)),
                                          "parallel_compile": wb.parallel_compile}
        wb.parallel_compile = not wb.parallel_compile
        # the same reload without compiling anything new (CuPy's cache): what the rest of the loop costs
        rec = wb.reload(trigger="manual")
        out["reload_cached"] = _brief(rec)
        # undo puts the file back; the deliberately wrong variant must be caught as q at layer 0
        while wb.section_history(section):
            wb.undo(section, reload=False)
        out["undo_restored"] = path.read_bytes() == original
        wb.edit("qkv_rope_append", wrong_rope(rope_original.decode()), variant=variant)
        rec = wb.use_variant("qkv_rope_append", variant)
        out["wrong_edit"] = {**_brief(rec), "where": list(rec.failure.where) if rec.failure else None,
                             "caught_as_q_layer0": bool(rec.failure and rec.failure.where == ("q", 0))}
        wb.use_variant("qkv_rope_append", None, reload=False)
        # instrumentation overhead: plain vs timing build vs taps build (no taps requested), interleaved
        with wb._gpu_ctx():
            n = overhead_tokens
            plain = dataclasses.replace(wb.options("timed"), timing=False)
            # every build fully optimised (the loop's own verification build is not: see verify_fast_compile)
            builds = {"plain": plain, "timing": wb.options("timed"), "taps": dataclasses.replace(plain, taps=True),
                      "taps+timing": dataclasses.replace(plain, taps=True, timing=True)}
            kernels = {k: Monokernel(wb.p, o, max_steps=n + 8) for k, o in builds.items()}
            tok = wb.cfg.bos_token_id or 1
            tps = {k: [] for k in kernels}
            for mk in kernels.values():
                mk.generate([tok], 4, eos=[])
            tps["timing, no stamps stored"] = []
            for _ in range(overhead_repeats):              # interleaved, so drifting clocks hit all alike
                for k, mk in kernels.items():
                    tps[k].append(mk.generate([tok], n, eos=[], timing_steps=n if "timing" in k else 0).tok_per_s)
                # the timing build asked for no stamps: what the compiled-in instrumentation costs by itself
                tps["timing, no stamps stored"].append(kernels["timing"].generate([tok], n, eos=[]).tok_per_s)
            kernels.clear()
        med = {k: float(np.median(v)) for k, v in tps.items()}
        out["overhead"] = {"tokens": n, "repeats": overhead_repeats, "runs": tps,
                           **{f"{k}_tok_s": v for k, v in med.items()},
                           **{f"{k}_overhead_pct": 100 * (med["plain"] / v - 1)
                              for k, v in med.items() if k != "plain"}}
    finally:
        if wb is not None:
            wb.close()
        if path.read_bytes() != original:
            _atomic_write(path, original.decode())
        if rope_path.read_bytes() != rope_original:
            _atomic_write(rope_path, rope_original.decode())
        wrong_path.unlink(missing_ok=True)
        shutil.rmtree(hist, ignore_errors=True)
        out["files_restored"] = (path.read_bytes() == original and rope_path.read_bytes() == rope_original
                                 and not wrong_path.exists())
    return out


def _brief(rec: ReloadRecord | None) -> dict | None:
    if rec is None:
        return None
    def num(v):
        return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
    return {"status": rec.status, "passed": rec.passed, "first_failure": rec.first_failure,
            "compile_s": num(rec.compile_s), "verify_s": num(rec.verify_s), "time_s": num(rec.time_s),
            "total_s": num(rec.total_s), "tok_per_s": num(rec.tok_per_s), "error": rec.error,
            "stages_summary": rec.stages.summary() if rec.stages is not None else None}

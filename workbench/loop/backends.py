"""Where the loop's builds compile and run: a GPU backend (kernels run, verified stage by stage, timed) and a CPU
backend (compile-only builds, and the reference run on the CPU). The Workbench talks to either through the same
methods, so the loop has no `if gpu` branches:

    build(builds, overrides, defer) → s     compile every named build; all or nothing (the last good ones stay).
                                            The builds named in `defer` compile in the background: the others are
                                            ready (verify runs) while they do
    finish() → seconds                      wait for the deferred builds (their compile wall time); a compile error
                                            there puts every build of the round back, as build's would
    key(name), resources(name)              what was built
    verify(sampling=...) → Verdict          stage-local checks on the debug build, plus the end-to-end check
    time(steps, prompt) → Timing            a greedy run of the timed build: tok/s, per-stage table, tokens
    ab(a, b, overrides, ...) → dict         two variant selections built, verified and timed, interleaved
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time

import numpy as np

from .. import paths
from ..check.stops import verify_stops
from ..check.verify import DEFAULT_RTOL, coverage, end_to_end, verify_stages
from ..compiler import assemble as _asm
from ..compiler.compile import CompileError, compile_cubin, resource_usage
from ..measure.bench import measure_ttft
from ..measure.timing import stage_table
from ..model.config import ModelConfig
from ..model.weights import load_prepared
from ..reference import forward
from ..run.holder import WeightHolder, open_lent
from ..run.runtime import KernelError, Monokernel, RegisteredMapped
from ..run.worker import Worker, WorkerFailure, phase_setter
from .records import format_compile_error
from .sections import texts_of


@dataclasses.dataclass
class Verdict:
    """What verification found."""
    table: object                       # check.stage_check.StageTable (None: nothing ran)
    passed: bool | None
    first_failure: str | None
    failure: object = None
    tokens_ok: bool | None = None       # greedy tokens equal the reference's argmax where judgeable
    end_to_end: str | None = None       # summary line of the end-to-end check
    tokens: list | None = None          # the first run's generated tokens (the timed build must agree)
    prompt: list | None = None
    margins: list | None = None         # the first run's top-2 logit gap at each generated step (relative)
    seconds: float = float("nan")


@dataclasses.dataclass
class FirstToken:
    """Time to first token of a random prompt (measure.bench.measure_ttft), median of `runs`: the batched prefill
    into the timed build's cache and its last logits' first largest, or (first="kernel") the prefill of all but
    the last token, then the kernel's first step; and one more prefill synchronised after each stage, its
    milliseconds by stage."""
    prompt: int
    ms: float
    runs: list
    prefill_ms: float                   # the last run's prefill alone
    stages: dict
    first_step: dict = dataclasses.field(default_factory=dict)   # the median run's (measure.bench.first_step_split;
    #                                                               empty where the prefill chose the token)
    first: str = "prefill"              # who chose the first token (run.prefill.FIRST_TOKEN)


@dataclasses.dataclass
class Timing:
    tok_per_s: float
    rows: list | None
    tokens: list
    seconds: float
    stamps: np.ndarray | None = None    # the run's %globaltimer stamps [steps, slots, blocks, 2] (the dashboards')


def _map(fn, items, parallel: bool):
    """fn over items, in threads when parallel (NVRTC releases the GIL); returns [(result, exception)]."""
    def safe(x):
        try:
            return fn(x), None
        except BaseException as e:            # noqa: BLE001 - reported per build
            return None, e
    if parallel and len(items) > 1:
        with concurrent.futures.ThreadPoolExecutor(len(items)) as ex:
            return list(ex.map(safe, items))
    return [safe(x) for x in items]


def default_parallel() -> bool:
    return (os.cpu_count() or 1) >= 4


class Deferred:
    """Builds compiling in a background thread (NVRTC and ptxas leave the GIL and this process's GPU work alone)
    while the caller goes on: `wait()` → (compile wall time, [(result, exception)]) once they are done."""

    def __init__(self, fn, names: list, parallel: bool, undo=None):
        self.names, self.undo, self.t0 = list(names), undo, time.perf_counter()
        self.done_at = None
        self.abandoned = False             # the round failed elsewhere: what this compiles is to be put back
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wb-deferred-build")
        self._future = self._pool.submit(self._run, fn, parallel)

    def _run(self, fn, parallel):
        try:
            return _map(fn, self.names, parallel)
        finally:
            self.done_at = time.perf_counter()

    def wait(self) -> tuple[float, list]:
        try:
            results = self._future.result()
        finally:
            self._pool.shutdown(wait=True)
        return self.done_at - self.t0, results


class CpuBackend:
    """No GPU: the builds compile to sm_90 cubins (errors, registers, spills), and the reference runs on the CPU
    for the verification tokens (small models only). Nothing is verified: there is no kernel run to check."""
    device = "cpu"

    def __init__(self, cfg: ModelConfig, *, loader, parallel: bool | None = None, cpu_reference: bool | None = None,
                 verify_seed: int = 0):
        self.cfg, self._loader = cfg, loader
        self.parallel = default_parallel() if parallel is None else parallel
        self.cpu_reference = (cfg.weight_bytes_per_token() < 5e8) if cpu_reference is None else cpu_reference
        self.verify_seed = verify_seed
        self.cubins: dict = {}                  # name → (key, cubin, resources)
        self._compiled: dict = {}               # source key → (cubin, resources)
        self._p = None
        self.last_reference = None

    @property
    def prepared(self):
        if self._p is None:
            self._p = self._loader()
        return self._p

    def build(self, builds: dict, overrides: dict, defer=()) -> float:
        if self._deferred is not None:
            with contextlib.suppress(Exception):    # a round nobody finished: waited for, what it built kept
                self.finish()

        def one(name):
            asm = _asm.assemble(self.cfg, builds[name], overrides)
            hit = self._compiled.get(asm.key)
            if hit is None:
                cubin, _ = compile_cubin(asm)
                try:
                    r = resource_usage(cubin)[0]
                    res = dict(registers=r.registers, local_bytes=r.stack, static_shared=r.shared,
                               threads=builds[name].launch.threads)
                except Exception:                 # cuobjdump missing: resources are a nicety here
                    res = {}
                hit = self._compiled[asm.key] = (cubin, res)
                while len(self._compiled) > 16:
                    self._compiled.pop(next(iter(self._compiled)))
            return name, asm.key, hit
        before = dict(self.cubins)
        now = [n for n in builds if n not in defer]
        later = [n for n in builds if n in defer]
        d = Deferred(one, later, self.parallel, undo=before) if later else None    # started first: beside
        t0 = time.perf_counter()
        results = _map(one, now, self.parallel)
        wall = time.perf_counter() - t0
        errors = [e for _, e in results if e is not None]
        if errors:
            if d is not None:                   # the round is over: what it compiles is never installed
                d.abandoned = True
                self._deferred = d
            raise errors[0]
        self.cubins.update((name, (key, cubin, res)) for (name, key, (cubin, res)), _ in results)
        self._deferred = d
        return wall

    _deferred = None

    def finish(self) -> float:
        """The deferred builds, once compiled, in place (nan: none were deferred)."""
        d, self._deferred = self._deferred, None
        if d is None:
            return float("nan")
        wall, results = d.wait()
        if d.abandoned:
            return float("nan")
        errors = [e for _, e in results if e is not None]
        if errors:
            self.cubins = d.undo                # the whole round goes back
            raise errors[0]
        self.cubins.update((name, (key, cubin, res)) for (name, key, (cubin, res)), _ in results)
        return wall

    def key(self, name):
        return self.cubins[name][0]

    def resources(self, name):
        return self.cubins[name][2]

    def verify(self, sampling: bool = False, stops: bool = False) -> Verdict:
        """The reference alone, on random tokens (what the GPU run would be compared with), when the model is small."""
        t0 = time.perf_counter()
        if self.cpu_reference:
            tokens = np.random.default_rng(self.verify_seed).integers(0, self.cfg.vocab, 8)
            taps: dict = {}
            forward(self.prepared, tokens, dtype=np.float32, taps=taps)
            self.last_reference = taps
        return Verdict(None, None, None, seconds=time.perf_counter() - t0 if self.cpu_reference else float("nan"))

    def time(self, steps: int, prompt=None) -> Timing | None:
        return None

    def ttft(self, prompt_len: int, repeats: int = 3, first: str = "prefill") -> FirstToken | None:
        return None

    def ab(self, a: dict, b: dict, overrides: dict, **kw) -> dict:
        """Both selections compiled (each build of each), no runs."""
        out = {}
        for tag, builds in (("a", a), ("b", b)):
            try:
                for opt in builds.values():
                    compile_cubin(_asm.assemble(self.cfg, opt, overrides))
                out[tag] = {"error": None}
            except (CompileError, ValueError, FileNotFoundError) as e:
                out[tag] = {"error": format_compile_error(e) if isinstance(e, CompileError) else str(e)}
        return out

    def close(self):
        self.cubins.clear()


class GpuBackend:
    """The kernels run here, on the current CUDA device: a debug (taps) build verified stage by stage on every code
    path, and a timed build whose tok/s and per-stage table the loop reports."""
    device = "gpu"

    def __init__(self, cfg: ModelConfig, *, loader, parallel: bool | None = None, timeout_s: float = 5.0,
                 verify_seed: int = 0, first_run: tuple = (4, 4), mapped=None, on_phase=None):
        import cupy
        self.cfg, self.cp = cfg, cupy
        self.dev_id = cupy.cuda.Device().id
        self.parallel = default_parallel() if parallel is None else parallel
        self.timeout_s, self.verify_seed, self.first_run = timeout_s, verify_seed, first_run
        self.mapped, self.on_phase = mapped, on_phase      # a worker's shared block and phase word, if any
        if on_phase:
            on_phase("loading")
        self.p = loader()
        self.kernels: dict = {}                # name → Monokernel

    def monokernel(self, opt, overrides, **kw):
        return Monokernel(self.p, opt, overrides=overrides, mapped=self.mapped, on_phase=self.on_phase, **kw)

    def _ctx(self):
        return self.cp.cuda.Device(self.dev_id)

    def build(self, builds: dict, overrides: dict, defer=()) -> float:
        """Compile the builds; all or nothing: if one fails, the others go back to what they were. A build named in
        `defer` that only reloads (its kernel exists, with the same launch) compiles in the background, without
        telling the phase word: finish() waits for it, and until then its previous kernel stays in place."""
        self._settle()
        overrides = dict(overrides)
        before = {n: (mk.opt, texts_of(mk.asm)) for n, mk in self.kernels.items()}

        def one(name, phase=True):
            with self._ctx():
                opt = builds[name]
                mk = self.kernels.get(name)
                t0 = time.perf_counter()
                if mk is None or not mk.same_launch(opt):
                    mk = self.monokernel(opt, overrides, max_steps=256, max_record=64)
                else:
                    mk.reload(opt, overrides, phase=phase)
                return name, mk, time.perf_counter() - t0
        later = [n for n in builds if n in defer and n in self.kernels and self.kernels[n].same_launch(builds[n])]
        names = [n for n in builds if n not in later]
        # the deferred builds start first, so that they compile beside the others
        d = Deferred(lambda n: one(n, phase=False), later, self.parallel, undo=(before, [])) if later else None
        self._one = one
        try:
            t0 = time.perf_counter()
            results = _map(one, names, self.parallel)
            if self.parallel and any(e is not None and not isinstance(e, CompileError) for _, e in results):
                # not a compile error: in case it came from building in threads, once more one after the other
                results = [(r, None) if e is None else _map(one, [n], False)[0]
                           for n, (r, e) in zip(names, results, strict=True)]
            wall = time.perf_counter() - t0
            self._install(results, before)
        except BaseException:
            if d is not None:
                # the round is over; the background compile is not waited for (the error is reported now): the
                # next call that needs the kernels waits for it and puts back whatever it compiled
                d.abandoned = True
                self._deferred = d
            raise
        if d is not None:
            d.undo = (before, [self.kernels[n] for n in names])
            self._deferred = d
        return wall

    _deferred = None

    def _install(self, results: list, before: dict):
        """Compiled kernels in place, or, if one failed, those that compiled put back as they were (raises)."""
        errors = [e for _, e in results if e is not None]
        if errors:
            self._put_back([res[1] for res, e in results if e is None], before)
            raise errors[0]
        for name, mk, _ in (r for r, _ in results):
            self.kernels[name] = mk

    def _put_back(self, kernels: list, before: dict):
        for mk in kernels:
            for name, k in list(self.kernels.items()):
                if k is mk and name in before:
                    opt, texts = before[name]
                    with contextlib.suppress(Exception), self._ctx():
                        mk.reload(opt, texts)

    def finish(self) -> float:
        """Wait for the deferred builds (the phase word says compiling meanwhile, so that a compiler hang is
        caught) and put them in place → their compile wall time (nan: none). A failure there that is not a compile
        error is tried once more here, outside the thread; a compile error puts the builds compiled before it back
        too, and is raised. A round abandoned at a failure of the other builds is waited for and put back."""
        d, self._deferred = self._deferred, None
        if d is None:
            return float("nan")
        if self.on_phase:
            self.on_phase("compiling")
        try:
            wall, results = d.wait()
            before, compiled = d.undo
            if d.abandoned:
                self._put_back([res[1] for res, e in results if e is None], before)
                return float("nan")
            if any(e is not None and not isinstance(e, CompileError) for _, e in results):
                results = [(r, None) if e is None else _map(self._one, [n], False)[0]
                           for n, (r, e) in zip(d.names, results, strict=True)]
                wall = time.perf_counter() - d.t0
        finally:
            if self.on_phase:
                self.on_phase("idle")
        errors = [e for _, e in results if e is not None]
        if errors:
            self._put_back(compiled + [res[1] for res, e in results if e is None], before)
            raise errors[0]
        self._install(results, before)
        return wall

    def deferred(self) -> list:
        """The builds compiling in the background now (their kernels are the previous ones until finish)."""
        return list(self._deferred.names) if self._deferred is not None else []

    def _settle(self):
        """A deferred round nobody finished (its caller stopped at a failure): wait for it, keep what it built."""
        if self._deferred is not None:
            with contextlib.suppress(Exception):
                self.finish()

    def key(self, name):
        return self.kernels[name].asm.key

    def resources(self, name):
        return self.kernels[name].resources()

    def verify(self, sampling: bool = False, mk=None, stops: bool = False) -> Verdict:
        """Stage-local verification of the debug build on every declared code path (and every sampler mode when
        `sampling`; every branch of the stop decision when `stops`), a second run of the first that must repeat
        it bit for bit, then the end-to-end check of that run."""
        mk = mk or self.kernels["debug"]
        t0 = time.perf_counter()
        with self._ctx():
            runs = coverage(self.cfg, mk.launch, sampling=sampling and mk.opt.sampler == "full", first=self.first_run)
            table, results = verify_stages(mk, runs=runs, seed=self.verify_seed, timeout_s=self.timeout_s)
            if stops and table.passed:
                t_stops = time.perf_counter()
                table.extra += verify_stops(mk, seed=self.verify_seed, timeout_s=self.timeout_s)
                table.seconds["stop decision"] = time.perf_counter() - t_stops
            first = results[0]
            t1 = time.perf_counter()
            e2e = end_to_end(self.p, first, runs[0].n_prompt, DEFAULT_RTOL)
            table.seconds["end to end"] = time.perf_counter() - t1
        bad_e2e = [c for c in e2e if not (c.finite and c.rel_err <= DEFAULT_RTOL)]
        tok = [c.token_ok for c in e2e if c.token_ok is not None]
        tokens_ok = None if not tok else all(tok)
        if e2e:
            worst = max(e2e, key=lambda c: (not c.finite, c.rel_err))
            e2e_line = (f"end to end: worst rel err {worst.rel_err:.1e} at position {worst.position} (tol "
                        f"{DEFAULT_RTOL:.0e}), greedy tokens {sum(bool(t) for t in tok)}/{len(tok)} as the reference")
        else:                                   # the kernel stopped before a recorded step ran (the table says why)
            e2e_line = "end to end: not checked (the kernel stopped before any recorded step)"
        passed = table.passed and not bad_e2e and tokens_ok is not False
        failure = table.first_failure
        if failure is not None:
            first_failure = str(failure)
        elif bad_e2e:
            first_failure = (f"end to end: logits at position {bad_e2e[0].position} off by "
                             f"{bad_e2e[0].rel_err:.2g} (tol {DEFAULT_RTOL:.0e}) although every stage passed on "
                             f"its own inputs: how the stages compose")
        elif tokens_ok is False:
            c = next(c for c in e2e if c.token_ok is False)
            first_failure = f"end to end: the greedy token at step {c.step} is not the reference's argmax"
        else:
            first_failure = None
        margins = []
        for slot, step in enumerate(first.recorded_steps):
            if step >= runs[0].n_prompt - 1:
                lg = np.sort(first.logits[slot].astype(np.float64))
                margins.append(float((lg[-1] - lg[-2]) / max(abs(lg[-1]), 1e-30)))
        return Verdict(table, passed, first_failure, failure, tokens_ok, e2e_line, list(first.tokens),
                       list(first.prompt), margins, time.perf_counter() - t0)

    def time(self, steps: int, prompt=None, mk=None) -> Timing:
        """A greedy run of the timed build (from `prompt`, default the BOS token) → tok/s, stages, tokens."""
        self._settle()                          # never a kernel whose module a background compile may swap
        mk = mk or self.kernels["timed"]
        prompt = list(prompt) if prompt else [self.cfg.bos_token_id if self.cfg.bos_token_id is not None else 1]
        t0 = time.perf_counter()
        with self._ctx():
            mk.generate(prompt, 2, eos=[], timeout_s=self.timeout_s)          # first launch after a load: warm up
            res = mk.generate(prompt, steps, eos=[], timing_steps=steps + len(prompt) - 1, timeout_s=self.timeout_s)
        rows = stage_table(self.cfg, res.timing, 0) if res.timing is not None and res.timing.shape[0] > 1 else None
        return Timing(res.tok_per_s, rows, list(res.tokens), time.perf_counter() - t0, res.timing)

    def ttft(self, prompt_len: int, repeats: int = 3, first: str = "prefill") -> FirstToken:
        """Time to first token of a random prompt of prompt_len tokens through the timed build (FirstToken)."""
        if not 2 <= prompt_len <= self.cfg.max_seq:
            raise ValueError(f"a prompt of {prompt_len} tokens: from 2 (the last is the kernel's) to the context's "
                             f"{self.cfg.max_seq}")
        self._settle()
        mk = self.kernels["timed"]
        prompt = np.random.default_rng(self.verify_seed).integers(0, self.cfg.vocab, prompt_len).tolist()
        with self._ctx():
            secs, pre, stages, step = measure_ttft(mk, prompt, repeats, first=first, timeout_s=self.timeout_s)
        ms = [1e3 * s for s in secs]
        return FirstToken(prompt_len, float(np.median(ms)), ms, 1e3 * pre.seconds,
                          {k: 1e3 * v for k, v in stages.items()}, step, first)

    def ab(self, a: dict, b: dict, overrides: dict, *, tokens: int = 128, repeats: int = 5,
           verify: bool = True) -> dict:
        """Build both selections (a and b: {"debug": opt, "timed": opt}), verify each with its debug build, and
        time both timed builds in `repeats` interleaved runs of `tokens` greedy steps."""
        out = {"a": {}, "b": {}}
        kernels = {}
        self._settle()
        with self._ctx():
            for tag, builds in (("a", a), ("b", b)):
                o = out[tag]
                o.update(error=None, failure=None, passed=None, stages=None)
                try:
                    kernels[tag] = self.monokernel(builds["timed"], dict(overrides), max_steps=tokens + 8)
                    if verify:
                        dbg = self.monokernel(builds["debug"], dict(overrides), max_steps=256)
                        v = self.verify(mk=dbg)
                        del dbg
                        o["stages"], o["passed"], o["failure"] = v.table, v.passed, v.first_failure
                except CompileError as e:
                    o["error"] = "compile error:\n" + format_compile_error(e)
                except (KernelError, ValueError, FileNotFoundError) as e:
                    o["error"] = f"{type(e).__name__}: {e}"
            live = {t: (mk, True) for t, mk in kernels.items() if not out[t]["error"]}
            runs, last, errors = self._interleaved(live, tokens, repeats)
            for tag, e in errors.items():
                out[tag]["error"] = e
            kernels.clear()
        for tag in ("a", "b"):
            out[tag]["runs"] = runs.get(tag, [])
            out[tag]["tok_s"] = float(np.median(runs[tag])) if runs.get(tag) else None
            out[tag]["rows"] = stage_table(self.cfg, last[tag].timing, 0) if tag in last else None
        return out

    def overhead(self, builds: dict, overrides: dict, *, tokens: int, repeats: int) -> dict:
        """tok/s of each build in `builds` ({name: BuildOptions}), `repeats` interleaved runs of `tokens` greedy
        steps; a build with timing stores every step's stamps. The build named "timing" is also run storing none:
        what the compiled-in instrumentation costs by itself."""
        self._settle()
        with self._ctx():
            kernels = {k: self.monokernel(o, dict(overrides), max_steps=tokens + 8) for k, o in builds.items()}
            spec = {k: (mk, mk.opt.timing) for k, mk in kernels.items()}
            if "timing" in kernels:
                spec["timing, no stamps stored"] = (kernels["timing"], False)
            runs, _, errors = self._interleaved(spec, tokens, repeats)
            kernels.clear()
        if errors:
            raise KernelError("; ".join(f"{k}: {e}" for k, e in errors.items()))
        return runs

    def _interleaved(self, spec: dict, tokens: int, repeats: int) -> tuple[dict, dict, dict]:
        """Time kernels against each other: spec {name: (Monokernel, store stamps)}. Each is warmed up (a kernel that
        fails there is left out, its error kept), then `repeats` rounds of `tokens` greedy steps from the BOS token
        run every kernel in turn, so that drifting clocks hit all alike. → ({name: [tok/s]}, {name: its last
        Result}, {name: error})."""
        tok = self.cfg.bos_token_id if self.cfg.bos_token_id is not None else 1
        errors = {}
        for name, (mk, _) in spec.items():
            try:
                mk.generate([tok], 2, eos=[], timeout_s=self.timeout_s)
            except KernelError as e:
                errors[name] = f"{type(e).__name__}: {e}"
        live = {n: v for n, v in spec.items() if n not in errors}
        runs, last = {n: [] for n in live}, {}
        for _ in range(repeats):
            for name, (mk, stamps) in live.items():
                last[name] = mk.generate([tok], tokens, eos=[], timing_steps=tokens if stamps else 0,
                                         timeout_s=self.timeout_s)
                runs[name].append(last[name].tok_per_s)
        return runs, last, errors

    def close(self):
        self._settle()
        self.kernels.clear()


# ---- the GPU in a worker process ----------------------------------------------------------------------------------

class GpuService:
    """The GPU backend as it runs inside a worker process (workbench.run.worker): its kernels write the shared
    block the caller watches, and it says what it is doing (compiling, running a kernel) through the phase word."""

    def __init__(self, buf, header, n_words, words, cfg: ModelConfig, lent=None, spec=None, backend_kw=None):
        set_phase = phase_setter(words)
        set_phase("loading")
        self.mapped = RegisteredMapped(buf, n_words, offset_words=header)
        if lent is not None:
            loader = lambda: open_lent(lent)                      # noqa: E731
        else:
            import cupy
            model, weights, seed, max_seq = spec
            loader = lambda: load_prepared(model, weights, seed=seed, xp=cupy, max_seq=max_seq, progress=False)  # noqa: E731
        self.backend = GpuBackend(cfg, loader=loader, mapped=self.mapped, on_phase=set_phase, **(backend_kw or {}))
        set_phase("idle")

    def at(self, kernels: str, method: str, *args, **kw):
        """`method` with the caller's kernel folder in force (sections are read from where the caller edits): this
        service's own (build, which answers with what the caller keeps of each kernel), else the backend's."""
        paths.set_kernels_dir(kernels)
        return getattr(self if method in ("build", "finish", "kernels", "close") else self.backend, method)(*args, **kw)

    def build(self, builds: dict, overrides: dict, defer=()):
        wall = self.backend.build(builds, overrides, defer)
        return wall, self._info(skip=self.backend.deferred())      # a kernel compiling in the background: later

    def finish(self):
        return self.backend.finish(), self._info()

    def kernels(self) -> dict:
        return self._info()

    def _info(self, skip=()) -> dict:
        return {n: (mk.asm.key, mk.resources(), texts_of(mk.asm)) for n, mk in self.backend.kernels.items()
                if n not in skip}

    def close(self):
        self.backend.close()
        self.mapped.close()


class WorkerBackend:
    """The GPU backend, run in a worker process that owns the GPU (workbench.run.worker): a hang, a fault or a
    compiler crash in an edited section is reported (a WorkerFailure, with every block's last state) and the worker
    replaced, the last good kernels rebuilt in it, while this process and everything it holds live on. The weights
    come from a holder process by CUDA IPC, so a restart does not load them again."""
    device = "gpu"

    def __init__(self, cfg: ModelConfig, *, model: str, weights=None, seed: int = 0, max_seq=None,
                 parallel: bool | None = None, timeout_s: float = 1.0, verify_seed: int = 0, hang_s: float = 2.0,
                 compile_s: float | None = None, holder: bool = True):
        self.cfg = cfg
        self.parallel = default_parallel() if parallel is None else parallel
        t0 = time.perf_counter()
        self.holder = WeightHolder(model, weights, seed, max_seq) if holder else None
        lent = self.holder.lend() if self.holder else None
        spec = None if holder else (model, weights, seed, max_seq)
        kw = dict(parallel=self.parallel, timeout_s=timeout_s, verify_seed=verify_seed)
        self._compile_s = compile_s
        # the mapped block holds the streamed tokens of the longest run asked for (ab and overhead run 264 steps)
        self.worker = Worker(GpuService, cfg, lent, spec, kw, hang_s=hang_s,
                             compile_s=compile_s or 30.0, max_tokens=1 << 13)
        self.start_s = self.worker.start()
        self.setup_s = time.perf_counter() - t0
        self.info: dict = {}                   # build name → (key, resources, texts)
        self.good = None                       # (builds, texts) of the last builds that ran without a failure
        self.restart_s = None                  # from a failure to a new worker holding the last good builds
        self._restore = False                  # a new worker is starting: load the good builds before the next call

    def _call(self, method, *args, **kw):
        if self._restore:
            self._restored()
        try:
            # the caller's kernel folder, every call: the worker is another process and would read the default
            return self.worker.call("at", str(paths.kernels_dir()), method, *args, **kw)
        except WorkerFailure as f:
            if f.kind == "crash" and self._deferred and method != "finish":
                # the worker died while a build compiled in its background: the compiler may be what died
                g = WorkerFailure(f.kind, f"{f.message} (the {', '.join(self._deferred)} build was compiling in "
                                          f"the background)", f.blocks, f.status, f.seconds)
                g.killed, f = f.killed, g
            if f.killed:                       # a hang the kernel survived needs no new worker
                self.recover(f)
            raise f from None

    def recover(self, failure=None):
        """A new worker, the weights checked: it starts now, in the background, so that the failure is reported at
        once; the next call waits for it and first loads the last good builds into it (from CuPy's cache)."""
        self._recover_t0 = time.perf_counter()
        if self.holder is not None and failure is not None and failure.kind == "fault":
            if self.holder.check():                        # a wild write reached the weights: they were prepared again
                self.worker.args = (self.cfg, self.holder.lend()) + self.worker.args[2:]
        self.worker.spawn()
        self._restore = True
        self._deferred = None                  # what compiled in the old worker's background went with it
        self.restart_s = None

    def _restored(self):
        self._restore = False
        self.worker.wait_ready()
        if self.good is not None:
            builds, texts = self.good
            _, self.info = self.worker.call("at", str(paths.kernels_dir()), "build", builds, texts)
        self.restart_s = time.perf_counter() - self._recover_t0

    def build(self, builds: dict, overrides: dict, defer=()) -> float:
        self._deferred = None
        wall, info = self._call("build", builds, overrides, defer)
        self.info = {**self.info, **info}             # a deferred build's entry is its previous one until finish
        self._pending = (builds, info[next(iter(info))][2])
        self._deferred = [n for n in builds if n in defer and n not in info] or None
        if not self._deferred:                       # else the limit follows the deferred build, in finish
            self._limit(wall)
        return wall

    def finish(self) -> float:
        if not self._deferred:
            return float("nan")
        self._deferred = None
        try:
            wall, self.info = self._call("finish")
        except WorkerFailure:
            raise
        except Exception:
            self.info = self._call("kernels")           # the round went back: what the worker holds now
            raise
        self._limit(wall)
        return wall

    _deferred = None

    def _limit(self, wall: float):
        if self._compile_s is None and wall == wall:   # a compile far longer than the ones before: a compiler hang
            self.worker.compile_s = max(10.0, 4 * wall)

    def mark_good(self):
        """The builds just made ran (verified and timed) without a hang or a fault: they are what a restart loads."""
        if getattr(self, "_pending", None) is not None:
            self.good = self._pending

    def key(self, name):
        return self.info[name][0]

    def resources(self, name):
        return self.info[name][1]

    def verify(self, sampling: bool = False, stops: bool = False) -> Verdict:
        return self._call("verify", sampling=sampling, stops=stops)

    def time(self, steps: int, prompt=None) -> Timing:
        return self._call("time", steps, prompt)

    def ttft(self, prompt_len: int, repeats: int = 3, first: str = "prefill") -> FirstToken:
        return self._call("ttft", prompt_len, repeats, first)

    def ab(self, a: dict, b: dict, overrides: dict, **kw) -> dict:
        return self._call("ab", a, b, overrides, **kw)

    def overhead(self, builds: dict, overrides: dict, **kw) -> dict:
        return self._call("overhead", builds, overrides, **kw)

    def close(self):
        self.worker.close()
        if self.holder is not None:
            self.holder.close()

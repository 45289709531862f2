"""Where the loop's builds compile and run: a GPU backend (kernels run, verified stage by stage, timed) and a CPU
backend (compile-only builds, and the reference run on the CPU). The Workbench talks to either through the same
methods, so the loop has no `if gpu` branches:

    build(builds, overrides) → seconds      compile every named build; all or nothing (the last good ones stay)
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

from ..build import assemble as _asm
from ..build.assemble import BuildOptions
from ..build.compile import CompileError
from ..model.config import ModelConfig


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
class Timing:
    tok_per_s: float
    rows: list | None
    tokens: list
    seconds: float


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

    def build(self, builds: dict, overrides: dict) -> float:
        from ..build.compile import compile_cubin, resource_usage

        def one(name):
            asm = _asm.assemble(self.cfg, builds[name], overrides)
            hit = self._compiled.get(asm.key)
            if hit is None:
                cubin, _ = compile_cubin(asm)
                try:
                    r = resource_usage(cubin)[0]
                    res = dict(registers=r.registers, local_bytes=r.stack, static_shared=r.shared,
                               threads=builds[name].threads)
                except Exception:                 # cuobjdump missing: resources are a nicety here
                    res = {}
                hit = self._compiled[asm.key] = (cubin, res)
                while len(self._compiled) > 16:
                    self._compiled.pop(next(iter(self._compiled)))
            return name, asm.key, hit
        t0 = time.perf_counter()
        results = _map(one, list(builds), self.parallel)
        wall = time.perf_counter() - t0
        errors = [e for _, e in results if e is not None]
        if errors:
            raise errors[0]
        for name, key, (cubin, res) in (r for r, _ in results):
            self.cubins[name] = (key, cubin, res)
        return wall

    def key(self, name):
        return self.cubins[name][0]

    def resources(self, name):
        return self.cubins[name][2]

    def verify(self, sampling: bool = False) -> Verdict:
        """The reference alone, on random tokens (what the GPU run would be compared with), when the model is small."""
        t0 = time.perf_counter()
        if self.cpu_reference:
            from ..check.reference import forward
            rng = np.random.default_rng(self.verify_seed)
            tokens = rng.integers(0, self.cfg.vocab, 8)
            taps: dict = {}
            forward(self.prepared, tokens, dtype=np.float32, taps=taps)
            self.last_reference = taps
        return Verdict(None, None, None, seconds=time.perf_counter() - t0 if self.cpu_reference else float("nan"))

    def time(self, steps: int, prompt=None) -> Timing | None:
        return None

    def ab(self, a: dict, b: dict, overrides: dict, **kw) -> dict:
        """Both selections compiled (each build of each), no runs."""
        from ..build.compile import compile_cubin
        out = {}
        for tag, builds in (("a", a), ("b", b)):
            try:
                for opt in builds.values():
                    compile_cubin(_asm.assemble(self.cfg, opt, overrides))
                out[tag] = {"error": None}
            except (CompileError, ValueError, FileNotFoundError) as e:
                from .records import format_compile_error
                out[tag] = {"error": format_compile_error(e) if isinstance(e, CompileError) else str(e)}
        return out

    def close(self):
        self.cubins.clear()


class GpuBackend:
    """The kernels run here, on the current CUDA device: a debug (taps) build verified stage by stage on every code
    path, and a timed build whose tok/s and per-stage table the loop reports."""
    device = "gpu"

    def __init__(self, cfg: ModelConfig, *, loader, parallel: bool | None = None, timeout_s: float = 5.0,
                 verify_seed: int = 0, first_run: tuple = (4, 4)):
        import cupy
        self.cfg, self.cp = cfg, cupy
        self.dev_id = cupy.cuda.Device().id
        self.parallel = default_parallel() if parallel is None else parallel
        self.timeout_s, self.verify_seed, self.first_run = timeout_s, verify_seed, first_run
        self.p = loader()
        self.kernels: dict = {}                # name → Monokernel

    def _ctx(self):
        return self.cp.cuda.Device(self.dev_id)

    def build(self, builds: dict, overrides: dict) -> float:
        """Compile the builds; all or nothing: if one fails, the others go back to what they were."""
        from ..run.runtime import Monokernel
        from .benchmark import texts_of
        overrides = dict(overrides)
        before = {n: (mk.opt, texts_of(mk.asm)) for n, mk in self.kernels.items()}

        def one(name):
            with self._ctx():
                opt = builds[name]
                mk = self.kernels.get(name)
                t0 = time.perf_counter()
                if mk is None or mk.opt.threads != opt.threads:
                    mk = Monokernel(self.p, opt, overrides=overrides, max_steps=256, max_record=64)
                else:
                    mk.reload(opt, overrides)
                return name, mk, time.perf_counter() - t0
        t0 = time.perf_counter()
        names = list(builds)
        results = _map(one, names, self.parallel)
        if self.parallel and any(e is not None and not isinstance(e, CompileError) for _, e in results):
            # not a compile error: in case it came from building in threads, once more one after the other
            results = [(r, None) if e is None else _map(one, [n], False)[0]
                       for n, (r, e) in zip(names, results, strict=True)]
        wall = time.perf_counter() - t0
        errors = [e for _, e in results if e is not None]
        if errors:
            for res, e in results:
                if e is None and res[0] in before:        # compiled, but its sibling did not: put it back
                    opt, texts = before[res[0]]
                    with contextlib.suppress(Exception), self._ctx():
                        res[1].reload(opt, texts)
            raise errors[0]
        for name, mk, _ in (r for r, _ in results):
            self.kernels[name] = mk
        return wall

    def key(self, name):
        return self.kernels[name].asm.key

    def resources(self, name):
        return self.kernels[name].resources()

    def verify(self, sampling: bool = False, mk=None) -> Verdict:
        """Stage-local verification of the debug build on every declared code path (and every sampler mode when
        `sampling`), then the end-to-end check of its first run."""
        from ..check.verify import DEFAULT_RTOL, coverage, end_to_end, verify_stages
        mk = mk or self.kernels["debug"]
        t0 = time.perf_counter()
        with self._ctx():
            runs = coverage(self.cfg, mk.launch, sampling=sampling and mk.opt.sampler == "full", first=self.first_run)
            table, results = verify_stages(mk, runs=runs, seed=self.verify_seed)
            first = results[0]
            e2e = end_to_end(self.p, first, runs[0].n_prompt, DEFAULT_RTOL)
        bad_e2e = [c for c in e2e if not (c.finite and c.rel_err <= DEFAULT_RTOL)]
        tok = [c.token_ok for c in e2e if c.token_ok is not None]
        tokens_ok = None if not tok else all(tok)
        worst = max(e2e, key=lambda c: (not c.finite, c.rel_err))
        e2e_line = (f"end to end: worst rel err {worst.rel_err:.1e} at position {worst.position} "
                    f"(tol {DEFAULT_RTOL:.0e}), greedy tokens {sum(bool(t) for t in tok)}/{len(tok)} as the reference")
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
        from ..measure.timing import stage_table
        mk = mk or self.kernels["timed"]
        prompt = list(prompt) if prompt else [self.cfg.bos_token_id if self.cfg.bos_token_id is not None else 1]
        t0 = time.perf_counter()
        with self._ctx():
            mk.generate(prompt, 2, eos=[], timeout_s=self.timeout_s)          # first launch after a load: warm up
            res = mk.generate(prompt, steps, eos=[], timing_steps=steps + len(prompt) - 1, timeout_s=self.timeout_s)
        rows = stage_table(self.cfg, res.timing, 0) if res.timing is not None and res.timing.shape[0] > 1 else None
        return Timing(res.tok_per_s, rows, list(res.tokens), time.perf_counter() - t0)

    def ab(self, a: dict, b: dict, overrides: dict, *, tokens: int = 128, repeats: int = 5,
           verify: bool = True) -> dict:
        """Build both selections (a and b: {"debug": opt, "timed": opt}), verify each with its debug build, and
        time both timed builds in `repeats` interleaved runs of `tokens` greedy steps."""
        from ..run.runtime import KernelError, Monokernel
        from ..measure.timing import stage_table
        from .records import format_compile_error
        out = {"a": {}, "b": {}}
        kernels = {}
        with self._ctx():
            for tag, builds in (("a", a), ("b", b)):
                o = out[tag]
                o.update(error=None, failure=None, passed=None, stages=None)
                try:
                    kernels[tag] = Monokernel(self.p, builds["timed"], overrides=dict(overrides),
                                              max_steps=tokens + 8)
                    if verify:
                        dbg = Monokernel(self.p, builds["debug"], overrides=dict(overrides), max_steps=256)
                        v = self.verify(mk=dbg)
                        del dbg
                        o["stages"], o["passed"], o["failure"] = v.table, v.passed, v.first_failure
                except CompileError as e:
                    o["error"] = "compile error:\n" + format_compile_error(e)
                except (KernelError, ValueError, FileNotFoundError) as e:
                    o["error"] = f"{type(e).__name__}: {e}"
            runs, timing = {"a": [], "b": []}, {}
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
            kernels.clear()
        for tag in ("a", "b"):
            out[tag]["runs"] = runs[tag]
            out[tag]["tok_s"] = float(np.median(runs[tag])) if runs[tag] else None
            out[tag]["rows"] = stage_table(self.cfg, timing[tag], 0) if tag in timing else None
        return out

    def close(self):
        self.kernels.clear()

"""Running the monokernel: one cooperative launch per generation, tokens streamed back through mapped memory,
a host watchdog, and errors that name the stage and block that stopped.

Needs CuPy with a CUDA GPU. Every buffer of the plan is allocated once per `Monokernel` (the KV cache persists
across calls, so a later call may continue at `pos0 > 0`); each call resets the control words, so a run that ended
in an error or a hang leaves nothing behind that disturbs the next.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time
from typing import Callable, Iterator

import numpy as np

from .. import abi, plan, schedule
from ..compiler.assemble import Assembled, BuildOptions, Params, assemble, with_fields
from ..compiler.compile import NVRTC_OPTIONS, CompileError, compile_error, compile_nvidia
from ..compiler.units import units_linkable
from ..errors import GpuMemoryError, UsageError
from ..model.weights import Prepared, to_bf16
from .prefill import PREFILL_CHUNK, free_device_bytes, prefill

STATUS = {name: i for i, name in enumerate(abi.STATUS_WORDS)}
ERROR = {name: i for i, name in enumerate(abi.ERRORS)}
M_STATUS, M_ABORT, M_N_OUT, M_PROGRESS, M_TOKENS = (
    abi.mapped_offset(n) for n in ("status", "host_abort", "n_out", "progress", "tokens_out"))
_ALLOC_LOCK = threading.Lock()


_NP_DTYPES = {"f32": np.float32, "bf16": np.uint16, "i32": np.int32, "u32": np.uint32, "u64": np.uint64,
              "fixed": np.int64}
BF16_NAN = 0x7FC0
# Inside a worker process (workbench.run.worker): the shared block every kernel writes and the phase word it sets,
# so that the parent watches whatever kernel runs here (set once by the worker's service)
WORKER_CONTEXT: dict = {}


def poison_activation(a, dtype: str):
    """Fill an activation with what reads as NaN: a fixed-point buffer (plan.X_FRAC_BITS) with INT64_MIN in part 0
    and 0 in the others, a total that every reader takes as NaN (a poison in every part could cancel: 2·2^63 ≡ 0)."""
    if dtype == "fixed":
        a.fill(0)
        a[0].fill(np.iinfo(np.int64).min)
    else:
        a.fill(np.nan)


def _worker_mapped():
    """The worker's shared block, registered on first use (a service may give a function that registers it)."""
    m = WORKER_CONTEXT.get("mapped")
    if callable(m):
        m = WORKER_CONTEXT["mapped"] = m()
    return m


class KernelError(RuntimeError):
    """The kernel stopped with an error; the process and the GPU stay usable."""


class KernelHang(KernelError):
    pass


class KernelAborted(KernelError):
    pass


class NonFiniteLogits(KernelError):
    pass


class StreamMismatch(KernelError):
    """A stage's section took other weights from the ring than the plan streams to it (another matrix, another
    number of units), or an item never arrived. `where` is (stage, layer, step), the stage the verdict names."""

    def __init__(self, message: str, where: tuple | None = None):
        super().__init__(message)
        self.where = where


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0     # 0: greedy
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1: off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """Argmax decoding (the kernel's own test: no temperature, or top-k of 1)."""
        return not self.temperature > 0 or self.top_k == 1

    @staticmethod
    def seed_problem(seed) -> str | None:
        """Why `seed` cannot be a seed, or None. The kernel's sampler takes a 64-bit word: a seed outside [0, 2**64)
        would be masked into another one, so every seed the workbench takes (the sampler's, the random weights',
        the verification's) is held to this, on the command line and in the API."""
        import numbers
        if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and 0 <= int(seed) < 2 ** 64:
            return None
        got = int(seed) if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) else repr(seed)
        return f"must be an integer from 0 to 2**64 - 1 (a 64-bit seed), got {got}"

    @staticmethod
    def check_seed(seed, name: str = "seed"):
        """Raise UsageError, naming `name`, for a seed that seed_problem refuses."""
        if (why := Sampling.seed_problem(seed)) is not None:
            raise UsageError(f"{name} {why}")

    def check(self, vocab: int):
        Sampling.check_seed(self.seed)
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = off), got {self.top_k}")


@dataclasses.dataclass
class Result:
    tokens: list[int]               # generated tokens (prompt excluded)
    steps: int                      # decode steps the kernel ran (prompt tokens + generated − 1)
    kernel_ms: float                # launch to completion, CUDA events
    logits: np.ndarray | None       # recorded logits [n_recorded, V] (fp32), in recorded-step order
    recorded_steps: list[int]
    draws: np.ndarray | None = None    # [n_recorded, n_draws]: the sampler's draws at the recorded steps
    timing: np.ndarray | None = None   # [steps, slots, blocks, 2] globaltimer ns, when built with timing
    taps: object = None                # [n_tapped, schedule.tap_step_floats] fp32 on the device, when built with taps
    tap_steps: list[int] = dataclasses.field(default_factory=list)
    pos0: int = 0
    fed: list[int] = dataclasses.field(default_factory=list)   # the token fed at each step (as streamed)
    prompt: list[int] = dataclasses.field(default_factory=list)
    max_new: int = 0
    eos: list[int] = dataclasses.field(default_factory=list)
    # the host's side of the call, ms from its start (time.perf_counter): "checked" (the arguments), "prepared"
    # (inputs on the device, the GPU synchronised), "launched" (the launch call returned), "first token" (the host
    # saw the first token published), "collected" (the results read back), "status read" (the kernel's status
    # words, an error raised). The time to first token's split between the host and the kernel's first step, which
    # CUDA's events (kernel_ms) cannot tell.
    host_ms: dict = dataclasses.field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.steps / (self.kernel_ms / 1e3) if self.kernel_ms > 0 else float("nan")

    def tap(self, stage: str, buffer: str, layer: int, step: int, cfg, launch=None):
        """One tap (a cupy view) of a tapped step: `buffer` as `stage` left it at `layer` (-1: token stage)."""
        t = schedule.tap(cfg, stage, buffer, launch or plan.Launch())
        i = self.tap_steps.index(step)
        off = t.at(max(layer, 0))
        return self.taps[i, off:off + t.size]


class _Mapped:
    """Pinned host memory mapped into the device address space: the kernel writes, the host reads while it runs."""

    def __init__(self, n_words: int):
        import cupy
        rt = cupy.cuda.runtime
        self.nbytes = 4 * n_words
        self.host = rt.hostAlloc(self.nbytes, rt.hostAllocMapped | rt.hostAllocPortable)
        self.dev = self.host             # unified addressing: a mapped allocation has the same address on the device
        self.words = np.ctypeslib.as_array((ctypes.c_int32 * n_words).from_address(self.host))
        self.words[:] = 0
        self._rt = rt

    def ptr(self, offset_words: int = 0) -> int:
        return self.dev + 4 * offset_words

    def __del__(self):
        with contextlib.suppress(Exception):
            self._rt.freeHost(self.host)


class RegisteredMapped:
    """Host memory someone else owns (a shared-memory segment the parent process reads), registered as mapped memory
    for the kernel: its status, heartbeat, where-words and tokens survive this process. The whole buffer is
    registered (it starts on a page); the kernel's block starts `offset_words` into it."""

    def __init__(self, buf, n_words: int, offset_words: int = 0):
        import cupy
        rt = cupy.cuda.runtime
        self._buf = buf
        whole = np.frombuffer(buf, dtype=np.int32, count=offset_words + n_words)
        self.words = whole[offset_words:]
        self.host = whole.ctypes.data
        self.nbytes = whole.nbytes
        from cuda.bindings import runtime as cudart        # CuPy wraps neither the flags nor the device pointer
        rt.hostRegister(self.host, self.nbytes, int(cudart.cudaHostRegisterMapped) | int(cudart.cudaHostRegisterPortable))
        self._rt = rt
        err, dev = cudart.cudaHostGetDevicePointer(self.host, 0)
        if err != cudart.cudaError_t.cudaSuccess:
            self.close()
            raise RuntimeError(f"cudaHostGetDevicePointer of the worker's shared block failed: {err.name}")
        self.dev = int(dev) + 4 * offset_words

    def ptr(self, offset_words: int = 0) -> int:
        return self.dev + 4 * offset_words

    def close(self):
        if self.host:
            with contextlib.suppress(Exception):
                self._rt.hostUnregister(self.host)
            self.host = 0
        self.words = self._buf = None


# ---- the control fields of the ABI (abi.CONTROL), each as this runtime fills it -----------------------------------
# A pointer into the mapped host block (abi.MAPPED), a device buffer of this runtime (DEVICE_CONTROL), or a scalar
# of the call (SCALAR_CONTROL). _check_control runs at import: a field the ABI gains that none of these fills stops
# the import, named, rather than reaching the kernel as a 0.
_C_DTYPES = {"int": np.int32, "u32": np.uint32, "u64": np.uint64, "float": np.float32}
_ALLOCATED_KINDS = ("activation", "cache", "scratch")   # the plan's buffers a Monokernel allocates (weights and
                                                        # tables come prepared)
# field: (elements, fill when allocated (None: uninitialised), zeroed before every run: a synchronisation word, which
# a run that stopped mid-count would leave counting from where it was); in allocation order
DEVICE_CONTROL = {
    "logits_hist": (lambda mk: (mk.max_record, mk.cfg.vocab), None, False),
    # indexed by step; one more than the steps, since the step after the last opens with an embedding
    "rec_slot": (lambda mk: mk.max_steps + 1, -1, False),
    "tap_slot": (lambda mk: mk.max_steps + 1, -1, False),
    "bar_count": (lambda mk: 1, 0, True),
    "arrive": (lambda mk: mk.grid, 0, True),
    # the where-words kept on the device in place of the mapped block's (Monokernel(where_in_device=True))
    "where": (lambda mk: mk.grid, 0, True),
    "dev_flags": (lambda mk: len(abi.DEV_FLAGS), 0, True),
    "tokens_in": (lambda mk: mk.max_steps + 1, 0, False),
    "eos": (lambda mk: max(1, len(mk.cfg.eos_token_ids)) + 8, 0, False),
    # grown to what a call keeps (Monokernel._fit_buffers)
    "draws": (lambda mk: 1, 0, False),
    "timing": (lambda mk: 1, 0, False),
    "taps": (lambda mk: 1, 0, False),
}
_ATTR = {"where": "where_dev"}      # the attribute of a device buffer whose field the mapped block also has


def _dtype(field: str):
    return _C_DTYPES.get(dict(abi.CONTROL).get(field, "?").removeprefix("const ").removesuffix("*"))


@dataclasses.dataclass
class _Request:
    """One call of stream_tokens, checked: what the kernel is told, and what its results are read back by."""
    prompt: list[int]
    max_new: int
    sampling: Sampling
    pos0: int
    eos: list[int]
    record: list[int]               # sorted
    n_draws: int
    timing_steps: int               # 0 unless the build stamps timing
    tap_steps: list[int]            # sorted
    n_steps: int                    # the call's decode steps: prompt + generated − 1
    k_steps: int                    # the kernel's limits: the call's own, or its kernel_limits
    k_new: int
    timeout_s: float
    poison_kv: bool
    stop_requested: bool
    n_slots: int                    # the step's barrier slots (the timing stamps' rows)
    tap_floats: int                 # the floats of one tapped step


# what each scalar of abi.CONTROL is, of the kernel and the checked call
SCALAR_CONTROL: dict[str, Callable[["Monokernel", _Request], object]] = {
    "seed": lambda mk, r: r.sampling.seed,          # in [0, 2**64): Sampling.check
    "timeout_ns": lambda mk, r: int(r.timeout_s * 1e9),
    "n_in": lambda mk, r: len(r.prompt),
    "n_steps": lambda mk, r: r.k_steps,
    "max_new": lambda mk, r: r.k_new,
    "pos0": lambda mk, r: r.pos0,
    "n_eos": lambda mk, r: len(r.eos),
    "top_k": lambda mk, r: r.sampling.top_k,
    "n_draws": lambda mk, r: r.n_draws,
    "attn_max_splits": lambda mk, r: mk.attn_max_splits,
    "timing_steps": lambda mk, r: r.timing_steps,
    "temperature": lambda mk, r: r.sampling.temperature,
    "top_p": lambda mk, r: r.sampling.top_p,
}


def _check_control():
    """RuntimeError, naming the field, unless each field of the Params is filled one of the ways above."""
    types, mapped = dict(abi.CONTROL), {name for name, _ in abi.MAPPED}
    for name, ctype in abi.CONTROL:
        if not (name in mapped or name in DEVICE_CONTROL if ctype.endswith("*") else name in SCALAR_CONTROL):
            raise RuntimeError(f"abi.CONTROL's {ctype} {name!r} is filled by nothing in the runtime (the mapped "
                               f"block, DEVICE_CONTROL or SCALAR_CONTROL)")
    for name in (*DEVICE_CONTROL, *SCALAR_CONTROL):
        if name not in types or types[name].endswith("*") != (name in DEVICE_CONTROL) or \
                (name in DEVICE_CONTROL and _dtype(name) is None):
            raise RuntimeError(f"the runtime fills {name!r}, which abi.CONTROL has as {types.get(name)}")
    for name, _ in abi.params_fields():
        if name in plan.BUFFERS and (name in types or plan.BUFFERS[name].kind not in
                                     ("weight", "table", *_ALLOCATED_KINDS)):
            raise RuntimeError(f"the plan's buffer {name!r} ({plan.BUFFERS[name].kind}) is neither prepared nor "
                               f"allocated by the runtime, or is also a control field")


_check_control()


class Monokernel:
    """A compiled monokernel bound to prepared weights on the GPU."""

    def __init__(self, prepared: Prepared, options: BuildOptions = BuildOptions(), *,
                 overrides: dict[str, str] | None = None, max_record: int = 64, max_steps: int | None = None,
                 mapped=None, where_in_device: bool = False, on_phase=None):
        import cupy
        self.cp = cupy
        if prepared.xp is not cupy:
            raise TypeError("prepare the weights on the GPU: prepare(weights, xp=cupy)")
        self.p, self.cfg = prepared, prepared.cfg
        mapped = mapped if mapped is not None else _worker_mapped()
        on_phase = on_phase or WORKER_CONTEXT.get("on_phase")
        # tells a watching parent what runs (its phase, the barrier timeout, the grid)
        self.on_phase = on_phase or (lambda phase, timeout_s=None, grid=None: None)
        self.n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # one block per SM: all resident, so grid barriers cannot deadlock; the build is specialised to that grid
        self.grid = self.n_sm
        self.opt = with_fields(options, grid=self.grid)
        self.module = self.fn = None
        self._install(self.opt, overrides)
        self.max_steps = max_steps or self.cfg.max_seq
        self.max_record = max_record
        # the where-words go to mapped host memory (readable after this process is gone); where_in_device keeps
        # them on the device (to measure what the mapped writes cost)
        self.where_in_device = where_in_device
        if mapped is not None and mapped.words.size < abi.mapped_words(self.max_steps + 1):
            raise ValueError(f"the mapped block has {mapped.words.size} words, {abi.mapped_words(self.max_steps + 1)} "
                             f"needed for {self.max_steps} steps")
        self._external_mapped = mapped
        if self.grid > abi.MAX_BLOCKS:
            raise ValueError(f"{self.grid} blocks: the mapped block holds where-words for {abi.MAX_BLOCKS}")
        with _ALLOC_LOCK:                # two kernels built in parallel threads must not both count the same memory
            problem = schedule.memory_problem(self.cfg, free_device_bytes(cupy), self.launch, weights_resident=True)
            if problem:                               # one line, not an allocator's traceback
                raise GpuMemoryError(problem)
            self._alloc()

    # -- build ---------------------------------------------------------------------------------------------------
    def _install(self, options: BuildOptions, overrides: dict[str, str] | None, phase: bool = True):
        """Assemble and compile; only when that succeeds does the new module replace the loaded one. phase=False:
        the compile does not tell the watching parent (it runs in the background while another kernel runs, and
        the phase word is that kernel's)."""
        options = with_fields(options, grid=self.grid)
        asm = assemble(self.cfg, options, overrides)
        t0 = time.perf_counter()
        say = self.on_phase if phase else (lambda *a, **k: None)
        say("compiling")
        try:
            module, fn = self._compile(asm)
        finally:
            say("checking")
        compile_s = time.perf_counter() - t0
        smem = schedule.smem_bytes(self.cfg, options.effective_launch())
        fn.max_dynamic_shared_size_bytes = smem
        if options.smem_carveout >= 0:
            fn.preferred_shared_memory_carveout = options.smem_carveout
        occ = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, options.launch.threads, smem)
        if occ < 1:
            raise KernelError(f"kernel cannot be resident: {options.launch.threads} threads, {smem} B shared memory")
        if getattr(self, "fn", None) is not None and not self.same_launch(options):
            raise ValueError("the launch (threads per block, attention's split size) cannot change on reload: the "
                             "buffers are sized for it; build a new Monokernel")
        old = self.module
        self.asm, self.module, self.fn, self.compile_s, self.smem = asm, module, fn, compile_s, smem
        self.opt, self.overrides = options, dict(overrides or {})
        if old is not None:
            # CuPy memoises every compiled module; forget them so replaced versions are unloaded (the loaded one
            # stays alive through self.module) and a long editing session does not grow without bound
            del old
            self.cp._util.clear_memo()

    @property
    def launch(self) -> plan.Launch:
        return self.opt.effective_launch()

    @property
    def attn_max_splits(self) -> int:
        return self.launch.max_splits(self.cfg)

    def same_launch(self, options: BuildOptions) -> bool:
        """Whether a build with `options` fits this kernel's buffers (so that reload can take it)."""
        return with_fields(options, grid=self.grid).effective_launch() == self.launch

    def reload(self, options: BuildOptions | None = None, overrides: dict[str, str] | None = None, *,
               phase: bool = True) -> float:
        """Rebuild from the sections on disk (plus `overrides`). On a compile error the last good kernel stays
        loaded and runnable, and CompileError (section file, line, source line) is raised. Returns compile seconds.
        phase=False: a compile in the background (see _install)."""
        self._install(options or self.opt, self.overrides if overrides is None else overrides, phase)
        return self.compile_s

    def _compile(self, asm: Assembled):
        cp = self.cp
        if asm.ptx_bodies or asm.numba or (asm.units and units_linkable()):
            return self._load_spliced(asm)
        try:
            mod = cp.RawModule(code=asm.source, options=(*NVRTC_OPTIONS, *asm.flags), backend="nvrtc")
            fn = mod.get_function("wb_generate")
            fn.kernel                       # compile now, inside the try
        except cp.cuda.compiler.CompileException as e:
            raise compile_error(str(e), asm) from None
        return mod, fn

    def _load_spliced(self, asm: Assembled):
        """A build with stages written in PTX (workbench.compiler.ptx): NVRTC's PTX of the module with their bodies in
        place, through ptxas (its messages at the .ptx files' lines) to a cubin, which the driver loads. A build with
        device functions in Python (workbench.compiler.numba_sections) comes the same way, numba's PTX spliced in; a
        build in units (workbench.compiler.units) as the cubin its linked units make."""
        import os
        import tempfile

        cp = self.cp
        arch = f"sm_{cp.cuda.Device().compute_capability}"
        try:
            data, suffix = compile_nvidia(asm, arch)[0], ".cubin"
        except FileNotFoundError:
            # no ptxas on this machine: the driver's JIT assembles the spliced PTX (its messages are not mapped)
            data, suffix = compile_nvidia(asm, arch, ptx_only=True)[1].encode(), ".ptx"
        fd, path = tempfile.mkstemp(suffix=suffix, prefix="wb-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            try:
                mod = cp.RawModule(path=path)
                fn = mod.get_function("wb_generate")
                fn.kernel                   # loaded now, while the file exists
            except cp.cuda.driver.CUDADriverError as e:
                where = (asm.ptx_bodies[0].display if asm.ptx_bodies else asm.numba[0].display if asm.numba
                         else "<the build's linked units>")
                raise CompileError([(where, 0, "error", f"the driver did not load the module: {e}", "")],
                                   str(e)) from None
        finally:
            os.unlink(path)
        return mod, fn

    def resources(self) -> dict:
        a = self.fn.attributes
        return dict(registers=a["num_regs"], local_bytes=a["local_size_bytes"], static_shared=a["shared_size_bytes"],
                    dynamic_shared=self.smem, threads=self.launch.threads, blocks=self.grid)

    def _alloc(self):
        """Every activation, cache and scratch buffer of the plan, at the plan's shapes; then the control words."""
        cp, cfg = self.cp, self.cfg
        self.buffers = {}
        for b in plan.BUFFERS.values():
            if b.kind in _ALLOCATED_KINDS:
                shape = b.shape(cfg, self.launch)
                if b.kind == "cache":
                    # one spare row past the end: the check of the kernel's own end-of-cache stop runs it with
                    # limits past the cache (workbench.check.stops), and a kernel that missed that stop would
                    # append one row beyond the last layer's last head
                    n = int(np.prod(shape))
                    self.buffers[b.name] = cp.zeros(n + shape[-1], _NP_DTYPES[b.dtype])[:n].reshape(shape)
                else:
                    self.buffers[b.name] = (cp.zeros if b.kind == "scratch" else cp.empty)(shape, _NP_DTYPES[b.dtype])
        for name, arr in self.buffers.items():
            setattr(self, name, arr)
        for name, (shape, fill, _) in DEVICE_CONTROL.items():
            n, dtype = shape(self), _dtype(name)
            setattr(self, _ATTR.get(name, name), cp.empty(n, dtype) if fill is None else cp.full(n, fill, dtype))
        self.mapped = self._external_mapped or _Mapped(abi.mapped_words(self.max_steps + 1))
        self.params_dev = cp.empty(ctypes.sizeof(Params), cp.uint8)
        self.stream = cp.cuda.Stream(non_blocking=True)

    def fill_cache(self, upto: int, seed: int = 0):
        """Random bf16 keys and values at positions [0, upto) of every layer (std 1, as real k and v roughly are):
        a context for checking attention at long positions without decoding that many tokens first. Stage-local
        verification compares attention with the reference on whatever the cache holds."""
        cp = self.cp
        if not 0 <= upto <= self.cfg.max_seq:
            raise ValueError(f"cannot fill {upto} positions of a {self.cfg.max_seq}-position cache")
        rng = cp.random.default_rng(seed)
        for cache in (self.k_cache, self.v_cache):
            for layer in range(self.cfg.n_layers):
                cache[layer, :, :upto] = to_bf16(rng.standard_normal(cache[layer, :, :upto].shape, dtype=cp.float32), cp)

    def prefill(self, tokens, *, pos0: int = 0, chunk: int | None = None, **options):
        """The prompt as batched matrix products (workbench.run.prefill), into this kernel's KV cache at positions
        pos0..: afterwards the kernel continues from the position after them (generate(..., pos0=...)) without
        replaying them. `options`: prefill's (gpu, tf32, timings). → prefill.Prefilled (its last token's
        logits, the seconds it took)."""
        return prefill(self.p, tokens, self.k_cache, self.v_cache, pos0=pos0, chunk=chunk or PREFILL_CHUNK, **options)

    # -- run -----------------------------------------------------------------------------------------------------
    def stream_tokens(self, prompt: list[int], max_new: int, sampling: Sampling = Sampling(), *, pos0: int = 0,
                      eos: list[int] | None = None, record: list[int] | None = None, n_draws: int = 0,
                      timing_steps: int = 0, tap_steps: list[int] | None = None, timeout_s: float = 5.0,
                      host_timeout_s: float = 20.0, poison_kv: bool = False,
                      on_token: Callable[[int], None] | None = None,
                      on_poll: Callable[["Monokernel", int], None] | None = None,
                      poll_interval_s: float = 0.05, kernel_limits: tuple[int, int] | None = None,
                      stop_requested: bool = False) -> Iterator[int]:
        """Launch once; yield each generated token as the kernel publishes it; the generator's return value (also
        in `self.last`) is the Result. `record`: decode steps whose logits are kept (step i feeds prompt[i], or
        the (i − len(prompt) + 1)-th generated token, at position pos0 + i), and at which `n_draws` draws of the
        sampler are kept. `poison_kv`: the cache rows this run appends are set to NaN first, so a row a stage fails
        to write cannot pass for one it wrote. `kernel_limits` = (n_steps, max_new): what the kernel is told in
        place of this call's own limits, which may pass them and the end of the cache (up to a step past it), so
        that each of the kernel's stop rules can be the one that ends a run (workbench.check.stops).
        `stop_requested`: the host's abort word is set before the launch (as `request_stop` sets it during a run),
        so the kernel ends at the first step that reads it, with KernelAborted."""
        t0 = time.perf_counter()
        host_ms = {}

        def mark(phase):
            host_ms[phase] = 1e3 * (time.perf_counter() - t0)
        req = self._check_request(prompt, max_new, sampling, pos0=pos0, eos=eos, record=record, n_draws=n_draws,
                                  timing_steps=timing_steps, tap_steps=tap_steps, kernel_limits=kernel_limits,
                                  timeout_s=timeout_s, poison_kv=poison_kv, stop_requested=stop_requested)
        mark("checked")
        self._fit_buffers(req)
        self._prepare(req)
        mark("prepared")
        start, end = self._launch(req)
        mark("launched")
        aborted_by_host = yield from self._watch(on_token, on_poll, poll_interval_s, host_timeout_s,
                                                 lambda: mark("first token"))
        self.last = self._collect(req, start, end)
        mark("collected")
        self.last.host_ms = host_ms
        try:
            self._raise_on_status(aborted_by_host, host_timeout_s)
        except KernelError as e:
            e.result = self.last        # what ran before the stop (its taps say which stage went wrong first)
            raise
        finally:
            mark("status read")
        return self.last

    def _check_request(self, prompt, max_new: int, sampling: Sampling, *, pos0: int, eos, record, n_draws: int,
                       timing_steps: int, tap_steps, kernel_limits, timeout_s: float, poison_kv: bool,
                       stop_requested: bool) -> _Request:
        """stream_tokens' arguments checked against the model and this kernel (ValueError saying what is wrong),
        before anything touches the device."""
        cfg = self.cfg
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]} is outside the vocabulary [0, {cfg.vocab})")
        if max_new < 1:
            raise ValueError("max_new must be ≥ 1")
        sampling.check(cfg.vocab)
        if self.opt.sampler == "greedy" and not sampling.greedy:
            raise ValueError("this kernel was built with sampler='greedy' (argmax only): build it with "
                             "BuildOptions(sampler='full') to sample with a temperature")
        n_steps = len(prompt) + max_new - 1
        if pos0 < 0 or pos0 + n_steps > cfg.max_seq:
            raise ValueError(f"positions {pos0}..{pos0 + n_steps - 1} do not fit the KV cache of {cfg.max_seq}")
        if n_steps > self.max_steps:
            raise ValueError(f"{n_steps} steps exceed this kernel's max_steps={self.max_steps}")
        k_steps, k_new = (n_steps, max_new) if kernel_limits is None else kernel_limits
        if not (1 <= k_steps <= min(self.max_steps, cfg.max_seq - pos0 + 1) and k_new >= 1):
            raise ValueError(f"kernel_limits {kernel_limits}: steps from 1 to one past the cache's end "
                             f"({min(self.max_steps, cfg.max_seq - pos0 + 1)}), max_new from 1")
        record = sorted(set(record or []))
        if len(record) > self.max_record:
            raise ValueError(f"at most {self.max_record} recorded steps (asked {len(record)}); raise max_record")
        if record and not (0 <= record[0] and record[-1] < n_steps):
            raise ValueError(f"recorded steps must be in [0, {n_steps})")
        eos = list(cfg.eos_token_ids if eos is None else eos)
        if len(eos) > self.eos.size:
            raise ValueError("too many EOS ids")
        if n_draws < 0:
            raise ValueError("n_draws must be ≥ 0")
        tap_steps = sorted(set(tap_steps or []))
        if tap_steps and not self.opt.taps:
            raise ValueError("tap_steps needs a build with BuildOptions(taps=True)")
        if tap_steps and not (0 <= tap_steps[0] and tap_steps[-1] < n_steps):
            raise ValueError(f"tap steps must be in [0, {n_steps})")
        return _Request(prompt, max_new, sampling, pos0, eos, record, n_draws, timing_steps if self.opt.timing else 0,
                        tap_steps, n_steps, k_steps, k_new, timeout_s, poison_kv, stop_requested,
                        schedule.n_slots(cfg), schedule.tap_step_floats(cfg, self.launch))

    def _fit_buffers(self, req: _Request):
        """The buffers a call sizes (draws, timing stamps, taps) grown to what it keeps; timing_snapshot reads
        this call's timing_steps from here on."""
        if req.n_draws:
            self._grow("draws", req.n_draws * max(1, len(req.record)))
        if req.timing_steps:
            self._grow("timing", req.timing_steps * req.n_slots * self.grid * 2)
        if req.tap_steps:
            self._grow("taps", len(req.tap_steps) * req.tap_floats)
        self.timing_steps = req.timing_steps

    def _grow(self, name: str, size: int):
        """A control buffer of DEVICE_CONTROL replaced by a zeroed one of `size` elements when it holds fewer."""
        if getattr(self, name).size < size:
            setattr(self, name, self.cp.zeros(size, _dtype(name)))

    def _prepare(self, req: _Request):
        """Everything the launch reads, on the device before it: the call's inputs, the debug buffers, the control
        words and counters reset, what the run must write poisoned, and the Params."""
        # Our stream does not synchronise with the legacy default stream, where the weights were generated or
        # prepared (or edited since): without this the kernel can start reading weights that are still being
        # written. Found by a run whose module came from CuPy's cache, so no compile time hid the race.
        self.cp.cuda.Device().synchronize()
        with self.stream:
            self.tokens_in[:len(req.prompt)].set(np.asarray(req.prompt, np.int32), stream=self.stream)
            if req.eos:
                self.eos[:len(req.eos)].set(np.asarray(req.eos, np.int32), stream=self.stream)
            self._prepare_debug(req)
            self._reset_control()
            self._poison_outputs(req)
            if req.timing_steps:
                self.timing[:req.timing_steps * req.n_slots * self.grid * 2].fill(0)
            self.params_dev.set(np.frombuffer(bytes(self._params(req)), np.uint8), stream=self.stream)
            self.stream.synchronize()

    def _prepare_debug(self, req: _Request):
        """The slot of each tapped and recorded step (-1: none), their buffers poisoned (an unwritten tap or logit
        cannot pass for one the kernel wrote), and the draws cleared."""
        cp = self.cp
        self.rec_slot.fill(-1)
        self.tap_slot.fill(-1)
        if req.tap_steps:
            self.tap_slot[cp.asarray(req.tap_steps)] = cp.arange(len(req.tap_steps), dtype=cp.int32)
            self.taps[:len(req.tap_steps) * req.tap_floats].fill(cp.nan)
        if req.record:
            self.rec_slot[cp.asarray(req.record)] = cp.arange(len(req.record), dtype=cp.int32)
            self.logits_hist[:len(req.record)].fill(cp.nan)
        if req.n_draws:
            self.draws[:req.n_draws * max(1, len(req.record))].fill(-1)

    def _reset_control(self):
        """The synchronisation words of DEVICE_CONTROL and the plan's arrival counters (its u32 scratch, which the
        last arrival resets) zeroed: a run that stopped mid-stage must not leave the next one counting from where
        it was."""
        words = [getattr(self, _ATTR.get(n, n)) for n, (_, _, per_run) in DEVICE_CONTROL.items() if per_run]
        counters = [self.buffers[n] for n, b in plan.BUFFERS.items() if b.kind == "scratch" and b.dtype == "u32"]
        for buf in (*words, *counters):
            buf.fill(0)

    def _poison_outputs(self, req: _Request):
        """What a step must write, as NaN: every activation of the plan, and (poison_kv) the cache rows this run
        appends."""
        for name, b in plan.BUFFERS.items():
            if b.kind == "activation":
                poison_activation(self.buffers[name], b.dtype)
        if req.poison_kv:
            for cache in (self.k_cache, self.v_cache):
                cache[:, :, req.pos0:req.pos0 + req.n_steps].fill(BF16_NAN)

    def _params(self, req: _Request) -> Params:
        """The kernel's Params, field by field of abi.params_fields: the plan's buffers, then the control fields."""
        P = Params()
        for name, _ in abi.params_fields():
            if name not in plan.BUFFERS:
                setattr(P, name, self._control_value(name, req))
            else:
                held = getattr(self.p, name) if plan.BUFFERS[name].kind in ("weight", "table") else self.buffers[name]
                setattr(P, name, held.data.ptr)
        return P

    def _control_value(self, name: str, req: _Request):
        """A field of abi.CONTROL: a scalar of the call, a pointer into the mapped block, or one to a device buffer
        (the where-words' too, when this kernel keeps them on the device)."""
        if name in SCALAR_CONTROL:
            return SCALAR_CONTROL[name](self, req)
        if name not in DEVICE_CONTROL or (name == "where" and not self.where_in_device):
            return self.mapped.ptr(abi.mapped_offset(name))
        return getattr(self, _ATTR.get(name, name)).data.ptr

    def _launch(self, req: _Request):
        """The mapped block cleared (its abort word set for a stop requested before the launch), the watching parent
        told, and the kernel launched between two events. → (start, end)"""
        w = self.mapped.words
        w[:] = 0
        if req.stop_requested:
            w[M_ABORT] = 1
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        self.on_phase("running", max(req.timeout_s, 0.0), self.grid)
        start.record(self.stream)
        # cooperative launch: the driver refuses (rather than deadlocks) a grid that cannot be resident at once
        self.fn.kernel((self.grid,), (self.launch.threads,), (self.params_dev,), shared_mem=self.smem,
                       stream=self.stream, enable_cooperative_groups=True)
        end.record(self.stream)
        return start, end

    def _watch(self, on_token, on_poll, poll_interval_s: float, host_timeout_s: float, on_first=None):
        """Yield each token as the kernel publishes it, until the stream is done, calling on_poll every
        poll_interval_s (and on_first when the first token is seen, before it is yielded). The host's watchdog: a
        heartbeat still for host_timeout_s sets the abort word; still as long again, KernelError. Returns whether
        the watchdog set the abort word."""
        w = self.mapped.words
        seen, last_progress, last_change, aborted_by_host = 0, -1, time.monotonic(), False
        next_poll = time.monotonic() + poll_interval_s
        while True:
            done = self.stream.done
            n = int(w[M_N_OUT])
            while seen < n:
                tok = int(w[M_TOKENS + seen])
                if seen == 0 and on_first is not None:
                    on_first()
                seen += 1
                if on_token:
                    on_token(tok)
                yield tok
            if done:
                return aborted_by_host
            prog = int(w[M_PROGRESS])
            now = time.monotonic()
            if on_poll is not None and now >= next_poll:
                on_poll(self, prog)                         # e.g. a dashboard reading timing_snapshot()
                next_poll = now + poll_interval_s
            if prog != last_progress:
                last_progress, last_change = prog, now
            elif now - last_change > host_timeout_s and not aborted_by_host:
                w[M_ABORT] = 1                              # ask the kernel to stop at its next bounded wait
                aborted_by_host, last_change = True, now
            elif aborted_by_host and now - last_change > host_timeout_s:
                raise KernelError("the kernel ignores the abort flag: a wait that is not bounded (a spin that never "
                                  "checks the flag); the GPU context cannot be recovered in this process")
            time.sleep(0.0002)       # the first token's too: a 1 ms nap added up to 1 ms to the time to first token

    def _collect(self, req: _Request, start, end) -> Result:
        """The finished run read back, once the stream has raised what CUDA reports (an illegal address, ...)."""
        cp, w = self.cp, self.mapped.words
        self.stream.synchronize()
        self.on_phase("checking")
        kernel_ms = cp.cuda.get_elapsed_time(start, end)
        steps = int(w[M_PROGRESS])
        toks = [int(t) for t in w[M_TOKENS:M_TOKENS + int(w[M_N_OUT])]]
        record, n_draws, tap_steps, tap_floats = req.record, req.n_draws, req.tap_steps, req.tap_floats
        logits = self.logits_hist[:len(record)].get() if record else None
        draws = self.draws[:n_draws * len(record)].get().reshape(len(record), n_draws) if n_draws and record else None
        timing = None
        if req.timing_steps:
            ts = min(req.timing_steps, steps)
            timing = self.timing[:ts * req.n_slots * self.grid * 2].get().reshape(ts, req.n_slots, self.grid, 2)
        # a copy: the next run reuses the buffer, and a verification checks many runs together
        taps = self.taps[:len(tap_steps) * tap_floats].reshape(len(tap_steps), tap_floats).copy() if tap_steps else None
        fed = (req.prompt + toks)[:steps]
        return Result(toks, steps, kernel_ms, logits, record, draws, timing, taps, tap_steps, req.pos0, fed,
                      req.prompt, req.max_new, req.eos)

    def timing_snapshot(self) -> np.ndarray | None:
        """The timing stamps so far, copied on a side stream while the kernel may still be running (stamps not yet
        written read 0). [timing_steps, slots, blocks, 2]."""
        if not self.opt.timing or not getattr(self, "timing_steps", 0):
            return None
        n = self.timing_steps * schedule.n_slots(self.cfg) * self.grid * 2
        self._side = side = getattr(self, "_side", None) or self.cp.cuda.Stream(non_blocking=True)
        out = np.empty(n, np.uint64)
        self.timing[:n].get(stream=side, out=out)
        side.synchronize()
        return out.reshape(self.timing_steps, -1, self.grid, 2)

    def request_stop(self):
        """Ask the running kernel to stop: it reads this word every 16 steps and ends with KernelAborted."""
        self.mapped.words[M_ABORT] = 1

    def generate(self, prompt, max_new, sampling: Sampling = Sampling(), **kw) -> Result:
        for _ in self.stream_tokens(prompt, max_new, sampling, **kw):
            pass
        return self.last

    def _raise_on_status(self, aborted_by_host: bool, host_timeout_s: float):
        w = self.mapped.words
        st = w[M_STATUS:M_STATUS + abi.STATUS_LEN]
        # an abort leaves its reason on the device only
        code = int(st[STATUS["code"]]) or int(self.dev_flags[abi.DEV_FLAGS.index("stop")].get())
        if code == ERROR["ok"]:
            return
        if code == ERROR["hang"]:
            raise KernelHang(abi.describe_hang({name: int(st[i]) for name, i in STATUS.items()}))
        if code == ERROR["aborted"]:
            why = f"no progress for {host_timeout_s:.0f} s (host watchdog)" if aborted_by_host else "abort requested"
            raise KernelAborted(f"kernel aborted: {why}; it stopped at step {int(w[M_PROGRESS])}")
        if code == ERROR["bad_token"]:
            raise NonFiniteLogits(f"no valid token at step {int(st[STATUS['step']])}: the logits are NaN or infinite")
        if code == ERROR["stream"]:
            raise stream_mismatch(self.cfg, self.launch, [int(v) for v in st])
        if code == ERROR["unwaited"]:
            name = abi.stage_name(int(st[STATUS["stage"]]))
            raise KernelError(
                f"{abi.place(name, int(st[STATUS['layer']]), int(st[STATUS['step']]))}, block {st[STATUS['block']]}: "
                f"stage_{name} returned without waiting at the grid barrier before it, which the build's early={name} "
                f"leaves to its prologue: read the weights through for_warp_units (kernels/lib/matvec.cuh), or "
                f"build without early={name}; it read its inputs before every block had written them")
        raise KernelError(f"kernel reported error code {code}")


def stream_mismatch(cfg, launch: plan.Launch, st: list[int]) -> StreamMismatch:
    """The kernel's stream report (status words, see kernels/lib/stream.cuh) as one line naming the stage."""
    stage, layer, step, block = (st[STATUS[k]] for k in ("stage", "layer", "step", "block"))
    name = abi.stage_name(stage)
    where = abi.place(name, layer, step)
    want, got = st[STATUS["stream_want"]] & 0xFFFFFFFF, st[STATUS["stream_got"]] & 0xFFFFFFFF
    w = abi.decode_where(want)
    item = w[2] if w else -1
    s = schedule.stream_stage(cfg, name, launch)
    declared = (f"the plan streams it {s.units:,} units of {s.rows} row(s) of {s.buffer} ({s.k} wide)"
                if s is not None else "the plan streams it no weights")
    if got == 0xFFFFFFFF:
        why = f"its item {item} never arrived in the ring"
    elif got == 0xFFFFFFFE:
        why = f"its {item} items do not fit the partial sums the build reserved (a grid it was not built for)"
    else:
        g = abi.decode_where(got)
        held = "nothing" if g is None else f"item {g[2]} of {g[0]}" + (f" of layer {g[1]}" if g[1] >= 0 else "")
        why = (f"it asked the ring for its item {item} of those rows and found {held}, or rows from another "
               f"address: the section reads other weights, or another number of units, than the plan declares")
    return StreamMismatch(f"weight stream: {where}, block {block}: {why}; {declared}", (name, layer, step))

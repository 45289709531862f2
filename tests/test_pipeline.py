"""The GPU backend's pipelined round, on the CPU: the timed build compiles in the background while the
verification build is ready, and all or nothing still holds. The kernels here are real NVRTC compiles of the
assembled sources (cubins, no GPU to load them into), standing in for Monokernel's compile-and-load; the same
round runs for real on the GPU in tests/test_gpu_session.py."""
from __future__ import annotations

import contextlib
import math

import pytest

from workbench.compiler.assemble import BuildOptions, assemble
from workbench.compiler.compile import CompileError, compile_cubin
from workbench.loop.backends import GpuBackend
from workbench.loop.sections import texts_of
from workbench.model.config import get_config

CFG = get_config("tiny")


class CompiledKernel:
    """What GpuBackend asks of a Monokernel: opt, asm, same_launch, and reload, which replaces the kernel only when
    the compile succeeds (here a real NVRTC compile to a cubin)."""

    def __init__(self, opt, overrides, phases):
        self.phases = phases
        self.asm = None
        self.reload(opt, overrides)

    def same_launch(self, opt):
        return opt.effective_launch() == self.opt.effective_launch()

    def reload(self, opt, overrides, phase=True):
        asm = assemble(CFG, opt, overrides)
        self.phases.append(("compile", opt.timing, phase))
        compile_cubin(asm)
        self.asm, self.opt = asm, opt


@pytest.fixture
def backend():
    b = GpuBackend.__new__(GpuBackend)
    b.cfg, b.parallel, b.kernels = CFG, False, {}
    b.phases = []
    b.on_phase = lambda phase, *a, **k: b.phases.append(phase)
    b._ctx = contextlib.nullcontext
    b.monokernel = lambda opt, overrides, **kw: CompiledKernel(opt, overrides, b.phases)
    return b


BUILDS = {"debug": BuildOptions(taps=True, fast_compile="max"), "timed": BuildOptions(timing=True, fast_compile="max")}


def lm_head_with(extra: str) -> dict:
    base = texts_of(assemble(CFG, BUILDS["debug"]))["lm_head"]
    return {"lm_head": base + "\n" + extra + "\n"}


def test_a_deferred_build_compiles_in_the_background_and_finish_puts_it_in(backend):
    assert backend.build(BUILDS, {}, defer=("timed",)) > 0
    assert math.isnan(backend.finish())                   # a first build is never deferred: it makes the kernels
    backend.phases.clear()
    edit = lm_head_with("// an edit")
    backend.build(BUILDS, edit, defer=("timed",))
    assert texts_of(backend.kernels["debug"].asm)["lm_head"] == edit["lm_head"]
    assert backend._deferred is not None
    wall = backend.finish()
    assert wall > 0 and backend._deferred is None
    assert texts_of(backend.kernels["timed"].asm)["lm_head"] == edit["lm_head"]
    # the background compile left the phase word alone; finish said "compiling" while it waited
    assert ("compile", True, False) in backend.phases and ("compile", False, True) in backend.phases
    assert [x for x in backend.phases if isinstance(x, str)] == ["compiling", "idle"]


def test_a_timed_only_compile_error_puts_both_builds_back(backend):
    backend.build(BUILDS, {})
    before = {n: texts_of(k.asm) for n, k in backend.kernels.items()}
    bad = lm_head_with("#if WB_TIMING\n__device__ void f() { undeclared_in_timed += 1; }\n#endif")
    backend.build(BUILDS, bad, defer=("timed",))
    assert texts_of(backend.kernels["debug"].asm)["lm_head"] == bad["lm_head"]   # verified meanwhile
    with pytest.raises(CompileError) as e:
        backend.finish()
    assert any("undeclared_in_timed" in m[3] for m in e.value.messages)
    assert {n: texts_of(k.asm) for n, k in backend.kernels.items()} == before
    assert math.isnan(backend.finish())                    # nothing left pending


def test_an_error_in_both_builds_raises_at_once_and_changes_nothing(backend):
    backend.build(BUILDS, {})
    before = {n: texts_of(k.asm) for n, k in backend.kernels.items()}
    with pytest.raises(CompileError):
        backend.build(BUILDS, lm_head_with("__device__ void f() { undeclared_everywhere += 1; }"), defer=("timed",))
    assert math.isnan(backend.finish()) and backend._deferred is None    # the abandoned timed build, settled
    assert {n: texts_of(k.asm) for n, k in backend.kernels.items()} == before


def test_a_round_nobody_finished_is_waited_for_before_the_next(backend):
    backend.build(BUILDS, {})
    edit = lm_head_with("// first")
    backend.build(BUILDS, edit, defer=("timed",))
    backend.build(BUILDS, lm_head_with("// second"), defer=("timed",))   # the first round settles first
    assert backend.finish() > 0
    assert texts_of(backend.kernels["timed"].asm)["lm_head"].endswith("// second\n")


def test_a_verification_only_compile_error_puts_back_what_the_background_compiled(backend):
    backend.build(BUILDS, {})
    before = {n: texts_of(k.asm) for n, k in backend.kernels.items()}
    bad = lm_head_with("#if WB_TAPS\n__device__ void f() { undeclared_in_taps += 1; }\n#endif")
    with pytest.raises(CompileError) as e:
        backend.build(BUILDS, bad, defer=("timed",))
    assert any("undeclared_in_taps" in m[3] for m in e.value.messages)
    # reported at once: the timed build goes on compiling in the background, abandoned, and is put back when the
    # next call that needs the kernels waits for it
    assert backend._deferred is not None and backend._deferred.abandoned
    assert math.isnan(backend.finish())
    assert ("compile", True, False) in backend.phases            # the timed build did compile, in the background
    assert {n: texts_of(k.asm) for n, k in backend.kernels.items()} == before
    assert backend._deferred is None


def test_a_background_failure_that_is_not_a_compile_error_is_tried_again_in_the_caller(backend):
    """A build that failed in the background for another reason (a driver error, say) is built once more outside
    the thread, as the foreground builds are."""
    backend.build(BUILDS, {})
    calls = []
    real = CompiledKernel.reload

    def flaky(self, opt, overrides, phase=True):
        calls.append(phase)
        if not phase and len(calls) == 1:
            raise RuntimeError("stand-in for a driver error in the thread")
        return real(self, opt, overrides, phase)
    CompiledKernel.reload = flaky
    try:
        edit = lm_head_with("// retried")
        backend.build(BUILDS, edit, defer=("timed",))
        assert backend.finish() > 0
    finally:
        CompiledKernel.reload = real
    assert False in calls and calls.count(True) >= 2          # the thread's try, then the caller's
    assert texts_of(backend.kernels["timed"].asm)["lm_head"] == edit["lm_head"]

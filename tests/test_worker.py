"""The worker process on a CPU (a stand-in service, tests/fake_service.py): answers come back, errors come back as
themselves, and a hang, a spin that ignores the abort flag, a compiler that never returns, a fault and a crash are
each reported, with every block's last state read from the shared block, while this process lives on and the next
worker answers. Real processes, real shared memory, real kills."""
from __future__ import annotations

import time

import pytest
from fake_service import FakeService

from workbench import abi
from workbench.run.worker import BlockState, Worker, WorkerFailure, block_states, summarize_blocks


@pytest.fixture
def worker():
    w = Worker(FakeService, "test", hang_s=0.6, grace_s=0.3, compile_s=1.5, max_tokens=64)
    w.start()
    yield w
    w.close()


def test_calls_come_back(worker):
    assert worker.call("echo", 41) == ("test", 41)
    assert worker.call("run", 20) == 20
    assert worker.progress() == 20 and worker.alive


def test_errors_come_back_as_themselves(worker):
    with pytest.raises(ValueError, match="a plain error"):
        worker.call("error")
    assert worker.alive and worker.call("echo", 1) == ("test", 1)


def test_a_stalled_block_is_a_hang_named_with_every_blocks_state(worker):
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailure) as e:
        worker.call("run", 400, stall_block=2, obey_abort=False)
    dt = time.perf_counter() - t0
    f = e.value
    assert f.kind == "hang" and dt < 5
    assert "block 2: in" in str(f) and "waiting after o_proj_residual of layer 1" in str(f)
    assert [b.block for b in f.blocks if not b.waiting] == [2]
    assert not worker.alive
    worker.start()
    assert worker.call("echo", 2) == ("test", 2)


def test_a_spin_that_ignores_the_abort_flag_is_killed(worker):
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailure) as e:
        worker.call("spin")
    assert e.value.kind == "hang" and time.perf_counter() - t0 < 5
    assert "did not stop when asked" in str(e.value)
    assert worker.start() < 30 and worker.call("echo", 3) == ("test", 3)


def test_a_halted_grid_is_a_fault_at_the_watchdog_time(worker):
    """As the H200 shows a trap or a bad address: the grid halts whole, the waiting blocks' own timeouts never
    fire and the CUDA error does not come; at the watchdog time that is a fault, the faulting block named (the one
    still inside its stage), and the worker killed, without waiting for an error that comes seconds later."""
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailure) as e:
        worker.call("freeze", 60.0)
    dt = time.perf_counter() - t0
    assert e.value.kind == "fault" and e.value.killed and "the whole grid halted at once" in str(e.value)
    assert "block 0: in o_proj_residual of layer 1" in str(e.value)
    assert worker.hang_s <= dt < worker.hang_s + 1.0
    assert not worker.alive
    worker.start()
    assert worker.call("echo", 5) == ("test", 5)


def test_a_reported_hang_whose_straggler_spins_is_killed_after_the_grace(worker):
    """The waiting blocks report the hang (their barrier timed out) but the straggler spins on: the abort flag goes
    up at the report, and the worker is killed one grace period later, not a whole watchdog period later."""
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailure) as e:
        worker.call("spin")
    dt = time.perf_counter() - t0
    assert e.value.kind == "hang" and "a barrier timed out" in e.value.message
    assert "the kernel's report: grid barrier timed out" in e.value.message
    # the barrier timeout (0.2 s) plus the grace: the no-progress watchdog alone would wait 1.2 s, then the grace
    assert dt < 0.2 + worker.grace_s + 0.4


def test_calls_are_timed_on_both_sides(worker):
    worker.call("run", 20)
    c = worker.calls[-1]
    assert c.method == "run" and 0.1 < c.service_s <= c.wall_s and 0 <= c.overhead_s < 0.5


def test_a_hang_the_kernel_reports_itself_is_a_hang_without_a_kill(worker):
    """The kernel's own barrier report (KernelHang) comes back as a WorkerFailure like every other hang, with the
    blocks, and the worker lives on: every caller (the loop, the command line) handles one kind of failure."""
    with pytest.raises(WorkerFailure) as e:
        worker.call("barrier_report")
    f = e.value
    assert f.kind == "hang" and not f.killed and f.message.startswith("grid barrier timed out")
    assert "block 0: in o_proj_residual of layer 1 at step 2" in str(f)
    assert worker.alive and worker.call("echo", 7) == ("test", 7)


def test_a_kernel_that_watches_the_abort_flag_stops_without_a_kill(worker):
    with pytest.raises(WorkerFailure) as e:
        worker.call("run", 400, stall_block=1, obey_abort=True)
    assert e.value.kind == "hang" and not e.value.killed and "stopped when asked" in str(e.value)
    assert worker.alive and worker.call("echo", 6) == ("test", 6)


def test_a_compiler_that_never_returns(worker):
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailure) as e:
        worker.call("compile_forever")
    assert e.value.kind == "compiler" and time.perf_counter() - t0 < 5


def test_a_fault_ends_the_worker(worker):
    with pytest.raises(WorkerFailure) as e:
        worker.call("fault")
    assert e.value.kind == "fault" and "cudaErrorIllegalAddress" in str(e.value)
    time.sleep(0.2)
    assert not worker.alive


def test_a_crash_is_reported(worker):
    with pytest.raises(WorkerFailure) as e:
        worker.call("crash")
    assert e.value.kind == "crash" and "exit code 134" in str(e.value)
    worker.start()
    assert worker.call("echo", 4) == ("test", 4)


def test_an_interrupt_stops_the_run_and_keeps_the_worker(worker):
    def interrupt(w):
        if w.progress() >= 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        worker.call("run", 10_000, on_poll=interrupt)
    assert worker.alive and worker.call("echo", 5) == ("test", 5)


def test_block_states_and_summary():
    import numpy as np
    words = np.array([abi.where(3, 1, 2, True)] * 3 + [abi.where(3, 1, 2)] + [0], np.uint32).view(np.int32)
    blocks = block_states(words, None, 5)
    assert blocks[3] == BlockState(3, "o_proj_residual", 1, 2, False, False)
    assert blocks[4].stage is None
    s = summarize_blocks(blocks)
    assert s.index("block 3: in o_proj_residual of layer 1 at step 2") < s.index("blocks 0, 1, 2: waiting after")


def test_the_worker_builds_from_the_callers_kernel_folder(tmp_path, capfd):
    """The worker is another process: it must read the sections from the folder the caller edits (use_kernels_dir,
    as the suites and the tests do), not from its own default. A real CLI service and a real NVRTC compile: a
    broken line in the copy is reported at the copy's file and line."""
    import shutil

    from workbench import cli, paths
    copy = tmp_path / "kernels"
    shutil.copytree(paths.kernels_dir(), copy, ignore=shutil.ignore_patterns(".history"))
    section = copy / "sections" / "embedding.cuh"
    text = section.read_text().rstrip("\n") + "\n"
    section.write_text(text + "__device__ void wb_broken() { float y = nonsense; }\n")
    line = len(text.splitlines()) + 1
    args = cli._parser().parse_args(["build", "--model", "tiny"])
    with paths.use_kernels_dir(copy):
        assert cli._in_worker(args) == 1
    err = capfd.readouterr().err
    assert f"kernels/sections/embedding.cuh:{line}: error" in err and "nonsense" in err, err   # the copy's line

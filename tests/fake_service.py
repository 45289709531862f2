"""A service for the worker process that needs no GPU: it plays a kernel through the shared block (the where-words
and the heartbeat move while it 'runs', the abort flag stops it) and fails in each of the ways a real one can."""
from __future__ import annotations

import os
import time

import numpy as np

from workbench import abi
from workbench.run.worker import phase_setter


class FakeService:
    def __init__(self, buf, header, n_words, words, label="fake"):
        self.words = words
        self.mapped = np.frombuffer(buf, dtype=np.int32, count=header + n_words)[header:]
        self.set_phase = phase_setter(words)
        self.label = label

    def _where(self):
        o = abi.mapped_offset("where")
        return self.mapped[o:o + 4].view(np.uint32)                # the kernel writes u32 words

    def echo(self, x):
        return (self.label, x)

    def run(self, steps: int, *, stall_block: int | None = None, obey_abort: bool = True, timeout_s: float = 0.5):
        """A kernel of `steps` steps, 5 ms each; `stall_block` stops moving from step 2 (the others wait for it)."""
        self.set_phase("running", timeout_s, 4)
        abort = abi.mapped_offset("host_abort")
        prog = abi.mapped_offset("progress")
        self.mapped[abort] = 0
        w = self._where()
        for step in range(steps):
            if obey_abort and self.mapped[abort]:
                self.set_phase("checking")
                raise RuntimeError("aborted")
            for b in range(4):
                if stall_block == b and step >= 2:
                    continue
                if stall_block is not None and step >= 3:
                    w[b] = abi.where(3, 1, 2, waiting=True)          # everyone else waits after o_proj of layer 1
                else:
                    w[b] = abi.where(step % 5, step % 3, step)
            if stall_block is None or step < 3:
                self.mapped[prog] = step + 1
            elif (step - 3) * 0.005 > timeout_s:
                self._barrier_timed_out()                  # the waiting blocks' own timeout, as a kernel's
            time.sleep(0.005)
        self.set_phase("checking")
        return self.mapped[prog]

    def _barrier_timed_out(self):
        """What a kernel's barrier writes when it times out: the hang code first among the status words."""
        self.mapped[abi.mapped_offset("status") + abi.STATUS_WORDS.index("code")] = 1

    def spin(self):
        """A block that spins on a flag nobody sets, ignoring the abort flag; the others time out at the barrier."""
        self.set_phase("running", 0.2, 4)
        w = self._where()
        w[:] = [abi.where(3, 1, 2), abi.where(3, 1, 2, True), abi.where(3, 1, 2, True), abi.where(3, 1, 2, True)]
        time.sleep(0.2)
        self._barrier_timed_out()
        while True:
            time.sleep(0.01)

    def freeze(self, after_s: float = 1.5):
        """A fault as the GPU shows it: every block halts at once (the waiting ones' timeouts never fire), and
        the CUDA error reaches the process only seconds later, when the driver has torn the context down."""
        self.set_phase("running", 0.2, 4)
        w = self._where()
        w[:] = [abi.where(3, 1, 2), abi.where(3, 1, 2, True), abi.where(3, 1, 2, True), abi.where(3, 1, 2, True)]
        time.sleep(after_s)
        self.fault()

    def compile_forever(self):
        self.set_phase("compiling")
        while True:
            time.sleep(0.01)

    def crash(self):
        os._exit(134)                               # as NVRTC or ptxas taking the process down

    def fault(self):
        e = RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        e.status = 700
        raise e

    def error(self):
        raise ValueError("a plain error, reported as itself")

    def barrier_report(self):
        """A hang the kernel caught itself: its barrier timed out, named the straggler, and the kernel stopped."""
        from workbench.run.runtime import KernelHang
        self.set_phase("running", 0.2, 4)
        w = self._where()
        w[:] = [abi.where(3, 1, 2), abi.where(3, 1, 2, True), abi.where(3, 1, 2, True), abi.where(3, 1, 2, True)]
        self._barrier_timed_out()
        self.set_phase("checking")
        raise KernelHang("grid barrier timed out after the o_proj_residual stage of layer 1 at step 2: block 1 "
                         "waited, 1 block(s) never arrived, the first being block 0")

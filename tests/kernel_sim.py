"""A CPU stand-in for a taps build of the monokernel, to test the verifier without a GPU.

The reference interpreter in fp32 plays the kernel: it runs the plan's stages on the prepared weights, keeps a bf16
KV cache, and its stage outputs are packed into the plan's tap layout exactly where the kernel's debug build puts
them. The LM head's per-block partials are dealt the kernel's way, the sampler draws the kernel's way (fixed-point
masses, inverse CDF in index order, radix-style thresholds), publish feeds and streams tokens. A `hook(stage, layer,
step, outputs)` makes one stage deliberately wrong, as a mutant of the kernel would be, and `sampler_bug` /
`publish_bug` break the two stages that have no fp reference; `stop_bug` breaks one rule of the stop decision as
the publish mutant of that name does (declared in kernels/sections/publish.cuh).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from workbench import plan, schedule
from workbench.compiler.assemble import BuildOptions
from workbench.model import stage_math as S
from workbench.model.weights import to_bf16, to_f32
from workbench.reference import KVCache, PreparedView, forward
from workbench.run.runtime import KernelAborted, NonFiniteLogits, Result, Sampling


def kernel_draw(logits: np.ndarray, s: Sampling, step: int, d: int, *, top_k_extra: int = 0) -> int:
    """The kernel's draw (sections/sampling.cuh) in numpy: keys = logits/T in fp32, masses in 2^-40 fixed point,
    top-k and top-p thresholds on the keys, the first kept token in index order whose cumulative mass exceeds u·Z."""
    keys = (logits.astype(np.float32) / np.float32(s.temperature)).astype(np.float32)
    mkey = keys.max()
    mass = np.floor(np.exp((keys - mkey).astype(np.float32)).astype(np.float64) * 2.0 ** 40).astype(np.int64)
    keep = np.ones(keys.size, bool)
    k = s.top_k + top_k_extra
    if 0 < s.top_k < keys.size:
        kth = np.sort(keys)[::-1][min(k, keys.size) - 1]
        keep &= keys >= kth
    if s.top_p < 1:
        zk = int(mass[keep].sum())
        target = max(int(s.top_p * zk), 1)
        order = np.argsort(-keys[keep], kind="stable")
        cum = np.cumsum(mass[keep][order])
        cut = keys[keep][order][int(np.searchsorted(cum, target))]
        keep &= keys >= cut
    z = int(mass[keep].sum())
    u = int(S.draw_uniform(s.seed, step, d) * z)
    cum = np.cumsum(np.where(keep, mass, 0))
    return int(np.searchsorted(cum, u, side="right"))


@dataclasses.dataclass
class SimKernel:
    p: object                                  # Prepared (numpy)
    grid: int = 132
    hook: object = None                        # (stage, layer, step, outputs) -> outputs
    sampler_bug: bool = False                  # top-k keeps one token too many
    publish_bug: bool = False                  # feeds the sampled token even while the prompt lasts
    stops_early: bool = False                  # ends every run one step before it should (a wrong stop decision)
    stop_bug: str | None = None                # one rule of publish.cuh's stop decision broken, as its mutant does

    def __post_init__(self):
        self.cfg = self.p.cfg
        self.opt = BuildOptions(launch=plan.Launch(grid=self.grid), taps=True, sampler="full")
        self.launch = self.opt.effective_launch()
        self.max_steps = 256
        c = self.cfg
        self.cache = KVCache.empty(c, np.float32)
        self.view = PreparedView(self.p, np.float32)

    @property
    def k_cache(self):
        return to_bf16(self.cache.k)

    @property
    def v_cache(self):
        return to_bf16(self.cache.v)

    def fill_cache(self, upto: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        for c in (self.cache.k, self.cache.v):
            c[:, :, :upto] = to_f32(to_bf16(rng.standard_normal(c[:, :, :upto].shape).astype(np.float32)))

    def _partials(self, logits):
        """Rows dealt to warps round-robin, warps numbered block by block (matvec.cuh's grid_warp)."""
        nwarps = self.launch.threads // 32
        nw = self.grid * nwarps
        rows = np.arange(logits.size)
        block = (rows % nw) // nwarps
        bmax = np.full(self.grid, -np.inf, np.float32)
        barg = np.full(self.grid, 0x7FFFFFFF, np.int64)
        for b in range(self.grid):
            r = rows[block == b]
            v = logits[r]
            ok = ~np.isnan(v)                           # the kernel's comparisons skip NaN
            if ok.any():
                bmax[b] = v[ok].max()
                barg[b] = r[np.flatnonzero(v == bmax[b])[0]]
        return bmax, barg

    def request_stop(self):
        self._abort = True

    def generate(self, prompt, max_new, sampling=Sampling(), *, pos0=0, eos=None, record=(), tap_steps=(),
                 n_draws=0, poison_kv=False, kernel_limits=None, stop_requested=False, on_token=None, **_):
        cfg, launch = self.cfg, self.launch
        eos = list(eos or [])
        n_steps = len(prompt) + max_new - 1
        k_steps, k_new = (n_steps, max_new) if kernel_limits is None else kernel_limits
        if self.stops_early and k_steps > 1:
            k_steps -= 1
        bug = self.stop_bug
        self._abort = stop_requested
        self.view._model.pop("embed", None)             # the weights as they are now (a check may have edited them)
        record, tap_steps = sorted(record), sorted(tap_steps)
        floats = schedule.tap_step_floats(cfg, launch)
        taps = np.full((len(tap_steps), floats), np.nan, np.float32)
        logits_hist, draws = [], []
        fed, out = [int(prompt[0])], []
        aborted, bad = False, None
        step = -1
        # the stop decision below ends the run; the cache's size bounds a kernel whose decision is broken
        for step in range(cfg.max_seq - pos0):
            pos = pos0 + step
            t: dict = {}
            hook = None if self.hook is None else (lambda st, l, res, step=step: self.hook(st, l, step, res))
            lg = forward(self.view, [fed[step]], [pos], cache=self.cache, dtype=np.float32, taps=t, hook=hook)[0]
            bmax, barg = self._partials(lg)
            greedy = int(np.argmax(lg)) if np.isfinite(lg).all() else -1    # NaN logits leave no valid choice
            row_draws = []
            if sampling.greedy:
                sampled = greedy
            else:
                extra = 1 if self.sampler_bug else 0
                sampled = kernel_draw(lg, sampling, step, 0, top_k_extra=extra)
                if step in record and n_draws:
                    row_draws = [kernel_draw(lg, sampling, step, d, top_k_extra=extra) for d in range(n_draws)]
            if step in record:
                logits_hist.append(lg.copy())
                if n_draws:
                    draws.append(row_draws or [sampled] * n_draws)
            forced = step + 1 < len(prompt)
            nxt = int(prompt[step + 1]) if forced and not self.publish_bug else sampled
            stop = nxt < 0                              # publish refuses it and stops the kernel
            done = stop and bug != "nan-runs-on"
            if stop:
                nxt = 0
            elif not forced:                            # an invalid choice is never published
                g = step + 1 - len(prompt)
                out.append(nxt)
                if on_token:
                    on_token(nxt)
                done |= nxt in (eos[:1] if bug == "eos-only-first-id" else eos)
                done |= g + 1 >= k_new and bug != "max-new-ignored"
            done |= step + 1 >= k_steps and bug != "n-steps-ignored"
            done |= pos0 + step + (2 if bug == "cache-end-one-early" else 1) >= cfg.max_seq
            if (step & 15) == 15 and self._abort and bug != "abort-ignored":
                aborted = done = True
            fed.append(nxt)
            if step in tap_steps:
                row = taps[tap_steps.index(step)]
                for tp in schedule.taps(cfg, launch):
                    layers = range(cfg.n_layers) if tp.layers > 1 else [-1]
                    for layer in layers:
                        if tp.buffer == "blk_max":
                            v = bmax
                        elif tp.buffer == "blk_arg":
                            v = barg.astype(np.float32)
                        elif tp.buffer == "sampled":
                            v = np.float32([sampled])
                        else:
                            v = t[tp.stage, tp.buffer, layer][0]
                            if plan.BUFFERS[tp.buffer].dtype == "fixed":     # as the kernel's x holds it
                                v = S.residual_fixed(v, plan.X_FRAC_BITS)
                        off = tp.at(max(layer, 0))
                        row[off:off + tp.size] = v.reshape(-1)
            if stop and bad is None:
                bad = step
            if done:
                break
        steps = step + 1
        # what the host knows it fed: the prompt, then what was streamed (the runtime's Result.fed)
        host_fed = (list(prompt) + out)[:steps]
        if bad is not None:
            # as the runtime returns it: every recorded row, those of the steps never run unwritten (NaN)
            hist = np.full((len(record), cfg.vocab), np.nan, np.float32)
            if logits_hist:
                hist[:len(logits_hist)] = np.stack(logits_hist)
            self.last = Result(out, steps, 1.0, hist if record else None, record, None, None,
                               taps if tap_steps else None, tap_steps, pos0, host_fed, list(prompt), max_new, eos)
            e = NonFiniteLogits(f"no valid token at step {bad}: the logits are NaN or infinite")
            e.result = self.last
            raise e
        self.last = Result(out, steps, 1.0, np.stack(logits_hist) if logits_hist else None, record,
                           np.asarray(draws) if n_draws and record else None, None, taps if tap_steps else None,
                           tap_steps, pos0, host_fed, list(prompt), max_new, eos)
        if aborted:
            e = KernelAborted(f"kernel aborted: abort requested; it stopped at step {steps}")
            e.result = self.last
            raise e
        return self.last

"""The step's stop decision (kernels/sections/publish.cuh), verified branch by branch on the GPU.

A run ends when the token just generated is one of the EOS ids, when `max_new` tokens are out, when `n_steps` steps
have run, at the cache's last position, when the host asks (its abort word, read every 16 steps), and when no
token can be chosen because the logits are not finite. In an ordinary run several of these coincide (the host sets
n_steps = prompt + max_new − 1 and keeps both inside the cache), so a wrong rule can hide behind a right one. Here
each run gives the kernel limits past every rule but the one under test (`stream_tokens(kernel_limits=...)`), and
the run must end exactly where that rule says, with exactly the tokens of an unconstrained greedy stream up to it.

Each branch is one `Check` of stage `publish` (the stage that decides), so a wrong rule is named like any wrong
stage; publish.cuh's wb:checks block holds a mutant for each (workbench/check/mutants.py).
"""
from __future__ import annotations

import numpy as np

from .. import plan, schedule
from ..run.runtime import KernelAborted, KernelError, Monokernel, NonFiniteLogits, Sampling
from .stage_check import Check

STAGE = "publish"
ABORT_EVERY = 16            # publish.cuh reads the host's abort word at steps 15, 31, ... (a PCIe round trip each)
BF16_NAN = 0x7FC0


def _check(i: int, what: str, ok: bool, note: str, step: int = -1, position: int = -1) -> Check:
    # run numbers after any stage-local run's, so a stage that failed on its own inputs is reported first
    return Check(STAGE, f"stop: {what}", -1, max(step, 0), position, 10_000 + i, 0.0 if ok else float("inf"),
                 0.0, ok, note)


def _ended(res, steps: int, tokens: list[int]) -> tuple[bool, str]:
    """The run ran `steps` steps and streamed `tokens`, neither more nor less."""
    if res.steps != steps or list(res.tokens) != list(tokens):
        return False, (f"ran {res.steps} steps and streamed {len(res.tokens)} tokens {list(res.tokens)[:8]}; the rule "
                       f"ends it after {steps} steps with {len(tokens)} tokens {list(tokens)[:8]}")
    return True, f"ended after {steps} steps with {len(tokens)} tokens"


def verify_stops(mk: Monokernel, *, seed: int = 0, timeout_s: float = 5.0) -> list[Check]:
    """Every branch of the stop decision on `mk` (any build with the full or greedy sampler) → [Check]."""
    cfg = mk.cfg
    rng = np.random.default_rng(seed)
    greedy = Sampling()
    n_in, new = 2, 12
    if cfg.max_seq < ABORT_EVERY + 8:
        raise ValueError(f"the stop checks need a cache of at least {ABORT_EVERY + 8} positions, {cfg.name}'s holds "
                         f"{cfg.max_seq}")
    prompt = rng.integers(0, cfg.vocab, n_in).tolist()
    room = max(n_in + new + 4, ABORT_EVERY + 4)   # steps the kernel may run: past every rule's end below
    checks: list[Check] = []

    def run(max_new: int, limits, eos=(), **kw):
        return mk.generate(prompt, max_new, greedy, eos=list(eos), kernel_limits=limits, timeout_s=timeout_s, **kw)

    # the stream every rule cuts: greedy, deterministic (verify_repeat checks that)
    stream = run(new, (room, new)).tokens
    ok, note = _ended(mk.last, n_in + new - 1, stream[:new])
    checks.append(_check(len(checks), "max_new", ok, note, mk.last.steps - 1))

    # n_steps alone: inside the prompt (nothing generated), and after a few generated tokens
    for k in (1, n_in + 2):
        res = run(new, (k, room))
        ok, note = _ended(res, k, stream[:max(0, k - n_in + 1)])
        checks.append(_check(len(checks), f"n_steps = {k}", ok, note, res.steps - 1))

    # each position of an EOS list as long as the config's (two at least): the id there, a token of the stream at
    # its first occurrence, must end the run right after it is streamed; the other ids never occur
    n_eos = max(2, len(cfg.eos_token_ids))
    firsts = [i for i, t in enumerate(stream) if t not in stream[:i]]
    unused = [t for t in range(cfg.vocab) if t not in stream][:n_eos]
    if len(firsts) >= 2 and len(unused) == n_eos:
        for j in range(n_eos):
            at = firsts[min(j + 1, len(firsts) - 1)]            # not the first token: a run that ends at once
            eos = list(unused)
            eos[j] = stream[at]
            res = run(new, (room, room), eos=eos)
            ok, note = _ended(res, n_in + at, stream[:at + 1])
            checks.append(_check(len(checks), f"eos[{j}] of {n_eos}", ok, note, res.steps - 1))
    else:
        checks.append(_check(len(checks), "eos", False, f"the greedy stream {stream} has too few distinct tokens "
                                                        "to place an EOS id; another seed"))

    # the cache's end: the last position is pos0 + step = max_seq − 1, with the limits one step past it
    r = 5
    pos0 = cfg.max_seq - r
    mk.fill_cache(pos0, seed=seed)
    res = mk.generate(prompt[:1], 1, greedy, pos0=pos0, eos=[], kernel_limits=(r + 1, r + 1), timeout_s=timeout_s)
    ok = res.steps == r and len(res.tokens) == r
    checks.append(_check(len(checks), "end of the cache", ok,
                         f"from position {pos0} it ran {res.steps} steps ({len(res.tokens)} tokens); the cache's end "
                         f"at {cfg.max_seq} ends it after {r}", res.steps - 1, pos0 + res.steps - 1))

    # the host's abort, asked for before the launch: the run ends at the first step that reads the word (the 16th),
    # with KernelAborted; a kernel that ignores it runs all its steps
    try:
        res = run(new, (room, room), stop_requested=True)
        ok, note = False, f"ran {res.steps} steps: the abort word, set before the launch, was not seen"
    except KernelAborted as e:
        ok = mk.last.steps == min(ABORT_EVERY, room)
        note = f"stopped after {mk.last.steps} steps ({e}); the word is read after step {ABORT_EVERY}"
    checks.append(_check(len(checks), "host abort", ok, note, mk.last.steps - 1))

    # a non-finite logit: the last prompt token's embedding row made NaN, so its step has no valid token; the run
    # must end at that step with NonFiniteLogits, having streamed nothing
    tok = prompt[-1]
    row = mk.p.embed[tok].copy()
    try:
        mk.p.embed[tok].fill(BF16_NAN)
        try:
            mk.generate(prompt, new, greedy, eos=[], kernel_limits=(room, room), timeout_s=timeout_s)
            ok, note = False, f"ran {mk.last.steps} steps past a NaN logit without stopping"
        except NonFiniteLogits as e:
            ok = mk.last.steps == n_in and not mk.last.tokens
            note = f"stopped after {mk.last.steps} steps, {len(mk.last.tokens)} tokens streamed ({e})"
        except KernelError as e:
            ok, note = False, f"stopped with another error: {e}"
    finally:
        mk.p.embed[tok] = row
    checks.append(_check(len(checks), "non-finite logit", ok, note, mk.last.steps - 1))
    return checks


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)      # a cupy array's, or numpy's own


def verify_repeat(mk: Monokernel, first, rerun) -> list[Check]:
    """Two runs of the same command must give the same bits: tokens, logits, draws, and every tap. `first` is a
    Result, `rerun` a callable that runs it again. A difference is pinned on the first stage (in decode order of
    the first step that differs) whose tapped output differs."""
    again = rerun()
    same = list(first.tokens) == list(again.tokens) and first.steps == again.steps
    for name in ("logits", "draws", "taps"):
        a, b = getattr(first, name), getattr(again, name)
        if (a is None) != (b is None):
            same = False
        elif a is not None and (a.shape != b.shape or _host(a).tobytes() != _host(b).tobytes()):
            same = False
    if same:
        return [Check(STAGE, "repeat: bit for bit", -1, 0, first.pos0, 20_000, 0.0, 0.0, True,
                      f"{first.steps} steps, tokens, logits and taps identical in a second run")]
    where = (STAGE, -1, 0)
    if first.taps is not None and again.taps is not None:
        ta, tb = _host(first.taps), _host(again.taps)
        order = schedule.execution(mk.cfg)
        by = {(t.stage, t.buffer): t for t in schedule.taps(mk.cfg, mk.launch)}
        found = None
        for si, step in enumerate(first.tap_steps):
            for stage_name, layer in order:
                for buf in plan.stage(stage_name).taps:
                    t = by[(stage_name, buf)]
                    off = t.at(max(layer, 0))
                    if ta[si, off:off + t.size].tobytes() != tb[si, off:off + t.size].tobytes():
                        found = (stage_name, layer, step)
                        break
                if found:
                    break
            if found:
                break
        where = found or where
    stage_name, layer, step = where
    return [Check(stage_name, "repeat: bit for bit", layer, step, first.pos0 + step, 20_000, float("inf"), 0.0,
                  False, "a second run of the same command gave other bits: the first stage whose output differs "
                         "(an order of floating-point additions that varies between runs?)")]

"""What a reload or an A/B comparison did: the records the loop keeps, shows and hands to dashboards."""
from __future__ import annotations

import dataclasses
import math

from ..compiler.compile import CompileError
from ..measure.timing import signed


def format_compile_error(e: CompileError, limit: int = 12) -> str:
    """file:line: error: text, each followed by the numbered source line; warnings left out."""
    out = []
    for f, n, _, text, src in [m for m in e.messages if m[2] == "error"]:
        out.append(f"{f}{f':{n}' if n else ''}: error: {text}")
        if src:
            out.append(f"  {n:5d} | {src.rstrip()}")
    if not out:
        return str(e)
    more = len(out) // 2 - limit
    return "\n".join(out[:2 * limit]) + (f"\n  ... and {more} more errors" if more > 0 else "")


OK, VERIFY_FAILED, COMPILE_ERROR, ASSEMBLE_ERROR, RUN_ERROR, NO_GPU = (
    "ok", "verify failed", "compile error", "assemble error", "run error", "compiled; no GPU to run")
# the GPU worker hung, faulted or died (workbench.run.worker.WorkerFailure.kind): it was replaced
HANG, FAULT, CRASH, COMPILER = "hang", "fault", "crash", "compiler hang or crash"
WORKER_FAILURES = {"hang": HANG, "fault": FAULT, "crash": CRASH, "compiler": COMPILER}


@dataclasses.dataclass
class ReloadRecord:
    """What one reload did. Times in seconds; nan where the step did not run."""
    time: float                           # wall clock at the start (time.time())
    trigger: str                          # initial | manual | edit | magic | undo | watch | variant
    section: str | None                   # the section whose edit triggered it, if known
    variant: str | None
    variants: tuple                       # ((section, variant), ...) in force
    status: str = OK                      # OK, VERIFY_FAILED, COMPILE_ERROR, ASSEMBLE_ERROR, RUN_ERROR or NO_GPU
    compile_s: float = math.nan           # the verification build's compile (and the timed one's, if not deferred)
    verify_s: float = math.nan
    time_s: float = math.nan
    total_s: float = math.nan
    verdict_s: float = math.nan           # from the reload's start to the verification's verdict
    timed_compile_s: float = math.nan     # the timed build, compiled in the background from the reload's start
    passed: bool | None = None            # None: not verified (no GPU, or no kernel)
    first_failure: str | None = None      # one line: "qkv_rope_append: q at layer 0, step 3 (position 3): ..."
    failure: object = None                # workbench.check.stage_check.Failure, structured
    tok_per_s: float | None = None
    error: str | None = None              # compile error (file:line + source line) or the run error
    messages: list = dataclasses.field(default_factory=list)   # CompileError.messages
    stages: object = None                 # workbench.check.stage_check.StageTable
    end_to_end: str | None = None         # the end-to-end check's summary line
    timing: list | None = None            # [workbench.measure.timing.StageRow]
    timing_text: str | None = None
    key: str | None = None                # assembled source key of the debug build
    resources: dict | None = None
    tokens_ok: bool | None = None         # greedy tokens equal the reference's argmax where judgeable
    sampler: str | None = None            # the builds' sampler: "greedy" (argmax only) or "full"
    blocks: list | None = None            # after a hang or fault: every block's last state (run.worker.BlockState)
    detect_s: float | None = None         # after a hang or fault: from the call to its report
    restart_s: float | None = None        # after a hang or fault: the new worker with the last good kernels

    @property
    def ok(self) -> bool:
        return self.status in (OK, NO_GPU)

    def block_table(self) -> str:
        """Every block's last state after a hang or fault: one line per block."""
        return "\n".join(str(b) for b in self.blocks or [])

    def report(self) -> str:
        """A short human-readable account: one line, plus the errors."""
        what = self.section + (f"@{self.variant}" if self.variant else "") if self.section else "reload"
        if self.status in (COMPILE_ERROR, ASSEMBLE_ERROR):
            return (f"✗ {what}: {self.status} after {self.compile_s:.2f} s; the last good kernel stays loaded\n"
                    f"{self.error}")
        parts = [f"compiled {self.compile_s:.2f} s"]
        if math.isfinite(self.timed_compile_s):
            parts[0] += f" (the timed build {self.timed_compile_s:.2f} s, beside verification)"
        if self.status == NO_GPU:
            if r := self.resources:
                parts.append(f"{r.get('registers')} registers, {r.get('local_bytes', 0)} B local")
            if not math.isnan(self.verify_s):
                parts.append(f"CPU reference {self.verify_s:.2f} s")
            # nothing ran on a GPU, so nothing was verified: no tick
            return f"○ {what}: " + ", ".join(parts) + "; not verified (no GPU to run the kernel)"
        if self.stages is not None:
            parts.append(f"verified {self.verify_s:.2f} s (verdict at {self.verdict_s:.2f} s)")
        if self.tok_per_s:
            parts.append(f"{self.tok_per_s:,.0f} tok/s (timed {self.time_s:.2f} s)")
        parts.append(f"total {self.total_s:.2f} s")
        line = ", ".join(parts)
        if self.status == OK:
            return f"✓ {what}: {line}; every stage within tolerance on its own inputs"
        if self.status == VERIFY_FAILED:
            return f"✗ {what}: VERIFY FAILED: {self.first_failure}\n  {line}; table: wb.last.stages"
        if self.status in WORKER_FAILURES.values():
            replaced = ("a new GPU worker is starting with the last good kernels" if self.restart_s is None else
                        f"the GPU worker was replaced in {self.restart_s:.1f} s with the last good kernels")
            return (f"✗ {what}: {self.status.upper()}, reported after {self.detect_s:.1f} s: {self.error}\n"
                    f"  {replaced}; every block: wb.last.block_table()")
        return f"✗ {what}: {self.status}: {self.error}\n  {line}"

    def verdict(self) -> str:
        """One line, as soon as verification has spoken (Workbench.on_verdict), before the timed build is in."""
        what = self.section + (f"@{self.variant}" if self.variant else "") if self.section else "reload"
        if self.passed is None:
            return f"○ {what}: not verified ({self.status})"
        mark, how = ("✓", "every stage within tolerance on its own inputs") if self.passed else \
            ("✗", f"VERIFY FAILED: {self.first_failure}")
        return f"{mark} {what}: {how} (verdict after {self.verdict_s:.2f} s; the timed build follows)"

    def to_dict(self) -> dict:
        """Plain Python for dashboards and JSON (NaN/inf become None)."""
        def num(v):
            return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
        d = {k: getattr(self, k) for k in ("time", "trigger", "section", "variant", "status", "passed",
                                           "first_failure", "error", "key", "tokens_ok", "sampler", "end_to_end")}
        d.update({k: num(getattr(self, k)) for k in ("compile_s", "verify_s", "time_s", "total_s", "tok_per_s",
                                                     "verdict_s", "timed_compile_s")})
        d.update(variants=[list(v) for v in self.variants], messages=[list(m) for m in self.messages],
                 resources=dict(self.resources) if self.resources else None,
                 blocks=[dataclasses.asdict(b) for b in self.blocks] if self.blocks else None,
                 detect_s=self.detect_s, restart_s=self.restart_s,
                 stages=self.stages.to_dict(json_safe=True) if self.stages is not None else None,
                 timing=_rows(self.timing), timing_text=self.timing_text, report=self.report())
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
            lines.append(f"B/A: {self.speedup:.3f}× ({signed(100 * (self.speedup - 1), 1, '%')})")
        deltas = self.stage_deltas()
        if deltas:
            # the per-stage µs/token of each build's last timed run (a table whose columns line up, whatever the
            # stages' names)
            w = max(len("stage"), *(len(st) for st, _, _ in deltas))
            lines.append(f"  {'stage':{w}s} {'A µs/token':>11s} {'B µs/token':>11s} {'B − A':>7s} {'%':>6s}")
            for stage, ua, ub in deltas:
                b = "—" if math.isnan(ub) else f"{ub:.1f}"
                pct = signed(100 * (ub - ua) / ua, 0, "%") if ua and not math.isnan(ub) else "—"
                lines.append(f"  {stage:{w}s} {ua:11.1f} {b:>11s} {signed(ub - ua):>7s} {pct:>6s}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"a": [list(v) for v in self.a], "b": [list(v) for v in self.b], "a_tok_s": self.a_tok_s,
                "b_tok_s": self.b_tok_s, "a_runs": list(self.a_runs), "b_runs": list(self.b_runs),
                "speedup": self.speedup, "a_passed": self.a_passed, "b_passed": self.b_passed,
                "a_failure": self.a_failure, "b_failure": self.b_failure, "a_error": self.a_error,
                "b_error": self.b_error, "a_timing": _rows(self.a_timing), "b_timing": _rows(self.b_timing),
                "a_stages": self.a_stages.to_dict(json_safe=True) if self.a_stages is not None else None,
                "b_stages": self.b_stages.to_dict(json_safe=True) if self.b_stages is not None else None,
                "report": self.report()}


def _rows(timing) -> list | None:
    """[StageRow] → plain dicts."""
    return [{**dataclasses.asdict(r), "spread": list(r.spread)} for r in timing] if timing else None

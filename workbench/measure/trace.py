"""Timing traces: the kernel's %globaltimer stamps, saved, loaded, and exported for Perfetto.

The stamps of a timing build (`BuildOptions(timing=True)`, see workbench/measure/timing.py) are uint64 nanoseconds
[steps, slots, blocks, 2]: for every grid barrier of a step (the slots of `workbench.schedule.slots`), when each block
arrived and when it left. Every slot is stamped in every step; slot 0 holds what the previous step ran after its
last barrier and this step's first stages (at step 0 only the latter). A stamp not yet written reads 0 (a snapshot
taken while the kernel runs).

A trace file is a compressed .npz:
  format    "workbench-timing-trace/2"
  base_ns   uint64 scalar: the earliest stamp
  delta_ns  int32 (int64 when a run spans more than 2 s) [steps, slots, blocks, 2]: stamp − base_ns; −1 = unwritten
  meta      a JSON object: device, date, commit, model, config, position, tok_s, roofline_tbps, recorded, ..., and
            slots: the layout the stamps follow ({"labels": [...], "layers": [...], "step0_label": slot 0's label
            at step 0}), so that a trace describes itself
so a few thousand stamps per step cost ~25 KB. A "workbench-timing-trace/1" file was recorded with the older slot
layout (slot 0 the first embedding, stamped in step 0 only; sampling last) and is refused on load: `convert_v1`
regroups its stamps (the same barriers) into this layout, and `python -m workbench.measure.trace convert OLD NEW`
does it for a file. `python -m workbench.measure.trace` also packs a raw .npy into a trace (`--from-v1` for stamps
of the older layout), prints a trace's metadata and table, and exports Perfetto JSON.

Perfetto export (`to_perfetto`): the Chrome trace-event JSON that Perfetto's importer reads: one track (thread) per
block, the blocks of one process; per slot and block a "work" slice (leaving the previous barrier → arriving at
this one) and a "wait" slice (arriving → leaving), with stage, layer, step and position in args; a "grid" track
with each barrier's release-to-release span. Timestamps are µs from the trace's first stamp (4 decimals, biased by
0.1 ns so that an importer truncating to integer ns gets the exact stamp). The JSON keeps to what the oldest
importers accept: "traceEvents" first, no arrays inside events, ASCII text.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..errors import UsageError, UserError
from ..model.config import PRESETS, ModelConfig, RopeScaling
from ..paths import FIXTURES
from .timing import (StageRow, critical_table, first_step_label, format_critical, format_table, slot_names,
                     stage_table)

FORMAT = "workbench-timing-trace/2"
FORMAT_V1 = "workbench-timing-trace/1"      # the older slot layout: see convert_v1
RECORDED = {0: "timing_h200_llama-3.2-1b_pos0.npz", 3700: "timing_h200_llama-3.2-1b_pos3700.npz"}


class OldLayoutError(UserError):
    """A trace recorded with the older slot layout (format /1): convert it first."""


# -- the slot layout a trace follows ------------------------------------------------------------------------------

def slots_meta(cfg: ModelConfig) -> dict:
    """The plan's slot layout for cfg, as a trace's meta["slots"]."""
    names = slot_names(cfg)
    return {"labels": [n for n, _ in names], "layers": [int(l) for _, l in names],
            "step0_label": first_step_label(cfg)}


def slots_from_meta(meta: dict) -> tuple[list[tuple[str, int]], str] | None:
    """(slot names, slot 0's label at step 0) stored in a trace's metadata; None when it has none."""
    s = (meta or {}).get("slots")
    if not s:
        return None
    names = [(str(n), int(l)) for n, l in zip(s["labels"], s["layers"])]
    return names, str(s.get("step0_label") or names[0][0])


def names_at(names: list[tuple[str, int]], step0_label: str, step: int) -> list[tuple[str, int]]:
    """The slot names of one step: at step 0, slot 0 holds only its own stages."""
    return [(step0_label, names[0][1])] + list(names[1:]) if step == 0 and names else list(names)


def _layout(cfg: ModelConfig, meta: dict | None) -> tuple[list[tuple[str, int]], str]:
    got = slots_from_meta(meta or {})
    return got if got is not None else (slot_names(cfg), first_step_label(cfg))


def convert_v1(stamps: np.ndarray) -> np.ndarray:
    """Stamps of the older layout (format /1: [steps, 1 + 5L + 2, blocks, 2], slot 0 the first embedding stamped in
    step 0 only, then the layers, lm_head, sampling) → this layout ([steps, 5L + 2, blocks, 2]). The barrier after
    step s's sampling is the barrier that ends slot 0 of step s + 1, so nothing is lost but the last step's final
    barrier: new[0, 0] = old[0, 0], new[s, 0] = old[s − 1, −1] for s ≥ 1, new[s, 1:] = old[s, 1:−1]."""
    old = np.asarray(stamps)
    if old.ndim != 4 or old.shape[-1] != 2 or old.shape[1] < 3:
        raise UserError(f"stamps of the older layout must be [steps, slots ≥ 3, blocks, 2], got shape {old.shape}")
    new = np.zeros((old.shape[0], old.shape[1] - 1) + old.shape[2:], dtype=old.dtype)
    new[:, 1:] = old[:, 1:-1]
    if old.shape[0]:
        new[0, 0] = old[0, 0]
        new[1:, 0] = old[:-1, -1]
    return new


# -- the trace object ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Trace:
    stamps: np.ndarray            # uint64 [steps, slots, blocks, 2], 0 = unwritten
    meta: dict
    path: str | None = None

    @property
    def cfg(self) -> ModelConfig:
        return config_from_meta(self.meta)

    @property
    def pos0(self) -> int:
        return int(self.meta.get("position", 0))

    @property
    def recorded(self) -> bool:
        return bool(self.meta.get("recorded", False))

    @property
    def tok_s(self) -> float | None:
        v = self.meta.get("tok_s")
        return None if v is None else float(v)

    @property
    def roofline_tbps(self) -> float | None:
        v = self.meta.get("roofline_tbps")
        return None if v is None else float(v)

    @property
    def title(self) -> str:
        return source_title(self.meta)

    @property
    def label(self) -> str:
        """Short name of the run: model and position (and variant, when the metadata has one)."""
        m = self.meta
        return f"{m.get('model', '?')} pos {self.pos0:,}" + (f", {m['variant']}" if m.get("variant") else "")

    @property
    def complete_steps(self) -> int:
        return complete_steps(self.stamps)

    @property
    def slot_names(self) -> list[tuple[str, int]]:
        """(label, layer) of every slot, as the trace's metadata records them (the plan's, for a raw .npy)."""
        return _layout(self.cfg, self.meta)[0]

    def stage_table(self, skip_first: int = 1) -> list[StageRow]:
        return stage_rows(self.stamps, self.cfg, self.pos0, skip_first, names=self.slot_names)

    def to_perfetto(self, **kw) -> dict:
        return to_perfetto(self.stamps, self.cfg, pos0=self.pos0, meta=self.meta, **kw)

    def write_perfetto(self, path, **kw) -> Path:
        return write_perfetto(path, self.to_perfetto(**kw))

    def save(self, path) -> Path:
        return save_trace(path, self.stamps, self.meta)


def source_title(meta: dict) -> str:
    """"recorded on NVIDIA H200, 2026-11-30, commit 9967ec4" for a recording; "live on …" otherwise."""
    parts = [f"{'recorded' if meta.get('recorded') else 'live'} on {meta.get('device') or 'unknown device'}"]
    if meta.get("date"):
        parts.append(str(meta["date"]))
    if meta.get("commit"):
        parts.append(f"commit {meta['commit']}")
    return ", ".join(parts)


def config_from_meta(meta: dict) -> ModelConfig:
    d = meta.get("config")
    if d:
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return ModelConfig(**d)
    name = meta.get("model")
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"the trace's metadata names no config and model {name!r} is not a preset")


def git_commit(short: bool = True) -> str | None:
    """The commit of this checkout (None outside git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short" if short else "--verify", "HEAD"],
                             cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def recording_meta(cfg: ModelConfig, *, position: int = 0, tok_s: float | None = None,
                   roofline_tbps: float | None = None, device: str | None = None, date: str | None = None,
                   commit: str | None = None, recorded: bool = True, **extra) -> dict:
    """The metadata of a trace saved from this machine (device name from CuPy when there is a GPU)."""
    if device is None:
        try:
            import cupy
            device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        except Exception:
            device = "unknown device"
    meta = dict(format=FORMAT, recorded=recorded, device=device, date=date or datetime.date.today().isoformat(),
                commit=commit or git_commit(), model=cfg.name,
                config={**dataclasses.asdict(cfg), "eos_token_ids": list(cfg.eos_token_ids)}, position=int(position),
                tok_s=None if tok_s is None else float(tok_s),
                roofline_tbps=None if roofline_tbps is None else float(roofline_tbps), slots=slots_meta(cfg))
    meta.update(extra)
    return meta


# -- files --------------------------------------------------------------------------------------------------------

def encode(stamps: np.ndarray) -> tuple[int, np.ndarray]:
    """(base, deltas): deltas are stamp − base, −1 where the stamp is unwritten (0)."""
    t = np.asarray(stamps, dtype=np.uint64)
    if t.ndim != 4 or t.shape[-1] != 2:
        raise ValueError(f"stamps must be [steps, slots, blocks, 2], got shape {t.shape}")
    written = t > 0
    base = int(t[written].min()) if written.any() else 0
    delta = np.where(written, t.astype(np.int64) - base, -1)
    return base, delta.astype(np.int32 if delta.max(initial=0) < 2**31 - 1 else np.int64)


def decode(base: int, delta: np.ndarray) -> np.ndarray:
    d = np.asarray(delta, dtype=np.int64)
    return np.where(d >= 0, d + int(base), 0).astype(np.uint64)


def save_trace(path, stamps: np.ndarray, meta: dict) -> Path:
    """Write a trace file. The slot layout goes into the metadata (the plan's for the metadata's config, unless
    meta has one already); stamps that do not fit it are refused."""
    path = Path(path)
    base, delta = encode(stamps)
    meta = dict(meta, format=FORMAT)
    if not meta.get("slots"):
        with contextlib.suppress(ValueError, TypeError):    # no config to derive it from: the reader assumes the plan's
            meta["slots"] = slots_meta(config_from_meta(meta))
    got = slots_from_meta(meta)
    if got is not None and len(got[0]) != delta.shape[1]:
        raise UserError(f"stamps have {delta.shape[1]} slots per step, the layout {len(got[0])} "
                        f"({meta.get('model', '?')}): stamps of the older layout need convert_v1 first")
    np.savez_compressed(path, format=np.array(FORMAT), base_ns=np.array(base, np.uint64), delta_ns=delta,
                        meta=np.array(json.dumps(meta, ensure_ascii=False, indent=1)))
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def _read(path: Path) -> tuple[str | None, dict, np.ndarray | None]:
    """(format, meta, stamps) of an .npz, whatever its format (stamps None when it is no trace)."""
    with np.load(path, allow_pickle=False) as z:
        fmt = str(z["format"]) if "format" in z else None
        if fmt not in (FORMAT, FORMAT_V1):
            return fmt, {}, None
        return fmt, json.loads(str(z["meta"])), decode(int(z["base_ns"]), z["delta_ns"])


def load_trace(path) -> Trace:
    """A trace file (.npz, see the module docstring), or a raw stamps .npy (metadata then empty: pass it on; its
    stamps are taken to follow the plan's layout). A trace of the older layout (format /1) is refused: convert it
    (`convert_trace`, or `python -m workbench.measure.trace convert OLD NEW`)."""
    path = Path(path)
    if path.suffix == ".npy":
        return Trace(np.load(path), {}, str(path))
    fmt, meta, stamps = _read(path)
    if fmt == FORMAT_V1:
        raise OldLayoutError(f"{path}: recorded with the old slot layout ({FORMAT_V1}: the first embedding in step 0 "
                             f"only, sampling last); convert it with `python -m workbench.measure.trace convert "
                             f"{path} NEW.npz`")
    if stamps is None:
        raise UserError(f"{path}: not a workbench timing trace (format {fmt!r}, expected {FORMAT!r})")
    got = slots_from_meta(meta)
    if got is not None and len(got[0]) != stamps.shape[1]:
        raise UserError(f"{path}: {stamps.shape[1]} slots per step but its layout lists {len(got[0])}")
    return Trace(stamps, meta, str(path))


CONVERSION_NOTE = (f"converted from the older slot layout ({FORMAT_V1}: the first embedding stamped in step 0 "
                   "only, sampling last) by convert_v1: the same barriers, regrouped so that slot 0 of step s is "
                   "the barrier after step s - 1's sampling; the last step's final barrier is dropped")


def convert_trace(src, dst) -> Path:
    """Convert a trace file of the older layout (format /1) into this one: stamps through convert_v1, metadata
    kept, with the slot layout and a note saying it was converted."""
    src = Path(src)
    fmt, meta, stamps = _read(src)
    if fmt != FORMAT_V1:
        raise UserError(f"{src}: not a {FORMAT_V1} trace (format {fmt!r})")
    cfg = config_from_meta(meta)
    want = len(slot_names(cfg)) + 1
    if stamps.shape[1] != want:
        raise UserError(f"{src}: {stamps.shape[1]} slots per step; the older layout of {cfg.name} has {want}")
    meta = dict(meta)
    meta.pop("slots", None)
    meta["converted_from"] = FORMAT_V1
    meta["note"] = f"{meta['note']}; {CONVERSION_NOTE}" if meta.get("note") else CONVERSION_NOTE
    return save_trace(dst, convert_v1(stamps), meta)


def recorded_path(position: int = 0) -> Path:
    """The recorded H200 fixture at `position` (0 or 3700) in this checkout's fixtures/."""
    if position not in RECORDED:
        raise KeyError(f"no recorded trace at position {position}; there are {sorted(RECORDED)}")
    p = FIXTURES / RECORDED[position]
    if not p.exists():
        raise FileNotFoundError(f"{p} is missing: the recorded traces ship in the repository's fixtures/, "
                                "not in an installed package")
    return p


def load_recorded(position: int = 0) -> Trace:
    return load_trace(recorded_path(position))


# -- analysis that tolerates unwritten stamps ---------------------------------------------------------------------

def complete_steps(stamps: np.ndarray) -> int:
    """How many leading steps have every stamp written (every slot is stamped in every step)."""
    t = np.asarray(stamps)
    if t.ndim != 4 or t.shape[0] == 0:
        return 0
    bad = np.flatnonzero(~(t > 0).all(axis=(1, 2, 3)))
    return int(bad[0]) if bad.size else int(t.shape[0])


def stage_rows(stamps: np.ndarray, cfg: ModelConfig, pos0: int = 0, skip_first: int = 1,
               names: list[tuple[str, int]] | None = None) -> list[StageRow]:
    """timing.stage_table over the complete steps only; [] when none is complete. With a single complete step that
    step is used even when skip_first asks to drop it. `names`: the trace's slot layout (default the plan's)."""
    n = complete_steps(stamps)
    if n == 0:
        return []
    return stage_table(cfg, np.asarray(stamps)[:n], pos0, skip_first if n > skip_first else 0, names=names)


def step_ns(stamps: np.ndarray) -> np.ndarray:
    """Duration of each complete step in ns: barrier release to barrier release (step 0 from its first arrival)."""
    n = complete_steps(stamps)
    if n == 0:
        return np.zeros(0)
    t = np.asarray(stamps)[:n].astype(np.int64)
    end = t[:, -1, :, 1].max(axis=1)
    start = np.empty_like(end)
    start[0] = t[0, 0, :, 0].min()
    start[1:] = end[:-1]
    return (end - start).astype(np.float64)


def roofline_tok_s(cfg: ModelConfig, tbps: float, position: int) -> float:
    """tok/s at the streaming-read roofline for a token at `position`: weights plus the KV cache read."""
    return tbps * 1e12 / (cfg.weight_bytes_per_token() + cfg.kv_bytes_per_token(position))


@dataclasses.dataclass
class Intervals:
    """Per block: start (it left the previous barrier), arrive, leave, in ns, [steps, slots, blocks]; `known` marks
    the slots whose three stamps are all written."""
    start: np.ndarray
    arrive: np.ndarray
    leave: np.ndarray
    known: np.ndarray

    @property
    def work(self) -> np.ndarray:
        return self.arrive - self.start

    @property
    def wait(self) -> np.ndarray:
        return self.leave - self.arrive


def intervals(stamps: np.ndarray) -> Intervals:
    t = np.asarray(stamps)
    arrive, leave = t[..., 0].astype(np.int64), t[..., 1].astype(np.int64)
    start = np.zeros_like(arrive)
    start[:, 1:] = leave[:, :-1]
    start[1:, 0] = leave[:-1, -1]             # slot 0 begins where the previous step's last barrier let go
    written = (arrive > 0) & (leave > 0)
    if t.shape[0]:
        first = arrive[0, 0][arrive[0, 0] > 0]
        start[0, 0] = first.min() if first.size else 0   # the kernel's start is not stamped: the first arrival
    return Intervals(start, arrive, leave, written & (start > 0))


# -- Perfetto / Chrome trace JSON ---------------------------------------------------------------------------------

def to_perfetto(stamps: np.ndarray, cfg: ModelConfig, *, pos0: int = 0, meta: dict | None = None,
                steps=None, blocks=None, grid_track: bool = True) -> dict:
    """Chrome trace-event JSON (a dict; see write_perfetto) of the given steps (default: every step with stamps) and
    blocks (default all); a step or block the stamps do not have is refused (UsageError). The slot layout is the
    one in `meta` (a trace's own), else the plan's. ~22k events per step for 132 blocks: export a few steps, not
    hundreds."""
    t = np.asarray(stamps)
    iv = intervals(t)
    names, step0_label = _layout(cfg, meta)
    if len(names) != t.shape[1]:
        raise UserError(f"stamps have {t.shape[1]} slots per step, the layout of {cfg.name} {len(names)}")
    base = int(t[t > 0].min()) if (t > 0).any() else 0
    n_steps, n_slots, n_blocks = iv.arrive.shape
    steps = range(n_steps) if steps is None else list(steps)
    blocks = range(n_blocks) if blocks is None else list(blocks)
    for what, asked, n in (("step", steps, n_steps), ("block", blocks, n_blocks)):
        missing = [x for x in asked if not 0 <= x < n]
        have = f"{what}s 0–{n - 1}" if n > 1 else f"{what} 0" if n else f"no {what}s"
        if missing:
            one = len(missing) == 1
            raise UsageError(f"{what}{'' if one else 's'} {_span(missing)} {'is' if one else 'are'} not in the "
                             f"trace: it has {have}")
        if not len(asked):
            raise UsageError(f"no {what}s asked for: the trace has {have}")
    title = f"monokernel {cfg.name}" + (f" ({source_title(meta)})" if meta else "")
    pid, grid_tid = 1, 999

    def us(ns) -> float:
        # µs with a +0.1 ns bias: importers that truncate µs·1000 to an integer land on the exact nanosecond
        return round((int(ns) - base + 0.1) / 1e3, 4)

    def dur(ns) -> float:
        return round((int(ns) + 0.1) / 1e3, 4)

    ev = [dict(name="process_name", ph="M", pid=pid, tid=0, args=dict(name=_ascii(title)))]
    if grid_track:
        ev += [dict(name="thread_name", ph="M", pid=pid, tid=grid_tid, args=dict(name="grid: barrier to barrier")),
               dict(name="thread_sort_index", ph="M", pid=pid, tid=grid_tid, args=dict(sort_index=-1))]
    for b in blocks:
        ev += [dict(name="thread_name", ph="M", pid=pid, tid=1000 + b, args=dict(name=f"block {b}")),
               dict(name="thread_sort_index", ph="M", pid=pid, tid=1000 + b, args=dict(sort_index=b))]
    for s in steps:
        step_names = names_at(names, step0_label, s)
        for k in range(n_slots):
            stage, layer = step_names[k]
            common = dict(stage=stage, layer=layer, step=s, position=pos0 + s, slot=k)
            for b in blocks:
                if not iv.known[s, k, b]:
                    continue
                st, ar, lv = iv.start[s, k, b], iv.arrive[s, k, b], iv.leave[s, k, b]
                a = dict(common, block=b)
                ev.append(dict(name=stage, cat="work", ph="X", pid=pid, tid=1000 + b, ts=us(st),
                               dur=dur(ar - st), args=dict(a, part="work")))
                ev.append(dict(name=f"wait ({stage})", cat="wait", ph="X", pid=pid, tid=1000 + b, ts=us(ar),
                               dur=dur(lv - ar), args=dict(a, part="wait")))
            if grid_track and iv.known[s, k].all():
                st = iv.start[s, k].max() if not (s == 0 and k == 0) else iv.start[0, 0, 0]
                ev.append(dict(name=stage, cat="grid", ph="X", pid=pid, tid=grid_tid, ts=us(st),
                               dur=dur(iv.leave[s, k].max() - st), args=dict(common)))
    other = {"generator": "workbench.trace", "model": cfg.name, "position": pos0, "base_ns": str(base)}
    for k, v in (meta or {}).items():
        if isinstance(v, (str, int, float, bool)) and k not in other:
            other[k] = _ascii(v) if isinstance(v, str) else v
    return {"traceEvents": ev, "otherData": other}


def write_perfetto(path, trace_json: dict) -> Path:
    """Write the JSON (traceEvents first: older importers ignore everything after an unknown top-level key)."""
    path = Path(path)
    with open(path, "w", encoding="ascii") as f:
        json.dump({"traceEvents": trace_json["traceEvents"], **trace_json}, f, separators=(",", ":"), ensure_ascii=True)
    return path


def _span(xs) -> str:
    """Numbers as text: "99", "17–20" for a run, else a list."""
    xs = sorted(xs)
    if len(xs) == 1:
        return str(xs[0])
    return f"{xs[0]}–{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else ", ".join(map(str, xs))


def _ascii(s: str) -> str:
    return s.replace("µ", "u").replace("–", "-").replace("·", "-").encode("ascii", "replace").decode()


# -- command line: pack, convert, info, perfetto ------------------------------------------------------------------

def _steps_arg(text: str) -> range:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise UsageError(f"--steps {text!r}: give N or A-B (e.g. 1 or 1-2)") from None
    if b < a:
        raise UsageError(f"--steps {text}: the range ends before it starts")
    return range(a, b + 1)


def main(argv=None) -> int:
    """The command line; a refusal (a trace of the older layout, steps the trace lacks, ...) is one line on stderr,
    `error: ...`, and exit code 2."""
    try:
        return _main(argv)
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.measure.trace",
                                 description="timing traces: pack, convert, info, perfetto")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="a raw stamps .npy (scripts/device_suite.py) → a trace .npz with metadata")
    p.add_argument("npy")
    p.add_argument("out")
    p.add_argument("--model", required=True)
    p.add_argument("--position", type=int, default=0)
    p.add_argument("--steps", type=int, help="keep the first N steps")
    p.add_argument("--device", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--tok-s", type=float)
    p.add_argument("--roofline-tbps", type=float)
    p.add_argument("--meta", default="{}", help="more metadata, a JSON object")
    p.add_argument("--from-v1", action="store_true",
                   help="the .npy was recorded with the older slot layout (first embedding in step 0 only, "
                        "sampling last): convert it (convert_v1)")
    c = sub.add_parser("convert", help=f"a {FORMAT_V1} trace (the older slot layout) → a {FORMAT} trace")
    c.add_argument("old")
    c.add_argument("new")
    i = sub.add_parser("info", help="metadata and the per-stage table of a trace")
    i.add_argument("trace")
    e = sub.add_parser("perfetto", help="export Chrome/Perfetto trace JSON (open it in ui.perfetto.dev)")
    e.add_argument("trace")
    e.add_argument("out")
    e.add_argument("--steps", default="1", help="steps to export: N or A-B (default 1)")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        t = np.load(a.npy)
        n_total = t.shape[0]
        cfg = PRESETS[a.model] if a.model in PRESETS else ModelConfig.from_json(a.model)
        n = len(slot_names(cfg))
        extra = {}
        if a.from_v1:
            if t.ndim != 4 or t.shape[1] != n + 1:
                raise UserError(f"{a.npy}: {t.shape[1] if t.ndim == 4 else '?'} slots per step; the older layout "
                                f"of {cfg.name} has {n + 1}")
            t = convert_v1(t)
            extra = dict(converted_from=FORMAT_V1, note=CONVERSION_NOTE)
        elif t.ndim == 4 and t.shape[1] == n + 1:
            raise UserError(f"{a.npy}: {n + 1} slots per step, {cfg.name} has {n}: stamps of the older layout "
                            "(first embedding in step 0 only, sampling last)? then add --from-v1")
        if a.steps:
            t = t[:a.steps]
        meta = recording_meta(cfg, position=a.position, tok_s=a.tok_s, roofline_tbps=a.roofline_tbps,
                              device=a.device, date=a.date, commit=a.commit, steps=int(t.shape[0]),
                              steps_in_run=int(n_total), blocks=int(t.shape[2]), **extra)
        meta.update(json.loads(a.meta))
        out = save_trace(a.out, t, meta)
        print(f"{out}: {out.stat().st_size / 1e3:.0f} kB, {t.shape[0]} steps, {complete_steps(t)} complete")
    elif a.cmd == "convert":
        out = convert_trace(a.old, a.new)
        tr = load_trace(out)
        print(f"{out}: {FORMAT}, stamps {tuple(tr.stamps.shape)}, {tr.complete_steps} complete steps")
    elif a.cmd == "info":
        tr = load_trace(a.trace)
        print(json.dumps({k: v for k, v in tr.meta.items() if k not in ("config", "slots")}, indent=1,
                         ensure_ascii=False))
        labels = list(dict.fromkeys(n for n, _ in tr.slot_names))
        print(f"stamps {tuple(tr.stamps.shape)}, {tr.complete_steps} complete steps — {tr.title}")
        print(f"{len(tr.slot_names)} slots per step: {', '.join(labels)}")
        print(format_table(tr.stage_table(), tr.roofline_tbps, tr.tok_s))
        n = tr.complete_steps
        if n:
            print(format_critical(critical_table(tr.cfg, np.asarray(tr.stamps)[:n], names=tr.slot_names)))
    else:
        tr = load_trace(a.trace)
        steps = _steps_arg(a.steps)
        try:
            doc = tr.to_perfetto(steps=steps)
        except UsageError as err:
            raise UsageError(f"--steps {a.steps}: {err} ({a.trace})") from None
        out = write_perfetto(a.out, doc)
        print(f"{out}: {out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

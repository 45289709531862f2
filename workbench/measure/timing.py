"""Per-stage timing from the kernel's %globaltimer stamps (a build with BuildOptions(timing=True)).

The stamps are [steps, slots, blocks, 2]: for every barrier, when each block arrived (its share of the stage's work
done) and when it left (everyone had arrived). Slot 0 is the first embedding, then five per layer
(qkv_rope_append, attention_decode, o_proj_residual, gate_up_silu, down_residual), then lm_head and sampling.
A stage's span runs from the previous barrier's release to its own; a block's work is the part before it arrived,
its wait the rest. All blocks read one clock, so spans from different SMs line up.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..build.assemble import LAYER_STAGES
from ..model.config import ModelConfig


def slot_names(cfg: ModelConfig) -> list[tuple[str, int]]:
    names = [("embedding", -1)]
    for layer in range(cfg.n_layers):
        names += [(s, layer) for s in LAYER_STAGES]
    return names + [("lm_head", -1), ("sampling", -1)]


def stage_bytes(cfg: ModelConfig, stage: str, pos: int) -> int:
    """Bytes a stage must move from memory (weights bf16, KV cache bf16), for the roofline of each stage."""
    D, F, hd = cfg.hidden, cfg.intermediate, cfg.head_dim
    return {"qkv_rope_append": 2 * cfg.qkv_rows * D,
            "attention_decode": 2 * 2 * cfg.kv_dim * (pos + 1),
            "o_proj_residual": 2 * D * cfg.q_dim,
            "gate_up_silu": 2 * 2 * F * D,
            "down_residual": 2 * D * F,
            "lm_head": 2 * cfg.vocab * D}.get(stage, 0)


@dataclasses.dataclass
class StageRow:
    stage: str
    us_per_token: float        # span summed over layers, median over steps
    spread: tuple              # (p10, p90) over steps
    work_us: float             # mean over blocks of the work part, summed over layers
    wait_us: float
    bytes: int
    tbps: float                # bytes / span


def spans(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """span [steps, slots], work and wait [steps, slots, blocks] in ns (step 0's slot 0 has no predecessor)."""
    arrive, leave = t[..., 0].astype(np.int64), t[..., 1].astype(np.int64)
    # slot 0 (the first embedding) is stamped in step 0 only; later steps start where the previous one ended
    arrive[1:, 0] = arrive[:-1, -1]
    leave[1:, 0] = leave[:-1, -1]
    release = leave.max(axis=2)                              # when the last block left: the barrier's release
    prev = np.empty_like(release)
    prev[:, 1:] = release[:, :-1]
    prev[1:, 0] = release[:-1, -1]
    prev[0, 0] = arrive[0, 0].min()
    span = release - prev
    work = arrive - prev[..., None]
    wait = leave - arrive
    return span, work, wait


def stage_table(cfg: ModelConfig, t: np.ndarray, pos0: int = 0, skip_first: int = 1) -> list[StageRow]:
    span, work, wait = spans(t)
    names = slot_names(cfg)
    steps = range(skip_first, t.shape[0])
    rows = []
    for stage in ["qkv_rope_append", "attention_decode", "o_proj_residual", "gate_up_silu", "down_residual",
                  "lm_head", "sampling"]:
        idx = [i for i, (s, _) in enumerate(names) if s == stage]
        per_step = span[steps][:, idx].sum(axis=1) / 1e3
        nbytes = stage_bytes(cfg, stage, pos0 + t.shape[0] // 2) * (len(idx) if stage in LAYER_STAGES else 1)
        us = float(np.median(per_step))
        rows.append(StageRow(stage, us, (float(np.percentile(per_step, 10)), float(np.percentile(per_step, 90))),
                             float(work[steps][:, idx].mean(axis=(0, 2)).sum() / 1e3),
                             float(wait[steps][:, idx].mean(axis=(0, 2)).sum() / 1e3), nbytes,
                             nbytes / (us * 1e-6) / 1e12 if us > 0 else 0.0))
    return rows


def format_table(rows: list[StageRow], roofline_tbps: float | None = None) -> str:
    total = sum(r.us_per_token for r in rows)
    out = [f"{'stage':18s} {'µs/token':>9s} {'p10–p90':>15s} {'work':>8s} {'wait':>8s} {'MB':>8s} {'TB/s':>6s}"
           + (f" {'%roof':>6s}" if roofline_tbps else "")]
    for r in rows:
        line = (f"{r.stage:18s} {r.us_per_token:9.1f} {r.spread[0]:7.1f}–{r.spread[1]:<7.1f} {r.work_us:8.1f} "
                f"{r.wait_us:8.1f} {r.bytes / 1e6:8.1f} {r.tbps:6.2f}")
        if roofline_tbps:
            line += f" {100 * r.tbps / roofline_tbps:6.1f}"
        out.append(line)
    out.append(f"{'total':18s} {total:9.1f}   ({1e6 / total:.0f} tok/s)")
    return "\n".join(out)


def barrier_cost(t: np.ndarray, skip_first: int = 1) -> dict:
    """The grid barrier measured in the kernel: from the last block's arrival to the first block's and to the last
    block's departure (ns, medians over every barrier of the recorded steps)."""
    arrive, leave = t[skip_first:, 1:, :, 0].astype(np.int64), t[skip_first:, 1:, :, 1].astype(np.int64)
    last_in = arrive.max(axis=2)
    first_out = leave.min(axis=2) - last_in
    last_out = leave.max(axis=2) - last_in
    return {"first_out_ns": float(np.median(first_out)), "last_out_ns": float(np.median(last_out)),
            "barriers_per_token": int(t.shape[1] - 1)}

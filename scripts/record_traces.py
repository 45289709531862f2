"""Timing traces of the kernel as it is, at several positions, for the schedule simulator's calibration and check
(`python -m workbench simulate FIT... --check CHECK...`): each saved as OUT/trace_MODEL[_FIELDVALUE...]_posP.npz
with its stage table printed, beside the plain build's tok/s at the same position (median of 3 × 256 tokens).

    python scripts/record_traces.py OUT [--model M] [--set FIELD=VALUE ...] --positions 0 128 1024 4096   (GPU)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    from workbench.cli import build_option, output_folder
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=output_folder)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--set", type=build_option, action="append", default=[], metavar="FIELD=VALUE",
                    help="a BuildOptions or launch field of the kernel traced (e.g. stream=1)")
    ap.add_argument("--positions", type=int, nargs="+", default=[0, 128, 1024, 4096])
    args = ap.parse_args()
    import cupy as cp
    from workbench.compiler.assemble import with_fields
    from workbench.measure import trace as T
    from workbench.measure.baselines import stream_read_tbps
    from workbench.measure.timing import format_table
    from workbench.model.config import get_config
    from workbench.model.weights import prepare, random_weights
    from workbench.run.runtime import Monokernel
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fields = dict(args.set)
    tag = "".join(f"_{k}{v}" for k, v in fields.items())
    cfg = get_config(args.model)
    p = prepare(random_weights(cfg, 7, xp=cp, progress=False), xp=cp, progress=False)
    top = max(args.positions)
    timed = Monokernel(p, with_fields(timing=True, **fields), max_steps=top + 64)
    plain = Monokernel(p, with_fields(**fields), max_steps=top + 300)
    roof = stream_read_tbps(cfg.weight_bytes_per_token())["tbps"]
    for pos in args.positions:
        timed.generate([1], 4, eos=[], pos0=pos)
        r = timed.generate([1], 17, eos=[], pos0=pos, timing_steps=17)
        plain.generate([1], 16, eos=[], pos0=pos)
        runs = sorted(plain.generate([1], 256, eos=[], pos0=pos).tok_per_s for _ in range(3))
        meta = T.recording_meta(cfg, position=pos, tok_s=r.tok_per_s, roofline_tbps=roof)
        path = out / f"trace_{args.model}{tag}_pos{pos}.npz"
        T.save_trace(path, r.timing, meta)
        print(f"{path.name}: timing build {r.tok_per_s:.0f} tok/s, plain build {runs[1]:.1f} tok/s "
              f"({', '.join(f'{x:.1f}' for x in runs)}), streaming read {roof:.2f} TB/s", flush=True)
        print(format_table(T.load_trace(path).stage_table(), roof, r.tok_per_s), flush=True)


if __name__ == "__main__":
    main()

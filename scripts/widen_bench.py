"""The reference's weight view on the CPU: one layer widened from the kernel's bf16 weights, by the numpy expressions
the view used before (the baseline), by model.widen's numpy passes and by its numba loops; then decode steps of
the CPU stand-in kernel (tests/kernel_sim.py) with the baseline view and with the view as it is. Best of
`--repeats` each, as other work on the machine only ever adds time.

    python scripts/widen_bench.py --model llama-3.2-1b --steps 4
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

from workbench.model import widen  # noqa: E402
from workbench.model.config import get_config  # noqa: E402
from workbench.model.weights import prepare, random_weights, to_f32  # noqa: E402
from workbench.reference import PreparedView  # noqa: E402


class BaselineView(PreparedView):
    """The view's layer as it was widened before model.widen: numpy, a pass per operation."""

    def layer(self, name: str, layer: int):
        if layer != self._layer:
            c, xp = self.cfg, self.xp
            f = lambda a: to_f32(a, xp).astype(self.dtype, copy=False)          # noqa: E731
            qkv = f(self.p.wqkv[layer])[self._inv]
            gu = f(self.p.wgu[layer]).reshape(c.intermediate, 2, c.hidden)
            ones = xp.ones(c.hidden, dtype=self.dtype)
            self._tensors = {"wq": qkv[:c.q_dim], "wk": qkv[c.q_dim:c.q_dim + c.kv_dim], "wv": qkv[c.q_dim + c.kv_dim:],
                             "wo": f(self.p.wo[layer]), "wg": xp.ascontiguousarray(gu[:, 0]),
                             "wu": xp.ascontiguousarray(gu[:, 1]), "wd": xp.ascontiguousarray(f(self.p.wd[layer]).T),
                             "attn_norm": ones, "mlp_norm": ones}
            self._layer = layer
        return self._tensors[name]


def best(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--steps", type=int, default=4, help="decode steps of the stand-in kernel (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    cfg = get_config(a.model)
    t0 = time.perf_counter()
    p = prepare(random_weights(cfg, seed=3, progress=False), progress=False)
    print(f"{cfg.name}: random weights prepared in {time.perf_counter() - t0:.0f} s; numba "
          f"{'present' if widen.numba_available() else 'absent'}")

    def widen_layer(view_cls, dtype, engine=None):
        def run():
            v = view_cls(p, dtype)
            if engine is not None:
                v_old, widen.NUMBA_MIN_ELEMENTS = widen.NUMBA_MIN_ELEMENTS, (0 if engine == "numba" else 1 << 62)
            try:
                v.layer("wq", 0)
            finally:
                if engine is not None:
                    widen.NUMBA_MIN_ELEMENTS = v_old
        return run

    engines = ["numpy"] + (["numba"] if widen.numba_available() else [])
    for dtype in (np.float32, np.float64):
        if "numba" in engines:
            widen_layer(PreparedView, dtype, "numba")()                 # compiled (or loaded from the cache) first
        base = best(widen_layer(BaselineView, dtype), a.repeats)
        line = [f"one layer widened to {np.dtype(dtype).name}: baseline {base * 1e3:.1f} ms"]
        for e in engines:
            t = best(widen_layer(PreparedView, dtype, e), a.repeats)
            line.append(f"{e} {t * 1e3:.1f} ms ({base / t:.1f}×)")
        print("; ".join(line))

    if a.steps:
        from kernel_sim import SimKernel
        tokens = list(range(1, a.steps + 1))
        for label, view_cls in (("baseline view", BaselineView), ("view as it is", PreparedView)):
            sim = SimKernel(p)
            sim.view = view_cls(p, np.float32)
            t = best(lambda: sim.generate(tokens[:1], a.steps, eos=[], record=range(a.steps)), 1)
            print(f"stand-in kernel, {a.steps} decode steps, {label}: {t:.2f} s ({t / a.steps * 1e3:.0f} ms a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

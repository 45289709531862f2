import sys, numpy as np, cupy as cp
sys.path.insert(0, '.')
from workbench.assemble import BuildOptions
from workbench.config import get_config
from workbench.model import prepare, random_weights, to_f32
from workbench.runtime import Monokernel, KernelError
cfg = get_config("llama-3.2-1b")
w = random_weights(cfg, 0, xp=cp, progress=False)
for k, v in w.tensors.items():
    f = to_f32(v, cp)
    if not bool(cp.isfinite(f).all()):
        print("non-finite weight", k)
p = prepare(w, xp=cp, progress=False)
for k, v in p.arrays().items():
    f = to_f32(v, cp) if v.dtype == cp.uint16 else v
    if not bool(cp.isfinite(f).all()): print("non-finite prepared", k, int((~cp.isfinite(f)).sum()))
prompt = np.random.default_rng(1).integers(0, cfg.vocab, 8).tolist()
print("prompt", prompt)
for opt, ms in [(BuildOptions(), 64), (BuildOptions(), 4360), (BuildOptions(), 4200)]:
    mk = Monokernel(p, opt, max_steps=ms)
    for rec in (list(range(8)), list(range(23))):
        try:
            r = mk.generate(prompt, 16 if len(rec) > 8 else 2, eos=[], record=rec)
            print(opt.taps, ms, len(rec), "ok", r.tokens[:4], flush=True)
        except KernelError as e:
            print(opt.taps, ms, len(rec), "error", e, flush=True)
            lh = mk.logits_hist[:len(rec)].get()
            print("finite logits per step", [bool(np.isfinite(l).all()) for l in lh])
    del mk
mk = Monokernel(p, BuildOptions(taps=True), max_steps=64)
r = mk.generate(prompt, 2, eos=[], record=list(range(8)), tap_steps=list(range(8)))
lh = mk.logits_hist[:8].get()
print("finite logits per step", [bool(np.isfinite(l).all()) for l in lh])
taps = mk.taps[:8 * (mk.taps.size // 8)].get()
from workbench.assemble import tap_offsets, tap_sizes, TAPS
off, per = tap_offsets(cfg)
t = mk.taps[:8 * per * cfg.n_layers].get().reshape(8, cfg.n_layers, per)
for s in range(8):
    for l in range(cfg.n_layers):
        for name, _ in TAPS:
            seg = t[s, l, off[name]:off[name] + tap_sizes(cfg)[name]]
            if not np.isfinite(seg).all():
                print(f"first non-finite: step {s} layer {l} tap {name}: {int((~np.isfinite(seg)).sum())} of {seg.size}, max finite {np.nanmax(np.abs(seg[np.isfinite(seg)])) if np.isfinite(seg).any() else None}")
                raise SystemExit
    print("step", s, "all taps finite; |x_out| max", float(np.abs(t[s, -1, off['x_out']:off['x_out']+cfg.hidden]).max()))

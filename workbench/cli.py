"""python -m workbench generate | verify | build | bench — see README.md."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .model.config import DEFAULT_MODEL, PRESETS, ConfigError, get_config


def _model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset ({', '.join(PRESETS)}) or a local HF folder (default {DEFAULT_MODEL})")
    p.add_argument("--weights", help="HF folder with safetensors (default: the --model folder, else random)")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of random weights")
    p.add_argument("--max-seq", type=int, help="KV-cache length (default: the config's, at most 8192)")
    p.add_argument("--threads", type=int, default=512, help="threads per block (one block per SM)")


def _load(args):
    import cupy

    from .model.weights import load, prepare
    t0 = time.perf_counter()
    w = load(args.model, args.weights, seed=args.weights_seed, xp=cupy, max_seq=args.max_seq)
    p = prepare(w, xp=cupy)
    del w
    cupy.cuda.Device().synchronize()
    print(f"[{p.cfg.name}] weights {p.source}: {p.nbytes() / 1e9:.2f} GB prepared in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return p


def _kernel(args, p, **kw):
    from .build.assemble import BuildOptions
    from .run.runtime import Monokernel
    mk = Monokernel(p, BuildOptions(threads=args.threads), **kw)
    r = mk.resources()
    print(f"[{p.cfg.name}] compiled in {mk.compile_s:.2f} s: {r['blocks']}×{r['threads']} threads, "
          f"{r['registers']} registers, {r['local_bytes']} B local, {r['dynamic_shared']} B shared", file=sys.stderr)
    return mk


def _tokenizer(args):
    folder = args.weights or (args.model if Path(args.model).is_dir() else None)
    if folder and (Path(folder) / "tokenizer.json").exists():
        try:
            from tokenizers import Tokenizer
            return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        except ImportError:
            print("tokenizer.json found but the `tokenizers` package is missing: ids only", file=sys.stderr)
    return None


def cmd_generate(args) -> int:
    from .run.runtime import Sampling
    tok = _tokenizer(args)
    if args.prompt is not None and tok is None:
        print("--prompt needs a folder with tokenizer.json; use --prompt-ids", file=sys.stderr)
        return 2
    p = _load(args)
    cfg = p.cfg
    if args.prompt is not None:
        ids = tok.encode(args.prompt).ids
    elif args.prompt_ids:
        ids = [int(t) for t in args.prompt_ids.split(",")]
    else:
        ids = [cfg.bos_token_id if cfg.bos_token_id is not None else 0]
    mk = _kernel(args, p, max_steps=len(ids) + args.tokens)
    s = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    out = []
    for t in mk.stream_tokens(ids, args.tokens, s, eos=None if args.stop_on_eos else []):
        out.append(t)
        if tok is not None:
            text = tok.decode(out)
            prev = tok.decode(out[:-1])
            print(text[len(prev):], end="", flush=True)
        else:
            print(t, end=" ", flush=True)
    res = mk.last
    print()
    print(f"{len(res.tokens)} tokens, {res.steps} decode steps in {res.kernel_ms:.1f} ms: "
          f"{res.tok_per_s:.0f} tok/s ({cfg.weight_bytes_per_token() * res.tok_per_s / 1e12:.2f} TB/s of weights)")
    return 0


def cmd_verify(args) -> int:
    from .run.runtime import Sampling
    from .check.verify import verify, verify_sampling
    p = _load(args)
    mk = _kernel(args, p, max_steps=max(args.prompt_len + args.tokens, 64))
    ok = True
    for seed in args.seeds:
        rep = verify(mk, prompt_len=args.prompt_len, max_new=args.tokens, seed=seed, rtol=args.rtol)
        print(rep.summary())
        ok &= rep.passed
    if args.sampling:
        for s in (Sampling(0.8, 0, 1.0, 1), Sampling(1.0, 50, 1.0, 2), Sampling(0.7, 0, 0.9, 3),
                  Sampling(1.3, 200, 0.95, 4)):
            rep = verify_sampling(mk, s, draws=args.draws)
            print(rep.summary())
            ok &= rep.passed
    print("verify:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def cmd_build(args) -> int:
    from .build import compile as C
    from .build.assemble import BuildOptions, assemble, smem_bytes
    target = args.target or ("hip" if args.dump == "amdgcn" else "cuda")
    arch = args.arch or {"cuda": "sm_90", "hip": "gfx942"}[target]
    if args.dump and (args.dump == "amdgcn") != (target == "hip"):
        print(f"--dump {args.dump} needs --target {'hip' if args.dump == 'amdgcn' else 'cuda'}", file=sys.stderr)
        return 2
    if args.section and not args.dump:
        print("--section goes with --dump ptx|sass|amdgcn", file=sys.stderr)
        return 2
    names = list(PRESETS) if args.all_presets else [args.model]
    opt = BuildOptions(threads=args.threads, timing=args.timing)
    failed = False
    for name in names:
        cfg = get_config(name, max_seq=args.max_seq)
        asm = assemble(cfg, opt)
        t0 = time.perf_counter()
        try:
            if args.dump:
                text = C.dump_section(asm, args.dump, args.section, arch)
                if len(names) > 1:
                    print(f"{C.DUMP_COMMENT[args.dump]} ==== {cfg.name} {arch} {args.section or 'wb_generate'}")
                print(text, end="")
                if not text.strip():
                    print(f"{cfg.name}: no {args.dump} attributed to {args.section or 'the kernel'}", file=sys.stderr)
                continue
            if target == "cuda":
                cubin, log = C.compile_cubin(asm, arch=arch)
                res = C.resource_usage(cubin)
            else:
                text, log = C.compile_hip(asm, arch=arch)
                res = C.amdgpu_resources(text)
        except C.CompileError as e:
            print(f"{cfg.name} {arch}: {e}", file=sys.stderr)
            failed = True
            continue
        except (ValueError, FileNotFoundError) as e:          # an unknown section, a missing compiler or tool
            print(f"error: {e}", file=sys.stderr)
            return 2
        dt = time.perf_counter() - t0
        if log.strip():
            print(log.strip(), file=sys.stderr)
        dyn = smem_bytes(cfg, args.threads)
        bad = False
        for r in res:
            if target == "cuda":
                print(f"{cfg.name} {arch} {r.kernel}: {r.registers} registers, {r.stack} B local (spills), "
                      f"{r.shared} B static shared + {dyn} B dynamic, compiled in {dt:.2f} s")
            else:
                print(f"{cfg.name} {arch} {r.kernel}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, {r.agprs} AGPRs, "
                      f"{r.scratch} B scratch (spills), {r.lds} B static LDS + {dyn} B dynamic, "
                      f"wave{r.wavefront}, compiled in {dt:.2f} s")
                if r.lds + dyn > 65536:
                    print(f"{cfg.name}: {r.lds + dyn} B of LDS exceeds the 64 KiB a {arch} workgroup can have",
                          file=sys.stderr)
            bad |= r.spills
        if bad:
            print(f"{cfg.name} {arch}: " + ("local memory in use: registers spill" if target == "cuda" else
                                             "scratch in use: registers spill"), file=sys.stderr)
            failed |= args.no_spills
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from .measure.bench import main as bench_main
    return bench_main(args.model, args.tokens, args.repeats, args.json, args.no_torch, args.no_hf)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench", description="batch-1 decode monokernel workbench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream tokens from the monokernel (GPU)")
    _model_args(g)
    g.add_argument("--prompt", help="prompt text (needs tokenizer.json in the weights folder)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--stop-on-eos", action="store_true", help="stop at the config's EOS ids")
    v = sub.add_parser("verify", help="kernel vs reference, teacher-forced (GPU); exits 1 on failure")
    _model_args(v)
    v.add_argument("--seeds", type=int, nargs="+", default=[0])
    v.add_argument("--prompt-len", type=int, default=8)
    v.add_argument("--tokens", type=int, default=24)
    v.add_argument("--rtol", type=float, default=None)
    v.add_argument("--sampling", action="store_true", help="also the chi-square checks of the sampler")
    v.add_argument("--draws", type=int, default=20000)
    b = sub.add_parser("build", help="compile only (no GPU): registers, spills, shared memory")
    b.add_argument("--model", default=DEFAULT_MODEL)
    b.add_argument("--all-presets", action="store_true", help=f"build every preset ({', '.join(PRESETS)})")
    b.add_argument("--max-seq", type=int)
    b.add_argument("--threads", type=int, default=512)
    b.add_argument("--target", choices=["cuda", "hip"],
                   help="cuda: NVRTC for NVIDIA; hip: clang-19 for AMD (default cuda, hip with --dump amdgcn)")
    b.add_argument("--arch", help="sm_90 for cuda, gfx942 for hip (the defaults)")
    b.add_argument("--timing", action="store_true", help="with per-stage timing instrumentation")
    b.add_argument("--no-spills", action="store_true",
                   help="exit 1 when registers spill (NVIDIA local memory, AMD scratch)")
    b.add_argument("--dump", choices=["ptx", "sass", "amdgcn"],
                   help="print the machine code instead (PTX, SASS: cuda; AMDGCN: hip), headed by source lines")
    b.add_argument("--section", help="with --dump: only the code of this section (e.g. qkv_rope_append, "
                                     "matvec, monokernel, portability), what is inlined into it included")
    be = sub.add_parser("bench", help="monokernel vs torch.compile, HF generate() and the bandwidth roofline (GPU)")
    be.add_argument("--model", default=DEFAULT_MODEL)
    be.add_argument("--tokens", type=int, default=128, help="decode steps per timed run")
    be.add_argument("--repeats", type=int, default=5)
    be.add_argument("--json", help="write the table as JSON here")
    be.add_argument("--no-torch", action="store_true", help="skip the PyTorch paths")
    be.add_argument("--no-hf", action="store_true", help="skip HF generate()")
    args = ap.parse_args(argv)
    if getattr(args, "rtol", 0) is None:
        from .check.verify import DEFAULT_RTOL
        args.rtol = DEFAULT_RTOL
    try:
        return {"generate": cmd_generate, "verify": cmd_verify, "build": cmd_build, "bench": cmd_bench}[args.cmd](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

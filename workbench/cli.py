"""python -m workbench generate | verify | build | plan | bench | sanitize | simulate | trace — see README.md.

One error path: what the user gave and the workbench cannot use (an argument, a config.json, a checkpoint, a machine
without a GPU: a `UserError`) is reported as one line, `error: …`, with exit code 2; anything else is a bug and keeps
its traceback. Arguments are checked before any weight is read and before a GPU is touched, so a typo costs no load
or compile.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import paths, plan, schedule
from .check.prefill import PREFILL_RTOL, check_prefill, verify_after_prefill
from .check.stops import verify_stops
from .check.verify import DEFAULT_RTOL, SAMPLER_MODES, verify, verify_sampling, verify_stages
from .compiler import assemble as A
from .compiler import compile as C
from .compiler.assemble import (BuildOptions, _display, option_from_text, section_path, smem_bytes, threads_problem,
                                with_fields)
from .compiler.compile import CUDA_ARCHS, HIP_ARCHS, CompileError
from .compiler.numba_sections import NumbaError, is_numba_variant, numba_problem
from .compiler.header import decode_step, write_step_files
from .errors import GpuMemoryError, NoDeviceError, UsageError, UserError
from .measure.bench import bench_positions, cache_positions, ttft_lengths
from .measure import dataflow, simulate
from .measure.bench import main as bench_main
from .measure.trace import load_trace
from .measure.trace import FORMAT as TRACE_FORMAT
from .measure.trace import FORMAT_V1 as TRACE_V1
from .measure.trace import main as trace_main
from .model import weights
from .nbclean import main as nbclean_main
from .model.config import DEFAULT_MODEL, PRESETS, ModelConfig, get_config, local_folder
from .paths import ROOT, write_problem
from .plan import Launch
from .run.prefill import FIRST_TOKEN, PREFILL_CHUNK, prefill_part
from .run.prefill_gpu import PRECISIONS
from .run.runtime import WORKER_CONTEXT, KernelError, Monokernel, RegisteredMapped, Sampling
from .run.worker import Worker, WorkerFailure, phase_setter
from .tp.shard import Sharding
from .worklists import format_handoffs, handoffs

# -- argument types: argparse reports an ArgumentTypeError as "argument --x: <message>" ---------------------------

def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def positive_int(text: str) -> int:
    n = _number(text, int)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def build_option(text: str) -> tuple:
    """--set FIELD=VALUE: one BuildOptions field or launch field (e.g. threads), checked as the options check it."""
    field, eq, value = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    try:
        v = option_from_text(field, value)
        with_fields(**{field: v})
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return field, v


def max_seq_arg(text: str):
    """--max-seq: a positive integer, or "max" (the model's max_position_embeddings)."""
    return "max" if text.strip().lower() == "max" else positive_int(text)


def non_negative_int(text: str) -> int:
    n = _number(text, int)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {n}")
    return n


MIN_TEMPERATURE = 1e-4


def temperature(text: str) -> float:
    t = _number(text, float)
    if not (math.isfinite(t) and t >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 = greedy), got {text}")
    if 0 < t < MIN_TEMPERATURE:
        # the kernel divides fp32 logits by it: they overflow to inf (NaN probabilities), or, below fp32's range,
        # it reads 0 and decodes greedily while the host thinks it samples
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {text}")
    return t


def top_p(text: str) -> float:
    p = _number(text, float)
    if not 0 < p <= 1:                       # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = off), got {text}")
    return p


def positive_float(text: str) -> float:
    x = _number(text, float)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return x


MAX_TIMEOUT_S = 1e6


def timeout_arg(text: str) -> float:
    """--timeout: the kernel holds it in nanoseconds (64 bits) and the worker in milliseconds (32 bits)."""
    x = _number(text, float)
    if not (math.isfinite(x) and 0 < x <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, at most {MAX_TIMEOUT_S:.0f}, "
                                         f"got {text}")
    return x


MAX_DRAWS = 1_000_000


def draws_arg(text: str) -> int:
    """--draws: the kernel counts them in an int and waits 5 ms a draw for the step that makes them all."""
    n = positive_int(text)
    if n > MAX_DRAWS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DRAWS}, got {n}")
    return n


def seed_arg(text: str) -> int:
    """Any seed: the rule of the kernel's 64-bit seed (Sampling.seed_problem), which the API holds to as well."""
    n = _number(text, int)
    if (why := Sampling.seed_problem(n)) is not None:
        raise argparse.ArgumentTypeError(why)
    return n


def non_empty(text: str) -> str:
    """A model, a folder, an executable: an empty one would stand for the current folder, silently."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}")
    return text


def arch_arg(text: str) -> str:
    """--arch: one the build is made for (compile.CUDA_ARCHS, HIP_ARCHS), never handed to a compiler to refuse."""
    if text not in CUDA_ARCHS + HIP_ARCHS:
        raise argparse.ArgumentTypeError(f"{text!r} is not an arch the build supports (cuda: {', '.join(CUDA_ARCHS)}; "
                                         f"hip: {', '.join(HIP_ARCHS)})")
    return text


# -- output paths: checked before the run, since a run takes minutes and writes only at its end --------------------

def _probe(folder: Path) -> str | None:
    """Why no file can be made in `folder` (paths.write_problem: by making one), as an output check says it."""
    why = write_problem(folder)
    return None if why is None else f"no file can be made in {folder} ({why})"


def output_path_problem(text: str) -> str | None:
    """Why a file cannot be written at `text`, or None. Nothing is left behind by the check."""
    if not text.strip():
        return "an empty path"
    if text.endswith(("/", "\\")):
        return f"{text} names a folder (it ends with a separator); give a file in it"
    path = Path(text)
    try:
        if path.is_dir():
            return f"{text} is a folder; give a file in it"
        parent = path.parent
        if not parent.exists():
            return f"folder {parent} does not exist"
        if not parent.is_dir():
            return f"{parent} is not a folder"
        if path.exists():
            with open(path, "ab"):                  # appending nothing: it stays as it is until the run writes it
                pass
            return None
    except OSError as e:
        return f"{e.strerror or e} ({text})"
    return _probe(parent)


def output_folder_problem(text: str, parents: bool = True) -> str | None:
    """Why `text` cannot be made (with its `parents`) or used as a folder to write files in, or None. Makes
    nothing: the first folder of it that exists is probed."""
    if not text.strip():
        return "an empty path"
    folder = Path(text)
    try:
        if folder.exists():
            return _probe(folder) if folder.is_dir() else f"{folder} is not a folder"
        up = folder.parent
        while parents and not up.exists() and up != up.parent:
            up = up.parent
        if not up.exists():
            return f"folder {up} does not exist"
        if not up.is_dir():
            return f"{up} is not a folder"
    except OSError as e:
        return f"{e.strerror or e} ({text})"
    return _probe(up)


def output_file(text: str) -> str:
    """argparse type of an output file (--json): refused at once, not after the run that was to fill it."""
    if (why := output_path_problem(text)) is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}")
    return text


def output_folder(text: str) -> str:
    """argparse type of an output folder, made later with its parents: refused now if it could not be."""
    if (why := output_folder_problem(text)) is not None:
        raise argparse.ArgumentTypeError(f"cannot write in {text!r}: {why}")
    return text


def env_output_folder(ap: argparse.ArgumentParser, variable: str, default: str) -> Path:
    """The folder an environment variable names for a script's results, made now (as the scripts made it at their
    end, without parents), or the script's usage error, before any work."""
    text = os.environ.get(variable, default)
    why = output_folder_problem(text, parents=False)
    if why is not None:
        ap.error(f"${variable}={text}: cannot write there: {why}")
    folder = Path(text)
    folder.mkdir(exist_ok=True)
    return folder


def threads(text: str) -> int:
    n = _number(text, int)
    if (why := threads_problem(n)) is not None:        # the builds' own rule, checked before anything is read
        raise argparse.ArgumentTypeError(why)
    return n


def section_variant(text: str) -> tuple[str, str]:
    name, sep, variant = text.partition("=")
    if not sep or not name or not variant:
        raise argparse.ArgumentTypeError(f"{text!r} is not SECTION=VARIANT (e.g. embedding=ptx)")
    try:
        section_path(name, variant)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, variant


def token_ids(text: str) -> list[int]:
    ids = []
    for part in text.split(","):
        if not (part.strip().isascii() and part.strip().isdigit()):     # "²".isdigit() is true, int("²") fails
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids "
                                             f"({part.strip()!r} is not a non-negative integer)")
        ids.append(int(part))
    return ids


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are raised as UsageError, to be reported like every other user error (one line)
    rather than printed with the usage and exited from where they happen."""

    def error(self, message):
        hint = "" if message.startswith("argument ") else f" (see {self.prog} --help)"
        raise UsageError(message + hint)


MODEL_HELP = f"preset ({', '.join(PRESETS)}) or a local HF folder (default {DEFAULT_MODEL})"
MAX_SEQ_HELP = ("KV-cache length (default: the config's, at most 8192; at most max_position_embeddings, which `max` "
                "asks for)")
THREADS_HELP = "threads per block (one block per SM): a multiple of 64 from 64 to 1024 (default 512)"


def _model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=DEFAULT_MODEL, type=non_empty, help=MODEL_HELP)
    p.add_argument("--weights", type=non_empty,
                   help="HF folder with safetensors (default: the --model folder, else random)")
    p.add_argument("--weights-seed", type=seed_arg, help="seed of random weights (default 0)")
    p.add_argument("--max-seq", type=max_seq_arg, help=MAX_SEQ_HELP)
    p.add_argument("--threads", type=threads, default=512, help=THREADS_HELP)


# -- checks that need the config: before any weight is read and before the GPU is touched ---------------------------

def _config(model: str, max_seq: int | None) -> ModelConfig:
    """The model's config at the asked KV-cache length, which may not pass the positions it was trained for."""
    cfg = get_config(model)
    of = f"preset {model}" if model in PRESETS else str(local_folder(model) / "config.json")
    if max_seq is not None and cfg.max_positions is not None and max_seq > cfg.max_positions:
        raise UsageError(f"--max-seq {max_seq} is larger than max_position_embeddings ({cfg.max_positions}) of {of}")
    return get_config(model, max_seq=max_seq)


def _longest(model: str) -> int:
    """--max-seq max: the positions the model was trained for."""
    cfg = get_config(model)
    if cfg.max_positions is None:
        raise UsageError(f"--max-seq max: {model} does not say how far it was trained to attend "
                         "(max_position_embeddings); give a number")
    return cfg.max_positions


def _weights_folder(args) -> Path | None:
    if args.weights is not None:
        p = Path(args.weights)
        if not p.exists():
            raise UsageError(f"--weights {args.weights}: no such file or folder")
        return p.parent if p.is_file() else p
    return local_folder(args.model)


def _fits(cfg: ModelConfig, prompt_len: int, tokens: int, what: str, hint: str = " (--max-seq)"):
    steps = prompt_len + tokens - 1             # positions the KV cache must hold: the last token is not fed back
    if steps > cfg.max_seq:
        raise UsageError(f"{what} need {steps} positions, but the KV cache of {cfg.name} holds {cfg.max_seq}{hint}")


def _check_vocab(cfg: ModelConfig, ids: list[int], given: str):
    bad = [t for t in ids if t >= cfg.vocab]
    if bad:
        raise UsageError(f"{given}: token id {bad[0]} is outside the vocabulary of {cfg.name} "
                         f"(vocab_size {cfg.vocab}: ids 0 to {cfg.vocab - 1})")


def _check_weights_seed(args):
    """--weights-seed seeds random weights only: with a weights folder it would be ignored."""
    folder = _weights_folder(args)
    if args.weights_seed is not None and folder is not None:
        raise UsageError(f"--weights-seed {args.weights_seed} seeds random weights, but the weights come from "
                         f"{folder}; leave it out")
    args.weights_seed = args.weights_seed or 0


def _check_generate(args):
    cfg = _config(args.model, args.max_seq)
    _check_weights_seed(args)
    tok = _tokenizer(args)
    if args.prompt is not None:
        if tok is None:
            folder = _weights_folder(args)
            where = f"in {folder}" if folder else "in a weights folder (these weights are random)"
            raise UsageError(f"--prompt needs a tokenizer.json {where} and the tokenizers package; "
                             "give --prompt-ids instead")
        ids, given = tok.encode(args.prompt).ids, "--prompt"
        if not ids:
            raise UsageError(f"--prompt {args.prompt!r} encodes to no tokens")
    elif args.prompt_ids is not None:
        ids, given = args.prompt_ids, "--prompt-ids"
    elif args.prompt_random is not None:
        import numpy as np
        ids = np.random.default_rng(args.seed or 0).integers(0, cfg.vocab, args.prompt_random).tolist()
        given = "--prompt-random"
    else:
        ids, given = [cfg.bos_token_id if cfg.bos_token_id is not None else 0], "the default prompt"
    _check_vocab(cfg, ids, given)
    if args.top_k > cfg.vocab:
        raise UsageError(f"--top-k {args.top_k} is larger than the vocabulary of {cfg.name} ({cfg.vocab}); "
                         "0 turns top-k off")
    _fits(cfg, len(ids), args.tokens, f"a {len(ids)}-token prompt and --tokens {args.tokens}")
    if args.check_prefill and args.prefill is False:
        raise UsageError("--check-prefill checks a prefill: leave out --no-prefill")
    if (args.prefill or args.check_prefill) and len(ids) < 2:   # else it did nothing, and --check-prefill checked nothing
        raise UsageError(f"{'--prefill' if args.prefill else '--check-prefill'} needs a prompt of at least 2 tokens "
                         f"(the last one is the kernel's); {given} has {len(ids)}")
    # prefilled unless told not to: a one-token prompt has nothing to prefill (its token is the kernel's)
    args.prefill = args.prefill is not False and len(ids) >= 2
    if args.prefill_precision is not None and not args.prefill:
        raise UsageError(f"--prefill-precision {args.prefill_precision} has no effect: "
                         + ("--no-prefill is given" if len(ids) >= 2 else f"{given} has 1 token, nothing to prefill"))
    args.prefill_precision = args.prefill_precision or "fp32"
    if args.first_token is not None and not args.prefill:
        raise UsageError(f"--first-token {args.first_token} has no effect: nothing is prefilled")
    if args.first_token == "prefill" and args.temperature > 0:
        raise UsageError("--first-token prefill chooses greedily (its last logits' first largest); a sampled first "
                         "token is the kernel's own draw: leave out --first-token, or give --temperature 0")
    args.first_token = args.first_token or ("prefill" if args.temperature == 0 else "kernel")
    if args.temperature == 0:
        # greedy decoding takes the argmax: these would change nothing, and the run would not say so
        for given_, off in ((f"--top-k {args.top_k}", args.top_k == 0), (f"--top-p {args.top_p}", args.top_p == 1),
                            (f"--seed {args.seed}", args.seed is None or args.prompt_random is not None)):
            if not off:
                raise UsageError(f"{given_} has no effect at --temperature 0 (greedy decoding): give a "
                                 "--temperature above 0 to sample")
    if args.stop_on_eos and not cfg.eos_token_ids:        # it would generate on, as if not given
        raise UsageError(f"--stop-on-eos: {cfg.name} names no end-of-sequence token (eos_token_id in its config)")
    args.seed = args.seed or 0
    args.prompt_tokens, args.tokenizer = ids, tok           # for cmd_generate: read and checked once, here


def _check_verify(args):
    cfg = _config(args.model, args.max_seq)
    _check_weights_seed(args)
    if args.draws is not None and not args.sampling:
        raise UsageError(f"--draws {args.draws} counts the draws of --sampling: give --sampling too")
    args.draws = args.draws or 20000
    _fits(cfg, args.prompt_len, args.tokens, f"--prompt-len {args.prompt_len} and --tokens {args.tokens}")
    if args.prefill_precision is not None and args.prefill_len is None:
        raise UsageError(f"--prefill-precision {args.prefill_precision} is the precision of --prefill-len's prefill: "
                         "give --prefill-len too")
    args.prefill_precision = args.prefill_precision or "fp32"
    if args.prefill_len is not None:
        if args.prefill_len < 2:
            raise UsageError("--prefill-len needs at least 2 tokens (the last one is the kernel's)")
        _fits(cfg, args.prefill_len, args.tokens, f"--prefill-len {args.prefill_len} and --tokens {args.tokens}")


def _check_build(args):
    of_arch = None if args.arch is None else "hip" if args.arch in HIP_ARCHS else "cuda"
    target = args.target or of_arch or ("hip" if args.dump == "amdgcn" else "cuda")
    if of_arch is not None and of_arch != target:
        raise UsageError(f"--arch {args.arch} is an arch of --target {of_arch}, not of --target {target}")
    if args.dump and (args.dump == "amdgcn") != (target == "hip"):
        raise UsageError(f"--dump {args.dump} needs --target {'hip' if args.dump == 'amdgcn' else 'cuda'}")
    args.target = target
    if args.section is not None and not args.dump:
        raise UsageError("--section goes with --dump ptx|sass|amdgcn")
    if args.no_spills and args.dump:
        raise UsageError(f"--no-spills judges a build's registers, and --dump {args.dump} prints code instead; "
                         "leave out one of them")
    chosen: dict[str, str] = {}
    for name, variant in args.variant:              # two variants of one section: one would be dropped, silently
        if chosen.setdefault(name, variant) != variant:
            raise UsageError(f"--variant {name}={chosen[name]} and --variant {name}={variant}: one variant per section")
    for name, variant in args.variant:
        path = section_path(name, variant)
        if not path.is_file():
            raise UsageError(f"--variant {name}={variant}: {_display(path)} does not exist")
        if is_numba_variant(variant):
            if not (py := path.with_suffix(".py")).is_file():
                raise UsageError(f"--variant {name}={variant}: {_display(py)} does not exist (a numba variant is "
                                 f"the .cuh and its device functions in the .py beside it)")
            # the AMD build refuses the variant itself (numba-cuda writes PTX only), with or without numba here
            if getattr(args, "target", None) != "hip" and (why := numba_problem()) is not None:
                raise UsageError(f"--variant {name}={variant}: {why}")
    for name in (list(PRESETS) if args.all_presets else [args.model]):
        _config(name, _max_seq_of(args, name))


def _max_seq_of(args, model: str) -> int | None:
    """--max-seq for this model: `max` with --all-presets is each preset's own (main resolves it for one model)."""
    return _longest(model) if args.max_seq == "max" else args.max_seq


def _check_bench(args):
    fields = [f for f, _ in args.set]
    twice = sorted({f for f in fields if fields.count(f) > 1})
    if twice:                                   # the last would win, silently
        raise UsageError(f"--set {twice[0]} is given more than once; give each BuildOptions field once")
    cfg = _config(args.model, None)
    positions = args.positions or bench_positions(args.model)
    need = cache_positions(positions, args.tokens)
    limit = cfg.max_positions or cfg.max_seq
    if need > limit:
        raise UsageError(f"position {max(positions)} and --tokens {args.tokens} need {need} positions, past the "
                         f"{limit} of max_position_embeddings of {cfg.name}")
    if args.ttft is not None:
        args.ttft = tuple(args.ttft or ttft_lengths(args.model))
        if min(args.ttft) < 2:
            raise UsageError("--ttft: a prompt of at least 2 tokens (the last one is the kernel's)")
        if max(args.ttft) + 8 > limit:
            raise UsageError(f"--ttft {max(args.ttft)}: past the {limit} of max_position_embeddings of {cfg.name}")
    elif args.first_token is not None:
        raise UsageError(f"--first-token {' '.join(args.first_token)} has no effect without --ttft")
    else:
        args.ttft = ()
    args.first_token = tuple(dict.fromkeys(args.first_token or ("prefill",)))      # in the order given, once each
    args.cache_positions = cache_positions(positions, args.tokens, args.ttft)   # what run_bench's kernel runs to


def worker_tokens(args) -> int:
    """The streamed tokens the worker's mapped block must hold for this command: its kernel's steps, which for the
    bench run to its furthest position or longest prompt (set by _check_bench) and otherwise to the context."""
    max_seq = get_config(args.model, max_seq=getattr(args, "max_seq", None)).max_seq
    return max(max_seq, getattr(args, "cache_positions", 0), 1 << 14) + 2


def nvidia_gpu_present() -> bool:
    """Whether the machine shows this process an NVIDIA GPU, usable or not: the driver's device files on Linux
    (WSL's /dev/dxg). Elsewhere it cannot tell, and says yes, so that CUDA's own reason is what gets reported."""
    if not sys.platform.startswith("linux"):
        return True
    return (any(Path("/dev").glob("nvidia[0-9]*")) or any(Path("/proc/driver/nvidia/gpus").glob("*"))
            or Path("/dev/dxg").exists())


NO_GPU = "needs an NVIDIA GPU"                  # in every answer of a GPU command on a machine without a usable one


def gpu_problem() -> str | None:
    """Why no CUDA GPU can be used here, to follow "`generate` needs an NVIDIA GPU, ", or None when one can. Asks
    the CUDA runtime through CuPy and nothing else: no weights, no compile. A machine with no NVIDIA GPU is told
    just that: CUDA's reason there (cudaErrorInsufficientDriver, for a missing driver) would send its reader after
    a driver that would not help."""
    try:
        import cupy
    except ImportError as e:
        if not nvidia_gpu_present():
            return "and this machine has none"
        return f"reached through CuPy, which cannot be imported ({e}; {paths.pip_install('cuda')} brings it)"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                      # no driver, a driver too old, no libcuda
        why = str(e) or type(e).__name__
    else:
        if n > 0:
            return None
        why = "CuPy sees 0 devices"
    return f"and CUDA cannot use this machine's ({why})" if nvidia_gpu_present() else "and this machine has none"


def without_gpu(prog: str) -> list[str]:
    """What runs on a machine without a GPU, as commands to type from where the workbench was installed: each works
    after the README's install (tests/test_cli_help.py runs the workbench's own). The recorded traces, the
    notebooks and the tests come with a source checkout, not with a wheel."""
    runs = [f"`{prog} plan`", f"`{prog} build`"]
    if paths.source_checkout():
        trace = _shown(paths.FIXTURES / "timing_h200_llama-3.2-1b_pos0.npz")
        runs += [f"`{prog} simulate {trace}`", f"`{prog} trace info {trace}`",
                 f"the notebooks (`jupyter lab {_shown(paths.ROOT / 'notebooks')}/`)",
                 "the tests (`python -m pytest -q`" + ("" if paths.ROOT == Path.cwd() else f" in {paths.ROOT}") + ")"]
    return runs


def _shown(path: Path) -> str:
    """A path as the user would type it from here: relative when it is below the current folder."""
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


def no_gpu_message(cmd: str, why: str, prog: str) -> str:
    """One sentence: what `cmd` needs and why this machine lacks it, and what runs without it."""
    runs = without_gpu(prog)
    return f"`{cmd}` {NO_GPU}, {why}; these run without one: {', '.join(runs[:-1])} and {runs[-1]}."


def _load(args):
    import cupy
    cfg = get_config(args.model, max_seq=args.max_seq)
    try:
        free = cupy.cuda.runtime.memGetInfo()[0]
    except cupy.cuda.runtime.CUDARuntimeError:  # no device after all: loading says so, in its own words
        free = None
    problem = free is not None and schedule.memory_problem(cfg, free, plan.Launch(threads=args.threads))
    if problem:                                  # before minutes of loading, not at the cache's allocation
        raise GpuMemoryError(problem)
    t0 = time.perf_counter()
    p = weights.load_prepared(args.model, args.weights, seed=args.weights_seed or 0, xp=cupy, max_seq=args.max_seq)
    print(f"[{p.cfg.name}] weights {p.source}: {p.nbytes() / 1e9:.2f} GB prepared in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return p


def _kernel(args, p, **kw):
    mk = Monokernel(p, BuildOptions(launch=Launch(threads=args.threads)), **kw)
    r = mk.resources()
    print(f"[{p.cfg.name}] compiled in {mk.compile_s:.2f} s: {r['blocks']}×{r['threads']} threads, "
          f"{r['registers']} registers, {r['local_bytes']} B local, {r['dynamic_shared']} B shared", file=sys.stderr)
    return mk


def _tokenizer(args):
    folder = _weights_folder(args)
    path = folder / "tokenizer.json" if folder else None
    if path is None or not path.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("tokenizer.json found but the `tokenizers` package is missing: ids only", file=sys.stderr)
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:                      # the tokenizers package raises plain Exception for a bad file
        raise UserError(f"{path}: not a tokenizer the tokenizers package can read ({e})") from None


def stream_text(tokenizer, ids: Iterable[int], prompt: Iterable[int] = ()) -> Iterator[str]:
    """The text of token ids as they arrive, piece by piece, through the tokenizer's own streaming decoder
    (tokenizers.decoders.DecodeStream): a character whose bytes span several tokens (byte-level BPE splits "ï" or
    an emoji across tokens) comes out whole once its last byte arrives, never as U+FFFD halves, and each token costs
    a decode of the last few tokens only, not of everything so far. `prompt` primes the decoder so the first piece
    reads in context (a leading space, a merge with the prompt's last token). Bytes still pending when `ids` ends
    (generation stopped inside a character) come out as the tokenizer decodes them alone, so nothing is dropped."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)       # as Tokenizer.decode does by default
    for t in prompt:
        stream.step(tokenizer, t)
    pending = []
    for t in ids:
        pending.append(t)
        piece = stream.step(tokenizer, t)
        if piece:
            pending.clear()
            yield piece
    if pending and (tail := tokenizer.decode(pending)):
        yield tail




def cmd_generate(args) -> int:
    tok, ids = args.tokenizer, args.prompt_tokens          # from _check_generate
    if tok is None and getattr(args, "has_tokenizer", False):
        tok = _tokenizer(args)                             # in the worker: opened again (it does not travel)
    p = _load(args)
    prefilled = args.prefill and len(ids) > 1
    # the first new token chosen by the prefill (greedy: its last logits' first largest) or by the kernel's first step
    by_prefill = prefilled and args.first_token == "prefill"
    prefix = prefill_part(ids, args.first_token)           # what the prefill takes
    fed = ids[-1:] if prefilled else ids                    # what the kernel itself feeds, from pos0 (by_prefill: the
    #                                                         first token, known only after the prefill)
    wanted = args.tokens - by_prefill                       # tokens the kernel generates
    # the steps whose logits choose a generated token: from the prompt's last on
    record = list(range(len(fed) - 1, len(fed) - 1 + wanted)) if args.logits_out else []
    mk = _kernel(args, p, max_steps=len(fed) + args.tokens, max_record=max(64, len(record)))
    s = Sampling(args.temperature, args.top_k, args.top_p, args.seed or 0)
    timeout = getattr(args, "timeout", 5.0)
    eos = None if args.stop_on_eos else []
    keep_logits = bool(args.check_prefill) or (by_prefill and bool(args.logits_out))
    warm = None
    if prefilled:
        # the first prefill of a process loads its kernels, creates cuBLAS's handle and workspace, has cuBLAS choose
        # its kernels for the products' shapes and grows the memory pool to a chunk's activations: what a serving
        # process pays once. A prefill of the prompt's first chunk pays it here, untimed (the timed prefill writes
        # the same positions again); 64 tokens left a 4k prompt's first token at 33.1 ms against the bench's ~25
        # (one H100), the pool and the products' shapes still to come.
        # A fresh machine's first process also paid ~270 ms in the kernel's first step (one H100: first token 294.9
        # ms after a 22.3 ms prefill, 25.9 ms in the next process), the first launch's one-time work (CuPy's own
        # small kernels for the launch's resets and poisoning, the module loaded): one step at position 0 pays it
        # here too, and the timed prefill writes that position again.
        warm_n = min(len(prefix), PREFILL_CHUNK)
        t0 = time.perf_counter()
        mk.prefill(prefix[:warm_n], precision=args.prefill_precision, logits=keep_logits, token=by_prefill)
        for _ in mk.stream_tokens(ids[:1], 1, s, pos0=0, eos=[], timeout_s=timeout):
            pass
        warm = time.perf_counter() - t0
    # the last row's logits only where they are checked or saved
    pre = (mk.prefill(prefix, precision=args.prefill_precision, logits=keep_logits, token=by_prefill)
           if prefilled else None)
    first = []
    if by_prefill:
        first.append(pre.seconds)                           # the token is on the host: the prefill read it back
        fed = [pre.token]                                   # the kernel goes on from it, after the prompt
        if args.stop_on_eos and pre.token in set(p.cfg.eos_token_ids):
            wanted = 0
    pos0 = len(ids) if by_prefill else len(ids) - len(fed)
    tokens = (mk.stream_tokens(fed, wanted, s, pos0=pos0, eos=eos, timeout_s=timeout,
                               host_timeout_s=max(20.0, 4 * timeout), record=record) if wanted else iter(()))

    def timed(stream):
        # the kernel launches when the stream is first asked for a token (after the text decoder has read the
        # prompt): the time to first token is the prefill's and the launch's to the first token, not that reading
        t0 = time.perf_counter()
        for t in stream:
            if not first:
                first.append(time.perf_counter() - t0 + (pre.seconds if pre else 0.0))
            yield t
    head = [pre.token] if by_prefill else []               # shown at once, before the kernel's launch
    if tok is not None:
        for piece in stream_text(tok, itertools.chain(head, timed(tokens)), prompt=ids):
            print(piece, end="", flush=True)
    else:
        for t in itertools.chain(head, timed(tokens)):
            print(t, end=" ", flush=True)
    res = mk.last if wanted else None
    print()
    if first:
        how = (f"{pre.n} prompt tokens prefilled ({pre.precision} products) in {1e3 * pre.seconds:.1f} ms "
               f"({pre.chunks} chunk{'s' if pre.chunks != 1 else ''}), " + (
                   "the first token their last logits' first largest" if by_prefill else "then the kernel generated")
               if pre else f"the kernel fed the {len(ids)}-token prompt step by step and generated")
        after = (f"; an untimed warm-up prefill of its first {warm_n} tokens and one kernel step came first "
                 f"({1e3 * warm:.0f} ms: the kernels loaded, cuBLAS and the memory pool set up)"
                 if warm is not None else "")
        print(f"time to first token {1e3 * first[0]:.1f} ms: {how}{after}")
    if args.check_prefill and pre is not None:
        c = check_prefill(p, prefix, pre, mk.k_cache, mk.v_cache)
        print(c.summary())
        if not c.passed:
            return 1
    if args.logits_out:
        import numpy as np
        got = res.logits[:len(res.tokens)] if res is not None else np.zeros((0, p.cfg.vocab), np.float32)
        toks = head + (list(res.tokens) if res is not None else [])
        np.savez(args.logits_out, tokens=np.asarray(toks, np.int64),
                 logits=np.concatenate([pre.logits[None], got]) if by_prefill else got)
    if res is not None:
        print(f"{len(res.tokens)} tokens{' after the first' if by_prefill else ''}, {res.steps} decode steps in "
              f"{res.kernel_ms:.1f} ms: {res.tok_per_s:.0f} tok/s "
              f"({p.cfg.weight_bytes_per_token() * res.tok_per_s / 1e12:.2f} TB/s of weights)")
    return 0


def cmd_verify(args) -> int:
    """Stage by stage on every code path (a taps build of the same sections: every stage of every layer on its own
    inputs, at both sides of every attention split threshold, a long position, every sampler mode with
    --sampling), then end to end on the kernel itself (teacher-forced logits and greedy tokens)."""
    p = _load(args)
    ok = True
    taps = Monokernel(p, BuildOptions(launch=Launch(threads=args.threads), taps=True), max_steps=256)
    table, _ = verify_stages(taps, thorough=True, sampling=args.sampling, seed=args.seeds[0])
    print(table.text() if args.table or not table.passed else table.summary())
    ok &= table.passed
    del taps
    mk = _kernel(args, p, max_steps=max(args.prompt_len + args.tokens, 64))
    # every branch of the step's stop decision, on the kernel that runs (a rule at a time: check/stops.py)
    stops = verify_stops(mk, seed=args.seeds[0])
    bad = [c for c in stops if not c.passed]
    print(f"{'PASS' if not bad else 'FAIL'} {p.cfg.name} stop decision: {len(stops) - len(bad)}/{len(stops)} branches "
          f"({', '.join(c.buffer.removeprefix('stop: ') for c in stops)})")
    for c in bad:
        print(f"  {c.stage}: {c.buffer}: {c.note}")
    ok &= not bad
    for seed in args.seeds:
        rep = verify(mk, prompt_len=args.prompt_len, max_new=args.tokens, seed=seed,
                     rtol=DEFAULT_RTOL if args.rtol is None else args.rtol)
        print(rep.summary())
        ok &= rep.passed
    if args.prefill_len:
        # the decode after reads the cache the prefill wrote: the prefill precision's bound, unless --rtol says
        # otherwise (it held the decode after a bf16 prefill to fp32's 5e-3 while the bound argued is 2e-2)
        # both ways to the first token: the prefill's (greedy's default) and the kernel's first step (sampling's)
        for first in FIRST_TOKEN:
            pc, rep = verify_after_prefill(mk, prompt_len=args.prefill_len, max_new=args.tokens, seed=args.seeds[0],
                                           rtol=args.rtol, precision=args.prefill_precision, first=first)
            print(f"first token by the {first}: {pc.summary()}")
            print(rep.summary())
            ok &= pc.passed and rep.passed
    if args.sampling:
        # the stage-local check's modes, with seeds of their own (draws independent of the ones it checked)
        for i, mode in enumerate(SAMPLER_MODES):
            rep = verify_sampling(mk, dataclasses.replace(mode, seed=i + 1), draws=args.draws or 20000)
            print(rep.summary())
            ok &= rep.passed
    print("verify:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def cmd_build(args) -> int:
    target = args.target or ("hip" if args.dump == "amdgcn" else "cuda")
    arch = args.arch or {"cuda": "sm_90", "hip": "gfx942"}[target]
    names = list(PRESETS) if args.all_presets else [args.model]
    opt = BuildOptions(launch=Launch(threads=args.threads), timing=args.timing,
                       variants=tuple(args.variant))
    try:
        opt = with_fields(opt, **dict(args.set)).for_target(target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = False
    for name in names:
        cfg = get_config(name, max_seq=_max_seq_of(args, name))
        t0 = time.perf_counter()
        try:
            asm = A.assemble(cfg, opt)
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
        except (C.CompileError, NumbaError) as e:           # NumbaError: a numba section's declarations
            print(f"{cfg.name} {arch}: {C.CompileError(e.messages, str(e))}", file=sys.stderr)
            failed = True
            continue
        except (ValueError, FileNotFoundError) as e:          # an unknown section, a missing compiler or tool
            print(f"error: {e}", file=sys.stderr)
            return 2
        dt = time.perf_counter() - t0
        if log.strip():
            print(log.strip(), file=sys.stderr)
        dyn = smem_bytes(cfg, opt)
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
        if any(r.spills for r in res):
            print(f"{cfg.name} {arch}: {'local memory' if target == 'cuda' else 'scratch'} in use: registers spill",
                  file=sys.stderr)
            failed |= args.no_spills
    return 1 if failed else 0


def cmd_bench(args) -> int:
    return bench_main(args.model, args.tokens, args.repeats, args.json, args.no_torch, args.no_hf, args.positions,
                      args.ttft, args.no_compile, options=args.set, first_token=args.first_token)


def cmd_simulate(args) -> int:
    traces = [load_trace(path) for path in args.fit]
    checks = [load_trace(path) for path in args.check]
    hbm = args.hbm_tbps or traces[0].roofline_tbps
    costs = simulate.calibrate(traces, hbm_tbps=hbm, sm_gbps=args.sm_gbps)
    print(f"fitted on {', '.join(t.label for t in traces)} (HBM {hbm:.2f} TB/s shared, one SM at most "
          f"{args.sm_gbps:.0f} GB/s)")
    for tr in traces:
        print("\n" + simulate.compare(tr, costs))
    for tr in checks:
        print("\nnot fitted on: " + simulate.compare(tr, costs))
    if args.design:
        print("\n" + dataflow.predict(traces[0].cfg, costs, ["today", *args.design],
                                      args.positions or sorted({t.pos0 for t in traces + checks})))
    return 0


def _check_simulate(args):
    for path in args.fit + args.check:
        if not Path(path).is_file():
            raise UsageError(f"no trace at {path}")
    for text in args.design:
        try:
            simulate.parse_design(text)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--design {text}: {e}") from None
    models = {load_trace(p).meta.get("model") for p in args.fit + args.check}
    if len(models) > 1:
        raise UsageError(f"the traces are of several models ({', '.join(sorted(map(str, models)))}): calibrate on "
                         "one model's")


def _in_process_arg(p):
    p.add_argument("--in-process", action="store_true",
                   help="run the kernel in this process (default: in a worker process that owns the GPU, so that a "
                        "hang or a fault is reported and Ctrl-C stops the kernel)")


def _prefill_precision_arg(p: argparse.ArgumentParser):
    p.add_argument("--prefill-precision", choices=tuple(PRECISIONS), default=None,
                   help="the prefill's products: fp32 (each activation as two bf16 halves, two products; as "
                        "accurate as fp32) or bf16 (one product, half the work; checked to a looser bound, see "
                        "the README). Default fp32")


def _parser(prog: str = "python -m workbench") -> argparse.ArgumentParser:
    ap = _Parser(prog=prog, description="batch-1 decode monokernel workbench")
    sub = ap.add_subparsers(dest="cmd", metavar="command", required=True)
    g = sub.add_parser("generate", help="stream tokens from the monokernel (GPU)")
    _model_args(g)
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the weights folder)")
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated prompt token ids")
    prompt.add_argument("--prompt-random", type=positive_int, metavar="N",
                        help="a prompt of N random token ids (seeded by --seed): long prompts for timing")
    g.add_argument("--tokens", type=positive_int, default=64, help="tokens to generate")
    g.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="the prompt (all but its last token) as batched matrix products before the kernel starts "
                        "(the default for a prompt of 2 tokens or more); --no-prefill feeds it to the kernel one "
                        "decode step per token")
    _prefill_precision_arg(g)
    g.add_argument("--first-token", choices=FIRST_TOKEN, default=None,
                   help="who chooses the first new token after a prefill: prefill (the whole prompt prefilled, "
                        "its last logits' first largest; the default when greedy) or kernel (the prompt's last token "
                        "left to the kernel's first step; the default, and the only way, when sampling)")
    g.add_argument("--check-prefill", action="store_true",
                   help="compare the prefill's cache and last logits with an fp64 run (exits 1 on failure)")
    g.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    g.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]; 1 = off")
    g.add_argument("--seed", type=seed_arg,
                   help="sampling seed (default 0), from 0 to 2**64 - 1; also seeds --prompt-random")
    g.add_argument("--stop-on-eos", action="store_true", help="stop at the config's EOS ids")
    g.add_argument("--logits-out", type=output_file, metavar="FILE.npz",
                   help="save the generated tokens and the logits each was drawn from (fp32, bit for bit: two runs "
                        "of one command can be compared)")
    g.add_argument("--timeout", type=timeout_arg, default=5.0,
                   help="seconds a grid barrier waits before the kernel reports a hang (raise it under a sanitizer)")
    _in_process_arg(g)
    v = sub.add_parser("verify", help="kernel vs reference, teacher-forced (GPU); exits 1 on failure")
    _in_process_arg(v)
    _model_args(v)
    v.add_argument("--seeds", type=seed_arg, nargs="+", default=[0],
                   help="seeds of the end-to-end runs' random prompts, one run each (default 0), from 0 to 2**64 - 1; "
                        "the first also seeds the stage-local check and the stop decision's runs")
    v.add_argument("--prompt-len", type=positive_int, default=8,
                   help="prompt tokens of each end-to-end run (default 8)")
    v.add_argument("--tokens", type=positive_int, default=24,
                   help="tokens each end-to-end run generates after its prompt (default 24)")
    v.add_argument("--rtol", type=positive_float, default=None,
                   help=f"relative tolerance of the end-to-end logits (default {DEFAULT_RTOL:g}; the decode after "
                        f"--prefill-len's prefill: its precision's bound, "
                        f"{', '.join(f'{k} {v:g}' for k, v in PREFILL_RTOL.items())})")
    v.add_argument("--sampling", action="store_true",
                   help="also every sampler mode, draw by draw, and the chi-square checks of its distribution")
    v.add_argument("--table", action="store_true", help="print the stage × layer table even when it passes")
    v.add_argument("--draws", type=draws_arg, help=f"with --sampling: draws per sampler mode (default 20000, at most "
                                                f"{MAX_DRAWS})")
    v.add_argument("--prefill-len", type=positive_int, metavar="N",
                   help="also: a random N-token prompt prefilled (batched) and checked, then the kernel from its "
                        "last token, end to end against the reference over the whole sequence")
    _prefill_precision_arg(v)
    b = sub.add_parser("build", help="compile only (no GPU): registers, spills, shared memory")
    which = b.add_mutually_exclusive_group()
    which.add_argument("--model", default=DEFAULT_MODEL, type=non_empty, help=MODEL_HELP)
    which.add_argument("--all-presets", action="store_true",
                       help=f"build every preset the kernel runs ({', '.join(PRESETS)})")
    b.add_argument("--max-seq", type=max_seq_arg, help=MAX_SEQ_HELP)
    b.add_argument("--threads", type=threads, default=512, help=THREADS_HELP)
    b.add_argument("--target", choices=["cuda", "hip"],
                   help="cuda: NVRTC for NVIDIA; hip: clang-19 for AMD (default cuda, hip with --dump amdgcn)")
    b.add_argument("--arch", type=arch_arg, help="sm_90 for cuda, gfx942 for hip (the defaults); an AMD arch "
                                              "alone means --target hip")
    b.add_argument("--timing", action="store_true", help="with per-stage timing instrumentation")
    b.add_argument("--set", type=build_option, action="append", default=[], metavar="FIELD=VALUE",
                   help="a BuildOptions or launch field of the build, e.g. --set ahead=gate_up_silu (repeatable)")
    b.add_argument("--no-spills", action="store_true",
                   help="exit 1 when registers spill (NVIDIA local memory, AMD scratch)")
    b.add_argument("--dump", choices=["ptx", "sass", "amdgcn"],
                   help="print the machine code instead (PTX, SASS: cuda; AMDGCN: hip), headed by source lines")
    b.add_argument("--section", type=non_empty,
                   help="with --dump: only the code of this section (e.g. qkv_rope_append, matvec, monokernel, "
                        "portability), what is inlined into it included")
    b.add_argument("--variant", action="append", default=[], type=section_variant, metavar="SECTION=VARIANT",
                   help="build SECTION from kernels/sections/SECTION@VARIANT.cuh (.ptx for a variant named ptx...; "
                        "for one named numba..., the .cuh calls device functions of SECTION@VARIANT.py, which "
                        "numba-cuda compiles); repeatable")
    sa = sub.add_parser("sanitize", help="generate under compute-sanitizer: memcheck, racecheck, synccheck, initcheck")
    sa.add_argument("--model", default="tiny", type=non_empty,
                    help=f"preset ({', '.join(PRESETS)}) or a local HF folder (default tiny: the tools are slow)")
    sa.add_argument("--tool", choices=[*SANITIZER_TOOLS, "all"], default="all",
                    help="the compute-sanitizer tool to run generate under (default all, one after another)")
    sa.add_argument("--tokens", type=positive_int, default=3, help="tokens to generate (racecheck is ~1000x slower)")
    sa.add_argument("--prompt-ids", type=token_ids, default=[1, 2, 3],
                    help="the prompt (each of its tokens is one more decode step under the tool)")
    sa.add_argument("--threads", type=threads, default=512, help=THREADS_HELP)
    sa.add_argument("--sanitizer", default="compute-sanitizer", type=non_empty, help="the compute-sanitizer executable")
    pl = sub.add_parser("plan", help="the decode step as the plan declares it (no GPU)")
    pl.add_argument("--model", default=DEFAULT_MODEL, type=non_empty, help=MODEL_HELP)
    pl.add_argument("--max-seq", type=max_seq_arg, help=MAX_SEQ_HELP)
    pl.add_argument("--decode-step", action="store_true", help="also the C++ decode loop generated from it")
    pl.add_argument("--write", action="store_true",
                    help="with --decode-step: rewrite the repository's copies of the decode step "
                         "(docs/decode_step.MODEL.cuh) instead of printing anything")
    pl.add_argument("--gpus", type=positive_int, default=1,
                    help="also how N GPUs split each layer (tensor parallel) and what a token exchanges")
    pl.add_argument("--handoffs", type=int, nargs="?", const=128, metavar="POSITION",
                    help="also each dependency's fan-in (producer blocks a consumer block waits for) and hand-off, "
                         "at a position (default 128: attention's split depends on it)")
    be = sub.add_parser("bench", help="monokernel vs torch.compile, HF generate() and the bandwidth roofline (GPU)")
    be.add_argument("--model", default=DEFAULT_MODEL, type=non_empty, help=MODEL_HELP)
    be.add_argument("--tokens", type=positive_int, default=128, help="decode steps per timed run")
    be.add_argument("--repeats", type=positive_int, default=5,
                    help="timed runs of each contender at each position, the median reported (default 5)")
    be.add_argument("--json", type=output_file, help="write the table as JSON here (its folder must exist)")
    be.add_argument("--no-torch", action="store_true", help="skip the PyTorch paths")
    be.add_argument("--no-hf", action="store_true", help="skip HF generate()")
    be.add_argument("--no-compile", action="store_true", help="skip torch.compile (minutes of compiling)")
    be.add_argument("--positions", type=positive_int, nargs="+",
                    help="starting positions (default 128, 4096 and 16384, and 32768 for llama-3.2-1b)")
    be.add_argument("--ttft", type=positive_int, nargs="*", metavar="N",
                    help="also time to first token for N-token prompts (the batched prefill against HF "
                         "transformers' prefill; default 1k, 4k, 16k and 32k for llama-3.2-1b, 4k otherwise)")
    be.add_argument("--first-token", choices=FIRST_TOKEN, nargs="+", default=None,
                    help="with --ttft: the ways to the first token timed, each in the same run (default prefill: "
                         "the prefill's last logits; kernel: the kernel's first step from the prompt's last token)")
    be.add_argument("--set", type=build_option, action="append", default=[], metavar="FIELD=VALUE",
                    help="a BuildOptions or launch field of the kernel benched, e.g. --set early=o_proj_residual "
                         "(repeatable)")
    _in_process_arg(be)
    si = sub.add_parser("simulate", help="the schedule simulator, calibrated on timing traces (no GPU): per-slot "
                                         "check, and designs priced before they are built")
    si.add_argument("fit", nargs="+", help="timing traces (.npz, a timing build's: bench/record) to calibrate on")
    si.add_argument("--check", nargs="*", default=[], help="traces not fitted on: the simulator's check")
    si.add_argument("--hbm-tbps", type=float, help="HBM's streaming read shared by all SMs (default: the first "
                                                   "trace's same-run figure)")
    si.add_argument("--sm-gbps", type=float, default=simulate.SM_GBPS,
                    help="one SM's streaming read alone (default: measured on the H200 by scripts/sm_bandwidth.py)")
    si.add_argument("--design", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                    help="a design to price against today's: fields of simulate.Design (early_bytes, handoff, deal) or of "
                         "the plan's Launch (attn_min_chunk, attn_single, early, ...); repeatable")
    si.add_argument("--positions", type=positive_int, nargs="+", help="positions to price designs at (default: "
                                                                      "the traces')")
    _trace_parser(sub)
    nb = sub.add_parser("nbclean", help="notebooks without outputs, execution counts or run metadata, as they are "
                                        "committed (no GPU); with no files, stdin to stdout: a git clean filter")
    nb.add_argument("files", nargs="*", help="notebooks (.ipynb) to clean in place")
    return ap


def _trace_parser(sub):
    """`trace`: the command line of workbench.measure.trace (`python -m workbench.measure.trace`), option for
    option, so that it is listed and explained with the others; main hands the arguments to that module, which
    tests/test_cli_help.py holds this copy to."""
    t = sub.add_parser("trace", help="timing traces (no GPU): pack a raw .npy, convert an older trace, print a "
                                     "trace's table, export Perfetto JSON")
    ts = t.add_subparsers(dest="trace_cmd", metavar="action", required=True)
    p = ts.add_parser("pack", help="a raw stamps .npy (scripts/device_suite.py) → a trace .npz with metadata")
    p.add_argument("npy", help="the stamps, uint64 [steps, slots, blocks, 2], as a timing build's run saved them")
    p.add_argument("out", help="the trace file to write (.npz)")
    p.add_argument("--model", required=True, help="the preset, or a config.json, the stamps were recorded on")
    p.add_argument("--position", type=int, default=0, help="the position of the run's first step (default 0)")
    p.add_argument("--steps", type=int, help="keep the first N steps")
    p.add_argument("--device", required=True, help="the GPU it was recorded on, e.g. H200")
    p.add_argument("--date", required=True, help="when it was recorded")
    p.add_argument("--commit", required=True, help="the commit of the kernel recorded")
    p.add_argument("--tok-s", type=float, help="the run's tok/s, to label the trace with")
    p.add_argument("--roofline-tbps", type=float, help="the weights' streaming read measured beside it, in TB/s")
    p.add_argument("--meta", default="{}", help="more metadata, a JSON object")
    p.add_argument("--from-v1", action="store_true",
                   help="the .npy was recorded with the older slot layout (first embedding in step 0 only, "
                        "sampling last): convert it (convert_v1)")
    c = ts.add_parser("convert", help=f"a {TRACE_V1} trace (the older slot layout) → a {TRACE_FORMAT} trace")
    c.add_argument("old", help=f"the {TRACE_V1} trace")
    c.add_argument("new", help="the trace file to write")
    i = ts.add_parser("info", help="metadata and the per-stage table of a trace")
    i.add_argument("trace", help="a trace file (.npz), e.g. one of fixtures/")
    e = ts.add_parser("perfetto", help="export Chrome/Perfetto trace JSON (open it in ui.perfetto.dev)")
    e.add_argument("trace", help="a trace file (.npz)")
    e.add_argument("out", help="the JSON file to write")
    e.add_argument("--steps", default="1", help="steps to export: N or A-B (default 1)")


def _check_plan(args):
    if args.write:
        if not args.decode_step:
            raise UsageError("--write: give --decode-step too (it writes the repository's copies of the decode step)")
        if args.model != DEFAULT_MODEL or args.max_seq is not None or args.gpus > 1 or args.handoffs is not None:
            raise UsageError("--write: the copies are of fixed models at their presets' shapes; give no --model, "
                             "--max-seq, --gpus or --handoffs")
        if not paths.source_checkout():
            raise UsageError("--write: the decode step's copies live in a source checkout's docs/, and this "
                             "installation is not one")
    cfg = _config(args.model, args.max_seq)
    if args.handoffs is not None and not 0 <= args.handoffs < cfg.max_seq:
        raise UsageError(f"--handoffs {args.handoffs}: a position from 0 to the context's last, {cfg.max_seq - 1}")


def cmd_plan(args) -> int:
    if args.write:
        for path, changed in write_step_files():
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"{'wrote' if changed else 'up to date:'} {shown}")
        return 0
    cfg = get_config(args.model, max_seq=args.max_seq)
    print(schedule.describe(cfg))
    if args.decode_step:
        print()
        print(decode_step(cfg, plan.Launch()), end="")
    if args.gpus > 1:
        print()
        print(Sharding(cfg, args.gpus).describe())
    if args.handoffs is not None:
        print(f"\nhand-offs at position {args.handoffs}: which producer blocks each consumer block waits for, and "
              "the cheapest order that serves (a grid barrier only where every block needs every producer)")
        print(format_handoffs(handoffs(cfg, plan.Launch(), args.handoffs)))
    return 0


SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def _check_sanitize(args):
    cfg = _config(args.model, None)
    # what the generate run under each tool would refuse, minutes in (it reports no summary, only its exit code)
    _check_vocab(cfg, args.prompt_ids, "--prompt-ids")
    _fits(cfg, len(args.prompt_ids), args.tokens, f"--prompt-ids ({len(args.prompt_ids)} tokens) and --tokens "
          f"{args.tokens}", hint="")


def _check_sanitizer(args):
    """Looked for once the GPU is known to be there (main checks it): on a machine without one, that is the news."""
    if shutil.which(args.sanitizer) is None and not Path(args.sanitizer).is_file():
        raise UsageError(f"{args.sanitizer} is not on the PATH (compute-sanitizer comes with the CUDA toolkit; "
                         "--sanitizer PATH names it)")


def sanitizer_errors(output: str) -> int | None:
    """The error count of a compute-sanitizer run's summary line, None without one. memcheck, synccheck and
    initcheck end with `ERROR SUMMARY: N errors`; racecheck with `RACECHECK SUMMARY: H hazards displayed (N errors,
    W warnings)`."""
    m = re.search(r"ERROR SUMMARY: (\d+) error", output) or re.search(r"RACECHECK SUMMARY: .*?\((\d+) error", output)
    return int(m[1]) if m else None


def sanitizer_summary(output: str) -> str:
    """The tool's own summary line, as it wrote it (racecheck's counts its hazards and warnings too)."""
    m = re.search(r"(?:ERROR|RACECHECK) SUMMARY: (.*)", output)
    return m[1].strip() if m else ""


_TOKEN_LINE = re.compile(r"(?:\d+ )+\d*")


def streamed_tokens(text: str) -> int:
    """Tokens a `generate --prompt-ids` run has streamed so far, in its output as far as it got: the whole numbers,
    each followed by its space, of its first line of numbers alone. Lines end at a newline or a carriage return: a
    progress bar (tqdm, on the same stream) ends its lines with \r, and the tokens follow its last one."""
    for line in re.split(r"[\r\n]", text):
        if _TOKEN_LINE.fullmatch(line):
            return line.count(" ")                    # a number not yet followed by its space may still be growing
    return 0


def _run_with_token_bar(cmd: list[str], tokens: int, desc: str) -> subprocess.CompletedProcess:
    """Run cmd, its stdout and stderr as one text, with a bar of the tokens it has streamed on this stderr (a
    sanitized run takes minutes: loading and compiling under the tool before the first token, then each token
    slow). The bar shows only on a terminal."""
    from tqdm import tqdm
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks: list[bytes] = []
    with tqdm(total=tokens, desc=desc, unit="token", leave=False, disable=None) as bar:
        while data := proc.stdout.read1(65536):
            chunks.append(data)
            bar.update(min(tokens, streamed_tokens(b"".join(chunks).decode(errors="replace"))) - bar.n)
    proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, b"".join(chunks).decode(errors="replace"), "")


def cmd_sanitize(args) -> int:
    """`generate` under compute-sanitizer, once per tool, in this process (the sanitizer must see the kernel):
    a line per tool with its error count; exit 1 if any tool found an error."""
    _check_sanitizer(args)
    tools = SANITIZER_TOOLS if args.tool == "all" else (args.tool,)
    worst = 0
    for tool in tools:
        # racecheck only our kernel: instrumented, the thousands of small CuPy kernels that make and prepare the
        # weights took the 1B's run past 5 minutes before the monokernel started (and racecheck looks only at
        # shared memory, which no other kernel shares with ours). The other tools see every kernel: initcheck
        # must watch the weights being written to know they are initialised.
        only_ours = ["--racecheck-report", "all", "--kernel-name", "kns=wb_generate"] if tool == "racecheck" else []
        # --no-prefill: the prompt goes through the monokernel, which is what is being checked (the prefill's
        # products are cuBLAS's)
        cmd = [args.sanitizer, "--tool", tool, "--error-exitcode", "9", *only_ours,
               sys.executable, "-m", "workbench", "generate", "--in-process", "--timeout", "600", "--model", args.model,
               "--tokens", str(args.tokens), "--prompt-ids", ",".join(map(str, args.prompt_ids)), "--no-prefill",
               "--threads", str(args.threads)]
        t0 = time.perf_counter()
        r = _run_with_token_bar(cmd, args.tokens, f"{tool} {args.model}")
        out = r.stdout
        errors = sanitizer_errors(out)
        dt = time.perf_counter() - t0
        if errors is None:
            print(f"{tool:10s} {args.model}: no summary (exit code {r.returncode}) in {dt:.0f} s; its output ends:\n"
                  + "\n".join(out.strip().splitlines()[-8:]))
            worst = max(worst, 1)
            continue
        print(f"{tool:10s} {args.model}: {errors} errors ({sanitizer_summary(out)}), exit code {r.returncode}, "
              f"{dt:.0f} s")
        if errors or r.returncode:
            # a nonzero exit with no error counted (racecheck on 1b exited 9 with "0 errors"): what the tool said,
            # its own lines first, then the end of the run's output
            lines = out.strip().splitlines()
            said = [l for l in lines if l.startswith("=========")]
            app = [l for l in lines if not l.startswith("=========")]
            print("\n".join(said)[:4000])
            if app:                                    # the program's own last words: why it ended as it did
                print("the program under the tool ended with:\n" + "\n".join(app[-15:]))
        worst = max(worst, 1 if errors or r.returncode else 0)
    return worst


class CliService:
    """The GPU side of a command, in a worker process (workbench.run.worker): every kernel it makes writes the
    shared block the caller watches. Its output goes to the same stdout and stderr."""

    def __init__(self, buf, header, n_words, words):
        # registered when the first kernel is made, so a command that fails on its input touches no GPU
        WORKER_CONTEXT["mapped"] = lambda: RegisteredMapped(buf, n_words, offset_words=header)
        WORKER_CONTEXT["on_phase"] = phase_setter(words)

    def close(self):
        """Let go of every view of the shared block, so that the worker can close it when it exits."""
        m = WORKER_CONTEXT.pop("mapped", None)
        WORKER_CONTEXT.pop("on_phase", None)
        if hasattr(m, "close"):
            m.close()

    def run(self, cmd: str, fields: dict) -> int:
        paths.set_kernels_dir(fields.pop("kernels_dir"))       # the caller's, not this process's default
        rc = COMMANDS[cmd][0](argparse.Namespace(**fields))
        sys.stdout.flush()
        sys.stderr.flush()
        return rc


def _in_worker(args) -> int:
    """Run a GPU command in a worker process that owns the GPU: a hang or a fault is reported in one line (with
    where every block was) and Ctrl-C stops the kernel cleanly, whatever the kernel does."""
    fields = dict(vars(args))
    fields.pop("in_process", None)
    fields["has_tokenizer"] = fields.get("tokenizer") is not None
    fields["tokenizer"] = None                              # opened again in the worker
    fields["kernels_dir"] = str(paths.kernels_dir())
    worker = Worker(CliService, hang_s=30.0, compile_s=300.0, max_tokens=worker_tokens(args))
    try:
        worker.start()
        return worker.call("run", args.cmd, fields)
    except WorkerFailure as f:
        print(f"error: the GPU worker failed ({f.kind}): " + " ".join(str(f).split()), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the kernel was asked to stop", file=sys.stderr)
        return 130
    finally:
        worker.close()


COMMANDS = {"generate": (cmd_generate, _check_generate, True), "verify": (cmd_verify, _check_verify, True),
            "build": (cmd_build, _check_build, False), "bench": (cmd_bench, _check_bench, True),
            "plan": (cmd_plan, _check_plan, False), "sanitize": (cmd_sanitize, _check_sanitize, True),
            "simulate": (cmd_simulate, _check_simulate, False)}
BUG = "this is a bug in the workbench: please report it, with the traceback above and the command line"


MODULE_PROG = "python -m workbench"


def invoked_as(argv0: str) -> str:
    """The command's name as the user typed it: the console script's own name (`monokernel-workbench`), or
    `python -m workbench` when run as a module (argv[0] is then the module's file)."""
    name = Path(argv0).name
    if not name or name.endswith(".py") or name == "-c":
        return MODULE_PROG
    return name.removesuffix(".exe")


def main(argv=None, prog: str | None = None) -> int:
    """Run one command; user errors become one line and exit code 2, anything else a traceback and a bug report.
    Called with no `argv`, the command line is sys.argv and the usage names the command as it was invoked."""
    if argv is None:
        argv, prog = sys.argv[1:], prog or invoked_as(sys.argv[0])
    argv, prog = [str(a) for a in argv], prog or MODULE_PROG
    try:
        args = _parser(prog).parse_args(argv)
        if args.cmd == "trace":                      # the module's own command line, already checked by ours
            return trace_main(argv[argv.index("trace") + 1:])
        if args.cmd == "nbclean":
            return nbclean_main(args.files)
        run, check, needs_gpu = COMMANDS[args.cmd]
        if getattr(args, "max_seq", None) == "max" and not getattr(args, "all_presets", False):
            args.max_seq = _longest(args.model)
        check(args)
        if needs_gpu:
            if (why := gpu_problem()) is not None:
                raise NoDeviceError(no_gpu_message(args.cmd, why, prog))
            if not getattr(args, "in_process", True):       # sanitize runs its own processes
                return _in_worker(args)
        return run(args)
    except UserError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)        # one line, whatever the message held
        return 2
    except BrokenPipeError:                             # the reader left (`... | head`): not an error of ours
        sys.stdout = None
        return 0
    except Exception as e:
        if isinstance(e, CompileError):                 # the kernel sources' fault, reported as `build` reports it
            print(e, file=sys.stderr)
            return 1
        if isinstance(e, KernelError):                  # the kernel stopped itself (a hang it caught, NaN logits)
            print("error: the kernel stopped: " + " ".join(str(e).split()), file=sys.stderr)
            return 1
        traceback.print_exc()
        print(BUG, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(prog=MODULE_PROG))

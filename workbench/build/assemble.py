"""Assembling the monokernel: sections → one self-contained source with `#line` markers.

CuPy keys its compile cache on the source text, not on included headers, so nothing is `#include`d: every section
is pasted in, each preceded by `#line 1 "kernels/..."`, and compiler messages point at the section's own file and
line. Shapes arrive only as the `#define`s generated from the model config; the `Params` struct is generated from
the ctypes layout the host fills, so the two cannot drift apart.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import re
from pathlib import Path

from ..model.config import ModelConfig
from .. import paths


# The decode path, in the order the source is assembled (each needs only what precedes it).
SECTIONS = ["grid_sync", "matvec", "embedding", "qkv_rope_append", "attention_decode", "o_proj_residual",
            "gate_up_silu", "down_residual", "lm_head", "sampling"]
# Stages a block can be in (named in hang reports and timing). Per layer: the five layer stages.
STAGES = ["embedding", "qkv_rope_append", "attention_decode", "o_proj_residual", "gate_up_silu", "down_residual",
          "lm_head", "sampling"]
LAYER_STAGES = STAGES[1:6]

# Kernel parameters: (field, C type). Pointers are 64-bit; the ctypes mirror below is generated from this list.
PARAMS = [
    # prepared weights and tables
    ("embed", "const bf16*"), ("wqkv", "const bf16*"), ("wo", "const bf16*"), ("wgu", "const bf16*"),
    ("wd", "const bf16*"), ("lm_head", "const bf16*"), ("rope_cos", "const float*"), ("rope_sin", "const float*"),
    # activations and the KV cache
    ("x", "float*"), ("q", "float*"), ("o", "float*"), ("hmlp", "float*"), ("k_cache", "bf16*"), ("v_cache", "bf16*"),
    ("logits", "float*"), ("logits_hist", "float*"), ("rec_slot", "const int*"),
    ("attn_part", "float*"), ("attn_count", "u32*"), ("blk_max", "float*"), ("blk_arg", "int*"),
    # synchronisation and control (status, host_abort, tokens_out, n_out, progress: mapped host memory)
    ("bar_count", "u32*"), ("arrive", "u32*"), ("where", "u32*"), ("dev_flags", "int*"), ("status", "int*"),
    ("host_abort", "const int*"), ("tokens_out", "int*"), ("n_out", "int*"), ("progress", "int*"),
    ("tokens_in", "const int*"), ("eos", "const int*"), ("draws", "int*"), ("timing", "u64*"),
    ("taps", "float*"), ("tap_slot", "const int*"),
    # scalars
    ("seed", "u64"), ("timeout_ns", "u64"),
    ("n_in", "int"), ("n_steps", "int"), ("max_new", "int"), ("pos0", "int"), ("n_eos", "int"), ("top_k", "int"),
    ("n_draws", "int"), ("attn_max_splits", "int"), ("timing_steps", "int"),
    ("temperature", "float"), ("top_p", "float"),
]
_CTYPES = {"u64": ctypes.c_uint64, "int": ctypes.c_int32, "float": ctypes.c_float}


class Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64 if t.endswith("*") else _CTYPES[t]) for n, t in PARAMS]


def params_struct() -> str:
    body = "\n".join(f"    {t} {n};" for n, t in PARAMS)
    return f"struct Params {{\n{body}\n}};\nstatic_assert(sizeof(Params) == {ctypes.sizeof(Params)}, \"Params layout\");\n"


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    threads: int = 512           # per block; one block per SM
    timing: bool = False         # WB_TIMING: per-stage %globaltimer stamps
    attn_min_chunk: int = 32     # fewest cache positions per attention split
    taps: bool = False           # WB_TAPS: copy every stage's output of chosen steps into tap buffers
    hang: tuple | None = None    # (stage, layer, block): fault injection for hang-safety tests
    variants: tuple = ()         # ((section, variant), ...): alternative section files, see section_path
    defines: tuple = ()          # ((NAME, value), ...): extra compile-time knobs (e.g. WB_BAR_FENCES)
    ptxas_opt: int = 3           # ptxas -O level (NVIDIA)
    fast_compile: str = "0"      # NVRTC -Ofc level: "0" (off), "min", "mid", "max": compile speed over code speed
    sampler: str = "full"        # "full": temperature, top-k, top-p; "greedy": argmax only (less code to compile)

    def __post_init__(self):
        if self.sampler not in ("full", "greedy"):
            raise ValueError(f"sampler must be 'full' or 'greedy', got {self.sampler!r}")
        if self.fast_compile not in ("0", "min", "mid", "max"):
            raise ValueError(f"fast_compile must be 0, min, mid or max, got {self.fast_compile!r}")
        if self.ptxas_opt not in (0, 1, 2, 3):
            raise ValueError(f"ptxas_opt must be 0 to 3, got {self.ptxas_opt!r}")


def option_from_text(field: str, text: str):
    """The value of a BuildOptions field written on a command line (`opt.sampler=greedy`, `--set ptxas_opt=1`)."""
    kinds = {f.name: type(f.default) for f in dataclasses.fields(BuildOptions)}
    kind = kinds.get(field)
    if kind not in (int, bool, str):
        settable = ", ".join(k for k, t in kinds.items() if t in (int, bool, str))
        raise ValueError(f"{field!r} is not a BuildOptions field that text can set (those are: {settable})")
    if kind is str:
        return text
    try:
        return kind(int(text))
    except ValueError:
        raise ValueError(f"{field} takes an integer, got {text!r}") from None


# What a debug build taps per layer, in buffer order, with the stage that produces it. Names match the reference's
# taps (workbench.reference.decode_step).
TAPS = [("x_in", "embedding"), ("q", "qkv_rope_append"), ("k", "qkv_rope_append"), ("v", "qkv_rope_append"),
        ("attn", "attention_decode"), ("x_attn", "o_proj_residual"), ("h_mlp", "gate_up_silu"),
        ("x_out", "down_residual")]


def tap_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {"x_in": cfg.hidden, "q": cfg.q_dim, "k": cfg.kv_dim, "v": cfg.kv_dim, "attn": cfg.q_dim,
            "x_attn": cfg.hidden, "h_mlp": cfg.intermediate, "x_out": cfg.hidden}


def tap_offsets(cfg: ModelConfig) -> tuple[dict[str, int], int]:
    """Offset of each tap inside a layer's record, and the record's length (floats)."""
    off, n = {}, 0
    for name, _ in TAPS:
        off[name] = n
        n += tap_sizes(cfg)[name]
    return off, n


def section_path(name: str, variant: str | None = None) -> Path:
    """kernels/sections/NAME.cuh, or kernels/sections/NAME@VARIANT.cuh for a named variant."""
    return paths.sections_dir() / (f"{name}@{variant}.cuh" if variant else f"{name}.cuh")


def timing_slots(cfg: ModelConfig) -> int:
    """Barriers per step that the timing build stamps: the first embedding, five per layer, LM head, sampling."""
    return 1 + len(LAYER_STAGES) * cfg.n_layers + 2


def smem_floats(cfg: ModelConfig, threads: int, warp: int = 32) -> dict[str, int]:
    """Dynamic shared memory each stage needs, in floats; the kernel gets the maximum."""
    act = -(-max(cfg.hidden, cfg.q_dim, cfg.intermediate) // 4) * 4
    nwarps = threads // warp
    attn = cfg.group * cfg.head_dim + nwarps * cfg.group * (cfg.head_dim + 2)
    sampling = (256 + 1024) * 2 + 8          # SampScratch: u64 hist[256], u64 chunk[1024], words
    return {"act": act, "reduction": 64, "attention": attn, "sampling": sampling}


def smem_bytes(cfg: ModelConfig, threads: int) -> int:
    f = smem_floats(cfg, threads)
    return 4 * max(f["act"] + f["reduction"], f["attention"], f["sampling"])


def defines(cfg: ModelConfig, opt: BuildOptions) -> dict[str, str]:
    d = dict(cfg.defines())
    d.update(WB_THREADS=str(opt.threads), WB_ACT_FLOATS=str(smem_floats(cfg, opt.threads)["act"]),
             WB_SLOTS=str(timing_slots(cfg)), WB_TIMING=str(int(opt.timing)),
             WB_ATTN_MIN_CHUNK=str(opt.attn_min_chunk), WB_TAPS=str(int(opt.taps)))
    d.update(WB_SAMPLER_FULL=str(int(opt.sampler == "full")))
    off, per_layer = tap_offsets(cfg)
    d.update({f"WB_TAP_{k.upper()}": str(v) for k, v in off.items()})
    d.update(WB_TAP_LAYER_FLOATS=str(per_layer), WB_TAP_STEP_FLOATS=str(per_layer * cfg.n_layers))
    d.update({k: str(v) for k, v in opt.defines})
    if opt.hang:
        stage, layer, block = opt.hang
        d.update(WB_HANG_STAGE=f"ST_{stage.upper()}", WB_HANG_LAYER=str(layer), WB_HANG_BLOCK=str(block))
    return d


@dataclasses.dataclass
class Assembled:
    source: str
    # (first line in source, display path, text as pasted) per piece, for mapping messages back
    pieces: list
    key: str
    flags: tuple = ()      # compiler options the build asks for beyond the common ones (NVRTC)

    def text_of(self, path: str) -> str | None:
        """The text that was compiled for a section file (an unsaved edit included)."""
        for _, p, text in self.pieces:
            if p == path:
                return text
        return None

    def locate(self, line: int) -> tuple[str, int]:
        """Where a line of the assembled source came from."""
        best = ("<generated>", line)
        for start, path, _ in self.pieces:
            if line >= start:
                best = (path, 1 + line - start)
        return best


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(paths.kernels_dir().parent).as_posix()
    except ValueError:
        return path.as_posix()


def _clean(text: str, path: Path) -> str:
    if re.search(r"^\s*#\s*include\b", text, re.M):
        raise ValueError(f"{_display(path)}: sections are pasted, not included: remove the #include "
                         "(the assembly already provides portability.cuh and the earlier sections)")
    return re.sub(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", "", text, flags=re.M)


def assemble(cfg: ModelConfig, opt: BuildOptions = BuildOptions(), overrides: dict[str, str] | None = None) -> Assembled:
    """The full kernel source. `overrides` maps a section name to replacement text (an edit not yet on disk)."""
    overrides = overrides or {}
    variants = dict(opt.variants)
    head = ["// monokernel — generated by workbench.assemble; edit the sections, not this text",
            *(f"#define {k} {v}" for k, v in defines(cfg, opt).items())]
    out, pieces = list(head), []

    def paste(path: Path, text: str):
        pieces.append((len(out) + 2, _display(path), text))
        out.append(f'#line 1 "{_display(path)}"')
        out.extend(_clean(text, path).splitlines())

    kernels = paths.kernels_dir()
    paste(kernels / "portability.cuh", (kernels / "portability.cuh").read_text())
    gen = params_struct() + "enum Stage { " + ", ".join(f"ST_{s.upper()}" for s in STAGES) + " };\n"
    pieces.append((len(out) + 2, "<generated: Params, Stage>", gen))
    out.append('#line 1 "<generated: Params, Stage>"')
    out.extend(gen.splitlines())
    for name in SECTIONS + ["monokernel"]:
        if name in overrides:
            path = section_path(name, variants.get(name))
            paste(path, overrides[name])
            continue
        path = kernels / "monokernel.cuh" if name == "monokernel" else section_path(name, variants.get(name))
        if not path.exists():
            raise FileNotFoundError(f"section {name!r}: {_display(path)} does not exist")
        paste(path, path.read_text())
    source = "\n".join(out) + "\n"
    flags = (() if opt.ptxas_opt == 3 else (f"--ptxas-options=-O{opt.ptxas_opt}",)) + \
        (() if opt.fast_compile == "0" else (f"-Ofc={opt.fast_compile}",))
    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    return Assembled(source, pieces, key, flags)

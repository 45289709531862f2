"""Model shapes: the one source of truth.

A `ModelConfig` is read from a Hugging Face `config.json` or taken from a named preset. Everything the kernel needs
to know about shapes reaches it through `defines()`, which becomes `#define` lines at the top of the assembled source.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
from pathlib import Path

from ..errors import ConfigError

__all__ = ["ConfigError", "RopeScaling", "ModelConfig", "PRESETS", "DEFAULT_MODEL", "get_config", "local_folder"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    # llama3 frequency-dependent scaling (Llama-3.1/3.2): long wavelengths stretched by `factor`
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def shape_problems(v: dict, names: dict[str, str] | None = None) -> list[str]:
    """What in the field values `v` (ModelConfig's field names) the kernel cannot run, each naming the field as
    `names` calls it (config.json's keys when the values come from one)."""
    n = {f: (names or {}).get(f, f) for f in v}
    problems = []
    for f in ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab", "max_seq"):
        if isinstance(v[f], bool) or not isinstance(v[f], int) or v[f] <= 0:
            problems.append(f"{n[f]} must be a positive integer, got {v[f]!r}")
    if problems:
        return problems
    if v["n_heads"] % v["n_kv_heads"]:
        problems.append(f"{n['n_heads']} ({v['n_heads']}) must be a multiple of {n['n_kv_heads']} ({v['n_kv_heads']})")
    if v["head_dim"] % 16:
        problems.append(f"{n['head_dim']} ({v['head_dim']}) must be a multiple of 16 (8 bf16 per lane, rope pairs)")
    if v["head_dim"] > 256:
        problems.append(f"{n['head_dim']} ({v['head_dim']}) above 256 is not supported")
    for f in ("hidden", "intermediate"):
        if v[f] % 8:
            problems.append(f"{n[f]} ({v[f]}) must be a multiple of 8 (16-byte weight loads)")
    eps = v["rms_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        problems.append(f"{n['rms_eps']} must be positive, got {eps!r}")
    elif not f32_positive(eps):
        problems.append(f"{n['rms_eps']} must be a positive number that float32 holds (the kernel adds it in fp32), "
                        f"got {eps!r}")
    theta = v.get("rope_theta")
    if theta is not None and not (not isinstance(theta, bool) and isinstance(theta, (int, float)) and theta > 0
                                  and f32_positive(theta)):
        problems.append(f"{n.get('rope_theta', 'rope_theta')} must be a positive number that float32 holds (RoPE's "
                        f"frequencies are computed in fp32), got {theta!r}")
    return problems + index_problems(v, n)


def f32_positive(x: float) -> bool:
    """x rounds to a finite, non-zero float32: what a number the kernel computes with in fp32 must do."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0] > 0
    except OverflowError:
        return False


# -- what the kernel's 32-bit indices reach ---------------------------------------------------------------------
# Every offset into a weight matrix or the KV cache is computed in long long: a row index times its row length
# (matvec.cuh `W + (long long)u * NR * K`, down_residual.cuh `(long long)j * WB_D`, embedding.cuh
# `(long long)token * WB_D`, attention_decode.cuh `((long long)kvh * WB_MAX_SEQ + start) * HD`, qkv_rope_append.cuh
# `(long long)pos * WB_HEAD_DIM`, the generated header's `constexpr long long WB_PER_LAYER_*`). The indices
# themselves are int, and so is every flat index into a vector:
#   vocab          lm_head.cuh's unit (row) index v and logits[v], with 0x7fffffff as "no token" in its argmax;
#                  sampling.cuh's and publish.cuh's `for (int i ...; i < WB_VOCAB; i += wb_ntid())`; token ids
#   hidden         o_proj's unit index, x[i] (the loops `i < WB_D`), matvec.cuh's column index k (up to K + 8·WB_WARP)
#   intermediate   gate_up's unit index j and hmlp[j], down_residual.cuh's row j
#   qkv rows       qkv_rope_append.cuh's `constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM`, KV_DIM, PAIRS and
#                  `row = 2 * u`; also bounds attention's partial index `(kvh * ATT_GQ + g) * max_splits + split`,
#                  which stays below max(heads, 8 · 1,024)
#   max_seq        attention_decode.cuh's positions (`n = pos + 1`, a split's `start + chunk` ≤ n + splits),
#                  publish.cuh's `P->pos0 + step + 1 >= WB_MAX_SEQ`
# An index is compared with its bound after a strided step, so the bound plus the largest stride must fit too: the
# grid's warp count (matvec.cuh warp_units: stride = grid_nwarps(), at most abi.MAX_BLOCKS = 1,024 blocks of 32
# warps of 32 lanes); the other strides (threads of a block, 8·WB_WARP columns, a block's positions) are smaller.
INT32_MAX = 2 ** 31 - 1
MAX_GRID_WARPS = 1024 * (1024 // 32)
INDEX_MAX = INT32_MAX - MAX_GRID_WARPS
# abi.WHERE_FIELDS: the where-word that names a block's stage and layer (hang reports, the weight stream's page
# tags) keeps layer + 1 in 7 bits, the token stages being layer -1
MAX_LAYERS = 2 ** 7 - 2
# the debug build's per-block values tapped after the LM head (schedule.taps: blk_max and blk_arg, a float each for up
# to abi.MAX_BLOCKS blocks) and the sampled token
_TAP_PER_BLOCK = 2 * 1024 + 1


def tap_record_floats(v: dict) -> int:
    """Floats of one step's tap record (schedule.tap_step_floats at the largest grid): what the debug build copies out
    after every stage. Its offsets are `constexpr int` (header.py's WB_TAP_* and WB_TAP_STEP_FLOATS, instrument.cuh's
    wb_tap_dst `int offset`): the embedding's x, per layer q, k, v (the rows appended), o, x and h, hmlp, x, then the
    logits."""
    q, kv = v["n_heads"] * v["head_dim"], v["n_kv_heads"] * v["head_dim"]
    per_layer = 2 * q + 2 * kv + 3 * v["hidden"] + v["intermediate"]
    return v["hidden"] + v["n_layers"] * per_layer + v["vocab"] + _TAP_PER_BLOCK


def index_problems(v: dict, n: dict) -> list[str]:
    """The sizes in `v` that overflow the kernel's int indices (see INDEX_MAX), each naming its field(s) and the
    limit; `n` names the fields as the user wrote them."""
    problems = []
    why = {"vocab": "the LM head's row index and the sampler's token index are int",
           "hidden": "the residual stream's index and the weight rows' column index are int",
           "intermediate": "the MLP's row index is int",
           "max_seq": "attention's position index is int"}
    for f, reason in why.items():
        if v[f] > INDEX_MAX:
            problems.append(f"{n.get(f, f)} ({v[f]}) is past the kernel's 32-bit indices: at most {INDEX_MAX} "
                            f"({reason})")
    rows = (v["n_heads"] + 2 * v["n_kv_heads"]) * v["head_dim"]
    if rows > INDEX_MAX:
        problems.append(f"({n['n_heads']} + 2 × {n['n_kv_heads']}) × {n['head_dim']} = {rows} rows of Wqkv is past "
                        f"the kernel's 32-bit indices: at most {INDEX_MAX} (the QKV stage's row index is int)")
    if v["n_layers"] > MAX_LAYERS:
        problems.append(f"{n['n_layers']} ({v['n_layers']}) is past the {MAX_LAYERS} layers the kernel's where-word "
                        "holds (7 bits of layer + 1, which its hang reports and weight stream tags name)")
    if not problems and tap_record_floats(v) > INT32_MAX:
        problems.append(f"a step's tap record, {n['hidden']} + {n['n_layers']} × (3 × {n['hidden']} + 2 × "
                        f"({n['n_heads']} + {n['n_kv_heads']}) × {n['head_dim']} + {n['intermediate']}) + "
                        f"{n['vocab']} + {_TAP_PER_BLOCK} = {tap_record_floats(v)} floats, is past the kernel's "
                        f"32-bit indices: at most {INT32_MAX} (the debug build's tap offsets are int)")
    return problems


# config.json keys of the ModelConfig fields, for messages about a config read from one
HF_KEYS = {"hidden": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
           "vocab": "vocab_size", "rms_eps": "rms_norm_eps", "rope_theta": "rope_theta", "max_seq": "max_seq"}

_ABSENT = object()

_JSON_KIND = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
              float: "a number", type(None): "null"}


def _shown(v) -> str:
    """A value as config.json spells it (null, "abc", 1e-05), so the message matches what the user sees."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def file_kind(path: str | Path) -> str | None:
    """What `path` is when it is not a regular file ("a folder", "a FIFO", ...), None when it is one; a path that
    does not exist raises FileNotFoundError. stat opens nothing: opening a FIFO would wait for a writer forever."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


class DuplicateKey(Exception):
    """A JSON object that names a key twice (json keeps the last silently): config.json, an index, a header."""


def unique_keys(pairs):
    """json's object_pairs_hook that refuses a key named twice."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise DuplicateKey(k)
        d[k] = v
    return d


@dataclasses.dataclass
class _Keys:
    """Typed reads of one JSON object of a config.json; every refusal names the file and the key. `null_ok` keys
    treat null as absent (HF writes e.g. "head_dim": null and "rope_scaling": null for the default)."""
    d: dict
    where: str                  # the file, for messages
    prefix: str = ""            # "rope_scaling." inside a sub-object

    def raw(self, key, default=_ABSENT, null_ok=False):
        v = self.d.get(key, _ABSENT)
        if v is _ABSENT or (v is None and null_ok):
            if default is _ABSENT:
                raise ConfigError(f"{self.where} lacks {self.prefix + key!r}")
            return default
        return v

    def bad(self, key, what, v) -> ConfigError:
        return ConfigError(f"{self.where}: {self.prefix}{key} must be {what}, got {_shown(v)}")

    def integer(self, key, default=_ABSENT, null_ok=False, minimum=1):
        v = self.raw(key, default, null_ok)
        if v is default and default is not _ABSENT:
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.bad(key, "a positive integer" if minimum == 1 else "a non-negative integer", v)
        return v

    def number(self, key, default=_ABSENT, null_ok=False):
        v = self.raw(key, default, null_ok)
        if v is default and default is not _ABSENT:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise self.bad(key, "a positive number", v)
        if not f32_positive(v):             # RoPE's tables and the norms are computed in fp32
            raise self.bad(key, "a positive number that float32 holds (the kernel computes in fp32)", v)
        return float(v)

    def flag(self, key, default=_ABSENT, null_ok=False):
        v = self.raw(key, default, null_ok)
        if not isinstance(v, bool):
            raise self.bad(key, "true or false", v)
        return v

    def string(self, key, default=_ABSENT, null_ok=False):
        v = self.raw(key, default, null_ok)
        if not isinstance(v, str):
            raise self.bad(key, "a string", v)
        return v

    def sub(self, key) -> "_Keys | None":
        v = self.raw(key, None, null_ok=True)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.bad(key, "an object", v)
        return _Keys(v, self.where, f"{self.prefix}{key}.")

    def default(self, key, family: str | None, **derived):
        """The value transformers gives `key` when config.json leaves it out: its family's config class default
        (HF_DEFAULTS). `derived` resolves the defaults that are other fields (None in the table)."""
        by_family = HF_DEFAULTS[key]
        if family is not None:
            return derived.get(key, None) if by_family[family] is None else by_family[family]
        # no model_type: the config runs as a Llama, whose architecture Mistral's is too; a default those two
        # classes disagree on cannot be guessed
        values = {derived.get(key, None) if by_family[f] is None else by_family[f] for f in LLAMA_ARCHITECTURE}
        if len(values) == 1:
            return values.pop()
        shown = ", ".join(f"{f} {_shown(by_family[f]) if by_family[f] is not None else derived.get(key)}"
                          for f in FAMILIES)
        raise ConfigError(f"{self.where} lacks {self.prefix + key!r}, and without model_type naming the family its "
                          f"default cannot be told (transformers' defaults: {shown}); add {key} or model_type")


# The families whose architecture the kernel runs (config.json's model_type), and the transformers class of each,
# which tells a family when config.json names no model_type.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
LLAMA_ARCHITECTURE = ("llama", "mistral")       # a config without model_type runs as these
# What transformers (5.x) gives a key that config.json leaves out: the default of its family's config class
# (transformers.LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config: their dataclass fields). None stands for a
# default that is another field: num_key_value_heads = num_attention_heads, head_dim = hidden_size /
# num_attention_heads, no sliding window, no bos/eos token. The keys every family defaults alike are read with
# that value directly: rms_norm_eps 1e-6, rope_theta 10,000 (RotaryEmbeddingConfigMixin.default_theta),
# tie_word_embeddings false, hidden_act silu.
HF_DEFAULTS = {
    "max_position_embeddings": {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768},
    "num_key_value_heads": {"llama": None, "mistral": 8, "qwen2": 32, "qwen3": 32},
    "head_dim": {"llama": None, "mistral": None, "qwen2": None, "qwen3": 128},
    "bos_token_id": {"llama": 1, "mistral": 1, "qwen2": None, "qwen3": None},
    "eos_token_id": {"llama": 2, "mistral": 2, "qwen2": None, "qwen3": None},
    # MistralModel applies its window to every layer (use_sliding_window is no field of MistralConfig); Qwen2 and
    # Qwen3 only with use_sliding_window (default false), to the layers from max_window_layers (default 28) on;
    # LlamaModel has none
    "sliding_window": {"llama": None, "mistral": 4096, "qwen2": 4096, "qwen3": 4096},
}
HF_RMS_EPS = 1e-6
HF_ROPE_THETA = 10000.0
QWEN_MAX_WINDOW_LAYERS = 28


def _family(k: _Keys) -> str | None:
    """config.json's family: its model_type, else the one its architectures name, else None (unknown)."""
    if "model_type" in k.d:
        family = k.string("model_type")
        if family not in FAMILIES:
            raise ConfigError(f"{k.where}: model_type {family!r} is not a Llama-family decoder this kernel implements")
        return family
    archs = k.d.get("architectures")
    named = {ARCHITECTURES.get(a) for a in archs if isinstance(a, str)} if isinstance(archs, list) else set()
    return named.pop() if len(named) == 1 and None not in named else None


def _rope(k: _Keys, mpe: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and the llama3 scaling, read as transformers reads them: rope_scaling (4.x) or rope_parameters
    (5.x), whose own rope_theta wins over the top-level one."""
    theta = k.number("rope_theta", None, null_ok=True)
    rs = k.sub("rope_scaling") if k.d.get("rope_scaling") else k.sub("rope_parameters")
    factor_at = rs if rs is not None and rs.d.get("partial_rotary_factor") is not None else k
    prf = factor_at.raw("partial_rotary_factor", None, null_ok=True)
    if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or prf != 1.0):
        raise ConfigError(f"{k.where}: {factor_at.prefix}partial_rotary_factor {_shown(prf)} is not implemented: the "
                          "kernel's RoPE rotates the whole head (only 1.0 is)")
    if rs is None:
        return (theta if theta is not None else HF_ROPE_THETA), None
    nested = [key for key, v in rs.d.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"{k.where}: {rs.prefix[:-1]} holds RoPE parameters per layer type ({', '.join(nested)}): "
                          "not implemented (one RoPE for every layer is)")
    kind = rs.string("rope_type") if "rope_type" in rs.d else rs.string("type", "default")
    inner = rs.number("rope_theta", None, null_ok=True)
    theta = inner if inner is not None else theta if theta is not None else HF_ROPE_THETA
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{k.where}: {rs.prefix[:-1]} type {kind!r} is not implemented (llama3 and default are)")
    low, high = rs.number("low_freq_factor", 1.0), rs.number("high_freq_factor", 4.0)
    if not high > low:
        # the smoothing between the two divides by their difference
        raise ConfigError(f"{k.where}: {rs.prefix}high_freq_factor ({high}) must be larger than "
                          f"{rs.prefix}low_freq_factor ({low})")
    # transformers takes a top-level original_max_position_embeddings first (standardize_rope_params), else the
    # rope dict's, else max_position_embeddings
    original = (k.integer("original_max_position_embeddings") if "original_max_position_embeddings" in k.d
                else rs.integer("original_max_position_embeddings", mpe))
    return theta, RopeScaling(rs.number("factor"), low, high, original)


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding_window(k: _Keys, family: str | None, n_layers: int) -> int | None:
    """The window of positions transformers' model of this family attends to in some layer, None for none."""
    if family == "llama":
        return None                        # LlamaModel has no sliding window: the keys are ignored
    window = k.integer("sliding_window", None, null_ok=True) if "sliding_window" in k.d else \
        HF_DEFAULTS["sliding_window"]["mistral" if family is None else family]
    if family in ("mistral", None):
        return window
    used = k.flag("use_sliding_window", False, null_ok=True)
    types = k.raw("layer_types", None, null_ok=True)
    if types is not None and (not isinstance(types, list) or any(t not in _LAYER_TYPES for t in types)):
        raise k.bad("layer_types", f"a list of {' and '.join(_LAYER_TYPES)} (the others are not implemented)", types)
    if not used:
        if types and "sliding_attention" in types:
            raise ConfigError(f"{k.where}: layer_types names sliding_attention layers but use_sliding_window is false "
                              "(transformers cannot run this config either): set use_sliding_window or make every "
                              "layer full_attention")
        return None
    sliding = ("sliding_attention" in types if types is not None
               else k.integer("max_window_layers", QWEN_MAX_WINDOW_LAYERS, null_ok=True, minimum=0) < n_layers)
    return window if sliding else None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int                 # D
    n_layers: int
    n_heads: int                # query heads
    n_kv_heads: int             # GQA: each kv head serves n_heads // n_kv_heads query heads
    head_dim: int
    intermediate: int           # F, the MLP width
    vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True
    max_seq: int = 8192         # KV-cache length the kernel is built for
    qk_norm: bool = False       # Qwen3: per-head RMSNorm on q and k before RoPE, each with its gain
    qkv_bias: bool = False      # Qwen2: biases on the q, k and v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    # how far the model was trained to attend (config.json's max_position_embeddings); max_seq may not exceed it
    # when asked for. Not part of equality: it says nothing about the shapes the kernel is built for.
    max_positions: int | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        problems = shape_problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problems:
            raise ConfigError(f"model config {self.name!r}: " + "; ".join(problems))

    # derived sizes
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def layer_weight_bytes(self, bytes_per=2) -> int:
        """A layer's matrices at `bytes_per`, plus the vectors the kernel reads in fp32 (Qwen2's q/k/v biases, Qwen3's
        q/k norm gains)."""
        D, F = self.hidden, self.intermediate
        return bytes_per * (self.qkv_rows * D + D * self.q_dim + 2 * F * D + D * F) + self._fp32_params() * 4

    def _fp32_params(self) -> int:
        return (self.qkv_rows if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    def weight_bytes_per_token(self, bytes_per=2) -> int:
        """Weight bytes one decode step must stream: every layer plus the LM head (the embedding row is negligible)."""
        return self.n_layers * self.layer_weight_bytes(bytes_per) + bytes_per * self.vocab * self.hidden

    def kv_bytes_per_token(self, position: int, bytes_per=2) -> int:
        """KV-cache bytes attention reads at `position` (keys and values of positions 0..position)."""
        return 2 * bytes_per * self.n_layers * self.kv_dim * (position + 1)

    def n_params(self) -> int:
        embed = self.vocab * self.hidden
        matrices = self.n_layers * (self.layer_weight_bytes(1) - 4 * self._fp32_params()) + embed
        return matrices + (0 if self.tie_embeddings else embed) + \
            self.n_layers * (2 * self.hidden + self._fp32_params()) + self.hidden

    def with_(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def defines(self) -> dict[str, str]:
        """Compile-time shape constants for the kernel (the only way shapes reach C++)."""
        return {
            "WB_D": str(self.hidden),
            "WB_LAYERS": str(self.n_layers),
            "WB_HEADS": str(self.n_heads),
            "WB_KV_HEADS": str(self.n_kv_heads),
            "WB_HEAD_DIM": str(self.head_dim),
            "WB_FF": str(self.intermediate),
            "WB_VOCAB": str(self.vocab),
            "WB_MAX_SEQ": str(self.max_seq),
            "WB_RMS_EPS": f"{float(self.rms_eps)!r}f",
            "WB_QKV_BIAS": str(int(self.qkv_bias)),
            "WB_QK_NORM": str(int(self.qk_norm)),
        }

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "hf", max_seq: int | None = None,
                     source: str = "config.json") -> "ModelConfig":
        """The config of a HF config.json's contents `d`. Every key read is checked for type and range, and a refusal
        names `source` (the file) and the key: a config.json is often hand-edited, and a KeyError or a TypeError
        from deep inside tells its author nothing. A key left out means what it means to transformers: its family's
        class default (HF_DEFAULTS)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source} must hold a JSON object (a Hugging Face model config), "
                              f"not {_JSON_KIND.get(type(d), type(d).__name__)}")
        k = _Keys(d, source)
        family = _family(k)
        arch = family or "llama"
        if k.raw("quantization_config", None, null_ok=True) is not None:
            raise ConfigError(f"{source}: quantization_config: quantised checkpoints are not implemented (bf16, fp16 "
                              "or fp32 weights only)")
        hidden, n_layers, n_heads = k.integer("hidden_size"), k.integer("num_hidden_layers"), \
            k.integer("num_attention_heads")
        intermediate, vocab = k.integer("intermediate_size"), k.integer("vocab_size")
        act = k.string("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r}: only silu is implemented")
        # qwen2's q/k/v projections have biases by architecture, with no config key saying so; llama's
        # attention_bias puts one on o_proj as well, and mlp_bias on the MLP: those are not implemented
        if arch != "qwen2" and (k.flag("attention_bias", False, null_ok=True) or
                                k.flag("mlp_bias", False, null_ok=True)):
            raise ConfigError(f"{source}: attention/MLP biases are not implemented (the q/k/v biases of qwen2 are)")
        # a null head_dim is derived, as HF writes it for qwen2
        head_dim = k.integer("head_dim", None, null_ok=True) if "head_dim" in d else k.default("head_dim", family)
        if head_dim is None:
            if hidden % n_heads:
                raise ConfigError(f"{source}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                  f"({n_heads}) and there is no head_dim to say what a head is")
            head_dim = hidden // n_heads
        n_kv_heads = (k.integer("num_key_value_heads", n_heads, null_ok=True) if "num_key_value_heads" in d
                      else k.default("num_key_value_heads", family, num_key_value_heads=n_heads))
        mpe = k.integer("max_position_embeddings") if "max_position_embeddings" in d else \
            k.default("max_position_embeddings", family)
        theta, scaling = _rope(k, mpe)
        eos = k.raw("eos_token_id", None, null_ok=True) if "eos_token_id" in d else k.default("eos_token_id", family)
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_list):
            raise k.bad("eos_token_id", "a token id or a list of token ids", eos)
        bos = k.integer("bos_token_id", None, null_ok=True, minimum=0) if "bos_token_id" in d else \
            k.default("bos_token_id", family)
        if bos is not None and bos >= vocab:
            # generate starts from it when no prompt is given
            given = "" if "bos_token_id" in d else \
                f" (transformers' default for {family or 'a Llama'}: config.json gives none)"
            raise ConfigError(f"{source}: bos_token_id {bos}{given} is outside the vocabulary (vocab_size {vocab})")
        window = _sliding_window(k, family, n_layers)
        if max_seq is None:
            max_seq = min(mpe, 8192, window or mpe)
        elif isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq <= 0:
            raise ConfigError(f"max_seq must be a positive integer, got {max_seq!r}")
        elif max_seq > mpe:
            raise ConfigError(f"max_seq {max_seq} is larger than max_position_embeddings ({mpe}) of {source}")
        # the kernel attends to every position, which equals a window only while no position is past it
        if window and max_seq > window:
            if family is None:
                raise ConfigError(f"{source}: without model_type, whether a sliding window of {window} positions "
                                  f"applies cannot be told (Mistral applies sliding_window, 4096 when absent; Llama "
                                  f"has none): add model_type, or max_seq {max_seq} must be <= {window}")
            raise ConfigError(f"{source}: sliding_window {window} is not implemented: max_seq {max_seq} must be "
                              f"<= {window}")
        fields = dict(
            name=name, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            intermediate=intermediate, vocab=vocab, rms_eps=k.number("rms_norm_eps", HF_RMS_EPS), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=k.flag("tie_word_embeddings", False, null_ok=True), max_seq=max_seq,
            qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2", bos_token_id=bos, eos_token_ids=tuple(eos_list),
            max_positions=mpe)
        problems = shape_problems(fields, HF_KEYS)
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | Path, max_seq: int | None = None) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            kind = file_kind(path)
            if kind is not None:
                raise ConfigError(f"{path}: not a regular file ({kind}); config.json must be a file")
            d = json.loads(path.read_text(), object_pairs_hook=unique_keys)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} cannot be read: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except DuplicateKey as e:
            # json (and so transformers) keeps the last silently: which one the author meant cannot be told
            raise ConfigError(f"{path}: key {e.args[0]!r} appears twice in one object; keep one") from None
        return cls.from_hf_dict(d, name=path.parent.name, max_seq=max_seq, source=str(path))

    def to_hf_dict(self) -> dict:
        """The HF config fields for these shapes (used to build test checkpoints and the PyTorch baselines): a
        LlamaConfig's, or Qwen3's (qk_norm) or Qwen2's (qkv_bias)."""
        family = "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[family]
        d = dict(model_type=family, architectures=[arch], hidden_size=self.hidden,
                 num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
                 num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim,
                 intermediate_size=self.intermediate, vocab_size=self.vocab, rms_norm_eps=self.rms_eps,
                 rope_theta=self.rope_theta, tie_word_embeddings=self.tie_embeddings, hidden_act="silu",
                 max_position_embeddings=self.max_seq)
        d.update({"llama": dict(attention_bias=False, mlp_bias=False), "qwen2": dict(use_sliding_window=False),
                  "qwen3": dict(attention_bias=False, use_sliding_window=False)}[family])
        if self.rope_scaling:
            r = self.rope_scaling
            d["rope_scaling"] = dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                                     high_freq_factor=r.high_freq_factor,
                                     original_max_position_embeddings=r.original_max_position_embeddings)
        # written when unset too: left out, each would read back as its family's default (1 and 2 for a Llama)
        d["bos_token_id"] = self.bos_token_id
        d["eos_token_id"] = list(self.eos_token_ids) if self.eos_token_ids else None
        return d


_LLAMA3_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig("llama-3.2-1b", hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                                intermediate=8192, vocab=128256, rope_scaling=_LLAMA3_ROPE, tie_embeddings=True,
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), max_positions=131072),
    "llama-3.2-3b": ModelConfig("llama-3.2-3b", hidden=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
                                intermediate=8192, vocab=128256, rope_scaling=_LLAMA3_ROPE, tie_embeddings=True,
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), max_positions=131072),
    "llama-3.1-8b": ModelConfig("llama-3.1-8b", hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                                intermediate=14336, vocab=128256,
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_embeddings=False,
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), max_positions=131072),
    # small, awkward sizes so tails run: vocab and widths that divide neither 256 nor the warp count
    "tiny": ModelConfig("tiny", hidden=264, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32, intermediate=712,
                        vocab=1003, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64), rope_theta=10000.0,
                        tie_embeddings=True, max_seq=4352, bos_token_id=1, eos_token_ids=(2,),
                        max_positions=131072),       # as the Llama 3 models it imitates
}


def _qwen(name, hidden, n_layers, n_heads, n_kv_heads, head_dim, intermediate, tied, mpe, **kw):
    return ModelConfig(name, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, intermediate=intermediate, vocab=151936, rms_eps=1e-6, rope_theta=1e6,
                       tie_embeddings=tied, max_seq=min(mpe, 8192), max_positions=mpe, bos_token_id=151643, **kw)


# Llama's relatives that need nothing new, each a check of the shapes it brings (config.json values):
# * SmolLM2 (HuggingFaceTB), the Llama architecture at small sizes: 135M has 9 query heads on 3 kv heads (groups of
#   3) and a hidden size of 576, a multiple of neither 256 nor 128; 1.7B is multi-head (32 kv heads).
# * Llama 2: multi-head, no RoPE scaling, a 32,000-token vocabulary, an intermediate size (11,008) that is no
#   multiple of 256, and a 4,096-token context.
PRESETS.update({
    "smollm2-135m": ModelConfig("smollm2-135m", hidden=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                intermediate=1536, vocab=49152, rope_theta=100000.0, tie_embeddings=True,
                                max_seq=8192, bos_token_id=1, eos_token_ids=(2,), max_positions=8192),
    "smollm2-1.7b": ModelConfig("smollm2-1.7b", hidden=2048, n_layers=24, n_heads=32, n_kv_heads=32, head_dim=64,
                                intermediate=8192, vocab=49152, rope_theta=130000.0, tie_embeddings=True,
                                max_seq=8192, bos_token_id=1, eos_token_ids=(2,), max_positions=8192),
    "llama-2-7b": ModelConfig("llama-2-7b", hidden=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                              intermediate=11008, vocab=32000, rope_theta=10000.0, tie_embeddings=False,
                              max_seq=4096, bos_token_id=1, eos_token_ids=(2,), max_positions=4096),
})

# Qwen3 and Qwen2.5 at the shapes of their config.json files.
PRESETS.update({
    "qwen3-0.6b": _qwen("qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, True, 40960, qk_norm=True, eos_token_ids=(151645,)),
    "qwen3-1.7b": _qwen("qwen3-1.7b", 2048, 28, 16, 8, 128, 6144, True, 40960, qk_norm=True, eos_token_ids=(151645,)),
    "qwen3-4b": _qwen("qwen3-4b", 2560, 36, 32, 8, 128, 9728, True, 40960, qk_norm=True, eos_token_ids=(151645,)),
    "qwen3-8b": _qwen("qwen3-8b", 4096, 36, 32, 8, 128, 12288, False, 40960, qk_norm=True, eos_token_ids=(151645,)),
    "qwen2.5-0.5b": _qwen("qwen2.5-0.5b", 896, 24, 14, 2, 64, 4864, True, 32768, qkv_bias=True,
                          eos_token_ids=(151643,)),
    "qwen2.5-1.5b": _qwen("qwen2.5-1.5b", 1536, 28, 12, 2, 128, 8960, True, 131072, qkv_bias=True,
                          eos_token_ids=(151643,)),
})
DEFAULT_MODEL = "llama-3.2-1b"


def local_folder(name_or_path: str | Path) -> Path | None:
    """The HF folder a --model names: None for a preset; a file inside a folder (its config.json, its
    model.safetensors) means that folder, which is where the config and the weights are looked for."""
    if str(name_or_path) in PRESETS:
        return None
    p = Path(name_or_path)
    if p.is_file():
        return p.parent
    if p.is_dir():
        return p
    raise ConfigError(f"{str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with config.json")


def get_config(name_or_path: str | Path, max_seq: int | None = None) -> ModelConfig:
    """A preset by name, or the config.json of a local HF folder (or of the folder of a file given instead)."""
    folder = local_folder(name_or_path)
    if folder is not None:
        return ModelConfig.from_json(folder, max_seq=max_seq)
    cfg = PRESETS[str(name_or_path)]
    if max_seq is None:
        return cfg
    if not isinstance(max_seq, bool) and isinstance(max_seq, int) and max_seq > cfg.max_positions:
        raise ConfigError(f"max_seq {max_seq} is larger than max_position_embeddings ({cfg.max_positions}) of "
                          f"preset {cfg.name}")
    return cfg.with_(max_seq=max_seq)             # a max_seq that is not a positive integer is refused there

"""Model shapes: the one source of truth.

A `ModelConfig` is read from a Hugging Face `config.json` or taken from a named preset. Everything the kernel needs
to know about shapes reaches it through `defines()`, which becomes `#define` lines at the top of the assembled source.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..errors import ConfigError

__all__ = ["ConfigError", "RopeScaling", "ModelConfig", "PRESETS", "DEFAULT_MODEL", "get_config",
           "local_folder"]


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
    return problems


# config.json keys of the ModelConfig fields, for messages about a config read from one
HF_KEYS = {"hidden": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
           "vocab": "vocab_size", "rms_eps": "rms_norm_eps"}

_ABSENT = object()
_JSON_KIND = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
              float: "a number", type(None): "null"}


def _shown(v) -> str:
    """A value as config.json spells it (null, "abc", 1e-05), so the message matches what the user sees."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


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
        from deep inside tells its author nothing."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source} must hold a JSON object (a Hugging Face model config), "
                              f"not {_JSON_KIND.get(type(d), type(d).__name__)}")
        k = _Keys(d, source)
        arch = k.string("model_type", "llama")
        if arch not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ConfigError(f"{source}: model_type {arch!r} is not a Llama-family decoder this kernel implements")
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
        head_dim = k.integer("head_dim", None, null_ok=True)
        if head_dim is None:
            if hidden % n_heads:
                raise ConfigError(f"{source}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                                  f"({n_heads}) and there is no head_dim to say what a head is")
            head_dim = hidden // n_heads
        n_kv_heads = k.integer("num_key_value_heads", n_heads, null_ok=True)
        theta = k.number("rope_theta", None, null_ok=True)
        # transformers 5 writes rope_parameters (rope_theta inside) where 4.x wrote rope_scaling + rope_theta
        rs = k.sub("rope_scaling") if d.get("rope_scaling") else k.sub("rope_parameters")
        scaling = None
        if rs is not None:
            kind = rs.string("rope_type") if "rope_type" in rs.d else rs.string("type", "default")
            if theta is None:
                theta = rs.number("rope_theta", None, null_ok=True)
            if kind == "llama3":
                low, high = rs.number("low_freq_factor", 1.0), rs.number("high_freq_factor", 4.0)
                if not high > low:
                    # the smoothing between the two divides by their difference
                    raise ConfigError(f"{source}: {rs.prefix}high_freq_factor ({high}) must be larger than "
                                      f"{rs.prefix}low_freq_factor ({low})")
                scaling = RopeScaling(rs.number("factor"), low, high,
                                      rs.integer("original_max_position_embeddings", 8192))
            elif kind != "default":
                raise ConfigError(f"{source}: {rs.prefix[:-1]} type {kind!r} is not implemented (llama3 and default "
                                  "are)")
        eos = k.raw("eos_token_id", None, null_ok=True)
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_list):
            raise k.bad("eos_token_id", "a token id or a list of token ids", eos)
        bos = k.integer("bos_token_id", None, null_ok=True, minimum=0)
        if bos is not None and bos >= vocab:
            # generate starts from it when no prompt is given
            raise ConfigError(f"{source}: bos_token_id {bos} is outside the vocabulary (vocab_size {vocab})")
        mpe = k.integer("max_position_embeddings", 8192)
        # a sliding window (Mistral 7B v0.1) equals full attention only while every position is inside it
        used = k.flag("use_sliding_window", True, null_ok=True)
        window = k.integer("sliding_window", None, null_ok=True) if used else None
        if max_seq is None:
            max_seq = min(mpe, 8192, window or mpe)
        elif isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq <= 0:
            raise ConfigError(f"max_seq must be a positive integer, got {max_seq!r}")
        elif max_seq > mpe:
            raise ConfigError(f"max_seq {max_seq} is larger than max_position_embeddings ({mpe}) of {source}")
        if window and max_seq > window:
            raise ConfigError(f"{source}: sliding_window {window} is not implemented: max_seq {max_seq} must be "
                              f"<= {window}")
        fields = dict(
            name=name, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            intermediate=intermediate, vocab=vocab, rms_eps=k.number("rms_norm_eps", 1e-5),
            rope_theta=theta if theta is not None else 10000.0, rope_scaling=scaling,
            tie_embeddings=k.flag("tie_word_embeddings", False, null_ok=True),
            max_seq=max_seq, qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2", bos_token_id=bos,
            eos_token_ids=tuple(eos_list),
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
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} cannot be read: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
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
        if family == "llama":
            d.update(attention_bias=False, mlp_bias=False)
        elif family == "qwen3":
            d.update(attention_bias=False, use_sliding_window=False)
        else:
            d.update(use_sliding_window=False)
        if self.rope_scaling:
            r = self.rope_scaling
            d["rope_scaling"] = dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                                     high_freq_factor=r.high_freq_factor,
                                     original_max_position_embeddings=r.original_max_position_embeddings)
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids)
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
    raise ConfigError(f"{str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with "
                      f"config.json")


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

"""Model shapes: the one source of truth.

A `ModelConfig` is read from a Hugging Face `config.json` or taken from a named preset. Everything the kernel needs
to know about shapes reaches it through `defines()`, which becomes `#define` lines at the top of the assembled source.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path


class ConfigError(ValueError):
    """A config that the monokernel cannot run, with the reason."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    # llama3 frequency-dependent scaling (Llama-3.1/3.2): long wavelengths stretched by `factor`
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    qk_norm: bool = False       # Qwen-style per-head RMSNorm on q and k (not yet in the kernel)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        problems = []
        for f in ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab", "max_seq"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                problems.append(f"{f} must be a positive integer, got {getattr(self, f)!r}")
        if not problems:
            if self.n_heads % self.n_kv_heads:
                problems.append(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
            if self.head_dim % 16:
                problems.append(f"head_dim ({self.head_dim}) must be a multiple of 16 (8 bf16 per lane, rope pairs)")
            if self.head_dim > 256:
                problems.append(f"head_dim ({self.head_dim}) above 256 is not supported")
            for f in ("hidden", "intermediate"):
                if getattr(self, f) % 8:
                    problems.append(f"{f} ({getattr(self, f)}) must be a multiple of 8 (16-byte weight loads)")
            if (self.n_heads * self.head_dim) % 8:
                problems.append("n_heads * head_dim must be a multiple of 8")
            if self.qk_norm:
                problems.append("qk_norm (Qwen-style) is read from the config but the kernel has no section for it yet")
            if not self.rms_eps > 0:
                problems.append(f"rms_eps must be positive, got {self.rms_eps}")
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
        D, F = self.hidden, self.intermediate
        return bytes_per * (self.qkv_rows * D + D * self.q_dim + 2 * F * D + D * F)

    def weight_bytes_per_token(self, bytes_per=2) -> int:
        """Weight bytes one decode step must stream: every layer plus the LM head (the embedding row is negligible)."""
        return self.n_layers * self.layer_weight_bytes(bytes_per) + bytes_per * self.vocab * self.hidden

    def kv_bytes_per_token(self, position: int, bytes_per=2) -> int:
        """KV-cache bytes attention reads at `position` (keys and values of positions 0..position)."""
        return 2 * bytes_per * self.n_layers * self.kv_dim * (position + 1)

    def n_params(self) -> int:
        embed = self.vocab * self.hidden
        return self.weight_bytes_per_token(1) + (0 if self.tie_embeddings else embed) + \
            self.n_layers * 2 * self.hidden + self.hidden

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
        }

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "hf", max_seq: int | None = None) -> "ModelConfig":
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ConfigError(f"model_type {arch!r} is not a Llama-family decoder this kernel implements")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in d:
                raise ConfigError(f"config.json lacks {key!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d.get('hidden_act')!r}: only silu is implemented")
        if d.get("attention_bias") or d.get("mlp_bias") or arch == "qwen2":
            # qwen2's q/k/v projections have biases by architecture, with no config key saying so
            why = " (qwen2 has q/k/v biases)" if arch == "qwen2" else ""
            raise ConfigError(f"attention/MLP biases are not implemented{why}")
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        rs = d.get("rope_scaling") or (d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else None)
        theta = d.get("rope_theta")
        scaling = None
        if rs:
            kind = rs.get("rope_type", rs.get("type", "default"))
            theta = theta if theta is not None else rs.get("rope_theta")
            if kind == "llama3":
                scaling = RopeScaling(float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                                      float(rs.get("high_freq_factor", 4.0)),
                                      int(rs.get("original_max_position_embeddings", 8192)))
            elif kind != "default":
                raise ConfigError(f"rope_scaling type {kind!r} is not implemented (llama3 and default are)")
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        mpe = int(d.get("max_position_embeddings", 8192))
        # a sliding window (Mistral 7B v0.1) equals full attention only while every position is inside it
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        max_seq = max_seq or min(mpe, 8192, window or mpe)
        if window and max_seq > window:
            raise ConfigError(f"sliding_window {window} is not implemented: max_seq {max_seq} must be <= {window}")
        return cls(
            name=name, hidden=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
            intermediate=d["intermediate_size"], vocab=d["vocab_size"], rms_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=scaling,
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_seq=max_seq, qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos)

    @classmethod
    def from_json(cls, path: str | Path, max_seq: int | None = None) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d, name=path.parent.name, max_seq=max_seq)

    def to_hf_dict(self) -> dict:
        """The HF LlamaConfig fields for these shapes (used to build test checkpoints and the PyTorch baselines)."""
        d = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=self.hidden,
                 num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
                 num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim,
                 intermediate_size=self.intermediate, vocab_size=self.vocab, rms_norm_eps=self.rms_eps,
                 rope_theta=self.rope_theta, tie_word_embeddings=self.tie_embeddings, hidden_act="silu",
                 max_position_embeddings=self.max_seq, attention_bias=False, mlp_bias=False)
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
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "llama-3.2-3b": ModelConfig("llama-3.2-3b", hidden=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
                                intermediate=8192, vocab=128256, rope_scaling=_LLAMA3_ROPE, tie_embeddings=True,
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-8b": ModelConfig("llama-3.1-8b", hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                                intermediate=14336, vocab=128256,
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_embeddings=False,
                                bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # small, awkward sizes so tails run: vocab and widths that divide neither 256 nor the warp count
    "tiny": ModelConfig("tiny", hidden=264, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32, intermediate=712,
                        vocab=1003, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64), rope_theta=10000.0,
                        tie_embeddings=True, max_seq=4352, bos_token_id=1, eos_token_ids=(2,)),
}
DEFAULT_MODEL = "llama-3.2-1b"


def get_config(name_or_path: str, max_seq: int | None = None) -> ModelConfig:
    """A preset by name, or the config.json of a local HF folder."""
    if name_or_path in PRESETS:
        cfg = PRESETS[name_or_path]
        return cfg.with_(max_seq=max_seq) if max_seq else cfg
    p = Path(name_or_path)
    if p.exists():
        return ModelConfig.from_json(p, max_seq=max_seq)
    raise ConfigError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with config.json")

"""Weights: loading (HF safetensors folders or random at a config's shapes) and the one-time preparation into the
layout the monokernel streams.

Arrays live on the host (numpy) or the device (cupy); every function here takes the array module `xp` so that large
models are generated and prepared where they will run. bf16 tensors are kept as uint16 bit patterns.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from .config import ModelConfig, get_config
from .safetensors_io import SafetensorsFile, WeightsError, bf16_to_f32

# -- bf16 bit helpers that work for numpy and cupy alike ---------------------------------------------------------


def to_f32(a, xp=np):
    """bf16 bits (uint16) or any float array → float32."""
    if a.dtype == xp.uint16:
        return (a.astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32)


def to_bf16(a, xp=np):
    """float → bf16 bits, round to nearest even."""
    if a.dtype == xp.uint16:
        return a
    u = xp.ascontiguousarray(a.astype(xp.float32)).view(xp.uint32)
    out = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(a), xp.uint16(0x7FC0), out)


def round_bf16(a, xp=np):
    """The float32 value a bf16 store would keep."""
    return to_f32(to_bf16(a, xp), xp)


# -- HF-layout weights -----------------------------------------------------------------------------------------


def layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return dict(attn_norm=p + "input_layernorm.weight", wq=p + "self_attn.q_proj.weight",
                wk=p + "self_attn.k_proj.weight", wv=p + "self_attn.v_proj.weight", wo=p + "self_attn.o_proj.weight",
                mlp_norm=p + "post_attention_layernorm.weight", wg=p + "mlp.gate_proj.weight",
                wu=p + "mlp.up_proj.weight", wd=p + "mlp.down_proj.weight")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F, V = cfg.hidden, cfg.intermediate, cfg.vocab
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        n = layer_names(i)
        shapes.update({n["attn_norm"]: (D,), n["wq"]: (cfg.q_dim, D), n["wk"]: (cfg.kv_dim, D),
                       n["wv"]: (cfg.kv_dim, D), n["wo"]: (D, cfg.q_dim), n["mlp_norm"]: (D,),
                       n["wg"]: (F, D), n["wu"]: (F, D), n["wd"]: (D, F)})
    return shapes


@dataclasses.dataclass
class Weights:
    """Tensors by their HF names (bf16 bits or float32), in the module `xp` they live in."""
    cfg: ModelConfig
    tensors: dict
    xp: object = np
    source: str = ""

    def f32(self, name: str):
        return to_f32(self.tensors[name], self.xp)

    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"


def check_shapes(cfg: ModelConfig, tensors: dict, source: str):
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{source}: missing tensors {', '.join(missing[:3])}{more}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise WeightsError(f"{source}: tensor {k} has shape {tuple(tensors[k].shape)}, config says {shape}")


def load_hf(folder: str | Path, cfg: ModelConfig | None = None, progress: bool = True) -> Weights:
    """Weights from a local HF folder: model.safetensors or a sharded model.safetensors.index.json."""
    folder = Path(folder)
    cfg = cfg or get_config(str(folder))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise WeightsError(f"{folder}: neither model.safetensors nor model.safetensors.index.json is there")
    tensors = {}
    want = expected_shapes(cfg)
    for fname in _progress(files, "loading shards", progress and len(files) > 1):
        path = folder / fname
        if not path.exists():
            raise WeightsError(f"{folder}: shard {fname} named by the index is missing")
        st = SafetensorsFile(path)
        for k in st.keys():
            if k in want or k == "lm_head.weight":
                t = st.get(k)
                tensors[k] = t if st.dtype(k) == "BF16" else t.astype(np.float32)
    check_shapes(cfg, tensors, str(folder))
    return Weights(cfg, tensors, np, source=str(folder))


def random_weights(cfg: ModelConfig, seed: int = 0, xp=np, progress: bool = True) -> Weights:
    """Random weights at the config's shapes, bf16. Projections have std 1/sqrt(fan_in) so every layer moves the
    residual stream; norm gains scatter around 1 so that folding them is exercised; embeddings have std 0.1 so the
    logits are neither flat nor one-hot. The values depend on (seed, xp): numpy and cupy generators differ."""
    rs = xp.random.default_rng(seed)
    tensors = {}
    shapes = expected_shapes(cfg)
    for name, shape in _progress(list(shapes.items()), "random weights", progress and cfg.n_layers > 4):
        if len(shape) == 1:
            t = 1.0 + 0.2 * rs.standard_normal(shape, dtype=xp.float32)
        else:
            std = 0.1 if ("embed" in name or "lm_head" in name) else 1.0 / np.sqrt(shape[1])
            t = rs.standard_normal(shape, dtype=xp.float32) * xp.float32(std)
        tensors[name] = to_bf16(t, xp)
    return Weights(cfg, tensors, xp, source=f"random(seed={seed})")


# -- preparation for the kernel ---------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies as HF computes them in fp32, llama3 scaling included, op for op.

    An ulp of a large inv_freq becomes ~1e-4 rad of angle by position 4096, so the rounding steps are reproduced:
    torch evaluates `scalar / tensor` as `tensor.reciprocal() * scalar` (two roundings), and its fp32 power is
    approximated here by the correctly rounded one (fp64, rounded once); numpy's float32 pow is an ulp off far more
    often. This is bit-exact for every preset; torch's vectorised powf is only faithful (≤ 1 ulp) in general, so
    other (rope_theta, head_dim) pairs can differ by an ulp at an index or two."""
    f32, hd = np.float32, cfg.head_dim
    expo = np.arange(0, hd, 2).astype(f32) / f32(hd)
    inv = f32(1) / (np.float64(f32(cfg.rope_theta)) ** expo.astype(np.float64)).astype(f32)
    r = cfg.rope_scaling
    if r is None:
        return inv
    low_wl = r.original_max_position_embeddings / r.low_freq_factor
    high_wl = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = (f32(1) / inv) * f32(2 * np.pi)
    scaled = np.where(wavelen > f32(low_wl), inv / f32(r.factor), inv)
    smooth = ((f32(1) / wavelen) * f32(r.original_max_position_embeddings) - f32(r.low_freq_factor)) \
        / f32(r.high_freq_factor - r.low_freq_factor)
    smoothed = (f32(1) - smooth) * scaled / f32(r.factor) + smooth * scaled
    medium = ~(wavelen < f32(high_wl)) & ~(wavelen > f32(low_wl))
    return np.where(medium, smoothed, scaled).astype(f32)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq, head_dim/2], fp32, angle = fp32(pos * inv_freq) as in HF."""
    pos = np.arange(cfg.max_seq, dtype=np.float32)[:, None]
    ang = (pos * rope_inv_freq(cfg)[None, :]).astype(np.float32)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_pair_order(cfg: ModelConfig, n_heads: int) -> np.ndarray:
    """Row order that puts each rotate-half pair (i, i + hd/2) of every head side by side: a warp then owns a
    whole pair and applies RoPE without talking to other warps."""
    hd = cfg.head_dim
    half = np.arange(hd // 2)
    per_head = np.stack([half, half + hd // 2], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * hd + per_head[None, :]).reshape(-1)


@dataclasses.dataclass
class Prepared:
    """Kernel-layout weights (bf16 bits) and tables, all in `xp`.
    wqkv [L, q_dim+2·kv_dim, D]: q heads, k heads, v heads, rows in rope pairs, attn-norm gain folded in.
    wo [L, D, q_dim]. wgu [L, 2F, D]: gate row j then up row j, mlp-norm gain folded in. wd [L, D, F].
    lm_head [V, D]: final-norm gain folded in (a copy even when embeddings are tied). embed [V, D].
    rope_cos/rope_sin [max_seq, hd/2] fp32."""
    cfg: ModelConfig
    embed: object
    wqkv: object
    wo: object
    wgu: object
    wd: object
    lm_head: object
    rope_cos: object
    rope_sin: object
    xp: object = np
    source: str = ""

    def arrays(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("cfg", "xp", "source")}

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())


def qkv_row_order(cfg: ModelConfig) -> np.ndarray:
    """Rows of cat(wq, wk, wv) in the kernel's order."""
    q = rope_pair_order(cfg, cfg.n_heads)
    k = cfg.q_dim + rope_pair_order(cfg, cfg.n_kv_heads)
    v = cfg.q_dim + cfg.kv_dim + np.arange(cfg.kv_dim)
    return np.concatenate([q, k, v])


def prepare(w: Weights, xp=None, progress: bool = True) -> Prepared:
    """Repack and fold, once at load. Gains are folded in fp32 and the product rounded to bf16 once:
    W·(g⊙x̂) = (W·diag g)·x̂ is exact in real arithmetic; the rounding of the product is the only change."""
    cfg, src = w.cfg, w.xp
    xp = xp or src
    L, D, F = cfg.n_layers, cfg.hidden, cfg.intermediate

    def dev(name):
        return xp.asarray(to_f32(w.tensors[name], src)) if xp is not src else w.f32(name)

    order = xp.asarray(qkv_row_order(cfg))
    wqkv = xp.empty((L, cfg.qkv_rows, D), dtype=xp.uint16)
    wo = xp.empty((L, D, cfg.q_dim), dtype=xp.uint16)
    wgu = xp.empty((L, 2 * F, D), dtype=xp.uint16)
    wd = xp.empty((L, D, F), dtype=xp.uint16)
    for i in _progress(range(L), "preparing layers", progress and L > 4):
        n = layer_names(i)
        g = dev(n["attn_norm"])
        qkv = xp.concatenate([dev(n["wq"]), dev(n["wk"]), dev(n["wv"])])[order]
        wqkv[i] = to_bf16(qkv * g[None, :], xp)
        wo[i] = to_bf16(dev(n["wo"]), xp)
        g = dev(n["mlp_norm"])
        gu = xp.stack([dev(n["wg"]), dev(n["wu"])], axis=1).reshape(2 * F, D)
        wgu[i] = to_bf16(gu * g[None, :], xp)
        wd[i] = to_bf16(dev(n["wd"]), xp)
    embed = to_bf16(dev("model.embed_tokens.weight"), xp)
    lm_head = to_bf16(dev(w.lm_head_name()) * dev("model.norm.weight")[None, :], xp)
    cos, sin = rope_tables(cfg)
    return Prepared(cfg, embed, wqkv, wo, wgu, wd, lm_head, xp.asarray(cos), xp.asarray(sin), xp, w.source)


def unprepare(p: Prepared, xp=np) -> Weights:
    """HF-layout float32 weights that compute exactly what the kernel computes: the prepared bf16 values, rope pairs
    put back, unit gains (they are folded). The reference runs on these to check the kernel."""
    cfg = p.cfg

    def host(a):
        return xp.asarray(to_f32(a, p.xp)) if xp is not p.xp else to_f32(a, xp)

    inv = np.argsort(qkv_row_order(cfg))
    ones = xp.ones(cfg.hidden, dtype=xp.float32)
    t = {"model.embed_tokens.weight": host(p.embed), "model.norm.weight": ones, "lm_head.weight": host(p.lm_head)}
    F = cfg.intermediate
    for i in range(cfg.n_layers):
        n = layer_names(i)
        qkv = host(p.wqkv[i])[xp.asarray(inv)]
        gu = host(p.wgu[i]).reshape(F, 2, cfg.hidden)
        t.update({n["attn_norm"]: ones, n["mlp_norm"]: ones,
                  n["wq"]: qkv[:cfg.q_dim], n["wk"]: qkv[cfg.q_dim:cfg.q_dim + cfg.kv_dim],
                  n["wv"]: qkv[cfg.q_dim + cfg.kv_dim:], n["wo"]: host(p.wo[i]),
                  n["wg"]: gu[:, 0], n["wu"]: gu[:, 1], n["wd"]: host(p.wd[i])})
    return Weights(cfg.with_(tie_embeddings=False), t, xp, source=p.source + " (prepared)")


def load(model: str, weights: str | None = None, seed: int = 0, xp=np, max_seq: int | None = None,
         progress: bool = True) -> Weights:
    """A model by preset name or HF folder; weights from `weights` (a folder), the folder itself, or random."""
    cfg = get_config(model, max_seq=max_seq)
    folder = weights or (model if Path(model).is_dir() else None)
    if folder is not None:
        return load_hf(folder, cfg, progress=progress)
    return random_weights(cfg, seed, xp=xp, progress=progress)


def _progress(it, desc, enabled):
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, leave=False)


__all__ = ["Weights", "Prepared", "load", "load_hf", "random_weights", "prepare", "unprepare", "rope_tables",
           "rope_inv_freq", "to_f32", "to_bf16", "round_bf16", "WeightsError", "bf16_to_f32"]

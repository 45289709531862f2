"""Weights: loading (HF safetensors folders or random at a config's shapes) and the one-time preparation into the
layout the monokernel streams.

Arrays live on the host (numpy) or the device (cupy); every function here takes the array module `xp` so that large
models are generated and prepared where they will run. bf16 tensors are kept as uint16 bit patterns.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np

from .config import ConfigError, DuplicateKey, ModelConfig, file_kind, get_config, local_folder, unique_keys
from .safetensors_io import SafetensorsFile, WeightsError, bf16_to_f32

# -- bf16 bit helpers that work for numpy and cupy alike ---------------------------------------------------------

def to_f32(a, xp=np):
    """bf16 bits (uint16) or any float array → float32."""
    return (a.astype(xp.uint32) << 16).view(xp.float32) if a.dtype == xp.uint16 else a.astype(xp.float32)


def to_bf16(a, xp=np):
    """float → bf16 bits, round to nearest even."""
    if a.dtype == xp.uint16:
        return a
    u = xp.ascontiguousarray(a.astype(xp.float32)).view(xp.uint32)
    out = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(a), xp.uint16(0x7FC0), out)


BF16_MAX = float(np.uint32(0x7F7F0000).view(np.float32))       # bf16's largest finite value


def round_bf16(a, xp=np):
    """The float32 value a bf16 store would keep."""
    return to_f32(to_bf16(a, xp), xp)


# -- HF-layout weights -----------------------------------------------------------------------------------------

def layer_names(i: int, cfg: ModelConfig | None = None) -> dict[str, str]:
    """Layer i's tensors by their short names: a Llama layer's, and with `cfg` also those its family adds
    (Qwen3's per-head norm gains, Qwen2's biases)."""
    p = f"model.layers.{i}."
    out = dict(attn_norm=p + "input_layernorm.weight", wq=p + "self_attn.q_proj.weight",
               wk=p + "self_attn.k_proj.weight", wv=p + "self_attn.v_proj.weight", wo=p + "self_attn.o_proj.weight",
               mlp_norm=p + "post_attention_layernorm.weight", wg=p + "mlp.gate_proj.weight",
               wu=p + "mlp.up_proj.weight", wd=p + "mlp.down_proj.weight")
    if cfg is not None and cfg.qk_norm:
        out.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
    if cfg is not None and cfg.qkv_bias:
        out.update(bq=p + "self_attn.q_proj.bias", bk=p + "self_attn.k_proj.bias", bv=p + "self_attn.v_proj.bias")
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F, V = cfg.hidden, cfg.intermediate, cfg.vocab
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        n = layer_names(i, cfg)
        shapes.update({n["attn_norm"]: (D,), n["wq"]: (cfg.q_dim, D), n["wk"]: (cfg.kv_dim, D),
                       n["wv"]: (cfg.kv_dim, D), n["wo"]: (D, cfg.q_dim), n["mlp_norm"]: (D,),
                       n["wg"]: (F, D), n["wu"]: (F, D), n["wd"]: (D, F)})
        if cfg.qk_norm:
            shapes.update({n["q_norm"]: (cfg.head_dim,), n["k_norm"]: (cfg.head_dim,)})
        if cfg.qkv_bias:
            shapes.update({n["bq"]: (cfg.q_dim,), n["bk"]: (cfg.kv_dim,), n["bv"]: (cfg.kv_dim,)})
    return shapes


@dataclasses.dataclass
class Weights:
    """Tensors by their HF names (bf16 bits or float32), in the module `xp` they live in."""
    cfg: ModelConfig
    tensors: dict
    xp: object = np
    source: str = ""
    files: dict = dataclasses.field(default_factory=dict)     # tensor → the file it was read from, for messages

    def f32(self, name: str):
        return to_f32(self.tensors[name], self.xp)

    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"


def check_shapes(cfg: ModelConfig, tensors: dict, source: str, where: dict[str, str] | None = None):
    """Every tensor the config needs is there at its shape. `tensors` maps names to arrays or to shapes (a header's,
    before any data is read); `where` names the file each came from, for the message."""
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        hint = (" (the config does not tie the LM head to the embedding: tie_word_embeddings is false)"
                if missing == ["lm_head.weight"] else "")
        raise WeightsError(f"{source}: missing tensors {', '.join(missing[:3])}{more}{hint}")
    for k, shape in want.items():
        got = tuple(tensors[k]) if isinstance(tensors[k], (tuple, list)) else tuple(tensors[k].shape)
        if got != shape:
            raise WeightsError(f"{(where or {}).get(k, source)}: tensor {k} has shape {got}, config says {shape}")


# Tensors a checkpoint may hold that the kernel has no use for and loses nothing by ignoring: the RoPE inverse
# frequencies older transformers saved as buffers (they are computed from the config here). The other one,
# lm_head.weight next to tied embeddings, is accepted only when it equals the embedding (see load_hf).
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# why a tensor the kernel does not read cannot just be dropped: what it would have changed, by its name
_UNSUPPORTED = [
    (re.compile(r"\.bias$"), "biases are not implemented for this model_type (qwen2's q/k/v biases are)"),
    (re.compile(r"\.(q_norm|k_norm)\."), "per-head q/k norms are Qwen3's (model_type qwen3), not this config's"),
    (re.compile(r"(_scale|_scales|\.scales|\.qweight|\.qzeros|\.g_idx|_zero_point|\.absmax|\.quant_map|\.SCB)$"),
     "quantised weights are not implemented (bf16, fp16 or fp32 weights only)"),
    (re.compile(r"\.(qkv_proj|gate_up_proj|W_pack)\."),
     "fused projections are not implemented (the kernel reads q_proj, k_proj, v_proj, gate_proj and up_proj)"),
]
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")


def _why_unused(name: str, cfg: ModelConfig) -> str:
    for pattern, why in _UNSUPPORTED:
        if pattern.search(name):
            return why
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m and int(m[1]) >= cfg.n_layers:
        return f"the config has {cfg.n_layers} layers (num_hidden_layers)"
    if name == "lm_head.weight":
        return "the config ties the LM head to the embedding (tie_word_embeddings) and this one differs from it"
    return "it is not part of a Llama model with this config"


def _kind(path: Path) -> str | None:
    """What `path` is: None for a regular file (a link to one included), "missing", or what else it is."""
    try:
        return file_kind(path)
    except (FileNotFoundError, NotADirectoryError):
        return "a symbolic link to nothing" if os.path.islink(path) else "missing"
    except OSError:
        return None                     # stat refused (permissions): opening it says why, naming the file


def _shard_files(folder: Path) -> tuple[list[str], dict[str, str], Path | None]:
    """The safetensors files of a checkpoint folder, the index's tensor → file map (empty for one file) and the
    index (None for one file). Nothing is opened that is not a regular file: a FIFO would block the read."""
    index = folder / "model.safetensors.index.json"
    kind = _kind(index)
    if kind == "missing":
        single = folder / "model.safetensors"
        kind = _kind(single)
        if kind == "missing":
            raise WeightsError(f"{folder}: neither model.safetensors nor model.safetensors.index.json is there")
        if kind is not None:
            raise WeightsError(f"{single}: not a regular file ({kind}); the weights must be a safetensors file")
        return ["model.safetensors"], {}, None
    if kind is not None:
        raise WeightsError(f"{index}: not a regular file ({kind}); a safetensors index is a JSON file")
    try:
        content = json.loads(index.read_text(), object_pairs_hook=unique_keys)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{index}: not a readable safetensors index ({e})") from None
    except DuplicateKey as e:
        raise WeightsError(f"{index}: key {e.args[0]!r} appears twice in one object (a tensor named twice?)") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise WeightsError(f"{index}: weight_map must be an object of tensor names to file names")
    for tensor, fname in weight_map.items():
        if why := _outside(folder, fname):
            raise WeightsError(f"{index}: weight_map entry {tensor} → {fname!r} is outside the checkpoint folder "
                               f"{folder} ({why}); a shard must be a file in it")
    return sorted(set(weight_map.values())), weight_map, index


def _outside(folder: Path, fname: str) -> str | None:
    """Why the shard `fname` an index names is not a file inside `folder`, None when it is. An index is a file's
    content: followed blindly, `../`, an absolute path or a link would read any file the user can read."""
    if "\0" in fname:
        return "a name with a NUL character"
    if os.path.isabs(fname):
        return "an absolute path"
    root = folder.resolve()
    target = (folder / fname).resolve()
    if target == root or root in target.parents:
        return None
    if ".." in Path(fname).parts:
        return "it climbs out with .."
    # the Hugging Face hub's cache keeps every file of a snapshot (snapshots/<revision>/) as a link into the
    # repository's blobs/: those links are how the cache is made, not an escape
    if root.parent.name == "snapshots" and root.parent.parent / "blobs" in target.parents:
        return None
    return f"a symbolic link to {target}"


def load_hf(folder: str | Path, cfg: ModelConfig | None = None, progress: bool = True,
            check_values: bool = True) -> Weights:
    """Weights from a local HF folder: model.safetensors or a sharded model.safetensors.index.json. A file given
    instead of the folder (its config.json, its model.safetensors) means its folder.

    Strict: every tensor in the checkpoint is either one the kernel reads or known to be harmless to leave out; a
    bias, a q/k norm, a quantisation scale or a fused projection is refused by name, since dropping it would run a
    different model without a word. Names, shapes and dtypes are checked from the headers before any data is read;
    `check_values` then looks for NaN and Inf (check_finite), which the kernel would otherwise only report as logits
    that are not finite, with no tensor named."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise WeightsError(f"{folder}: no such folder")
    cfg = cfg or get_config(str(folder))
    files, weight_map, index = _shard_files(folder)
    opened, file_of, where = {}, {}, {}           # file name → file; tensor → its file, and that file's path
    for fname in files:
        path = folder / fname
        kind = _kind(path) if index is not None else None
        if kind == "missing":
            raise WeightsError(f"{folder}: shard {fname} named by the index is missing")
        if kind is not None:
            raise WeightsError(f"{path}: not a regular file ({kind}), named as a shard by {index}; a shard must be "
                               "a safetensors file")
        opened[fname] = st = SafetensorsFile(path)
        for k in st.keys():
            if k in where:
                raise WeightsError(f"{folder}: tensor {k} is in both {where[k]} and {path}")
            file_of[k], where[k] = st, str(path)
    for k, fname in weight_map.items():
        if k not in opened[fname].keys():
            raise WeightsError(f"{folder / 'model.safetensors.index.json'}: names tensor {k} in {fname}, "
                               "which does not hold it")
    want = expected_shapes(cfg)
    # lm_head.weight next to tied embeddings is judged once its values are read, below
    tied_head = cfg.tie_embeddings and "lm_head.weight" in where
    unused = [k for k in where
              if k not in want and not _HARMLESS.search(k) and not (tied_head and k == "lm_head.weight")]
    if unused:
        k = unused[0]
        more = len(unused) - 1
        more = f" (and {more} more tensor{'s' if more > 1 else ''} the kernel does not read)" if more else ""
        raise WeightsError(f"{where[k]}: tensor {k} is not used by the kernel: {_why_unused(k, cfg)}{more}")
    check_shapes(cfg, {k: f.shape(k) for k, f in file_of.items()}, str(folder), where)
    for k in want:
        dt = file_of[k].dtype(k)
        if dt not in WEIGHT_DTYPES:
            raise WeightsError(f"{where[k]}: tensor {k} has dtype {dt}; weights must be "
                               f"{', '.join(WEIGHT_DTYPES[:-1])} or {WEIGHT_DTYPES[-1]}")
    tensors = {k: _read_f32_or_bf16(file_of[k], k, where[k])
               for k in _progress(list(want), "reading tensors", progress and len(files) > 1)}
    if tied_head:
        head, embed = file_of["lm_head.weight"].get("lm_head.weight"), tensors["model.embed_tokens.weight"]
        if file_of["lm_head.weight"].dtype("lm_head.weight") == "BF16" and embed.dtype == np.uint16:
            same = np.array_equal(head, embed)                  # the bits: a NaN equals itself here
        else:
            with np.errstate(over="ignore", invalid="ignore"):  # an F64 past float32 compares as inf: unequal
                same = head.shape == embed.shape and np.array_equal(to_f32(head), to_f32(embed), equal_nan=True)
        if not same:
            raise WeightsError(f"{where['lm_head.weight']}: tensor lm_head.weight is not used by the kernel: "
                               f"{_why_unused('lm_head.weight', cfg)}")
    w = Weights(cfg, tensors, np, source=str(folder), files={k: where[k] for k in tensors})
    if check_values:
        check_finite(w, where, progress=progress)
    return w


def _read_f32_or_bf16(st: SafetensorsFile, name: str, path: str):
    """A tensor as the loader keeps it: bf16 bits as stored, any other float as float32. An F64 value past
    float32's range would become an infinity (and a RuntimeWarning on stderr): refused, naming it."""
    t = st.get(name)
    if st.dtype(name) == "BF16":
        return t
    with np.errstate(over="ignore", invalid="ignore"):
        f = t.astype(np.float32)
    if st.dtype(name) == "F64":
        lost = np.isfinite(t) & ~np.isfinite(f)
        if lost.any():
            at = np.unravel_index(int(np.argmax(lost)), t.shape)
            raise WeightsError(f"{path}: tensor {name} (F64) holds {float(t[at])!r} at [{_index(at)}], past "
                               f"float32's range (±{float(np.finfo(np.float32).max):.8g}); the kernel's weights are "
                               f"bf16: store the checkpoint as bf16, fp16 or fp32")
    return f


def _index(at) -> str:
    return ", ".join(str(int(i)) for i in at)


def check_finite(w: Weights, where: dict[str, str] | None = None, chunk: int = 1 << 20, progress: bool = False):
    """Refuse NaN and Inf in any tensor, naming it, with the count and the first index. Works on numpy and cupy
    arrays alike. Cheap: each tensor is read once, a chunk at a time into one reused buffer (allocating a
    full-size temporary per tensor made it several times slower on the host), and counting only happens where a
    chunk has a bad value. bf16 bits are judged by their exponent: all ones is Inf (mantissa 0) or NaN.

    With `progress`, a bar by bytes once it has taken BAR_DELAY_S: load_hf's tensors are memory-mapped, so this
    is where a checkpoint is first read from disk (llama-3.1-8b: 16 GB, 2 s from the page cache, several times
    that from disk)."""
    xp = w.xp
    scratch = xp.empty(chunk, xp.uint16), xp.empty(chunk, xp.bool_)
    where = where or w.files
    bar = _bytes_bar(sum(int(t.nbytes) for t in w.tensors.values()), "checking values (reading weights)", progress)
    try:
        for name, t in w.tensors.items():
            first = _first_nonfinite(t, xp, chunk, scratch)
            if first is not None:
                _report_nonfinite(name, t.reshape(-1)[first:], first, t.shape, where.get(name, w.source), xp)
            if bar is not None:
                bar.update(int(t.nbytes))
    finally:
        if bar is not None:
            bar.close()


def _first_nonfinite(t, xp, chunk: int = 1 << 20, scratch=None) -> int | None:
    """The flat index of t's first NaN or Inf (bf16 bits or floats), None when it has none; see check_finite."""
    bits, flags = scratch or (xp.empty(min(chunk, max(t.size, 1)), xp.uint16),
                              xp.empty(min(chunk, max(t.size, 1)), xp.bool_))
    flat = t.reshape(-1)
    for start in range(0, flat.size, chunk):
        c = flat[start:start + chunk]
        if c.dtype == xp.uint16:
            mag = xp.bitwise_and(c, xp.uint16(0x7FFF), out=bits[:c.size])
            if int(mag.max()) < 0x7F80:
                continue
            bad = mag >= 0x7F80
        else:
            ok = xp.isfinite(c, out=flags[:c.size])
            if bool(ok.all()):
                continue
            bad = ~ok
        return start + int(xp.argmax(bad))
    return None


def _report_nonfinite(name, rest, start, shape, src, xp):
    if rest.dtype == xp.uint16:
        mag = rest & xp.uint16(0x7FFF)
        nan, inf = mag > 0x7F80, mag == 0x7F80
    else:
        nan, inf = xp.isnan(rest), xp.isinf(rest)
    n_nan, n_inf = int(nan.sum()), int(inf.sum())
    first = start + int(xp.argmax(nan | inf))
    what = " and ".join(s for s in (f"{n_nan} NaN" if n_nan else "", f"{n_inf} infinite" if n_inf else "") if s)
    index = ", ".join(str(int(i)) for i in np.unravel_index(first, shape))
    raise WeightsError(f"{src + ': ' if src else ''}tensor {name} has {what} value{'s' if n_nan + n_inf > 1 else ''} "
                       f"(first at [{index}])")


def random_weights(cfg: ModelConfig, seed: int = 0, xp=np, progress: bool = True) -> Weights:
    """Random weights at the config's shapes, bf16. Projections have std 1/sqrt(fan_in) so every layer moves the
    residual stream; norm gains scatter around 1 so that folding them is exercised; embeddings have std 0.1 so the
    logits are neither flat nor one-hot. The values depend on (seed, xp): numpy and cupy generators differ."""
    rs = xp.random.default_rng(seed)
    tensors = {}
    for name, shape in _progress(list(expected_shapes(cfg).items()), "random weights", progress and cfg.n_layers > 4):
        if name.endswith(".bias"):
            t = 0.1 * rs.standard_normal(shape, dtype=xp.float32)
        elif len(shape) == 1:
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
    with np.errstate(all="ignore"):                # extreme RoPE settings: judged by the tables, below
        ang = (pos * rope_inv_freq(cfg)[None, :]).astype(np.float32)
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if not (np.isfinite(cos).all() and np.isfinite(sin).all()):
        at, pair = np.argwhere(~(np.isfinite(cos) & np.isfinite(sin)))[0]
        raise ConfigError(f"model config {cfg.name!r}: rope_theta {cfg.rope_theta} and rope_scaling "
                          f"{cfg.rope_scaling} give RoPE an angle that is not finite in fp32 (position {at}, pair "
                          f"{pair}): the model's RoPE settings are out of range")
    return cos, sin


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
    wo [L, D, q_dim]. wgu [L, 2F, D]: gate row j then up row j, mlp-norm gain folded in. wd [L, F, D]: Wd
    transposed, row j is Wd's column j (the kernel's down projection reads Wd by columns).
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
    bqkv: object = None                # [L, q_dim+2·kv_dim] fp32 in wqkv's row order (zeros without biases)
    qk_gain: object = None             # [L, 2, hd] fp32: q's then k's per-head norm gain (ones without, Qwen3)
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

    def bf16(name, gain=None):
        """Tensor `name` in bf16 for the kernel, its column j times `gain`[j] where a norm's gain is folded in.
        A finite value can still end infinite, past bf16's range once rounded (from F32) or once multiplied by its
        gain: refused here, naming both, since the kernel would otherwise only see infinite logits."""
        a = dev(name)
        g = dev(gain) if gain is not None else None
        with np.errstate(over="ignore", invalid="ignore"):       # checked below, in the one message
            bits = to_bf16(a * g[None, :] if g is not None else a, xp)
        at = _first_nonfinite(bits, xp)
        if at is not None:
            raise _overflow(w, name, a, gain, g, np.unravel_index(at, a.shape))
        return bits

    order = xp.asarray(qkv_row_order(cfg))
    wqkv = xp.empty((L, cfg.qkv_rows, D), dtype=xp.uint16)
    wo = xp.empty((L, D, cfg.q_dim), dtype=xp.uint16)
    wgu = xp.empty((L, 2 * F, D), dtype=xp.uint16)
    wd = xp.empty((L, F, D), dtype=xp.uint16)
    bqkv = xp.zeros((L, cfg.qkv_rows), dtype=xp.float32)
    qk_gain = xp.ones((L, 2, cfg.head_dim), dtype=xp.float32)
    for i in _progress(range(L), "preparing layers", progress and L > 4):
        n = layer_names(i, cfg)
        # each matrix rounded (and checked) in its own layout, then its rows reordered: rounding is elementwise
        wqkv[i] = xp.concatenate([bf16(n[m], n["attn_norm"]) for m in ("wq", "wk", "wv")])[order]
        if cfg.qkv_bias:                   # added after the projection: nothing of the norm's gain is folded in
            bqkv[i] = xp.concatenate([dev(n["bq"]), dev(n["bk"]), dev(n["bv"])])[order]
        if cfg.qk_norm:                    # applied after a norm of the projection's output: nothing to fold into
            qk_gain[i] = xp.stack([dev(n["q_norm"]), dev(n["k_norm"])])
        wo[i] = bf16(n["wo"])
        wgu[i] = xp.stack([bf16(n["wg"], n["mlp_norm"]), bf16(n["wu"], n["mlp_norm"])], axis=1).reshape(2 * F, D)
        wd[i] = bf16(n["wd"]).T
    embed = bf16("model.embed_tokens.weight")
    lm_head = bf16(w.lm_head_name(), "model.norm.weight")
    cos, sin = rope_tables(cfg)
    return Prepared(cfg, embed, wqkv, wo, wgu, wd, lm_head, xp.asarray(cos), xp.asarray(sin), bqkv, qk_gain, xp,
                    w.source)


def _overflow(w: Weights, name, a, gain, g, at) -> WeightsError:
    """The message for tensor `name` (values `a`), times the gain `g` (tensor `gain`) if any, whose bf16 at
    index `at` is infinite. Values are shown as float32's shortest repr (3.3999e+38)."""
    src = w.files.get(name, w.source)
    v = np.float32(float(a[at]))
    if gain is None:
        what = (f"tensor {name} holds {v!s} at [{_index(at)}], which rounds past bf16's largest finite value "
                f"(±{BF16_MAX:.8g}): the kernel's bf16 copy would be infinite")
    else:
        gv = np.float32(float(g[at[-1]]))
        with np.errstate(over="ignore"):
            product = v * gv
        what = (f"tensor {name} holds {v!s} at [{_index(at)}], and its norm gain {gain} holds {gv!s} at "
                f"[{int(at[-1])}]: folded into the weight for the kernel, their product ({product!s}) is past "
                f"bf16's largest finite value (±{BF16_MAX:.8g})")
    return WeightsError(f"{src + ': ' if src else ''}{what}; the checkpoint's values are out of range for bf16 "
                        "weights: fix or rescale that tensor")


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
        n = layer_names(i, cfg)
        qkv = host(p.wqkv[i])[xp.asarray(inv)]
        gu = host(p.wgu[i]).reshape(F, 2, cfg.hidden)
        if cfg.qkv_bias:
            b = host(p.bqkv[i])[xp.asarray(inv)]
            t.update({n["bq"]: b[:cfg.q_dim], n["bk"]: b[cfg.q_dim:cfg.q_dim + cfg.kv_dim], n["bv"]: b[cfg.q_dim + cfg.kv_dim:]})
        if cfg.qk_norm:
            g = host(p.qk_gain[i])
            t.update({n["q_norm"]: g[0], n["k_norm"]: g[1]})
        t.update({n["attn_norm"]: ones, n["mlp_norm"]: ones,
                  n["wq"]: qkv[:cfg.q_dim], n["wk"]: qkv[cfg.q_dim:cfg.q_dim + cfg.kv_dim],
                  n["wv"]: qkv[cfg.q_dim + cfg.kv_dim:], n["wo"]: host(p.wo[i]),
                  n["wg"]: gu[:, 0], n["wu"]: gu[:, 1], n["wd"]: xp.ascontiguousarray(host(p.wd[i]).T)})
    return Weights(cfg.with_(tie_embeddings=False), t, xp, source=p.source + " (prepared)")


def load(model: str, weights: str | None = None, seed: int = 0, xp=np, max_seq: int | None = None,
         progress: bool = True) -> Weights:
    """A model by preset name or HF folder (or a file in one); weights from `weights` (a folder, or a file in one),
    else from the model's folder, else random at the preset's shapes."""
    cfg = get_config(model, max_seq=max_seq)
    folder = weights if weights is not None else local_folder(model)
    if folder is not None:
        return load_hf(folder, cfg, progress=progress)
    return random_weights(cfg, seed, xp=xp, progress=progress)


def load_prepared(model: str, weights: str | None = None, seed: int = 0, xp=np, max_seq: int | None = None,
                  progress: bool = True) -> Prepared:
    """load, then prepare where it will run: the loaded copy is let go before returning (on a GPU that halves
    what the weights occupy at their peak)."""
    w = load(model, weights, seed=seed, xp=xp, max_seq=max_seq, progress=progress)
    p = prepare(w, xp=xp, progress=progress)
    del w
    if xp is not np:
        xp.cuda.Device().synchronize()
    return p


BAR_DELAY_S = 1.0         # a bar by bytes appears once its job has run this long: a quick one prints nothing


def _bytes_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                delay=BAR_DELAY_S)


def _progress(it, desc, enabled):
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, leave=False)


__all__ = ["Weights", "Prepared", "load", "load_hf", "check_finite", "check_shapes", "random_weights", "prepare",
           "unprepare", "rope_tables", "rope_inv_freq", "to_f32", "to_bf16", "round_bf16", "WeightsError", "bf16_to_f32"]

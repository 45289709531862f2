"""What the monokernel is measured against, in the same process and on the same weights:

* `stream_read_tbps`: a tuned streaming read of N bytes (16-byte loads, 8 in flight per thread, grid-stride): the
  bandwidth roofline. tok/s at the roofline = that bandwidth / weight bytes per token.
* `GptFast`: a gpt-fast-style batch-1 decoder (static KV cache, bf16) for torch.compile(mode="reduce-overhead"),
  i.e. CUDA graphs, which is the strongest plain-PyTorch batch-1 path.
"""
from __future__ import annotations

import time

import numpy as np

from ..model.weights import expected_shapes, rope_tables

_READ_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, unsigned long long n16, unsigned int* out) {
    unsigned int acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n16; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + i + u * stride));
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) { uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x12345678u) out[0] = acc;      // keeps the loads alive
}
"""


def stream_read_tbps(nbytes: int, repeats: int = 20) -> dict:
    """Median TB/s of reading `nbytes` once (the buffer is far larger than L2, so each pass reads HBM)."""
    import cupy as cp
    buf = cp.random.default_rng(0).integers(0, 2**31, nbytes // 4, dtype=cp.int32)
    out = cp.zeros(1, cp.uint32)
    fn = cp.RawKernel(_READ_SRC, "stream_read")
    grid, block = cp.cuda.Device().attributes["MultiProcessorCount"] * 4, 512
    times = []
    for r in range(repeats + 3):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn((grid,), (block,), (buf, np.uint64(buf.nbytes // 16), out))
        e.record()
        e.synchronize()
        if r >= 3:
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del buf
    t = np.median(times)
    return {"tbps": nbytes / t / 1e12, "spread": (nbytes / max(times) / 1e12, nbytes / min(times) / 1e12)}


def tensors_from_weights(w, device="cpu", dtype=None) -> dict:
    """Weights (numpy or cupy; bf16 bits or floats) → torch tensors by HF name on `device` (the PyTorch baselines
    and the HF comparisons run on these)."""
    import torch
    dtype = dtype or torch.float32
    names = dict.fromkeys([*expected_shapes(w.cfg), *(k for k in ("lm_head.weight",) if k in w.tensors)])
    return {name: _to_torch(w.tensors[name]).to(device=device, dtype=dtype) for name in names}


def _to_torch(a):
    import torch
    bf16 = a.dtype == np.uint16                                 # bf16 bits: reinterpret, then widen
    if isinstance(a, np.ndarray):
        if bf16:
            a = a.view(np.int16)                                # torch views int16 as bf16; same bits
        t = torch.from_numpy(a if a.flags.writeable else np.array(a))   # torch wants writable memory; memmaps aren't
    else:                                                       # cupy (or anything with DLPack) stays on its device
        t = torch.from_dlpack(a.view("int16") if bf16 else a)
    return t.view(torch.bfloat16) if bf16 else t


def gpt_fast_model(cfg, tensors: dict, device, max_seq: int):
    """A gpt-fast-style Llama (static KV cache) on HF-named bf16 tensors, with the family's own steps when the config
    has them (Qwen2's q/k/v biases, Qwen3's per-head q/k norms), so that it does the kernel's math."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, i):
            super().__init__()
            p = f"model.layers.{i}."
            g = lambda n: nn.Parameter(tensors[p + n].to(device, torch.bfloat16), requires_grad=False)  # noqa: E731
            self.wqkv = nn.Parameter(torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).to(
                device, torch.bfloat16), requires_grad=False)
            self.wo, self.w1, self.w3, self.w2 = (g("self_attn.o_proj.weight"), g("mlp.gate_proj.weight"),
                                                  g("mlp.up_proj.weight"), g("mlp.down_proj.weight"))
            self.n1, self.n2 = g("input_layernorm.weight"), g("post_attention_layernorm.weight")
            self.bqkv = nn.Parameter(torch.cat([tensors[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]).to(
                device, torch.bfloat16), requires_grad=False) if cfg.qkv_bias else None
            self.qn, self.kn = ((g("self_attn.q_norm.weight"), g("self_attn.k_norm.weight")) if cfg.qk_norm
                                else (None, None))
            shape = (1, cfg.n_kv_heads, max_seq, cfg.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.bfloat16, device=device))
            self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.bfloat16, device=device))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Parameter(tensors["model.embed_tokens.weight"].to(device, torch.bfloat16),
                                      requires_grad=False)
            lm = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
            self.lm = nn.Parameter(lm.to(device, torch.bfloat16), requires_grad=False)
            self.norm = nn.Parameter(tensors["model.norm.weight"].to(device, torch.bfloat16), requires_grad=False)
            self.layers = nn.ModuleList(Layer(i) for i in range(cfg.n_layers))
            cos, sin = rope_tables(cfg.with_(max_seq=max_seq))
            self.register_buffer("cos", torch.from_numpy(cos).to(device))
            self.register_buffer("sin", torch.from_numpy(sin).to(device))
            self.register_buffer("mask", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device=device)))

        @staticmethod
        def rms(x, w):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_eps)).to(x.dtype) * w

        def forward(self, idx, input_pos):                           # idx [1, 1], input_pos [1]
            x = self.embed[idx]                                      # [1, 1, D]
            cos, sin = self.cos[input_pos], self.sin[input_pos]      # [1, hd/2]
            mask = self.mask[None, None, input_pos]                  # [1, 1, 1, S]
            hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
            for L in self.layers:
                h = self.rms(x, L.n1)
                q, k, v = F.linear(h, L.wqkv, L.bqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
                q, k, v = q.view(1, 1, nh, hd), k.view(1, 1, nkv, hd), v.view(1, 1, nkv, hd)
                if L.qn is not None:
                    q, k = self.rms(q, L.qn), self.rms(k, L.kn)

                def rope(a):
                    a1, a2 = a.float().chunk(2, -1)
                    c, s = cos[:, None, :], sin[:, None, :]
                    return torch.cat([a1 * c - a2 * s, a2 * c + a1 * s], -1).to(a.dtype)
                q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
                L.k_cache[:, :, input_pos] = k
                L.v_cache[:, :, input_pos] = v.transpose(1, 2)
                y = F.scaled_dot_product_attention(q, L.k_cache, L.v_cache, attn_mask=mask, enable_gqa=True)
                x = x + F.linear(y.transpose(1, 2).reshape(1, 1, nh * hd), L.wo)
                h = self.rms(x, L.n2)
                x = x + F.linear(F.silu(F.linear(h, L.w1)) * F.linear(h, L.w3), L.w2)
            return F.linear(self.rms(x, self.norm), self.lm)

    return Model().eval()


def gpt_fast_tok_per_s(model, *, pos0: int, n_tokens: int, compile: bool = True, inductor_flags: bool = False,
                       warm: int = 8) -> dict:
    """Greedy decode of n_tokens from position pos0 (argmax on the GPU, no host sync per token)."""
    import torch
    if inductor_flags:
        import torch._inductor.config as ic
        ic.coordinate_descent_tuning = True
        ic.triton.unique_kernel_names = True
        ic.fx_graph_cache = True

    def step(idx, pos):
        return torch.argmax(model(idx, pos)[:, -1], dim=-1, keepdim=True).to(torch.int)

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile else step
    dev = model.embed.device
    idx = torch.zeros(1, 1, dtype=torch.int, device=dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(warm):
            pos = torch.tensor([pos0 + i], device=dev)
            idx = fn(idx, pos).clone()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n_tokens):
            pos = torch.tensor([pos0 + i], device=dev)
            idx = fn(idx, pos).clone()
        e.record()
        torch.cuda.synchronize()
    ms = s.elapsed_time(e)
    return {"tok_per_s": n_tokens / ms * 1e3, "us_per_token": ms * 1e3 / n_tokens, "compile_s": compile_s}

// The batched prefill's own row-wise work around its matrix products (workbench/run/prefill_gpu.py): each stage of
// the plan is one or two bf16 products on the tensor cores (cuBLAS) between these kernels, which fuse what the
// reference does in several whole-array passes. They compute what the stage references compute (workbench/check/
// stages.py) in fp32, and check_prefill holds the result to fp64.
//
// Products take bf16 operands, and an activation is not bf16: each is split as hi + lo, two bf16 rows with
// |a − hi − lo| ≤ 2⁻¹⁷|a| (hi is a rounded, lo the rounded rest, which a − hi holds exactly in fp32), and the
// product is W·hi + W·lo, accumulated in fp32. The weights are bf16 already, so the product is as accurate as an
// fp32 one, 2⁻¹⁷ against TF32's 2⁻¹¹, at the cost of two bf16 products (each twice TF32's rate on the H200).
// With halves = 1 (the bf16 precision, prefill_gpu.PRECISIONS argues its bound) only hi is written and read: one
// product, an activation rounded to bf16 as HF's bf16 prefill rounds it.
//
// Set by the launcher: WB_THREADS (threads a block, a multiple of the warp).

static_assert(WB_THREADS % WB_WARP == 0 && WB_THREADS <= 1024, "whole warps, one block");

__device__ __forceinline__ void pf_split(float a, bf16& hi, bf16& lo, int halves) {
    hi = f32_to_bf16(a);
    if (halves == 2) lo = f32_to_bf16(a - bf16_to_f32(hi));
}

__device__ __forceinline__ float pf_warp_sum(float v) {
#pragma unroll
    for (int m = WB_WARP / 2; m > 0; m >>= 1) v += wb_shfl_xor(v, m);
    return v;
}

__device__ __forceinline__ float pf_block_sum(float v) {
    __shared__ float part[WB_THREADS / WB_WARP];
    v = pf_warp_sum(v);
    if (threadIdx.x % WB_WARP == 0) part[threadIdx.x / WB_WARP] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WB_THREADS / WB_WARP; ++w) s += part[w];
    return s;
}

// RMSNorm of each row (its gain is folded into the weights that read it, as the decode path's is), split for the
// product: one block a row
extern "C" __global__ void __launch_bounds__(WB_THREADS) prefill_norm_split(
    const float* __restrict__ x, int cols, float eps, bf16* __restrict__ hi, bf16* __restrict__ lo, int halves)
{
    const long long row = blockIdx.x;
    const float* xr = x + row * cols;
    float ss = 0.f;
    for (int i = threadIdx.x; i < cols; i += WB_THREADS) ss += xr[i] * xr[i];
    const float r = 1.f / sqrtf(pf_block_sum(ss) / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += WB_THREADS)
        pf_split(xr[i] * r, hi[row * cols + i], lo[row * cols + i], halves);
}

// an activation split for the product as it is (attention's output before o_proj, the MLP's before down)
extern "C" __global__ void __launch_bounds__(WB_THREADS) prefill_split(
    const float* __restrict__ a, long long count, bf16* __restrict__ hi, bf16* __restrict__ lo, int halves)
{
    const long long step = (long long)gridDim.x * WB_THREADS;
    for (long long i = blockIdx.x * (long long)WB_THREADS + threadIdx.x; i < count; i += step)
        pf_split(a[i], hi[i], lo[i], halves);
}

// silu(gate)·up of each row's interleaved products (wgu's rows: gate j, then up j), split for the down product;
// silu as stages.silu computes it, a / (1 + e^−a)
// Four outputs a thread a step (two 16-byte loads, one 8-byte store a half): the kernel reads twice what it writes
// in fp32, so it is bound by its reads, which wider loads bring closer to the read's rate; the same math per element.
// count is whole quads: a row's F is a multiple of 8 (ModelConfig), and the launcher checks it.
__device__ __forceinline__ float pf_silu_mul(float g, float u) { return g / (1.f + wb_exp_precise(-g)) * u; }

// four outputs from their (gate, up) pairs, split and stored at quad i
__device__ __forceinline__ void pf_silu_mul_quad(const float (&g)[4], const float (&u)[4], long long i,
                                                 bf16* __restrict__ hi, bf16* __restrict__ lo, int halves) {
    bf16 h[4], l[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) pf_split(pf_silu_mul(g[k], u[k]), h[k], l[k], halves);
    *(uint2*)(hi + 4 * i) = make_uint2(h[0] | (u32)h[1] << 16, h[2] | (u32)h[3] << 16);
    if (halves == 2) *(uint2*)(lo + 4 * i) = make_uint2(l[0] | (u32)l[1] << 16, l[2] | (u32)l[3] << 16);
}

extern "C" __global__ void __launch_bounds__(WB_THREADS) prefill_silu_mul_split(
    const float* __restrict__ gu, long long count, bf16* __restrict__ hi, bf16* __restrict__ lo, int halves)
{
    const long long step = (long long)gridDim.x * WB_THREADS, quads = count / 4;
    for (long long i = blockIdx.x * (long long)WB_THREADS + threadIdx.x; i < quads; i += step) {
        const float4 a = *(const float4*)(gu + 8 * i), b = *(const float4*)(gu + 8 * i + 4);
        pf_silu_mul_quad({a.x, a.z, b.x, b.z}, {a.y, a.w, b.y, b.w}, i, hi, lo, halves);
    }
}

// The same from gate_up's sums rounded to bf16 (the prefill's mlp_bf16): four outputs a thread a step from one
// 16-byte load, half the bytes of the fp32 sums' read, and a product's epilogue that writes half as many
extern "C" __global__ void __launch_bounds__(WB_THREADS) prefill_silu_mul_split_bf16(
    const bf16* __restrict__ gu, long long count, bf16* __restrict__ hi, bf16* __restrict__ lo, int halves)
{
    const long long step = (long long)gridDim.x * WB_THREADS, quads = count / 4;
    for (long long i = blockIdx.x * (long long)WB_THREADS + threadIdx.x; i < quads; i += step) {
        const uint4 a = *(const uint4*)(gu + 8 * i);                // gate j in a word's low half, up j in its high
        pf_silu_mul_quad({bf16_to_f32((bf16)(a.x & 0xffffu)), bf16_to_f32((bf16)(a.y & 0xffffu)),
                          bf16_to_f32((bf16)(a.z & 0xffffu)), bf16_to_f32((bf16)(a.w & 0xffffu))},
                         {bf16_to_f32((bf16)(a.x >> 16)), bf16_to_f32((bf16)(a.y >> 16)),
                          bf16_to_f32((bf16)(a.z >> 16)), bf16_to_f32((bf16)(a.w >> 16))}, i, hi, lo, halves);
    }
}

// The q/k/v products' epilogue, one block a row: the bias (Qwen2), each head's RMSNorm with its gain (Qwen3), RoPE
// on q and k; q out in HF order for attention, k and v rounded to bf16 into the kernel's cache at the row's
// position. y's rows are wqkv's (workbench.model.weights.qkv_row_order): q heads, k heads, v heads, and in q's and
// k's each rotate-half pair (i, i + hd/2) side by side, so a thread takes whole pairs. With a head norm one warp
// takes a head (its sum of squares), each warp every (warps)-th head of the row; without one, the block's threads
// take the row's pairs. A block a (row, eight heads) was 24,576 blocks of one head's work each for a 4k prompt of
// the 1B, and ran at 35% of its bytes' time (one H100, NOTES.md round 26): the blocks' own start and end, not the
// bytes, were its time. A pair takes the same operations, in the same order, in every arrangement.
// one rotate-half pair of a q or k head (its dims i and i + half: a, b) rotated to position p and stored: q's in
// fp32, k's rounded to bf16 into the cache
__device__ __forceinline__ void pf_rope_pair(float a, float b, int slot, int i, int half, long long row, long long p,
                                             const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                             float* __restrict__ q, bf16* __restrict__ kc, int n_heads, int max_seq) {
    const float c = cos_t[p * half + i], s = sin_t[p * half + i];
    const float ra = a * c - b * s, rb = b * c + a * s;
    const int head_dim = 2 * half;
    if (slot < n_heads) {
        float* dst = q + row * (long long)n_heads * head_dim + (long long)slot * head_dim;
        dst[i] = ra;
        dst[i + half] = rb;
    } else {
        bf16* dst = kc + ((long long)(slot - n_heads) * max_seq + p) * head_dim;
        dst[i] = f32_to_bf16(ra);
        dst[i + half] = f32_to_bf16(rb);
    }
}

extern "C" __global__ void __launch_bounds__(WB_THREADS) prefill_qkv_rope(
    const float* __restrict__ y,         // [n, qkv_rows]
    const float* __restrict__ bias,      // [qkv_rows] in y's order (zeros without biases)
    const float* __restrict__ qk_gain,   // [2, hd]: q's, then k's norm gain, HF order (read when qk_norm)
    const float* __restrict__ cos_t,     // [max_seq, hd/2]
    const float* __restrict__ sin_t,
    const long long* __restrict__ pos,   // [n]
    float* __restrict__ q,               // [n, Hq·hd]
    bf16* __restrict__ kc,               // this layer's [Hkv, max_seq, hd]
    bf16* __restrict__ vc,
    int n, int head_dim, int n_heads, int n_kv, int max_seq, float eps, int qk_norm)
{
    const int row = blockIdx.x, lane = threadIdx.x % WB_WARP, half = head_dim / 2, slots = n_heads + 2 * n_kv;
    if (row >= n) return;                                            // no block barrier follows
    const long long rows = (long long)slots * head_dim, p = pos[row];
    if (!qk_norm) {
        // No head's norm: a pair's rotation needs nothing else of its head, so the row's pairs are spread over all
        // the block's threads, each loading its pairs (8-byte loads) before it stores any. The warp-a-head loop
        // below waits a load's latency per head; this one waits about one per block (round 37's profile: 0.86 ms
        // of a 4k prompt's 1B prefill at 1.7 TB/s).
        constexpr int PER = 6;                                   // 64 registers: 4 blocks an SM (8: 124, 2)
        const int pairs = slots * half;
        const float2* yp = (const float2*)(y + row * rows);          // pair j: elements 2j, 2j + 1
        const float2* bp = (const float2*)bias;
        for (int first = threadIdx.x; first < pairs; first += PER * WB_THREADS) {
            float2 v[PER];
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const int j = first + k * WB_THREADS;
                if (j < pairs) { v[k] = yp[j]; const float2 b = bp[j]; v[k].x += b.x; v[k].y += b.y; }
            }
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const int j = first + k * WB_THREADS;
                if (j >= pairs) break;
                const int slot = j / half, i = j - slot * half;
                if (slot >= n_heads + n_kv) {                        // a value head: dims 2i, 2i + 1 as they are
                    bf16* dst = vc + ((long long)(slot - n_heads - n_kv) * max_seq + p) * head_dim + 2 * i;
                    dst[0] = f32_to_bf16(v[k].x);
                    dst[1] = f32_to_bf16(v[k].y);
                    continue;
                }
                pf_rope_pair(v[k].x, v[k].y, slot, i, half, row, p, cos_t, sin_t, q, kc, n_heads, max_seq);
            }
        }
        return;
    }
    for (int slot = threadIdx.x / WB_WARP; slot < slots; slot += WB_THREADS / WB_WARP) {
        const float* yr = y + row * rows + (long long)slot * head_dim;
        const float* br = bias + (long long)slot * head_dim;
        if (slot >= n_heads + n_kv) {                                // a value head: as it is
            bf16* dst = vc + ((long long)(slot - n_heads - n_kv) * max_seq + p) * head_dim;
            for (int d = lane; d < head_dim; d += WB_WARP) dst[d] = f32_to_bf16(yr[d] + br[d]);
            continue;
        }
        float ss = 0.f;
        for (int i = lane; i < half; i += WB_WARP) {
            const float a = yr[2 * i] + br[2 * i], b = yr[2 * i + 1] + br[2 * i + 1];
            ss += a * a + b * b;
        }
        const float r = qk_norm ? 1.f / sqrtf(pf_warp_sum(ss) / (float)head_dim + eps) : 1.f;
        const float* gain = qk_gain + (slot < n_heads ? 0 : head_dim);
        for (int i = lane; i < half; i += WB_WARP) {
            float a = yr[2 * i] + br[2 * i], b = yr[2 * i + 1] + br[2 * i + 1];      // dims i and i + half
            if (qk_norm) { a = a * r * gain[i]; b = b * r * gain[i + half]; }
            pf_rope_pair(a, b, slot, i, half, row, p, cos_t, sin_t, q, kc, n_heads, max_seq);
        }
    }
}

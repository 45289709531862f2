// Building blocks shared by every projection: a warp's dot products of bf16 weight rows with an fp32 activation
// vector held in shared memory, and the block-wide RMS normalisation that feeds them.
//
// A warp owns whole rows. Lane l reads the 16-byte pieces l, l+WB_WARP, l+2·WB_WARP ... of a row, so each warp-wide
// load is one contiguous, coalesced span of WB_WARP·16 bytes; UNROLL pieces per row are in flight before the first
// FMA, which is what keeps enough bytes moving to approach the bandwidth roofline.
#pragma once

template <int K, int NR>
__device__ __forceinline__ void warp_rows_dot(const bf16* __restrict__ row0, long long row_stride,
                                              const float* __restrict__ act, float out[NR]) {
    constexpr int STEP = WB_WARP * 8;                 // elements one warp-wide load covers
    constexpr int ITERS = (K + STEP - 1) / STEP;
    constexpr int UNROLL = NR == 1 ? 8 : 4;
    const int lane = wb_lane();
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
    for (int i0 = 0; i0 < ITERS; i0 += UNROLL) {
        wb_u4 w[NR][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = (i0 + u) * STEP + lane * 8;
            if (i0 + u < ITERS && (K % STEP == 0 || k < K)) {
#pragma unroll
                for (int r = 0; r < NR; ++r) w[r][u] = wb_ld_stream(row0 + r * row_stride + k);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = (i0 + u) * STEP + lane * 8;
            if (i0 + u < ITERS && (K % STEP == 0 || k < K)) {
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r] = wb_dot8(w[r][u], act + k, acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = wb_warp_sum(acc[r]);
}

// Sum of one value per thread over the block; every thread gets the total. `red` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = wb_warp_sum(v);
    if (wb_lane() == 0) red[wb_warp()] = v;
    wb_syncthreads();
    float t = 0.f;
    for (int w = 0; w < wb_nwarps(); ++w) t += red[w];
    wb_syncthreads();
    return t;
}

// Copy n floats written by other blocks during this kernel into shared memory (through L2, see wb_ld_cg_f4).
__device__ __forceinline__ void load_activation(float* __restrict__ dst, const float* __restrict__ src, int n) {
    for (int i = wb_tid() * 4; i < n; i += wb_ntid() * 4) *(float4*)(dst + i) = wb_ld_cg_f4(src + i);
    wb_syncthreads();
}

// dst = x / rms(x). The norm's gain is folded into the weights that read dst (W·diag(g)), so none is applied here.
__device__ __forceinline__ void load_rms_normalized(float* __restrict__ dst, const float* __restrict__ x, int n,
                                                    float* red) {
    float ss = 0.f;
    for (int i = wb_tid() * 4; i < n; i += wb_ntid() * 4) {
        float4 v = wb_ld_cg_f4(x + i);
        *(float4*)(dst + i) = v;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float scale = wb_rsqrt(block_sum(ss, red) / (float)n + WB_RMS_EPS);
    for (int i = wb_tid(); i < n; i += wb_ntid()) dst[i] *= scale;
    wb_syncthreads();
}

// Rows are dealt to warps round-robin over the whole grid: warp g takes rows g, g + NW, g + 2·NW ...
__device__ __forceinline__ int grid_warp() { return wb_bid() * wb_nwarps() + wb_warp(); }
__device__ __forceinline__ int grid_nwarps() { return wb_nbid() * wb_nwarps(); }

// A warp that has finished its share of a stage asks L2 for the first `budget` bytes of its share of the next one
// (units of UNIT_ROWS adjacent rows of K bf16, dealt as above). HBM keeps streaming while the stragglers finish and
// the barrier completes, and the next stage's first loads hit L2 instead of paying the full memory latency.
// The budget keeps the sum over the grid (≤ 2112 warps × budget) well inside the 60 MB L2.
template <int K, int UNIT_ROWS>
__device__ __forceinline__ void warp_prefetch_units(const bf16* __restrict__ W, int n_units, int budget) {
    constexpr int UNIT_BYTES = UNIT_ROWS * K * 2;
    for (int u = grid_warp(); u < n_units && budget > 0; u += grid_nwarps(), budget -= UNIT_BYTES) {
        const char* p = (const char*)(W + (long long)u * UNIT_ROWS * K);
        const int n = UNIT_BYTES < budget ? UNIT_BYTES : budget;
        for (int off = wb_lane() * 128; off < n; off += WB_WARP * 128) wb_prefetch_l2(p + off);
    }
}
#ifndef WB_PREFETCH_BYTES
#define WB_PREFETCH_BYTES 0
#endif

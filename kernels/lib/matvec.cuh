// Building blocks shared by every projection: a warp's dot products of bf16 weight rows with an fp32 activation
// vector held in shared memory, and the block-wide RMS normalisation that feeds them.
//
// A warp owns whole rows. Lane l reads the 16-byte pieces l, l+WB_WARP, l+2·WB_WARP ... of a row, so each warp-wide
// load is one contiguous, coalesced span of WB_WARP·16 bytes; UNROLL pieces per row are in flight before the first
// FMA, which is what keeps enough bytes moving to approach the bandwidth roofline.
#pragma once

// Rows are dealt to warps round-robin over the whole grid: warp g takes rows g, g + NW, g + 2·NW ... Warps are
// numbered block by block (g = block·warps + warp), so a block's warps read neighbouring rows; ACROSS_BLOCKS
// numbers them block-fastest (g = warp·blocks + block), so that a stage with fewer units than warps loads every SM
// alike instead of filling the first blocks.
template <bool ACROSS_BLOCKS = false>
__device__ __forceinline__ int grid_warp() {
    return ACROSS_BLOCKS ? wb_warp() * wb_nbid() + wb_bid() : wb_bid() * wb_nwarps() + wb_warp();
}
__device__ __forceinline__ int grid_nwarps() { return wb_nbid() * wb_nwarps(); }

#ifndef WB_UNROLL_1
#define WB_UNROLL_1 8
#endif
#ifndef WB_UNROLL_2
#define WB_UNROLL_2 4
#endif
template <int K, int NR>
struct RowLoads {
    static constexpr int STEP = WB_WARP * 8;                  // elements one warp-wide load covers
    static constexpr int ITERS = (K + STEP - 1) / STEP;
    static constexpr int UNROLL = NR == 1 ? WB_UNROLL_1 : WB_UNROLL_2;   // 16-byte loads in flight per lane per row
    // see warp_rows_dot: single rows unrolled up to four chunks of loads (K ≤ 8,192 on NVIDIA), rolled beyond
    static constexpr int CHUNKS_UNROLLED = NR == 1 && ITERS <= 4 * UNROLL ? ITERS : 1;
};

// acc[r] += the chunk of UNROLL loads starting at step i0, for each of the NR rows
template <int K, int NR>
__device__ __forceinline__ void warp_rows_fma(const wb_u4 (&w)[NR][RowLoads<K, NR>::UNROLL], int i0,
                                              const float* __restrict__ act, float (&acc)[NR]) {
    using L = RowLoads<K, NR>;
#pragma unroll
    for (int u = 0; u < L::UNROLL; ++u) {
        const int k = (i0 + u) * L::STEP + wb_lane() * 8;
        if (i0 + u < L::ITERS && (K % L::STEP == 0 || k < K)) {
#pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = wb_dot8(w[r][u], act + k, acc[r]);
        }
    }
}

// acc[r] += row r · act over the loads from step `first` on (a multiple of UNROLL), read from global memory
template <int K, int NR>
__device__ __forceinline__ void warp_rows_acc(const bf16* __restrict__ row0, long long row_stride,
                                              const float* __restrict__ act, float (&acc)[NR], int first) {
    using L = RowLoads<K, NR>;
    // Row pairs: chunks not unrolled. Each chunk's loads are already UNROLL deep; unrolling the chunks as well cost
    // registers, 2% tok/s (H200: 1,144 vs 1,121 tok/s) and a tenth of the compile time. Single rows stay unrolled:
    // rolled, the long rows of the down projection spill on some shapes (3b: 8 row pointers in local memory).
    // Longer rows (8b's down projection, K = 14,336: 56 loads per lane) are rolled: unrolled, with the stage's
    // buffers passed as arguments, they spilled 56 B.
#pragma unroll L::CHUNKS_UNROLLED
    for (int i0 = first; i0 < L::ITERS; i0 += L::UNROLL) {
        wb_u4 w[NR][L::UNROLL];
#pragma unroll
        for (int u = 0; u < L::UNROLL; ++u) {
            const int k = (i0 + u) * L::STEP + wb_lane() * 8;
            if (i0 + u < L::ITERS && (K % L::STEP == 0 || k < K)) {
#pragma unroll
                for (int r = 0; r < NR; ++r) w[r][u] = wb_ld_stream(row0 + r * row_stride + k);
            }
        }
        warp_rows_fma<K, NR>(w, i0, act, acc);
    }
}

// out[r] = row r · act for NR rows of K (UNROLL loads per row in flight before the first FMA)
template <int K, int NR>
__device__ __forceinline__ void warp_rows_dot(const bf16* __restrict__ row0, long long row_stride,
                                              const float* __restrict__ act, float (&out)[NR]) {
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
    warp_rows_acc<K, NR>(row0, row_stride, act, acc, 0);
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = wb_warp_sum(acc[r]);
}

// ---- weights staged in shared memory ahead of their stage ------------------------------------------------------
// Before a stage whose plan entry names a `staged` weight, the copy engine is handed the first rows of each warp's
// first unit (as much of them as the warp's share of the staging area holds), so that HBM streams them while the
// block does something else: waits at the grid barrier, or normalises the stage's input in its prologue (3-4 µs per
// stage in which HBM would otherwise sit idle, NOTES.md). Each warp then takes the staged part of its first unit
// from shared memory and the rest, and its other units, from global memory as before. Weights never change, so
// staging them early is always safe; what a warp's share holds is tagged (source pointer and shape), and a stage
// that finds something else there reads global memory.
//
// WB_STAGE_AT says where the copies are issued (measured in NOTES.md):
//   0: by thread 0 for the whole block, when it arrives at the barrier before the stage
//   1: by each warp's lane 0 for its own rows, at the same barrier, while thread 0 waits
//   2: by each warp's lane 0 for its own rows, at the start of the stage, before the prologue
// One mbarrier per warp, one phase in flight: each issue is waited for exactly once more before the next
// (wb_stage_retire), so the parity the readers wait on is always the current one. Every wait is bounded
// (WB_STAGE_TIMEOUT_NS): a copy that never lands turns that warp's staging off, and it reads global memory.
#ifndef WB_STAGE_AT
#define WB_STAGE_AT 2
#endif

// The matrix of a stage as its warps read it: rows of K, NR adjacent rows per unit, N units dealt to warps block by
// block, or across blocks (see grid_warp). A section declares it once (`<stage>_rows`) and both the staging and its
// for_warp_units use it.
template <int K_, int NR_, int N_, bool ACROSS_ = false>
struct WarpRows {
    static constexpr int K = K_, NR = NR_, N = N_;
    static constexpr bool ACROSS = ACROSS_;
    using L = RowLoads<K, NR>;
    static_assert(K % 8 == 0, "rows are read in 16-byte pieces");
    static constexpr int WARP_BYTES = WB_BULK_COPY ? WB_STAGING_BYTES / (WB_THREADS / WB_WARP) : 0;
    // loads per lane of each row that the warp's share holds: whole chunks of UNROLL, or the whole row
    static constexpr int FIT = WARP_BYTES / (NR * L::STEP * 2);
    static constexpr int STAGED_ITERS = FIT >= L::ITERS ? L::ITERS : FIT / L::UNROLL * L::UNROLL;
    static constexpr int ROW_PAD = STAGED_ITERS * L::STEP;                     // elements per staged row
    static constexpr int ROW_BYTES = 2 * (ROW_PAD < K ? ROW_PAD : K);          // bytes copied per row
    static constexpr u32 TAG = ((u32)K << 8) | ((u32)NR << 1) | (u32)ACROSS;
    static_assert(STAGED_ITERS == 0 || NR * ROW_PAD * 2 <= WARP_BYTES, "a warp's staged rows fit its share");
};

#ifndef WB_STAGE_TIMEOUT_NS
#define WB_STAGE_TIMEOUT_NS 200000000ull          // 0.2 s: a bulk copy takes microseconds
#endif
struct WbStaging {
    u64 bar[WB_MAX_WARPS];
    const void* src[WB_MAX_WARPS];                // what the warp's share holds or is filling with; null: nothing
    u32 tag[WB_MAX_WARPS], phase[WB_MAX_WARPS], pending[WB_MAX_WARPS], off[WB_MAX_WARPS];
    bf16* area;
};
__shared__ WbStaging wb_stg;

__device__ __forceinline__ bf16* wb_stage_share(int w) { return wb_stg.area + (long long)w * (WB_STAGING_BYTES / 2 / (WB_THREADS / WB_WARP)); }

__device__ __forceinline__ void wb_stage_init(float* smem) {
    if (wb_lane() == 0) {
        const int w = wb_warp();
        wb_stg.src[w] = nullptr;
        wb_stg.tag[w] = wb_stg.phase[w] = wb_stg.pending[w] = 0;
        wb_stg.off[w] = !WB_BULK_COPY || WB_STAGING_BYTES == 0;
        if (!wb_stg.off[w]) wb_mbar_init(&wb_stg.bar[w], 1);
        if (w == 0) wb_stg.area = (bf16*)(smem + WB_SMEM_STAGING);
    }
    wb_syncthreads();
}

// wait for warp w's phase in flight, at most WB_STAGE_TIMEOUT_NS
__device__ __forceinline__ bool wb_stage_wait(int w) {
    const u32 phase = wb_stg.phase[w];
    if (wb_mbar_test(&wb_stg.bar[w], phase)) return true;
    const u64 t0 = wb_globaltimer_ns();
    while (!wb_mbar_test(&wb_stg.bar[w], phase))
        if (wb_globaltimer_ns() - t0 > WB_STAGE_TIMEOUT_NS) return false;
    return true;
}

// the issuer of warp w: the last issue is waited for (its readers are done with it) and the share is free
__device__ __forceinline__ void wb_stage_retire(int w) {
    if (!wb_stg.pending[w]) return;
    if (!wb_stage_wait(w)) wb_stg.off[w] = 1;
    wb_stg.phase[w] ^= 1u;
    wb_stg.pending[w] = 0;
    wb_stg.src[w] = nullptr;
}

template <bool ACROSS>
__device__ __forceinline__ int unit_of_warp(int w) { return ACROSS ? w * wb_nbid() + wb_bid() : wb_bid() * wb_nwarps() + w; }

// copy the staged part of warp w's first unit of W into its share
template <typename R>
__device__ __forceinline__ void wb_stage_warp(const bf16* __restrict__ W, int w) {
    if constexpr (R::STAGED_ITERS > 0) {
        wb_stage_retire(w);
        const int u = unit_of_warp<R::ACROSS>(w);
        if (wb_stg.off[w] || u >= R::N) return;
        bf16* share = wb_stage_share(w);
        wb_fence_proxy_async();
        wb_mbar_expect_tx(&wb_stg.bar[w], R::NR * R::ROW_BYTES);
#pragma unroll
        for (int r = 0; r < R::NR; ++r)
            wb_bulk_g2s(share + r * R::ROW_PAD, W + ((long long)u * R::NR + r) * R::K, R::ROW_BYTES, &wb_stg.bar[w]);
        wb_stg.src[w] = W; wb_stg.tag[w] = R::TAG; wb_stg.pending[w] = 1;
    }
}

// At the barrier before R's stage, called by every warp's lane 0 (WB_STAGE_AT 0: thread 0 issues for every warp;
// 1: each for its own warp; 2: nothing here, the stage issues).
// Out of line: at six barriers of the step, inlined, it only made the compile slower.
template <typename R>
__device__ __noinline__ void wb_stage_rows(const bf16* __restrict__ W) {
    if (WB_STAGE_AT == 0) {
        if (wb_warp() == 0)
            for (int w = 0; w < wb_nwarps(); ++w) wb_stage_warp<R>(W, w);
    } else if (WB_STAGE_AT == 1) {
        wb_stage_warp<R>(W, wb_warp());
    }
}

// before the kernel ends: no copy may still be landing in a block's shared memory when it exits
__device__ __forceinline__ void wb_stage_drain() {
    if (wb_lane() == 0) wb_stage_retire(wb_warp());
    wb_syncthreads();
}

// whether this warp's first unit of W is staged (and landed); every thread of the warp asks
template <typename R>
__device__ __forceinline__ bool wb_stage_take(const bf16* W) {
    const int w = wb_warp();
    return R::STAGED_ITERS > 0 && wb_stg.src[w] == (const void*)W && wb_stg.tag[w] == R::TAG && wb_stage_wait(w);
}

// out[r] = row r · act, the first STAGED_ITERS loads of each row from the warp's staged copy
template <typename R>
__device__ __forceinline__ void warp_rows_dot_staged(const bf16* __restrict__ staged, const bf16* __restrict__ row0,
                                                     const float* __restrict__ act, float (&out)[R::NR]) {
    using L = typename R::L;
    constexpr int K = R::K, NR = R::NR;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll L::CHUNKS_UNROLLED
    for (int i0 = 0; i0 < R::STAGED_ITERS; i0 += L::UNROLL) {
        wb_u4 w[NR][L::UNROLL];
#pragma unroll
        for (int u = 0; u < L::UNROLL; ++u) {
            const int k = (i0 + u) * L::STEP + wb_lane() * 8;
            if (i0 + u < L::ITERS && (K % L::STEP == 0 || k < K)) {
#pragma unroll
                for (int r = 0; r < NR; ++r) w[r][u] = *(const wb_u4*)(staged + r * R::ROW_PAD + k);
            }
        }
        warp_rows_fma<K, NR>(w, i0, act, acc);
    }
    if (R::STAGED_ITERS < L::ITERS) warp_rows_acc<K, NR>(row0, K, act, acc, R::STAGED_ITERS);
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = wb_warp_sum(acc[r]);
}

// A weight stage: the block's `prologue` fills `act`, then this warp's units of W (R: see WarpRows), each result
// handed to `done(unit, y[NR])`, the stage's epilogue. The warp's first unit comes from the staging area when the
// barrier before staged it.
template <typename R, typename Prologue, typename Done>
__device__ __forceinline__ void for_warp_units(const bf16* __restrict__ W, const float* act, Prologue prologue,
                                               Done done) {
    if (WB_STAGE_AT == 2 && wb_lane() == 0) wb_stage_warp<R>(W, wb_warp());   // lands while the prologue runs
    prologue();                                        // block-wide: every thread takes part
    float y[R::NR];
    int u = grid_warp<R::ACROSS>();
    if (u < R::N && wb_stage_take<R>(W)) {
        warp_rows_dot_staged<R>(wb_stage_share(wb_warp()), W + (long long)u * R::NR * R::K, act, y);
        done(u, y);
        u += grid_nwarps();
    }
    for (; u < R::N; u += grid_nwarps()) {
        warp_rows_dot<R::K, R::NR>(W + (long long)u * R::NR * R::K, R::K, act, y);
        done(u, y);
    }
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



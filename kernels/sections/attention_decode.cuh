// o = softmax(q·Kᵀ/√hd)·V for every query head, over the cache positions 0..pos (grouped-query attention).
//
// The positions are split into S chunks per kv head so that Hkv·S blocks share the work (S grows with pos, up to
// about one block per SM). One block reads each K/V row once for all the query heads of its group. Inside a block,
// a warp works on PPW positions at a time (a group of LG lanes each, one 16-byte load of k and of v per lane) with
// an online softmax; warps, then blocks, are merged with the usual (max, sum, acc) rescaling. The last block to
// finish a kv head (an arrival counter) merges the S partials, so no extra grid barrier is spent on the reduction.
#pragma once

constexpr int ATT_GQ = WB_HEADS / WB_KV_HEADS;      // query heads per kv head
constexpr int att_pow2_at_least(int n) { return n <= 1 ? 1 : 2 * att_pow2_at_least((n + 1) / 2); }
// A position's hd/8 lanes, rounded up to a power of two: the shuffle reductions pair lanes by xor, which needs
// aligned power-of-two groups. For hd = 96 that is 16 lanes of which 12 hold dims; the other 4 add zeros.
constexpr int ATT_LPP = WB_HEAD_DIM / 8;            // lanes holding dims of one position
constexpr int ATT_LG = att_pow2_at_least(ATT_LPP);  // lanes per position group
constexpr int ATT_PPW = WB_WARP / ATT_LG;           // positions per warp at a time
static_assert(WB_HEAD_DIM % 8 == 0 && ATT_LG <= WB_WARP, "a position's dims fit one warp, 8 per lane");
static_assert(WB_SMEM_ATTENTION_DECODE_Q_FLOATS >= ATT_GQ * WB_HEAD_DIM &&
              WB_SMEM_ATTENTION_DECODE_WARPS_FLOATS >= (WB_THREADS / WB_WARP) * ATT_GQ * (WB_HEAD_DIM + 2),
              "the plan's regions hold the group's queries and every warp's (m, l, acc) per head");

__device__ __forceinline__ int attn_splits(int n, int max_splits) {
    int s = (n + WB_ATTN_MIN_CHUNK - 1) / WB_ATTN_MIN_CHUNK;
    return s < max_splits ? s : max_splits;
}

// exp(m - M), with an empty state (m = -inf) weighing nothing
__device__ __forceinline__ float att_rescale(float m, float M) { return m == -WB_INF ? 0.f : wb_exp(m - M); }

// Merge the per-warp states (m, l, acc) of query head g, dimension d: max, rescaled sum, rescaled accumulator
__device__ __forceinline__ void att_merge_warps(const float* ws, int g, int d, float& M, float& L, float& A) {
    constexpr int HD = WB_HEAD_DIM;
    M = -WB_INF;
    for (int w = 0; w < wb_nwarps(); ++w) M = wb_fmaxf(M, ws[(w * ATT_GQ + g) * (HD + 2)]);
    L = 0.f; A = 0.f;
    for (int w = 0; w < wb_nwarps(); ++w) {
        const float* st = ws + (w * ATT_GQ + g) * (HD + 2);
        const float e = att_rescale(st[0], M);
        L += st[1] * e;
        A += st[2 + d] * e;
    }
}

// k_cache, v_cache: this layer's [Hkv, max_seq, hd]. attn_part [Hq, max_splits, hd + 2] and attn_count [Hkv]
// carry the split partials to the block that merges them.
WB_SECTION void stage_attention_decode(const float* q, const bf16* k_cache, const bf16* v_cache, int layer, int pos,
                                       int max_splits, float* smem, float* o, float* attn_part, u32* attn_count) {
    constexpr int HD = WB_HEAD_DIM;
    const int n = pos + 1, S = attn_splits(n, max_splits), chunk = (n + S - 1) / S;
    const int item = wb_bid();
    if (item >= WB_KV_HEADS * S) return;
    const int kvh = item / S, split = item % S;
    const int start = split * chunk, end = start + chunk < n ? start + chunk : n;

    float* qs = smem + WB_SMEM_ATTENTION_DECODE_Q;      // [GQ][HD], pre-scaled by 1/sqrt(hd)
    float* ws = smem + WB_SMEM_ATTENTION_DECODE_WARPS;  // per warp, per head: m, l, acc[HD]
    const float scale = wb_rsqrt((float)HD);
    for (int i = wb_tid(); i < ATT_GQ * HD; i += wb_ntid()) qs[i] = wb_ld_cg(q + kvh * ATT_GQ * HD + i) * scale;
    wb_syncthreads();

    const int lane = wb_lane(), sub = lane / ATT_LG, d0 = (lane % ATT_LG) * 8;
    const bool holds = ATT_LG == ATT_LPP || d0 < HD;    // false only for the padding lanes of a group
    const long long base = (long long)kvh * WB_MAX_SEQ * HD;
    const bf16* K = k_cache + base;
    const bf16* V = v_cache + base;
    float m[ATT_GQ], l[ATT_GQ], acc[ATT_GQ][8];
#pragma unroll
    for (int g = 0; g < ATT_GQ; ++g) {
        m[g] = -WB_INF; l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    }
    // the loop bound is uniform over the warp (shuffles need every lane); lanes past `end` only watch
    for (int t0 = start + wb_warp() * ATT_PPW; t0 < end; t0 += wb_nwarps() * ATT_PPW) {
        const int t = t0 + sub;
        const bool valid = t < end;
        wb_u4 kk = {0, 0, 0, 0}, vv = {0, 0, 0, 0};
        if (valid && holds) { kk = wb_ld_cg_u4(K + (long long)t * HD + d0); vv = wb_ld_cg_u4(V + (long long)t * HD + d0); }
        float vf[8] = {bf16_lo(vv.x), bf16_hi(vv.x), bf16_lo(vv.y), bf16_hi(vv.y),
                       bf16_lo(vv.z), bf16_hi(vv.z), bf16_lo(vv.w), bf16_hi(vv.w)};
#pragma unroll
        for (int g = 0; g < ATT_GQ; ++g) {
            const float s = wb_warp_sum<ATT_LG>(holds ? wb_dot8(kk, qs + g * HD + d0, 0.f) : 0.f);
            if (valid) {
                const float mn = wb_fmaxf(m[g], s), c = att_rescale(m[g], mn), p = wb_exp(s - mn);
                l[g] = l[g] * c + p;
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * c + p * vf[j];
                m[g] = mn;
            }
        }
    }
    // merge the PPW position groups of the warp (lanes with the same dims, differing in `sub`)
#pragma unroll
    for (int mask = ATT_LG; mask < WB_WARP; mask <<= 1) {
#pragma unroll
        for (int g = 0; g < ATT_GQ; ++g) {
            const float mo = wb_shfl_xor(m[g], mask), lo = wb_shfl_xor(l[g], mask);
            const float M = wb_fmaxf(m[g], mo), a = att_rescale(m[g], M), b = att_rescale(mo, M);
            l[g] = l[g] * a + lo * b;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * a + wb_shfl_xor(acc[g][j], mask) * b;
            m[g] = M;
        }
    }
    if (sub == 0 && holds) {
#pragma unroll
        for (int g = 0; g < ATT_GQ; ++g) {
            float* w = ws + (wb_warp() * ATT_GQ + g) * (HD + 2);
            if (d0 == 0) { w[0] = m[g]; w[1] = l[g]; }
#pragma unroll
            for (int j = 0; j < 8; ++j) w[2 + d0 + j] = acc[g][j];
        }
    }
    wb_syncthreads();
    // merge the warps; with one split that is the answer, else this block's partial for (head, split)
    if (S == 1) {
        for (int i = wb_tid(); i < ATT_GQ * HD; i += wb_ntid()) {
            const int g = i / HD, d = i % HD;
            float M, L, A;
            att_merge_warps(ws, g, d, M, L, A);
            o[(kvh * ATT_GQ + g) * HD + d] = A / L;
        }
        return;
    }
    for (int i = wb_tid(); i < ATT_GQ * HD; i += wb_ntid()) {
        const int g = i / HD, d = i % HD;
        float M, L, A;
        att_merge_warps(ws, g, d, M, L, A);
        const int hs = (kvh * ATT_GQ + g) * max_splits + split;
        attn_part[(long long)hs * (HD + 2) + 2 + d] = A;
        if (d == 0) { attn_part[(long long)hs * (HD + 2)] = M; attn_part[(long long)hs * (HD + 2) + 1] = L; }
    }
    // the last of the S blocks of this kv head merges all splits
    __shared__ int last;
    wb_fence_gpu();
    wb_syncthreads();
    if (wb_tid() == 0) {
        last = wb_atomic_add(attn_count + kvh, 1u) == (u32)(S - 1);
        if (last) { attn_count[kvh] = 0; wb_fence_gpu(); }      // ready for the next layer (after a barrier)
    }
    wb_syncthreads();
    if (!last) return;
    for (int i = wb_tid(); i < ATT_GQ * HD; i += wb_ntid()) {
        const int g = i / HD, d = i % HD;
        const float* part = attn_part + (long long)(kvh * ATT_GQ + g) * max_splits * (HD + 2);
        float M = -WB_INF;
        for (int s = 0; s < S; ++s) M = wb_fmaxf(M, wb_ld_cg(part + s * (HD + 2)));
        float L = 0.f, A = 0.f;
        for (int s = 0; s < S; ++s) {
            const float e = att_rescale(wb_ld_cg(part + s * (HD + 2)), M);
            L += wb_ld_cg(part + s * (HD + 2) + 1) * e;
            A += wb_ld_cg(part + s * (HD + 2) + 2 + d) * e;
        }
        o[(kvh * ATT_GQ + g) * HD + d] = A / L;
    }
}

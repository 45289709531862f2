// o = softmax(q·Kᵀ/√hd)·V for every query head, over the cache positions 0..pos (grouped-query attention).
//
// The positions are split into S chunks per kv head so that Hkv·S blocks share the work (S grows with pos, up to
// about one block per SM). One block reads each K/V row once for all the query heads of its group. The last block
// to finish a kv head (an arrival counter) merges the S partials, so no extra grid barrier is spent on the
// reduction. Inside a block, each warp keeps an online softmax (max, sum, acc) per query head over its positions,
// and the warps are merged with the usual rescaling.
//
// On NVIDIA a warp takes 16 positions at a time (a step) and multiplies on the tensor cores: Sᵀ = K·Qᵀ (16
// positions × the group's heads, padded to 8), then Oᵀ += Vᵀ·Pᵀ. Its steps reach shared memory through the
// warp's own ring of WB_ATTN_BUFS steps, filled by asynchronous 16-byte copies, so a warp never waits on a load
// it could have issued earlier and never waits for another warp. The fp32 path it replaces (each position's dot
// products, shuffle sums, exps and rescaling on the CUDA cores, 8 lanes a position) was bound by its instruction
// issue: it took 20 µs a layer for a block's 1,000 positions at 16k with its K/V already in shared memory.
//
// Precision (held to the fp32 tolerance, model.stage_math.ATTENTION): K and V are bf16 in the cache, so they enter the
// products exactly; the scaled queries and the probabilities are split as hi + mid + lo, three bf16 whose sum is
// within ~2⁻²⁵ of the fp32 value, and all three are multiplied (accumulating in fp32), so the products sit at
// fp32's own level. Two parts (2⁻¹⁷) would pass too: the queries cut to two were not caught on the 1B (every
// stage output stayed inside its bound), so the third part is margin, bought with one more mma per 16 dims.
//
// AMD (no mma.sync): the fp32 path, reading K/V straight to registers.
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
constexpr int ATT_MERGE = 8;                        // splits whose partials the merging block loads at once

// One block alone up to WB_ATTN_SINGLE positions (no merge to pay), else chunks of at least WB_ATTN_MIN_CHUNK
__device__ __forceinline__ int attn_splits(int n, int max_splits) {
    if (n <= WB_ATTN_SINGLE) return 1;
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


#if WB_HAS_MMA
constexpr int ATT_KK = WB_HEAD_DIM / 16;            // 16-wide steps of head_dim
constexpr int ATT_CH = WB_HEAD_DIM / 8;             // 16-byte copies a K (or V) row
constexpr int ATT_RING = 2 * WB_ATTN_STEP * WB_ATTN_KS;   // bf16 a step: its K rows, then its V rows
static_assert(WB_HEAD_DIM % 16 == 0 && ATT_GQ <= 8 && WB_ATTN_STEP == 16,
              "head_dim in 16-wide steps; the group's query heads are the 8 columns of one mma tile");
static_assert(WB_ATTN_WARPS >= 1, "attn_kv_bytes holds no warp's ring of K/V steps: raise it (only the AMD build, "
              "which has no ring, goes without)");
static_assert(WB_ATTN_WARPS <= WB_THREADS / WB_WARP && WB_ATTN_BUFS >= 2 &&
              2 * WB_SMEM_ATTENTION_DECODE_KV_FLOATS >= WB_ATTN_WARPS * WB_ATTN_BUFS * ATT_RING &&
              WB_SMEM_ATTENTION_DECODE_Q_FLOATS >= ATT_KK * 6 * WB_WARP &&
              WB_SMEM_ATTENTION_DECODE_SRC_FLOATS >= 4 * WB_ATTN_WARPS && WB_SMEM_ATTENTION_DECODE_SRC % 2 == 0,
              "the plan's regions hold every reading warp's ring, its K/V addresses and the queries' fragments");

// x ≈ hi + mid + lo for a pair of elements, three bf16 pairs, each part the rounded rest of the one before (the
// rests are exact in fp32)
__device__ __forceinline__ void att_split3(float x0, float x1, u32* part) {
    part[0] = wb_pack_bf16x2(x0, x1);
    const float r0 = x0 - bf16_lo(part[0]), r1 = x1 - bf16_hi(part[0]);
    part[1] = wb_pack_bf16x2(r0, r1);
    part[2] = wb_pack_bf16x2(r0 - bf16_lo(part[1]), r1 - bf16_hi(part[1]));
}

// This warp's (m, l, acc) over its steps of the chunk (`left` positions from K and V) into ws. qf: the scaled
// queries as B fragments of Qᵀ, [ATT_KK][6][lane] words: rows 2t, 2t+1 then 2t+8, 2t+9 of column g (head g of the
// group, zero past it), each as hi, mid, lo, which `load_q` (block-wide) fills after the warp's first steps are
// issued: K and V do not depend on the queries, so the cache's latency runs beside the queries' trip to L2
// instead of after it.
template <typename LoadQ>
__device__ __forceinline__ void att_warp_mma(const bf16* K, const bf16* V, int left, const u32* qf, bf16* rings,
                                             const bf16* volatile* src, float* ws, LoadQ load_q) {
    constexpr int HD = WB_HEAD_DIM, KS = WB_ATTN_KS, AW = WB_ATTN_WARPS;
    const int w = wb_warp(), lane = wb_lane(), g = lane >> 2, t = lane & 3;
    const int steps = (left + WB_ATTN_STEP - 1) / WB_ATTN_STEP;
    const int mine = w < AW && w < steps ? (steps - w + AW - 1) / AW : 0;    // steps w, w + AW, ...
    bf16* ring = rings + w * WB_ATTN_BUFS * ATT_RING;
    // K and V are read back from shared memory at each refill: held in registers across the loop, they pushed the
    // kernel past its 128 (8 B of spills with head_dim 128). src, like the rings, holds WB_ATTN_WARPS warps'.
    if (mine > 0 && lane == 0) { src[2 * w] = K; src[2 * w + 1] = V; }
    wb_syncwarp();
    // the warp's j-th step into buffer j % BUFS; rows past the chunk land as zeros (their scores are masked, and a
    // zero value row keeps 0·x from meeting a stale NaN)
    auto issue = [&](int j) {
        bf16* kb = ring + (j % WB_ATTN_BUFS) * ATT_RING;
        const int k0 = (w + j * AW) * WB_ATTN_STEP;
        const bf16* Ks = src[2 * w];
        const bf16* Vs = src[2 * w + 1];
#pragma unroll 1
        for (int c = lane; c < WB_ATTN_STEP * ATT_CH; c += WB_WARP) {
            const int r = c / ATT_CH, d = (c % ATT_CH) * 8;
            const bool valid = k0 + r < left;
            const long long at = valid ? (long long)(k0 + r) * HD + d : 0;
            wb_cp_async16(kb + r * KS + d, Ks + at, valid);
            wb_cp_async16(kb + (WB_ATTN_STEP + r) * KS + d, Vs + at, valid);
        }
    };
    // a group is committed for every step, real or not, so that "all but the newest BUFS - 2" is always step j
#pragma unroll
    for (int j = 0; j < WB_ATTN_BUFS - 1; ++j) {
        if (j < mine) issue(j);
        wb_cp_async_commit();
    }
    load_q();
    float o[ATT_KK][4];                 // Oᵀ: rows d = 16mt + g (+8), columns heads 2t, 2t + 1
#pragma unroll
    for (int mt = 0; mt < ATT_KK; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float m0 = -WB_INF, m1 = -WB_INF, l0 = 0.f, l1 = 0.f;     // heads 2t, 2t + 1; l: this lane's positions only
    for (int j = 0; j < mine; ++j) {
        wb_cp_async_wait<WB_ATTN_BUFS - 2>();      // this lane's copies of step j are in
        wb_syncwarp();                              // and every lane's; all are done with step j - 1's buffer
        if (j + WB_ATTN_BUFS - 1 < mine) issue(j + WB_ATTN_BUFS - 1);
        wb_cp_async_commit();
        const bf16* kb = ring + (j % WB_ATTN_BUFS) * ATT_RING;
        const bf16* vb = kb + WB_ATTN_STEP * KS;
        const int k0 = (w + j * AW) * WB_ATTN_STEP;
        // Sᵀ = K·Qᵀ: positions g, g + 8 of the step, heads 2t, 2t + 1
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < ATT_KK; ++kk) {
            u32 a[4];
            wb_ldmatrix_x4(a, kb + (((lane >> 3) & 1) * 8 + (lane & 7)) * KS + kk * 16 + (lane >> 4) * 8);
            const u32* f = qf + kk * 6 * WB_WARP + lane;
#pragma unroll
            for (int part = 0; part < 3; ++part) {
                const u32 b[2] = {f[part * WB_WARP], f[(3 + part) * WB_WARP]};
                wb_mma_bf16_16816(s, a, b);
            }
        }
        if (k0 + g >= left) s[0] = s[1] = -WB_INF;
        if (k0 + g + 8 >= left) s[2] = s[3] = -WB_INF;
        // each head's max over the step (the 8 lanes of a column), then the online softmax
        float x0 = wb_fmaxf(s[0], s[2]), x1 = wb_fmaxf(s[1], s[3]);
#pragma unroll
        for (int mask = 4; mask < WB_WARP; mask <<= 1) {
            x0 = wb_fmaxf(x0, wb_shfl_xor(x0, mask));
            x1 = wb_fmaxf(x1, wb_shfl_xor(x1, mask));
        }
        const float n0 = wb_fmaxf(m0, x0), n1 = wb_fmaxf(m1, x1);
        const float c0 = att_rescale(m0, n0), c1 = att_rescale(m1, n1);
        s[0] = wb_exp(s[0] - n0); s[2] = wb_exp(s[2] - n0);
        s[1] = wb_exp(s[1] - n1); s[3] = wb_exp(s[3] - n1);
        l0 = l0 * c0 + s[0] + s[2];
        l1 = l1 * c1 + s[1] + s[3];
        m0 = n0; m1 = n1;
#pragma unroll
        for (int mt = 0; mt < ATT_KK; ++mt) { o[mt][0] *= c0; o[mt][1] *= c1; o[mt][2] *= c0; o[mt][3] *= c1; }
        // P as B fragments (positions × heads): the score tile's two 8×8 halves transposed in the registers
        u32 pg[3], pg8[3], b[3][2];
        att_split3(s[0], s[1], pg);
        att_split3(s[2], s[3], pg8);
#pragma unroll
        for (int part = 0; part < 3; ++part) { b[part][0] = wb_movmatrix_trans(pg[part]); b[part][1] = wb_movmatrix_trans(pg8[part]); }
        // Oᵀ += Vᵀ·P: Vᵀ's A fragments come transposed out of the row-major value rows
#pragma unroll
        for (int mt = 0; mt < ATT_KK; ++mt) {
            u32 a[4];
            wb_ldmatrix_x4_trans(a, vb + ((lane >> 4) * 8 + (lane & 7)) * KS + mt * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int part = 0; part < 3; ++part) wb_mma_bf16_16816(o[mt], a, b[part]);
        }
    }
#pragma unroll
    for (int mask = 4; mask < WB_WARP; mask <<= 1) { l0 += wb_shfl_xor(l0, mask); l1 += wb_shfl_xor(l1, mask); }
    // a warp with no steps writes the empty state (m = -inf weighs nothing in the merge)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int h = 2 * t + c;
        if (h >= ATT_GQ) continue;
        float* st = ws + (w * ATT_GQ + h) * (HD + 2);
        if (g == 0) { st[0] = c ? m1 : m0; st[1] = c ? l1 : l0; }
#pragma unroll
        for (int mt = 0; mt < ATT_KK; ++mt) { st[2 + mt * 16 + g] = o[mt][c]; st[2 + mt * 16 + g + 8] = o[mt][2 + c]; }
    }
}
#endif

#if !WB_HAS_MMA
// This warp's (m, l, acc) over its positions of the chunk into ws, on the CUDA cores: PPW positions at a time (a
// group of LG lanes each, one 16-byte load of k and of v per lane) with an online softmax, then the position groups
// merged by shuffles.
__device__ __forceinline__ void att_warp_plain(const bf16* K, const bf16* V, int left, const float* qs, float* ws) {
    constexpr int HD = WB_HEAD_DIM;
    const int lane = wb_lane(), sub = lane / ATT_LG, d0 = (lane % ATT_LG) * 8;
    const bool holds = ATT_LG == ATT_LPP || d0 < HD;    // false only for the padding lanes of a group
    float m[ATT_GQ], l[ATT_GQ], acc[ATT_GQ][8];
#pragma unroll
    for (int g = 0; g < ATT_GQ; ++g) {
        m[g] = -WB_INF; l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    }
    // the loop bound is uniform over the warp (shuffles need every lane); lanes past the chunk only watch
    for (int t0 = wb_warp() * ATT_PPW; t0 < left; t0 += wb_nwarps() * ATT_PPW) {
        const int t = t0 + sub;
        const bool valid = t < left;
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
}
#endif

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
    // this block's chunk of the cache: end - start positions from K[0] and V[0]
    const long long base = ((long long)kvh * WB_MAX_SEQ + start) * HD;
    const bf16* K = k_cache + base;
    const bf16* V = v_cache + base;

    float* ws = smem + WB_SMEM_ATTENTION_DECODE_WARPS;  // per warp, per head: m, l, acc[HD]
    const float scale = wb_rsqrt((float)HD);
#if WB_HAS_MMA
    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);
    auto load_q = [&] {                               // after the first K/V steps are issued
        for (int i = wb_tid(); i < ATT_KK * WB_WARP; i += wb_ntid()) {
            const int kk = i / WB_WARP, g = (i % WB_WARP) >> 2, t = i & 3, d = kk * 16 + 2 * t;
            const float* qh = q + (kvh * ATT_GQ + g) * HD;
            const bool real = g < ATT_GQ;
            u32* f = qf + kk * 6 * WB_WARP + i % WB_WARP;
            u32 lo[3], hi[3];
            att_split3(real ? wb_ld_cg(qh + d) * scale : 0.f, real ? wb_ld_cg(qh + d + 1) * scale : 0.f, lo);
            att_split3(real ? wb_ld_cg(qh + d + 8) * scale : 0.f, real ? wb_ld_cg(qh + d + 9) * scale : 0.f, hi);
#pragma unroll
            for (int part = 0; part < 3; ++part) { f[part * WB_WARP] = lo[part]; f[(3 + part) * WB_WARP] = hi[part]; }
        }
        wb_syncthreads();
    };
    att_warp_mma(K, V, end - start, qf, (bf16*)(smem + WB_SMEM_ATTENTION_DECODE_KV),
                 (const bf16* volatile*)(smem + WB_SMEM_ATTENTION_DECODE_SRC), ws, load_q);
#else
    float* qs = smem + WB_SMEM_ATTENTION_DECODE_Q;      // [GQ][HD], pre-scaled by 1/sqrt(hd)
    for (int i = wb_tid(); i < ATT_GQ * HD; i += wb_ntid()) qs[i] = wb_ld_cg(q + kvh * ATT_GQ * HD + i) * scale;
    wb_syncthreads();
    att_warp_plain(K, V, end - start, qs, ws);
#endif
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
        // ATT_MERGE splits' (m, l, acc[d]) loaded at once, then folded in: one trip to L2 per ATT_MERGE splits
        // where a loop over the splits waited on each load it summed
        float M = -WB_INF, L = 0.f, A = 0.f;
        for (int s0 = 0; s0 < S; s0 += ATT_MERGE) {
            float pm[ATT_MERGE], pl[ATT_MERGE], pa[ATT_MERGE];
#pragma unroll
            for (int j = 0; j < ATT_MERGE; ++j) {
                const float* ps = part + (s0 + j) * (HD + 2);
                const bool in = s0 + j < S;
                pm[j] = in ? wb_ld_cg(ps) : -WB_INF;
                pl[j] = in ? wb_ld_cg(ps + 1) : 0.f;
                pa[j] = in ? wb_ld_cg(ps + 2 + d) : 0.f;
            }
            float Mn = M;
#pragma unroll
            for (int j = 0; j < ATT_MERGE; ++j) Mn = wb_fmaxf(Mn, pm[j]);
            const float c = att_rescale(M, Mn);
            L *= c; A *= c;
#pragma unroll
            for (int j = 0; j < ATT_MERGE; ++j) {
                const float e = att_rescale(pm[j], Mn);
                L += pl[j] * e;
                A += pa[j] * e;
            }
            M = Mn;
        }
        o[(kvh * ATT_GQ + g) * HD + d] = A / L;
    }
}

// spin-in-attention (below): o_proj loads early by default, so the other blocks enter it, issue their first
// loads and wait at the barrier after attention inside it; the picture must show them waiting there, and
// block 4 alone inside its stage.
/* wb:checks
mutant merge-drops-last-split: the split merge leaves out the last split (only S ≥ 2)
-const bool in = s0 + j < S;
+const bool in = s0 + j < S - 1;

mutant attn-ring-skips-step: a warp's third step is never fetched (the ring's refill re-fetches the step in flight): only where a warp has three steps of a chunk
-if (j + WB_ATTN_BUFS - 1 < mine) issue(j + WB_ATTN_BUFS - 1);
+if (j + WB_ATTN_BUFS - 1 < mine) issue(j + WB_ATTN_BUFS - 2);

mutant attn-step-tail-unmasked: the first position past a chunk's end is not masked (a zero key and value weigh in): only where a chunk ends inside a step
-if (k0 + g + 8 >= left) s[2] = s[3] = -WB_INF;
+if (k0 + g + 8 > left) s[2] = s[3] = -WB_INF;

mutant gqa-wrong-head: a kv head reads the next group's queries
-const float* qh = q + (kvh * ATT_GQ + g) * HD;
+const float* qh = q + (((kvh + 1) % WB_KV_HEADS) * ATT_GQ + g) * HD;

mutant attn-scale-1e-4: scores scaled 1e-4 too much
-const float scale = wb_rsqrt((float)HD);
+const float scale = wb_rsqrt((float)HD) * 1.0001f;

mutant attn-long-context-short: from 4,096 on, the newest position is left out
-const int n = pos + 1, S
+const int n = pos + (pos >= 4096 ? 0 : 1), S

mutant softmax-no-rescale: the running sum is not rescaled when the max grows
-l0 = l0 * c0 + s[0] + s[2];
+l0 = l0 + s[0] + s[2];

mutant merge-warps-drops-first: the warp merge leaves out the first warp's sum (the last warps read no positions on NVIDIA, so leaving out the last one changed nothing)
-    for (int w = 0; w < wb_nwarps(); ++w) {
-        const float* st
+    for (int w = 1; w < wb_nwarps(); ++w) {
+        const float* st

inject spin-in-attention [expect=hang, block=4, alone]: block 4 spins in attention while the others wait inside o_proj
-    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);
+    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);
+    if (wb_bid() == 4) { volatile u32* never = qf; if (wb_tid() == 0) *never = 0;
+                         while (*never == 0) { } }

inject too-much-shared [expect=compile error]: asks for 256 KB of static shared memory
-    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);
+    __shared__ float huge[64 * 1024];
+    huge[wb_tid()] = 1.f;
+    u32* qf = (u32*)(smem + WB_SMEM_ATTENTION_DECODE_Q);
+    if (huge[(wb_tid() * 7) % 1024] == 2.f) o[0] = 0.f;
*/

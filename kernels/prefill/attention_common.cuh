// What both prefill attention kernels (attention.cuh on mma.sync, attention_wgmma.cuh on sm_90a's warpgroup
// products) do alike, on the fragments the two instructions share: a lane holds two rows of a 16-row fragment
// (g and g + 8 of it) and, for each 8 columns j, the pair (row a: [4j], [4j+1]; row b: [4j+2], [4j+3]) at columns
// 8j + 2t, 8j + 2t + 1. attention.cuh argues the precision of both.

// The kernels' parameters, in the order workbench/run/prefill_gpu.flash_attention passes them:
// q [n, Hq·hd], the rows' queries, RoPE applied; k, v [Hkv, kv_stride, hd], this layer's keys and values, the
// kernel's cache (bf16); pos [n], row r attends to keys 0..pos[r] (< kv_stride); out [n, Hq·hd].
#define PA_PARAMS const float* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, \
    const long long* __restrict__ pos, float* __restrict__ out, int n, int kv_stride, int n_heads, int group,  \
    float scale

// WB_PA_HEAVY_FIRST: the grid is (heads, row tiles) and the last row tiles, whose rows see the most keys, go first,
// every head's before any head's next: the blocks are dispatched in that order, so the causal triangle's longest
// blocks start early and its shortest fill the end, instead of a last wave of one head's longest
#ifndef WB_PA_HEAVY_FIRST
#define WB_PA_HEAVY_FIRST 0
#endif
#ifndef WB_PA_HALVES
#define WB_PA_HALVES 2
#endif
static_assert(WB_PA_HALVES == 1 || WB_PA_HALVES == 2, "bf16 halves of the queries and probabilities: 1 or 2");
// WB_PA_EXP_FTZ 1: the softmax's exps flush results below 2⁻¹²⁶ to zero (wb_exp_ftz); wherever __expf's result is
// normal the two give the same bits. A flushed probability is ≥ 2¹²⁶ times smaller than the row's largest, which
// is 1; a flushed rescale factor (ca, cb) zeroes what the row had summed before a max 87 or more above it, which is
// as small against the new terms. Every term lost is below 2⁻¹²⁶ against a row sum that ends ≥ 1 (one lane's part
// may be smaller, but the row's is what the output is divided by), so neither the sum nor the output moves at
// fp32's precision: the same bits in all but contrived rows, for about a third of the softmax's instructions.
#ifndef WB_PA_EXP_FTZ
#define WB_PA_EXP_FTZ 0
#endif
__device__ __forceinline__ float pa_exp(float x) { return WB_PA_EXP_FTZ ? wb_exp_ftz(x) : wb_exp(x); }

// x ≈ hi + lo, both bf16 (|x − hi − lo| ≤ 2⁻¹⁷|x|), for a pair of operand elements: hi rounded, lo the rounded
// rest (x − hi is exact in fp32). With one half, hi alone (lo is never read, and the compiler drops it).
__device__ __forceinline__ void pa_split(float x0, float x1, u32& hi, u32& lo) {
    hi = wb_pack_bf16x2(x0, x1);
    lo = WB_PA_HALVES == 2 ? wb_pack_bf16x2(x0 - bf16_lo(hi), x1 - bf16_hi(hi)) : 0u;
}

// One key tile's scores s (NT groups of 8 keys from j0) of the lane's rows a and b (positions pa, pb) into the
// running softmax, in three steps that pa_softmax_tile takes in this order and a kernel with a product still adding
// into the output o takes apart (pa_softmax_scores, then pa_rescale once the product has landed):
// pa_softmax_max: the causal mask where the tile reaches past the warp's first row position `first` (`keys` keys a
// tile), each row's new max over the four lanes that hold it, the factors (ca, cb) from the old max to it, and the
// sums (la, lb: this lane's part) rescaled by them;
template <int NT>
__device__ __forceinline__ void pa_softmax_max(float* s, int j0, int keys, int first, int pa, int pb, int t,
                                               float& ma, float& mb, float& la, float& lb, float& ca, float& cb) {
    if (j0 + keys - 1 > first) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int key = j0 + nt * 8 + 2 * t + c;
                if (key > pa) s[4 * nt + c] = -WB_INF;
                if (key > pb) s[4 * nt + 2 + c] = -WB_INF;
            }
        }
    }
    float xa = ma, xb = mb;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        xa = wb_fmaxf(xa, wb_fmaxf(s[4 * nt], s[4 * nt + 1]));
        xb = wb_fmaxf(xb, wb_fmaxf(s[4 * nt + 2], s[4 * nt + 3]));
    }
    xa = wb_fmaxf(xa, wb_shfl_xor(xa, 1)); xa = wb_fmaxf(xa, wb_shfl_xor(xa, 2));
    xb = wb_fmaxf(xb, wb_shfl_xor(xb, 1)); xb = wb_fmaxf(xb, wb_shfl_xor(xb, 2));
    // key 0 is in every row's first tile, so the max is finite from then on; before it nothing is rescaled
    ca = ma == -WB_INF ? 0.f : pa_exp(ma - xa);
    cb = mb == -WB_INF ? 0.f : pa_exp(mb - xb);
    ma = xa;
    mb = xb;
    la *= ca;
    lb *= cb;
}

// pa_rescale: the output o (OT groups of 8 columns) of rows a and b rescaled to their new max;
template <int OT>
__device__ __forceinline__ void pa_rescale(float* o, float ca, float cb) {
#pragma unroll
    for (int nt = 0; nt < OT; ++nt) {
        o[4 * nt] *= ca; o[4 * nt + 1] *= ca;
        o[4 * nt + 2] *= cb; o[4 * nt + 3] *= cb;
    }
}

// pa_softmax_exp: s turned into the unnormalised probabilities, added to the sums.
template <int NT>
__device__ __forceinline__ void pa_softmax_exp(float* s, float ma, float mb, float& la, float& lb) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[4 * nt] = pa_exp(s[4 * nt] - ma); s[4 * nt + 1] = pa_exp(s[4 * nt + 1] - ma);
        s[4 * nt + 2] = pa_exp(s[4 * nt + 2] - mb); s[4 * nt + 3] = pa_exp(s[4 * nt + 3] - mb);
        la += s[4 * nt] + s[4 * nt + 1];
        lb += s[4 * nt + 2] + s[4 * nt + 3];
    }
}

template <int NT, int OT>
__device__ __forceinline__ void pa_softmax_tile(float* s, float* o, int j0, int keys, int first, int pa, int pb,
                                                int t, float& ma, float& mb, float& la, float& lb) {
    float ca, cb;
    pa_softmax_max<NT>(s, j0, keys, first, pa, pb, t, ma, mb, la, lb, ca, cb);
    pa_rescale<OT>(o, ca, cb);
    pa_softmax_exp<NT>(s, ma, mb, la, lb);
}

// The scores' steps without the output's: its factors (ca, cb) are left for pa_rescale
template <int NT>
__device__ __forceinline__ void pa_softmax_scores(float* s, int j0, int keys, int first, int pa, int pb, int t,
                                                  float& ma, float& mb, float& la, float& lb, float& ca, float& cb) {
    pa_softmax_max<NT>(s, j0, keys, first, pa, pb, t, ma, mb, la, lb, ca, cb);
    pa_softmax_exp<NT>(s, ma, mb, la, lb);
}

// The rows' outputs (OT groups of 8 columns) divided by their sums over the four lanes, written where a row exists
// (row a at out + qa, row b at out + qb, each written only if it is below `rows`).
template <int OT>
__device__ __forceinline__ void pa_write_rows(float* __restrict__ out, const float* o, long long qa, long long qb,
                                              bool a_exists, bool b_exists, int t, float la, float lb) {
    float sa = la, sb = lb;
    sa += wb_shfl_xor(sa, 1); sa += wb_shfl_xor(sa, 2);
    sb += wb_shfl_xor(sb, 1); sb += wb_shfl_xor(sb, 2);
#pragma unroll
    for (int nt = 0; nt < OT; ++nt) {
        const int d = nt * 8 + 2 * t;
        if (a_exists) { out[qa + d] = o[4 * nt] / sa; out[qa + d + 1] = o[4 * nt + 1] / sa; }
        if (b_exists) { out[qb + d] = o[4 * nt + 2] / sb; out[qb + d + 1] = o[4 * nt + 3] / sb; }
    }
}

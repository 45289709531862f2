// Causal attention of the batched prefill (workbench/run/prefill.py), flash-style on the tensor cores: the score
// matrix of a long prompt (n² per head) never leaves the registers. One block takes PA_BM = 64 query rows of one
// query head, and each of its four warps owns 16 of them. Tiles of PA_BN = 64 keys and values pass through shared
// memory as bf16, which loses nothing: the cache holds bf16 values. The running softmax (max, sum) of each row
// stays in the registers of the four lanes that hold the row.
//
// Precision (the prefill is held to the end-to-end tolerance against fp64, check_prefill):
// - Q·Kᵀ: each scaled query is split as hi + lo, two bf16 with |q − hi − lo| ≤ 2⁻¹⁷|q|, and both are multiplied,
//   so the scores are accurate to about 2⁻¹⁷ of their terms, at the cost of two products instead of one.
// - P·V: the probabilities are split the same way. Rounded to one bf16 each (2⁻⁸ relative at most, 2⁻⁹
//   typically, independent across keys), they moved the output by 1.0–1.3e-3 of its size on random inputs
//   (measured: the weighted sum of random values is no larger than its rounding noise), the same order as the bf16
//   cache's own rounding, which is too much to add on top of it. The sum the output is divided by is kept in fp32,
//   from the unrounded weights.
// - A NaN in a query or a key makes its row's output NaN: the max skips it, but exp(NaN) enters the sum.
//
// Set by the launcher (workbench/run/prefill.py): WB_HD (head_dim, a multiple of 16, at most 128: two tiles must fit
// the 48 KB of static shared memory), WB_THREADS and WB_PA_ROWS (the rows a block takes, as its grid counts them).

// The tile, in mma.sync's m16n8k16 fragments: each warp 16 query rows (one fragment's M), a tile 8 fragments' N of keys
#define PA_FRAG_M 16
#define PA_FRAG_N 8
#define PA_WARPS 4
#define PA_BM (PA_WARPS * PA_FRAG_M)
#define PA_BN (8 * PA_FRAG_N)
#define PA_KS (WB_HD + 8)   // row stride of the key tile, in bf16: the 8 keys of a fragment load fall on distinct banks
#define PA_VS (PA_BN + 8)   // row stride of the value tile, stored transposed ([d][key]): a fragment's pair is a word

static_assert(WB_HD % 16 == 0 && WB_HD <= 128, "head_dim: a multiple of 16, at most 128");
static_assert(WB_THREADS == PA_WARPS * WB_WARP, "one warp per 16 query rows");
static_assert(WB_PA_ROWS == PA_BM, "the launcher's grid counts rows in this tile's");

__device__ __forceinline__ u32 pa_pack(float first, float second) {   // a bf16 pair, the first in the low half
    return (u32)f32_to_bf16(first) | ((u32)f32_to_bf16(second) << 16);
}
// x ≈ hi + lo, both bf16 (|x − hi − lo| ≤ 2⁻¹⁷|x|), for a pair of operand elements
__device__ __forceinline__ void pa_split(float x0, float x1, u32& hi, u32& lo) {
    const float h0 = bf16_to_f32(f32_to_bf16(x0)), h1 = bf16_to_f32(f32_to_bf16(x1));
    hi = pa_pack(h0, h1);
    lo = pa_pack(x0 - h0, x1 - h1);
}

extern "C" __global__ void __launch_bounds__(WB_THREADS) prefill_attention(
    const float* __restrict__ q,         // [n, Hq·hd]: the rows' queries, RoPE applied
    const float* __restrict__ k,         // [Hkv, n_ctx, hd]: this layer's keys (bf16 values held in fp32)
    const float* __restrict__ v,         // [Hkv, n_ctx, hd]
    const long long* __restrict__ pos,   // [n]: row r attends to keys 0..pos[r]
    float* __restrict__ out,             // [n, Hq·hd]
    int n, int n_ctx, int n_heads, int group, float scale)
{
    __shared__ __align__(16) bf16 ks[PA_BN * PA_KS];
    __shared__ __align__(16) bf16 vt[WB_HD * PA_VS];
    __shared__ int last_key;
    const int h = blockIdx.y, kvh = h / group;
    const int warp = threadIdx.x / WB_WARP, lane = threadIdx.x % WB_WARP, g = lane >> 2, t = lane & 3;
    const long long stride = (long long)n_heads * WB_HD;              // of q's rows and out's
    // this lane's two rows; a row past n attends to key 0 alone and is not written
    const int ra = blockIdx.x * PA_BM + warp * PA_FRAG_M + g, rb = ra + 8;
    const int pa = ra < n ? (int)pos[ra] : 0, pb = rb < n ? (int)pos[rb] : 0;
    if (threadIdx.x == 0) last_key = 0;
    __syncthreads();
    atomicMax(&last_key, max(pa, pb));                                // two rows a lane: all 64 rows counted

    // the queries as A fragments, one per 16 of head_dim: rows g, g+8; columns 2t, 2t+1 and 2t+8, 2t+9
    u32 qh[WB_HD / 16][4], ql[WB_HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < WB_HD / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = (i & 1) ? rb : ra, col = kk * 16 + 2 * t + ((i & 2) ? 8 : 0);
            float x0 = 0.f, x1 = 0.f;
            if (row < n) {
                const float* p = q + row * stride + h * WB_HD + col;
                x0 = p[0] * scale;
                x1 = p[1] * scale;
            }
            pa_split(x0, x1, qh[kk][i], ql[kk][i]);
        }
    }
    float o[WB_HD / 8][4];
#pragma unroll
    for (int nt = 0; nt < WB_HD / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float ma = -WB_INF, mb = -WB_INF, la = 0.f, lb = 0.f;            // running max and (this lane's part of) sum
    __syncthreads();
    const int tiles = last_key / PA_BN + 1;
    const float* kb = k + (long long)kvh * n_ctx * WB_HD;
    const float* vb = v + (long long)kvh * n_ctx * WB_HD;

    for (int tile = 0; tile < tiles; ++tile) {
        const int j0 = tile * PA_BN;
        // keys past the block's last are zeros: every row masks them, and 0·x is then never 0·NaN
        // the keys: a thread takes 4 consecutive d of one key (rows read whole, pairs stored on distinct banks)
        for (int e = threadIdx.x * 4; e < PA_BN * WB_HD; e += WB_THREADS * 4) {
            const int key = e / WB_HD, d = e % WB_HD;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j0 + key <= last_key) kv = *(const float4*)(kb + (long long)(j0 + key) * WB_HD + d);
            u32* kw = (u32*)(ks + key * PA_KS + d);
            kw[0] = pa_pack(kv.x, kv.y);
            kw[1] = pa_pack(kv.z, kv.w);
        }
        // the values, transposed: consecutive lanes take consecutive keys of the same 4 d, so each of a warp's
        // 16-bit stores into a row of vt covers 16 consecutive words (taken d-major, as the keys are, the lanes'
        // rows of vt were 4·PA_VS apart, on two banks: a 16-way conflict)
        for (int e = threadIdx.x; e < PA_BN * (WB_HD / 4); e += WB_THREADS) {
            const int key = e % PA_BN, d = (e / PA_BN) * 4;
            float4 vv = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j0 + key <= last_key) vv = *(const float4*)(vb + (long long)(j0 + key) * WB_HD + d);
            vt[(d + 0) * PA_VS + key] = f32_to_bf16(vv.x);
            vt[(d + 1) * PA_VS + key] = f32_to_bf16(vv.y);
            vt[(d + 2) * PA_VS + key] = f32_to_bf16(vv.z);
            vt[(d + 3) * PA_VS + key] = f32_to_bf16(vv.w);
        }
        __syncthreads();

        // S = Q·Kᵀ, the warp's 16 rows × 64 keys as 8 tiles of 8 keys; B[d][key] = K[key][d]
        float s[PA_BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < PA_BN / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < WB_HD / 16; ++kk) {
                const bf16* kp = ks + (nt * 8 + g) * PA_KS + kk * 16 + 2 * t;
                const u32 b[2] = {*(const u32*)kp, *(const u32*)(kp + 8)};
                wb_mma_bf16_16816(s[nt], qh[kk], b);
                wb_mma_bf16_16816(s[nt], ql[kk], b);
            }
        }
        // the causal mask, and each row's new max over the four lanes that hold it
        float xa = ma, xb = mb;
#pragma unroll
        for (int nt = 0; nt < PA_BN / 8; ++nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int key = j0 + nt * 8 + 2 * t + c;
                if (key > pa) s[nt][c] = -WB_INF;
                if (key > pb) s[nt][2 + c] = -WB_INF;
                xa = wb_fmaxf(xa, s[nt][c]);
                xb = wb_fmaxf(xb, s[nt][2 + c]);
            }
        }
        xa = wb_fmaxf(xa, wb_shfl_xor(xa, 1)); xa = wb_fmaxf(xa, wb_shfl_xor(xa, 2));
        xb = wb_fmaxf(xb, wb_shfl_xor(xb, 1)); xb = wb_fmaxf(xb, wb_shfl_xor(xb, 2));
        // key 0 is in every row's first tile, so the max is finite from then on; before it nothing is rescaled
        const float ca = ma == -WB_INF ? 0.f : wb_exp_precise(ma - xa);
        const float cb = mb == -WB_INF ? 0.f : wb_exp_precise(mb - xb);
        ma = xa;
        mb = xb;
        la *= ca;
        lb *= cb;
#pragma unroll
        for (int nt = 0; nt < WB_HD / 8; ++nt) {
            o[nt][0] *= ca; o[nt][1] *= ca;
            o[nt][2] *= cb; o[nt][3] *= cb;
        }
#pragma unroll
        for (int nt = 0; nt < PA_BN / 8; ++nt) {
            s[nt][0] = wb_exp_precise(s[nt][0] - ma); s[nt][1] = wb_exp_precise(s[nt][1] - ma);
            s[nt][2] = wb_exp_precise(s[nt][2] - mb); s[nt][3] = wb_exp_precise(s[nt][3] - mb);
            la += s[nt][0] + s[nt][1];
            lb += s[nt][2] + s[nt][3];
        }
        // O += P·V, 16 keys a step: the scores' tiles 2kk and 2kk+1 are the A fragment as they lie in registers,
        // split in hi + lo as the queries are
#pragma unroll
        for (int kk = 0; kk < PA_BN / 16; ++kk) {
            const float* e[4] = {&s[2 * kk][0], &s[2 * kk][2], &s[2 * kk + 1][0], &s[2 * kk + 1][2]};
            u32 ah[4], al[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) pa_split(e[i][0], e[i][1], ah[i], al[i]);
#pragma unroll
            for (int nt = 0; nt < WB_HD / 8; ++nt) {
                const bf16* vp = vt + (nt * 8 + g) * PA_VS + kk * 16 + 2 * t;
                const u32 b[2] = {*(const u32*)vp, *(const u32*)(vp + 8)};
                wb_mma_bf16_16816(o[nt], ah, b);
                wb_mma_bf16_16816(o[nt], al, b);
            }
        }
        __syncthreads();                                              // before the next tile overwrites these
    }
    la += wb_shfl_xor(la, 1); la += wb_shfl_xor(la, 2);
    lb += wb_shfl_xor(lb, 1); lb += wb_shfl_xor(lb, 2);
#pragma unroll
    for (int nt = 0; nt < WB_HD / 8; ++nt) {
        const int d = h * WB_HD + nt * 8 + 2 * t;
        if (ra < n) { out[ra * stride + d] = o[nt][0] / la; out[ra * stride + d + 1] = o[nt][1] / la; }
        if (rb < n) { out[rb * stride + d] = o[nt][2] / lb; out[rb * stride + d + 1] = o[nt][3] / lb; }
    }
}

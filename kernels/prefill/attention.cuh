// Causal attention of the batched prefill (workbench/run/prefill_gpu.py), flash-style on the tensor cores: the score
// matrix of a long prompt (n² per head) never leaves the registers. One block takes PA_BM = 64 query rows of one
// query head, and each of its four warps owns 16 of them. Tiles of PA_BN keys and values are copied from the
// kernel's own bf16 cache straight into shared memory (cp.async, two tiles in flight: the next tile's copy runs
// while this one's products do), so nothing is converted on the way and half the bytes of fp32 move. The running
// softmax (max, sum) of each row stays in the registers of the four lanes that hold the row.
//
// Precision (the prefill is held to the end-to-end tolerance against fp64, check_prefill):
// - Q·Kᵀ: each scaled query is split as hi + lo, two bf16 with |q − hi − lo| ≤ 2⁻¹⁷|q|, and both are multiplied,
//   so the scores are accurate to about 2⁻¹⁷ of their terms, at the cost of two products instead of one.
// - P·V: the probabilities are split the same way. Rounded to one bf16 each (2⁻⁸ relative at most, 2⁻⁹
//   typically, independent across keys), they moved the output by 1.0–1.3e-3 of its size on random inputs
//   (measured: the weighted sum of random values is no larger than its rounding noise), the same order as the bf16
//   cache's own rounding, which is too much to add on top of it. The sum the output is divided by is kept in fp32,
//   from the unrounded weights.
// - exp is the fast one (ex2.approx after a multiply by log2 e): its error grows with |x|, to about |x|·2⁻²³ of
//   e^x, and e^x·|x| ≤ 1/e, so no probability is off by more than ~2⁻²³ of the row's largest.
// - A NaN in a query or a key makes its row's output NaN: the max skips it, but exp(NaN) enters the sum. A NaN or
//   an infinity in a value at position j also reaches the earlier rows of j's block, whose weight for it is 0 (and
//   0·NaN is NaN): a cache holding one is wrong at j already, and every later row reads it, so the prefill fails
//   its check either way. The layouts below are bit-identical for finite values.
// - WB_PA_HALVES 1 (the bf16 precision, prefill_gpu.PRECISIONS): the scaled queries and the probabilities rounded to
//   one bf16 each (|x − hi| ≤ 2⁻⁹|x|) and one product each, half the tensor-core work: the roundings HF's bf16
//   attention does too. A score's error is Σ εᵢ·(q·scale)ᵢ·kᵢ, εᵢ independent and uniform within half a bf16 step
//   (rms 2⁻⁹/√3 ≈ 1.1e-3), so ~1.1e-3·‖(q·scale)∘k‖₂: at most ~1.1e-3 of the score's largest term-sum, ~1e-3 in
//   absolute terms for scores of a few units, and a probability moves by about its score's error, relatively. The
//   output is a weighted mean of the values, so it moves by ~1e-3 of its size from the scores, plus the 1.0–1.3e-3
//   measured above for the rounded probabilities: ~1.5e-3 a layer, the size of one rounded product's, which enters
//   the residual through o_proj. As a random walk over the layers it adds √L·1.5e-3 (6e-3 for the 1B's 16, 8.5e-3
//   for the 8B's 32) to the products' 6e-3 and 9e-3: ~8.5e-3 and ~1.2e-2 in quadrature, under the check's 2e-2.
//   Scores far from a few units (a head that puts most of its weight on one key with a score of tens) move by
//   tens of 1e-3: the check on the model's own prompt decides, as it does for HF's bf16.
//
// Set by the launcher (workbench/run/prefill_gpu.py): WB_HD (head_dim, a multiple of 16, at most 128), WB_THREADS and
// WB_PA_ROWS (the rows a block takes, as its grid counts them), and two layouts that change no result, bit for bit
// (the GPU test holds them to it): WB_PA_GQA_ROWS, a block's rows are (position, query head) pairs of one kv head,
// head fastest, so that each key and value tile copied serves every query head of the group (the grid is
// (⌈n·group / 64⌉, Hkv)) instead of one head (the grid (⌈n / 64⌉, Hq)); WB_PA_K_LDMATRIX, the keys' fragments
// taken by ldmatrix, four 8×8 matrices an instruction, instead of two 32-bit loads each. Two stages of a key tile
// and a value tile fit the 48 KB of static shared memory with 64 keys a tile up to head_dim 64, and 32 beyond.

// The tile, in mma.sync's m16n8k16 fragments: each warp 16 query rows (one fragment's M), a tile PA_BN keys
#define PA_FRAG_M 16
#define PA_WARPS 4
// WB_PA_FRAGS (FlashLayout.frags): each warp's 16-row fragments, 1 or 2. Two take 32 rows a warp, 128 a block, and
// every key and value fragment loaded from shared memory serves both (half the loads a product), at twice the
// accumulators' registers; each row's arithmetic is the same, in the same order.
#ifndef WB_PA_FRAGS
#define WB_PA_FRAGS 1
#endif
#define PA_MF WB_PA_FRAGS
#define PA_BM (PA_WARPS * PA_FRAG_M * PA_MF)
// keys a tile: four 16-key steps of P·V up to head_dim 64, two beyond (two stages of both tiles in 48 KB)
#define PA_KSTEP 16
#define PA_BN (PA_KSTEP * (WB_HD <= 4 * PA_KSTEP ? 4 : 2))
#define PA_KS (WB_HD + 8)   // row stride of both tiles, in bf16: 16-byte rows, whose 8-row fragment loads fall on
                            // distinct banks
#define PA_CHUNKS (PA_BN * WB_HD / 8)    // 16-byte copies a tile

#ifndef WB_PA_GQA_ROWS
#define WB_PA_GQA_ROWS 0
#endif
#ifndef WB_PA_K_LDMATRIX
#define WB_PA_K_LDMATRIX 0
#endif
// The launch bounds, for ptxas's register budget. One half frees the lo fragments (~30 registers at head_dim 64,
// ~60 at 128); with the block size alone ptxas then aimed at 128 registers and spilled at head_dims 80 and 96 (8
// and 24 bytes of stack), and with no limit it took up to 177 at 64, two blocks an SM where two halves have three.
// Three blocks an SM (≤ 170 registers) keep the default layout out of local memory at every head_dim up to 128 at
// the two halves' occupancy. Two halves keep the block size alone: a minimum of one block moved ptxas to more
// registers for the same code (165 → 206 at head_dim 64).
// WB_PA_MIN_BLOCKS (FlashLayout.min_blocks) asks for more: 4 an SM is 16 warps, at ≤ 128 registers.
#ifndef WB_PA_MIN_BLOCKS
#define WB_PA_MIN_BLOCKS (WB_PA_FRAGS == 2 ? 2 : WB_PA_HALVES == 1 ? 3 : 0)
#endif
#if WB_PA_MIN_BLOCKS > 0
#define PA_LAUNCH_BOUNDS __launch_bounds__(WB_THREADS, WB_PA_MIN_BLOCKS)
#else
#define PA_LAUNCH_BOUNDS __launch_bounds__(WB_THREADS)
#endif
static_assert(WB_HD % 16 == 0 && WB_HD <= 128, "head_dim: a multiple of 16, at most 128");
static_assert(WB_THREADS == PA_WARPS * WB_WARP, "four warps a block");
static_assert(WB_PA_FRAGS == 1 || WB_PA_FRAGS == 2, "16-row fragments a warp: 1 or 2");
static_assert(WB_PA_ROWS == PA_BM, "the launcher's grid counts rows in this tile's");
static_assert(2 * 2 * PA_BN * PA_KS * 2 <= 48 * 1024, "two stages of both tiles fit static shared memory");

// acc += (hi + lo)·b, or hi·b with one half
__device__ __forceinline__ void pa_mma(float* acc, const u32* hi, const u32* lo, const u32* b) {
    wb_mma_bf16_16816(acc, hi, b);
    if (WB_PA_HALVES == 2) wb_mma_bf16_16816(acc, lo, b);
}

// one tile's keys and values, keys j0.. of this kv head, into a stage; keys past the block's last are zeros (every
// row masks them, and 0·x is then never 0·NaN)
__device__ __forceinline__ void pa_load_tile(bf16* ks, bf16* vs, const bf16* kb, const bf16* vb, int j0, int last_key) {
    for (int e = threadIdx.x; e < PA_CHUNKS; e += WB_THREADS) {
        const int key = e / (WB_HD / 8), d = (e % (WB_HD / 8)) * 8;
        const bool valid = j0 + key <= last_key;
        const long long at = (long long)(valid ? j0 + key : 0) * WB_HD + d;
        wb_cp_async16(ks + key * PA_KS + d, kb + at, valid);
        wb_cp_async16(vs + key * PA_KS + d, vb + at, valid);
    }
    wb_cp_async_commit();
}

extern "C" __global__ void PA_LAUNCH_BOUNDS prefill_attention(PA_PARAMS)
{
    __shared__ __align__(16) bf16 ks[2][PA_BN * PA_KS];
    __shared__ __align__(16) bf16 vs[2][PA_BN * PA_KS];
    __shared__ int last_key;
    const int warp = threadIdx.x / WB_WARP, lane = threadIdx.x % WB_WARP, g = lane >> 2, t = lane & 3;
    const long long stride = (long long)n_heads * WB_HD;              // of q's rows and out's
    // this lane's two rows of each fragment, and where each one's query and output start; a row past the last
    // attends to key 0 alone and is not written
#if WB_PA_HEAVY_FIRST
    const int row_tile = gridDim.y - 1 - blockIdx.y, head = blockIdx.x;
#else
    const int row_tile = blockIdx.x, head = blockIdx.y;
#endif
#if WB_PA_GQA_ROWS
    const int kvh = head, rows = n * group;
#else
    const int h = head, kvh = h / group, rows = n;
#endif
    int ra[PA_MF], rb[PA_MF], pa[PA_MF], pb[PA_MF];
    long long qa[PA_MF], qb[PA_MF];
#pragma unroll
    for (int f = 0; f < PA_MF; ++f) {
        ra[f] = row_tile * PA_BM + (warp * PA_MF + f) * PA_FRAG_M + g;
        rb[f] = ra[f] + 8;
#if WB_PA_GQA_ROWS
        qa[f] = ra[f] < rows ? (ra[f] / group) * stride + (kvh * group + ra[f] % group) * WB_HD : 0;
        qb[f] = rb[f] < rows ? (rb[f] / group) * stride + (kvh * group + rb[f] % group) * WB_HD : 0;
        pa[f] = ra[f] < rows ? (int)pos[ra[f] / group] : 0;
        pb[f] = rb[f] < rows ? (int)pos[rb[f] / group] : 0;
#else
        qa[f] = ra[f] * stride + h * WB_HD;
        qb[f] = rb[f] * stride + h * WB_HD;
        pa[f] = ra[f] < n ? (int)pos[ra[f]] : 0;
        pb[f] = rb[f] < n ? (int)pos[rb[f]] : 0;
#endif
    }
    if (threadIdx.x == 0) last_key = 0;
    __syncthreads();
    // the warp's first row position: tiles wholly at or before it need no mask
    int first = min(pa[0], pb[0]), most = max(pa[0], pb[0]);
#pragma unroll
    for (int f = 1; f < PA_MF; ++f) {
        first = min(first, min(pa[f], pb[f]));
        most = max(most, max(pa[f], pb[f]));
    }
    atomicMax(&last_key, most);                                       // every lane's rows: all the block's counted
#pragma unroll
    for (int m = 1; m < WB_WARP; m <<= 1) first = min(first, wb_shfl_xor(first, m));

    // the queries as A fragments, one per 16 of head_dim: rows g, g+8; columns 2t, 2t+1 and 2t+8, 2t+9
    u32 qh[PA_MF][WB_HD / 16][4], ql[PA_MF][WB_HD / 16][4];
#pragma unroll
    for (int f = 0; f < PA_MF; ++f) {
#pragma unroll
        for (int kk = 0; kk < WB_HD / 16; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = (i & 1) ? rb[f] : ra[f], col = kk * 16 + 2 * t + ((i & 2) ? 8 : 0);
                float x0 = 0.f, x1 = 0.f;
                if (row < rows) {
                    const float* p = q + ((i & 1) ? qb[f] : qa[f]) + col;
                    x0 = p[0] * scale;
                    x1 = p[1] * scale;
                }
                pa_split(x0, x1, qh[f][kk][i], ql[f][kk][i]);
            }
        }
    }
    float o[PA_MF][WB_HD / 8][4];
    float ma[PA_MF], mb[PA_MF], la[PA_MF], lb[PA_MF];                // running max and (this lane's part of) sum
#pragma unroll
    for (int f = 0; f < PA_MF; ++f) {
#pragma unroll
        for (int nt = 0; nt < WB_HD / 8; ++nt) o[f][nt][0] = o[f][nt][1] = o[f][nt][2] = o[f][nt][3] = 0.f;
        ma[f] = mb[f] = -WB_INF;
        la[f] = lb[f] = 0.f;
    }
    __syncthreads();
    const int tiles = last_key / PA_BN + 1;
    const bf16* kb = k + (long long)kvh * kv_stride * WB_HD;
    const bf16* vb = v + (long long)kvh * kv_stride * WB_HD;
    pa_load_tile(ks[0], vs[0], kb, vb, 0, last_key);

    for (int tile = 0; tile < tiles; ++tile) {
        const int j0 = tile * PA_BN, stage = tile & 1;
        if (tile + 1 < tiles) {                       // the next tile's copy, into the stage the last tile used
            pa_load_tile(ks[stage ^ 1], vs[stage ^ 1], kb, vb, j0 + PA_BN, last_key);
            wb_cp_async_wait<1>();
        } else {
            wb_cp_async_wait<0>();
        }
        __syncthreads();                              // every thread's copies of this tile have landed
        const bf16* kt = ks[stage];
        const bf16* vt = vs[stage];

        // S = Q·Kᵀ, each fragment's 16 rows × PA_BN keys as tiles of 8 keys; B[d][key] = K[key][d], a word a pair,
        // loaded once for every fragment
        float s[PA_MF][PA_BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < PA_BN / 8; ++nt) {
#pragma unroll
            for (int f = 0; f < PA_MF; ++f) s[f][nt][0] = s[f][nt][1] = s[f][nt][2] = s[f][nt][3] = 0.f;
            int kk = 0;
#if WB_PA_K_LDMATRIX
            // two 16-wide steps of head_dim an instruction: lane L names row L % 8 of the tile's keys nt·8.., at
            // columns 16kk + 8·(L / 8): matrices kk low, kk high, kk + 1 low, kk + 1 high
#pragma unroll
            for (; kk + 1 < WB_HD / 16; kk += 2) {
                u32 b[4];
                wb_ldmatrix_x4(b, kt + (nt * 8 + (lane & 7)) * PA_KS + kk * 16 + (lane >> 3) * 8);
#pragma unroll
                for (int f = 0; f < PA_MF; ++f) {
                    pa_mma(s[f][nt], qh[f][kk], ql[f][kk], b);
                    pa_mma(s[f][nt], qh[f][kk + 1], ql[f][kk + 1], b + 2);
                }
            }
#endif
#pragma unroll
            for (; kk < WB_HD / 16; ++kk) {
                const bf16* kp = kt + (nt * 8 + g) * PA_KS + kk * 16 + 2 * t;
                const u32 b[2] = {*(const u32*)kp, *(const u32*)(kp + 8)};
#pragma unroll
                for (int f = 0; f < PA_MF; ++f) pa_mma(s[f][nt], qh[f][kk], ql[f][kk], b);
            }
        }
#pragma unroll
        for (int f = 0; f < PA_MF; ++f)
            pa_softmax_tile<PA_BN / 8, WB_HD / 8>(&s[f][0][0], &o[f][0][0], j0, PA_BN, first, pa[f], pb[f], t, ma[f],
                                                  mb[f], la[f], lb[f]);
        // O += P·V, 16 keys a step: the scores' tiles 2kk and 2kk+1 are the A fragment as they lie in registers,
        // split in hi + lo as the queries are; the values' B fragments come transposed out of their row-major tile,
        // two 8-wide column tiles a load (lane L: key 16kk + 8·(L/8 % 2) + L % 8, columns 8·(nt + L/16)..), loaded
        // once for every fragment
#pragma unroll
        for (int kk = 0; kk < PA_BN / PA_KSTEP; ++kk) {
            u32 ah[PA_MF][4], al[PA_MF][4];           // rows g, g + 8 of keys 2t.. and of keys 2t + 8..
#pragma unroll
            for (int f = 0; f < PA_MF; ++f) {
                pa_split(s[f][2 * kk][0], s[f][2 * kk][1], ah[f][0], al[f][0]);
                pa_split(s[f][2 * kk][2], s[f][2 * kk][3], ah[f][1], al[f][1]);
                pa_split(s[f][2 * kk + 1][0], s[f][2 * kk + 1][1], ah[f][2], al[f][2]);
                pa_split(s[f][2 * kk + 1][2], s[f][2 * kk + 1][3], ah[f][3], al[f][3]);
            }
#pragma unroll
            for (int nt = 0; nt < WB_HD / 8; nt += 2) {
                u32 b[4];
                wb_ldmatrix_x4_trans(b, vt + (kk * PA_KSTEP + ((lane >> 3) & 1) * 8 + (lane & 7)) * PA_KS
                                            + (nt + (lane >> 4)) * 8);
#pragma unroll
                for (int f = 0; f < PA_MF; ++f) {
                    pa_mma(o[f][nt], ah[f], al[f], b);
                    pa_mma(o[f][nt + 1], ah[f], al[f], b + 2);
                }
            }
        }
        __syncthreads();                              // before the next tile's copy overwrites this stage
    }
#pragma unroll
    for (int f = 0; f < PA_MF; ++f)
        pa_write_rows<WB_HD / 8>(out, &o[f][0][0], qa[f], qb[f], ra[f] < rows, rb[f] < rows, t, la[f], lb[f]);
}

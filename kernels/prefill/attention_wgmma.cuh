// Causal attention of the batched prefill on Hopper's warpgroup products (wgmma, sm_90a): the same math as
// attention.cuh, whose precision argument holds here unchanged (the queries and probabilities in WB_PA_HALVES bf16
// halves, the running softmax in fp32, the fast exp), on the instruction the GPU's tensor cores run at full rate.
// mma.sync reaches about a third of it; the mma.sync kernel measured ~255 TFLOP/s at 32k on an H100, cuDNN's
// wgmma kernel about twice its speed at 4k (NOTES.md, rounds 26 and 28).
//
// One block takes PW_BM = 64·WB_PW_WARPGROUPS query rows of one query head, or 64 rows of WB_PW_WARPGROUPS heads
// (WB_PW_HEADS); each warpgroup (four warps) owns 64 rows of one head and issues its products as one: S = Q·Kᵀ
// as 64 × PW_BN per key tile (the queries in shared memory for the whole block), then O += P·V as 64 × head_dim,
// P taken from S's accumulators as they lie (wgmma's accumulator fragments are mma.sync's, and so are its A
// fragments). Key and value tiles are copied from
// the kernel's bf16 cache into shared memory with cp.async, WB_PW_STAGES tiles in flight, laid out as
// wgmma's 8 × 8 core matrices without a swizzle: 16-byte chunk e of a tile holds key (e / hd)·8 + e % 8, columns
// 8·((e / 8) % (hd / 8)) onwards, at byte 16e, so each core matrix (8 keys × 8 columns) is 128 contiguous bytes,
// the next along the columns 128 bytes on and the next along the keys hd·16. The same bytes serve both products:
// K as B of Q·Kᵀ (K-major: its reduction, the columns, runs within a core matrix's rows) and V as B of P·V
// (transposed: MN-major, its reduction over keys runs across a core matrix's rows).
//
// At 64 keys a tile each row's sums are formed in attention.cuh's order (one H100 gave the same bits); at other
// tile sizes the online softmax rescales at other keys, which agrees to rounding. The GPU tests hold every layout to
// the fp64 math at attention.cuh's bounds, and every 64-key one (prefill_gpu.WGMMA_FP32, fp32's layout on sm_90,
// among them) to attention.cuh's bits.
//
// Set by the launcher (workbench/run/prefill_gpu.py): WB_HD, WB_PW_WARPGROUPS, WB_PW_KEYS (PW_BN), WB_PW_STAGES,
// WB_PW_HEADS, WB_PA_HALVES, WB_PA_HEAVY_FIRST, WB_PA_ROWS (the rows a block takes, as the grid counts them),
// WB_PA_MIN_BLOCKS, WB_PW_OVERLAP, WB_PW_PINGPONG, WB_PW_TMA and WB_PA_EXP_FTZ; and the generated wb_wgmma_bf16 products for
// N = PW_BN and N = WB_HD.

#define PW_WG WB_PW_WARPGROUPS
#ifndef WB_PW_PRODUCER
#define WB_PW_PRODUCER 0
#endif
// the warpgroups' threads, and the producer warpgroup's after them (WB_PW_PRODUCER)
#define PW_THREADS (4 * WB_WARP * (PW_WG + WB_PW_PRODUCER))
// WB_PW_HEADS 0: the warpgroups take consecutive 64-row tiles of one query head (PW_BM = 64·warpgroups rows a
// block); 1: they take the same 64 rows of as many query heads of one kv head (a GQA group), so each key and value
// tile copied serves all of them. The copies are what bounds the first: ~2 TB/s of tiles from L2 at 32k on an H100
// with one warpgroup a block and with two alike (round 32), where the second copies 1/warpgroups of them.
#ifndef WB_PW_HEADS
#define WB_PW_HEADS 0
#endif
// WB_PW_OVERLAP 1: a tile's softmax while the last tile's P·V is in flight (the key loop's first form below)
#ifndef WB_PW_OVERLAP
#define WB_PW_OVERLAP 0
#endif
// WB_PW_PINGPONG 1 (two warpgroups, the key loop's second form): they take turns to issue a tile's Q·Kᵀ, on two
// named barriers (FA3's warp scheduler barriers), so one's softmax runs while the other's products do. At head_dim
// 64 a score's exp (the multi-function unit's 16 a clock an SM) costs about what its share of the two products
// does on the tensor cores: at 32k on an H100, ~4.6 and ~5.5 ms of a 1B layer's 10.6 (NOTES.md round 37), so the
// two warpgroups, left to themselves, run both phases at once and the units take turns idling. A turn orders when
// products are issued, not what they compute: the same bits.
#ifndef WB_PW_PINGPONG
#define WB_PW_PINGPONG 0
#endif
static_assert(!WB_PW_PINGPONG || (PW_WG == 2 && !WB_PW_OVERLAP), "pingpong: two warpgroups, the loop without overlap");
#define PW_TURN 8                                            // the named barriers of the turns: 8 (warpgroup 0's), 9
// WB_PW_TMA 1: the key and value tiles copied by the tensor memory accelerator, one thread issuing a tile's boxes
// onto its stage's mbarrier, which the warps wait on, in place of every thread's cp.async of 16-byte chunks and the
// block barrier that published them (round 33's profile: ~30 instructions of address arithmetic a chunk, and the
// copies' long-scoreboard, barrier and LDGSTS-queue stalls, 3.2 of ~8.5 stall cycles an instruction). The tiles lie
// as the accelerator writes them in the 128-byte swizzle: each key's 64-column span one 128-byte row (a head_dim of
// 128 is two boxes, the second span 64 keys' rows on), which the products read through swizzled descriptors.
// The map's keys end at the launch's last position (prefill_gpu.flash_attention): the box's keys past it are zeros,
// as the cp.async copy's past the block's last key are. Between the two ends lie keys of this launch's own rows,
// which every row of this block masks (probability 0, exactly) and whose values enter its output as 0·v: the same
// bits where they are finite, and where one is not, the launch's output at its own row is not finite either.
// WB_PW_PRODUCER 1 (with WB_PW_TMA): the copies are issued by a warpgroup of their own (one thread of it), which
// waits for a stage to be free (an mbarrier each consumer warp arrives on once its products have read the stage)
// and runs ahead by as many tiles as there are stages, so no block barrier is left in the key loop and the
// warpgroups run apart, as FA3's do. The producer gives its registers back (setmaxnreg) to the consumers: a
// warp of its own could not, and two blocks of nine warps an SM left 96 registers a thread, where ptxas serialised
// the products.
#ifndef WB_PW_TMA
#define WB_PW_TMA 0
#endif
#define PW_M (4 * 16)                              // wgmma's M: four warps' 16-row fragments
#define PW_BM (WB_PW_HEADS ? PW_M : PW_M * PW_WG)
#define PW_Q_BYTES (PW_M * WB_HD * 2)              // a warpgroup's queries, one bf16 half
#define PW_BN WB_PW_KEYS
#define PW_TILE_BYTES (PW_BN * WB_HD * 2)          // one tile of keys or of values
// stages of the key and value tiles in flight: at two, a tile's copy had one tile's products to land in, about an
// L2 round trip at one warpgroup a block (which ran at half the two's speed, one H100)
#define PW_STAGES WB_PW_STAGES
#define PW_CHUNKS (PW_BN * WB_HD / 8)              // its 16-byte chunks
// WB_PW_TMA: a tile's rows in the 128-byte swizzle hold PW_SPAN columns (bf16), a box of the accelerator's;
// PW_BOX_BYTES a span of the tile's keys
#define PW_SPAN (128 / 2)
#define PW_BOX_BYTES (PW_BN * 128)
#if WB_PW_TMA
static_assert(WB_HD % PW_SPAN == 0, "the tensor memory accelerator's tiles: spans of 128-byte rows");
#define PW_TMA_PARAMS , const __grid_constant__ wb_tensor_map k_map, const __grid_constant__ wb_tensor_map v_map
#else
#define PW_TMA_PARAMS
#endif

#ifndef WB_PA_MIN_BLOCKS
#define WB_PA_MIN_BLOCKS 1
#endif
static_assert(WB_HD % 16 == 0 && WB_HD <= 256, "head_dim: a multiple of 16 (P·V's N, and Q·Kᵀ's 16-wide steps)");
static_assert(PW_BN % 16 == 0 && PW_BN >= 16 && PW_BN <= 256, "keys a tile: P·V's 16-key steps, Q·Kᵀ's N ≤ 256");
static_assert(PW_WG >= 1 && PW_WG <= 4 && (PW_WG != 3 || WB_PW_PRODUCER), "one to four warpgroups a block "
              "(three beside a producer)");
static_assert(PW_STAGES >= 2 + WB_PW_OVERLAP && PW_STAGES <= 4,
              "two to four stages of the key and value tiles, three or more where the products overlap");
static_assert(WB_THREADS == PW_THREADS, "the launcher's block is four warps a warpgroup, and the producer's");
static_assert(!WB_PW_PRODUCER || WB_PW_TMA, "the producer warpgroup issues the accelerator's copies");
static_assert(WB_PA_ROWS == PW_BM, "the launcher's grid counts rows in this tile's");

// tile `tile`'s keys and values into its stage, as one commit group (an empty one past the last tile, so that
// every thread counts one group a tile)
__device__ __forceinline__ void pw_load_tile(u8* smem, const bf16* kb, const bf16* vb, int tile, int last_key) {
    u8* ks = smem + (tile % PW_STAGES) * 2 * PW_TILE_BYTES;
    u8* vs = ks + PW_TILE_BYTES;
    const int j0 = tile * PW_BN;
    for (int e = threadIdx.x; e < PW_CHUNKS && j0 <= last_key; e += PW_THREADS) {
        const int key = (e / WB_HD) * 8 + (e & 7), col = ((e >> 3) % (WB_HD / 8)) * 8;
        const bool valid = j0 + key <= last_key;           // keys past the block's last: zeros (0·x is never 0·NaN)
        const long long at = (long long)(valid ? j0 + key : 0) * WB_HD + col;
        wb_cp_async16(ks + 16 * e, kb + at, valid);
        wb_cp_async16(vs + 16 * e, vb + at, valid);
    }
    wb_cp_async_commit();
}

// the same by the tensor memory accelerator, issued by one thread: the tile's boxes onto its stage's mbarrier
// `full`, which expects their bytes (every box's, those past the map's keys filled with zeros); a tile past the
// block's last key is not copied (no warp waits for it)
__device__ __forceinline__ void pw_load_tile_tma(u8* smem, u64* full, const wb_tensor_map* km,
                                                 const wb_tensor_map* vm, int kvh, int tile, int last_key) {
    const int j0 = tile * PW_BN;
    if (j0 > last_key) return;
    u8* ks = smem + (tile % PW_STAGES) * 2 * PW_TILE_BYTES;
    u64* bar = full + tile % PW_STAGES;
    wb_mbar_expect_tx(bar, 2 * PW_TILE_BYTES);
#pragma unroll
    for (int b = 0; b < WB_HD / PW_SPAN; ++b) {
        wb_tma_load_3d(ks + b * PW_BOX_BYTES, km, PW_SPAN * b, j0, kvh, bar);
        wb_tma_load_3d(ks + PW_TILE_BYTES + b * PW_BOX_BYTES, vm, PW_SPAN * b, j0, kvh, bar);
    }
}

// until tile `tile`'s copy has landed (its stage's phase tile / STAGES completes; a stage is copied again only
// after every warp is past its last tile, so the phase waited for is never one behind)
__device__ __forceinline__ void pw_wait_tile_tma(u64* full, int tile) {
    while (!wb_mbar_test(full + tile % PW_STAGES, (tile / PW_STAGES) & 1)) {}
}

// WB_PW_PRODUCER: tile `tile`'s stage read by this warp's products (each warp arrives once, after the wait that
// follows its last product to read it), and the producer's wait until every warp has, before it copies tile `tile`
// (STAGES tiles after the stage's last)
__device__ __forceinline__ void pw_free_stage(u64* empty, int tile) {
    __syncwarp();
    if (threadIdx.x % WB_WARP == 0) wb_mbar_arrive(empty + tile % PW_STAGES);
}
__device__ __forceinline__ void pw_wait_stage_free(u64* empty, int tile) {
    while (!wb_mbar_test(empty + tile % PW_STAGES, (tile / PW_STAGES + 1) & 1)) {}
}

// The descriptors of K (B of Q·Kᵀ, K-major: its 16-column step kk) and V (B of P·V, MN-major: its 16-key step kk)
// in a stage: the cp.async copy's core matrices without a swizzle, or the accelerator's 128-byte swizzle (8-key
// atoms of 1,024 bytes; a 16-column step 32 bytes on within a row, 64 columns a span apart)
__device__ __forceinline__ u64 pw_k_desc(const u8* kt, int kk) {
#if WB_PW_TMA
    return wb_wgmma_desc_sw128(kt + (kk / 4) * PW_BOX_BYTES + (kk % 4) * 16 * 2, 16, 1024);
#else
    return wb_wgmma_desc(kt + kk * 256, 128, WB_HD * 16);
#endif
}
__device__ __forceinline__ u64 pw_v_desc(const u8* vt, int kk) {
#if WB_PW_TMA
    return wb_wgmma_desc_sw128(vt + kk * 2 * 1024, PW_BOX_BYTES, 1024);       // 16 keys: two atoms
#else
    return wb_wgmma_desc(vt + kk * 2 * WB_HD * 16, WB_HD * 16, 128);
#endif
}

template <int N>
__device__ __forceinline__ void pw_fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) wb_reg_fence(d[i]);
}

// S = Q·Kᵀ of one key tile (kt) into s, issued: head_dim in 16-wide steps, K's step kk two core matrices (256
// bytes) on; the caller fences before, commits and waits
__device__ __forceinline__ void pw_issue_scores(float* s, const u8* qs, const u8* kt) {
#pragma unroll
    for (int kk = 0; kk < WB_HD / 16; ++kk) {
        const u64 desc = pw_k_desc(kt, kk);
        wb_wgmma_bf16_ss<PW_BN>(s, wb_wgmma_desc(qs + kk * 256, 128, WB_HD * 16), desc, kk > 0);
        if (WB_PA_HALVES == 2)
            wb_wgmma_bf16_ss<PW_BN>(s, wb_wgmma_desc(qs + PW_Q_BYTES + kk * 256, 128, WB_HD * 16), desc, 1);
    }
}

// P as A fragments, 16 keys a step: S's fragments 2kk and 2kk+1 as they lie (rows g, g+8 of keys 2t.. and of keys
// 2t+8..), split as the queries are
__device__ __forceinline__ void pw_split_probabilities(const float* s, u32 (*ph)[4], u32 (*pl)[4]) {
#pragma unroll
    for (int kk = 0; kk < PW_BN / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) pa_split(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1], ph[kk][i], pl[kk][i]);
    }
}

// O += P·V of one value tile (vt), issued: keys in 16-wide steps, V's step kk two core matrices along the keys
// (2·hd·16 bytes) on; V is B transposed (its N, the columns, runs within a core matrix's rows)
__device__ __forceinline__ void pw_issue_values(float* o, u32 (*ph)[4], u32 (*pl)[4], const u8* vt) {
#pragma unroll
    for (int kk = 0; kk < PW_BN / 16; ++kk) {
        const u64 desc = pw_v_desc(vt, kk);
        wb_wgmma_bf16<WB_HD, 1>(o, ph[kk], desc, 1);
        if (WB_PA_HALVES == 2) wb_wgmma_bf16<WB_HD, 1>(o, pl[kk], desc, 1);
    }
}

// A shared-memory store that needs `sum` (of every exp of the tile's softmax) and never happens: a sum of exps is
// never negative, and a NaN compares false. Placed before the P·V's wait, it keeps the exps before it in the
// machine code. Without it ptxas scheduled the wait above all 34 MUFU.EX2 of a tile, so that the softmax ran after
// the P·V had landed and nothing overlapped (found by a review of round 33's build, which measured no gain).
__device__ __forceinline__ void pw_softmax_before_wait(float sum, int* pin) {
    asm volatile("{\n.reg .pred p;\nsetp.lt.f32 p, %0, 0f00000000;\n@p st.shared.u32 [%1], 0;\n}"
                 :: "f"(sum), "r"(wb_smem_addr(pin)) : "memory");
}

template <int N>
__device__ __forceinline__ void pw_fence_frags(u32 (*f)[4]) {
#pragma unroll
    for (int kk = 0; kk < N; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) wb_reg_fence(f[kk][i]);
    }
}

// With the producer warpgroup, the registers a thread at the launch are what WB_PA_MIN_BLOCKS blocks an SM leave
// (an SM's registers are four sub-partitions of 16K, each holding a quarter of the warps, rounded up); then the
// producer keeps 24 and the consumers share the rest (PW_CONSUMER_REGS, at most 256)
#if WB_PW_PRODUCER
#define PW_WARPS_A_QUARTER ((WB_PA_MIN_BLOCKS * PW_THREADS / WB_WARP + 3) / 4)
#define PW_LAUNCH_REGS_ (16384 / (PW_WARPS_A_QUARTER * WB_WARP) / 8 * 8)
#define PW_LAUNCH_REGS (PW_LAUNCH_REGS_ < 248 ? PW_LAUNCH_REGS_ : 248)
#define PW_PRODUCER_REGS 24
#define PW_CONSUMER_REGS_ ((PW_LAUNCH_REGS * PW_THREADS - PW_PRODUCER_REGS * 4 * WB_WARP) / (4 * WB_WARP * PW_WG) / 8 * 8)
#define PW_CONSUMER_REGS (PW_CONSUMER_REGS_ < 256 ? PW_CONSUMER_REGS_ : 256)
#endif
extern "C" __global__ void __launch_bounds__(PW_THREADS, WB_PA_MIN_BLOCKS) prefill_attention(PA_PARAMS PW_TMA_PARAMS)
{
    // [PW_STAGES][the key tile, the value tile], then each warpgroup's queries [halves][64 × hd]; the accelerator's
    // swizzled tiles start on 1,024 bytes (the launcher gives the kernel as many more)
    extern __shared__ __align__(128) u8 pw_dynamic[];
#if WB_PW_TMA
    u8* pw_smem = (u8*)(((unsigned long long)pw_dynamic + 1023) & ~1023ull);
    __shared__ u64 pw_full[PW_STAGES];                       // a stage's copy landed, a phase a tile
#if WB_PW_PRODUCER
    __shared__ u64 pw_empty[PW_STAGES];                      // a stage read by every warp, a phase a tile
#endif
#else
    u8* pw_smem = pw_dynamic;
#endif
    __shared__ int last_key, wg_last[PW_WG];
    // the producer warpgroup (WB_PW_PRODUCER) takes the last warpgroup's indices: the same kv head and key range
    const bool producer = WB_PW_PRODUCER && threadIdx.x >= 4 * WB_WARP * PW_WG;
    const int wg = producer ? PW_WG - 1 : threadIdx.x / (4 * WB_WARP), warp = (threadIdx.x / WB_WARP) % 4;
    const int lane = threadIdx.x % WB_WARP;
    const int g = lane >> 2, t = lane & 3;
    const long long stride = (long long)n_heads * WB_HD;
#if WB_PA_HEAVY_FIRST
    const int row_tile = gridDim.y - 1 - blockIdx.y, head_tile = blockIdx.x;
#else
    const int row_tile = blockIdx.x, head_tile = blockIdx.y;
#endif
    // the launcher checks that a block's heads share their kv head (warpgroups divide the group)
    const int h = WB_PW_HEADS ? head_tile * PW_WG + wg : head_tile, kvh = h / group;
    // this lane's two rows (g and g + 8 of its warp's 16); a row past the last attends to key 0 alone, unwritten
    const int ra = row_tile * PW_BM + (WB_PW_HEADS ? 0 : wg * PW_M) + warp * 16 + g, rb = ra + 8;
    const long long qa = ra * stride + h * WB_HD, qb = rb * stride + h * WB_HD;
    const int pa = ra < n ? (int)pos[ra] : 0, pb = rb < n ? (int)pos[rb] : 0;
    if (threadIdx.x == 0) last_key = 0;
    if (threadIdx.x < PW_WG) wg_last[threadIdx.x] = 0;
#if WB_PW_TMA
    if (threadIdx.x == 0) {
        for (int s = 0; s < PW_STAGES; ++s) wb_mbar_init(pw_full + s, 1);   // the issuer's one arrival a phase
#if WB_PW_PRODUCER
        for (int s = 0; s < PW_STAGES; ++s) wb_mbar_init(pw_empty + s, 4 * PW_WG);     // each consumer warp's
#endif
        wb_mbar_init_fence();
    }
#endif
    __syncthreads();
    atomicMax(&last_key, max(pa, pb));
    atomicMax(&wg_last[wg], max(pa, pb));
    int first = min(pa, pb);                                   // the warp's first row position: no mask before it
#pragma unroll
    for (int m = 1; m < WB_WARP; m <<= 1) first = min(first, wb_shfl_xor(first, m));

    // the queries, scaled and split, into shared memory as Q·Kᵀ's A (64 rows × head_dim a warpgroup, K-major core
    // matrices as the tiles': row r, columns 8c.. at ((r / 8)·(hd / 8) + c)·128 + (r % 8)·16): each lane writes
    // the pairs its mma.sync A fragment would hold. A from the registers lost them: ptxas (13.0) gave the
    // loop-invariant fragments' registers to P's inside the key loop (the SASS read P as Q from the second tile).
    u8* qs = pw_smem + PW_STAGES * 2 * PW_TILE_BYTES + wg * WB_PA_HALVES * PW_Q_BYTES;
#pragma unroll
    for (int kk = 0; kk < WB_HD / 16 && !producer; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = (i & 1) ? rb : ra, col = kk * 16 + 2 * t + ((i & 2) ? 8 : 0);
            float x0 = 0.f, x1 = 0.f;
            if (row < n) {
                const float* p = q + ((i & 1) ? qb : qa) + col;
                x0 = p[0] * scale;
                x1 = p[1] * scale;
            }
            u32 hi, lo;
            pa_split(x0, x1, hi, lo);
            const int r = warp * 16 + g + ((i & 1) ? 8 : 0);
            const int at = ((r >> 3) * (WB_HD / 8) + (col >> 3)) * 128 + (r & 7) * 16 + (col & 7) * 2;
            *(u32*)(qs + at) = hi;
            if (WB_PA_HALVES == 2) *(u32*)(qs + PW_Q_BYTES + at) = lo;
        }
    }
    wb_fence_proxy_async();                           // the queries, visible to the products' reads
    float o[WB_HD / 2];                                    // 8 columns a fragment: (ra, 2t), (ra, 2t+1), (rb, ..)
#pragma unroll
    for (int i = 0; i < WB_HD / 2; ++i) o[i] = 0.f;
    float ma = -WB_INF, mb = -WB_INF, la = 0.f, lb = 0.f;     // running max and (this lane's part of) sum
    __syncthreads();
    const int tiles = last_key / PW_BN + 1, my_last = wg_last[wg];
#if !WB_PW_TMA
    const bf16* kb = k + (long long)kvh * kv_stride * WB_HD;
    const bf16* vb = v + (long long)kvh * kv_stride * WB_HD;
#endif
    u32 ph[PW_BN / 16][4], pl[PW_BN / 16][4];
    // a tile's copy issued, the wait until it has landed with `ahead` more tiles' copies in flight behind it, and
    // the tile's stage free once this thread's products have read it (a block barrier: every thread's have)
#if WB_PW_PRODUCER
    if (producer) {                                   // every tile's copy, as soon as its stage is free
        wb_setmaxnreg_dec<PW_PRODUCER_REGS>();
        if (threadIdx.x == 4 * WB_WARP * PW_WG) {
            for (int tile = 0; tile < tiles; ++tile) {
                if (tile >= PW_STAGES) pw_wait_stage_free(pw_empty, tile);
                pw_load_tile_tma(pw_smem, pw_full, &k_map, &v_map, kvh, tile, last_key);
            }
        }
        return;
    }
    wb_setmaxnreg_inc<PW_CONSUMER_REGS>();
#define PW_LOAD_TILE(tile)
#define PW_WAIT_TILE(tile, ahead) pw_wait_tile_tma(pw_full, (tile))
#define PW_FREE_STAGE(tile) pw_free_stage(pw_empty, (tile))
#elif WB_PW_TMA
#define PW_LOAD_TILE(tile) if (threadIdx.x == 0) pw_load_tile_tma(pw_smem, pw_full, &k_map, &v_map, kvh, (tile), last_key)
#define PW_WAIT_TILE(tile, ahead) pw_wait_tile_tma(pw_full, (tile))
#define PW_FREE_STAGE(tile) __syncthreads()
#else
#define PW_LOAD_TILE(tile) pw_load_tile(pw_smem, kb, vb, (tile), last_key)
    // this thread's copies made visible to the products' reads, and every thread's landed
#define PW_WAIT_TILE(tile, ahead) (wb_cp_async_wait<(ahead)>(), wb_fence_proxy_async(), __syncthreads())
#define PW_FREE_STAGE(tile) __syncthreads()
#endif
#if WB_PW_OVERLAP
    const int my_tiles = my_last / PW_BN + 1;               // the tiles this warpgroup's rows reach
    __shared__ int pw_pin;                                  // pw_softmax_before_wait's, never written
    // FA3's pipelining within a warpgroup: tile j's Q·Kᵀ and tile j − 1's P·V are in flight together, and tile j's
    // softmax runs while the P·V is, so the tensor cores work through the exps. The output takes the same
    // operations in the same order as below (P·V of tile j − 1 added, then the rescale to tile j's max, then tile
    // j's P·V), so the same bits. A tile's stage is read until the next tile's P·V lands: STAGES − 2 tiles are in
    // flight ahead of the one the products read.
#pragma unroll
    for (int tile = 0; tile < PW_STAGES - 2; ++tile) PW_LOAD_TILE(tile);
    for (int tile = 0; tile <= tiles; ++tile) {
        if (tile < tiles) {
            // tile + STAGES − 2's copy, into the stage of tile − 2 (whose P·V landed before the barrier that ended
            // the last iteration); then this tile's group, the oldest of the STAGES − 1 in flight, has landed
            PW_LOAD_TILE(tile + PW_STAGES - 2);
            PW_WAIT_TILE(tile, PW_STAGES - 2);
        }
        // tiles wholly past the warpgroup's last row are skipped, the same for all its warps. Each case fences,
        // issues and waits within its own branch: ptxas serialises every product (C7520) where a wgmma's registers
        // were last written on another branch than the one that issues it.
        const u8* kt = pw_smem + (tile % PW_STAGES) * 2 * PW_TILE_BYTES;
        const u8* vt = pw_smem + ((tile + PW_STAGES - 1) % PW_STAGES) * 2 * PW_TILE_BYTES + PW_TILE_BYTES;
        if (tile > 0 && tile < my_tiles) {                 // S of this tile and P·V of the last, in flight together
            float s[PW_BN / 2], ca, cb;
            wb_wgmma_fence();
            pw_issue_scores(s, qs, kt);
            wb_wgmma_commit();
            pw_issue_values(o, ph, pl, vt);
            wb_wgmma_commit();
            wb_wgmma_wait<1>();                            // the groups land in order: S first
            pw_fence_regs<PW_BN / 2>(s);
            pa_softmax_scores<PW_BN / 8>(s, tile * PW_BN, PW_BN, first, pa, pb, t, ma, mb, la, lb, ca, cb);
            pw_softmax_before_wait(la + lb, &pw_pin);
            wb_wgmma_wait<0>();
            pw_fence_regs<WB_HD / 2>(o);
            pw_fence_frags<PW_BN / 16>(ph);                // read by the P·V until here: not reused before
            if (WB_PA_HALVES == 2) pw_fence_frags<PW_BN / 16>(pl);
            pa_rescale<WB_HD / 8>(o, ca, cb);
            pw_split_probabilities(s, ph, pl);
        } else if (tile == 0) {                            // the first tile's S alone
            float s[PW_BN / 2], ca, cb;
            wb_wgmma_fence();
            pw_issue_scores(s, qs, kt);
            wb_wgmma_commit();
            wb_wgmma_wait<0>();
            pw_fence_regs<PW_BN / 2>(s);
            pa_softmax_scores<PW_BN / 8>(s, 0, PW_BN, first, pa, pb, t, ma, mb, la, lb, ca, cb);
            pa_rescale<WB_HD / 8>(o, ca, cb);
            pw_split_probabilities(s, ph, pl);
        } else if (tile == my_tiles) {                     // the last tile's P·V alone
            wb_wgmma_fence();
            pw_issue_values(o, ph, pl, vt);
            wb_wgmma_commit();
            wb_wgmma_wait<0>();
            pw_fence_regs<WB_HD / 2>(o);
        }
        if (tile > 0) PW_FREE_STAGE(tile - 1);        // tile − 1's stage read by the P·V (every warpgroup's)
    }
#else
#pragma unroll
    for (int tile = 0; tile < PW_STAGES - 1; ++tile) PW_LOAD_TILE(tile);
    // the turns (WB_PW_PINGPONG): warpgroup w waits on barrier PW_TURN + w before it issues a tile's scores, and
    // once they are issued lets the other go; warpgroup 1 gives warpgroup 0 the first turn, and every tile of the
    // block takes both turns, a skipped one at once, so each barrier is synced on as often as it is arrived on
    // (warpgroup 1's last turn hands nothing on)
    if (WB_PW_PINGPONG && wg == 1) wb_named_arrive(PW_TURN, 8 * WB_WARP);

    for (int tile = 0; tile < tiles; ++tile) {
        const int j0 = tile * PW_BN;
        const bool hand_on = WB_PW_PINGPONG && !(wg == 1 && tile == tiles - 1);
        // tile + STAGES − 1's copy, into the stage tile − 1 used (every thread is past it: the barrier below);
        // then this tile's group, the oldest of the STAGES in flight, has landed
        PW_LOAD_TILE(tile + PW_STAGES - 1);
        PW_WAIT_TILE(tile, PW_STAGES - 1);
        const u8* kt = pw_smem + (tile % PW_STAGES) * 2 * PW_TILE_BYTES;
        if (WB_PW_PINGPONG) wb_named_sync(PW_TURN + wg, 8 * WB_WARP);
        // a tile wholly past the warpgroup's last row changes none of its rows (every weight would be 0): skipped,
        // the same for all its warps, which issue the products together
        if (j0 <= my_last) {
            float s[PW_BN / 2];
            wb_wgmma_fence();
            pw_issue_scores(s, qs, kt);
            wb_wgmma_commit();
            if (hand_on) wb_named_arrive(PW_TURN + 1 - wg, 8 * WB_WARP);
            wb_wgmma_wait<0>();
            pw_fence_regs<PW_BN / 2>(s);
            pa_softmax_tile<PW_BN / 8, WB_HD / 8>(s, o, j0, PW_BN, first, pa, pb, t, ma, mb, la, lb);
            pw_split_probabilities(s, ph, pl);
            wb_wgmma_fence();
            pw_issue_values(o, ph, pl, kt + PW_TILE_BYTES);
            wb_wgmma_commit();
            wb_wgmma_wait<0>();
            pw_fence_regs<WB_HD / 2>(o);
        } else if (hand_on) {
            wb_named_arrive(PW_TURN + 1 - wg, 8 * WB_WARP);
        }
        PW_FREE_STAGE(tile);                          // before the next tile's copy overwrites this stage
    }
#endif
    pa_write_rows<WB_HD / 8>(out, o, qa, qb, ra < n, rb < n, t, la, lb);
}

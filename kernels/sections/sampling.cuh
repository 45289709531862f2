// The next token, chosen on the GPU by one block: greedy (fused argmax partials from the LM head), or a draw from
// softmax(logits / T) restricted by top-k and top-p, exactly the distribution of HF's Temperature → TopK → TopP
// warpers. No sort: top-k and top-p thresholds come from radix selection over the order-preserving 32-bit image
// of the keys, 8 bits per pass (4 passes each). Probability mass is summed in 2^-40 fixed point on 64-bit
// integers, so sums are exact and the draw is bit-reproducible for a given seed, whatever the thread schedule.
#pragma once

constexpr double SAMP_ONE = 1099511627776.0;   // 2^40: the fixed-point unit of probability mass

__device__ __forceinline__ u32 ord_key(float f) {      // a > b as floats ⇔ ord_key(a) > ord_key(b) as integers
    const u32 u = wb_float_as_u32(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ u64 samp_mass(float key, float mkey) { return (u64)((double)wb_exp_precise(key - mkey) * SAMP_ONE); }

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
// uniform in [0, 1), a pure function of (seed, step, draw): reruns with a seed reproduce the stream
__device__ __forceinline__ double samp_uniform(u64 seed, int step, int draw) {
    return (double)(splitmix64(splitmix64(seed ^ splitmix64((u64)step)) + (u64)draw) >> 11) * (1.0 / 9007199254740992.0);
}

struct SampScratch {
    u64 hist[256];
    u64 chunk[1024];      // per-thread inclusive prefix of kept mass (thread t owns a contiguous index range)
    u32 prefix, mask;
    u64 remaining;
};
static_assert(sizeof(SampScratch) <= 4 * WB_SMEM_SAMPLING_SCRATCH_FLOATS && WB_THREADS <= 1024,
              "the plan's scratch region holds SampScratch, one chunk per thread");

// Radix selection: the largest key threshold t (as ord_key) such that the kept set {ord ≥ t} reaches `target`,
// counting each kept element as 1 (by_mass = false: top-k) or as its fixed-point mass (top-p). Only elements
// with ord ≥ floor_ord take part.
__device__ u32 samp_radix_select(const float* __restrict__ logits, float T, float mkey, u32 floor_ord, u64 target,
                                 bool by_mass, SampScratch* sc) {
    if (wb_tid() == 0) { sc->prefix = 0; sc->mask = 0; sc->remaining = target; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = wb_tid(); b < 256; b += wb_ntid()) sc->hist[b] = 0;
        wb_syncthreads();
        const u32 prefix = sc->prefix, mask = sc->mask;
        for (int i = wb_tid(); i < WB_VOCAB; i += wb_ntid()) {
            const float key = wb_ld_cg(logits + i) / T;
            const u32 o = ord_key(key);
            if (o >= floor_ord && (o & mask) == prefix)
                wb_atomic_add(&sc->hist[(o >> shift) & 255u], by_mass ? samp_mass(key, mkey) : 1ull);
        }
        wb_syncthreads();
        if (wb_tid() == 0) {
            u64 cum = 0, rem = sc->remaining;
            int sel = 0;
            for (int b = 255; b >= 0; --b) {
                if (cum + sc->hist[b] >= rem) { sel = b; break; }
                cum += sc->hist[b];
            }
            sc->remaining = rem - cum;
            sc->prefix = prefix | ((u32)sel << shift);
            sc->mask = mask | (255u << shift);
        }
        wb_syncthreads();
    }
    return sc->prefix;
}

// Returns the sampled token (valid in thread 0). Called by one block only. At a recorded step with n_draws > 0,
// the final draw is repeated with successive draw counters into P->draws (the statistical and the exact checks of
// the sampler), the first draw being the token. P: temperature, top_k, top_p, seed.
WB_SECTION int stage_sampling(const float* logits, const float* blk_max, const int* blk_arg, const Params* __restrict__ P,
                              int step, float* smem) {
    // max logit and greedy argmax from the LM head's per-block partials
    __shared__ float best_v;
    __shared__ int best_i;
    if (wb_warp() == 0) {                        // one warp: a strided pass, then a shuffle tree
        float bv = -WB_INF;
        int bi = 0x7fffffff;
        for (int b = wb_lane(); b < wb_nbid(); b += WB_WARP) {
            const float v = wb_ld_cg(blk_max + b);
            const int i = ((volatile const int*)blk_arg)[b];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
#pragma unroll
        for (int m = WB_WARP / 2; m > 0; m >>= 1) {
            const float v = wb_shfl_xor(bv, m);
            const int i = wb_shfl_xor(bi, m);
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        if (wb_lane() == 0) { best_v = bv; best_i = bv > -WB_INF ? bi : -1; }   // all NaN / -inf: no token
    }
    wb_syncthreads();
    const float T = P->temperature;
    // a greedy-only build (WB_SAMPLER_FULL 0) has none of the code below; the host refuses to sample with it
    if (!WB_SAMPLER_FULL || !(T > 0.f) || P->top_k == 1) return best_i;

    SampScratch* sc = (SampScratch*)(smem + WB_SMEM_SAMPLING_SCRATCH);
    const float mkey = best_v / T;
    u32 floor_ord = 0;
    if (P->top_k > 0 && P->top_k < WB_VOCAB)
        floor_ord = samp_radix_select(logits, T, mkey, 0u, (u64)P->top_k, false, sc);
    // kept mass per thread over a contiguous index range, then an inclusive scan (thread 0; ≤ 1024 entries)
    const int nt = wb_ntid(), per = (WB_VOCAB + nt - 1) / nt;
    auto chunk_mass = [&](u32 fl) {
        u64 s = 0;
        const int lo = wb_tid() * per, hi = lo + per < WB_VOCAB ? lo + per : WB_VOCAB;
        for (int i = lo; i < hi; ++i) {
            const float key = wb_ld_cg(logits + i) / T;
            if (ord_key(key) >= fl) s += samp_mass(key, mkey);
        }
        sc->chunk[wb_tid()] = s;
        wb_syncthreads();
        if (wb_tid() == 0) for (int t = 1; t < nt; ++t) sc->chunk[t] += sc->chunk[t - 1];
        wb_syncthreads();
        return sc->chunk[nt - 1];
    };
    if (P->top_p < 1.f) {
        const u64 zk = chunk_mass(floor_ord);
        u64 target = (u64)((double)P->top_p * (double)zk);
        if (target == 0) target = 1;
        const u32 p_ord = samp_radix_select(logits, T, mkey, floor_ord, target, true, sc);
        floor_ord = p_ord > floor_ord ? p_ord : floor_ord;
    }
    const u64 Z = chunk_mass(floor_ord);
    __shared__ int token;
    {   // draws are independent: the block's threads share them (thread 0 makes draw 0, the token)
        const int rec = P->rec_slot[step];
        const bool keep = P->n_draws > 0 && rec >= 0;             // a recorded step: its draws go to P->draws
        const int ndraw = keep ? P->n_draws : 1;
        for (int d = wb_tid(); d < ndraw; d += wb_ntid()) {
            const u64 u = (u64)(samp_uniform(P->seed, step, d) * (double)Z);   // in [0, Z)
            int lo = 0, hi = nt - 1;                                            // first chunk whose prefix > u
            while (lo < hi) { const int mid = (lo + hi) / 2; if (sc->chunk[mid] > u) hi = mid; else lo = mid + 1; }
            u64 cum = lo > 0 ? sc->chunk[lo - 1] : 0;
            int tok = -1;
            const int end = (lo + 1) * per < WB_VOCAB ? (lo + 1) * per : WB_VOCAB;
            for (int i = lo * per; i < end; ++i) {
                const float key = wb_ld_cg(logits + i) / T;
                if (ord_key(key) < floor_ord) continue;
                cum += samp_mass(key, mkey);
                if (cum > u) { tok = i; break; }
            }
            if (d == 0) token = tok;
            if (keep) P->draws[(long long)rec * ndraw + d] = tok;
        }
    }
    wb_syncthreads();
    return token;
}

/* wb:checks
mutant greedy-off-by-one: the greedy token is the argmax + 1
-best_i = bv > -WB_INF ? bi : -1;
+best_i = bv > -WB_INF ? bi + 1 : -1;

mutant top-k-one-more: top-k keeps k + 1 tokens
-(u64)P->top_k, false, sc);
+(u64)P->top_k + 1, false, sc);

mutant top-p-drops-boundary: top-p drops the token that reaches p
-floor_ord = p_ord > floor_ord ? p_ord : floor_ord;
+floor_ord = p_ord + 1 > floor_ord ? p_ord + 1 : floor_ord;

mutant draw-wrong-step: the draws use the next step's random numbers
-samp_uniform(P->seed, step, d)
+samp_uniform(P->seed, step + 1, d)

inject sampler-loops [expect=hang, block=0]: the sampler never returns (block 0 spins)
-    // max logit and greedy argmax from the LM head's per-block partials
+    if (wb_tid() == 0) { volatile int spin = 1; while (spin) { } }
+    // max logit and greedy argmax from the LM head's per-block partials
*/

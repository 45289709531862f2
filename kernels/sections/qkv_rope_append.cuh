// q, k, v = Wqkv · rmsnorm(x) (+ bqkv, Qwen2); each q and k head RMS-normalised with its gain (Qwen3); RoPE on q
// and k; k and v appended to the layer's bf16 KV cache at `pos`.
//
// The attention norm's gain is folded into Wqkv, so the block only divides x by its RMS. Wqkv rows come in
// rotate-half pairs (i, i + hd/2) side by side, so the warp that computes a pair also rotates it: no exchange
// between warps, and q/k never round-trip through memory unrotated.
//
// Qwen3's per-head norm needs the whole head before any of it can be rotated, and a head's hd/2 row pairs are dealt
// across blocks. Each pair goes to qk_raw unrotated; the warp that finishes a head's last pair (an arrival counter
// per head, as attention merges its splits) normalises, scales and rotates the whole head. Nobody waits, so no
// grid barrier is added and no wait can hang; the order of the arrivals changes nothing, since the finisher reads
// the head in a fixed order.
#pragma once

__device__ __forceinline__ void qk_put(float* o, float v) { *o = v; }
__device__ __forceinline__ void qk_put(bf16* o, float v) { *o = f32_to_bf16(v); }

// One head of qk_raw (`raw`, hd floats in natural order) RMS-normalised, times `gain`, rotated, written to `out`
// (q: fp32, k: the cache's bf16), by a whole warp: lane l takes the pairs l, l + WB_WARP, ...
template <typename T>
__device__ __forceinline__ void qk_norm_rope_head(const float* raw, const float* __restrict__ gain,
                                                  const float* __restrict__ cs, const float* __restrict__ sn, T* out) {
    constexpr int HALF = WB_HEAD_DIM / 2, PER_LANE = (HALF + WB_WARP - 1) / WB_WARP;
    float lo[PER_LANE], hi[PER_LANE], ss = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int p = wb_lane() + j * WB_WARP;
        lo[j] = p < HALF ? wb_ld_cg(raw + p) : 0.f;              // through L2: other SMs wrote most of the head
        hi[j] = p < HALF ? wb_ld_cg(raw + p + HALF) : 0.f;
        ss += lo[j] * lo[j] + hi[j] * hi[j];
    }
    const float scale = wb_rsqrt(wb_warp_sum(ss) / (float)WB_HEAD_DIM + WB_RMS_EPS);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int p = wb_lane() + j * WB_WARP;
        if (p >= HALF) continue;
        const float a = lo[j] * scale * gain[p], b = hi[j] * scale * gain[p + HALF], c = cs[p], s = sn[p];
        qk_put(out + p, a * c - b * s);
        qk_put(out + p + HALF, b * c + a * s);
    }
}

WB_SECTION void stage_qkv_rope_append(const fx64* x, const bf16* __restrict__ wqkv, const float* __restrict__ bqkv,
                                      const float* __restrict__ qk_gain, const float* __restrict__ rope_cos,
                                      const float* __restrict__ rope_sin, int layer, int pos, float* smem, float* q,
                                      bf16* k_cache, bf16* v_cache, float* qk_raw, u32* qk_count) {
    constexpr int HALF = WB_HEAD_DIM / 2;
    constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM, KV_DIM = WB_KV_HEADS * WB_HEAD_DIM;
    constexpr int PAIRS = (Q_DIM + 2 * KV_DIM) / 2;
    static_assert(WB_SMEM_QKV_ROPE_APPEND_ACT_FLOATS >= WB_D && WB_SMEM_QKV_ROPE_APPEND_RED_FLOATS >= WB_MAX_WARPS,
                  "the plan's regions hold x and one float per warp");
    float* act = smem + WB_SMEM_QKV_ROPE_APPEND_ACT;
    float* red = smem + WB_SMEM_QKV_ROPE_APPEND_RED;
    const float* __restrict__ cs = rope_cos + (long long)pos * HALF;
    const float* __restrict__ sn = rope_sin + (long long)pos * HALF;
    const long long kv_base = (long long)pos * WB_HEAD_DIM;                 // cache [Hkv, max_seq, hd], row pos
    auto prologue = [&] { load_rms_normalized(act, x, WB_D, red); };
    // fewer row pairs than warps (1,536 for 2,112 on 1B shapes): dealt across blocks, so that every SM loads a share
    for_warp_units<WB_D, 2, WB_DEAL_QKV_ROPE_APPEND>(wqkv, PAIRS, act, prologue, [&](int u, const float* y) {
        const int row = 2 * u;
        // the biases in Wqkv's row order, added before RoPE as HF does (a model without them compiles this away)
        const float r[2] = {WB_QKV_BIAS ? y[0] + bqkv[row] : y[0], WB_QKV_BIAS ? y[1] + bqkv[row + 1] : y[1]};
        if (WB_QK_NORM && row < Q_DIM + KV_DIM) {              // a q or k head: stored raw, finished by its last pair
            const int h = row / WB_HEAD_DIM, p = (row % WB_HEAD_DIM) / 2;   // h: q heads, then k heads
            int last = 0;
            if (wb_lane() == 0) {
                qk_raw[h * WB_HEAD_DIM + p] = r[0];
                qk_raw[h * WB_HEAD_DIM + p + HALF] = r[1];
                wb_fence_gpu();                                // the pair is in L2 before it is counted
                last = wb_atomic_add(qk_count + h, 1u) == (u32)(HALF - 1);
                if (last) {
                    qk_count[h] = 0;                           // ready for the next layer (after a barrier)
                    wb_fence_gpu();                            // every other pair of the head is visible here...
                }
            }
            if (!wb_shfl(last, 0)) return;
            wb_syncwarp();                                     // ...and to the lanes, ordered after lane 0 by the warp barrier
            const float* raw = qk_raw + h * WB_HEAD_DIM;
            if (h < WB_HEADS)
                qk_norm_rope_head(raw, qk_gain, cs, sn, q + h * WB_HEAD_DIM);
            else
                qk_norm_rope_head(raw, qk_gain + WB_HEAD_DIM, cs, sn,
                                  k_cache + kv_base + (long long)(h - WB_HEADS) * WB_MAX_SEQ * WB_HEAD_DIM);
            return;
        }
        if (wb_lane() != 0) return;
        if (row < Q_DIM + KV_DIM) {                            // q or k: rotate the pair (p, p + hd/2)
            const int rr = row < Q_DIM ? row : row - Q_DIM;
            const int head = rr / WB_HEAD_DIM, p = (rr % WB_HEAD_DIM) / 2;
            const float c = cs[p], s = sn[p];
            const float lo = r[0] * c - r[1] * s, hi = r[1] * c + r[0] * s;
            if (row < Q_DIM) {
                q[head * WB_HEAD_DIM + p] = lo;
                q[head * WB_HEAD_DIM + p + HALF] = hi;
            } else {
                bf16* k = k_cache + kv_base + (long long)head * WB_MAX_SEQ * WB_HEAD_DIM;
                k[p] = f32_to_bf16(lo);
                k[p + HALF] = f32_to_bf16(hi);
            }
        } else {                                               // v: two consecutive dims, no rotation
            const int rr = row - Q_DIM - KV_DIM;
            bf16* v = v_cache + kv_base + (long long)(rr / WB_HEAD_DIM) * WB_MAX_SEQ * WB_HEAD_DIM;
            v[rr % WB_HEAD_DIM] = f32_to_bf16(r[0]);
            v[rr % WB_HEAD_DIM + 1] = f32_to_bf16(r[1]);
        }
    });
}

/* wb:checks
mutant rope-sign [not_with=qk_norm]: rotates by −angle (sin term's sign)
-const float lo = r[0] * c - r[1] * s, hi = r[1] * c + r[0] * s;
+const float lo = r[0] * c + r[1] * s, hi = r[1] * c - r[0] * s;

mutant rope-pair [not_with=qk_norm]: rotates pair p by the angle of pair p^1
-const float c = cs[p], s = sn[p];
+const float c = cs[p ^ 1], s = sn[p ^ 1];

mutant rope-long-position: rope angle of position − 1 from 4,096 on (off by one, long only)
-rope_cos + (long long)pos * HALF
+rope_cos + (long long)(pos < 4096 ? pos : pos - 1) * HALF

mutant kv-wrong-slot: appends k and v at pos + 1
-const long long kv_base = (long long)pos * WB_HEAD_DIM;
+const long long kv_base = (long long)(pos + 1) * WB_HEAD_DIM;

mutant k-truncated [not_with=qk_norm]: k to bf16 by truncation instead of rounding
-k[p] = f32_to_bf16(lo);
+k[p] = (bf16)(wb_float_as_u32(lo) >> 16);

mutant q-scale-1e-4 [not_with=qk_norm]: q's first halves 1e-4 too large
-q[head * WB_HEAD_DIM + p] = lo;
+q[head * WB_HEAD_DIM + p] = lo * 1.0001f;

mutant qk-norm-k-takes-q-gain [needs=qk_norm]: k heads normalised with q's gain
-qk_gain + WB_HEAD_DIM, cs, sn,
+qk_gain, cs, sn,

mutant qk-norm-rope-sign [needs=qk_norm]: a normalised head rotated by −angle (sin term's sign)
-qk_put(out + p, a * c - b * s);
-        qk_put(out + p + HALF, b * c + a * s);
+qk_put(out + p, a * c + b * s);
+        qk_put(out + p + HALF, b * c - a * s);

mutant qk-norm-k-truncated [needs=qk_norm]: a normalised k to bf16 by truncation instead of rounding
-__device__ __forceinline__ void qk_put(bf16* o, float v) { *o = f32_to_bf16(v); }
+__device__ __forceinline__ void qk_put(bf16* o, float v) { *o = (bf16)(wb_float_as_u32(v) >> 16); }

mutant qk-norm-scale-1e-4 [needs=qk_norm]: the per-head RMS 1e-4 too large (q and k 1e-4 too small)
-wb_warp_sum(ss) / (float)WB_HEAD_DIM + WB_RMS_EPS
+wb_warp_sum(ss) / (float)WB_HEAD_DIM * 1.0002f + WB_RMS_EPS

mutant qk-norm-last-pair-unwritten [needs=qk_norm]: each q and k head's last rope pair is never written
-if (p >= HALF) continue;
+if (p >= HALF - 1) continue;

mutant qkv-bias-dropped [needs=qkv_bias]: the bias of each pair's first row is not added
-WB_QKV_BIAS ? y[0] + bqkv[row] : y[0]
+y[0]

mutant v-dims-swapped: v's two dims of a pair swapped
-v[rr % WB_HEAD_DIM] = f32_to_bf16(r[0]);
-            v[rr % WB_HEAD_DIM + 1] = f32_to_bf16(r[1]);
+v[rr % WB_HEAD_DIM] = f32_to_bf16(r[1]);
+            v[rr % WB_HEAD_DIM + 1] = f32_to_bf16(r[0]);
*/

// q, k, v = Wqkv · rmsnorm(x) (+ bqkv, Qwen2); RoPE on q and k; k and v appended to the layer's bf16 KV cache at
// `pos`.
//
// The attention norm's gain is folded into Wqkv, so the block only divides x by its RMS. Wqkv rows come in
// rotate-half pairs (i, i + hd/2) side by side, so the warp that computes a pair also rotates it: no exchange
// between warps, and q/k never round-trip through memory unrotated.
#pragma once

WB_SECTION void stage_qkv_rope_append(const float* x, const bf16* __restrict__ wqkv, const float* __restrict__ bqkv,
                                      const float* __restrict__ rope_cos,
                                      const float* __restrict__ rope_sin, int layer, int pos, float* smem, float* q,
                                      bf16* k_cache, bf16* v_cache) {
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
    for_warp_units<WB_D, 2, true>(wqkv, PAIRS, act, prologue, [&](int u, const float* y) {
        if (wb_lane() != 0) return;
        const int row = 2 * u;
        // the biases in Wqkv's row order, added before RoPE as HF does (a model without them compiles this away)
        const float r[2] = {WB_QKV_BIAS ? y[0] + bqkv[row] : y[0], WB_QKV_BIAS ? y[1] + bqkv[row + 1] : y[1]};
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

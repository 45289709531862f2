// logits = W_lm · rmsnorm(x) (final norm's gain folded into W_lm). The greedy argmax is fused here: each block
// leaves its best (value, index) in blk_max/blk_arg, so the sampler reduces one pair per block instead of
// rereading the vocabulary.
#pragma once

WB_SECTION void stage_lm_head(const fx64* x, const bf16* __restrict__ lm_head, float* smem, float* logits,
                              float* blk_max, int* blk_arg) {
    static_assert(WB_SMEM_LM_HEAD_ACT_FLOATS >= WB_D && WB_SMEM_LM_HEAD_RED_FLOATS >= 2 * WB_MAX_WARPS,
                  "the plan's regions hold x and a (value, index) per warp");
    float* act = smem + WB_SMEM_LM_HEAD_ACT;
    float* red = smem + WB_SMEM_LM_HEAD_RED;
    float best = -WB_INF;
    int arg = 0x7fffffff;
    auto prologue = [&] { load_rms_normalized(act, x, WB_D, red); };
    for_warp_units<WB_D, 1>(lm_head, WB_VOCAB, act, prologue, [&](int v, const float* y) {
        if (y[0] > best) { best = y[0]; arg = v; }             // rows rise within a warp: ties keep the lowest
        if (wb_lane() == 0) logits[v] = y[0];
    });
    // block reduction of (best, arg): larger value wins, equal values keep the lower index
    int* red_arg = (int*)(red + WB_MAX_WARPS);
    if (wb_lane() == 0) { red[wb_warp()] = best; red_arg[wb_warp()] = arg; }
    wb_syncthreads();
    if (wb_tid() == 0) {
        for (int w = 1; w < wb_nwarps(); ++w)
            if (red[w] > best || (red[w] == best && red_arg[w] < arg)) { best = red[w]; arg = red_arg[w]; }
        blk_max[wb_bid()] = best;
        blk_arg[wb_bid()] = arg;
    }
}

/* wb:checks
mutant logits-last-row: the last vocabulary row is never written
-(lm_head, WB_VOCAB, act,
+(lm_head, WB_VOCAB - 1, act,

mutant partial-wrong-index: each block's argmax partial is off by one
-blk_arg[wb_bid()] = arg;
+blk_arg[wb_bid()] = arg + 1;

mutant logits-scale-1e-4: logits 1e-4 too large
-if (wb_lane() == 0) logits[v] = y[0];
+if (wb_lane() == 0) logits[v] = y[0] * 1.0001f;

inject shared-out-of-bounds [expect=fault, block=11]: block 11 writes 16 MB past its shared memory
-    float* act = smem + WB_SMEM_LM_HEAD_ACT;
+    float* act = smem + WB_SMEM_LM_HEAD_ACT;
+    if (wb_bid() == 11 && wb_tid() == 0) ((volatile float*)smem)[1 << 22] = 1.f;
*/

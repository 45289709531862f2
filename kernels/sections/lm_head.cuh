// logits = W_lm · rmsnorm(x) (final norm's gain folded into W_lm). The greedy argmax is fused here: each block
// leaves its best (value, index); the sampler reduces 1 pair per block instead of rereading the vocabulary.
#pragma once

WB_SECTION void stage_lm_head(const Params* __restrict__ P, float* __restrict__ logits, float* act, float* red) {
    float best = -WB_INF;
    int arg = 0x7fffffff;
    auto prologue = [&] { load_rms_normalized(act, P->x, WB_D, red); };
    for_warp_units<WB_D, 1>(P->lm_head, WB_VOCAB, act, prologue, [&](int v, const float* y) {
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
        P->blk_max[wb_bid()] = best;
        P->blk_arg[wb_bid()] = arg;
    }
}

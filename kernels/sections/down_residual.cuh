// x += Wd · h: the MLP's output projection and the second residual add.
#pragma once

WB_SECTION void stage_down_residual(const Params* __restrict__ P, int layer, float* act) {
    load_activation(act, P->hmlp, WB_FF);
    const bf16* __restrict__ W = P->wd + (long long)layer * WB_D * WB_FF;
    for (int r = grid_warp(); r < WB_D; r += grid_nwarps()) {
        float y[1];
        warp_rows_dot<WB_FF, 1>(W + (long long)r * WB_FF, WB_FF, act, y);
        if (wb_lane() == 0) P->x[r] = wb_ld_cg(P->x + r) + y[0];
    }
    // the next stage: the next layer's QKV, or after the last layer the LM head
    constexpr int QKV_ROWS = (WB_HEADS + 2 * WB_KV_HEADS) * WB_HEAD_DIM;
    if (layer + 1 < WB_LAYERS)
        warp_prefetch_units<WB_D, 2>(P->wqkv + (long long)(layer + 1) * QKV_ROWS * WB_D, QKV_ROWS / 2, WB_PREFETCH_BYTES);
    else
        warp_prefetch_units<WB_D, 1>(P->lm_head, WB_VOCAB, WB_PREFETCH_BYTES);
}

// x += Wo · o. One warp owns each output row, so the residual add needs no atomics.
#pragma once

WB_SECTION void stage_o_proj_residual(const Params* __restrict__ P, int layer, float* act) {
    constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM;
    load_activation(act, P->o, Q_DIM);
    const bf16* __restrict__ W = P->wo + (long long)layer * WB_D * Q_DIM;
    for (int r = grid_warp(); r < WB_D; r += grid_nwarps()) {
        float y[1];
        warp_rows_dot<Q_DIM, 1>(W + (long long)r * Q_DIM, Q_DIM, act, y);
        if (wb_lane() == 0) P->x[r] = wb_ld_cg(P->x + r) + y[0];
    }
    warp_prefetch_units<WB_D, 2>(P->wgu + (long long)layer * 2 * WB_FF * WB_D, WB_FF, WB_PREFETCH_BYTES);
}

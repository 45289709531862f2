// x += Wd · h: the MLP's output projection and the second residual add.
#pragma once

__device__ void stage_down_residual(const Params* __restrict__ P, int layer, float* act) {
    load_activation(act, P->hmlp, WB_FF);
    const bf16* __restrict__ W = P->wd + (long long)layer * WB_D * WB_FF;
    for (int r = grid_warp(); r < WB_D; r += grid_nwarps()) {
        float y[1];
        warp_rows_dot<WB_FF, 1>(W + (long long)r * WB_FF, WB_FF, act, y);
        if (wb_lane() == 0) P->x[r] = wb_ld_cg(P->x + r) + y[0];
    }
}

// x += Wd · hmlp: the MLP's output projection and the second residual add.
#pragma once

WB_SECTION void stage_down_residual(const float* hmlp, const bf16* __restrict__ wd, int layer, float* smem, float* x) {
    static_assert(WB_SMEM_DOWN_RESIDUAL_ACT_FLOATS >= WB_FF, "the plan's act region holds hmlp");
    float* act = smem + WB_SMEM_DOWN_RESIDUAL_ACT;
    auto prologue = [&] { load_activation(act, hmlp, WB_FF); };
    for_warp_units<WB_FF, 1>(wd, WB_D, act, prologue, [&](int r, const float* y) {
        if (wb_lane() == 0) x[r] = wb_ld_cg(x + r) + y[0];
    });
}

// x += Wo · o, and h = the same value (the MLP's norm reads h while down_residual adds into x). One warp owns each
// output row, so the residual add needs no atomics.
#pragma once

WB_SECTION void stage_o_proj_residual(const float* o, const bf16* __restrict__ wo, int layer, float* smem, float* x,
                                      float* h) {
    constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM;
    static_assert(WB_SMEM_O_PROJ_RESIDUAL_ACT_FLOATS >= Q_DIM, "the plan's act region holds o");
    float* act = smem + WB_SMEM_O_PROJ_RESIDUAL_ACT;
    auto prologue = [&] { load_activation(act, o, Q_DIM); };
    for_warp_units<Q_DIM, 1>(wo, WB_D, act, prologue, [&](int r, const float* y) {
        if (wb_lane() == 0) x[r] = h[r] = wb_ld_cg(x + r) + y[0];
    });
}

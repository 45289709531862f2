// x += Wo · o. One warp owns each output row, so the residual add needs no atomics.
#pragma once

WB_SECTION void stage_o_proj_residual(const Params* __restrict__ P, int layer, float* act) {
    constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM;
    const bf16* __restrict__ W = P->wo + (long long)layer * WB_D * Q_DIM;
    auto prologue = [&] { load_activation(act, P->o, Q_DIM); };
    for_warp_units<Q_DIM, 1>(W, WB_D, act, prologue, [&](int r, const float* y) {
        if (wb_lane() == 0) P->x[r] = wb_ld_cg(P->x + r) + y[0];
    });
}

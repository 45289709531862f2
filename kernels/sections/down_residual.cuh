// x += Wd · h: the MLP's output projection and the second residual add.
#pragma once

WB_SECTION void stage_down_residual(const Params* __restrict__ P, int layer, float* act) {
    const bf16* __restrict__ W = P->wd + (long long)layer * WB_D * WB_FF;
    auto prologue = [&] { load_activation(act, P->hmlp, WB_FF); };
    for_warp_units<WB_FF, 1>(W, WB_D, act, prologue, [&](int r, const float* y) {
        if (wb_lane() == 0) P->x[r] = wb_ld_cg(P->x + r) + y[0];
    });
}

// h = silu(Wg · rmsnorm(x)) ⊙ (Wu · rmsnorm(x)). Gate row j and up row j sit side by side in Wgu (the MLP norm's
// gain folded in), so one warp produces h[j] from a single pass over both rows.
#pragma once

WB_SECTION void stage_gate_up_silu(const Params* __restrict__ P, int layer, float* act, float* red) {
    load_rms_normalized(act, P->x, WB_D, red);
    const bf16* __restrict__ W = P->wgu + (long long)layer * 2 * WB_FF * WB_D;
    for (int j = grid_warp(); j < WB_FF; j += grid_nwarps()) {
        float gu[2];
        warp_rows_dot<WB_D, 2>(W + (long long)(2 * j) * WB_D, WB_D, act, gu);
        if (wb_lane() == 0) P->hmlp[j] = gu[0] / (1.f + wb_exp(-gu[0])) * gu[1];
    }
    warp_prefetch_units<WB_FF, 1>(P->wd + (long long)layer * WB_D * WB_FF, WB_D, WB_PREFETCH_BYTES);
}

// h = silu(Wg · rmsnorm(x)) ⊙ (Wu · rmsnorm(x)). Gate row j and up row j sit side by side in Wgu (the MLP norm's
// gain folded in), so one warp produces h[j] from a single pass over both rows.
#pragma once

WB_SECTION void stage_gate_up_silu(const Params* __restrict__ P, int layer, float* act, float* red) {
    const bf16* __restrict__ W = P->wgu + (long long)layer * 2 * WB_FF * WB_D;
    auto prologue = [&] { load_rms_normalized(act, P->x, WB_D, red); };
    for_warp_units<WB_D, 2>(W, WB_FF, act, prologue, [&](int j, const float* gu) {
        if (wb_lane() == 0) P->hmlp[j] = gu[0] / (1.f + wb_exp(-gu[0])) * gu[1];
    });
}

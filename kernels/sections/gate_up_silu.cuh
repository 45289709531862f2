// hmlp = silu(Wg · rmsnorm(x)) ⊙ (Wu · rmsnorm(x)). Gate row j and up row j sit side by side in Wgu (the MLP norm's
// gain folded in), so one warp produces hmlp[j] from a single pass over both rows.
#pragma once

WB_SECTION void stage_gate_up_silu(const float* x, const bf16* __restrict__ wgu, int layer, float* smem, float* hmlp) {
    static_assert(WB_SMEM_GATE_UP_SILU_ACT_FLOATS >= WB_D && WB_SMEM_GATE_UP_SILU_RED_FLOATS >= WB_MAX_WARPS,
                  "the plan's regions hold x and one float per warp");
    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
    float* red = smem + WB_SMEM_GATE_UP_SILU_RED;
    auto prologue = [&] { load_rms_normalized(act, x, WB_D, red); };
    for_warp_units<WB_D, 2>(wgu, WB_FF, act, prologue, [&](int j, const float* gu) {
        if (wb_lane() == 0) hmlp[j] = gu[0] / (1.f + wb_exp(-gu[0])) * gu[1];
    });
}

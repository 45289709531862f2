// hmlp = silu(Wg · rmsnorm(h)) ⊙ (Wu · rmsnorm(h)), with the epilogue in Python: wb_silu_mul is a device function of
// gate_up_silu@numba.py, compiled by numba-cuda (its prototype comes with the build). Gate row j and up row j sit
// side by side in Wgu (the MLP norm's gain folded in), so one warp produces hmlp[j] from a single pass over both
// rows. The units are dealt by blocks: down_residual reads the rows this block wrote, after a block barrier only.
#pragma once

WB_SECTION void stage_gate_up_silu(const float* h, const bf16* __restrict__ wgu, int layer, float* smem, float* hmlp) {
    static_assert(WB_SMEM_GATE_UP_SILU_ACT_FLOATS >= WB_D && WB_SMEM_GATE_UP_SILU_RED_FLOATS >= WB_MAX_WARPS,
                  "the plan's regions hold h and one float per warp");
    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
    float* red = smem + WB_SMEM_GATE_UP_SILU_RED;
    auto prologue = [&] { load_rms_normalized(act, h, WB_D, red); };
    for_warp_units<WB_D, 2, WB_DEAL_GATE_UP_SILU>(wgu, WB_FF, act, prologue, [&](int j, const float* gu) {
        if (wb_lane() == 0) hmlp[j] = wb_silu_mul(gu[0], gu[1]);
    });
}

// hmlp = silu(Wg · rmsnorm(h)) ⊙ (Wu · rmsnorm(h)). Gate row j and up row j sit side by side in Wgu (the MLP norm's
// gain folded in), so one warp produces hmlp[j] from a single pass over both rows. The units are dealt by blocks:
// down_residual reads the rows this block wrote, after a block barrier only.
#pragma once

WB_SECTION void stage_gate_up_silu(const float* h, const bf16* __restrict__ wgu, int layer, float* smem, float* hmlp) {
    static_assert(WB_SMEM_GATE_UP_SILU_ACT_FLOATS >= WB_D && WB_SMEM_GATE_UP_SILU_RED_FLOATS >= WB_MAX_WARPS,
                  "the plan's regions hold h and one float per warp");
    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
    float* red = smem + WB_SMEM_GATE_UP_SILU_RED;
    auto prologue = [&] { load_rms_normalized(act, h, WB_D, red); };
    for_warp_units<WB_D, 2, WB_DEAL_GATE_UP_SILU>(wgu, WB_FF, act, prologue, [&](int j, const float* gu) {
        if (wb_lane() == 0) hmlp[j] = gu[0] / (1.f + wb_exp(-gu[0])) * gu[1];
    });
}

/* wb:checks
mutant silu-1e-4: the gate's sigmoid argument 1e-4 off
-gu[0] / (1.f + wb_exp(-gu[0])) * gu[1]
+gu[0] / (1.f + wb_exp(-gu[0] * 1.0001f)) * gu[1]

mutant gate-up-swapped: silu on the up projection instead of the gate
-gu[0] / (1.f + wb_exp(-gu[0])) * gu[1]
+gu[1] / (1.f + wb_exp(-gu[1])) * gu[0]

mutant hmlp-last-row: the last MLP row is never written
-(wgu, WB_FF, act,
+(wgu, WB_FF - 1, act,

inject trap [expect=fault, block=7]: block 7 executes a trap
-    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
+    float* act = smem + WB_SMEM_GATE_UP_SILU_ACT;
+    if (wb_bid() == 7 && wb_tid() == 0) __trap();
*/

// x += Wo · o, and h = the same value (the MLP's norm reads h while down_residual adds into x). One warp owns each
// output row, so the residual add needs no atomics: it reads x's value (residual.cuh: the parts' sum, rounded to
// fp32 once) and stores the new one whole, in part 0, the other parts cleared for down_residual's adds.
#pragma once

WB_SECTION void stage_o_proj_residual(const float* o, const bf16* __restrict__ wo, int layer, float* smem, fx64* x,
                                      float* h) {
    constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM;
    static_assert(WB_SMEM_O_PROJ_RESIDUAL_ACT_FLOATS >= Q_DIM, "the plan's act region holds o");
    float* act = smem + WB_SMEM_O_PROJ_RESIDUAL_ACT;
    auto prologue = [&] { load_activation(act, o, Q_DIM); };
    for_warp_units<Q_DIM, 1>(wo, WB_D, act, prologue, [&](int r, const float* y) {
        if (wb_lane() == 0) {
            const float v = x_value(x, r) + y[0];
            h[r] = v;
            x_store(x, r, v);
        }
    });
}

/* wb:checks
mutant o-residual-one-layer: layer 1 loses its attention residual
-const float v = x_value(x, r) + y[0];
+const float v = (layer == 1 ? 0.f : x_value(x, r)) + y[0];

mutant o-last-row: the last output row is never written
-(wo, WB_D, act,
+(wo, WB_D - 1, act,

mutant o-h-1e-4: h, the MLP norm's copy of x, 1e-4 off
-h[r] = v;
+h[r] = v * 1.0001f;

inject spin-on-flag [expect=hang, block=3]: block 3 spins on a flag nobody sets, outside any barrier
-    float* act = smem + WB_SMEM_O_PROJ_RESIDUAL_ACT;
+    float* act = smem + WB_SMEM_O_PROJ_RESIDUAL_ACT;
+    if (wb_bid() == 3) { volatile int* never = (volatile int*)act; if (wb_tid() == 0) *never = 0;
+                         while (*never == 0) { } }
*/

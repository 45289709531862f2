// h = x += Wo · o with the dot product's FMAs written in AMDGCN (x as o_proj_residual.cuh reads and stores it): an inline-asm variant of o_proj_residual.cuh.
// On gfx942 one v_pk_fma_f32 does two fp32 FMAs (a VGPR pair each operand): the even elements of a row accumulate
// in one half, the odd in the other, and the halves are added before the wavefront's sum. Each lane reads the
// row's 16-byte pieces at 8·lane, 8·lane + 512, ... (a wavefront is 64 lanes), as the portable GEMV does. On
// NVIDIA this variant is the portable code; NVIDIA's assembly variant is o_proj_residual@ptx.ptx.
#pragma once

#if WB_AMD
typedef float wb_f2 __attribute__((ext_vector_type(2)));

// acc + w·a, element by element, in one instruction
__device__ __forceinline__ wb_f2 gcn_pk_fma(wb_f2 w, wb_f2 a, wb_f2 acc) {
    wb_f2 d;
    asm("v_pk_fma_f32 %0, %1, %2, %3" : "=v"(d) : "v"(w), "v"(a), "v"(acc));   // no side effects: schedulable
    return d;
}

// the two bf16 of a 32-bit word as two floats (exact: the bits become each float's high half)
__device__ __forceinline__ wb_f2 gcn_bf16_pair(u32 w) { return wb_f2{bf16_lo(w), bf16_hi(w)}; }
#endif

WB_SECTION void stage_o_proj_residual(const float* o, const bf16* __restrict__ wo, int layer, float* smem, fx64* x,
                                      float* h) {
    constexpr int Q_DIM = WB_HEADS * WB_HEAD_DIM;
    static_assert(WB_SMEM_O_PROJ_RESIDUAL_ACT_FLOATS >= Q_DIM, "the plan's act region holds o");
    float* act = smem + WB_SMEM_O_PROJ_RESIDUAL_ACT;
    auto prologue = [&] { load_activation(act, o, Q_DIM); };
#if WB_AMD
    prologue();
    constexpr int STEP = WB_WARP * 8;
    for (int r = grid_warp(); r < WB_D; r += grid_nwarps()) {
        const bf16* __restrict__ row = wo + (long long)r * Q_DIM;
        wb_f2 acc = {0.f, 0.f};
#pragma unroll 4
        for (int k = wb_lane() * 8; k < Q_DIM; k += STEP) {       // up to four pieces' loads in flight
            const wb_u4 w = wb_ld_stream(row + k);
            const float* a = act + k;
            acc = gcn_pk_fma(gcn_bf16_pair(w.x), wb_f2{a[0], a[1]}, acc);
            acc = gcn_pk_fma(gcn_bf16_pair(w.y), wb_f2{a[2], a[3]}, acc);
            acc = gcn_pk_fma(gcn_bf16_pair(w.z), wb_f2{a[4], a[5]}, acc);
            acc = gcn_pk_fma(gcn_bf16_pair(w.w), wb_f2{a[6], a[7]}, acc);
        }
        const float y = wb_warp_sum(acc.x + acc.y);
        if (wb_lane() == 0) {
            const float v = x_value(x, r) + y;
            h[r] = v;
            x_store(x, r, v);
        }
    }
#else
    for_warp_units<Q_DIM, 1>(wo, WB_D, act, prologue, [&](int r, const float* y) {
        if (wb_lane() == 0) {
            const float v = x_value(x, r) + y[0];
            h[r] = v;
            x_store(x, r, v);
        }
    });
#endif
}

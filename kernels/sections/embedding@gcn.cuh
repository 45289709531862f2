// x = embed[token], widened to fp32, with the widening written in AMDGCN: an inline-asm variant of embedding.cuh.
// v_lshlrev_b32 moves the 16 bf16 bits to the high half of a 32-bit register, which is then the fp32 of the same
// value (exact); x_store puts it in the residual stream's fixed point. On NVIDIA this variant is the portable
// code; NVIDIA's assembly variant is embedding@ptx.ptx.
#pragma once

WB_SECTION void stage_embedding(int token, const bf16* __restrict__ embed, fx64* x) {
    const bf16* __restrict__ row = embed + (long long)token * WB_D;
    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) {
#if WB_AMD
        u32 bits;
        asm volatile("v_lshlrev_b32 %0, 16, %1" : "=v"(bits) : "v"((u32)row[i]));
        x_store(x, i, __builtin_bit_cast(float, bits));
#else
        x_store(x, i, bf16_to_f32(row[i]));
#endif
    }
}

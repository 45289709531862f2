// x = embed[token], widened to fp32 and stored as the residual stream's fixed point (kernels/lib/residual.cuh):
// exact for every bf16 of magnitude 2^-25 or more, the nearest multiple of 2^-32 below that.
// Run by block 0 (the block that chose the token), before the barrier that opens the step.
#pragma once

WB_SECTION void stage_embedding(int token, const bf16* __restrict__ embed, fx64* x) {
    const bf16* __restrict__ row = embed + (long long)token * WB_D;
    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x_store(x, i, bf16_to_f32(row[i]));
}

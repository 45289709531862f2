// x = embed[token], widened to fp32: the residual stream lives in fp32 for the whole step.
// Run by block 0 (the block that chose the token), before the barrier that opens the step.
#pragma once

WB_SECTION void stage_embedding(int token, const bf16* __restrict__ embed, float* x) {
    const bf16* __restrict__ row = embed + (long long)token * WB_D;
    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x[i] = bf16_to_f32(row[i]);
}

// x = embed[token], widened to fp32: the residual stream lives in fp32 for the whole step.
// Run by one block (the one that chose the token), before the barrier that ends the step.
#pragma once

WB_SECTION void embed_token(const Params* __restrict__ P, int token) {
    const bf16* __restrict__ row = P->embed + (long long)token * WB_D;
    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) P->x[i] = bf16_to_f32(row[i]);
}

// The monokernel: one launch generates the whole stream. A persistent grid (one block per SM, all resident, so
// the grid barriers cannot deadlock) runs the decode step of workbench/plan.py, generated above as
// wb_decode_step, once per token until the step's publish says stop or a barrier reports an error.
#pragma once

extern "C" __global__ void __launch_bounds__(WB_THREADS, 1) wb_generate(const Params* __restrict__ P) {
    extern __shared__ __attribute__((aligned(16))) float smem[];
#if WB_STREAMING
    wb_stream_init(P);
    if (wb_is_streamer()) { wb_stream_run(P); return; }    // the last warp: weights into the ring, until we leave
#endif
    wb_grid_sync_init(P);
    wb_ahead_init();
    // the step's values and the first position in shared memory: held in registers across the whole step they
    // took some of every thread's 128, and the larger builds spilled them to the stack
    __shared__ int values[WB_STEP_VALUES], pos0;
    static_assert(WB_STEP_VALUES == 2, "the step carries the token and the sampled token");
    WbStep s{0, 0, values[0], values[1]};
    wb_set_value(s.token, P->tokens_in[0]);
    wb_set_value(s.sampled, -1);
    wb_set_value(pos0, P->pos0);
    wb_syncthreads();
    for (s.step = 0;; ++s.step) {
        s.pos = pos0 + s.step;
        if (wb_decode_step(P, s, smem)) break;
    }
    wb_ahead_drain();
#if WB_STREAMING
    wb_stream_finish();
#endif
}

// How the generated decode step runs a stage: entering it, the grid barrier that ends it, and what the timing and
// debug builds add there (%globaltimer stamps, taps). Everything here compiles away in a plain build except the
// where word and the barrier itself.
#pragma once

#if WB_TIMING
// timing[step][slot][block][arrive, leave]. Out of line: inlined, its index arithmetic was hoisted out of the
// step loop and spilled (the kernel is at its 128-register cap).
__device__ __noinline__ void wb_flush_stamps(const Params* __restrict__ P, int step) {
    if (wb_warp() != 0 || step >= P->timing_steps) return;
    wb_syncwarp();                                         // thread 0's stamps, seen by its warp
    for (int i = wb_lane(); i < 2 * WB_SLOTS; i += WB_WARP)
        P->timing[(((long long)step * WB_SLOTS + i / 2) * wb_nbid() + wb_bid()) * 2 + i % 2] = wb_t_stamps[i / 2][i % 2];
}
#else
#define wb_flush_stamps(P, step) ((void)0)
#endif

// The previous step's publish decided to stop (dev_flags[WB_FLAG_DONE]); read by every block after the first barrier.
__device__ __forceinline__ bool wb_done(const Params* __restrict__ P) { return ((volatile int*)P->dev_flags)[WB_FLAG_DONE] != 0; }

// A stage every block takes part in; and one that block 0 runs alone (the others go on to the next barrier).
#define WB_GRID(stage, layer, call)                                                                            \
    do { wb_enter(P, stage, layer, s.step); wb_count_grid_entry(); wb_maybe_hang(P, stage, layer); call;            \
         wb_count_grid_exit(); } while (0)
#define WB_BLOCK0(stage, layer, call)                                                                          \
    do {                                                                                                        \
        if (wb_bid() == 0) { wb_enter(P, stage, layer, s.step); wb_maybe_hang(P, stage, layer); call; wb_syncthreads(); } \
    } while (0)
// A value the step carries (WbStep's, in block 0's shared memory) is stored by thread 0 alone: every thread storing
// the same value would still race with the others' reads. A block-0 stage ends in the block barrier that publishes
// it (WB_BLOCK0).
__device__ __forceinline__ void wb_set_value(int& value, int v) { if (wb_tid() == 0) value = v; }
// Ends a slot: the grid barrier (returning from the step on an error or abort), stamped when timing.
#define WB_SYNC(stage, layer, slot)                                                                            \
    do { if (grid_sync(P, wb_where(stage, layer, s.step), slot)) return true; } while (0)
// Ends a slot whose next stage reads weights before the wait (BuildOptions.early): only the arrival here; the
// wait is that stage's (its prologue's wb_grid_wait_owed, after its first loads); WB_WAIT_OWED after the stage
// stops the kernel, naming the stage, if its section returned without it. The debug build waits here (block 0
// copies the slot's outputs after the barrier), and its next stage still takes its first weights the early way,
// so that stage-by-stage verification checks that path too.
#if WB_TAPS
#define WB_ARRIVE(stage, layer, slot)                                                                          \
    do { if (grid_sync(P, wb_where(stage, layer, s.step), slot, 1)) return true; } while (0)
#else
#define WB_ARRIVE(stage, layer, slot) wb_grid_arrive(P, wb_where(stage, layer, s.step), slot)
#endif
#define WB_WAIT_OWED(stage, layer)                                                                             \
    do {                                                                                                        \
        if (wb_bar_pending) { wb_grid_wait_owed(P); wb_report_unwaited(P, stage, layer, s.step); return true; } \
        WB_EARLY_DONE();                                                                                        \
        if (wb_bar_stop) return true;                                                                           \
    } while (0)
// The debug build's mark that the stage after a barrier loads early lasts until that stage is done: a later stage
// of the same slot (no barrier between) must not take it for its own. Its threads read it before the prologue's
// block barrier, which thread 0 has passed by now.
#if WB_TAPS
#define WB_EARLY_DONE() do { if (wb_tid() == 0) wb_bar_early = 0; } while (0)
#else
#define WB_EARLY_DONE() ((void)0)
#endif

#if WB_TAPS
// Debug build: after a stage, block 0 copies what it wrote into the step's tap record (steps the host asked for),
// so the host can check every stage of every layer on its own inputs. The copies read buffers that the next stage
// does not write (the generator refuses a plan where it would); where a later stage of the next slot writes one,
// WB_TAP_SYNC below holds the grid until block 0 is done.
#define WB_TAP_COPIES(copies) do { if (wb_bid() == 0 && P->tap_slot[s.step] >= 0) { copies wb_syncthreads(); } } while (0)
// After a stage that no grid barrier follows: every block copies the rows of its own units (a stage that deals
// by blocks), once its warps have written them.
#define WB_TAP_LOCAL_COPIES(copies) do { if (P->tap_slot[s.step] >= 0) { wb_syncthreads(); copies wb_syncthreads(); } } while (0)
// (step and pos by value: a reference to the step's state would put it in local memory for the whole kernel)
__device__ __forceinline__ float* wb_tap_dst(const Params* __restrict__ P, int step, int offset, int layer, int n) {
    return P->taps + (long long)P->tap_slot[step] * WB_TAP_STEP_FLOATS + offset + (long long)layer * n;
}
__device__ __noinline__ void wb_tap_f32(const Params* __restrict__ P, int step, int offset, int layer,
                                        const float* src, int n) {
    float* dst = wb_tap_dst(P, step, offset, layer, n);
    for (int i = wb_tid(); i < n; i += wb_ntid()) dst[i] = wb_ld_cg(src + i);
}
__device__ __noinline__ void wb_tap_int(const Params* __restrict__ P, int step, int offset, int layer,
                                        const int* src, int n) {
    float* dst = wb_tap_dst(P, step, offset, layer, n);
    for (int i = wb_tid(); i < n; i += wb_ntid()) dst[i] = (float)((volatile const int*)src)[i];   // exact below 2^24
}
// a fixed-point buffer (the residual stream) as the value its readers see: the parts' sum rounded to fp32
__device__ __noinline__ void wb_tap_fixed(const Params* __restrict__ P, int step, int offset, int layer,
                                          const fx64* src, int n) {
    float* dst = wb_tap_dst(P, step, offset, layer, n);
    for (int i = wb_tid(); i < n; i += wb_ntid()) dst[i] = x_value(src, i);
}
// the row a stage appended to a layer's cache [Hkv, max_seq, hd] at pos, as [Hkv·hd] floats
__device__ __noinline__ void wb_tap_kv(const Params* __restrict__ P, int step, int pos, int offset, int layer,
                                       const bf16* cache) {
    constexpr int KVD = WB_KV_HEADS * WB_HEAD_DIM;
    float* dst = wb_tap_dst(P, step, offset, layer, KVD);
    for (int i = wb_tid(); i < KVD; i += wb_ntid())
        dst[i] = bf16_to_f32(((volatile const bf16*)cache)[((long long)(i / WB_HEAD_DIM) * WB_MAX_SEQ + pos) * WB_HEAD_DIM
                                                        + i % WB_HEAD_DIM]);
}
// this block's units' rows (`per` floats a unit) of a buffer of n_units·per floats
__device__ __noinline__ void wb_tap_f32_units(const Params* __restrict__ P, int step, int offset, int layer,
                                              const float* src, int n_units, int per) {
    int u0, u1;
    wb_block_units(n_units, u0, u1);
    float* dst = wb_tap_dst(P, step, offset, layer, n_units * per);
    for (int i = u0 * per + wb_tid(); i < u1 * per; i += wb_ntid()) dst[i] = wb_ld_cg(src + i);
}
// a value thread 0 holds (the sampled token)
__device__ __forceinline__ void wb_tap_value(const Params* __restrict__ P, int step, int offset, int v) {
    if (wb_tid() == 0) *wb_tap_dst(P, step, offset, 0, 1) = (float)v;
}
// After block 0's copies of a buffer that a stage of the next slot writes (down_residual adds into all of x while
// block 0 would still be copying o_proj's x): the debug build waits for the copies at a grid barrier of its own.
#define WB_TAP_SYNC(stage, layer)                                                                              \
    do { if (grid_sync(P, wb_where(stage, layer, s.step), -1, wb_bar_early)) return true; } while (0)
#else
#define WB_TAP_SYNC(stage, layer) ((void)0)
#define WB_TAP_COPIES(copies) ((void)0)
#define WB_TAP_LOCAL_COPIES(copies) ((void)0)
#endif

// The monokernel: one launch generates the whole stream. A persistent grid (about one block per SM) loops over
// tokens and layers; grid barriers separate the stages whose inputs other blocks produce. Block 0 samples, streams
// the token to the host through mapped memory and embeds it for the next step.
#pragma once

#if WB_TIMING
// Stamps of %globaltimer at each barrier: when this block arrived (its work done) and when it left (all arrived).
// The stage's work is [previous leave, arrive); its wait is [arrive, leave). Compiled away when WB_TIMING is 0.
// A step's stamps collect in shared memory (nothing extra stays live in registers across the stage calls) and
// warp 0 writes them out once the step is over: a global store after every barrier cost 2.5% tok/s, mostly in
// the next barrier's release waiting for it.
__shared__ u64 wb_t_stamps[WB_SLOTS][2];
#define WB_STAMP_ARRIVE(slot) if (wb_tid() == 0) wb_t_stamps[slot][0] = wb_globaltimer_ns()
#define WB_STAMP_LEAVE(slot, step) if (wb_tid() == 0) wb_t_stamps[slot][1] = wb_globaltimer_ns()
// [step][slot][block][arrive, leave]; the first embedding (slot 0) is stamped in step 0 only
__device__ __forceinline__ void wb_flush_stamps(const Params* __restrict__ P, int step) {
    if (wb_warp() != 0 || step >= P->timing_steps) return;
    wb_syncwarp();                                         // thread 0's stamps, seen by its warp
    for (int i = step == 0 ? wb_lane() : 2 + wb_lane(); i < 2 * WB_SLOTS; i += WB_WARP)
        P->timing[(((long long)step * WB_SLOTS + i / 2) * wb_nbid() + wb_bid()) * 2 + i % 2] = wb_t_stamps[i / 2][i % 2];
}
#else
#define WB_STAMP_ARRIVE(slot) ((void)0)
#define WB_STAMP_LEAVE(slot, step) ((void)0)
#define wb_flush_stamps(P, step) ((void)0)
#endif

// Ends a stage: barrier (returning from the kernel on error or abort) and, when timing, the two stamps.
#define WB_SYNC(stage, layer, slot)                                                                                \
    do {                                                                                                            \
        WB_STAMP_ARRIVE(slot);                                                                                      \
        if (grid_sync(P, stage, layer, step)) return;                                                            \
        WB_STAMP_LEAVE(slot, step);                                                                                 \
    } while (0)

#if WB_TAPS
// Debug build: after a stage's barrier, block 0 copies what the stage produced into the tap buffer of the step
// (only for steps the host asked for), so the host can compare every stage of every layer with the reference.
// The copies read buffers that the next stage does not write, so they need no extra barrier.
WB_SECTION void wb_tap(const Params* __restrict__ P, int tap, int layer, int step, int pos) {
    const int slot = P->tap_slot[step];
    if (slot < 0 || wb_bid() != 0) return;
    float* dst = P->taps + (long long)slot * WB_TAP_STEP_FLOATS + (long long)layer * WB_TAP_LAYER_FLOATS;
    const long long kv = ((long long)layer * WB_KV_HEADS * WB_MAX_SEQ + pos) * WB_HEAD_DIM;
    constexpr int KVD = WB_KV_HEADS * WB_HEAD_DIM;
    switch (tap) {
    case 0: for (int i = wb_tid(); i < WB_D; i += wb_ntid()) dst[WB_TAP_X_IN + i] = wb_ld_cg(P->x + i); break;
    case 1:
        for (int i = wb_tid(); i < WB_HEADS * WB_HEAD_DIM; i += wb_ntid()) dst[WB_TAP_Q + i] = wb_ld_cg(P->q + i);
        for (int i = wb_tid(); i < KVD; i += wb_ntid()) {
            const long long c = kv + (long long)(i / WB_HEAD_DIM) * WB_MAX_SEQ * WB_HEAD_DIM + i % WB_HEAD_DIM;
            dst[WB_TAP_K + i] = bf16_to_f32(((volatile bf16*)P->k_cache)[c]);
            dst[WB_TAP_V + i] = bf16_to_f32(((volatile bf16*)P->v_cache)[c]);
        }
        break;
    case 2: for (int i = wb_tid(); i < WB_HEADS * WB_HEAD_DIM; i += wb_ntid()) dst[WB_TAP_ATTN + i] = wb_ld_cg(P->o + i); break;
    case 3: for (int i = wb_tid(); i < WB_D; i += wb_ntid()) dst[WB_TAP_X_ATTN + i] = wb_ld_cg(P->x + i); break;
    case 4: for (int i = wb_tid(); i < WB_FF; i += wb_ntid()) dst[WB_TAP_H_MLP + i] = wb_ld_cg(P->hmlp + i); break;
    case 5: for (int i = wb_tid(); i < WB_D; i += wb_ntid()) dst[WB_TAP_X_OUT + i] = wb_ld_cg(P->x + i); break;
    }
}
#define WB_TAP(tap, layer) wb_tap(P, tap, layer, step, pos)
#else
#define WB_TAP(tap, layer) ((void)0)
#endif

#define WB_STAGE(stage, layer) do { wb_enter(P, stage, layer, step); wb_maybe_hang(P, stage, layer); } while (0)

extern "C" __global__ void __launch_bounds__(WB_THREADS, 1) wb_generate(const Params* __restrict__ P) {
    extern __shared__ __attribute__((aligned(16))) float smem[];
    float* act = smem;                        // the stage's input vector, fp32
    float* red = smem + WB_ACT_FLOATS;        // block reductions: 32 floats + 32 ints
    wb_grid_sync_init();
    int step = 0;
    if (wb_bid() == 0) embed_token(P, P->tokens_in[0]);
    WB_SYNC(ST_EMBEDDING, -1, 0);

    for (step = 0; step < P->n_steps; ++step) {
        const int pos = P->pos0 + step;
        for (int layer = 0; layer < WB_LAYERS; ++layer) {
            const int s0 = 1 + layer * 5;
            (void)s0;
            WB_TAP(0, layer);
            WB_STAGE(ST_QKV_ROPE_APPEND, layer);
            stage_qkv_rope_append(P, layer, pos, act, red);
            WB_SYNC(ST_QKV_ROPE_APPEND, layer, s0);
            WB_TAP(1, layer);
            WB_STAGE(ST_ATTENTION_DECODE, layer);
            stage_attention_decode(P, layer, pos, smem);
            WB_SYNC(ST_ATTENTION_DECODE, layer, s0 + 1);
            WB_TAP(2, layer);
            WB_STAGE(ST_O_PROJ_RESIDUAL, layer);
            stage_o_proj_residual(P, layer, act);
            WB_SYNC(ST_O_PROJ_RESIDUAL, layer, s0 + 2);
            WB_TAP(3, layer);
            WB_STAGE(ST_GATE_UP_SILU, layer);
            stage_gate_up_silu(P, layer, act, red);
            WB_SYNC(ST_GATE_UP_SILU, layer, s0 + 3);
            WB_TAP(4, layer);
            WB_STAGE(ST_DOWN_RESIDUAL, layer);
            stage_down_residual(P, layer, act);
            WB_SYNC(ST_DOWN_RESIDUAL, layer, s0 + 4);
            WB_TAP(5, layer);
        }
        const int slot = P->rec_slot ? P->rec_slot[step] : -1;
        float* logits = slot >= 0 ? P->logits_hist + (long long)slot * WB_VOCAB : P->logits;
        WB_STAGE(ST_LM_HEAD, -1);
        stage_lm_head(P, logits, act, red);
        WB_SYNC(ST_LM_HEAD, -1, WB_SLOTS - 2);

        WB_STAGE(ST_SAMPLING, -1);
        if (wb_bid() == 0) {
            const bool forced = step + 1 < P->n_in;
            const int sampled = sample_token(P, logits, step, smem);
            __shared__ int next;
            if (wb_tid() == 0) {
                next = forced ? P->tokens_in[step + 1] : sampled;
                int done = 0;
                if (next < 0 || next >= WB_VOCAB) {                 // NaN logits leave no valid choice
                    ((volatile int*)P->status)[ST_STEP] = step;
                    ((volatile int*)P->dev_flags)[0] = WB_ERR_BAD_TOKEN;
                    wb_fence_system();
                    ((volatile int*)P->status)[ST_CODE] = WB_ERR_BAD_TOKEN;
                    next = 0;
                    done = 1;
                } else if (!forced) {
                    const int g = step + 1 - P->n_in;               // index among generated tokens
                    P->tokens_out[g] = next;
                    wb_fence_system();                              // the token is visible before its count
                    *(volatile int*)P->n_out = g + 1;               // the host streams tokens[0..n_out)
                    for (int e = 0; e < P->n_eos; ++e) done |= next == P->eos[e];
                    done |= g + 1 >= P->max_new;
                }
                done |= step + 1 >= P->n_steps || P->pos0 + step + 1 >= WB_MAX_SEQ;
                // reading host memory costs a PCIe round trip: look at the abort word every 16 steps only
                if ((step & 15) == 15 && wb_load_volatile(P->host_abort)) {
                    ((volatile int*)P->dev_flags)[0] = WB_ERR_ABORTED;
                    done = 1;
                }
                *(volatile int*)P->progress = step + 1;             // the host watchdog's heartbeat
                P->dev_flags[1] = done;
            }
            wb_syncthreads();
            embed_token(P, next);
        }
        WB_SYNC(ST_SAMPLING, -1, WB_SLOTS - 1);
        wb_flush_stamps(P, step);
        if (((volatile int*)P->dev_flags)[1]) break;
    }
}

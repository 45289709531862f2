// The step's end, by block 0: the token fed next is the prompt's next token while the prompt lasts, else the one
// the sampler chose, which is streamed to the host (tokens_out[g], then the count n_out: mapped memory, in that
// order). The stop decision (an EOS token, max_new, n_steps, the end of the cache, the host's abort word) goes to
// dev_flags[WB_FLAG_DONE], which every block reads after the next barrier. A recorded step's logits are copied to
// logits_hist for the host to compare with the reference.
#pragma once

WB_SECTION int stage_publish(int sampled, const Params* __restrict__ P, int step) {
    __shared__ int next;
    if (wb_tid() == 0) {
        const bool forced = step + 1 < P->n_in;
        next = forced ? P->tokens_in[step + 1] : sampled;
        int done = 0;
        if (next < 0 || next >= WB_VOCAB) {                 // NaN logits leave no valid choice
            ((volatile int*)P->status)[WB_STATUS_STEP] = step;
            ((volatile int*)P->dev_flags)[WB_FLAG_STOP] = WB_ERR_BAD_TOKEN;
            wb_fence_system();
            ((volatile int*)P->status)[WB_STATUS_CODE] = WB_ERR_BAD_TOKEN;
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
            ((volatile int*)P->dev_flags)[WB_FLAG_STOP] = WB_ERR_ABORTED;
            done = 1;
        }
        *(volatile int*)P->progress = step + 1;             // the host watchdog's heartbeat
        P->dev_flags[WB_FLAG_DONE] = done;
    }
    const int rec = P->rec_slot[step];
    if (rec >= 0)
        for (int i = wb_tid(); i < WB_VOCAB; i += wb_ntid()) P->logits_hist[(long long)rec * WB_VOCAB + i] = wb_ld_cg(P->logits + i);
    wb_syncthreads();
    return next;
}

// The stop decision's mutants (below) break a rule at a time: workbench/check/stops.py gives each run limits
// past every other rule.
/* wb:checks
mutant forced-one-short: the prompt's last token is replaced by a sampled one
-const bool forced = step + 1 < P->n_in;
+const bool forced = step + 2 < P->n_in;

mutant stops-one-early: generation stops one token before max_new
-done |= g + 1 >= P->max_new;
+done |= g + 2 >= P->max_new;

mutant streams-wrong-token: streams token + 1 (feeds the right one)
-P->tokens_out[g] = next;
+P->tokens_out[g] = next + 1;

mutant eos-only-first-id: only the first of several EOS ids ends the run
-for (int e = 0; e < P->n_eos; ++e)
+for (int e = 0; e < P->n_eos && e < 1; ++e)

mutant max-new-ignored: max_new never ends the run (n_steps still does)
-done |= g + 1 >= P->max_new;
+(void)0;

mutant n-steps-ignored: n_steps never ends the run
-done |= step + 1 >= P->n_steps || 
+done |= 

mutant cache-end-one-early: the run ends a position before the cache's last
-P->pos0 + step + 1 >= WB_MAX_SEQ
+P->pos0 + step + 2 >= WB_MAX_SEQ

mutant abort-ignored: the host's abort word is never acted on
-wb_load_volatile(P->host_abort)
+(0 && wb_load_volatile(P->host_abort))

mutant nan-runs-on: a step with no valid token (NaN logits) does not end the run
-next = 0;
-            done = 1;
+next = 0;
+            done = 0;
*/

// Grid-wide barrier for the persistent kernel, hang-safe.
//
// One monotonically increasing arrival counter: barrier number e is passed when the counter reaches e·G, so it
// never needs resetting inside a launch. Arrival is a fence and a release-add, the wait a spin of
// acquire loads; the counter's top bit is the stop signal, so a waiter learns of an error or an abort from the very
// load it spins on, without reading another word on the fast path. Every spin is bounded: a waiter gives up when the host raises its abort
// flag (mapped memory), when another block has already reported an error, or after `timeout_ns` of %globaltimer.
// The block that times out names the stage, layer and step it was waiting in and the first block that never
// arrived, with the stage that block last entered, so a hung section is reported instead of freezing the host.
#pragma once

// WbError, the WbStatus words of status[] and wb_where() come from the plan (the generated header).
static_assert(WB_STATUS_WORDS >= WB_STATUS_N_MISSING + 1, "status[] holds every status word wb_report writes");

#define WB_BAR_STOP 0x80000000u

// Stop every block at its next barrier: dev_flags[WB_FLAG_STOP] keeps the reason, the counter's top bit releases the waiters.
__device__ __forceinline__ void wb_raise_stop(const Params* __restrict__ P, int code) {
    ((volatile int*)P->dev_flags)[WB_FLAG_STOP] = code;
    wb_fence_gpu();
    wb_atomic_or(P->bar_count, WB_BAR_STOP);
}

// dev_flags[WB_FLAG_STOP] is the device's copy of "stop now" (an error or a host abort seen by some block): cheap to poll.
// host_abort lives in mapped host memory: a read crosses PCIe, so it is polled only on slow paths.
__device__ __forceinline__ bool wb_should_stop(const Params* __restrict__ P) {
    if (wb_load_volatile(P->dev_flags + WB_FLAG_STOP) != 0) return true;
    if (wb_load_volatile(P->host_abort) != 0) { wb_raise_stop(P, WB_ERR_ABORTED); return true; }
    return false;
}

// Where a block is: written at every stage entry and again, marked waiting, when it arrives at the barrier after the
// stage; read by the host while the kernel runs (a hang's per-block picture) and by a barrier that times out. The
// barrier takes the word from shared memory: recomputing it there kept stage, layer and step live across the
// stage, one register too many at the 128-register cap (8 B of spills).
__shared__ u32 wb_where_entered;

__device__ __forceinline__ void wb_enter(const Params* __restrict__ P, int stage, int layer, int step) {
    if (wb_tid() == 0) {
        const u32 w = wb_where(stage, layer, step);
        wb_where_entered = w;
        ((volatile u32*)P->where)[wb_bid()] = w;
    }
}

// Out of line: it runs only when a barrier times out, and inlined into every barrier it made the kernel 1,300 PTX
// lines longer and its compile 16% slower.
__device__ __noinline__ void wb_report(const Params* __restrict__ P, int code, int stage, int layer, int step, u32 epoch) {
    // One reporter, claimed before anything is looked at: every waiter times out at about the same moment, and the
    // stop releases the stragglers too (a hung block that watches for it moves on to its next stage within
    // microseconds), so who has not arrived, and where they were, must be read before any stop is raised. A later
    // reporter that read after an earlier one's stop named where the hung block went next, not where it hung. The
    // losers leave without raising: the winner raises once it has looked, or another error's report already did.
    if (wb_atomic_cas(P->dev_flags + WB_FLAG_REPORTED, 0, 1) != 0) return;
    int first = -1, missing = 0;
    for (int b = 0; b < wb_nbid(); ++b) {
        if (((volatile u32*)P->arrive)[b] < epoch) { if (first < 0) first = b; ++missing; }
    }
    const int first_where = first >= 0 ? (int)((volatile u32*)P->where)[first] : -1;
    wb_raise_stop(P, code);
    volatile int* st = P->status;
    st[WB_STATUS_STAGE] = stage; st[WB_STATUS_LAYER] = layer; st[WB_STATUS_STEP] = step;
    st[WB_STATUS_BLOCK] = wb_bid(); st[WB_STATUS_EPOCH] = (int)epoch;
    st[WB_STATUS_MISSING_BLOCK] = first;
    st[WB_STATUS_MISSING_WHERE] = first_where;
    st[WB_STATUS_N_MISSING] = missing;
    wb_fence_system();
    st[WB_STATUS_CODE] = code;                                // published last: the host reads the rest after it
    wb_fence_system();
}

// Barriers this block has passed. In shared memory, so nothing of the barrier stays live in the caller's registers
// across the out-of-line stages; reset by wb_grid_sync_init at kernel start.
__shared__ u32 wb_epoch;
#if WB_TIMING
// Stamps of %globaltimer at each barrier: when this block arrived (its work done) and when it left (all arrived).
// A slot's work is [previous leave, arrive); its wait is [arrive, leave). A step's stamps collect in shared memory
// (nothing extra stays live in registers across the stage calls) and warp 0 writes them out once the step's last
// barrier is passed (instrument.cuh): a global store after every barrier cost 2.5% tok/s, mostly in the next
// barrier's release waiting for it.
__shared__ u64 wb_t_stamps[WB_SLOTS][2];
#endif
// A barrier arrived at and not yet waited for (wb_grid_arrive, BuildOptions.early): its where-word for a report, and
// the slot its timing stamp goes to; the stop its wait saw; whether the stage after it loads its first weights
// before its prologue (and before the wait, where one is owed). Shared, for the same reason as wb_epoch.
__shared__ int wb_bar_pending, wb_bar_stop, wb_bar_slot, wb_bar_early;
__shared__ u32 wb_bar_where;
// The kernel's parameters, for the waits that library code runs on a stage's behalf (sections have no P).
__shared__ const Params* wb_P;

__device__ __forceinline__ void wb_grid_sync_init(const Params* __restrict__ P) {
    if (wb_tid() == 0) {
        wb_epoch = 0; wb_where_entered = 0; wb_bar_pending = 0; wb_bar_stop = 0; wb_bar_early = 0; wb_P = P;
    }
    wb_syncthreads();
}

// The block's writes reach the other blocks through bar.sync (CTA scope) then thread 0's release-add (GPU scope);
// their writes reach this block through thread 0's acquire load then bar.sync. PTX release/acquire are cumulative
// over what the CTA barrier ordered before, so no fence is needed: CUTLASS's GenericBarrier (cutlass/barrier.h) is
// the same pattern. WB_BAR_FENCES=1 adds a fence.acq_rel.gpu on either side, as cooperative groups' grid sync does
// with its relaxed atomics: measured on the H200, that costs 4-6% tok/s (barrier 1.70 µs instead of 1.09 µs).
// On AMD the fences stay: there a workgroup barrier does not wait for other waves' stores to complete, so thread
// 0's agent-scope release alone would not cover them.
#ifndef WB_BAR_FENCES
#if WB_AMD
#define WB_BAR_FENCES 1
#else
#define WB_BAR_FENCES 0
#endif
#endif

// (thread 0) this block's arrival, and the wait it owes from now on
__device__ __forceinline__ void wb_arrive_t0(const Params* __restrict__ P, u32 where, int slot, int early) {
#if WB_TIMING
    if (slot >= 0) wb_t_stamps[slot][0] = wb_globaltimer_ns();
#endif
    ++wb_epoch;
    wb_bar_stop = 0;
    wb_bar_pending = 1;
#if WB_TAPS
    wb_bar_early = early;
#endif
    wb_bar_slot = slot;
    wb_bar_where = where;
    if (WB_BAR_FENCES) wb_fence_gpu();
    wb_red_release_add(P->bar_count, 1u);
    ((volatile u32*)P->arrive)[wb_bid()] = wb_epoch;
    ((volatile u32*)P->where)[wb_bid()] = wb_where_entered | WB_WHERE_WAITING;   // for the host: arrived, waiting
}

// (thread 0) until every block has arrived: bounded, a timeout reported with the barrier's stage, layer and step.
// A wait that reaches the slow checks shows the block waiting at this barrier, for the host's picture of a hang:
// an owed wait runs inside the next stage, whose entry overwrote the word the arrival wrote. True when it did (the
// owed wait then writes the stage back); the fast path writes nothing (stores to mapped memory there measured
// about 1% on the 1B).
__device__ __forceinline__ bool wb_wait_t0(const Params* __restrict__ P) {
    const u32 epoch = wb_epoch, target = epoch * (u32)wb_nbid();
    u64 t0 = 0;
    u32 seen;
    for (u32 spin = 0; ((seen = wb_load_acquire(P->bar_count)) & ~WB_BAR_STOP) < target && !(seen & WB_BAR_STOP); ++spin) {
        if ((spin & 63) == 63) {                          // the slow checks, off the fast path
            if (wb_should_stop(P)) { wb_bar_stop = 1; break; }
            const u64 now = wb_globaltimer_ns();
            if (t0 == 0) {
                t0 = now;
                ((volatile u32*)P->where)[wb_bid()] = wb_bar_where | WB_WHERE_WAITING;
            } else if (now - t0 > P->timeout_ns) {
                const u32 w = wb_bar_where;
                wb_report(P, WB_ERR_HANG, wb_where_stage(w), wb_where_layer(w), wb_where_step(w), epoch);
                wb_bar_stop = 1;
                break;
            }
        }
    }
    if (seen & WB_BAR_STOP) wb_bar_stop = 1;
    wb_bar_pending = 0;
    if (WB_BAR_FENCES) wb_fence_gpu();
#if WB_TIMING
    if (wb_bar_slot >= 0) wb_t_stamps[wb_bar_slot][1] = wb_globaltimer_ns();
#endif
    return t0 != 0;
}

// A stage that loads early (BuildOptions.early) returned with the barrier before it still owed: its section did not
// read its weights through for_warp_units, whose prologue waits, so it read its inputs before every block had
// written them. The decode step then waits (the grid stays in step) and stops the kernel with the stage named.
__device__ __noinline__ void wb_report_unwaited(const Params* __restrict__ P, int stage, int layer, int step) {
    if (wb_tid() != 0) return;
    wb_raise_stop(P, WB_ERR_UNWAITED);
    if (wb_atomic_cas(P->dev_flags + WB_FLAG_REPORTED, 0, 1) != 0) return;
    volatile int* st = P->status;
    st[WB_STATUS_STAGE] = stage; st[WB_STATUS_LAYER] = layer; st[WB_STATUS_STEP] = step;
    st[WB_STATUS_BLOCK] = wb_bid();
    wb_fence_system();
    st[WB_STATUS_CODE] = WB_ERR_UNWAITED;
    wb_fence_system();
}

// The whole barrier. `where`: the stage, layer and step it follows (a timeout's report names them); `slot`: its
// timing stamps' row (-1: none, the debug build's extra barriers); `early`: the stage after it loads its first
// weights before its prologue (the debug build's WB_ARRIVE, which waits at once). True when the kernel must stop
// (an error or an abort): callers return at once.
__device__ __forceinline__ bool grid_sync(const Params* __restrict__ P, u32 where, int slot, int early = 0) {
    wb_syncthreads();
    if (wb_tid() == 0) { wb_arrive_t0(P, where, slot, early); wb_wait_t0(P); }
    wb_syncthreads();
    return wb_bar_stop != 0;
}

// Whether this stage takes its first weights early: it owes the wait of a split barrier (a plain build), or the
// debug build's whole barrier before it was marked early (WB_ARRIVE there), so that verification runs that path.
#if WB_TAPS
#define WB_LOADS_EARLY() (wb_bar_early != 0)
#else
#define WB_LOADS_EARLY() (wb_bar_pending != 0)
#endif

// The barrier in two halves (BuildOptions.early). Between the arrival and the wait a block may do only what reads
// nothing another block writes before the barrier: the next stage's first weight loads, weights being immutable.
__device__ __forceinline__ void wb_grid_arrive(const Params* __restrict__ P, u32 where, int slot) {
    wb_syncthreads();
    if (wb_tid() == 0) wb_arrive_t0(P, where, slot, 1);
    wb_syncthreads();                                  // every thread sees the wait owed
}

// The wait owed when the barrier before a stage was only arrived at (the decode step's WB_ARRIVE): a stage's
// prologue runs it after its first weight loads, and the decode step after the stage in case it did not. Nothing
// when none is owed; true when the kernel must stop. Every thread of the block calls it; each has read the flag
// before thread 0 clears it (the block barrier first).
__device__ __forceinline__ bool wb_grid_wait_owed(const Params* __restrict__ P) {
    if (wb_bar_pending) {
        wb_syncthreads();
        // a long wait showed the block waiting at that barrier (wb_wait_t0): it is in its stage again, unless the
        // kernel stops, when the failure picture must keep showing where it waited
        if (wb_tid() == 0 && wb_wait_t0(P) && !wb_bar_stop) ((volatile u32*)P->where)[wb_bid()] = wb_where_entered;
        wb_syncthreads();
    }
    return wb_bar_stop != 0;
}

#ifdef WB_HANG_STAGE
// Fault injection for testing hang safety: one block never leaves the chosen stage (it only watches for the stop).
__device__ __forceinline__ void wb_maybe_hang(const Params* __restrict__ P, int stage, int layer) {
    if (stage == WB_HANG_STAGE && layer == WB_HANG_LAYER && wb_bid() == WB_HANG_BLOCK % wb_nbid() && wb_tid() == 0) {
        while (!wb_should_stop(P)) wb_nanosleep(1000);
    }
}
#else
#define wb_maybe_hang(P, stage, layer) ((void)0)
#endif

/* wb:checks
inject barrier-skipped [expect=hang, block=5]: block 5 skips the barrier after qkv_rope_append of layer 1
-bool grid_sync(const Params* __restrict__ P, u32 where, int slot, int early = 0) {
-    wb_syncthreads();
+bool grid_sync(const Params* __restrict__ P, u32 where, int slot, int early = 0) {
+    if (wb_bid() == 5 && wb_where_stage(where) == ST_QKV_ROPE_APPEND && wb_where_layer(where) == 1) return false;
+    wb_syncthreads();
*/

// The weight stream: weights flow from HBM into shared memory without pause, ahead of the stages that read them.
//
// The block's last warp is the streamer. It walks the step's weight streams in decode order (wb_stream_step,
// generated from plan.streams) and copies this block's items of each (a row, or a piece of a long row, of the
// block's contiguous units) into a ring of WB_RING_SLOTS pages, one page per round: round k of a stage is its
// items kW .. kW + W - 1, one per consumer warp, contiguous in memory and so one bulk copy. It waits only for a
// page to free, never for an activation, a grid barrier or another block: while the stages wait at a barrier,
// reduce a norm or run attention, the next weights are on their way, as far ahead as the ring is deep.
//
// The consumer side (for_warp_units in matvec.cuh) walks the same rounds in the same order: item kW + w of a stage
// is warp w's, and every warp passes through every round (a warp without an item in the last, partial round only
// waits for the page and releases it), so all count the same rounds (wb_rounds) as the streamer counts those it
// issued. Every page carries a tag (stage, layer, first item) and its source address, checked on every take: a
// section that reads another matrix or another number of units than the plan streams to it stops the kernel with
// its stage and block named, instead of computing with the wrong rows.
#pragma once

// Pieces per row of k bf16: the fewest, each within a slot, that split the row into whole 16-byte loads (plan.pieces,
// checked against this by the generated stream step).
constexpr int wb_pieces(int k) {
    int n = (2 * k + WB_SLOT_BYTES - 1) / WB_SLOT_BYTES;
    if (n < 1) n = 1;
    while (k % n != 0 || (k / n) % 8 != 0) ++n;
    return n;
}

// The block's units of a stage: [b·n/G, (b+1)·n/G), contiguous, so its rows are one span of the matrix.
// plan.block_units is its twin: a stage that deals by blocks (Stage.deal) gives block b these units in any build.
__device__ __forceinline__ int wb_block_unit(int n_units, int b) { return (int)((long long)b * n_units / wb_nbid()); }
__device__ __forceinline__ void wb_block_units(int n_units, int& u0, int& u1) {
    u0 = wb_block_unit(n_units, wb_bid());
    u1 = wb_block_unit(n_units, wb_bid() + 1);
}

// This block's items of a stream of n_units units of NR rows of K from W: the one account of them that the
// streamer and the consumers (for_warp_units) both walk, so that they agree item for item.
template <int K, int NR>
struct WbBlockItems {
    static constexpr int PIECES = wb_pieces(K), PIECE = K / PIECES, PER_UNIT = NR * PIECES;
    int u0, u1, n;                                 // units [u0, u1); n items, item i at src0 + i·PIECE
    const bf16* src0;
    __device__ __forceinline__ WbBlockItems(const bf16* W, int n_units)
        : u0(wb_block_unit(n_units, wb_bid())), u1(wb_block_unit(n_units, wb_bid() + 1)),
          n((u1 - u0) * PER_UNIT), src0(W + (long long)u0 * NR * K) {}
};

#if WB_STREAMING
static_assert(WB_CONSUMER_WARPS >= 1 && WB_CONSUMER_WARPS <= WB_WARP, "a page holds one item per consumer warp");
static_assert(WB_RING_SLOTS >= 1 && WB_SLOT_BYTES % 16 == 0 && WB_RING_OFFSET % 16 == 0, "bulk copies move 16-byte units");
constexpr int WB_PAGE_BYTES = WB_CONSUMER_WARPS * WB_SLOT_BYTES;

__shared__ __attribute__((aligned(8))) u64 wb_full[WB_RING_SLOTS];    // the page's copy has landed
__shared__ __attribute__((aligned(8))) u64 wb_empty[WB_RING_SLOTS];   // every consumer warp is done with it
__shared__ u32 wb_tag[WB_RING_SLOTS];
__shared__ const bf16* wb_src[WB_RING_SLOTS];
__shared__ u32 wb_rounds;                          // pages the consumers have taken, over the whole launch
__shared__ u32 wb_streams_entered;                 // streams the consumers have begun, over the launch (WB_STREAM_AHEAD)
#ifndef WB_STREAM_LEAD
#define WB_STREAM_LEAD 0                           // a meter on the streamer (below, with the others)
#endif
#ifndef WB_STREAM_EXIT
#define WB_STREAM_EXIT 0                           // a meter on the streamer (below, with the others)
#endif
#if WB_STREAM_LEAD
__shared__ u32 wb_grid_entered;                    // stages every block enters that the consumers have entered
#endif
#if WB_STREAM_EXIT
__shared__ u32 wb_grid_exited;                     // and that their first warp has left
#endif
__shared__ int wb_stream_stop;                     // the consumers have left: the streamer stops
__shared__ const Params* wb_params;                // for the slow paths of the consumer side (sections have no P)

// The ring starts on a WB_RING_ALIGN boundary of the shared address space, not of the dynamic block (which follows
// the static variables at any 16-byte offset): bulk copies into pages 96 bytes off a 128-byte boundary ran 4-5×
// slower (H200, 1b).
__device__ __forceinline__ u8* wb_ring() {
    extern __shared__ __attribute__((aligned(16))) u8 wb_dynamic_smem[];
    const u32 a = wb_smem_addr(wb_dynamic_smem + WB_RING_OFFSET);
    return wb_dynamic_smem + WB_RING_OFFSET + ((WB_RING_ALIGN - a % WB_RING_ALIGN) % WB_RING_ALIGN);
}
__device__ __forceinline__ bool wb_stage_streamed(u32 where) { return (WB_STREAMED_STAGES >> wb_where_stage(where)) & 1; }
__device__ __forceinline__ bool wb_is_streamer() { return wb_tid() >= WB_CONSUMER_WARPS * WB_WARP; }
__device__ __forceinline__ bool wb_stream_stopped() { return ((volatile int*)&wb_stream_stop)[0] != 0; }

// Every thread of the block, before the streamer parts from the others.
__device__ __forceinline__ void wb_stream_init(const Params* __restrict__ P) {
    if (wb_tid() == 0) {
        for (int s = 0; s < WB_RING_SLOTS; ++s) {
            wb_mbar_init(&wb_full[s], 1);                      // the streamer's arrival, with the page's bytes
            wb_mbar_init(&wb_empty[s], WB_CONSUMER_WARPS);     // one release per consumer warp
        }
        wb_rounds = 0;
        wb_streams_entered = 0;
#if WB_STREAM_LEAD
        wb_grid_entered = 0;
#endif
#if WB_STREAM_EXIT
        wb_grid_exited = 0;
#endif
        wb_stream_stop = 0;
        wb_params = P;
        wb_mbar_init_fence();
    }
    wb_syncblock();
}

// Consumer thread 0, on the way out: the streamer finishes the copies in flight and leaves too.
__device__ __forceinline__ void wb_stream_finish() {
    if (wb_tid() == 0) ((volatile int*)&wb_stream_stop)[0] = 1;
}

// Meters on the streamer, off by default (0); none has yet taken the stream past the register path:
// WB_STREAM_INFLIGHT: at most this many pages copied and not yet landed. A full ring refilled at once is up to
// 180 KB per SM queued at the memory system (24 MB over the GPU), and a grid barrier's atomics, or attention's
// loads, wait behind that queue; the register path keeps 64 KB per SM in flight.
// WB_STREAM_AHEAD: a stream's pages wait until the consumers have entered the stream this many before it, so that
// the ring holds the next stage's rows and not the one after (o_proj's pages, not gate_up's, during attention).
// WB_STREAM_LEAD: a stream's pages wait until the consumers have entered the stage this many before its own, of the
// stages every block enters, streamed or not: 1 issues o_proj's rows as attention begins, as the register path's
// early loads go out at attention's barrier, where WB_STREAM_AHEAD 1 lets them out during qkv (a stream's stage
// counts attention, which streams nothing). On an H100 the stream build's qkv slot ran 71 µs a token past the
// register path's with the next stages' pages in flight at its barrier (NOTES.md, rounds 32 and 35).
// WB_STREAM_EXIT: a stream whose stage follows one that streams nothing (attention: its loads are its own) waits
// until this block's consumers (their first warp) have left that stage: a block's gate, not the grid's, so the
// blocks without attention work issue their pages at once, and without the lead the ring's free slot takes the
// next stream's first page too. It measured −7.4% against the register path (NOTES.md round 37). The stream
// build's attention is another schedule as well: its split follows its one reading warp (Launch.attn_warps), so at
// 129 positions each kv head is split over 9 blocks and merged, where the register path runs one block a head.
#ifndef WB_STREAM_INFLIGHT
#define WB_STREAM_INFLIGHT 0
#endif
#ifndef WB_STREAM_AHEAD
#define WB_STREAM_AHEAD 0
#endif
static_assert(WB_STREAM_INFLIGHT >= 0 && WB_STREAM_INFLIGHT <= WB_RING_SLOTS && WB_STREAM_AHEAD >= 0 &&
              WB_STREAM_LEAD >= 0 && (WB_STREAM_EXIT == 0 || WB_STREAM_EXIT == 1),
              "the meters count pages, streams and stages");
// The streamer is one thread: one bulk copy per page is few enough instructions that issuing never holds it up.
struct WbStreamer {
    u32 issued;                                    // pages so far (the consumers' wb_rounds, ahead)
    u32 streams;                                   // streams begun so far
    u32 entries;                                   // the grid entries of the steps streamed before this one

    // Copy this block's items of a stream, n_units units of NR rows of K from W, a page per round; its stage is
    // the step's grid entry `entry` (0 the first: generated, header.grid_entries), and `after_quiet` says the
    // entry before it streams nothing (header.after_quiet).
    template <int K, int NR>
    __device__ __forceinline__ bool stream(int stage, int layer, const bf16* __restrict__ W, int n_units, int entry,
                                           bool after_quiet) {
        using B = WbBlockItems<K, NR>;
        constexpr int PIECE = B::PIECE;
        static_assert(PIECE * 2 <= WB_SLOT_BYTES && PIECE % 8 == 0, "an item fits a slot in whole 16-byte units");
        const B items(W, n_units);
        const int n_items = items.n;
        const bf16* src0 = items.src0;
        const u32 stream_no = streams++;
        if (WB_STREAM_AHEAD > 0 && stream_no >= WB_STREAM_AHEAD)
            while (((volatile u32*)&wb_streams_entered)[0] < stream_no - WB_STREAM_AHEAD + 1)
                if (wb_stream_stopped()) return true;
#if WB_STREAM_LEAD
        // the consumers enter this stage as their (entries + entry + 1)-th: wait for the entry WB_STREAM_LEAD before
        const u32 own = entries + (u32)entry + 1;
        if (own > WB_STREAM_LEAD)
            while (((volatile u32*)&wb_grid_entered)[0] < own - WB_STREAM_LEAD)
                if (wb_stream_stopped()) return true;
#endif
#if WB_STREAM_EXIT
        // the stage before this one is the consumers' (entries + entry)-th: wait until they have left it
        if (after_quiet)
            while (((volatile u32*)&wb_grid_exited)[0] < entries + (u32)entry)
                if (wb_stream_stopped()) return true;
#endif
        for (int i0 = 0; i0 < n_items; i0 += WB_CONSUMER_WARPS, ++issued) {
            const int slot = issued % WB_RING_SLOTS;
            // a fresh mbarrier counts its phase "−1" as complete: the first pass over the pages needs no release
            const u32 parity = ((issued / WB_RING_SLOTS) & 1) ^ 1;
            while (!wb_mbar_done(&wb_empty[slot], parity))
                if (wb_stream_stopped()) return true;
            if (WB_STREAM_INFLIGHT > 0 && issued >= (u32)WB_STREAM_INFLIGHT) {
                // page issued − INFLIGHT: its slot is not copied into again before this page is issued
                const u32 j = issued - WB_STREAM_INFLIGHT;
                while (!wb_mbar_done(&wb_full[j % WB_RING_SLOTS], (j / WB_RING_SLOTS) & 1))
                    if (wb_stream_stopped()) return true;
            }
            const int n = n_items - i0 < WB_CONSUMER_WARPS ? n_items - i0 : WB_CONSUMER_WARPS;
            const bf16* src = src0 + (long long)i0 * PIECE;
            wb_tag[slot] = wb_where(stage, layer, 0) | ((u32)i0 << WB_TAG_ITEM_SHIFT);
            wb_src[slot] = src;
            wb_mbar_expect_tx(&wb_full[slot], n * PIECE * 2);   // releases the tag with the phase
            wb_bulk_g2s(wb_ring() + slot * WB_PAGE_BYTES, src, n * PIECE * 2, &wb_full[slot]);
        }
        return wb_stream_stopped();
    }
};

__device__ bool wb_stream_step(const Params* P, WbStreamer& st);   // generated from the plan, after the sections

// The streamer's whole life: step after step until the consumers leave, then the copies in flight land (the block
// must not exit with the copy engine still writing its shared memory).
__device__ __noinline__ void wb_stream_run(const Params* __restrict__ P) {
    if (wb_lane() != 0) return;
    WbStreamer st{0, 0, 0};
    while (!wb_stream_step(P, st) && !wb_stream_stopped())    // a step with nothing to stream returns at once
        st.entries += WB_GRID_ENTRIES_A_STEP;
    const u64 t0 = wb_globaltimer_ns();
    for (u32 j = st.issued > WB_RING_SLOTS ? st.issued - WB_RING_SLOTS : 0; j < st.issued; ++j) {
        while (!wb_mbar_done(&wb_full[j % WB_RING_SLOTS], (j / WB_RING_SLOTS) & 1))
            if (wb_globaltimer_ns() - t0 > P->timeout_ns) return;    // a copy that never lands: leave, reported by now
    }
}

// A stop the consumers' ring causes: the stage's section and the ring disagree, or a page never arrived.
__device__ __noinline__ void wb_stream_report(int code, u32 want, u32 got) {
    const Params* P = wb_params;
    wb_raise_stop(P, code);
    if (wb_atomic_cas(P->dev_flags + WB_FLAG_REPORTED, 0, 1) != 0) return;
    const u32 w = wb_where_entered;
    volatile int* st = P->status;
    st[WB_STATUS_STAGE] = wb_where_stage(w);
    st[WB_STATUS_LAYER] = wb_where_layer(w);
    st[WB_STATUS_STEP] = wb_where_step(w);
    st[WB_STATUS_BLOCK] = wb_bid();
    st[WB_STATUS_STREAM_WANT] = (int)want;
    st[WB_STATUS_STREAM_GOT] = (int)got;
    st[WB_STATUS_MISSING_BLOCK] = -1;
    wb_fence_system();
    st[WB_STATUS_CODE] = code;
    wb_fence_system();
}

// Slow path of a take: the page is not there yet. Bounded: gives up when the kernel is stopping (the stage then
// finishes on whatever the page holds and the next barrier ends the step) or after the barrier timeout. The stop
// words and the clock are looked at only every WB_RING_CHECK_SPINS tries: the host's abort flag is a read across
// PCIe, a microsecond or two during which the page could have landed unnoticed.
#ifndef WB_RING_CHECK_SPINS
#define WB_RING_CHECK_SPINS (1 << 12)
#endif
__device__ __noinline__ void wb_ring_wait(u64* full, u32 parity, u32 want) {
    const Params* P = wb_params;
    u64 t0 = 0;
    for (u32 spin = 1; !wb_mbar_test(full, parity); ++spin) {
        if (spin % WB_RING_CHECK_SPINS) continue;
        const u64 now = wb_globaltimer_ns();
        if (t0 == 0) { t0 = now; continue; }
        if (wb_should_stop(P)) return;
        if (now - t0 > P->timeout_ns) {
            if (wb_lane() == 0) wb_stream_report(WB_ERR_STREAM, want, 0xffffffffu);   // "never came"
            return;
        }
    }
}

// The stage's tag: its stage and layer, from the where-word its entry wrote (read after the prologue's block
// barrier has made thread 0's write visible).
__device__ __forceinline__ u32 wb_stream_tag() { return wb_where_entered & WB_TAG_STAGE_LAYER; }

// Page `round` (counted over the launch), which must hold the stage's (tag's) items from `first`, copied from
// `src`; the warp's item in it is at `item` (its index within the page). The page stays taken until
// wb_ring_release.
template <int PIECE>
__device__ __forceinline__ const u8* wb_ring_take(u32 round, u32 tag, int first, const bf16* src) {
    const int slot = round % WB_RING_SLOTS;
    const u32 parity = (round / WB_RING_SLOTS) & 1;
    const u32 want = tag | ((u32)first << WB_TAG_ITEM_SHIFT);
    if (!wb_mbar_test(&wb_full[slot], parity)) wb_ring_wait(&wb_full[slot], parity, want);
    if ((wb_tag[slot] != want || wb_src[slot] != src) && wb_lane() == 0)
        wb_stream_report(WB_ERR_STREAM, want, wb_tag[slot]);
    return wb_ring() + slot * WB_PAGE_BYTES + wb_warp() * PIECE * 2;
}

__device__ __forceinline__ void wb_ring_release(u32 round) {
    wb_syncwarp();                                 // every lane has read its part of the page
    if (wb_lane() == 0) wb_mbar_arrive(&wb_empty[round % WB_RING_SLOTS]);
}
#endif

// At a stage every block enters (instrument.cuh's WB_GRID): with WB_STREAM_LEAD, one more the consumers entered;
// and on the way out, with WB_STREAM_EXIT, one more their first warp left.
__device__ __forceinline__ void wb_count_grid_entry() {
#if WB_STREAMING && WB_STREAM_LEAD
    if (wb_tid() == 0) ((volatile u32*)&wb_grid_entered)[0] = wb_grid_entered + 1;
#endif
}
__device__ __forceinline__ void wb_count_grid_exit() {
#if WB_STREAMING && WB_STREAM_EXIT
    if (wb_tid() == 0) ((volatile u32*)&wb_grid_exited)[0] = wb_grid_exited + 1;
#endif
}

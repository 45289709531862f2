// Building blocks shared by every projection: a warp's dot products of bf16 weight rows with an fp32 activation
// vector held in shared memory, and the block-wide RMS normalisation that feeds them.
//
// A warp owns whole rows. Lane l reads the 16-byte pieces l, l+WB_WARP, l+2·WB_WARP ... of a row, so each warp-wide
// load is one contiguous, coalesced span of WB_WARP·16 bytes; UNROLL pieces per row are in flight before the first
// FMA, which is what keeps enough bytes moving to approach the bandwidth roofline.
#pragma once

// How a stage's units are dealt (the plan's Stage.deal, WB_DEAL_<STAGE> in the generated header: a section passes
// its own). WB_DEAL_WARPS: round-robin over the whole grid's warps, warp g taking units g, g + NW, g + 2·NW ...,
// warps numbered block by block (g = block·warps + warp) so that a block's warps read neighbouring rows. WB_DEAL_ACROSS: the same, numbered block-fastest (g = warp·blocks + block),
// so that a stage with fewer units than warps loads every SM alike instead of filling the first blocks.
// WB_DEAL_BLOCKS: block b owns the contiguous units wb_block_units (as a stream build deals every stage), its warps
// round-robin over them, so that a later stage can read them with only a block barrier (the plan's Use.local).
template <int DEAL = WB_DEAL_WARPS>
__device__ __forceinline__ int grid_warp() {
    return DEAL == WB_DEAL_ACROSS ? wb_warp() * wb_nbid() + wb_bid() : wb_bid() * wb_nwarps() + wb_warp();
}
__device__ __forceinline__ int grid_nwarps() { return wb_nbid() * wb_nwarps(); }

#ifndef WB_UNROLL_1
#define WB_UNROLL_1 8
#endif
#ifndef WB_UNROLL_2
#define WB_UNROLL_2 4
#endif
template <int K, int NR>
struct RowLoads {
    static constexpr int STEP = WB_WARP * 8;                  // elements one warp-wide load covers
    static constexpr int ITERS = (K + STEP - 1) / STEP;
    static constexpr int UNROLL = NR == 1 ? WB_UNROLL_1 : WB_UNROLL_2;   // 16-byte loads in flight per lane per row
    // see warp_rows_dot: single rows unrolled up to four chunks of loads (K ≤ 8,192 on NVIDIA), rolled beyond
    static constexpr int CHUNKS_UNROLLED = NR == 1 && ITERS <= 4 * UNROLL ? ITERS : 1;
};

// acc[r] += the chunk of UNROLL loads starting at step i0, for each of the NR rows
template <int K, int NR>
__device__ __forceinline__ void warp_rows_fma(const wb_u4 (*w)[RowLoads<K, NR>::UNROLL], int i0,
                                              const float* __restrict__ act, float (&acc)[NR]) {
    using L = RowLoads<K, NR>;
#pragma unroll
    for (int u = 0; u < L::UNROLL; ++u) {
        const int k = (i0 + u) * L::STEP + wb_lane() * 8;
        if (i0 + u < L::ITERS && (K % L::STEP == 0 || k < K)) {
#pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = wb_dot8(w[r][u], act + k, acc[r]);
        }
    }
}

// The chunk of UNROLL loads starting at step i0 of NR rows, into w
template <int K, int NR>
__device__ __forceinline__ void warp_rows_load(const bf16* __restrict__ row0, long long row_stride, int i0,
                                               wb_u4 (&w)[NR][RowLoads<K, NR>::UNROLL]) {
    using L = RowLoads<K, NR>;
#pragma unroll
    for (int u = 0; u < L::UNROLL; ++u) {
        const int k = (i0 + u) * L::STEP + wb_lane() * 8;
        if (i0 + u < L::ITERS && (K % L::STEP == 0 || k < K)) {
#pragma unroll
            for (int r = 0; r < NR; ++r) w[r][u] = wb_ld_stream(row0 + r * row_stride + k);
        }
    }
}

// out[r] = row r · act for NR rows of K (UNROLL loads per row in flight before the first FMA). FIRST: the first
// chunk is already in `first` (loaded before the grid barrier: warp_units_from_registers).
template <int K, int NR, bool FIRST = false>
__device__ __forceinline__ void warp_rows_dot(const bf16* __restrict__ row0, long long row_stride,
                                              const float* __restrict__ act, float (&out)[NR],
                                              const wb_u4 (*first)[RowLoads<K, NR>::UNROLL] = nullptr) {
    using L = RowLoads<K, NR>;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
    if (FIRST) warp_rows_fma<K, NR>(first, 0, act, acc);
    // Row pairs: chunks not unrolled. Each chunk's loads are already UNROLL deep; unrolling the chunks as well cost
    // registers, 2% tok/s (H200: 1,144 vs 1,121 tok/s) and a tenth of the compile time. Single rows stay unrolled
    // up to K = 8,192, rolled beyond: measured when the down projection still read Wd by rows (rolled, its rows
    // spilled 3b's row pointers; unrolled, 8b's K = 14,336 spilled 56 B).
#pragma unroll L::CHUNKS_UNROLLED
    for (int i0 = FIRST ? L::UNROLL : 0; i0 < L::ITERS; i0 += L::UNROLL) {
        wb_u4 w[NR][L::UNROLL];
        warp_rows_load<K, NR>(row0, row_stride, i0, w);
        warp_rows_fma<K, NR>(w, i0, act, acc);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = wb_warp_sum(acc[r]);
}

// warp_rows_dot for a unit whose first EC chunks are in shared memory (the early region's layout: piece i of row r of
// this lane at first[(r·EC·UNROLL + i)·WB_WARP]), the rest read from global memory: its chunks and sums in
// warp_rows_dot's order, so the unit gives the same bits. A chunk at a time comes to registers, as in the row loop.
template <int K, int NR, int EC>
__device__ __forceinline__ void warp_rows_dot_early(const bf16* __restrict__ row0, const wb_u4* first,
                                                    const float* __restrict__ act, float (&out)[NR]) {
    using L = RowLoads<K, NR>;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll
    for (int c = 0; c < EC; ++c) {
        wb_u4 w[NR][L::UNROLL];
#pragma unroll
        for (int i = 0; i < L::UNROLL; ++i) {
            const int ii = c * L::UNROLL + i;
            if (ii < L::ITERS) {
#pragma unroll
                for (int r = 0; r < NR; ++r) w[r][i] = first[(r * EC * L::UNROLL + ii) * WB_WARP];
            }
        }
        warp_rows_fma<K, NR>(w, c * L::UNROLL, act, acc);
    }
    for (int i0 = EC * L::UNROLL; i0 < L::ITERS; i0 += L::UNROLL) {
        wb_u4 w[NR][L::UNROLL];
        warp_rows_load<K, NR>(row0, K, i0, w);
        warp_rows_fma<K, NR>(w, i0, act, acc);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = wb_warp_sum(acc[r]);
}

// This warp's first unit and the stride to its next, as the deal gives them (grid_warp, wb_block_units).
template <int DEAL>
__device__ __forceinline__ void warp_units(int n_units, int& u, int& end, int& stride) {
    u = grid_warp<DEAL>(), end = n_units, stride = grid_nwarps();
    if (DEAL == WB_DEAL_BLOCKS) {
        wb_block_units(n_units, u, end);
        u += wb_warp();
        stride = wb_nwarps();
    }
}

// ---- a stage's first units copied ahead (Launch.ahead, schedule.ahead) ----------------------------------------
// The block's first units of Launch.ahead's stage (WB_AHEAD_ROWS rows of WB_AHEAD_K each: the first unit of each of
// its first WB_AHEAD_WARPS warps, contiguous rows since the stage deals by blocks) come into shared memory by the
// bulk-copy engine while the block runs the slot before that stage. Those are bytes the register path has no
// registers for, moving while that slot's own reads are few (o_proj's rows are all loaded early; attention reads
// little at short positions). The decode step posts the copy at the barrier before that slot (every thread fences
// its last use of the region first), and thread 0 sends it once past that barrier's block barrier, after the slot's
// own first loads (wb_ahead_issue), which are needed sooner; a warp then reads its unit from shared memory, and its
// early loads go to its next unit. Off the register path (stream builds) and on AMD (no copy engine reachable)
// nothing is copied. Measured on an H100 (NOTES.md, round 30): -2.0% on the 1B at 128, since the barrier after
// attention releases later with the copy's bytes in flight.
#if WB_AMD
#define WB_AHEAD_ON 0
#else
#define WB_AHEAD_ON (WB_AHEAD_WARPS > 0 && !WB_STREAMING)
#endif
__shared__ __attribute__((aligned(8))) u64 wb_ahead_bar;    // a phase per copy: complete when its bytes have landed
__shared__ const bf16* wb_ahead_src;                       // the copy posted and not yet sent (thread 0's alone)
__shared__ u32 wb_ahead_bytes;
__shared__ u32 wb_ahead_sent, wb_ahead_taken;              // copies sent, and read, over the launch
__shared__ u32 wb_ahead_dead;                              // a wait for the last copy timed out (reported)

__device__ __forceinline__ void wb_ahead_init() {          // thread 0, before the kernel's first block barrier
#if !WB_AMD
    if (WB_AHEAD_ON && wb_tid() == 0) {
        wb_mbar_init(&wb_ahead_bar, 1);
        wb_mbar_init_fence();
        wb_ahead_bytes = 0; wb_ahead_sent = 0; wb_ahead_taken = 0; wb_ahead_dead = 0;
    }
#endif
}

// The decode step, every thread, just before a grid barrier's arrival: the block's first units of a stage of n_units
// units, NR rows of K from W, to be copied once every thread is past the barrier's block barrier. Each thread fences
// its own last use of the region (the stage before, through the generic proxy) against the copy engine's writes.
template <int K, int NR>
__device__ __forceinline__ void wb_ahead_post(const bf16* __restrict__ W, int n_units) {
    if (!WB_AHEAD_ON) return;
#if !WB_AMD
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    if (wb_tid() != 0) return;
    int u0, u1;
    wb_block_units(n_units, u0, u1);
    const int n = u1 - u0 < WB_AHEAD_WARPS ? u1 - u0 : WB_AHEAD_WARPS;
    wb_ahead_src = W + (long long)u0 * NR * K;
    wb_ahead_bytes = n > 0 ? (u32)n * NR * K * 2 : 0u;
}

// Thread 0 sends the copy posted, if any: whole units in copies of at most WB_AHEAD_COPY bytes (few instructions:
// round 6 measured a thread issuing 16–32 small copies for microseconds), all on one mbarrier phase.
constexpr u32 WB_AHEAD_COPY = 65536;
__device__ __forceinline__ void wb_ahead_issue() {
    if (!WB_AHEAD_ON || wb_tid() != 0 || wb_ahead_bytes == 0) return;
#if !WB_AMD
    extern __shared__ __attribute__((aligned(16))) float wb_smem_floats[];
    u8* dst = (u8*)(wb_smem_floats + WB_SMEM_AHEAD);
    const u8* src = (const u8*)wb_ahead_src;
    constexpr u32 UNIT = WB_AHEAD_ON ? WB_AHEAD_ROWS * WB_AHEAD_K * 2 : 16;   // (16: a build without it)
    const u32 bytes = wb_ahead_bytes;
    wb_mbar_expect_tx(&wb_ahead_bar, bytes);
    constexpr u32 STEP = WB_AHEAD_COPY / UNIT > 0 ? WB_AHEAD_COPY / UNIT * UNIT : UNIT;
    for (u32 off = 0; off < bytes; off += STEP)
        wb_bulk_g2s(dst + off, src + off, bytes - off < STEP ? bytes - off : STEP, &wb_ahead_bar);
#endif
    wb_ahead_bytes = 0;
    ++wb_ahead_sent;
}

// Whether this stage reads units copied ahead: the build's stage (its units' shape and deal; a copy sent and not
// yet read). Every thread asks at the stage's entry, before thread 0 marks the copy read after the prologue's block
// barrier (warp_units_from_registers).
template <int K, int NR, int DEAL>
__device__ __forceinline__ bool wb_ahead_here() {
    return WB_AHEAD_ON && DEAL == WB_DEAL_BLOCKS && K == WB_AHEAD_K && NR == WB_AHEAD_ROWS &&
           wb_ahead_sent != wb_ahead_taken;
}

// A copy that never lands stops the kernel, named where the block is (its stage and layer), the unit that waited
// for it (-1: the kernel's end) and what it waited for, instead of hanging it. One reporter (wb_report's rule): the
// first claims the report, fills it, then raises the stop; the others leave.
__device__ __noinline__ void wb_ahead_report(const Params* __restrict__ P, int unit) {
    if (wb_atomic_cas(P->dev_flags + WB_FLAG_REPORTED, 0, 1) != 0) return;
    const u32 w = wb_where_entered;
    volatile int* st = P->status;
    st[WB_STATUS_STAGE] = wb_where_stage(w); st[WB_STATUS_LAYER] = wb_where_layer(w);
    st[WB_STATUS_STEP] = wb_where_step(w); st[WB_STATUS_BLOCK] = wb_bid();
    st[WB_STATUS_WAITED_ON] = WB_WAITED_ON_COPY_AHEAD; st[WB_STATUS_UNIT] = unit;
    wb_fence_system();
    st[WB_STATUS_CODE] = WB_ERR_HANG;
    wb_fence_system();
    wb_raise_stop(P, WB_ERR_HANG);
}

// One thread: until the last copy sent has landed (true); false after half the kernel's timeout (reported, naming
// `unit`; the phase is then dead, and the kernel's end does not wait for it again) or, when `watch_stop`, once the
// kernel must stop. Half: the other blocks, waiting at the next grid barrier for this one, start their clocks later
// but must not time out first, or their report (this block missing) would take the place of this one. The stop word
// and the clock are read every 64 tries, as the grid barrier does: the stop word may be in host memory.
__device__ __forceinline__ bool wb_ahead_spin(bool watch_stop, int unit) {
#if WB_AMD
    return true;
#else
    const u32 parity = (wb_ahead_sent - 1) & 1;
    const u64 t0 = wb_globaltimer_ns();
    for (u32 tries = 1; !wb_mbar_test(&wb_ahead_bar, parity); ++tries) {
        if (tries & 63) continue;                      // the slow checks, at the grid barrier's rate
        if (watch_stop && wb_should_stop(wb_P)) return false;
        if (*(volatile u32*)&wb_ahead_dead) return false;   // another warp's wait for it timed out
        if (wb_globaltimer_ns() - t0 > wb_P->timeout_ns / 2) {
            wb_ahead_dead = 1;
            wb_ahead_report(wb_P, unit);
            return false;
        }
    }
    return true;
#endif
}

// A warp, before it reads its unit: lane 0 waits and the warp follows its answer, so that no lane goes on alone
// into the warp's shuffles; then each lane sees the phase complete itself (its own acquire of the copy's bytes).
__device__ __forceinline__ bool wb_ahead_wait(int unit) {
#if WB_AMD
    return true;
#else
    const int ok = wb_shfl(wb_lane() == 0 ? (int)wb_ahead_spin(true, unit) : 0, 0);
    if (!ok) return false;
    while (!wb_mbar_test(&wb_ahead_bar, (wb_ahead_sent - 1) & 1)) {}    // complete already: one try
    return true;
#endif
}

// The kernel's end: a block must not exit with the copy engine still writing its shared memory (a copy whose wait
// timed out is not waited for again: its report is out, and the kernel must stop within the host's grace).
__device__ __forceinline__ void wb_ahead_drain() {
    if (WB_AHEAD_ON && wb_tid() == 0 && wb_ahead_sent > 0 && !wb_ahead_dead) wb_ahead_spin(false, -1);
}

// out[r] = row r · act for the NR rows of K at `rows` in shared memory: warp_rows_dot's loads and sums in its order
// (each lane's pieces in step order, then the warp's sum), so a unit gives the same bits from either place.
template <int K, int NR>
__device__ __forceinline__ void warp_rows_dot_shared(const bf16* rows, const float* __restrict__ act, float (&out)[NR]) {
    using L = RowLoads<K, NR>;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll 4
    for (int i = 0; i < L::ITERS; ++i) {
        const int k = i * L::STEP + wb_lane() * 8;
        if (K % L::STEP == 0 || k < K) {
#pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = wb_dot8(*(const wb_u4*)(rows + r * K + k), act + k, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = wb_warp_sum(acc[r]);
}

// This warp's units (NR adjacent rows of K, dealt as DEAL says), each read straight to registers and its result
// handed to `done(unit, y[NR])`, after the block-wide `prologue` has filled `act`: the register path, and a stream
// build's register stages (whose prologue has run already: an empty one). The units are found before the prologue
// runs, the order whose machine code the H200 measurements were taken on.
//
// WB_EARLY_LOADS (BuildOptions.early): in a stage that owes the wait of the grid barrier before it (the decode
// step's WB_ARRIVE), the first unit's first chunk of loads goes out before that wait and the prologue, so the
// weights are on their way while the block waits for its activations. They land in shared memory (the plan's
// early region, [warp][row][load][lane] 16-byte pieces), by asynchronous copies: held in registers across the
// wait and the prologue, they spilled (384 B on the 1B). The first unit then runs its own copy of the row loop
// (measured, H200: +3.7% on 1b at 128). Reading the chunk inside the one loop instead compiled faster and spilled
// less, and ran 3% slower on the 1B: a branch on the chunk inside the hot row loop costs more than the copy.
#ifndef WB_EARLY_LOADS
#define WB_EARLY_LOADS 0
#endif
template <int K, int NR, int DEAL, typename Prologue, typename Done>
__device__ __forceinline__ void warp_units_from_registers(const bf16* __restrict__ W, int n_units,
                                                          const float* act, Prologue prologue, Done done) {
    using L = RowLoads<K, NR>;
    float y[NR];
    int u, end, stride;
    warp_units<DEAL>(n_units, u, end, stride);
    // this warp's unit copied ahead (Launch.ahead), if any: the early loads below go to its next unit
    const bool ahead = wb_ahead_here<K, NR, DEAL>();
    int ua = end;
    if (ahead && wb_warp() < WB_AHEAD_WARPS && u < end) { ua = u; u += stride; }
    auto from_ahead = [&] {                           // after the prologue
        if (ahead && wb_tid() == 0) wb_ahead_taken = wb_ahead_sent;   // every thread has asked (the prologue's barrier)
        if (ua < end) {
            if (!wb_ahead_wait(ua)) return false;
            extern __shared__ __attribute__((aligned(16))) float wb_smem_floats[];
            warp_rows_dot_shared<K, NR>((const bf16*)(wb_smem_floats + WB_SMEM_AHEAD) + wb_warp() * NR * K, act, y);
            done(ua, y);
        }
        return true;
    };
    if (WB_EARLY_LOADS && WB_LOADS_EARLY()) {         // only the stage after a split barrier (plan.early_region)
        // the first unit's first EC chunks of the row loop: as many as the region holds a thread (Launch.early_loads
        // pieces), at most the whole unit
        constexpr int CHUNKS = (L::ITERS + L::UNROLL - 1) / L::UNROLL;
        constexpr int HELD = WB_SMEM_EARLY_FLOATS / (WB_THREADS * 4) / (NR * L::UNROLL);
        constexpr int EC = HELD < CHUNKS ? HELD : CHUNKS;
        static_assert(!WB_EARLY_LOADS || EC >= 1, "the plan's early region holds a chunk of loads a thread");
        extern __shared__ __attribute__((aligned(16))) float wb_smem_floats[];
        wb_u4* first = (wb_u4*)(wb_smem_floats + WB_SMEM_EARLY) + wb_warp() * NR * EC * L::UNROLL * WB_WARP + wb_lane();
        const bf16* row0 = W + (long long)u * NR * K;
        if (u < end) {
#pragma unroll
            for (int i = 0; i < EC * L::UNROLL; ++i) {
                const int k = i * L::STEP + wb_lane() * 8;
                if (i < L::ITERS && (K % L::STEP == 0 || k < K)) {
#pragma unroll
                    for (int r = 0; r < NR; ++r)
                        wb_cp_async16(first + (r * EC * L::UNROLL + i) * WB_WARP, row0 + r * K + k, true);
                }
            }
        }
        wb_cp_async_commit();
        wb_ahead_issue();                              // a copy posted for the next slot goes out behind these loads
        if (wb_grid_wait_owed(wb_P)) {                 // the kernel stops (the decode step returns after the stage):
            wb_cp_async_wait<0>();                     // its inputs may never come, and no copy may land after it
            return;
        }
        prologue();                                    // block-wide: every thread takes part
        if (!from_ahead()) {
            wb_cp_async_wait<0>();
            return;
        }
        if (u < end) {
            wb_cp_async_wait<0>();                     // this lane's pieces, which only it reads
            if (EC == 1) {
                wb_u4 w[NR][L::UNROLL];
#pragma unroll
                for (int i = 0; i < L::UNROLL; ++i)
#pragma unroll
                    for (int r = 0; r < NR; ++r) w[r][i] = first[(r * L::UNROLL + i) * WB_WARP];
                warp_rows_dot<K, NR, true>(row0, K, act, y, w);
            } else {
                warp_rows_dot_early<K, NR, EC>(row0, first, act, y);
            }
            done(u, y);
            u += stride;
        }
    } else {
        wb_ahead_issue();
        wb_grid_wait_owed(wb_P);
        prologue();
        if (!from_ahead()) return;
    }
    for (; u < end; u += stride) {
        warp_rows_dot<K, NR>(W + (long long)u * NR * K, K, act, y);
        done(u, y);
    }
}

#if WB_STREAMING
// acc += one item (PIECE elements of a row, in a ring page) · act[0, PIECE). In each 256 elements, lane l takes
// elements 4l .. 4l + 3 and 128 + 4l .. 128 + 4l + 3: its weights are two 8-byte reads and its activations two
// 16-byte reads, each warp-wide read one contiguous span, so none of them has a bank conflict. (The register
// path's 16-byte weight loads take act[8l .. 8l + 7] instead, which in shared memory is a 2-4-way conflict; from
// the ring, where the copy engine's writes and the weight reads share the same shared-memory bandwidth, that cost
// 20% of the stream's rate.)
template <int PIECE>
__device__ __forceinline__ float slot_dot(const u8* __restrict__ w, const float* __restrict__ act) {
    constexpr int BLOCK = WB_WARP * 8, ITERS = (PIECE + BLOCK - 1) / BLOCK;
    float acc = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = it * BLOCK + h * (BLOCK / 2) + wb_lane() * 4;
            if (PIECE % BLOCK == 0 || k < PIECE) {
                const u64 wv = *(const u64*)(w + 2 * k);
                const float4 a = *(const float4*)(act + k);
                const u32 lo = (u32)wv, hi = (u32)(wv >> 32);
                acc = wb_fma(bf16_lo(lo), a.x, acc); acc = wb_fma(bf16_hi(lo), a.y, acc);
                acc = wb_fma(bf16_lo(hi), a.z, acc); acc = wb_fma(bf16_hi(hi), a.w, acc);
            }
        }
    }
    return acc;
}

// A weight stage: the block's `prologue` fills `act`, then its units (NR adjacent rows of K; the block's are the
// contiguous [b·n/G, (b+1)·n/G)), each result handed by one warp to `done(unit, y[NR])`, the stage's epilogue. The
// rows come from the ring (stream.cuh) as items, a page of W per round, item i to warp i mod W. A unit of one item
// is finished by the warp that took it; a unit of several (row pairs, long rows in pieces) is summed from the
// items' partial sums in shared memory once every warp is through, in a fixed order, so the result does not
// depend on timing.
template <int K, int NR, int DEAL = WB_DEAL_WARPS, typename Prologue, typename Done>
__device__ __forceinline__ void for_warp_units(const bf16* __restrict__ W, int n_units, const float* act,
                                               Prologue prologue, Done done) {
    using B = WbBlockItems<K, NR>;
    constexpr int PIECES = B::PIECES, PIECE = B::PIECE, PER_UNIT = B::PER_UNIT;
    extern __shared__ __attribute__((aligned(16))) float wb_smem_floats[];
    float* partial = wb_smem_floats + WB_SMEM_PARTIALS;
    const B items(W, n_units);
    const int u0 = items.u0, u1 = items.u1, n_items = items.n;
    const bf16* src0 = items.src0;
    u32 round = wb_rounds;                             // read before the prologue's barrier: thread 0 moves it on after
    // thread 0 wrote the where-word at the stage's entry; the others see it after the prologue's block barrier
    if (WB_STREAM_AHEAD > 0 && wb_tid() == 0 && wb_stage_streamed(wb_where_entered))
        ((volatile u32*)&wb_streams_entered)[0] = wb_streams_entered + 1;
    wb_grid_wait_owed(wb_P);                           // the ring's pages fill while the block waits
    prologue();                                        // block-wide: every consumer thread takes part
    if (WB_STREAM_REGISTER_STAGES && !wb_stage_streamed(wb_where_entered)) {   // BuildOptions.stream_register
        warp_units_from_registers<K, NR, DEAL>(W, n_units, act, [] {}, done);   // no wait owed: waited above
        return;
    }
    const u32 tag = wb_stream_tag();
    if (PER_UNIT > 1 && n_items > WB_SMEM_PARTIALS_FLOATS && wb_tid() == 0)   // a grid the build was not sized for
        wb_stream_report(WB_ERR_STREAM, tag | ((u32)n_items << WB_TAG_ITEM_SHIFT), 0xfffffffeu);
    for (int i0 = 0; i0 < n_items; i0 += WB_CONSUMER_WARPS, ++round) {
        const int i = i0 + wb_warp();
        const u8* w = wb_ring_take<PIECE>(round, tag, i0, src0 + (long long)i0 * PIECE);
        float acc = 0.f;
        if (i < n_items) acc = slot_dot<PIECE>(w, act + (i % PIECES) * PIECE);
        wb_ring_release(round);
        if (i >= n_items) continue;                    // the last page of the stage has fewer items than warps
        const float y = wb_warp_sum(acc);
        if (PER_UNIT == 1) {
            float yy[NR];
            yy[0] = y;
            done(u0 + i, yy);
        } else if (wb_lane() == 0 && i < WB_SMEM_PARTIALS_FLOATS) {
            partial[i] = y;
        }
    }
    if (wb_tid() == 0) wb_rounds = round;
    if (PER_UNIT > 1) {
        wb_syncthreads();                              // every item's partial sum is in
        for (int u = u0 + wb_warp(); u < u1; u += WB_CONSUMER_WARPS) {
            float y[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const float* p = partial + (u - u0) * PER_UNIT + r * PIECES;
                float s = p[0];
                for (int q = 1; q < PIECES; ++q) s += p[q];
                y[r] = s;
            }
            done(u, y);
        }
        wb_syncthreads();                              // the partials are free for the next stage
    }
}
#else
// A weight stage: the block's `prologue` fills `act`, then this warp's units (NR adjacent rows of K, dealt
// round-robin, see grid_warp), each result handed to `done(unit, y[NR])`, the stage's epilogue.
template <int K, int NR, int DEAL = WB_DEAL_WARPS, typename Prologue, typename Done>
__device__ __forceinline__ void for_warp_units(const bf16* __restrict__ W, int n_units, const float* act,
                                               Prologue prologue, Done done) {
    warp_units_from_registers<K, NR, DEAL>(W, n_units, act, prologue, done);
}
#endif

// Sum of one value per thread over the block; every thread gets the total. `red` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* red) {
    v = wb_warp_sum(v);
    if (wb_lane() == 0) red[wb_warp()] = v;
    wb_syncthreads();
    float t = 0.f;
    for (int w = 0; w < wb_nwarps(); ++w) t += red[w];
    wb_syncthreads();
    return t;
}

// Copy n floats written by other blocks during this kernel into shared memory (through L2, see wb_ld_cg_f4).
__device__ __forceinline__ void load_activation(float* __restrict__ dst, const float* __restrict__ src, int n) {
    for (int i = wb_tid() * 4; i < n; i += wb_ntid() * 4) *(float4*)(dst + i) = wb_ld_cg_f4(src + i);
    wb_syncthreads();
}

// dst = x / rms(x). The norm's gain is folded into the weights that read dst (W·diag(g)), so none is applied here.
__device__ __forceinline__ void load_rms_normalized(float* __restrict__ dst, const float* __restrict__ x, int n,
                                                    float* red) {
    float ss = 0.f;
    for (int i = wb_tid() * 4; i < n; i += wb_ntid() * 4) {
        float4 v = wb_ld_cg_f4(x + i);
        *(float4*)(dst + i) = v;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float scale = wb_rsqrt(block_sum(ss, red) / (float)n + WB_RMS_EPS);
    for (int i = wb_tid(); i < n; i += wb_ntid()) dst[i] *= scale;
    wb_syncthreads();
}

// The same for the residual stream in fixed point (residual.cuh): its value rounded to fp32, then normalised. A
// thread takes 4 elements a round, as the float version does, each part's two 16-byte loads issued before any sum:
// after the grid barrier this read is on the critical path, and a second round trip to L2 costs a layer ~0.5 us.
__device__ __forceinline__ void load_rms_normalized(float* __restrict__ dst, const fx64* __restrict__ x, int n,
                                                    float* red) {
    float ss = 0.f;
    for (int i = wb_tid() * 4; i < n; i += wb_ntid() * 4) {
        float v[4];
        x_value4(x, i, v);
        *(float4*)(dst + i) = float4{v[0], v[1], v[2], v[3]};
        ss += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
    }
    const float scale = wb_rsqrt(block_sum(ss, red) / (float)n + WB_RMS_EPS);
    for (int i = wb_tid(); i < n; i += wb_ntid()) dst[i] *= scale;
    wb_syncthreads();
}


/* wb:checks
mutant eps-x10 [expect=qkv_rope_append, count=2]: RMSNorm's eps ten times too large (library: every normalising stage)
-/ (float)n + WB_RMS_EPS);
+/ (float)n + 10.f * WB_RMS_EPS);
*/

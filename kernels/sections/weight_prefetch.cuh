// Weights of the two small projections staged in shared memory before their stage begins.
//
// QKV (12.6 MB for 1B shapes) and O-proj (8.4 MB) are too small to reach the bandwidth roofline on their own: every
// warp holds one or two rows, so the stage is one round trip to HBM plus a barrier. Attention, between them, moves
// almost no bytes at short positions and leaves most SMs idle. So when a block enters attention, lane 0 of each
// warp asks the bulk-copy engine for that warp's first O-proj unit of this layer and first QKV unit of the next
// layer (the next token's layer 0 after the last layer); the copies stream while attention runs and while the
// barriers pass, and the two stages start with their weights already on chip.
//
// Slot w of a region holds warp w's first unit: the NR·K contiguous weights of rows grid_warp()·NR ... (the deal of
// for_warp_units), so a block's slots are one contiguous span of the weight matrix. WB_PF_O_WARPS and
// WB_PF_QKV_WARPS (from the config and the shared-memory budget, workbench.assemble.prefetch_plan) say how many warps
// of a block get a slot; the other warps read their rows from global memory as usual. Each slot has an mbarrier;
// per warp, copies issued and slots consumed are counted so that waits use the right phase and a block that stops
// early first lets its copies land (wb_pf_drain).
#pragma once

enum PfRegion { PF_O = 0, PF_QKV = 1 };
constexpr int PF_O_UNIT = WB_HEADS * WB_HEAD_DIM;          // bf16 elements of one O-proj unit (one row)
constexpr int PF_QKV_UNIT = 2 * WB_D;                        // one rotate-half pair of Wqkv rows
__device__ __forceinline__ constexpr int pf_warps(int region) {
    return !WB_HAS_BULK_COPY ? 0 : region == PF_O ? WB_PF_O_WARPS : WB_PF_QKV_WARPS;
}
__device__ __forceinline__ constexpr int pf_unit(int region) { return region == PF_O ? PF_O_UNIT : PF_QKV_UNIT; }

extern __shared__ __attribute__((aligned(16))) unsigned char wb_dyn_smem[];
constexpr int PF_NWARPS = WB_THREADS / WB_WARP;
__shared__ u64 wb_pf_bar[2][PF_NWARPS];
__shared__ u32 wb_pf_issued[2][PF_NWARPS], wb_pf_used[2][PF_NWARPS];

__device__ __forceinline__ bf16* pf_slot(int region, int w) {
    bf16* r = (bf16*)(wb_dyn_smem + WB_PF_BASE_BYTES);
    if (region == PF_QKV) r += pf_warps(PF_O) * PF_O_UNIT;
    return r + w * pf_unit(region);
}

__device__ __forceinline__ void wb_pf_init() {
    if (wb_lane() == 0) {
        for (int r = 0; r < 2; ++r) {
            wb_pf_issued[r][wb_warp()] = wb_pf_used[r][wb_warp()] = 0;
            if (wb_warp() < pf_warps(r)) wb_mbar_init(&wb_pf_bar[r][wb_warp()], 1);
        }
    }
    wb_syncthreads();
}

// Does this warp's first unit of the region's stage sit in a slot?
__device__ __forceinline__ bool pf_has(int region, int n_units) {
    return wb_warp() < pf_warps(region) && grid_warp() < n_units;
}

// Lane 0 of each warp with a slot: the warp's first unit of W (n_units units of pf_unit(region) elements) into it
__device__ __forceinline__ void pf_issue(int region, const bf16* __restrict__ W, int n_units) {
    if (wb_lane() != 0 || !pf_has(region, n_units)) return;
    const int w = wb_warp();
    wb_bulk_load(pf_slot(region, w), W + (long long)grid_warp() * pf_unit(region), pf_unit(region) * 2,
                 &wb_pf_bar[region][w]);
    ++wb_pf_issued[region][w];
}

// The whole warp waits until its slot has landed, then owns it until the stage's barrier. A copy that never lands
// (a bug, not a slow HBM: the engine always finishes) stops the kernel instead of freezing it.
__device__ __forceinline__ const bf16* pf_wait(const Params* __restrict__ P, int region) {
    const int w = wb_warp();
    const u32 parity = wb_pf_used[region][w] & 1u;
    u64 t0 = 0;
    for (u32 spin = 0; !wb_mbar_try_wait(&wb_pf_bar[region][w], parity); ++spin) {
        if ((spin & 1023) == 1023) {
            const u64 now = wb_globaltimer_ns();
            if (t0 == 0) t0 = now;
            else if (now - t0 > P->timeout_ns) { if (wb_lane() == 0) wb_raise_stop(P, WB_ERR_HANG); break; }
        }
    }
    wb_syncwarp();
    if (wb_lane() == 0) ++wb_pf_used[region][w];
    return pf_slot(region, w);
}

// Before the block exits: copies still in flight land first (they write into this block's shared memory).
// Out of line: it is reached from every barrier's stop path.
__device__ __noinline__ void wb_pf_drain() {
    if (wb_lane() != 0) return;
    for (int r = 0; r < 2; ++r) {
        const int w = wb_warp();
        if (w >= pf_warps(r)) continue;
        for (; wb_pf_used[r][w] < wb_pf_issued[r][w]; ++wb_pf_used[r][w])
            while (!wb_mbar_try_wait(&wb_pf_bar[r][w], wb_pf_used[r][w] & 1u)) {}
    }
}

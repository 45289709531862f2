// x += Wd · hmlp: the MLP's output projection and the second residual add, by columns of Wd.
//
// Block b owns the hmlp rows j of its units (wb_block_units, as gate_up_silu deals them), so it needs no other
// block's hmlp: only a block barrier, not a grid barrier, stands between the two stages. It reads the rows j of
// Wdᵀ (wd is stored transposed, row j = Wd's column j, contiguous) and forms the partial sum Σ_j hmlp[j]·Wd[:, j]
// over all D outputs, which it adds into x atomically, in the residual stream's fixed point (kernels/lib/residual.cuh:
// integer adds, so the order in which the blocks' additions arrive does not change the sum). x holds h (o_proj
// wrote both), and no block reads x in this slot: gate_up_silu's norm reads h. The build is specialised to its
// grid (WB_BLOCKS, the runtime compiles for the grid it launches), which sizes the hmlp region.
//
// A thread owns 4 adjacent columns (one 8-byte load of a Wdᵀ row: four accumulators and two registers a row in
// flight, where 16-byte loads spilled the kernel at its 128-register cap) and every PHASES-th of the block's rows,
// LOADS rows in flight; the phases' sums meet in shared memory in a fixed order, then go to x a column a thread, so
// that a warp's 32 integer adds (no vector form) touch 256 adjacent bytes.
#pragma once

constexpr int DOWN_GROUPS = WB_D / 4;                                          // 8-byte column groups of a row
// the row phases the plan sized the sum region for (plan.down_phases: as many covers of D as the threads make)
constexpr int DOWN_PHASES = WB_SMEM_DOWN_RESIDUAL_SUM_FLOATS / WB_D;
constexpr int DOWN_ROWS_PER_THREAD = ((WB_FF + WB_BLOCKS - 1) / WB_BLOCKS + DOWN_PHASES - 1) / DOWN_PHASES;
// rows in flight per thread: 8 (more spilled the kernel at its 128-register cap), and no more than a thread has
// (small models' phases leave it few, and spare loads spilled there too). A stream build's 15 consumer warps make
// fewer phases than its loop's column groups, so warp 0 takes a second pass alone while the others wait: 12 loads
// a pass halve that pass's dependent batches (11 → 6 on the 1B), measured +3.4% on the 1B's stream build (828 →
// 856 tok/s, one H100; NOTES round 26), with no preset spilling
#ifndef WB_DOWN_LOADS
#define WB_DOWN_LOADS (WB_STREAMING ? (DOWN_ROWS_PER_THREAD < 12 ? DOWN_ROWS_PER_THREAD : 12) \
                                    : DOWN_ROWS_PER_THREAD < 8 ? DOWN_ROWS_PER_THREAD : 8)
#endif
constexpr int DOWN_LOADS = WB_DOWN_LOADS;
static_assert(WB_D % 4 == 0, "a row of Wdᵀ is whole 8-byte loads");
static_assert(WB_DEAL_DOWN_RESIDUAL == WB_DEAL_BLOCKS && WB_DEAL_GATE_UP_SILU == WB_DEAL_BLOCKS,
              "down reads the hmlp rows of its own block's units: the plan deals both MLP stages by blocks");
static_assert(DOWN_PHASES >= 1 && WB_SMEM_DOWN_RESIDUAL_SUM_FLOATS == DOWN_PHASES * WB_D &&
              WB_SMEM_DOWN_RESIDUAL_HMLP_FLOATS >= (WB_FF + WB_BLOCKS - 1) / WB_BLOCKS,
              "the plan's regions hold whole phases of sums and the block's hmlp rows");

WB_SECTION void stage_down_residual(const float* hmlp, const bf16* __restrict__ wd, int layer, float* smem, fx64* x) {
    float* hs = smem + WB_SMEM_DOWN_RESIDUAL_HMLP;     // this block's hmlp rows
    // [PHASES][D]: each phase's partial sums
    float* sum = smem + WB_SMEM_DOWN_RESIDUAL_SUM;
    int u0, u1;
    wb_block_units(WB_FF, u0, u1);
    for (int i = wb_tid(); i < u1 - u0; i += wb_ntid()) hs[i] = wb_ld_cg(hmlp + u0 + i);
    wb_syncthreads();
    const int per_phase = wb_ntid() / DOWN_PHASES, phase = wb_tid() / per_phase;
    if (phase < DOWN_PHASES) {
        for (int g = wb_tid() % per_phase; g < DOWN_GROUPS; g += per_phase) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            for (int j0 = u0 + phase; j0 < u1; j0 += DOWN_LOADS * DOWN_PHASES) {
                wb_u2 w[DOWN_LOADS];
#pragma unroll
                for (int k = 0; k < DOWN_LOADS; ++k) {
                    const int j = j0 + k * DOWN_PHASES;
                    if (j < u1) w[k] = wb_ld_stream_u2(wd + (long long)j * WB_D + g * 4);
                }
#pragma unroll
                for (int k = 0; k < DOWN_LOADS; ++k) {
                    const int j = j0 + k * DOWN_PHASES;
                    if (j < u1) {
                        const float a = hs[j - u0];
                        acc[0] = wb_fma(bf16_lo(w[k].x), a, acc[0]); acc[1] = wb_fma(bf16_hi(w[k].x), a, acc[1]);
                        acc[2] = wb_fma(bf16_lo(w[k].y), a, acc[2]); acc[3] = wb_fma(bf16_hi(w[k].y), a, acc[3]);
                    }
                }
            }
            *(float4*)(sum + phase * WB_D + g * 4) = float4{acc[0], acc[1], acc[2], acc[3]};
        }
    }
    wb_syncthreads();
    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) {
        float t = sum[i];
        for (int p = 1; p < DOWN_PHASES; ++p) t += sum[p * WB_D + i];
        x_add(x, i, t);
    }
}

// illegal-address (below) writes through a null pointer, not far past a buffer: a far address can land in
// another allocation and not fault.
/* wb:checks
mutant down-scale-1e-4: x + 1.0001·y instead of x + y
-x_add(x, i, t);
+x_add(x, i, t * 1.0001f);

mutant down-residual-one-layer: the last layer loses its MLP output
-x_add(x, i, t);
+if (layer != WB_LAYERS - 1) x_add(x, i, t);

mutant down-last-row: the last output rows are never added to
-for (int i = wb_tid(); i < WB_D; i += wb_ntid()) {
+for (int i = wb_tid(); i < WB_D - 4; i += wb_ntid()) {

mutant down-unit-skipped: each block leaves out its last column of Wd
-wb_block_units(WB_FF, u0, u1);
+wb_block_units(WB_FF, u0, u1);
+    --u1;

mutant down-column-swapped: every fourth column takes its left neighbour's weight
-acc[3] = wb_fma(bf16_hi(w[k].y), a, acc[3]);
+acc[3] = wb_fma(bf16_lo(w[k].y), a, acc[3]);

inject illegal-address [expect=fault, block=9]: block 9 writes through a null pointer
-    float* sum = smem + WB_SMEM_DOWN_RESIDUAL_SUM;
+    float* sum = smem + WB_SMEM_DOWN_RESIDUAL_SUM;
+    if (wb_bid() == 9 && wb_tid() == 0) { volatile fx64* null = x + (0 - (long long)(size_t)x / 8); *null = 1; }
*/

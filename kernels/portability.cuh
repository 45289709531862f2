// Portability layer: one section source builds with NVRTC for NVIDIA (sm_90) and with clang's HIP front end for
// AMD (gfx942). Vendor assembly (PTX / AMDGCN) appears only here, each behind a macro with a portable fallback.
// Nothing in a section may name a vendor intrinsic, a warp width or an assembly mnemonic directly.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__AMDGCN__)
#define WB_AMD 1
#define WB_HAS_MMA 0    // no mma.sync: a section that multiplies on the tensor cores keeps a plain path for AMD
#else
#define WB_NV 1
#define WB_HAS_MMA 1    // wb_mma_bf16_16816, wb_ldmatrix_x4(_trans), wb_movmatrix_trans, wb_pack_bf16x2
#endif

typedef unsigned char      u8;
typedef unsigned short     u16;
typedef unsigned int       u32;
typedef unsigned long long u64;
typedef u16 bf16;   // bf16 kept as bits: no vendor header needed, identical on both vendors
typedef long long fx64;   // a fixed-point number (plan.X_FRAC_BITS): the residual stream's parts

#if WB_AMD
// With -nogpulib -nogpuinc nothing of HIP is predefined: supply the few keywords we use.
// Under hipRTC or with the HIP headers these already exist (a macro each, and HIP's own float4): keep theirs.
#ifndef __global__
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __constant__ __attribute__((constant))
// `__shared__` on a block-scope or namespace-scope variable puts it in LDS; `extern __shared__ T name[]` (no size)
// is clang's dynamic-LDS convention, sized by the launch (hidden_dynamic_lds_size), exactly as in CUDA.
#define __shared__ __attribute__((shared))
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
// CUDA's second argument (min blocks per SM) has no AMD meaning for a persistent one-block-per-CU grid: dropped
#define __launch_bounds__(t, b) __attribute__((amdgpu_flat_work_group_size(1, t)))
struct float4 { float x, y, z, w; } __attribute__((aligned(16)));
#endif
#define WB_WARP 64
// No bulk copy engine reachable from here: the weights are read by the stages themselves (WB_STREAM is ignored).
#define WB_STREAMING 0
__device__ __forceinline__ int wb_tid()   { return __builtin_amdgcn_workitem_id_x(); }
__device__ __forceinline__ int wb_bid()   { return __builtin_amdgcn_workgroup_id_x(); }
__device__ __forceinline__ int wb_ntid()  { return __builtin_amdgcn_workgroup_size_x(); }
__device__ __forceinline__ int wb_nbid()  { return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(); }
__device__ __forceinline__ void wb_syncthreads() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
                                                   __builtin_amdgcn_s_barrier();
                                                   __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup"); }
__device__ __forceinline__ void wb_syncblock() { wb_syncthreads(); }
__device__ __forceinline__ void wb_syncwarp() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
                                                __builtin_amdgcn_wave_barrier();
                                                __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront"); }
__device__ __forceinline__ float wb_shfl_xor(float v, int m) {
    int lane = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((lane ^ m) << 2, __builtin_bit_cast(int, v)));
}
__device__ __forceinline__ int wb_shfl_xor(int v, int m) {
    int lane = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
    return __builtin_amdgcn_ds_bpermute((lane ^ m) << 2, v);
}
__device__ __forceinline__ float wb_shfl(float v, int src) {
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src << 2, __builtin_bit_cast(int, v)));
}
__device__ __forceinline__ int wb_shfl(int v, int src) { return __builtin_amdgcn_ds_bpermute(src << 2, v); }
__device__ __forceinline__ void wb_fence_gpu()    { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
__device__ __forceinline__ void wb_fence_system() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, ""); }
__device__ __forceinline__ u32 wb_atomic_add(u32* p, u32 v) { return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT); }
__device__ __forceinline__ u64 wb_atomic_add(u64* p, u64 v) { return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP); }
__device__ __forceinline__ void wb_red_release_add(u32* p, u32 v) { __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT); }
__device__ __forceinline__ void wb_atomic_or(u32* p, u32 v) { __hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
// p[0..3] += v, each element atomically at device scope (no ordering)
__device__ __forceinline__ void wb_red_add_f4(float* p, float4 v) {
    __hip_atomic_fetch_add(p, v.x, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
    __hip_atomic_fetch_add(p + 1, v.y, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
    __hip_atomic_fetch_add(p + 2, v.z, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
    __hip_atomic_fetch_add(p + 3, v.w, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ int wb_atomic_cas(int* p, int cmp, int v) {
    __hip_atomic_compare_exchange_strong(p, &cmp, v, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM); return cmp; }
__device__ __forceinline__ u32 wb_load_acquire(const u32* p) { return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT); }
__device__ __forceinline__ int wb_load_volatile(const volatile int* p) { return __hip_atomic_load((int*)p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM); }
// s_memrealtime: a constant 100 MHz clock shared by the whole device
__device__ __forceinline__ u64 wb_globaltimer_ns() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
__device__ __forceinline__ void wb_nanosleep(u32) { __builtin_amdgcn_s_sleep(2); }
struct wb_u4 { u32 x, y, z, w; };
// The loads below only ever read global memory (weights, KV cache, activations): saying so (address space 1) gives
// global_load_* instead of flat_load_*, which would also wait on the LDS counter and cannot take a scalar base.
#define WB_GLOBAL(T, p) ((const __attribute__((address_space(1))) T*)(p))
// Weights are read once per token: non-temporal, so they do not evict the activations and KV cache
__device__ __forceinline__ wb_u4 wb_ld_stream(const void* p) {
    typedef u32 v4u __attribute__((ext_vector_type(4)));
    v4u v = __builtin_nontemporal_load(WB_GLOBAL(v4u, p));
    return wb_u4{v.x, v.y, v.z, v.w};
}
struct wb_u2 { u32 x, y; };
__device__ __forceinline__ wb_u2 wb_ld_stream_u2(const void* p) {
    typedef u32 v2u __attribute__((ext_vector_type(2)));
    v2u v = __builtin_nontemporal_load(WB_GLOBAL(v2u, p));
    return wb_u2{v.x, v.y};
}
__device__ __forceinline__ float wb_exp(float x)  { return __builtin_expf(x); }
__device__ __forceinline__ float wb_exp_ftz(float x)  { return __builtin_expf(x); }
__device__ __forceinline__ float wb_rsqrt(float x) { return __builtin_amdgcn_rsqf(x); }
__device__ __forceinline__ float wb_fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
__device__ __forceinline__ float wb_u32_as_float(u32 u) { return __builtin_bit_cast(float, u); }
__device__ __forceinline__ u32 wb_float_as_u32(float f) { return __builtin_bit_cast(u32, f); }
__device__ __forceinline__ float wb_log(float x) { return __builtin_logf(x); }
__device__ __forceinline__ float wb_exp_precise(float x) { return __builtin_expf(x); }
__device__ __forceinline__ float wb_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
// Data other blocks wrote during the kernel: the agent-scope fences of the grid barrier (and of the attention merge)
// write back and invalidate the caches that are not coherent, so plain global loads see it.
__device__ __forceinline__ float4 wb_ld_cg_f4(const float* p) {
    typedef float v4f __attribute__((ext_vector_type(4)));
    v4f v = *WB_GLOBAL(v4f, p);
    return float4{v.x, v.y, v.z, v.w};
}
__device__ __forceinline__ float wb_ld_cg(const float* p) { return *WB_GLOBAL(float, p); }
__device__ __forceinline__ wb_u4 wb_ld_cg_u4(const void* p) {
    typedef u32 v4u __attribute__((ext_vector_type(4)));
    v4u v = *WB_GLOBAL(v4u, p);
    return wb_u4{v.x, v.y, v.z, v.w};
}
#define WB_INF __builtin_inff()
// Fixed point (kernels/lib/residual.cuh): integer adds at L2, in any order the same sum
__device__ __forceinline__ fx64 wb_ld_cg_fx(const fx64* p) { return *WB_GLOBAL(fx64, p); }
__device__ __forceinline__ void wb_red_add_fx(fx64* p, fx64 v) {
    __hip_atomic_fetch_add((u64*)p, (u64)v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
__device__ __forceinline__ void wb_atomic_exch_fx(fx64* p, fx64 v) {
    __hip_atomic_exchange((u64*)p, (u64)v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT); }
__device__ __forceinline__ fx64 wb_f32_to_fx_rn(float v) { return (fx64)__builtin_rintf(v); }   // |v| < 2^62
__device__ __forceinline__ float wb_fx_to_f32(fx64 v) { return (float)v; }
// No asynchronous copy to LDS that takes 16 bytes a lane here: the copy passes through registers and is complete
// when it returns, so a commit and a wait have nothing to do (the caller's block barrier still orders it).
__device__ __forceinline__ void wb_cp_async16(void* dst, const void* src, bool valid) {
    typedef u32 v4u __attribute__((ext_vector_type(4)));
    v4u v = {0u, 0u, 0u, 0u};
    if (valid) v = *WB_GLOBAL(v4u, src);
    *(v4u*)dst = v;
}
__device__ __forceinline__ void wb_cp_async_commit() {}
template <int pending> __device__ __forceinline__ void wb_cp_async_wait() {}
#else  // ---------------------------------------------------------------------------------------------- NVIDIA
#define WB_WARP 32
// WB_STREAM: the block's last warp streams weights (kernels/lib/stream.cuh) and the stages run on the other warps.
// The block the sections see is those warps: wb_ntid() counts them and wb_syncthreads() is a named barrier of
// theirs (bar.sync 1), so the streaming warp, which never stops for an activation, is never waited for.
#ifndef WB_STREAM
#define WB_STREAM 0
#endif
#define WB_STREAMING WB_STREAM
__device__ __forceinline__ int wb_tid()  { return threadIdx.x; }
__device__ __forceinline__ int wb_bid()  { return blockIdx.x; }
__device__ __forceinline__ int wb_ntid() { return WB_STREAMING ? WB_THREADS - WB_WARP : blockDim.x; }
__device__ __forceinline__ int wb_nbid() { return gridDim.x; }
__device__ __forceinline__ void wb_syncthreads() {
    if (WB_STREAMING) asm volatile("bar.sync 1, %0;" :: "n"(WB_THREADS - WB_WARP) : "memory");
    else __syncthreads();
}
// every thread of the block, the streaming warp included (only before it parts from the others)
__device__ __forceinline__ void wb_syncblock() { __syncthreads(); }
__device__ __forceinline__ void wb_syncwarp() { __syncwarp(); }
__device__ __forceinline__ float wb_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ int   wb_shfl_xor(int v, int m)   { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float wb_shfl(float v, int src)   { return __shfl_sync(0xffffffffu, v, src); }
__device__ __forceinline__ int   wb_shfl(int v, int src)     { return __shfl_sync(0xffffffffu, v, src); }
// For a stage written in PTX (workbench.compiler.ptx): wb_keep uses a value at no cost, so that the compiler keeps
// every parameter for the .ptx body; wb_opaque hands a value on through a move the compiler cannot see through, so
// that it cannot fold a parameter every call passes the same value for
template <typename T> __device__ __forceinline__ void wb_keep(T* p) { asm volatile("" ::"l"(p)); }
__device__ __forceinline__ void wb_keep(int v) { asm volatile("" ::"r"(v)); }
__device__ __forceinline__ void wb_keep(u32 v) { asm volatile("" ::"r"(v)); }
__device__ __forceinline__ void wb_keep(float v) { asm volatile("" ::"f"(v)); }
template <typename T> __device__ __forceinline__ T* wb_opaque(T* p) {
    T* r; asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(p)); return r; }
__device__ __forceinline__ int wb_opaque(int v) { int r; asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v)); return r; }
__device__ __forceinline__ u32 wb_opaque(u32 v) { u32 r; asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v)); return r; }
__device__ __forceinline__ float wb_opaque(float v) {
    float r; asm volatile("mov.b32 %0, %1;" : "=f"(r) : "f"(v)); return r; }
__device__ __forceinline__ void wb_fence_gpu()    { __threadfence(); }
__device__ __forceinline__ void wb_fence_system() { __threadfence_system(); }
__device__ __forceinline__ u32 wb_atomic_add(u32* p, u32 v) { return atomicAdd(p, v); }
// Arrive at a barrier: an atomic add with release semantics (this thread's writes, and those of its block ordered
// before it by a block barrier, are visible to whoever acquires the new value); no separate full fence needed
__device__ __forceinline__ void wb_red_release_add(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void wb_atomic_or(u32* p, u32 v) { atomicOr(p, v); }
// p[0..3] += v, each element atomically at device scope (no ordering). sm_90 does the four in one 16-byte reduction
// at L2 (REDG.E.ADD.F32x4, which flushes denormal results to zero); before it, four.
__device__ __forceinline__ void wb_red_add_f4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
#else
    atomicAdd(p, v.x); atomicAdd(p + 1, v.y); atomicAdd(p + 2, v.z); atomicAdd(p + 3, v.w);
#endif
}
__device__ __forceinline__ u64 wb_atomic_add(u64* p, u64 v) { return atomicAdd((unsigned long long*)p, (unsigned long long)v); }
__device__ __forceinline__ int wb_atomic_cas(int* p, int cmp, int v) { return atomicCAS(p, cmp, v); }
__device__ __forceinline__ u32 wb_load_acquire(const u32* p) {
    u32 v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ int wb_load_volatile(const volatile int* p) { return *p; }
// %globaltimer: one nanosecond clock for every SM (32 ns steps on H200), so stamps from all blocks share an axis
__device__ __forceinline__ u64 wb_globaltimer_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ void wb_nanosleep(u32 ns) { __nanosleep(ns); }
struct wb_u4 { u32 x, y, z, w; };
// Weights are read once per token: bypass L1 allocation so activations and the KV cache keep it
__device__ __forceinline__ wb_u4 wb_ld_stream(const void* p) {
    wb_u4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// 8 bytes of a weight row (four bf16), the same way: where a thread keeps many rows in flight, half the registers
struct wb_u2 { u32 x, y; };
__device__ __forceinline__ wb_u2 wb_ld_stream_u2(const void* p) {
    wb_u2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ float wb_exp(float x)  { return __expf(x); }
// wb_exp with results below 2⁻¹²⁶ flushed to zero: __expf's own product and ex2, without the steps that keep a
// denormal result (a compare, two conditional multiplies), which cost as much as the ex2 in a softmax
__device__ __forceinline__ float wb_exp_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}
__device__ __forceinline__ float wb_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float wb_fmaxf(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float wb_u32_as_float(u32 u) { return __uint_as_float(u); }
__device__ __forceinline__ u32 wb_float_as_u32(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float wb_log(float x) { return logf(x); }
__device__ __forceinline__ float wb_exp_precise(float x) { return expf(x); }
__device__ __forceinline__ float wb_fma(float a, float b, float c) { return fmaf(a, b, c); }
// Data written during the kernel by other blocks is read through L2 only (.cg): L1 is not coherent across SMs
__device__ __forceinline__ float4 wb_ld_cg_f4(const float* p) { return __ldcg((const float4*)p); }
__device__ __forceinline__ float wb_ld_cg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ wb_u4 wb_ld_cg_u4(const void* p) { uint4 v = __ldcg((const uint4*)p); return wb_u4{v.x, v.y, v.z, v.w}; }
// Bulk copies global → shared (sm_90's cp.async.bulk, the copy engine TMA uses, without a tensor map): issued by one
// thread, they complete on a shared-memory mbarrier whose transaction count the issuer set, so the copy costs the
// SM no registers and no load slots while its bytes are in flight.
__device__ __forceinline__ u32 wb_smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wb_mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(wb_smem_addr(bar)), "r"(count) : "memory");
}
// makes the initialised mbarriers visible to the copy engine (the async proxy)
__device__ __forceinline__ void wb_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// the one arrival of the phase, with the bytes the phase's copy will bring
__device__ __forceinline__ void wb_mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(wb_smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wb_mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(wb_smem_addr(bar)) : "memory");
}
// whether the phase of this parity has completed (try_wait: the thread may be suspended a while before it answers)
__device__ __forceinline__ bool wb_mbar_test(u64* bar, u32 parity) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(wb_smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}
// weights are read once per token: the copy marks its lines first to go from L2, as the loads' no_allocate does in L1
// the same without waiting (test_wait): for the streamer, which polls its own stop flag between tries
__device__ __forceinline__ bool wb_mbar_done(u64* bar, u32 parity) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(wb_smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void wb_bulk_g2s(void* dst, const void* src, u32 bytes, u64* bar) {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(wb_smem_addr(dst)), "l"(src), "r"(bytes), "r"(wb_smem_addr(bar)), "l"(policy) : "memory");
}
#define WB_INF __int_as_float(0x7f800000)
// Fixed point (kernels/lib/residual.cuh): integer adds at L2, in any order the same sum. There is no vector
// form of an integer red, so a warp's adds go to 32 adjacent words (coalesced), one instruction each.
__device__ __forceinline__ fx64 wb_ld_cg_fx(const fx64* p) { return __ldcg(p); }
__device__ __forceinline__ void wb_red_add_fx(fx64* p, fx64 v) {
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void wb_atomic_exch_fx(fx64* p, fx64 v) {
    atomicExch((unsigned long long*)p, (unsigned long long)v); }
__device__ __forceinline__ fx64 wb_f32_to_fx_rn(float v) { return __float2ll_rn(v); }    // cvt.rni: to nearest even
__device__ __forceinline__ float wb_fx_to_f32(fx64 v) { return __ll2float_rn(v); }
// D += A·B on the tensor cores: one m16n8k16 product of bf16 with fp32 accumulation, operands in the PTX ISA's
// register fragments (a: 4 registers of bf16 pairs, rows g and g+8 of the 16; b: 2; d: rows g and g+8, two columns
// each, g = lane / 4). The prefill's attention (kernels/prefill/attention.cuh) is built on it; the decode
// sections are matrix-vector products and never need it.
__device__ __forceinline__ void wb_mma_bf16_16816(float* d, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// An 8×8 bf16 matrix held as mma fragments (lane 4g + t: row g, columns 2t and 2t+1, a word) transposed in the
// registers: the lane then holds row g of the transpose, which is column g of the input.
__device__ __forceinline__ u32 wb_movmatrix_trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
// two floats → a bf16 pair (the first in the low half), each rounded to nearest even, NaN staying NaN: one
// conversion instruction where f32_to_bf16 takes five integer ones a value
__device__ __forceinline__ u32 wb_pack_bf16x2(float first, float second) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
    return r;
}
// 16 bytes global → shared without passing through registers (sm_80's cp.async, L1 bypassed), zeros instead when
// !valid: a tile's rows past the data need no separate clearing. Groups of them complete in issue order.
__device__ __forceinline__ void wb_cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(wb_smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void wb_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most `pending` of this thread's groups are still in flight
template <int pending> __device__ __forceinline__ void wb_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(pending) : "memory");
}
// Four 8×8 bf16 matrices from shared memory, transposed, into mma.sync's B fragments: lane L gives the address of
// row L % 8 of matrix L / 8; out[m] holds that matrix's column g = lane / 4, rows 2t and 2t+1 (t = lane % 4).
__device__ __forceinline__ void wb_ldmatrix_x4_trans(u32* out, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3]) : "r"(wb_smem_addr(row)));
}
// The same, not transposed: out[m] holds row g of matrix m, columns 2t and 2t+1.
__device__ __forceinline__ void wb_ldmatrix_x4(u32* out, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3]) : "r"(wb_smem_addr(row)));
}
// Hopper's warpgroup products (wgmma, sm_90a only: a build for plain sm_90 never calls these, and NVRTC emits no
// PTX for an uncalled inline function). Four warps issue one m64nNk16 product together, asynchronously: A (64 × 16
// bf16) from the registers in mma.sync's A fragments, one per warp's 16 rows, or from shared memory; B (16 × N)
// from shared memory through a descriptor; D (64 × N, fp32) in the registers, mma.sync's C fragments for each 8
// columns (generated per N by workbench.run.prefill_gpu.wgmma_products, since the operand list is N/2 registers
// long). The registers a product reads or writes are not to be touched between wb_wgmma_fence and
// wb_wgmma_wait; wb_reg_fence after the wait keeps the compiler from reading them before it.
template <int N, int TRANS_B>
__device__ __forceinline__ void wb_wgmma_bf16(float* d, const u32* a, u64 desc, int accumulate);
template <int N>      // A (64 × 16, K-major) through a descriptor too
__device__ __forceinline__ void wb_wgmma_bf16_ss(float* d, u64 desc_a, u64 desc_b, int accumulate);
__device__ __forceinline__ void wb_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wb_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int pending> __device__ __forceinline__ void wb_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(pending) : "memory");
}
__device__ __forceinline__ void wb_reg_fence(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void wb_reg_fence(u32& x) { asm volatile("" : "+r"(x) :: "memory"); }
// shared memory written by this thread's loads or cp.async (the generic proxy), made visible to what reads it
// through the async proxy (wgmma's operands, bulk copies out): before the block barrier that publishes it
__device__ __forceinline__ void wb_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// A shared-memory matrix descriptor without a swizzle: the matrix is 8 × 8 core matrices of 8 rows of 16 bytes,
// each 128 contiguous bytes; `lead` bytes from one core matrix to the next along K, `stride` along M or N.
__device__ __forceinline__ u64 wb_wgmma_desc(const void* smem, u32 lead, u32 stride) {
    return (u64)((wb_smem_addr(smem) & 0x3ffff) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32);
}
// The same in the 128-byte swizzle (layout type 1 in bits 62-63), as the tensor memory accelerator writes it: rows
// of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), in atoms of 8 rows (1,024 bytes, aligned to 1,024).
// K-major: `stride` bytes from one 8-row atom to the next along M or N (`lead` unused); MN-major: `lead` bytes from
// one 64-element span of M or N to the next, `stride` from one 8-row atom to the next along K. A step along K
// within a row moves the start address (32 bytes a 16-element step), as CUTLASS's descriptors do.
__device__ __forceinline__ u64 wb_wgmma_desc_sw128(const void* smem, u32 lead, u32 stride) {
    return wb_wgmma_desc(smem, lead, stride) | (1ull << 62);
}
// A warpgroup's registers a thread set to N (a multiple of 8, 24 to 256), every thread of the warpgroup executing
// it: dec gives registers back to the block's pool, inc waits until the pool has them (sm_90a; FA3's producer and
// consumer warpgroups). ptxas allocates the code after it within N.
template <int N> __device__ __forceinline__ void wb_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}
template <int N> __device__ __forceinline__ void wb_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}
// Named barrier `id` (1 to 15; 0 is __syncthreads') of `count` threads, a multiple of the warp: sync waits until
// `count` threads have arrived or synced on it, arrive counts this warp's threads and goes on (FA3's warp
// scheduler barriers, which make two warpgroups take turns)
__device__ __forceinline__ void wb_named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void wb_named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}
// A tensor map: the 128 opaque bytes the driver encodes on the host (cuTensorMapEncodeTiled), passed to the kernel
// by value as a __grid_constant__ parameter
struct __align__(64) wb_tensor_map { u64 opaque[16]; };
// One box of a rank-3 tensor map at coordinates (c0 innermost, c1, c2) into shared memory, by the tensor memory
// accelerator: issued by one thread, completing on mbarrier `bar` (whose phase expects its bytes); a box reaching
// past the tensor is filled with zeros there
__device__ __forceinline__ void wb_tma_load_3d(void* dst, const wb_tensor_map* map, int c0, int c1, int c2,
                                               u64* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(wb_smem_addr(dst)), "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(wb_smem_addr(bar))
                 : "memory");
}
#endif

// ---- vendor-neutral helpers built on the layer above ---------------------------------------------------------
// A stage of the decode step. Kept out of line on NVIDIA: the persistent kernel would otherwise be one function with
// every stage's live ranges competing for the 128 registers a 512-thread block allows, and it spills. On AMD a
// 512-thread block (8 waves, 2 per SIMD) gets 256 VGPRs a lane, so the stages fit inlined; out of line, every call
// would save the callee-saved VGPRs it uses to scratch.
#if WB_AMD
#define WB_SECTION __device__
#else
#ifndef WB_SECTION
#define WB_SECTION __device__ __attribute__((noinline))
#endif
#endif
// Warps in a block of the largest size (1024 threads on both vendors): 32 on NVIDIA, 16 on AMD. Per-warp scratch
// (e.g. one float and one int per warp for block reductions) is sized by this, never by a literal.
#define WB_MAX_WARPS (1024 / WB_WARP)
__device__ __forceinline__ int wb_lane() { return wb_tid() % WB_WARP; }
__device__ __forceinline__ int wb_warp() { return wb_tid() / WB_WARP; }
__device__ __forceinline__ int wb_nwarps() { return wb_ntid() / WB_WARP; }

__device__ __forceinline__ float bf16_lo(u32 w) { return wb_u32_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return wb_u32_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf16_to_f32(bf16 b) { return wb_u32_as_float(((u32)b) << 16); }
__device__ __forceinline__ bf16 f32_to_bf16(float f) {   // round to nearest even, NaN stays NaN
    u32 u = wb_float_as_u32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#if WB_AMD
__device__ __forceinline__ u32 wb_pack_bf16x2(float first, float second) {
    return (u32)f32_to_bf16(first) | ((u32)f32_to_bf16(second) << 16);
}
#endif

// Sum over the lanes of a warp (or over aligned groups of `width` lanes: xor pairing needs a power of two)
template <int width = WB_WARP>
__device__ __forceinline__ float wb_warp_sum(float v) {
    static_assert(width > 0 && (width & (width - 1)) == 0 && width <= WB_WARP, "lane groups are powers of two");
#pragma unroll
    for (int m = width / 2; m > 0; m >>= 1) v += wb_shfl_xor(v, m);
    return v;
}
template <int width = WB_WARP>
__device__ __forceinline__ float wb_warp_max(float v) {
    static_assert(width > 0 && (width & (width - 1)) == 0 && width <= WB_WARP, "lane groups are powers of two");
#pragma unroll
    for (int m = width / 2; m > 0; m >>= 1) v = wb_fmaxf(v, wb_shfl_xor(v, m));
    return v;
}

// Dot product of 8 bf16 weights (one 16-byte load) with 8 fp32 activations.
// WB_DOT8 may be replaced by a packed-dot instruction per vendor; the fallback is 8 FMAs in fp32.
__device__ __forceinline__ float wb_dot8(wb_u4 w, const float* a, float acc) {
    acc = wb_fma(bf16_lo(w.x), a[0], acc); acc = wb_fma(bf16_hi(w.x), a[1], acc);
    acc = wb_fma(bf16_lo(w.y), a[2], acc); acc = wb_fma(bf16_hi(w.y), a[3], acc);
    acc = wb_fma(bf16_lo(w.z), a[4], acc); acc = wb_fma(bf16_hi(w.z), a[5], acc);
    acc = wb_fma(bf16_lo(w.w), a[6], acc); acc = wb_fma(bf16_hi(w.w), a[7], acc);
    return acc;
}

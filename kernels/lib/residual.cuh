// The residual stream x in fixed point (workbench/plan.py, X_FRAC_BITS): x[i] is the sum of its WB_X_PARTS parts
// x[part·D + i], int64s in units of 2^-WB_X_FRAC_BITS. The MLP's down projection adds every block's partial sums
// into x with atomics that arrive in a different order each run; integer addition makes the sum the same bits in
// any order, where float addition gave seeded runs that did not repeat. A block adds into part block % parts, so
// no address serialises more than grid / parts atomic adds.
//
// Readers take the sum and round it to fp32 once: x_value is the float nearest the exact total. A value past its
// bound (NaN and ±inf included) poisons the element, INT64_MIN in part 0; a total of magnitude 2^WB_X_NAN_BITS or
// more reads as NaN, so a NaN still reaches the logits and the step's stop decision.
#pragma once

static_assert(WB_X_PARTS >= 1 && WB_X_FRAC_BITS + WB_X_VALUE_BITS + 1 < WB_X_NAN_BITS && WB_X_NAN_BITS == 62,
              "totals stay below 2^(VALUE + FRAC + 1), a poisoned one at least 2^63 - 2^61 away from zero");
static_assert(WB_D % 4 == 0, "x is read four elements (two 16-byte loads a part) at a time");

constexpr fx64 WB_X_NAN = (fx64)1 << WB_X_NAN_BITS;         // a total this far from zero is NaN
constexpr fx64 WB_X_POISON = -WB_X_NAN - WB_X_NAN;           // INT64_MIN: what a value past its bound becomes

__device__ __forceinline__ float x_float(fx64 total) {
    return total < WB_X_NAN && total > -WB_X_NAN ? wb_fx_to_f32(total) * wb_u32_as_float(WB_X_ULP_BITS)
                                                 : wb_u32_as_float(0x7fc00000u);
}

// v in fixed point, or the poison when |v| is not below `limit` (NaN fails the comparison too)
__device__ __forceinline__ fx64 x_fixed(float v, float limit) {
    return v < limit && v > -limit ? wb_f32_to_fx_rn(v * wb_u32_as_float(WB_X_ONE_BITS)) : WB_X_POISON;
}

// x[i] as a float; the parts' sum in u64, where wrapping is defined (a poisoned total wraps by design)
__device__ __forceinline__ float x_value(const fx64* x, int i) {
    u64 s = 0;
#pragma unroll
    for (int k = 0; k < WB_X_PARTS; ++k) s += (u64)wb_ld_cg_fx(x + (long long)k * WB_D + i);
    return x_float((fx64)s);
}

// x[i .. i + 3], i a multiple of 4: every part's two 16-byte loads in flight before the first sum
__device__ __forceinline__ void x_value4(const fx64* x, int i, float* v) {
    u64 s[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < WB_X_PARTS; ++k) {
        const wb_u4 a = wb_ld_cg_u4(x + (long long)k * WB_D + i), b = wb_ld_cg_u4(x + (long long)k * WB_D + i + 2);
        s[0] += (u64)a.y << 32 | a.x;
        s[1] += (u64)a.w << 32 | a.z;
        s[2] += (u64)b.y << 32 | b.x;
        s[3] += (u64)b.w << 32 | b.z;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = x_float((fx64)s[j]);
}

// x[i] = v, a whole value (the embedding, the attention residual): the other parts cleared
__device__ __forceinline__ void x_store(fx64* x, int i, float v) {
    x[i] = x_fixed(v, wb_u32_as_float(WB_X_VALUE_LIMIT_BITS));
#pragma unroll
    for (int k = 1; k < WB_X_PARTS; ++k) x[(long long)k * WB_D + i] = 0;
}

// x[i] += v, this block's partial sum: an integer atomic into the block's part. A partial past its bound (2^VALUE /
// grid: the grid's partials together stay in range) poisons the element in part 0, where every poison goes: two
// poisons in different parts would cancel (2·2^63 ≡ 0), two in one part cannot (the second overwrites the first).
__device__ __forceinline__ void x_add(fx64* x, int i, float v) {
    const float limit = wb_u32_as_float(WB_X_PARTIAL_LIMIT_BITS);
    if (v < limit && v > -limit)
        wb_red_add_fx(x + (long long)(wb_bid() % WB_X_PARTS) * WB_D + i, wb_f32_to_fx_rn(v * wb_u32_as_float(WB_X_ONE_BITS)));
    else
        wb_atomic_exch_fx(x + i, WB_X_POISON);
}

// The checks below: x-sum-drops-last-part is named at qkv_rope_append, since the first reader of what down
// adds is the next layer's norm; x-parts-not-cleared at o_proj_residual, since a whole value stored over
// down's sums of the layer before makes o_proj's x at layer 1 the first wrong output.
/* wb:checks
mutant x-sum-drops-last-part [expect=qkv_rope_append]: x's value, as the norms read it, leaves out its last part
-for (int k = 0; k < WB_X_PARTS; ++k) {
-        const wb_u4 a
+for (int k = 0; k < WB_X_PARTS - 1; ++k) {
+        const wb_u4 a

mutant x-parts-not-cleared [expect=o_proj_residual]: a stored value leaves x's other parts as they were
-for (int k = 1; k < WB_X_PARTS; ++k) x[(long long)k * WB_D + i] = 0;
*/

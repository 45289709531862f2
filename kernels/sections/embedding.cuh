// x = embed[token], widened to fp32 and stored as the residual stream's fixed point (kernels/lib/residual.cuh):
// exact for every bf16 of magnitude 2^-25 or more, the nearest multiple of 2^-32 below that.
// Run by block 0 (the block that chose the token), before the barrier that opens the step.
#pragma once

WB_SECTION void stage_embedding(int token, const bf16* __restrict__ embed, fx64* x) {
    const bf16* __restrict__ row = embed + (long long)token * WB_D;
    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x_store(x, i, bf16_to_f32(row[i]));
}

// compiler-hangs (below): 2^24 copies of a statement, by the preprocessor. The compiler front end alone takes
// minutes (a large `#pragma unroll` is not enough: NVVM declines to unroll past its own limit and compiles in
// seconds).
/* wb:checks
mutant embed-wrong-row: reads the next token's row
-(long long)token * WB_D
+(long long)(token + 1) * WB_D

mutant embed-last-dim: leaves the last dimension unwritten
-i < WB_D; i += wb_ntid()) x_store(
+i < WB_D - 1; i += wb_ntid()) x_store(

inject compiler-hangs [expect=compiler hang or crash]: 16 million copies of a statement (the compiler runs for minutes)
-    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x_store(x, i, bf16_to_f32(row[i]));
+#define WB_X0(s) s
+#define WB_X1(s) WB_X0(s) WB_X0(s)
+#define WB_X2(s) WB_X1(s) WB_X1(s)
+#define WB_X3(s) WB_X2(s) WB_X2(s)
+#define WB_X4(s) WB_X3(s) WB_X3(s)
+#define WB_X5(s) WB_X4(s) WB_X4(s)
+#define WB_X6(s) WB_X5(s) WB_X5(s)
+#define WB_X7(s) WB_X6(s) WB_X6(s)
+#define WB_X8(s) WB_X7(s) WB_X7(s)
+#define WB_X9(s) WB_X8(s) WB_X8(s)
+#define WB_X10(s) WB_X9(s) WB_X9(s)
+#define WB_X11(s) WB_X10(s) WB_X10(s)
+#define WB_X12(s) WB_X11(s) WB_X11(s)
+#define WB_X13(s) WB_X12(s) WB_X12(s)
+#define WB_X14(s) WB_X13(s) WB_X13(s)
+#define WB_X15(s) WB_X14(s) WB_X14(s)
+#define WB_X16(s) WB_X15(s) WB_X15(s)
+#define WB_X17(s) WB_X16(s) WB_X16(s)
+#define WB_X18(s) WB_X17(s) WB_X17(s)
+#define WB_X19(s) WB_X18(s) WB_X18(s)
+#define WB_X20(s) WB_X19(s) WB_X19(s)
+#define WB_X21(s) WB_X20(s) WB_X20(s)
+#define WB_X22(s) WB_X21(s) WB_X21(s)
+#define WB_X23(s) WB_X22(s) WB_X22(s)
+#define WB_X24(s) WB_X23(s) WB_X23(s)
+    float acc = 0.f;
+    WB_X24(acc = acc * 0.999f + (float)token;)
+    for (int i = wb_tid(); i < WB_D; i += wb_ntid()) x_store(x, i, bf16_to_f32(row[i]) + acc * 0.f);
*/

"""The mutation suite: deliberately wrong edits of the kernel's sections, each of which the loop must reject and
pin on the right stage. A verifier is proven by the mutants it catches.

Each `Mutant` replaces one piece of text of one section file (its `find`, which must occur exactly `count` times)
and names the stage whose verdict must fail first (`expect`: for an edit of a library file, the first stage in
decode order that runs the edited code). A mutant of a family's own step (`needs`: the config flag, e.g. Qwen3's
qk_norm) runs on a model of that family (FAMILY_MODELS), since any other compiles that code away. `sampling` marks a
mutant that only a sampler run with a temperature exposes, which the loop does when the sampling section is the one
edited. The mutants are declared here; workbench.loop.mutation applies them (GPU) one by one through the real edit
path (Workbench.edit + reload), records what the loop named and how long the verdict took, and undoes each;
`scripts/mutation_suite.py` runs it and prints the table. Without a GPU, `tests/test_mutants.py` checks that every
mutant applies and compiles.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    section: str               # the file edited (plan.FILES)
    breaks: str                # what it breaks, in words
    find: str
    replace: str
    expect: str                # the stage the verdict must name
    count: int = 1             # occurrences of `find` replaced (all of them)
    needs: str | None = None   # the ModelConfig flag of the family whose code it mutates (None: every model's)
    not_with: str | None = None  # a flag under which the mutated code is compiled away (that family's own step
                                 # does the work instead)

    def apply(self, text: str) -> str:
        n = text.count(self.find)
        if n != self.count:
            raise ValueError(f"mutant {self.name}: {self.find!r} occurs {n} times in {self.section}, "
                             f"expected {self.count}")
        return text.replace(self.find, self.replace)


M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    # embedding
    M("embed-wrong-row", "embedding", "reads the next token's row", "(long long)token * WB_D",
      "(long long)(token + 1) * WB_D", "embedding"),
    M("embed-last-dim", "embedding", "leaves the last dimension unwritten", "i < WB_D; i += wb_ntid()) x_store(",
      "i < WB_D - 1; i += wb_ntid()) x_store(", "embedding"),
    # qkv_rope_append
    M("rope-sign", "qkv_rope_append", "rotates by −angle (sin term's sign)",
      "const float lo = r[0] * c - r[1] * s, hi = r[1] * c + r[0] * s;",
      "const float lo = r[0] * c + r[1] * s, hi = r[1] * c - r[0] * s;", "qkv_rope_append", not_with="qk_norm"),
    M("rope-pair", "qkv_rope_append", "rotates pair p by the angle of pair p^1", "const float c = cs[p], s = sn[p];",
      "const float c = cs[p ^ 1], s = sn[p ^ 1];", "qkv_rope_append", not_with="qk_norm"),
    M("rope-long-position", "qkv_rope_append", "rope angle of position − 1 from 4,096 on (off by one, long only)",
      "rope_cos + (long long)pos * HALF", "rope_cos + (long long)(pos < 4096 ? pos : pos - 1) * HALF",
      "qkv_rope_append"),
    M("kv-wrong-slot", "qkv_rope_append", "appends k and v at pos + 1", "const long long kv_base = (long long)pos * WB_HEAD_DIM;",
      "const long long kv_base = (long long)(pos + 1) * WB_HEAD_DIM;", "qkv_rope_append"),
    M("k-truncated", "qkv_rope_append", "k to bf16 by truncation instead of rounding", "k[p] = f32_to_bf16(lo);",
      "k[p] = (bf16)(wb_float_as_u32(lo) >> 16);", "qkv_rope_append", not_with="qk_norm"),
    M("q-scale-1e-4", "qkv_rope_append", "q's first halves 1e-4 too large", "q[head * WB_HEAD_DIM + p] = lo;",
      "q[head * WB_HEAD_DIM + p] = lo * 1.0001f;", "qkv_rope_append", not_with="qk_norm"),
    # qkv_rope_append, Qwen3's per-head q/k norm, and Qwen2's biases
    M("qk-norm-k-takes-q-gain", "qkv_rope_append", "k heads normalised with q's gain",
      "qk_gain + WB_HEAD_DIM, cs, sn,", "qk_gain, cs, sn,", "qkv_rope_append", needs="qk_norm"),
    M("qk-norm-rope-sign", "qkv_rope_append", "a normalised head rotated by −angle (sin term's sign)",
      "qk_put(out + p, a * c - b * s);\n        qk_put(out + p + HALF, b * c + a * s);",
      "qk_put(out + p, a * c + b * s);\n        qk_put(out + p + HALF, b * c - a * s);", "qkv_rope_append",
      needs="qk_norm"),
    M("qk-norm-k-truncated", "qkv_rope_append", "a normalised k to bf16 by truncation instead of rounding",
      "__device__ __forceinline__ void qk_put(bf16* o, float v) { *o = f32_to_bf16(v); }",
      "__device__ __forceinline__ void qk_put(bf16* o, float v) { *o = (bf16)(wb_float_as_u32(v) >> 16); }",
      "qkv_rope_append", needs="qk_norm"),
    M("qk-norm-scale-1e-4", "qkv_rope_append", "the per-head RMS 1e-4 too large (q and k 1e-4 too small)",
      "wb_warp_sum(ss) / (float)WB_HEAD_DIM + WB_RMS_EPS", "wb_warp_sum(ss) / (float)WB_HEAD_DIM * 1.0002f + WB_RMS_EPS",
      "qkv_rope_append", needs="qk_norm"),
    M("qk-norm-last-pair-unwritten", "qkv_rope_append", "each q and k head's last rope pair is never written",
      "if (p >= HALF) continue;", "if (p >= HALF - 1) continue;", "qkv_rope_append", needs="qk_norm"),
    M("qkv-bias-dropped", "qkv_rope_append", "the bias of each pair's first row is not added",
      "WB_QKV_BIAS ? y[0] + bqkv[row] : y[0]", "y[0]", "qkv_rope_append", needs="qkv_bias"),
    M("v-dims-swapped", "qkv_rope_append", "v's two dims of a pair swapped",
      "v[rr % WB_HEAD_DIM] = f32_to_bf16(r[0]);\n            v[rr % WB_HEAD_DIM + 1] = f32_to_bf16(r[1]);",
      "v[rr % WB_HEAD_DIM] = f32_to_bf16(r[1]);\n            v[rr % WB_HEAD_DIM + 1] = f32_to_bf16(r[0]);",
      "qkv_rope_append"),
    M("eps-x10", "matvec", "RMSNorm's eps ten times too large (library: every normalising stage)",
      "/ (float)n + WB_RMS_EPS);", "/ (float)n + 10.f * WB_RMS_EPS);", "qkv_rope_append", count=2),
    # the residual stream's fixed point (library): its first reader of what down adds is the next layer's norm
    M("x-sum-drops-last-part", "residual", "x's value, as the norms read it, leaves out its last part",
      "for (int k = 0; k < WB_X_PARTS; ++k) {\n        const wb_u4 a",
      "for (int k = 0; k < WB_X_PARTS - 1; ++k) {\n        const wb_u4 a", "qkv_rope_append"),
    # a whole value stored over down's sums of the layer before: o_proj's x at layer 1 is the first wrong output
    M("x-parts-not-cleared", "residual", "a stored value leaves x's other parts as they were",
      "for (int k = 1; k < WB_X_PARTS; ++k) x[(long long)k * WB_D + i] = 0;", "", "o_proj_residual"),
    # attention_decode
    M("merge-drops-last-split", "attention_decode", "the split merge leaves out the last split (only S ≥ 2)",
      "const bool in = s0 + j < S;", "const bool in = s0 + j < S - 1;", "attention_decode"),
    M("attn-ring-skips-step", "attention_decode", "a warp's third step is never fetched (the ring's refill re-fetches "
      "the step in flight): only where a warp has three steps of a chunk",
      "if (j + WB_ATTN_BUFS - 1 < mine) issue(j + WB_ATTN_BUFS - 1);",
      "if (j + WB_ATTN_BUFS - 1 < mine) issue(j + WB_ATTN_BUFS - 2);", "attention_decode"),
    M("attn-step-tail-unmasked", "attention_decode", "the first position past a chunk's end is not masked (a zero key "
      "and value weigh in): only where a chunk ends inside a step", "if (k0 + g + 8 >= left) s[2] = s[3] = -WB_INF;",
      "if (k0 + g + 8 > left) s[2] = s[3] = -WB_INF;", "attention_decode"),
    M("gqa-wrong-head", "attention_decode", "a kv head reads the next group's queries",
      "const float* qh = q + (kvh * ATT_GQ + g) * HD;", "const float* qh = q + (((kvh + 1) % WB_KV_HEADS) * ATT_GQ + g) * HD;",
      "attention_decode"),
    M("attn-scale-1e-4", "attention_decode", "scores scaled 1e-4 too much", "const float scale = wb_rsqrt((float)HD);",
      "const float scale = wb_rsqrt((float)HD) * 1.0001f;", "attention_decode"),
    M("attn-long-context-short", "attention_decode", "from 4,096 on, the newest position is left out",
      "const int n = pos + 1, S", "const int n = pos + (pos >= 4096 ? 0 : 1), S", "attention_decode"),
    M("softmax-no-rescale", "attention_decode", "the running sum is not rescaled when the max grows",
      "l0 = l0 * c0 + s[0] + s[2];", "l0 = l0 + s[0] + s[2];", "attention_decode"),
    M("merge-warps-drops-first", "attention_decode", "the warp merge leaves out the first warp's sum (the last "
      "warps read no positions on NVIDIA, so leaving out the last one changed nothing)",
      "    for (int w = 0; w < wb_nwarps(); ++w) {\n        const float* st",
      "    for (int w = 1; w < wb_nwarps(); ++w) {\n        const float* st", "attention_decode"),
    # o_proj_residual
    M("o-residual-one-layer", "o_proj_residual", "layer 1 loses its attention residual",
      "const float v = x_value(x, r) + y[0];", "const float v = (layer == 1 ? 0.f : x_value(x, r)) + y[0];",
      "o_proj_residual"),
    M("o-last-row", "o_proj_residual", "the last output row is never written", "(wo, WB_D, act,",
      "(wo, WB_D - 1, act,", "o_proj_residual"),
    M("o-h-1e-4", "o_proj_residual", "h, the MLP norm's copy of x, 1e-4 off", "h[r] = v;", "h[r] = v * 1.0001f;",
      "o_proj_residual"),
    # gate_up_silu
    M("silu-1e-4", "gate_up_silu", "the gate's sigmoid argument 1e-4 off",
      "gu[0] / (1.f + wb_exp(-gu[0])) * gu[1]", "gu[0] / (1.f + wb_exp(-gu[0] * 1.0001f)) * gu[1]", "gate_up_silu"),
    M("gate-up-swapped", "gate_up_silu", "silu on the up projection instead of the gate",
      "gu[0] / (1.f + wb_exp(-gu[0])) * gu[1]", "gu[1] / (1.f + wb_exp(-gu[1])) * gu[0]", "gate_up_silu"),
    M("hmlp-last-row", "gate_up_silu", "the last MLP row is never written", "(wgu, WB_FF, act,",
      "(wgu, WB_FF - 1, act,", "gate_up_silu"),
    # down_residual
    M("down-scale-1e-4", "down_residual", "x + 1.0001·y instead of x + y", "x_add(x, i, t);",
      "x_add(x, i, t * 1.0001f);", "down_residual"),
    M("down-residual-one-layer", "down_residual", "the last layer loses its MLP output",
      "x_add(x, i, t);", "if (layer != WB_LAYERS - 1) x_add(x, i, t);", "down_residual"),
    M("down-last-row", "down_residual", "the last output rows are never added to",
      "for (int i = wb_tid(); i < WB_D; i += wb_ntid()) {",
      "for (int i = wb_tid(); i < WB_D - 4; i += wb_ntid()) {", "down_residual"),
    M("down-unit-skipped", "down_residual", "each block leaves out its last column of Wd",
      "wb_block_units(WB_FF, u0, u1);", "wb_block_units(WB_FF, u0, u1);\n    --u1;", "down_residual"),
    M("down-column-swapped", "down_residual", "every fourth column takes its left neighbour's weight",
      "acc[3] = wb_fma(bf16_hi(w[k].y), a, acc[3]);", "acc[3] = wb_fma(bf16_lo(w[k].y), a, acc[3]);",
      "down_residual"),
    # lm_head
    M("logits-last-row", "lm_head", "the last vocabulary row is never written", "(lm_head, WB_VOCAB, act,",
      "(lm_head, WB_VOCAB - 1, act,", "lm_head"),
    M("partial-wrong-index", "lm_head", "each block's argmax partial is off by one", "blk_arg[wb_bid()] = arg;",
      "blk_arg[wb_bid()] = arg + 1;", "lm_head"),
    M("logits-scale-1e-4", "lm_head", "logits 1e-4 too large", "if (wb_lane() == 0) logits[v] = y[0];",
      "if (wb_lane() == 0) logits[v] = y[0] * 1.0001f;", "lm_head"),
    # sampling
    M("greedy-off-by-one", "sampling", "the greedy token is the argmax + 1",
      "best_i = bv > -WB_INF ? bi : -1;", "best_i = bv > -WB_INF ? bi + 1 : -1;", "sampling"),
    M("top-k-one-more", "sampling", "top-k keeps k + 1 tokens", "(u64)P->top_k, false, sc);",
      "(u64)P->top_k + 1, false, sc);", "sampling"),
    M("top-p-drops-boundary", "sampling", "top-p drops the token that reaches p",
      "floor_ord = p_ord > floor_ord ? p_ord : floor_ord;", "floor_ord = p_ord + 1 > floor_ord ? p_ord + 1 : floor_ord;",
      "sampling"),
    M("draw-wrong-step", "sampling", "the draws use the next step's random numbers",
      "samp_uniform(P->seed, step, d)", "samp_uniform(P->seed, step + 1, d)", "sampling"),
    # publish
    M("forced-one-short", "publish", "the prompt's last token is replaced by a sampled one",
      "const bool forced = step + 1 < P->n_in;", "const bool forced = step + 2 < P->n_in;", "publish"),
    M("stops-one-early", "publish", "generation stops one token before max_new",
      "done |= g + 1 >= P->max_new;", "done |= g + 2 >= P->max_new;", "publish"),
    M("streams-wrong-token", "publish", "streams token + 1 (feeds the right one)",
      "P->tokens_out[g] = next;", "P->tokens_out[g] = next + 1;", "publish"),
    # the stop decision, a rule at a time (workbench.check.stops gives each run limits past every other rule)
    M("eos-only-first-id", "publish", "only the first of several EOS ids ends the run",
      "for (int e = 0; e < P->n_eos; ++e)", "for (int e = 0; e < P->n_eos && e < 1; ++e)", "publish"),
    M("max-new-ignored", "publish", "max_new never ends the run (n_steps still does)",
      "done |= g + 1 >= P->max_new;", "(void)0;", "publish"),
    M("n-steps-ignored", "publish", "n_steps never ends the run", "done |= step + 1 >= P->n_steps || ",
      "done |= ", "publish"),
    M("cache-end-one-early", "publish", "the run ends a position before the cache's last",
      "P->pos0 + step + 1 >= WB_MAX_SEQ", "P->pos0 + step + 2 >= WB_MAX_SEQ", "publish"),
    M("abort-ignored", "publish", "the host's abort word is never acted on",
      "wb_load_volatile(P->host_abort)", "(0 && wb_load_volatile(P->host_abort))", "publish"),
    M("nan-runs-on", "publish", "a step with no valid token (NaN logits) does not end the run",
      "next = 0;\n            done = 1;", "next = 0;\n            done = 0;", "publish"),
)


# the plan's stages whose section no mutant edits, and why (tests/test_stage_tables.py: every stage of the plan has
# a mutant of its section or an entry here): none
MUTANTS_EXEMPT: dict[str, str] = {}

# the model each family's mutants run on: random weights at its real shapes
FAMILY_MODELS = {"qk_norm": "qwen3-0.6b", "qkv_bias": "qwen2.5-0.5b"}


def for_model(cfg, mutants=MUTANTS) -> list[Mutant]:
    """The mutants whose code this model compiles: every model's (less those its family's step replaces), and its
    own family's."""
    return [m for m in mutants if (m.needs is None or getattr(cfg, m.needs))
            and not (m.not_with and getattr(cfg, m.not_with))]


def by_name(name: str) -> Mutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"no mutant {name!r}")

"""The batched prefill's own GPU path (workbench.run.prefill picks it where it runs): each of the plan's stages as
bf16 products on the tensor cores (cuBLAS gemmEx, fp32 accumulation) between fused row-wise kernels
(kernels/prefill/layer.cuh), with causal attention in one flash-style kernel (kernels/prefill/attention.cuh). It
reads the prepared weights as they are (bf16, the kernel's row order: nothing converted to fp32) and writes the
kernel's bf16 cache directly, which attention then reads.

A stage's implementation is found through the math the plan binds it: IMPLEMENTS is keyed by the stage math's `*_io`
functions, and a fused stage's math (stage_math.composed) runs its parts' implementations in order
(`implementation`). The stages without one are IMPLEMENTS_EXEMPT, each with the reason, and
tests/test_stage_tables.py holds both to the plan's stages. Where the plan has a layer stage this module has no
implementation of, the prefill takes the interpreter's path instead (`covers`); a token stage without one (the
sampler) runs the reference's math on its rows.

Each implementation computes its stage reference's math (workbench/model/stage_math.py) in fp32, to within fp32's
rounding (the kernels' comments argue it), takes the stage's inputs from the chunk's state by the plan's buffer
names and returns what it writes (the prefill checks that against the plan's declared writes); keys and values go
straight into the kernel's cache. The order is the plan's (schedule.execution), as on the interpreter's path.
check_prefill holds the result to fp64.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from .. import paths, plan, schedule
from ..model import stage_math as ref
from ..model.weights import Prepared, to_f32

ATTN_THREADS = 128           # four warps of 16 query rows, and so 64 rows a block: the kernel's static_asserts
ATTN_ROWS = 64               # hold both to its tile (a warp's 16-row fragment each: FlashLayout.frags takes more)
LAYER_THREADS = 256          # the row-wise kernels' blocks (a multiple of the warp on both vendors)


# what the prefill reads of the kernels folder, besides portability.cuh
PREFILL_FILES = ("prefill/layer.cuh", "prefill/attention_common.cuh", "prefill/attention.cuh",
                 "prefill/attention_wgmma.cuh")


# what the prefill's kernels take from the portability layer that older workspaces' copies lack: without the tensor
# map's copy, a tma layout's launch would run an older kernel that ignores the maps, under the tma layout's name
PORTABILITY_NEEDS = ("wb_wgmma_desc", "wb_wgmma_desc_sw128", "wb_tma_load_3d", "wb_setmaxnreg_inc", "wb_named_sync")


def _text(path) -> str:
    """A kernel file's text, read again only when the file changed (its modification time or size): a prefill
    builds its sources on every call, and reading five files each time was ~0.5 ms of host time before its first
    kernel, a time to first token's own."""
    st = path.stat()
    return _read(str(path), st.st_ino, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _read(path: str, inode: int, mtime_ns: int, size: int) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _kernels_dir():
    """The kernels in use, or the shipped ones for a workspace filled before this version's prefill kernels: a
    workspace is filled once and never updated, so one without a file the prefill reads, or whose portability
    layer lacks what they use (PORTABILITY_NEEDS), would fail to build the prefill or build an older one; it takes
    the shipped kernels whole, portability layer included, for the prefill alone (the monokernel's sections stay
    the workspace's)."""
    k = paths.kernels_dir()
    port = k / "portability.cuh"
    complete = (all((k / f).is_file() for f in PREFILL_FILES) and port.is_file()
                and all(name in _text(port) for name in PORTABILITY_NEEDS))
    return k if complete else paths.template_dir()


@dataclasses.dataclass(frozen=True)
class FlashLayout:
    """How the attention kernel lays its work out; no choice changes a result, bit for bit (the GPU test holds
    every combination to it), but `warpgroups` at other than 64 keys a tile, and `exp_ftz` in contrived rows.
    gqa_rows: a block's 64 rows are (position, query head) pairs of one kv head, so each key and value tile serves
    the whole group; k_ldmatrix: the keys' fragments by ldmatrix;
    heavy_first: the row tiles with the most keys are dispatched first, every head's (the grid is (heads, row
    tiles)); min_blocks: the blocks an SM the kernel's registers are capped for (0: attention.cuh's default for
    the precision); frags: 16-row fragments a warp (2: 128 rows a block, each key and value fragment loaded once
    for both).
    warpgroups: the other kernel, attention_wgmma.cuh (sm_90a's warpgroup products: 64 rows a warpgroup of four
    warps, 1, 2 or 4 a block), which takes `keys` keys a tile (0: 64), `stages` tiles in flight (0: 2), `heads`
    (the warpgroups take one GQA group's heads over the same 64 rows, not 64 rows each of one head), and
    heavy_first and min_blocks as above; `overlap`: a tile's softmax runs while the last tile's P·V is in flight
    (FA3's pipelining within a warpgroup; 3 stages or more, the same bits); `tma`: the key and value tiles copied
    by the tensor memory accelerator into the 128-byte swizzle, one thread issuing a tile onto an mbarrier, not by
    every thread's cp.async (head_dim a multiple of 64; the same bits where the cache is finite:
    attention_wgmma.cuh argues it); `producer` (with tma): a warpgroup of its own issues the copies as stages come
    free, so the key loop has no block barrier, and gives its registers to the others (setmaxnreg); `pingpong`
    (two warpgroups): they take turns to issue a tile's products (FA3's warp scheduler barriers), so one's softmax
    runs beside the other's products, the same bits. The same math;
    at 64 keys a tile the same bits as attention.cuh (measured on an H100), at 128 another order of sums, which
    agrees to rounding.
    exp_ftz (either kernel): the softmax's exps flush results below 2⁻¹²⁶ to zero, the same bits in all but
    contrived rows (attention_common.cuh argues it), with fewer instructions a score."""
    gqa_rows: bool = False
    k_ldmatrix: bool = False
    heavy_first: bool = False
    min_blocks: int = 0
    frags: int = 1
    warpgroups: int = 0
    keys: int = 0
    stages: int = 0
    heads: bool = False
    overlap: bool = False
    exp_ftz: bool = False
    tma: bool = False
    producer: bool = False
    pingpong: bool = False

    def __post_init__(self):
        if self.warpgroups not in (0, 1, 2, 4) and not (self.warpgroups == 3 and self.producer):
            raise ValueError(f"warpgroups={self.warpgroups}: 0 (the mma.sync kernel), 1, 2 or 4 (3 beside a "
                             f"producer)")
        if self.warpgroups and (self.gqa_rows or self.k_ldmatrix or self.frags != 1):
            raise ValueError("the wgmma kernel (warpgroups) has no gqa_rows, k_ldmatrix or frags: they lay out "
                             "attention.cuh's mma.sync fragments")
        if self.keys and not (self.warpgroups and self.keys % 16 == 0 and 16 <= self.keys <= 256):
            raise ValueError(f"keys={self.keys}: a tile of the wgmma kernel (warpgroups), a multiple of 16 to 256")
        if self.heads and self.warpgroups < 2:
            raise ValueError("heads: the wgmma kernel's warpgroups take a GQA group's heads (warpgroups 2 to 4)")
        if self.stages and not (self.warpgroups and 2 <= self.stages <= 4):
            raise ValueError(f"stages={self.stages}: tiles in flight in the wgmma kernel (warpgroups), 2 to 4")
        if self.tma and not self.warpgroups:
            raise ValueError("tma: the wgmma kernel's tile copies (warpgroups)")
        if self.producer and not self.tma:
            raise ValueError("producer: a warpgroup that issues the accelerator's copies (tma)")
        if self.producer and (self.tile_keys != 64 or self.min_blocks > 2):
            # what the producer gives back leaves a consumer too few registers for more (ptxas: C7602 at 128 keys
            # and two blocks an SM, 80 registers a thread; at three blocks, 56)
            raise ValueError(f"producer: 64 keys a tile and at most 2 blocks an SM (keys={self.keys}, "
                             f"min_blocks={self.min_blocks}): the consumers' registers hold no more")
        if self.pingpong and (self.warpgroups != 2 or self.overlap):
            raise ValueError("pingpong: two warpgroups of the wgmma kernel taking turns, without overlap")
        if self.overlap and not (self.warpgroups and self.tile_stages >= 3):
            raise ValueError("overlap: the wgmma kernel (warpgroups) with 3 stages or more (a tile's stage is read "
                             "until the next tile's P·V lands)")

    @property
    def rows(self) -> int:
        """Rows a block takes (of each of its heads)."""
        if self.warpgroups:
            return 64 if self.heads else 64 * self.warpgroups
        return ATTN_ROWS * self.frags

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + self.producer) if self.warpgroups else ATTN_THREADS

    @property
    def tile_keys(self) -> int:
        """Keys a tile of the wgmma kernel."""
        return self.keys or 64

    @property
    def tile_stages(self) -> int:
        """Key and value tiles the wgmma kernel keeps in flight."""
        return self.stages or 2

    def shared_bytes(self, head_dim: int, halves: int) -> int:
        """Dynamic shared memory a block takes: the wgmma kernel's stages of a key and a value tile, and its
        warpgroups' queries in `halves` bf16 halves (and with `tma`, 1,024 bytes more to align the swizzled tiles)."""
        if not self.warpgroups:
            return 0
        return (self.tile_stages * 2 * self.tile_keys * head_dim * 2 + halves * 64 * self.warpgroups * head_dim * 2
                + 1024 * self.tma)

    def head_dim_problem(self, head_dim: int) -> str | None:
        """Why this layout cannot take this head_dim (None: it can): `tma` copies 64-column spans; `producer`'s
        consumers hold their products' accumulators in what the producer gives back up to head_dim 64."""
        if self.tma and head_dim % 64:
            return f"tma: the accelerator's tiles are 64-column spans; head_dim {head_dim} is not a multiple of 64"
        if self.producer and head_dim > 64:
            return (f"producer: its consumer warpgroups' registers hold the accumulators of head_dim 64 at most, "
                    f"not {head_dim}")
        return None

    def group_problem(self, n_heads: int, n_kv: int) -> str | None:
        """Why this layout cannot take a model of these heads (None: it can): `heads` wants its warpgroups to
        divide a GQA group."""
        if self.heads and (n_heads // n_kv) % self.warpgroups:
            return (f"heads: {self.warpgroups} warpgroups a block do not divide a GQA group of {n_heads // n_kv} "
                    f"query heads")
        return None

    def grid(self, n: int, n_heads: int, n_kv: int) -> tuple:
        if self.gqa_rows:
            g = ((n * (n_heads // n_kv) + self.rows - 1) // self.rows, n_kv)
        elif self.heads:
            if problem := self.group_problem(n_heads, n_kv):
                raise ValueError(problem)
            g = ((n + self.rows - 1) // self.rows, n_heads // self.warpgroups)
        else:
            g = ((n + self.rows - 1) // self.rows, n_heads)
        if self.heavy_first and g[0] > 65535:
            raise ValueError(f"{g[0]} row tiles: the heavy-first grid counts them in y, at most 65,535")
        return (g[1], g[0]) if self.heavy_first else g


# every layout, for the A/B and the tests that hold them to the same bits
LAYOUTS = tuple(FlashLayout(*bits) for bits in itertools.product((False, True), repeat=3))
# fp32's attention at head_dim ≤ 64 on sm_90: 0.44 against 0.50 ms a 1B layer at 4k and 20.9 against 25.0 at 32k,
# the same bits as FLASH_LAYOUT (one H100, NOTES.md round 32; the GPU test holds it to them)
WGMMA_FP32 = FlashLayout(heavy_first=True, warpgroups=2, keys=64, stages=4)
# the wgmma kernel's layouts the A/B times beside them, variations of it (at 64 keys a tile held to LAYOUTS' bits)
# (round 32, one H100: two warpgroups and 64 keys the best of four with two stages; one warpgroup at half its speed)
WGMMA_LAYOUTS = (*(dataclasses.replace(WGMMA_FP32, warpgroups=wg, keys=keys, stages=stages)
                   for wg, keys, stages in ((2, 64, 2), (2, 64, 4), (1, 64, 4), (2, 128, 2))),
                 *(dataclasses.replace(WGMMA_FP32, warpgroups=wg, stages=stages, heads=True)
                   for wg, stages in ((2, 2), (4, 2), (4, 3))),
                 *(dataclasses.replace(WGMMA_FP32, warpgroups=wg, stages=stages, heads=heads, overlap=True)
                   for wg, stages, heads in ((2, 3, False), (2, 4, False), (1, 4, False), (2, 3, True))),
                 dataclasses.replace(WGMMA_FP32, exp_ftz=True),
                 # the tiles by the tensor memory accelerator (round 34)
                 *(dataclasses.replace(WGMMA_FP32, warpgroups=wg, stages=stages, overlap=overlap, exp_ftz=ftz, tma=True)
                   for wg, stages, overlap, ftz in ((2, 4, False, False), (2, 4, False, True), (2, 2, False, False),
                                                    (2, 4, True, False), (1, 4, False, False))),
                 # and issued by a warpgroup of their own, FA3's way: two consumer warpgroups and two blocks an SM
                 # (104 registers a consumer thread), or one block of three or four (160, 112)
                 *(dataclasses.replace(WGMMA_FP32, warpgroups=wg, min_blocks=blocks, stages=stages, overlap=overlap,
                                       tma=True, producer=True)
                   for wg, blocks, stages, overlap in ((2, 2, 4, False), (3, 1, 4, False), (3, 1, 4, True),
                                                       (4, 1, 4, False))),
                 # the two warpgroups taking turns (round 37): the producer's, the accelerator's alone, cp.async's
                 *(dataclasses.replace(WGMMA_FP32, stages=stages, min_blocks=blocks, tma=tma, producer=producer,
                                       pingpong=True)
                   for stages, blocks, tma, producer in ((4, 2, True, True), (2, 0, True, False), (4, 0, False, False))))


def layout_runs(layout: FlashLayout, n_heads: int, n_kv: int, head_dim: int, halves: int, smem_most: int) -> bool:
    """Whether the attention kernel takes this layout for these shapes: a block's heads within one GQA group, and
    its shared memory within what the GPU gives a block (`smem_most` bytes)."""
    return (layout.group_problem(n_heads, n_kv) is None and layout.head_dim_problem(head_dim) is None
            and layout.shared_bytes(head_dim, halves) <= smem_most)


# bf16's attention at head_dim 64 on sm_90: the wgmma kernel with its tiles by the tensor memory accelerator,
# issued by a producer warpgroup, two blocks an SM: 10.61 against frags=2's 15.55 ms a 1B layer at 32k and 0.38
# against 0.42 at 4k, the same bits (one H100, NOTES.md round 36; the GPU tests hold it to them)
WGMMA_BF16 = dataclasses.replace(WGMMA_FP32, min_blocks=2, tma=True, producer=True)
# and past head_dim 64, where the producer's consumers cannot hold the accumulators: the accelerator's tiles in two
# stages, the consumers issuing them: 0.56 against mma.sync's 0.88 ms an 8B layer at 4k (head_dim 128), within the
# bf16 bound as every wgmma layout is (one H100, NOTES.md round 37; the GPU test holds it to the fp64 math)
WGMMA_BF16_WIDE = dataclasses.replace(WGMMA_FP32, stages=2, tma=True)


# measured on the H200 (scripts/ab_prefill_attention.py): the keys by ldmatrix 3-5% faster at 4k
# and 32k; rows per kv head 1-15% slower (more blocks on the diagonal's long tail than tiles saved); the longest
# row tiles first 2-3% faster at 32k (bf16 20.86 against 21.32 ms a layer, fp32 28.80 against 29.81)
FLASH_LAYOUT = FlashLayout(k_ldmatrix=True, heavy_first=True)


def flash_layout(head_dim: int, halves: int, compute_capability: str = "") -> FlashLayout:
    """The layout the prefill runs at this head_dim and precision (PRECISIONS' halves) on a GPU of this compute
    capability (CuPy's string, "90" for an H100 or H200; "" for none known: the mma.sync kernel's layouts).
    - fp32 at head_dim ≤ 64 on sm_90: WGMMA_FP32, 12-15% faster than FLASH_LAYOUT and the same bits (its 64-key
      tiles sum a row in FLASH_LAYOUT's order).
    - bf16 at head_dim 64 on sm_90: WGMMA_BF16 (the tensor memory accelerator's tiles, a producer warpgroup),
      32% faster than two fragments a warp at 32k and 10% at 4k, the same bits.
    - bf16 at head_dim 128 on sm_90: WGMMA_BF16_WIDE (the same tiles, no producer), 36% faster than mma.sync at
      4k on the 8B; other bits (another order of sums), within the bf16 bound.
    - bf16 at head_dim ≤ 64 elsewhere (the accelerator's tiles are 64 columns): two fragments a warp, where they
      were measured faster and build without a spill (0.34 against 0.38 ms a 1B layer at 4k and 17.2 against 19.0
      at 32k, one H100, NOTES.md round 28). In fp32 they spill 32-544 B and lost at 4k (0.59 against 0.50 ms); at
      head_dim 128 the bf16 build spills.
    - FLASH_LAYOUT elsewhere."""
    if head_dim <= 64 and compute_capability == "90":
        if halves == PRECISIONS["fp32"]:
            return WGMMA_FP32
        if WGMMA_BF16.head_dim_problem(head_dim) is None:
            return WGMMA_BF16
    wide = halves == PRECISIONS["bf16"] and compute_capability == "90"
    if wide and head_dim == 128:                      # measured there (the prefill takes head_dim ≤ 128)
        return WGMMA_BF16_WIDE
    two = halves == PRECISIONS["bf16"] and head_dim <= 64
    return dataclasses.replace(FLASH_LAYOUT, frags=2) if two else FLASH_LAYOUT


def flash_source(head_dim: int, layout: FlashLayout | None = None, halves: int = 2) -> str:
    """The prefill attention kernel's source for one head_dim (and layout, FLASH_LAYOUT unless given), with the
    queries and probabilities in `halves` bf16 halves (PRECISIONS; attention.cuh argues both): the portability
    layer, then the kernel (attention_wgmma.cuh and its products where the layout has warpgroups)."""
    if halves not in PRECISIONS.values():
        raise ValueError(f"halves={halves}: the attention kernel takes {sorted(set(PRECISIONS.values()))}")
    k, layout = _kernels_dir(), layout or FLASH_LAYOUT
    if problem := layout.head_dim_problem(head_dim):
        raise ValueError(problem)
    head = (f"#define WB_HD {head_dim}\n#define WB_THREADS {layout.threads}\n#define WB_PA_ROWS {layout.rows}\n"
            f"#define WB_PA_HEAVY_FIRST {int(layout.heavy_first)}\n#define WB_PA_HALVES {halves}\n"
            f"#define WB_PA_EXP_FTZ {int(layout.exp_ftz)}\n"
            + (f"#define WB_PA_MIN_BLOCKS {layout.min_blocks}\n" if layout.min_blocks else ""))
    if layout.warpgroups:
        return (head + f"#define WB_PW_WARPGROUPS {layout.warpgroups}\n#define WB_PW_KEYS {layout.tile_keys}\n"
                f"#define WB_PW_STAGES {layout.tile_stages}\n#define WB_PW_HEADS {int(layout.heads)}\n"
                f"#define WB_PW_OVERLAP {int(layout.overlap)}\n#define WB_PW_TMA {int(layout.tma)}\n"
                f"#define WB_PW_PINGPONG {int(layout.pingpong)}\n"
                f"#define WB_PW_PRODUCER {int(layout.producer)}\n"
                + _text(k / "portability.cuh") + wgmma_products(tuple(sorted({layout.tile_keys, head_dim})))
                + _text(k / "prefill" / "attention_common.cuh") + _text(k / "prefill" / "attention_wgmma.cuh"))
    return (head + f"#define WB_PA_FRAGS {layout.frags}\n"
            f"#define WB_PA_GQA_ROWS {int(layout.gqa_rows)}\n#define WB_PA_K_LDMATRIX {int(layout.k_ldmatrix)}\n"
            + _text(k / "portability.cuh") + _text(k / "prefill" / "attention_common.cuh")
            + _text(k / "prefill" / "attention.cuh"))


@functools.cache
def wgmma_products(ns: tuple) -> str:
    """The portability layer's warpgroup products for each N in `ns` (portability.cuh declares them and says what
    they compute): wgmma.mma_async m64nNk16, bf16 × bf16 into fp32, B through a shared-memory descriptor; A from
    four registers (wb_wgmma_bf16<N, TRANS_B>; TRANS_B 1: B MN-major) or through a descriptor too
    (wb_wgmma_bf16_ss<N>, both K-major); D = A·B or D += A·B as `accumulate` says. Generated because the
    instruction names its N/2 accumulator registers one by one."""
    out = []
    for n in sorted(ns):
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma's N is a multiple of 8 from 8 to 256, got {n}")
        r = n // 2
        regs = ", ".join(f"%{i}" for i in range(r))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(r))
        for trans in (0, 1):
            out.append(
                f"template <> __device__ __forceinline__ void wb_wgmma_bf16<{n}, {trans}>(float* d, const u32* a, "
                f"u64 desc, int accumulate) {{\n"
                f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"\n'
                f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, '
                f'{{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1, {trans};\\n}}"\n'
                f'                 : {outs}\n'
                f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));\n}}\n')
        out.append(
            f"template <> __device__ __forceinline__ void wb_wgmma_bf16_ss<{n}>(float* d, u64 desc_a, u64 desc_b, "
            f"int accumulate) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, %{r}, %{r + 1}, '
            f'p, 1, 1, 0, 0;\\n}}"\n'
            f'                 : {outs}\n'
            f'                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));\n}}\n')
    return "".join(out)


def flash_options(layout: FlashLayout) -> tuple:
    """NVRTC's options for the attention kernel of this layout: the wgmma kernel is sm_90a's alone (NVRTC takes
    this target over the one CuPy appends for the device)."""
    return ("--std=c++17", "-arch=sm_90a") if layout.warpgroups else ("--std=c++17",)


def flash_kernel(head_dim: int, layout: FlashLayout | None = None, halves: int = 2):
    """The compiled attention kernel for this head_dim, layout and halves, its dynamic shared memory allowed."""
    layout = layout or FLASH_LAYOUT
    fn = module(flash_source(head_dim, layout, halves), flash_options(layout)).get_function("prefill_attention")
    smem = layout.shared_bytes(head_dim, halves)
    if smem:
        import cupy
        rt = cupy.cuda.runtime        # one attribute, not Device().attributes' whole table, on every prefill
        most = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, cupy.cuda.Device().id)
        if smem > most:
            raise ValueError(f"{layout} at head_dim {head_dim} needs {smem // 1024} KB of shared memory a block; "
                             f"this GPU gives a block {most // 1024} KB")
    # past 48 KB of static and dynamic together a launch needs the opt-in (at 48 KB of dynamic alone, the kernel's
    # few static words made it an invalid argument)
    if smem and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def compile_ahead(builds, workers: int = 8) -> None:
    """Each (head_dim, layout, halves) build's attention kernel compiled in parallel threads (NVRTC runs without
    the GIL) into CuPy's on-disk cache, from which flash_kernel then loads it without compiling: an A/B or a test of
    twenty layouts at four head_dims waited minutes on one NVRTC compile after another. A build the layout refuses
    is skipped (flash_kernel says why when it is asked for)."""
    import concurrent.futures

    import cupy

    def build(b):
        hd, layout, halves = b
        if layout.head_dim_problem(hd) is None:
            cupy.RawModule(code=flash_source(hd, layout, halves),
                           options=flash_options(layout)).get_function("prefill_attention")
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for f in [pool.submit(build, b) for b in dict.fromkeys(builds)]:
            f.result()


def layer_source() -> str:
    k = _kernels_dir()
    return f"#define WB_THREADS {LAYER_THREADS}\n" + _text(k / "portability.cuh") + _text(k / "prefill" / "layer.cuh")


def flash_supported(cfg, xp, dtype) -> bool:
    """This path takes fp32 on an NVIDIA GPU of sm_80 or later (bf16 mma.sync and cp.async, which the portability
    header has on NVIDIA only), head_dim a multiple of 16 up to 128; elsewhere the interpreter's path runs."""
    if not (hasattr(xp, "cuda") and np.dtype(dtype) == np.float32 and cfg.head_dim % 16 == 0 and cfg.head_dim <= 128):
        return False
    return not xp.cuda.runtime.is_hip and int(xp.cuda.Device().compute_capability) >= 80


_MODULES: dict = {}


def module(src: str, options: tuple = ("--std=c++17",)):
    """The compiled module of this source (an edited kernel file is compiled again)."""
    import cupy
    key = (src, options)
    if key not in _MODULES:
        if len(_MODULES) >= 8:
            _MODULES.clear()
        _MODULES[key] = cupy.RawModule(code=src, options=options)
    return _MODULES[key]


def flash_attention(q, k_layer, v_layer, positions, n_heads: int, kernel=None, layout: FlashLayout | None = None,
                    halves: int = 2, span: tuple[int, int] | None = None):
    """o [n, Hq·hd] of queries q [n, Hq·hd] (fp32, RoPE applied) over one layer's cache k_layer, v_layer
    [Hkv, n_ctx, hd] (bf16 bits, the kernel's cache as it is), row i over keys 0..positions[i]: what
    stages.attention_decode computes, in one kernel (kernels/prefill/attention.cuh, which argues its precision).
    `kernel`: the compiled one for this head_dim, `layout` and `halves` (PRECISIONS), if the caller holds it.
    `span`: the positions' least and greatest where the caller knows them on the host (the prefill's rows are
    consecutive); without it they are read back from the GPU to be checked, a wait for everything queued before
    (the profile of a 4k prefill had 64 such waits leaving the GPU idle ~7 ms of 31)."""
    import cupy
    n_kv, n_ctx, hd = k_layer.shape
    n = q.shape[0]
    if q.shape != (n, n_heads * hd) or n_heads % n_kv or v_layer.shape != k_layer.shape:
        raise ValueError(f"q {q.shape}, k {k_layer.shape}, v {v_layer.shape}: expected q [n, {n_heads}·hd] over "
                         f"[Hkv, n_ctx, hd] caches, Hkv dividing {n_heads}")
    if q.dtype != cupy.float32 or k_layer.dtype != cupy.uint16 or v_layer.dtype != cupy.uint16:
        raise TypeError("the prefill's attention kernel takes float32 queries over bf16 (uint16 bits) keys and values")
    if not (k_layer.flags.c_contiguous and v_layer.flags.c_contiguous):
        raise ValueError("the keys and values must be one layer of the cache, contiguous")
    q = cupy.ascontiguousarray(q)
    pos = cupy.ascontiguousarray(cupy.asarray(positions, dtype=cupy.int64).reshape(-1))
    if pos.size != n:
        raise ValueError(f"{n} query rows but {pos.size} positions")
    if n:
        lo, hi = span if span is not None else (int(pos.min()), int(pos.max()))
        if hi >= n_ctx or lo < 0:
            raise ValueError(f"positions {lo}..{hi} are not all in a cache of {n_ctx} positions")
    if k_layer.data.ptr % 16 or v_layer.data.ptr % 16:      # the kernel copies 16-byte pieces
        raise ValueError("the keys and values must start on a 16-byte boundary")
    out = cupy.empty_like(q)
    if n == 0:
        return out
    layout = layout or FLASH_LAYOUT
    kernel = kernel or flash_kernel(hd, layout, halves)
    # the accelerator's maps of the keys and values end at the last position: past it a tile's keys are zeros, and
    # before it the keys of this launch's rows, which the kernel takes as written (attention_wgmma.cuh): the rows'
    # positions must be lo..hi, each once, as the prefill's are
    if layout.tma and hi - lo + 1 != n:
        raise ValueError(f"{layout}: the rows' positions must be consecutive ({n} rows over positions {lo}..{hi})")
    maps = tuple(tile_map(c, hi + 1, layout.tile_keys) for c in (k_layer, v_layer)) if layout.tma else ()
    kernel(layout.grid(n, n_heads, n_kv), (layout.threads,),
           (q, k_layer, v_layer, pos, out, np.int32(n), np.int32(n_ctx), np.int32(n_heads), np.int32(n_heads // n_kv),
            np.float32(hd ** -0.5), *maps), shared_mem=layout.shared_bytes(hd, halves))
    return out


# CUtensorMap, passed by value (CuPy takes a structured numpy value as the struct of the same bytes)
TENSOR_MAP = np.dtype({"names": ["opaque"], "formats": [(np.uint64, 16)]})


def tile_map(cache_layer, keys: int, box_keys: int):
    """The tensor map (attention_wgmma.cuh's WB_PW_TMA) of one layer's keys or values [Hkv, n_ctx, hd] (bf16 bits):
    its first `keys` positions of each kv head, in boxes of 64 columns × box_keys keys laid out in the 128-byte
    swizzle. Encoded by the driver and kept for the next launch over the same cache and keys."""
    n_kv, n_ctx, hd = cache_layer.shape
    if hd % 64 or not 0 < keys <= n_ctx or cache_layer.data.ptr % 16:
        raise ValueError(f"a tensor map of {keys} keys over a cache [{n_kv}, {n_ctx}, {hd}] at "
                         f"{cache_layer.data.ptr:#x}: head_dim a multiple of 64, 16-byte aligned")
    return _tile_map(cache_layer.data.ptr, n_kv, n_ctx, hd, keys, box_keys)


@functools.cache
def _encode_tiled():
    """The driver's cuTensorMapEncodeTiled (its library is the one CuPy has loaded)."""
    import ctypes
    encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    return encode


@functools.lru_cache(maxsize=256)
def _tile_map(ptr: int, n_kv: int, n_ctx: int, hd: int, keys: int, box_keys: int):
    import ctypes
    encode = _encode_tiled()
    raw = (ctypes.c_uint8 * (TENSOR_MAP.itemsize + 64))()           # the driver writes a 64-byte aligned map
    at = -ctypes.addressof(raw) % 64
    u64s, u32s = ctypes.c_uint64 * 3, ctypes.c_uint32 * 3
    # uint16 elements (bf16 bits; the copy moves bytes), dims innermost first, strides of the outer two in bytes,
    # no interleave, the 128-byte swizzle (3), L2 promotion of 128 bytes (2), zeros past the tensor (0)
    rc = encode(ctypes.c_void_p(ctypes.addressof(raw) + at), ctypes.c_int(1), ctypes.c_uint32(3),
                ctypes.c_void_p(ptr), u64s(hd, keys, n_kv), (ctypes.c_uint64 * 2)(hd * 2, n_ctx * hd * 2),
                u32s(64, box_keys, 1), u32s(1, 1, 1), ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(2),
                ctypes.c_int(0))
    if rc:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({rc}) for a [{n_kv}, {n_ctx}, {hd}] cache, {keys} keys")
    return np.frombuffer(bytes(raw)[at:at + TENSOR_MAP.itemsize], dtype=TENSOR_MAP)


# ---- products ---------------------------------------------------------------------------------------------------

# The precisions of the products: bf16 halves an activation is cut into (layer.cuh), and why check_prefill holds
# each to its bound (check.prefill.PREFILL_RTOL: relative L2 error of every layer's cached keys and values and of
# the last logits, against the fp64 math).
# - "fp32": a = hi + lo to 2⁻¹⁷|a|, two products. Each product is an fp32 one, and what separates the prefill from
#   fp64 is fp32 accumulation and the cache's own bf16 rounding (which the fp64 run rounds alike, but a value near
#   a rounding boundary may fall the other way): the end-to-end tolerance, verify.DEFAULT_RTOL (5e-3).
# - "bf16": a rounded to bf16 once, |a − hi| ≤ 2⁻⁹|a|, one product: half the tensor-core work, and the rounding
#   HF's bf16 prefill does too (which also rounds each product's output and the residual to bf16; this one keeps
#   those in fp32). Each rounding error is uniform within half a bf16 step, rms 2⁻⁹/√3 ≈ 1.1e-3 of the element,
#   and independent across the K terms of a product, so a product's output is off by ~1.1e-3 of its rms. The
#   residual takes 2L such products (L layers, o_proj and down) and every layer's keys depend on all before it: as
#   a random walk, √(2L)·1.1e-3 ≈ 6e-3 for the 1B's 16 layers and 9e-3 for the 8B's 32, plus the LM head's 1.1e-3.
#   The attention takes the same halves (its queries and probabilities, attention.cuh argues its ~1.5e-3 a layer):
#   ~8.5e-3 and ~1.2e-2 in all. The bound, 2e-2, is 1.6× the 8B's; a wrong row, stage or chunk is off by its own
#   size, O(1).
# The decode after a prefill reads the cache it wrote, so it is held to the same bound (verify_after_prefill).
PRECISIONS = {"fp32": 2, "bf16": 1}


@dataclasses.dataclass
class Split:
    """An fp32 activation [rows, cols] as two bf16 arrays (uint16 bits), a ≈ hi + lo to 2⁻¹⁷ (layer.cuh); or, in
    the bf16 precision, hi alone (lo None), a ≈ hi to 2⁻⁹."""
    hi: object
    lo: object | None

    @property
    def shape(self):
        return self.hi.shape

    @property
    def halves(self) -> int:
        return 1 if self.lo is None else 2

    @classmethod
    def empty(cls, shape, halves: int = 2) -> "Split":
        cp = _cp()
        return cls(cp.empty(shape, cp.uint16), cp.empty(shape, cp.uint16) if halves == 2 else None)

    def args(self) -> tuple:
        """The kernels' (hi, lo, halves): with one half, lo is hi again, never written (pf_split)."""
        return self.hi, self.hi if self.lo is None else self.lo, np.int32(self.halves)


# cudaDataType CUDA_R_32F, CUDA_R_16BF; cublasComputeType_t CUBLAS_COMPUTE_32F; CUBLAS_GEMM_DEFAULT; CUBLAS_OP_N, _T
_CUDA_R_32F, _CUDA_R_16BF, _COMPUTE_32F, _GEMM_DEFAULT, _OP_N, _OP_T = 0, 14, 68, -1, 0, 1


def gemm(a, w, out, accumulate: bool, w_t: bool = False):
    """out [m, N] (fp32, C-contiguous) = a [m, K] · wᵀ (+ out if accumulate), a and w bf16 bits [m, K] and [N, K],
    on the tensor cores with fp32 accumulation (cuBLAS gemmEx). Row-major out = a·wᵀ is column-major outᵀ = w·aᵀ,
    which is how cuBLAS is asked. `w_t`: w is given transposed, [K, N] (out = a·w). An out of bf16 bits (uint16)
    takes the fp32 sums rounded to bf16 (not accumulated onto)."""
    import cupy
    from cupy_backends.cuda.libs import cublas
    m, k = a.shape
    n = w.shape[1] if w_t else w.shape[0]
    out_bf16 = out.dtype == cupy.uint16 and not accumulate
    if w.shape != ((k, n) if w_t else (n, k)) or out.shape != (m, n) or (out.dtype != cupy.float32 and not out_bf16) \
            or a.dtype != cupy.uint16 or w.dtype != cupy.uint16 \
            or not (a.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError(f"gemm: a {a.dtype}{a.shape}, w {w.dtype}{w.shape}, out {out.dtype}{out.shape}: expected "
                         f"contiguous bf16 bits [m, K] and {'[K, N]' if w_t else '[N, K]'} into float32 [m, N] (or "
                         f"bf16 bits, not accumulated onto)")
    h = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(h, cupy.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(h)
    if mode != cublas.CUBLAS_POINTER_MODE_HOST:
        cublas.setPointerMode(h, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(h, _OP_N if w_t else _OP_T, _OP_N, n, m, k, _SCALARS.ctypes.data, w.data.ptr, _CUDA_R_16BF,
                      n if w_t else k, a.data.ptr, _CUDA_R_16BF, k, _SCALARS.ctypes.data + 4 * (not accumulate),
                      out.data.ptr, _CUDA_R_16BF if out_bf16 else _CUDA_R_32F, n, _COMPUTE_32F, _GEMM_DEFAULT)
    finally:
        if mode != cublas.CUBLAS_POINTER_MODE_HOST:
            cublas.setPointerMode(h, mode)
    return out


# alpha = 1, then beta = 1 or 0 (accumulate or not) at the next word: host scalars that outlive every call (cuBLAS
# reads them when the call is made, in host pointer mode)
_SCALARS = np.array([1.0, 0.0], np.float32)


def project(a: Split, w, onto=None, w_t: bool = False, bf16_out: bool = False):
    """a·wᵀ as W·hi + W·lo (W·hi alone in the bf16 precision), added onto `onto` in place if given (a residual:
    x + W·a, in the residual's own rows: the stages that read x before it did so already, and a copy cost ~6% of a
    4k prefill); `w_t`: w stored transposed. `bf16_out`: the sums rounded to bf16 bits (one product, no `onto`)."""
    import cupy
    if onto is not None and not onto.flags.c_contiguous:
        raise ValueError("the residual a product adds onto must be contiguous (the chunk's rows of x)")
    if bf16_out and (onto is not None or a.lo is not None):
        raise ValueError("a product into bf16 is one product (the bf16 precision's), not added onto a residual")
    out = onto if onto is not None else cupy.empty((a.shape[0], w.shape[1 if w_t else 0]),
                                                   dtype=cupy.uint16 if bf16_out else cupy.float32)
    gemm(a.hi, w, out, accumulate=onto is not None, w_t=w_t)
    return out if a.lo is None else gemm(a.lo, w, out, accumulate=True, w_t=w_t)


# ---- the row-wise kernels -----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sms(device: int) -> int:
    return _cp().cuda.Device(device).attributes["MultiProcessorCount"]


def _grid(count: int) -> tuple:
    """Blocks for a grid-stride pass over `count` elements: enough to fill every SM many times over."""
    return (max(1, min((count + LAYER_THREADS - 1) // LAYER_THREADS, _sms(_cp().cuda.Device().id) * 32)),)


@dataclasses.dataclass
class PrefillIO:
    """What a stage implementation reads beside the activations: the prepared weights, this chunk's positions
    and tokens, the kernel's cache, and the compiled kernels."""
    p: Prepared
    layer: int
    positions: object          # [rows] int64 on the GPU
    tokens: object             # [rows]
    k_cache: object            # the kernel's, [L, Hkv, max_seq, hd] bf16 bits
    v_cache: object
    layer_kernels: object      # the compiled layer.cuh
    attend: tuple              # (the compiled attention kernel for this head_dim, the FlashLayout it was built for)
    halves: int = 2            # bf16 halves of an activation in a product (PRECISIONS)
    span: tuple | None = None  # the rows' least and greatest position, known on the host (flash_attention's span)
    mlp_bf16: bool = False     # gate_up's product rounded to bf16 before silu·up (prefill's mlp_bf16)

    @property
    def cfg(self):
        return self.p.cfg

    def fn(self, name: str):
        return self.layer_kernels.get_function(name)


def norm_split(io: PrefillIO, x) -> Split:
    import cupy
    rows, cols = x.shape
    x = cupy.ascontiguousarray(x)
    out = Split.empty((rows, cols), io.halves)
    if rows:
        io.fn("prefill_norm_split")((rows,), (LAYER_THREADS,), (x, np.int32(cols), np.float32(io.cfg.rms_eps),
                                                                *out.args()))
    return out


def split(io: PrefillIO, a) -> Split:
    import cupy
    a = cupy.ascontiguousarray(a)
    out = Split.empty(a.shape, io.halves)
    if a.size:
        io.fn("prefill_split")(_grid(a.size), (LAYER_THREADS,), (a, np.int64(a.size), *out.args()))
    return out


# ---- the stages: each stage reference's math, on this path --------------------------------------------------------

def embedding(io: PrefillIO, st: dict) -> dict:
    """The rows' embeddings; the prefill checked the tokens against the vocabulary once, before its first chunk
    (check_tokens), as every read back from the GPU here would stall it."""
    return {"x": to_f32(io.p.embed[io.tokens], _cp())}


def check_tokens(tokens, vocab: int):
    """ValueError unless every token id is in [0, vocab): on the host for a numpy prompt, else one read back from
    the GPU for the whole prompt."""
    if not tokens.size:
        return
    ends = (tokens.min(), tokens.max())
    lo, hi = (int(v) for v in (ends if isinstance(tokens, np.ndarray) else _cp().stack(ends).get()))
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab})")


def qkv_rope_append(io: PrefillIO, st: dict) -> dict:
    """q for attention; k and v into the cache at the rows' positions (bf16, as the decode path writes them)."""
    cp, c = _cp(), io.cfg
    y = project(norm_split(io, st["x"]), io.p.wqkv[io.layer])
    rows = y.shape[0]
    q = cp.empty((rows, c.q_dim), dtype=cp.float32)
    if rows:
        io.fn("prefill_qkv_rope")(                                   # a block a row, a warp a head at a time
            (rows,), (LAYER_THREADS,),
            (y, _row(io.p.bqkv if c.qkv_bias else None, io.layer, (c.qkv_rows,), 0.0),
             _row(io.p.qk_gain if c.qk_norm else None, io.layer, (2, c.head_dim), 1.0),
             cp.ascontiguousarray(io.p.rope_cos), cp.ascontiguousarray(io.p.rope_sin), io.positions, q,
             io.k_cache[io.layer], io.v_cache[io.layer], np.int32(rows), np.int32(c.head_dim), np.int32(c.n_heads),
             np.int32(c.n_kv_heads), np.int32(c.max_seq), np.float32(c.rms_eps), np.int32(bool(c.qk_norm))))
    return {"q": q}


def attention(io: PrefillIO, st: dict) -> dict:
    return {"o": flash_attention(st["q"], io.k_cache[io.layer], io.v_cache[io.layer], io.positions, io.cfg.n_heads,
                                 kernel=io.attend[0], layout=io.attend[1], halves=io.halves, span=io.span)}


def o_proj_residual(io: PrefillIO, st: dict) -> dict:
    x = project(split(io, st["o"]), io.p.wo[io.layer], onto=st["x"])
    return {"x": x, "h": x}


def gate_up_silu(io: PrefillIO, st: dict) -> dict:
    """hmlp, kept split for the down product that reads it (no other stage does: see covers)."""
    gu = project(norm_split(io, st["h"]), io.p.wgu[io.layer], bf16_out=io.mlp_bf16)    # [rows, 2F]: gate j, up j
    rows, f = gu.shape[0], gu.shape[1] // 2
    h = Split.empty((rows, f), io.halves)
    if f % 4:
        raise ValueError(f"the MLP's width {f} is not a multiple of 4, which prefill_silu_mul_split takes a step")
    if rows:
        io.fn("prefill_silu_mul_split" + "_bf16" * io.mlp_bf16)(_grid(rows * f), (LAYER_THREADS,),
                                                                 (gu, np.int64(rows * f), *h.args()))
    return {"hmlp": h}


def down_residual(io: PrefillIO, st: dict) -> dict:
    return {"x": project(st["hmlp"], io.p.wd[io.layer], onto=st["x"], w_t=True)}     # wd: [F, D]


def lm_head(io: PrefillIO, st: dict) -> dict:
    return {"logits": project(norm_split(io, st["x"]), io.p.lm_head)}


# the stage math (model/stage_math.py) → its implementation here
IMPLEMENTS = {ref.embedding_io: embedding, ref.qkv_rope_append_io: qkv_rope_append, ref.attention_decode_io: attention,
              ref.o_proj_residual_io: o_proj_residual, ref.gate_up_silu_io: gate_up_silu,
              ref.down_residual_io: down_residual, ref.lm_head_io: lm_head}
# the plan's stages without one, and why
IMPLEMENTS_EXEMPT = {
    "sampling": "a token stage, run on the last row alone: its reference's math runs there instead",
    "publish": "no math of its own (the plan binds it no reference): no prefill path runs it",
}


def implementation(stage: plan.Stage):
    """The stage's implementation here, `(PrefillIO, state) → {buffer: value}`: its math's, or for a fused stage's
    math its parts' in order, each reading what the earlier ones wrote, giving the fused stage's own buffers.
    None where any is missing."""
    parts = getattr(stage.reference, "parts", (stage.reference,))
    impls = [IMPLEMENTS.get(p) for p in parts]
    if None in impls:
        return None
    if len(impls) == 1:
        return impls[0]

    def fused(io, st: dict) -> dict:
        written: dict = {}
        for impl in impls:
            written.update(impl(io, {**st, **written}))
        return {b: written[b] for b in stage.reference.gives}
    return fused


def covers(cfg) -> bool:
    """Whether every layer stage of the plan (for this config) has an implementation here: then the path runs,
    its split activations (hmlp) read only by its own stages."""
    return all(implementation(plan.stage(name)) is not None
               for name, layer in schedule.execution(cfg) if layer >= 0 and plan.stage(name).reference is not None)


def _row(table, layer: int, shape: tuple, fill: float):
    """This layer's row of a per-layer fp32 table of Prepared, or `fill` where the weights have none."""
    cp = _cp()
    if table is None:
        return cp.full(shape, fill, dtype=cp.float32)
    return cp.ascontiguousarray(table[layer], dtype=cp.float32)


def _cp():
    import cupy
    return cupy

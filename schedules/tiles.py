"""The shipped kernels' tuned parameters, in one table keyed by kernel, architecture and shape.

A shipped kernel builder takes shapes and dtypes from its caller and everything else (tile
sizes, block counts, pipeline depths, launch options) from here, through :func:`tuned`. The
measurements behind each entry are in ``schedules/results/<kernel>.md``; variants and sweeps
live in ``schedules/lab/``, which may call a builder's inner, tile-taking function with other
values, but the product never does.

Lookup order for ``tuned(kernel, arch, shape)``: the entry for ``(arch, shape)``, else
``(arch, ANY)``, else ``(ANY, ANY)``. ``arch`` is a CUDA architecture such as ``"sm_90"``
(``ANY`` where the entry holds for every architecture the kernel builds for); ``shape`` is the
kernel's own key (a tuple of the dimensions its tiles depend on) or ``ANY``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

ANY = "*"


@dataclass(frozen=True)
class TileKey:
    """Where an entry applies: an architecture (or ANY) and a shape key (or ANY)."""

    arch: str = ANY
    shape: Any = ANY


# ---------------------------------------------------------------------------------------------
# Tile and option types (one per kernel family; fields documented where they are defined).
# ---------------------------------------------------------------------------------------------

# -- MLA attention, prologue, append, prefill attention ---------------------------------------


@dataclass(frozen=True)
class MLAAttentionTiles:
    """:func:`~.mla_attention_cuda.mla_attention_cuda` (schedules/results/mla_attention.md).

    ``stages``: shared page buffers of the pipelined split block's ``cp.async`` ring (>= 2; it
    keeps ``stages - 1`` pages in flight). ``min_pages_per_split``: pages a split takes at least,
    ``long_min_pages`` past ``long_pages`` visible pages (a split's fixed cost against the
    merge's, which grows with the splits). ``max_split``: splits of a row at most.
    ``target_blocks``: split blocks the grid aims at (``smax = clamp(ceil(target_blocks /
    rows), 1, max_split)``). ``merge_cols``: output columns of one merge block.

    ``pages_per_step`` (``G``, 1 to 4): pages the pipelined block takes per loop step (one ring
    wait and 3 barriers for ``16 G`` tokens, longer and independent MMA chains). Its ring is
    ``stages / G`` slots of ``G`` page buffers, ``stages / G - 1`` of them in flight, so
    ``stages`` must be a multiple of ``G`` and at least ``2 G``; the block's shared memory
    (about ``stages * 18.3 KB + G * 8.5 KB`` at V2's rows, FP8 ``stages * 10 KB + G * 27 KB``)
    must fit 227 KB (the builder refuses other combinations). A split's page count is rounded
    up to a multiple of ``G`` (only a row's last split has a part-filled group, its pages past
    the row's end zero-filled and masked). The pages copied before the PDL wait are those of
    the split's old pages among its first ``stages - G``. ``G = 1``: the one-page block.

    ``min_blocks`` (0: none): the split kernel's ``__launch_bounds__`` minimum of blocks an SM,
    which caps its registers (65,536 / (256 x min_blocks) a thread) so that more blocks fit.

    ``block``: ``"pipe"``, the pipelined block; ``"wgmma"``, the FP8 cache's block of
    :mod:`~.mla_wgmma_cuda` (sm_90a; 16 heads, ``pages_per_step`` 4: 64 tokens a step, 512
    threads, two producer warpgroups converting the rows into two key tiles, scores on ``wgmma``;
    ``stages`` only sets the pages the prefetch to L2 leaves to the block, ``stages - 4``)."""

    stages: int
    min_pages_per_split: int
    long_min_pages: int
    long_pages: int
    max_split: int
    target_blocks: int
    merge_cols: int
    pages_per_step: int = 1
    min_blocks: int = 0
    block: str = "pipe"


@dataclass(frozen=True)
class MLAExtendTiles:
    """:func:`~.mla_extend_cuda.mla_extend_cuda`, the row-tiled kernel of extends
    (schedules/results/mla_extend.md).

    ``stages``: key-tile buffers of the ``cp.async`` ring (>= 2; 32 latent rows each).
    ``min_rows``: the MLA slot runs the row-tiled kernel when ``total_len >= min_rows *
    batch_size`` (query rows a sequence on average), the split-KV kernel otherwise; it has no
    split over the prefix, so it wants about one wave of blocks (4 rows a block) per sequence."""

    stages: int
    min_rows: int


@dataclass(frozen=True)
class MLAPrologueTiles:
    """:func:`~.mla_prologue_cuda.mla_prologue_cuda` (schedules/results/mla_prologue.md).

    ``cols``: latent columns of one column-tile block; ``threads``: threads of a block (column
    groups of one 16-byte load each x reduction groups over ``nope``)."""

    cols: int
    threads: int


@dataclass(frozen=True)
class PrefillAttentionTiles:
    """:func:`~.prefill_attention_cuda.prefill_attention_cuda`
    (schedules/results/prefill_attention.md).

    ``block_m``: query rows of a block (16 per warp); ``block_n``: keys of a KV tile."""

    block_m: int
    block_n: int


# -- MoE decode / grouped GEMMs, decode GEMVs, norm + GEMV ------------------------------------


@dataclass(frozen=True)
class GemmTiles:
    """The SIMT grouped GEMM of the routed experts (``moe_grouped_cuda.schedule_grouped_gemm``,
    where the tensor-core kernel does not apply; ``TM = ty * vr`` rows per tile)."""

    ty: int = 8  # threads along the tile's rows
    tx: int = 16  # threads along the output columns
    vr: int = 8  # rows per thread
    vc: int = 8  # columns per thread (per half)
    tk: int = 32  # reduction step staged in shared memory
    pad: int = 4  # extra floats per shared activation row (bank shift, keeps 16-byte rows)

    @property
    def tm(self) -> int:
        return self.ty * self.vr


@dataclass(frozen=True)
class GroupedMmaTiles:
    """The grouped GEMM of the routed experts on tensor cores (``moe_mma_cuda``): ``warps_n``
    warps along the columns (x 2 along the rows) of the one-tile blocks; blocks of a pair of
    tiles from ``pair_from`` tiles on (0: always, None: never)."""

    warps_n: int = 2
    pair_from: int | None = 256


@dataclass(frozen=True)
class MmaTiles:
    """The expert-major MoE decode kernels on tensor cores (``moe_expert_mma_cuda``): ``blocks``
    of ``warps`` warps; an item is ``rows`` weight rows (a multiple of 16) of one expert for a
    chunk of at most ``chunk`` (token, slot) pairs. A step of a warp's K loop is a *run* of ``run``
    inputs (128 or 256: a lane loads ``run / 128`` consecutive uint4 of each of its rows, the
    row's 4 lanes ``run / 2`` contiguous bytes; a width of an odd number of 128 ends with a run of
    128), and a warp has ``depth`` runs in flight ahead of the one it multiplies (a ring of
    registers; depth > 1 only without a K split). ``tokens``: the tokens a block plans together
    (a multiple of 32; a batch of more runs as several groups, each group reading its experts'
    weights again); ``chunk``: the (token, slot) pairs of an item (8, 16 or 32: one, two or four
    MMA n-tiles of 8 per dequantised weight fragment); an item's chunk of activations (chunk x
    the full width) is staged whole before its K loop."""

    warps: int = 4
    blocks: int = 264
    rows: int = 64
    depth: int = 1
    run: int = 128
    tokens: int = 32
    chunk: int = 8

    @property
    def name(self) -> str:
        deep = f"_d{self.depth}" if self.depth != 1 else ""
        run = f"_k{self.run}" if self.run != 128 else ""
        plan = f"_t{self.tokens}" if self.tokens != 32 else ""
        chunk = f"_c{self.chunk}" if self.chunk != 8 else ""
        return f"w{self.warps}_b{self.blocks}_r{self.rows}{deep}{run}{plan}{chunk}"

    @property
    def words(self) -> int:
        """uint4 a lane loads of each of its rows for a run."""
        return self.run // 128

    @property
    def ntiles(self) -> int:
        """MMA n-tiles (8 pairs each) of a chunk."""
        return self.chunk // 8


@dataclass(frozen=True)
class SwapTiles:
    """The grouped GEMMs of decode batches with the weights as ``wgmma``'s M (``moe_swap_cuda``):
    ``tokens`` rows of a tile (``wgmma``'s N and ``moe_align``'s padding unit: 16, 32 or 64),
    ``stages`` activation slots of the K loop's ``cp.async`` ring (loaded ``stages - 1`` steps of
    64 inputs ahead), ``ahead`` steps of packed weights a lane loads ahead into registers,
    ``warpgroups`` a block: 1 (a lane holds both 64-row halves) or 2 (one half each)."""

    tokens: int = 32
    stages: int = 4
    ahead: int = 2
    warpgroups: int = 1

    @property
    def name(self) -> str:
        wgs = f"_wg{self.warpgroups}" if self.warpgroups != 1 else ""
        return f"t{self.tokens}_s{self.stages}_a{self.ahead}{wgs}"


@dataclass(frozen=True)
class DecodeGemmTiles:
    """What ``batch_decode_gemm`` (decode of large batches through the prefill path's GEMMs)
    runs for a MoE layer's experts: ``moe="grouped"``, the routed experts as grouped GEMMs
    (``moe_mma_cuda``) plus the shared experts' GEMMs; ``moe="expert_major"``, the expert-major
    kernels (``moe_expert_mma_cuda``, each with its ``tokens`` of the table: with ``tokens`` >=
    the batch every selected expert's weights are read once a step) where they take the layer's
    shape, else the grouped GEMMs."""

    moe: str = "grouped"


@dataclass(frozen=True)
class GemvConfig:
    """The decode GEMV schedule (``decode_gemv_cuda``; its module docstring says what each field
    does)."""

    rows: int = 1  # outputs per group of lanes (R)
    groups: int = 4  # lane groups per thread block (TY)
    lanes: int | None = None  # lanes per output (TX); None: the legacy SPLITS rule
    vec: int = 32  # K elements per lane and step (with ``lanes``)
    unroll: int = 64  # pragma_auto_unroll_max_step of the K-step loop (0: none)
    unroll_k: bool = False  # unroll the K-step loop fully instead
    fast_dequant: bool = False  # INT4 -> float32 by the 2^23 bit trick instead of I2F
    hfma2: int = 0  # products per fp16 partial per half lane (4, 8, 16); 0: scalar fp32 path

    @property
    def name(self) -> str:
        """A short tag, e.g. ``r4_g4_l32_v32_u64_fast``."""
        lanes = "legacy" if self.lanes is None else f"l{self.lanes}_v{self.vec}"
        fast = "_fast" if self.fast_dequant else ""
        unroll = "uk" if self.unroll_k else f"u{self.unroll}"
        h2 = f"_h{self.hfma2}" if self.hfma2 else ""
        return f"r{self.rows}_g{self.groups}_{lanes}_{unroll}{fast}{h2}"


@dataclass(frozen=True)
class PrefetchGemvTiles:
    """The decode GEMVs that load their weights before they wait (``prefetch_gemv_cuda``):
    ``warps`` a block (a warp an output row), at most ``max_blocks`` blocks (taller weights take
    several passes of the grid); ``run`` products per fp16 partial sum of the INT4 dot
    product."""

    warps: int = 8
    max_blocks: int = 1024
    run: int = 16


@dataclass(frozen=True)
class NormGemvTiles:
    """The add + RMSNorm + INT4 GEMV kernel (``norm_gemv_cuda.add_norm_gemv_q4``): ``blocks``
    per token of ``warps`` warps (a warp per output); ``run`` products per fp16 partial sum of
    the INT4 dot product."""

    warps: int = 8
    blocks: int = 264
    run: int = 16

    @property
    def name(self) -> str:
        return f"w{self.warps}_b{self.blocks}_h{self.run}"


@dataclass(frozen=True)
class NormRouterTiles:
    """The add + RMSNorm + router logits kernel (``norm_gemv_cuda.add_norm_router``): ``warps``
    a block, a warp per expert; a lane loads ``preload`` chunks of its gate row (32 floats
    each) into registers before the PDL wait, the rest as it multiplies (None: all of them)."""

    warps: int = 4
    preload: int | None = None

    @property
    def name(self) -> str:
        return f"w{self.warps}" + ("" if self.preload is None else f"_p{self.preload}")


@dataclass(frozen=True)
class GateUpTiles:
    """The MoE decode gate/up kernel (``moe_decode_cuda``): ``blocks`` per token of ``warps``
    warps; each warp takes every ``blocks * warps``-th output (a warp per output, two in
    flight); ``run`` products per fp16 partial sum."""

    warps: int
    blocks: int
    run: int = 16
    min_blocks: int = 0  # __launch_bounds__ blocks an SM (caps the registers), 0: none

    @property
    def name(self) -> str:
        bound = f"_m{self.min_blocks}" if self.min_blocks else ""
        return f"w{self.warps}_b{self.blocks}_h{self.run}{bound}"


@dataclass(frozen=True)
class DecodeTiles:
    """The MoE decode down kernel (``moe_decode_cuda``): ``warps`` per block, ``lanes`` per
    output (a power of two <= 32), ``rows`` outputs per group of lanes, ``run`` products per
    fp16 partial sum."""

    warps: int
    lanes: int
    rows: int
    run: int = 16
    min_blocks: int = 0  # __launch_bounds__ blocks an SM (caps the registers), 0: none

    @property
    def outputs_per_block(self) -> int:
        return self.warps * (32 // self.lanes) * self.rows

    @property
    def name(self) -> str:
        bound = f"_m{self.min_blocks}" if self.min_blocks else ""
        return f"w{self.warps}_l{self.lanes}_r{self.rows}_h{self.run}{bound}"


# ---------------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------------

# the split-KV MLA decode kernel's tiles, tuned on sm_90 at V2-Lite's shapes (the table's
# entries for other shapes differ from it in a field or two)
_MLA_ATTENTION = MLAAttentionTiles(
    stages=3,
    min_pages_per_split=2,
    long_min_pages=4,
    long_pages=128,
    max_split=256,
    # 256: at most one wave of 2 blocks an SM, and one split a row from 256 rows on (no merge):
    # 134 against 230 us a layer at 256 x 1K (528: 3 splits a row, 2.9 waves, a merge of 32,768
    # blocks); batch 1 keeps its 256 splits (schedules/results/mla_attention.md, "Splits at
    # large batches")
    target_blocks=256,
    merge_cols=64,
)

TABLE: dict[str, dict[TileKey, Any]] = {
    # -- MLA attention, prologue, append, prefill attention -----------------------------------
    # Tuned on sm_90 at the V2-Lite shapes (schedules/results/); used for every architecture
    # and shape but where an entry for the shape says otherwise.
    "mla_attention": {
        TileKey(): _MLA_ATTENTION,
        # V2-Lite's heads over an FP8 cache: 2 pages a loop step in a ring of 4 (batch 1, TPOT
        # 1.456 / 3.354 ms at 4K / 128K against 1.616 / 3.499 with 1 page and 3 stages;
        # schedules/results/mla_attention.md, "Pages a step")
        TileKey(ANY, (16, 512, 64, "e4m3")): replace(_MLA_ATTENTION, stages=4, pages_per_step=2),
        # ... on sm_90: the wgmma block, one block an SM, one wave of splits (split kernel at
        # batch 1, 128K: 48.3 against 70.5 us for the pipelined block, 54.7 for the wgmma block
        # without producer warpgroups; schedules/results/mla_wgmma.md)
        TileKey("sm_90", (16, 512, 64, "e4m3")): replace(
            _MLA_ATTENTION,
            block="wgmma",
            pages_per_step=4,
            stages=8,
            target_blocks=132,
            max_split=132,
        ),  # fmt: skip
        # V2 (236B): 128 heads, 8 split blocks of 16 heads for each (row, split), and
        # target_blocks counts one head group's: 66 keeps 528 split blocks a grid (V2-Lite's
        # target before it went to 256), what V2's figures were measured with
        TileKey(ANY, (128, 512, 64, "float16")): replace(_MLA_ATTENTION, target_blocks=66),
    },
    # not measured yet (schedules/results/mla_extend.md): 3 stages fit 227 KB at V2-Lite's
    # shapes; from 512 rows a sequence the row-tiled grid is one wave (132 SMs, 4 rows a block)
    "mla_extend": {TileKey(): MLAExtendTiles(stages=3, min_rows=512)},
    "mla_prologue": {TileKey(): MLAPrologueTiles(cols=64, threads=128)},
    "prefill_attention": {TileKey(): PrefillAttentionTiles(block_m=64, block_n=32)},
    # -- MoE decode / grouped GEMMs, decode GEMVs, norm + GEMV --------------------------------
    # decode_gemv_cuda, by class of shape (decode_gemv_cuda.shape_class; kernel times in us on
    # V2-Lite's shapes against the best scalar fp32 configuration, from
    # schedules/results/decode_kernels.md); ANY: the schedule for every other kernel it takes
    "decode_gemv": {
        TileKey(): GemvConfig(),
        # the routed experts (6 x 2816 x 2048, 6 x 2048 x 1408): 10.16 / 6.06 us vs 11.84 / 7.62
        TileKey(ANY, "routed"): GemvConfig(2, 4, 16, unroll_k=True, fast_dequant=True, hfma2=16),
        # lm_head (102400 x 2048): 30.0 vs 53.1 us
        TileKey(ANY, "vocab"): GemvConfig(4, 4, 16, unroll_k=True, fast_dequant=True, hfma2=16),
        # kv_a (576), the router (64): 64 lanes an output, 2.20 / 2.26 us
        TileKey(ANY, "skinny"): GemvConfig(1, 2, 64, unroll_k=True, fast_dequant=True),
        # the shared experts' down (K = 2816): 3.66 vs 4.17 us
        TileKey(ANY, "long_k"): GemvConfig(2, 4, 32, unroll_k=True, fast_dequant=True, hfma2=8),
        # q_proj, o_proj, the shared gate_up: 3.36 / 3.13 / 4.11 vs 3.45 / 2.98 / 5.35 us
        TileKey(ANY, "wide"): GemvConfig(2, 4, 32, unroll_k=True, fast_dequant=True, hfma2=16),
    },
    # prefetch_gemv_cuda (schedules/results/prefetch_gemv.md)
    "prefetch_gemv": {TileKey(): PrefetchGemvTiles(warps=8, max_blocks=1024, run=16)},
    # norm_gemv_cuda (schedules/results/decode_kernels.md): one wave of 264 blocks for the GEMV
    # (2 an SM: 76 registers a thread at V2-Lite's hidden 2048). Keyed by (hidden,): a lane holds
    # its chunks of the normed row in registers. Hidden 5120 (V2 236B), unmeasured: 167 registers
    # a thread (ptxas, sm_90a), so 8-warp blocks fit one an SM; 4-warp blocks keep one wave of
    # 264 blocks, 2 an SM
    "add_norm_gemv": {
        TileKey(): NormGemvTiles(warps=8, blocks=264, run=16),
        TileKey(ANY, (5120,)): NormGemvTiles(warps=4, blocks=264, run=16),
    },
    # the router kernel, keyed by (hidden,): a lane holds its chunks of the normed row and of its
    # gate row in registers. Hidden 5120 (V2 236B), unmeasured: the whole gate row (5 chunks, 160
    # registers) spills (255 registers, 320 bytes, ptxas sm_90a); 2 chunks before the wait, as
    # at V2-Lite's 2048, the other 3 after
    "add_norm_router": {
        TileKey(): NormRouterTiles(warps=4),
        TileKey(ANY, (5120,)): NormRouterTiles(warps=4, preload=2),
    },
    # moe_decode_cuda (schedules/results/moe_decode.md): one wave of 264 blocks (2 an SM; the
    # gate/up kernel takes 95 registers a thread at V2-Lite's hidden 2048). The gate/up kernel is
    # keyed by (hidden,): a lane holds its chunks of x in registers. Hidden 5120 (V2 236B),
    # unmeasured: 254 registers a thread (ptxas, sm_90a), so 8-warp blocks fit one an SM; 4-warp
    # blocks keep one wave of 264 blocks, 2 an SM
    "moe_decode_gate_up": {
        TileKey(): GateUpTiles(warps=8, blocks=264, run=16),
        TileKey(ANY, (5120,)): GateUpTiles(warps=4, blocks=264, run=16),
    },
    # the down kernel, keyed by (hidden,): at V2's 5120 (lab at V2's shapes, 1 / 4 tokens:
    # 12.87 / 52.62 us against 17.89 / 61.59 for 8 warps)
    "moe_decode_down": {
        TileKey(): DecodeTiles(warps=8, lanes=32, rows=2, run=8),
        TileKey(ANY, (5120,)): DecodeTiles(warps=4, lanes=32, rows=2, run=8),
    },
    # moe_mma_cuda (schedules/results/moe_grouped.md): 2 warps along the columns, 128 threads of
    # 32 x 64 warp tiles (1.98 ms for n = 4096; 4 warps of 32 x 32 tiles: 2.22 ms);
    # pairs of tiles from 256 tiles on (about 2K tokens at top-6 of 64): at n = 4096 1.80 ms for
    # V2-Lite's routed experts against 1.93 (one-tile blocks), at n = 512 0.44 against 0.32
    "moe_grouped_mma": {TileKey(): GroupedMmaTiles(warps_n=2, pair_from=256)},
    # moe_expert_mma_cuda (schedules/results/moe_decode.md): items of 64 rows for gate/up, 128
    # for down, a 16-row tile a warp (no K split); runs of 256 inputs for gate/up (a row's lanes
    # read 128 contiguous bytes; runs of 64 take 24 % longer) and two runs in flight for
    # down, which also wants more warps an SM (8 a block, 528 blocks): at batch 16 74.9 + 65.2 us
    # a layer against 98.4 + 109.7. Items of one tile split 4 ways among the warps were slower
    # a plan of 256 tokens (a decode step of up to 256 sequences reads each selected expert
    # once) and chunks of 16 pairs: in batch_decode_gemm at 64 / 128 / 256 sequences 5,732 /
    # 8,534 / 11,146 tok/s against 5,839 / 7,628 / 9,578 with chunks of 8 and 4,048 / 6,854 /
    # 10,013 with 32 (schedules/results/moe_decode.md, "Plans of 256 tokens")
    "moe_expert_mma_gate_up": {
        TileKey(): MmaTiles(warps=4, blocks=396, rows=64, run=256, tokens=256, chunk=16)
    },
    "moe_expert_mma_down": {
        TileKey(): MmaTiles(warps=8, blocks=528, rows=128, depth=2, tokens=256, chunk=16)
    },
    # batch_decode_gemm's MoE experts: the expert-major kernels above, against the grouped GEMMs
    # (3,862 / 6,909 / 11,468 tok/s at 64 / 128 / 256 sequences; moe_decode.md)
    "decode_gemm": {TileKey(): DecodeGemmTiles(moe="expert_major")},
    # moe_swap_cuda (schedules/results/moe_swap.md): tiles of 32 tokens, weights 2 steps ahead,
    # one warpgroup a block: at 256 tokens of V2-Lite 124 + 65 us a layer (gate/up + down);
    # 4 steps ahead 133 + 77, two warpgroups 133 + 77, tiles of 16 172 + 105
    "moe_swap": {TileKey(): SwapTiles(tokens=32, stages=4, ahead=2, warpgroups=1)},
}


def tuned(kernel: str, arch: str | None = None, shape: Any = ANY) -> Any:
    """The tuned parameters of ``kernel`` for ``arch`` and ``shape`` (see the module docstring).

    Raises ``KeyError`` naming the kernel when the table has no entry that applies."""
    entries = TABLE.get(kernel)
    if entries is None:
        raise KeyError(f"no tuned parameters for kernel {kernel!r}")
    arch = arch or ANY
    for key in (TileKey(arch, shape), TileKey(arch, ANY), TileKey(ANY, shape), TileKey(ANY, ANY)):
        if key in entries:
            return entries[key]
    raise KeyError(f"no tuned parameters for kernel {kernel!r} at arch {arch!r}, shape {shape!r}")

"""A split-KV (flash-decoding) MLA attention kernel over the paged latent cache, for CUDA.

TVM 0.27 has no MLA decode kernel: ``cross_attention`` runs its paged *prefill* kernel
``batch_prefill_paged_kv_mla`` with one query row, i.e. one thread block per sequence, which
takes milliseconds per layer at a 4K context (schedules/results/mla_attention.md). This kernel
has the same ABI (the ``TIRPagedPrefillFunc::MLA`` slot of
``vm.builtin.paged_attention_kv_cache_create``)::

    f(q[total, H, L+R], qo_indptr[b+1] int32, pages[num_pages, 16, L+R], page_indptr[b+1] int32,
      page_indices[nnz] int32, length_info[b] int32 (last page length),
      out[total, H, L] , lse[total, H] float32 (base 2), causal: int32, sm_scale: float32)

with the conventions of :mod:`dsv2_mlc.schedules.mla_cpu` (``lse`` in base 2, rows that see no
key get ``out = 0`` and ``lse = -inf``, ``causal=1`` lets query ``r`` of a ``q_len``-row chunk see
the KV positions ``< kv_len - q_len + r + 1``). ``L`` is ``kv_lora_rank`` (512), ``R`` the rope
width (64); the page size is 16 (as TVM's CUDA kernels and the C++ cache use). The tile sizes
come from :data:`~.tiles.TABLE` (``"mla_attention"``, :class:`~.tiles.MLAAttentionTiles`).

Design (one PrimFunc, two kernels):

1. **Split kernel**, grid ``(total * smax, H / HG)``, 256 threads (512 for the wgmma block). A
   block owns one query row, a group of ``HG = min(H, 16)`` heads and a contiguous range of the
   row's pages (split ``s`` of ``nsplit``). All heads of a row attend to the *same* latent rows,
   so the block loads each page (16 tokens x 576 fp16 = 18 KB) into shared memory **once** and
   uses it for all its heads.
   Two block codes:

   * **Pipelined tensor-core block** (float16, 16 heads a block, ``(L + R) % 16 == 0``,
     ``L % 64 == 0``: DeepSeek-V2's shapes): one CUDA device function
     (:func:`~.mla_cuda_helpers.pipe_source`; the PrimFunc keeps the page-table preamble). It
     walks its pages with a ring of ``stages`` shared page buffers: the first ``stages - 1``
     pages go out as ``cp.async`` 16-byte copies (one commit group each, rows past the visible
     length zero-filled), then the Q fragments (``mma.sync.m16n8k16`` A operands, in registers
     for the whole block) are loaded while they fly; per page: ``cp.async.wait_group(stages -
     2)`` + barrier, issue page ``i + stages - 1`` into the buffer page ``i - 1`` used, QK^T
     with K fragments by ``ldmatrix.x4``, the online softmax (fp32, base 2, one head per 16
     lanes, warp-shuffle max/sum), PV with V fragments by ``ldmatrix.x4.trans`` (3 barriers a
     page). Shared memory: ``stages * 18.7 KB`` + 9 KB (past 48 KB ``shared.dyn``, which TVM's
     launcher opts in). With ``min_pages_per_split >= stages - 1`` every page of a split is in
     flight at once. With the tile ``pages_per_step = G > 1`` the block takes ``G`` pages a
     step (a ring of ``stages / G`` slots of ``G`` pages; 3 barriers and one cross-warp score
     reduction per ``16 G`` tokens, ``2 G`` score n-tiles and ``G`` PV k-steps a warp), and a
     split's page count is rounded up to a multiple of ``G`` (a row's last split may end in a
     part-filled group: its pages past the split are zero-filled and masked).
   * **SIMT block** (other dtypes and head counts): Q (HG x 576) stays in shared memory; per
     page: scores ``S[HG heads, 16 tokens]`` (each thread a 2x2 head/token register tile over a
     share of the 576 dims, partial sums reduced through shared memory), an online-softmax
     update (fp32, base 2), then ``O[HG, 512] += P @ V`` with ``V = page[:, :512]`` (fp32
     accumulators in registers). Shared-memory rows are padded to ``L+R+8`` halves so the column
     reads of 8 rows hit 8 different bank groups and the rows stay 16-byte aligned.

   * **FP8 cache** (``kv_scale`` given; :mod:`~.kv_fp8`'s storage: ``q``/``out``/``lse`` as
     ``kH`` pseudo-heads, pages of ``L / k + R`` slots, the first ``L / k`` holding ``k`` e4m3
     latent bytes each, then the rope values): float16 slots, 16 heads a block, ``L % 128 ==
     0`` and ``R % 16 == 0`` (V2-Lite, V2): the pipelined tensor-core block over raw rows,
     each page decoded in shared memory to the float16 page it reads (``pipe_source(kscale=)``),
     or where the tile says ``block="wgmma"`` (V2-Lite on sm_90) the block of
     :mod:`~.mla_wgmma_cuda` (64 tokens a step, producer warpgroups converting the rows into
     two key tiles, scores on ``wgmma``); otherwise the SIMT block,
     whose page load reads 16-byte slot vectors and writes the latent bytes decoded (shifts
     and masks, ``value / 256`` as float16) and the rope values as they are into the same
     shared rows. Both keep the score sums of the latent part and the rope
     part apart, ``256 * kv_scale`` multiplying the former, and the output (or the partial
     outputs). The float16 kernel's TIR is unchanged (the FP8 code is chosen in Python while
     the script is built).

2. **Merge kernel**, grid ``total * H * (L / merge_cols)``, 256 threads: combines the ``nsplit``
   partial states ``(o_s, lse_s)`` of a row/head from a float32 workspace
   (``TVMBackendAllocWorkspace``, pooled by the runtime): ``lse = m + log2(sum 2^(lse_s - m))``,
   ``o = sum 2^(lse_s - lse) o_s``. The split lse go to shared memory, every warp reduces their
   max/sum by shuffles, 16 split lanes x 16 column lanes read the partial outputs (float4, 4
   splits in flight per thread), a shared-memory sum finishes. With ``nsplit == 1`` the split
   kernel writes ``out``/``lse`` itself and the merge kernel returns at once.

**Before the PDL wait** (the split kernel calls the wait itself, after its page-table preamble,
and releases its dependents right after it, as the hand decode kernels do): a split block reads
its page tables (the runtime writes them, no kernel). The pipelined block then copies the pages
of its split whose tokens are all older than the row's new tokens into its ring and asks L2 for
the split's other pages (``cp.async.bulk.prefetch``), then waits. This relies on what the cache
does in a step: it appends each sequence's ``q_len`` new tokens (rows ``kv_len - q_len`` on),
then calls this kernel, so the append that precedes this kernel writes only those rows. A
sequence forked mid-page gets a copy of the partial page (the cache's ``f_copy_single_page``),
so the pages it shares are full, and no append writes them. Behind
:mod:`~.mla_append_cuda`'s append, which releases first, this preamble overlaps the MLA
prologue.

The grid provides ``smax = clamp(ceil(target_blocks / total), 1, max_split)`` splits per row; a
row uses ``pps`` pages per split (:func:`split_pages`) and ``nsplit = ceil(visible_pages /
pps)`` splits, read from its page table on the device (``ws_n`` tells the merge), and the blocks
past it do nothing. So the launch configuration depends on the number of rows only, not on the
context length: a captured CUDA graph of a decode step stays valid while the sequence grows
(:mod:`dsv2_mlc.runtime.cuda_graph`). Multi-row queries run one block per row, each reading the
row's whole prefix; on CUDA long extends go to the row-tiled kernel instead
(:mod:`~.mla_extend_cuda`).
"""

import math

from tvm import tirx
from tvm.script import tirx as T

from ..errors import Dsv2Error, UsageError
from .kv_fp8 import e4m3_byte_f16, fp8_cache_dims, read_scale, slot_values
from .mla_cuda_helpers import (
    WAIT_RELEASE,
    pipe_shared_halves,
    pipe_source,
    prefetch_source,
    wait_release_source,
)
from .mla_paging import find_sequence, kv_length, visible_length
from .mla_wgmma_cuda import THREADS as WGMMA_THREADS
from .mla_wgmma_cuda import split_block
from .tiles import MLAAttentionTiles, tuned

__all__ = [
    "MLA_CUDA_PAGE_SIZE",
    "build_mla_attention",
    "mla_attention_cuda",
    "mla_attention_cuda_supports",
    "split_pages",
]

MLA_CUDA_PAGE_SIZE = 16
_LOG2E = math.log2(math.e)
_HEADS_PER_BLOCK = 16  # at most; the pipelined block's only shape
_THREADS = 256  # of a split block (8 warps) and of a merge block
_LOAD_BYTES = 16  # one vector load per thread and step
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_MAX_SHARED_BYTES = 49152  # static shared memory of one block (no opt-in)
_MAX_DYN_SHARED_BYTES = 232448  # sm_90 opt-in limit of one block (227 KB)
_MERGE_UNROLL = 4  # splits a merge thread has in flight


def split_pages(vis_pages, smax, min_pages: int, long_min_pages: int, long_pages: int):
    """Pages a split of a row of ``vis_pages`` visible pages takes (``PrimExpr``s or ints; an
    ``IntImm`` for constants): at least ``min_pages`` (``long_min_pages`` past ``long_pages``
    pages), and at most ``smax`` splits. Longer rows take longer splits because a split's fixed
    cost competes with the merge's, which grows with the splits
    (schedules/results/mla_attention.md)."""
    least = T.if_then_else(vis_pages > long_pages, long_min_pages, min_pages)
    want = T.max(T.min(T.floordiv(vis_pages + least - 1, least), smax), 1)
    return T.max(T.floordiv(vis_pages + want - 1, want), 1)


def mla_attention_cuda_supports(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str = "float16",
    kv_scale: float | None = None,
    arch: str | None = None,
) -> bool:
    """Whether :func:`mla_attention_cuda` handles these shapes with the tiles for ``arch`` (else
    it raises ``ValueError``)."""
    try:
        mla_attention_cuda(num_heads, latent_dim, rope_dim, dtype, kv_scale, arch)
    except Dsv2Error:  # (a tile table entry that no shape can use: not a shape to skip)
        raise
    except ValueError:
        return False
    return True


def mla_attention_cuda(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str = "float16",
    kv_scale: float | None = None,
    arch: str | None = None,
) -> tirx.PrimFunc:
    """The split-KV MLA attention PrimFunc (module docstring) for ``num_heads`` query heads of
    ``latent_dim + rope_dim`` values, with the tiles of :data:`~.tiles.TABLE` for ``arch`` (e.g.
    ``"sm_90"``; None: the entries for every architecture). Raises ``ValueError`` for shapes it
    does not handle (the cache then keeps TVM's kernel). ``kv_scale``: the FP8 (e4m3) cache of
    :mod:`~.kv_fp8` with that scale (module docstring)."""
    cache = dtype if kv_scale is None else "e4m3"  # the FP8 cache has entries of its own
    tiles = tuned("mla_attention", arch, shape=(num_heads, latent_dim, rope_dim, cache))
    return build_mla_attention(num_heads, latent_dim, rope_dim, dtype, tiles, kv_scale)


def build_mla_attention(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str,
    tiles: MLAAttentionTiles,
    kv_scale: float | None = None,
) -> tirx.PrimFunc:
    """:func:`mla_attention_cuda` with the tiles given (the lab sweeps them)."""
    if dtype not in _ELEM_BYTES:
        raise ValueError(f"mla_attention_cuda supports {sorted(_ELEM_BYTES)}, got {dtype}")
    stages = tiles.stages
    min_pps, long_min_pages, long_pages = (
        tiles.min_pages_per_split,
        tiles.long_min_pages,
        tiles.long_pages,
    )
    max_split, target_blocks = tiles.max_split, tiles.target_blocks
    if min(min_pps, long_min_pages, max_split, target_blocks) < 1 or long_pages < 0:
        raise ValueError(
            "min_pages_per_split, long_min_pages, max_split and target_blocks must be >= 1, "
            "long_pages >= 0"
        )
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    G = tiles.pages_per_step
    if not 1 <= G <= 4 or stages % G or stages < 2 * G:
        raise UsageError(
            f"mla_attention tiles: pages_per_step={G} with stages={stages}; pages_per_step must "
            "be 1 to 4 and stages a multiple of it, at least 2 * pages_per_step (a ring of at "
            "least 2 slots of pages_per_step pages): fix the entry in schedules/tiles.py"
        )
    _VEC = _LOAD_BYTES // _ELEM_BYTES[dtype]  # lanes of one 16-byte load
    H = num_heads
    DL = latent_dim
    D = latent_dim + rope_dim
    P = MLA_CUDA_PAGE_SIZE
    HG = min(H, _HEADS_PER_BLOCK)  # heads per block
    if H % HG or HG not in (2, 4, 8, 16):
        raise ValueError(
            f"mla_attention_cuda needs 2, 4, 8 or 16 heads or a multiple of 16, got {H}"
        )
    if D % _VEC:
        raise ValueError(f"mla_attention_cuda needs (latent + rope) % {_VEC} == 0, got {D}")
    NT = WGMMA_THREADS if tiles.block == "wgmma" else _THREADS
    MIN_BLOCKS = tiles.min_blocks
    # FP8 cache (kv_fp8's storage): K e4m3 bytes a dtype slot; the C++ cache passes q, out and
    # lse as KH pseudo-heads of QD, ODL values, the pages as rows of PD slots
    KV8 = kv_scale is not None
    K = slot_values(dtype) if KV8 else 1
    QH, QD, ODL = fp8_cache_dims(H, DL, rope_dim, dtype) if KV8 else (H, D, DL)
    PD = QD
    kscale = read_scale(kv_scale) if KV8 else 1.0
    if KV8 and (ODL % _VEC or rope_dim % _VEC):
        raise ValueError(
            f"an FP8 cache row of {ODL} latent and {rope_dim} rope {dtype} slots is not whole "
            "16-byte pieces of each"
        )
    DV8 = PD // _VEC  # 16-byte slot vectors of an FP8 row
    DLV8 = ODL // _VEC  # ... of its latent part (the rest: rope values)
    LOAD_ITERS8 = (P * DV8 + NT - 1) // NT
    SCORE_C = _LOG2E  # score scale besides sm_scale (FP8: kscale on the latent part's sums)
    SC_N = 8 if KV8 else 4  # score accumulators a thread (FP8: latent and rope parts apart)
    SLOT_T = getattr(T, dtype)  # the type of a cache slot
    # the pipelined tensor-core block: 16 heads of fp16, whole k-steps and 64-column n-tiles
    # (FP8: whole k-steps of each part in every warp's latent / rope k-steps)
    pipe = dtype == "float16" and HG == 16 and D % 16 == 0 and DL % 64 == 0
    pipe = pipe and (not KV8 or (DL % 128 == 0 and rope_dim % 16 == 0))
    HGH = HG // 2
    TT = HGH * 8  # SIMT score tile threads: (head pair, token pair) per thread
    DS = NT // TT  # the head dim is split over DS thread groups
    DCH = (D + DS - 1) // DS
    D_EXACT = DCH * DS == D
    HH = min(HG, 4)  # PV phase: head groups
    HPT = HG // HH  # heads per thread
    CG = NT // HH  # column groups
    CPT = (DL + CG - 1) // CG  # columns per thread
    C_EXACT = CPT * CG == DL
    SROW = D + _VEC  # padded shared row (halves): 16-byte aligned, bank-shifted
    DV = D // _VEC
    LOAD_ITERS = (P * DV + NT - 1) // NT
    LOAD_N = 0 if KV8 else LOAD_ITERS  # (FP8 pages load in their own loop)
    Q_ITERS = (HG * DV + NT - 1) // NT
    tag = f"{H}_{DL}_{D}"
    ptag = f"{tag}_s{stages}_e" + ("_fp8" if KV8 else "") + (f"_g{G}" if G > 1 else "")
    wg = tiles.block == "wgmma"  # the FP8 cache's wgmma block (mla_wgmma_cuda)
    if wg and not (pipe and KV8 and G == 4):
        raise UsageError(
            "mla_attention tiles: block='wgmma' is the FP8 cache's block for 16 float16 heads "
            "with pages_per_step=4: fix the entry in schedules/tiles.py"
        )
    if wg:
        pipe_src, SMEM_N = split_block(ptag, D, DL, kscale)
    elif pipe:
        kscale_pipe = kscale if KV8 else None
        pipe_src = pipe_source(ptag, D, DL, stages, kscale=kscale_pipe, pages_per_step=G)
        SMEM_N = pipe_shared_halves(D, stages, DL if KV8 else 0, G)
    else:
        pipe_src, SMEM_N = "", 1  # (one buffer)
    pf_tag, pf_bytes = (tag + "_fp8" if KV8 else tag), P * PD * _ELEM_BYTES[dtype]
    pf_name, pf_src = prefetch_source(pf_tag, pf_bytes, NT) if pipe else ("", "")
    wr_src = wait_release_source()
    SMEM_SCOPE = "shared.dyn" if SMEM_N * 2 > _MAX_SHARED_BYTES else "shared"
    if pipe:
        smem, smem_max = SMEM_N * 2, _MAX_DYN_SHARED_BYTES
    else:
        smem = (HG + P) * SROW * _ELEM_BYTES[dtype] + (DS + 2) * HG * P * 4 + 3 * HG * 4
        smem_max = _MAX_SHARED_BYTES
    if smem > smem_max and pipe and G > 1:
        raise UsageError(
            f"mla_attention tiles: pages_per_step={G} with stages={stages} needs {smem} bytes of "
            f"shared memory a block, more than {smem_max}: use fewer stages"
        )
    if smem > smem_max:
        raise ValueError(
            f"mla_attention_cuda needs {smem} bytes of shared memory for {dtype} rows of {D}, "
            f"more than {smem_max}"
        )
    # merge kernel
    MT = _THREADS
    MV = 4 if DL % 4 == 0 else 1  # float4 workspace reads
    MCOLS = min(tiles.merge_cols, DL)
    if MCOLS % MV or DL % MCOLS or MCOLS // MV > 32:
        MCOLS = DL if DL // MV <= 32 else 32 * MV
        if DL % MCOLS:
            MV, MCOLS = 1, DL if DL <= 32 else 32
    CL = MCOLS // MV  # column lanes
    SL = MT // CL  # split lanes
    NCH = (DL + MCOLS - 1) // MCOLS  # column chunks (blocks) per row and head
    MC_EXACT = NCH * MCOLS == DL
    SMX = max_split
    log2e = _LOG2E
    n_hg = H // HG
    neg_inf = -math.inf
    n_merge_blocks = NCH
    Q_SH = 1 if pipe else HG * SROW
    KV_N = 1 if pipe else P * SROW
    SP_N = 1 if pipe else DS
    SIMT_HP = 1 if pipe else HG * P
    LSE_SH = SMX
    RED_N = SL * MCOLS

    def max_splits(total_len):
        # Splits per row the grid and workspace provide for: depends on the row count only, so
        # one captured CUDA graph stays valid while the context grows (nothing else of the
        # launch configuration reads the page count).
        want = T.floordiv(target_blocks + total_len - 1, T.max(total_len, 1))
        return T.max(T.min(want, max_split), 1)

    def row_pps(vis_pages, smax):
        pps = split_pages(vis_pages, smax, min_pps, long_min_pages, long_pages)
        if G > 1 and pipe:  # whole groups of pages_per_step pages (a row's last split: a tail)
            return T.floordiv(pps + G - 1, G) * G
        return pps

    @T.prim_func(s_tir=True)
    def batch_mla_paged_attention_split_kv(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        length_info_elem_offset = T.int32()

        q = T.match_buffer(var_q, (total_len, QH, QD), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        # No elem_offset: the cache allocates each layer's pages on its own (offset 0), and
        # an unknown offset would stop the 16-byte vector loads (the runtime checks it).
        pages = T.match_buffer(var_pages, (max_num_pages, P, PD), dtype)
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        length_info = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset
        )
        output = T.match_buffer(var_output, (total_len, QH, ODL), dtype)
        lse = T.match_buffer(var_lse, (total_len, QH), "float32")

        ws_o = T.alloc_buffer(
            (
                T.if_then_else(
                    max_splits(total_len) > 1, total_len * max_splits(total_len) * H * DL, 1
                ),
            ),
            "float32",
            scope="global",
        )
        ws_lse = T.alloc_buffer((total_len * max_splits(total_len) * H,), "float32", scope="global")
        ws_n = T.alloc_buffer((total_len,), "int32", scope="global")  # splits used per row

        for bx in T.thread_binding(total_len * max_splits(total_len), thread="blockIdx.x"):
            for by in T.thread_binding(n_hg, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("split_attn"):
                        T.reads()
                        T.writes()
                        if MIN_BLOCKS > 0:
                            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_BLOCKS)
                        q_s = T.sblock_alloc_buffer((Q_SH,), dtype, scope="shared")
                        kv_s = T.sblock_alloc_buffer((KV_N,), dtype, scope="shared")
                        s_part = T.sblock_alloc_buffer((SP_N, HG, P), "float32", scope="shared")
                        smem = T.sblock_alloc_buffer((SMEM_N,), dtype, scope=SMEM_SCOPE)
                        s_s = T.sblock_alloc_buffer((SIMT_HP,), "float32", scope="shared")
                        p_s = T.sblock_alloc_buffer((SIMT_HP,), "float32", scope="shared")
                        m_s = T.sblock_alloc_buffer((HG,), "float32", scope="shared")
                        d_s = T.sblock_alloc_buffer((HG,), "float32", scope="shared")
                        r_s = T.sblock_alloc_buffer((HG,), "float32", scope="shared")
                        sc = T.sblock_alloc_buffer((SC_N,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((HPT * CPT,), "float32", scope="local")
                        lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        tmax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        pl = T.sblock_alloc_buffer((P,), "float32", scope="local")
                        psum = T.sblock_alloc_buffer((1,), "float32", scope="local")

                        smax: T.let[T.int32] = max_splits(total_len)
                        row: T.let[T.int32] = bx // smax
                        split: T.let[T.int32] = bx % smax
                        find_sequence(q_indptr, batch_size, row, lo, hi)
                        b: T.let[T.int32] = lo[0]
                        q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        page_begin: T.let[T.int32] = page_indptr[b]
                        num_pages: T.let[T.int32] = page_indptr[b + 1] - page_begin
                        kv_len: T.let[T.int32] = kv_length(num_pages, length_info[b], P)
                        n_vis: T.let[T.int32] = visible_length(
                            kv_len, q_len, row - q_indptr[b], causal
                        )
                        vis_pages: T.let[T.int32] = (n_vis + P - 1) // P
                        pps: T.let[T.int32] = row_pps(vis_pages, smax)
                        nsplit: T.let[T.int32] = T.max((vis_pages + pps - 1) // pps, 1)
                        pg_lo: T.let[T.int32] = T.min(split * pps, vis_pages)
                        pg_hi: T.let[T.int32] = T.min(pg_lo + pps, vis_pages)
                        h0: T.let[T.int32] = by * HG
                        # the split's leading pages older than the row's new tokens (those
                        # the KV append of this step writes), and how many of them the
                        # pipelined block copies before its wait
                        n_early: T.let[T.int32] = T.max(
                            T.min(T.floordiv(kv_len - q_len, P) - pg_lo, pg_hi - pg_lo), 0
                        )
                        n_pre: T.let[T.int32] = T.if_then_else(
                            split < nsplit, T.min(n_early, stages - G), 0
                        )
                        if pipe:
                            # this split's pages -> L2 (those it copies before its wait
                            # excepted; the pipelined block waits itself); an idle block
                            # waits as the others do
                            T.cuda.func_call(
                                pf_name,
                                T.address_of(pages[0, 0, 0]),
                                T.address_of(page_values[page_begin]),
                                pg_lo + n_pre,
                                pg_hi - pg_lo - n_pre,
                                tx,
                                source_code=pf_src,
                            )
                            if split >= nsplit:
                                T.cuda.func_call(WAIT_RELEASE, source_code=wr_src)
                        else:
                            # page tables only before the wait: the runtime writes them
                            T.cuda.func_call(WAIT_RELEASE, source_code=wr_src)

                        if pipe:
                            # The whole split block in CUDA (mla_cuda_helpers.pipe_source).
                            if split < nsplit:
                                T.cuda.func_call(
                                    f"mla_split_pipe_{ptag}",
                                    T.address_of(q[row, h0 * K, 0]),
                                    T.address_of(pages[0, 0, 0]),
                                    T.address_of(page_values[page_begin + pg_lo]),
                                    pg_hi - pg_lo,
                                    pg_lo * P,
                                    n_vis,
                                    sm_scale * log2e,
                                    T.if_then_else(nsplit == 1, 1, 0),
                                    T.address_of(output[row, h0 * K, 0]),
                                    T.address_of(lse[row, h0 * K]),
                                    ws_o.data,  # opaque: the workspaces keep their size
                                    ws_lse.data,
                                    bx * H + h0,
                                    T.address_of(smem[0]),
                                    T.address_of(smem[SMEM_N - 1]),
                                    tx,
                                    n_early,
                                    source_code=pipe_src,
                                )
                        else:
                            # Q rows of the head group -> shared (16-byte vectors).
                            for it in T.serial(Q_ITERS):
                                if it * NT + tx < HG * DV:
                                    qh: T.let[T.int32] = (it * NT + tx) // DV
                                    qv: T.let[T.int32] = (it * NT + tx) % DV
                                    if KV8:  # head h is pseudo-heads hK .. hK + K - 1
                                        for k in T.vectorized(_VEC):
                                            q_s[qh * SROW + qv * _VEC + k] = q[
                                                row,
                                                (h0 + qh) * K + qv * _VEC // QD,
                                                qv * _VEC % QD + k,
                                            ]
                                    else:
                                        for k in T.vectorized(_VEC):
                                            q_s[qh * SROW + qv * _VEC + k] = q[
                                                row, h0 + qh, qv * _VEC + k
                                            ]
                            if tx < HG:
                                m_s[tx] = T.float32(neg_inf)
                                d_s[tx] = T.float32(0)
                            for i in T.unroll(HPT * CPT):
                                acc[i] = T.float32(0)
                            T.tvm_storage_sync("shared")

                            for pg in T.serial(pg_hi - pg_lo):
                                page_id: T.let[T.int32] = page_values[page_begin + pg_lo + pg]
                                tok0: T.let[T.int32] = (pg_lo + pg) * P
                                # The page -> shared; rows past the visible length are zeroed.
                                if KV8:  # 16-byte slot vectors: latent bytes decoded
                                    # (value / 256) to dtype, rope values copied
                                    for it in T.serial(LOAD_ITERS8):
                                        if it * NT + tx < P * DV8:
                                            k8t: T.let[T.int32] = (it * NT + tx) // DV8
                                            k8v: T.let[T.int32] = (it * NT + tx) % DV8
                                            if k8v < DLV8:
                                                if tok0 + k8t < n_vis:
                                                    for k in T.unroll(_VEC):
                                                        slot: T.let[SLOT_T] = pages[
                                                            page_id, k8t, k8v * _VEC + k
                                                        ]
                                                        dst: T.let[T.int32] = (
                                                            k8t * SROW + (k8v * _VEC + k) * K
                                                        )
                                                        for i in T.unroll(K):
                                                            kv_s[dst + i] = T.cast(
                                                                e4m3_byte_f16(slot, i, dtype), dtype
                                                            )
                                                else:
                                                    for k in T.serial(_VEC * K):
                                                        kv_s[k8t * SROW + k8v * _VEC * K + k] = (
                                                            T.cast(0, dtype)
                                                        )
                                            elif tok0 + k8t < n_vis:
                                                for k in T.vectorized(_VEC):
                                                    kv_s[
                                                        k8t * SROW + DL + (k8v - DLV8) * _VEC + k
                                                    ] = pages[page_id, k8t, k8v * _VEC + k]
                                            else:
                                                for k in T.serial(_VEC):
                                                    kv_s[
                                                        k8t * SROW + DL + (k8v - DLV8) * _VEC + k
                                                    ] = T.cast(0, dtype)
                                for it in T.serial(LOAD_N):
                                    if it * NT + tx < P * DV:
                                        kt: T.let[T.int32] = (it * NT + tx) // DV
                                        kvv: T.let[T.int32] = (it * NT + tx) % DV
                                        if tok0 + kt < n_vis:
                                            for k in T.vectorized(_VEC):
                                                kv_s[kt * SROW + kvv * _VEC + k] = pages[
                                                    page_id, kt, kvv * _VEC + k
                                                ]
                                        else:
                                            for k in T.serial(_VEC):
                                                kv_s[kt * SROW + kvv * _VEC + k] = T.cast(0, dtype)
                                T.tvm_storage_sync("shared")

                                # Partial scores: (heads hp, hp + HG/2) x (tokens tp, tp + 8).
                                ds: T.let[T.int32] = tx // TT
                                hp: T.let[T.int32] = (tx % TT) // 8
                                tp: T.let[T.int32] = tx % 8
                                for i in T.unroll(SC_N):
                                    sc[i] = T.float32(0)
                                for kd in T.serial(DCH):
                                    dd: T.let[T.int32] = ds * DCH + kd
                                    if D_EXACT or dd < D:
                                        qa: T.let[T.float32] = T.cast(
                                            q_s[hp * SROW + dd], "float32"
                                        )
                                        qb: T.let[T.float32] = T.cast(
                                            q_s[(hp + HGH) * SROW + dd], "float32"
                                        )
                                        ka: T.let[T.float32] = T.cast(
                                            kv_s[tp * SROW + dd], "float32"
                                        )
                                        kb: T.let[T.float32] = T.cast(
                                            kv_s[(tp + 8) * SROW + dd], "float32"
                                        )
                                        if KV8 and dd >= DL:  # the rope part's, unscaled
                                            sc[4] = sc[4] + qa * ka
                                            sc[5] = sc[5] + qa * kb
                                            sc[6] = sc[6] + qb * ka
                                            sc[7] = sc[7] + qb * kb
                                        else:
                                            sc[0] = sc[0] + qa * ka
                                            sc[1] = sc[1] + qa * kb
                                            sc[2] = sc[2] + qb * ka
                                            sc[3] = sc[3] + qb * kb
                                if KV8:
                                    s_part[ds, hp, tp] = sc[0] * T.float32(kscale) + sc[4]
                                    s_part[ds, hp, tp + 8] = sc[1] * T.float32(kscale) + sc[5]
                                    s_part[ds, hp + HGH, tp] = sc[2] * T.float32(kscale) + sc[6]
                                    s_part[ds, hp + HGH, tp + 8] = sc[3] * T.float32(kscale) + sc[7]
                                else:
                                    s_part[ds, hp, tp] = sc[0]
                                    s_part[ds, hp, tp + 8] = sc[1]
                                    s_part[ds, hp + HGH, tp] = sc[2]
                                    s_part[ds, hp + HGH, tp + 8] = sc[3]
                                T.tvm_storage_sync("shared")

                                if tx < HG * P:
                                    sh: T.let[T.int32] = tx // P
                                    st: T.let[T.int32] = tx % P
                                    psum[0] = T.float32(0)
                                    for k in T.unroll(DS):
                                        psum[0] = psum[0] + s_part[k, sh, st]
                                    s_s[sh * P + st] = T.if_then_else(
                                        tok0 + st < n_vis,
                                        psum[0] * sm_scale * SCORE_C,
                                        T.float32(neg_inf),
                                    )
                                T.tvm_storage_sync("shared")

                                # Online softmax, one thread per head.
                                if tx < HG:
                                    m_old: T.let[T.float32] = m_s[tx]
                                    tmax[0] = m_old
                                    for t in T.unroll(P):
                                        pl[t] = s_s[tx * P + t]
                                        tmax[0] = T.max(tmax[0], pl[t])
                                    psum[0] = T.float32(0)
                                    for t in T.unroll(P):
                                        pl[t] = T.if_then_else(
                                            tmax[0] == T.float32(neg_inf),
                                            T.float32(0),
                                            T.exp2(pl[t] - tmax[0]),
                                        )
                                        psum[0] = psum[0] + pl[t]
                                        p_s[tx * P + t] = pl[t]
                                    r_s[tx] = T.if_then_else(
                                        m_old == T.float32(neg_inf),
                                        T.float32(0),
                                        T.exp2(m_old - tmax[0]),
                                    )
                                    d_s[tx] = (
                                        d_s[tx]
                                        * T.if_then_else(
                                            m_old == T.float32(neg_inf),
                                            T.float32(0),
                                            T.exp2(m_old - tmax[0]),
                                        )
                                        + psum[0]
                                    )
                                    m_s[tx] = tmax[0]
                                T.tvm_storage_sync("shared")

                                # O[heads, cols] = O * rescale + P @ V.
                                hh: T.let[T.int32] = tx // CG
                                cg: T.let[T.int32] = tx % CG
                                for i in T.unroll(HPT):
                                    for j in T.unroll(CPT):
                                        acc[i * CPT + j] = acc[i * CPT + j] * r_s[hh * HPT + i]
                                for t in T.serial(P):
                                    for j in T.unroll(CPT):
                                        if C_EXACT or cg + j * CG < DL:
                                            vv: T.let[T.float32] = T.cast(
                                                kv_s[t * SROW + cg + j * CG], "float32"
                                            )
                                            for i in T.unroll(HPT):
                                                acc[i * CPT + j] = (
                                                    acc[i * CPT + j]
                                                    + p_s[(hh * HPT + i) * P + t] * vv
                                                )
                                T.tvm_storage_sync("shared")

                            # Epilogue: the final state (nsplit == 1) or a partial one.
                            ho: T.let[T.int32] = tx // CG
                            co: T.let[T.int32] = tx % CG
                            for i in T.unroll(HPT):
                                hl: T.let[T.int32] = ho * HPT + i
                                dsum: T.let[T.float32] = d_s[hl]
                                for j in T.unroll(CPT):
                                    if C_EXACT or co + j * CG < DL:
                                        val: T.let[T.float32] = T.if_then_else(
                                            dsum > T.float32(0),
                                            acc[i * CPT + j] / dsum,
                                            T.float32(0),
                                        )
                                        if KV8:
                                            oc: T.let[T.int32] = co + j * CG
                                            if nsplit == 1 and split == 0:
                                                output[row, (h0 + hl) * K + oc // ODL, oc % ODL] = (
                                                    T.cast(val * T.float32(kscale), dtype)
                                                )
                                            elif split < nsplit:
                                                ws_o[((bx * H) + h0 + hl) * DL + oc] = (
                                                    val * T.float32(kscale)
                                                )
                                        elif nsplit == 1 and split == 0:
                                            output[row, h0 + hl, co + j * CG] = T.cast(val, dtype)
                                        elif split < nsplit:
                                            ws_o[((bx * H) + h0 + hl) * DL + co + j * CG] = val
                            if tx < HG:
                                lse_v: T.let[T.float32] = T.if_then_else(
                                    d_s[tx] > T.float32(0),
                                    m_s[tx] + T.log2(d_s[tx]),
                                    T.float32(neg_inf),
                                )
                                if KV8:
                                    if nsplit == 1 and split == 0:
                                        for i in T.unroll(K):
                                            lse[row, (h0 + tx) * K + i] = lse_v
                                    elif split < nsplit:
                                        ws_lse[bx * H + h0 + tx] = lse_v
                                elif nsplit == 1 and split == 0:
                                    lse[row, h0 + tx] = lse_v
                                elif split < nsplit:
                                    ws_lse[bx * H + h0 + tx] = lse_v
                        # the splits the row uses, for the merge (after every path's wait)
                        if split == 0 and by == 0 and tx == 0:
                            ws_n[row] = nsplit

        # one split a row (the grid's, so every row's): nothing to merge, one idle block
        # instead of total * H * NCH blocks that return at once (21 us at 256 rows)
        merge_grid = T.meta_var(
            T.if_then_else(max_splits(total_len) > 1, total_len * H * n_merge_blocks, 1)
        )
        for mbx in T.thread_binding(merge_grid, thread="blockIdx.x"):
            for mtx in T.thread_binding(MT, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    mmax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    wsum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    vacc = T.sblock_alloc_buffer((MV,), "float32", scope="local")
                    vld = T.sblock_alloc_buffer((MV,), "float32", scope="local")
                    csum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    lse_sh = T.sblock_alloc_buffer((LSE_SH,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((RED_N,), "float32", scope="shared")
                    mrow: T.let[T.int32] = mbx // (H * n_merge_blocks)
                    msplit: T.let[T.int32] = ws_n[mrow]
                    mmax_s: T.let[T.int32] = max_splits(total_len)
                    mh: T.let[T.int32] = (mbx // n_merge_blocks) % H
                    mch: T.let[T.int32] = mbx % n_merge_blocks
                    # Block (row, head, column chunk); thread (split lane, column lane).
                    if msplit > 1:
                        for i in T.serial((SMX + MT - 1) // MT):
                            if i * MT + mtx < msplit:
                                lse_sh[i * MT + mtx] = ws_lse[
                                    (mrow * mmax_s + i * MT + mtx) * H + mh
                                ]
                        T.tvm_storage_sync("shared")
                        mlane: T.let[T.int32] = mtx % 32
                        mmax[0] = T.float32(neg_inf)
                        for i in T.serial((SMX + 31) // 32):
                            if i * 32 + mlane < msplit:
                                mmax[0] = T.max(mmax[0], lse_sh[i * 32 + mlane])
                        gmax: T.let[T.float32] = T.cuda.warp_reduce(mmax[0], "max", 32)
                        wsum[0] = T.float32(0)
                        if gmax > T.float32(neg_inf):
                            for i in T.serial((SMX + 31) // 32):
                                if i * 32 + mlane < msplit:
                                    wsum[0] = wsum[0] + T.exp2(lse_sh[i * 32 + mlane] - gmax)
                        gsum: T.let[T.float32] = T.cuda.warp_reduce(wsum[0], "sum", 32)
                        msl: T.let[T.int32] = mtx // CL
                        mcl: T.let[T.int32] = mtx % CL
                        mcol: T.let[T.int32] = mch * MCOLS + mcl * MV
                        for v in T.unroll(MV):
                            vacc[v] = T.float32(0)
                        if gmax > T.float32(neg_inf) and (MC_EXACT or mcol < DL):
                            for so in T.serial(
                                (msplit + SL * _MERGE_UNROLL - 1) // (SL * _MERGE_UNROLL)
                            ):
                                for u in T.unroll(_MERGE_UNROLL):
                                    ms: T.let[T.int32] = (so * _MERGE_UNROLL + u) * SL + msl
                                    if ms < msplit:
                                        mw: T.let[T.float32] = T.exp2(lse_sh[ms] - gmax)
                                        for v in T.vectorized(MV):
                                            vld[v] = T.Cast(
                                                "float32",
                                                ws_o[
                                                    ((mrow * mmax_s + ms) * H + mh) * DL + mcol + v
                                                ],
                                            )
                                        for v in T.unroll(MV):
                                            vacc[v] = vacc[v] + mw * vld[v]
                        for v in T.unroll(MV):
                            red[msl * MCOLS + mcl * MV + v] = vacc[v]
                        T.tvm_storage_sync("shared")
                        for i in T.serial((MCOLS + MT - 1) // MT):
                            if i * MT + mtx < MCOLS and (
                                MC_EXACT or mch * MCOLS + i * MT + mtx < DL
                            ):
                                csum[0] = T.float32(0)
                                for k in T.serial(SL):
                                    csum[0] = csum[0] + red[k * MCOLS + i * MT + mtx]
                                if KV8:
                                    mc: T.let[T.int32] = mch * MCOLS + i * MT + mtx
                                    output[mrow, mh * K + mc // ODL, mc % ODL] = T.cast(
                                        T.if_then_else(
                                            gsum > T.float32(0), csum[0] / gsum, T.float32(0)
                                        ),
                                        dtype,
                                    )
                                else:
                                    output[mrow, mh, mch * MCOLS + i * MT + mtx] = T.cast(
                                        T.if_then_else(
                                            gsum > T.float32(0), csum[0] / gsum, T.float32(0)
                                        ),
                                        dtype,
                                    )
                        if KV8:
                            if mch == 0 and mtx == 0:
                                for i in T.unroll(K):
                                    lse[mrow, mh * K + i] = T.if_then_else(
                                        gsum > T.float32(0),
                                        gmax + T.log2(gsum),
                                        T.float32(neg_inf),
                                    )
                        elif mch == 0 and mtx == 0:
                            lse[mrow, mh] = T.if_then_else(
                                gsum > T.float32(0),
                                gmax + T.log2(gsum),
                                T.float32(neg_inf),
                            )

    return batch_mla_paged_attention_split_kv

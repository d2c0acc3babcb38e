"""A split-KV (flash-decoding) MLA attention kernel over the paged latent cache, for CUDA.

TVM 0.27 has no MLA decode kernel: ``cross_attention`` runs its paged *prefill* kernel
``batch_prefill_paged_kv_mla`` with one query row, i.e. one thread block per sequence, which
takes 4.96 ms per layer at 4K context on an H200 (docs/benchmarks.md). This kernel has the same
ABI (the ``TIRPagedPrefillFunc::MLA`` slot of ``vm.builtin.paged_attention_kv_cache_create``)::

    f(q[total, H, L+R], qo_indptr[b+1] int32, pages[num_pages, 16, L+R], page_indptr[b+1] int32,
      page_indices[nnz] int32, length_info[b] int32 (last page length),
      out[total, H, L] , lse[total, H] float32 (base 2), causal: int32, sm_scale: float32)

with the conventions of :mod:`dsv2_mlc.schedules.mla_cpu` (``lse`` in base 2, rows that see no
key get ``out = 0`` and ``lse = -inf``, ``causal=1`` lets query ``r`` of a ``q_len``-row chunk see
the KV positions ``< kv_len - q_len + r + 1``). ``L`` is ``kv_lora_rank`` (512), ``R`` the rope
width (64); the page size is 16 (as TVM's CUDA kernels and the C++ cache use).

Design (one PrimFunc, two kernels):

1. **Split kernel**, grid ``(total * smax, H / HG)``, 256 threads. A block owns one query row,
   a group of ``HG = min(H, 16)`` heads and a contiguous range of the row's pages (split ``s`` of
   ``nsplit``). All heads of a row attend to the *same* latent rows, so the block loads each page
   (16 tokens x 576 fp16 = 18 KB, 16-byte vector loads) into shared memory **once** and uses it
   for all 16 heads; Q (16 x 576 fp16) stays in shared memory for the whole block. Per page:
   scores ``S[16 heads, 16 tokens]`` (each thread a 2x2 head/token register tile over a quarter of
   the 576 dims, partial sums reduced through shared memory), an online-softmax update (fp32, base
   2), then ``O[16, 512] += P @ V`` with ``V = page[:, :512]`` (each thread 4 heads x 8 columns,
   32 fp32 accumulators in registers). Shared-memory rows are padded to ``L+R+8`` halves so the
   column reads of 8 rows hit 8 different bank groups and the rows stay 16-byte aligned.
2. **Merge kernel**, grid ``total * H``: combines the ``nsplit`` partial states ``(o_s, lse_s)``
   of a row/head from a float32 workspace (``TVMBackendAllocWorkspace``, pooled by the runtime):
   ``lse = m + log2(sum 2^(lse_s - m))``, ``o = sum 2^(lse_s - lse) o_s``. With ``nsplit == 1``
   the split kernel writes ``out``/``lse`` itself and the merge kernel returns at once.

**Tensor-core path (fp16, 16 heads per block; with ``stages=1``):** Q stays in registers as
``mma.sync.m16n8k16`` A fragments (each of the 8 warps holds its k-steps ``w, w + 8, ...`` of the
36), scores come from 16x8x16 MMAs against the shared page (partial sums of the 8 warps through
shared memory), the online softmax runs on all 256 threads (one head per 16 lanes, warp-shuffle
max/sum), P goes to shared as fp16 and ``O += P @ V`` is 8 MMAs per warp (64 columns each) with
the accumulators in registers (CUDA helpers passed as source through ``T.cuda.func_call``).

**Pipelined tensor-core path (``stages >= 2``; the default, 3 stages):** the split
block is one CUDA device function (:func:`~.mla_cuda_helpers.pipe_source`; the PrimFunc keeps the
page-table preamble). It walks its pages with a ring of ``stages`` shared page buffers: the
prologue issues the first ``stages - 1`` pages as ``cp.async`` 16-byte copies (one commit group
each, rows past the visible length zero-filled), then the Q fragments are loaded while they fly;
per page: ``cp.async.wait_group(stages - 2)`` + barrier, issue page ``i + stages - 1`` into the
buffer page ``i - 1`` used (its id read one page ahead), QK^T with K fragments by ``ldmatrix.x4``,
the same online softmax, PV with V fragments by ``ldmatrix.x4.trans`` (3 barriers a page, the
TIR path has 4). Shared memory: ``stages * 18.7 KB`` + 9 KB (2 stages: 46.5 KB static; more:
``shared.dyn``, which TVM's launcher opts in past 48 KB). With ``min_pages_per_split >=
stages - 1`` every page of a split is in flight at once. On the H200 (CUPTI, batch 1, V2-Lite;
schedules/results/mla_attention.md, third round) 3 stages with >= 2 pages per split take 7.4 /
9.6 / 21.3 us per layer at context 512 / 4K / 32K, against 9.7 / 17.3 / 37.4 for ``stages=1``
with 1 page per split (the previous default).

**Before the PDL wait (``release``, ``l2_prefetch``, ``early_pages``; all on):** a split block
reads its page tables (the runtime writes them, no kernel), copies the pages of its split whose
tokens are all older than the row's new tokens into its ring, asks L2 for the split's other
pages, then waits and releases. This relies on what the cache does in a step: it appends each
sequence's ``q_len`` new tokens (rows ``kv_len - q_len`` on), then calls this kernel. So the
append that precedes this kernel writes only those rows. A sequence forked mid-page gets a
copy of the partial page (the cache's ``f_copy_single_page``), so the pages it shares are full,
and no append writes them.

**Merge (default "parallel"):** grid ``total * H * (L / 64)``, 256 threads: the split lse go to
shared memory, every warp reduces their max/sum by shuffles, 16 split lanes x 16 column lanes
read the partial outputs (float4, 4 splits in flight per thread), a shared-memory sum finishes.
With ``merge_prefetch`` the lse of all ``smax`` slots are loaded together with ``ws_n`` (two
dependent global round trips instead of three; the slots past ``ws_n`` are ignored).

The grid provides ``smax = clamp(ceil(target_blocks / total), 1, max_split)`` splits per row
(defaults 528 and 256); a row uses ``pps = ceil(visible_pages / clamp(ceil(visible_pages /
m), 1, smax))`` pages per split, with ``m = min_pages_per_split`` (default 2) up to
``long_pages`` visible pages (default 128, 2K tokens) and ``long_min_pages`` past them (default
4), and ``nsplit = ceil(visible_pages / pps)`` splits, read from its page table on the device
(``ws_n`` tells the merge), and the blocks past it do nothing. So the launch configuration
depends on the number of rows only, not on the context length: a captured CUDA graph of a
decode step stays valid while the sequence grows (:mod:`dsv2_mlc.runtime.cuda_graph`).
Multi-row queries (chunked prefill / extend) run one block per row, each reading the row's whole
prefix (from L2 after the first): correct, but a prefill-style kernel that tiles rows would read
less (see schedules/results/mla_attention.md).

Bytes and FLOPs, V2-Lite (H=16, L=512, R=64), batch 1, 4K context, one layer: the pages are
``4096 * 576 * 2 B = 4.7 MB`` (at 3-4 TB/s about 1.5 us), the workspace ``64 * 16 * 512 * 4 B =
2 MB`` written and read once (L2), FLOPs ``2 * 16 * 4096 * (576 + 512) = 143 MFLOP`` (fp32 SIMT
on 132 SMs: a few us). The target is tens of microseconds per layer instead of 4.96 ms.
"""

import math

from tvm import tirx
from tvm.script import tirx as T

from .cuda_call import (
    GRID_WAIT,
    L2_PREFETCH,
    WAIT_THEN_RELEASE,
    grid_wait_source,
    l2_prefetch_source,
)
from .mla_cuda_helpers import PARTIAL_TYPES, mma_source, pipe_shared_halves, pipe_source
from .mla_paging import find_sequence, kv_length, visible_length

__all__ = ["MLA_CUDA_PAGE_SIZE", "mla_attention_cuda", "mla_attention_cuda_supports", "split_pages"]

MLA_CUDA_PAGE_SIZE = 16
_LOG2E = math.log2(math.e)
_MERGE_THREADS = 256
_LOAD_BYTES = 16  # one vector load per thread and step
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_MAX_SHARED_BYTES = 49152  # static shared memory of one block (no opt-in)
_MAX_DYN_SHARED_BYTES = 232448  # sm_90 opt-in limit of one block (227 KB)
_MERGE_UNROLL = 4  # splits a merge thread has in flight


def split_pages(vis_pages, smax, min_pages: int, long_min_pages: int, long_pages: int):
    """Pages a split of a row of ``vis_pages`` visible pages takes (``PrimExpr``s or ints; an
    ``IntImm`` for constants): at least ``min_pages`` (``long_min_pages`` past ``long_pages``
    pages), and at most ``smax`` splits. On the H200 (V2-Lite, batch 1; schedules/results/
    mla_attention.md, seventh round) 2 pages a split were fastest at 512 tokens (32 pages) and 4 at
    4K (256 pages): a split's fixed cost against the merge's, which grows with the splits."""
    least = T.if_then_else(vis_pages > long_pages, long_min_pages, min_pages)
    want = T.max(T.min(T.floordiv(vis_pages + least - 1, least), smax), 1)
    return T.max(T.floordiv(vis_pages + want - 1, want), 1)


def mla_attention_cuda_supports(
    num_heads: int, latent_dim: int, rope_dim: int, dtype: str = "float16"
) -> bool:
    """Whether :func:`mla_attention_cuda` handles these shapes (else it raises ``ValueError``)."""
    try:
        mla_attention_cuda(num_heads, latent_dim, rope_dim, dtype)
    except ValueError:
        return False
    return True


def mla_attention_cuda(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str = "float16",
    *,
    heads_per_block: int = 16,
    threads: int = 256,
    min_pages_per_split: int = 2,
    long_min_pages: int = 4,
    long_pages: int = 128,
    max_split: int = 256,
    target_blocks: int = 528,
    mma: bool = True,
    merge: str = "parallel",
    merge_cols: int = 64,
    stages: int = 3,
    merge_prefetch: bool = False,
    l2_prefetch: bool = True,
    partials: str = "float32",
    release: bool = True,
    merge_release: bool = False,
    early_pages: bool = True,
) -> tirx.PrimFunc:
    """The split-KV MLA attention PrimFunc (module docstring) for ``num_heads`` query heads.

    The keyword arguments select a variant (``schedules/lab/kernel_lab_mla.py`` measures them; the
    defaults are the model's kernel): ``heads_per_block`` (HG, at most 16), ``threads`` of the
    split kernel (SIMT path), ``min_pages_per_split`` and ``max_split`` (pages of a split, splits
    of a row; a row of more than ``long_pages`` visible pages takes at least ``long_min_pages``
    pages a split: :func:`split_pages`), ``target_blocks`` (split blocks the grid aims at:
    ``smax = clamp(ceil(target_blocks / rows), 1, max_split)``), ``mma`` (tensor-core scores
    and PV: used when ``dtype`` is float16, HG is 16, the threads are 256, ``(L + R) % 16 == 0`` and
    ``L % 64 == 0``; else the SIMT path), ``merge`` (``"parallel"``: splits and column chunks of
    ``merge_cols`` over the threads and blocks; ``"serial"``: one block per row/head looping over
    the splits), ``stages`` (tensor-core path only: 1 = the TIR page loop, one page loaded then
    computed; ``>= 2`` = the pipelined split block of :func:`~.mla_cuda_helpers.pipe_source`,
    ``cp.async`` ``stages - 1`` pages ahead into a ring of ``stages`` shared page buffers,
    dynamic shared memory past 48 KB), ``merge_prefetch`` (parallel merge: read the split lse
    of all ``smax`` slots without waiting for ``ws_n``, one dependent global round trip less),
    ``l2_prefetch`` (pipelined path: before its PDL wait each split block asks L2 for its pages,
    :func:`_prefetch_wait_source`; behind TVM's KV append, which releases at its exit, it changed
    nothing in the model, schedules/results/mla_attention.md, fourth round; behind
    :mod:`~.mla_append_cuda`'s append, which releases first, the preamble and the prefetches
    overlap the MLA prologue: sixth round),
    ``partials`` (the workspace's partial outputs, ``"float32"`` or ``"float16"``: half the
    bytes the split writes and the merge reads; float16 needs the pipelined path and the
    parallel merge; the split lse stay float32), ``release`` (the split kernel calls the PDL
    wait itself, after its page-table preamble, which reads only what the runtime writes, and
    releases its dependents right after it, as the hand decode kernels do; off:
    ``passes/grid_dependency_control.py`` puts the wait first and it releases at its exit),
    ``merge_release`` (the same for the merge kernel, its wait first thing), ``early_pages``
    (pipelined path with ``release`` only, ignored otherwise: a split block copies the pages
    among its first ``stages - 1`` whose tokens are all older than the row's new tokens, which
    no kernel of the step writes, into shared memory before its PDL wait, the others after it;
    the L2 prefetch then covers only the pages after those). The defaults
    (``release`` and ``l2_prefetch`` on, ``merge_release`` off) took a V2-Lite decode graph's
    replay on the H200 from 1,283-1,290 to 1,253-1,257 us (sixth round); ``early_pages`` (on)
    from 1,222 to 1,213-1,214 us at context ~4,000 (eighth round).
    """
    if dtype not in _ELEM_BYTES:
        raise ValueError(f"mla_attention_cuda supports {sorted(_ELEM_BYTES)}, got {dtype}")
    if merge not in ("parallel", "serial"):
        raise ValueError(f"merge must be 'parallel' or 'serial', got {merge!r}")
    if min(min_pages_per_split, long_min_pages, max_split, target_blocks) < 1 or long_pages < 0:
        raise ValueError(
            "min_pages_per_split, long_min_pages, max_split and target_blocks must be >= 1, "
            "long_pages >= 0"
        )
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    _VEC = _LOAD_BYTES // _ELEM_BYTES[dtype]  # lanes of one 16-byte load
    H = num_heads
    DL = latent_dim
    D = latent_dim + rope_dim
    P = MLA_CUDA_PAGE_SIZE
    HG = min(H, heads_per_block)  # heads per block
    if H % HG or HG not in (2, 4, 8, 16):
        raise ValueError(
            f"mla_attention_cuda needs 2, 4, 8 or 16 heads or a multiple of 16, got {H} "
            f"(heads per block {heads_per_block})"
        )
    if D % _VEC:
        raise ValueError(f"mla_attention_cuda needs (latent + rope) % {_VEC} == 0, got {D}")
    NT = threads
    if NT not in (128, 256, 512, 1024):
        raise ValueError(f"threads must be 128, 256, 512 or 1024, got {threads}")
    use_mma = bool(mma) and dtype == "float16" and HG == 16 and NT == 256
    use_mma = use_mma and D % 16 == 0 and DL % 64 == 0
    HGH = HG // 2
    TT = HGH * 8  # score tile threads: (head pair, token pair) per thread
    if NT % TT:
        raise ValueError(f"threads {NT} not a multiple of {TT} (heads per block {HG})")
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
    Q_ITERS = (HG * DV + NT - 1) // NT
    # tensor-core path: 8 warps; k-steps of QK^T and n-tiles of PV per warp
    KS = D // 16
    KSW = (KS + 7) // 8
    NTW = max(DL // 64, 1)
    PS = 24  # p_s row stride (halves): conflict-free A-fragment loads
    tag = f"{H}_{DL}_{D}"
    use_pipe = use_mma and stages >= 2
    if partials not in PARTIAL_TYPES:
        raise ValueError(f"partials must be one of {PARTIAL_TYPES}, got {partials!r}")
    half_ws = partials == "float16"
    if half_ws and not (use_pipe and merge == "parallel"):
        raise ValueError("float16 partials need the pipelined split block and the parallel merge")
    mma_src = mma_source(tag, KS, KSW, NTW, SROW, PS) if use_mma and not use_pipe else ""
    # only the pipelined block copies pages before a wait it calls itself (release)
    early_pages = early_pages and use_pipe and release
    EARLY = int(early_pages)  # the prefetch skips the pages copied before the wait
    ptag = f"{tag}_s{stages}" + ("_p16" if half_ws else "") + ("_e" if early_pages else "")
    pipe_src = (
        pipe_source(ptag, D, DL, stages, partials=partials, early=early_pages) if use_pipe else ""
    )
    use_l2 = use_pipe and l2_prefetch
    pf_name, pf_src = (
        _prefetch_wait_source(tag, P * D * _ELEM_BYTES[dtype], NT, release, wait=not early_pages)
        if use_l2
        else ("", "")
    )
    wr_src = _wait_release_source() if release or merge_release else ""
    SMEM_N = pipe_shared_halves(D, stages) if use_pipe else 1  # pipelined path: one buffer
    SMEM_SCOPE = "shared.dyn" if SMEM_N * 2 > _MAX_SHARED_BYTES else "shared"
    if use_pipe:
        smem, smem_max = SMEM_N * 2, _MAX_DYN_SHARED_BYTES
    elif use_mma:
        smem = P * SROW * 2 + 8 * HG * P * 4 + HG * PS * 2 + 3 * HG * 4
        smem_max = _MAX_SHARED_BYTES
    else:
        smem = (HG + P) * SROW * _ELEM_BYTES[dtype] + (DS + 2) * HG * P * 4 + 3 * HG * 4
        smem_max = _MAX_SHARED_BYTES
    if smem > smem_max:
        raise ValueError(
            f"mla_attention_cuda needs {smem} bytes of shared memory for {dtype} rows of {D}, "
            f"more than {smem_max}"
        )
    # merge kernel
    MT = _MERGE_THREADS
    MCPT = (DL + MT - 1) // MT  # serial merge: columns per thread
    MV = 4 if DL % 4 == 0 else 1  # parallel merge: float4 workspace reads
    MCOLS = min(merge_cols, DL)
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
    min_pps = min_pages_per_split
    n_merge_blocks = NCH if merge == "parallel" else 1
    Q_SH = 1 if use_mma else HG * SROW
    KV_N = 1 if use_pipe else P * SROW
    SP_N = 1 if use_pipe else (8 if use_mma else DS)
    SIMT_HP = 1 if use_mma else HG * P
    PH_N = HG * PS if use_mma and not use_pipe else 1
    LSE_SH = SMX if merge == "parallel" else 1
    RED_N = SL * MCOLS if merge == "parallel" else 1

    def max_splits(total_len):
        # Splits per row the grid and workspace provide for: depends on the row count only, so
        # one captured CUDA graph stays valid while the context grows (nothing else of the
        # launch configuration reads the page count).
        want = T.floordiv(target_blocks + total_len - 1, T.max(total_len, 1))
        return T.max(T.min(want, max_split), 1)

    def row_pps(vis_pages, smax):
        return split_pages(vis_pages, smax, min_pps, long_min_pages, long_pages)

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

        q = T.match_buffer(var_q, (total_len, H, D), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        # No elem_offset: the cache allocates each layer's pages on its own (offset 0), and
        # an unknown offset would stop the 16-byte vector loads (the runtime checks it).
        pages = T.match_buffer(var_pages, (max_num_pages, P, D), dtype)
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        length_info = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset
        )
        output = T.match_buffer(var_output, (total_len, H, DL), dtype)
        lse = T.match_buffer(var_lse, (total_len, H), "float32")

        ws_o = T.alloc_buffer(
            (
                T.if_then_else(
                    max_splits(total_len) > 1, total_len * max_splits(total_len) * H * DL, 1
                ),
            ),
            partials,
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
                        q_s = T.sblock_alloc_buffer((Q_SH,), dtype, scope="shared")
                        kv_s = T.sblock_alloc_buffer((KV_N,), dtype, scope="shared")
                        s_part = T.sblock_alloc_buffer((SP_N, HG, P), "float32", scope="shared")
                        smem = T.sblock_alloc_buffer((SMEM_N,), dtype, scope=SMEM_SCOPE)
                        s_s = T.sblock_alloc_buffer((SIMT_HP,), "float32", scope="shared")
                        p_s = T.sblock_alloc_buffer((SIMT_HP,), "float32", scope="shared")
                        ph_s = T.sblock_alloc_buffer((PH_N,), dtype, scope="shared")
                        m_s = T.sblock_alloc_buffer((HG,), "float32", scope="shared")
                        d_s = T.sblock_alloc_buffer((HG,), "float32", scope="shared")
                        r_s = T.sblock_alloc_buffer((HG,), "float32", scope="shared")
                        sc = T.sblock_alloc_buffer((4,), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((HPT * CPT,), "float32", scope="local")
                        lo = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        hi = T.sblock_alloc_buffer((1,), "int32", scope="local")
                        tmax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        pl = T.sblock_alloc_buffer((P,), "float32", scope="local")
                        psum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        qf = T.sblock_alloc_buffer((KSW * 4,), "uint32", scope="local")
                        macc = T.sblock_alloc_buffer((NTW * 4,), "float32", scope="local")
                        m_run = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        d_run = T.sblock_alloc_buffer((1,), "float32", scope="local")

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
                        # early_pages: the split's leading pages older than the row's new
                        # tokens (those the KV append of this step writes), and how many of
                        # them the pipelined block copies before its wait
                        n_early: T.let[T.int32] = T.max(
                            T.min(T.floordiv(kv_len - q_len, P) - pg_lo, pg_hi - pg_lo), 0
                        )
                        n_pre: T.let[T.int32] = T.if_then_else(
                            split < nsplit, T.min(n_early, stages - 1), 0
                        )
                        if use_l2:
                            # this split's pages -> L2 (those it copies early excepted), then
                            # the PDL wait unless the pipelined block waits itself (page tables
                            # only before it: the runtime, not a kernel, writes them)
                            T.cuda.func_call(
                                pf_name,
                                T.address_of(pages[0, 0, 0]),
                                T.address_of(page_values[page_begin]),
                                pg_lo + n_pre * EARLY,
                                pg_hi - pg_lo - n_pre * EARLY,
                                tx,
                                source_code=pf_src,
                            )
                        elif release and not early_pages:
                            T.cuda.func_call(_WAIT_RELEASE, source_code=wr_src)
                        if early_pages:
                            if split >= nsplit:  # idle: wait as the others do
                                T.cuda.func_call(_WAIT_RELEASE, source_code=wr_src)

                        if use_pipe:
                            # The whole split block in CUDA (mla_cuda_helpers.pipe_source).
                            if split < nsplit:
                                T.cuda.func_call(
                                    f"mla_split_pipe_{ptag}",
                                    T.address_of(q[row, h0, 0]),
                                    T.address_of(pages[0, 0, 0]),
                                    T.address_of(page_values[page_begin + pg_lo]),
                                    pg_hi - pg_lo,
                                    pg_lo * P,
                                    n_vis,
                                    sm_scale * log2e,
                                    T.if_then_else(nsplit == 1, 1, 0),
                                    T.address_of(output[row, h0, 0]),
                                    T.address_of(lse[row, h0]),
                                    ws_o.data,  # opaque: the workspaces keep their size
                                    ws_lse.data,
                                    bx * H + h0,
                                    T.address_of(smem[0]),
                                    T.address_of(smem[SMEM_N - 1]),
                                    tx,
                                    n_early,
                                    source_code=pipe_src,
                                )
                        elif use_mma:
                            # Q fragments of this warp's k-steps -> registers (global).
                            for i in T.unroll(KSW * 4):  # (full extent: no buffer compaction)
                                qf[i] = T.uint32(0)
                            if split < nsplit:
                                T.cuda.func_call(
                                    f"mla_load_q_{tag}",
                                    T.address_of(qf[0]),
                                    T.address_of(q[row, h0, 0]),
                                    D,
                                    tx // 32,
                                    tx % 32,
                                    source_code=mma_src,
                                )
                            m_run[0] = T.float32(neg_inf)
                            d_run[0] = T.float32(0)
                            for i in T.unroll(NTW * 4):
                                macc[i] = T.float32(0)
                            for upg in T.serial(pg_hi - pg_lo):
                                upage: T.let[T.int32] = page_values[page_begin + pg_lo + upg]
                                utok0: T.let[T.int32] = (pg_lo + upg) * P
                                for it in T.serial(LOAD_ITERS):
                                    if it * NT + tx < P * DV:
                                        ukt: T.let[T.int32] = (it * NT + tx) // DV
                                        ukv: T.let[T.int32] = (it * NT + tx) % DV
                                        if utok0 + ukt < n_vis:
                                            for k in T.vectorized(_VEC):
                                                kv_s[ukt * SROW + ukv * _VEC + k] = pages[
                                                    upage, ukt, ukv * _VEC + k
                                                ]
                                        else:
                                            for k in T.serial(_VEC):
                                                kv_s[ukt * SROW + ukv * _VEC + k] = T.cast(0, dtype)
                                T.tvm_storage_sync("shared")
                                # Partial scores of this warp's k-steps (tensor cores).
                                T.cuda.func_call(
                                    f"mla_qk_{tag}",
                                    T.address_of(s_part[0, 0, 0]),
                                    T.address_of(qf[0]),
                                    T.address_of(kv_s[0]),
                                    tx // 32,
                                    tx % 32,
                                    source_code=mma_src,
                                )
                                T.tvm_storage_sync("shared")
                                # Online softmax: thread (head tx/16, token tx%16); the
                                # running max/sum live in the 16 lanes of a head.
                                ush: T.let[T.int32] = tx // P
                                ust: T.let[T.int32] = tx % P
                                psum[0] = T.float32(0)
                                for k in T.unroll(8):
                                    psum[0] = psum[0] + s_part[k, ush, ust]
                                usv: T.let[T.float32] = T.if_then_else(
                                    utok0 + ust < n_vis,
                                    psum[0] * sm_scale * log2e,
                                    T.float32(neg_inf),
                                )
                                umax: T.let[T.float32] = T.max(
                                    m_run[0], T.cuda.warp_reduce(usv, "max", P)
                                )
                                upv: T.let[T.float32] = T.if_then_else(
                                    umax == T.float32(neg_inf),
                                    T.float32(0),
                                    T.exp2(usv - umax),
                                )
                                urs: T.let[T.float32] = T.if_then_else(
                                    m_run[0] == T.float32(neg_inf),
                                    T.float32(0),
                                    T.exp2(m_run[0] - umax),
                                )
                                d_run[0] = d_run[0] * urs + T.cuda.warp_reduce(upv, "sum", P)
                                m_run[0] = umax
                                ph_s[ush * PS + ust] = T.cast(upv, dtype)
                                if ust == 0:
                                    r_s[ush] = urs
                                T.tvm_storage_sync("shared")
                                # O = O * rescale + P @ V (tensor cores).
                                T.cuda.func_call(
                                    f"mla_pv_{tag}",
                                    T.address_of(macc[0]),
                                    T.address_of(ph_s[0]),
                                    T.address_of(kv_s[0]),
                                    T.address_of(r_s[0]),
                                    tx // 32,
                                    tx % 32,
                                    source_code=mma_src,
                                )
                                T.tvm_storage_sync("shared")
                            if tx % P == 0:
                                m_s[tx // P] = m_run[0]
                                d_s[tx // P] = d_run[0]
                            T.tvm_storage_sync("shared")
                            # Epilogue (mma C layout): final state or a partial one.
                            uw: T.let[T.int32] = tx // 32
                            ug: T.let[T.int32] = (tx % 32) // 4
                            ut: T.let[T.int32] = tx % 4
                            for j in T.unroll(NTW):
                                for e in T.unroll(4):
                                    uhl: T.let[T.int32] = ug + 8 * (e // 2)
                                    ucol: T.let[T.int32] = uw * (NTW * 8) + j * 8 + ut * 2 + e % 2
                                    udsum: T.let[T.float32] = d_s[uhl]
                                    uval: T.let[T.float32] = T.if_then_else(
                                        udsum > T.float32(0),
                                        macc[j * 4 + e] / udsum,
                                        T.float32(0),
                                    )
                                    if nsplit == 1 and split == 0:
                                        output[row, h0 + uhl, ucol] = T.cast(uval, dtype)
                                    elif split < nsplit:
                                        ws_o[((bx * H) + h0 + uhl) * DL + ucol] = uval
                            if tx < HG:
                                ulse: T.let[T.float32] = T.if_then_else(
                                    d_s[tx] > T.float32(0),
                                    m_s[tx] + T.log2(d_s[tx]),
                                    T.float32(neg_inf),
                                )
                                if nsplit == 1 and split == 0:
                                    lse[row, h0 + tx] = ulse
                                elif split < nsplit:
                                    ws_lse[bx * H + h0 + tx] = ulse
                        else:
                            # Q rows of the head group -> shared (16-byte vectors).
                            for it in T.serial(Q_ITERS):
                                if it * NT + tx < HG * DV:
                                    qh: T.let[T.int32] = (it * NT + tx) // DV
                                    qv: T.let[T.int32] = (it * NT + tx) % DV
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
                                for it in T.serial(LOAD_ITERS):
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
                                for i in T.unroll(4):
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
                                        sc[0] = sc[0] + qa * ka
                                        sc[1] = sc[1] + qa * kb
                                        sc[2] = sc[2] + qb * ka
                                        sc[3] = sc[3] + qb * kb
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
                                        psum[0] * sm_scale * log2e,
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
                                        if nsplit == 1 and split == 0:
                                            output[row, h0 + hl, co + j * CG] = T.cast(val, dtype)
                                        elif split < nsplit:
                                            ws_o[((bx * H) + h0 + hl) * DL + co + j * CG] = val
                            if tx < HG:
                                lse_v: T.let[T.float32] = T.if_then_else(
                                    d_s[tx] > T.float32(0),
                                    m_s[tx] + T.log2(d_s[tx]),
                                    T.float32(neg_inf),
                                )
                                if nsplit == 1 and split == 0:
                                    lse[row, h0 + tx] = lse_v
                                elif split < nsplit:
                                    ws_lse[bx * H + h0 + tx] = lse_v
                        # the splits the row uses, for the merge (after every path's wait)
                        if split == 0 and by == 0 and tx == 0:
                            ws_n[row] = nsplit

        for mbx in T.thread_binding(total_len * H * n_merge_blocks, thread="blockIdx.x"):
            for mtx in T.thread_binding(MT, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    mmax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    wsum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    macc = T.sblock_alloc_buffer((MCPT,), "float32", scope="local")
                    vacc = T.sblock_alloc_buffer((MV,), "float32", scope="local")
                    vld = T.sblock_alloc_buffer((MV,), "float32", scope="local")
                    csum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    lse_sh = T.sblock_alloc_buffer((LSE_SH,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((RED_N,), "float32", scope="shared")
                    if merge_release:
                        T.cuda.func_call(_WAIT_RELEASE, source_code=wr_src)
                    mrow: T.let[T.int32] = mbx // (H * n_merge_blocks)
                    msplit: T.let[T.int32] = ws_n[mrow]
                    mmax_s: T.let[T.int32] = max_splits(total_len)
                    mh: T.let[T.int32] = (mbx // n_merge_blocks) % H
                    mch: T.let[T.int32] = mbx % n_merge_blocks
                    if merge == "parallel":
                        # Block (row, head, column chunk); thread (split lane, column lane).
                        if merge_prefetch:
                            # All smax slots, not waiting for ws_n (unused ones are ignored).
                            for i in T.serial((SMX + MT - 1) // MT):
                                if i * MT + mtx < mmax_s:
                                    lse_sh[i * MT + mtx] = ws_lse[
                                        (mrow * mmax_s + i * MT + mtx) * H + mh
                                    ]
                            T.tvm_storage_sync("shared")
                        if msplit > 1:
                            if not merge_prefetch:
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
                                                        ((mrow * mmax_s + ms) * H + mh) * DL
                                                        + mcol
                                                        + v
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
                                    output[mrow, mh, mch * MCOLS + i * MT + mtx] = T.cast(
                                        T.if_then_else(
                                            gsum > T.float32(0), csum[0] / gsum, T.float32(0)
                                        ),
                                        dtype,
                                    )
                            if mch == 0 and mtx == 0:
                                lse[mrow, mh] = T.if_then_else(
                                    gsum > T.float32(0),
                                    gmax + T.log2(gsum),
                                    T.float32(neg_inf),
                                )
                    else:
                        if msplit > 1:
                            mmax[0] = T.float32(neg_inf)
                            for s in T.serial(msplit):
                                mmax[0] = T.max(mmax[0], ws_lse[(mrow * mmax_s + s) * H + mh])
                            wsum[0] = T.float32(0)
                            for j in T.unroll(MCPT):
                                macc[j] = T.float32(0)
                            if mmax[0] > T.float32(neg_inf):
                                for s in T.serial(msplit):
                                    ls: T.let[T.float32] = ws_lse[(mrow * mmax_s + s) * H + mh]
                                    if ls > T.float32(neg_inf):
                                        w: T.let[T.float32] = T.exp2(ls - mmax[0])
                                        wsum[0] = wsum[0] + w
                                        for j in T.unroll(MCPT):
                                            if mtx + j * MT < DL:
                                                macc[j] = (
                                                    macc[j]
                                                    + w
                                                    * ws_o[
                                                        ((mrow * mmax_s + s) * H + mh) * DL
                                                        + mtx
                                                        + j * MT
                                                    ]
                                                )
                            for j in T.unroll(MCPT):
                                if mtx + j * MT < DL:
                                    output[mrow, mh, mtx + j * MT] = T.cast(
                                        T.if_then_else(
                                            wsum[0] > T.float32(0), macc[j] / wsum[0], T.float32(0)
                                        ),
                                        dtype,
                                    )
                            if mtx == 0:
                                lse[mrow, mh] = T.if_then_else(
                                    wsum[0] > T.float32(0),
                                    mmax[0] + T.log2(wsum[0]),
                                    T.float32(neg_inf),
                                )

    return batch_mla_paged_attention_split_kv


def _prefetch_wait_source(
    tag: str, page_bytes: int, threads: int, release: bool, wait: bool = True
) -> tuple[str, str]:
    """(name, CUDA) of ``mla_prefetch_wait[_r]_<tag>(pages, page_ids, first, count, tid)``:
    the block's threads ask L2 for pages ``page_ids[first:first + count]``
    (``cp.async.bulk.prefetch``, one page of ``page_bytes`` each), then the PDL wait (``_r``:
    and the release; ``wait=False``: ``mla_prefetch_<tag>``, no wait). Safe before the wait: a
    prefetch reads nothing into the block, and the page the previous kernel appends to is read
    after it."""
    name = f"mla_prefetch_wait{'_r' if release else ''}_{tag}" if wait else f"mla_prefetch_{tag}"
    return name, (
        grid_wait_source()
        + l2_prefetch_source()
        + f"""
#ifndef {name.upper()}
#define {name.upper()}
__device__ __forceinline__ void {name}(const half* pages, const int* page_ids,
    int first, int count, int tid) {{
  for (int i = tid; i < count; i += {threads})
    {L2_PREFETCH}(reinterpret_cast<const char*>(pages) + (long long)page_ids[first + i] *
                  {page_bytes}, {page_bytes});
  {(WAIT_THEN_RELEASE if release else f"{GRID_WAIT}();") if wait else ""}
}}
#endif
"""
    )


_WAIT_RELEASE = "mla_wait_release"


def _wait_release_source() -> str:
    """CUDA: ``mla_wait_release()``, the PDL wait, then the release of the dependents."""
    return (
        grid_wait_source()
        + f"""
#ifndef MLA_WAIT_RELEASE
#define MLA_WAIT_RELEASE
__device__ __forceinline__ void {_WAIT_RELEASE}() {{
  {WAIT_THEN_RELEASE}
}}
#endif
"""
    )

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

1. **Split kernel**, grid ``(total * nsplit, H / HG)``, 256 threads. A block owns one query row,
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

``nsplit = clamp(min(ceil(264 / total), ceil(avg_pages / 2)), 1, 64)``: about two blocks per SM
of the H200's 132 for decode, at least 2 pages per split, no split for long extends (which have
``total`` rows of parallelism already). Multi-row queries (chunked prefill / extend) run one
block per row, each reading the row's whole prefix (from L2 after the first): correct, but a
prefill-style kernel that tiles rows would read less (see schedules/results/mla_attention.md).

Bytes and FLOPs, V2-Lite (H=16, L=512, R=64), batch 1, 4K context, one layer: the pages are
``4096 * 576 * 2 B = 4.7 MB`` (at 3-4 TB/s about 1.5 us), the workspace ``64 * 16 * 512 * 4 B =
2 MB`` written and read once (L2), FLOPs ``2 * 16 * 4096 * (576 + 512) = 143 MFLOP`` (fp32 SIMT
on 132 SMs: a few us). The target is tens of microseconds per layer instead of 4.96 ms.
"""

import math

from tvm import tirx
from tvm.script import tirx as T

__all__ = ["MLA_CUDA_PAGE_SIZE", "mla_attention_cuda", "mla_attention_cuda_supports"]

MLA_CUDA_PAGE_SIZE = 16
_LOG2E = math.log2(math.e)
_THREADS = 256  # split kernel block size
_MERGE_THREADS = 128
_TARGET_BLOCKS = 264  # two per SM on the H200 (132 SMs)
_MAX_SPLIT = 64
_MIN_PAGES_PER_SPLIT = 2
_LOAD_BYTES = 16  # one vector load per thread and step
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_MAX_SHARED_BYTES = 49152  # static shared memory of one block (no opt-in)


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
    num_heads: int, latent_dim: int, rope_dim: int, dtype: str = "float16"
) -> tirx.PrimFunc:
    """The split-KV MLA attention PrimFunc (module docstring) for ``num_heads`` query heads."""
    if dtype not in _ELEM_BYTES:
        raise ValueError(f"mla_attention_cuda supports {sorted(_ELEM_BYTES)}, got {dtype}")
    _VEC = _LOAD_BYTES // _ELEM_BYTES[dtype]  # lanes of one 16-byte load
    H = num_heads
    DL = latent_dim
    D = latent_dim + rope_dim
    P = MLA_CUDA_PAGE_SIZE
    HG = min(H, 16)  # heads per block
    if H % HG or HG not in (2, 4, 8, 16):
        raise ValueError(
            f"mla_attention_cuda needs 2, 4, 8 or 16 heads or a multiple of 16, got {H}"
        )
    if D % _VEC:
        raise ValueError(f"mla_attention_cuda needs (latent + rope) % {_VEC} == 0, got {D}")
    NT = _THREADS
    HGH = HG // 2
    TT = HGH * 8  # score tile threads: (head pair, token pair) per thread
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
    smem = (HG + P) * SROW * _ELEM_BYTES[dtype] + (DS + 2) * HG * P * 4 + 3 * HG * 4
    if smem > _MAX_SHARED_BYTES:
        raise ValueError(
            f"mla_attention_cuda needs {smem} bytes of shared memory for {dtype} rows of {D}, "
            f"more than {_MAX_SHARED_BYTES}"
        )
    MT = _MERGE_THREADS
    MCPT = (DL + MT - 1) // MT
    log2e = _LOG2E
    n_hg = H // HG
    neg_inf = -math.inf

    def num_splits(total_len, nnz_pages, batch_size):
        avg_pages = T.floordiv(nnz_pages + batch_size - 1, T.max(batch_size, 1))
        want = T.min(
            T.floordiv(_TARGET_BLOCKS + total_len - 1, T.max(total_len, 1)),
            T.floordiv(avg_pages + _MIN_PAGES_PER_SPLIT - 1, _MIN_PAGES_PER_SPLIT),
        )
        return T.max(T.min(want, _MAX_SPLIT), 1)

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
                    num_splits(total_len, nnz_pages, batch_size) > 1,
                    total_len * num_splits(total_len, nnz_pages, batch_size) * H * DL,
                    1,
                ),
            ),
            "float32",
            scope="global",
        )
        ws_lse = T.alloc_buffer(
            (total_len * num_splits(total_len, nnz_pages, batch_size) * H,),
            "float32",
            scope="global",
        )

        for bx in T.thread_binding(
            total_len * num_splits(total_len, nnz_pages, batch_size), thread="blockIdx.x"
        ):
            for by in T.thread_binding(n_hg, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.sblock("split_attn"):
                        T.reads()
                        T.writes()
                        q_s = T.sblock_alloc_buffer((HG * SROW,), dtype, scope="shared")
                        kv_s = T.sblock_alloc_buffer((P * SROW,), dtype, scope="shared")
                        s_part = T.sblock_alloc_buffer((DS, HG, P), "float32", scope="shared")
                        s_s = T.sblock_alloc_buffer((HG, P), "float32", scope="shared")
                        p_s = T.sblock_alloc_buffer((HG, P), "float32", scope="shared")
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

                        nsplit: T.let[T.int32] = num_splits(total_len, nnz_pages, batch_size)
                        row: T.let[T.int32] = bx // nsplit
                        split: T.let[T.int32] = bx % nsplit
                        # Binary search: the sequence b with q_indptr[b] <= row < q_indptr[b+1].
                        lo[0] = 0
                        hi[0] = batch_size
                        while hi[0] - lo[0] > 1:
                            if q_indptr[(lo[0] + hi[0]) // 2] <= row:
                                lo[0] = (lo[0] + hi[0]) // 2
                            else:
                                hi[0] = (lo[0] + hi[0]) // 2
                        b: T.let[T.int32] = lo[0]
                        q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        page_begin: T.let[T.int32] = page_indptr[b]
                        num_pages: T.let[T.int32] = page_indptr[b + 1] - page_begin
                        kv_len: T.let[T.int32] = T.if_then_else(
                            num_pages > 0, (num_pages - 1) * P + length_info[b], 0
                        )
                        n_vis: T.let[T.int32] = T.max(
                            T.if_then_else(
                                causal > 0,
                                T.min(kv_len, kv_len - q_len + (row - q_indptr[b]) + 1),
                                kv_len,
                            ),
                            0,
                        )
                        vis_pages: T.let[T.int32] = (n_vis + P - 1) // P
                        pps: T.let[T.int32] = (vis_pages + nsplit - 1) // nsplit
                        pg_lo: T.let[T.int32] = T.min(split * pps, vis_pages)
                        pg_hi: T.let[T.int32] = T.min(pg_lo + pps, vis_pages)
                        h0: T.let[T.int32] = by * HG

                        # Q rows of the head group -> shared (16-byte vectors).
                        for it in T.serial(Q_ITERS):
                            if it * NT + tx < HG * DV:
                                qh: T.let[T.int32] = (it * NT + tx) // DV
                                qv: T.let[T.int32] = (it * NT + tx) % DV
                                for k in T.vectorized(_VEC):
                                    q_s[qh * SROW + qv * _VEC + k] = q[row, h0 + qh, qv * _VEC + k]
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
                                    qa: T.let[T.float32] = T.cast(q_s[hp * SROW + dd], "float32")
                                    qb: T.let[T.float32] = T.cast(
                                        q_s[(hp + HGH) * SROW + dd], "float32"
                                    )
                                    ka: T.let[T.float32] = T.cast(kv_s[tp * SROW + dd], "float32")
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
                                s_s[sh, st] = T.if_then_else(
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
                                    pl[t] = s_s[tx, t]
                                    tmax[0] = T.max(tmax[0], pl[t])
                                psum[0] = T.float32(0)
                                for t in T.unroll(P):
                                    pl[t] = T.if_then_else(
                                        tmax[0] == T.float32(neg_inf),
                                        T.float32(0),
                                        T.exp2(pl[t] - tmax[0]),
                                    )
                                    psum[0] = psum[0] + pl[t]
                                    p_s[tx, t] = pl[t]
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
                                                acc[i * CPT + j] + p_s[hh * HPT + i, t] * vv
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
                                    if nsplit == 1:
                                        output[row, h0 + hl, co + j * CG] = T.cast(val, dtype)
                                    else:
                                        ws_o[((bx * H) + h0 + hl) * DL + co + j * CG] = val
                        if tx < HG:
                            lse_v: T.let[T.float32] = T.if_then_else(
                                d_s[tx] > T.float32(0),
                                m_s[tx] + T.log2(d_s[tx]),
                                T.float32(neg_inf),
                            )
                            if nsplit == 1:
                                lse[row, h0 + tx] = lse_v
                            else:
                                ws_lse[bx * H + h0 + tx] = lse_v

        for mbx in T.thread_binding(total_len * H, thread="blockIdx.x"):
            for mtx in T.thread_binding(MT, thread="threadIdx.x"):
                with T.sblock("merge"):
                    T.reads()
                    T.writes()
                    mmax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    wsum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    macc = T.sblock_alloc_buffer((MCPT,), "float32", scope="local")
                    msplit: T.let[T.int32] = num_splits(total_len, nnz_pages, batch_size)
                    mrow: T.let[T.int32] = mbx // H
                    mh: T.let[T.int32] = mbx % H
                    if msplit > 1:
                        mmax[0] = T.float32(neg_inf)
                        for s in T.serial(msplit):
                            mmax[0] = T.max(mmax[0], ws_lse[(mrow * msplit + s) * H + mh])
                        wsum[0] = T.float32(0)
                        for j in T.unroll(MCPT):
                            macc[j] = T.float32(0)
                        if mmax[0] > T.float32(neg_inf):
                            for s in T.serial(msplit):
                                ls: T.let[T.float32] = ws_lse[(mrow * msplit + s) * H + mh]
                                if ls > T.float32(neg_inf):
                                    w: T.let[T.float32] = T.exp2(ls - mmax[0])
                                    wsum[0] = wsum[0] + w
                                    for j in T.unroll(MCPT):
                                        if mtx + j * MT < DL:
                                            macc[j] = (
                                                macc[j]
                                                + w
                                                * ws_o[
                                                    ((mrow * msplit + s) * H + mh) * DL
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

"""TIR kernels for the MLA (multi-head latent attention) paged KV cache on the LLVM (CPU) target.

TVM 0.27 ships no MLA kernels for LLVM (``TIRPagedKVCache(attn_kind="mla")`` raises there). These
kernels fill the MLA slots of ``vm.builtin.paged_attention_kv_cache_create`` so that the C++
``PagedAttentionKVCache`` runs MLA on the CPU. Layout conventions (shared with TVM's CUDA kernels):

* ``pages``: ``[num_pages, page_size, latent_dim + rope_dim]`` per layer; one cached row per token
  is ``[compressed_kv (latent_dim) | k_pe (rope_dim)]``. The value of a token is the first
  ``latent_dim`` entries of its row.
* ``lse`` is the log-sum-exp in **base 2** of the scaled scores: ``lse = log2(sum_j 2^(s_j))`` with
  ``s_j = (q . k_j) * sm_scale * log2(e)``; i.e. ``lse = ln_lse * log2(e)``. All TVM attention and
  merge kernels use this convention.
* A query that sees no key gets ``out = 0`` and ``lse = -inf``; :func:`merge_state_inplace_cpu`
  treats ``-inf`` as "empty" (never NaN).

Unlike TVM's kernels (which hard-code ``page_size=16`` in the buffer shapes), the page size here is
read from ``pages.shape[1]``, so these kernels work for any page size the runtime chooses.
The loops are plain serial loops, parallelised over independent rows with ``T.parallel``.
"""

import math

from tvm import tirx
from tvm.script import tirx as T

from .kv_fp8 import e4m3_byte_f16, fp8_cache_dims, read_scale, slot_values
from .mla_paging import find_sequence, kv_length, visible_length

__all__ = [
    "compact_kv_copy_mla_cpu",
    "copy_single_page_mla_cpu",
    "kv_cache_transpose_append_mla_cpu",
    "merge_state_inplace_cpu",
    "mla_paged_attention_cpu",
    "mla_paged_attention_fp8_cpu",
]

_LOG2E = math.log2(math.e)
# Number of keys scored before one online-softmax rescale of the accumulator.
_KV_TILE = 16


def mla_paged_attention_cpu(
    num_heads: int, latent_dim: int, rope_dim: int, dtype: str
) -> tirx.PrimFunc:
    """Absorbed MLA attention over the paged latent cache (``TIRPagedPrefillFunc::MLA`` ABI).

    Signature of the returned PrimFunc (argument order fixed by ``attn_backend.h``)::

        f(q[total, H, latent+rope], qo_indptr[b+1] int32, pages[num_pages, page_size, latent+rope],
          page_indptr[b+1] int32, page_indices[nnz] int32, length_info[b] int32 (last_page_len),
          out[total, H, latent], lse[total, H] float32, causal: int32, sm_scale: float32)

    Sequence ``i`` owns the query rows ``qo_indptr[i]:qo_indptr[i+1]`` and the pages
    ``page_indices[page_indptr[i]:page_indptr[i+1]]``; its KV length is
    ``(num_pages - 1) * page_size + length_info[i]`` (0 when it has no page). With ``causal=1``
    query ``r`` of a chunk of ``q_len`` rows sees the KV positions ``< kv_len - q_len + r + 1``,
    otherwise all ``kv_len`` positions. Scores and the online softmax run in float32; the output is
    ``softmax(q . k * sm_scale) @ latent``, ``lse`` is in base 2. Rows that see no key get
    ``out = 0``, ``lse = -inf``. Parallel over (row, head); the page size is symbolic.
    """
    H = num_heads
    DL = latent_dim
    D = latent_dim + rope_dim
    TILE = _KV_TILE
    log2e = _LOG2E
    # Vector lanes of the inner loops (the dot product keeps LANES partial sums).
    LANES = next(k for k in (8, 4, 2, 1) if D % k == 0 and DL % k == 0)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_mla_cpu(
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
        page_size = T.int32()
        q_elem_offset = T.int64()
        pages_elem_offset = T.int64()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        output_elem_offset = T.int64()
        lse_elem_offset = T.int64()

        q = T.match_buffer(var_q, (total_len, H, D), dtype, elem_offset=q_elem_offset)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        pages = T.match_buffer(
            var_pages, (max_num_pages, page_size, D), dtype, elem_offset=pages_elem_offset
        )
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        length_info = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset
        )
        output = T.match_buffer(
            var_output, (total_len, H, DL), dtype, elem_offset=output_elem_offset
        )
        lse = T.match_buffer(var_lse, (total_len, H), "float32", elem_offset=lse_elem_offset)

        for rh in T.parallel(total_len * H):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                q_f = T.sblock_alloc_buffer((D,), "float32")
                acc = T.sblock_alloc_buffer((DL,), "float32")
                score = T.sblock_alloc_buffer((TILE,), "float32")
                lo = T.sblock_alloc_buffer((1,), "int32")
                hi = T.sblock_alloc_buffer((1,), "int32")
                m_run = T.sblock_alloc_buffer((1,), "float32")
                m_tile = T.sblock_alloc_buffer((1,), "float32")
                d_run = T.sblock_alloc_buffer((1,), "float32")
                part = T.sblock_alloc_buffer((LANES,), "float32")
                rescale = T.sblock_alloc_buffer((1,), "float32")
                prob = T.sblock_alloc_buffer((1,), "float32")

                row: T.let[T.int32] = rh // H
                h: T.let[T.int32] = rh % H
                find_sequence(q_indptr, batch_size, row, lo, hi)
                b: T.let[T.int32] = lo[0]
                q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                page_begin: T.let[T.int32] = page_indptr[b]
                num_pages: T.let[T.int32] = page_indptr[b + 1] - page_begin
                kv_len: T.let[T.int32] = kv_length(num_pages, length_info[b], page_size)
                n_vis: T.let[T.int32] = visible_length(kv_len, q_len, row - q_indptr[b], causal)

                for d in T.serial(D):
                    q_f[d] = T.cast(q[row, h, d], "float32") * sm_scale * log2e
                for d in T.serial(DL):
                    acc[d] = T.float32(0)
                m_run[0] = -T.infinity("float32")
                d_run[0] = T.float32(0)

                for t in T.serial((n_vis + TILE - 1) // TILE):
                    m_tile[0] = m_run[0]
                    for jj in T.serial(TILE):
                        if t * TILE + jj < n_vis:
                            pg: T.let[T.int32] = page_values[
                                page_begin + (t * TILE + jj) // page_size
                            ]
                            off: T.let[T.int32] = (t * TILE + jj) % page_size
                            for ln in T.vectorized(LANES):
                                part[ln] = T.float32(0)
                            for d_o in T.serial(D // LANES):
                                for ln in T.vectorized(LANES):
                                    part[ln] = part[ln] + q_f[d_o * LANES + ln] * T.cast(
                                        pages[pg, off, d_o * LANES + ln], "float32"
                                    )
                            score[jj] = T.float32(0)
                            for ln in T.serial(LANES):
                                score[jj] = score[jj] + part[ln]
                            m_tile[0] = T.max(m_tile[0], score[jj])
                    rescale[0] = T.exp2(m_run[0] - m_tile[0])
                    d_run[0] = d_run[0] * rescale[0]
                    for d_o in T.serial(DL // LANES):
                        for ln in T.vectorized(LANES):
                            acc[d_o * LANES + ln] = acc[d_o * LANES + ln] * rescale[0]
                    for jj in T.serial(TILE):
                        if t * TILE + jj < n_vis:
                            pg2: T.let[T.int32] = page_values[
                                page_begin + (t * TILE + jj) // page_size
                            ]
                            off2: T.let[T.int32] = (t * TILE + jj) % page_size
                            prob[0] = T.exp2(score[jj] - m_tile[0])
                            d_run[0] = d_run[0] + prob[0]
                            for d_o in T.serial(DL // LANES):
                                for ln in T.vectorized(LANES):
                                    acc[d_o * LANES + ln] = acc[d_o * LANES + ln] + prob[
                                        0
                                    ] * T.cast(pages[pg2, off2, d_o * LANES + ln], "float32")
                    m_run[0] = m_tile[0]

                if n_vis > 0:
                    for d in T.serial(DL):
                        output[row, h, d] = T.cast(acc[d] / d_run[0], dtype)
                    lse[row, h] = m_run[0] + T.log2(d_run[0])
                else:
                    for d in T.serial(DL):
                        output[row, h, d] = T.cast(T.float32(0), dtype)
                    lse[row, h] = -T.infinity("float32")

    return batch_prefill_paged_kv_mla_cpu


def mla_paged_attention_fp8_cpu(
    num_heads: int, latent_dim: int, rope_dim: int, dtype: str, kv_scale: float
) -> tirx.PrimFunc:
    """:func:`mla_paged_attention_cpu` over an FP8 cache in the storage of
    :mod:`dsv2_mlc.schedules.kv_fp8` (the latent ``k`` e4m3 bytes a ``dtype`` slot, then the rope
    values): the same ABI with ``q[total, kH, L/k + R]`` (head ``h``'s ``L + R`` values at the
    start of pseudo-heads ``hk ..``), ``pages[num_pages, page_size, L/k + R]``, ``out[total, kH,
    L/k]`` and ``lse[total, kH]`` (``out`` the reshape of ``[total, H, L]``; each head's ``lse``
    goes to all its pseudo-heads). The latent values are decoded with shifts (``value / 256``)
    and ``256 * kv_scale`` is folded into the latent part of the score and into the output.
    Scores and softmax in float32, as :func:`mla_paged_attention_cpu`."""
    H = num_heads
    DL = latent_dim
    R = rope_dim
    D = latent_dim + rope_dim
    H2, DP, DLP = fp8_cache_dims(num_heads, latent_dim, rope_dim, dtype)
    K = slot_values(dtype)
    TILE = _KV_TILE
    log2e = _LOG2E
    kscale = read_scale(kv_scale)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_mla_fp8_cpu(
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
        page_size = T.int32()
        q_elem_offset = T.int64()
        pages_elem_offset = T.int64()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        output_elem_offset = T.int64()
        lse_elem_offset = T.int64()

        q = T.match_buffer(var_q, (total_len, H2, DP), dtype, elem_offset=q_elem_offset)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        pages = T.match_buffer(
            var_pages, (max_num_pages, page_size, DP), dtype, elem_offset=pages_elem_offset
        )
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        length_info = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset
        )
        output = T.match_buffer(
            var_output, (total_len, H2, DLP), dtype, elem_offset=output_elem_offset
        )
        lse = T.match_buffer(var_lse, (total_len, H2), "float32", elem_offset=lse_elem_offset)

        for rh in T.parallel(total_len * H):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                q_f = T.sblock_alloc_buffer((D,), "float32")
                acc = T.sblock_alloc_buffer((DL,), "float32")
                score = T.sblock_alloc_buffer((TILE,), "float32")
                lo = T.sblock_alloc_buffer((1,), "int32")
                hi = T.sblock_alloc_buffer((1,), "int32")
                m_run = T.sblock_alloc_buffer((1,), "float32")
                m_tile = T.sblock_alloc_buffer((1,), "float32")
                d_run = T.sblock_alloc_buffer((1,), "float32")
                rescale = T.sblock_alloc_buffer((1,), "float32")
                prob = T.sblock_alloc_buffer((1,), "float32")

                row: T.let[T.int32] = rh // H
                h: T.let[T.int32] = rh % H
                find_sequence(q_indptr, batch_size, row, lo, hi)
                b: T.let[T.int32] = lo[0]
                q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                page_begin: T.let[T.int32] = page_indptr[b]
                num_pages: T.let[T.int32] = page_indptr[b + 1] - page_begin
                kv_len: T.let[T.int32] = kv_length(num_pages, length_info[b], page_size)
                n_vis: T.let[T.int32] = visible_length(kv_len, q_len, row - q_indptr[b], causal)

                # q (the start of pseudo-heads hK .. of DP values), scaled for base 2 and
                # (the latent part) the decode
                for d in T.serial(D):
                    q_f[d] = (
                        T.cast(q[row, h * K + d // DP, d % DP], "float32")
                        * sm_scale
                        * T.if_then_else(d < DL, T.float32(log2e * kscale), T.float32(log2e))
                    )
                for d in T.serial(DL):
                    acc[d] = T.float32(0)
                m_run[0] = -T.infinity("float32")
                d_run[0] = T.float32(0)

                for t in T.serial((n_vis + TILE - 1) // TILE):
                    m_tile[0] = m_run[0]
                    for jj in T.serial(TILE):
                        if t * TILE + jj < n_vis:
                            pg: T.let[T.int32] = page_values[
                                page_begin + (t * TILE + jj) // page_size
                            ]
                            off: T.let[T.int32] = (t * TILE + jj) % page_size
                            score[jj] = T.float32(0)
                            for j in T.serial(DLP):
                                for i in T.unroll(K):
                                    score[jj] = score[jj] + q_f[j * K + i] * T.cast(
                                        e4m3_byte_f16(pages[pg, off, j], i, dtype), "float32"
                                    )
                            for r in T.serial(R):
                                score[jj] = score[jj] + q_f[DL + r] * T.cast(
                                    pages[pg, off, DLP + r], "float32"
                                )
                            m_tile[0] = T.max(m_tile[0], score[jj])
                    rescale[0] = T.exp2(m_run[0] - m_tile[0])
                    d_run[0] = d_run[0] * rescale[0]
                    for d in T.serial(DL):
                        acc[d] = acc[d] * rescale[0]
                    for jj in T.serial(TILE):
                        if t * TILE + jj < n_vis:
                            pg2: T.let[T.int32] = page_values[
                                page_begin + (t * TILE + jj) // page_size
                            ]
                            off2: T.let[T.int32] = (t * TILE + jj) % page_size
                            prob[0] = T.exp2(score[jj] - m_tile[0])
                            d_run[0] = d_run[0] + prob[0]
                            for j in T.serial(DLP):
                                for i in T.unroll(K):
                                    acc[j * K + i] = acc[j * K + i] + prob[0] * T.cast(
                                        e4m3_byte_f16(pages[pg2, off2, j], i, dtype), "float32"
                                    )
                    m_run[0] = m_tile[0]

                for i in T.serial(K):
                    if n_vis > 0:
                        for d in T.serial(DLP):
                            output[row, h * K + i, d] = T.cast(
                                acc[i * DLP + d] / d_run[0] * T.float32(kscale), dtype
                            )
                        lse[row, h * K + i] = m_run[0] + T.log2(d_run[0])
                    else:
                        for d in T.serial(DLP):
                            output[row, h * K + i, d] = T.cast(T.float32(0), dtype)
                        lse[row, h * K + i] = -T.infinity("float32")

    return batch_prefill_paged_kv_mla_fp8_cpu


def merge_state_inplace_cpu(dtype: str, head_dim: int | None = None) -> tirx.PrimFunc:
    """Merge two partial attention states in place: ``(V, S) <- merge((V, S), (V_o, S_o))``.

    Signature: ``f(v[N, H, D], s[N, H] float32, v_other[N, H, D], s_other[N, H] float32)``.
    ``s`` is a base-2 log-sum-exp. With ``m = max(s, s_o)``, ``a = 2^(s - m)``, ``c = 2^(s_o - m)``:
    ``V = (a V + c V_o) / (a + c)`` and ``S = m + log2(a + c)``. Unlike TVM's
    ``merge_state_inplace_cpu`` it is safe for empty states: one side ``-inf`` returns the other
    side unchanged, both ``-inf`` give ``V = 0`` and ``S = -inf`` (never NaN). ``head_dim=None``
    makes ``D`` symbolic (one function for every width); an int specialises it.
    """
    D = tirx.Var("D", "int32") if head_dim is None else head_dim

    @T.prim_func(s_tir=True)
    def merge_state_inplace_mla_cpu(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        N = T.int32()
        H = T.int32()
        v_off = T.int64()
        s_off = T.int64()
        vo_off = T.int64()
        so_off = T.int64()
        V = T.match_buffer(v, (N, H, D), dtype, elem_offset=v_off)
        S = T.match_buffer(s, (N, H), "float32", elem_offset=s_off)
        V_other = T.match_buffer(v_other, (N, H, D), dtype, elem_offset=vo_off)
        S_other = T.match_buffer(s_other, (N, H), "float32", elem_offset=so_off)

        for nh in T.parallel(N * H):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                w_self = T.sblock_alloc_buffer((1,), "float32")
                w_other = T.sblock_alloc_buffer((1,), "float32")
                n: T.let[T.int32] = nh // H
                hh: T.let[T.int32] = nh % H
                s_max: T.let[T.float32] = T.max(S[n, hh], S_other[n, hh])
                if s_max == -T.infinity("float32"):
                    for d in T.serial(D):
                        V[n, hh, d] = T.cast(T.float32(0), dtype)
                    S[n, hh] = -T.infinity("float32")
                else:
                    w_self[0] = T.exp2(S[n, hh] - s_max)
                    w_other[0] = T.exp2(S_other[n, hh] - s_max)
                    for d in T.serial(D):
                        V[n, hh, d] = T.cast(
                            (
                                T.cast(V[n, hh, d], "float32") * w_self[0]
                                + T.cast(V_other[n, hh, d], "float32") * w_other[0]
                            )
                            / (w_self[0] + w_other[0]),
                            dtype,
                        )
                    S[n, hh] = s_max + T.log2(w_self[0] + w_other[0])

    suffix = "" if head_dim is None else f"_d{head_dim}"
    return merge_state_inplace_mla_cpu.with_attr(
        "global_symbol", f"merge_state_inplace_mla_cpu{suffix}"
    )


def copy_single_page_mla_cpu(head_dim: int, dtype: str) -> tirx.PrimFunc:
    """Copy the first ``copy_length`` rows of page ``src_page_id`` into page ``tgt_page_id``.

    Signature (as ``_copy_single_page_mla`` on GPU, called by ``ForkSequence`` when a fork
    position falls inside a page): ``f(pages[num_pages, page_size, head_dim], src_page_id: int64,
    tgt_page_id: int64, copy_length: int64)``.
    """

    @T.prim_func(s_tir=True)
    def copy_single_page_mla_cpu_func(
        var_pages: T.handle, src_page_id: T.int64, tgt_page_id: T.int64, copy_length: T.int64
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        num_pages = T.int32()
        page_size = T.int32()
        pages_elem_offset = T.int64()
        pages = T.match_buffer(
            var_pages, (num_pages, page_size, head_dim), dtype, elem_offset=pages_elem_offset
        )
        for p in T.serial(copy_length):
            for d in T.serial(head_dim):
                with T.sblock("copy"):
                    T.reads()
                    T.writes()
                    pages[tgt_page_id, p, d] = pages[src_page_id, p, d]

    return copy_single_page_mla_cpu_func


def kv_cache_transpose_append_mla_cpu(head_dim: int, dtype: str) -> tirx.PrimFunc:
    """Write new latent rows into the pages: ``pages[pos // P, pos % P] = kv[i]``.

    Signature (as TVM's ``_kv_cache_transpose_append_mla``): ``f(pages[num_pages, P, head_dim],
    kv[ntoken, head_dim], position_map[ntoken] int32)``; rows with position ``-1`` are skipped.
    The page size ``P`` is read from ``pages`` (TVM's version hard-codes 16).
    """

    @T.prim_func(s_tir=True)
    def tir_kv_cache_transpose_append_mla_cpu(
        var_pages: T.handle, var_kv_data: T.handle, var_position_map: T.handle
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        ntoken = T.int64()
        num_pages = T.int64()
        page_size = T.int64()
        pages_elem_offset = T.int64()
        kv_elem_offset = T.int64()
        position_map_elem_offset = T.int32()
        pages = T.match_buffer(
            var_pages, (num_pages, page_size, head_dim), dtype, elem_offset=pages_elem_offset
        )
        kv_data = T.match_buffer(var_kv_data, (ntoken, head_dim), dtype, elem_offset=kv_elem_offset)
        position_map = T.match_buffer(
            var_position_map, (ntoken,), "int32", elem_offset=position_map_elem_offset
        )
        for i in T.parallel(ntoken):
            with T.sblock("append"):
                T.reads()
                T.writes()
                pos: T.let[T.int64] = T.cast(position_map[i], "int64")
                if pos != T.int64(-1):
                    for d in T.serial(head_dim):
                        pages[pos // page_size, pos % page_size, d] = kv_data[i, d]

    return tir_kv_cache_transpose_append_mla_cpu


def compact_kv_copy_mla_cpu(head_dim: int, dtype: str) -> tirx.PrimFunc:
    """Move rows inside the MLA pages: ``row(dst) = row(src)`` for each copy pair.

    Signature (the ``f_compact_copy`` slot): ``f(pages[num_pages, P, head_dim],
    copy_length_indptr[batch+1] int32, copy_src_dst_pos[2, total] int32, batch_size: int32)``;
    positions are global slots ``page * P + offset``. The runtime only calls it after committing
    accepted token-tree nodes, which MLA does not support yet; it is here so the slot is typed.
    """

    @T.prim_func(s_tir=True)
    def compact_kv_copy_mla_cpu_func(
        var_pages: T.handle,
        var_copy_length_indptr: T.handle,
        var_copy_src_dst_pos: T.handle,
        batch_size: T.int32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        num_pages = T.int32()
        page_size = T.int32()
        total_copy_length = T.int32()
        pages_elem_offset = T.int64()
        indptr_elem_offset = T.int32()
        pos_elem_offset = T.int32()
        pages = T.match_buffer(
            var_pages, (num_pages, page_size, head_dim), dtype, elem_offset=pages_elem_offset
        )
        copy_length_indptr = T.match_buffer(
            var_copy_length_indptr, (batch_size + 1,), "int32", elem_offset=indptr_elem_offset
        )
        copy_src_dst_pos = T.match_buffer(
            var_copy_src_dst_pos, (2, total_copy_length), "int32", elem_offset=pos_elem_offset
        )
        for b in T.serial(batch_size):
            for i in T.serial(copy_length_indptr[b + 1] - copy_length_indptr[b]):
                with T.sblock("copy"):
                    T.reads()
                    T.writes()
                    src: T.let[T.int32] = copy_src_dst_pos[0, copy_length_indptr[b] + i]
                    dst: T.let[T.int32] = copy_src_dst_pos[1, copy_length_indptr[b] + i]
                    for d in T.serial(head_dim):
                        pages[dst // page_size, dst % page_size, d] = pages[
                            src // page_size, src % page_size, d
                        ]

    return compact_kv_copy_mla_cpu_func

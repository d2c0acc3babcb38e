"""CUDA kernel: the whole MLA prologue of absorbed attention (decode / extend) in one launch.

From the fused ``qkv_a_proj`` output it produces both tensors absorbed attention needs:

* ``q_lat[t, h] = [q_nope[t, h] @ W_UK[h], rope(q_pe[t, h])]`` ``[n, H, L + R]``, the query in
  latent space (what :func:`dsv2_mlc.model.mla_ops.absorb_query` computes);
* ``latent[t] = [w * RMSNorm(c_kv[t]), rope(k_pe[t])]`` ``[n, L + R]``, the cached latent (what
  the TE kernel :func:`dsv2_mlc.model.mla_ops.latent_norm_rope` computes).

Decode at batch 1 is launch-bound, so one launch does both, over enough blocks to fill the
GPU's SMs. Per token:

* block 0: the latent. Each thread squares ``ceil(L / threads)`` values of ``c_kv`` (kept in
  registers), a warp-shuffle sum plus one shared-memory step gives the row's sum of squares,
  then ``w * (x * rsqrt(mean + eps))`` (rounded to the dtype before the weight multiply, as the
  TE kernel and Hugging Face do) and the rope of the ``R`` key dims;
* blocks ``1 + h * TILES + tile``: ``cols`` latent columns of head ``h`` (64 in
  :data:`~.tiles.TABLE`: 8 tiles per head at L = 512, so 129 blocks at batch 1 for 16 heads).
  Each thread loads its share of the ``W_UK`` tile into registers before the PDL wait.
  ``threads`` = column groups (``VEC`` consecutive columns each: one 16-byte load of
  ``W_UK[h, d, c:c+VEC]`` per step, coalesced across the groups) x reduction groups (each
  ``ceil(nope / groups)`` of the ``nope`` steps); the partial sums meet in shared memory (padded
  so neither the stores nor the loads conflict much), float32 throughout and one rounding at the
  end. The last ``ceil(R / TILES)`` threads of each block also rotate their share of head ``h``'s
  ``R`` query rope dims;
* rope exactly as :func:`dsv2_mlc.rope.apply_rope` (DeepSeek's YaRN on interleaved pairs),
  from the forward pass's cos/sin table.

The query and the latent come from the same projection output for models without q-LoRA (the
same tensor passed twice: ``q`` at columns ``[0, H * (nope + R))``, the latent from column
``kv_offset``); with q-LoRA the query is ``q_b_proj``'s output. The reference is the Relax / TE
composition of the CPU path (checked against Hugging Face in CI); the CPU emulation test
(``tests/test_mla_prologue_emulation.py``) checks the CUDA code against NumPy.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..rope import rotate_pair
from .cuda_call import L2_PREFETCH, WAIT_THEN_RELEASE, grid_wait_source, l2_prefetch_source
from .tiles import MLAPrologueTiles, tuned

__all__ = ["build_mla_prologue", "mla_prologue_cuda"]

_LOAD_BYTES = 16
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def mla_prologue_cuda(
    num_heads: int,
    nope: int,
    rope_dim: int,
    lora: int,
    dtype: str,
    *,
    q_width: int,
    kv_width: int,
    kv_offset: int,
    eps: float,
) -> tirx.PrimFunc:
    """``f(q [n, q_width], kv [n, kv_width], w_uk [H, nope, L], norm_w [L], rope [n, R] float32,
    q_lat [n, H, L + R], latent [n, L + R])``: the query heads at columns ``[0, H * (nope + R))``
    of ``q``, ``[c_kv, k_pe]`` at columns ``[kv_offset, kv_offset + L + R)`` of ``kv``; ``rope``
    the tokens' cos/sin table (``dsv2_mlc.rope.rope_table``); ``eps`` of the latent
    RMSNorm (module docstring), with the tiles of :data:`~.tiles.TABLE`. Raises ``ValueError``
    for shapes it does not handle."""
    tiles = tuned("mla_prologue", shape=(num_heads, nope, rope_dim, lora, dtype))
    return build_mla_prologue(
        num_heads,
        nope,
        rope_dim,
        lora,
        dtype,
        tiles,
        q_width=q_width,
        kv_width=kv_width,
        kv_offset=kv_offset,
        eps=eps,
    )


def build_mla_prologue(
    num_heads: int,
    nope: int,
    rope_dim: int,
    lora: int,
    dtype: str,
    tiles: MLAPrologueTiles,
    *,
    q_width: int,
    kv_width: int,
    kv_offset: int,
    eps: float,
) -> tirx.PrimFunc:
    """:func:`mla_prologue_cuda` with the tiles given (the lab sweeps them).

    Before its PDL wait a column-tile block loads its share of its ``W_UK`` tile (``nope`` rows
    of ``cols`` values; weights, which no kernel writes) into registers, so the tile loads while
    the previous kernel finishes (schedules/results/mla_prologue.md); it reads everything else
    after the wait."""
    cols, threads = tiles.cols, tiles.threads
    H, QK, L, R = num_heads, nope + rope_dim, lora, rope_dim
    VEC = _LOAD_BYTES // _ELEM_BYTES.get(dtype, 2)
    problems = []
    if dtype not in _ELEM_BYTES:
        problems.append(f"dtype {dtype}")
    if L % VEC or R % 2:
        problems.append(f"L={L} (a multiple of {VEC}), rope={R} (even)")
    if threads % 32 or cols % VEC or threads % (cols // VEC) or cols > threads:
        problems.append(f"cols={cols}, threads={threads}")
    if q_width < H * QK or kv_offset + L + R > kv_width:
        problems.append(f"q_width={q_width}, kv_width={kv_width}, kv_offset={kv_offset}")
    TILES = (L + cols - 1) // cols
    RPT = (R + TILES - 1) // TILES  # query rope dims per column tile
    if RPT > threads:
        problems.append(f"rope={R} over {TILES} tiles of {threads} threads")
    if problems:
        raise ValueError(f"mla_prologue_cuda: unsupported {', '.join(problems)}")

    NB = 1 + H * TILES  # blocks per token: the latent, then the column tiles
    CG = cols // VEC  # column groups
    RG = threads // CG  # reduction groups
    DPG = (nope + RG - 1) // RG  # reduction steps per group
    S = cols + CG  # shared row stride of a reduction group (bank padding)
    WARPS = threads // 32
    LPT = (L + threads - 1) // threads  # latent values per thread
    RPB = (R + threads - 1) // threads  # latent rope dims per thread
    D_EXACT = DPG * RG == nope
    C_EXACT = TILES * cols == L
    L_EXACT = LPT * threads == L
    KVO, ROPE0 = kv_offset, threads - RPT
    ELEM = _ELEM_BYTES.get(dtype, 2)
    WPRE = DPG * VEC  # a thread's W_UK values in registers
    pf_name = _prefetch_wait_name(nope, L, ELEM)
    pf_src = _prefetch_wait_source(nope, L, ELEM, threads)

    @T.prim_func(private=True, s_tir=True)
    def mla_prologue(var_q: T.handle, var_kv: T.handle, w: T.Buffer((H, nope, L), dtype),
                     norm_w: T.Buffer((L,), dtype), var_tab: T.handle, var_q_lat: T.handle,
                     var_latent: T.handle):  # fmt: skip
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(var_q, (n, q_width), dtype)
        kv = T.match_buffer(var_kv, (n, kv_width), dtype)
        tab = T.match_buffer(var_tab, (n, R), "float32")
        q_lat = T.match_buffer(var_q_lat, (n, H, L + R), dtype)
        latent = T.match_buffer(var_latent, (n, L + R), dtype)
        for bx in T.thread_binding(n * NB, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("mla_prologue"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((RG * S,), "float32", scope="shared")
                    wsum = T.sblock_alloc_buffer((WARPS,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((VEC,), "float32", scope="local")
                    wv = T.sblock_alloc_buffer((VEC,), dtype, scope="local")
                    wpre = T.sblock_alloc_buffer((WPRE,), dtype, scope="local")
                    xs = T.sblock_alloc_buffer((LPT,), "float32", scope="local")
                    part = T.sblock_alloc_buffer((2,), "float32", scope="local")
                    t: T.let[T.int64] = bx // NB
                    b: T.let[T.int64] = bx % NB
                    # a column-tile block (b > 0): tile `tile` of head `h`; this thread's
                    # columns c0 ... c0 + VEC and reduction steps dg * DPG ...
                    h: T.let[T.int64] = T.max(b - 1, 0) // TILES
                    tile: T.let[T.int64] = T.max(b - 1, 0) % TILES
                    cg: T.let[T.int32] = tx % CG
                    dg: T.let[T.int32] = tx // CG
                    c0: T.let[T.int64] = tile * cols + cg * VEC
                    # this thread's share of the block's W_UK tile -> registers, then the
                    # PDL wait and the release (nothing read before it that a kernel writes)
                    if b > 0:
                        if C_EXACT or c0 < L:
                            for dd in T.unroll(DPG):
                                if D_EXACT or dg * DPG + dd < nope:
                                    for j in T.vectorized(VEC):
                                        wpre[dd * VEC + j] = w[h, dg * DPG + dd, c0 + j]
                    T.cuda.func_call(
                        pf_name,
                        T.address_of(w[h, 0, tile * cols]),
                        T.int64(0),
                        tx,
                        source_code=pf_src,
                    )
                    if b == 0:
                        # The latent: RMSNorm of c_kv, rope of k_pe.
                        part[0] = T.float32(0)
                        for i in T.unroll(LPT):
                            if L_EXACT or i * threads + tx < L:
                                xs[i] = T.cast(kv[t, KVO + i * threads + tx], "float32")
                                part[0] = part[0] + xs[i] * xs[i]
                        warp_sum: T.let[T.float32] = T.cuda.warp_reduce(part[0], "sum", 32)
                        if tx % 32 == 0:
                            wsum[tx // 32] = warp_sum
                        T.tvm_storage_sync("shared")
                        part[1] = T.float32(0)
                        for i in T.unroll(WARPS):
                            part[1] = part[1] + wsum[i]
                        inv: T.let[T.float32] = T.rsqrt(part[1] / T.float32(L) + T.float32(eps))
                        for i in T.unroll(LPT):
                            if L_EXACT or i * threads + tx < L:
                                latent[t, i * threads + tx] = norm_w[i * threads + tx] * T.cast(
                                    xs[i] * inv, dtype
                                )
                        for i in T.unroll(RPB):
                            if i * threads + tx < R:
                                ld: T.let[T.int32] = i * threads + tx
                                k_even: T.let[T.float32] = T.cast(
                                    kv[t, KVO + L + ld // 2 * 2], "float32"
                                )
                                k_odd: T.let[T.float32] = T.cast(
                                    kv[t, KVO + L + ld // 2 * 2 + 1], "float32"
                                )
                                latent[t, L + ld] = T.cast(
                                    rotate_pair(
                                        ld, k_even, k_odd, tab[t, ld // 2 * 2],
                                        tab[t, ld // 2 * 2 + 1],
                                    ),
                                    dtype,
                                )  # fmt: skip
                    else:
                        # Column tile `tile` of head `h`: q_nope @ W_UK, and a share of the rope.
                        for j in T.unroll(VEC):
                            acc[j] = T.float32(0)
                        if C_EXACT or c0 < L:
                            for dd in T.unroll(DPG):
                                if D_EXACT or dg * DPG + dd < nope:
                                    qv: T.let[T.float32] = T.cast(
                                        q[t, h * QK + dg * DPG + dd], "float32"
                                    )
                                    for j in T.vectorized(VEC):
                                        wv[j] = wpre[dd * VEC + j]
                                    for j in T.unroll(VEC):
                                        acc[j] = acc[j] + qv * T.cast(wv[j], "float32")
                        for j in T.unroll(VEC):
                            red[dg * S + j * CG + cg] = acc[j]
                        if tx >= ROPE0:
                            qd: T.let[T.int64] = tile * RPT + (tx - ROPE0)
                            if qd < R:
                                q_even: T.let[T.float32] = T.cast(
                                    q[t, h * QK + nope + qd // 2 * 2], "float32"
                                )
                                q_odd: T.let[T.float32] = T.cast(
                                    q[t, h * QK + nope + qd // 2 * 2 + 1], "float32"
                                )
                                q_lat[t, h, L + qd] = T.cast(
                                    rotate_pair(
                                        qd, q_even, q_odd, tab[t, qd // 2 * 2],
                                        tab[t, qd // 2 * 2 + 1],
                                    ),
                                    dtype,
                                )  # fmt: skip
                        T.tvm_storage_sync("shared")
                        if tx < cols:
                            if C_EXACT or tile * cols + tx < L:
                                part[0] = T.float32(0)
                                for g in T.unroll(RG):
                                    part[0] = part[0] + red[g * S + tx % VEC * CG + tx // VEC]
                                q_lat[t, h, tile * cols + tx] = T.cast(part[0], dtype)

    return mla_prologue


def _prefetch_wait_name(rows: int, stride: int, elem: int) -> str:
    return f"mla_prologue_prefetch_wait_r{rows}_s{stride}_e{elem}"


def _prefetch_wait_source(rows: int, stride: int, elem: int, threads: int) -> str:
    """CUDA: ``mla_prologue_prefetch_wait_*(tile, cols, tid)``: threads ``< rows`` each ask L2
    for one row of a ``W_UK`` tile (``cols`` values of ``elem`` bytes from ``tile + row *
    stride``; nothing for ``cols == 0``), then the PDL wait and the release. The kernel passes
    ``cols == 0`` (its threads have loaded their tile into registers before the call), so the
    call is its wait and release; the prefetch loop stays in the source, which the kernel's
    generated code carries unchanged."""
    name = _prefetch_wait_name(rows, stride, elem)
    return (
        grid_wait_source()
        + l2_prefetch_source()
        + f"""
#ifndef {name.upper()}
#define {name.upper()}
__device__ __forceinline__ void {name}(const void* tile, long long cols, int tid) {{
  const char* base = static_cast<const char*>(tile);
  for (int r = tid; cols > 0 && r < {rows}; r += {threads})
    {L2_PREFETCH}(base + (long long)r * {stride * elem}, (unsigned)(cols * {elem}));
  {WAIT_THEN_RELEASE}
}}
#endif
"""
    )

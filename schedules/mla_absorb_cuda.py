"""CUDA kernel of absorbed MLA attention's query side alone: the kernel lab's baseline.

The model now runs :mod:`dsv2_mlc.schedules.mla_prologue_cuda` instead (this query side plus the
cached latent's RMSNorm + RoPE in one launch, with more blocks);
``schedules/lab/kernel_lab_absorb.py``
times the two against each other. What this kernel does:

Absorbed attention needs the query in latent space, ``q_lat[t, h] = [q_nope[t, h] @ W_UK[h],
rope(q_pe[t, h])]`` (``[n, H, kv_lora_rank + rope]``). Written as Relax ops this is a split, a
transpose, a batched matmul and a rope + transpose + concatenate: five launches per layer, 15.6 us
at batch 1 on the H200 (CUPTI, docs/benchmarks.md), for 2 MB of ``W_UK``. :func:`absorb_q_cuda`
does it in one launch straight from the ``q_proj`` output ``[n, H * (nope + rope)]``:

* blocks ``(t, h, column tile)``: each of the ``ceil(L / 128)`` tiles computes 128 latent columns
  of one head; one more tile per ``(t, h)`` rotates the ``rope`` query dims;
* 128 threads = 16 column groups x 8 reduction groups: a thread owns 8 consecutive columns (one
  16-byte load of ``W_UK[h, d, c:c+8]`` per step, coalesced across the 16 groups) and
  ``ceil(nope / 8)`` of the ``nope`` reduction steps; the 8 partial sums per column meet in
  shared memory (float32 throughout, one rounding at the end);
* rope exactly as :func:`dsv2_mlc.model.rope.apply_rope` (DeepSeek's YaRN on interleaved pairs),
  from the forward pass's cos/sin table.

``schedules/lab/kernel_lab_absorb.py`` checks this kernel against a torch float32 reference on the
GPU.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..rope import rotate_pair

__all__ = ["absorb_q_cuda"]

_THREADS = 128
_COLS = 128  # latent columns per block
_VEC = 8  # columns per thread (one 16-byte fp16 load)
_COL_GROUPS = _COLS // _VEC  # 16
_RED_GROUPS = _THREADS // _COL_GROUPS  # 8


def absorb_q_cuda(num_heads: int, nope: int, rope_dim: int, lora: int, dtype: str) -> tirx.PrimFunc:
    """``f(q [n, H*(nope+rope)], w_uk [H, nope, L], rope [n, rope] float32) -> q_lat [n, H,
    L+rope]`` with ``rope`` the tokens' cos/sin table (``dsv2_mlc.model.rope.rope_table``;
    module docstring)."""
    if lora % _VEC or rope_dim > _THREADS or rope_dim % 2:
        raise ValueError(f"absorb_q_cuda: unsupported shapes (L={lora}, rope={rope_dim})")
    H, QK, L, R = num_heads, nope + rope_dim, lora, rope_dim
    n_tiles = (L + _COLS - 1) // _COLS
    NB = n_tiles + 1  # + the rope tile
    DPG = (nope + _RED_GROUPS - 1) // _RED_GROUPS  # reduction steps per group
    D_EXACT = DPG * _RED_GROUPS == nope
    C_EXACT = n_tiles * _COLS == L

    @T.prim_func(private=True, s_tir=True)
    def absorb_q(var_q: T.handle, w: T.Buffer((H, nope, L), dtype), var_pos: T.handle,
                 var_out: T.handle):  # fmt: skip
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(var_q, (n, H * QK), dtype)
        tab = T.match_buffer(var_pos, (n, R), "float32")
        out = T.match_buffer(var_out, (n, H, L + R), dtype)
        for bx in T.thread_binding(n * (H * NB), thread="blockIdx.x"):
            for tx in T.thread_binding(_THREADS, thread="threadIdx.x"):
                with T.sblock("absorb_q"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((_RED_GROUPS * _COLS,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((_VEC,), "float32", scope="local")
                    wv = T.sblock_alloc_buffer((_VEC,), dtype, scope="local")
                    t: T.let[T.int64] = bx // (H * NB)
                    h: T.let[T.int64] = bx // NB % H
                    tile: T.let[T.int64] = bx % NB
                    if tile < n_tiles:
                        cg: T.let[T.int32] = tx % _COL_GROUPS
                        dg: T.let[T.int32] = tx // _COL_GROUPS
                        c0: T.let[T.int64] = tile * _COLS + cg * _VEC
                        for j in T.unroll(_VEC):
                            acc[j] = T.float32(0)
                        if C_EXACT or c0 < L:
                            for dd in T.unroll(DPG):
                                if D_EXACT or dg * DPG + dd < nope:
                                    qv: T.let[T.float32] = T.cast(
                                        q[t, h * QK + dg * DPG + dd], "float32"
                                    )
                                    for j in T.vectorized(_VEC):
                                        wv[j] = w[h, dg * DPG + dd, c0 + j]
                                    for j in T.unroll(_VEC):
                                        acc[j] = acc[j] + qv * T.cast(wv[j], "float32")
                        for j in T.unroll(_VEC):
                            red[dg * _COLS + cg * _VEC + j] = acc[j]
                        T.tvm_storage_sync("shared")
                        if C_EXACT or tile * _COLS + tx < L:
                            acc[0] = T.float32(0)
                            for g in T.unroll(_RED_GROUPS):
                                acc[0] = acc[0] + red[g * _COLS + tx]
                            out[t, h, tile * _COLS + tx] = T.cast(acc[0], dtype)
                    elif tx < R:
                        even: T.let[T.float32] = T.cast(
                            q[t, h * QK + nope + tx // 2 * 2], "float32"
                        )
                        odd: T.let[T.float32] = T.cast(
                            q[t, h * QK + nope + tx // 2 * 2 + 1], "float32"
                        )
                        out[t, h, L + tx] = T.cast(
                            rotate_pair(
                                tx, even, odd, tab[t, tx // 2 * 2], tab[t, tx // 2 * 2 + 1]
                            ),
                            dtype,
                        )

    return absorb_q

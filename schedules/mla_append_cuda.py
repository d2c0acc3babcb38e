"""The MLA latent cache's append on CUDA as a hand kernel that releases its dependents first.

TVM's ``tir_kv_cache_transpose_append_mla`` (the cache's ``f_transpose_append_mla`` slot: the
new tokens' latent rows ``[n, L + R]`` into their page slots) is a scheduled TIR kernel; in a
``--pdl`` build ``passes/grid_dependency_control.py`` starts it with the PDL wait and it releases
the next kernel at its exit. In a decode step that next kernel is the attention's split kernel,
so the split block's own preamble (page tables, the page ids of its split, its pages asked of
L2 and its old pages copied) would start only once the append has finished, and the append only
once the MLA prologue has.

:func:`mla_append_cuda` has the same ABI, one block of ``(L + R) / 8`` threads a token, a
16-byte copy per thread (rows of ``position_map == -1`` are skipped, as in TVM's kernel), and
calls :data:`~.cuda_call.RELEASE_THEN_WAIT` first: the split kernel is launched while the
append still waits for the prologue, so the split's preamble overlaps the prologue. Safe by
:func:`~.cuda_call.grid_wait_source`'s rule: the append has nothing to read or write before its
wait, and the split's wait returns only once the append, hence the prologue, has completed.
Without programmatic launches both instructions are no-ops.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cuda_call import RELEASE_THEN_WAIT, grid_wait_source

__all__ = ["mla_append_cuda", "mla_append_cuda_supports"]

_ELEM_BYTES = {"float16": 2, "float32": 4}
_CTYPE = {"float16": "half", "float32": "float"}


def mla_append_cuda_supports(d_qk: int, dtype: str, page_size: int = 16) -> bool:
    """Whether :func:`mla_append_cuda` takes rows of ``d_qk`` ``dtype`` values (whole 16-byte
    pieces, at most 1024 threads a token)."""
    if dtype not in _ELEM_BYTES or page_size < 1:
        return False
    row = d_qk * _ELEM_BYTES[dtype]
    return row % 16 == 0 and 0 < row // 16 <= 1024


def mla_append_cuda(d_qk: int, dtype: str = "float16", page_size: int = 16) -> tirx.PrimFunc:
    """``f(pages [P, page_size, d_qk], kv_data [n, d_qk], position_map [n] int32)``:
    ``pages[pos // page_size, pos % page_size] = kv_data[t]`` for ``pos = position_map[t] !=
    -1`` (module docstring). The pages' element offset must keep rows 16-byte aligned (the
    cache allocates each layer's pages on its own)."""
    if not mla_append_cuda_supports(d_qk, dtype, page_size):
        raise ValueError(
            f"mla_append_cuda needs rows of whole 16-byte pieces (at most 1024), got {d_qk} x "
            f"{dtype}"
        )
    nv = d_qk * _ELEM_BYTES[dtype] // 16  # threads of a token: one 16-byte piece each
    tag = f"{d_qk}_{dtype}"
    ctype = _CTYPE[dtype]
    fname = f"dsv2_mla_append_{tag}"
    src = (
        grid_wait_source()
        + f"""
#ifndef DSV2_MLA_APPEND_{tag}
#define DSV2_MLA_APPEND_{tag}
__device__ __forceinline__ void {fname}({ctype}* __restrict__ pages,
    const {ctype}* __restrict__ kv, const int* __restrict__ position_map, long long t, int tx) {{
  {RELEASE_THEN_WAIT}  // (PDL) nothing to load before it: the next kernel may start now
  const int pos = position_map[t];
  if (pos == -1) return;
  reinterpret_cast<uint4*>(pages + (long long)pos * {d_qk})[tx] =
      reinterpret_cast<const uint4*>(kv + t * {d_qk})[tx];
}}
#endif
"""
    )

    @T.prim_func(s_tir=True)
    def mla_append_release_first(
        var_pages: T.handle, var_kv_data: T.handle, var_position_map: T.handle
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        ntoken = T.int64()
        num_pages = T.int64()
        pages_elem_offset = T.int64()
        position_map_elem_offset = T.int32()
        pages = T.match_buffer(
            var_pages, (num_pages, page_size, d_qk), dtype, elem_offset=pages_elem_offset
        )
        kv_data = T.match_buffer(var_kv_data, (ntoken, d_qk), dtype)
        position_map = T.match_buffer(
            var_position_map, (ntoken,), "int32", elem_offset=position_map_elem_offset
        )
        for bx in T.thread_binding(ntoken, thread="blockIdx.x"):
            for tx in T.thread_binding(nv, thread="threadIdx.x"):
                with T.sblock("append"):
                    T.reads()
                    T.writes()
                    T.cuda.func_call(
                        fname,
                        T.address_of(pages[0, 0, 0]),
                        T.address_of(kv_data[0, 0]),
                        T.address_of(position_map[0]),
                        bx,
                        tx,
                        source_code=src,
                    )

    return mla_append_release_first

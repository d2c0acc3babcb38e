"""INT4 group dequantization on CUDA: a thread per packed word, its 8 values in one 16-byte store.

Prefill and extend dequantize each INT4 weight of a dense matmul to fp16 (``[rows, k]``) for the
tensor-core matmul that follows (decode folds the dequantization into its GEMVs instead). The TE
(``dsv2_mlc/quant/modules.py``: ``(nibble - 8) * scale`` in float32, rounded to fp16 once) got
dlight's ``Fallback``: a thread per value, each loading its packed word and scale again, 2-byte
stores, several times slower than the stores need (schedules/results/prefill_small_kernels.md),
a cost paid again by every prefill call whatever its length.

Here thread ``i`` of the flattened ``rows * k / 8`` words reads word ``i`` and its group's scale,
and writes values ``8 i .. 8 i + 7`` (nibble ``j`` is value ``8 i + j``) with the same float32
arithmetic and single rounding: bit-identical to the TE.
"""

from __future__ import annotations

from tvm import tirx

from .cuda_call import buffer_dims, token_grid_call

__all__ = ["DEQUANTIZE_ATTR", "THREADS", "dequantize_int4_kernel", "dequantize_int4_rows"]

# PrimFunc attribute (value: the group size) of the dequantize TEs (dsv2_mlc/quant/modules.py), by
# which FuseDequantizeMatmul recognises them and :func:`dequantize_int4_kernel` replaces them.
DEQUANTIZE_ATTR = "dsv2_mlc.dequantize_int4_group"
THREADS = 256


def dequantize_int4_rows(rows: int, k: int, group: int) -> tirx.PrimFunc:
    """``f(qw [rows, k/8] uint32, qs [rows, k/group] fp16, out [rows, k] fp16)``."""
    if k % 8 or group % 8:
        raise ValueError(f"k {k} and group {group} must be multiples of 8")
    kw, ng = k // 8, -(-k // group)  # the last group may be partial (10944 = 85.5 x 128)
    words = rows * kw
    tag = f"r{rows}_k{k}_g{group}"
    src = f"""
#ifndef DSV2_DEQUANT_{tag}
#define DSV2_DEQUANT_{tag}
__device__ __forceinline__ void dsv2_dequant_{tag}(const unsigned* __restrict__ qw,
    const half* __restrict__ qs, half* __restrict__ out, long long n, int blk, int tid) {{
  const long long i = (long long)blk * {THREADS} + tid;
  if (i >= {words}LL) return;
  const long long r = i / {kw};
  const int w = (int)(i - r * {kw});
  const unsigned word = qw[i];
  const float sc = __half2float(qs[r * {ng} + (w * 8) / {group}]);
  __align__(16) half v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {{
    v[j] = __float2half_rn(((float)((word >> (4 * j)) & 15u) - 8.0f) * sc);
  }}
  *reinterpret_cast<uint4*>(out + i * 8) = *reinterpret_cast<const uint4*>(v);
}}
#endif
"""
    params = [
        ("qw", [rows, kw], "uint32"),
        ("qs", [rows, ng], "float16"),
        ("out", [rows, k], "float16"),
    ]
    blocks = -(-words // THREADS)
    return token_grid_call(
        "dequantize_int4", f"dsv2_dequant_{tag}", src, params, blocks, THREADS, per_token=False
    )


def dequantize_int4_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """:func:`dequantize_int4_rows` for ``func``, a dequantize TE (tagged ``DEQUANTIZE_ATTR``)
    of a 2-D weight with fp16 output and fixed shapes (``qw, qs, out`` in that order); None for
    any other (dlight's then)."""
    if func.attrs is None or DEQUANTIZE_ATTR not in func.attrs:
        return None
    group = int(func.attrs[DEQUANTIZE_ATTR])
    dims = buffer_dims(func, [("uint32", 2), ("float16", 2), ("float16", 2)])
    if dims is None or None in (d for shape in dims for d in shape):
        return None
    (rows, kw), (rows_s, ng), (rows_o, k) = dims
    if rows_s != rows or rows_o != rows or k != 8 * kw or group <= 0 or group % 8:
        return None
    if ng != -(-k // group):
        return None
    return dequantize_int4_rows(rows, k, group)

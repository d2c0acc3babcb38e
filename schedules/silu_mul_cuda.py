"""SwiGLU over a fused gate/up projection (``silu(gu[:, :I]) * gu[:, I:]``) on CUDA: a thread per 8
outputs, 16-byte loads of gate and up and a 16-byte store.

``passes/fuse_gate_up_silu_mul.py`` makes it one TE (tagged ``SILU_MUL_ATTR``), which dlight's
``Fallback`` would run a thread per value with 2-byte accesses, about 3.4x slower
(schedules/results/prefill_small_kernels.md). Decode folds the same TE into its down-projection GEMV
instead (the fused kernel carries no tag). The arithmetic is the TE's: ``g * sigmoid(g) * u`` in
float32, rounded to fp16 once; ``sigmoid(g) = 1 / (1 + exp(-g))``.
"""

from __future__ import annotations

from tvm import tirx

from .cuda_call import TOKENS, buffer_dims, token_grid_call

__all__ = ["SILU_MUL_ATTR", "THREADS", "silu_mul_cuda", "silu_mul_kernel"]

SILU_MUL_ATTR = "dsv2_mlc.silu_mul"  # PrimFunc attribute of the SwiGLU TE
THREADS = 128


def silu_mul_cuda(inter: int) -> tirx.PrimFunc:
    """``f(gu [n, 2 * inter] fp16, out [n, inter] fp16)``."""
    if inter % 8:
        raise ValueError(f"intermediate size {inter} is not a multiple of 8")
    chunks = inter // 8
    bpt = -(-chunks // THREADS)
    name = f"dsv2_silu_mul_i{inter}"
    src = f"""
#ifndef DSV2_SILU_MUL_I{inter}
#define DSV2_SILU_MUL_I{inter}
__device__ __forceinline__ void {name}(const half* __restrict__ gu, half* __restrict__ out,
    long long t, int blk, int tid) {{
  const int c = blk * {THREADS} + tid;
  if (c >= {chunks}) return;
  const half* row = gu + t * {2 * inter} + c * 8;
  const uint4 graw = *reinterpret_cast<const uint4*>(row);
  const uint4 uraw = *reinterpret_cast<const uint4*>(row + {inter});
  const half* g = reinterpret_cast<const half*>(&graw);
  const half* u = reinterpret_cast<const half*>(&uraw);
  __align__(16) half r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {{
    const float gf = __half2float(g[j]);
    r[j] = __float2half_rn(gf * (1.0f / (1.0f + expf(-gf))) * __half2float(u[j]));
  }}
  *reinterpret_cast<uint4*>(out + t * {inter} + c * 8) = *reinterpret_cast<const uint4*>(r);
}}
#endif
"""
    params = [("gu", [TOKENS, 2 * inter], "float16"), ("out", [TOKENS, inter], "float16")]
    return token_grid_call("silu_mul", name, src, params, bpt, THREADS)


def silu_mul_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """:func:`silu_mul_cuda` for a tagged 2-D fp16 SwiGLU TE whose width is a multiple of 8;
    None otherwise (dlight's schedule then)."""
    if func.attrs is None or SILU_MUL_ATTR not in func.attrs:
        return None
    dims = buffer_dims(func, [("float16", 2), ("float16", 2)])
    if dims is None:
        return None
    (_, both), (_, inter) = dims
    if inter is None or both != 2 * inter or inter % 8:
        return None
    return silu_mul_cuda(inter)

"""Greedy decoding on the device: the arg-max of each row of the logits, one int32 per row.

Semantics are ``np.argmax`` over the last axis: ties go to the lowest index, a NaN counts as
larger than every number (the first NaN of a row wins), and ``-0.0 == +0.0``. Rows hold at least
one element; any vocabulary size is fine.

* CPU (:func:`argmax_cpu`): one loop per row, rows in parallel.
* GPU (:func:`argmax_gpu`): one block of 1024 threads per row. Each thread scans a strided slice
  (``float4`` loads when the row is 16-byte aligned), keeping the best element as one 64-bit key
  ``(order-preserving bits of the value) << 32 | ~index``, so "larger value, else lower index"
  is a plain unsigned maximum, exact whatever the float flags of the build (nvcc runs with
  ``--use_fast_math``: flushed denormals and NaN-unaware compares cannot change the result).
  Then warp-shuffle maxima, one key per warp through shared memory, and warp 0 finishes.

:func:`greedy_argmax` picks by target. The logits are ``[rows, 1, vocab]`` float32 (the
``batch_decode`` output as it is); the result is ``[rows]`` int32.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

__all__ = ["GPU_THREADS", "argmax_cpu", "argmax_gpu", "greedy_argmax"]

GPU_THREADS = 1024  # threads per row (block) of the GPU kernel; 32 warps


def argmax_cpu() -> tirx.PrimFunc:
    """``f(logits[n, 1, V] f32, out[n] i32)`` for the LLVM target: a scan per row, rows in
    parallel."""

    @T.prim_func(private=True, s_tir=True)
    def argmax(var_logits: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n, vocab = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (n, 1, vocab), "float32")
        out = T.match_buffer(var_out, (n,), "int32")
        for r in T.parallel(n):
            with T.sblock("argmax"):
                T.reads()
                T.writes()
                best = T.sblock_alloc_buffer((1,), "float32")
                best_i = T.sblock_alloc_buffer((1,), "int64")
                best[0] = logits[r, 0, 0]
                best_i[0] = T.int64(0)
                for i in range(T.int64(1), vocab):
                    # strictly better only (indices grow): a first NaN beats any number, later
                    # NaNs beat nothing; ``>`` is false whenever a NaN is involved
                    if (T.isnan(logits[r, 0, i]) and not T.isnan(best[0])) or (
                        logits[r, 0, i] > best[0]
                    ):
                        best[0] = logits[r, 0, i]
                        best_i[0] = i
                out[r] = T.Cast("int32", best_i[0])

    return argmax


_FUNC = f"dsv2_argmax_row_t{GPU_THREADS}"

# One row per block of GPU_THREADS threads; ``out`` is written by thread 0.
_SOURCE = f"""
#ifndef DSV2_ARGMAX_ROW_T{GPU_THREADS}
#define DSV2_ARGMAX_ROW_T{GPU_THREADS}
// (value, index) -> a key whose unsigned order is "larger value, then lower index" with
// np.argmax's float order: any NaN above +inf, -0.0 equal to +0.0. Never 0 (the empty key).
__device__ __forceinline__ unsigned long long dsv2_argmax_key(float v, int i) {{
  const unsigned b = __float_as_uint(v);
  unsigned k;
  if ((b & 0x7fffffffu) > 0x7f800000u) k = 0xffffffffu;  // NaN
  else if (b == 0x80000000u) k = 0x80000000u;             // -0.0 as +0.0
  else k = (b & 0x80000000u) ? ~b : (b | 0x80000000u);    // order-preserving bits
  return ((unsigned long long)k << 32) | (unsigned)(~i);
}}
__device__ __forceinline__ unsigned long long dsv2_argmax_max(unsigned long long a,
                                                             unsigned long long b) {{
  return a > b ? a : b;
}}
__device__ __forceinline__ void {_FUNC}(const float* __restrict__ row, int vocab,
                                        int* __restrict__ out, int tid) {{
  __shared__ unsigned long long warp_best[{GPU_THREADS // 32}];
  unsigned long long best = 0ull;
  if ((vocab & 3) == 0 && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0ull) {{
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const int n4 = vocab >> 2;
#pragma unroll 4
    for (int j = tid; j < n4; j += {GPU_THREADS}) {{
      const float4 v = row4[j];
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.x, 4 * j));
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.y, 4 * j + 1));
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.z, 4 * j + 2));
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.w, 4 * j + 3));
    }}
  }} else {{
#pragma unroll 4
    for (int j = tid; j < vocab; j += {GPU_THREADS}) {{
      best = dsv2_argmax_max(best, dsv2_argmax_key(row[j], j));
    }}
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {{
    best = dsv2_argmax_max(best, __shfl_xor_sync(0xffffffffu, best, o));
  }}
  if ((tid & 31) == 0) warp_best[tid >> 5] = best;
  __syncthreads();
  if (tid < 32) {{
    best = tid < {GPU_THREADS // 32} ? warp_best[tid] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {{
      best = dsv2_argmax_max(best, __shfl_xor_sync(0xffffffffu, best, o));
    }}
    if (tid == 0) *out = (int)(~(unsigned)(best & 0xffffffffull));
  }}
}}
#endif
"""


def argmax_gpu() -> tirx.PrimFunc:
    """The same arg-max for GPU targets: one block of ``GPU_THREADS`` threads per row (see the
    module docstring; the reduction is CUDA source through ``T.cuda.func_call``)."""

    @T.prim_func(private=True, s_tir=True)
    def argmax(var_logits: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n, vocab = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (n, 1, vocab), "float32")
        out = T.match_buffer(var_out, (n,), "int32")
        for bx in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(GPU_THREADS, thread="threadIdx.x"):
                with T.sblock("argmax"):
                    T.reads()
                    T.writes()
                    T.cuda.func_call(
                        _FUNC,
                        T.address_of(logits[bx, 0, 0]),
                        T.Cast("int32", vocab),
                        T.address_of(out[bx]),
                        T.Cast("int32", tx),
                        source_code=_SOURCE,
                    )

    return argmax


def greedy_argmax(target: Target | None) -> tirx.PrimFunc:
    """The arg-max kernel for ``target``: :func:`argmax_gpu` if it has the ``gpu`` key, else
    :func:`argmax_cpu` (also for ``target=None``)."""
    gpu = target is not None and "gpu" in target.keys
    return argmax_gpu() if gpu else argmax_cpu()

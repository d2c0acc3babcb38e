"""Greedy decoding on the device: the arg-max of each row of the logits, one int32 per row.

Semantics are ``np.argmax`` over the last axis: ties go to the lowest index, a NaN counts as
larger than every number (the first NaN of a row wins), and ``-0.0 == +0.0``. Rows hold at least
one element; any vocabulary size is fine.

* CPU (:func:`argmax_cpu`): one loop per row, rows in parallel.
* GPU (:func:`argmax_gpu`): grid ``(chunks, rows)`` of ``GPU_THREADS`` threads. A block scans one
  chunk of its row (:func:`argmax_chunks`: ``CHUNK`` = 2,048 floats, at most ``MAX_CHUNKS`` = 128
  chunks a row, longer chunks past that), each thread a strided slice (``float4`` loads when the
  row is 16-byte aligned), keeping the best element as one 64-bit key ``(order-preserving bits of
  the value) << 32 | ~index``, so "larger value, else lower index" is a plain unsigned maximum,
  exact whatever the float flags of the build (nvcc runs with ``--use_fast_math``: flushed
  denormals and NaN-unaware compares cannot change the result). Warp-shuffle maxima and one key
  per warp through shared memory give the block's key; it goes to a device-global slot of its
  (row, chunk), then (after a ``__threadfence``) the block takes a ticket from its row's
  device-global counter; the block that takes the last ticket reduces the row's keys, writes the
  token and sets the counter back to 0 for the next launch (the counters start at 0 when the
  module is loaded; the ticket pattern of CUDA's ``threadFenceReduction`` sample). Rows past
  ``MAX_ROWS`` (64; decode steps have at most 31) are scanned by one block each instead.

  Many blocks per row rather than one block of 1,024 threads: one block scanning V2's 102,400
  logits alone takes ~1 % of a decode step (schedules/results/decode_kernels.md).

:func:`greedy_argmax` picks by target. The logits are ``[rows, 1, vocab]`` float32 (the
``batch_decode`` output as it is); the result is ``[rows]`` int32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

__all__ = [
    "CHUNK",
    "GPU_THREADS",
    "MAX_CHUNKS",
    "MAX_ROWS",
    "argmax_chunks",
    "argmax_cpu",
    "argmax_gpu",
    "greedy_argmax",
]

GPU_THREADS = 256  # threads per block of the GPU kernel; 8 warps
CHUNK = 2048  # floats a block scans (two float4 loads a thread), until MAX_CHUNKS blocks a row
MAX_CHUNKS = 128  # blocks a row at most (one key per thread in the last block's reduction)
MAX_ROWS = 64  # rows with a ticket counter; rows past it are scanned by one block each


def argmax_chunks(vocab: Any, lo: Callable = min, hi: Callable = max) -> tuple[Any, Any]:
    """``(chunks, chunk)``: the blocks of a row of ``vocab`` logits and the floats each scans
    (a multiple of 4, so every chunk of an aligned row starts aligned). ``vocab`` an int, or a
    TIR expression with ``lo, hi = T.min, T.max`` (the kernel's grid: the same arithmetic)."""
    chunks = lo(hi((vocab + CHUNK - 1) // CHUNK, 1), MAX_CHUNKS)
    per = (vocab + chunks - 1) // chunks
    return chunks, (per + 3) // 4 * 4


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


_FUNC = f"dsv2_argmax_chunk_t{GPU_THREADS}"
_GUARD = f"DSV2_ARGMAX_CHUNK_T{GPU_THREADS}"
_NW = GPU_THREADS // 32

# One (chunk, row) per block of GPU_THREADS threads; the last block of a row writes ``out``.
_SOURCE = f"""
#ifndef {_GUARD}
#define {_GUARD}
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
// The block's best key (every thread gets it); red: {_NW} shared keys.
__device__ __forceinline__ unsigned long long dsv2_argmax_block(unsigned long long best,
    unsigned long long* red, int tid) {{
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {{
    best = dsv2_argmax_max(best, __shfl_xor_sync(0xffffffffu, best, o));
  }}
  if ((tid & 31) == 0) red[tid >> 5] = best;
  __syncthreads();
  best = red[0];
#pragma unroll
  for (int w = 1; w < {_NW}; ++w) best = dsv2_argmax_max(best, red[w]);
  return best;
}}
// Best key of row[lo, hi) over the block's threads (float4 loads when row and lo are aligned).
__device__ __forceinline__ unsigned long long dsv2_argmax_scan(const float* __restrict__ row,
    int lo, int hi, int tid) {{
  unsigned long long best = 0ull;
  if ((lo & 3) == 0 && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0ull) {{
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const int n4 = (hi - lo) >> 2;
#pragma unroll 2
    for (int j = tid; j < n4; j += {GPU_THREADS}) {{
      const int i = lo + 4 * j;
      const float4 v = row4[i >> 2];
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.x, i));
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.y, i + 1));
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.z, i + 2));
      best = dsv2_argmax_max(best, dsv2_argmax_key(v.w, i + 3));
    }}
    for (int i = lo + 4 * n4 + tid; i < hi; i += {GPU_THREADS}) {{
      best = dsv2_argmax_max(best, dsv2_argmax_key(row[i], i));
    }}
  }} else {{
#pragma unroll 4
    for (int i = lo + tid; i < hi; i += {GPU_THREADS}) {{
      best = dsv2_argmax_max(best, dsv2_argmax_key(row[i], i));
    }}
  }}
  return best;
}}
__device__ unsigned long long dsv2_argmax_keys[{MAX_ROWS} * {MAX_CHUNKS}];
__device__ unsigned int dsv2_argmax_tickets[{MAX_ROWS}];
__device__ __forceinline__ void {_FUNC}(const float* __restrict__ row, int vocab, int chunks,
    int chunk, int r, int c, int* __restrict__ out, int tid) {{
  __shared__ unsigned long long red[{_NW}];
  __shared__ bool last;
  if (r >= {MAX_ROWS}) {{  // no counter: one block scans the row
    if (c == 0) {{
      const unsigned long long best = dsv2_argmax_block(dsv2_argmax_scan(row, 0, vocab, tid),
                                                        red, tid);
      if (tid == 0) *out = (int)(~(unsigned)(best & 0xffffffffull));
    }}
    return;
  }}
  const int lo = c * chunk;
  const int hi = lo + chunk < vocab ? lo + chunk : vocab;
  unsigned long long best = dsv2_argmax_block(dsv2_argmax_scan(row, lo, hi, tid), red, tid);
  if (tid == 0) {{
    dsv2_argmax_keys[r * {MAX_CHUNKS} + c] = best;
    __threadfence();  // the key is visible to every block before the ticket is
    last = atomicAdd(&dsv2_argmax_tickets[r], 1u) == (unsigned)(chunks - 1);
  }}
  __syncthreads();
  if (!last) return;  // (every thread read red, the block key, before the barrier above)
  const volatile unsigned long long* keys = dsv2_argmax_keys + r * {MAX_CHUNKS};
  best = tid < chunks ? keys[tid] : 0ull;
  best = dsv2_argmax_block(best, red, tid);
  if (tid == 0) {{
    *out = (int)(~(unsigned)(best & 0xffffffffull));
    dsv2_argmax_tickets[r] = 0u;  // ready for the next launch
  }}
}}
#endif
"""


def argmax_gpu() -> tirx.PrimFunc:
    """The same arg-max for GPU targets: ``(chunks, rows)`` blocks of ``GPU_THREADS`` threads
    (see the module docstring; the scan and the reductions are CUDA source through
    ``T.cuda.func_call``)."""

    def chunks_of(vocab):
        return argmax_chunks(vocab, T.min, T.max)[0]

    def chunk_of(vocab):
        return argmax_chunks(vocab, T.min, T.max)[1]

    @T.prim_func(private=True, s_tir=True)
    def argmax(var_logits: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n, vocab = T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (n, 1, vocab), "float32")
        out = T.match_buffer(var_out, (n,), "int32")
        for by in T.thread_binding(n, thread="blockIdx.y"):
            for bx in T.thread_binding(chunks_of(vocab), thread="blockIdx.x"):
                for tx in T.thread_binding(GPU_THREADS, thread="threadIdx.x"):
                    with T.sblock("argmax"):
                        T.reads()
                        T.writes()
                        T.cuda.func_call(
                            _FUNC,
                            T.address_of(logits[by, 0, 0]),
                            T.Cast("int32", vocab),
                            T.Cast("int32", chunks_of(vocab)),
                            T.Cast("int32", chunk_of(vocab)),
                            T.Cast("int32", by),
                            T.Cast("int32", bx),
                            T.address_of(out[by]),
                            T.Cast("int32", tx),
                            source_code=_SOURCE,
                        )

    return argmax


def greedy_argmax(target: Target | None) -> tirx.PrimFunc:
    """The arg-max kernel for ``target``: :func:`argmax_gpu` if it has the ``gpu`` key, else
    :func:`argmax_cpu` (also for ``target=None``)."""
    gpu = target is not None and "gpu" in target.keys
    return argmax_gpu() if gpu else argmax_cpu()

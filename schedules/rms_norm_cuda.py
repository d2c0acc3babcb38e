"""Row-per-block CUDA kernels for the fused residual add + RMSNorm: a hand kernel, else a schedule.

Where the fused kernel carries its epsilon (``passes/fuse_add_rms_norm.py`` sets it) and its
rows are 2-D fp16 of a width that is a multiple of 256, :func:`add_rms_norm_cuda` replaces it:
each of ``d / 8`` threads holds 8 values of the row in registers from one 16-byte load of each
input to the 16-byte stores of ``s`` and of the normalised row (the TIR schedule below re-reads
``s`` with 2-byte loads and normalises it with scalar stores, about 2.4x slower at 4096 rows of
2048; schedules/results/prefill_small_kernels.md).

The TIR schedule, for any other shape:

The kernel (``passes/fuse_add_rms_norm.py``) has three blocks over rows of ``d`` values: the sum
``s = a + b`` (an output, its block tagged ``ADD_RMS_NORM``), the sum of squares of ``s``, the
normalised row. One thread block per row; every block's row loop is split the same way
(``j = (jo * TX + tx) * VEC + v``), so each thread reads back only the ``s`` values it wrote
itself (no barrier needed); the sum is written with 16-byte vector stores (``a + b`` loaded the
same way, which makes the add about 1.6x faster; the normalised row stays scalar, as
TVM's CUDA codegen cannot vectorise its float32 x 8 broadcast); the sum of squares is a
block-wide reduction (``rfactor`` over the ``TX`` threads + TVM's cross-thread reduce: warp
shuffles, then shared memory).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .cuda_call import TOKENS, buffer_dims, token_grid_call
from .decode_gemv_cuda import DECODE_GEMV, tagged_blocks

ADD_RMS_NORM = (DECODE_GEMV[0], "add_rms_norm")
# PrimFunc attribute (value: epsilon) the model sets on its RMSNorm kernels (FuseAddRMSNorm finds
# them by it and carries it over to the fused kernel, which :func:`add_rms_norm_cuda` needs).
RMS_NORM_ATTR = "dsv2_mlc.rms_norm_eps"

TX = 256  # threads per row at most (one row of 2048 values: 8 per thread)
VEC = 8


def schedule_add_rms_norm(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """For a fused add + RMSNorm kernel: :func:`add_rms_norm_cuda` where ``func`` carries its
    epsilon (``RMS_NORM_ATTR``) and has its shape, else the TIR schedule of the module
    docstring; None if ``func`` is not such a kernel."""
    names = tagged_blocks(func, ADD_RMS_NORM[1])
    if len(names) != 1:
        return None
    if func.attrs is not None and RMS_NORM_ATTR in func.attrs:
        hand = _hand_kernel(func, float(func.attrs[RMS_NORM_ATTR]))
        if hand is not None:
            return hand
    try:
        return _norm(func)
    except Exception:  # noqa: BLE001 (a shape this schedule does not cover: leave it to dlight)
        return None


def add_rms_norm_cuda(d: int, eps: float) -> tirx.PrimFunc:
    """``f(a [n, d], b [n, d], w [d], s [n, d], y [n, d])`` (fp16): ``s = a + b`` (fp16, as the
    TE), ``y = w * fp16(s * rsqrt(sum(s^2) / d + eps))`` (float32 inside), one block of ``d / 8``
    threads per row, each with 8 values in registers: 16-byte loads and stores, one barrier."""
    threads = d // 8
    if d % 256 or threads > 1024:
        raise ValueError(f"row width {d} is not a multiple of 256 up to 8192")
    name = f"dsv2_add_rms_norm_d{d}"
    src = f"""
#ifndef DSV2_ADD_RMS_NORM_D{d}
#define DSV2_ADD_RMS_NORM_D{d}
__device__ __forceinline__ void {name}(const half* __restrict__ a, const half* __restrict__ b,
    const half* __restrict__ w, half* __restrict__ s_out, half* __restrict__ y, long long t,
    int blk, int tid) {{
  __shared__ float part[{threads // 32}];
  const long long off = t * {d} + tid * 8;
  uint4 sv = *reinterpret_cast<const uint4*>(a + off);
  const uint4 bv = *reinterpret_cast<const uint4*>(b + off);
  __half2* sh = reinterpret_cast<__half2*>(&sv);
  const __half2* bh = reinterpret_cast<const __half2*>(&bv);
  float sf[8], sq = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {{
    sh[j] = __hadd2(sh[j], bh[j]);
    const float2 f = __half22float2(sh[j]);
    sf[2 * j] = f.x;
    sf[2 * j + 1] = f.y;
    sq += f.x * f.x + f.y * f.y;
  }}
  *reinterpret_cast<uint4*>(s_out + off) = sv;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, m);
  if ((tid & 31) == 0) part[tid >> 5] = sq;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < {threads // 32}; ++i) total += part[i];
  const float inv = rsqrtf(total / {d}.0f + {eps!r}f);
  const uint4 wv = *reinterpret_cast<const uint4*>(w + tid * 8);
  const __half2* wh = reinterpret_cast<const __half2*>(&wv);
  __align__(16) __half2 r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {{
    r[j] = __hmul2(wh[j], __floats2half2_rn(sf[2 * j] * inv, sf[2 * j + 1] * inv));
  }}
  *reinterpret_cast<uint4*>(y + off) = *reinterpret_cast<const uint4*>(r);
}}
#endif
"""
    rows = [TOKENS, d]
    params = [
        ("a", rows, "float16"),
        ("b", rows, "float16"),
        ("w", [d], "float16"),
        ("s", rows, "float16"),
        ("y", rows, "float16"),
    ]
    return token_grid_call("add_rms_norm", name, src, params, 1, threads)


def _hand_kernel(func: tirx.PrimFunc, eps: float) -> tirx.PrimFunc | None:
    """:func:`add_rms_norm_cuda` for ``func`` (2-D fp16 rows of a width it takes), else None."""
    rows, vec = ("float16", 2), ("float16", 1)
    dims = buffer_dims(func, [rows, rows, vec, rows, rows])
    if dims is None:
        return None
    d = dims[0][1]
    if d is None or d % 256 or d // 8 > 1024:
        return None
    return add_rms_norm_cuda(d, eps)


def _norm(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The schedule, raising where ``func`` does not have its shape."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 3:
        return None
    add, sq, norm = blocks
    if sch.get(add).name_hint != tagged_blocks(func, ADD_RMS_NORM[1])[0]:
        return None
    d = int(sch.get(sch.get_loops(add)[-1]).extent)
    tx_n = min(TX, d // VEC)
    if d % VEC or (d // VEC) % tx_n:
        return None
    # the sum of squares: partial sums per thread (rf), then the block-wide reduce (sq)
    ro, tx, v = sch.split(sch.get_loops(sq)[-1], [None, tx_n, VEC])
    sch.reorder(tx, ro, v)
    rf = sch.rfactor(tx, factor_axis=0)
    # one thread block per row: everything under the row loop of ``s`` (an output block)
    *rows, j = sch.get_loops(add)
    row = sch.fuse(*rows)
    sch.bind(row, "blockIdx.x")
    _row_split(sch, j, tx_n)
    for blk in (rf, sq, norm):
        sch.reverse_compute_at(blk, row)
    rf_loops = sch.get_loops(rf)[1:]  # (tx, ro, v); ro dropped when it is 1
    sch.bind(rf_loops[0], "threadIdx.x")
    sch.unroll(rf_loops[-1])
    sch.bind(sch.get_loops(sq)[-1], "threadIdx.x")
    _row_split(sch, sch.get_loops(norm)[-1], tx_n, vector=False)
    sch.set_scope(rf, 0, "local")
    sch.set_scope(sq, 0, "local")  # every thread holds the row's sum after the reduce
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _row_split(
    sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, tx_n: int, vector: bool = True
) -> None:
    """``j = (jo * tx_n + tx) * VEC + v`` with ``tx`` on threadIdx.x (the rf block's split)."""
    jo, tx, v = sch.split(loop, [None, tx_n, VEC])
    sch.reorder(tx, jo, v)
    sch.bind(tx, "threadIdx.x")
    if vector:
        sch.vectorize(v)  # 16-byte loads and stores
    else:
        sch.unroll(v)

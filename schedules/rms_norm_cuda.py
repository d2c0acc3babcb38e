"""Row-per-block schedule (CUDA) for the fused residual add + RMSNorm kernel.

The kernel (``passes/fuse_add_rms_norm.py``) has three blocks over rows of ``d`` values: the sum
``s = a + b`` (an output, its block tagged ``ADD_RMS_NORM``), the sum of squares of ``s``, the
normalised row. One thread block per row; every block's row loop is split the same way
(``j = (jo * TX + tx) * VEC + v``), so each thread reads back only the ``s`` values it wrote
itself (no barrier needed); the sum is written with 16-byte vector stores (``a + b`` loaded the
same way: 59 -> 37 us per call at 4096 rows on the H200; the normalised row stays scalar, as
TVM's CUDA codegen cannot vectorise its float32 x 8 broadcast); the sum of squares is a
block-wide reduction (``rfactor`` over the ``TX`` threads + TVM's cross-thread reduce: warp
shuffles, then shared memory).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .decode_gemv_cuda import DECODE_GEMV, tagged_blocks

ADD_RMS_NORM = (DECODE_GEMV[0], "add_rms_norm")

TX = 256  # threads per row at most (one row of 2048 values: 8 per thread)
VEC = 8


def schedule_add_rms_norm(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The schedule of the module docstring, or None if ``func`` does not have its shape."""
    names = tagged_blocks(func, ADD_RMS_NORM[1])
    if len(names) != 1:
        return None
    try:
        return _norm(func)
    except Exception:  # noqa: BLE001 (a shape this schedule does not cover: leave it to dlight)
        return None


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

"""Batch-1 decode GEMV schedule (CUDA) for the tagged matrix-vector kernels.

Kernels tagged ``DECODE_GEMV`` (a block annotation set by their TE builders: the INT4
dequantize-matmuls, the routed-expert gather GEMVs, the router gate) have one reduction block
``out[s..., o] = sum_r x[s..., r] * W(s..., o, r)``. dlight's GEMV rule does not take them (the
batch extent is dynamic), and its Matmul rule tiles them for large batches, which is slow at
batch 1. This schedule: ``TY`` outputs per thread block, ``TX`` lanes (a warp, or 16) per
output; per step each lane reduces ``VEC`` consecutive elements of K (32 INT4 values = one
16-byte load of packed weights), its K-indexed operands staged in registers with 16-byte loads;
the lanes' partial sums are combined by a shuffle reduction (``rfactor`` + cross-thread reduce).
Epilogue blocks (casts, the expert-weight multiply, a residual add) are inlined or computed per
output under its lanes. A K that no ``(TX, VEC)`` divides is left to dlight.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

# Block annotation (key, value) the kernel builders set on the reduction block of a decode GEMV.
DECODE_GEMV = ("dsv2_mlc.decode_schedule", "gemv")

TY = 4  # output elements per thread block (one per group of TX lanes)
# (lanes reducing over K, consecutive K elements per lane and step), the first that divides K:
# 32 INT4 values = one 16-byte load of packed weights per lane and step.
SPLITS = ((32, 32), (32, 16), (32, 8), (16, 8))
# Fewer lanes only for a short K (a long K over 8 lanes measured slower than dlight on the H200).
SHORT_K, SHORT_K_SPLITS = 512, ((8, 8), (4, 8))
VEC_BYTES = 16  # widest load per lane


def tagged_blocks(func: tirx.PrimFunc, value: str) -> list[str]:
    """Names of the top-level blocks of ``func`` annotated ``{DECODE_GEMV[0]: value}``."""
    try:
        sch = s_tir.Schedule(func)
        blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 (no single root block: not one of ours)
        return []
    key = DECODE_GEMV[0]
    return [
        b.name_hint for b in blocks if key in b.annotations and str(b.annotations[key]) == value
    ]


def _inline_spatial(sch: s_tir.Schedule, keep: str) -> list[s_tir.schedule.SBlockRV]:
    """Inline every block but ``keep`` where possible; the blocks that remain (besides ``keep``)."""
    changed = True
    while changed:
        changed = False
        for blk in sch.get_child_blocks(sch.get_sblock("root")):
            if sch.get(blk).name_hint == keep:
                continue
            for inline in (sch.compute_inline, sch.reverse_compute_inline):
                try:
                    inline(blk)
                except Exception:  # noqa: BLE001, S112 (not inlinable: try the next)
                    continue
                changed = True
                break
            if changed:
                break
    return [b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint != keep]


def _vector_loads(sch: s_tir.Schedule, rf_name: str) -> s_tir.Schedule:
    """Stage each K-indexed operand of a lane's step in registers, with 16-byte loads."""
    for index in range(len(sch.get(sch.get_sblock(rf_name)).reads)):
        trial = sch.copy()
        try:
            block = trial.get_sblock(rf_name)
            dtype = trial.get(block).reads[index].source.dtype
            cache = trial.cache_read(block, index, "local")
            trial.compute_at(cache, trial.get_loops(block)[-2])  # under the lane's K step
            lanes = max(1, VEC_BYTES * 8 // tvm.DataType(str(dtype)).bits)
            extent = int(trial.get(trial.get_loops(cache)[-1]).extent)
            if extent < 2 or extent % lanes:  # a scale or an expert id: one value per step
                continue
            _, v = trial.split(trial.get_loops(cache)[-1], [None, lanes])
            trial.vectorize(v)
        except Exception:  # noqa: BLE001, S112 (not stageable: keep the direct loads)
            continue
        sch = trial
    return sch


def schedule_decode_gemv(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """The schedule of the module docstring, or None if ``func`` does not have its shape."""
    names = tagged_blocks(func, DECODE_GEMV[1])
    if len(names) != 1:
        return None
    try:
        return _gemv(func, names[0])
    except Exception:  # noqa: BLE001 (a shape this schedule does not cover: leave it to dlight)
        return None


def _gemv(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc | None:
    """The schedule, raising where ``func`` does not have its shape."""
    sch = s_tir.Schedule(func)
    rest = _inline_spatial(sch, name)
    main = sch.get_sblock(name)
    loops = sch.get_loops(main)
    iters = sch.get(main).iter_vars
    if len(loops) != len(iters) or iters[-1].iter_type != tirx.IterVar.CommReduce:
        return None
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in iters[:-1]):
        return None
    *spatial, red = loops
    k_dim = iters[-1].dom.extent
    if not isinstance(k_dim, tirx.IntImm):
        return None
    splits = SPLITS + (SHORT_K_SPLITS if int(k_dim) <= SHORT_K else ())
    split = next(((t, v) for t, v in splits if int(k_dim) % (t * v) == 0), None)
    if split is None:  # (dense layer-0 down, K=10944: dlight's kernel measured faster)
        return None
    tx_n, vec = split
    fused = sch.fuse(*spatial)
    bx, ty = sch.split(fused, [None, TY])
    ro, tx, vi = sch.split(red, [None, tx_n, vec])
    sch.reorder(bx, ty, tx, ro, vi)
    rf = sch.rfactor(tx, factor_axis=0)  # rf: partial sums per lane, in a new loop nest
    bx, ty, tx, ro, vi = sch.get_loops(rf)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(rf, 0, "local")
    sch = _vector_loads(sch, f"{name}_rf")
    rf = sch.get_sblock(f"{name}_rf")
    *_, ro, vi = sch.get_loops(rf)
    sch.unroll(vi)
    sch.annotate(ro, "pragma_auto_unroll_max_step", 64)
    sch.annotate(ro, "pragma_unroll_explicit", 1)
    main = sch.get_sblock(name)
    ty = sch.get_loops(rf)[1]
    sch.reverse_compute_at(main, ty)  # the warp's shuffle reduction of the 32 partial sums
    sch.bind(sch.get_loops(main)[-1], "threadIdx.x")
    if rest:  # the epilogue: per output element, under its warp (every lane holds the sum)
        sch.set_scope(main, 0, "local")
    for blk in rest:
        sch.reverse_compute_at(blk, ty)
    mod = sch.mod
    return mod["main"].with_attr("tirx.is_scheduled", True)

"""Expert-sorted grouped GEMMs for the routed experts in CUDA prefill: weights read per tile.

The gather kernels of :mod:`dsv2_mlc.model.moe` compute ``y[t, j] = W[idx[t, j]] @ x[t]`` as one
reduction per (token, slot, output) and re-read the expert weights for every token, which is right
for batch-1 decode and slow for prefill (most of a long prompt's time:
schedules/results/moe_grouped.md). Here the ``n * k`` (token, slot) pairs are sorted by expert
first, each expert's segment padded to a multiple of the tile height ``TM`` (vLLM's
``moe_align_block_size``), so one tile of ``TM`` rows belongs to one expert and a thread block
multiplies it with a tile of that expert's dequantised weights, as in a dense GEMM. Four kernels per
MoE layer (the GEMM builder runs twice; :func:`dsv2_mlc.model.moe.grouped_experts` chains them for
prefill / extend on CUDA):

1. :func:`moe_align` (one thread block on CUDA; on LLVM, for tests, serial loops):
   from ``idx [n, k]`` the per-expert ``counts [E]``, ``rows [T, TM]`` (the token of every padded
   row, expert-sorted, stable in (token, slot) order; padding rows point at token 0),
   ``tile_expert [T]`` (-1 for the tiles past the last expert's segment) and ``inv [n, k]`` (the
   padded row of each pair). ``T = (n * k + E * (TM - 1)) // TM`` tiles bound every routing. Each
   of ``E * S`` threads owns one (expert, segment of pairs): it counts its expert's pairs in its
   segment; thread 0 scans the counts (expert-major, so each expert's pairs stay in pair order)
   and pads the segments; every thread then writes its pairs' rows. Deterministic: no atomics.
   On CUDA :func:`moe_align_warps` (CUDA source, same outputs and order): 32
   warps over contiguous chunks of the pairs, ``__match_any_sync`` per 32 pairs (count, scan per
   expert over the warps, fill with each lane's rank in its match group).
2. :func:`grouped_gemm_te` + :func:`schedule_grouped_gemm`: ``acc[t, i, c, h] = sum_k
   x[row(t, i), k] * W[e(t), h * C + c, k]`` in float32 (``x`` gathered by ``rows`` for gate/up,
   or already in padded-row order for down), the weight read through a :data:`WeightReader`
   (INT4 dequantisation or a float weight). With ``halves=2`` (gate/up: the fused weight's rows
   ``[0, I)`` are gate, ``[I, 2I)`` up) the epilogue is ``silu(acc[.., 0]) * acc[.., 1]``, so a
   thread holds the gate and up columns of its outputs and the [.., 2I] intermediate is never
   written. The TE runs unscheduled on LLVM (tests); the CUDA schedule: a thread block per
   (tile, ``TC`` output columns), ``TY x TX`` threads, each a ``VR x VC (x halves)`` register
   tile; per ``TK`` step the block stages the tile's activations ``[TM, TK]`` (float32, rows
   padded for bank-conflict-free reads, 4-wide loads) and the dequantised weights
   ``[TK, halves, TC]`` (one packed word per thread and step) in shared memory; the inner loop
   reads ``VR`` activations and ``VC`` weights (vectorised) per k into registers.
2b. :func:`grouped_gemm_mma` (in :mod:`.moe_mma_cuda`; the default of :func:`grouped_gemm_cuda`
   wherever :func:`mma_supported`: fp16 activations, INT4 experts with a group that is a
   multiple of 32, ``TM = 64``, reduction a multiple of 64, ``out_dim`` a multiple of 64
   (gate/up) or 128 (down)): tensor cores, hand-written CUDA through ``T.cuda.func_call`` (TIR
   only launches it). From 256 tiles on, a block per pair of tiles (128 rows, 4 x 2 warps; that
   module's docstring); below, a block per (tile, 128 weight rows: gate/up 64 gate rows + the
   matching 64 up rows), 2 x
   ``warps_n`` warps, K in steps of 64 through two shared stages (activations 64 x 64 and
   weights 128 x 64 fp16, XOR-swizzled 128-byte rows, 48 KB static): the gathered activation
   rows by ``cp.async`` one step ahead, the packed weights by 16-byte global loads one step
   ahead, dequantised after this step's mma into the other stage (``1024 + nibble`` as an fp16
   bit pattern, minus 1032, times the fp16 scale: one rounding, the weight is fp16 as the mma
   needs it); ``ldmatrix.x4`` fragments, ``mma.sync.m16n8k16`` fp16 x fp16 -> fp32, one
   ``__syncthreads`` per step; epilogue from the C fragments (gate/up: ``silu(g) * u`` in fp32,
   then fp16). Tiles with ``tile_expert < 0`` are skipped.
3. :func:`combine_te` / :func:`combine_cuda`: ``out[t] = sum_j w[t, j] * down[inv[t, j]]`` in
   float32, a fixed order over ``j``, cast to the activation dtype; no atomics.

All CUDA kernels are returned scheduled (``tirx.is_scheduled``) and opaque to ``FuseOps``
(``op_pattern`` 8), so the pipeline's dlight phase and fusion leave them as they are.

On V2-Lite's shapes the tensor-core path runs the routed-expert block several times faster
than the SIMT path and two orders of magnitude faster than the gather kernels, at the same
relative error against float32 (~5e-4; schedules/results/moe_grouped.md has the kernel times
and errors). Skewed routing (a few hot experts) leaves a long tail of few blocks. SIMT tiling
(:func:`pick_tiles`, the fallback for the shapes the mma kernel does not take, e.g. the small
test configs, and for float experts): 8 x 16 threads, 8 x 8 register tiles (gate/up: 8 rows x 4
columns x 2 halves), ``TK = 32``; 16 x 16 threads with 4 x 8 tiles are about a quarter slower.
Not done: TMA, a deeper pipeline, tensor cores for float (q0f16) experts, split-K for the
few-token skewed case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tvm import s_tir, te, tirx
from tvm.ir.expr import Expr
from tvm.script import tirx as T

from .moe_mma_cuda import grouped_gemm_mma, int4_group, kernel_attrs, mma_supported
from .tiles import GemmTiles

WeightReader = Callable[[list[te.Tensor], Expr, Expr, Expr], Expr]

TM = 64  # rows per tile (and the padding unit of each expert's segment)
ALIGN_THREADS = 1024  # threads of the moe_align block (E x S, S segments of the pairs)
# Block annotation of the grouped GEMM's reduction block (what the schedule looks for).
GROUPED_GEMM = ("dsv2_mlc.moe_schedule", "grouped_gemm")

__all__ = [
    "TM",
    "GemmTiles",
    "combine_cuda",
    "combine_te",
    "grouped_gemm_cuda",
    "grouped_gemm_mma",
    "grouped_gemm_te",
    "int4_group",
    "moe_align",
    "moe_align_warps",
    "mma_supported",
    "num_tiles",
    "pick_tiles",
    "schedule_grouped_gemm",
    "wide_index",
]


def num_tiles(n: Expr | int, top_k: int, num_experts: int, tm: int = TM) -> Expr | int:
    """Tiles that hold any routing of ``n`` tokens: ``(n * k + E * (TM - 1)) // TM``."""
    return (n * top_k + num_experts * (tm - 1)) // tm


# -- 1. bookkeeping -----------------------------------------------------------------------------
def _align_phases(num_experts: int, top_k: int, tm: int, segments: int):
    """The four phases of :func:`moe_align` as macros of a (virtual) thread id ``tx``."""
    E, K, S = num_experts, top_k, segments
    NT = E * S

    @T.macro
    def reset(tok, tile_expert, n_tiles, tx):
        # every row -> token 0 (padding), every tile -> -1 (unused until phase 3 says otherwise)
        for it in T.serial((n_tiles * tm + NT - 1) // NT):
            if it * NT + tx < n_tiles * tm:
                tok[(it * NT + tx) // tm, (it * NT + tx) % tm] = 0
        for it in T.serial((n_tiles + NT - 1) // NT):
            if it * NT + tx < n_tiles:
                tile_expert[it * NT + tx] = -1

    @T.macro
    def count(idx, cnt, loc, n, tx):
        # thread (e, s): pairs of expert e in segment s of the n * K pairs
        seg = (n * K + S - 1) // S
        loc[0] = 0
        for q in T.serial(T.max(T.min(seg, n * K - (tx // E) * seg), 0)):
            p = (tx // E) * seg + q
            if idx[p // K, p % K] == tx % E:
                loc[0] = loc[0] + 1
        cnt[tx] = loc[0]

    @T.macro
    def scan(cnt, off, counts, tile_expert, run):
        # expert-major exclusive scan (off[s * E + e]: the first row of thread (e, s)),
        # each expert's segment padded to a multiple of tm, its tiles mapped to it
        run[0] = 0
        for e in T.serial(E):
            run[1] = run[0]
            for s in T.serial(S):
                off[s * E + e] = run[0]
                run[0] = run[0] + cnt[s * E + e]
            counts[e] = T.Cast("int32", run[0] - run[1])
            for tl in T.serial((run[0] - run[1] + tm - 1) // tm):
                tile_expert[run[1] // tm + tl] = e
            run[0] = run[1] + (run[0] - run[1] + tm - 1) // tm * tm

    @T.macro
    def fill(idx, tok, inv, off, loc, n, tx):
        seg = (n * K + S - 1) // S
        loc[0] = off[tx]
        for q in T.serial(T.max(T.min(seg, n * K - (tx // E) * seg), 0)):
            p = (tx // E) * seg + q
            if idx[p // K, p % K] == tx % E:
                tok[loc[0] // tm, loc[0] % tm] = T.Cast("int32", p // K)
                inv[p // K, p % K] = T.Cast("int32", loc[0])
                loc[0] = loc[0] + 1

    return reset, count, scan, fill


def moe_align(num_experts: int, top_k: int, tm: int = TM, gpu: bool = True) -> tirx.PrimFunc:
    """``f(idx[n, k] i32, rows[T, tm] i32, tile_expert[T] i32, inv[n, k] i32, counts[E] i32)``.

    See the module docstring; ``T = num_tiles(n, k, E, tm)``. ``gpu``: one CUDA thread block,
    :func:`moe_align_warps`; otherwise the phases of ``E * S`` virtual threads (``S =
    ALIGN_THREADS // E`` segments) as serial loops (LLVM, for tests).
    """
    E, K = num_experts, top_k
    if gpu:
        return moe_align_warps(E, K, tm)
    if not 1 <= E <= ALIGN_THREADS:
        raise ValueError(f"moe_align supports 1..{ALIGN_THREADS} experts, got {E}")
    S = ALIGN_THREADS // E
    NT = E * S
    reset, count, scan, fill = _align_phases(E, K, tm, S)

    @T.prim_func(private=True, s_tir=True)
    def moe_align_cpu(
        var_idx: T.handle, var_tok: T.handle, var_te: T.handle, var_inv: T.handle,
        var_counts: T.handle,
    ):  # fmt: skip
        n = T.int64()
        idx = T.match_buffer(var_idx, (n, K), "int32")
        tok = T.match_buffer(var_tok, ((n * K + E * (tm - 1)) // tm, tm), "int32")
        tile_expert = T.match_buffer(var_te, ((n * K + E * (tm - 1)) // tm,), "int32")
        inv = T.match_buffer(var_inv, (n, K), "int32")
        counts = T.match_buffer(var_counts, (E,), "int32")
        with T.sblock("moe_align"):
            T.reads()
            T.writes()
            cnt = T.sblock_alloc_buffer((NT,), "int64")
            off = T.sblock_alloc_buffer((NT,), "int64")
            loc = T.sblock_alloc_buffer((1,), "int64")
            run = T.sblock_alloc_buffer((2,), "int64")
            for tx in T.serial(NT):
                reset(tok, tile_expert, (n * K + E * (tm - 1)) // tm, tx)
            for tx in T.serial(NT):
                count(idx, cnt, loc, n, tx)
            scan(cnt, off, counts, tile_expert, run)
            for tx in T.serial(NT):
                fill(idx, tok, inv, off, loc, n, tx)

    return kernel_attrs(moe_align_cpu)


_ALIGN_WARPS = r"""
#ifndef DSV2_MOE_ALIGN_{tag}
#define DSV2_MOE_ALIGN_{tag}
// 1024 threads = 32 warps; warp w owns the w-th contiguous chunk of the n * K pairs and walks it
// 32 pairs at a time: __match_any_sync groups the lanes of one expert, the lowest lane counts
// them (pass 1) / each lane takes base + running count + its rank among them (pass 2), so the
// order is the stable (token, slot) order of the serial version. No atomics.
__device__ __forceinline__ void moe_align_warps_{tag}(const int* __restrict__ idx,
                                                     int* __restrict__ rows,
                                                     int* __restrict__ tile_expert,
                                                     int* __restrict__ inv,
                                                     int* __restrict__ counts, long long n,
                                                     int tid) {{
  constexpr int E = {E}, K = {K}, TM = {TM}, NW = 32;
  __shared__ int cnt[NW * E];
  __shared__ long long base[E];
  const long long P = n * K, n_tiles = (P + E * (TM - 1)) / TM;
  for (long long i = tid; i < n_tiles * TM; i += 1024) rows[i] = 0;
  for (long long i = tid; i < n_tiles; i += 1024) tile_expert[i] = -1;
  for (int i = tid; i < NW * E; i += 1024) cnt[i] = 0;
  __syncthreads();
  const int w = tid >> 5, lane = tid & 31;
  const long long chunk = ((P + NW - 1) / NW + 31) / 32 * 32;
  const long long lo = w * chunk, hi = (lo + chunk < P ? lo + chunk : P);
  for (long long b = lo; b < hi; b += 32) {{
    const long long p = b + lane;
    const int e = p < hi ? idx[p] : -1;
    const unsigned m = __match_any_sync(0xFFFFFFFFu, e);
    if (e >= 0 && lane == __ffs(m) - 1) cnt[w * E + e] += __popc(m);
  }}
  __syncthreads();
  if (tid < E) {{  // expert tid: exclusive scan over the warps
    int s = 0;
    for (int v = 0; v < NW; ++v) {{
      const int c = cnt[v * E + tid];
      cnt[v * E + tid] = s;
      s += c;
    }}
    counts[tid] = s;
  }}
  __syncthreads();
  if (tid == 0) {{  // segments, each padded to a multiple of TM
    long long run = 0;
    for (int e = 0; e < E; ++e) {{
      base[e] = run;
      run += (counts[e] + TM - 1) / TM * TM;
    }}
  }}
  __syncthreads();
  if (tid < E) {{
    const long long t0 = base[tid] / TM, t1 = t0 + (counts[tid] + TM - 1) / TM;
    for (long long t = t0; t < t1; ++t) tile_expert[t] = tid;
  }}
  for (long long b = lo; b < hi; b += 32) {{
    const long long p = b + lane;
    const int e = p < hi ? idx[p] : -1;
    const unsigned m = __match_any_sync(0xFFFFFFFFu, e);
    if (e >= 0) {{
      const long long pos = base[e] + cnt[w * E + e] + __popc(m & ((1u << lane) - 1u));
      rows[pos] = static_cast<int>(p / K);
      inv[p] = static_cast<int>(pos);
    }}
    __syncwarp();
    if (e >= 0 && lane == __ffs(m) - 1) cnt[w * E + e] += __popc(m);
    __syncwarp();
  }}
}}
#endif
"""


def moe_align_warps(num_experts: int, top_k: int, tm: int = TM) -> tirx.PrimFunc:
    """:func:`moe_align` on CUDA as 32 warps over chunks of the pairs (same outputs, same
    order): ``__match_any_sync`` per 32 pairs instead of one thread per (expert, segment)
    scanning its whole segment. CUDA source through ``T.cuda.func_call``."""
    E, K = num_experts, top_k
    if not 1 <= E <= ALIGN_THREADS:
        raise ValueError(f"moe_align supports 1..{ALIGN_THREADS} experts, got {E}")
    tag = f"{E}_{K}_{tm}"
    src = _ALIGN_WARPS.format(tag=tag, E=E, K=K, TM=tm)
    fname = f"moe_align_warps_{tag}"

    @T.prim_func(private=True, s_tir=True)
    def moe_align_warp(
        var_idx: T.handle, var_tok: T.handle, var_te: T.handle, var_inv: T.handle,
        var_counts: T.handle,
    ):  # fmt: skip
        n = T.int64()
        idx = T.match_buffer(var_idx, (n, K), "int32")
        tok = T.match_buffer(var_tok, ((n * K + E * (tm - 1)) // tm, tm), "int32")
        tile_expert = T.match_buffer(var_te, ((n * K + E * (tm - 1)) // tm,), "int32")
        inv = T.match_buffer(var_inv, (n, K), "int32")
        counts = T.match_buffer(var_counts, (E,), "int32")
        for _bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(ALIGN_THREADS, thread="threadIdx.x"):
                with T.sblock("moe_align"):
                    T.reads()
                    T.writes()
                    T.cuda.func_call(
                        fname,
                        T.address_of(idx[0, 0]),
                        T.address_of(tok[0, 0]),
                        T.address_of(tile_expert[0]),
                        T.address_of(inv[0, 0]),
                        T.address_of(counts[0]),
                        n,
                        tx,
                        source_code=src,
                    )

    return kernel_attrs(moe_align_warp)


# -- 2. grouped GEMM ----------------------------------------------------------------------------
def wide_index(t: te.Tensor) -> te.Tensor:
    """``t`` as a placeholder with int64 dimensions where its elements do not fit int32 indices.

    TVM computes a buffer's flat offsets in the dtype of its shape: a stacked expert weight whose
    shape is Python ints (int32) is indexed ``expert * stride + ...`` in 32-bit arithmetic, which
    wraps past 2**31 - 1 elements (DeepSeek-V2's float16 gate/up ``[160, 3072, 5120]``: 2.5e9,
    expert 137 on). With int64 dimensions every product of the offset is 64-bit. Smaller tensors
    (V2-Lite's, packed INT4) keep their int32 shape, so their generated code does not change."""
    dims = list(t.shape)
    if not isinstance(t.op, te.PlaceholderOp) or not all(isinstance(d, tirx.IntImm) for d in dims):
        return t
    if all(str(d.ty) == "int64" for d in dims) or math.prod(int(d) for d in dims) < 2**31:
        return t
    shape = [tirx.IntImm("int64", int(d)) for d in dims]
    return te.placeholder(shape, t.dtype, name=t.op.name)


def grouped_gemm_te(
    x: te.Tensor,
    rows: te.Tensor,
    tile_expert: te.Tensor,
    weights: Sequence[te.Tensor],
    read: WeightReader,
    out_dim: int,
    halves: int,
    gathered: bool,
    name: str,
) -> te.Tensor:
    """The grouped GEMM of tiles ``[T, TM]`` (module docstring), as TE.

    ``x`` is ``[n, K]`` (``gathered``: row ``i`` of tile ``t`` is token ``rows[t, i]``) or
    ``[T, TM, K]`` (already in padded-row order); ``weights`` are read as float32 through
    ``read(weights, expert, output_row, k)``. ``halves=1``: returns ``[T, TM, out_dim]``;
    ``halves=2``: the weight has ``2 * out_dim`` rows (gate then up) and the result is
    ``silu(gate) * up``, ``[T, TM, out_dim]``. Output dtype: that of ``x``.
    """
    n_tiles, tm = rows.shape
    red = int(x.shape[-1])
    C = out_dim
    if gathered:
        xs = te.compute(
            (n_tiles, tm, red), lambda t, i, k: x[rows[t, i], k].astype("float32"), name=f"{name}_x"
        )
    else:
        xs = te.compute(
            (n_tiles, tm, red), lambda t, i, k: x[t, i, k].astype("float32"), name=f"{name}_x"
        )
    ws = list(weights)

    def weight(t: Expr, k: Expr, h: Expr, c: Expr) -> Expr:
        expert = tirx.max(tile_expert[t], tirx.const(0, tile_expert.dtype))
        return read(ws, expert, h * C + c, k)

    wt = te.compute((n_tiles, red, halves, C), weight, name=f"{name}_w")
    k = te.reduce_axis((0, red), name="k")
    acc = te.compute(
        (n_tiles, tm, C, halves),
        lambda t, i, c, h: te.sum(xs[t, i, k] * wt[t, k, h, c], axis=k),
        name=f"{name}_acc",
        attrs=dict([GROUPED_GEMM]),
    )
    if halves == 2:

        def swiglu(t: Expr, i: Expr, c: Expr) -> Expr:
            g = acc[t, i, c, 0]
            return (g * tirx.sigmoid(g) * acc[t, i, c, 1]).astype(x.dtype)

        return te.compute((n_tiles, tm, C), swiglu, name=name)
    return te.compute((n_tiles, tm, C), lambda t, i, c: acc[t, i, c, 0].astype(x.dtype), name=name)


def pick_tiles(out_dim: int, red: int, tm: int = TM, halves: int = 1) -> GemmTiles:
    """The default tiling for ``out_dim`` columns (per half) and a reduction of ``red``."""
    ty = 8 if tm % 8 == 0 else 1  # 8 x 8 (x halves) register tiles: the fastest SIMT tiling
    vr = tm // ty
    vcs = (8, 4, 2, 1) if halves == 1 else (4, 2, 1)
    tx, vc = next(((a, v) for v in vcs for a in (16, 8) if out_dim % (a * v) == 0), (1, 1))
    tk = next((k for k in (32, 16, 8) if red % k == 0), 1)
    return GemmTiles(ty=ty, tx=tx, vr=vr, vc=vc, tk=tk)


def schedule_grouped_gemm(func: tirx.PrimFunc, tiles: GemmTiles) -> tirx.PrimFunc:
    """The CUDA schedule of the module docstring for a PrimFunc of :func:`grouped_gemm_te`."""
    sch = s_tir.Schedule(func)
    root = sch.get_child_blocks(sch.get_sblock("root"))
    key = GROUPED_GEMM[0]
    (acc,) = [b for b in root if str(sch.get(b).annotations.get(key, "")) == GROUPED_GEMM[1]]
    name = sch.get(acc).name_hint.removesuffix("_acc")
    xs, wt, out = sch.get_sblock(f"{name}_x"), sch.get_sblock(f"{name}_w"), sch.get_sblock(name)
    ty_n, tx_n, vr, vc, tk = tiles.ty, tiles.tx, tiles.vr, tiles.vc, tiles.tk
    nthreads = ty_n * tx_n

    # the output tile: a block per (tile, TC columns), a VR x VC register tile per thread
    t, i, c = sch.get_loops(out)
    i_ty, i_r = sch.split(i, [ty_n, vr])
    c_b, c_tx, c_v = sch.split(c, [None, tx_n, vc])
    sch.reorder(t, c_b, i_ty, c_tx, i_r, c_v)
    sch.bind(t, "blockIdx.y")
    sch.bind(c_b, "blockIdx.x")
    sch.bind(i_ty, "threadIdx.y")
    sch.bind(c_tx, "threadIdx.x")
    # the accumulators (VR x VC x halves registers per thread) before the epilogue
    sch.set_scope(acc, 0, "local")
    sch.compute_at(acc, c_tx, preserve_unit_loops=True)
    a_i, a_c, a_h, k = sch.get_loops(acc)[-4:]
    k_o, k_i = sch.split(k, [None, tk])
    sch.reorder(k_o, k_i, a_i, a_c, a_h)
    sch.decompose_reduction(acc, k_o)

    # activations of the tile: [TM, TK] float32 in shared memory, 4-wide loads along k
    sch.set_scope(xs, 0, "shared")  # (first: the region under k_o then spans the threads)
    sch.compute_at(xs, k_o, preserve_unit_loops=True)
    sch.storage_align(xs, 0, axis=1, factor=32, offset=tiles.pad)
    x_loops = sch.get_loops(xs)[-2:]  # (i, k) under k_o (the tile index is fixed)
    fused = sch.fuse(*x_loops)
    vec = 4 if (tiles.tm * tk) % (4 * nthreads) == 0 else 1
    _, l_ty, l_tx, l_v = sch.split(fused, [None, ty_n, tx_n, vec])
    sch.bind(l_ty, "threadIdx.y")
    sch.bind(l_tx, "threadIdx.x")
    sch.vectorize(l_v)

    # dequantised weights: [TK, halves, TC] float32, one packed word (8 k) per thread and step
    sch.set_scope(wt, 0, "shared")
    sch.compute_at(wt, k_o, preserve_unit_loops=True)
    w_k, w_h, w_c = sch.get_loops(wt)[-3:]
    word = 8 if tk % 8 == 0 else 1
    w_kw, w_j = sch.split(w_k, [None, word])
    sch.reorder(w_h, w_c, w_kw, w_j)
    fused = sch.fuse(w_h, w_c, w_kw)
    _, l_ty, l_tx = sch.split(fused, [None, ty_n, tx_n])
    sch.bind(l_ty, "threadIdx.y")
    sch.bind(l_tx, "threadIdx.x")
    sch.unroll(w_j)

    # per k: VR activations and VC (x halves) weights into registers
    reads = [r.source.name for r in sch.get(acc).reads]
    a_loc = sch.cache_read(acc, reads.index(f"{name}_x_shared"), "local")
    sch.compute_at(a_loc, k_i)
    b_loc = sch.cache_read(acc, reads.index(f"{name}_w_shared"), "local")
    sch.compute_at(b_loc, k_i)
    b_inner = sch.get_loops(b_loc)[-1]
    if vc % 4 == 0:
        _, b_v = sch.split(b_inner, [None, 4])
        sch.vectorize(b_v)
    elif vc in (2, 4):
        sch.vectorize(b_inner)
    for loop in (k_i, a_i, a_c, a_h, i_r, c_v):
        sch.unroll(loop)
    return kernel_attrs(sch.mod["main"])


def grouped_gemm_cuda(
    x: te.Tensor,
    rows: te.Tensor,
    tile_expert: te.Tensor,
    weights: Sequence[te.Tensor],
    read: WeightReader,
    out_dim: int,
    halves: int,
    gathered: bool,
    name: str,
    tiles: GemmTiles | None = None,
    mma: bool | None = None,
) -> tirx.PrimFunc:
    """:func:`grouped_gemm_te` as a scheduled CUDA PrimFunc ``f(x, rows, tile_expert, *weights,
    out)``: the tensor-core kernel (:func:`grouped_gemm_mma`) where ``mma`` is true or None (the
    default: wherever :func:`mma_supported`; it assumes ``read`` is the INT4 dequantisation of
    :func:`int4_group`'s layout), the SIMT schedule (``tiles``) otherwise. A weight of
    2**31 elements or more is indexed with 64-bit offsets (:func:`wide_index`)."""
    weights = [wide_index(w) for w in weights]
    use_mma = mma_supported(x, rows, weights, out_dim, halves) if mma is None else mma
    if use_mma:
        return grouped_gemm_mma(x, rows, tile_expert, weights, out_dim, halves, gathered, name)
    red = int(x.shape[-1])
    tiles = tiles or pick_tiles(out_dim, red, int(rows.shape[1]), halves)
    out = grouped_gemm_te(x, rows, tile_expert, weights, read, out_dim, halves, gathered, name)
    func = te.create_prim_func([x, rows, tile_expert, *weights, out])
    return schedule_grouped_gemm(func, tiles)


# -- 3. combine ---------------------------------------------------------------------------------
def combine_te(down: te.Tensor, inv: te.Tensor, weights: te.Tensor, name: str) -> te.Tensor:
    """``out[t, :] = sum_j weights[t, j] * down[inv[t, j]]`` (float32, fixed order over j)."""
    _, tm, hidden = down.shape
    top_k = int(inv.shape[1])

    def f(t: Expr, o: Expr) -> Expr:
        total = tirx.const(0.0, "float32")
        for j in range(top_k):
            r = inv[t, j]
            total = total + weights[t, j] * down[r // tm, r % tm, o].astype("float32")
        return total.astype(down.dtype)

    return te.compute((inv.shape[0], hidden), f, name=name)


def combine_cuda(down: te.Tensor, inv: te.Tensor, weights: te.Tensor, name: str) -> tirx.PrimFunc:
    """:func:`combine_te` as a scheduled CUDA PrimFunc ``f(down, inv, weights, out)``."""
    out = combine_te(down, inv, weights, name)
    sch = s_tir.Schedule(te.create_prim_func([down, inv, weights, out]))
    block = sch.get_sblock(name)
    fused = sch.fuse(*sch.get_loops(block))
    vec = 4 if int(down.shape[-1]) % 4 == 0 else 1
    bx, tx, v = sch.split(fused, [None, 256, vec])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    return kernel_attrs(sch.mod["main"])

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

The schedule is parameterised by a :class:`~dsv2_mlc.schedules.tiles.GemvConfig` (the
``"decode_gemv"`` entries of ``schedules/tiles.py``: one per class of shape, :func:`config_for`;
the ``ANY`` one is the schedule above; the kernel lab ``schedules/lab/kernel_lab_gemv.py`` builds
and times other configurations through :func:`schedule_decode_gemv`'s ``config``):

* ``rows``: outputs per group of lanes (R). Each lane issues R independent 16-byte weight loads
  per K step; its activation values are staged once per step and reused for the R rows.
* ``groups``: lane groups per thread block (TY); ``lanes``: lanes per output (TX). ``lanes=None``
  keeps the legacy ``SPLITS`` rule; a number takes ``vec`` K elements per lane and step and
  splits the ``K / vec`` steps over the lanes, a predicated last step where they do not divide
  (whole 16-byte chunks, so the loads stay vectorised). ``lanes`` > 32 splits K over several
  warps of the block (shuffles + shared memory), for skinny outputs (kv_a, the router).
* ``unroll``: ``pragma_auto_unroll_max_step`` of the K-step loop.
* ``fast_dequant``: the INT4 ``float(nibble) - 8`` is computed as
  ``bits_as_float(nibble | 0x4B000000) - 8388616.0`` (exact: 2^23 + nibble is a float with the
  nibble in its mantissa): one LOP3 + one FADD instead of an int->float conversion (I2F), which
  sm_90 issues at a quarter of the FP32 rate and which bounds the INT4 GEMVs at ~2 TB/s.
* ``hfma2``: a lane's 32-element step (one 16-byte load of packed weights per row, one scale) is
  one call of a hand CUDA device function (:func:`dot32_source`, injected by
  ``T.cuda.func_call``): nibbles -> half2 by the magic-number trick (``(w & 0x000f000f) |
  0x64006400`` is half2 ``1024 + q``; the high nibbles of each byte are ``1024 + 16 q``, scaled by
  1/16), products accumulated by ``__hfma2`` on half2 activations, every ``hfma2`` products per
  half lane converted to float32 (16: the whole 32-element step in fp16), times the scale once.
  ~1.5-2 instructions per weight instead of ~5. It applies where the reduction is the plain
  ``float(x) * dequantize_expr`` (dense, the routed-expert gathers) with vec 32 and a group that
  is a multiple of 32; elsewhere (the SwiGLU prologue, the fp32 router) the config falls back to
  the scalar path (with ``fast_dequant`` if set).
"""

from __future__ import annotations

from dataclasses import replace

import tvm
import tvm.sym
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.tirx.analysis import undefined_vars

from .tiles import GemvConfig, tuned

# Block annotation (key, value) the kernel builders set on the reduction block of a decode GEMV.
DECODE_GEMV = ("dsv2_mlc.decode_schedule", "gemv")

# (lanes reducing over K, consecutive K elements per lane and step), the first that divides K:
# 32 INT4 values = one 16-byte load of packed weights per lane and step.
SPLITS = ((32, 32), (32, 16), (32, 8), (16, 8))
# Fewer lanes only for a short K (a long K over 8 lanes is slower than dlight's GEMV).
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
            # under the lane's K step (ro; above the rows loop: one activation load for R rows)
            trial.compute_at(cache, trial.get_loops(block)[-3])
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


_MAGIC = 0x4B000000  # float32 2^23: bits_as_float(_MAGIC | q) == 2^23 + q for q < 2^23


def _fast_nibbles(e: tirx.Expr) -> tirx.Expr:
    """``e`` with every ``float32(u & 15) - 8.0`` (uint32 ``u``) computed by the 2^23 trick."""
    if isinstance(e, tirx.Sub) and isinstance(e.a, tirx.Cast) and isinstance(e.b, tirx.FloatImm):
        inner = e.a.value
        if (
            str(e.a.ty) == "float32"
            and str(inner.ty) == "uint32"
            and isinstance(inner, tirx.BitwiseAnd)
            and isinstance(inner.b, tirx.IntImm)
            and 0 < int(inner.b.value) < (1 << 23)
        ):
            bits = inner | tirx.const(_MAGIC, "uint32")
            offset = tirx.const(float(1 << 23) + float(e.b.value), "float32")
            return tirx.reinterpret("float32", bits) - offset
    if isinstance(e, tirx.expr.BinaryOpExpr) and not isinstance(e, tirx.expr.CmpExpr):
        a, b = _fast_nibbles(e.a), _fast_nibbles(e.b)
        return e if a.same_as(e.a) and b.same_as(e.b) else type(e)(a, b)
    if isinstance(e, tirx.Cast):
        v = _fast_nibbles(e.value)
        return e if v.same_as(e.value) else tirx.Cast(str(e.ty), v)
    return e


def _apply_fast_dequant(sch: s_tir.Schedule, name: str) -> None:
    """Rewrite the reduction block ``name``'s update with :func:`_fast_nibbles` (in place)."""
    block = sch.get(sch.get_sblock(name))
    store = block.body
    if not isinstance(store, tirx.BufferStore):
        return
    value = _fast_nibbles(store.value)
    if value.same_as(store.value):
        return
    new_store = tirx.BufferStore(store.buffer, value, store.indices)
    new_block = s_tir.stmt.SBlock(
        block.iter_vars, block.reads, block.writes, block.name_hint, new_store, block.init,
        block.alloc_buffers, block.match_buffers, block.annotations,
    )  # fmt: skip
    sch.state.replace(sch.get_sref(sch.get_sblock(name)), new_block, {block: new_block})


HFMA2_RUNS = (4, 8, 16)  # fp16 partial lengths (products per half lane) of ``dot32_source``


def dot32_source(run: int) -> str:
    """CUDA source of ``dsv2_dot32_int4_h{run}(const unsigned* w, const half* x, half scale)``:
    ``scale * sum_i x[i] * (q_i - 8)`` over the 32 nibbles ``q_i`` of ``w[0..3]`` (nibble ``i``
    of word ``j`` is element ``8 j + i``, low nibble first), ``x`` 32 fp16 values. Word ``q`` gives
    half2 ``(q & 0x000f000f) | 0x64006400 = 1024 + (n0, n4)`` and ``(q & 0x00f000f0) | ... = 1024
    + 16 (n1, n5)`` (then ``(q >> 8)`` for n2, n6, n3, n7): minus 1032, or times 1/16 minus 72,
    both exact; the activations are paired the same way by PRMT (``dsv2_pair8``). The half2
    products are accumulated by HFMA2 in fp16, ``run`` per half lane, then added in float32.

    With it, ``dsv2_pair8`` and ``dsv2_swz(c, p)`` (the slot of piece ``p`` of chunk ``c`` of a
    row staged in shared memory, XOR-swizzled against bank conflicts), and
    ``dsv2_dot32p_int4_h{run}(const unsigned* w, const uint4* xp, half scale)``: the same
    sum (bit for bit) on ``x`` already in pair order, ``xp[i] = dsv2_pair8(x[8 i : 8 i + 8])``
    (the half2s ``(x0, x4), (x1, x5), (x2, x6), (x3, x7)`` of each 16-byte piece): a kernel that
    reuses one ``x`` for many rows pairs it once instead of 16 PRMTs per dot product (the INT4
    decode kernels are issue-bound: ~1 eligible warp per scheduler in Nsight Compute)."""
    if run not in HFMA2_RUNS:
        raise ValueError(f"hfma2 run {run} not in {HFMA2_RUNS}")
    words = run // 4  # words per fp16 partial
    return f"""
#ifndef DSV2_PAIR8
#define DSV2_PAIR8
__device__ __forceinline__ uint4 dsv2_pair8(uint4 v) {{
  uint4 r;
  r.x = __byte_perm(v.x, v.z, 0x5410);
  r.y = __byte_perm(v.x, v.z, 0x7632);
  r.z = __byte_perm(v.y, v.w, 0x5410);
  r.w = __byte_perm(v.y, v.w, 0x7632);
  return r;
}}
// where a row staged in shared memory as 16-byte pieces keeps piece p (of 4) of 32-element chunk
// c: XOR-swizzled so that lanes reading consecutive chunks do not collide on banks
__device__ __forceinline__ int dsv2_swz(int c, int p) {{ return 4 * c + (p ^ ((c >> 1) & 3)); }}
#endif
#ifndef DSV2_DOT32_INT4_H{run}
#define DSV2_DOT32_INT4_H{run}
__device__ __forceinline__ __half2 dsv2_u2h2_h{run}(unsigned v) {{
  return *reinterpret_cast<__half2*>(&v);
}}
__device__ __forceinline__ float dsv2_dot32p_int4_h{run}(const unsigned* w, const uint4* xp,
                                                        half scale) {{
  const __half2 lo_b = dsv2_u2h2_h{run}(0x64086408u);  // 1032 = 1024 + the nibble offset 8
  const __half2 hi_m = dsv2_u2h2_h{run}(0x2c002c00u);  // 1/16
  const __half2 hi_b = dsv2_u2h2_h{run}(0xd480d480u);  // -72 = -(1024 / 16 + 8)
  float total = 0.f;
  __half2 acc;
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const unsigned q = w[i], q8 = q >> 8;
    const __half2 w0 = __hsub2(dsv2_u2h2_h{run}((q & 0x000f000fu) | 0x64006400u), lo_b);
    const __half2 w1 = __hfma2(dsv2_u2h2_h{run}((q & 0x00f000f0u) | 0x64006400u), hi_m, hi_b);
    const __half2 w2 = __hsub2(dsv2_u2h2_h{run}((q8 & 0x000f000fu) | 0x64006400u), lo_b);
    const __half2 w3 = __hfma2(dsv2_u2h2_h{run}((q8 & 0x00f000f0u) | 0x64006400u), hi_m, hi_b);
    // w0..w3 hold nibbles (0, 4), (1, 5), (2, 6), (3, 7) of the word: x comes paired the same way
    const uint4 p = xp[i];
    acc = (i % {words} == 0) ? __hmul2(w0, dsv2_u2h2_h{run}(p.x))
                             : __hfma2(w0, dsv2_u2h2_h{run}(p.x), acc);
    acc = __hfma2(w1, dsv2_u2h2_h{run}(p.y), acc);
    acc = __hfma2(w2, dsv2_u2h2_h{run}(p.z), acc);
    acc = __hfma2(w3, dsv2_u2h2_h{run}(p.w), acc);
    if (i % {words} == {words - 1}) {{
      const float2 f = __half22float2(acc);
      total += f.x + f.y;
    }}
  }}
  return total * __half2float(scale);
}}
__device__ __forceinline__ float dsv2_dot32_int4_h{run}(const unsigned* w, const half* x,
                                                       half scale) {{
  const unsigned* xw = reinterpret_cast<const unsigned*>(x);
  uint4 xp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    uint4 v;
    v.x = xw[4 * i];
    v.y = xw[4 * i + 1];
    v.z = xw[4 * i + 2];
    v.w = xw[4 * i + 3];
    xp[i] = dsv2_pair8(v);
  }}
  return dsv2_dot32p_int4_h{run}(w, xp, scale);
}}
#endif
"""


def _dot_operands(store: tirx.Stmt) -> tuple | None:
    """(x load, packed-word load, shift, scale load) of a reduction update ``acc = acc +
    float32(x) * ((float32((w >> shift) & 15) - 8) * float32(scale))`` (``dequantize_expr``, fp16
    x and scale), or None."""

    def load(e: tirx.Expr, dtype: str) -> TensorLoad | None:
        ok = isinstance(e, TensorLoad) and str(e.source.dtype) == dtype
        return e if ok else None

    def f32_of(e: tirx.Expr, dtype: str) -> TensorLoad | None:
        ok = isinstance(e, tirx.Cast) and str(e.ty) == "float32"
        return load(e.value, dtype) if ok else None

    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, prod = store.value.a, store.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(store.buffer)):
        return None
    if not isinstance(prod, tirx.Mul) or not isinstance(prod.b, tirx.Mul):
        return None
    x, (q, sc) = f32_of(prod.a, "float16"), (prod.b.a, prod.b.b)
    scale = f32_of(sc, "float16")
    if x is None or scale is None or not isinstance(q, tirx.Sub):
        return None
    if not (isinstance(q.b, tirx.FloatImm) and float(q.b.value) == 8.0):
        return None
    if not (isinstance(q.a, tirx.Cast) and str(q.a.ty) == "float32"):
        return None
    masked = q.a.value
    if not (isinstance(masked, tirx.BitwiseAnd) and isinstance(masked.b, tirx.IntImm)):
        return None
    if int(masked.b.value) != 15 or not isinstance(masked.a, tirx.RShift):
        return None
    word = load(masked.a.a, "uint32")
    return None if word is None else (x, word, masked.a.b, scale)


def _apply_hfma2(sch: s_tir.Schedule, rf_name: str, run: int) -> None:
    """Replace the rf block's 32-element inner loop (``vi``) by one ``dsv2_dot32_int4_h{run}``
    call per row and step: the block, with its ``vi`` iterator bound to 0, computes the whole
    step (raises where the operands are not laid out as the function needs). The last primitive
    of the schedule."""
    vi = sch.get_loops(sch.get_sblock(rf_name))[-1]
    loop = sch.get(vi)
    realize = loop.body
    if int(loop.extent) != 32 or not isinstance(realize, s_tir.stmt.SBlockRealize):
        raise ValueError("hfma2: the inner loop is not one 32-element step")
    block = realize.block
    lv = loop.loop_var
    pairs = zip(block.iter_vars, realize.iter_values, strict=True)
    k1 = [iv.var for iv, val in pairs if val.same_as(lv)]
    if len(k1) != 1:
        raise ValueError("hfma2: no block iterator of the inner loop")
    (k1,) = k1
    ops = _dot_operands(block.body)
    if ops is None:
        raise ValueError("hfma2: not a dequantize_expr dot product")
    store = block.body
    x, word, shift, scale = ops
    ana = tvm.sym.Analyzer()
    for iv in block.iter_vars:
        ana.bind(iv.var, iv.dom)

    def at(e: tirx.Expr, j: int, var: tirx.Var = k1) -> tirx.Expr:
        return ana.simplify(_subst(e, {var: tirx.const(j, str(var.ty))}))

    def offsets(ld: TensorLoad, j: int) -> list:
        return [ana.simplify(at(i, j) - at(i, 0)) for i in ld.indices]

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"hfma2: {what}")

    def consts(exprs: list) -> list | None:
        return [int(e) for e in exprs] if all(isinstance(e, tirx.IntImm) for e in exprs) else None

    for j in range(32):
        check(consts(offsets(x, j)) == [0] * (len(x.indices) - 1) + [j], "x: 32 fp16 in a row")
        check(
            consts(offsets(word, j)) == [0] * (len(word.indices) - 1) + [j // 8],
            "weights: 4 words in a row",
        )
        check(consts([at(shift, j)]) == [4 * (j % 8)], "nibble order")
        check(all(ana.can_prove_equal(o, 0) for o in offsets(scale, j)), "one scale per step")
    used = [v for i in store.indices for v in undefined_vars(i)]
    check(not any(k1.same_as(v) for v in used), "the output varies in the step")
    from tvm.backend.cuda.op import cuda_func_call

    def first(ld: TensorLoad) -> tirx.Expr:
        return tirx.BufferLoad(ld.source, [at(i, 0) for i in ld.indices])

    dot = cuda_func_call(
        f"dsv2_dot32_int4_h{run}",
        tirx.address_of(first(word)),
        tirx.address_of(first(x)),
        first(scale),
        source_code=dot32_source(run),
        return_type="float32",
    )
    acc = tirx.BufferLoad(store.buffer, store.indices)
    new_store = tirx.BufferStore(store.buffer, acc + dot, store.indices)

    def whole_step(region):  # the region a step reads: vi over [0, 32)
        ranges = []
        for r in region.region:
            lo, hi = at(r.min, 0), at(r.min + r.extent - 1, 31)
            ranges.append(tvm.ir.Range.from_min_extent(lo, ana.simplify(hi - lo + 1)))
        return tirx.BufferRegion(region.source, ranges)

    new_block = s_tir.stmt.SBlock(
        block.iter_vars, [whole_step(r) for r in block.reads], block.writes, block.name_hint,
        new_store, block.init, block.alloc_buffers, block.match_buffers, block.annotations,
    )  # fmt: skip
    values = [at(v, 0, lv) for v in realize.iter_values]
    pred = realize.predicate  # (a predicated last step: on the step, not within it)
    check(not any(lv.same_as(v) for v in undefined_vars(pred)), "a predicate within the step")
    new_realize = s_tir.stmt.SBlockRealize(values, pred, new_block)
    sch.state.replace(sch.get_sref(vi), new_realize, {block: new_block})


def _subst(e: tirx.Expr, vmap: dict) -> tirx.Expr:
    """``e`` with the variables of ``vmap`` replaced (the node kinds of a GEMV update; raises on
    others)."""
    if isinstance(e, tirx.Var):
        return next((v for k, v in vmap.items() if k.same_as(e)), e)
    if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
        return e
    if isinstance(e, tirx.Cast):
        return tirx.Cast(str(e.ty), _subst(e.value, vmap))
    if isinstance(e, TensorLoad):
        return tirx.BufferLoad(e.source, [_subst(i, vmap) for i in e.indices])
    if isinstance(e, (tirx.expr.BinaryOpExpr, tirx.expr.CmpExpr, tirx.And, tirx.Or)):
        return type(e)(_subst(e.a, vmap), _subst(e.b, vmap))
    raise ValueError(f"hfma2: unexpected {type(e).__name__} in the update")


# The classes of shape config_for tells apart (outputs per row, K).
SKINNY_N, VOCAB_N, LONG_K_MIN = 1024, 32768, 2816


def shape_class(n_out: int, k_dim: int, routed: bool) -> str:
    """The class of a GEMV with ``n_out`` outputs per row over ``k_dim``, the key of its
    configuration in ``schedules/tiles.py``: ``"routed"`` (the routed experts, gathered by id),
    ``"vocab"`` (``n_out >= VOCAB_N``: lm_head), ``"skinny"`` (``n_out <= SKINNY_N``: kv_a, the
    router), ``"long_k"`` (``k_dim >= LONG_K_MIN``: the shared experts' down), else ``"wide"``."""
    if routed:
        return "routed"
    if n_out >= VOCAB_N:
        return "vocab"
    if n_out <= SKINNY_N:
        return "skinny"
    if k_dim >= LONG_K_MIN:
        return "long_k"
    return "wide"


def config_for(n_out: int, k_dim: int, routed: bool) -> GemvConfig:
    """The configuration of ``schedules/tiles.py`` for the :func:`shape_class` of a GEMV (the
    measurements behind each: schedules/results/decode_kernels.md). ``hfma2`` configs fall back
    to their scalar path (``fast_dequant``) where the kernel is not a plain INT4 dot product (a
    SwiGLU prologue, fp32 weights)."""
    return tuned("decode_gemv", shape=shape_class(n_out, k_dim, routed))


def _has_prologue(block: tirx.SBlock, k_dim: int) -> bool:
    """Whether the reduction's inputs are not those of a plain GEMV (the shapes tiles.py tunes):

    * a ``[..., 2K]`` input (a SwiGLU ``silu(g) * u`` of a fused gate/up output, read as it goes);
    * a float ``[..., K]`` operand of rank >= 3 indexed by the output axis (the absorbed
      ``o_lat[t, h(o), :] . W_UV[h(o), v(o), :]``: the activation row changes with the output,
      which the multi-row configurations, staging one activation vector per lane group for R
      outputs, do not model)."""
    out_var = block.iter_vars[-2].var
    for region in block.reads:
        shape = region.source.shape
        last = shape[-1]
        if not isinstance(last, tirx.IntImm):
            continue
        if int(last) == 2 * k_dim:
            return True
        if int(last) == k_dim and len(shape) >= 3:
            used = {v for r in region.region for v in tirx.analysis.undefined_vars(r.min, [])}
            if out_var in used:
                return True
    return False


def _shape_of(func: tirx.PrimFunc, name: str) -> tuple[int, int, bool] | None:
    """(outputs per row, K, routed) of the tagged block, if static and without an input
    prologue: the configurations are tuned for plain GEMVs only and make a SwiGLU-prologue
    kernel (silu(g) * u read from a [.., 2K] input) many times slower; those keep
    the ``ANY`` configuration of ``schedules/tiles.py``."""
    sch = s_tir.Schedule(func)
    block = sch.get(sch.get_sblock(name))
    iters = block.iter_vars
    n_out, k_dim = iters[-2].dom.extent, iters[-1].dom.extent
    if not isinstance(n_out, tirx.IntImm) or not isinstance(k_dim, tirx.IntImm):
        return None
    if _has_prologue(block, int(k_dim)):
        return None
    return int(n_out), int(k_dim), len(iters) > 3  # (rows, expert slot, out, k): gathered


def schedule_decode_gemv(
    func: tirx.PrimFunc, config: GemvConfig | None = None
) -> tirx.PrimFunc | None:
    """The schedule of the module docstring, or None if ``func`` does not have its shape.
    ``config`` None: :func:`config_for` the kernel's shape (the first that applies of it and
    the ``ANY`` entry of ``schedules/tiles.py``)."""
    names = tagged_blocks(func, DECODE_GEMV[1])
    if len(names) != 1:
        return None
    if config is None:
        shape = _shape_of(func, names[0])
        configs = [config_for(*shape)] if shape is not None else []
        if configs and configs[0].lanes and shape[1] < configs[0].lanes * configs[0].vec:
            # Fewer K chunks than lanes (the tiny test models, K = 64): the configurations
            # assume full-width reductions and give wrong results here; the legacy split rule
            # has short-K splits for them.
            configs = []
        if configs and configs[0].hfma2:  # (the scalar path of the same config next)
            configs.append(replace(configs[0], hfma2=0))
        for cfg in [*configs, tuned("decode_gemv")]:
            done = schedule_decode_gemv(func, cfg)
            if done is not None:
                return done
        return None
    try:
        return _gemv(func, names[0], config)
    except Exception:  # noqa: BLE001 (a shape this schedule does not cover: leave it to dlight)
        return None


def _k_split(k_dim: int, config: GemvConfig) -> tuple[int, int] | None:
    """(lanes per output, K elements per lane and step), or None: leave the kernel to dlight."""
    if config.lanes is None:
        splits = SPLITS + (SHORT_K_SPLITS if k_dim <= SHORT_K else ())
        return next(((t, v) for t, v in splits if k_dim % (t * v) == 0), None)
    if k_dim % config.vec:
        return None
    return config.lanes, config.vec


def _gemv(func: tirx.PrimFunc, name: str, config: GemvConfig) -> tirx.PrimFunc | None:
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
    split = _k_split(int(k_dim), config)
    if split is None:  # (dense layer-0 down, K=10944: dlight's kernel is faster there)
        return None
    tx_n, vec = split
    # the hand dot product where the update is a plain INT4 dot (else the scalar path below)
    hfma2 = bool(config.hfma2) and config.lanes is not None and vec == 32
    hfma2 = hfma2 and _dot_operands(sch.get(main).body) is not None
    if config.fast_dequant and not hfma2:
        _apply_fast_dequant(sch, name)
        main = sch.get_sblock(name)
    if config.lanes is None and config.rows == 1:  # the legacy schedule: all spatial axes fused
        bx, ty, r = sch.split(sch.fuse(*spatial), [None, config.groups, config.rows])
    else:  # the output axis split alone, so a lane's R partial sums have constant indices
        *lead, out = spatial
        ob, ty, r = sch.split(out, [None, config.groups, config.rows])
        if lead:  # (batch, expert slot) fused: blockIdx.y
            sch.fuse(*lead)
        bx = ob
    if config.lanes is None:
        ro, tx, vi = sch.split(red, [None, tx_n, vec])
    else:  # whole vec-chunks over the lanes; a predicated last step where they do not divide
        chunks, vi = sch.split(red, [None, vec])
        ro, tx = sch.split(chunks, [None, tx_n])
    sch.reorder(bx, ty, tx, ro, r, vi)
    n_outer = len(sch.get_loops(sch.get_sblock(name))) - 6  # 1 with a blockIdx.y loop
    rf = sch.rfactor(tx, factor_axis=0)  # rf: partial sums per lane, in a new loop nest
    *outer, bx, ty, tx, ro, r, vi = sch.get_loops(rf)
    if outer:
        sch.bind(outer[0], "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(rf, 0, "local")
    sch = _vector_loads(sch, f"{name}_rf")
    rf = sch.get_sblock(f"{name}_rf")
    *_, ro, r, vi = sch.get_loops(rf)
    sch.unroll(vi)
    sch.unroll(r)
    if config.unroll_k:
        sch.unroll(ro)
    elif config.unroll:
        sch.annotate(ro, "pragma_auto_unroll_max_step", config.unroll)
        sch.annotate(ro, "pragma_unroll_explicit", 1)
    main = sch.get_sblock(name)
    bx, ty = sch.get_loops(rf)[n_outer : n_outer + 2]
    if config.lanes is None and config.rows == 1:
        sch.reverse_compute_at(main, ty)  # the lanes' shuffle reduction of the partial sums
        sch.bind(sch.get_loops(main)[-1], "threadIdx.x")
        if rest:  # the epilogue: per output element, under its lanes (every lane holds the sum)
            sch.set_scope(main, 0, "local")
        for blk in rest:
            sch.reverse_compute_at(blk, ty)
    else:  # as dlight's GEMV rule: a shuffle reduction per row, the rows loop outermost
        sch.reverse_compute_at(main, bx)
        lane, outs = sch.get_loops(main)[n_outer + 1 :]
        group, row = sch.split(outs, [config.groups, config.rows])
        sch.reorder(row, group, lane)  # (unrolling ``row`` breaks the allreduce lowering)
        sch.bind(group, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        if rest:
            sch.set_scope(main, 0, "local")
        for blk in rest:  # per output, in the lane group that holds its sum (all lanes store)
            sch.reverse_compute_at(blk, bx)
            inner = sch.fuse(*sch.get_loops(blk)[n_outer + 1 :])
            group, row = sch.split(inner, [config.groups, None])
            sch.bind(group, "threadIdx.y")
            sch.unroll(row)
    if hfma2:
        _apply_hfma2(sch, f"{name}_rf", config.hfma2)
    mod = sch.mod
    return mod["main"].with_attr("tirx.is_scheduled", True)

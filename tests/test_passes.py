"""Each custom Relax pass on a small TVMScript ``Before``: the ``Expected`` rewrite, and a case
where it must not fire. ``Expected`` is built with the BlockBuilder from the same TE kernel
builders the pass uses (their numerics are checked end to end in test_quantization.py)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I  # noqa: E741
from tvm.script import relax as R
from tvm.script import tirx as T

from dsv2_mlc.model.deepseek_v2 import RMS_NORM_ATTR, rms_norm_te
from dsv2_mlc.passes.dispatch_cublas_gemm import DispatchCublasGemm
from dsv2_mlc.passes.fuse_add_rms_norm import FuseAddRMSNorm, add_rms_norm_te
from dsv2_mlc.passes.fuse_dequantize_matmul import FuseDequantizeMatmul, dequantize_matmul_te
from dsv2_mlc.passes.fuse_gate_up_silu_mul import FuseGateUpSiluMul, silu_mul_te
from dsv2_mlc.schedules.silu_mul_cuda import SILU_MUL_ATTR


def _tensor(name: str, shape: list, dtype: str = "float32") -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, dtype))


# -- FuseDequantizeMatmul ----------------------------------------------------------------------
@I.ir_module
class DequantBefore:
    @T.prim_func(private=True, s_tir=True)
    def dequantize(
        qw: T.Buffer((T.int64(32), T.int64(8)), "uint32"),
        scale: T.Buffer((T.int64(32), T.int64(2)), "float32"),
        out: T.Buffer((T.int64(32), T.int64(64)), "float32"),
    ):
        T.func_attr({"dsv2_mlc.dequantize_int4_group": 32, "tirx.noalias": True})
        for n, k in T.grid(T.int64(32), T.int64(64)):
            with T.sblock("dequantize"):
                v_n, v_k = T.axis.remap("SS", [n, k])
                out[v_n, v_k] = (
                    T.Cast(
                        "float32",
                        qw[v_n, v_k // T.int64(8)]
                        >> T.Cast("uint32", v_k % T.int64(8) * T.int64(4))
                        & T.uint32(15),
                    )
                    - T.float32(8.0)
                ) * scale[v_n, v_k // T.int64(32)]

    @R.function
    def main(
        x: R.Tensor((1, 64), dtype="float32"),
        qw: R.Tensor((32, 8), dtype="uint32"),
        scale: R.Tensor((32, 2), dtype="float32"),
    ) -> R.Tensor((1, 32), dtype="float32"):
        cls = DequantBefore
        with R.dataflow():
            w = R.call_tir(cls.dequantize, (qw, scale), out_ty=R.Tensor((32, 64), dtype="float32"))
            wt: R.Tensor((64, 32), dtype="float32") = R.permute_dims(w, axes=None)
            y: R.Tensor((1, 32), dtype="float32") = R.matmul(x, wt, out_dtype=None)
            R.output(y)
        return y


def _dequant_expected() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x, qw, scale = (
        _tensor("x", [1, 64]),
        _tensor("qw", [32, 8], "uint32"),
        _tensor("scale", [32, 2]),
    )
    with bb.function("main", [x, qw, scale]):
        with bb.dataflow():
            y = bb.emit_output(
                bb.call_te(
                    dequantize_matmul_te, x, qw, scale, 64, 32,
                    primfunc_name_hint="fused_dequantize_matmul",
                )
            )  # fmt: skip
        bb.emit_func_output(y)
    return bb.get()


def test_fuse_dequantize_matmul():
    after = FuseDequantizeMatmul(DequantBefore)
    tvm.ir.assert_structural_equal(after, _dequant_expected())


def test_fuse_dequantize_matmul_does_not_fire_without_the_dequantize_marker():
    unmarked = DequantBefore.with_attr("unused", 0)
    gv = unmarked.get_global_var("dequantize")
    unmarked[gv] = unmarked[gv].without_attr("dsv2_mlc.dequantize_int4_group")
    tvm.ir.assert_structural_equal(FuseDequantizeMatmul(unmarked), unmarked)


@I.ir_module
class PlainMatmul:
    @R.function
    def main(
        x: R.Tensor((1, 64), dtype="float32"), w: R.Tensor((32, 64), dtype="float32")
    ) -> R.Tensor((1, 32), dtype="float32"):
        with R.dataflow():
            wt: R.Tensor((64, 32), dtype="float32") = R.permute_dims(w, axes=None)
            y: R.Tensor((1, 32), dtype="float32") = R.matmul(x, wt, out_dtype=None)
            R.output(y)
        return y


def test_fuse_dequantize_matmul_does_not_fire_on_float_weights():
    tvm.ir.assert_structural_equal(FuseDequantizeMatmul(PlainMatmul), PlainMatmul)


# -- FuseAddRMSNorm ----------------------------------------------------------------------------
def _rms_module(residual_shape: list) -> tvm.IRModule:
    """``s = a + b; y = rms_norm(s, w); return (y, s)`` with the model's marked norm kernel."""
    bb = relax.BlockBuilder()
    a, b, w = _tensor("a", [4, 64]), _tensor("b", residual_shape), _tensor("w", [64])
    with bb.function("main", [a, b, w]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(a, b))
            y = bb.emit(bb.call_te(rms_norm_te, s, w, 1e-6, primfunc_name_hint="rms_norm"))
            out = bb.emit_output(relax.Tuple([y, s]))
        bb.emit_func_output(out)
    mod = bb.get()
    gv = mod.get_global_var("rms_norm")
    mod[gv] = mod[gv].with_attr(RMS_NORM_ATTR, 1e-6)
    return mod


def test_fuse_add_rms_norm():
    bb = relax.BlockBuilder()
    a, b, w = _tensor("a", [4, 64]), _tensor("b", [4, 64]), _tensor("w", [64])
    with bb.function("main", [a, b, w]):
        with bb.dataflow():
            fused = bb.emit(
                bb.call_te(
                    add_rms_norm_te,
                    a,
                    b,
                    w,
                    1e-6,
                    primfunc_name_hint="fused_add_rms_norm",
                    primfunc_attrs={RMS_NORM_ATTR: 1e-6},
                )
            )
            total = bb.emit(relax.TupleGetItem(fused, 0))
            y = bb.emit(relax.TupleGetItem(fused, 1))
            out = bb.emit_output(relax.Tuple([y, total]))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(FuseAddRMSNorm(_rms_module([4, 64])), bb.get())


def test_fuse_add_rms_norm_does_not_fire_on_broadcasting_add():
    before = _rms_module([64])
    tvm.ir.assert_structural_equal(FuseAddRMSNorm(before), before)


# -- FuseGateUpSiluMul -------------------------------------------------------------------------
@I.ir_module
class SwiGLUBefore:
    @R.function
    def main(gate_up: R.Tensor((4, 64), dtype="float32")) -> R.Tensor((4, 32), dtype="float32"):
        with R.dataflow():
            parts = R.split(gate_up, indices_or_sections=2, axis=-1)
            g: R.Tensor((4, 32), dtype="float32") = parts[0]
            u: R.Tensor((4, 32), dtype="float32") = parts[1]
            act: R.Tensor((4, 32), dtype="float32") = R.nn.silu(g)
            y: R.Tensor((4, 32), dtype="float32") = R.multiply(act, u)
            R.output(y)
        return y


def test_fuse_gate_up_silu_mul():
    bb = relax.BlockBuilder()
    gate_up = _tensor("gate_up", [4, 64])
    with bb.function("main", [gate_up]):
        with bb.dataflow():
            y = bb.emit_output(
                bb.call_te(
                    silu_mul_te,
                    gate_up,
                    primfunc_name_hint="fused_silu_mul",
                    primfunc_attrs={SILU_MUL_ATTR: 1},
                )
            )
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(FuseGateUpSiluMul(SwiGLUBefore), bb.get())


@I.ir_module
class SwappedHalves:
    @R.function
    def main(gate_up: R.Tensor((4, 64), dtype="float32")) -> R.Tensor((4, 32), dtype="float32"):
        with R.dataflow():
            parts = R.split(gate_up, indices_or_sections=2, axis=-1)
            g: R.Tensor((4, 32), dtype="float32") = parts[0]
            u: R.Tensor((4, 32), dtype="float32") = parts[1]
            act: R.Tensor((4, 32), dtype="float32") = R.nn.silu(u)
            y: R.Tensor((4, 32), dtype="float32") = R.multiply(act, g)
            R.output(y)
        return y


def test_fuse_gate_up_silu_mul_does_not_fire_when_halves_are_swapped():
    tvm.ir.assert_structural_equal(FuseGateUpSiluMul(SwappedHalves), SwappedHalves)


# -- DispatchCublasGemm ------------------------------------------------------------------------
def _gemm_module(kind: str) -> tvm.IRModule:
    @I.ir_module
    class GemmBefore:
        @R.function
        def main(
            x: R.Tensor(("n", 64), dtype="float16"),
            w: R.Tensor((32, 64), dtype="float16"),
            v: R.Tensor((16, 64), dtype="float16"),
            r: R.Tensor((8, 64), dtype="float16"),
        ):
            R.func_attr({"dsv2_mlc.entry_kind": kind})
            with R.dataflow():
                wt = R.permute_dims(w, axes=None)
                acc = R.matmul(x, wt, out_dtype="float32")
                y = R.astype(acc, dtype="float16")
                vt = R.permute_dims(v, axes=None)
                z = R.matmul(x, vt)
                rt = R.permute_dims(r, axes=None)
                logits = R.matmul(x, rt, out_dtype="float32")
                R.output(y, z, logits)
            return (y, z, logits)

    return GemmBefore


@I.ir_module
class GemmExpected:
    @R.function
    def main(
        x: R.Tensor(("n", 64), dtype="float16"),
        w: R.Tensor((32, 64), dtype="float16"),
        v: R.Tensor((16, 64), dtype="float16"),
        r: R.Tensor((8, 64), dtype="float16"),
    ):
        n = T.int64()
        R.func_attr({"dsv2_mlc.entry_kind": "prefill"})
        with R.dataflow():
            y = R.call_dps_packed(
                "dsv2.cublas.gemm_nt", (x, w), out_ty=R.Tensor((n, 32), dtype="float16")
            )
            z = R.call_dps_packed(
                "dsv2.cublas.gemm_nt", (x, v), out_ty=R.Tensor((n, 16), dtype="float16")
            )
            rt = R.permute_dims(r, axes=None)
            logits = R.matmul(x, rt, out_dtype="float32")
            R.output(y, z, logits)
        return (y, z, logits)


def test_dispatch_cublas_gemm():
    """The float32-accumulated linear (matmul + astype) and the fp16 matmul go to cuBLAS; the
    float32 matmul read as float32 (the router logits) stays."""
    tvm.ir.assert_structural_equal(DispatchCublasGemm(_gemm_module("prefill")), GemmExpected)


def test_dispatch_cublas_gemm_in_the_large_batch_decode():
    """The large-batch decode entry (kind decode_gemm) gets the prefill path's GEMMs."""
    after = DispatchCublasGemm(_gemm_module("decode_gemm"))
    assert "dsv2.cublas.gemm_nt" in after.script()


def test_dispatch_cublas_gemm_does_not_fire_in_decode():
    before = _gemm_module("decode")
    tvm.ir.assert_structural_equal(DispatchCublasGemm(before), before)


@I.ir_module
class BatchedMatmul:
    @R.function
    def main(x: R.Tensor((4, "n", 64), dtype="float16"), w: R.Tensor((4, 32, 64), dtype="float16")):
        R.func_attr({"dsv2_mlc.entry_kind": "prefill"})
        with R.dataflow():
            wt = R.permute_dims(w, axes=[0, 2, 1])
            y = R.matmul(x, wt)
            R.output(y)
        return y


def test_dispatch_cublas_gemm_does_not_fire_on_batched_matmul():
    tvm.ir.assert_structural_equal(DispatchCublasGemm(BatchedMatmul), BatchedMatmul)


def _dequant_sized(rows: int, cols: int, kind: str) -> tvm.IRModule:
    """``x [4, cols] @ dequantize(qw, scale)^T`` with a ``rows x cols`` float16 weight, in an entry
    of ``kind`` (shapes only: no data)."""
    bb = relax.BlockBuilder()
    x = _tensor("x", [4, cols], "float16")
    qw, scale = _tensor("qw", [rows, cols // 8], "uint32"), _tensor("scale", [rows, cols // 32])

    def dequantize(q: tvm.te.Tensor, s: tvm.te.Tensor) -> tvm.te.Tensor:
        return tvm.te.compute(
            (rows, cols),
            lambda n, k: (
                (
                    ((q[n, k // 8] >> (k % 8 * 4).astype("uint32")) & 15).astype("float32") - 8.0
                ).astype("float16")
                * s[n, k // 32].astype("float16")
            ),
            name="dequantize",
        )

    with bb.function("main", [x, qw, scale]):
        with bb.dataflow():
            w = bb.emit(bb.call_te(dequantize, qw, scale, primfunc_name_hint="dequantize"))
            y = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(y)
    mod = bb.get()
    gv = mod.get_global_var("dequantize")
    mod[gv] = mod[gv].with_attr("dsv2_mlc.dequantize_int4_group", 32)
    main = mod.get_global_var("main")
    mod[main] = mod[main].with_attr("dsv2_mlc.entry_kind", kind)
    return relax.transform.Normalize()(mod)


def _fused(mod: tvm.IRModule) -> bool:
    return any(gv.name_hint.startswith("fused_dequantize_matmul") for gv in mod.get_global_vars())


def test_fuse_dequantize_matmul_on_gpu_by_entry_kind_and_size():
    """On a GPU target a weight whose float copy exceeds MAX_MATERIALISED_BYTES (here 512 MiB) is
    fused in prefill / extend (lm_head: one row per sequence) but materialised in the
    large-batch decode entry; a small one is materialised in both; decode fuses every weight."""
    big, small = (65536, 4096), (256, 4096)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        for shape, kind, fused in (
            (big, "extend", True),
            (big, "decode_gemm", False),
            (small, "extend", False),
            (small, "decode_gemm", False),
            (small, "decode", True),
        ):
            assert _fused(FuseDequantizeMatmul(_dequant_sized(*shape, kind))) == fused, (
                shape,
                kind,
            )
    # on the CPU every entry fuses (no tensor cores to feed)
    assert _fused(FuseDequantizeMatmul(_dequant_sized(*big, "decode_gemm")))

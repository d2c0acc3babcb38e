"""FuseDequantizeMatmul: ``matmul(x, permute_dims(dequantize(qw, scale)))`` -> one kernel.

The INT4 weight is dequantised inside the matmul's reduction, element by element, so no
full-precision copy of the weight is written to memory; accumulation is float32. ``dequantize``
kernels are recognised by the PrimFunc attribute that ``QuantizeInt4`` sets, not by name.

Where it fires: everywhere on CPU. On GPU targets only in the decode entry point (batch-1 GEMVs,
bandwidth-bound: reading INT4 is the point) and, in prefill / extend, for weights whose float
copy would exceed ``MAX_MATERIALISED_BYTES`` (the vocab-sized lm_head, which prefill applies to
one row per sequence). Prefill / extend GEMMs on GPU are compute-bound: there the weight is
dequantised to a float buffer per call (a few MB, memory-bound, microseconds) and the float
matmul gets cuBLAS or dlight's tensor-core schedule, which a fused INT4 reduction does not (a
fused INT4 reduction runs at a small fraction of the tensor cores' rate). The large-batch decode
entry (kind ``decode_gemm``) materialises every weight, lm_head included: it multiplies 64-256
rows by it, where the fused kernel (a GEMV schedule) took 44 ms a step for V2-Lite's lm_head at
256 rows and the float copy plus a GEMM well under a millisecond.
"""

from __future__ import annotations

import tvm
from tvm import relax, te
from tvm.ir import IRModule

from ..quant.modules import dequantize_expr
from ..schedules.decode_gemv_cuda import DECODE_GEMV
from ..schedules.dequantize_cuda import DEQUANTIZE_ATTR
from ._rewrite import bound_call, entry_kind, primfunc_attr, rewrite_relax_functions

# Larger float copies of a weight are never materialised per call (GPU prefill), see above.
MAX_MATERIALISED_BYTES = 256 << 20


def dequantize_matmul_te(
    x: te.Tensor,
    qw: te.Tensor,
    scale: te.Tensor,
    k_dim: int,
    group: int,
    out_dtype: str | None = None,
) -> te.Tensor:
    """``x [..., K] @ dequantize(qw, scale)^T`` -> ``[..., N]`` in ``out_dtype`` (default: the
    dtype of ``x``), accumulated in float32."""
    r = te.reduce_axis((0, k_dim), name="k")
    out_shape = (*x.shape[:-1], qw.shape[0])
    acc = te.compute(
        out_shape,
        lambda *i: te.sum(
            x(*i[:-1], r).astype("float32") * dequantize_expr(qw, scale, (i[-1],), r, group),
            axis=r,
        ),
        name="dequantize_matmul",
        attrs=dict([DECODE_GEMV]),
    )
    out_dtype = out_dtype or x.dtype
    if out_dtype == "float32":
        return acc
    return te.compute(
        out_shape, lambda *i: acc(*i).astype(out_dtype), name="dequantize_matmul_cast"
    )


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: IRModule, min_bytes: int = 0):
        super().__init__(mod)
        self.mod = mod
        self.min_bytes = min_bytes  # fuse only weights whose float copy is at least this big

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.matmul"):
            return call
        transpose = bound_call(self, call.args[1], "relax.permute_dims")
        if transpose is None or len(transpose.args[0].ty.shape) != 2:
            return call
        axes = transpose.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return call
        dequant = (
            self.lookup_binding(transpose.args[0])
            if isinstance(transpose.args[0], relax.Var)
            else None
        )
        group = primfunc_attr(self.mod, dequant, DEQUANTIZE_ATTR)
        if group is None:
            return call
        qw, scale = dequant.args[1].fields
        w_ty = transpose.args[0].ty
        k_dim = int(w_ty.shape[1])
        if int(w_ty.shape[0]) * k_dim * tvm.DataType(w_ty.dtype).bits // 8 < self.min_bytes:
            return call
        return self.builder_.call_te(
            dequantize_matmul_te,
            call.args[0],
            qw,
            scale,
            k_dim,
            int(group),
            str(call.ty.dtype),
            primfunc_name_hint="fused_dequantize_matmul",
        )


@tvm.transform.module_pass(opt_level=0, name="FuseDequantizeMatmul")
def FuseDequantizeMatmul(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Fuse INT4 dequantisation into the consuming matmul (see the module docstring)."""
    target = tvm.target.Target.current(allow_none=True)
    gpu = target is not None and "gpu" in target.keys
    decode = rewrite_relax_functions(mod, _Rewriter(mod), lambda f: entry_kind(f) == "decode")
    # on GPU the large-batch decode entry fuses nothing: every weight is materialised
    done = ("decode", "decode_gemm") if gpu else ("decode",)
    return rewrite_relax_functions(
        decode,
        _Rewriter(decode, MAX_MATERIALISED_BYTES if gpu else 0),
        lambda f: entry_kind(f) not in done,
    )

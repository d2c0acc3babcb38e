"""FuseDequantizeMatmul: ``matmul(x, permute_dims(dequantize(qw, scale)))`` -> one kernel.

The INT4 weight is dequantised inside the matmul's reduction, element by element, so no
full-precision copy of any weight is ever written to memory (decode GEMV and prefill GEMM alike);
accumulation is float32. ``dequantize`` kernels are recognised by the PrimFunc attribute that
``QuantizeInt4`` sets, not by name.
"""

from __future__ import annotations

import tvm
from tvm import relax, te
from tvm.ir import IRModule

from ..schedules.decode_gemv_cuda import DECODE_GEMV
from ._rewrite import bound_call, primfunc_attr, rewrite_relax_functions
from .quantize_int4 import DEQUANTIZE_ATTR, dequantize_expr


def dequantize_matmul_te(
    x: te.Tensor, qw: te.Tensor, scale: te.Tensor, k_dim: int, group: int
) -> te.Tensor:
    """``x [..., K] @ dequantize(qw, scale)^T`` -> ``[..., N]`` in the dtype of ``x``."""
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
    if x.dtype == "float32":
        return acc
    return te.compute(out_shape, lambda *i: acc(*i).astype(x.dtype), name="dequantize_matmul_cast")


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod

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
        k_dim = int(transpose.args[0].ty.shape[1])
        return self.builder_.call_te(
            dequantize_matmul_te,
            call.args[0],
            qw,
            scale,
            k_dim,
            int(group),
            primfunc_name_hint="fused_dequantize_matmul",
        )


@tvm.transform.module_pass(opt_level=0, name="FuseDequantizeMatmul")
def FuseDequantizeMatmul(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Fuse INT4 dequantisation into the consuming matmul (see the module docstring)."""
    return rewrite_relax_functions(mod, _Rewriter(mod))

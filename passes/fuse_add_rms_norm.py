"""FuseAddRMSNorm: ``s = a + b; y = rms_norm(s, w)`` -> one kernel writing both ``s`` and ``y``.

Every decoder layer adds a residual and immediately normalises the sum (post-attention norm, the
next layer's input norm). One kernel reads ``a`` and ``b`` once and writes the sum (still needed
as the next residual) and its norm, instead of an add kernel plus a norm kernel that re-reads the
sum. RMSNorm kernels are recognised by the PrimFunc attribute the model sets (the epsilon).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, te
from tvm.ir import IRModule

from ..model.deepseek_v2 import RMS_NORM_ATTR, rms_norm_te
from ..schedules.rms_norm_cuda import ADD_RMS_NORM
from ._rewrite import bound_call, primfunc_attr, rewrite_relax_functions


def add_rms_norm_te(a: te.Tensor, b: te.Tensor, w: te.Tensor, eps: float) -> list[te.Tensor]:
    """``[a + b, rms_norm(a + b, w)]``."""
    total = te.compute(
        a.shape, lambda *i: a(*i) + b(*i), name="residual_add", attrs=dict([ADD_RMS_NORM])
    )
    return [total, rms_norm_te(total, w, eps, name="add_rms_norm")]


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        eps = primfunc_attr(self.mod, call, RMS_NORM_ATTR)
        if eps is None:
            return call
        x, weight = call.args[1].fields
        add = bound_call(self, x, "relax.add")
        if add is None:
            return call
        a, b = add.args
        if not tvm_ffi.structural_equal(a.ty, b.ty):  # no broadcasting adds
            return call
        fused = self.builder_.emit(
            self.builder_.call_te(
                add_rms_norm_te,
                a,
                b,
                weight,
                float(eps),
                primfunc_name_hint="fused_add_rms_norm",
                primfunc_attrs={RMS_NORM_ATTR: float(eps)},  # for the CUDA kernel (schedules)
            )
        )
        total = self.builder_.emit(relax.TupleGetItem(fused, 0))
        self.set_var_remap(x, total)  # later users of the sum read the fused output
        return relax.TupleGetItem(fused, 1)


@tvm.transform.module_pass(opt_level=0, name="FuseAddRMSNorm")
def FuseAddRMSNorm(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Fuse residual add + RMSNorm (see the module docstring)."""
    return rewrite_relax_functions(mod, _Rewriter(mod))

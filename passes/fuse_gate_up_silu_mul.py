"""FuseGateUpSiluMul: ``g, u = split(gate_up, 2); silu(g) * u`` -> one kernel.

The MLPs and experts compute gate and up in one fused projection (``gate_up_proj``); the SwiGLU
activation then reads that [.., 2I] tensor once and writes [.., I], instead of a split, a SiLU and
a multiply that each pass over memory.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.ir import IRModule

from ..schedules.silu_mul_cuda import SILU_MUL_ATTR
from ._rewrite import bound_call, bound_tuple_item, rewrite_relax_functions


def silu_mul_te(gate_up: te.Tensor) -> te.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` computed in float32."""
    half = gate_up.shape[-1] // 2

    def f(*i):
        g = gate_up(*i[:-1], i[-1]).astype("float32")
        u = gate_up(*i[:-1], i[-1] + half).astype("float32")
        return (g * tirx.sigmoid(g) * u).astype(gate_up.dtype)

    return te.compute((*gate_up.shape[:-1], half), f, name="silu_mul")


def match_swiglu(mutator: relax.PyExprMutator, call: relax.Expr) -> relax.Expr | None:
    """The fused gate/up tensor if ``call`` is ``silu(split(gu, 2)[0]) * split(gu, 2)[1]`` (split
    over the last axis), else None."""
    if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.multiply"):
        return None
    silu = bound_call(mutator, call.args[0], "relax.nn.silu")
    gate = bound_tuple_item(mutator, silu.args[0]) if silu is not None else None
    up = bound_tuple_item(mutator, call.args[1])
    if gate is None or up is None or (gate.index, up.index) != (0, 1):
        return None
    if not gate.tuple_value.same_as(up.tuple_value):
        return None
    split = bound_call(mutator, gate.tuple_value, "relax.split")
    if split is None:
        return None
    data = split.args[0]
    ndim = len(data.ty.shape)
    sections = split.attrs.indices_or_sections
    even_halves = isinstance(sections, tvm.tirx.IntImm) and int(sections) == 2
    if not even_halves or int(split.attrs.axis) % ndim != ndim - 1:
        return None
    return data


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        data = match_swiglu(self, call)
        if data is None:
            return call
        return self.builder_.call_te(
            silu_mul_te,
            data,
            primfunc_name_hint="fused_silu_mul",
            primfunc_attrs={SILU_MUL_ATTR: 1},  # CUDA: schedules/silu_mul_cuda.py where alone
        )


@tvm.transform.module_pass(opt_level=0, name="FuseGateUpSiluMul")
def FuseGateUpSiluMul(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Fuse the SwiGLU activation over a fused gate/up projection (see the module docstring)."""
    return rewrite_relax_functions(mod, _Rewriter(mod))

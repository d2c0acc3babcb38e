"""DispatchCublasGemm: prefill / extend ``x @ w.T`` (fp16/bf16) -> cuBLAS, whose GEMMs run ~3x
faster than dlight's WMMA schedules on sm_90 (schedules/results/prefill_gemm.md).

In the entry functions annotated ``prefill``, ``extend`` or ``decode_gemm`` (the large-batch
decode step; ``ENTRY_KIND_ATTR``), a
``matmul(x, permute_dims(w))`` of a 2-D activation ``x [n, k]`` and a 2-D weight ``w [o, k]`` of
the same 16-bit float dtype becomes ``call_dps_packed("dsv2.cublas.gemm_nt", (x, w))``, which
``dsv2_mlc/runtime/cublas_gemm.cc`` (compiled into the library) runs with float32 accumulation:

* ``astype(matmul(.., out_dtype="float32"), x.dtype)`` (the model's float32-accumulated linear)
  -> one GEMM writing ``x.dtype``, rounded once, as the pair computes it;
* ``matmul(..)`` in ``x.dtype`` -> the same GEMM (accumulating in float32 instead of ``x.dtype``).

A float32 matmul read as float32 (the router logits' exact split product) and every matmul of
the decode entry (its GEMVs are hand kernels, and its CUDA graphs capture no library call) are
left alone; so is anything that is not a 2-D ``x`` times a transposed 2-D weight.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import IRModule

from ._rewrite import bound_call, entry_kind, rewrite_relax_functions

GEMM_NT = "dsv2.cublas.gemm_nt"
ENTRY_KINDS = ("prefill", "extend", "decode_gemm")
_DTYPES = ("float16", "bfloat16")


def _tensor_type(expr: relax.Expr) -> relax.TensorType | None:
    ty = expr.ty
    return ty if isinstance(ty, relax.TensorType) else None


def match_gemm_nt(
    mutator: relax.PyExprMutator, matmul: relax.Call
) -> tuple[relax.Expr, relax.Expr] | None:
    """``(x, w)`` if ``matmul`` is ``matmul(x, permute_dims(w, axes=None))`` with 2-D ``x [n, k]``
    and 2-D static ``w [o, k]`` of one 16-bit float dtype, else None."""
    if not isinstance(matmul, relax.Call) or matmul.op != tvm.ir.Op.get("relax.matmul"):
        return None
    transpose = bound_call(mutator, matmul.args[1], "relax.permute_dims")
    if transpose is None or transpose.attrs.axes is not None:
        return None
    x, w = matmul.args[0], transpose.args[0]
    x_ty, w_ty = _tensor_type(x), _tensor_type(w)
    if x_ty is None or w_ty is None or x_ty.dtype not in _DTYPES or w_ty.dtype != x_ty.dtype:
        return None
    if x_ty.ndim != 2 or w_ty.ndim != 2 or x_ty.shape is None or w_ty.shape is None:
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in w_ty.shape):
        return None
    k = x_ty.shape.values[1]
    if not isinstance(k, tvm.tirx.IntImm) or int(k) != int(w_ty.shape.values[1]):
        return None
    return x, w


def gemm_nt_call(x: relax.Expr, w: relax.Expr, dtype: str) -> relax.Call:
    """``call_dps_packed(GEMM_NT, (x, w))`` producing ``[n, o]`` in ``dtype``."""
    n = _tensor_type(x).shape.values[0]
    o = _tensor_type(w).shape.values[0]
    return relax.op.call_dps_packed(
        relax.ExternFunc(GEMM_NT), relax.Tuple([x, w]), relax.TensorType([n, o], dtype)
    )


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op == tvm.ir.Op.get("relax.astype"):
            matmul = bound_call(self, call.args[0], "relax.matmul")
            operands = match_gemm_nt(self, matmul) if matmul is not None else None
            dtype = str(call.attrs.dtype)
            if operands is not None and dtype == _tensor_type(operands[0]).dtype:
                return gemm_nt_call(*operands, dtype)
            return call
        operands = match_gemm_nt(self, call)
        if operands is not None and _tensor_type(call).dtype == _tensor_type(operands[0]).dtype:
            return gemm_nt_call(*operands, _tensor_type(call).dtype)
        return call


@tvm.transform.module_pass(opt_level=0, name="DispatchCublasGemm")
def DispatchCublasGemm(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Route the prefill / extend GEMMs of ``mod`` to cuBLAS (module docstring)."""
    return rewrite_relax_functions(
        mod, _Rewriter(mod), select=lambda func: entry_kind(func) in ENTRY_KINDS
    )

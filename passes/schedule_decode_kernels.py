"""ScheduleDecodeKernels: hand CUDA schedules for the tagged kernels (decode GEMVs, row norms).

Every entry point gets the row-per-block schedules (``ROW_SCHEDULES``, copies named ``*_rows``), as
dlight's add+RMSNorm schedule is far slower at thousands of rows
(schedules/results/prefill_small_kernels.md); the INT4 dequantization of prefill's weights becomes a
thread per packed word (``schedules/dequantize_cuda.py``), prefill's query and key rows one
vectorised kernel each (``schedules/prefill_qk_cuda.py``), the SwiGLU of the MLPs one too
(``schedules/silu_mul_cuda.py``). The decode entry point also gets the batch-1 GEMV schedules
(``DECODE_SCHEDULES``, copies named ``*_decode``); prefill and extend keep dlight's tiled schedules
for their matmuls, which are right for hundreds of rows.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.ir import GlobalVar, IRModule

from ..schedules.decode_gemv_cuda import schedule_decode_gemv
from ..schedules.dequantize_cuda import dequantize_int4_kernel
from ..schedules.prefill_qk_cuda import prefill_key_kernel, prefill_query_kernel
from ..schedules.rms_norm_cuda import schedule_add_rms_norm
from ..schedules.silu_mul_cuda import silu_mul_kernel
from ._rewrite import entry_kind

Rule = Callable[[tirx.PrimFunc], tirx.PrimFunc | None]


DECODE_SCHEDULES: tuple[Rule, ...] = (schedule_decode_gemv,)
ROW_SCHEDULES: tuple[Rule, ...] = (
    schedule_add_rms_norm,
    dequantize_int4_kernel,
    prefill_query_kernel,
    prefill_key_kernel,
    silu_mul_kernel,
)


def _schedule(func: tirx.PrimFunc, rules: tuple[Rule, ...]) -> tirx.PrimFunc | None:
    if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
        return None
    for rule in rules:
        done = rule(func)
        if done is not None:
            return done
    return None


@relax.expr_functor.mutator
class _Redirect(relax.PyExprMutator):
    """Point a function's ``call_tir``s of kernels ``rules`` schedule to scheduled copies
    (named ``<kernel><suffix>``)."""

    def __init__(self, mod: IRModule, rules: tuple[Rule, ...], suffix: str):
        super().__init__(mod)
        self.mod = mod
        self.rules, self.suffix = rules, suffix
        self.copies: dict[GlobalVar, GlobalVar | None] = {}

    def _copy(self, gv: GlobalVar) -> GlobalVar | None:
        if gv not in self.copies:
            func = self.mod[gv]
            done = _schedule(func, self.rules) if isinstance(func, tirx.PrimFunc) else None
            self.copies[gv] = None
            if done is not None:
                self.copies[gv] = self.builder_.add_func(done, f"{gv.name_hint}{self.suffix}")
        return self.copies[gv]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.call_tir") or not isinstance(call.args[0], GlobalVar):
            return call
        copy = self._copy(call.args[0])
        if copy is None:
            return call
        return relax.Call(call.op, [copy, *call.args[1:]], call.attrs, call.ty_args, call.span)


def _redirect(mod: IRModule, rules: tuple[Rule, ...], suffix: str, decode_only: bool) -> IRModule:
    redirect = _Redirect(mod, rules, suffix)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and (not decode_only or entry_kind(func) == "decode"):
            redirect.builder_.update_func(gv, redirect.visit_expr(func))
    return redirect.builder_.finalize()


@tvm.transform.module_pass(opt_level=0, name="ScheduleDecodeKernels")
def ScheduleDecodeKernels(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Give the entry points hand-scheduled copies of their tagged kernels (GPU only; see the
    module docstring)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or "gpu" not in target.keys:
        return mod
    mod = _redirect(mod, ROW_SCHEDULES, "_rows", decode_only=False)
    mod = _redirect(mod, DECODE_SCHEDULES, "_decode", decode_only=True)
    # Kernels now called only through scheduled copies: drop the unscheduled originals
    # (dlight would schedule them for nothing, or fail on ones only our schedule takes).
    return relax.transform.DeadCodeElimination()(mod)

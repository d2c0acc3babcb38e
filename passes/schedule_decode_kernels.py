"""ScheduleDecodeKernels: hand CUDA schedules for the tagged kernels of the decode entry point."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx
from tvm.ir import GlobalVar, IRModule

from ..schedules.decode_gemv_cuda import schedule_decode_gemv
from ..schedules.rms_norm_cuda import schedule_add_rms_norm

# The Relax functions that run at batch-1 decode shapes (prefill keeps dlight's tiled schedules).
DECODE_ENTRIES = ("batch_decode",)
SCHEDULES: tuple[Callable[[tirx.PrimFunc], tirx.PrimFunc | None], ...] = (
    schedule_decode_gemv,
    schedule_add_rms_norm,
)


def _schedule(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
        return None
    for rule in SCHEDULES:
        done = rule(func)
        if done is not None:
            return done
    return None


@relax.expr_functor.mutator
class _Redirect(relax.PyExprMutator):
    """Point the decode function's ``call_tir``s of tagged kernels to their scheduled copies."""

    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.copies: dict[GlobalVar, GlobalVar | None] = {}

    def _copy(self, gv: GlobalVar) -> GlobalVar | None:
        if gv not in self.copies:
            func = self.mod[gv]
            done = _schedule(func) if isinstance(func, tirx.PrimFunc) else None
            self.copies[gv] = None
            if done is not None:
                self.copies[gv] = self.builder_.add_func(done, f"{gv.name_hint}_decode")
        return self.copies[gv]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op != tvm.ir.Op.get("relax.call_tir") or not isinstance(call.args[0], GlobalVar):
            return call
        copy = self._copy(call.args[0])
        if copy is None:
            return call
        return relax.Call(call.op, [copy, *call.args[1:]], call.attrs, call.ty_args, call.span)


@tvm.transform.module_pass(opt_level=0, name="ScheduleDecodeKernels")
def ScheduleDecodeKernels(mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:  # noqa: N802
    """Give the decode entry points hand-scheduled copies of the tagged kernels (GPU only)."""
    target = tvm.target.Target.current(allow_none=True)
    if target is None or "gpu" not in target.keys:
        return mod
    redirect = _Redirect(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and gv.name_hint in DECODE_ENTRIES:
            redirect.builder_.update_func(gv, redirect.visit_expr(func))
    return redirect.builder_.finalize()

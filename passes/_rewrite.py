"""Shared plumbing of the dsv2-mlc Relax rewrite passes (not a pass itself)."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir import IRModule

from ..model.attrs import ENTRY_KIND_ATTR


def entry_kind(func: relax.Function) -> str | None:
    """The entry kind a Relax function was annotated with, if any."""
    if func.attrs is None or ENTRY_KIND_ATTR not in func.attrs:
        return None
    return str(func.attrs[ENTRY_KIND_ATTR])


def bound_call(mutator: relax.PyExprMutator, expr: relax.Expr, op_name: str) -> relax.Call | None:
    """The call of Relax op ``op_name`` that ``expr`` (a var) is bound to, if any."""
    if not isinstance(expr, relax.Var):
        return None
    value = mutator.lookup_binding(expr)
    if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(op_name):
        return value
    return None


def bound_tuple_item(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.TupleGetItem | None:
    """The ``TupleGetItem`` that ``expr`` (a var) is bound to, if any."""
    if not isinstance(expr, relax.Var):
        return None
    value = mutator.lookup_binding(expr)
    return value if isinstance(value, relax.TupleGetItem) else None


def primfunc_attr(mod: IRModule, call: relax.Call | None, key: str):
    """Attribute ``key`` of the PrimFunc that a ``call_tir`` calls (None if absent)."""
    if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.call_tir"):
        return None
    func = mod[call.args[0]]
    if func.attrs is None or key not in func.attrs:
        return None
    return func.attrs[key]


def rewrite_relax_functions(
    mod: IRModule,
    mutator: relax.PyExprMutator,
    select: Callable[[relax.Function], bool] | None = None,
) -> IRModule:
    """Run ``mutator`` over every Relax function of ``mod`` (those ``select`` accepts) and drop
    what became dead."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and (select is None or select(func)):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return relax.transform.DeadCodeElimination()(mutator.builder_.get())

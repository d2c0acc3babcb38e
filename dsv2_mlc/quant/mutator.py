"""QuantizeInt4: rewrite an nn model so its weights are INT4 groups, dequantised on the fly.

It runs on the ``nn.Module`` tree before export (TVM's ``nn.Mutator``): every ``nn.Linear``
becomes a :class:`~.modules.GroupQuantLinear` and the embedding a
:class:`~.modules.GroupQuantEmbedding` (unless the scheme keeps ``lm_head`` / the embedding in
float). A model module that stores its weights its own way (the stacked routed experts, which read
packed weights inside their kernels) says so with a method ``int4_form(q) -> (module, {float
parameter: packed prefix})``: the mutator swaps in that module and records its parameters. The
router gate (float32), norms and the absorbed MLA matrices are left alone. It also returns the
plan that the weight converter follows (:func:`~.packing.quantize_params`): float parameter name
-> (packed name, scale name).
"""

from __future__ import annotations

from tvm.relax.frontend import nn

from .modules import GroupQuantEmbedding, GroupQuantLinear
from .spec import Quantization, QuantizedParam

__all__ = ["QuantizeInt4", "quantize_model"]


class QuantizeInt4(nn.Mutator):
    """Swap float layers for INT4-group ones; records the conversion plan in ``self.plan``."""

    def __init__(self, q: Quantization):
        self.q = q
        self.plan: dict[str, QuantizedParam] = {}

    def _record(self, float_name: str, prefix: str) -> None:
        self.plan[float_name] = QuantizedParam(
            f"{prefix}q_weight", f"{prefix}q_scale", self.q.group_size, self.q.scale_dtype
        )

    def visit_module(self, name: str, node: nn.Module) -> nn.Module:
        q = self.q
        if isinstance(node, nn.Linear):
            if name == "lm_head" and not q.quantize_lm_head:
                return node
            self._record(f"{name}.weight", f"{name}.")
            return GroupQuantLinear(node.in_features, node.out_features, q)
        if isinstance(node, nn.Embedding):
            if not q.quantize_embedding:
                return node
            self._record(f"{name}.weight", f"{name}.")
            return GroupQuantEmbedding(node.num, node.dim, q)
        int4_form = getattr(node, "int4_form", None)
        if callable(int4_form):  # a model module with its own INT4 form (module docstring)
            quantized, params = int4_form(q)
            for param, prefix in params.items():
                self._record(f"{name}.{param}", f"{name}.{prefix}")
            return quantized
        return self.visit(name, node)


def quantize_model(model: nn.Module, q: Quantization) -> dict[str, QuantizedParam]:
    """Rewrite ``model`` in place for ``q``; returns the conversion plan (empty for q0*)."""
    if not q.quantized:
        return {}
    mutator = QuantizeInt4(q)
    mutator.visit("", model)
    return mutator.plan

"""QuantizeInt4: rewrite the nn model so linear weights are INT4 groups, dequantised on the fly.

It runs on the ``nn.Module`` tree before export (like TVM's ``nn.Mutator``): every ``nn.Linear``
becomes a :class:`GroupQuantLinear` (packed uint32 + scales, ``dequantize`` then ``matmul``, which
``FuseDequantizeMatmul`` fuses), the stacked routed experts read packed weights inside their gather
kernel, and the embedding gathers and dequantises rows in one kernel. The router gate (float32),
norms and the absorbed MLA matrices are left alone. It also returns the plan that the weight
converter follows: float parameter name -> (packed name, scale name).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import te, tirx
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..model.moe import (
    DeepseekV2Experts,
    DeepseekV2Gate,
    DeepseekV2MLP,
    gather_matmul,
    grouped_experts,
    use_grouped_experts,
)
from ..quantization import Quantization, packed_shape, quantize_int4
from ..schedules.dequantize_cuda import DEQUANTIZE_ATTR
from ..schedules.moe_decode_cuda import MoeDecodeShape, moe_down_decode, moe_gate_up_decode
from ..schedules.moe_expert_mma_cuda import (
    expert_mma_unsupported,
    moe_down_expert_mma,
    moe_gate_up_expert_mma,
)

# (DEQUANTIZE_ATTR, the dequantize kernels' tag, is the kernel lab's: schedules/dequantize_cuda.py)


def dequantize_expr(qw: te.Tensor, scale: te.Tensor, lead: tuple, k: Expr, group: int) -> Expr:
    """Float32 value of element ``[*lead, k]`` of an INT4-group-quantized weight."""
    word = qw[(*lead, k // 8)]
    nibble = (word >> ((k % 8) * 4).astype("uint32")) & tirx.const(0xF, "uint32")
    return (nibble.astype("float32") - tirx.const(8.0, "float32")) * scale[
        (*lead, k // group)
    ].astype("float32")


@dataclass(frozen=True)
class QuantizedParam:
    """How one float parameter is stored."""

    q_weight: str
    q_scale: str
    group_size: int
    scale_dtype: str


class GroupQuantLinear(nn.Module):
    """A bias-free linear layer with INT4-group weights ``q_weight`` [out, in/8], ``q_scale``."""

    def __init__(self, in_features: int, out_features: int, q: Quantization):
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.dtype = q.group_size, q.dtype
        w_shape, s_shape = packed_shape((out_features, in_features), q.group_size)
        self.q_weight = nn.Parameter(w_shape, "uint32")
        self.q_scale = nn.Parameter(s_shape, q.scale_dtype)

    def forward(self, x: Tensor) -> Tensor:
        group, dtype, k = self.group_size, self.dtype, self.in_features

        def compute(qw: te.Tensor, scale: te.Tensor) -> te.Tensor:
            return te.compute(
                (qw.shape[0], k),
                lambda n, i: dequantize_expr(qw, scale, (n,), i, group).astype(dtype),
                name="dequantize",
            )

        w = nn.tensor_expr_op(
            compute, "dequantize", [self.q_weight, self.q_scale], attrs={DEQUANTIZE_ATTR: group}
        )
        if dtype == "float32":
            return op.matmul(x, op.permute_dims(w))
        # Accumulate in float32 whatever kernel computes it (fused GEMV, tensor-core GEMM).
        return op.matmul(x, op.permute_dims(w), out_dtype="float32").astype(dtype)


class GroupQuantEmbedding(nn.Module):
    """Embedding rows gathered and dequantised in one kernel."""

    def __init__(self, num: int, dim: int, q: Quantization):
        self.dim, self.group_size, self.dtype = dim, q.group_size, q.dtype
        w_shape, s_shape = packed_shape((num, dim), q.group_size)
        self.q_weight = nn.Parameter(w_shape, "uint32")
        self.q_scale = nn.Parameter(s_shape, q.scale_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        group, dtype, dim = self.group_size, self.dtype, self.dim

        def compute(qw: te.Tensor, scale: te.Tensor, it: te.Tensor) -> te.Tensor:
            return te.compute(
                (*it.shape, dim),
                lambda *i: dequantize_expr(qw, scale, (it(*i[:-1]),), i[-1], group).astype(dtype),
                name="embedding_dequantize",
            )

        args = [self.q_weight, self.q_scale, ids]
        return nn.tensor_expr_op(compute, "embedding_dequantize", args)


def expert_major_combine_te(part: te.Tensor, weights: te.Tensor, dtype: str) -> te.Tensor:
    """``out[t, o] = sum_j weights[t, j] * part[t, j, o] + part[t, K, o]`` in float32, the
    slots in order then the shared experts (one elementwise kernel, a fixed order: replays give
    the eager step's bits), cast to ``dtype``."""
    n, k1, h = part.shape
    k = int(k1) - 1

    def out(t: Expr, o: Expr) -> Expr:
        acc = weights[t, 0] * part[t, 0, o]
        for j in range(1, k):
            acc = acc + weights[t, j] * part[t, j, o]
        return (acc + part[t, k, o]).astype(dtype)

    return te.compute((n, h), out, name="moe_expert_major_combine")


class GroupQuantExperts(nn.Module):
    """Stacked routed experts with INT4-group weights, dequantised inside the gather kernels."""

    def __init__(self, experts: DeepseekV2Experts, q: Quantization):
        e, i2, h = experts.gate_up_proj.shape
        self.num_experts, self.intermediate, self.hidden = int(e), experts.intermediate, int(h)
        self.group_size = q.group_size
        gu_w, gu_s = packed_shape((e, i2, h), q.group_size)
        dn_w, dn_s = packed_shape((e, h, experts.intermediate), q.group_size)
        self.gate_up_q_weight = nn.Parameter(gu_w, "uint32")
        self.gate_up_q_scale = nn.Parameter(gu_s, q.scale_dtype)
        self.down_q_weight = nn.Parameter(dn_w, "uint32")
        self.down_q_scale = nn.Parameter(dn_s, q.scale_dtype)

    def decode_shape(
        self, x: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> MoeDecodeShape | None:
        """The shape of the fused decode kernels for this layer, or None where they do not
        apply: not a CUDA target, not fp16, shared experts not INT4 with this group, or a shape
        the kernels do not take (``MoeDecodeShape.unsupported``)."""
        target = Target.current(allow_none=True)
        if target is None or target.kind.name != "cuda" or x.dtype != "float16":
            return None
        lin = (shared.gate_up_proj, shared.down_proj)
        if not all(isinstance(m, GroupQuantLinear) for m in lin):
            return None
        if any(m.group_size != self.group_size or m.q_scale.dtype != "float16" for m in lin):
            return None
        if self.gate_up_q_scale.dtype != "float16":
            return None
        cfg = gate.cfg
        limited = cfg.topk_method == "group_limited_greedy"
        shape = MoeDecodeShape(
            hidden=self.hidden,
            inter=self.intermediate,
            shared_inter=shared.down_proj.in_features,
            experts=self.num_experts,
            top_k=cfg.num_experts_per_tok,
            group=self.group_size,
            n_group=cfg.n_group if limited else 1,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        return None if shape.unsupported() else shape

    def fused_decode(
        self, x: Tensor, logits: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> Tensor | None:
        """Decode on CUDA: routing + routed and shared gate/up + SwiGLU in one kernel, the
        down projections + weighted sum in another (:mod:`dsv2_mlc.schedules.moe_decode_cuda`);
        None where :meth:`decode_shape` says they do not apply."""
        shape = self.decode_shape(x, gate, shared)
        if shape is None:
            return None
        n, k = x.shape[0], shape.top_k
        su = shared.gate_up_proj
        hidden, weights, idx = op.tensor_ir_op(
            moe_gate_up_decode(shape),
            "moe_decode_gate_up",
            args=[x, logits, self.gate_up_q_weight, self.gate_up_q_scale, su.q_weight, su.q_scale],
            out=[
                Tensor.placeholder((n, shape.total), x.dtype),
                Tensor.placeholder((n, k), "float32"),
                Tensor.placeholder((n, k), "int32"),
            ],
        )
        sd = shared.down_proj
        return op.tensor_ir_op(
            moe_down_decode(shape),
            "moe_decode_down",
            args=[hidden, weights, idx, self.down_q_weight, self.down_q_scale, sd.q_weight,
                  sd.q_scale],
            out=Tensor.placeholder((n, shape.hidden), x.dtype),
        )  # fmt: skip

    def expert_major_decode(
        self, x: Tensor, logits: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> Tensor | None:
        """Decode of a batch on CUDA: routing (``moe_route``), then every expert the batch
        selects read once for its tokens (:mod:`dsv2_mlc.schedules.moe_expert_mma_cuda`: the
        routed and shared gate/up + SwiGLU, then their down projections, unweighted), then the
        weighted sum in float32; None where :meth:`decode_shape` or the kernels do not apply."""
        shape = self.decode_shape(x, gate, shared)
        if shape is None or expert_mma_unsupported(shape) is not None:
            return None
        n, k, h = x.shape[0], shape.top_k, shape.hidden
        weights, idx = gate.route(logits)
        su, sd = shared.gate_up_proj, shared.down_proj
        hidden = op.tensor_ir_op(
            moe_gate_up_expert_mma(shape),
            "moe_expert_major_gate_up",
            args=[x, idx, self.gate_up_q_weight, self.gate_up_q_scale, su.q_weight, su.q_scale],
            out=Tensor.placeholder((n, shape.total), x.dtype),
        )
        part = op.tensor_ir_op(
            moe_down_expert_mma(shape),
            "moe_expert_major_down",
            args=[hidden, idx, self.down_q_weight, self.down_q_scale, sd.q_weight, sd.q_scale],
            out=Tensor.placeholder((n, k + 1, h), "float32"),
        )
        return nn.tensor_expr_op(
            lambda p, w: expert_major_combine_te(p, w, x.dtype),
            "moe_expert_major_combine",
            [part, weights],
        )

    def forward(self, x: Tensor, weights: Tensor, idx: Tensor, mode: str | None = None) -> Tensor:
        """As ``DeepseekV2Experts.forward``: grouped GEMMs for prefill / extend on CUDA."""
        group = self.group_size

        def read(ws: list[te.Tensor], e: Expr, o: Expr, r: Expr) -> Expr:
            return dequantize_expr(ws[0], ws[1], (e, o), r, group)

        if use_grouped_experts(mode):
            return grouped_experts(
                x, weights, idx, [self.gate_up_q_weight, self.gate_up_q_scale],
                [self.down_q_weight, self.down_q_scale], self.num_experts, self.intermediate,
                "moe_grouped_q4", read,
            )  # fmt: skip

        gate_up = gather_matmul(
            x, [self.gate_up_q_weight, self.gate_up_q_scale], idx, 2 * self.intermediate,
            "moe_gate_up_q4", read,
        )  # fmt: skip
        gate, up = op.split(gate_up, 2, axis=-1)
        down = gather_matmul(
            op.silu(gate) * up, [self.down_q_weight, self.down_q_scale], idx, self.hidden,
            "moe_down_q4", read,
        )  # fmt: skip
        weighted = down.astype("float32") * op.unsqueeze(weights, -1)
        return op.sum(weighted, axis=1).astype(x.dtype)


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
        if isinstance(node, DeepseekV2Experts):
            self._record(f"{name}.gate_up_proj", f"{name}.gate_up_")
            self._record(f"{name}.down_proj", f"{name}.down_")
            return GroupQuantExperts(node, q)
        return self.visit(name, node)


def quantize_model(model: nn.Module, q: Quantization) -> dict[str, QuantizedParam]:
    """Rewrite ``model`` in place for ``q``; returns the conversion plan (empty for q0*)."""
    if not q.quantized:
        return {}
    mutator = QuantizeInt4(q)
    mutator.visit("", model)
    return mutator.plan


def quantize_params(
    stream, plan: dict[str, QuantizedParam]
):  # Iterator[tuple[str, np.ndarray]] -> same
    """Apply ``plan`` to a stream of (name, float array): quantized tensors become two."""
    for name, arr in stream:
        if name in plan:
            p = plan[name]
            packed, scale = quantize_int4(np.asarray(arr, np.float32), p.group_size, p.scale_dtype)
            yield p.q_weight, packed
            yield p.q_scale, scale
        else:
            yield name, arr

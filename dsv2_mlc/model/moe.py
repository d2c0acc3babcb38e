"""DeepSeekMoE: fp32 softmax gate, greedy / group-limited top-k routing, routed + shared experts.

Routed experts are stacked per layer (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I], the layout transformers keeps internally) and addressed through the top-k expert ids,
so the expert kernels read weights by indirection (expert id -> weights), never as 64 separate
parameters. Routing (one kernel: softmax, group limit, top-k, renormalise or scale) follows the
original DeepSeek-V2 code, including ``norm_topk_prob`` (renormalise, and then *no*
``routed_scaling_factor``), which Hugging Face ignores.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..schedules.moe_routing import moe_route_cpu
from .config import DeepseekV2Config


def _gather_matmul(x: Tensor, w: Tensor, idx: Tensor, name: str) -> Tensor:
    """y[t, j, :] = w[idx[t, j]] @ x[t, j or 0, :] with float32 accumulation.

    ``x`` is [n, d] (shared by the k selected experts) or [n, k, d]; ``w`` is [E, out, d];
    ``idx`` is [n, k] int32. Returns [n, k, out] in the dtype of ``x``.
    """
    per_slot = len(x.shape) == 3

    def compute(xt: te.Tensor, wt: te.Tensor, it: te.Tensor) -> te.Tensor:
        n, k = it.shape
        out_dim, red_dim = wt.shape[1], wt.shape[2]
        r = te.reduce_axis((0, red_dim), name="r")

        def f(t: tirx.PrimExpr, j: tirx.PrimExpr, o: tirx.PrimExpr) -> tirx.PrimExpr:
            xv = xt[t, j, r] if per_slot else xt[t, r]
            return te.sum(xv.astype("float32") * wt[it[t, j], o, r].astype("float32"), axis=r)

        acc = te.compute((n, k, out_dim), f, name=f"{name}_acc")
        return te.compute(acc.shape, lambda *i: acc(*i).astype(xt.dtype), name=name)

    return nn.tensor_expr_op(compute, name, [x, w, idx])


class DeepseekV2MLP(nn.Module):
    """SwiGLU MLP (the dense layers and the shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: str):
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(op.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV2Gate(nn.Module):
    """The router: an fp32 linear gate, softmax, then greedy or group-limited top-k."""

    def __init__(self, cfg: DeepseekV2Config):
        self.cfg = cfg
        self.weight = nn.Parameter((cfg.n_routed_experts, cfg.hidden_size), "float32")

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [n, H] -> (weights [n, k] float32, expert ids [n, k] int32)."""
        cfg = self.cfg
        n, k = x.shape[0], cfg.num_experts_per_tok
        logits = op.matmul(x.astype("float32"), op.permute_dims(self.weight))
        route = moe_route_cpu(
            cfg.n_routed_experts,
            k,
            cfg.n_group if cfg.topk_method == "group_limited_greedy" else 1,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        weights, idx = op.tensor_ir_op(
            route,
            "moe_route",
            args=[logits],
            out=[
                Tensor.placeholder((n, k), "float32"),
                Tensor.placeholder((n, k), "int32"),
            ],
        )
        return weights, idx


class DeepseekV2Experts(nn.Module):
    """The routed experts of one layer, stacked: gate/up fused per expert, then down."""

    def __init__(self, cfg: DeepseekV2Config, dtype: str):
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.intermediate = i
        self.gate_up_proj = nn.Parameter((e, 2 * i, h), dtype)
        self.down_proj = nn.Parameter((e, h, i), dtype)

    def forward(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        """x [n, H], weights [n, k] fp32, idx [n, k] -> sum_j weights[:, j] * expert_j(x)."""
        gate_up = _gather_matmul(x, self.gate_up_proj, idx, "moe_gate_up")
        gate, up = op.split(gate_up, 2, axis=-1)
        hidden = op.silu(gate) * up
        down = _gather_matmul(hidden, self.down_proj, idx, "moe_down")  # [n, k, H]
        weighted = down.astype("float32") * op.unsqueeze(weights, -1)
        return op.sum(weighted, axis=1).astype(x.dtype)


class DeepseekV2MoE(nn.Module):
    """Router + routed experts + always-on shared experts."""

    def __init__(self, cfg: DeepseekV2Config, dtype: str):
        self.gate = DeepseekV2Gate(cfg)
        self.experts = DeepseekV2Experts(cfg, dtype)
        self.shared_experts = (
            DeepseekV2MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: [n, H] (the tokens of the batch, flattened) -> [n, H]."""
        weights, idx = self.gate(x)
        out = self.experts(x, weights, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

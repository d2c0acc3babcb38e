"""The INT4 group-quantised forms of the nn layers, and the TE of reading one INT4 weight.

:class:`GroupQuantLinear` keeps a linear layer's weight as packed uint32 words + scales
(:mod:`.packing`'s layout) and computes ``dequantize`` then ``matmul`` (which the pipeline's
``FuseDequantizeMatmul`` fuses into one kernel); :class:`GroupQuantEmbedding` gathers and
dequantises rows in one kernel. Kernels that read the layout elsewhere (the routed experts'
gathers and grouped GEMMs) read an element through :func:`dequantize_expr`.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from ..schedules.dequantize_cuda import DEQUANTIZE_ATTR
from .packing import packed_shape
from .spec import Quantization

__all__ = ["DEQUANTIZE_ATTR", "GroupQuantEmbedding", "GroupQuantLinear", "dequantize_expr"]


def dequantize_expr(qw: te.Tensor, scale: te.Tensor, lead: tuple, k: Expr, group: int) -> Expr:
    """Float32 value of element ``[*lead, k]`` of an INT4-group-quantized weight."""
    word = qw[(*lead, k // 8)]
    nibble = (word >> ((k % 8) * 4).astype("uint32")) & tirx.const(0xF, "uint32")
    return (nibble.astype("float32") - tirx.const(8.0, "float32")) * scale[
        (*lead, k // group)
    ].astype("float32")


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

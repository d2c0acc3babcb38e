"""INT4 linear layers of a CUDA decode step as the GEMV that loads its weights before it waits.

:func:`~dsv2_mlc.schedules.prefetch_gemv_cuda.gemv_q4_decode` takes any INT4 group-quantised linear
layer with fp16 scales whose row fits its shared-memory staging; in a ``--pdl`` build its weight
loads overlap the previous kernel, which a TIR GEMV (loading after its launch completes) cannot do.
The model calls :func:`int4_decode_gemv` for the decode linear layers that no fused kernel covers
where it is faster than the TIR GEMV on V2-Lite (``o_proj``, the dense MLP's ``down_proj``, the
first layer's ``qkv_a``: schedules/results/decode_kernels.md). Weights taller than one pass of the
kernel's grid (8,192 rows: the dense ``gate_up`` 21,888, ``lm_head`` 102,400, V2's ``q_b_proj``
24,576) are slower on it and stay on the TIR GEMV. Anywhere else (CPU, prefill, float or
non-fp16-scale weights, a shape the kernel does not take, a tall weight) it returns None and the
caller keeps the plain linear layer.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..schedules.prefetch_gemv_cuda import (
    gemv_q4_decode,
    gemv_q4_rows_per_pass,
    gemv_q4_unsupported,
)
from .modules import GroupQuantLinear

__all__ = ["int4_decode_gemv", "int4_group"]


def int4_group(linear: nn.Module) -> int | None:
    """The group size of ``linear`` if it is an INT4 group-quantised linear layer with fp16
    scales, the layout of the hand decode kernels (else None)."""
    if not isinstance(linear, GroupQuantLinear) or linear.q_scale.dtype != "float16":
        return None
    return linear.group_size


def int4_decode_gemv(linear: nn.Module, x: Tensor, name: str) -> Tensor | None:
    """``linear(x)`` for ``x [n, K]`` fp16 as one ``gemv_q4_decode`` kernel named ``name``, when
    tracing for CUDA and ``linear`` is an INT4 group linear layer with fp16 scales of a shape
    the kernel takes; else None. Call it for decode steps only (it reads the weights once for
    all ``n`` rows: a GEMV, not a GEMM)."""
    target = Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda" or x.dtype != "float16":
        return None
    group = int4_group(linear)
    n_out, k_in = linear.out_features, linear.in_features
    if group is None or gemv_q4_unsupported(n_out, k_in, group):
        return None
    if n_out > gemv_q4_rows_per_pass():  # tall: slower than the TIR GEMV (module docstring)
        return None
    return op.tensor_ir_op(
        gemv_q4_decode(n_out, k_in, group),
        name,
        args=[x, linear.q_weight, linear.q_scale],
        out=Tensor.placeholder((x.shape[0], n_out), x.dtype),
    )

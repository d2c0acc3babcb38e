"""DeepSeek-V2 rotary position embedding (plain RoPE or DeepSeek's YaRN), as DeepSeek defines it.

TVM's built-in ``rope_freq_yarn`` ramps over the raw dim index and has no mscale, so it does not
match DeepSeek (notes/tvm-0.27.md section 8). Here the inverse frequencies are computed exactly as
DeepSeek's ``DeepseekV2YarnRotaryEmbedding`` (floor/ceil correction range, ramp over dim // 2) and
applied to interleaved pairs ``(x[2i], x[2i+1])`` as Hugging Face's ``apply_rotary_emb`` does, so
checkpoint weights are used unpermuted.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn

from .config import RopeConfig, yarn_get_mscale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """Inverse frequencies (float32, ``dim // 2`` values) for ``dim`` rotary dims."""
    pos_freqs = np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.kind == "default":
        return extrapolation
    interpolation = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    orig = rope.original_max_position_embeddings
    low = math.floor(_yarn_correction_dim(rope.beta_fast, dim, rope.theta, orig))
    high = math.ceil(_yarn_correction_dim(rope.beta_slow, dim, rope.theta, orig))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = (np.float32(1.0) - ramp).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32)


def rope_cos_sin_scale(rope: RopeConfig) -> float:
    """The factor DeepSeek multiplies cos/sin by: mscale(factor, mscale) / mscale(factor, all_dim).

    This is the original DeepSeek definition (``mscale_all_dim`` absent counts as 0, giving 1.0 in
    the denominator). Hugging Face differs only when one of the two keys is missing.
    """
    if rope.kind != "yarn":
        return 1.0
    return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(
        rope.factor, rope.mscale_all_dim
    )


def apply_rope(x: nn.Tensor, positions: nn.Tensor, rope: RopeConfig, name: str) -> nn.Tensor:
    """Rotate interleaved pairs of the last axis of ``x`` ([n, ..., d]) at ``positions`` ([n]).

    The angle and the rotation are computed in float32 whatever the dtype of ``x``.
    """
    dim = int(x.shape[-1])
    inv_freq = [float(v) for v in rope_inv_freq(rope, dim)]
    scale = rope_cos_sin_scale(rope)
    dtype = x.dtype

    def inv_freq_of(i: Expr) -> Expr:
        # A select chain over compile-time constants: exact float32 values, no parameter needed.
        expr = tirx.const(inv_freq[-1], "float32")
        for j in range(len(inv_freq) - 2, -1, -1):
            expr = tirx.Select(i == j, tirx.const(inv_freq[j], "float32"), expr)
        return expr

    def compute(xt: te.Tensor, pos: te.Tensor) -> te.Tensor:
        def f(*idx: Expr) -> Expr:
            d = idx[-1]
            pair = d // 2
            angle = pos[idx[0]].astype("float32") * inv_freq_of(pair)
            cos = tirx.cos(angle) * tirx.const(scale, "float32")
            sin = tirx.sin(angle) * tirx.const(scale, "float32")
            even = xt(*idx[:-1], pair * 2).astype("float32")
            odd = xt(*idx[:-1], pair * 2 + 1).astype("float32")
            out = tirx.Select(d % 2 == 0, even * cos - odd * sin, odd * cos + even * sin)
            return out.astype(dtype)

        return te.compute(xt.shape, f, name=name)

    return nn.tensor_expr_op(compute, name, [x, positions])

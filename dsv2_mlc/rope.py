"""DeepSeek-V2 rotary position embedding (plain RoPE or DeepSeek's YaRN), as DeepSeek defines it.

TVM's built-in ``rope_freq_yarn`` ramps over the raw dim index and has no mscale, so it does not
match DeepSeek (notes/tvm-0.27.md section 8). Here the inverse frequencies are computed exactly as
DeepSeek's ``DeepseekV2YarnRotaryEmbedding`` (floor/ceil correction range, ramp over dim // 2) and
applied to interleaved pairs ``(x[2i], x[2i+1])`` as Hugging Face's ``apply_rotary_emb`` does, so
checkpoint weights are used unpermuted.

The parameters and the tables are plain NumPy, so :mod:`dsv2_mlc.model.config` (which holds a
:class:`RopeConfig`) reads without TVM; the TIR builders import TVM when they are called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tvm.ir.expr import Expr
    from tvm.relax.frontend import nn


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (plain RoPE when ``kind == "default"``, else YaRN)."""

    kind: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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


def rope_cos_sin(rope: RopeConfig, dim: int, pos: Expr, pair: Expr) -> tuple[Expr, Expr]:
    """float32 ``(cos, sin)`` of pair ``pair`` (of ``dim // 2``) at position ``pos`` (a TIR
    expression), with DeepSeek's cos/sin scale folded in."""
    from tvm import tirx

    inv_freq = [float(v) for v in rope_inv_freq(rope, dim)]
    scale = tirx.const(rope_cos_sin_scale(rope), "float32")
    # A select chain over compile-time constants: exact float32 values, no parameter needed.
    freq = tirx.const(inv_freq[-1], "float32")
    for j in range(len(inv_freq) - 2, -1, -1):
        freq = tirx.Select(pair == j, tirx.const(inv_freq[j], "float32"), freq)
    angle = pos.astype("float32") * freq
    return tirx.cos(angle) * scale, tirx.sin(angle) * scale


def rotate_pair(d: Expr, even: Expr, odd: Expr, cos: Expr, sin: Expr) -> Expr:
    """Element ``d`` of a rotated interleaved pair ``(even, odd)`` (float32 values)."""
    from tvm import tirx

    return tirx.Select(d % 2 == 0, even * cos - odd * sin, odd * cos + even * sin)


def rope_table(positions: nn.Tensor, rope: RopeConfig, dim: int) -> nn.Tensor:
    """``[n, dim]`` float32: ``(cos, sin)`` of pair ``p`` at columns ``2p, 2p + 1`` for each
    position (DeepSeek's cos/sin scale folded in). Computed once per forward pass and read by
    every RoPE of every layer, instead of each of them evaluating cos and sin per element."""
    from tvm import te, tirx
    from tvm.relax.frontend import nn

    def compute(pos: te.Tensor) -> te.Tensor:
        def f(t: Expr, j: Expr) -> Expr:
            cos, sin = rope_cos_sin(rope, dim, pos[t], j // 2)
            return tirx.Select(j % 2 == 0, cos, sin)

        return te.compute((pos.shape[0], dim), f, name="rope_table")

    return nn.tensor_expr_op(compute, "rope_table", [positions])


def apply_rope(x: nn.Tensor, table: nn.Tensor, name: str) -> nn.Tensor:
    """Rotate interleaved pairs of the last axis of ``x`` ([n, ..., d]) with the
    :func:`rope_table` of its tokens ([n, d]).

    The rotation is computed in float32 whatever the dtype of ``x``.
    """
    from tvm import te
    from tvm.relax.frontend import nn

    dtype = x.dtype

    def compute(xt: te.Tensor, tab: te.Tensor) -> te.Tensor:
        def f(*idx: Expr) -> Expr:
            d = idx[-1]
            pair = d // 2
            cos, sin = tab[idx[0], pair * 2], tab[idx[0], pair * 2 + 1]
            even = xt(*idx[:-1], pair * 2).astype("float32")
            odd = xt(*idx[:-1], pair * 2 + 1).astype("float32")
            return rotate_pair(d, even, odd, cos, sin).astype(dtype)

        return te.compute(xt.shape, f, name=name)

    return nn.tensor_expr_op(compute, name, [x, table])

"""Weight quantization schemes: names, dtypes, group sizes.

``q{bits}f{16|32}[_g{group}]``: ``q0f32`` / ``q0f16`` keep every weight in float32 / float16;
``q4f16_g32``, ``q4f16_g128``, ``q4f32_g32`` and ``q4f32_g128`` store linear-layer weights
(attention, dense MLP, shared and routed experts, and by default the embedding and ``lm_head``)
as symmetric signed INT4 in groups of ``group`` consecutive input features, eight 4-bit values
packed little-end-first into each uint32, with one float16 (``f16``) or float32 (``f32``) scale
per group (:mod:`.packing`). Activations run in that float dtype. Kept in float: norms, the router
gate (float32), and the absorbed MLA matrices ``kv_b_proj.w_uk`` / ``w_uv`` (see
docs/quantization.md for the measurement behind that choice).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Dsv2Error


class QuantizationError(Dsv2Error, ValueError):
    """A quantization request that cannot be honoured (unknown scheme, a weight that does not
    pack); a user error (``dsv2_mlc.errors.USER_ERRORS``)."""


@dataclass(frozen=True)
class Quantization:
    """One quantization scheme."""

    name: str
    dtype: str  # activation / float-weight dtype
    bits: int  # 0: no quantization
    group_size: int = 0
    quantize_embedding: bool = True
    quantize_lm_head: bool = True

    @property
    def scale_dtype(self) -> str:
        """The dtype of the per-group scales (the activation dtype)."""
        return self.dtype

    @property
    def quantized(self) -> bool:
        """Whether any weight is stored in INT4."""
        return self.bits > 0


QUANTIZATIONS: dict[str, Quantization] = {
    q.name: q
    for q in (
        Quantization("q0f32", "float32", 0),
        Quantization("q0f16", "float16", 0),
        Quantization("q4f16_g32", "float16", 4, 32),
        Quantization("q4f16_g128", "float16", 4, 128),
        Quantization("q4f32_g32", "float32", 4, 32),
        Quantization("q4f32_g128", "float32", 4, 128),
    )
}


def get_quantization(
    name: str,
    *,
    quantize_embedding: bool | None = None,
    quantize_lm_head: bool | None = None,
) -> Quantization:
    """The scheme called ``name`` (optionally with embedding / lm_head kept in float)."""
    if name not in QUANTIZATIONS:
        raise QuantizationError(
            f"unknown quantization {name!r}; choose one of: {', '.join(QUANTIZATIONS)}"
        )
    q = QUANTIZATIONS[name]
    return Quantization(
        q.name,
        q.dtype,
        q.bits,
        q.group_size,
        q.quantize_embedding if quantize_embedding is None else quantize_embedding,
        q.quantize_lm_head if quantize_lm_head is None else quantize_lm_head,
    )


@dataclass(frozen=True)
class QuantizedParam:
    """How one float parameter is stored: its packed weights' and scales' names."""

    q_weight: str
    q_scale: str
    group_size: int
    scale_dtype: str

"""Weight quantization schemes (names, dtypes) and the NumPy reference of INT4 group quantization.

``q{bits}f{16|32}[_g{group}]``: ``q0f32`` / ``q0f16`` keep every weight in float32 / float16;
``q4f16_g32``, ``q4f16_g128``, ``q4f32_g32`` and ``q4f32_g128`` store linear-layer weights
(attention, dense MLP, shared and routed experts, and by default the embedding and ``lm_head``)
as symmetric signed INT4 in groups of ``group`` consecutive input features, eight 4-bit values
packed little-end-first into each uint32, with one float16 (``f16``) or float32 (``f32``) scale
per group. Activations run in that float dtype. Kept in float: norms, the router gate (float32),
and the absorbed MLA matrices ``kv_b_proj.w_uk`` / ``w_uv`` (see docs/quantization.md for the
measurement behind that choice).

Encoding of one group ``w[0:G]``: ``scale = max|w| / 7``; ``q = clip(round(w / scale), -8, 7)``;
stored nibble ``q + 8``; dequantised value ``(nibble - 8) * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import UsageError


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
        raise UsageError(
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


def packed_shape(shape: tuple[int, ...], group_size: int) -> tuple[tuple, tuple]:
    """Shapes of (packed uint32 weights, scales) for a float weight ``[..., K]``."""
    *lead, k = shape
    return (*lead, -(-k // 8)), (*lead, -(-k // group_size))


def quantize_int4(
    w: np.ndarray, group_size: int, scale_dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w [..., K]`` (K a multiple of 8) -> (packed uint32 [..., K/8], scales)."""
    *lead, k = w.shape
    if k % 8:
        raise UsageError(f"cannot pack a weight with {k} input features into INT4 (need % 8)")
    groups = -(-k // group_size)
    padded = np.zeros((*lead, groups * group_size), np.float32)
    padded[..., :k] = w
    grouped = padded.reshape(*lead, groups, group_size)
    scale = (np.abs(grouped).max(axis=-1) / 7.0).astype(scale_dtype)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)
    q = np.clip(np.rint(grouped / safe[..., None]), -8, 7).astype(np.int64) + 8
    q = q.reshape(*lead, groups * group_size)[..., :k].reshape(*lead, k // 8, 8)
    packed = np.zeros((*lead, k // 8), np.uint32)
    for i in range(8):
        packed |= (q[..., i].astype(np.uint32) << np.uint32(4 * i)).astype(np.uint32)
    return packed, scale


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """The float32 weights ``[..., K]`` that ``(packed, scale)`` encode (the reference)."""
    *lead, k8 = packed.shape
    k = k8 * 8
    shifts = (np.arange(8, dtype=np.uint32) * 4).astype(np.uint32)
    nib = (packed[..., None] >> shifts) & np.uint32(0xF)
    q = nib.reshape(*lead, k).astype(np.float32) - 8.0
    s = np.repeat(scale.astype(np.float32), group_size, axis=-1)[..., :k]
    return q * s

"""INT4 group quantization in NumPy: the packed layout, the quantizer and its reference inverse.

Encoding of one group ``w[0:G]``: ``scale = max|w| / 7``; ``q = clip(round(w / scale), -8, 7)``;
stored nibble ``q + 8``; dequantised value ``(nibble - 8) * scale``. Nibble ``i`` of word ``j``
is element ``8 j + i`` of the row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .spec import QuantizationError, QuantizedParam


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
        raise QuantizationError(
            f"cannot pack a weight with {k} input features into INT4 (need % 8)"
        )
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


def quantize_params(
    stream: Iterable[tuple[str, np.ndarray]], plan: dict[str, QuantizedParam]
) -> Iterator[tuple[str, np.ndarray]]:
    """Apply ``plan`` to a stream of (name, float array): quantized tensors become two."""
    for name, arr in stream:
        if name in plan:
            p = plan[name]
            packed, scale = quantize_int4(np.asarray(arr, np.float32), p.group_size, p.scale_dtype)
            yield p.q_weight, packed
            yield p.q_scale, scale
        else:
            yield name, arr

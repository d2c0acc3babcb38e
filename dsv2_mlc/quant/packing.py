"""INT4 group quantization in NumPy: the packed layout, the quantizer and its reference inverse.

Encoding of one group ``w[0:G]``: ``scale = max|w| / 7``; ``q = clip(round(w / scale), -8, 7)``;
stored nibble ``q + 8``; dequantised value ``(nibble - 8) * scale``. Nibble ``i`` of word ``j``
is element ``8 j + i`` of the row.

Groups run along a row, so rows quantize independently: :func:`quantize_params` quantizes a
parameter a block of rows at a time into its preallocated packed arrays (the same bytes as one
:func:`quantize_int4` call), which bounds the quantizer's temporaries (float32 and uint8 copies of
its input) by the block instead of the weight, and lets a stack of experts arrive one expert at a
time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from .spec import QuantizationError, QuantizedParam

BLOCK_VALUES = 1 << 20
"""Values quantized per :func:`quantize_int4` call in :func:`quantize_blockwise` (4 MB of
float32): the call's temporaries, a few times that, stay in the allocator's heap instead of
fresh pages faulted in for every block."""


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
    if k == groups * group_size and w.dtype == np.float32:
        grouped = w.reshape(*lead, groups, group_size)  # read only
    else:
        padded = np.zeros((*lead, groups * group_size), np.float32)
        padded[..., :k] = w
        grouped = padded.reshape(*lead, groups, group_size)
    scale = (np.abs(grouped).max(axis=-1) / 7.0).astype(scale_dtype)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)
    q = np.divide(grouped, safe[..., None])
    np.rint(q, out=q)
    np.clip(q, -8, 7, out=q)
    q += 8  # the nibbles 0..15, exact in float32
    nib = q.reshape(*lead, groups * group_size)[..., :k].astype(np.uint8).reshape(*lead, k // 2, 2)
    # byte b of a word holds elements 2b (low nibble) and 2b + 1; four bytes make a
    # little-endian uint32, so nibble i of word j is element 8 j + i
    byte = nib[..., 0] | (nib[..., 1] << np.uint8(4))
    return byte.view(np.dtype("<u4")).astype(np.uint32, copy=False), scale


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """The float32 weights ``[..., K]`` that ``(packed, scale)`` encode (the reference)."""
    *lead, k8 = packed.shape
    k = k8 * 8
    shifts = (np.arange(8, dtype=np.uint32) * 4).astype(np.uint32)
    nib = (packed[..., None] >> shifts) & np.uint32(0xF)
    q = nib.reshape(*lead, k).astype(np.float32) - 8.0
    s = np.repeat(scale.astype(np.float32), group_size, axis=-1)[..., :k]
    return q * s


def quantize_blockwise(
    w: Any, group_size: int, scale_dtype: str, block_values: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_int4` of ``w [..., K]``, a block of at most ``block_values`` values (at
    least one row; default :data:`BLOCK_VALUES`) at a time, into preallocated outputs.

    ``w`` is an array, or a stack read along its first axis: anything with ``shape`` whose
    ``w[i]`` is the array ``[..., K]`` of entry ``i`` (the weight converter's stack of experts),
    so only one entry is in memory at a time."""
    shape = tuple(int(d) for d in w.shape)
    k = shape[-1]
    if k % 8:
        raise QuantizationError(
            f"cannot pack a weight with {k} input features into INT4 (need % 8)"
        )
    p_shape, s_shape = packed_shape(shape, group_size)
    packed = np.empty(p_shape, np.uint32)
    scale = np.empty(s_shape, scale_dtype)
    rows = max(1, (block_values or BLOCK_VALUES) // max(k, 1))

    def rows_into(w2: np.ndarray, p2: np.ndarray, s2: np.ndarray) -> None:
        for r in range(0, w2.shape[0], rows):
            p2[r : r + rows], s2[r : r + rows] = quantize_int4(
                w2[r : r + rows], group_size, scale_dtype
            )

    if isinstance(w, np.ndarray):
        rows_into(w.reshape(-1, k), packed.reshape(-1, p_shape[-1]), scale.reshape(-1, s_shape[-1]))
    else:
        for i in range(shape[0]):
            entry = np.asarray(w[i])
            if entry.shape != shape[1:]:
                raise ValueError(f"stack entry {i} has shape {entry.shape}, expected {shape[1:]}")
            rows_into(
                entry.reshape(-1, k),
                packed[i].reshape(-1, p_shape[-1]),
                scale[i].reshape(-1, s_shape[-1]),
            )
    return packed, scale


def quantize_params(
    stream: Iterable[tuple[str, Any]], plan: dict[str, QuantizedParam]
) -> Iterator[tuple[str, np.ndarray]]:
    """Apply ``plan`` to a stream of (name, float array): quantized tensors become two.

    A planned tensor may also be a stack read entry by entry (see :func:`quantize_blockwise`)."""
    for name, arr in stream:
        if name in plan:
            p = plan[name]
            packed, scale = quantize_blockwise(arr, p.group_size, p.scale_dtype)
            del arr  # the float input is freed while the packed arrays are consumed
            yield p.q_weight, packed
            del packed
            yield p.q_scale, scale
            del scale
        else:
            yield name, arr
            del arr

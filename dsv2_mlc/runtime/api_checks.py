"""Checks at the Engine API's boundary: sequence ids, token ids and engine options are validated
here, before anything reaches the KV cache's C++ checks, TVM's allocator or a kernel that does not
bounds-check, and each problem is reported with the project's own error naming it and the fix."""

from __future__ import annotations

import numbers
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ..errors import Dsv2Error
from .placement import EXPERT_PLACEMENTS

MAX_BATCH_SIZE = 1024
"""The most sequences an engine is opened for (its auxiliary arrays are sized by it)."""

MAX_KV_CAPACITY = 1 << 24
"""The most tokens a KV cache is sized for (16M tokens: far beyond any GPU's memory)."""


class SequenceError(Dsv2Error, ValueError):
    """A sequence id that does not name a live sequence, or a call that repeats one."""


class TokenIdError(Dsv2Error, ValueError):
    """Token ids that are not integers inside the model's vocabulary."""


class EngineOptionError(Dsv2Error, ValueError):
    """An engine option outside its range (the message names the option and what it may be)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def token_ids(tokens: Any, vocab: int, what: str = "token ids") -> list[int]:
    """``tokens`` as a list of Python ints, each an integer in ``[0, vocab)``; text, bytes,
    fractions and other types are refused, never converted."""
    if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence | Collection):
        raise TokenIdError(
            f"{what} must be a sequence of integers, got {type(tokens).__name__}; "
            "give text as str to the methods that tokenize, or a list of token ids"
        )
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu" and tokens.ndim == 1:
        ids = tokens.tolist()  # Python ints; the range check below is the same
    else:
        ids = list(tokens)
    if not all(type(t) is int for t in ids):  # (fast path: plain ints, a prompt's thousands)
        for t in ids:
            if not _is_int(t):
                raise TokenIdError(f"{what} must be integers; got {t!r} ({type(t).__name__})")
        ids = [int(t) for t in ids]
    if ids and not (0 <= min(ids) and max(ids) < vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise TokenIdError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def live_sequence(seq: Any, live: Collection[int]) -> int:
    """``seq`` checked to be a live sequence's id."""
    if not _is_int(seq) or seq not in live:
        raise SequenceError(
            f"sequence {seq!r} does not exist (removed, or never added); add_sequence() or "
            "fork_sequence() gives a sequence id"
        )
    return int(seq)


def sequence_ids(seq_ids: Any, live: Collection[int]) -> list[int]:
    """A list of live sequence ids, none repeated (one call takes each sequence once)."""
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence | Collection):
        raise SequenceError(f"seq_ids must be a list of sequence ids, got {seq_ids!r}")
    ids = [live_sequence(s, live) for s in seq_ids]
    if len(set(ids)) != len(ids):
        dup = next(s for s in ids if ids.count(s) > 1)
        raise SequenceError(
            f"sequence {dup} appears twice in one call; give each sequence once, with all its "
            "tokens in one list"
        )
    return ids


def same_length(seq_ids: Sequence[int], values: Sequence[Any], what: str) -> None:
    """One entry of ``values`` per sequence."""
    if len(values) != len(seq_ids):
        raise TokenIdError(f"{len(seq_ids)} sequences but {len(values)} {what}; give one each")


def fork_position(fork_pos: Any, length: int) -> int:
    """A fork position: -1 (the whole parent) or ``1 <= fork_pos <= length``."""
    if not _is_int(fork_pos) or not (fork_pos == -1 or 1 <= fork_pos <= length):
        raise SequenceError(
            f"fork_pos={fork_pos!r} is not a position of a sequence of {length} tokens; give "
            f"-1 (all of them) or 1..{length}"
        )
    return int(fork_pos)


def positive_option(name: str, value: Any, high: int, *, optional: bool = False) -> int | None:
    """An integer option in ``[1, high]`` (None allowed where ``optional``)."""
    if value is None and optional:
        return None
    if not _is_int(value) or not 1 <= value <= high:
        raise EngineOptionError(f"{name}={value!r} must be an integer in [1, {high}]")
    return int(value)


def expert_placement(experts: Any) -> str:
    """``experts`` if it is one of :data:`EXPERT_PLACEMENTS`; :class:`EngineOptionError` else."""
    if experts not in EXPERT_PLACEMENTS:
        raise EngineOptionError(
            f"experts={experts!r}: use one of {', '.join(EXPERT_PLACEMENTS)} (gpu: every weight "
            "in device memory; host: the routed experts in pinned host memory, read over PCIe)"
        )
    return experts

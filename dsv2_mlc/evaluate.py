"""Quality yardsticks: perplexity over token windows and greedy top-1 agreement between builds."""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LogitsFn = Callable[[Sequence[int]], np.ndarray]  # ids -> float32 [len(ids), vocab]


@dataclass(frozen=True)
class Perplexity:
    """Mean next-token negative log-likelihood over ``tokens`` predicted tokens."""

    nll: float
    tokens: int

    @property
    def ppl(self) -> float:
        """exp(mean NLL)."""
        return math.exp(self.nll)


def heldout_files(model_dir: str | Path, stdlib: str | Path | None = None) -> list[Path]:
    """The held-out source files of the embedded default model (listed in heldout_files.txt)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    listing = (Path(model_dir) / "heldout_files.txt").read_text().splitlines()
    return [root / line for line in listing if line and not line.startswith("#")]


def token_windows(
    ids_per_doc: Sequence[Sequence[int]], window: int, max_windows: int, bos: int | None
) -> list[list[int]]:
    """Cut documents into non-overlapping windows of ``window`` tokens (BOS first if given)."""
    windows: list[list[int]] = []
    body = window - (bos is not None)
    for ids in ids_per_doc:
        for start in range(0, len(ids) - body + 1, body):
            windows.append(([bos] if bos is not None else []) + list(ids[start : start + body]))
            if len(windows) == max_windows:
                return windows
    return windows


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def perplexity(logits_fn: LogitsFn, windows: Sequence[Sequence[int]]) -> Perplexity:
    """Perplexity of the next-token predictions inside every window."""
    total, count = 0.0, 0
    for ids in windows:
        logp = log_softmax(logits_fn(ids)[:-1])
        targets = np.asarray(ids[1:])
        total -= float(logp[np.arange(len(targets)), targets].sum())
        count += len(targets)
    return Perplexity(total / count, count)


def top1_agreement(reference: LogitsFn, candidate: LogitsFn, ids: Sequence[int]) -> float:
    """Share of positions of ``ids`` where both models predict the same next token."""
    a, b = reference(ids), candidate(ids)
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))

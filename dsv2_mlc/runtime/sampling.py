"""Sampling parameters and the host-side sampler (NumPy on the float32 logits).

The logits go through the usual Hugging Face chain, in its order: repetition penalty (CTRL: a
seen token's logit is divided by the penalty when positive, multiplied when negative), then
temperature, top-k and top-p. Temperature 0 is greedy decoding: exactly ``argmax`` (of the
penalised logits when a repetition penalty is set). A seed makes sampling reproducible: every
generation that carries it starts a fresh ``numpy.random.Generator(seed)``.

Plain greedy decoding (temperature 0, no repetition penalty) needs no logits on the host
(:attr:`Sampler.needs_logits`): the generation loop then takes the engine's device arg-max
(``Engine.decode_greedy``, the same ``argmax``) and hands the token to :meth:`Sampler.accept`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Dsv2Error

GENERATION_CONFIG = "generation_config.json"


class SamplingError(Dsv2Error, ValueError):
    """An invalid sampling value (the message names the parameter and its valid range)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``max_tokens`` bounds the new tokens; ``stop`` are strings that end the text (they are not part
    of it); ``stop_token_ids`` end it too (``None``: the model's end-of-sequence token).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SamplingError(f"{name} must be a number (got {value!r})")
            if not math.isfinite(value):
                raise SamplingError(f"{name} must be finite (got {value!r})")
            return float(value)

        if number("temperature", self.temperature) < 0:
            raise SamplingError(
                f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding"
            )
        if not 0 < number("top_p", self.top_p) <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p}); 1 disables it")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(
                f"top_k must be an integer >= 0 (got {self.top_k!r}); 0 disables it"
            )
        if number("repetition_penalty", self.repetition_penalty) <= 0:
            raise SamplingError(
                f"repetition_penalty must be > 0 (got {self.repetition_penalty}); 1 disables it"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0
        ):
            raise SamplingError(f"seed must be an integer >= 0 (got {self.seed!r})")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max tokens must be an integer >= 1 (got {self.max_tokens!r})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingError(f"stop strings must be non-empty strings (got {s!r})")

    @property
    def greedy(self) -> bool:
        """True when every token is the arg-max."""
        return self.temperature == 0

    def updated(self, **changes: Any) -> SamplingParams:
        """A copy with the given fields changed; ``None`` values are ignored."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_generation_config(cls, model_dir: str | Path) -> SamplingParams:
        """Defaults from a model's ``generation_config.json`` (Hugging Face meaning: sampling only
        with ``do_sample``); the class defaults where there is none."""
        path = Path(model_dir) / GENERATION_CONFIG
        if not path.is_file():
            return cls()
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise SamplingError(f"{path}: unreadable ({err}); fix or delete it") from err
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        if cfg.get("do_sample"):
            hf_defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
            for key, default in hf_defaults.items():
                values[key] = default if cfg.get(key) is None else cfg[key]
        elif cfg.get("repetition_penalty") is not None:
            values["repetition_penalty"] = cfg["repetition_penalty"]
        try:
            return cls(**{k: v for k, v in values.items() if k in names})
        except SamplingError as err:
            raise SamplingError(f"{path}: {err}") from err


class Sampler:
    """Picks tokens from logits under :class:`SamplingParams`; tracks the tokens seen so far."""

    def __init__(self, params: SamplingParams, vocab_size: int, history: Sequence[int] = ()):
        self.params = params
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(params.seed)
        self._seen = np.zeros(vocab_size, dtype=bool)
        self.observe(history)

    def observe(self, tokens: Sequence[int]) -> None:
        """Mark tokens as part of the context (for the repetition penalty)."""
        if len(tokens):
            self._seen[np.asarray(tokens, dtype=np.int64)] = True

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        penalty = self.params.repetition_penalty
        if penalty == 1.0 or not self._seen.any():
            return logits
        out = np.array(logits, dtype=np.float32, copy=True)
        seen = out[self._seen]
        out[self._seen] = np.where(seen > 0, seen / penalty, seen * penalty)
        return out

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the next token is drawn from, float64 ``[vocab]`` (one-hot when
        greedy)."""
        logits = self._penalised(np.asarray(logits, dtype=np.float32))
        probs = np.zeros(logits.shape[-1], dtype=np.float64)
        if self.params.greedy:
            probs[int(np.argmax(logits))] = 1.0
            return probs
        ids, p = self._candidates(logits)
        if ids is None:
            return p.astype(np.float64)
        probs[ids] = p
        return probs

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Kept token ids (``None``: all, in id order) and their renormalised probabilities
        (most likely first when filtered). Only a small set known to hold the nucleus is sorted,
        so a step costs a few passes over the vocabulary rather than a full sort."""
        params = self.params
        z = logits.astype(np.float32) / np.float32(params.temperature)
        n, top_max = z.size, z.max()
        if 0 < params.top_k < n:  # ties with the k-th are kept, as in HF
            ids = np.flatnonzero(z >= np.partition(z, n - params.top_k)[n - params.top_k])
            total = float(np.exp(z[ids] - top_max).sum(dtype=np.float64))
        else:
            e = np.exp(z - top_max)  # float32: several times faster than float64 here
            total = float(e.sum(dtype=np.float64))
            if params.top_p >= 1.0:
                return None, e / total
            ids = np.arange(n)
            k = 256
            while k < n:  # the k most likely tokens hold the nucleus once they hold top_p
                sel = np.flatnonzero(z >= np.partition(z, n - k)[n - k])
                if e[sel].sum(dtype=np.float64) > params.top_p * total * (1 + 1e-6):
                    ids = sel
                    break
                k *= 4
        ids = ids[np.argsort(-z[ids], kind="stable")]
        p = np.exp(z[ids] - top_max).astype(np.float64) / total
        if params.top_p < 1.0:
            before = np.cumsum(p) - p  # mass of the more likely tokens
            keep = before < params.top_p
            keep[0] = True
            ids, p = ids[keep], p[keep]
        return ids, p / p.sum()

    @property
    def needs_logits(self) -> bool:
        """False when the next token is exactly the arg-max of the raw logits (greedy, no
        repetition penalty), so the caller may pick it on the device and :meth:`accept` it."""
        return not (self.params.greedy and self.params.repetition_penalty == 1.0)

    def accept(self, token: int) -> int:
        """Take ``token`` picked elsewhere (the device arg-max) as the next token."""
        token = int(token)
        self._seen[token] = True
        return token

    def sample(self, logits: np.ndarray) -> int:
        """The next token; it is added to the seen tokens."""
        logits = self._penalised(np.asarray(logits, dtype=np.float32))
        if self.params.greedy:
            token = int(np.argmax(logits))
        else:
            ids, p = self._candidates(logits)
            cdf = np.cumsum(p, dtype=np.float64)
            pick = min(
                int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right")), cdf.size - 1
            )
            token = pick if ids is None else int(ids[pick])
        self._seen[token] = True
        return token

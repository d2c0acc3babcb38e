"""One generation on one KV sequence: prefill, sample, decode, detokenize, stop, stream.

The text is streamed as deltas that are never taken back: an incomplete UTF-8 character, or text
that may turn out to begin a stop string, is held until it is settled. Joining the deltas gives
exactly the final text (stop string trimmed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class GenerationResult:
    """The outcome of a generation: new token ids, their text and how long it took.

    ``prompt_tokens`` is the whole prompt; ``cached_tokens`` of it were already in the KV cache
    (a chat turn reuses the conversation so far) and were not prefilled again.
    """

    token_ids: list[int]
    finish_reason: str  # "length", "stop" or "abort"
    prompt_tokens: int
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    text: str = ""
    cached_tokens: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens prefilled per second (the cached ones excluded)."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens per second after the prefill."""
        return len(self.token_ids) / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class StreamDelta:
    """One generated token and the text it settled (often empty when text is held back)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta


class GenerationStream(Iterator[StreamDelta]):
    """An iterator of :class:`StreamDelta`; :attr:`result` is set once it is exhausted (or
    closed early, then with ``finish_reason == "abort"``)."""

    def __init__(self, gen: Generator[StreamDelta, None, GenerationResult]):
        self._gen = gen
        self.result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StreamDelta:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def close(self) -> None:
        """Stop generating; the tokens so far stay in :attr:`result`."""
        self._gen.close()

    def collect(self) -> GenerationResult:
        """Run to the end and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


class _StopStrings:
    """Finds stop strings in growing text and says how much text is safe to emit."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> int:
        """Index of the earliest stop string that ends at or after ``new_from``; -1 if none."""
        start = max(0, new_from - self.longest + 1)
        hits = [i for s in self.stops if (i := text.find(s, start)) >= 0]
        return min(hits, default=-1)

    def held(self, text: str, emitted: int) -> int:
        """Length of the longest tail of ``text[emitted:]`` that begins some stop string."""
        tail = text[emitted:]
        for n in range(min(len(tail), self.longest - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0


def run_generation(
    engine: Engine,
    seq: int,
    prompt: Sequence[int],
    cached: int,
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    stop_token_ids: Sequence[int],
    max_tokens: int,
    on_finish: Callable[[GenerationResult], None] | None = None,
) -> GenerationStream:
    """Generate on ``seq``, which already holds ``prompt[:cached]``: prefill the rest, then
    sample up to ``max_tokens`` tokens. ``on_finish`` gets the result however it ends."""
    gen = _generate(
        engine, seq, list(prompt), cached, params, tokenizer, stop_token_ids, max_tokens, on_finish
    )
    next(gen)  # enter the generator, so closing it (or dropping it) always runs ``on_finish``
    return GenerationStream(gen)


def _generate(
    engine: Engine,
    seq: int,
    prompt: list[int],
    cached: int,
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    stop_token_ids: Sequence[int],
    max_tokens: int,
    on_finish: Callable[[GenerationResult], None] | None,
) -> Generator[StreamDelta, None, GenerationResult]:
    stop_ids = set(stop_token_ids)
    stops = _StopStrings(params.stop)
    detok = StreamDecoder(tokenizer) if tokenizer is not None else None
    sampler = Sampler(params, engine.config.vocab_size, prompt)
    tokens: list[int] = []
    text, emitted, reason = "", 0, "abort"
    prefill_s = decode_s = 0.0

    def extend(delta: str) -> bool:
        """Append settled text; True when it completes a stop string (the text is cut there)."""
        nonlocal text
        at = stops.find(text + delta, len(text)) if delta and stops.stops else -1
        text = text + delta if at < 0 else (text + delta)[:at]
        return at >= 0

    try:
        yield StreamDelta("", [])  # the priming step of run_generation, never seen outside
        t0 = time.perf_counter()
        logits = engine.prefill([seq], [prompt[cached:]])[0]
        t1 = time.perf_counter()
        prefill_s = t1 - t0
        picked: int | None = None  # the next token, when the device picked it (greedy)
        while True:
            token = sampler.sample(logits) if picked is None else sampler.accept(picked)
            tokens.append(token)
            finished = None
            if token in stop_ids:
                finished = "stop"
                if detok is not None:
                    extend(detok.flush())
            elif detok is not None and extend(detok.push(token)):
                finished = "stop"
            elif len(tokens) >= max_tokens:
                finished = "length"
                if detok is not None and extend(detok.flush()):
                    finished = "stop"
            if finished is not None:
                out, emitted, reason = text[emitted:], len(text), finished
                decode_s = time.perf_counter() - t1
                yield StreamDelta(out, [token], finished)
                break
            safe = len(text) - stops.held(text, emitted)
            out, emitted = text[emitted:safe], max(emitted, safe)
            if sampler.needs_logits:
                yield StreamDelta(out, [token])
                logits = engine.decode([seq], [token])[0]
            else:  # greedy: the arg-max on the device, only the token comes back; the step is
                # launched first, so the device runs while the text goes out, and the next one
                # as soon as its token is known (``follow``; undone if that token stops here)
                more = len(tokens) + 1 < max_tokens  # another step may follow this one
                follow = more and engine.overlap_steps
                pending = engine.launch_greedy([seq], [token], next_step=more, follow=follow)
                yield StreamDelta(out, [token])
                picked = int(pending.result()[0])
            decode_s = time.perf_counter() - t1
    finally:
        try:  # a launched step completes, a step begun ahead (then a stop token) is undone
            engine.settle()
        finally:
            if reason == "abort":  # closed early or failed: keep what was streamed
                text = text[:emitted]
            result = GenerationResult(
                tokens, reason, len(prompt), prefill_s, decode_s, text=text, cached_tokens=cached
            )
            if on_finish is not None:
                on_finish(result)
    return result

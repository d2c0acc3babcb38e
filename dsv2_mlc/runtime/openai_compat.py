"""An OpenAI-style chat API on an :class:`Engine`: ``engine.chat.completions.create(...)``.

The answers have the shape of the ``openai`` client's objects (``.choices[0].message.content``,
``.usage``; streamed chunks carry ``.choices[0].delta.content``). Calls share one KV sequence, so
a client that sends the growing conversation each time prefills only the new part of it.
Unset sampling values come from the model's ``generation_config.json`` (as vLLM does).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .chat import ChatSession
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class ChatMessage:
    """A whole reply."""

    role: str
    content: str


@dataclass(frozen=True)
class Usage:
    """Token counts of one call."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Choice:
    """The one answer of a non-streamed call."""

    index: int
    message: ChatMessage
    finish_reason: str


@dataclass(frozen=True)
class ChatCompletion:
    """The answer of ``create(stream=False)``."""

    id: str
    model: str
    created: int
    choices: list[Choice]
    usage: Usage
    token_ids: list[int] = field(default_factory=list)
    object: str = "chat.completion"


@dataclass(frozen=True)
class Delta:
    """New text of a streamed answer (``role`` only in the first chunk)."""

    content: str
    role: str | None = None


@dataclass(frozen=True)
class ChunkChoice:
    """The one answer's part in a chunk."""

    index: int
    delta: Delta
    finish_reason: str | None = None


@dataclass(frozen=True)
class ChatCompletionChunk:
    """One piece of ``create(stream=True)``."""

    id: str
    model: str
    created: int
    choices: list[ChunkChoice]
    token_ids: list[int] = field(default_factory=list)
    object: str = "chat.completion.chunk"


class Completions:
    """``engine.chat.completions``."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._session: ChatSession | None = None
        self._defaults: SamplingParams | None = None

    def create(
        self,
        *,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        model: str | None = None,
    ) -> ChatCompletion | Iterator[ChatCompletionChunk]:
        """Answer ``messages``; with ``stream`` an iterator of chunks instead of one answer."""
        if self._defaults is None:
            self._defaults = SamplingParams.from_generation_config(self._engine.path)
        params = self._defaults.updated(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            seed=seed,
            max_tokens=max_tokens,
            stop=(stop,) if isinstance(stop, str) else (None if stop is None else tuple(stop)),
        )
        if self._session is None:
            self._session = ChatSession(self._engine)
        gen = self._session.complete(messages, params)
        ident = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        name = model or self._engine.path.name
        created = int(time.time())
        if stream:
            return self._chunks(gen, ident, name, created)
        result = gen.collect()
        return ChatCompletion(
            id=ident,
            model=name,
            created=created,
            choices=[Choice(0, ChatMessage("assistant", result.text), result.finish_reason)],
            usage=Usage(
                result.prompt_tokens,
                len(result.token_ids),
                result.prompt_tokens + len(result.token_ids),
                result.cached_tokens,
            ),
            token_ids=result.token_ids,
        )

    @staticmethod
    def _chunks(gen, ident: str, name: str, created: int) -> Iterator[ChatCompletionChunk]:
        first, ids = True, []
        for delta in gen:
            ids.extend(delta.token_ids)
            if not delta.text and delta.finish_reason is None:
                continue  # text held back: its tokens go with the next chunk
            yield ChatCompletionChunk(
                id=ident,
                model=name,
                created=created,
                choices=[
                    ChunkChoice(
                        0, Delta(delta.text, "assistant" if first else None), delta.finish_reason
                    )
                ],
                token_ids=ids,
            )
            first, ids = False, []


class ChatNamespace:
    """``engine.chat``: holds ``completions``."""

    def __init__(self, engine: Engine):
        self.completions = Completions(engine)

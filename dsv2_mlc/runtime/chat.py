"""A multi-turn conversation that keeps its KV cache between turns.

Each turn renders the whole conversation (the chat template, or for a base model the plain
concatenation of the texts) to token ids, keeps the longest prefix already in the KV sequence,
drops the rest of the sequence and prefills only what is new. Earlier turns are never prefilled
again; the tokens a turn generated stay in the cache when they are what the rendering of the
reply gives. The result is, token for token, a fresh prefill of the rendered conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chat_template import check_messages
from .generation import GenerationResult, GenerationStream, run_generation
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class ChatStats:
    """Speeds of the last turn and how much of the context window the conversation uses."""

    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    context_used: int
    context_window: int
    turns: int

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens prefilled per second in the last turn."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens generated per second in the last turn."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def summary(self) -> str:
        """One line: prefill and decode speed, context used."""
        return (
            f"prefill: {self.prefill_tokens_per_second:.1f} tok/s ({self.prefill_tokens} tokens), "
            f"decode: {self.decode_tokens_per_second:.1f} tok/s ({self.decode_tokens} tokens), "
            f"context: {self.context_used}/{self.context_window} tokens"
        )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """A conversation with one model on one KV sequence.

    With a chat template the turns are rendered with it (and replies are stored stripped of
    surrounding whitespace, as chat front-ends do); without one (a base model) the conversation is
    plain text: every turn's text and reply are concatenated and the model continues it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        use_template: bool | None = None,
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.sampling = sampling or SamplingParams()
        if use_template is None:
            use_template = self.tokenizer.chat_template is not None
        self.use_template = use_template
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self._seq: int | None = None
        self._kv_tokens: list[int] = []  # what the KV sequence holds, token for token
        self._pending: list[int] = []  # the last generated token(s), not yet in the cache
        self._active: GenerationStream | None = None
        self._last: GenerationResult | None = None
        self._turns = 0
        self.reset()

    # -- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and free its cache."""
        self._close_active()
        if self._seq is not None:
            self.engine.remove_sequence(self._seq)
            self._seq = None
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self._kv_tokens, self._pending = [], []
        self._last, self._turns = None, 0

    def close(self) -> None:
        """Free the KV sequence."""
        self.reset()

    @property
    def context_used(self) -> int:
        """Tokens of the conversation so far (cached plus the last one generated)."""
        return len(self._kv_tokens) + len(self._pending)

    @property
    def stats(self) -> ChatStats:
        """Speeds of the last turn and the context used."""
        last = self._last
        return ChatStats(
            prefill_tokens=0 if last is None else last.prompt_tokens - last.cached_tokens,
            prefill_seconds=0.0 if last is None else last.prefill_seconds,
            decode_tokens=0 if last is None else len(last.token_ids),
            decode_seconds=0.0 if last is None else last.decode_seconds,
            context_used=self.context_used,
            context_window=self.engine.context_window,
            turns=self._turns,
        )

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    # -- rendering ------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` followed by the prompt for the model's reply."""
        if self.use_template:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            assert isinstance(ids, list)
            return ids
        messages = check_messages(messages)
        return self.tokenizer.encode("".join(m["content"] for m in messages))

    # -- turns ----------------------------------------------------------------------------------
    def stream(self, content: str, sampling: SamplingParams | None = None) -> GenerationStream:
        """Add a user turn and stream the reply (recorded in :attr:`messages` when it ends)."""
        return self.complete([*self.messages, {"role": "user", "content": content}], sampling)

    def send(self, content: str, sampling: SamplingParams | None = None) -> GenerationResult:
        """Add a user turn and return the whole reply."""
        return self.stream(content, sampling).collect()

    def complete(
        self, messages: Sequence[Mapping[str, Any]], sampling: SamplingParams | None = None
    ) -> GenerationStream:
        """Stream the reply to ``messages`` (which replace the conversation), reusing the cached
        prefix they share with it."""
        from .engine import ContextLengthError

        self._close_active()
        params = sampling or self.sampling
        messages = check_messages(messages)
        target = self.render(messages)
        window = self.engine.context_window
        if len(target) >= window:
            if any(m["role"] == "assistant" for m in messages):
                raise ContextLengthError(
                    f"the conversation is {len(target)} tokens, the context window holds "
                    f"{window}; start a new conversation (/reset) or raise the context window"
                )
            raise ContextLengthError(
                f"the prompt is {len(target)} tokens, the context window holds {window}; "
                "shorten it or raise the context window (--context-window)"
            )
        if self._seq is None:
            self._seq = self.engine.add_sequence()
        # Keep the longest cached prefix of the new rendering (at least one token to prefill).
        keep = min(_common_prefix(self._kv_tokens, target), len(target) - 1)
        self.engine.popn(self._seq, len(self._kv_tokens) - keep)
        self._kv_tokens, self._pending = self._kv_tokens[:keep], []
        stop_ids = self.engine.eos_token_ids if params.stop_token_ids is None else None
        seq = self._seq

        def finished(result: GenerationResult) -> None:
            # The prompt and all generated tokens but the last went through the model.
            held = self.engine.sequence_length(seq)
            history = target + result.token_ids
            self._kv_tokens, self._pending = history[:held], history[held:]
            reply = result.text.strip() if self.use_template else result.text
            self.messages = [*messages, {"role": "assistant", "content": reply}]
            self._last = result
            self._turns += 1
            self._active = None

        stream = run_generation(
            self.engine,
            seq,
            target,
            keep,
            params,
            self.tokenizer,
            stop_ids if stop_ids is not None else (params.stop_token_ids or ()),
            min(params.max_tokens, window - len(target)),
            on_finish=finished,
        )
        self._active = stream
        return stream

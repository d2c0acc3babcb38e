"""The :class:`~dsv2_mlc.runtime.engine.Engine`'s text side: its tokenizer, prompts, and
``generate`` / ``stream`` / ``chat`` on fresh sequences, built on the engine's token-level calls
(sequences, ``prefill``, decode steps)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Dsv2Error
from ..layout import ModelInfo
from . import api_checks as check
from .generation import GenerationResult, GenerationStream, run_generation
from .sampling import SamplingParams
from .tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from .openai_compat import ChatNamespace


class ContextLengthError(Dsv2Error, ValueError):
    """A request that does not fit the context window or the KV cache."""


class PromptError(Dsv2Error, ValueError):
    """A prompt that cannot be run (empty, or text for a model without a tokenizer)."""


class TextMixin:
    """Text-level calls of an engine: needs ``path``, ``config``, ``context_window`` and the
    token-level ``add_sequence`` / ``prefill`` / ``remove_sequence``."""

    path: Path
    config: ModelInfo
    context_window: int
    _tokenizer: Tokenizer | None
    _chat: ChatNamespace | None

    if TYPE_CHECKING:

        def add_sequence(self) -> int: ...
        def remove_sequence(self, seq: int) -> None: ...
        def prefill(self, seq_ids: Any, token_lists: Any, all_logits: bool = False) -> Any: ...

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (read from the compiled folder on first use)."""
        if self._tokenizer is None:
            tok = Tokenizer.from_dir(self.path)
            if tok.max_token_id >= self.config.vocab_size:
                raise TokenizerError(
                    f"{self.path}: the tokenizer has token ids up to {tok.max_token_id} but the "
                    f"model's vocabulary has {self.config.vocab_size}; it is not this model's "
                    "tokenizer"
                )
            self._tokenizer = tok
        return self._tokenizer

    def has_tokenizer(self) -> bool:
        """Whether the compiled folder carries a tokenizer."""
        return self._tokenizer is not None or (self.path / "tokenizer.json").is_file()

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokens that end a generation by default (the config's and the tokenizer's EOS)."""
        eos = self.config.eos_token_id
        ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if self.has_tokenizer() and self.tokenizer.eos_token_id is not None:
            if self.tokenizer.eos_token_id not in ids:
                ids.append(self.tokenizer.eos_token_id)
        return ids

    @property
    def chat(self) -> ChatNamespace:
        """OpenAI-style chat: ``engine.chat.completions.create(messages=..., stream=...)``."""
        if self._chat is None:
            from .openai_compat import ChatNamespace

            self._chat = ChatNamespace(self)
        return self._chat

    def logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """Float32 logits ``[len(prompt_ids), vocab]`` for every position of a fresh sequence."""
        seq = self.add_sequence()
        try:
            return self.prefill([seq], [prompt_ids], all_logits=True)[0]
        finally:
            self.remove_sequence(seq)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: text is tokenized (BOS first when the model wants it)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = check.token_ids(prompt, self.config.vocab_size, "a prompt of token ids")
            except check.TokenIdError as err:
                raise PromptError(str(err)) from err
        if not ids:
            raise PromptError("the prompt is empty; give at least one token of text")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        *,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generate on a fresh sequence; returns the new token ids and their text.

        Without ``sampling`` it is greedy (arg-max) with ``max_new_tokens`` 32, as it always
        was. ``max_new_tokens`` and ``stop_token_ids`` override the fields of ``sampling``;
        ``stop_token_ids`` defaults to the model's EOS. ``max_new_tokens`` must fit the context
        window with the prompt; ``sampling.max_tokens`` is cut to fit instead (generation then
        stops when the window is full, ``finish_reason == "length"``).
        """
        if max_new_tokens is None and sampling is None:
            max_new_tokens = 32
        return self.stream(prompt, max_new_tokens, stop_token_ids, sampling=sampling).collect()

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        *,
        sampling: SamplingParams | None = None,
    ) -> GenerationStream:
        """Like :meth:`generate`, as an iterator of :class:`StreamDelta` (text settled by each new
        token; joined, exactly the final text); ``.result`` holds the outcome at the end."""
        params = sampling or SamplingParams()
        if stop_token_ids is not None:
            params = params.updated(stop_token_ids=tuple(stop_token_ids))
        prompt_ids = self.encode_prompt(prompt)
        if max_new_tokens is not None:
            if len(prompt_ids) + max_new_tokens > self.context_window:
                raise ContextLengthError(
                    f"prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new tokens exceeds "
                    f"the context window of {self.context_window}; shorten the prompt or "
                    "max_new_tokens"
                )
            params = params.updated(max_tokens=max_new_tokens)
        room = self.context_window - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens, the context window holds "
                f"{self.context_window}; shorten the prompt or raise the context window"
            )
        tokenizer = self.tokenizer if (isinstance(prompt, str) or self.has_tokenizer()) else None
        if params.stop and tokenizer is None:
            raise TokenizerError("stop strings need the model's tokenizer, which it has not")
        seq = self.add_sequence()
        return run_generation(
            self,
            seq,
            prompt_ids,
            0,
            params,
            tokenizer,
            self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids,
            min(params.max_tokens, room),
            on_finish=lambda _: self.remove_sequence(seq),
        )

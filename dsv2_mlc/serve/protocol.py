"""The OpenAI wire format: request bodies (pydantic), errors, and the response objects.

Unset sampling values come from the model's ``generation_config.json`` (as vLLM does), so the
embedded default model answers greedily unless the request sets a temperature. ``top_k``,
``repetition_penalty`` and ``ignore_eos`` are accepted as extensions (vLLM's names). Fields the
engine cannot honour (``frequency_penalty``/``presence_penalty`` other than 0, ``echo``,
``logit_bias``, tools) are refused with a 400 rather than ignored.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import Dsv2Error
from .scheduler import TokenLogprob

MAX_N = 16  # choices of one request
MAX_TOP_LOGPROBS = 20


class ApiError(Dsv2Error):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the tokens

    def check_supported(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported (use repetition_penalty)", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", param="stream_options")

    @property
    def stops(self) -> tuple[str, ...] | None:
        if self.stop is None:
            return None
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    default_max_tokens: ClassVar[int | None] = None  # as many as the context window leaves

    @property
    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for completions

    @property
    def wanted_logprobs(self) -> int | None:
        return self.logprobs


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_logprobs(items: list[TokenLogprob], piece: Any) -> dict[str, Any]:
    """``choices[i].logprobs`` of the chat API; ``piece(id)`` is a token's text."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(t.token_id, t.logprob), "top_logprobs": [one(i, lp) for i, lp in t.top]}
            for t in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob], piece: Any, offset: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of the completions API (offsets into the choice's text from
    ``offset``)."""
    tokens = [piece(t.token_id) for t in items]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{piece(i): lp for i, lp in t.top} for t in items],
        "text_offset": offsets,
    }

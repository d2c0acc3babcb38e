"""The model's tokenizer: ``tokenizer.json`` through ``tokenizers``, plus ``tokenizer_config.json``
(special tokens, ``add_bos_token``, the chat template), and incremental detokenization.

``encode`` prepends BOS when the config asks for it (``add_bos_token``), as the original
checkpoints expect; ``transformers`` 5 no longer does so for these tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import Dsv2Error
from .chat_template import render_chat_template

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerError(Dsv2Error, ValueError):
    """A missing or unreadable tokenizer (the message names the file and the fix)."""


def _token_text(value: Any) -> str | None:
    """A special token as written in ``tokenizer_config.json``: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path}: unreadable ({err}); restore the model's tokenizer") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: not a JSON object; restore the model's tokenizer")
    return data


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, backend: Any, config: Mapping[str, Any] | None = None):
        self._tok = backend  # a tokenizers.Tokenizer
        config = dict(config or {})
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.special_tokens.get("eos_token"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` and (when present) ``tokenizer_config.json``,
        ``special_tokens_map.json`` and ``chat_template.jinja`` from ``path``."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / TOKENIZER_JSON
        if not file.is_file():
            raise TokenizerError(
                f"{file}: not found; this model has no tokenizer (put tokenizer.json and "
                "tokenizer_config.json beside config.json and compile again, or pass token ids)"
            )
        try:
            backend = Backend.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(
                f"{file}: unreadable ({str(err).splitlines()[0] if str(err) else err!r}); "
                "restore the model's tokenizer.json"
            ) from err
        config: dict[str, Any] = {}
        if (path / SPECIAL_TOKENS_MAP).is_file():
            config.update(_read_json(path / SPECIAL_TOKENS_MAP))
        if (path / TOKENIZER_CONFIG).is_file():
            config.update(_read_json(path / TOKENIZER_CONFIG))
        if (path / CHAT_TEMPLATE_FILE).is_file():  # how transformers >= 4.47 saves templates
            try:
                config["chat_template"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise TokenizerError(f"{path / CHAT_TEMPLATE_FILE}: unreadable ({err})") from err
        return cls(backend, config)

    # -- vocabulary -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_id(self) -> int:
        """The largest token id this tokenizer can produce."""
        return max(self._tok.get_vocab(with_added_tokens=True).values())

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token string (``None`` when unknown)."""
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token text."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token text."""
        return self.special_tokens.get("eos_token")

    # -- text -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS first when the model wants it."""
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered with the chat template, as ``transformers`` renders it
        (text, or its token ids without added BOS when ``tokenize``)."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model has no chat template (a base model); use plain completion"
            )
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class StreamDecoder:
    """Token ids in, text deltas out; never emits a partial UTF-8 character.

    Decodes a short window of ids so tokenizers that change leading spaces (SentencePiece) and
    byte-level ones alike produce exactly ``decode(all ids)`` when the deltas are joined; text that
    ends in an incomplete byte sequence (U+FFFD) is held back until the next ids complete it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are emitted

    def _text(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def push(self, token: int) -> str:
        """Add one id; returns the text it completes (may be empty)."""
        self.ids.append(int(token))
        before = self._text(self._prefix, self._read)
        now = self._text(self._prefix)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        before = self._text(self._prefix, self._read)
        now = self._text(self._prefix)
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]

"""Chat templates rendered with jinja2 the way ``transformers`` renders them.

Same sandboxed environment (``trim_blocks``, ``lstrip_blocks``, loop controls, the
``{% generation %}`` tag), the same globals (``raise_exception``, ``strftime_now``, ``namespace``)
and ``tojson`` filter, and the same variables: ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..errors import Dsv2Error


class ChatTemplateError(Dsv2Error, ValueError):
    """A chat template that cannot be rendered for the given messages (the message says why)."""


@functools.lru_cache(maxsize=8)
def _compile(template: str):  # -> jinja2.Template
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError(
            "this model has a chat template, which needs jinja2: pip install jinja2"
        ) from err

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text; it renders as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template is not valid jinja2: {err}") from err


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict copies of chat messages, each with a string ``role`` and ``content``."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(
                f"message {i} must be a mapping with a 'role' and a 'content' (got {m!r})"
            )
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} ({m['role']}) needs a string 'content'")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """``messages`` rendered with ``template`` as ``tokenizer.apply_chat_template(...,
    tokenize=False)`` renders them."""
    import jinja2

    compiled = _compile(template)
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compiled.render(
            messages=check_messages(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template rejected the messages: {err}") from err

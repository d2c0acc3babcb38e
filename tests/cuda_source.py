"""Generated CUDA source as statements, for checks of what a kernel does before or after its
PDL wait that the CPU emulation cannot see (an L2 prefetch, copies issued early).

``function_body`` finds a function's definition (not a declaration) and returns the text inside
its braces, matched by nesting; ``statements`` splits such a body into its top-level statements
(a declaration or call up to its ``;``, a whole ``if``/``else`` chain, loop or block with its
braces, a preprocessor line; comments dropped), so a check compares the places of statements in
a body rather than raw string positions.
"""

from __future__ import annotations

import re

_OPEN, _CLOSE = "({[", ")}]"


def _skip(src: str, i: int) -> int:
    """The index past the string literal, character literal or comment that starts at ``i``
    (``i`` itself when none does)."""
    if src.startswith("//", i):
        end = src.find("\n", i)
        return len(src) if end < 0 else end
    if src.startswith("/*", i):
        return src.index("*/", i + 2) + 2
    if src[i] in "\"'":
        j = i + 1
        while src[j] != src[i]:
            j += 2 if src[j] == "\\" else 1
        return j + 1
    return i


def function_body(src: str, name: str) -> str:
    """The text between the braces of the definition of the ``void`` function (a kernel, a
    device function) ``name`` in ``src``."""
    head = rf"\bvoid\s+(?:__launch_bounds__\(\d+\)\s+)?{re.escape(name)}\("
    match = re.search(head + r"[^;{]*\)\s*\{", src)
    assert match, f"no definition of {name}"
    depth, i = 1, match.end()
    while depth:
        j = _skip(src, i)
        if j != i:
            i = j
            continue
        depth += (src[i] == "{") - (src[i] == "}")
        i += 1
    return src[match.end() : i - 1]


def _without_comments(src: str) -> str:
    out, i = [], 0
    while i < len(src):
        j = _skip(src, i)
        if j == i:
            out.append(src[i])
            i += 1
            continue
        out.append(" " if src.startswith(("//", "/*"), i) else src[i:j])
        i = j
    return "".join(out)


def statements(body: str) -> list[str]:
    """The top-level statements of a function body, stripped, comments removed."""
    body = _without_comments(body)
    out, depth, start, i = [], 0, 0, 0

    def close(end: int) -> None:
        nonlocal start
        text = body[start:end].strip()
        if text:
            out.append(text)
        start = end

    while i < len(body):
        j = _skip(body, i)
        if j != i:
            i = j
            continue
        c = body[i]
        if depth == 0 and c == "#" and not body[start:i].strip():  # a preprocessor line
            end = body.find("\n", i)
            i = len(body) if end < 0 else end
            close(i)
            continue
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0 and c == "}" and not re.match(r"\s*else\b", body[i + 1 :]):
                close(i + 1)  # the end of a block (and of its if/else chain)
        elif c == ";" and depth == 0:
            close(i + 1)
        i += 1
    close(len(body))
    return out

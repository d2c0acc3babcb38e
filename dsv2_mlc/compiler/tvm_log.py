"""Keep TVM's known-benign C++ log lines out of a compile's output.

TVM's C++ side logs straight to file descriptor 2 (``std::cerr``), out of reach of ``sys.stderr``
and of Python's warning filters, and has no switch to mute one warning. While lowering,
:func:`benign_tvm_lines_hidden` points descriptor 2 at a temporary file; when the block ends it
passes every line on to the real stderr except those of :data:`BENIGN_TVM_LINES`. The generated
code is untouched: only what is printed changes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

BENIGN_TVM_LINES = (
    # topi's ``take`` in its default "fast" mode (no bounds clamp) warns, once per legalised
    # ``take``, that an out-of-range index would read out of bounds. The model's takes read rows
    # at indices that are in range by construction: the token embedding (the runtime checks every
    # token id against the vocabulary first, ``Engine._checked_ids``) and the rows whose logits are
    # returned (``logit_positions``: each sequence's last token, or every token, which the runtime
    # counts from the lengths of the batch it passes).
    "Warning: Fast mode segfaults when there are out-of-bounds indices",
)


@contextlib.contextmanager
def benign_tvm_lines_hidden(hidden: tuple[str, ...] = BENIGN_TVM_LINES) -> Iterator[None]:
    """Within the block, drop the stderr lines that contain one of ``hidden``; every other line
    (TVM's or Python's) reaches stderr, in order, when the block ends."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    patterns = [h.encode() for h in hidden]
    with tempfile.TemporaryFile() as buf:
        _flush_python_stderr()
        os.dup2(buf.fileno(), 2)
        try:
            yield
        finally:
            _flush_python_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            buf.seek(0)
            kept = [
                line
                for line in buf.read().splitlines(keepends=True)
                if not any(p in line for p in patterns)
            ]
            if kept:
                with os.fdopen(os.dup(2), "wb") as err:
                    err.write(b"".join(kept))


def _flush_python_stderr() -> None:
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stderr.flush()

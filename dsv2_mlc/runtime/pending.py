"""The tokens of a launched greedy step (:meth:`Engine.launch_greedy`), taken when needed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["PendingTokens"]


class PendingTokens:
    """The tokens of a greedy step from :meth:`Engine.launch_greedy`: :meth:`result` waits for
    the device where the step's graph is still running. A step launched with ``follow`` launches
    the next one on these tokens inside :meth:`result`, right after the wait."""

    def __init__(self, wait: Callable[[], np.ndarray]) -> None:
        self._wait: Callable[[], np.ndarray] | None = wait
        self._tokens: np.ndarray | None = None
        self._then: Callable[[np.ndarray], None] | None = None

    @property
    def done(self) -> bool:
        """Whether :meth:`result` has been taken (the step has completed)."""
        return self._wait is None

    def result(self) -> np.ndarray:
        """The next token ids, int64 ``[len(seq_ids)]`` (the same array on every call)."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._tokens = wait()
        assert self._tokens is not None
        then, self._then = self._then, None
        if then is not None:
            then(self._tokens)
        return self._tokens

    def _follow(self, then: Callable[[np.ndarray], None] | None) -> None:
        """Call ``then(tokens)`` once they are known (now, if they are); None: do not."""
        self._then = then
        if then is not None and self.done:
            self.result()

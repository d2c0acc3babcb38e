"""The errors a user can cause (bad input, not bugs): the CLI prints them as one line.

Every error class of dsv2-mlc derives from :class:`Dsv2Error` (and keeps a standard base such as
``ValueError``), so ``except Dsv2Error`` catches all of them. This module imports nothing of the
project: any layer may import it.
"""

from __future__ import annotations


class Dsv2Error(Exception):
    """The base of every dsv2-mlc error: the message names the problem and the fix."""


class UsageError(Dsv2Error, ValueError):
    """A request the library cannot honour (unknown option value, unsupported combination)."""

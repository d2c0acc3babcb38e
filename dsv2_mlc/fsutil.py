"""Filesystem helpers shared by the compiler and the artifact store."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import Dsv2Error


class UnwritableFolderError(Dsv2Error, OSError):
    """A folder that cannot be created or written (the message names it and the fix)."""


def replace_dir(new: Path, dest: Path) -> None:
    """Move the finished folder ``new`` to ``dest`` (same filesystem), replacing what was there.

    The old folder is renamed aside first and deleted only after ``new`` is in place, so ``dest``
    always holds either the old or the new content, never a mixture. The caller decides whether
    what ``dest`` holds may be deleted (the compiler replaces only an earlier build).
    """
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
    os.replace(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_dir(dest: Path, before_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A temporary folder beside ``dest`` to build into; it replaces ``dest`` (``replace_dir``)
    when the block succeeds, and is deleted, leaving ``dest`` untouched, when it raises.

    ``before_replace(dest)`` runs after the block, just before ``dest`` is replaced: it raises
    when ``dest`` holds something that must not be deleted (a file added while the block ran).
    A folder that cannot be created is an :class:`UnwritableFolderError`.
    """
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    except OSError as err:
        raise UnwritableFolderError(
            f"{dest.parent}: cannot write there ({err.strerror or err}); choose an output folder "
            "you can write to"
        ) from err
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it private; a build folder is not
        yield tmp
        if before_replace is not None:
            before_replace(dest)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Filesystem helpers shared by the compiler and the artifact store."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def replace_dir(new: Path, dest: Path) -> None:
    """Move the finished folder ``new`` to ``dest`` (same filesystem), replacing what was there.

    The old folder is renamed aside first and deleted only after ``new`` is in place, so ``dest``
    always holds either the old or the new content, never a mixture.
    """
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
    os.replace(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(dest: Path) -> Iterator[Path]:
    """A temporary folder beside ``dest`` to build into; it replaces ``dest`` (``replace_dir``)
    when the block succeeds, and is deleted, leaving ``dest`` untouched, when it raises."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield tmp
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

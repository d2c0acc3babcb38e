"""Filesystem helpers shared by the compiler and the artifact store."""

from __future__ import annotations

import os
import shutil
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

"""The per-user cache folder of dsv2-mlc: compiled builds and installed artifacts live in it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "DSV2_MLC_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$DSV2_MLC_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsv2-mlc``, else ``~/.cache/dsv2-mlc``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dsv2-mlc"

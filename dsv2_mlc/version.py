"""The versions of dsv2-mlc and of the TVM it builds with (no TVM import)."""

from __future__ import annotations

import contextlib
import importlib.metadata

__version__ = "0.1.0"


def tvm_version() -> str:
    """The installed TVM version (read from package metadata, without importing TVM)."""
    for dist in ("apache-tvm", "tvm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "none"

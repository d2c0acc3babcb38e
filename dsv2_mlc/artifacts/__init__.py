"""Prebuilt artifacts: package a compiled model, pull it (verified) into the per-user cache, and
run it with only ``apache-tvm-ffi`` and the TVM runtime libraries bundled in it.

The format is specified in ``dist/README.md``. Nothing here imports the TVM compiler.
"""

from __future__ import annotations

from .errors import (
    ArtifactError,
    ArtifactExistsError,
    ArtifactNotFoundError,
    CorruptArtifactError,
    DownloadError,
    HashMismatchError,
    IncompleteDownloadError,
    ManifestError,
    MissingFileError,
    RuntimeVersionError,
    TargetMismatchError,
)
from .manifest import Manifest
from .package import PackageResult, package_artifact
from .pull import PullResult, pull
from .store import InstalledArtifact, list_installed, open_installed, remove_installed

__all__ = [
    "ArtifactError",
    "ArtifactExistsError",
    "ArtifactNotFoundError",
    "CorruptArtifactError",
    "DownloadError",
    "HashMismatchError",
    "IncompleteDownloadError",
    "InstalledArtifact",
    "Manifest",
    "ManifestError",
    "MissingFileError",
    "PackageResult",
    "PullResult",
    "RuntimeVersionError",
    "TargetMismatchError",
    "list_installed",
    "open_installed",
    "package_artifact",
    "pull",
    "remove_installed",
]

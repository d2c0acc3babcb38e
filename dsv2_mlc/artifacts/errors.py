"""What can go wrong with an artifact: each error's message names the problem and the fix.

Every failure of ``dsv2-mlc pull`` leaves the artifact cache exactly as it was (a partial download
kept for resuming lives beside it, in ``downloads/``).
"""

from __future__ import annotations

from ..errors import Dsv2Error


class ArtifactError(Dsv2Error, ValueError):
    """An artifact that cannot be packaged, pulled, installed or opened."""


class ArtifactNotFoundError(ArtifactError):
    """A source or name that points at no artifact."""


class ManifestError(ArtifactError):
    """A ``manifest.json`` that is missing, unreadable or malformed."""


class HashMismatchError(ArtifactError):
    """A file whose size or SHA-256 differs from what the manifest (or the index) says."""


class IncompleteDownloadError(ArtifactError):
    """A download that stopped early; the partial file is kept and the next pull resumes it."""


class DownloadError(ArtifactError):
    """A download the server refused (HTTP error, unreachable host)."""


class MissingFileError(ArtifactError):
    """A file the manifest lists that the artifact (or the installed copy) does not hold."""


class TargetMismatchError(ArtifactError):
    """An artifact built for another device, GPU architecture or machine than this one."""


class RuntimeVersionError(ArtifactError):
    """An artifact built with another TVM / tvm-ffi version than the one installed here."""


class ArtifactExistsError(ArtifactError):
    """An artifact of that name, but a different build, is already installed."""


class CorruptArtifactError(ArtifactError):
    """An artifact file that is not a readable artifact (truncated, damaged, or another file)."""

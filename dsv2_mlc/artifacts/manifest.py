"""``manifest.json``: what an artifact is, what it runs on, and the size and SHA-256 of each file.

The format is specified in ``dist/README.md``. The manifest's own identity is the SHA-256 of its
exact bytes (``manifest_sha256``), which is what ``dist/index.json`` publishes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from .errors import ManifestError

ARTIFACT_FORMAT = "dsv2-mlc-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RUNTIME_LIB_DIR = "lib"  # the bundled TVM runtime libraries
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BLOCK = 1 << 20


def check_name(name: str) -> str:
    """``name`` if it is a valid artifact name (letters, digits, ``.``, ``_``, ``-``)."""
    if not NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise ManifestError(
            f"invalid artifact name {name!r}: use letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit)"
        )
    return name


def check_relpath(path: str) -> str:
    """``path`` if it is a safe relative POSIX path inside an artifact (no ``..``, not absolute)."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or str(p) != path or "\\" in path:
        raise ManifestError(f"unsafe file path {path!r} in manifest; the artifact is not valid")
    return path


def sha256_stream(stream: BinaryIO, sink: BinaryIO | None = None) -> tuple[int, str]:
    """Size and SHA-256 of what ``stream`` yields (copied to ``sink`` when given)."""
    h = hashlib.sha256()
    size = 0
    for block in iter(lambda: stream.read(_BLOCK), b""):
        h.update(block)
        size += len(block)
        if sink is not None:
            sink.write(block)
    return size, h.hexdigest()


def sha256_file(path: str | Path) -> tuple[int, str]:
    """Size and SHA-256 of a file."""
    with open(path, "rb") as f:
        return sha256_stream(f)


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact: its relative path, size in bytes and SHA-256 (hex)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Target:
    """What an artifact runs on.

    ``device``: ``"cpu"`` or ``"cuda"``; ``os`` and ``machine``: the host code's platform
    (``"linux"``, ``"x86_64"`` / ``"aarch64"``); ``cuda_arch``: the GPU architecture of the
    embedded kernels (``"sm_90"``); ``cuda_runtime``: the major version of the bundled CUDA runtime
    (the driver must support it); ``tvm_target``: the TVM target of the build, for the record.
    """

    device: str
    os: str
    machine: str
    cuda_arch: str | None = None
    cuda_runtime: int | None = None
    tvm_target: str = ""

    def describe(self) -> str:
        """A short human form: ``cpu linux/x86_64`` or ``cuda sm_90 linux/x86_64``."""
        gpu = f" {self.cuda_arch}" if self.cuda_arch else ""
        return f"{self.device}{gpu} {self.os}/{self.machine}"


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of an artifact."""

    name: str
    model: dict[str, Any]
    quantization: str
    dtype: str
    target: Target
    tvm_version: str
    tvm_ffi_version: str
    dsv2_mlc_version: str
    files: tuple[FileEntry, ...]
    runtime_libs: tuple[str, ...] = field(default_factory=tuple)
    format: str = ARTIFACT_FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def size(self) -> int:
        """Bytes of all files (the manifest excluded)."""
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry | None:
        """The entry of ``path``, if listed."""
        return next((f for f in self.files if f.path == path), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (key order fixed, so equal manifests serialise to equal bytes)."""
        return {
            "format": self.format,
            "format_version": self.format_version,
            "name": self.name,
            "model": self.model,
            "quantization": self.quantization,
            "dtype": self.dtype,
            "target": asdict(self.target),
            "tvm_version": self.tvm_version,
            "tvm_ffi_version": self.tvm_ffi_version,
            "dsv2_mlc_version": self.dsv2_mlc_version,
            "runtime_libs": list(self.runtime_libs),
            "files": [asdict(f) for f in self.files],
        }

    def to_bytes(self) -> bytes:
        """The exact bytes written as ``manifest.json``."""
        return (json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str = MANIFEST) -> Manifest:
        """Parse and validate ``manifest.json`` (``where`` names it in errors)."""
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ManifestError(f"{where}: not valid JSON ({err}); get the artifact again") from err
        if not isinstance(raw, dict) or raw.get("format") != ARTIFACT_FORMAT:
            raise ManifestError(f"{where}: not a dsv2-mlc artifact manifest")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: artifact format {raw.get('format_version')} is not the supported "
                f"{FORMAT_VERSION}; upgrade dsv2-mlc or pull an artifact packaged by this version"
            )
        try:
            target = Target(**raw["target"])
            files = tuple(FileEntry(**f) for f in raw["files"])
            manifest = cls(
                name=check_name(str(raw["name"])),
                model=dict(raw["model"]),
                quantization=str(raw["quantization"]),
                dtype=str(raw["dtype"]),
                target=target,
                tvm_version=str(raw["tvm_version"]),
                tvm_ffi_version=str(raw["tvm_ffi_version"]),
                dsv2_mlc_version=str(raw["dsv2_mlc_version"]),
                files=files,
                runtime_libs=tuple(raw.get("runtime_libs", ())),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ManifestError):
                raise
            raise ManifestError(f"{where}: malformed manifest ({err!r}); get it again") from err
        seen: set[str] = set()
        for f in files:
            check_relpath(f.path)
            if f.path == MANIFEST or f.path in seen:
                raise ManifestError(f"{where}: {f.path} listed twice; the artifact is not valid")
            if not isinstance(f.size, int) or f.size < 0 or not _SHA256.fullmatch(str(f.sha256)):
                raise ManifestError(f"{where}: bad size or sha256 for {f.path}")
            seen.add(f.path)
        for lib in manifest.runtime_libs:
            if lib not in seen:
                raise ManifestError(f"{where}: runtime library {lib} is not among its files")
        return manifest


def manifest_sha256(data: bytes) -> str:
    """The identity of an artifact: the SHA-256 of its ``manifest.json`` bytes."""
    return hashlib.sha256(data).hexdigest()

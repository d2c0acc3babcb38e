"""``dist/index.json``: the published artifacts, each with where to get it and the hashes that
identify it (the SHA-256 of its manifest and of its file). ``dsv2-mlc pull NAME`` looks NAME up
here and refuses anything that does not match.

A NAME is never a path: a SOURCE spelled like an artifact name (see :func:`is_name`) is looked up
in the index only, even where a file or folder of that name is in the current directory; a local
file or folder is passed as a path (``./NAME``, any path with a ``/``, or ``NAME.tar``).

An entry's ``url`` is absolute, or relative to the index's own location (a path or a URL), so an
index and its artifacts can be published together in one folder.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArtifactNotFoundError, DownloadError, ManifestError
from .manifest import NAME_PATTERN

INDEX_FORMAT = "dsv2-mlc-index"
INDEX_FORMAT_VERSION = 1
INDEX_ENV = "DSV2_MLC_INDEX"
MAX_INDEX_BYTES = 16 << 20  # an index lists artifacts: a few hundred bytes each
ARTIFACT_FILE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class IndexEntry:
    """One published artifact: its name, absolute location, and the hashes to verify."""

    name: str
    url: str
    manifest_sha256: str
    sha256: str | None
    size: int | None
    target: dict[str, Any]


def default_index() -> str | None:
    """``$DSV2_MLC_INDEX``, else this source checkout's ``dist/index.json`` (if present)."""
    if os.environ.get(INDEX_ENV):
        return os.environ[INDEX_ENV]
    repo_index = Path(__file__).resolve().parents[2] / "dist" / "index.json"
    return str(repo_index) if repo_index.is_file() else None


def is_url(text: str) -> bool:
    """Whether ``text`` is an ``http(s)://`` or ``file://`` URL."""
    return urllib.parse.urlsplit(text).scheme in ("http", "https", "file")


def is_name(source: str) -> bool:
    """Whether SOURCE is spelled as an artifact name (``[A-Za-z0-9][A-Za-z0-9._-]*``, no
    ``/``, not ending in ``.tar``/``.tar.gz``/``.tgz``/``.tar.bz2``/``.tar.xz``) rather than as a
    path or URL. A name means an artifact (in the index, or installed), never a local file."""
    return (
        NAME_PATTERN.fullmatch(source) is not None
        and source not in (".", "..")
        and not source.lower().endswith(ARTIFACT_FILE_SUFFIXES)
        and not is_url(source)
    )


def local_path(location: str) -> Path | None:
    """The local path of a plain path or ``file://`` URL (``None`` for http(s))."""
    parts = urllib.parse.urlsplit(location)
    if parts.scheme == "file":
        return Path(urllib.request.url2pathname(parts.path))
    if parts.scheme in ("http", "https"):
        return None
    return Path(location).expanduser()


def read_index(location: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """The parsed index at a path or URL."""
    path = local_path(location)
    try:
        if path is not None:
            with open(path, "rb") as f:
                data = f.read(MAX_INDEX_BYTES + 1)
        else:
            with urllib.request.urlopen(location, timeout=timeout) as resp:
                data = resp.read(MAX_INDEX_BYTES + 1)
    except (OSError, ValueError, http.client.HTTPException) as err:
        raise DownloadError(f"cannot read the artifact index {location} ({err})") from err
    if len(data) > MAX_INDEX_BYTES:
        raise ManifestError(
            f"{location}: larger than {MAX_INDEX_BYTES >> 20} MiB; not a dsv2-mlc artifact index"
        )
    try:
        index = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ManifestError(f"{location}: not a valid artifact index ({err})") from err
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise ManifestError(f"{location}: not a dsv2-mlc artifact index")
    if index.get("format_version") != INDEX_FORMAT_VERSION:
        raise ManifestError(
            f"{location}: index format {index.get('format_version')} is not the supported "
            f"{INDEX_FORMAT_VERSION}; upgrade dsv2-mlc"
        )
    if not isinstance(index.get("artifacts", []), list):
        raise ManifestError(f'{location}: "artifacts" is not a list; not a valid artifact index')
    return index


def resolve_url(index_location: str, url: str) -> str:
    """An entry's ``url`` made absolute against the index's location."""
    if is_url(url) or Path(url).is_absolute():
        return url
    if local_path(index_location) is None:
        return urllib.parse.urljoin(index_location, url)
    base = local_path(index_location)
    assert base is not None
    return str(base.resolve().parent / url)


def lookup(name: str, location: str, *, timeout: float = 60.0) -> IndexEntry:
    """The entry called ``name`` in the index at ``location`` (its fields' types checked)."""
    index = read_index(location, timeout=timeout)
    entries = {e.get("name"): e for e in index.get("artifacts", []) if isinstance(e, dict)}
    if name not in entries:
        known = ", ".join(sorted(str(n) for n in entries)) or "none"
        raise ArtifactNotFoundError(
            f"{name!r} is not an artifact in the index {location} (published: {known}); a "
            f"local file or folder is given as a path (./{name}, a path with '/', or NAME.tar)"
        )
    e = entries[name]
    if not e.get("url") or not e.get("manifest_sha256"):
        raise ArtifactNotFoundError(
            f"{name} is listed in {location} but not published yet (no url/manifest_sha256); "
            "build it with scripts/build_artifacts.py, or pull a path or URL"
        )
    return IndexEntry(
        name=name,
        url=resolve_url(location, _field(e, "url", location, str)),
        manifest_sha256=_sha256(e, "manifest_sha256", location),
        sha256=_sha256(e, "sha256", location) if e.get("sha256") is not None else None,
        size=_field(e, "size", location, int) if e.get("size") is not None else None,
        target=dict(_field(e, "target", location, dict) if e.get("target") is not None else {}),
    )


def _field(entry: dict[str, Any], key: str, location: str, kind: type) -> Any:
    """``entry[key]`` if it has the type ``kind`` (a size also >= 0; no bool for an int)."""
    value = entry.get(key)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok or (kind is int and value < 0):
        what = {str: "a string", int: "a number of bytes", dict: "an object"}[kind]
        raise ManifestError(
            f"{location}: artifact {entry.get('name')}: {key} is {value!r}, not {what}; the "
            "index is damaged: get it again"
        )
    return value


def _sha256(entry: dict[str, Any], key: str, location: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not _SHA256.fullmatch(value.lower()):
        raise ManifestError(
            f"{location}: artifact {entry.get('name')}: {key} is {value!r}, not a SHA-256 (64 hex "
            "digits); the index is damaged: get it again"
        )
    return value.lower()


def entry_for(result: Any, url: str) -> dict[str, Any]:
    """The index entry of a :class:`~dsv2_mlc.artifacts.package.PackageResult` published at
    ``url`` (absolute, or relative to the index)."""
    m = result.manifest
    return {
        "name": m.name,
        "model": m.model.get("name"),
        "quantization": m.quantization,
        "dtype": m.dtype,
        "target": {
            "device": m.target.device,
            "os": m.target.os,
            "machine": m.target.machine,
            "cuda_arch": m.target.cuda_arch,
            "cuda_runtime": m.target.cuda_runtime,
        },
        "tvm_version": m.tvm_version,
        "tvm_ffi_version": m.tvm_ffi_version,
        "url": url,
        "size": result.size,
        "sha256": result.sha256,
        "manifest_sha256": result.manifest_sha256,
    }


def write_index(path: str | Path, entries: list[dict[str, Any]], **extra: Any) -> Path:
    """Write an index of ``entries`` (sorted by name) to ``path``."""
    path = Path(path)
    index = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_FORMAT_VERSION,
        **extra,
        "artifacts": sorted(entries, key=lambda e: e["name"]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(index, indent=1) + "\n")
    return path

"""``dsv2-mlc pull SOURCE``: fetch an artifact, verify every file, install it atomically.

SOURCE is an artifact file (a local path or a ``file://`` / ``http(s)://`` URL), an unpacked
artifact folder (``manifest.json`` + files), or the name of an artifact in the index
(``dist/index.json``, ``--index`` or ``$DSV2_MLC_INDEX``), which also supplies the hashes the
artifact must have. HTTP downloads resume (see :mod:`.download`); a partial download waits in
``downloads/`` beside the installed artifacts and is deleted once used or found bad.

Before anything is installed: the manifest is checked (its SHA-256 against the index or
``--sha256``; no file beside the listed ones), this machine must be able to run the artifact
(target, GPU arch, tvm-ffi version; skip with ``check=False``), and every file's size and SHA-256
must match while it is copied into a staging folder. Any failure leaves the cache as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import tarfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from . import store
from .download import download
from .errors import (
    ArtifactNotFoundError,
    CorruptArtifactError,
    HashMismatchError,
    IncompleteDownloadError,
    ManifestError,
    MissingFileError,
)
from .index import IndexEntry, default_index, is_url, local_path, lookup
from .manifest import MANIFEST, NAME_PATTERN, Manifest, manifest_sha256, sha256_file
from .target import check_compatible

_MAX_MANIFEST = 64 << 20


@dataclass(frozen=True)
class PullResult:
    """What was installed (or found installed already) and where."""

    name: str
    path: Path
    manifest: Manifest
    manifest_sha256: str
    source: str
    already_installed: bool


class _TarSource:
    """An artifact file: an (uncompressed or compressed) tar with ``manifest.json``."""

    def __init__(self, path: Path, label: str):
        self.label = label
        try:
            self.tar = tarfile.open(path, "r:*")
            self.members = {}
            for info in self.tar.getmembers():
                name = str(PurePosixPath(info.name))
                if info.isdir():
                    continue
                if not info.isfile():
                    raise CorruptArtifactError(
                        f"{label}: member {info.name} is not a regular file; not a valid artifact"
                    )
                self.members[name] = info
        except (tarfile.TarError, EOFError, OSError) as err:
            raise CorruptArtifactError(
                f"{label}: not a readable artifact file ({err}); it is truncated or damaged: "
                "download it again"
            ) from err

    def names(self) -> set[str]:
        return set(self.members)

    def open(self, rel: str) -> BinaryIO | None:
        info = self.members.get(rel)
        if info is None:
            return None
        stream = self.tar.extractfile(info)
        return _Guarded(stream, self.label) if stream is not None else None

    def close(self) -> None:
        self.tar.close()


class _Guarded:
    """A tar member stream whose truncation surfaces as :class:`CorruptArtifactError`."""

    def __init__(self, stream: BinaryIO, label: str):
        self.stream, self.label = stream, label

    def read(self, n: int = -1) -> bytes:
        try:
            return self.stream.read(n)
        except (tarfile.TarError, EOFError, OSError) as err:
            raise CorruptArtifactError(
                f"{self.label}: truncated or damaged ({err}); download it again"
            ) from err

    def __enter__(self) -> _Guarded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()


class _FolderSource:
    """An unpacked artifact: a folder with ``manifest.json`` and the files it lists."""

    def __init__(self, path: Path, label: str):
        self.path, self.label = path, label

    def names(self) -> set[str]:
        return {p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file()}

    def open(self, rel: str) -> BinaryIO | None:
        file = self.path / rel
        return open(file, "rb") if file.is_file() else None

    def close(self) -> None:
        pass


def _read_manifest(src: _TarSource | _FolderSource) -> bytes:
    stream = src.open(MANIFEST)
    if stream is None:
        raise ManifestError(
            f"{src.label}: no {MANIFEST}; not a dsv2-mlc artifact (make one with "
            "`dsv2-mlc package COMPILED_DIR -o ARTIFACT`)"
        )
    with stream:
        data = stream.read(_MAX_MANIFEST + 1)
    if len(data) > _MAX_MANIFEST:
        raise ManifestError(f"{src.label}: {MANIFEST} is implausibly large; not an artifact")
    return data


def _download_path(url: str, cache_dir: str | Path | None) -> Path:
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    base = Path(urllib.parse.urlsplit(url).path).name or "artifact"
    return store.downloads_root(cache_dir) / f"{key}-{base}.partial"


def _resolve(source: str, index: str | None, timeout: float) -> tuple[str, IndexEntry | None]:
    """SOURCE as a location (path or URL), with its index entry when SOURCE is a name."""
    if is_url(source):
        return source, None
    if Path(source).expanduser().exists():
        return source, None
    location = index or default_index()
    if NAME_PATTERN.fullmatch(source) and location is not None:
        entry = lookup(source, location, timeout=timeout)
        return entry.url, entry
    raise ArtifactNotFoundError(
        f"{source}: no such file or folder"
        + ("" if location is None else f", and not a name in the index {location}")
        + "; pass an artifact file, folder, URL, or a name listed in dist/index.json"
    )


def pull(
    source: str,
    *,
    cache_dir: str | Path | None = None,
    sha256: str | None = None,
    index: str | None = None,
    force: bool = False,
    check: bool = True,
    progress: bool = True,
    timeout: float = 60.0,
) -> PullResult:
    """Fetch, verify and install the artifact ``source`` into the cache (see the module doc).

    ``sha256`` is the expected SHA-256 of the artifact's ``manifest.json`` (what the index
    publishes). ``force`` replaces another build of the same name. ``check=False`` installs an
    artifact this machine cannot run (it is checked again when opened).
    """
    location, entry = _resolve(source, index, timeout)
    expected = (sha256 or (entry.manifest_sha256 if entry else None) or "").lower() or None
    path = local_path(location)
    partial: Path | None = None
    created: list[Path] = []
    if path is None:  # http(s)
        partial = _download_path(location, cache_dir)
        created = store.make_dirs(partial.parent)
        try:
            download(
                location,
                partial,
                expected_size=entry.size if entry else None,
                progress=progress,
                timeout=timeout,
            )
        except IncompleteDownloadError:
            raise  # the partial file stays for the next pull to resume
        except BaseException:
            if partial.is_file() and partial.stat().st_size == 0:
                partial.unlink()
            store.remove_dirs(created)
            raise
        path = partial
    elif not path.exists():
        raise ArtifactNotFoundError(f"{location}: no such file or folder")
    try:
        result = _install_from(path, location, entry, expected, cache_dir, force, check, progress)
    except BaseException:
        if partial is not None:  # bad or unusable: a resume cannot fix it
            _drop(partial)
        raise
    if partial is not None:
        _drop(partial)
    return result


def _drop(partial: Path) -> None:
    """Delete a used (or useless) download, and its folder once empty."""
    partial.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        partial.parent.rmdir()


def _install_from(
    path: Path,
    label: str,
    entry: IndexEntry | None,
    expected: str | None,
    cache_dir: str | Path | None,
    force: bool,
    check: bool,
    progress: bool,
) -> PullResult:
    if entry is not None and entry.sha256 and path.is_file():
        size, digest = sha256_file(path)
        if digest != entry.sha256:
            raise HashMismatchError(
                f"{label}: the file has sha256 {digest[:16]}... ({size} bytes), the index says "
                f"{entry.sha256[:16]}... ({entry.size} bytes); download it again (nothing was "
                "installed)"
            )
    src: _TarSource | _FolderSource = (
        _FolderSource(path, label) if path.is_dir() else _TarSource(path, label)
    )
    try:
        data = _read_manifest(src)
        msha = manifest_sha256(data)
        if expected is not None and msha != expected:
            raise HashMismatchError(
                f"{label}: manifest.json has sha256 {msha[:16]}..., expected {expected[:16]}...; "
                "this is not the published artifact: get it from the right source"
            )
        manifest = Manifest.from_bytes(data, f"{label}: {MANIFEST}")
        extra = sorted(src.names() - {MANIFEST} - {f.path for f in manifest.files})
        if extra:
            raise ManifestError(
                f"{label}: holds files its manifest does not list ({', '.join(extra[:3])}); it "
                "was changed after packaging: get it again"
            )
        if check:
            check_compatible(manifest)
        installed = store.get_installed(manifest.name, cache_dir)
        if installed is not None and installed.manifest_sha256 == msha and not force:
            try:
                store.check_files(installed)
                return PullResult(manifest.name, installed.path, manifest, msha, label, True)
            except (MissingFileError, HashMismatchError):
                force = True  # the installed copy was damaged: replace it with this one
        dest = store.install(
            src.open,
            manifest,
            data,
            source=label,
            cache_dir=cache_dir,
            force=force,
            progress=progress,
        )
    finally:
        src.close()
    return PullResult(manifest.name, dest, manifest, msha, label, False)

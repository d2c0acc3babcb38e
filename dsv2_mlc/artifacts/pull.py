"""``dsv2-mlc pull SOURCE``: fetch an artifact, verify every file, install it atomically.

SOURCE is an artifact file (a local path or a ``file://`` / ``http(s)://`` URL), an unpacked
artifact folder (``manifest.json`` + files), or the name of an artifact in the index
(``dist/index.json``, ``--index`` or ``$DSV2_MLC_INDEX``), which also supplies the hashes the
artifact must have. A name is never a path (:func:`~.index.is_name`): ``pull NAME`` uses the
index even where a file or folder NAME is in the current directory; that one is ``./NAME``.
HTTP downloads are bounded by the declared size and resume (see :mod:`.download`); a partial
download waits in ``downloads/`` beside the installed artifacts and is deleted once used or
found bad.

Before anything is installed: the manifest is checked (its SHA-256 against the index or
``--sha256``; no file beside the listed ones), this machine must be able to run the artifact
(target, GPU arch, tvm-ffi version; skip with ``check=False``), and every file's size and SHA-256
must match while it is copied into a staging folder - a file is cut off as soon as it exceeds
its declared size (a tar member whose header says another size is refused before any copying),
and ``manifest.json`` itself may be at most :data:`MAX_MANIFEST` bytes. Any failure leaves the
cache as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import tarfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from . import store
from .download import download
from .errors import (
    ArtifactError,
    ArtifactNotFoundError,
    CorruptArtifactError,
    HashMismatchError,
    ManifestError,
    MissingFileError,
)
from .index import IndexEntry, default_index, is_name, is_url, local_path, lookup
from .manifest import MANIFEST, Manifest, manifest_sha256, sha256_file
from .target import check_compatible

MAX_MANIFEST = 16 << 20  # bytes; a manifest lists files: ~150 bytes each


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
    """An artifact file: an (uncompressed or compressed) tar with ``manifest.json``. Only
    regular files and folders may be members, each path once."""

    def __init__(self, path: Path, label: str):
        self.label = label
        self.members: dict[str, tarfile.TarInfo] = {}
        try:
            self.tar = tarfile.open(path, "r:*")
        except PermissionError:
            raise  # not damage: cache_access names the file
        except (tarfile.TarError, EOFError, OSError, ValueError) as err:
            raise CorruptArtifactError(
                f"{label}: not a readable artifact file ({err}); it is truncated or damaged: "
                "download it again"
            ) from err
        try:
            for info in self.tar:  # headers only: no member is extracted here
                name = PurePosixPath(info.name).as_posix()
                if info.isdir():
                    continue
                if not info.isfile():
                    raise CorruptArtifactError(
                        f"{label}: member {info.name!r} is a {_kind(info)}, not a regular file; "
                        "not a valid artifact"
                    )
                if name in self.members:
                    raise CorruptArtifactError(
                        f"{label}: member {info.name!r} is in it twice; not a valid artifact"
                    )
                self.members[name] = info
        except (tarfile.TarError, EOFError, OSError, ValueError) as err:
            self.tar.close()
            raise CorruptArtifactError(
                f"{label}: not a readable artifact file ({err}); it is truncated or damaged: "
                "download it again"
            ) from err
        except BaseException:
            self.tar.close()
            raise

    def names(self) -> set[str]:
        return set(self.members)

    def size(self, rel: str) -> int | None:
        """The size a member's header declares (what reading it yields)."""
        info = self.members.get(rel)
        return None if info is None else info.size

    def open(self, rel: str) -> BinaryIO | None:
        info = self.members.get(rel)
        if info is None:
            return None
        stream = self.tar.extractfile(info)
        return _Guarded(stream, self.label) if stream is not None else None

    def close(self) -> None:
        self.tar.close()


def _kind(info: tarfile.TarInfo) -> str:
    if info.issym():
        return f"symbolic link (to {info.linkname!r})"
    if info.islnk():
        return f"hard link (to {info.linkname!r})"
    if info.isdev():
        return "device or FIFO"
    return "special member"


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

    def close(self) -> None:
        self.stream.close()

    def __enter__(self) -> _Guarded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _FolderSource:
    """An unpacked artifact: a folder with ``manifest.json`` and the files it lists."""

    def __init__(self, path: Path, label: str):
        self.path, self.label = path, label

    def names(self) -> set[str]:
        return {p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file()}

    def size(self, rel: str) -> int | None:
        file = self.path / rel
        return file.stat().st_size if file.is_file() else None

    def open(self, rel: str) -> BinaryIO | None:
        file = self.path / rel
        return open(file, "rb") if file.is_file() else None

    def close(self) -> None:
        pass


class _Bounded:
    """A file's stream that fails as soon as it yields more than the manifest's size for it, so
    no more than that is ever written (a compressed member can expand to anything)."""

    def __init__(self, stream: BinaryIO, limit: int, label: str, rel: str):
        self.stream, self.limit, self.label, self.rel = stream, limit, label, rel
        self.seen = 0

    def read(self, n: int = -1) -> bytes:
        want = (
            self.limit - self.seen + 1 if n is None or n < 0 else min(n, self.limit - self.seen + 1)
        )
        data = self.stream.read(want)
        self.seen += len(data)
        if self.seen > self.limit:
            raise HashMismatchError(
                f"{self.label}: {self.rel} is larger than the {self.limit} bytes the manifest "
                "says; the artifact is corrupted or forged (nothing was installed)"
            )
        return data

    def __enter__(self) -> _Bounded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()


def _read_manifest(src: _TarSource | _FolderSource) -> bytes:
    size = src.size(MANIFEST)
    stream = src.open(MANIFEST)
    if stream is None or size is None:
        raise ManifestError(
            f"{src.label}: no {MANIFEST}; not a dsv2-mlc artifact (make one with "
            "`dsv2-mlc package COMPILED_DIR -o ARTIFACT`)"
        )
    if size > MAX_MANIFEST:
        stream.close()
        raise ManifestError(
            f"{src.label}: {MANIFEST} is {size} bytes, more than the {MAX_MANIFEST} a manifest "
            "may have; not an artifact"
        )
    with stream:
        data = stream.read(MAX_MANIFEST + 1)
    if len(data) > MAX_MANIFEST:
        raise ManifestError(f"{src.label}: {MANIFEST} is implausibly large; not an artifact")
    return data


def _download_path(url: str, cache_dir: str | Path | None) -> Path:
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    base = Path(urllib.parse.urlsplit(url).path).name or "artifact"
    return store.downloads_root(cache_dir) / f"{key}-{base}.partial"


def _resolve(source: str, index: str | None, timeout: float) -> tuple[str, IndexEntry | None]:
    """SOURCE as a location (path or URL), with its index entry when SOURCE is a name.

    A name (:func:`~.index.is_name`) is only ever looked up in the index, never taken for a
    file or folder of that name in the current directory (that one is ``./NAME``)."""
    if is_url(source) or not is_name(source):
        return source, None
    here = Path(source)
    hint = (
        f"; the {'folder' if here.is_dir() else 'file'} {source} in the current directory is "
        f"not used for a name: pass ./{source} to pull it"
        if here.exists()
        else ""
    )
    location = index or default_index()
    if location is None:
        raise ArtifactNotFoundError(
            f"{source!r} looks like an artifact name, and there is no artifact index to look it "
            "up in: pass --index PATH_OR_URL (or set DSV2_MLC_INDEX), or an artifact file, "
            f"folder or URL{hint}"
        )
    try:
        entry = lookup(source, location, timeout=timeout)
    except ArtifactNotFoundError as err:
        if hint:
            raise ArtifactNotFoundError(f"{err}{hint}") from err
        raise
    return entry.url, entry


@contextlib.contextmanager
def cache_access(cache_dir: str | Path | None, *, write: bool = True) -> Iterator[None]:
    """Turn a permission error on the artifact cache into an :class:`ArtifactError` naming the
    folder and the fix (the commands ``pull``, ``rm`` and, with ``write=False``, ``list`` run
    under it); one on a file outside the cache (an unreadable SOURCE) says so."""
    try:
        yield
    except PermissionError as err:
        root = store.cache_root(cache_dir)
        where = Path(err.filename) if err.filename else None
        try:
            inside = where is not None and where.resolve().is_relative_to(root.resolve())
        except OSError:
            inside = False
        if where is not None and not inside:
            msg = f"cannot read {where} ({err.strerror}); check its permissions"
            raise ArtifactError(msg) from err
        able = "writable" if write else "readable"
        raise ArtifactError(
            f"the artifact cache {root} is not {able} ({err.strerror}: {where or root}); make it "
            f"{able}, or use another cache folder: --cache-dir DIR or DSV2_MLC_CACHE_DIR=DIR"
        ) from err


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
    with cache_access(cache_dir):
        return _pull(source, cache_dir, sha256, index, force, check, progress, timeout)


def _pull(
    source: str,
    cache_dir: str | Path | None,
    sha256: str | None,
    index: str | None,
    force: bool,
    check: bool,
    progress: bool,
    timeout: float,
) -> PullResult:
    location, entry = _resolve(source, index, timeout)
    expected = (sha256 or (entry.manifest_sha256 if entry else None) or "").lower() or None
    path = local_path(location)
    partial: Path | None = None
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
        except BaseException:
            # download() keeps the partial file only when it can be resumed (bounded by its
            # declared size); otherwise it is gone, and so are the folders made for it
            if partial.is_file() and partial.stat().st_size == 0:
                partial.unlink()
            if not partial.exists():
                store.remove_dirs(created)
            raise
        path = partial
    elif path.is_dir() or path.is_file():
        pass
    elif path.exists():
        raise ArtifactNotFoundError(f"{location}: neither a file nor a folder; not an artifact")
    else:
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
        declared = {f.path: f.size for f in manifest.files}
        extra = sorted(src.names() - {MANIFEST} - set(declared))
        if extra:
            raise ManifestError(
                f"{label}: holds files its manifest does not list "
                f"({', '.join(map(repr, extra[:3]))}); it was changed after packaging: get it again"
            )
        if isinstance(src, _TarSource):  # a member's header fixes its size: check before copying
            for rel, size in declared.items():
                have = src.size(rel)
                if have is not None and have != size:
                    raise HashMismatchError(
                        f"{label}: {rel} is {have} bytes, the manifest says {size}; the artifact "
                        "is corrupted or forged (nothing was installed)"
                    )

        def open_bounded(rel: str) -> BinaryIO | None:
            stream = src.open(rel)
            return None if stream is None else _Bounded(stream, declared[rel], label, rel)

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
            open_bounded,
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

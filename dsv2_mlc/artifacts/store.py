"""The installed artifacts in the per-user cache: install atomically, list, remove, open by name.

Layout under the cache folder (``$DSV2_MLC_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsv2-mlc``, else
``~/.cache/dsv2-mlc``; see :mod:`dsv2_mlc.paths`)::

    artifacts/NAME/                  one installed artifact: manifest.json + its files
    artifacts/.NAME.staging-XXXX/    an install in progress (renamed to NAME when verified)
    downloads/KEY-FILE.partial       an interrupted download, resumed by the next pull

An install writes and verifies every file in a staging folder inside ``artifacts/`` and then
renames it into place (one ``rename``, atomic on POSIX); any failure removes the staging folder
and every folder it created, so the cache is left exactly as it was. Installs and removals hold an
exclusive lock on the ``artifacts/`` folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..fsutil import replace_dir
from ..paths import default_cache_dir
from .errors import (
    ArtifactExistsError,
    ArtifactNotFoundError,
    HashMismatchError,
    ManifestError,
    MissingFileError,
)
from .manifest import (
    MANIFEST,
    NAME_PATTERN,
    RUNTIME_LIB_DIR,
    Manifest,
    manifest_sha256,
    sha256_file,
)
from .manifest import sha256_stream as _copy_hashed

ARTIFACTS_DIR = "artifacts"
DOWNLOADS_DIR = "downloads"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The per-user cache folder (``cache_dir`` when given)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def artifacts_root(cache_dir: str | Path | None = None) -> Path:
    """Where installed artifacts live."""
    return cache_root(cache_dir) / ARTIFACTS_DIR


def downloads_root(cache_dir: str | Path | None = None) -> Path:
    """Where interrupted downloads wait to be resumed."""
    return cache_root(cache_dir) / DOWNLOADS_DIR


@dataclass(frozen=True)
class InstalledArtifact:
    """An artifact in the cache."""

    path: Path
    manifest: Manifest
    manifest_sha256: str

    @property
    def name(self) -> str:
        """The artifact's name (also its folder's name)."""
        return self.manifest.name


def read_installed(path: Path) -> InstalledArtifact:
    """The installed artifact in folder ``path``."""
    data = (path / MANIFEST).read_bytes()
    manifest = Manifest.from_bytes(data, str(path / MANIFEST))
    return InstalledArtifact(path, manifest, manifest_sha256(data))


def get_installed(name: str, cache_dir: str | Path | None = None) -> InstalledArtifact | None:
    """The installed artifact called ``name``, if any."""
    if not NAME_PATTERN.fullmatch(name):
        return None
    path = artifacts_root(cache_dir) / name
    if not (path / MANIFEST).is_file():
        return None
    return read_installed(path)


def list_installed(cache_dir: str | Path | None = None) -> list[InstalledArtifact]:
    """Every installed artifact, by name (folders with an unreadable manifest are skipped)."""
    root = artifacts_root(cache_dir)
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not (path / MANIFEST).is_file():
            continue
        with contextlib.suppress(ManifestError, OSError):
            out.append(read_installed(path))
    return out


def _not_installed(name: str, cache_dir: str | Path | None) -> ArtifactNotFoundError:
    names = ", ".join(a.name for a in list_installed(cache_dir)) or "none"
    return ArtifactNotFoundError(
        f"no installed artifact named {name!r} (installed: {names}); `dsv2-mlc pull SOURCE` "
        "installs one"
    )


def make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the folders it created, outermost first."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    created = []
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
            created.append(d)
    return created


def remove_dirs(created: list[Path]) -> None:
    """Remove the (still empty) folders :func:`make_dirs` created, innermost first."""
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the folder ``root`` itself (no lock file is left behind)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def install(
    open_file: Callable[[str], BinaryIO | None],
    manifest: Manifest,
    manifest_bytes: bytes,
    *,
    source: str,
    cache_dir: str | Path | None = None,
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Copy every file of ``manifest`` from ``open_file(path)`` into the cache, verifying its size
    and SHA-256, then move the finished folder into place atomically; returns its path.

    ``open_file`` returns ``None`` for a file the source does not hold. An installed artifact of
    the same name and a different manifest is replaced only with ``force``.
    """
    root = artifacts_root(cache_dir)
    created = make_dirs(root)
    staging: Path | None = None
    try:
        with _locked(root):
            dest = root / manifest.name
            _check_replace(dest, manifest_sha256(manifest_bytes), force)
            staging = Path(tempfile.mkdtemp(prefix=f".{manifest.name}.staging-", dir=root))
            _fill(staging, open_file, manifest, source, progress)
            (staging / MANIFEST).write_bytes(manifest_bytes)
            replace_dir(staging, dest)
            staging = None
            return dest
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        remove_dirs(created)
        raise


def _check_replace(dest: Path, new_sha: str, force: bool) -> None:
    if not dest.exists() or force:
        return
    try:
        old = read_installed(dest).manifest_sha256
    except (ManifestError, OSError):
        old = "unreadable"
    if old != new_sha:
        raise ArtifactExistsError(
            f"another build of {dest.name} is installed (manifest sha256 {old[:12]}, this one "
            f"{new_sha[:12]}); `dsv2-mlc rm {dest.name}` first, or pull with --force"
        )


def _fill(
    staging: Path,
    open_file: Callable[[str], BinaryIO | None],
    manifest: Manifest,
    source: str,
    progress: bool,
) -> None:
    from tqdm import tqdm

    with tqdm(
        total=manifest.size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"verifying {manifest.name}",
        disable=not progress,
        leave=False,
    ) as bar:
        for entry in manifest.files:
            stream = open_file(entry.path)
            if stream is None:
                raise MissingFileError(
                    f"{source}: {entry.path} is listed in the manifest but missing from the "
                    "artifact; download (or package) the artifact again"
                )
            out = staging / entry.path
            out.parent.mkdir(parents=True, exist_ok=True)
            with stream, open(out, "wb") as sink:
                size, digest = _copy_hashed(stream, sink)
            bar.update(size)
            if (size, digest) != (entry.size, entry.sha256):
                what = (
                    f"{size} bytes, the manifest says {entry.size}"
                    if size != entry.size
                    else f"sha256 {digest[:16]}..., the manifest says {entry.sha256[:16]}..."
                )
                raise HashMismatchError(
                    f"{source}: {entry.path} is corrupted ({what}); download the artifact again "
                    "(nothing was installed)"
                )


def remove_installed(name: str, cache_dir: str | Path | None = None) -> Path:
    """Delete the installed artifact ``name`` (renamed away first, so it vanishes at once)."""
    art = get_installed(name, cache_dir)
    if art is None:
        raise _not_installed(name, cache_dir)
    root = artifacts_root(cache_dir)
    with _locked(root):
        doomed = Path(tempfile.mkdtemp(prefix=f".{name}.removing-", dir=root))
        os.replace(art.path, doomed / name)
        shutil.rmtree(doomed)
    return art.path


def check_files(art: InstalledArtifact, *, full: bool = True) -> None:
    """Every file the manifest lists is present with its size and, with ``full``, its SHA-256
    (what ``pull`` checks before it calls an artifact installed, so a damaged copy is replaced).
    Opening checks the sizes here; the runtime hashes the libraries before it loads them
    (:mod:`dsv2_mlc.runtime.integrity`)."""
    fix = f"reinstall it: `dsv2-mlc pull {art.name} --force` (or the artifact file it came from)"
    for entry in art.manifest.files:
        path = art.path / entry.path
        if not path.is_file():
            raise MissingFileError(f"{path}: missing from the installed artifact; {fix}")
        if path.stat().st_size != entry.size:
            raise HashMismatchError(
                f"{path}: {path.stat().st_size} bytes, the manifest says {entry.size}; the "
                f"installed artifact was modified: {fix}"
            )
        if full and sha256_file(path)[1] != entry.sha256:
            raise HashMismatchError(
                f"{path}: its sha256 is not the manifest's; the installed artifact was modified: "
                f"{fix}"
            )


def open_installed(name: str, cache_dir: str | Path | None = None) -> Path:
    """Ready the installed artifact ``name`` to run: its files present, this machine and the
    installed tvm-ffi able to run it, its bundled TVM runtime preferred; returns its folder."""
    from ..runtime import tvm_runtime
    from .target import check_compatible

    art = get_installed(name, cache_dir)
    if art is None:
        raise _not_installed(name, cache_dir)
    check_files(art, full=False)  # sizes; the runtime hashes what it loads
    check_compatible(art.manifest)
    if art.manifest.runtime_libs:
        tvm_runtime.prefer_lib_dir(art.path / RUNTIME_LIB_DIR)
    return art.path


def installed_artifact(model: str, cache_dir: str | Path | None = None) -> Path | None:
    """The hook MODEL resolution calls (:func:`dsv2_mlc.resolve.resolve_model`):
    the ready folder of the installed artifact called ``model``, or ``None`` if there is none."""
    if get_installed(model, cache_dir) is None:
        return None
    return open_installed(model, cache_dir)


def format_listing(arts: list[InstalledArtifact]) -> str:
    """A table of installed artifacts (what ``dsv2-mlc list`` prints)."""
    if not arts:
        return "no artifacts installed (`dsv2-mlc pull SOURCE` installs one)"
    rows = [("NAME", "TARGET", "QUANT", "SIZE", "MANIFEST SHA256", "PATH")]
    for a in arts:
        m = a.manifest
        rows.append(
            (
                a.name,
                m.target.describe(),
                m.quantization,
                _human(m.size),
                a.manifest_sha256[:16],
                str(a.path),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    )


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"

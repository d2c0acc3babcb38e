"""Artifact commands against hostile or malformed input: a name is never a path, extraction and
downloads stop at the declared sizes, and malformed indexes, tars, caches and compiled folders
give the project's one-line errors (never a traceback), each leaving the cache as it was.

The artifacts here are small synthetic ones (a manifest and a few files, no compiled model), so
these tests need no compiler; what they check is the pull/package machinery itself."""

from __future__ import annotations

import collections
import hashlib
import importlib
import io
import json
import os
import tarfile
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from http_server import serving, url

from dsv2_mlc.artifacts import (
    ArtifactError,
    ArtifactNotFoundError,
    CorruptArtifactError,
    DownloadError,
    HashMismatchError,
    ManifestError,
    pull,
    store,
)
from dsv2_mlc.artifacts import download as download_mod
from dsv2_mlc.artifacts import target as target_mod
from dsv2_mlc.artifacts.index import is_name, write_index
from dsv2_mlc.artifacts.manifest import MANIFEST, FileEntry, Manifest, Target
from dsv2_mlc.cli import main
from dsv2_mlc.errors import Dsv2Error
from dsv2_mlc.layout import BUILD_CONFIG, FORMAT_VERSION, BuildConfig
from dsv2_mlc.resolve import ModelNotFoundError, resolve_model

pull_mod = importlib.import_module("dsv2_mlc.artifacts.pull")  # the package exports pull()
NAME = "tiny-art-cpu"


# -- synthetic artifacts -----------------------------------------------------------------------
def build_config() -> bytes:
    config = BuildConfig(FORMAT_VERSION, model={}, dtype="float32", device="cpu", target="llvm")
    return json.dumps(config.to_dict()).encode()


def make_files(tag: str = "published") -> dict[str, bytes]:
    return {
        BUILD_CONFIG: build_config(),
        "model.so": f"library {tag}\n".encode() * 100,
        "params/params_shard_0.bin": bytes(range(256)) * 64,
    }


def manifest_of(files: dict[str, bytes], name: str = NAME) -> Manifest:
    entries = tuple(
        FileEntry(p, len(d), hashlib.sha256(d).hexdigest()) for p, d in sorted(files.items())
    )
    return Manifest(
        name=name,
        model={"name": "tiny"},
        quantization="q0f32",
        dtype="float32",
        target=Target("cpu", "linux", target_mod.host_machine()),
        tvm_version="0",
        tvm_ffi_version="0",
        dsv2_mlc_version="0",
        files=entries,
    )


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: Path, files: dict[str, bytes], manifest: Manifest | None = None) -> Path:
    """An artifact file: the manifest first, then ``files`` (all of them, listed or not)."""
    data = (manifest or manifest_of(files)).to_bytes()
    with tarfile.open(path, "w") as tar:
        add(tar, MANIFEST, data)
        for rel, blob in sorted(files.items()):
            add(tar, rel, blob)
    return path


def write_folder(path: Path, files: dict[str, bytes], manifest: Manifest | None = None) -> Path:
    for rel, blob in {**files, MANIFEST: (manifest or manifest_of(files)).to_bytes()}.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(blob)
    return path


def index_entry(tar: Path, url: str, name: str = NAME) -> dict:
    data = tar.read_bytes()
    with tarfile.open(tar) as t:
        manifest = t.extractfile(MANIFEST).read()
    return {
        "name": name,
        "url": url,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
        "target": {"device": "cpu"},
    }


def snapshot(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {
        p.relative_to(root).as_posix(): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def published(tmp_path) -> tuple[Path, Path]:
    """A published artifact and the index listing it (relative URL): (index, artifact file)."""
    pub = tmp_path / "pub"
    pub.mkdir()
    tar = write_tar(pub / f"{NAME}.tar", make_files())
    index = write_index(pub / "index.json", [index_entry(tar, f"{NAME}.tar")])
    return index, tar


@pytest.fixture
def no_compat_check(monkeypatch):
    """The synthetic artifacts run nowhere: skip the target/runtime check where pulls run it."""
    monkeypatch.setattr(pull_mod, "check_compatible", lambda manifest: None)
    monkeypatch.setattr(target_mod, "check_compatible", lambda manifest: None)


# -- names are not paths -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("dsv2-coder-tiny-q4f32_g32-cpu", True),
        ("a.b_c-1", True),
        ("./dsv2-coder-tiny-q4f32_g32-cpu", False),
        ("dir/name", False),
        ("/abs/name", False),
        ("~/name", False),
        ("name.tar", False),
        ("name.TAR.GZ", False),
        ("name.tgz", False),
        (".hidden", False),
        ("..", False),
        ("has space", False),
        ("http://host/name", False),
        ("file:///x/name", False),
    ],
)
def test_is_name_spelling(source, name):
    assert is_name(source) is name


def test_pull_by_name_ignores_a_same_named_folder_in_cwd(
    published, tmp_path, monkeypatch, capsys, no_compat_check
):
    """The reported case: a tampered folder NAME in the current directory, with a manifest
    consistent with its tampering, must not be installed for `pull NAME --index`."""
    index, tar = published
    work = tmp_path / "work"
    forged = make_files("forged")
    write_folder(work / NAME, forged)
    monkeypatch.chdir(work)
    cache = tmp_path / "cache"

    assert main(["pull", NAME, "--index", str(index), "--cache-dir", str(cache), "--quiet"]) == 0
    installed = store.artifacts_root(cache) / NAME
    assert (installed / "model.so").read_bytes() == make_files()["model.so"]  # the published one
    entry = json.loads(index.read_text())["artifacts"][0]
    got = hashlib.sha256((installed / MANIFEST).read_bytes()).hexdigest()
    assert got == entry["manifest_sha256"]
    capsys.readouterr()

    # The folder is pulled when given as a path (here: another build of the name, so --force).
    with pytest.raises(ArtifactError, match="another build of"):
        pull(f"./{NAME}", cache_dir=cache, progress=False)
    assert pull(f"./{NAME}", cache_dir=cache, force=True, progress=False).name == NAME
    assert (installed / "model.so").read_bytes() == forged["model.so"]


def test_pull_unknown_name_says_how_to_pull_the_folder(published, tmp_path, monkeypatch, capsys):
    index, _ = published
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local-art").mkdir()
    before = snapshot(tmp_path / "cache")
    argv = ["pull", "local-art", "--index", str(index), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "'local-art' is not an artifact in the index" in err[0]
    assert err[0].endswith(
        "the folder local-art in the current directory is not used for a "
        "name: pass ./local-art to pull it"
    )
    # No index at all: the name cannot be looked up, and is still not taken for the folder.
    monkeypatch.setattr(pull_mod, "default_index", lambda: None)
    with pytest.raises(ArtifactNotFoundError, match=r"no artifact index.*pass ./local-art"):
        pull("local-art", cache_dir=tmp_path / "cache", progress=False)
    assert snapshot(tmp_path / "cache") == before


def test_model_name_means_the_installed_artifact_not_a_folder_in_cwd(
    published, tmp_path, monkeypatch, no_compat_check
):
    """`dsv2-mlc chat NAME` / dsv2_mlc.load(NAME): an installed artifact's name means it, even
    with a same-named folder in the current directory; ./NAME (or a Path) is the folder."""
    _, tar = published
    cache = tmp_path / "cache"
    pull(str(tar), cache_dir=cache, progress=False)
    work = tmp_path / "work"
    (work / NAME).mkdir(parents=True)  # not a model folder: choosing it would raise
    monkeypatch.chdir(work)
    notes: list[str] = []
    assert (
        resolve_model(NAME, cache_dir=cache, log=notes.append) == store.artifacts_root(cache) / NAME
    )
    assert notes == [
        f"{NAME}: the installed artifact {store.artifacts_root(cache) / NAME} (for the folder "
        f"{NAME} here, pass ./{NAME})"
    ]
    for folder in (f"./{NAME}", Path(NAME)):
        with pytest.raises(ModelNotFoundError, match=rf"^{NAME}: neither a checkpoint folder"):
            resolve_model(folder, cache_dir=cache)
    # A name that is not installed is still the folder of that name.
    with pytest.raises(ModelNotFoundError, match=rf"^{NAME}: neither a checkpoint folder"):
        resolve_model(NAME, cache_dir=tmp_path / "empty-cache")


# -- bounded extraction --------------------------------------------------------------------------
class _Zeros(io.RawIOBase):
    """``n`` zero bytes, streamed (so a huge member needs no memory to write)."""

    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        k = min(len(buf), self.left)
        buf[:k] = bytes(k)
        self.left -= k
        return k


@pytest.fixture
def written(monkeypatch) -> list[int]:
    """The bytes each file copied into staging got (what the install wrote)."""
    sizes: list[int] = []
    copy = store._copy_hashed

    def spy(stream, sink):
        class Counting:
            def write(self, block):
                sizes[-1] += len(block)
                return sink.write(block)

        sizes.append(0)
        return copy(stream, Counting())

    monkeypatch.setattr(store, "_copy_hashed", spy)
    return sizes


def test_compressed_member_larger_than_declared_is_refused_before_copying(tmp_path, written):
    """The reported case: a small .tar.gz whose dsv2-mlc.json expands far past the size the
    manifest declares is refused from the tar header, before anything is written."""
    files = make_files()
    big = 64 << 20
    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz", compresslevel=1) as tar:
        add(tar, MANIFEST, manifest_of(files).to_bytes())
        info = tarfile.TarInfo(BUILD_CONFIG)
        info.size = big
        tar.addfile(info, io.BufferedReader(_Zeros(big)))
    assert bomb.stat().st_size < big // 100
    cache = tmp_path / "cache"
    msg = rf"dsv2-mlc\.json is {big} bytes, the manifest says {len(files[BUILD_CONFIG])}"
    with pytest.raises(HashMismatchError, match=msg):
        pull(str(bomb), cache_dir=cache, check=False, progress=False)
    assert written == []  # nothing reached the staging folder
    assert snapshot(cache) == {}


def test_folder_file_larger_than_declared_stops_at_the_declared_size(tmp_path, written):
    files = make_files()
    folder = write_folder(tmp_path / "art", files)
    declared = len(files["params/params_shard_0.bin"])
    (folder / "params/params_shard_0.bin").write_bytes(bytes(8 << 20))  # grew after packaging
    with pytest.raises(
        HashMismatchError,
        match=rf"params_shard_0\.bin is larger than the "
        rf"{declared} bytes the manifest says",
    ):
        pull(str(folder), cache_dir=tmp_path / "cache", check=False, progress=False)
    assert max(written) <= declared  # cut off at the declared size, not copied whole
    assert snapshot(tmp_path / "cache") == {}


def test_oversized_manifest_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(pull_mod, "MAX_MANIFEST", 1000)
    art = tmp_path / "big-manifest.tar"
    with tarfile.open(art, "w") as tar:
        add(tar, MANIFEST, b" " * 1001)
    with pytest.raises(ManifestError, match="manifest.json is 1001 bytes, more than the 1000"):
        pull(str(art), cache_dir=tmp_path / "cache", check=False, progress=False)
    assert snapshot(tmp_path / "cache") == {}


# -- malformed tars and indexes: one-line errors -------------------------------------------------
def _special(tar: tarfile.TarFile, kind: str) -> None:
    info = tarfile.TarInfo(
        {"backslash": "params\\x.bin", "absolute": "/etc/x", "dotdot": "../x"}.get(kind, "odd")
    )
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        info.type, info.linkname = tarfile.LNKTYPE, MANIFEST
    elif kind == "device":
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    elif kind == "fifo":
        info.type = tarfile.FIFOTYPE
    if kind in ("backslash", "absolute", "dotdot"):
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    elif kind == "duplicate":
        add(tar, MANIFEST, b"{}")
    else:
        tar.addfile(info)


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("symlink", CorruptArtifactError, r"member 'odd' is a symbolic link \(to '/etc/passwd'\)"),
        ("hardlink", CorruptArtifactError, r"member 'odd' is a hard link \(to 'manifest.json'\)"),
        ("device", CorruptArtifactError, "member 'odd' is a device or FIFO, not a regular file"),
        ("fifo", CorruptArtifactError, "member 'odd' is a device or FIFO, not a regular file"),
        ("duplicate", CorruptArtifactError, "member 'manifest.json' is in it twice"),
        ("backslash", ManifestError, r"does not list \('params\\\\x.bin'\)"),
        ("absolute", ManifestError, r"does not list \('/etc/x'\)"),
        ("dotdot", ManifestError, r"does not list \('../x'\)"),
    ],
)
def test_malformed_tar_members_are_refused(kind, error, message, tmp_path, capsys):
    files = make_files()
    art = write_tar(tmp_path / "art.tar", files)
    with tarfile.open(art, "a") as tar:
        _special(tar, kind)
    cache = tmp_path / "cache"
    with pytest.raises(error, match=message):
        pull(str(art), cache_dir=cache, check=False, progress=False)
    assert main(["pull", str(art), "--cache-dir", str(cache), "--no-check", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv2-mlc pull: error: ")
    assert snapshot(cache) == {}


def test_manifest_listing_a_backslash_path_is_refused(tmp_path):
    files = {**make_files(), "params\\y.bin": b"y"}
    art = write_tar(tmp_path / "art.tar", files, manifest_of(files))
    with pytest.raises(ManifestError, match=r"unsafe file path 'params\\\\y.bin'"):
        pull(str(art), cache_dir=tmp_path / "cache", check=False, progress=False)


def _bad_index(entry: dict, key: str, value) -> dict:
    return {**entry, key: value}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("sha256", 12, "sha256 is 12, not a SHA-256"),
        ("sha256", "xyz", "sha256 is 'xyz', not a SHA-256"),
        ("manifest_sha256", ["a"], r"manifest_sha256 is \['a'\], not a SHA-256"),
        ("size", "7", "size is '7', not a number of bytes"),
        ("size", -1, "size is -1, not a number of bytes"),
        ("size", True, "size is True, not a number of bytes"),
        ("url", 5, "url is 5, not a string"),
        ("target", ["cpu"], r"target is \['cpu'\], not an object"),
    ],
)
def test_index_entry_of_the_wrong_type_is_refused(key, value, message, published, tmp_path, capsys):
    index, tar = published
    entry = index_entry(tar, str(tar))
    bad = write_index(tmp_path / "bad.json", [_bad_index(entry, key, value)])
    with pytest.raises(ManifestError, match=rf"artifact {NAME}: {message}.*index is damaged"):
        pull(NAME, index=str(bad), cache_dir=tmp_path / "cache", check=False, progress=False)
    argv = ["pull", NAME, "--index", str(bad), "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    assert main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert snapshot(tmp_path / "cache") == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[1, 2]", "not a dsv2-mlc artifact index"),
        (b'{"format": "dsv2-mlc-index", "format_version": 1, "artifacts": 5}', "is not a list"),
        (b"\xff\xfe{", "not a valid artifact index"),
        (b"{", "not a valid artifact index"),
    ],
)
def test_malformed_index_is_refused(content, message, tmp_path, capsys):
    bad = tmp_path / "index.json"
    bad.write_bytes(content)
    with pytest.raises(ManifestError, match=message):
        pull(NAME, index=str(bad), cache_dir=tmp_path / "cache", progress=False)
    assert main(["pull", NAME, "--index", str(bad), "--cache-dir", str(tmp_path / "c")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# -- read-only cache -----------------------------------------------------------------------------
CACHE_FIX = "or use another cache folder: --cache-dir DIR or DSV2_MLC_CACHE_DIR=DIR"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_cache_real(published, tmp_path, capsys, no_compat_check):
    _, tar = published
    cache = tmp_path / "cache"
    pull(str(tar), cache_dir=cache, progress=False)
    (store.artifacts_root(cache)).chmod(0o555)
    try:
        for argv in (["pull", str(tar), "--force"], ["rm", NAME]):
            assert main([*argv, "--cache-dir", str(cache)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and CACHE_FIX in err[0] and str(cache) in err[0]
    finally:
        (store.artifacts_root(cache)).chmod(0o755)


def test_read_only_cache_pull_rm_list(published, tmp_path, monkeypatch, capsys, no_compat_check):
    """The errors a read-only (or unreadable) cache gives, as root too: os calls that fail the
    way they do there."""
    _, tar = published
    cache = tmp_path / "cache"
    pull(str(tar), cache_dir=cache, progress=False)
    before = snapshot(cache)
    root = store.artifacts_root(cache)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(root / ".x"))

    monkeypatch.setattr(store.tempfile, "mkdtemp", denied)  # the staging / removal folder
    for argv in (["pull", str(tar), "--force", "--no-check", "--quiet"], ["rm", NAME]):
        assert main([*argv, "--cache-dir", str(cache)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"dsv2-mlc {argv[0]}: error: the artifact cache {cache} is not writable (Permission "
            f"denied: {root / '.x'}); make it writable, {CACHE_FIX}"
        ]
    monkeypatch.setattr(Path, "iterdir", denied)
    assert main(["list", "--cache-dir", str(cache)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dsv2-mlc list: error: the artifact cache {cache} is not readable (Permission denied: "
        f"{root / '.x'}); make it readable, {CACHE_FIX}"
    ]
    monkeypatch.undo()
    assert snapshot(cache) == before

    unreadable = tmp_path / "elsewhere.tar"

    def no_read(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(unreadable))

    monkeypatch.setattr(pull_mod.tarfile, "open", no_read)
    unreadable.write_bytes(b"x")
    with pytest.raises(ArtifactError, match=rf"cannot read {unreadable} \(Permission denied\)"):
        pull(str(unreadable), cache_dir=cache, progress=False)


# -- bounded downloads ---------------------------------------------------------------------------
SERVER_BUDGET = 256 << 20  # the most any test server sends on one request, whatever the client


class _Server(ThreadingHTTPServer):  # (the attributes serving() sets)
    files: dict[str, bytes]
    requests: list[tuple[str, str | None]]
    sent: list[int]


class _Handler(BaseHTTPRequestHandler):
    """``/endless*``: zeros without a Content-Length (HTTP/1.0, ends when the client hangs up,
    or at SERVER_BUDGET); others: static files with ``bytes=N-`` ranges."""

    protocol_version = "HTTP/1.0"
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        srv = self.server
        rng = self.headers.get("Range")
        srv.requests.append((self.path, rng))
        if self.path.startswith("/endless"):
            self.send_response(200)
            self.end_headers()
            sent, block = 0, bytes(1 << 16)
            try:
                while sent < SERVER_BUDGET:
                    self.wfile.write(block)
                    sent += len(block)
            except OSError:
                pass
            srv.sent.append(sent)
            return
        data = srv.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start = int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http() -> Iterator[_Server]:
    """A local HTTP server on a free loopback port, shut down after the test (or 60 s)."""
    with serving(_Handler, 60, files={}, requests=[], sent=[]) as srv:
        yield srv


def test_endless_download_without_a_size_stops_at_the_cap(http, tmp_path, monkeypatch):
    """The reported case: a server streaming forever without a Content-Length. The download
    stops at the cap on undeclared sizes (here lowered to 4 MiB) and the partial is deleted."""
    cap = 4 << 20
    monkeypatch.setattr(download_mod, "MAX_UNDECLARED", cap)
    cache = tmp_path / "cache"
    msg = r"sent more than 4194304 bytes \(the cap on downloads\).*partial download was deleted"
    with pytest.raises(DownloadError, match=msg):
        pull(url(http, "/endless/a.tar"), cache_dir=cache, progress=False, timeout=10)
    assert snapshot(cache) == {}  # no partial file, no downloads/ folder


def test_endless_download_stops_at_the_index_size(http, published, tmp_path):
    """By name, the index's size bounds the download, whatever the server sends."""
    _, tar = published
    index = write_index(tmp_path / "index.json", [index_entry(tar, url(http, "/endless/x.tar"))])
    size = tar.stat().st_size
    cache = tmp_path / "cache"
    with pytest.raises(DownloadError, match=rf"sent more than {size} bytes \(its declared size\)"):
        pull(NAME, index=str(index), cache_dir=cache, progress=False, timeout=10)
    assert snapshot(cache) == {}


def test_declared_download_larger_than_the_free_space_is_refused(
    http, published, tmp_path, monkeypatch
):
    _, tar = published
    http.files["/x.tar"] = tar.read_bytes()
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(download_mod.shutil, "disk_usage", lambda path: usage(1000, 900, 100))
    with pytest.raises(
        DownloadError, match=rf"{tar.stat().st_size} bytes to download and 100 bytes free"
    ):
        pull(url(http, "/x.tar"), cache_dir=tmp_path / "cache", progress=False, timeout=10)
    assert snapshot(tmp_path / "cache") == {}
    assert http.requests == [("/x.tar", None)]


class _Interrupting:
    """An HTTP response whose third read is Ctrl-C (as if the user pressed it mid-download)."""

    def __init__(self, response):
        self.response, self.reads = response, 0
        self.status, self.headers = response.status, response.headers

    def read(self, n: int = -1) -> bytes:
        self.reads += 1
        if self.reads == 3:
            raise KeyboardInterrupt
        return self.response.read(min(n, 1 << 12))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.response.close()


def _interrupt_third_read(monkeypatch) -> None:
    real = urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: _Interrupting(real(*a, **k)))


def test_ctrl_c_deletes_a_download_of_unknown_size(http, tmp_path, monkeypatch, capsys):
    _interrupt_third_read(monkeypatch)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        pull(url(http, "/endless/a.tar"), cache_dir=cache, progress=False, timeout=10)
    assert snapshot(cache) == {}
    assert main(["pull", url(http, "/endless/a.tar"), "--cache-dir", str(cache), "--quiet"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert snapshot(cache) == {}


def test_ctrl_c_keeps_a_download_of_known_size_and_the_same_command_resumes(
    http, published, tmp_path, monkeypatch, capsys, no_compat_check
):
    _, tar = published
    data = tar.read_bytes()
    http.files["/x.tar"] = data
    cache = tmp_path / "cache"
    argv = ["pull", url(http, "/x.tar"), "--cache-dir", str(cache), "--quiet"]
    with monkeypatch.context() as m:
        _interrupt_third_read(m)
        assert main(argv) == 130
    (partial,) = store.downloads_root(cache).iterdir()
    assert capsys.readouterr().err == (
        f"the partial download is kept in {partial}; run the same command again to resume\n"
        "interrupted\n"
    )
    assert partial.stat().st_size == 2 << 12 and partial.read_bytes() == data[: 2 << 12]
    assert main(argv) == 0
    assert http.requests[-1] == ("/x.tar", f"bytes={2 << 12}-")  # resumed, not restarted
    assert not store.downloads_root(cache).exists()
    installed = store.artifacts_root(cache) / NAME
    assert (installed / "model.so").read_bytes() == make_files()["model.so"]


# -- package: a malformed compiled folder --------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "tensor_cache", "message"),
    [
        (None, b"{bad", r"tensor-cache\.json: corrupted \(JSONDecodeError"),
        (
            None,
            b'{"records": [{"x": 1}]}',
            r"corrupted \(KeyError\('dataPath'\)",
        ),
        (None, b"[1]", r"tensor-cache\.json: no list of weight shards"),
        (None, b'{"records": [{"dataPath": "../../x"}]}', "unsafe file path 'params/../../x'"),
        (b'{"format_version": 1}', b"{}", r"dsv2-mlc\.json: not a build config of this dsv2"),
        (b"[1]", b"{}", r"dsv2-mlc\.json: not a valid build config"),
    ],
)
def test_package_of_a_malformed_compiled_folder_is_refused(
    build, tensor_cache, message, tmp_path, capsys
):
    from dsv2_mlc.artifacts.package import package_artifact

    compiled = tmp_path / "compiled"
    files = {**make_files(), "params/tensor-cache.json": tensor_cache}
    if build is not None:
        files[BUILD_CONFIG] = build
    for rel, blob in files.items():
        (compiled / rel).parent.mkdir(parents=True, exist_ok=True)
        (compiled / rel).write_bytes(blob)
    with pytest.raises(Dsv2Error, match=message):  # ArtifactError, or BuildError from layout
        package_artifact(compiled, tmp_path / "out.tar")
    assert main(["package", str(compiled), "-o", str(tmp_path / "out.tar")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv2-mlc package: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compiled"]  # nothing written

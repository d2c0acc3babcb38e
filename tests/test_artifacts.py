"""Prebuilt artifacts: package -> pull (local, file://, HTTP with resume, index) -> run by name,
runtime-only (TVM's compiler and torch impossible to import), and every pull error leaving the
cache exactly as it was. Reuses the session's compiled tiny model "A" plus a BPE tokenizer with
DeepSeek-V2's chat template."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from chat_fixtures import copy_model, deepseek_chat_template, write_tokenizer
from http_server import serving, url

import dsv2_mlc
from dsv2_mlc.artifacts import (
    ArtifactExistsError,
    CorruptArtifactError,
    HashMismatchError,
    IncompleteDownloadError,
    ManifestError,
    MissingFileError,
    RuntimeVersionError,
    TargetMismatchError,
    package_artifact,
    pull,
)
from dsv2_mlc.artifacts import target as target_mod
from dsv2_mlc.artifacts.index import entry_for, write_index
from dsv2_mlc.artifacts.manifest import MANIFEST, Manifest, Target
from dsv2_mlc.artifacts.store import artifacts_root, downloads_root, get_installed
from dsv2_mlc.cli import main
from dsv2_mlc.layout import BUILD_CONFIG, LIBRARY
from dsv2_mlc.runtime.engine import Engine

NAME = "tiny-q0f32-cpu"
PROMPT = [0, 17, 301, 44, 9, 250, 111, 7]


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(compiled, tmp_path_factory) -> Path:
    """The compiled model "A" with a tokenizer and DeepSeek-V2's chat template."""
    out = copy_model(compiled["A"], tmp_path_factory.mktemp("art-model") / "tiny")
    write_tokenizer(out, chat_template=deepseek_chat_template())
    return out


@pytest.fixture(scope="module")
def artifact(chat_model, tmp_path_factory):
    return package_artifact(chat_model, tmp_path_factory.mktemp("art-out"), model_name="tiny")


@pytest.fixture(scope="module")
def other(chat_model, tmp_path_factory):
    """A second artifact (another name): what a cache holds before a failing pull."""
    out = tmp_path_factory.mktemp("art-other") / "other.tar"
    return package_artifact(chat_model, out, name="tiny-other")


@pytest.fixture
def cache(tmp_path, other) -> Path:
    """A cache already holding one artifact."""
    root = tmp_path / "cache"
    pull(str(other.path), cache_dir=root, progress=False)
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content hash ("dir" for folders)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def unpack(tar_path: Path, dest: Path) -> Path:
    """An artifact file unpacked into a folder (a valid pull source too)."""
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    return dest


def edit_manifest(folder: Path, **changes) -> Manifest:
    """Rewrite ``folder/manifest.json`` with some fields (or target fields) changed."""
    m = Manifest.from_bytes((folder / MANIFEST).read_bytes())
    target = {k.removeprefix("target_"): v for k, v in changes.items() if k.startswith("target_")}
    fields = {k: v for k, v in changes.items() if not k.startswith("target_")}
    m = replace(m, target=replace(m.target, **target), **fields)
    (folder / MANIFEST).write_bytes(m.to_bytes())
    return m


class _Server(ThreadingHTTPServer):  # (the attributes serving() sets)
    files: dict[str, bytes]
    cut: dict[str, int]  # path -> bytes to send before hanging up (once)
    requests: list[tuple[str, str | None]]


class _Handler(BaseHTTPRequestHandler):
    """Static files with single ``bytes=N-`` ranges, and hang-ups on demand."""

    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        srv = self.server
        rng = self.headers.get("Range")
        srv.requests.append((self.path, rng))
        data = srv.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1)) if rng else 0
        if start >= len(data):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.end_headers()
            return
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if self.path in srv.cut:
            body = body[: srv.cut.pop(self.path)]
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http() -> Iterator[_Server]:
    """A local HTTP server on a free loopback port, shut down after the test (or 120 s)."""
    with serving(_Handler, 120, files={}, cut={}, requests=[]) as srv:
        yield srv


# -- the artifact ----------------------------------------------------------------------------
def test_package_lists_every_file_with_size_and_sha256(artifact, chat_model, tmp_path):
    m = artifact.manifest
    with tarfile.open(artifact.path) as tar:
        members = tar.getmembers()
        assert members[0].name == MANIFEST  # readable before the rest
        data = {i.name: tar.extractfile(i).read() for i in members}
    assert Manifest.from_bytes(data[MANIFEST]) == m
    assert hashlib.sha256(data[MANIFEST]).hexdigest() == artifact.manifest_sha256
    assert set(data) - {MANIFEST} == {f.path for f in m.files}
    for f in m.files:
        assert (len(data[f.path]), hashlib.sha256(data[f.path]).hexdigest()) == (f.size, f.sha256)
    paths = {f.path for f in m.files}
    assert {LIBRARY, BUILD_CONFIG, "params/tensor-cache.json", "tokenizer.json"} <= paths
    assert any(p.startswith("params/params_shard_") for p in paths)
    assert m.runtime_libs == ("lib/libtvm_runtime.so",)
    assert "chat_template" in json.loads(data["tokenizer_config.json"])
    build = json.loads((chat_model / BUILD_CONFIG).read_text())
    assert (m.name, m.quantization, m.dtype) == (NAME, build["quantization"], build["dtype"])
    assert (m.tvm_version, m.tvm_ffi_version) == (build["tvm_version"], build["tvm_ffi_version"])
    assert m.model["config"] == build["model"]
    assert m.target == Target(
        "cpu", "linux", target_mod.host_machine(), None, None, build["target"]
    )
    # Deterministic: the same compiled folder packages to the same bytes.
    again = package_artifact(chat_model, tmp_path / "again.tar", model_name="tiny")
    assert again.sha256 == artifact.sha256 and again.path.read_bytes() == artifact.path.read_bytes()


def test_pull_local_file_url_and_folder_then_list_and_rm(artifact, tmp_path, capsys):
    root = tmp_path / "cache"
    first = pull(f"file://{artifact.path}", cache_dir=root, progress=False)
    assert (first.name, first.already_installed) == (NAME, False)
    assert first.path == artifacts_root(root) / NAME
    assert not downloads_root(root).exists()
    for f in artifact.manifest.files:
        assert hashlib.sha256((first.path / f.path).read_bytes()).hexdigest() == f.sha256
    assert pull(str(artifact.path), cache_dir=root, progress=False).already_installed
    folder = unpack(artifact.path, tmp_path / "unpacked")
    assert pull(str(folder), cache_dir=root, progress=False).already_installed

    assert main(["list", "--cache-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert NAME in listing and artifact.manifest_sha256[:16] in listing
    assert main(["rm", NAME, "--cache-dir", str(root)]) == 0
    assert get_installed(NAME, root) is None and not (artifacts_root(root) / NAME).exists()
    assert list(artifacts_root(root).iterdir()) == []  # nothing left behind
    assert main(["rm", NAME, "--cache-dir", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no installed artifact named" in err[0]


def test_engine_opens_an_installed_artifact_by_name(artifact, chat_model, tmp_path):
    root = tmp_path / "cache"
    pull(str(artifact.path), cache_dir=root, progress=False)
    by_name = dsv2_mlc.load(NAME, cache_dir=root, context_window=64, max_batch_size=1)
    assert by_name.path == artifacts_root(root) / NAME
    direct = Engine(chat_model, context_window=64, max_batch_size=1)
    assert by_name.generate(PROMPT, 6).token_ids == direct.generate(PROMPT, 6).token_ids


# -- HTTP: resume, index, and the runtime-only chat ------------------------------------------------
def test_http_download_interrupted_then_resumed(artifact, cache, http):
    data = artifact.path.read_bytes()
    http.files["/a/x.tar"] = data
    cut = len(data) // 3
    http.cut["/a/x.tar"] = cut
    before = snapshot(artifacts_root(cache))
    with pytest.raises(IncompleteDownloadError, match="run the same command again to resume"):
        pull(url(http, "/a/x.tar"), cache_dir=cache, progress=False)
    assert snapshot(artifacts_root(cache)) == before  # nothing installed, nothing half-written
    (partial,) = downloads_root(cache).iterdir()
    assert partial.stat().st_size == cut

    result = pull(url(http, "/a/x.tar"), cache_dir=cache, progress=False)
    assert result.name == NAME and not result.already_installed
    assert http.requests[-1] == ("/a/x.tar", f"bytes={cut}-")  # continued, not restarted
    assert not downloads_root(cache).exists()  # the partial is gone once used


RUNTIME_ONLY = """
import importlib.abc, importlib.machinery, json, sys
class Hidden(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    '''`import tvm` (the compiler's Python side) and torch fail, as where neither is installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tvm", "torch", "transformers"):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is not installed (hidden by the test)")
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Hidden())
import ctypes
_init = ctypes.CDLL.__init__
def _guard(self, name, *args, **kwargs):
    if "libtvm_compiler" in str(name):
        raise OSError("libtvm_compiler.so is hidden by the test")
    _init(self, name, *args, **kwargs)
ctypes.CDLL.__init__ = _guard

from dsv2_mlc.cli import main
import dsv2_mlc
engine = dsv2_mlc.load(sys.argv[1], context_window=64, max_batch_size=1)
tokens = engine.generate(json.loads(sys.argv[2]), 6).token_ids
del engine
rc = main(["chat", sys.argv[1], "--prompt", "hello", "--max-tokens", "8", "--temperature", "0"])
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libtvm" in l})
hidden = sorted(m for m in sys.modules if m.split(".")[0] in ("tvm", "torch", "transformers"))
print("RESULT", json.dumps({"rc": rc, "tokens": tokens, "libs": libs, "hidden": hidden}))
"""


def test_round_trip_package_http_index_pull_chat_runtime_only(
    artifact, chat_model, http, tmp_path, capsys
):
    """package -> index + artifact served over HTTP -> `dsv2-mlc pull NAME --index URL` ->
    `dsv2-mlc chat NAME` in a process where TVM's compiler (and torch) cannot be imported."""
    http.files["/dist/artifacts/x.tar"] = artifact.path.read_bytes()
    index = write_index(tmp_path / "index.json", [entry_for(artifact, "artifacts/x.tar")])
    http.files["/dist/index.json"] = index.read_bytes()
    root = tmp_path / "cache"
    argv = ["pull", NAME, "--index", url(http, "/dist/index.json"), "--cache-dir", str(root)]
    assert main([*argv, "--quiet"]) == 0
    assert f"installed {NAME}" in capsys.readouterr().out
    assert ("/dist/artifacts/x.tar", None) in http.requests  # relative URL resolved

    env = {k: v for k, v in os.environ.items() if k != "DSV2_MLC_TVM_LIB_DIR"}
    env["DSV2_MLC_CACHE_DIR"] = str(root)
    proc = subprocess.run(
        [sys.executable, "-c", RUNTIME_ONLY, NAME, json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["rc"] == 0 and result["hidden"] == []
    bundled = str(artifacts_root(root) / NAME / "lib" / "libtvm_runtime.so")
    runtime = [lib for lib in result["libs"] if "libtvm_runtime" in lib]
    assert runtime == [bundled]  # the artifact's own TVM runtime...
    assert not [lib for lib in result["libs"] if "compiler" in lib or "/tvm/lib/" in lib]
    reply = proc.stdout.split("RESULT ", 1)[0]

    # Same tokens and the same chat reply as the compiled folder it was packaged from.
    direct = Engine(chat_model, context_window=64, max_batch_size=1)
    assert result["tokens"] == direct.generate(PROMPT, 6).token_ids
    chat = ["chat", str(chat_model), "--prompt", "hello", "--max-tokens", "8", "--temperature", "0"]
    assert main(chat) == 0
    assert capsys.readouterr().out == reply


# -- errors: each names the fix, and the cache is left exactly as it was ---------------------------
def test_hash_mismatch_is_refused(artifact, cache, tmp_path):
    bad = tmp_path / "bad.tar"
    shutil.copy(artifact.path, bad)
    with tarfile.open(bad) as tar:
        info = tar.getmember("params/params_shard_0.bin")
    with open(bad, "r+b") as f:  # flip one byte in the middle of the weights
        f.seek(info.offset_data + info.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = snapshot(cache)
    with pytest.raises(HashMismatchError, match=r"params_shard_0\.bin is corrupted.*again"):
        pull(str(bad), cache_dir=cache, progress=False)
    assert snapshot(cache) == before
    # The published manifest hash is checked too (index entry or --sha256).
    with pytest.raises(HashMismatchError, match="not the published artifact"):
        pull(str(artifact.path), cache_dir=cache, sha256="0" * 64, progress=False)
    assert snapshot(cache) == before


def test_truncated_file_is_refused(artifact, cache, tmp_path):
    short = tmp_path / "short.tar"
    short.write_bytes(artifact.path.read_bytes()[: artifact.size // 2])
    before = snapshot(cache)
    with pytest.raises(CorruptArtifactError, match="truncated or damaged.*download it again"):
        pull(str(short), cache_dir=cache, progress=False)
    assert snapshot(cache) == before


def test_corrupted_download_leaves_no_partial_behind(artifact, cache, http):
    """A download that arrives whole but bad is deleted: resuming it could not help."""
    data = bytearray(artifact.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    http.files["/bad.tar"] = bytes(data)
    before = snapshot(cache)
    with pytest.raises((HashMismatchError, CorruptArtifactError)):
        pull(url(http, "/bad.tar"), cache_dir=cache, progress=False)
    assert snapshot(cache) == before


def test_other_target_or_arch_is_refused(artifact, cache, tmp_path, monkeypatch):
    other_machine = "aarch64" if target_mod.host_machine() != "aarch64" else "x86_64"
    folder = unpack(artifact.path, tmp_path / "arm")
    edit_manifest(folder, target_machine=other_machine)
    before = snapshot(cache)
    with pytest.raises(TargetMismatchError, match=f"built for linux/{other_machine}.*pull the"):
        pull(str(folder), cache_dir=cache, progress=False)
    assert snapshot(cache) == before

    cuda = unpack(artifact.path, tmp_path / "cuda")
    edit_manifest(cuda, target_device="cuda", target_cuda_arch="sm_90", target_cuda_runtime=13)
    monkeypatch.setattr(target_mod, "detect_cuda", lambda: None)  # whatever this machine has
    with pytest.raises(TargetMismatchError, match="no usable CUDA driver.*pull the cpu artifact"):
        pull(str(cuda), cache_dir=cache, progress=False)
    ampere = target_mod.CudaInfo(13000, ((8, 0),))
    monkeypatch.setattr(target_mod, "detect_cuda", lambda: ampere)
    with pytest.raises(TargetMismatchError, match="built for sm_90.*GPUs are sm_80"):
        pull(str(cuda), cache_dir=cache, progress=False)
    old_driver = target_mod.CudaInfo(12040, ((9, 0),))
    monkeypatch.setattr(target_mod, "detect_cuda", lambda: old_driver)
    with pytest.raises(TargetMismatchError, match="supports CUDA 12.4 only; upgrade the NVIDIA"):
        pull(str(cuda), cache_dir=cache, progress=False)
    assert snapshot(cache) == before
    hopper = target_mod.CudaInfo(13000, ((9, 0),))  # sm_90 kernels run on 9.x
    target_mod.check_target(Target("cuda", "linux", target_mod.host_machine(), "sm_90", 13), hopper)


def test_tvm_ffi_version_mismatch_is_refused(artifact, cache, tmp_path, capsys):
    folder = unpack(artifact.path, tmp_path / "ffi")
    edit_manifest(folder, tvm_ffi_version="0.1.15.post2")
    before = snapshot(cache)
    with pytest.raises(RuntimeVersionError, match=r"pip install apache-tvm-ffi==0\.1\.15\.post2"):
        pull(str(folder), cache_dir=cache, progress=False)
    assert snapshot(cache) == before
    assert main(["pull", str(folder), "--cache-dir", str(cache), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv2-mlc pull: error: artifact tiny-q0f32-cpu")
    assert snapshot(cache) == before
    # Installed anyway (--no-check), it is refused when opened.
    pull(str(folder), cache_dir=cache, check=False, progress=False)
    with pytest.raises(RuntimeVersionError, match="pip install apache-tvm-ffi=="):
        dsv2_mlc.load(NAME, cache_dir=cache)


def test_missing_file_is_refused(artifact, cache, tmp_path):
    folder = unpack(artifact.path, tmp_path / "missing")
    (folder / "params" / "params_shard_0.bin").unlink()
    before = snapshot(cache)
    with pytest.raises(MissingFileError, match=r"params_shard_0\.bin is listed.*missing"):
        pull(str(folder), cache_dir=cache, progress=False)
    assert snapshot(cache) == before
    # A file deleted from an installed artifact is caught when it is opened.
    installed = pull(str(artifact.path), cache_dir=cache, progress=False).path
    (installed / LIBRARY).unlink()
    with pytest.raises(MissingFileError, match=rf"reinstall it: `dsv2-mlc pull {NAME} --force`"):
        dsv2_mlc.load(NAME, cache_dir=cache)
    # Pulling it again repairs it.
    assert not pull(str(artifact.path), cache_dir=cache, progress=False).already_installed
    assert (installed / LIBRARY).is_file()


def test_unlisted_file_and_name_clash_are_refused(artifact, cache, tmp_path):
    folder = unpack(artifact.path, tmp_path / "extra")
    (folder / "evil.py").write_text("print('not in the manifest')\n")
    before = snapshot(cache)
    with pytest.raises(ManifestError, match="does not list.*evil.py"):
        pull(str(folder), cache_dir=cache, progress=False)
    assert snapshot(cache) == before
    (folder / "evil.py").unlink()
    edit_manifest(folder, name="tiny-other", dsv2_mlc_version="0.0.0")  # another build, same name
    with pytest.raises(ArtifactExistsError, match="dsv2-mlc rm tiny-other"):
        pull(str(folder), cache_dir=cache, progress=False)
    assert snapshot(cache) == before
    assert pull(str(folder), cache_dir=cache, force=True, progress=False).name == "tiny-other"


def test_runtime_only_subprocess_helper_really_hides_tvm():
    """The guard the runtime-only test relies on: `import tvm` fails under it."""
    prelude = RUNTIME_ONLY.split("from dsv2_mlc.cli")[0]
    code = prelude + "try:\n    import tvm\nexcept ImportError:\n    print('HIDDEN')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "HIDDEN", proc.stderr

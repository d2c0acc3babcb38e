"""Integrity before load: no file of a build is loaded unless it has the size and SHA-256 recorded
when it was made (dsv2_mlc/runtime/integrity.py; the trust model is in dist/README.md).

The attack of every case: a shared object of the same size whose constructor writes a marker
file replaces a library. The negative control shows that loading it does write the marker; the
product must refuse (or rebuild) before that. The installed artifact is the published CPU one
(dist/artifacts), so no test here compiles a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import dsv2_mlc
from dsv2_mlc import resolve
from dsv2_mlc.artifacts import pull
from dsv2_mlc.compiler import cuda
from dsv2_mlc.layout import BUILD_CONFIG, LIBRARY, BuildConfig, file_records
from dsv2_mlc.runtime import tvm_runtime
from dsv2_mlc.runtime.engine import Engine
from dsv2_mlc.runtime.integrity import IntegrityError, verify_build

ROOT = Path(__file__).resolve().parent.parent
TAR = ROOT / "dist" / "artifacts" / "dsv2-coder-tiny-q4f32_g32-cpu.tar"
NAME = "dsv2-coder-tiny-q4f32_g32-cpu"
EVIL_C = """
#include <stdio.h>
__attribute__((constructor)) static void evil(void) {
  FILE *f = fopen(MARKER, "w");
  if (f) { fputs("constructor ran\\n", f); fclose(f); }
}
"""

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (evil .so)")
pytestmark = [
    needs_gcc,
    pytest.mark.skipif(not TAR.is_file(), reason="the published CPU artifact is not here"),
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def evil_library(tmp: Path, size: int | None) -> tuple[Path, Path]:
    """A shared object (of exactly ``size`` bytes, if given) whose constructor writes a marker
    file; returns (library, marker)."""
    src, lib, marker = tmp / "evil.c", tmp / "evil.so", tmp / "MARKER"
    src.write_text(EVIL_C)
    cmd = ["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(src)]
    subprocess.run(cmd, check=True, capture_output=True)
    if size is not None:
        assert lib.stat().st_size <= size
        with open(lib, "r+b") as f:
            f.truncate(size)
    return lib, marker


def test_negative_control_the_evil_library_runs_its_constructor_when_loaded(tmp_path):
    lib, marker = evil_library(tmp_path, 100_000)
    code = f"import ctypes; ctypes.CDLL({str(lib)!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert marker.read_text() == "constructor ran\n"


@pytest.fixture(autouse=True)
def _no_preferred_runtime(monkeypatch):
    """Opening an installed artifact makes its bundled TVM runtime the preferred one for the
    process; a later ``import tvm`` beside that copy aborts, so successful opens of installed
    artifacts run in a subprocess and the preference is undone after each test."""
    monkeypatch.setattr(tvm_runtime, "_preferred", [])


@pytest.fixture
def installed(tmp_path) -> tuple[Path, Path]:
    """The published CPU artifact pulled into a fresh cache: (cache, its folder)."""
    cache = tmp_path / "cache"
    result = pull(str(TAR), cache_dir=cache, progress=False)
    return cache, result.path


def tar_member(name: str) -> bytes:
    with tarfile.open(TAR) as tar:
        f = tar.extractfile(name)
        assert f is not None
        return f.read()


def test_tampered_installed_library_is_refused_before_its_constructor_runs(installed, tmp_path):
    cache, folder = installed
    lib = folder / LIBRARY
    evil, marker = evil_library(tmp_path, lib.stat().st_size)
    shutil.copyfile(evil, lib)
    with pytest.raises(IntegrityError) as err:
        dsv2_mlc.load(NAME, cache_dir=cache)
    assert str(err.value).startswith(f"{lib}: sha256 {sha256(evil)[:16]}...")
    assert f"`dsv2-mlc pull {NAME} --force`" in str(err.value)
    assert not marker.exists()


def test_tampered_bundled_runtime_library_is_refused(installed, tmp_path):
    cache, folder = installed
    lib = folder / "lib" / "libtvm_runtime.so"
    evil, marker = evil_library(tmp_path, lib.stat().st_size)
    shutil.copyfile(evil, lib)
    with pytest.raises(IntegrityError, match=f"^{lib}: sha256 "):
        Engine(folder)
    assert not marker.exists()


def test_pull_again_repairs_a_damaged_installed_artifact(installed, tmp_path):
    cache, folder = installed
    lib = folder / LIBRARY
    evil, marker = evil_library(tmp_path, lib.stat().st_size)
    shutil.copyfile(evil, lib)
    again = pull(str(TAR), cache_dir=cache, progress=False)
    assert (again.path, again.already_installed) == (folder, False)
    assert lib.read_bytes() == tar_member(LIBRARY)
    # an intact one is left alone
    assert pull(str(TAR), cache_dir=cache, progress=False).already_installed
    proc = run_chat(NAME, "--cache-dir", str(cache))
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


def test_weights_are_hashed_with_verify_and_at_pull(installed):
    cache, folder = installed
    shard = folder / "params" / "params_shard_0.bin"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF  # same size: only a hash finds it
    shard.write_bytes(bytes(data))
    verify_build(folder, BuildConfig.read(folder))  # what opening checks: their sizes only
    with pytest.raises(IntegrityError, match=f"^{shard}: sha256 "):
        dsv2_mlc.load(NAME, cache_dir=cache, verify=True)
    proc = run_chat(NAME, "--cache-dir", str(cache), "--verify")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"dsv2-mlc chat: error: {shard}: sha256 ")
    assert not pull(str(TAR), cache_dir=cache, progress=False).already_installed
    assert shard.read_bytes() == tar_member("params/params_shard_0.bin")
    verify_build(folder, BuildConfig.read(folder), full=True)


def compiled_copy(folder: Path, out: Path, records: bool = True) -> Path:
    """The installed artifact ``folder`` as a compiled folder (no manifest, no bundled runtime),
    its ``dsv2-mlc.json`` with (``records``) or without the files' sizes and hashes."""
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("manifest.json", "lib"))
    config = json.loads((out / BUILD_CONFIG).read_text())
    config["files"] = file_records(out) if records else {}
    (out / BUILD_CONFIG).write_text(json.dumps(config))
    return out


def run_chat(model: str | Path, *args: str) -> subprocess.CompletedProcess:
    """``dsv2-mlc chat MODEL --prompt hi --max-tokens 1 ARGS`` in a subprocess."""
    cmd = [sys.executable, "-m", "dsv2_mlc.cli", "chat", str(model), "--prompt", "hi", *args]
    return subprocess.run(cmd + ["--max-tokens", "1"], capture_output=True, text=True, timeout=300)


def test_truncated_library_is_the_projects_error_not_sigbus(installed, tmp_path):
    folder = compiled_copy(installed[1], tmp_path / "build")
    lib = folder / LIBRARY
    full_size = lib.stat().st_size
    with open(lib, "r+b") as f:
        f.truncate(1000)
    # negative control: the loader itself dies of SIGBUS on it
    crash = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r})"])
    assert crash.returncode == -7  # SIGBUS
    proc = run_chat(folder)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"dsv2-mlc chat: error: {lib}: 1000 bytes, {full_size} when it was made: it is "
        "truncated or was changed; compile the model again (a build in the compile-on-first-use "
        "cache is compiled again the next time it is opened)\n"
    )


def test_build_without_records_opens_with_a_warning_and_a_structural_check(
    installed, tmp_path, caplog
):
    folder = compiled_copy(installed[1], tmp_path / "old", records=False)
    with caplog.at_level(logging.WARNING, logger="dsv2_mlc"):
        engine = Engine(folder)
    assert [r.getMessage() for r in caplog.records] == [
        f"{folder}: unverified build (made before dsv2-mlc recorded the SHA-256 of its files); "
        "compile it again to have it checked"
    ]
    assert len(engine.generate([1, 2, 3], max_new_tokens=2).token_ids) == 2
    # a copy: this process maps the library it loaded, and truncating it would fault here
    folder = compiled_copy(installed[1], tmp_path / "old-truncated", records=False)
    with open(folder / LIBRARY, "r+b") as f:
        f.truncate(1000)
    proc = run_chat(folder)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{folder}: unverified build (made before dsv2-mlc recorded the SHA-256 of its files); "
        "compile it again to have it checked",
        f"dsv2-mlc chat: error: {folder / LIBRARY}: not a complete shared library (1000 bytes, "
        "its headers need more: truncated); compile the model again (a build in the "
        "compile-on-first-use cache is compiled again the next time it is opened)",
    ]


def test_short_weight_shard_is_refused_by_the_weight_index(installed, tmp_path):
    folder = compiled_copy(installed[1], tmp_path / "old", records=False)
    shard = folder / "params" / "params_shard_0.bin"
    nbytes = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(nbytes - 4096)
    with pytest.raises(IntegrityError, match=f"^{shard}: {nbytes - 4096} bytes, the weight index"):
        Engine(folder)


def test_tampered_cache_entry_is_compiled_again_never_loaded(installed, tmp_path, monkeypatch):
    """A compile-on-first-use entry whose library differs from its record is removed and compiled
    again (the compiler is replaced by a copy of a good build: what it would write)."""
    good = compiled_copy(installed[1], tmp_path / "good")
    calls = []

    def fake_compile(ckpt, out, **kwargs):
        calls.append(Path(out))
        shutil.copytree(good, out)

    from dsv2_mlc.compiler import compile as compiler

    monkeypatch.setattr(compiler, "compile_model", fake_compile)
    cache = tmp_path / "cache"
    ckpt = resolve.default_model_dir()
    entry = resolve.cached_build(ckpt, cache_dir=cache)
    assert calls == [entry]
    assert resolve.cached_build(ckpt, cache_dir=cache) == entry and len(calls) == 1
    lib = entry / LIBRARY
    evil, marker = evil_library(tmp_path, lib.stat().st_size)
    shutil.copyfile(evil, lib)
    lines: list[str] = []
    assert resolve.cached_build(ckpt, cache_dir=cache, log=lines.append) == entry
    assert calls == [entry, entry]
    assert lines[0] == (
        f"damaged cache entry, compiling it again: {lib}: sha256 {sha256(evil)[:16]}..., "
        f"{sha256(good / LIBRARY)[:16]}... when it was made: the file was changed; compile the "
        "model again (a build in the compile-on-first-use cache is compiled again the next time "
        "it is opened)"
    )
    assert sha256(lib) == sha256(good / LIBRARY)
    Engine(entry)
    assert not marker.exists()


def test_compiler_records_library_and_weights(compiled):
    folder = compiled["A"]
    files = BuildConfig.read(folder).files
    expected = [LIBRARY] + sorted(
        p.relative_to(folder).as_posix() for p in (folder / "params").iterdir()
    )
    assert sorted(files) == sorted(expected)
    for rel, record in files.items():
        path = folder / rel
        assert record == {"size": path.stat().st_size, "sha256": sha256(path)}


def test_tampered_driver_stub_is_built_again_never_loaded(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSV2_MLC_CACHE_DIR", str(cache))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # not where it goes
    stub = cuda.build_driver_stub()
    assert stub == cache / "cuda-driver-stub-v1" / "libcuda.so.1"
    record = stub.with_name("libcuda.so.1.sha256")
    assert record.read_text() == sha256(stub) + "\n"
    evil, marker = evil_library(tmp_path, None)
    shutil.copyfile(evil, stub)
    with caplog.at_level(logging.WARNING, logger="dsv2_mlc"):
        assert cuda.build_driver_stub() == stub
    assert [r.getMessage() for r in caplog.records] == [
        f"{stub}: not the driver stub dsv2-mlc built (sha256 differs); building anew"
    ]
    assert sha256(stub) == record.read_text().strip() != sha256(evil)
    assert not marker.exists()
    assert not (tmp_path / "xdg").exists()
    # a stub built before records were kept (no record) is built again quietly
    record.unlink()
    shutil.copyfile(evil, stub)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv2_mlc"):
        assert cuda.build_driver_stub() == stub
    assert caplog.records == []
    assert sha256(stub) == record.read_text().strip() != sha256(evil)

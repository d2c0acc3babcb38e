"""``dsv2-mlc package``: a compiled folder -> one artifact file (an uncompressed tar).

The artifact holds ``manifest.json`` (first member), the compiled library, the weight shards and
their index, the build config, the tokenizer files with the chat template, and the TVM runtime
libraries the library was built against (``lib/``: ``libtvm_runtime.so``, plus
``libtvm_runtime_cuda.so`` and the CUDA runtime ``libcudart.so.N`` for CUDA), so it runs with
only ``apache-tvm-ffi`` installed. Packaging is deterministic (fixed member order, times and
owners): the same compiled folder gives the same bytes. The file is written beside ``output`` and
renamed into place when complete; an existing ``output`` is replaced only when it is an artifact
(a tar whose first member is a valid ``manifest.json``), anything else there is refused.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import Dsv2Error
from ..layout import BUILD_CONFIG, LIBRARY, PARAMS_DIR, TOKENIZER_FILES, BuildConfig
from .errors import ArtifactError, ManifestError, MissingFileError, RuntimeVersionError
from .manifest import (
    MANIFEST,
    RUNTIME_LIB_DIR,
    FileEntry,
    Manifest,
    Target,
    check_name,
    check_relpath,
    manifest_sha256,
    sha256_file,
)
from .target import elf_machine

EXTRA_TOKENIZER_FILES = ("special_tokens_map.json", "chat_template.jinja")
ARTIFACT_SUFFIX = ".tar"
_MTIME = 946684800  # 2000-01-01: fixed, so packaging is reproducible
_FORMAT = tarfile.PAX_FORMAT  # no size limit per member


@dataclass(frozen=True)
class PackageResult:
    """The artifact written: its path, manifest, manifest SHA-256, and the file's size and
    SHA-256."""

    path: Path
    manifest: Manifest
    manifest_sha256: str
    size: int
    sha256: str


def default_name(build: BuildConfig, model_name: str) -> str:
    """``MODEL-QUANT-cpu`` or ``MODEL-QUANT-cuda-sm_90``."""
    suffix = build.device
    arch = cuda_arch_of(build)
    if build.device == "cuda" and arch:
        suffix += f"-{arch}"
    return f"{model_name}-{build.quantization}-{suffix}"


def cuda_arch_of(build: BuildConfig) -> str | None:
    """The CUDA arch (``sm_90``) of a build's target, if any."""
    m = re.search(r"""["']arch["']\s*:\s*["'](sm_\d+a?)["']""", build.target)
    return m.group(1) if m else None


def _model_files(compiled: Path) -> list[str]:
    """The files of a compiled folder that go into the artifact (required ones checked)."""
    files = [BUILD_CONFIG, LIBRARY, f"{PARAMS_DIR}/tensor-cache.json"]
    for rel in files:
        if not (compiled / rel).is_file():
            raise MissingFileError(
                f"{compiled / rel}: missing from the compiled folder; compile the model again"
            )
    index_path = compiled / PARAMS_DIR / "tensor-cache.json"
    try:
        index = json.loads(index_path.read_text())
        records = index["records"] if isinstance(index, dict) else None
        shards = [r["dataPath"] for r in records] if isinstance(records, list) else None
    except (ValueError, KeyError, TypeError) as err:
        raise ArtifactError(f"{index_path}: corrupted ({err!r}); compile the model again") from err
    if shards is None or not all(isinstance(d, str) for d in shards):
        raise ArtifactError(f"{index_path}: no list of weight shards; compile the model again")
    for shard in shards:
        try:
            rel = check_relpath(f"{PARAMS_DIR}/{shard}")
        except ManifestError as err:
            raise ArtifactError(f"{index_path}: {err}; compile the model again") from err
        if not (compiled / rel).is_file():
            raise MissingFileError(
                f"{compiled / rel}: weight shard missing from the compiled folder; compile the "
                "model again"
            )
        files.append(rel)
    for name in (*TOKENIZER_FILES, *EXTRA_TOKENIZER_FILES):
        if (compiled / name).is_file():
            files.append(name)
    return files


def _cudart_soname(runtime_cuda: Path) -> str:
    m = re.search(rb"libcudart\.so\.(\d+)", runtime_cuda.read_bytes())
    if not m:
        raise ArtifactError(f"{runtime_cuda}: does not name its CUDA runtime (libcudart.so.N)")
    return m.group(0).decode()


def find_cudart(soname: str) -> Path:
    """The CUDA runtime library ``soname`` (e.g. ``libcudart.so.13``) of the installed toolkit."""
    roots = [os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots += ["/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")), reverse=True)]
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (Path(root) / sub / soname).is_file():
                return Path(root) / sub / soname
    raise ArtifactError(
        f"{soname} not found (looked in $CUDA_HOME, beside nvcc and /usr/local/cuda*); set "
        "CUDA_HOME to the CUDA toolkit the model was built with"
    )


def _runtime_libs(build: BuildConfig, lib_dir: str | Path | None) -> dict[str, Path]:
    """The TVM runtime libraries to bundle (``lib/NAME`` -> file), checked against the build."""
    import importlib.util

    from ..runtime.tvm_runtime import find_lib_dir
    from ..version import tvm_version

    found = find_lib_dir(lib_dir).resolve()
    spec = importlib.util.find_spec("tvm")
    package_lib = Path(spec.origin).parent.resolve() / "lib" if spec and spec.origin else None
    if found == package_lib and tvm_version() != build.tvm_version:
        raise RuntimeVersionError(
            f"the model was compiled with TVM {build.tvm_version}, and the runtime libraries here "
            f"are TVM {tvm_version()}'s; compile it again with this TVM, or pass --lib-dir with "
            f"TVM {build.tvm_version}'s runtime libraries"
        )
    libs = {f"{RUNTIME_LIB_DIR}/libtvm_runtime.so": found / "libtvm_runtime.so"}
    if build.device == "cuda":
        runtime_cuda = found / "libtvm_runtime_cuda.so"
        if not runtime_cuda.is_file():
            raise MissingFileError(f"{runtime_cuda}: not found; a CUDA artifact bundles it")
        libs[f"{RUNTIME_LIB_DIR}/libtvm_runtime_cuda.so"] = runtime_cuda
        soname = _cudart_soname(runtime_cuda)
        libs[f"{RUNTIME_LIB_DIR}/{soname}"] = find_cudart(soname)
    return libs


def _target(build: BuildConfig, library: Path, libs: dict[str, Path]) -> Target:
    with open(library, "rb") as f:
        head = f.read(64)
    try:
        machine = elf_machine(head)
    except ValueError as err:
        raise ArtifactError(f"{library}: not a Linux shared library; compile again") from err
    arch = cuda_arch_of(build)
    cuda_runtime = None
    if build.device == "cuda":
        from ..compiler.cuda import check_fatbin

        if arch is None:
            raise ArtifactError(f"{library}: the build names no CUDA arch; compile it again")
        try:
            check_fatbin(library, arch)
        except AssertionError as err:
            raise ArtifactError(
                f"{err}; compile again with `dsv2-mlc compile --device cuda` (nvcc on PATH)"
            ) from err
        cudart = next(k for k in libs if "libcudart.so." in k)
        cuda_runtime = int(cudart.rsplit(".", 1)[1])
    return Target(build.device, "linux", machine, arch, cuda_runtime, build.target)


def build_manifest(
    compiled_dir: str | Path,
    *,
    name: str | None = None,
    model_name: str | None = None,
    lib_dir: str | Path | None = None,
) -> tuple[Manifest, dict[str, Path]]:
    """The manifest of ``compiled_dir`` as an artifact, and where each listed file comes from."""
    from ..version import __version__

    compiled = Path(compiled_dir)
    try:
        build = BuildConfig.read(compiled)
    except (TypeError, AttributeError, ValueError) as err:
        if isinstance(err, Dsv2Error):
            raise
        raise ArtifactError(
            f"{compiled / BUILD_CONFIG}: not a valid build config ({err}); compile the model again"
        ) from err
    model_name = model_name or compiled.resolve().name
    name = check_name(name or default_name(build, model_name))
    sources = {rel: compiled / rel for rel in _model_files(compiled)}
    libs = _runtime_libs(build, lib_dir)
    sources.update(libs)
    target = _target(build, compiled / LIBRARY, libs)
    files = []
    for rel in sorted(sources):
        size, digest = sha256_file(sources[rel])
        files.append(FileEntry(rel, size, digest))
    manifest = Manifest(
        name=name,
        model={"name": model_name, "architecture": "DeepseekV2ForCausalLM", "config": build.model},
        quantization=build.quantization,
        dtype=build.dtype,
        target=target,
        tvm_version=build.tvm_version,
        tvm_ffi_version=build.tvm_ffi_version,
        dsv2_mlc_version=__version__,
        files=tuple(files),
        runtime_libs=tuple(sorted(libs)),
    )
    return manifest, sources


def _tarinfo(name: str, size: int, executable: bool) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _MTIME
    info.mode = 0o755 if executable else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def is_artifact(path: Path) -> bool:
    """Whether ``path`` is an artifact file: a tar whose first member is a valid manifest."""
    try:
        with tarfile.open(path, "r:*") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST or not first.isfile():
                return False
            stream = tar.extractfile(first)
            if stream is None:
                return False
            Manifest.from_bytes(stream.read(), where=f"{path}: {MANIFEST}")
            return True
    except (tarfile.TarError, EOFError, OSError, ValueError):  # ManifestError is a ValueError
        return False


def check_output(out: Path) -> None:
    """Refuse an ``out`` whose replacement would delete what is not an artifact."""
    if out.is_symlink():
        raise ArtifactError(
            f"{out}: a symbolic link; packaging would replace the link: choose another path"
        )
    if out.is_dir():
        raise ArtifactError(f"{out}: a folder, not an artifact file; choose another path")
    if out.exists() and not is_artifact(out):
        raise ArtifactError(
            f"{out}: exists and is not a dsv2-mlc artifact, and packaging would replace it; "
            "choose another path, or move that file away first"
        )


def package_artifact(
    compiled_dir: str | Path,
    output: str | Path,
    *,
    name: str | None = None,
    model_name: str | None = None,
    lib_dir: str | Path | None = None,
) -> PackageResult:
    """Package ``compiled_dir`` (written by ``dsv2-mlc compile``) into an artifact file.

    ``output`` is the artifact's path, or an existing folder to put ``NAME.tar`` in. ``name``
    defaults to ``MODEL-QUANT-DEVICE[-ARCH]`` with ``model_name`` (default: the folder's name).
    ``lib_dir`` holds the TVM runtime libraries to bundle (default: found like the runtime does).
    """
    out = Path(output)
    if not out.is_dir():
        check_output(out)  # before the (long) hashing of every file
    manifest, sources = build_manifest(
        compiled_dir, name=name, model_name=model_name, lib_dir=lib_dir
    )
    if out.is_dir():
        out = out / f"{manifest.name}{ARTIFACT_SUFFIX}"
        check_output(out)
    out = out.resolve()
    data = manifest.to_bytes()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    except OSError as err:
        raise ArtifactError(f"cannot write {out} ({err}); pass another -o/--output") from err
    tmp = Path(tmp_name)
    try:
        with (
            os.fdopen(fd, "wb") as raw,
            tarfile.open(fileobj=raw, mode="w:", format=_FORMAT) as tar,
        ):
            tar.addfile(_tarinfo(MANIFEST, len(data), False), io.BytesIO(data))
            for entry in manifest.files:
                with open(sources[entry.path], "rb") as f:
                    info = _tarinfo(entry.path, entry.size, ".so" in Path(entry.path).name)
                    tar.addfile(info, f)
        size, digest = sha256_file(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private
        os.replace(tmp, out)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"packaging {compiled_dir} into {out} failed ({err})") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return PackageResult(out, manifest, manifest_sha256(data), size, digest)

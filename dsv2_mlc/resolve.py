"""Which compiled folder a MODEL names, compiling checkpoints on first use into a per-user cache,
and :func:`open_engine` (what :func:`dsv2_mlc.load` runs): that folder opened as an Engine.

MODEL is a compiled folder (``dsv2-mlc.json``), a Hugging Face checkpoint folder (``config.json``
+ safetensors), the name of an installed artifact (``dsv2-mlc pull``), or nothing for the model
embedded in the package. A string spelled as an artifact name (no ``/``; see
:func:`dsv2_mlc.artifacts.index.is_name`) that names an installed artifact means that artifact,
even where a folder of that name is in the current directory: that folder is ``./NAME`` (or a
:class:`~pathlib.Path`), so a folder in the current directory never stands in for a verified
artifact. A name that is not installed is a folder as before. A checkpoint is compiled once
per cache key: a SHA-256 over the checkpoint files' contents, the dtype and device, the dsv2-mlc
version, the source of its compiler (compiler/model/passes/quant/schedules, the build layout, RoPE)
and the TVM version, so anything that changes the build gives a new entry.

The cache is ``cache_dir``, else ``$DSV2_MLC_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsv2-mlc``, else
``~/.cache/dsv2-mlc``; builds go to its ``builds/NAME-QUANT-DEVICE-KEY/`` (beside the installed
artifacts of :mod:`dsv2_mlc.artifacts`). An entry is used only if its files have the sizes and
SHA-256 its build recorded (:func:`dsv2_mlc.runtime.integrity.verify_build`); a damaged one is
removed and compiled again. The compiler is imported only when something must be compiled, so a
compiled folder or an installed artifact opens without TVM's compiler.

This module sits above the compiler, the runtime and the artifacts: none of them imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import Dsv2Error
from .fsutil import UnwritableFolderError
from .layout import BUILD_CONFIG, LIBRARY, TOKENIZER_FILES, BuildConfig, BuildError
from .paths import CACHE_DIR_ENV, default_cache_dir
from .version import __version__, tvm_version

if TYPE_CHECKING:
    from .runtime.engine import Engine

__all__ = [
    "CACHE_DIR_ENV",
    "ModelNotFoundError",
    "cache_key",
    "cached_build",
    "default_cache_dir",
    "open_engine",
    "resolve_model",
]

LOG = logging.getLogger("dsv2_mlc")
BUILDS_DIR = "builds"
DEFAULT_MODEL = "default_model"
CHECKPOINT_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json")
EXTRA_TOKENIZER_FILES = ("special_tokens_map.json", "chat_template.jinja")
COMPILER_PACKAGES = ("compiler", "model", "passes", "quant", "schedules")
COMPILER_MODULES = ("layout.py", "rope.py", "runtime/cublas_gemm.cc")
_HASH_MEMO = "file-hashes.json"


class ModelNotFoundError(Dsv2Error, ValueError):
    """MODEL names nothing that can be run (the message lists what MODEL may be)."""


def default_model_dir() -> Path:
    """The checkpoint folder embedded in the package."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL


def checkpoint_files(ckpt_dir: Path) -> list[Path]:
    """The files of a checkpoint that change its build: config, weights, tokenizer."""
    files = {p for pattern in CHECKPOINT_PATTERNS for p in ckpt_dir.glob(pattern)}
    for name in (*TOKENIZER_FILES, *EXTRA_TOKENIZER_FILES):
        if (ckpt_dir / name).is_file():
            files.add(ckpt_dir / name)
    return sorted(p for p in files if p.is_file())


def compiler_sources() -> list[Path]:
    """The source files whose change changes a build (Python, and the C++ linked into it)."""
    files: list[Path] = []
    for pkg in COMPILER_PACKAGES:
        spec = importlib.util.find_spec(f"dsv2_mlc.{pkg}")
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            files.extend(sorted(Path(root).rglob("*.py")))
    package = Path(__file__).resolve().parent
    files.extend(package / m for m in COMPILER_MODULES if (package / m).is_file())
    return files


class _HashMemo:
    """File digests remembered by (path, size, mtime) so unchanged weights are hashed once."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, list] = {}
        self.dirty = False
        if path is not None and path.is_file():
            with contextlib.suppress(OSError, ValueError):
                self.data = json.loads(path.read_text())

    def digest(self, file: Path) -> str:
        st = file.stat()
        key = str(file.resolve())
        hit = self.data.get(key)
        if isinstance(hit, list) and hit[:2] == [st.st_size, st.st_mtime_ns]:
            return str(hit[2])
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        self.data[key] = [st.st_size, st.st_mtime_ns, h.hexdigest()]
        self.dirty = True
        return h.hexdigest()

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".hashes-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)


def build_scheme(dtype: str | None, quantization: str | None) -> str:
    """The quantization a build gets (``compile_model``'s default: ``q0`` in ``dtype``)."""
    if quantization is not None:
        return quantization
    return "q0f16" if dtype == "float16" else "q0f32"


def kv_cache_dtype(kv_dtype: str | None) -> str:
    """The ``BuildConfig.kv_dtype`` a ``kv_dtype`` option asks for: ``""`` (the build's dtype)
    for ``None``, ``"float16"`` or ``"float32"``; ``"float8_e4m3fn"`` for ``"fp8"``."""
    if kv_dtype in (None, "", "float16", "float32"):
        return ""
    if kv_dtype in ("fp8", "float8_e4m3fn"):
        return "float8_e4m3fn"
    raise ModelNotFoundError(
        f"unsupported kv_dtype {kv_dtype!r}; use fp8 (an e4m3 KV cache) or leave it out"
    )


def cache_key(
    ckpt_dir: str | Path,
    *,
    dtype: str | None,
    device: str,
    quantization: str | None = None,
    cache_dir: str | Path | None = None,
    kv_dtype: str | None = None,
) -> str:
    """The SHA-256 (hex) that names a checkpoint's build in the cache (``kv_dtype`` enters it
    only when it is not the default, so default builds keep their keys)."""
    ckpt_dir = Path(ckpt_dir)
    memo = _HashMemo(Path(cache_dir) / _HASH_MEMO if cache_dir is not None else None)
    h = hashlib.sha256()

    def put(label: str, value: str) -> None:
        h.update(f"{label}\0{value}\0".encode())

    put("dsv2-mlc", __version__)
    put("tvm", tvm_version())
    put("dtype", dtype or "")
    put("quantization", build_scheme(dtype, quantization))
    put("device", device)
    if kv_cache_dtype(kv_dtype):
        put("kv_dtype", kv_cache_dtype(kv_dtype))
    for f in checkpoint_files(ckpt_dir):
        put(f"checkpoint:{f.name}", memo.digest(f))
    for f in compiler_sources():
        put(f"source:{f.parent.name}/{f.name}", hashlib.sha256(f.read_bytes()).hexdigest())
    memo.save()
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (so two processes do not compile the same entry at once)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_build(
    ckpt_dir: str | Path,
    *,
    cache_dir: str | Path | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    quantization: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    kv_dtype: str | None = None,
) -> Path:
    """The compiled folder of the checkpoint ``ckpt_dir``, compiled now if not cached."""
    ckpt_dir = Path(ckpt_dir).resolve()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = root / BUILDS_DIR
    key = cache_key(
        ckpt_dir,
        dtype=dtype,
        device=device,
        quantization=quantization,
        cache_dir=root,
        kv_dtype=kv_dtype,
    )
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", ckpt_dir.name) or "model"
    scheme = re.sub(r"[^A-Za-z0-9._-]+", "_", build_scheme(dtype, quantization))
    if kv_cache_dtype(kv_dtype):
        scheme += "-fp8kv"
    entry = root / f"{name}-{scheme}-{device}-{key[:16]}"
    if _intact(entry):
        return entry
    _check_writable(root, ckpt_dir)
    with _locked(root / f".{entry.name}.lock"):
        if _intact(entry, log or LOG.warning):  # built by another process meanwhile
            return entry
        from .compiler import compile as compiler  # lazily: running needs no compiler

        if entry.exists():  # damaged or incomplete: it is ours to rebuild
            shutil.rmtree(entry)

        if log is not None:
            log(f"compiling {ckpt_dir} for {device} ({scheme}) on first use into {entry}")
        compiler.compile_model(
            ckpt_dir,
            entry,
            device=device,
            dtype=dtype,
            quantization=quantization,
            progress=progress,
            kv_dtype="fp8" if kv_cache_dtype(kv_dtype) else None,
        )
    return entry


def _check_writable(root: Path, ckpt_dir: Path) -> None:
    """Raise :class:`UnwritableFolderError` unless a build can be written into ``root``."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-test-"):
            pass
    except OSError as err:
        raise UnwritableFolderError(
            f"{root}: the cache of checkpoints compiled on first use cannot be written "
            f"({err.strerror or err}); set {CACHE_DIR_ENV} or --cache-dir to a folder you can "
            f"write, or compile it yourself (`dsv2-mlc compile {ckpt_dir} -o OUT`) and pass OUT"
        ) from err


def _intact(entry: Path, log: Callable[[str], None] | None = None) -> bool:
    """Whether the cache entry ``entry`` is a complete build whose files have the sizes and
    SHA-256 it recorded (:func:`~dsv2_mlc.runtime.integrity.verify_build`, weights by size);
    a damaged one is reported through ``log``, to be compiled again."""
    if not (entry / BUILD_CONFIG).is_file():
        return False
    from .runtime.integrity import verify_build

    try:
        build = BuildConfig.read(entry)
        if LIBRARY not in build.files:
            raise BuildError(f"{entry / BUILD_CONFIG}: no recorded SHA-256 of {LIBRARY}")
        verify_build(entry, build)
    except BuildError as err:
        if log is not None:
            log(f"damaged cache entry, compiling it again: {err}")
        return False
    return True


def resolve_model(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    kv_dtype: str | None = None,
) -> Path:
    """The compiled folder MODEL names: itself when compiled, else its cached build (compiled on
    first use); ``None`` is the embedded default model. ``kv_dtype`` (``"fp8"`` or None for the
    build's dtype) is the KV cache's element type, part of the cached build's key."""
    if model is None:
        path = default_model_dir()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"the embedded default model is not in this install ({path} has no config.json); "
                "pass a MODEL: a checkpoint folder or a compiled folder"
            )
    else:
        path = _installed_by_name(model, cache_dir, log) or Path(model).expanduser()
        if not path.exists():
            raise ModelNotFoundError(
                f"unknown model {str(model)!r}: no such folder; pass a checkpoint folder "
                "(config.json + *.safetensors), a compiled folder (dsv2-mlc.json), an installed "
                "artifact's name (`dsv2-mlc list`), or no MODEL for the embedded default model"
            )
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{model}: not a folder; MODEL is a checkpoint folder or a compiled folder"
            )
    if (path / BUILD_CONFIG).is_file():
        build = BuildConfig.read(path)
        for what, want, have in (
            ("device", device, build.device),
            ("dtype", dtype, build.dtype),
            ("quantization", quantization, getattr(build, "quantization", None)),
            ("kv-dtype", kv_dtype and (kv_cache_dtype(kv_dtype) or build.dtype), build.cache_dtype),
        ):
            if want is not None and want != have:
                raise ModelNotFoundError(
                    f"{path} was compiled for {what} {have}, not {want}; drop --{what} or "
                    "pass the checkpoint folder to compile it again"
                )
        return path
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path}: neither a checkpoint folder (no config.json) nor a compiled folder "
            f"(no {BUILD_CONFIG})"
        )
    return cached_build(
        path,
        cache_dir=cache_dir,
        device=device or "cpu",
        dtype=dtype,
        quantization=quantization,
        progress=progress,
        log=log,
        kv_dtype=kv_dtype,
    )


def _installed_by_name(
    model: str | Path, cache_dir: str | Path | None, log: Callable[[str], None] | None
) -> Path | None:
    """The installed artifact a MODEL spelled as a name means (see the module doc), if any."""
    from .artifacts.index import is_name

    if not isinstance(model, str) or not is_name(model):
        return None
    from .artifacts.store import installed_artifact

    path = installed_artifact(model, cache_dir)
    if path is not None and log is not None and Path(model).exists():
        log(f"{model}: the installed artifact {path} (for the folder {model} here, pass ./{model})")
    return path


def open_engine(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    context_window: int | None = None,
    max_batch_size: int = 4,
    prefill_chunk_size: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    verify: bool = False,
    experts: str | None = None,
    gpu_memory: int | str | None = None,
    kv_dtype: str | None = None,
) -> Engine:
    """Open MODEL as an :class:`~dsv2_mlc.runtime.engine.Engine`: a compiled folder, an installed
    artifact's name, a checkpoint folder (compiled on first use into the per-user cache, see
    :func:`resolve_model`) or ``None`` for the embedded default model. ``verify``: hash the
    weight files too before loading them (the library is hashed on every open). ``experts``:
    where the routed experts' weights live (``"gpu"`` or ``"host"``, see the Engine).
    ``gpu_memory``: plan the engine inside this budget (``Engine(gpu_memory=...)``).
    ``kv_dtype``: ``"fp8"`` for an e4m3 KV cache (:func:`resolve_model`)."""
    from .runtime.engine import ContextLengthError, Engine

    if context_window is not None and context_window < 2:
        raise ContextLengthError(f"context window must be at least 2 tokens (got {context_window})")
    path = resolve_model(
        model,
        cache_dir=cache_dir,
        device=device,
        dtype=dtype,
        quantization=quantization,
        progress=progress,
        log=log,
        kv_dtype=kv_dtype,
    )
    return Engine(
        path,
        context_window=context_window,
        max_batch_size=max_batch_size,
        prefill_chunk_size=prefill_chunk_size,
        verify=verify,
        experts=experts,
        gpu_memory=gpu_memory,
    )

"""CUDA builds with precompiled kernels, also on a machine with no GPU and no CUDA driver.

TVM's CUDA codegen always emits CUDA C++; whether the exported library holds that *source* or a
*compiled binary* depends on one registered global, ``ffi.Module.create.cuda``, which only
``libtvm_runtime_cuda.so`` registers (in its static initialisers, when the library is loaded).
That library needs the driver, ``libcuda.so.1``, to load at all. Without it the build silently
keeps the source (``fmt "cuda"``), and the runtime then needs nvcc/NVRTC plus the TVM compiler's
Python callback to load the model (notes/tvm-0.27.md, section 4).

:func:`cuda_codegen` makes a build precompiled anywhere:

1. If the real driver loads, it is used. Otherwise a stub ``libcuda.so.1`` exporting the nine
   driver symbols that ``libtvm_runtime_cuda.so`` links against (every call returns
   ``CUDA_ERROR_NO_DEVICE``) is built with ``gcc`` into the per-user cache folder
   (:func:`dsv2_mlc.paths.default_cache_dir`) and loaded ``RTLD_GLOBAL``; its SHA-256, recorded
   beside it when it is built, is checked before every load (a stub that differs is built
   again). The stub is a build-time crutch only: it never goes into a build folder and is never
   committed.
2. ``libtvm_runtime_cuda.so`` is then loaded ``RTLD_GLOBAL`` from TVM's ``lib/`` folder.

Why no "stub before ``import tvm``" subprocess: ``import tvm`` merely *tries* to load
``libtvm_runtime_cuda.so`` (``tvm.backend._autoload_backends``) and carries on without it; the
codegen looks the global up when it runs, not at import. Loading the library ourselves after
``import tvm`` registers the same global (checked: ``ffi.Module.create.cuda`` is absent before and
present after), so CUDA builds work in any process, including one that already imported TVM for a
CPU build (the test session does). If TVM is not imported yet, the stub is simply in place before
the import and TVM's own autoload picks the library up. Loading is idempotent and process-wide;
the stub never affects CPU builds (nothing calls the driver), and a process that has a real driver
never sees the stub.

3. While the context is active, ``TVM_CUDA_COMPILE_MODE=nvcc`` (restored afterwards): TVM's
   ``tvm_callback_cuda_compile`` then runs ``nvcc --fatbin -gencode arch=compute_NN,code=sm_NN``
   with the arch of ``Target.current()``, so the TVM build must run inside ``with target:``. The
   default mode, NVRTC, would need the ``cuda-bindings`` package and yields a plain cubin.
4. With ``arch_specific=True`` (the default) the callback is replaced for the context's duration
   by one that compiles the archs of :data:`ARCH_SPECIFIC` with their arch-specific features
   (``sm_90`` -> ``-gencode arch=compute_90a,code=sm_90a``: ``wgmma``; the kernels test
   ``__CUDA_ARCH_FEAT_SM90_ALL``). The target itself stays ``sm_90``: dlight's tensor-core rule
   only parses plain ``sm_NN``. An ``sm_90a`` cubin runs on the same devices as an ``sm_90`` one
   (compute capability 9.0 exactly; neither embeds PTX).

:func:`check_fatbin` verifies an exported library: fatbin magic present, no CUDA source left.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import UsageError
from ..layout import sha256_file
from ..paths import default_cache_dir

LOG = logging.getLogger("dsv2_mlc")

DEFAULT_ARCH = "sm_90"
# target arch -> the nvcc arch with its arch-specific features (``cuda_codegen``)
ARCH_SPECIFIC = {"sm_90": "90a"}
_COMPILE_CALLBACK = "tvm_callback_cuda_compile"

# Every driver symbol libtvm_runtime_cuda.so 0.27 leaves undefined (``nm -D --undefined-only``).
_STUB_SOURCE = """\
/* Build-time stand-in for the CUDA driver (dsv2-mlc). Never ship it. */
typedef int CUresult;
#define STUB(name) CUresult name() { return 100; } /* CUDA_ERROR_NO_DEVICE */
STUB(cuDeviceGetName) STUB(cuFuncSetAttribute) STUB(cuLaunchKernelEx) STUB(cuModuleGetFunction)
STUB(cuModuleLoadData) STUB(cuModuleUnload) STUB(cuTensorMapEncodeTiled)
CUresult cuGetErrorName(CUresult e, const char **s) { *s = "CUDA_ERROR_STUB_NO_DEVICE"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "libcuda stub: no device"; return 0; }
"""
_STUB_VERSION = "1"  # bump when _STUB_SOURCE changes
_STUB_RECORD_SUFFIX = ".sha256"  # libcuda.so.1.sha256: the stub's SHA-256 when it was built
_FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")  # fatbin wrapper magic 0xBA55ED50
_CUDA_SOURCE_MARKER = b"__global__"
_EM_CUDA = 190

_driver: ctypes.CDLL | None = None


class CudaBuildError(UsageError):
    """A CUDA build that cannot run here: a bad arch, or missing tools (gcc, nvcc, TVM's CUDA
    runtime library)."""


def make_cuda_target(arch: str = DEFAULT_ARCH):  # -> tvm.target.Target
    """The CUDA target (LLVM host) for ``arch``, e.g. ``"sm_90"`` for the H100/H200.

    Only plain ``sm_NN`` is accepted: dlight's tensor-core matmul rule parses the digits after
    ``sm_`` and silently falls back to SIMT kernels for ``sm_90a``. The resource limits are
    Hopper's defaults for a block without opt-in shared memory (notes/tvm-0.27.md, section 2).
    """
    if not re.fullmatch(r"sm_[1-9][0-9]{1,2}", arch):
        raise CudaBuildError(
            f"unsupported CUDA arch {arch!r}; use the plain form sm_NN, e.g. sm_90 for H100/H200 "
            "(sm_90a disables dlight's tensor-core matmuls)"
        )
    enable_cuda_codegen()  # before the first ``import tvm`` where possible (see module docstring)
    import tvm

    cuda = {
        "kind": "cuda",
        "arch": arch,
        "max_shared_memory_per_block": 49152,
        "max_threads_per_block": 1024,
        "thread_warp_size": 32,
        "registers_per_block": 65536,
    }
    return tvm.target.Target(cuda, host={"kind": "llvm"})


def cache_dir() -> Path:
    """The per-user folder that holds the driver stub (the cache folder of dsv2-mlc)."""
    return default_cache_dir()


def _stub_intact(lib: Path) -> bool:
    """Whether ``lib`` has the SHA-256 recorded when it was built (a stub without a record, built
    before records were kept, is built again quietly; one that differs is reported)."""
    record = lib.with_name(lib.name + _STUB_RECORD_SUFFIX)
    try:
        recorded = record.read_text().strip()
    except OSError:
        return False
    if recorded == sha256_file(lib)[1]:
        return True
    LOG.warning("%s: not the driver stub dsv2-mlc built (sha256 differs); building anew", lib)
    return False


def build_driver_stub(folder: Path | None = None) -> Path:
    """Compile the stub ``libcuda.so.1`` into ``folder`` (default: :func:`cache_dir`) once; a
    stub whose SHA-256 is not the one recorded when it was built is built again (never loaded)."""
    folder = (folder or cache_dir()) / f"cuda-driver-stub-v{_STUB_VERSION}"
    lib = folder / "libcuda.so.1"
    if lib.is_file():
        if _stub_intact(lib):
            return lib
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise CudaBuildError(
            "a CUDA build on a machine without the CUDA driver needs gcc (to build a driver "
            "stub); install gcc or compile on a machine with the driver"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = Path(tmp) / "cuda_stub.c", Path(tmp) / "libcuda.so.1"
        src.write_text(_STUB_SOURCE)
        cmd = [gcc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CudaBuildError(f"building the CUDA driver stub failed: {proc.stderr.strip()}")
        record = Path(tmp) / "sha256"
        record.write_text(sha256_file(out)[1] + "\n")
        os.replace(out, lib)  # atomic: concurrent builders are fine
        os.replace(record, lib.with_name(lib.name + _STUB_RECORD_SUFFIX))
    return lib


def _load_driver() -> None:
    """The real ``libcuda.so.1`` if it loads, else the stub, ``RTLD_GLOBAL``, once."""
    global _driver
    if _driver is not None:
        return
    try:
        _driver = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        _driver = ctypes.CDLL(str(build_driver_stub()), mode=ctypes.RTLD_GLOBAL)


def _tvm_lib_dir() -> Path:
    spec = importlib.util.find_spec("tvm")
    if spec is None or spec.origin is None:
        raise CudaBuildError("apache-tvm is not installed; install dsv2-mlc[compiler]")
    return Path(spec.origin).parent / "lib"


def _cuda_module_registered() -> bool:
    import tvm_ffi  # loads libtvm_ffi.so, which the TVM libraries need

    return tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None


def enable_cuda_codegen() -> None:
    """Make TVM's CUDA codegen produce compiled modules in this process (idempotent)."""
    if shutil.which("nvcc") is None:
        raise CudaBuildError(
            "nvcc not found on PATH; a CUDA build needs the CUDA toolkit (nvcc) to precompile "
            "its kernels"
        )
    if _cuda_module_registered():
        return
    _load_driver()
    import tvm  # noqa: F401  (loads libtvm_runtime.so; autoloads the CUDA runtime if it can)

    if not _cuda_module_registered():
        lib = _tvm_lib_dir() / "libtvm_runtime_cuda.so"
        try:
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise CudaBuildError(f"cannot load {lib}: {err}") from err
    if not _cuda_module_registered():
        raise CudaBuildError(
            "TVM's CUDA runtime library loaded but registered no ffi.Module.create.cuda; "
            f"this apache-tvm ({tvm.__version__}) cannot precompile CUDA kernels"
        )


def _arch_specific_compile(code: str) -> bytes:
    """``tvm_callback_cuda_compile`` for nvcc with :data:`ARCH_SPECIFIC` features."""
    from tvm.support.nvcc import compile_cuda
    from tvm.target import Target

    target = Target.current(allow_none=True)
    arch = ARCH_SPECIFIC.get(str(getattr(target, "arch", "")))
    gencode = None if arch is None else ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return compile_cuda(code, target_format="fatbin", arch=gencode, compiler="nvcc")


@contextlib.contextmanager
def cuda_codegen(arch_specific: bool = True) -> Iterator[None]:
    """Inside: TVM CUDA builds embed nvcc fatbins, with the arch-specific features of
    :data:`ARCH_SPECIFIC` unless ``arch_specific=False`` (see the module docstring)."""
    import tvm_ffi

    enable_cuda_codegen()
    import tvm.support.nvcc  # noqa: F401  (registers TVM's callback, restored below)

    key = "TVM_CUDA_COMPILE_MODE"
    old = os.environ.get(key)
    os.environ[key] = "nvcc"
    callback = tvm_ffi.get_global_func(_COMPILE_CALLBACK)
    if arch_specific:
        tvm_ffi.register_global_func(_COMPILE_CALLBACK, _arch_specific_compile, override=True)
    try:
        yield
    finally:
        if arch_specific:
            tvm_ffi.register_global_func(_COMPILE_CALLBACK, callback, override=True)
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def embedded_sm_archs(data: bytes) -> set[int]:
    """The SM versions (90 for sm_90) of the CUDA ELF images (cubins) found in ``data``."""
    archs = set()
    start = data.find(b"\x7fELF")
    while start >= 0:
        header = data[start : start + 52]
        if len(header) == 52 and header[4] == 2:  # ELFCLASS64
            machine = int.from_bytes(header[18:20], "little")
            if machine == _EM_CUDA:
                flags = int.from_bytes(data[start + 48 : start + 52], "little")
                archs.add((flags >> 8) & 0xFF)
        start = data.find(b"\x7fELF", start + 4)
    return archs


def check_fatbin(library: str | Path, arch: str = DEFAULT_ARCH) -> None:
    """Raise ``AssertionError`` unless ``library`` embeds a fatbin with ``arch`` machine code and
    no CUDA source (so it loads where neither nvcc nor NVRTC is installed)."""
    data = Path(library).read_bytes()
    if _FATBIN_MAGIC not in data:
        raise AssertionError(f"{library}: no CUDA fatbin embedded (the kernels were not compiled)")
    if _CUDA_SOURCE_MARKER in data:
        raise AssertionError(f"{library}: CUDA source embedded (it would need nvcc at load time)")
    want = int(arch.removeprefix("sm_"))
    found = embedded_sm_archs(data)
    if want not in found:
        raise AssertionError(f"{library}: no {arch} machine code in the fatbin (found {found})")


def cuda_sources(module) -> list[str]:  # (tvm.runtime.Module) -> list[str]
    """The CUDA C++ of every CUDA module imported (transitively) by ``module``, as generated
    (also when the module holds compiled kernels, before export)."""
    found, stack, seen = [], [module], set()
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        if mod.kind == "cuda":
            found.append(mod.inspect_source("cuda"))
        stack.extend(mod.imports_)
    return found

"""Find libcublas for a build compiled with ``--gemm cublas`` and hand it to the library's shim.

Such a library carries ``runtime/cublas_gemm.cc``, which registers ``dsv2.cublas.*`` when the
library is loaded but opens libcublas only when told where it is (``dsv2.cublas.init``), so that
the build box needs no cuBLAS and the error for a machine without it comes here, at load time,
with the fix in the message. Looked for, first found wins:

1. ``DSV2_MLC_CUBLAS`` (a path to the library file);
2. the ``nvidia`` pip packages (``nvidia-cublas``, also what a CUDA build of PyTorch installs):
   ``site-packages/nvidia/*/lib/libcublas.so.*``;
3. ``$CUDA_HOME`` / ``$CUDA_PATH``, then ``/usr/local/cuda``: ``lib64/libcublas.so.*``;
4. the dynamic loader's own search (``ldconfig``), by name.

CUDA 13's library (``libcublas.so.13``) is preferred over 12's at each place.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from pathlib import Path

import tvm_ffi

from .device import device_of
from .tvm_runtime import RuntimeLibraryError, global_func

CUBLAS_ENV = "DSV2_MLC_CUBLAS"
# The workspace given to cuBLAS (``dsv2.cublas.set_workspace``): the size cuBLAS' documentation
# recommends for Hopper (``cublasSetWorkspace``).
WORKSPACE_BYTES = 32 << 20
SONAMES = ("libcublas.so.13", "libcublas.so.12")
_FIX = (
    "install cuBLAS (`pip install nvidia-cublas` or the CUDA toolkit), set "
    f"{CUBLAS_ENV} to the libcublas.so file, or compile the model with --gemm tir"
)


def _lib_dirs() -> list[Path]:
    dirs: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            dirs.extend(sorted(Path(root).glob("*/lib")))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "lib64")
    dirs.append(Path("/usr/local/cuda/lib64"))
    return dirs


def find_cublas() -> str:
    """The path (or, from the loader's cache, the name) of the libcublas to open."""
    explicit = os.environ.get(CUBLAS_ENV)
    if explicit:
        if not Path(explicit).is_file():
            raise RuntimeLibraryError(f"{CUBLAS_ENV}={explicit}: no such file; {_FIX}")
        return explicit
    dirs = _lib_dirs()
    for soname in SONAMES:
        for folder in dirs:
            if (folder / soname).is_file():
                return str(folder / soname)
    if ctypes.util.find_library("cublas"):
        return SONAMES[0]  # in the loader's cache: dlopen finds it by name
    looked = ", ".join(str(d) for d in dirs)
    raise RuntimeLibraryError(
        f"this model runs its prefill GEMMs with cuBLAS (compiled with --gemm cublas), and no "
        f"libcublas was found (looked in {looked} and the loader's cache); {_FIX}"
    )


def init_cublas() -> str:
    """Open libcublas in the loaded library's shim (idempotent); the path it opened."""
    path = find_cublas()
    try:
        return str(global_func("dsv2.cublas.init")(path))
    except RuntimeLibraryError:
        raise RuntimeLibraryError(
            "the library was compiled with --gemm cublas but registers no dsv2.cublas.init; "
            "compile the model again"
        ) from None
    except Exception as err:  # the shim raises plain RuntimeErrors (dlopen, missing symbols)
        raise RuntimeLibraryError(f"{err}; {_FIX}") from err


def set_cublas_workspace(device_index: int = 0, nbytes: int = WORKSPACE_BYTES) -> int | None:
    """Give cuBLAS on CUDA device ``device_index`` a workspace of ``nbytes`` that the shim holds
    for the process (the first one a device gets stays; its size is returned), so that a
    captured decode graph holds no cuBLAS memory-allocation nodes: such graphs can move between
    page buckets (``runtime/graph_relocation.py``) and allocate nothing per capture. None where
    the loaded library's shim predates the function (its GEMMs allocate their own workspace)."""
    func = tvm_ffi.get_global_func("dsv2.cublas.set_workspace", allow_missing=True)
    if func is None:
        return None
    workspace = global_func("runtime.TVMTensorAllocWithScope")(
        tvm_ffi.Shape((nbytes,)), tvm_ffi.dtype("uint8"), device_of("cuda", device_index), None
    )
    return int(func(workspace))

"""The cuBLAS GEMM shim of ``compile --gemm cublas``: compiled here, linked into the model library.

``dsv2_mlc/runtime/cublas_gemm.cc`` registers the TVM FFI functions that the Relax VM calls for
the prefill / extend GEMMs (``passes/dispatch_cublas_gemm.py``). It is host C++ against TVM FFI's
headers only (libcublas is opened at run time), so any machine that builds the model builds it:
no CUDA toolkit, no cuBLAS, no GPU. The object goes into ``export_library(addons=...)``, so the
one library file of a build carries it and registers the functions when it is loaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..errors import UsageError

SHIM_SOURCE = Path(__file__).resolve().parent.parent / "runtime" / "cublas_gemm.cc"
LINK_OPTIONS = ["-ldl"]  # dlopen / dladdr (part of libc on glibc >= 2.34; harmless there)


class ShimBuildError(UsageError):
    """The cuBLAS shim cannot be built here (no C++ compiler, or it failed)."""


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise ShimBuildError(
        "--gemm cublas needs a C++17 compiler (g++ or clang++) to build the cuBLAS shim; "
        "install one or compile with --gemm tir"
    )


def build_cublas_shim(workdir: str | Path) -> Path:
    """Compile the shim to ``workdir/cublas_gemm.o`` (position independent) and return it."""
    import tvm_ffi.libinfo

    if not SHIM_SOURCE.is_file():
        raise ShimBuildError(f"{SHIM_SOURCE}: the cuBLAS shim source is missing; reinstall")
    obj = Path(workdir) / "cublas_gemm.o"
    includes = [f"-I{path}" for path in tvm_ffi.libinfo.include_paths()]
    cmd = [_compiler(), "-std=c++17", "-O2", "-fPIC", "-c", str(SHIM_SOURCE), *includes]
    proc = subprocess.run([*cmd, "-o", str(obj)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ShimBuildError(f"building the cuBLAS shim failed ({' '.join(cmd)}):\n{proc.stderr}")
    return obj

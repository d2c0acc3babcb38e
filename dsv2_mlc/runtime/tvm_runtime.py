"""Load the TVM runtime libraries through ``tvm_ffi`` and ``ctypes``, never ``import tvm``.

A compiled model needs only ``libtvm_runtime.so`` (plus ``libtvm_runtime_cuda.so`` for CUDA) and
the ``apache-tvm-ffi`` package: the compiler library (250 MB) is not needed to run it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import tvm_ffi

from ..errors import Dsv2Error

LIB_DIR_ENV = "DSV2_MLC_TVM_LIB_DIR"
_loaded: dict[str, ctypes.CDLL] = {}
_preferred: list[Path] = []  # runtime folders bundled in opened artifacts (dsv2_mlc.artifacts)


class RuntimeLibraryError(Dsv2Error, RuntimeError):
    """The TVM runtime libraries cannot be found or loaded (the message says how to fix it)."""


def find_lib_dir(lib_dir: str | Path | None = None) -> Path:
    """Where ``libtvm_runtime.so`` is: the argument, ``$DSV2_MLC_TVM_LIB_DIR``, or the
    ``lib/`` folder of an installed ``tvm`` package (located without importing it)."""
    candidates = []
    if lib_dir is not None:
        candidates.append(Path(lib_dir))
    if os.environ.get(LIB_DIR_ENV):
        candidates.append(Path(os.environ[LIB_DIR_ENV]))
    candidates.extend(_preferred)
    spec = importlib.util.find_spec("tvm")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "lib")
    for cand in candidates:
        if (cand / "libtvm_runtime.so").is_file():
            return cand
    raise RuntimeLibraryError(
        "libtvm_runtime.so not found (looked in: "
        + (", ".join(str(c) for c in candidates) or "nothing")
        + f"); install apache-tvm, or set {LIB_DIR_ENV} to a folder holding the TVM runtime "
        "libraries (see dist/README.md)"
    )


def prefer_lib_dir(lib_dir: str | Path) -> None:
    """Look in ``lib_dir`` (an artifact's bundled runtime) before the installed ``tvm`` package;
    an explicit folder and ``$DSV2_MLC_TVM_LIB_DIR`` still come first."""
    path = Path(lib_dir)
    if path in _preferred:
        _preferred.remove(path)
    _preferred.insert(0, path)


_MARKERS = {  # a global each library registers when loaded
    "libtvm_runtime.so": "vm.builtin.kv_state_clear",
    "libtvm_runtime_cuda.so": "device_api.cuda",
}


def _present(name: str) -> bool:
    """Whether library ``name`` is already in this process (e.g. loaded by ``import tvm``)."""
    return tvm_ffi.get_global_func(_MARKERS[name], allow_missing=True) is not None


def load_runtime(device: str = "cpu", lib_dir: str | Path | None = None) -> Path:
    """Load ``libtvm_runtime.so`` (and the CUDA runtime for ``device == "cuda"``) once; when
    they are in the process already (an earlier call, ``import tvm``), ``lib_dir`` is not
    needed and the folder of the loaded runtime is returned."""
    names = ["libtvm_runtime.so"] + (["libtvm_runtime_cuda.so"] if device == "cuda" else [])
    if lib_dir is None and all(n in _loaded or _present(n) for n in names):
        first = _loaded.get(names[0])
        return Path(first._name).parent if first is not None else Path(".")
    found = find_lib_dir(lib_dir)
    for name in names:
        if name in _loaded:
            continue
        if _present(name):
            continue  # a second copy (another path) would register every global twice
        try:
            _loaded[name] = ctypes.CDLL(str(found / name), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise RuntimeLibraryError(f"cannot load {found / name}: {err}") from err
    return found


def global_func(name: str) -> tvm_ffi.Function:
    """A registered global function of the TVM runtime (after :func:`load_runtime`)."""
    func = tvm_ffi.get_global_func(name, allow_missing=True)
    if func is None:
        raise RuntimeLibraryError(f"TVM runtime function {name!r} is not registered")
    return func

"""Random weights created on the device, in the compiled layout, for config-only builds.

A build made with ``dsv2-mlc compile CONFIG --random-weights`` has no ``params/`` folder; it holds
``random-params.json`` (written by :func:`write_spec`: every parameter's name, shape, dtype and
how to fill it) and fill kernels in its library (:mod:`dsv2_mlc.compiler.random_fill`). At load
time :func:`create_random_params` allocates each parameter on the device and runs its kernel:
nothing is read from disk or copied from the host.

What the weights look like (value ``v`` of a parameter with ``K`` input features, its last axis):

* linear weights, absorbed MLA matrices and the fp32 router gate: uniform with std ``1/sqrt(K)``;
* the token embedding: uniform with std 1 (activations O(1), as the test checkpoints);
* RMSNorm weights: 1;
* INT4 weights: codes uniform on -7..7 (``dsv2_fill_int4_uint32``) and one constant scale per
  tensor, ``std / sqrt(56/3)``, so the dequantised weights have the std above.

Values depend on (seed, parameter index, element index) only (see :func:`param_key`);
:func:`reference_fill` is the NumPy mirror of the kernels.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tvm_ffi

from .device import device_of
from .layout import BuildError, read_build_json
from .tvm_runtime import global_func

SPEC_FILE = "random-params.json"
SPEC_VERSION = 1
INT4_KERNEL = "dsv2_fill_int4_uint32"
_GOLDEN = 0x9E3779B1
_FMIX = (0x85EBCA6B, 0xC2B2AE35)
_MASK = 0xFFFFFFFF
INT4_CODE_VAR = 56.0 / 3.0  # variance of a code uniform on -7..7


def uniform_kernel(dtype: str) -> str:
    """The fill kernel of float tensors of ``dtype`` (must match compiler/random_fill.py)."""
    return f"dsv2_fill_uniform_{dtype}"


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is filled: ``kernel``; for float kernels uniform on center +- half."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kernel: str
    center: float = 0.0
    half: float = 0.0


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * _FMIX[0]) & _MASK
    h ^= h >> 13
    h = (h * _FMIX[1]) & _MASK
    return h ^ (h >> 16)


def param_key(seed: int, index: int) -> int:
    """The 32-bit hash key of parameter ``index`` under ``seed``."""
    return _fmix32((_fmix32(seed & _MASK) ^ ((index * _GOLDEN + 0x165667B1) & _MASK)) & _MASK)


def _std(name: str, fan_in: int) -> float:
    return 1.0 if name.startswith("model.embed_tokens.") else 1.0 / math.sqrt(fan_in)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def init_spec(params: Iterable[tuple[str, Sequence[int], str]]) -> list[ParamInit]:
    """The fill of every parameter (name, shape, dtype) of a compiled model, in order."""
    params = [(n, tuple(int(s) for s in shape), str(d)) for n, shape, d in params]
    shapes = {n: s for n, s, _ in params}
    spec = []
    for name, shape, dtype in params:
        if dtype == "uint32":
            if not name.endswith("q_weight"):
                raise ValueError(f"{name}: uint32 parameter that is not an INT4 weight")
            spec.append(ParamInit(name, shape, dtype, INT4_KERNEL))
            continue
        if name.endswith("q_scale"):
            fan_in = shapes[name[: -len("q_scale")] + "q_weight"][-1] * 8
            scale = _std(name, fan_in) / math.sqrt(INT4_CODE_VAR)
            spec.append(ParamInit(name, shape, dtype, uniform_kernel(dtype), scale, 0.0))
        elif _is_norm(name):
            spec.append(ParamInit(name, shape, dtype, uniform_kernel(dtype), 1.0, 0.0))
        else:
            half = math.sqrt(3.0) * _std(name, shape[-1])
            spec.append(ParamInit(name, shape, dtype, uniform_kernel(dtype), 0.0, half))
    return spec


def write_spec(path: str | Path, spec: list[ParamInit]) -> None:
    """Write ``random-params.json`` into the build folder ``path``."""
    data = {"version": SPEC_VERSION, "params": [asdict(p) for p in spec]}
    (Path(path) / SPEC_FILE).write_text(json.dumps(data, indent=1))


def has_spec(path: str | Path) -> bool:
    """Whether ``path`` is a config-only build (random weights)."""
    return (Path(path) / SPEC_FILE).is_file()


def read_spec(path: str | Path) -> list[ParamInit]:
    """Read ``random-params.json`` of the build folder ``path``."""
    data = read_build_json(
        Path(path) / SPEC_FILE,
        "version",
        SPEC_VERSION,
        missing=f"{path}: no {SPEC_FILE}; random weights need a build made with "
        "`dsv2-mlc compile CONFIG --random-weights`",
    )
    return [ParamInit(**{**p, "shape": tuple(p["shape"])}) for p in data["params"]]


def create_random_params(
    library: tvm_ffi.Module, spec: list[ParamInit], device: str, seed: int
) -> tvm_ffi.Array:
    """Allocate every parameter of ``spec`` on ``device`` and fill it with its kernel from the
    compiled ``library``; returns them in order (the VM's packed parameter array)."""
    alloc = global_func("runtime.TVMTensorAllocWithScope")
    view = global_func("runtime.TVMTensorCreateView")
    dev = device_of(device)
    kernels: dict[str, tvm_ffi.Function] = {}
    tensors = []
    for index, p in enumerate(spec):
        if p.kernel not in kernels:
            try:
                kernels[p.kernel] = library.get_function(p.kernel, query_imports=True)
            except Exception as err:  # noqa: BLE001 (the loader raises plain C++ errors)
                raise BuildError(
                    f"the compiled library has no {p.kernel}; compile with --random-weights again"
                ) from err
            if kernels[p.kernel] is None:
                raise BuildError(f"the compiled library has no {p.kernel}; compile again")
        dtype = tvm_ffi.dtype(p.dtype)
        tensor = alloc(tvm_ffi.Shape(p.shape), dtype, dev, None)
        numel = math.prod(p.shape)
        if numel:
            flat = view(tensor, tvm_ffi.Shape([numel]), dtype, 0)
            key = param_key(seed, index)
            if p.kernel == INT4_KERNEL:
                kernels[p.kernel](flat, key)
            else:
                kernels[p.kernel](flat, key, float(p.center), float(p.half))
        tensors.append(tensor)
    return tvm_ffi.Array(tensors)


# -- NumPy mirror of the kernels (tests, and host-side checks) -------------------------------------
def _np_hash(index: np.ndarray, key: int) -> np.ndarray:
    h = (index.astype(np.uint64) * _GOLDEN & _MASK).astype(np.uint32) ^ np.uint32(key)
    h = h.astype(np.uint64)
    h ^= h >> 16
    h = (h * _FMIX[0]) & _MASK
    h ^= h >> 13
    h = (h * _FMIX[1]) & _MASK
    h ^= h >> 16
    return h.astype(np.uint32)


def reference_fill(p: ParamInit, seed: int, index: int) -> np.ndarray:
    """What :func:`create_random_params` puts into parameter ``index`` (``p``), in NumPy."""
    numel = math.prod(p.shape)
    key = param_key(seed, index)
    if p.kernel == INT4_KERNEL:
        elems = np.arange(numel * 8, dtype=np.uint64)
        h = _np_hash(elems, key).astype(np.uint64)
        codes = (((h >> 16) * 15) >> 16) + 1
        words = np.zeros(numel, np.uint64)
        for c in range(8):
            words |= codes[c::8] << np.uint64(4 * c)
        return words.astype(np.uint32).reshape(p.shape)
    h = _np_hash(np.arange(numel, dtype=np.uint64), key)
    u = (h >> 8).astype(np.float32) * np.float32(1.0 / (1 << 24))
    val = np.float32(p.center) + np.float32(p.half) * (u * np.float32(2.0) - np.float32(1.0))
    return val.astype(p.dtype).reshape(p.shape)

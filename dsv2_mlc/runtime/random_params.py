"""Random weights created on the device, in the compiled layout, for config-only builds.

A build made with ``dsv2-mlc compile CONFIG --random-weights`` has no ``params/`` folder; it holds
``random-params.json`` (written by :func:`dsv2_mlc.layout.write_spec`: every parameter's name,
shape, dtype and how to fill it) and fill kernels in its library
(:mod:`dsv2_mlc.compiler.random_fill`). At load time :func:`create_random_params` allocates each
parameter on the device and runs its kernel: nothing is read from disk or copied from the host.

What the weights look like (value ``v`` of a parameter with ``K`` input features, its last axis):

* linear weights, absorbed MLA matrices and the fp32 router gate: uniform with std ``1/sqrt(K)``;
* the token embedding: uniform with std 1 (activations O(1), as the test checkpoints);
* RMSNorm weights: 1;
* INT4 weights: codes uniform on -7..7 (``dsv2_fill_int4_uint32``) and one constant scale per
  tensor, ``std / sqrt(56/3)``, so the dequantised weights have the std above.

Values depend on (seed, parameter index, element index) only (see :func:`param_key`);
:func:`reference_fill` is the NumPy mirror of the kernels. Parameters placed in host memory
(``Engine(experts="host")``, :mod:`dsv2_mlc.runtime.host_memory`) are filled by the same kernel
where they lie (on CUDA it writes them over PCIe), so they hold the same bits and take no device
memory, not even for a while.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import tvm_ffi

from ..layout import INT4_KERNEL, BuildError, ParamInit
from .device import device_of
from .tvm_runtime import global_func

if TYPE_CHECKING:
    from .host_memory import HostWeights

_GOLDEN = 0x9E3779B1
_FMIX = (0x85EBCA6B, 0xC2B2AE35)
_MASK = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * _FMIX[0]) & _MASK
    h ^= h >> 13
    h = (h * _FMIX[1]) & _MASK
    return h ^ (h >> 16)


def param_key(seed: int, index: int) -> int:
    """The 32-bit hash key of parameter ``index`` under ``seed``."""
    return _fmix32((_fmix32(seed & _MASK) ^ ((index * _GOLDEN + 0x165667B1) & _MASK)) & _MASK)


def create_random_params(
    library: tvm_ffi.Module,
    spec: list[ParamInit],
    device: str,
    seed: int,
    host: HostWeights | None = None,
) -> tvm_ffi.Array:
    """Allocate every parameter of ``spec`` on ``device`` (those ``host`` wants in its host
    memory) and fill it with its kernel from the compiled ``library``; returns them in order
    (the VM's packed parameter array)."""
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
        if host is not None and host.wants(p.name):
            tensor = host.tensor(p.name, p.shape, p.dtype)[0]
        else:
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

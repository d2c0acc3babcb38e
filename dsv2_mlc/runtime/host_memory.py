"""Weights in host memory handed to the compiled library as ordinary tensors of the build's device.

``Engine(experts="host")`` places the routed experts' weights (:mod:`.placement`) here. On CUDA
each tensor is pinned, mapped host memory (``cudaHostAlloc`` with ``cudaHostAllocMapped |
cudaHostAllocPortable``): its device address (``cudaHostGetDevicePointer``; the host address
itself under unified addressing) goes into a DLPack tensor whose device is ``cuda:0``, so the
library's kernels, unchanged, read the weights over PCIe (zero-copy), and CUDA graphs stay valid
(the addresses never move). On a CPU build the same tensors come from ``aligned_alloc``: nothing
moves in memory, but the weights go through the same allocation and loading path.

Each allocation holds its own DLPack header: the ``DLManagedTensor`` and the shape lie in the
first :data:`HEADER_BYTES` bytes, the data after them, and the header's deleter is the
allocator's C free function (``cudaFreeHost`` / ``free``) applied to the header, the start of the
allocation. The memory is so freed exactly when ``tvm_ffi`` drops the last reference to the
tensor (the engine's parameter array, a view, a captured graph's owner), never before, and with
no Python callback at teardown.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tvm_ffi

from ..layout import BuildError
from .device import DEVICE_TYPES, device_of
from .placement import dtype_bytes, is_routed_expert, weight_records
from .tvm_runtime import global_func

__all__ = ["HEADER_BYTES", "HostWeights", "load_params_placed"]

HEADER_BYTES = 256  # the DLPack header before the data; keeps the data 256-byte aligned
_PAGE = 4096
_CUDA_HOST_ALLOC_PORTABLE = 1  # cudaHostAllocPortable: pinned for every CUDA context
_CUDA_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped: mapped into the device's address space


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]  # fmt: skip


_SHAPE_AT = ctypes.sizeof(_DLManagedTensor)  # the shape's int64s follow the managed tensor
_MAX_NDIM = (HEADER_BYTES - _SHAPE_AT) // 8
_CAPSULE_NAME = b"dltensor"  # DLPack's legacy capsule name; kept alive with the module
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Allocator:
    """Host memory for one device kind: ``alloc`` gives (host address, device address) of
    ``nbytes``; ``free_fn`` is the address of the C function that frees the host address."""

    device_type: int
    free_fn: int

    def alloc(self, nbytes: int) -> tuple[int, int]:
        raise NotImplementedError


class _CpuAllocator(_Allocator):
    def __init__(self) -> None:
        libc = ctypes.CDLL(None)
        self._aligned_alloc = libc.aligned_alloc
        self._aligned_alloc.restype = ctypes.c_void_p
        self._aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        self.free_fn = int(ctypes.cast(libc.free, ctypes.c_void_p).value or 0)
        self.device_type = DEVICE_TYPES["cpu"]

    def alloc(self, nbytes: int) -> tuple[int, int]:
        ptr = self._aligned_alloc(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        if not ptr:
            raise MemoryError(f"cannot allocate {nbytes} bytes of host memory")
        return int(ptr), int(ptr)


class _CudaAllocator(_Allocator):
    def __init__(self) -> None:
        from .cudart import CudaRuntime

        self._rt = CudaRuntime()
        self.free_fn = int(ctypes.cast(self._rt.lib.cudaFreeHost, ctypes.c_void_p).value or 0)
        self.device_type = DEVICE_TYPES["cuda"]

    def alloc(self, nbytes: int) -> tuple[int, int]:
        host = self._rt.host_alloc(nbytes, _CUDA_HOST_ALLOC_MAPPED | _CUDA_HOST_ALLOC_PORTABLE)
        try:
            dev = self._rt.host_device_pointer(host)
        except RuntimeError:
            self._rt.free_host(host)
            raise
        return host, dev


@dataclass
class HostWeights:
    """The parameters placed in host memory for one engine: :meth:`wants` says which (the
    routed experts), :meth:`tensor` allocates one; ``bytes`` counts the data allocated."""

    device: str
    names: list[str] = field(default_factory=list)
    bytes: int = 0

    def __post_init__(self) -> None:
        self._alloc: _Allocator = _CudaAllocator() if self.device == "cuda" else _CpuAllocator()

    @staticmethod
    def wants(name: str) -> bool:
        """Whether parameter ``name`` goes to host memory (a routed expert weight)."""
        return is_routed_expert(name)

    def tensor(self, name: str, shape: Sequence[int], dtype: str) -> tuple[tvm_ffi.Tensor, int]:
        """A new tensor ``name`` of ``shape`` / ``dtype`` in host memory, on the build's device
        (uninitialised); returns it and the host address of its data."""
        shape = tuple(int(s) for s in shape)
        if len(shape) > _MAX_NDIM:
            raise ValueError(f"{name}: {len(shape)} dimensions, at most {_MAX_NDIM}")
        nbytes = math.prod(shape) * dtype_bytes(dtype)
        host, dev = self._alloc.alloc(HEADER_BYTES + nbytes)
        try:
            tensor = _wrap(host, dev, shape, dtype, self._alloc)
        except BaseException:
            ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._alloc.free_fn)(host)
            raise
        self.names.append(name)
        self.bytes += nbytes
        return tensor, host + HEADER_BYTES


def _wrap(host: int, dev: int, shape: tuple[int, ...], dtype: str, alloc: _Allocator):
    """The tensor over the allocation at ``host`` (device address ``dev``): its header written
    at ``host``, its data at ``dev + HEADER_BYTES``; ``tvm_ffi`` owns it from here on."""
    dt = tvm_ffi.dtype(dtype)
    shape_at = host + _SHAPE_AT
    (ctypes.c_int64 * len(shape)).from_address(shape_at)[:] = shape
    managed = _DLManagedTensor.from_address(host)
    managed.dl_tensor = _DLTensor(
        data=dev + HEADER_BYTES,
        device=_DLDevice(alloc.device_type, 0),
        ndim=len(shape),
        dtype=_DLDataType(dt.type_code, dt.bits, dt.lanes),
        shape=shape_at,
        strides=None,
        byte_offset=0,
    )
    managed.manager_ctx = None
    managed.deleter = alloc.free_fn  # free(header) frees the whole allocation
    return tvm_ffi.from_dlpack(_capsule_new(host, _CAPSULE_NAME, None))


def load_params_placed(
    params_dir: Path, names: Sequence[str], device: str, host: HostWeights
) -> tvm_ffi.Array:
    """The parameters ``names`` of the weight index in ``params_dir`` (``tensor-cache.json``,
    raw shards): those ``host`` wants read from their shards straight into host memory, the
    others copied to new ``device`` tensors."""
    records = {r["name"]: r for r in weight_records(params_dir / "tensor-cache.json")}
    alloc = global_func("runtime.TVMTensorAllocWithScope")
    copy_from = global_func("runtime.TVMTensorCopyFromBytes")
    dev = device_of(device)
    files: dict[str, object] = {}
    tensors = []
    try:
        for name in names:
            rec = records.get(name)
            if rec is None:
                raise BuildError(f"{params_dir}: the weight index has no {name}; compile again")
            if rec.get("format", "raw") != "raw":
                raise BuildError(f"{params_dir}: {name} is stored as {rec['format']!r}, not raw")
            shape, dtype, nbytes = tuple(rec["shape"]), str(rec["dtype"]), int(rec["nbytes"])
            if math.prod(shape) * dtype_bytes(dtype) != nbytes:
                raise BuildError(f"{params_dir}: {name} has {nbytes} bytes for {shape} {dtype}")
            path = str(rec["dataPath"])
            if path not in files:
                files[path] = open(params_dir / path, "rb")  # noqa: SIM115 (closed below)
            f = files[path]
            f.seek(int(rec["byteOffset"]))
            if host.wants(name):
                tensor, ptr = host.tensor(name, shape, dtype)
                dest = (ctypes.c_char * nbytes).from_address(ptr)
            else:
                tensor = alloc(tvm_ffi.Shape(shape), tvm_ffi.dtype(dtype), dev, None)
                dest = bytearray(nbytes)
            if nbytes and f.readinto(dest) != nbytes:
                raise BuildError(f"{params_dir / path}: truncated at {name}; compile again")
            if not host.wants(name) and nbytes:
                buf = (ctypes.c_char * nbytes).from_buffer(dest)
                copy_from(tensor, ctypes.c_void_p(ctypes.addressof(buf)), nbytes)
            tensors.append(tensor)
    finally:
        for f in files.values():
            f.close()
    return tvm_ffi.Array(tensors)

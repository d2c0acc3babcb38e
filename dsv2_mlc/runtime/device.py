"""NumPy arrays in and out of device tensors for the thin runtime (``tvm_ffi`` only).

* CPU: :func:`to_device` is a zero-copy DLPack view of the (C-contiguous) array, which the view
  keeps alive; :func:`to_numpy` copies the tensor out, so later calls cannot overwrite it.
* Other devices (``"cuda"``): a tensor is allocated on the device with the TVM runtime's
  ``runtime.TVMTensorAllocWithScope`` and filled with ``runtime.TVMTensorCopyFromBytes``;
  :func:`to_numpy` reads back with ``runtime.TVMTensorCopyToBytes``. Both copies are on the
  device's default stream (the one the VM launches its kernels on) and return only when complete.

These globals are registered by ``libtvm_runtime.so``; load it first
(:func:`dsv2_mlc.runtime.tvm_runtime.load_runtime`, which also loads the CUDA runtime library).
"""

from __future__ import annotations

import ctypes

import numpy as np
import tvm_ffi

from .tvm_runtime import global_func

DEVICE_TYPES = {"cpu": 1, "cuda": 2}  # DLPack device types (kDLCPU, kDLCUDA)

__all__ = ["DEVICE_TYPES", "copy_into", "device_of", "to_device", "to_numpy"]


def device_of(name: str, index: int = 0) -> tvm_ffi.Device:
    """The ``tvm_ffi`` device for a device name of a build (``"cpu"`` or ``"cuda"``)."""
    if name not in DEVICE_TYPES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICE_TYPES)}")
    return tvm_ffi.device(name, index)


def to_device(
    array: np.ndarray, device: str, index: int = 0, *, copy: bool = False
) -> tvm_ffi.Tensor:
    """``array`` as a tensor on ``device``: on the CPU a zero-copy view unless ``copy``;
    elsewhere always a copy in a new device allocation."""
    array = np.ascontiguousarray(array)
    if device == "cpu" and not copy:
        return tvm_ffi.from_dlpack(array)
    tensor = global_func("runtime.TVMTensorAllocWithScope")(
        tvm_ffi.Shape(array.shape), tvm_ffi.dtype(str(array.dtype)), device_of(device, index), None
    )
    copy_into(tensor, array)
    return tensor


def copy_into(tensor: tvm_ffi.Tensor, array: np.ndarray) -> None:
    """Overwrite ``tensor`` (any device) with ``array`` of the same shape and dtype."""
    array = np.ascontiguousarray(array, dtype=np.dtype(str(tensor.dtype)))
    if tuple(array.shape) != tuple(int(s) for s in tensor.shape):
        raise ValueError(f"shape {array.shape} does not match the tensor's {tensor.shape}")
    if array.nbytes:
        global_func("runtime.TVMTensorCopyFromBytes")(
            tensor, ctypes.c_void_p(array.ctypes.data), array.nbytes
        )


def to_numpy(tensor: tvm_ffi.Tensor) -> np.ndarray:
    """A NumPy copy of ``tensor``, wherever it lives (waits for the device to finish it)."""
    if tensor.device.dlpack_device_type() == DEVICE_TYPES["cpu"]:
        return np.array(np.from_dlpack(tensor), copy=True)
    out = np.empty(tuple(int(s) for s in tensor.shape), dtype=np.dtype(str(tensor.dtype)))
    if out.nbytes:
        global_func("runtime.TVMTensorCopyToBytes")(
            tensor, ctypes.c_void_p(out.ctypes.data), out.nbytes
        )
    return out

"""The few CUDA runtime (``libcudart``) calls made from Python: streams, graphs, memory."""

from __future__ import annotations

import ctypes

__all__ = ["CudaRuntime"]

_CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed


class CudaRuntime:
    """The CUDA runtime calls the runtime makes itself (graphs, memory figures), through the
    ``libcudart`` the TVM CUDA runtime loaded."""

    def __init__(self) -> None:
        lib = None
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise RuntimeError("libcudart not found; install the CUDA runtime library")
        self.lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.cudaGetErrorString(err).decode()
            raise RuntimeError(f"{what} failed: {msg} (cudaError {err})")

    def create_stream(self) -> int:
        stream = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        return int(stream.value or 0)

    def begin_capture(self, stream: int) -> None:
        self._check(
            self.lib.cudaStreamBeginCapture(ctypes.c_void_p(stream), _CAPTURE_MODE_RELAXED),
            "cudaStreamBeginCapture",
        )

    def end_capture(self, stream: int) -> int:
        graph = ctypes.c_void_p()
        self._check(
            self.lib.cudaStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)),
            "cudaStreamEndCapture",
        )
        return int(graph.value or 0)

    def instantiate(self, graph: int) -> int:
        exe = ctypes.c_void_p()
        err = self.lib.cudaGraphInstantiate(
            ctypes.byref(exe), ctypes.c_void_p(graph), ctypes.c_ulonglong(0)
        )
        self.lib.cudaGraphDestroy(ctypes.c_void_p(graph))
        self._check(err, "cudaGraphInstantiate")
        return int(exe.value or 0)

    def launch(self, exe: int, stream: int) -> None:
        self._check(
            self.lib.cudaGraphLaunch(ctypes.c_void_p(exe), ctypes.c_void_p(stream)),
            "cudaGraphLaunch",
        )

    def destroy(self, exe: int) -> None:
        self.lib.cudaGraphExecDestroy(ctypes.c_void_p(exe))

    def clear_error(self) -> None:
        self.lib.cudaGetLastError()

    def memory_used(self) -> tuple[int, int] | None:
        """(used, total) bytes of the current device (``cudaMemGetInfo``), None on error."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return total.value - free.value, total.value

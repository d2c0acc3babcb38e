"""The few CUDA runtime (``libcudart``) calls made from Python: streams, graphs, memory."""

from __future__ import annotations

import ctypes

from .graph_relocation import Node

__all__ = ["MEMCPY_DEVICE_TO_HOST", "MEMCPY_HOST_TO_DEVICE", "CudaRuntime", "EdgeData"]

_CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
_HOST_ALLOC_DEFAULT = 0  # cudaHostAllocDefault: page-locked, one device, not mapped
MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice (enum cudaMemcpyKind)
MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost
_EDGE_DATA_API = 12030  # cudaGraphEdgeData and the *_v2 graph edge calls: CUDA 12.3
_EDGE_DATA_DEFAULT_NAMES = 13000  # CUDA 13 dropped the _v2 names: the plain ones take edge data
_NODE_KERNEL, _NODE_MEMCPY, _NODE_MEMSET = 0, 1, 2  # cudaGraphNodeType
_CU_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE: cuFuncGetParamInfo past the last argument
# cudaMemcpy3DParms as 20 words: srcPtr.ptr and dstPtr.ptr are words 4 and 12, the copy kind the
# low half of word 19 (its high half is padding)
_MEMCPY_WORDS, _MEMCPY_PTRS = 20, (4, 12)


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (driver API, CUDA 12+)."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("kernel_params", ctypes.POINTER(ctypes.c_void_p)),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


def _foreign(params: KernelNodeParams) -> bool:
    """A kernel node's parameters without a function and an argument array to read."""
    return not params.func or not params.kernel_params or bool(params.extra)


class MemsetParams(ctypes.Structure):
    """``cudaMemsetParams``."""

    _fields_ = [
        ("dst", ctypes.c_void_p),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("element_size", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


class EdgeData(ctypes.Structure):
    """``cudaGraphEdgeData`` (driver_types.h, CUDA 12.3+): three bytes and 5 reserved zeros."""

    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class KernelArgs:
    """One kernel node's arguments in an executable graph: ``set({index: bytes})`` writes them
    into its buffers and gives the node all of them (``cuGraphExecKernelNodeSetParams``: later
    launches use them, a launch in flight is not affected). The parameters are read once."""

    def __init__(self, set_params, exe: int, node: int, params: KernelNodeParams, args: list):
        self._set, self._exe, self._node, self._params = set_params, exe, node, params
        self._buffers = [ctypes.create_string_buffer(a, len(a)) for a in args]
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(b) for b in self._buffers))
        self._pointers = pointers  # kept alive with the struct that points at it
        params.kernel_params = ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p))

    def set(self, args: dict[int, bytes]) -> None:
        for j, value in args.items():
            if len(value) != len(self._buffers[j]):
                raise ValueError(f"argument {j}: {len(value)} bytes for {len(self._buffers[j])}")
            ctypes.memmove(self._buffers[j], value, len(value))
        err = self._set(ctypes.c_void_p(self._exe), ctypes.c_void_p(self._node),
                        ctypes.byref(self._params))  # fmt: skip
        if err != 0:
            raise RuntimeError(f"cuGraphExecKernelNodeSetParams failed (CUresult {err})")


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
        self._driver: ctypes.CDLL | None = None
        self._arg_sizes: dict[int, tuple[int, ...]] = {}  # CUfunction -> its arguments' bytes

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
        """An executable graph of ``graph`` (which stays; :meth:`destroy_graph` frees it)."""
        exe = ctypes.c_void_p()
        err = self.lib.cudaGraphInstantiate(
            ctypes.byref(exe), ctypes.c_void_p(graph), ctypes.c_ulonglong(0)
        )
        self._check(err, "cudaGraphInstantiate")
        return int(exe.value or 0)

    def destroy_graph(self, graph: int) -> None:
        self.lib.cudaGraphDestroy(ctypes.c_void_p(graph))

    def synchronize(self, stream: int) -> None:
        self._check(
            self.lib.cudaStreamSynchronize(ctypes.c_void_p(stream)), "cudaStreamSynchronize"
        )

    # -- pinned host memory and asynchronous copies (greedy decode graphs, cuda_graph.py) ------
    def host_alloc(self, nbytes: int, flags: int = _HOST_ALLOC_DEFAULT) -> int:
        """``nbytes`` of page-locked host memory (``cudaHostAlloc`` with ``flags``);
        :meth:`free_host` frees it.

        A copy captured in a graph is replayed as a DMA transfer from or to fixed physical
        pages, with no staging by the driver: its host end must be page-locked."""
        ptr = ctypes.c_void_p()
        err = self.lib.cudaHostAlloc(
            ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(flags)
        )
        self._check(err, "cudaHostAlloc")
        return int(ptr.value or 0)

    def host_device_pointer(self, host: int) -> int:
        """The device address of mapped pinned memory at ``host`` (``cudaHostGetDevicePointer``;
        the host address itself under unified addressing)."""
        ptr = ctypes.c_void_p()
        err = self.lib.cudaHostGetDevicePointer(ctypes.byref(ptr), ctypes.c_void_p(host), 0)
        self._check(err, "cudaHostGetDevicePointer")
        return int(ptr.value or 0)

    def free_host(self, ptr: int) -> None:
        """Free memory from :meth:`host_alloc` (``cudaFreeHost``); no copy may still use it."""
        self._check(self.lib.cudaFreeHost(ctypes.c_void_p(ptr)), "cudaFreeHost")

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """``cudaMemcpyAsync(dst, src, nbytes, kind, stream)``; ``kind`` is
        :data:`MEMCPY_HOST_TO_DEVICE` or :data:`MEMCPY_DEVICE_TO_HOST`. Issued on a capturing
        stream, it becomes a memcpy node of the graph instead of running."""
        err = self.lib.cudaMemcpyAsync(
            ctypes.c_void_p(dst),
            ctypes.c_void_p(src),
            ctypes.c_size_t(nbytes),
            ctypes.c_int(kind),
            ctypes.c_void_p(stream),
        )
        self._check(err, "cudaMemcpyAsync")

    # -- graph topology (programmatic edges, runtime/pdl.py) ---------------------------------
    def _edge_call(self, name: str):  # -> the ctypes function taking cudaGraphEdgeData
        """``name`` (e.g. ``cudaGraphGetEdges``) in its edge-data form: ``name`` itself from
        CUDA 13 on, ``name_v2`` on 12.3-12.9; RuntimeError where neither exists."""
        runtime, driver = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.cudaRuntimeGetVersion(ctypes.byref(runtime)), "cudaRuntimeGetVersion")
        self._check(self.lib.cudaDriverGetVersion(ctypes.byref(driver)), "cudaDriverGetVersion")
        if min(runtime.value, driver.value) < _EDGE_DATA_API:
            raise RuntimeError(
                f"graph edge data needs CUDA 12.3+ (runtime {runtime.value}, driver {driver.value})"
            )
        symbol = name if runtime.value >= _EDGE_DATA_DEFAULT_NAMES else f"{name}_v2"
        try:
            return getattr(self.lib, symbol)
        except AttributeError as err:
            raise RuntimeError(f"{symbol} not found in the CUDA runtime") from err

    def graph_nodes(self, graph: int) -> list[int]:
        """Every node of ``graph`` (``cudaGraphGetNodes``)."""
        count = ctypes.c_size_t()
        g = ctypes.c_void_p(graph)
        self._check(self.lib.cudaGraphGetNodes(g, None, ctypes.byref(count)), "cudaGraphGetNodes")
        nodes = (ctypes.c_void_p * count.value)()
        self._check(self.lib.cudaGraphGetNodes(g, nodes, ctypes.byref(count)), "cudaGraphGetNodes")
        return [int(n or 0) for n in nodes[: count.value]]

    def node_type(self, node: int) -> int:
        """``cudaGraphNodeGetType``: a ``cudaGraphNodeType`` (0 is a kernel)."""
        kind = ctypes.c_int()
        err = self.lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        self._check(err, "cudaGraphNodeGetType")
        return kind.value

    def graph_edges(self, graph: int) -> list[tuple[int, int, tuple[int, int, int]]]:
        """Every edge of ``graph``: (from node, to node, (from_port, to_port, type))."""
        get = self._edge_call("cudaGraphGetEdges")
        count = ctypes.c_size_t()
        g = ctypes.c_void_p(graph)
        self._check(get(g, None, None, None, ctypes.byref(count)), "cudaGraphGetEdges")
        n = count.value
        src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
        self._check(get(g, src, dst, data, ctypes.byref(count)), "cudaGraphGetEdges")
        return [
            (int(src[i] or 0), int(dst[i] or 0), (d.from_port, d.to_port, d.type))
            for i, d in enumerate(data[: count.value])
        ]

    def _edges(self, name: str, graph: int, edges: list[tuple[int, int]], data: tuple) -> None:
        n = len(edges)
        src = (ctypes.c_void_p * n)(*(a for a, _ in edges))
        dst = (ctypes.c_void_p * n)(*(b for _, b in edges))
        arr = (EdgeData * n)(*(EdgeData(*data) for _ in edges))
        fn = self._edge_call(name)
        self._check(fn(ctypes.c_void_p(graph), src, dst, arr, ctypes.c_size_t(n)), name)

    def remove_edges(self, graph: int, edges: list[tuple[int, int]], data: tuple) -> None:
        """Remove ``edges`` (from, to), each with edge data ``data`` (from_port, to_port, type)."""
        self._edges("cudaGraphRemoveDependencies", graph, edges, data)

    def add_edges(self, graph: int, edges: list[tuple[int, int]], data: tuple) -> None:
        """Add ``edges`` (from, to), each with edge data ``data`` (from_port, to_port, type)."""
        self._edges("cudaGraphAddDependencies", graph, edges, data)

    # -- node parameters (graphs moved between page buckets, runtime/graph_relocation.py) -------
    def _cu(self, name: str):  # -> a driver API function of libcuda
        if self._driver is None:
            self._driver = ctypes.CDLL("libcuda.so.1")
        for symbol in (f"{name}_v2", name):
            fn = getattr(self._driver, symbol, None)
            if fn is not None:
                return fn
        raise RuntimeError(f"{name} not found in the CUDA driver")

    def _cu_check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed (CUresult {err})")

    def _node_params(self, node: int) -> KernelNodeParams:
        params = KernelNodeParams()
        fn = self._cu("cuGraphKernelNodeGetParams")
        err = fn(ctypes.c_void_p(node), ctypes.byref(params))
        self._cu_check(err, "cuGraphKernelNodeGetParams")
        return params

    def _kernel_params(self, node: int) -> KernelNodeParams:
        params = self._node_params(node)
        if _foreign(params):
            raise RuntimeError("a kernel node without a function or an argument array")
        return params

    def foreign_kernel(self, node: int) -> bool:
        """Whether kernel ``node`` was launched by a library through its own launch path: its
        parameters name no function with an argument array (cuBLAS's kernels in a graph of
        ``batch_decode_gemm``; the TVM runtime launches every kernel of a build with
        ``cuLaunchKernel`` and an argument array). Such a kernel's arguments cannot be read or
        set, and it does not wait for its predecessors as a ``--pdl`` build's kernels do."""
        return _foreign(self._node_params(node))

    def _sizes(self, func: int) -> tuple[int, ...]:
        """The byte size of each argument of ``func`` (``cuFuncGetParamInfo``, CUDA 12.4+)."""
        if func not in self._arg_sizes:
            info = self._cu("cuFuncGetParamInfo")
            sizes, offset, size = [], ctypes.c_size_t(), ctypes.c_size_t()
            while True:
                err = info(ctypes.c_void_p(func), ctypes.c_size_t(len(sizes)),
                           ctypes.byref(offset), ctypes.byref(size))  # fmt: skip
                if err == _CU_INVALID_VALUE:
                    break
                self._cu_check(err, "cuFuncGetParamInfo")
                sizes.append(size.value)
            self._arg_sizes[func] = tuple(sizes)
        return self._arg_sizes[func]

    def _args(self, p: KernelNodeParams) -> list[bytes]:
        """The bytes of each argument of the kernel node whose parameters are ``p``."""
        return [ctypes.string_at(p.kernel_params[i], n) for i, n in enumerate(self._sizes(p.func))]

    def graph_node(self, node: int) -> Node:
        """``node`` as :func:`~dsv2_mlc.runtime.graph_relocation.derive` compares it: a kernel's
        function, launch shape and argument bytes (a foreign kernel's, :meth:`foreign_kernel`,
        without its arguments), a copy's or memset's pointers and sizes."""
        kind = self.node_type(node)
        if kind == _NODE_KERNEL:
            p = self._node_params(node)
            if _foreign(p):  # compared by its function and launch shape only
                shape = (p.func or p.kern or 0, *p.grid, *p.block, p.shared_mem)
                return Node(kind, shape, (), foreign=True)
            return Node(kind, (p.func, *p.grid, *p.block, p.shared_mem), tuple(self._args(p)))
        if kind == _NODE_MEMCPY:
            words = (ctypes.c_uint64 * _MEMCPY_WORDS)()
            err = self.lib.cudaGraphMemcpyNodeGetParams(ctypes.c_void_p(node), words)
            self._check(err, "cudaGraphMemcpyNodeGetParams")
            words[_MEMCPY_WORDS - 1] &= 0xFFFFFFFF
            ptrs = tuple(int(words[i]).to_bytes(8, "little") for i in _MEMCPY_PTRS)
            fixed = tuple(int(w) for i, w in enumerate(words) if i not in _MEMCPY_PTRS)
            return Node(kind, fixed, ptrs)
        if kind == _NODE_MEMSET:
            m = MemsetParams()
            err = self.lib.cudaGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(m))
            self._check(err, "cudaGraphMemsetNodeGetParams")
            dst = int(m.dst or 0).to_bytes(8, "little")
            return Node(kind, (m.pitch, m.value, m.element_size, m.width, m.height), (dst,))
        raise RuntimeError(f"graph node of type {kind}: its parameters are not compared")

    def kernel_args(self, exe: int, node: int) -> KernelArgs:
        """The arguments of kernel ``node`` of the executable graph ``exe`` (as the template
        node has them), to be set anew (:class:`KernelArgs`)."""
        p = self._kernel_params(node)
        return KernelArgs(self._cu("cuGraphExecKernelNodeSetParams"), exe, node, p, self._args(p))

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

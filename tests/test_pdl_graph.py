"""Programmatic kernel->kernel edges in captured decode graphs (runtime/pdl.py), against a fake
CUDA runtime that keeps a real edge list; the fallbacks when the runtime cannot; the libcudart
edge-data ABI. Replays on a GPU: scripts/gpu_pdl_check.py."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from dsv2_mlc.layout import BUILD_CONFIG, BuildConfig, BuildError
from dsv2_mlc.runtime.cuda_graph import DecodeGraphs
from dsv2_mlc.runtime.cudart import CudaRuntime, EdgeData
from dsv2_mlc.runtime.engine import _pdl_port
from dsv2_mlc.runtime.pdl import (
    DEFAULT_EDGE,
    PORT_LAUNCH_COMPLETION,
    PORT_PROGRAMMATIC,
    BrokenGraphError,
    make_programmatic,
    programmatic_edges,
    restore_default,
)

KERNEL, MEMCPY, MEMSET = 0, 1, 2  # cudaGraphNodeType
PROG = (PORT_PROGRAMMATIC, 0, 1)


class FakeGraphCuda:
    """A CUDA runtime whose captures all yield one graph: ``nodes`` (id -> type) linked by
    ``edges``; the edge calls edit it like CUDA does (an unknown edge to remove, or an existing
    one to add, is an error). ``fail`` names calls that raise."""

    def __init__(self, nodes: dict[int, int], edges: list[tuple[int, int]], fail=(),
                 foreign=()):  # fmt: skip
        self.nodes = nodes
        self.foreign = set(foreign)  # kernel nodes a library launched (no argument array)
        self.captured = {(a, b): DEFAULT_EDGE for a, b in edges}
        self.edges: dict[tuple[int, int], tuple] = {}
        self.fail = set(fail)
        self.instantiated: list[dict] = []  # the edges of every instantiated graph
        self.log: list[str] = []

    def _maybe_fail(self, name: str) -> None:
        self.log.append(name)
        if name in self.fail:
            raise RuntimeError(f"{name} failed: not supported (cudaError 801)")

    # DecodeGraphs' calls
    def create_stream(self) -> int:
        return 7

    def begin_capture(self, stream: int) -> None:
        pass

    def end_capture(self, stream: int) -> int:
        self.edges = dict(self.captured)
        return 55

    def instantiate(self, graph: int) -> int:
        self._maybe_fail("instantiate")
        self.instantiated.append(dict(self.edges))
        return 1000 + len(self.instantiated)

    def destroy_graph(self, graph: int) -> None:
        self.log.append("destroy_graph")

    def launch(self, exe: int, stream: int) -> None:
        pass

    def destroy(self, exe: int) -> None:
        pass

    def clear_error(self) -> None:
        pass

    # topology calls
    def graph_nodes(self, graph: int) -> list[int]:
        self._maybe_fail("graph_nodes")
        return list(self.nodes)

    def node_type(self, node: int) -> int:
        return self.nodes[node]

    def foreign_kernel(self, node: int) -> bool:
        return node in self.foreign

    def graph_edges(self, graph: int) -> list:
        self._maybe_fail("graph_edges")
        return [(a, b, d) for (a, b), d in self.edges.items()]

    def remove_edges(self, graph: int, edges: list, data: tuple) -> None:
        self._maybe_fail("remove_edges")
        for e in edges:
            if self.edges.get(e) != tuple(data):
                raise RuntimeError("cudaGraphRemoveDependencies failed: invalid value")
        for e in edges:
            del self.edges[e]

    def add_edges(self, graph: int, edges: list, data: tuple) -> None:
        self._maybe_fail("add_edges" if data != DEFAULT_EDGE else "add_default_edges")
        if any(e in self.edges for e in edges):
            raise RuntimeError("cudaGraphAddDependencies failed: invalid value")
        self.edges.update({e: tuple(data) for e in edges})


# k1 -> k2 -> memcpy 3 -> k4 -> k5, and k1 -> k5 (a join); node 6 is a memset feeding k2.
NODES = {1: KERNEL, 2: KERNEL, 3: MEMCPY, 4: KERNEL, 5: KERNEL, 6: MEMSET}
EDGES = [(1, 2), (2, 3), (3, 4), (4, 5), (1, 5), (6, 2)]
KERNEL_EDGES = [(1, 2), (4, 5), (1, 5)]


def test_only_plain_kernel_to_kernel_edges_are_selected():
    edges = [(a, b, DEFAULT_EDGE) for a, b in EDGES] + [(7, 8, PROG)]
    kinds = {**NODES, 7: KERNEL, 8: KERNEL}
    assert programmatic_edges(kinds, edges) == KERNEL_EDGES  # memcpy/memset ends stay plain
    assert programmatic_edges({1: KERNEL}, [(1, 9, DEFAULT_EDGE)]) == []  # unknown node


@pytest.mark.parametrize("port", [PORT_PROGRAMMATIC, PORT_LAUNCH_COMPLETION])
def test_make_programmatic_rewrites_kernel_edges_with_the_port(port: int):
    cuda = FakeGraphCuda(NODES, EDGES)
    cuda.end_capture(7)
    assert make_programmatic(cuda, 55, port) == KERNEL_EDGES
    want = {e: ((port, 0, 1) if e in KERNEL_EDGES else DEFAULT_EDGE) for e in EDGES}
    assert cuda.edges == want
    restore_default(cuda, 55, KERNEL_EDGES, port)
    assert cuda.edges == cuda.captured


def test_a_failed_add_puts_the_plain_edges_back():
    cuda = FakeGraphCuda(NODES, EDGES, fail={"add_edges"})
    cuda.end_capture(7)
    with pytest.raises(RuntimeError, match="add_edges failed"):
        make_programmatic(cuda, 55, PORT_PROGRAMMATIC)
    assert cuda.edges == cuda.captured
    cuda.fail.add("add_default_edges")  # and if even that fails, the graph is unusable
    with pytest.raises(BrokenGraphError):
        make_programmatic(cuda, 55, PORT_PROGRAMMATIC)
    with pytest.raises(ValueError, match="unknown kernel node port"):
        make_programmatic(cuda, 55, 3)


def _step(graphs: DecodeGraphs, key=(1, 1)):
    ids = np.zeros((1, 1), np.int32)
    return graphs.run(key, ids, lambda t: "out", lambda a: a, lambda t, a: None)


def test_decode_graphs_instantiate_with_programmatic_edges():
    cuda = FakeGraphCuda(NODES, EDGES)
    graphs = DecodeGraphs("cuda", cuda=cuda, pdl_port=PORT_PROGRAMMATIC)
    _step(graphs)
    (edges,) = cuda.instantiated
    assert {e for e, d in edges.items() if d == PROG} == set(KERNEL_EDGES)
    assert graphs.stats["pdl_edges"] == 3 and graphs.stats["pdl_failures"] == 0
    assert cuda.log[-1] == "instantiate"  # the captured graph stays with it (graphs may move)
    graphs.clear()
    assert cuda.log[-1] == "destroy_graph"
    plain = FakeGraphCuda(NODES, EDGES)
    _step(DecodeGraphs("cuda", cuda=plain))  # no pdl_port: the graph as captured
    assert plain.instantiated == [plain.captured] and "graph_edges" not in plain.log


def test_a_graph_with_a_foreign_kernel_keeps_plain_edges_and_pdl_stays_on():
    # node 4 a library's kernel (cuBLAS in a GEMM-path step): it does not wait, so no edge of
    # its graph turns programmatic; the driver is never asked (it refuses such edits)
    cuda = FakeGraphCuda(NODES, EDGES, fail={"remove_edges"}, foreign={4})
    cuda.end_capture(7)
    assert make_programmatic(cuda, 55, PORT_PROGRAMMATIC) == []
    assert cuda.edges == cuda.captured and "remove_edges" not in cuda.log
    graphs = DecodeGraphs("cuda", cuda=cuda, pdl_port=PORT_PROGRAMMATIC)
    _step(graphs)
    assert cuda.instantiated == [cuda.captured] and graphs.stats["pdl_failures"] == 0
    assert graphs.pdl_port == PORT_PROGRAMMATIC  # later graphs of our kernels only: converted
    cuda.foreign.clear()
    cuda.fail.clear()
    _step(graphs, (1, 2))
    assert {e for e, d in cuda.instantiated[-1].items() if d == PROG} == set(KERNEL_EDGES)


@pytest.mark.parametrize("call", ["graph_nodes", "add_edges"])
def test_pdl_errors_keep_the_plain_graph_and_turn_pdl_off(call: str, caplog):
    cuda = FakeGraphCuda(NODES, EDGES, fail={call})
    graphs = DecodeGraphs("cuda", cuda=cuda, pdl_port=PORT_PROGRAMMATIC)
    _step(graphs, (1, 1))
    _step(graphs, (1, 2))
    assert cuda.instantiated == [cuda.captured] * 2  # both keys captured, plain edges
    assert graphs.stats["captures"] == 2 and graphs.stats["failures"] == 0
    assert graphs.stats["pdl_failures"] == 1 and graphs.pdl_port is None
    assert call in graphs.last_error and "plain edges" in caplog.text


def test_an_instantiation_refusing_programmatic_edges_is_retried_plain():
    cuda = FakeGraphCuda(NODES, EDGES, fail={"instantiate"})
    real = cuda.instantiate

    def once(graph: int) -> int:  # refuses the first (programmatic) graph only
        cuda.fail.discard("instantiate")
        if any(d != DEFAULT_EDGE for d in cuda.edges.values()):
            raise RuntimeError("cudaGraphInstantiate failed: not supported")
        return real(graph)

    cuda.instantiate = once
    graphs = DecodeGraphs("cuda", cuda=cuda, pdl_port=PORT_PROGRAMMATIC)
    _step(graphs)
    assert cuda.instantiated == [cuda.captured] and graphs.stats["captures"] == 1
    assert graphs.pdl_port is None and "instantiating" in graphs.last_error


def test_a_graph_left_broken_is_not_used():
    cuda = FakeGraphCuda(NODES, EDGES, fail={"add_edges", "add_default_edges"})
    graphs = DecodeGraphs("cuda", cuda=cuda, pdl_port=PORT_PROGRAMMATIC)
    assert _step(graphs) == "out"  # the eager result
    assert cuda.instantiated == [] and graphs.stats["failures"] == 1
    assert cuda.log[-1] == "destroy_graph" and graphs.pdl_port is None


def _build(tmp_path, pdl: bool) -> BuildConfig:
    raw = dict(format_version=1, model={}, dtype="float16", device="cuda", target="{}", pdl=pdl)
    (tmp_path / BUILD_CONFIG).write_text(json.dumps(raw))
    return BuildConfig.read(tmp_path)


def test_engine_pdl_option_follows_the_build(tmp_path):
    (tmp_path / "pdl").mkdir()
    pdl, plain = _build(tmp_path / "pdl", True), _build(tmp_path, False)
    assert _pdl_port(pdl, None) == PORT_PROGRAMMATIC
    assert _pdl_port(pdl, "launch-completion") == PORT_LAUNCH_COMPLETION
    assert _pdl_port(pdl, "off") is None
    assert _pdl_port(plain, None) is None and _pdl_port(plain, "off") is None
    with pytest.raises(BuildError, match="compiled with --pdl"):
        _pdl_port(plain, "programmatic")
    with pytest.raises(ValueError, match="use one of"):
        _pdl_port(pdl, "fast")


def test_edge_data_matches_the_cuda_header():
    # driver_types.h: struct cudaGraphEdgeData_st { unsigned char from_port, to_port, type,
    # reserved[5]; }
    assert ctypes.sizeof(EdgeData) == 8
    assert [getattr(EdgeData, f).offset for f in ("from_port", "to_port", "type")] == [0, 1, 2]
    assert bytes(EdgeData(*PROG)) == b"\x01\x00\x01" + bytes(5)


class _FakeLib:
    def __init__(self, runtime: int, driver: int, symbols: list[str]):
        self.versions = {"cudaRuntimeGetVersion": runtime, "cudaDriverGetVersion": driver}
        for name in symbols:
            setattr(self, name, name)

    def __getattr__(self, name: str):
        if name in self.versions:
            return lambda ref: (setattr(ref._obj, "value", self.versions[name]), 0)[1]
        raise AttributeError(name)


@pytest.mark.parametrize(
    ("runtime", "driver", "symbols", "want"),
    [
        (13000, 13000, ["cudaGraphGetEdges"], "cudaGraphGetEdges"),
        (12080, 12080, ["cudaGraphGetEdges", "cudaGraphGetEdges_v2"], "cudaGraphGetEdges_v2"),
        (12020, 12080, ["cudaGraphGetEdges"], "needs CUDA 12.3"),
        (13000, 0, ["cudaGraphGetEdges"], "needs CUDA 12.3"),  # no driver
        (12040, 12040, ["cudaGraphGetEdges"], "cudaGraphGetEdges_v2 not found"),
    ],
)
def test_edge_calls_pick_the_edge_data_abi(runtime, driver, symbols, want):
    cuda = CudaRuntime.__new__(CudaRuntime)
    cuda.lib = _FakeLib(runtime, driver, symbols)
    if want.startswith("cudaGraph") and " " not in want:
        assert cuda._edge_call("cudaGraphGetEdges") == want
    else:
        with pytest.raises(RuntimeError, match=want):
            cuda._edge_call("cudaGraphGetEdges")


def test_real_libcudart_without_a_driver_fails_cleanly():
    try:
        cuda = CudaRuntime()
    except RuntimeError:
        pytest.skip("no libcudart here")
    if (
        cuda.lib.cudaDriverGetVersion(ctypes.byref(version := ctypes.c_int())) == 0
        and version.value
    ):
        pytest.skip("a CUDA driver is present")
    with pytest.raises(RuntimeError, match="cudaGraphGetNodes failed"):
        make_programmatic(cuda, 0, PORT_PROGRAMMATIC)
    with pytest.raises(RuntimeError, match="needs CUDA 12.3"):
        cuda.graph_edges(0)

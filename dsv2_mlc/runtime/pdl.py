"""Programmatic Dependent Launch in a captured CUDA graph: kernel->kernel edges made programmatic.

A stream capture links consecutive kernels with full dependencies: kernel N+1 is launched only
after kernel N has finished and its writes are flushed, a gap of the order of a microsecond per
boundary even inside a graph, a large share of a decode step's few-microsecond kernels
(schedules/results/decode_floor.md). A *programmatic* edge
(``cudaGraphDependencyTypeProgrammatic``) lets N+1 be launched earlier; N+1 must then wait for N
itself before reading N's output, which every kernel of a build compiled with ``--pdl`` does
first thing (``griddepcontrol.wait``, ``passes/grid_dependency_control.py``). Where the edge
fires from is its upstream port:

* ``PORT_PROGRAMMATIC`` (``cudaGraphKernelNodePortProgrammatic``): when every block of N has
  exited or executed ``griddepcontrol.launch_dependents`` (the hand kernels do, right after
  their wait; TVM's kernels at their exit). Without that, N+1's launch
  overlaps N's drain and memory flush only.
* ``PORT_LAUNCH_COMPLETION`` (``cudaGraphKernelNodePortLaunchCompletion``): when every block of
  N has started. N+1's blocks may then occupy SM slots while they wait, and so on down the chain.

A graph holding a *foreign* kernel (one a library launched through its own launch path, whose
node shows no argument array: cuBLAS's GEMMs in ``batch_decode_gemm``'s steps) keeps all its
edges plain: such a kernel does not wait for its predecessors, and the driver refuses to edit
edges around it (``cudaGraphRemoveDependencies``: operation not supported, seen on the H200).

Only edges between two kernel nodes are converted; edges to or from copies and memsets stay full
dependencies (those nodes have no wait), e.g. the pinned-memory copies that open and close a
greedy decode graph (``runtime/cuda_graph.py``). The wait blocks until the upstream grid has
*completed* and its memory is visible, so with every kernel waiting first, each kernel still runs
after all its predecessors, transitively. A build without ``--pdl`` must never get programmatic
edges: its kernels would race their predecessors.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import Dsv2Error

__all__ = [
    "BrokenGraphError",
    "PORT_LAUNCH_COMPLETION",
    "PORT_PROGRAMMATIC",
    "PORTS",
    "make_programmatic",
    "programmatic_edges",
    "restore_default",
]

NODE_KERNEL = 0  # cudaGraphNodeTypeKernel
DEFAULT_EDGE = (0, 0, 0)  # cudaGraphEdgeData (from_port, to_port, type), zero: full dependency
PORT_PROGRAMMATIC = 1  # cudaGraphKernelNodePortProgrammatic
PORT_LAUNCH_COMPLETION = 2  # cudaGraphKernelNodePortLaunchCompletion
DEPENDENCY_PROGRAMMATIC = 1  # cudaGraphDependencyTypeProgrammatic
PORTS = {"programmatic": PORT_PROGRAMMATIC, "launch-completion": PORT_LAUNCH_COMPLETION}

Edge = tuple[int, int, tuple[int, int, int]]


class GraphTopology(Protocol):
    """The graph calls this module needs (:class:`~dsv2_mlc.runtime.cudart.CudaRuntime`)."""

    def graph_nodes(self, graph: int) -> list[int]: ...

    def node_type(self, node: int) -> int: ...

    def foreign_kernel(self, node: int) -> bool: ...

    def graph_edges(self, graph: int) -> list[Edge]: ...

    def remove_edges(self, graph: int, edges: list[tuple[int, int]], data: tuple) -> None: ...

    def add_edges(self, graph: int, edges: list[tuple[int, int]], data: tuple) -> None: ...


def programmatic_edges(kinds: dict[int, int], edges: list[Edge]) -> list[tuple[int, int]]:
    """The edges (from, to) to convert: plain full dependencies between two kernel nodes.

    ``kinds`` maps every node to its ``cudaGraphNodeType``. Edges that already carry edge data,
    and edges with a non-kernel end (memcpy, memset, host, event nodes), are left alone."""
    return [
        (src, dst)
        for src, dst, data in edges
        if tuple(data) == DEFAULT_EDGE
        and kinds.get(src) == NODE_KERNEL
        and kinds.get(dst) == NODE_KERNEL
    ]


def _programmatic_data(port: int) -> tuple[int, int, int]:
    if port not in PORTS.values():
        raise ValueError(f"unknown kernel node port {port}; use one of {PORTS}")
    return (port, 0, DEPENDENCY_PROGRAMMATIC)


class BrokenGraphError(Dsv2Error, RuntimeError):
    """A graph whose edges could not be put back as captured: it must not be instantiated."""


def make_programmatic(cuda: GraphTopology, graph: int, port: int) -> list[tuple[int, int]]:
    """Convert every kernel->kernel edge of the (not yet instantiated) ``graph`` into a
    programmatic edge from ``port``; the converted edges (none where ``graph`` holds a foreign
    kernel: module docstring).

    On an error the converted edges are put back as plain ones (checked against the graph) and
    the error is raised; :class:`BrokenGraphError` if they could not be."""
    data = _programmatic_data(port)
    kinds = {node: cuda.node_type(node) for node in cuda.graph_nodes(graph)}
    if any(kind == NODE_KERNEL and cuda.foreign_kernel(n) for n, kind in kinds.items()):
        return []
    edges = programmatic_edges(kinds, cuda.graph_edges(graph))
    if not edges:
        return []
    try:
        cuda.remove_edges(graph, edges, DEFAULT_EDGE)
        cuda.add_edges(graph, edges, data)
    except Exception:
        _reset(cuda, graph, edges, data)
        raise
    return edges


def restore_default(
    cuda: GraphTopology, graph: int, edges: list[tuple[int, int]], port: int
) -> None:
    """Undo :func:`make_programmatic`: ``edges`` become plain full dependencies again
    (:class:`BrokenGraphError` if they could not)."""
    _reset(cuda, graph, edges, _programmatic_data(port))


def _reset(
    cuda: GraphTopology, graph: int, edges: list[tuple[int, int]], data: tuple[int, int, int]
) -> None:
    """Make each of ``edges`` a plain edge again, whatever a failed conversion left (the edge
    with ``data``, a plain one, or none), and check the result."""
    wanted = set(edges)
    try:
        now = {(src, dst): tuple(d) for src, dst, d in cuda.graph_edges(graph)}
        converted = [e for e in edges if now.get(e) == data]
        if converted:
            cuda.remove_edges(graph, converted, data)
        missing = [e for e in edges if now.get(e) != DEFAULT_EDGE]
        if missing:
            cuda.add_edges(graph, missing, DEFAULT_EDGE)
        now = {(src, dst): tuple(d) for src, dst, d in cuda.graph_edges(graph)}
        ok = all(now.get(e) == DEFAULT_EDGE for e in wanted)
    except Exception as err:
        raise BrokenGraphError(f"graph edges not restored: {err}") from err
    if not ok:
        raise BrokenGraphError("graph edges not restored")

"""Decode CUDA graphs: the graph key and the capture / replay / fallback bookkeeping; greedy
graphs' ids and tokens through pinned host memory, against a simulated CUDA runtime that runs
the captured copies and kernels asynchronously (so a missing synchronize or a late write shows).

The GPU side (graph replays equal eager steps bit for bit, over page boundaries, popn, forks and
batch 2) is ``scripts/gpu_graph_check.py``, run on the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
import tvm_ffi

from dsv2_mlc.runtime import cuda_graph
from dsv2_mlc.runtime.cuda_graph import DecodeGraphs, decode_graph_key
from dsv2_mlc.runtime.cudart import MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, CudaRuntime
from dsv2_mlc.runtime.pdl import DEFAULT_EDGE, PORT_PROGRAMMATIC


def test_graph_key_counts_pages_in_units_of_four():
    # 16-token pages; lengths include the token being appended.
    assert decode_graph_key(16, [1]) == (1, 1)
    assert decode_graph_key(16, [64]) == (1, 1)  # 4 pages
    assert decode_graph_key(16, [65]) == (1, 2)  # 5 pages
    assert decode_graph_key(16, [513, 17]) == (2, 9)  # 33 + 2 pages
    keys = {decode_graph_key(16, [n]) for n in range(500, 800)}
    assert keys == {(1, b) for b in range(8, 14)}  # pages 32..50


class FakeCuda:
    """Records what DecodeGraphs asks of the CUDA runtime; ``fail_capture`` breaks captures."""

    def __init__(self, fail_capture: bool = False):
        self.fail_capture = fail_capture
        self.log: list[tuple] = []
        self.capturing = False
        self._next = 100

    def create_stream(self) -> int:
        return 7

    def begin_capture(self, stream: int) -> None:
        self.capturing = True
        self.log.append(("begin", stream))

    def end_capture(self, stream: int) -> int:
        self.capturing = False
        self.log.append(("end", stream))
        if self.fail_capture:
            raise RuntimeError("cudaStreamEndCapture failed: operation not permitted")
        self._next += 1
        return self._next

    def instantiate(self, graph: int) -> int:
        return graph + 1000

    def destroy_graph(self, graph: int) -> None:
        self.log.append(("destroy_graph", graph))

    def launch(self, exe: int, stream: int) -> None:
        self.log.append(("launch", exe, stream))

    def destroy(self, exe: int) -> None:
        self.log.append(("destroy", exe))

    def clear_error(self) -> None:
        self.log.append(("clear",))


def _run(graphs: DecodeGraphs, cuda: FakeCuda, key: tuple, token: int, calls: list):
    def call(ids_t):
        calls.append(("capture" if cuda.capturing else "eager", int(ids_t[0, 0])))
        return ("out", cuda.capturing)

    written = []
    out = graphs.run(
        key, np.array([[token]], np.int32), call, lambda a: a.copy(),
        lambda t, a: (written.append(int(a[0, 0])), t.__setitem__(..., a)),
    )  # fmt: skip
    return out, written


def test_capture_once_per_key_then_replay():
    cuda, calls = FakeCuda(), []
    graphs = DecodeGraphs("cuda", capacity=2, cuda=cuda)
    out, _ = _run(graphs, cuda, (1, 9), 5, calls)
    assert out == ("out", False)  # the step's own (eager) result
    assert calls == [("eager", 5), ("capture", 5)]
    out, written = _run(graphs, cuda, (1, 9), 6, calls)
    assert out == ("out", True) and written == [6]  # the captured outputs, new ids copied in
    assert cuda.log[-1] == ("launch", 1101, 7) and len(calls) == 2
    # the captured graph stays while its executable lives (its nodes are how graphs move)
    assert ("destroy_graph", 101) not in cuda.log
    _run(graphs, cuda, (1, 10), 7, calls)
    _run(graphs, cuda, (1, 11), 8, calls)  # third key: the least recently used one goes
    assert ("destroy", 1101) in cuda.log and ("destroy_graph", 101) in cuda.log
    assert graphs.stats["captures"] == 3 and graphs.stats["replays"] == 1


def test_graphs_that_never_move_free_their_capture_once_instantiated():
    cuda, calls = FakeCuda(), []
    graphs = DecodeGraphs("cuda", cuda=cuda, relocate=False)
    _run(graphs, cuda, (1, 9), 5, calls)
    assert ("destroy_graph", 101) in cuda.log


def test_failed_capture_keeps_eager_result_and_is_not_retried():
    cuda, calls = FakeCuda(fail_capture=True), []
    graphs = DecodeGraphs("cuda", cuda=cuda)
    out, _ = _run(graphs, cuda, (1, 3), 5, calls)
    assert out == ("out", False) and graphs.stats["failures"] == 1
    assert "not permitted" in graphs.last_error
    out, _ = _run(graphs, cuda, (1, 3), 6, calls)
    assert out == ("out", False) and calls[-1] == ("eager", 6)
    assert [c for c in calls if c[0] == "capture"] == [("capture", 5)]


def test_capture_error_inside_the_call_ends_the_capture():
    cuda = FakeCuda()
    graphs = DecodeGraphs("cuda", cuda=cuda)
    state = {"n": 0}

    def call(_ids):
        state["n"] += 1
        if cuda.capturing:
            raise RuntimeError("kernel launch failed during capture")
        return "eager"

    ids = np.zeros((1, 1), np.int32)
    assert graphs.run((1, 1), ids, call, lambda a: a, lambda t, a: None) == "eager"
    assert ("end", 7) in cuda.log and not cuda.capturing and graphs.stats["failures"] == 1
    with pytest.raises(RuntimeError):  # an eager failure is the caller's error, not swallowed
        graphs.run((1, 2), ids, lambda _i: (_ for _ in ()).throw(RuntimeError("bad")),
                   lambda a: a, lambda t, a: None)  # fmt: skip


def _checked_graphs(same):
    """DecodeGraphs over FakeCuda, with a ``run()`` for one key checked by ``same``."""
    cuda, calls = FakeCuda(), []
    graphs = DecodeGraphs("cuda", cuda=cuda)
    ids = np.zeros((1, 1), np.int32)

    def call(ids_t):
        calls.append("capture" if cuda.capturing else "eager")
        return "captured" if cuda.capturing else "eager-out"

    def run():
        return graphs.run((1, 5), ids, call, lambda a: a.copy(), lambda t, a: None, same)

    return graphs, cuda, calls, run


def test_first_replay_is_checked_against_an_eager_step():
    graphs, _, calls, run = _checked_graphs(lambda a, b: True)
    run()  # eager + capture
    assert run() == "captured"  # first replay: checked, equal
    assert calls == ["eager", "capture", "eager"]
    assert run() == "captured" and len(calls) == 3  # verified: no more checks
    assert graphs.stats["mismatches"] == 0


def test_a_replay_that_differs_falls_back_to_eager_for_that_key():
    graphs, cuda, calls, run = _checked_graphs(lambda a, b: a == b)
    run()
    assert run() == "eager-out"  # replay "captured" != eager "eager-out": the eager result
    assert graphs.stats["mismatches"] == 1 and "differs" in graphs.last_error
    assert ("destroy", 1101) in cuda.log
    n = len(calls)
    assert run() == "eager-out" and calls[n:] == ["eager"]  # key stays eager, no recapture


# -- greedy graphs: ids in and tokens out through pinned host memory ------------------------------

STREAM = 7
KERNEL, MEMCPY = 0, 1  # cudaGraphNodeType
H2D, D2H = MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST


class SimCuda:
    """A CUDA runtime that runs what DecodeGraphs captures, on the host with real memory.

    A capture records ops: copies (``memcpy_async``, moving real bytes) and kernels (Python
    callables the model registers with :meth:`kernel`). Like a GPU, a replay is asynchronous:
    ``launch`` takes the host sources of host->device copies as they are then (the device may
    read them any time after the launch) and everything else runs at ``synchronize``, so ids
    written after the launch or tokens read before the synchronize are stale. Pinned memory is
    real; copies check that their host end is live pinned memory, and freeing it while a replay
    is pending fails. ``lose_d2h`` drops the device->host copies (a broken copy node);
    ``fail`` names calls that raise (``"host_alloc"``: the second allocation)."""

    def __init__(self, fail=(), lose_d2h: bool = False):
        self.fail = set(fail)
        self.lose_d2h = lose_d2h
        self.capturing = False
        self.ops: list[tuple] = []  # of the capture under way
        self.graphs: dict[int, list[tuple]] = {}
        self.edges: dict[int, dict[tuple[int, int], tuple]] = {}
        self.execs: dict[int, list[tuple]] = {}
        self.instantiated: list[dict] = []  # the edges of every instantiated graph
        self.pending: list[tuple] = []
        self.pinned: dict[int, np.ndarray] = {}
        self.freed: dict[int, np.ndarray] = {}  # kept alive: a stray copy fails a check, not us
        self.log: list[tuple] = []
        self._next = 100

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise RuntimeError(f"{name} failed: simulated (cudaError 999)")

    def _is_pinned(self, ptr: int, n: int) -> bool:
        return any(a <= ptr and ptr + n <= a + b.nbytes for a, b in self.pinned.items())

    # DecodeGraphs' calls
    def create_stream(self) -> int:
        return STREAM

    def begin_capture(self, stream: int) -> None:
        assert stream == STREAM and not self.capturing
        self.capturing, self.ops = True, []

    def end_capture(self, stream: int) -> int:
        self.capturing = False
        self._maybe_fail("end_capture")
        self._next += 1
        g = self._next
        self.graphs[g] = self.ops
        chain = range(100 * g, 100 * g + len(self.ops) - 1)  # node ids: 100 * graph + op index
        self.edges[g] = {(n, n + 1): DEFAULT_EDGE for n in chain}
        return g

    def instantiate(self, graph: int) -> int:
        self._maybe_fail("instantiate")
        self.instantiated.append(dict(self.edges[graph]))
        self.execs[graph + 1000] = list(self.graphs[graph])
        return graph + 1000

    def destroy_graph(self, graph: int) -> None:
        del self.graphs[graph]

    def launch(self, exe: int, stream: int) -> None:
        assert stream == STREAM
        self.log.append(("launch", exe))
        for op in self.execs[exe]:
            if op[0] == "memcpy" and op[4] == H2D:
                _, dst, src, n, _ = op
                assert self._is_pinned(src, n), "host->device copy from memory not pinned"
                op = ("h2d", dst, ctypes.string_at(src, n))
            self.pending.append(op)

    def synchronize(self, stream: int) -> None:
        assert stream == STREAM
        self.log.append(("sync",))
        for op in self.pending:
            if op[0] == "h2d":
                ctypes.memmove(op[1], op[2], len(op[2]))
            elif op[0] == "kernel":
                op[1]()
            elif not self.lose_d2h:
                _, dst, src, n, _ = op
                assert self._is_pinned(dst, n), "device->host copy to memory not pinned"
                ctypes.memmove(dst, src, n)
        self.pending = []

    def destroy(self, exe: int) -> None:
        del self.execs[exe]
        self.log.append(("destroy", exe))

    def clear_error(self) -> None:
        pass

    def host_alloc(self, nbytes: int) -> int:
        if len(self.pinned) % 2:
            self._maybe_fail("host_alloc")
        buf = np.zeros(nbytes, np.uint8)
        self.pinned[buf.ctypes.data] = buf
        self.log.append(("host_alloc", nbytes))
        return buf.ctypes.data

    def free_host(self, ptr: int) -> None:
        assert not self.pending, "pinned memory freed while a replay may still use it"
        self.freed[ptr] = self.pinned.pop(ptr)
        self.log.append(("free_host", ptr))

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        assert self.capturing and stream == STREAM, "a copy outside the graph's capture"
        self.ops.append(("memcpy", dst, src, nbytes, kind))

    # the model's kernels
    def kernel(self, fn) -> None:
        if self.capturing:
            self.ops.append(("kernel", fn))
        else:
            fn()

    # topology (programmatic edges)
    def graph_nodes(self, graph: int) -> list[int]:
        return [100 * graph + i for i in range(len(self.graphs[graph]))]

    def node_type(self, node: int) -> int:
        return KERNEL if self.graphs[node // 100][node % 100][0] == "kernel" else MEMCPY

    def foreign_kernel(self, node: int) -> bool:  # every simulated kernel is the build's own
        return False

    def graph_edges(self, graph: int) -> list:
        return [(a, b, d) for (a, b), d in self.edges[graph].items()]

    def remove_edges(self, graph: int, edges: list, data: tuple) -> None:
        assert all(self.edges[graph][e] == tuple(data) for e in edges)
        for e in edges:
            del self.edges[graph][e]

    def add_edges(self, graph: int, edges: list, data: tuple) -> None:
        assert not any(e in self.edges[graph] for e in edges)
        self.edges[graph].update({e: tuple(data) for e in edges})


def _model(sim: SimCuda, calls: list, kernels: int = 1, graph_offset: int = 0):
    """A greedy decode call: logits ``[b, 1, 4]`` and tokens ``3 * id + 1`` (int32 ``[b]``),
    computed by ``kernels`` sim kernels into fresh outputs; captured ones add
    ``graph_offset`` to the tokens (a graph that does not replay the eager step)."""

    def call(ids_t):
        ids = np.from_dlpack(ids_t)  # the input's memory: what the ids copy writes
        logits = np.zeros((ids.shape[0], 1, 4), np.float32)
        tokens = np.zeros(ids.shape[0], np.int32)
        offset = graph_offset if sim.capturing else 0
        calls.append("capture" if sim.capturing else "eager")

        def first():
            logits[...] = 2.0 * ids[:, :, None]

        def last():
            tokens[...] = 3 * ids[:, 0] + 1 + offset

        if kernels == 1:
            sim.kernel(lambda: (first(), last()))
        else:
            sim.kernel(first)
            for _ in range(kernels - 2):
                sim.kernel(lambda: None)
            sim.kernel(last)
        return tvm_ffi.from_dlpack(logits), tvm_ffi.from_dlpack(tokens)

    return call


def _same(a, b) -> bool:
    pairs = zip(a, b, strict=True)
    return all(np.array_equal(np.from_dlpack(x), np.from_dlpack(y)) for x, y in pairs)


class _Greedy:
    """``run_greedy`` for one key over a SimCuda, counting the host<->device copies made
    outside the graphs (uploads through ``to_device``, reads through ``to_numpy``)."""

    def __init__(self, monkeypatch, sim=None, key=(2, 3, "greedy"), same=None, **model):
        self.sim = sim or SimCuda()
        self.graphs = DecodeGraphs("cuda", capacity=model.pop("capacity", 16), cuda=self.sim,
                                   pdl_port=model.pop("pdl_port", None))  # fmt: skip
        self.calls: list[str] = []
        self.call = _model(self.sim, self.calls, **model)
        self.key, self.same = key, same
        self.uploads, self.reads = 0, 0
        real = cuda_graph.to_numpy

        def counted(t):
            self.reads += 1
            return real(t)

        monkeypatch.setattr(cuda_graph, "to_numpy", counted)

    def _upload(self, a: np.ndarray):
        self.uploads += 1
        return tvm_ffi.from_dlpack(np.ascontiguousarray(a).copy())

    def __call__(self, *ids: int, key=None) -> np.ndarray:
        col = np.array(ids, np.int32).reshape(-1, 1)
        return self.graphs.run_greedy(key or self.key, col, self.call, self._upload, self.same)


def test_greedy_replays_copy_ids_in_and_tokens_out_through_pinned_memory(monkeypatch):
    step = _Greedy(monkeypatch)
    sim, graphs = step.sim, step.graphs
    first = step(5, 9)
    assert first.dtype == np.int64 and first.tolist() == [16, 28]  # the eager step's tokens
    assert step.calls == ["eager", "capture"] and (step.uploads, step.reads) == (1, 1)
    assert [e for e in sim.log if e[0] == "host_alloc"] == [("host_alloc", 8)] * 2
    (graph,) = graphs._graphs.values()
    (ops,) = sim.execs.values()
    assert [op[0] for op in ops] == ["memcpy", "kernel", "memcpy"]
    pinned_ids, pinned_tokens = graph.pinned.ids.ctypes.data, graph.pinned.tokens.ctypes.data
    assert ops[0][1:] == (graph.ids.data_ptr(), pinned_ids, 8, H2D)  # ids: pinned -> input
    assert ops[2][1:] == (pinned_tokens, graph.out[1].data_ptr(), 8, D2H)  # tokens -> pinned
    got = [step(1, 2), step(7, 4), step(0, 11), step(7, 4)]
    assert [g.tolist() for g in got] == [[4, 7], [22, 13], [1, 34], [22, 13]]
    assert all(g.dtype == np.int64 for g in got)  # each a copy, not the next step's buffer
    assert step.calls == ["eager", "capture"] and (step.uploads, step.reads) == (1, 1)
    replays = [e[0] for e in sim.log if e[0] in ("launch", "sync")]
    assert replays == ["launch", "sync"] * 4  # each step waits for its graph
    assert graphs.stats["replays"] == graphs.stats["greedy_replays"] == 4
    assert graphs.stats["captures"] == 1 and not sim.freed


def test_greedy_first_replay_is_checked_then_trusted(monkeypatch):
    step = _Greedy(monkeypatch, same=_same)
    step(5, 9)
    assert step(1, 2).tolist() == [4, 7]
    assert step.calls == ["eager", "capture", "eager"]  # the check: an eager run of that step
    assert step(3, 3).tolist() == [10, 10] and len(step.calls) == 3
    assert step.graphs.stats["mismatches"] == 0 and step.reads == 2  # eager, eager check


@pytest.mark.parametrize("broken", ["graph", "copy"])
def test_a_greedy_replay_that_differs_falls_back_to_eager(monkeypatch, broken: str):
    # "graph": the captured kernels compute other tokens (a wrong key); "copy": the graph's
    # tokens are right on the device but never reach the pinned buffer
    sim = SimCuda(lose_d2h=broken == "copy")
    step = _Greedy(monkeypatch, sim=sim, same=_same, graph_offset=100 if broken == "graph" else 0)
    step(5, 9)
    assert step(1, 2).tolist() == [4, 7]  # the eager step's tokens
    graphs = step.graphs
    assert graphs.stats["mismatches"] == 1 and "differs" in graphs.last_error
    assert not graphs._graphs and not sim.execs and not sim.pinned and len(sim.freed) == 2
    assert step(3, 3).tolist() == [10, 10] and step.calls[-2:] == ["eager", "eager"]
    assert graphs.stats["captures"] == 1 and len(sim.freed) == 2  # the key stays eager


def test_pinned_buffers_are_freed_with_their_graphs_never_while_one_runs(monkeypatch):
    step = _Greedy(monkeypatch, capacity=1)
    sim, graphs = step.sim, step.graphs
    step(5, 9, key=(2, 1, "greedy"))
    first = set(sim.pinned)
    step(5, 9, key=(2, 2, "greedy"))  # evicts the first graph: its two buffers go
    assert set(sim.freed) == first and len(sim.pinned) == 2
    assert step(1, 2, key=(2, 2, "greedy")).tolist() == [4, 7]
    (graph,) = graphs._graphs.values()
    sim.launch(graph.exe, STREAM)  # a replay still in flight: clear() must wait for it
    graphs.clear()
    assert not sim.pinned and not sim.execs and len(sim.freed) == 4
    assert sim.log[-4:-2] == [("destroy", graph.exe), ("sync",)]
    step(5, 9, key=(2, 2, "greedy"))  # cleared: captured again
    graphs.close()
    assert not sim.pinned and len(sim.freed) == 6
    step(5, 9, key=(2, 2, "greedy"))
    assert len(sim.pinned) == 2
    del step.graphs, graphs, graph
    gc.collect()
    assert not sim.pinned and not sim.execs and len(sim.freed) == 8


@pytest.mark.parametrize("fail", ["end_capture", "instantiate", "host_alloc", "tokens"])
def test_a_failed_greedy_capture_frees_its_buffers_and_stays_eager(monkeypatch, fail: str):
    sim = SimCuda(fail={fail})
    step = _Greedy(monkeypatch, sim=sim)
    if fail == "tokens":  # the captured call returns tokens unlike the eager step's

        def call(ids_t, _real=step.call):
            logits, tokens = _real(ids_t)
            return logits, (tvm_ffi.from_dlpack(np.zeros(5, np.int64)) if sim.capturing else tokens)

        step.call = call
    assert step(5, 9).tolist() == [16, 28]
    graphs = step.graphs
    assert graphs.stats["failures"] == 1 and not graphs._graphs and not sim.pinned
    assert ("tokens" if fail == "tokens" else fail) in graphs.last_error
    assert len(sim.freed) == (1 if fail == "host_alloc" else 2)
    assert step(1, 2).tolist() == [4, 7] and step.calls[-1] == "eager"
    assert step.calls.count("capture") == (0 if fail == "host_alloc" else 1)


def test_logits_graphs_use_no_pinned_memory(monkeypatch):
    sim, calls = SimCuda(), []
    graphs = DecodeGraphs("cuda", cuda=sim)
    greedy = _model(sim, calls)

    def call(ids_t):
        return greedy(ids_t)[0]

    def write(t, a):
        np.from_dlpack(t)[...] = a

    def same(a, b):  # as the runtime's copies on the legacy stream, wait for the graph
        sim.synchronize(STREAM)
        return np.array_equal(np.from_dlpack(a), np.from_dlpack(b))

    ids = np.array([[5]], np.int32)
    for _ in range(2):
        graphs.run((1, 1), ids, call, lambda a: tvm_ffi.from_dlpack(a.copy()), write, same)
    assert calls == ["eager", "capture", "eager"] and not sim.pinned and not sim.freed
    assert [op[0] for op in next(iter(sim.execs.values()))] == ["kernel"]
    with pytest.raises(ValueError, match="holds a logits graph"):
        graphs.run_greedy((1, 1), ids, greedy, lambda a: tvm_ffi.from_dlpack(a.copy()))


def test_programmatic_edges_leave_the_pinned_copies_alone(monkeypatch):
    step = _Greedy(monkeypatch, pdl_port=PORT_PROGRAMMATIC, kernels=3)
    step(5, 9)
    (edges,) = step.sim.instantiated
    kinds = [d for _, d in sorted(edges.items())]
    prog = (PORT_PROGRAMMATIC, 0, 1)
    # memcpy(ids) -> k -> k -> k -> memcpy(tokens): only the kernel->kernel edges change
    assert kinds == [DEFAULT_EDGE, prog, prog, DEFAULT_EDGE]
    assert step.graphs.stats["pdl_edges"] == 2 and step.graphs.stats["pdl_failures"] == 0
    assert step(1, 2).tolist() == [4, 7] and step.calls == ["eager", "capture"]


class _MemLib:
    """libcudart stand-in recording the pinned memory and copy calls' arguments."""

    def __init__(self, err: int = 0):
        self.err, self.calls = err, []

    def cudaHostAlloc(self, ref, size, flags):
        ref._obj.value = 0x7000
        self.calls.append(("cudaHostAlloc", size.value, flags.value))
        return self.err

    def cudaFreeHost(self, ptr):
        self.calls.append(("cudaFreeHost", ptr.value))
        return self.err

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        args = (dst.value, src.value, n.value, kind.value, stream.value)
        self.calls.append(("cudaMemcpyAsync", *args))
        return self.err

    def cudaGetErrorString(self, err):
        return b"out of memory"


def test_cudart_pinned_memory_and_copy_calls():
    cuda = CudaRuntime.__new__(CudaRuntime)
    cuda.lib = _MemLib()
    assert cuda.host_alloc(8) == 0x7000
    cuda.memcpy_async(0xD000, 0x7000, 8, MEMCPY_HOST_TO_DEVICE, 7)
    cuda.memcpy_async(0x7000, 0xD000, 8, MEMCPY_DEVICE_TO_HOST, 7)
    cuda.free_host(0x7000)
    assert cuda.lib.calls == [
        ("cudaHostAlloc", 8, 0),  # cudaHostAllocDefault
        ("cudaMemcpyAsync", 0xD000, 0x7000, 8, 1, 7),  # dst, src, count, kind, stream
        ("cudaMemcpyAsync", 0x7000, 0xD000, 8, 2, 7),
        ("cudaFreeHost", 0x7000),
    ]
    cuda.lib = _MemLib(err=2)
    with pytest.raises(RuntimeError, match="cudaHostAlloc failed: out of memory"):
        cuda.host_alloc(8)
    with pytest.raises(RuntimeError, match="cudaMemcpyAsync failed"):
        cuda.memcpy_async(0xD000, 0x7000, 8, MEMCPY_HOST_TO_DEVICE, 7)


def test_a_verified_greedy_graph_is_launched_without_waiting(monkeypatch):
    step = _Greedy(monkeypatch, same=_same)
    sim, graphs, key = step.sim, step.graphs, step.key
    col = np.array([[1], [2]], np.int32)
    assert graphs.launch_greedy(key, col) is None and key not in graphs._graphs  # none yet
    step(5, 9)
    assert graphs.launch_greedy(key, col) is None  # captured, not yet checked
    assert step(1, 2).tolist() == [4, 7] and graphs._graphs[key].verified
    n_log = len(sim.log)
    graph = graphs.launch_greedy(key, col + 6)
    assert graph is not None and sim.log[n_log:] == [("launch", graph.exe)]  # no wait
    assert graph.pinned.tokens.tolist() == [4, 7]  # the device has not written them yet
    tokens = graphs.wait_greedy(graph)
    assert tokens.dtype == np.int64 and tokens.tolist() == [22, 25]
    assert sim.log[-1] == ("sync",) and graphs.stats["greedy_replays"] == 2
    assert len(step.calls) == 3  # eager, capture, the first replay's check: nothing since
    with pytest.raises(ValueError, match="ids of shape"):
        graphs.launch_greedy(key, np.zeros((3, 1), np.int32))


def test_after_two_checked_keys_new_keys_are_captured_without_an_eager_step(monkeypatch):
    step = _Greedy(monkeypatch, same=_same)
    graphs = step.graphs
    for key in [(2, 3, "greedy"), (2, 4, "greedy")]:  # eager, capture, eager check: each
        step(5, 9, key=key)
        assert step(1, 2, key=key).tolist() == [4, 7]
    assert step.calls == ["eager", "capture", "eager"] * 2 and graphs._verified == 2
    n = len(step.calls)
    assert step(6, 1, key=(2, 5, "greedy")).tolist() == [19, 4]  # the replay's tokens
    assert step.calls[n:] == ["capture"]  # no eager run, no check
    assert step(0, 3, key=(2, 5, "greedy")).tolist() == [1, 10] and len(step.calls) == n + 1
    assert step(2, 2, key=(3, 5, "greedy")).tolist() == [7, 7]  # ids of another batch: eager
    assert step.calls[n + 1 :] == ["eager", "capture"]


def test_trusted_keys_whose_graphs_cannot_move_capture_on_a_second_step(monkeypatch):
    """Where a group's graphs do not move, a trusted key that differs from its group's last step
    runs eagerly (one decision a step: no capture after the eager run either); a key that stays
    for a second step is captured then."""
    step = _Greedy(monkeypatch, same=_same)
    graphs = step.graphs
    for key in [(2, 3, "greedy"), (2, 4, "greedy")]:
        step(5, 9, key=key)
        step(1, 2, key=key)
    assert graphs._verified == 2
    graphs._moves[(2, "greedy")] = None  # as after a failed derive: captured per bucket
    n = len(step.calls)
    for bucket in (5, 6, 7):  # a new key every step (mixed lengths)
        assert step(6, 1, key=(2, bucket, "greedy")).tolist() == [19, 4]
    assert step.calls[n:] == ["eager"] * 3 and graphs.stats["eager_unseen"] == 3
    assert step(6, 1, key=(2, 7, "greedy")).tolist() == [19, 4]  # stays: captured, replayed
    assert step.calls[n + 3 :] == ["capture"] and (2, 7, "greedy") in graphs._graphs


def test_trust_needs_a_clean_record_and_a_capture_that_works(monkeypatch):
    sim = SimCuda()
    step = _Greedy(monkeypatch, sim=sim, same=_same)
    step.graphs.trust_after = 1
    step(5, 9)
    step(1, 2)  # verified
    sim.fail = {"end_capture"}
    assert step(4, 4, key=(2, 9, "greedy")).tolist() == [13, 13]  # the capture fails: eager
    assert step.calls[-2:] == ["capture", "eager"] and (2, 9, "greedy") in step.graphs._failed
    sim.fail = set()
    step.graphs.stats["mismatches"] = 1  # a key once failed its check: no trust from then on
    step(4, 4, key=(2, 10, "greedy"))
    assert step.calls[-2:] == ["eager", "capture"]


def test_trusted_logits_graphs_are_captured_and_replayed_in_one_step(monkeypatch):
    step = _Greedy(monkeypatch, same=_same)
    graphs, sim = step.graphs, step.sim

    def same(a, b) -> bool:  # the host copy of a replay's logits waits for it (to_numpy)
        sim.synchronize(STREAM)
        return _same(a, b)

    def run(key: tuple, *ids: int):
        col = np.array(ids, np.int32).reshape(-1, 1)
        out = graphs.run(
            key, col, step.call, step._upload, lambda t, a: np.copyto(np.from_dlpack(t), a), same
        )
        sim.synchronize(STREAM)  # (the caller's copy to the host waits for the replay)
        return np.from_dlpack(out[0])[:, 0, 0].tolist()

    for key in [(2, 3), (2, 4)]:
        run(key, 5, 9)
        assert run(key, 1, 2) == [2.0, 4.0]
    n = len(step.calls)
    assert run((2, 5), 6, 1) == [12.0, 2.0] and step.calls[n:] == ["capture"]

"""Decode CUDA graphs: the graph key and the capture / replay / fallback bookkeeping.

The GPU side (graph replays equal eager steps bit for bit, over page boundaries, popn, forks and
batch 2) is ``scripts/gpu_graph_check.py``, run on the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np
import pytest

from dsv2_mlc.runtime.cuda_graph import DecodeGraphs, decode_graph_key


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
    assert ("destroy_graph", 101) in cuda.log  # the graph itself, once instantiated
    _run(graphs, cuda, (1, 10), 7, calls)
    _run(graphs, cuda, (1, 11), 8, calls)  # third key: the least recently used one goes
    assert ("destroy", 1101) in cuda.log
    assert graphs.stats["captures"] == 3 and graphs.stats["replays"] == 1


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

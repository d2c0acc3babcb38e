"""Decode graphs moved between page buckets (``runtime/graph_relocation.py``): what ``derive``
learns from two captures and refuses, and DecodeGraphs replaying moved graphs over a simulated
CUDA runtime whose kernels read a page-table-like buffer through pointer arguments.

On the GPU, ``scripts/gpu_graph_check.py`` compares every replay, moved ones included, with an
eager engine (docs/benchmarks.md)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import tvm_ffi
from test_cuda_graph import KERNEL, MEMCPY, STREAM, SimCuda, _same

from dsv2_mlc.runtime.cuda_graph import DecodeGraphs
from dsv2_mlc.runtime.graph_relocation import Capture, Node, NotRelocatable, derive, owner


def _b(*values: int, size: int = 8) -> tuple[bytes, ...]:
    return tuple((v % (1 << (8 * size))).to_bytes(size, "little") for v in values)


AUX, WEIGHTS = 0x7000_0000, 0x5000_0000
OWN = {9: [(0x1000, 64), (0x2000, 256)], 10: [(0x3000, 64), (0x4000, 256)],
       12: [(0x8000, 64), (0x9000, 256)]}  # fmt: skip
POOL = {9: 0x6000_0000, 10: 0x6004_0000, 12: 0x6001_0000}  # blocks a capture's pool handed out


def _nodes(bucket: int) -> list[Node]:
    """A step's nodes at ``bucket``: a kernel reading the ids (owned), the weights, the cache's
    buffer at an element offset of 4 a bucket, and a pool block of its capture; one writing the
    logits (owned) with a pointer 16 bytes a bucket into the cache's buffer; a copy of the
    logits to pinned memory (owned, both ends)."""
    ids, out = OWN[bucket][0][0], OWN[bucket][1][0]
    return [
        Node(KERNEL, (11, 1, 1, 1, 256, 1, 1, 0),
             _b(ids, WEIGHTS, AUX) + _b(4 * bucket, size=4) + _b(POOL[bucket])),
        Node(KERNEL, (12, 8, 1, 1, 128, 1, 1, 0), _b(out + 16, AUX + 16 * bucket)),
        Node(MEMCPY, (1024, 2), _b(out + 256, out)),
    ]  # fmt: skip


def _captures(change=None, buckets=(9, 10, 12), every: bool = False) -> list[Capture]:
    """Captures of ``buckets``, the second one's nodes (``every``: all) passed through
    ``change(nodes, bucket)``."""
    out = []
    for i, b in enumerate(buckets):
        nodes = _nodes(b)
        if change and (every or i == 1):
            nodes = change(nodes, b)
        out.append(Capture(nodes, OWN[b], b))
    return out


def test_derive_moves_the_cache_offsets_and_keeps_each_captures_own_buffers():
    move = derive(_captures())
    assert move.steps == {(0, 3): 4, (1, 1): 16}
    # bucket 12 from the capture of bucket 10: only the cache offsets change (its own ids,
    # logits and pool block stay)
    assert move.moved(_nodes(10), 2) == {0: {3: _b(48, size=4)[0]}, 1: {1: _b(AUX + 192)[0]}}
    back = move.moved(_nodes(12), -3)  # and back to 9
    assert back == {0: {3: _nodes(9)[0].args[3]}, 1: {1: _nodes(9)[1].args[1]}}
    assert owner(0x2000 + 256, OWN[9]) == (1, 256) and owner(0x2101, OWN[9]) is None


def _with(node: int, arg: int, value):
    """A change: argument ``arg`` of node ``node`` becomes ``value(bucket)``."""

    def change(nodes, bucket):
        n = nodes[node]
        args = (*n.args[:arg], value(bucket), *n.args[arg + 1 :])
        return [*nodes[:node], Node(n.kind, n.fixed, args), *nodes[node + 1 :]]

    return change


@pytest.mark.parametrize(
    "change, every, why",
    [
        (lambda n, b: n[:2], False, "nodes"),  # another node count
        (lambda n, b: [Node(KERNEL, (13, *n[0].fixed[1:]), n[0].args), *n[1:]], False, "beyond"),
        (lambda n, b: [n[0], Node(KERNEL, (12, 9, 1, 1, 128, 1, 1, 0), n[1].args), n[2]], False,
         "beyond"),  # another grid
        (_with(2, 0, lambda b: _b(AUX + 16 * b)[0]), True, "node 2 .type 1. argument 0"),  # copy
        (_with(0, 3, lambda b: _b(41, size=4)[0]), False, "argument 3 .4 bytes."),  # irregular
        (_with(1, 1, lambda b: _b(AUX + 0x10000 * b)[0]), True, "argument 1 .8 bytes."),  # fresh
    ],
)  # fmt: skip
def test_derive_refuses_what_a_move_does_not_explain(change, every, why):
    with pytest.raises(NotRelocatable, match=why):
        derive(_captures(change, every=every))


def _foreign(nodes, bucket, shape=(21, 4, 1, 1, 128, 1, 1, 0)):
    """A change: a library's kernel (its arguments unreadable) after the first node."""
    return [nodes[0], Node(KERNEL, shape, (), foreign=True), *nodes[1:]]


def test_foreign_kernels_keep_their_arguments_and_must_launch_alike():
    move = derive(_captures(_foreign, every=True))
    assert move.steps == {(0, 3): 4, (2, 1): 16}  # the moves of the readable nodes only
    # in one capture only (another node count), readable in one capture, or launched
    # otherwise: refused
    with pytest.raises(NotRelocatable, match="nodes"):
        derive(_captures(_foreign))
    readable = _foreign(_nodes(10), 10)
    readable[1] = Node(KERNEL, readable[1].fixed, ())
    wider = _foreign(_nodes(10), 10, (21, 8, 1, 1, 128, 1, 1, 0))
    for other in (readable, wider):
        captures = _captures(_foreign, every=True)
        captures[1] = Capture(other, OWN[10], 10)
        with pytest.raises(NotRelocatable, match="node 1 .type 0. differs beyond"):
            derive(captures)


def test_irregular_pointers_are_each_captures_own():
    # a pool block elsewhere in one capture, or the ids at another offset of their own buffer:
    # kept as the moved graph's capture had them, never moved
    for change in (_with(1, 0, lambda b: _b(0x6123_0000)[0]),
                   _with(0, 0, lambda b: _b(0x3008)[0])):  # fmt: skip
        assert derive(_captures(change)).steps == {(0, 3): 4, (1, 1): 16}


def test_derive_needs_three_buckets():
    with pytest.raises(ValueError, match="three"):
        derive(_captures()[:2])
    with pytest.raises(ValueError, match="distinct"):
        derive(_captures(buckets=(9, 10, 10)))


# -- DecodeGraphs over a simulated runtime whose kernels take pointer arguments ----------------


class _ArgKernel:
    def __init__(self, fn, args: tuple[int, ...]):
        self.fn, self.args = fn, args

    def __call__(self) -> None:
        self.fn(*self.args)


class _ForeignKernel(_ArgKernel):
    """A kernel whose graph node shows no arguments (a library's launch)."""


def _arg_bytes(a) -> bytes:
    """A simulated kernel argument as a node shows it: ``np.int32`` 4 bytes, an int 8."""
    return _b(int(a), size=4 if isinstance(a, np.int32) else 8)[0]


class ArgCuda(SimCuda):
    """SimCuda whose kernels take integer arguments (8-byte pointers, ``np.int32`` scalars),
    which a graph's nodes show (``graph_node``) and an executable graph's can be given anew
    (``kernel_args``)."""

    def __init__(self):
        super().__init__()
        self.set_calls = 0

    def launch_kernel(self, fn, *args: int) -> None:  # the model's launches
        self.kernel(_ArgKernel(fn, args))

    def launch_foreign(self, fn, *args: int) -> None:  # a library's launch (cuBLAS's)
        self.kernel(_ForeignKernel(fn, args))

    def graph_node(self, node: int) -> Node:
        op = self.graphs[node // 100][node % 100]
        if op[0] == "kernel" and isinstance(op[1], _ForeignKernel):
            return Node(KERNEL, (id(op[1].fn),), (), foreign=True)
        if op[0] == "kernel":
            return Node(KERNEL, (id(op[1].fn),), tuple(_arg_bytes(a) for a in op[1].args))
        return Node(MEMCPY, (op[3], op[4]), _b(op[1], op[2]))

    def kernel_args(self, exe: int, node: int) -> _Setter:
        op = self.execs[exe][node % 100]
        assert op[0] == "kernel" and not isinstance(op[1], _ForeignKernel)
        return _Setter(self, exe, node % 100)


class _Setter:
    """``CudaRuntime.kernel_args`` of ArgCuda: rewrites the op of one executable graph."""

    def __init__(self, sim: ArgCuda, exe: int, i: int):
        self.sim, self.exe, self.i = sim, exe, i

    def set(self, args: dict[int, bytes]) -> None:
        op = self.sim.execs[self.exe][self.i][1]
        new = list(op.args)
        for j, raw in args.items():
            assert len(raw) == len(_arg_bytes(new[j]))
            new[j] = (np.int32(int.from_bytes(raw, "little", signed=True)) if len(raw) == 4
                      else int.from_bytes(raw, "little"))  # fmt: skip
        self.sim.execs[self.exe][self.i] = ("kernel", _ArgKernel(op.fn, tuple(new)))
        self.sim.set_calls += 1


def _read(ptr: int, n: int, dtype) -> np.ndarray:
    nbytes = n * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype).copy()


WEIGHTS_F = np.array([1.0, -2.0, 0.5, 3.0], np.float32)


def _stage(ids_ptr: int, aux_ptr: int, offset: int, scratch_ptr: int) -> None:
    """Kernel 1: ``(id, position)`` into a pool block, the position read at element ``offset``
    of the cache's buffer (as TVM passes a view's offset)."""
    tok, pos = _read(ids_ptr, 1, np.int32)[0], _read(aux_ptr + 4 * int(offset), 1, np.int32)[0]
    staged = np.array([tok, pos], np.float32)
    ctypes.memmove(scratch_ptr, staged.ctypes.data, staged.nbytes)


def _finish(scratch_ptr: int, out_ptr: int, salt: int) -> None:
    """Kernel 2: ``logits = weights * id + position`` from the pool block (``salt`` unused)."""
    tok, pos = _read(scratch_ptr, 2, np.float32)
    value = (WEIGHTS_F * tok + pos).astype(np.float32)
    ctypes.memmove(out_ptr, value.ctypes.data, value.nbytes)


class AuxModel:
    """A decode step over a cache-like auxiliary buffer: a page table of ``4 * bucket`` int32,
    then the position (element offset ``4 * bucket``); its intermediate goes through a block of
    a pool, another one at each call (as the VM's pool hands them out); the logits are
    ``weights * id + position``. ``irregular``: a scalar argument that changes from call to
    call without the bucket (such graphs must not move)."""

    def __init__(self, sim: ArgCuda, irregular: bool = False):
        self.sim, self.irregular = sim, irregular
        self.aux = np.zeros(1024, np.int32)
        self.pool = np.zeros(64 * 64, np.float32)
        self.calls = 0

    def begin(self, bucket: int, position: int) -> None:
        """What the KV cache does before a step, outside any graph: the arrays laid out anew."""
        self.bucket = bucket
        self.aux[:] = -1
        self.aux[4 * bucket] = position

    def __call__(self, ids_t: tvm_ffi.Tensor) -> tuple:
        logits = np.zeros((1, 1, 4), np.float32)
        self.calls += 1
        block = self.pool.ctypes.data + 256 * (self.calls**2 % 61)
        salt = self.calls**3 % 97 if self.irregular else 0
        offset = np.int32(4 * self.bucket)
        self.sim.launch_kernel(_stage, ids_t.data_ptr(), self.aux.ctypes.data, offset, block)
        self.sim.launch_kernel(_finish, block, logits.ctypes.data, np.int32(salt))
        return (tvm_ffi.from_dlpack(logits),)


def _copy(src_ptr: int, dst_ptr: int) -> None:
    ctypes.memmove(dst_ptr, src_ptr, 8)


class ForeignAuxModel(AuxModel):
    """AuxModel with a library's kernel between its two: the staged block copied into another
    pool block (one per call), which the second kernel reads."""

    def __call__(self, ids_t: tvm_ffi.Tensor) -> tuple:
        logits = np.zeros((1, 1, 4), np.float32)
        self.calls += 1
        block = self.pool.ctypes.data + 256 * (self.calls**2 % 61)
        other = self.pool.ctypes.data + 256 * (self.calls**2 % 59 + 1)
        offset = np.int32(4 * self.bucket)
        self.sim.launch_kernel(_stage, ids_t.data_ptr(), self.aux.ctypes.data, offset, block)
        self.sim.launch_foreign(_copy, block, other)
        self.sim.launch_kernel(_finish, other, logits.ctypes.data, np.int32(0))
        return (tvm_ffi.from_dlpack(logits),)


def _decode(graphs: DecodeGraphs, sim: ArgCuda, model: AuxModel, positions) -> None:
    """Decode one token at each position (the bucket from it, as the engine's key), checking
    the logits against the model's formula."""

    def same(x, y) -> bool:  # the first replay's check (as the engine's, after the replay)
        sim.synchronize(STREAM)
        return np.array_equal(np.from_dlpack(x[0]), np.from_dlpack(y[0]))

    for i, pos in enumerate(positions):
        bucket = pos // 64 + 1
        model.begin(bucket, pos)
        tok = np.array([[i % 50]], np.int32)
        out = graphs.run((1, bucket), tok, model, lambda a: tvm_ffi.from_dlpack(a.copy()),
                         lambda t, a: np.copyto(np.from_dlpack(t), a), same)  # fmt: skip
        sim.synchronize(STREAM)
        want = WEIGHTS_F * tok[0, 0] + pos
        np.testing.assert_array_equal(np.from_dlpack(out[0])[0, 0], want, err_msg=f"step {i}")


def test_decode_graphs_move_to_new_buckets_after_three_captures():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim)
    _decode(graphs, sim, model, range(0, 64 * 7, 5))  # buckets 1..7
    # buckets 1-2 checked (eager, capture, eager), 3 captured trusted, 4-7 moved
    assert graphs.stats["captures"] == 3 and graphs.stats["relocations"] == 4
    assert graphs.stats["relocation_failures"] == 0 and graphs.stats["moved_args"] == 1
    assert graphs.stats["checks"] == 2 and model.calls == 3 * 2 + 1  # 1-2 checked, 3 trusted
    assert sim.set_calls == 4 and len(sim.execs) == 3
    _decode(graphs, sim, model, range(100, 130, 3))  # back to buckets 2-3 (popn): cached
    # bucket 1 (still cached), 10 (bucket 1's graph moved), 1 again (moved back)
    _decode(graphs, sim, model, [10, 20, 64 * 9, 5])
    assert graphs.stats["captures"] == 3 and graphs.stats["relocations"] == 6


def test_graphs_with_a_foreign_kernel_move_and_keep_its_arguments():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), ForeignAuxModel(sim)
    _decode(graphs, sim, model, range(0, 64 * 7, 5))  # right logits at every step
    assert graphs.stats["captures"] == 3 and graphs.stats["relocations"] == 4
    assert graphs.stats["relocation_failures"] == 0 and graphs.stats["moved_args"] == 1


def test_graphs_whose_arguments_do_not_move_in_steps_are_captured_per_bucket():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim, irregular=True)
    _decode(graphs, sim, model, range(0, 64 * 6, 7))
    assert graphs.stats["relocations"] == 0 and graphs.stats["relocation_failures"] == 1
    assert graphs.stats["captures"] == 6 and "per bucket" in graphs.last_error


def test_relocation_off_captures_every_bucket():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim, relocate=False), AuxModel(sim)
    _decode(graphs, sim, model, range(0, 64 * 5, 9))
    assert graphs.stats["captures"] == 5 and graphs.stats["relocations"] == 0


def test_a_failed_move_drops_the_graph_and_captures_from_then_on():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim)
    _decode(graphs, sim, model, range(0, 64 * 3, 8))
    sim.kernel_args = lambda *a: (_ for _ in ()).throw(RuntimeError("CUresult 1"))
    _decode(graphs, sim, model, range(64 * 3, 64 * 6, 8))
    assert graphs.stats["relocations"] == 0 and graphs.stats["relocation_failures"] == 1
    assert graphs.stats["captures"] == 6 and "CUresult 1" in graphs.last_error


def test_graphs_captured_with_moves_off_are_never_moved():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim)
    _decode(graphs, sim, model, range(0, 64 * 3, 8))  # buckets 1-3: the moves are learnable
    graphs.relocate = False
    _decode(graphs, sim, model, range(64 * 3, 64 * 4, 8))  # bucket 4: its template not kept
    graphs.relocate = True
    _decode(graphs, sim, model, range(64 * 4, 64 * 6, 8))  # 5, 6: bucket 3's graph moved
    assert graphs.stats["captures"] == 4 and graphs.stats["relocations"] == 2
    cached = graphs._graphs
    assert cached[(1, 6)].bucket == 3 and not cached[(1, 4)].template  # moved; left alone


def test_prepare_moves_the_next_buckets_graph_before_its_step_even_while_it_runs():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim)
    _decode(graphs, sim, model, range(0, 64 * 3, 8))  # buckets 1-3: trusted, moves learnable
    graphs.prepare((1, 2), False)  # cached: nothing to do
    assert graphs.stats["relocations"] == 0
    # the last step of bucket 3 launched (not yet run), then bucket 4 prepared: the graph in
    # flight moves; the launch keeps the arguments it had
    model.begin(3, 190)
    graph = graphs._graphs[(1, 3)]
    graphs._replay(graph, np.array([[7]], np.int32), lambda t, a: np.copyto(np.from_dlpack(t), a))
    graphs.prepare((1, 4), False)
    assert graphs.stats["relocations"] == 1 and (1, 4) in graphs._graphs
    sim.synchronize(STREAM)  # the step runs now, after the move
    np.testing.assert_array_equal(np.from_dlpack(graph.out[0])[0, 0], WEIGHTS_F * 7 + 190)
    _decode(graphs, sim, model, range(64 * 3, 64 * 4, 8))  # bucket 4: replays only
    assert graphs.stats["relocations"] == 1 and graphs.stats["captures"] == 3
    graphs.prepare((1, 9), True)  # a greedy key: no greedy graph yet, nothing moves
    assert graphs.stats["relocations"] == 1


# -- keys that change every step (a batch of mixed lengths: some sequence crosses a page) -------


def _tallies(graphs: DecodeGraphs) -> tuple:
    s = graphs.stats
    return s["captures"], s["checks"], s["relocations"], s["replays"], graphs._verified


class GreedyAuxModel(AuxModel):
    """AuxModel's step returning (logits, tokens): the token ``int(logits[0])`` (id +
    position), picked by a third kernel into a fresh int32 output."""

    def __call__(self, ids_t: tvm_ffi.Tensor) -> tuple:
        (logits,) = super().__call__(ids_t)
        tokens = np.zeros(1, np.int32)
        self.sim.launch_kernel(_pick, logits.data_ptr(), tokens.ctypes.data)
        return logits, tvm_ffi.from_dlpack(tokens)


def _pick(logits_ptr: int, tokens_ptr: int) -> None:
    token = np.array([int(_read(logits_ptr, 1, np.float32)[0])], np.int32)
    ctypes.memmove(tokens_ptr, token.ctypes.data, token.nbytes)


def test_keys_that_change_every_step_replay_moved_graphs_after_three_captures():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim)
    seen = []
    for pos in [64 * b + 3 * b for b in range(10)]:  # buckets 1..10, one step each
        _decode(graphs, sim, model, [pos])  # the logits checked against the model's formula
        seen.append(_tallies(graphs))
    # three captures (eager + capture each) teach the move; buckets 4 and 5 take the latest
    # graph moved, replayed and checked against an eager step: trusted after two, so buckets
    # 6-10 are moved and replayed only
    assert seen[:6] == [(1, 0, 0, 0, 0), (2, 0, 0, 0, 0), (3, 0, 0, 0, 0), (3, 1, 1, 1, 1),
                        (3, 2, 2, 2, 2), (3, 2, 3, 3, 2)]  # fmt: skip
    assert seen[-1] == (3, 2, 7, 7, 2) and graphs.stats["mismatches"] == 0
    assert model.calls == 3 * 2 + 2 and len(sim.execs) == 3 and sim.set_calls == 7


def test_greedy_keys_that_change_every_step_as_the_engine_steps_them():
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), GreedyAuxModel(sim)
    buckets = [2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 16]  # up by one or two pages of 4
    for i, bucket in enumerate(buckets):
        pos = 64 * (bucket - 1) + i
        model.begin(bucket, pos)
        key, tok = (1, bucket, "greedy"), np.array([[i]], np.int32)
        graph = graphs.launch_greedy(key, tok)  # a verified graph (cached or moved), else None
        if graph is not None:
            tokens = graphs.wait_greedy(graph)
        else:
            tokens = graphs.run_greedy(key, tok, model, lambda a: tvm_ffi.from_dlpack(a.copy()),
                                       _same)  # fmt: skip
        assert tokens.tolist() == [i + pos], f"step {i}"
        if i + 1 < len(buckets):  # the next step's graph moved while this one "runs"
            graphs.prepare((1, buckets[i + 1], "greedy"), True)
    s = graphs.stats
    assert (s["captures"], s["checks"], s["mismatches"]) == (3, 2, 0)
    assert s["relocations"] == s["greedy_replays"] == len(buckets) - 3
    assert model.calls == 3 * 2 + 2


def test_a_moved_graph_that_fails_its_check_stops_moves_and_trust(monkeypatch):
    sim = ArgCuda()
    graphs, model = DecodeGraphs("cuda", cuda=sim), AuxModel(sim)
    real = _Setter.set

    def skewed(self, args):  # a wrong move: every moved int32 one element off
        real(self, {j: _b(int.from_bytes(r, "little") + 1, size=len(r))[0] if len(r) == 4
                    else r for j, r in args.items()})  # fmt: skip

    monkeypatch.setattr(_Setter, "set", skewed)
    _decode(graphs, sim, model, [64 * b for b in range(7)])  # right logits: the eager ones
    s = graphs.stats
    assert s["mismatches"] == 1 and s["checks"] == 1 and (1, 4) in graphs._failed
    assert s["relocations"] == 1 and s["relocation_failures"] == 1 and graphs._verified == 0
    assert "differs" in graphs.last_error and "per bucket" in graphs.last_error
    # from then on a new bucket runs eagerly, uncaptured (it may never recur: never trusted,
    # never moved) ...
    assert s["captures"] == 3 and s["eager_unseen"] == 3 and s["replays"] == 1
    assert (1, 4) not in graphs._graphs and (1, 7) not in graphs._graphs
    # ... a bucket that stays for a second step in a row is captured then, and replayed
    # (checked) on its third step ...
    _decode(graphs, sim, model, [64 * 6 + 1, 64 * 6 + 2])
    assert s["captures"] == 4 and s["eager_unseen"] == 3 and (1, 7) in graphs._graphs
    assert s["replays"] == 2 and s["checks"] == 2 and s["mismatches"] == 1
    # ... and buckets that come back, but never two steps in a row, stay eager
    _decode(graphs, sim, model, [64 * 4, 64 * 5, 64 * 4 + 1, 64 * 5 + 1])
    assert s["captures"] == 4 and s["eager_unseen"] == 7 and (1, 5) not in graphs._graphs

"""CUDA graphs for decode steps: one whole ``batch_decode`` call captured, then replayed per token.

A decode step at batch 1 launches hundreds of small kernels through the Relax VM (541 at the
V2-Lite shape); enqueueing them (VM bookkeeping + one driver call each) takes the host longer
than the kernels take to run (schedules/results/decode_kernels.md). A CUDA graph of
the whole call replays the same launches with one ``cudaGraphLaunch``.

**What a replay relies on.** A graph replays the kernels with the arguments they had at capture:
device pointers, shapes and scalars. A decode step's kernels read

* the token ids, from an input tensor the graph owns (:class:`DecodeGraphs` copies the new ids
  into it before a replay; a greedy graph copies them in itself, from pinned host memory, see
  below);
* the weights and the KV pages (allocated once), and intermediate tensors from the VM's pooled
  allocator (same sizes every call, so the same blocks; nothing allocated from the pool after a
  capture is kept alive across a replay);
* the KV cache's auxiliary arrays (page table, positions), which the cache copies to one device
  buffer in ``begin_forward``'s first use and hands to the kernels as views at offsets. The
  offsets depend on the batch size and, for the arrays after the page table, on the number of
  pages rounded up to 4 (``paged_kv_cache.cc``: 16-byte aligned int32 arrays). So the graph key
  is :func:`decode_graph_key` ``(batch size, ceil(pages / 4))``; the MLA attention kernel reads
  its split count from the page table on the device, so its launch shape depends on the batch
  size only (``schedules/mla_attention_cuda.py``).

Sequences that share pages (forks) have more than one block "depth" in the cache, which changes
the arrays' layout: the engine does not use graphs for them. Capture runs right after an eager
run of the same step (which loads modules and warms the pools) on a blocking stream, so ordering
with the legacy default stream (where the runtime's copies run) is implicit. If a capture fails,
the step's eager result stands and that key is not tried again. The engine checks each graph's
first replay against an eager run of the same step (``same``), so a wrong key would fall back to
eager steps instead of returning wrong logits.

**Trusted keys.** Checking each new key (every 64 tokens of a sequence) costs an eager step, the
capture and a second eager step, several ms of host time, which would slow a fresh process's
first generations well below a warm one's. Once
``trust_after`` keys (2) have passed their check and none has failed one, and a graph of the same
batch size and kind exists (modules loaded, pools holding the step's blocks: a capture cannot
allocate), a new key is captured directly (or moved, below), marked verified and replayed for
its own step: no eager run, no check. ``gpu_graph_check.py`` still compares every replay with an
eager engine.

**Moved graphs.** A trusted capture still costs the host several ms (the VM enqueues the step's
launches, then the graph is instantiated), once every 64 tokens: a step several times as long as
the others, at every context length; a move costs a fraction of that (docs/benchmarks.md,
"Decode over new KV page buckets").
Graphs of neighbouring buckets differ in the element offsets of the cache's arrays after its
page table, and otherwise only in buffers each capture has of its own
(:mod:`~dsv2_mlc.runtime.graph_relocation`). So, with ``relocate`` (the default), once three
graphs of a batch size and kind agree on how their kernel arguments move per bucket, a new
trusted key takes the most recently used of them instead of a capture: the moved arguments are
written into its executable graph (``cuGraphExecKernelNodeSetParams``) and it is cached under
the new key (its old key is captured or moved again when it comes back). A greedy step launched
ahead knows the next step's key: the engine moves its graph then (:meth:`DecodeGraphs.prepare`),
while the device runs, even the graph of the running step (a launch in flight keeps the
arguments it was launched with), so the next step only replays. Each graph keeps its captured
template, whose nodes name the executable's. The ``batch_decode_gemm`` step's cuBLAS kernels,
whose nodes do not expose their arguments, keep the arguments they were captured with
(:mod:`~.graph_relocation`). A kind of graph that does not move (``last_error`` says why;
``stats["relocation_failures"]``) is captured per bucket, and only by the second step in a row
of the same key: a step whose key differs from its group's last one
runs eagerly (``stats["eager_unseen"]``), since with keys that change every step a capture would
cost each step several ms and never be replayed.

Before the keys are trusted, a new key likewise takes the most recently used graph of its batch
size and kind, verified or not, once the move is known; the moved graph is replayed and checked
against an eager run of the step like a capture's first replay, and the check counts towards
trust; no capture is made. So a batch whose key changes at every step (sequences of mixed
lengths, some crossing a page at each step: no key recurs, so a captured graph would never be
replayed, nor checked) takes three captures (to learn the move) and two checked moves, then
moves only. A moved graph that fails its check is dropped like any other (the eager result
stands, that key stays eager, no trust) and its batch size and kind are captured per bucket
(keys that stay) from then on. Keys that recur (a batch of equal lengths: 16 steps a key
at batch 256) pass their checks on their own replays and are trusted before three captures
exist.

**Programmatic Dependent Launch.** For a build compiled with ``--pdl`` (``BuildConfig.pdl``),
``DecodeGraphs(pdl_port=...)`` turns every kernel->kernel edge of a captured graph into a
programmatic one before instantiating it (:mod:`dsv2_mlc.runtime.pdl`), so each kernel is
launched while its predecessor drains. If the CUDA runtime or driver cannot (older than 12.3, or
the instantiation refuses the edges), the plain graph is used and PDL stays off for later
captures (``stats["pdl_failures"]``, ``last_error``).

**Greedy steps: ids and tokens through pinned host memory.** A greedy step
(:meth:`DecodeGraphs.run_greedy`: the call returns ``(logits, tokens)``, the tokens being the
int32 ``[b]`` arg-max picked on the device) moves 4 bytes per sequence each way, yet the
runtime's synchronous copies cost more than the graph launch (a host->device copy of the ids,
and a device->host copy that then waits for the graph). So a greedy graph owns two page-locked host
buffers (``cudaHostAlloc``) and captures on its stream a host->device copy of the ids from the
first into its input tensor, then the call, then a device->host copy of the tokens into the
second. A replay writes the ids into the first buffer (a NumPy view of it), launches the graph,
synchronizes the stream and copies the tokens out of the second: no other host<->device copy.

* The host writes the input buffer only while no replay is in flight (a replay may read it at
  any time until it completes): ``run_greedy`` synchronizes the stream before it returns, and
  :meth:`DecodeGraphs.launch_greedy` (a verified graph launched without waiting, so that the host
  prepares the next step meanwhile: ``Engine.launch_greedy``) must be followed by
  :meth:`~DecodeGraphs.wait_greedy` before the next launch. Launching step ``t + 1`` before step
  ``t`` completes would need a buffer per replay in flight, and more: step ``t + 1``'s token is
  step ``t``'s output, and the KV cache copies its page tables for a step (on a stream of its
  own) into the one device buffer that step ``t``'s kernels read.
* The buffers are freed only after synchronizing the stream, when their graph is dropped (LRU
  eviction, a failed first-replay check, :meth:`DecodeGraphs.clear` / ``close``, garbage
  collection) or its capture failed.
* The copies are memcpy nodes: programmatic (PDL) edges never touch them (only kernel->kernel
  edges are converted), so the first kernel starts after the ids have landed and the tokens are
  copied after the arg-max kernel has completed.
* The first-replay check also compares the tokens read from the pinned buffer with the eager
  step's, so it covers the two copies as well.
"""

from __future__ import annotations

import ctypes
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm_ffi

from .cudart import MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, CudaRuntime
from .device import device_of, to_numpy
from .graph_relocation import Capture, Node, Relocation, derive
from .pdl import BrokenGraphError, make_programmatic, restore_default

__all__ = ["DecodeGraphs", "decode_graph_key", "same_greedy", "same_logits"]

log = logging.getLogger(__name__)

PAGE_ALIGN = 4  # int32 elements per 16-byte alignment unit of the KV cache's auxiliary buffer


def same_logits(a: Any, b: Any) -> bool:
    """Whether two ``batch_decode`` outputs hold bit-identical logits."""
    return bool(np.array_equal(to_numpy(a[0]), to_numpy(b[0])))


def same_greedy(a: Any, b: Any) -> bool:
    """Whether two greedy decode outputs (logits, tokens) are bit-identical."""
    return same_logits(a, b) and bool(np.array_equal(to_numpy(a[1]), to_numpy(b[1])))


def decode_graph_key(page_size: int, lengths_after: list[int]) -> tuple[int, int]:
    """The graph key of a decode step: batch size and the pages of the batch in units of 4.

    ``lengths_after`` are the sequences' lengths including the token this step appends."""
    pages = sum(-(-n // page_size) for n in lengths_after)
    return len(lengths_after), -(-pages // PAGE_ALIGN)


def _group(key: tuple) -> tuple:
    """The graphs ``key``'s may move between: the key without its page bucket (``key[1]``)."""
    return (key[0], *key[2:])


def _layout(tensor: tvm_ffi.Tensor) -> tuple[tuple[int, ...], np.dtype]:
    return tuple(int(s) for s in tensor.shape), np.dtype(str(tensor.dtype))


def _tokens(out: Any) -> np.ndarray:
    """The host copy of a greedy call's tokens (``out[1]``), as they are (int32)."""
    return to_numpy(out[1])


class _Pinned:
    """The page-locked host buffers of one greedy graph: the ids its first node copies to the
    device and the tokens its last node copies back, each with a NumPy view over it.

    Only :func:`_drop` and a failed capture free them, after synchronizing the graph's stream:
    a launched replay may read ``ids`` and write ``tokens`` until it completes."""

    def __init__(self, cuda: Any, ids: tuple, tokens: tuple) -> None:
        """``ids`` and ``tokens``: (shape, dtype) of the two buffers."""
        self.ptrs: list[int] = []
        views = []
        try:
            for shape, dtype in (ids, tokens):
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                self.ptrs.append(cuda.host_alloc(nbytes))
                raw = (ctypes.c_char * nbytes).from_address(self.ptrs[-1])
                views.append(np.frombuffer(raw, dtype=dtype).reshape(shape))
        except Exception:
            for ptr in self.ptrs:
                cuda.free_host(ptr)  # nothing was captured: no copy can use them
            raise
        self.ids: np.ndarray = views[0]
        self.tokens: np.ndarray = views[1]

    def free(self, cuda: Any, stream: int) -> None:
        """Free both buffers once no replay can use them any more (a leak, logged, where the
        stream cannot be synchronized: better than memory a running graph may touch)."""
        if not self.ptrs:
            return
        try:
            cuda.synchronize(stream)
        except Exception as err:  # noqa: BLE001 (an unusable device: keep the memory)
            log.warning("pinned decode graph buffers not freed: %s", err)
            return
        del self.ids, self.tokens  # no view may outlive the memory
        ptrs, self.ptrs = self.ptrs, []
        for ptr in ptrs:
            cuda.free_host(ptr)


@dataclass
class _Graph:
    exe: int
    ids: tvm_ffi.Tensor  # the input the graph reads [b, 1] int32
    out: Any  # what the captured call returned (its tensors are the graph's outputs)
    verified: bool = False  # a replay has matched an eager run of the same step
    pinned: _Pinned | None = None  # greedy graphs: the ids in and tokens out, on the host
    template: int = 0  # the captured graph (kept where graphs may move: its nodes name exe's)
    bucket: int = 0  # the page bucket (key[1]) of the capture
    owned: list[tuple[int, int]] = field(default_factory=list)  # (address, bytes) of its buffers
    nodes: list[int] | None = None  # the template's nodes and, read once, their parameters
    snapshot: list[Node] | None = None
    setters: dict[int, Any] = field(default_factory=dict)  # node index -> its KernelArgs


def _drop(cuda: Any, stream: int, graph: _Graph) -> None:
    """Destroy ``graph``'s executable and template, then free its pinned buffers (after a
    synchronize)."""
    cuda.destroy(graph.exe)
    if graph.template:
        cuda.destroy_graph(graph.template)
    if graph.pinned is not None:
        graph.pinned.free(cuda, stream)


def _owned(ids_t: tvm_ffi.Tensor, out: Any, pinned: _Pinned | None) -> list[tuple[int, int]]:
    """(address, bytes) of the buffers a graph owns: its ids input, every tensor it returned,
    its pinned host buffers (in that order: the same order in every capture of a step)."""
    if isinstance(out, tvm_ffi.Tensor):
        outs = [out]
    else:
        try:
            outs = list(out)
        except TypeError:
            outs = []
    ranges = []
    for t in [ids_t, *outs]:
        if isinstance(t, tvm_ffi.Tensor):
            shape, dtype = _layout(t)
            ranges.append((int(t.data_ptr()), int(np.prod(shape, dtype=np.int64)) * dtype.itemsize))
    if pinned is not None:
        ranges += [(ptr, view.nbytes) for ptr, view in zip(pinned.ptrs, (pinned.ids, pinned.tokens),
                                                           strict=True)]  # fmt: skip
    return ranges


def _drop_all(cuda: Any, stream: int, graphs: OrderedDict) -> None:
    """Every graph of ``graphs`` dropped (errors logged: also runs at garbage collection)."""
    while graphs:
        _, graph = graphs.popitem(last=False)
        try:
            _drop(cuda, stream, graph)
        except Exception as err:  # noqa: BLE001 (free what can be freed)
            log.warning("decode graph not released: %s", err)


class DecodeGraphs:
    """Captured decode steps by :func:`decode_graph_key` (at most ``capacity``, LRU).

    A key serves 64 tokens of one sequence (a page bucket) and is captured (several ms of host
    time), or moved from another bucket's graph (``relocate``, module docstring); each graph
    keeps its output logits alive (``batch x vocab`` float32, 0.4 MB at batch 1 for a 102K
    vocabulary), so a small LRU is enough and bounds that memory.

    ``pdl_port`` (a :mod:`~dsv2_mlc.runtime.pdl` port; only for ``--pdl`` builds, whose kernels
    all wait for their predecessors): captured kernel->kernel edges become programmatic.

    Graphs (and the pinned buffers of greedy graphs) are released by :meth:`clear`,
    :meth:`close` or garbage collection."""

    def __init__(
        self,
        device: str,
        capacity: int = 16,
        cuda: CudaRuntime | None = None,
        pdl_port: int | None = None,
        trust_after: int = 2,
        relocate: bool = True,
    ) -> None:
        self.cuda = cuda or CudaRuntime()
        self.device = device_of(device)
        self.stream = self.cuda.create_stream()  # blocking: ordered with the legacy stream
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._failed: set[tuple] = set()
        self.trust_after = trust_after
        self._verified = 0  # keys whose first replay matched an eager step
        # (batch size, greedy?) of the graphs captured so far -> the tokens' (shape, dtype)
        self._warm: dict[tuple[int, bool], tuple | None] = {}
        self.pdl_port = pdl_port
        self.relocate = relocate
        # (batch size, kind) -> how its graphs move between page buckets; None: they cannot
        self._moves: dict[tuple, Relocation | None] = {}
        # the key of each group's last step that found no graph (groups whose graphs cannot move)
        self._last: dict[tuple, tuple] = {}
        self.stats: dict[str, float] = dict(
            captures=0, replays=0, greedy_replays=0, failures=0, checks=0, mismatches=0,
            capture_s=0.0, relocations=0, relocate_s=0.0, relocation_failures=0, eager_unseen=0,
        )  # fmt: skip
        if pdl_port is not None:
            self.stats.update(pdl_edges=0, pdl_failures=0)
        self.last_error: str | None = None
        # garbage collection (or exit) releases the graphs; the finalizer holds what it needs,
        # never self (which it would keep alive)
        self._finalizer = weakref.finalize(self, _drop_all, self.cuda, self.stream, self._graphs)

    def _cached(self, key: tuple, greedy: bool) -> _Graph | None:
        """The graph of ``key`` (now the most recently used), if one is cached."""
        graph = self._graphs.get(key)
        if graph is None:
            return None
        if (graph.pinned is not None) != greedy:
            kind = "greedy" if graph.pinned is not None else "logits"
            raise ValueError(f"decode graph key {key} holds a {kind} graph; give each its own key")
        self._graphs.move_to_end(key)
        return graph

    def run(
        self,
        key: tuple,
        ids: np.ndarray,
        call: Callable[[tvm_ffi.Tensor], Any],
        to_device: Callable[[np.ndarray], tvm_ffi.Tensor],
        write: Callable[[tvm_ffi.Tensor, np.ndarray], None],
        same: Callable[[Any, Any], bool] | None = None,
    ) -> Any:
        """``call(ids_tensor)`` for this step: replayed from a graph when one is cached for
        ``key``; otherwise run eagerly and then captured for the next steps with that key.

        With ``same`` (outputs -> equal?), a graph's first replay is checked against an eager
        run of the same step (the KV append writes the same values twice); a mismatch drops the
        graph, returns the eager result and keeps that key eager. This guards the key (which
        follows the KV cache's internal layout, see the module docstring) at the cost of one
        eager step per key, until the keys are trusted (module docstring): then a new key's
        graph is moved from another bucket or captured, and replayed for its own step. Before
        that, a new key whose group's graphs move gets one moved to it, replayed and checked
        (:meth:`_moved_to_check`) instead of an eager run and a capture."""
        graph = self._cached(key, greedy=False) or self._moved_to_check(key, greedy=False)
        if graph is not None:
            self._replay(graph, ids, write)
            if same is None or graph.verified:
                return graph.out
            ref = call(graph.ids)
            return graph.out if self._check(key, graph, same(graph.out, ref)) else ref
        ids_t, worth = None, None
        if self._trusted(key, greedy=False):  # moved from another bucket, else captured
            graph = self._relocated(key, False)
            if graph is None and (worth := self._worth_capturing(key)):
                ids_t = to_device(ids)
                graph = self._capture(key, ids_t, call)
            if graph is not None:
                graph.verified = True
                self._replay(graph, ids, write)
                return graph.out
        ids_t = to_device(ids) if ids_t is None else ids_t
        out = call(ids_t)  # this step's result; also loads kernels and warms the pools
        if key not in self._failed and (self._worth_capturing(key) if worth is None else worth):
            self._capture(key, ids_t, call)
        return out

    def run_greedy(
        self,
        key: tuple,
        ids: np.ndarray,
        call: Callable[[tvm_ffi.Tensor], Any],
        to_device: Callable[[np.ndarray], tvm_ffi.Tensor],
        same: Callable[[Any, Any], bool] | None = None,
    ) -> np.ndarray:
        """:meth:`run` for a greedy step, whose ``call`` returns ``(logits, tokens)`` (device
        tensors; tokens int32 ``[b]``): the tokens, as a new int64 host array.

        Its graph copies the ids in from, and the tokens out to, pinned host memory (module
        docstring); a replay returns once the graph has completed. ``same`` compares two
        ``(logits, tokens)`` outputs; the first replay's host tokens are also compared with the
        eager step's. ``key`` must differ from every key given to :meth:`run`."""
        graph = self._cached(key, greedy=True) or self._moved_to_check(key, greedy=True)
        if graph is not None:
            self._replay_greedy(graph, ids)
            tokens = self.wait_greedy(graph)  # on the host now, and the ids buffer free again
            if same is None or graph.verified:
                return tokens
            ref = call(graph.ids)  # the ids the graph copied in
            ref_tokens = _tokens(ref)
            ok = same(graph.out, ref) and np.array_equal(tokens, ref_tokens)
            return tokens if self._check(key, graph, ok) else ref_tokens.astype(np.int64)
        ids_t, worth = None, None
        if self._trusted(key, greedy=True):  # moved from another bucket, else captured
            graph = self._relocated(key, True)
            if graph is None and (worth := self._worth_capturing(key)):
                ids_t = to_device(ids)
                graph = self._capture(key, ids_t, call, self._warm[(key[0], True)])
            if graph is not None:
                graph.verified = True
                self._replay_greedy(graph, ids)
                return self.wait_greedy(graph)
        ids_t = to_device(ids) if ids_t is None else ids_t
        out = call(ids_t)
        tokens = _tokens(out)
        if key not in self._failed and (self._worth_capturing(key) if worth is None else worth):
            self._capture(key, ids_t, call, (tokens.shape, tokens.dtype))
        return tokens.astype(np.int64)

    def _worth_capturing(self, key: tuple) -> bool:
        """Whether a step of ``key`` without a graph should capture one (asked once a step: it
        records the step's key): always, but where the graphs of its batch size and kind cannot
        move between page buckets. There a capture (several ms, more for large batches) pays
        off only if the key stays for the steps that follow, so only the second step in a row of
        the same key captures: keys that change every step, as a batch of mixed lengths makes
        them, run eagerly."""
        group = _group(key)
        if self._moves.get(group, True) is not None:
            return True
        again = self._last.get(group) == key
        self._last[group] = key
        if not again:
            self.stats["eager_unseen"] += 1
        return again

    def _trusted(self, key: tuple, greedy: bool) -> bool:
        """Whether ``key``'s graph may be captured without an eager run of the step first and
        used without a first-replay check: once ``trust_after`` keys have passed their check and
        none has failed one (the key function has held on this engine), and a graph of this
        batch size and kind has been captured (the modules are loaded and the pools hold the
        step's blocks: a capture cannot allocate)."""
        return (
            key not in self._failed
            and self._verified >= self.trust_after
            and self.stats["mismatches"] == 0
            and (key[0], greedy) in self._warm
        )

    def launch_greedy(self, key: tuple, ids: np.ndarray) -> _Graph | None:
        """Launch the verified greedy graph of ``key`` on ``ids`` without waiting for it; None
        (nothing launched) where there is none yet (:meth:`run_greedy` captures and checks it).

        The caller must :meth:`wait_greedy` for it before any other call of these graphs or of
        the KV cache that touches the device (the next step's ``begin_forward``, host-only, may
        run meanwhile): the replay reads the ids buffer and the cache's auxiliary arrays until it
        completes."""
        graph = self._cached(key, greedy=True)
        if graph is None and self._trusted(key, greedy=True):
            graph = self._relocated(key, True)
        if graph is None or not graph.verified:
            return None
        self._replay_greedy(graph, ids)
        return graph

    def prepare(self, key: tuple, greedy: bool) -> None:
        """Have a graph for ``key`` (a greedy one or not) before its step: where none is cached
        and the keys are trusted, move one now (:meth:`_relocated`), while the device runs the
        step before. The move may take the graph of that very step: a launch in flight keeps
        the arguments it was launched with. So the step itself only replays."""
        if key not in self._graphs and self._trusted(key, greedy):
            self._relocated(key, greedy)

    def _replay(self, graph: _Graph, ids: np.ndarray, write: Callable) -> None:
        """Write ``ids`` into ``graph``'s input tensor and launch it."""
        write(graph.ids, ids)
        self.cuda.launch(graph.exe, self.stream)
        self.stats["replays"] += 1

    def _replay_greedy(self, graph: _Graph, ids: np.ndarray) -> None:
        """Write ``ids`` into ``graph``'s pinned input and launch it (no replay is in flight)."""
        pinned = graph.pinned
        assert pinned is not None
        if ids.shape != pinned.ids.shape:
            raise ValueError(f"ids of shape {ids.shape} for a graph of {pinned.ids.shape}")
        np.copyto(pinned.ids, ids, casting="same_kind")
        self.cuda.launch(graph.exe, self.stream)
        self.stats["replays"] += 1
        self.stats["greedy_replays"] += 1

    def wait_greedy(self, graph: _Graph) -> np.ndarray:
        """The tokens of a replay begun by :meth:`launch_greedy`, once it has completed (a new
        int64 host array: the pinned buffer is the next replay's)."""
        assert graph.pinned is not None
        self.cuda.synchronize(self.stream)
        return graph.pinned.tokens.astype(np.int64)

    def _check(self, key: tuple, graph: _Graph, same: bool) -> bool:
        """Record the first replay check of ``graph`` at ``key``: verified, or dropped for good.
        A graph moved to ``key`` (captured at another bucket) that fails it stops the moves of
        its group: their graphs are captured per bucket from then on."""
        self.stats["checks"] += 1
        if same:
            graph.verified = True
            self._verified += 1
            return True
        self._graphs.pop(key)
        _drop(self.cuda, self.stream, graph)
        self._failed.add(key)
        self.stats["mismatches"] += 1
        self.last_error = f"graph replay for key {key} differs from the eager step"
        if graph.bucket != key[1]:  # moved there from its capture's bucket
            group = _group(key)
            self._unmovable(group, f"moved {self.last_error}: {group} captured per bucket")
        return False

    def _capture(
        self,
        key: tuple,
        ids_t: tvm_ffi.Tensor,
        call: Callable,
        tokens: tuple | None = None,
    ) -> _Graph | None:
        """Capture ``call(ids_t)`` for ``key`` (None if that failed); with ``tokens`` (the
        (shape, dtype) of the step's tokens) a greedy graph, with its pinned copies around the
        call."""
        cuda, stream = self.cuda, self.stream
        start = time.perf_counter()
        pinned = None
        try:
            if tokens is not None:
                pinned = _Pinned(cuda, _layout(ids_t), tokens)
            with tvm_ffi.use_raw_stream(self.device, stream):
                cuda.begin_capture(stream)
                try:
                    if pinned is not None:
                        src, n = pinned.ids.ctypes.data, pinned.ids.nbytes
                        cuda.memcpy_async(ids_t.data_ptr(), src, n, MEMCPY_HOST_TO_DEVICE, stream)
                    out = call(ids_t)
                    if pinned is not None:
                        dev = out[1]
                        if _layout(dev) != (pinned.tokens.shape, pinned.tokens.dtype):
                            raise RuntimeError(f"captured tokens {_layout(dev)} != eager tokens")
                        dst, n = pinned.tokens.ctypes.data, pinned.tokens.nbytes
                        cuda.memcpy_async(dst, dev.data_ptr(), n, MEMCPY_DEVICE_TO_HOST, stream)
                finally:
                    template = cuda.end_capture(stream)
            try:
                exe = self._instantiate(template)
            except BaseException:
                cuda.destroy_graph(template)
                raise
            if not self.relocate:  # nothing will read its nodes again
                cuda.destroy_graph(template)
                template = 0
        except Exception as err:  # noqa: BLE001 (fall back to eager steps for this key)
            cuda.clear_error()
            if pinned is not None:
                pinned.free(cuda, stream)
            self._failed.add(key)
            self.stats["failures"] += 1
            self.last_error = str(err)
            return None
        graph = _Graph(exe, ids_t, out, pinned=pinned, template=template, bucket=key[1],
                       owned=_owned(ids_t, out, pinned))  # fmt: skip
        self._graphs[key] = graph
        self._warm[(key[0], tokens is not None)] = tokens
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - start
        while len(self._graphs) > self.capacity:
            _, old = self._graphs.popitem(last=False)
            _drop(cuda, stream, old)
        return graph

    def _moved_to_check(self, key: tuple, greedy: bool) -> _Graph | None:
        """Before the keys are trusted, for a ``key`` with no graph: the most recently used graph
        of its batch size and kind, verified or not, moved to it (:meth:`_relocated`) and marked
        unverified, so that its replay is checked against an eager step like a capture's first
        replay (:meth:`_check`). None where the key is trusted or failed, or no graph can move
        yet (fewer than three captures of the group): then the step runs eagerly and is
        captured. So keys that change every step (sequences of mixed lengths crossing pages at
        different steps) need three captures, and the checks of their moves earn the trust."""
        if key in self._failed or self._trusted(key, greedy):
            return None
        graph = self._relocated(key, greedy, verified=False)
        if graph is not None:
            graph.verified = False
        return graph

    def _relocated(self, key: tuple, greedy: bool, verified: bool = True) -> _Graph | None:
        """The most recently used graph of ``key``'s batch size and kind (``verified``: a
        verified one), moved to ``key``'s page bucket and now cached under it
        (:mod:`~.graph_relocation`); None where there is none or its kind of graph does not move
        (then ``key`` is captured)."""
        group = _group(key)
        move = self._move(group) if self.relocate else None
        base = next((k for k, g in reversed(self._graphs.items())
                     if _group(k) == group and g.template and (g.verified or not verified)
                     and (g.pinned is not None) == greedy), None)  # fmt: skip
        if move is None or base is None:
            return None
        graph, start = self._graphs[base], time.perf_counter()
        try:
            snapshot = self._snapshot(graph)
            assert graph.nodes is not None
            for i, args in move.moved(snapshot, key[1] - graph.bucket).items():
                if i not in graph.setters:
                    graph.setters[i] = self.cuda.kernel_args(graph.exe, graph.nodes[i])
                graph.setters[i].set(args)
        except Exception as err:  # noqa: BLE001 (its arguments may be half moved: drop it)
            self.cuda.clear_error()
            del self._graphs[base]
            _drop(self.cuda, self.stream, graph)
            self._unmovable(group, f"moving a decode graph failed: {err}")
            return None
        del self._graphs[base]
        self._graphs[key] = graph
        self.stats["relocations"] += 1
        self.stats["relocate_s"] += time.perf_counter() - start
        return graph

    def _move(self, group: tuple) -> Relocation | None:
        """How the graphs of ``group`` move between page buckets, learned from three or more of
        its captures (None: not yet three, or they do not move)."""
        if group in self._moves:
            return self._moves[group]
        found: dict[int, _Graph] = {}
        for key, graph in reversed(self._graphs.items()):
            if _group(key) == group and graph.template and graph.bucket not in found:
                found[graph.bucket] = graph
            if len(found) == 4:  # enough to tell moves from pool buffers; each costs a read
                break
        if len(found) < 3:
            return None
        try:
            move = derive([Capture(self._snapshot(g), g.owned, g.bucket) for g in found.values()])
        except Exception as err:  # noqa: BLE001 (NotRelocatable, or a node not readable)
            self.cuda.clear_error()
            self._unmovable(group, f"decode graphs of {group} are captured per bucket: {err}")
            return None
        self._moves[group] = move
        self.stats["moved_args"] = len(move.steps)
        return move

    def _snapshot(self, graph: _Graph) -> list[Node]:
        """The template's nodes and their parameters, read once."""
        if graph.snapshot is None:
            graph.nodes = self.cuda.graph_nodes(graph.template)
            graph.snapshot = [self.cuda.graph_node(n) for n in graph.nodes]
        return graph.snapshot

    def _unmovable(self, group: tuple, why: str) -> None:
        log.info("%s", why)
        self._moves[group] = None
        self.stats["relocation_failures"] += 1
        self.last_error = why

    def _instantiate(self, graph: int) -> int:
        """``graph`` instantiated, with programmatic kernel edges where PDL is on and works."""
        cuda, port = self.cuda, self.pdl_port
        if port is None:
            return cuda.instantiate(graph)
        try:
            edges = make_programmatic(cuda, graph, port)
        except BrokenGraphError:
            self._pdl_off("programmatic graph edges failed and left the graph broken")
            raise  # this capture fails (eager steps for its key)
        except Exception as err:  # noqa: BLE001 (the graph is as captured)
            cuda.clear_error()
            self._pdl_off(f"programmatic graph edges unavailable: {err}")
            return cuda.instantiate(graph)
        try:
            exe = cuda.instantiate(graph)
        except Exception as err:  # noqa: BLE001 (retry without the programmatic edges)
            cuda.clear_error()
            self._pdl_off(f"instantiating a graph with programmatic edges failed: {err}")
            restore_default(cuda, graph, edges, port)  # BrokenGraphError: this capture fails
            return cuda.instantiate(graph)
        self.stats["pdl_edges"] = len(edges)  # of the latest capture
        return exe

    def _pdl_off(self, why: str) -> None:
        log.warning("%s; decode graphs use plain edges from now on", why)
        self.pdl_port = None
        self.stats["pdl_failures"] += 1
        self.last_error = why

    def clear(self) -> None:
        """Drop every graph and free its pinned buffers (after the cache's page layout was
        reset); later steps capture again."""
        _drop_all(self.cuda, self.stream, self._graphs)
        self._failed.clear()
        self._moves.clear()
        self._last.clear()

    def close(self) -> None:
        """Release every graph now (:meth:`clear`); garbage collection does the same."""
        self.clear()

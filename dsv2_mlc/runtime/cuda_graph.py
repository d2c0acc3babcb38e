"""CUDA graphs for decode steps: one whole ``batch_decode`` call captured, then replayed per token.

A decode step at batch 1 launches hundreds of small kernels through the Relax VM (541 at the
V2-Lite shape); enqueueing them (VM bookkeeping + one driver call each) takes about 3 ms on the
host, longer than the kernels run (about 1.9 ms on an H200; docs/benchmarks.md). A CUDA graph of
the whole call replays the same launches with one ``cudaGraphLaunch``.

**What a replay relies on.** A graph replays the kernels with the arguments they had at capture:
device pointers, shapes and scalars. A decode step's kernels read

* the token ids, from an input tensor the graph owns (:class:`DecodeGraphs` copies the new ids
  into it before a replay);
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

**Programmatic Dependent Launch.** For a build compiled with ``--pdl`` (``BuildConfig.pdl``),
``DecodeGraphs(pdl_port=...)`` turns every kernel->kernel edge of a captured graph into a
programmatic one before instantiating it (:mod:`dsv2_mlc.runtime.pdl`), so each kernel is
launched while its predecessor drains. If the CUDA runtime or driver cannot (older than 12.3, or
the instantiation refuses the edges), the plain graph is used and PDL stays off for later
captures (``stats["pdl_failures"]``, ``last_error``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm_ffi

from .cudart import CudaRuntime
from .device import device_of
from .pdl import BrokenGraphError, make_programmatic, restore_default

__all__ = ["DecodeGraphs", "decode_graph_key"]

log = logging.getLogger(__name__)

PAGE_ALIGN = 4  # int32 elements per 16-byte alignment unit of the KV cache's auxiliary buffer


def decode_graph_key(page_size: int, lengths_after: list[int]) -> tuple[int, int]:
    """The graph key of a decode step: batch size and the pages of the batch in units of 4.

    ``lengths_after`` are the sequences' lengths including the token this step appends."""
    pages = sum(-(-n // page_size) for n in lengths_after)
    return len(lengths_after), -(-pages // PAGE_ALIGN)


@dataclass
class _Graph:
    exe: int
    ids: tvm_ffi.Tensor  # the input the graph reads [b, 1] int32
    out: Any  # what the captured call returned (its tensors are the graph's outputs)
    verified: bool = False  # a replay has matched an eager run of the same step


class DecodeGraphs:
    """Captured decode steps by :func:`decode_graph_key` (at most ``capacity``, LRU).

    A key serves 64 tokens of one sequence (a page bucket) and is captured in about 6 ms on the
    H200; each graph keeps its output logits alive (``batch x vocab`` float32, 0.4 MB at batch
    1 for a 102K vocabulary), so a small LRU is enough and bounds that memory.

    ``pdl_port`` (a :mod:`~dsv2_mlc.runtime.pdl` port; only for ``--pdl`` builds, whose kernels
    all wait for their predecessors): captured kernel->kernel edges become programmatic."""

    def __init__(
        self,
        device: str,
        capacity: int = 16,
        cuda: CudaRuntime | None = None,
        pdl_port: int | None = None,
    ) -> None:
        self.cuda = cuda or CudaRuntime()
        self.device = device_of(device)
        self.stream = self.cuda.create_stream()  # blocking: ordered with the legacy stream
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._failed: set[tuple] = set()
        self.pdl_port = pdl_port
        self.stats: dict[str, float] = dict(
            captures=0, replays=0, failures=0, mismatches=0, capture_s=0.0
        )
        if pdl_port is not None:
            self.stats.update(pdl_edges=0, pdl_failures=0)
        self.last_error: str | None = None

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
        eager step per key."""
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            write(graph.ids, ids)
            self.cuda.launch(graph.exe, self.stream)
            self.stats["replays"] += 1
            if same is None or graph.verified:
                return graph.out
            ref = call(graph.ids)
            if same(graph.out, ref):
                graph.verified = True
                return graph.out
            self._graphs.pop(key)
            self.cuda.destroy(graph.exe)
            self._failed.add(key)
            self.stats["mismatches"] += 1
            self.last_error = f"graph replay for key {key} differs from the eager step"
            return ref
        ids_t = to_device(ids)
        out = call(ids_t)  # this step's result; also loads kernels and warms the pools
        if key not in self._failed:
            self._capture(key, ids_t, call)
        return out

    def _capture(self, key: tuple, ids_t: tvm_ffi.Tensor, call: Callable) -> None:
        cuda = self.cuda
        start = time.perf_counter()
        try:
            with tvm_ffi.use_raw_stream(self.device, self.stream):
                cuda.begin_capture(self.stream)
                try:
                    out = call(ids_t)
                finally:
                    graph = cuda.end_capture(self.stream)
            try:
                exe = self._instantiate(graph)
            finally:
                cuda.destroy_graph(graph)
        except Exception as err:  # noqa: BLE001 (fall back to eager steps for this key)
            cuda.clear_error()
            self._failed.add(key)
            self.stats["failures"] += 1
            self.last_error = str(err)
            return
        self._graphs[key] = _Graph(exe, ids_t, out)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - start
        while len(self._graphs) > self.capacity:
            _, old = self._graphs.popitem(last=False)
            cuda.destroy(old.exe)

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
        """Drop every graph (after the cache's page layout was reset)."""
        for graph in self._graphs.values():
            self.cuda.destroy(graph.exe)
        self._graphs.clear()
        self._failed.clear()

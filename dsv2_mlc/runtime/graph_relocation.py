"""Decode graphs moved to another page bucket by rewriting kernel arguments, not captured again.

A decode step's graph key is ``(batch, ceil(pages / 4))`` (:mod:`~dsv2_mlc.runtime.cuda_graph`):
the KV cache lays its auxiliary arrays out one after the other in one device buffer, so every
array after the page table starts 4 int32 later per bucket, and the kernels that read them get
other element offsets (in a V2-Lite build, the KV append and the attention's split kernel of
every layer: an int32 argument that grows by 4 a bucket). A capture costs the host several ms
(the VM enqueues the step's launches, then the graph is instantiated), one every 64 tokens of a
sequence, a step several times as long as the others. Rewriting the arguments that move, in the
executable graph of another bucket, costs a fraction of that (docs/benchmarks.md, "Decode over
new KV page buckets").

A kernel launched by a library through its own launch path (cuBLAS's GEMMs in a graph of
``batch_decode_gemm``) shows its function and launch shape but not its arguments
(:meth:`~dsv2_mlc.runtime.cudart.CudaRuntime.foreign_kernel`): it is compared by those and
keeps the arguments it was captured with. That is sound because the step hands such a library
activations and weights only, never the cache's arrays; and it is checked, as every move is
before the keys are trusted: the moved graph's replay against an eager step
(:mod:`~dsv2_mlc.runtime.cuda_graph`).

What else differs between two captures of a step stays as each capture has it: the buffers the
graph owns (its ids input, its outputs, the pinned host buffers of a greedy graph: pointers at
the same place of each capture's own buffers), and the blocks of the VM's memory pool that the
capture's intermediates used (a pointer that changes irregularly from capture to capture: the
pool hands its free blocks out in another order each time, and a graph's blocks stay valid for
its replays, see :mod:`~dsv2_mlc.runtime.cuda_graph`). :func:`derive` tells these apart over
three or more captures; anything it cannot explain (a scalar that changes irregularly, a
pointer that moves like a fresh allocation, another kernel, launch shape or node) raises
:class:`NotRelocatable`, and the graphs are captured per bucket as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Dsv2Error

__all__ = ["Capture", "Node", "NotRelocatable", "Relocation", "derive", "owner"]

NODE_KERNEL = 0  # cudaGraphNodeTypeKernel: the only nodes whose arguments are rewritten
MAX_POINTER_STEP = 1024  # bytes a bucket: more is how fresh allocations move, not an array


@dataclass(frozen=True)
class Node:
    """One node of a captured graph, as :func:`derive` compares it: its ``kind``
    (``cudaGraphNodeType``), ``fixed`` (what must be equal in every capture: for a kernel its
    function, grid, block and shared memory; for a copy or memset its sizes and kind) and
    ``args`` (the bytes of each kernel argument; a copy's or memset's pointers as 8 bytes).
    A ``foreign`` kernel (a library's launch, its arguments unreadable) has no ``args``: it is
    compared by ``fixed`` and keeps its arguments."""

    kind: int
    fixed: tuple[int, ...]
    args: tuple[bytes, ...]
    foreign: bool = False


class NotRelocatable(Dsv2Error):
    """Captures of one step differ in a way a move between page buckets does not explain."""


@dataclass(frozen=True)
class Capture:
    """A captured graph as :func:`derive` reads it: its nodes, the ``(address, bytes)`` of the
    buffers it owns (the same buffers, in the same order, in every capture) and its bucket."""

    nodes: list[Node]
    owned: list[tuple[int, int]]
    bucket: int


def owner(value: int, owned: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(index, offset) of the owned range ``(start, nbytes)`` that address ``value`` falls in
    (its end included: a pointer one past a buffer), or None."""
    for i, (start, nbytes) in enumerate(owned):
        if start <= value <= start + nbytes:
            return i, value - start
    return None


def _signed(raw: int, size: int) -> int:
    bits = 8 * size
    return raw - (1 << bits) if raw >> (bits - 1) else raw


@dataclass(frozen=True)
class Relocation:
    """The arguments that move with the page bucket: ``steps[(node, arg)] = change a bucket``
    (signed; node and argument by index in capture order). Every other argument of a moved
    graph stays as captured."""

    steps: dict[tuple[int, int], int]

    def moved(self, base: list[Node], by: int) -> dict[int, dict[int, bytes]]:
        """The arguments that change, ``by`` buckets on from the capture ``base``: node index
        -> {argument index: its bytes}."""
        out: dict[int, dict[int, bytes]] = {}
        for (i, j), step in sorted(self.steps.items()):
            size = len(base[i].args[j])
            value = (int.from_bytes(base[i].args[j], "little") + step * by) % (1 << (8 * size))
            out.setdefault(i, {})[j] = value.to_bytes(size, "little")
        return out


def _step(values: list[int], buckets: list[int], size: int) -> int | None:
    """The change a bucket if ``values`` move by whole equal steps with ``buckets``, else None."""
    deltas = [_signed((v - values[0]) % (1 << (8 * size)), size) for v in values]
    step, rest = divmod(deltas[1], buckets[1] - buckets[0])
    ok = not rest and all(
        d == step * (b - buckets[0]) for d, b in zip(deltas, buckets, strict=True)
    )
    return step if ok else None


def derive(captures: list[Capture]) -> Relocation:
    """How the graphs of one step move between page buckets, from ``captures`` of three or more
    buckets: :class:`Relocation`, or :class:`NotRelocatable` naming the node.

    Per argument, over the captures: equal, or pointing at the same place of each capture's own
    buffers (kept); moving by whole equal steps with the bucket (a scalar, or a pointer by less
    than :data:`MAX_POINTER_STEP` a bucket: an array of the cache's buffer) and a kernel's
    (moved); a kernel's pointer that changes irregularly (a buffer of the VM's pool that the
    capture used, its own: kept). Anything else is refused: a scalar that changes irregularly,
    a pointer that moves like fresh allocations, a copy or memset whose pointers move, nodes or
    launch shapes that differ."""
    buckets = [c.bucket for c in captures]
    if len(set(buckets)) != len(buckets) or len(buckets) < 3:
        raise ValueError(f"captures of three or more distinct buckets needed, got {buckets}")
    counts = {len(c.nodes) for c in captures}
    if len(counts) != 1:
        raise NotRelocatable(f"captures of {sorted(counts)} nodes")
    steps: dict[tuple[int, int], int] = {}
    for i, nodes in enumerate(zip(*(c.nodes for c in captures), strict=True)):
        first = nodes[0]
        shape = (first.kind, first.fixed, len(first.args), first.foreign)
        if any((n.kind, n.fixed, len(n.args), n.foreign) != shape for n in nodes):
            raise NotRelocatable(f"node {i} (type {first.kind}) differs beyond its arguments")
        for j, raw in enumerate(zip(*(n.args for n in nodes), strict=True)):
            size = len(raw[0])
            if len(set(raw)) == 1:
                continue
            if any(len(x) != size for x in raw):
                raise NotRelocatable(f"node {i} argument {j}: sizes differ")
            values = [int.from_bytes(x, "little") for x in raw]
            where = [owner(v, c.owned) for v, c in zip(values, captures, strict=True)]
            if size == 8 and where[0] is not None and len(set(where)) == 1:
                continue  # the same place in each capture's own buffer
            step = _step(values, buckets, size) if size in (4, 8) else None
            kernel = first.kind == NODE_KERNEL
            if step is not None and kernel and (size == 4 or abs(step) < MAX_POINTER_STEP):
                steps[i, j] = step
            elif step is None and size == 8:
                continue  # a pool buffer the capture used: each graph keeps its own
            else:
                raise NotRelocatable(
                    f"node {i} (type {first.kind}) argument {j} ({size} bytes) takes "
                    f"{[hex(v) for v in values]} at buckets {buckets}"
                )
    return Relocation(steps)

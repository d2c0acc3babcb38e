"""The memory budget planner: what an engine of a compiled model needs, placed inside a budget.

``Engine(gpu_memory="4GiB", context_window=...)``, ``dsv2-mlc chat --gpu-memory`` and
``dsv2-mlc bench --gpu-memory`` plan before anything is loaded. The plan counts, in bytes:

* **weights (resident)**: every parameter but the routed experts (sizes from the build's
  ``random-params.json`` or its weight index ``params/tensor-cache.json``);
* **routed experts**: the MoE layers' stacked ``mlp.experts.*`` tensors (not the shared experts,
  not the router): in device memory when they fit, else in pinned host memory, read by the same
  kernels over PCIe (``Engine(experts="host")``), where they count nothing against the budget;
* **KV cache**: the engine's page pool, ``kv_capacity`` tokens plus one 16-token page per
  sequence of a full batch, at ``BuildConfig.kv_bytes_per_token()``;
* **workspace**: the activations of one prefill chunk or decode batch, ``fixed + per-token x
  chunk tokens + the float32 logits of every sequence``. The per-token figure is an analytic
  estimate from the model's widths (:func:`workspace_per_token`) times the device's
  ``workspace_scale``; a tight budget gets smaller prefill chunks (never below
  :data:`MIN_PREFILL_CHUNK`);
* **CUDA graphs** (CUDA builds with decode graphs) and **runtime overhead** (CUDA context, cuBLAS
  workspace, the library's kernels): constants of the device.

The device constants live in one table, :data:`DEVICE_MEMORY`; ``scripts/gpu_memory_calibration.py``
measures them on a GPU and prints the values to put there.

On a CPU build the "device" is host memory: the budget bounds what the engine allocates there
(weights, KV pages, workspace). The process itself (Python, the TVM runtime libraries) is not
counted (the CPU row's runtime overhead is 0), and the routed experts never move (they are in
host memory already).

The budget is planned, not enforced: TVM's allocator is not capped. An allocation that fails at
run time (TVM raises an error whose text has ``out of memory``) is reported with the plan's
breakdown (:func:`out_of_memory_error`). TVM's pooled allocator keeps freed buffers for reuse by
their exact size, so prompts of many different chunk lengths can leave more cached than one
chunk's workspace; it releases them and retries when the device itself runs out.

Pure arithmetic: no TVM, so CI checks it without a device.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import Dsv2Error
from ..layout import BuildConfig
from .placement import build_params, dtype_bytes, is_routed_expert, param_bytes

__all__ = [
    "DEVICE_MEMORY",
    "DeviceMemory",
    "MemoryBudgetError",
    "MemoryPlan",
    "ModelMemory",
    "budget_needed",
    "format_bytes",
    "is_out_of_memory",
    "longest_context",
    "out_of_memory_error",
    "parse_size",
    "plan_engine",
    "plan_memory",
    "reports_oom",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE_SIZE = 16  # tokens a KV page holds (the engine's PAGE_SIZE)
MIN_PREFILL_CHUNK = 512  # the smallest prefill chunk the planner picks
LOGITS_ITEMSIZE = 4  # the logits come back in float32
# decode steps of this many sequences and more run ``batch_decode_gemm`` (the engine's default
# ``gemm_decode_from``): its workspace holds a float copy of an INT4 lm_head. On the H200 at
# V2-Lite's shapes it beats the expert-major entry from 32 (3,471 against 2,890 tok/s; at 16:
# 2,019 against 2,054; docs/benchmarks.md, "Decode batches")
GEMM_DECODE_FROM = 32
# decode steps of this many sequences and more run ``batch_decode_swap`` where the build has it
# (sm_90: the routed experts as grouped GEMMs with the weights as the MMA's M; the engine's
# default ``swap_decode_from``; its workspace is the GEMM path's). On the H200 at V2-Lite's
# shapes (scripts/gpu_large_batches.py, tok/s against batch_decode_gemm): 9,442 / 8,731 at 128,
# 10,236 / 9,172 at 160, 16,350 / 12,527 at 256; at 64 it was slower (5,237 / 6,011)
SWAP_DECODE_FROM = 128


class MemoryBudgetError(Dsv2Error, ValueError):
    """A memory budget that cannot hold the request (the message gives the breakdown and what
    would fit), a size that does not parse, or an allocation that failed inside a plan."""


@dataclass(frozen=True)
class DeviceMemory:
    """The constants of one device kind (bytes, except ``workspace_scale``).

    ``runtime_overhead``: the CUDA context, cuBLAS's workspace and handle, the library's kernels
    and the KV cache's auxiliary arrays; ``workspace_fixed``: the part of a model call's
    workspace that does not grow with its tokens; ``workspace_scale``: the measured per-token
    workspace over :func:`workspace_per_token`'s estimate; ``cuda_graphs``: the decode graphs
    and their static buffers; ``source``: where the figures come from."""

    runtime_overhead: int
    workspace_fixed: int
    workspace_scale: float
    cuda_graphs: int
    source: str


DEVICE_MEMORY: dict[str, DeviceMemory] = {
    # Measured on the H200 (V2-Lite q4f16_g128, scripts/gpu_memory_calibration.py, raw in
    # docs/bench-results/memory/): the CUDA context 527 MiB before anything loads, and ~380 MiB
    # more once a model is loaded beyond its weights and KV pages (cuBLAS, the cache's auxiliary
    # arrays, module images). A prefill chunk's workspace peaked at 413 / 568 / 1,005 / 1,883 MB
    # for 1,024 / 2,048 / 4,096 / 8,192 tokens: a fixed part (the float copies of the INT4
    # weights that prefill multiplies on cuBLAS, pooled by size) and ~205 KB a token, 1.70x
    # workspace_per_token's estimate. The constants cover the 1K and 8K points and overestimate
    # 2K and 4K by <= 60 MB (a plan with no fixed part under-counted a 131,072-token prompt in
    # 1,024-token chunks by 136 MB: 4.11 GiB measured against 3.99 planned). The decode graphs'
    # buffers are inside those peaks; cuda_graphs is kept as a margin. With the dense layer's
    # MLP read packed by the grouped GEMMs (no 134 MB float copy of it) the fixed part measured
    # 95 MiB (FP8-cache build; the same run: runtime overhead 837 MiB, 1.575x the estimate a
    # token); the larger overhead and scale of the first calibration are kept.
    "cuda": DeviceMemory(
        runtime_overhead=908 * MiB,
        workspace_fixed=95 * MiB,
        workspace_scale=1.70,
        cuda_graphs=64 * MiB,
        source="measured on an H200 (V2-Lite INT4)",
    ),
    "cpu": DeviceMemory(
        runtime_overhead=0,
        workspace_fixed=16 * MiB,
        workspace_scale=1.0,
        cuda_graphs=0,
        source="estimate; the process itself is not counted",
    ),
}


# -- sizes -----------------------------------------------------------------------------------------
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "ki": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mi": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gi": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | str) -> int:
    """Bytes of a size: an int (bytes) or text such as ``"4GiB"``, ``"4.5G"``, ``"3500MiB"``,
    ``"4096"``. K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; KB, MB, GB, TB powers of
    1000 (case does not matter)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise MemoryBudgetError(
            f"a memory size must be bytes (int) or text like '4GiB', got {value!r}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise MemoryBudgetError(f"a memory size must be positive, got {value}")
        return value
    match = _SIZE.fullmatch(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise MemoryBudgetError(
            f"cannot read {value!r} as a memory size; write a number with a unit, e.g. 4GiB, "
            "4.5G, 3500MiB (K/M/G/T and KiB/MiB/GiB/TiB: powers of 1024; KB/MB/GB/TB: of 1000)"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise MemoryBudgetError(f"a memory size must be positive, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB (two decimals), or MiB / KiB below one GiB / MiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# -- what a build needs ----------------------------------------------------------------------------
def workspace_per_token(model: dict[str, Any], dtype: str) -> int:
    """Estimated activation bytes one token of a prefill chunk holds, from the model's widths:
    the residual stream and its normed copies (4 x hidden), the attention's projections
    (the q / kv-a output, the normed latent with its rotated rope part, per-head q, decompressed
    k and v, the heads' output) and the widest MLP (the
    dense MLP's gate, up and activation, or top-k routed experts' gate, up, activation and
    outputs before they are summed), all of ``dtype``. TVM's pooled allocator keeps the
    attention's and the MLP's buffers both, so they add."""
    h = int(model["hidden_size"])
    heads = int(model["num_attention_heads"])
    nope, rope, v = (int(model[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    latent = int(model["kv_lora_rank"]) + rope
    q_lora = model.get("q_lora_rank") or 0
    q_a = int(q_lora) if q_lora else heads * (nope + rope)
    attention = q_a + 2 * latent + heads * (2 * (nope + rope) + 2 * v)
    dense = 3 * int(model["intermediate_size"])
    top_k = int(model.get("num_experts_per_tok") or 0)
    routed = top_k * (3 * int(model.get("moe_intermediate_size") or 0) + h)
    return (4 * h + attention + max(dense, routed)) * dtype_bytes(dtype)


@dataclass(frozen=True)
class ModelMemory:
    """What an engine of one compiled model needs, apart from the plan's choices."""

    device: str
    resident_bytes: int  # every parameter but the routed experts
    routed_expert_bytes: int
    kv_bytes_per_token: int
    workspace_per_token: int  # the analytic estimate (before the device's workspace_scale)
    logits_bytes_per_sequence: int
    max_context: int
    # the float copy of an INT4 lm_head that a large-batch decode step multiplies (0: none)
    lm_head_copy_bytes: int = 0

    @classmethod
    def from_params(
        cls, build: BuildConfig, params: Iterable[tuple[str, Sequence[int], str]]
    ) -> ModelMemory:
        """From the build config and its parameters ``(name, shape, dtype)``."""
        resident = experts = lm_head = 0
        for name, shape, dtype in params:
            if name == "lm_head.q_weight":  # packed INT4: 8 values a 32-bit word
                lm_head = param_bytes(shape, dtype) // 4 * 8 * dtype_bytes(build.dtype)
            if is_routed_expert(name):
                experts += param_bytes(shape, dtype)
            else:
                resident += param_bytes(shape, dtype)
        model = build.model
        return cls(
            device=build.device,
            resident_bytes=resident,
            routed_expert_bytes=experts,
            kv_bytes_per_token=build.kv_bytes_per_token(),
            workspace_per_token=workspace_per_token(model, build.dtype),
            logits_bytes_per_sequence=int(model["vocab_size"]) * LOGITS_ITEMSIZE,
            max_context=int(model["max_position_embeddings"]),
            lm_head_copy_bytes=lm_head,
        )

    @classmethod
    def from_build(cls, build_dir: str | Path, build: BuildConfig | None = None) -> ModelMemory:
        """From a compiled folder (nothing but its JSON files read)."""
        build = build or BuildConfig.read(build_dir)
        return cls.from_params(build, build_params(build_dir))


# -- the plan --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """A placement inside ``budget``: the engine options it chose and the bytes of each part."""

    budget: int
    device: str
    context_window: int
    max_batch_size: int
    kv_capacity: int
    prefill_chunk_size: int
    experts: str  # "gpu": routed experts in device memory; "host": in pinned host memory
    weights: int  # resident weights (+ the routed experts when experts == "gpu")
    host_experts: int  # routed-expert bytes in host memory (not counted against the budget)
    kv_cache: int
    workspace: int
    cuda_graphs: int
    runtime_overhead: int
    constants_source: str = ""

    @property
    def total(self) -> int:
        """Bytes counted against the budget."""
        return (
            self.weights + self.kv_cache + self.workspace + self.cuda_graphs + self.runtime_overhead
        )

    @property
    def fits(self) -> bool:
        """Whether the total is within the budget."""
        return self.total <= self.budget

    def components(self) -> list[tuple[str, int]]:
        """(component, bytes) counted against the budget, in the order of the table."""
        rows = [
            (
                f"weights ({'with' if self.experts == 'gpu' else 'without'} the routed experts)",
                self.weights,
            ),
            (f"KV cache ({self.kv_capacity:,} tokens)", self.kv_cache),
            (f"workspace (prefill chunks of {self.prefill_chunk_size:,})", self.workspace),
        ]
        if self.cuda_graphs:
            rows.append(("CUDA graphs", self.cuda_graphs))
        rows.append(("runtime overhead", self.runtime_overhead))
        return rows

    def table(self) -> str:
        """The plan as a small text table (component, bytes)."""
        unit = "GPU" if self.device == "cuda" else "host (CPU build)"
        lines = [
            f"memory plan: budget {format_bytes(self.budget)} of {unit} memory, context "
            f"{self.context_window:,} x batch {self.max_batch_size}"
        ]
        rows = self.components() + [("total", self.total)]
        width = max(len(name) for name, _ in rows)
        for name, n in rows:
            lines.append(f"  {name:<{width}}  {format_bytes(n):>11}  {n:>15,} B")
        if self.experts == "host":
            lines.append(
                f"  routed experts in pinned host memory: {format_bytes(self.host_experts)} "
                "(not counted; read over PCIe)"
            )
        lines.append(f"  constants: {self.constants_source}")
        return "\n".join(lines)

    def breakdown(self) -> str:
        """One sentence: weights, KV at context, workspace, overhead; total vs budget."""
        experts = (
            f" (routed experts in host memory: {format_bytes(self.host_experts)})"
            if self.experts == "host"
            else ""
        )
        graphs = f", CUDA graphs {format_bytes(self.cuda_graphs)}" if self.cuda_graphs else ""
        return (
            f"weights {format_bytes(self.weights)}{experts}, KV {format_bytes(self.kv_cache)} at "
            f"context {self.context_window:,} x batch {self.max_batch_size}, workspace "
            f"{format_bytes(self.workspace)} (prefill chunks of {self.prefill_chunk_size:,})"
            f"{graphs}, runtime overhead {format_bytes(self.runtime_overhead)}; total "
            f"{format_bytes(self.total)} vs budget {format_bytes(self.budget)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (bench reports carry it)."""
        return {
            "budget": self.budget,
            "device": self.device,
            "context_window": self.context_window,
            "max_batch_size": self.max_batch_size,
            "kv_capacity": self.kv_capacity,
            "prefill_chunk_size": self.prefill_chunk_size,
            "experts": self.experts,
            "weights": self.weights,
            "host_experts": self.host_experts,
            "kv_cache": self.kv_cache,
            "workspace": self.workspace,
            "cuda_graphs": self.cuda_graphs,
            "runtime_overhead": self.runtime_overhead,
            "total": self.total,
            "constants_source": self.constants_source,
        }


def kv_pool_bytes(model: ModelMemory, kv_capacity: int, max_batch_size: int) -> int:
    """Bytes of the engine's page pool: ``kv_capacity`` tokens plus a page per sequence of a
    full batch, in whole pages."""
    pages = -(-(kv_capacity + PAGE_SIZE * max_batch_size) // PAGE_SIZE)
    return pages * PAGE_SIZE * model.kv_bytes_per_token


def workspace_bytes(
    model: ModelMemory, chunk: int, max_batch_size: int, constants: DeviceMemory
) -> int:
    """Workspace of a prefill chunk of ``chunk`` tokens (a decode batch takes fewer tokens), and
    from :data:`GEMM_DECODE_FROM` sequences the large-batch decode step's float copy of an INT4
    lm_head."""
    per_token = model.workspace_per_token * constants.workspace_scale
    logits = max_batch_size * model.logits_bytes_per_sequence
    gemm = model.lm_head_copy_bytes if max_batch_size >= GEMM_DECODE_FROM else 0
    return int(constants.workspace_fixed + per_token * chunk + logits + gemm)


def _chunks(default_chunk: int, kv_capacity: int) -> list[int]:
    """The prefill chunks to try, largest first: the default halved down to
    :data:`MIN_PREFILL_CHUNK` (each at most ``kv_capacity``, as the engine caps it)."""
    sizes, c = [], default_chunk
    while True:
        sizes.append(min(c, kv_capacity))
        if c // 2 < MIN_PREFILL_CHUNK:
            break
        c //= 2
    return list(dict.fromkeys(sizes))


def _layout(
    model: ModelMemory,
    budget: int,
    context_window: int,
    max_batch_size: int,
    kv_capacity: int,
    chunk: int,
    experts: str,
    cuda_graph: bool,
    constants: DeviceMemory,
) -> MemoryPlan:
    on_host = experts == "host"
    return MemoryPlan(
        budget=budget,
        device=model.device,
        context_window=context_window,
        max_batch_size=max_batch_size,
        kv_capacity=kv_capacity,
        prefill_chunk_size=chunk,
        experts=experts,
        weights=model.resident_bytes + (0 if on_host else model.routed_expert_bytes),
        host_experts=model.routed_expert_bytes if on_host else 0,
        kv_cache=kv_pool_bytes(model, kv_capacity, max_batch_size),
        workspace=workspace_bytes(model, chunk, max_batch_size, constants),
        cuda_graphs=constants.cuda_graphs if cuda_graph and model.device == "cuda" else 0,
        runtime_overhead=constants.runtime_overhead,
        constants_source=constants.source,
    )


def _candidates(
    model: ModelMemory,
    budget: int,
    context_window: int,
    max_batch_size: int,
    kv_capacity: int | None,
    prefill_chunk_size: int | None,
    experts: str | None,
    default_chunk: int,
    cuda_graph: bool,
    constants: DeviceMemory,
) -> list[MemoryPlan]:
    """Every layout the plan may choose, best first: routed experts in device memory before
    host memory, larger prefill chunks before smaller ones. The last is the smallest."""
    capacity = kv_capacity or context_window * max_batch_size
    if experts is not None:
        places = [experts]
    elif model.device == "cuda" and model.routed_expert_bytes:
        places = ["gpu", "host"]
    else:
        places = ["gpu"]  # a CPU build's experts are in host memory already
    chunks = [prefill_chunk_size] if prefill_chunk_size else _chunks(default_chunk, capacity)
    return [
        _layout(
            model, budget, context_window, max_batch_size, capacity, c, place, cuda_graph, constants
        )  # fmt: skip
        for place in places
        for c in chunks
    ]


def plan_memory(
    model: ModelMemory,
    budget: int | str,
    context_window: int,
    max_batch_size: int = 1,
    *,
    kv_capacity: int | None = None,
    prefill_chunk_size: int | None = None,
    experts: str | None = None,
    default_chunk: int = 8192,
    cuda_graph: bool = True,
    constants: DeviceMemory | None = None,
) -> MemoryPlan:
    """Place an engine of ``context_window`` x ``max_batch_size`` tokens (or ``kv_capacity``)
    inside ``budget``: the routed experts in device memory if they fit, else in host memory
    (unless ``experts`` says where); the largest prefill chunk from ``default_chunk`` halved down
    to :data:`MIN_PREFILL_CHUNK` that fits (unless ``prefill_chunk_size`` is given).

    Raises :class:`MemoryBudgetError` when even the smallest layout exceeds the budget; its
    message gives that layout's breakdown, the longest context the budget holds and the budget
    the request needs."""
    budget = parse_size(budget)
    if experts not in (None, "gpu", "host"):
        raise MemoryBudgetError(f"experts={experts!r}: use 'gpu' or 'host'")
    constants = constants or DEVICE_MEMORY[model.device]
    args = (kv_capacity, prefill_chunk_size, experts, default_chunk, cuda_graph, constants)
    layouts = _candidates(model, budget, context_window, max_batch_size, *args)
    for layout in layouts:
        if layout.fits:
            return layout
    smallest = layouts[-1]
    longest = longest_context(model, budget, max_batch_size, *args[1:])
    needed = budget_needed(model, context_window, max_batch_size, *args)
    default = kv_capacity in (None, context_window * max_batch_size)
    tokens = "tokens" if default else f"tokens (a KV cache of {kv_capacity:,})"
    if longest == 0:
        holds = "this budget holds no context at all at this batch size"
    elif longest >= model.max_context:
        holds = f"this budget holds the model's longest context, {model.max_context:,} tokens"
    else:
        holds = f"this budget holds at most {longest:,} tokens of context x batch {max_batch_size}"
    raise MemoryBudgetError(
        f"a budget of {format_bytes(budget)} cannot hold a context of {context_window:,} {tokens}"
        f" x batch {max_batch_size}: {smallest.breakdown()}. {holds[0].upper()}{holds[1:]}; "
        f"{context_window:,} tokens need a budget of at least {format_bytes(needed)} "
        f"({needed:,} B)"
    )


def budget_needed(
    model: ModelMemory,
    context_window: int,
    max_batch_size: int = 1,
    kv_capacity: int | None = None,
    prefill_chunk_size: int | None = None,
    experts: str | None = None,
    default_chunk: int = 8192,
    cuda_graph: bool = True,
    constants: DeviceMemory | None = None,
) -> int:
    """The smallest budget that holds the request (its smallest layout's total)."""
    constants = constants or DEVICE_MEMORY[model.device]
    return _candidates(
        model, 0, context_window, max_batch_size, kv_capacity, prefill_chunk_size, experts,
        default_chunk, cuda_graph, constants,
    )[-1].total  # fmt: skip


def longest_context(
    model: ModelMemory,
    budget: int | str,
    max_batch_size: int = 1,
    prefill_chunk_size: int | None = None,
    experts: str | None = None,
    default_chunk: int = 8192,
    cuda_graph: bool = True,
    constants: DeviceMemory | None = None,
) -> int:
    """The longest context window (per sequence, at ``max_batch_size``) whose smallest layout
    fits ``budget``, at most the model's ``max_position_embeddings``; 0 if none does."""
    budget = parse_size(budget)
    constants = constants or DEVICE_MEMORY[model.device]

    def fits(context: int) -> bool:
        need = budget_needed(
            model, context, max_batch_size, None, prefill_chunk_size, experts, default_chunk,
            cuda_graph, constants,
        )  # fmt: skip
        return need <= budget

    low, high = 0, model.max_context
    if fits(high):
        return high
    while high - low > 1:  # fits(low) or low == 0; not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def with_constants(device: str, **values: Any) -> DeviceMemory:
    """The table's constants of ``device`` with ``values`` replaced (calibration, tests)."""
    return replace(DEVICE_MEMORY[device], **values)


# -- out of memory at run time ---------------------------------------------------------------------
# TVM's CUDA allocator raises with cudaGetErrorString's text ("CUDA: out of memory"; tvm_ffi's
# CUDA checks say "cudaErrorMemoryAllocation"); its CPU allocator throws std::bad_alloc.
_OOM_TEXT = ("out of memory", "cudaErrorMemoryAllocation", "bad_alloc")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation (TVM's runtime error text, or MemoryError)."""
    if isinstance(err, MemoryError):
        return True
    text = str(err)
    return any(t.lower() in text.lower() for t in _OOM_TEXT)


def out_of_memory_error(plan: MemoryPlan, err: BaseException) -> MemoryBudgetError:
    """The :class:`MemoryBudgetError` of an allocation that failed inside ``plan``."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return MemoryBudgetError(
        f"out of memory inside the memory plan ({first}); the plan: {plan.breakdown()}. Raise "
        "the budget, shorten the context, or give the device more free memory (other processes "
        "may hold some)"
    )


def reports_oom(method: Callable) -> Callable:
    """An engine method whose failed allocation, inside the engine's ``memory_plan``, is reported
    as a :class:`MemoryBudgetError` giving the plan's breakdown (other errors pass unchanged)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as err:
            plan = getattr(self, "memory_plan", None)
            if plan is None or isinstance(err, Dsv2Error) or not is_out_of_memory(err):
                raise
            raise out_of_memory_error(plan, err) from err

    return call


def plan_engine(
    path: str | Path,
    build: BuildConfig,
    gpu_memory: int | str,
    context_window: int,
    max_batch_size: int,
    kv_capacity: int | None,
    prefill_chunk_size: int | None,
    default_chunk: int,
    cuda_graph: bool,
    experts: str | None = None,
) -> MemoryPlan:
    """The plan of ``Engine(gpu_memory=...)`` for the compiled folder ``path`` (its options
    already checked); a plan with the routed experts in host memory needs an engine that can put
    them there."""
    model = ModelMemory.from_build(path, build)
    plan = plan_memory(
        model,
        gpu_memory,
        context_window,
        max_batch_size,
        kv_capacity=kv_capacity,
        prefill_chunk_size=prefill_chunk_size,
        default_chunk=default_chunk,
        cuda_graph=cuda_graph,
        experts=experts,
    )
    return plan

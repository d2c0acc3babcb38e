"""Where the weights live: which parameters are routed experts, and the bytes on each side.

``Engine(experts="host")`` keeps the routed experts' weights (every MoE layer's stacked
``mlp.experts.*`` tensors; not the shared experts, not the router) in pinned host memory that
the GPU reads over PCIe (:mod:`dsv2_mlc.runtime.host_memory`); everything else stays in device
memory. This module is the arithmetic of that split, with no runtime library needed: the memory
planner sizes a GPU budget from it without opening an engine.

* :func:`is_routed_expert`: whether a parameter name is a routed expert's weight;
* :func:`weight_bytes`: ``(gpu_bytes, host_bytes)`` of a list of ``(name, shape, dtype)``
  under a placement;
* :func:`build_params`: that list for a compiled folder (from ``random-params.json`` or the
  weight index ``params/tensor-cache.json``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..layout import PARAMS_DIR, SPEC_FILE, BuildError, has_spec, read_spec

__all__ = [
    "EXPERT_PLACEMENTS",
    "build_params",
    "dtype_bytes",
    "is_routed_expert",
    "param_bytes",
    "placed_bytes",
    "weight_bytes",
]

EXPERT_PLACEMENTS = ("gpu", "host")
"""``Engine(experts=...)``: ``"gpu"`` every weight in device memory; ``"host"`` the routed
experts in pinned host memory, read by the same kernels over PCIe (zero-copy)."""

# ``model.layers.N.mlp.experts.<tensor>``: the stacked routed experts of a MoE layer (float:
# gate_up_proj / down_proj; INT4: gate_up_q_weight, gate_up_q_scale, down_q_*). The shared
# experts are ``mlp.shared_experts.*`` and the router ``mlp.gate.*``: neither matches.
_ROUTED = re.compile(r"(?:^|\.)experts\.[^.]+$")

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
}


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` is a routed expert weight (``...mlp.experts.<tensor>``)."""
    return _ROUTED.search(name) is not None


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype``."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown parameter dtype {dtype!r}")
    return _DTYPE_BYTES[dtype]


def param_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of one parameter of ``shape`` and ``dtype``."""
    return math.prod(int(s) for s in shape) * dtype_bytes(dtype)


def check_placement(experts: str) -> str:
    """``experts`` if it is a placement of :data:`EXPERT_PLACEMENTS`; ValueError otherwise."""
    if experts not in EXPERT_PLACEMENTS:
        raise ValueError(
            f"experts={experts!r}: use one of {', '.join(EXPERT_PLACEMENTS)} (where the routed "
            "experts' weights live)"
        )
    return experts


def weight_bytes(
    params: Iterable[tuple[str, Sequence[int], str]], experts: str = "gpu"
) -> tuple[int, int]:
    """``(gpu_bytes, host_bytes)`` of the weights ``params`` (name, shape, dtype) with the routed
    experts placed on ``experts`` (``"gpu"``: host_bytes is 0)."""
    check_placement(experts)
    gpu = host = 0
    for name, shape, dtype in params:
        n = param_bytes(shape, dtype)
        if experts == "host" and is_routed_expert(name):
            host += n
        else:
            gpu += n
    return gpu, host


def placed_bytes(named: Iterable[tuple[str, Any]], host: Collection[str]) -> dict[str, int]:
    """``{"gpu": n, "host": n}``: bytes of the tensors ``named`` (name, tensor with ``shape`` and
    ``dtype``) whose names are in ``host`` and of the others."""
    sizes = {"gpu": 0, "host": 0}
    for name, t in named:
        sizes["host" if name in host else "gpu"] += param_bytes(t.shape, str(t.dtype))
    return sizes


def build_params(path: str | Path) -> list[tuple[str, tuple[int, ...], str]]:
    """Every parameter (name, shape, dtype) of the compiled folder ``path``, in the compiled
    order: from ``random-params.json`` for a config-only build, else from the weight index."""
    path = Path(path)
    if has_spec(path):
        return [(p.name, tuple(p.shape), p.dtype) for p in read_spec(path)]
    index = path / PARAMS_DIR / "tensor-cache.json"
    if not index.is_file():
        raise BuildError(f"{path}: neither {SPEC_FILE} nor {PARAMS_DIR}/tensor-cache.json")
    records = weight_records(index)
    return [(r["name"], tuple(int(s) for s in r["shape"]), str(r["dtype"])) for r in records]


def weight_records(index: Path) -> list[dict]:
    """Every tensor record of the weight index ``index`` (``tensor-cache.json``), each with its
    shard's path (``dataPath``, relative to the index's folder) added."""
    try:
        shards = json.loads(index.read_bytes())["records"]
        return [{**t, "dataPath": s["dataPath"]} for s in shards for t in s["records"]]
    except (ValueError, KeyError, TypeError) as err:
        raise BuildError(f"{index}: damaged weight index ({err}); compile the model again") from err

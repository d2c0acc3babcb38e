"""Helpers of the GPU lane (tests/gpu): options, the GPU probe, the builds, HF references.

Pure parts (option resolution, the manifest) are also tested on the CPU
(tests/test_gpu_lane.py); everything that opens a build needs the GPU machine.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for _folder in (ROOT / "scripts", ROOT / "tests", ROOT):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as the module ``name`` (its ``main`` is not run)."""
    return importlib.import_module(name)


BUILDS_ENV = "DSV2_GPU_LANE_BUILDS"  # the builds folder, where --builds is not given
LIB_DIR_ENV = "DSV2_MLC_TVM_LIB_DIR"  # the runtime's own variable (runtime/tvm_runtime.py)
lane = script("gpu_lane")


@dataclass(frozen=True)
class LaneOptions:
    """Where the builds and the TVM runtime libraries are (None: not given)."""

    builds: Path | None
    lib_dir: str | None


def resolve_options(
    builds: str | None, lib_dir: str | None, environ: dict[str, str] | None = None
) -> LaneOptions:
    """``--builds`` / ``--lib-dir``, else ``$DSV2_GPU_LANE_BUILDS`` / ``$DSV2_MLC_TVM_LIB_DIR``."""
    env = os.environ if environ is None else environ
    builds = builds or env.get(BUILDS_ENV) or None
    lib_dir = lib_dir or env.get(LIB_DIR_ENV) or None
    return LaneOptions(Path(builds).resolve() if builds else None, lib_dir)


def lane_build(manifest: Any, tag: str) -> Any:
    """The build ``tag`` of the manifest (a ``gpu_lane.LaneBuild``); skips the test where it
    was not prepared."""
    import pytest

    try:
        return manifest.build(tag)
    except lane.ManifestError as err:
        pytest.skip(str(err))


def cuda_devices(lib_dir: str | None) -> tuple[int, str]:
    """(number of CUDA devices, why none) through the project's runtime: the TVM CUDA runtime
    loaded as an engine loads it, then ``cudaGetDeviceCount`` of the ``libcudart`` it uses."""
    from dsv2_mlc.runtime.cudart import CudaRuntime
    from dsv2_mlc.runtime.tvm_runtime import RuntimeLibraryError, load_runtime

    try:
        load_runtime("cuda", lib_dir)
        lib = CudaRuntime().lib
    except (RuntimeLibraryError, RuntimeError, OSError) as err:
        return 0, f"the TVM CUDA runtime does not load ({str(err).splitlines()[0]})"
    count = ctypes.c_int(0)
    err = lib.cudaGetDeviceCount(ctypes.byref(count))
    if err != 0:
        return 0, f"cudaGetDeviceCount: {lib.cudaGetErrorString(err).decode()} (cudaError {err})"
    if count.value == 0:
        return 0, "cudaGetDeviceCount: 0 devices"
    return count.value, ""


def gpu_properties() -> dict[str, str]:
    """The GPU's name and the driver's CUDA version, for the report (after :func:`cuda_devices`
    found one)."""
    from dsv2_mlc.runtime.cudart import CudaRuntime

    lib = CudaRuntime().lib
    version = ctypes.c_int(0)
    lib.cudaDriverGetVersion(ctypes.byref(version))
    props = {"cuda_driver_api": f"{version.value // 1000}.{version.value % 1000 // 10}"}
    try:
        import torch

        props["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the name is informational
        props["gpu"] = "unknown"
    return props


# -- the tiny configs against HF float32 -----------------------------------------------------------
refs_script = script("make_gpu_refs")  # the references of scripts/gpu_numerics.py
numerics = script("gpu_numerics")  # the measurements of one tiny build
PROMPT, NEW_TOKENS = refs_script.PROMPT, refs_script.NEW_TOKENS
MIN_ROUTING_MARGIN = refs_script.MIN_ROUTING_MARGIN  # softmax probability
SEED_TRIES = 20


@dataclass
class TinyReference:
    """The HF float32 model on a build's random weights of ``seed`` and its routing margin."""

    seed: int
    model: Any
    margin: float
    tried: int


def well_routed_reference(build: Path, lib_dir: str | None) -> TinyReference:
    """HF float32 on the random weights of the first seed (0, 1, ...) whose routing over
    :data:`PROMPT` and its greedy continuation has no decision closer than
    :data:`MIN_ROUTING_MARGIN`: below it an fp16 build's rounding may pick the other expert and
    no comparison of logits means anything (scripts/make_gpu_refs.py picks its checkpoints so)."""
    from hf_reference import hf_greedy, routing_margin

    from dsv2_mlc.hf_export import load_into_hf
    from dsv2_mlc.runtime.engine import Engine

    best = (-1, -1.0)
    for seed in range(SEED_TRIES):
        engine = Engine(build, context_window=256, max_batch_size=1, lib_dir=lib_dir,
                        random_weights=seed, cuda_graph=False)  # fmt: skip
        model = load_into_hf(engine, device="cpu", dtype="float32")
        del engine
        margin = routing_margin(model, PROMPT + hf_greedy(model, PROMPT, NEW_TOKENS))
        if margin >= MIN_ROUTING_MARGIN:
            return TinyReference(seed, model, margin, seed + 1)
        best = max(best, (seed, margin), key=lambda b: b[1])
    raise AssertionError(
        f"no seed in [0, {SEED_TRIES}) routes the prompt with a margin >= {MIN_ROUTING_MARGIN} "
        f"(best: seed {best[0]}, {best[1]:.1e})"
    )


def near_ties(ref: np.ndarray, bound: float) -> np.ndarray:
    """Rows (last axis: vocabulary) whose two largest reference logits are within ``bound``:
    an error below ``bound / 2`` may flip their arg-max."""
    top2 = np.sort(ref, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]) <= bound

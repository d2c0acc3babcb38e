"""The GPU lane: pytest options ``--builds`` and ``--lib-dir``, the GPU probe, the builds.

Every test here carries the marker ``gpu`` (deselected by default; ``-m gpu`` selects them). A
session fixture probes for a CUDA device through the project's runtime (the TVM CUDA runtime
loaded as an engine loads it, then ``cudaGetDeviceCount``): without one, every test is skipped
with the reason. Without ``--builds`` (or ``$DSV2_GPU_LANE_BUILDS``) the tests that need a build
are skipped too. The device command and the carry list: tests/gpu/README.md.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lane_helpers import (  # noqa: E402
    LaneOptions,
    cuda_devices,
    gpu_properties,
    lane,
    lane_build,
    resolve_options,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu lane (tests/gpu)")
    group.addoption(
        "--builds",
        default=None,
        help="folder of `scripts/gpu_lane.py prepare` (or $DSV2_GPU_LANE_BUILDS)",
    )
    group.addoption("--lib-dir", default=None,
                    help="folder of libtvm_runtime*.so (or $DSV2_MLC_TVM_LIB_DIR)")  # fmt: skip


@pytest.fixture(scope="session")
def lane_options(request: pytest.FixtureRequest) -> LaneOptions:
    get = request.config.getoption
    return resolve_options(get("--builds", default=None), get("--lib-dir", default=None))


@pytest.fixture(scope="session", autouse=True)
def cuda_gpu(lane_options: LaneOptions, record_testsuite_property) -> int:  # noqa: ANN001
    """The number of CUDA devices; skips every test of the lane where there is none."""
    count, why = cuda_devices(lane_options.lib_dir)
    if count == 0:
        pytest.skip(f"no CUDA GPU: {why}")
    for key, value in gpu_properties().items():
        record_testsuite_property(key, value)
    return count


@pytest.fixture(scope="session")
def manifest(lane_options: LaneOptions, record_testsuite_property):  # noqa: ANN001, ANN201
    """The prepared builds (``scripts/gpu_lane.py prepare``); skips without them."""
    if lane_options.builds is None:
        pytest.skip("no builds: give --builds DIR (scripts/gpu_lane.py prepare --out DIR)")
    try:
        found = lane.read_manifest(lane_options.builds)
    except lane.ManifestError as err:
        pytest.skip(str(err))
    record_testsuite_property("builds_commit", found.commit)
    modified = found.data.get("modified_files", [])
    record_testsuite_property("builds_modified_files", str(len(modified)))
    return found


@pytest.fixture(scope="session")
def lib_dir(lane_options: LaneOptions) -> str | None:
    return lane_options.lib_dir


@pytest.fixture(scope="session")
def v2_lite(manifest):  # noqa: ANN001, ANN201
    """The V2-Lite ``q4f16_g128`` build (random weights)."""
    return lane_build(manifest, lane.V2_LITE)


@pytest.fixture(autouse=True)
def _release_device_memory():  # noqa: ANN202
    """After each test, collect its engines and models, so the next one has the GPU's memory."""
    yield
    gc.collect()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

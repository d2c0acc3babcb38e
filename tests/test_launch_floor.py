"""The standalone GPU benchmarks behind docs/benchmarks.md (``schedules/lab/launch_floor.cu``: a
chain
of dependent kernels; ``schedules/lab/cluster_floor.cu``: the same chain with cluster
barriers;
``schedules/lab/l2_stream_floor.cu``: the chain with its weights streamed into L2 ahead) still
compile
for sm_90; they run on the GPU machine only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402

LAB = Path(__file__).resolve().parents[1] / "schedules" / "lab"
pytestmark = pytest.mark.lab


@needs_nvcc
@pytest.mark.parametrize("name", ["launch_floor.cu", "cluster_floor.cu", "l2_stream_floor.cu"])
def test_floor_benchmark_compiles_for_sm90(tmp_path: Path, name: str) -> None:
    out = tmp_path / "floor.o"
    run = subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90", "-c", str(LAB / name), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0

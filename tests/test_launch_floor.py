"""``scripts/launch_floor.cu`` (the GPU benchmark of a chain of dependent kernels behind
docs/benchmarks.md) still compiles for sm_90; it runs on the GPU machine only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "scripts" / "launch_floor.cu"


@needs_nvcc
def test_launch_floor_compiles_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "launch_floor.o"
    run = subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90", "-c", str(SOURCE), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0

"""The expert-offload floor study (schedules/lab/expert_offload/): the CUDA program compiles for
sm_90 (it runs on the GPU machine only); the host-side INT4 expert GEMV builds and, run here on
one layer's worth of cores, agrees with its float64 reference."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402

LAB = Path(__file__).resolve().parents[1] / "schedules" / "lab" / "expert_offload"
pytestmark = pytest.mark.lab


@needs_nvcc
def test_pcie_floor_compiles_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "pcie_floor.o"
    run = subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90", "-c", str(LAB / "pcie_floor.cu"), "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_host_gemv_matches_its_float64_reference(tmp_path: Path) -> None:
    binary = tmp_path / "host_gemv"
    cmd = ["g++", "-O3", "-march=x86-64-v3", "-fopenmp", "-o", str(binary),
           str(LAB / "host_gemv.cpp")]  # fmt: skip
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["token_bytes"] == 26 * 6 * 4_460_544
    assert report["check_max_rel_err"] < 1e-4

"""The V2-Lite build's device arg-max, its cuBLAS shim and overlapped greedy generation.

scripts/gpu_argmax_check.py (``greedy_tokens`` on crafted logits: ties, NaNs, infinities,
signed zeros, rows past the ticket counters, against ``np.argmax``), scripts/gpu_cublas_check.py
(``dsv2.cublas.gemm_nt`` against torch over a shape sweep, bad calls refused) and
scripts/gpu_generate_overlap.py (``Engine.stream`` with and without overlapped steps: the same
tokens).
"""

from __future__ import annotations

import pytest
from lane_helpers import script

pytestmark = pytest.mark.gpu


def test_device_argmax_equals_numpy(v2_lite, lib_dir):
    report = script("gpu_argmax_check").check(str(v2_lite.path), lib_dir, repeat=5)
    assert len(report["cases"]) == 21
    wrong = [c for c in report["cases"] if c["wrong"]]
    assert report["wrong"] == 0, wrong


def test_cublas_gemm_matches_torch(v2_lite, lib_dir):
    if v2_lite.gemm != "cublas":
        pytest.skip(f"the V2-Lite build's prefill GEMMs are {v2_lite.gemm!r}, not cuBLAS")
    report = script("gpu_cublas_check").check(str(v2_lite.path), lib_dir, timing=False)
    bad = [c for c in report["cases"] if not c["ok"]]
    assert report["failures"] == 0, {"cases": bad[:5], "bad calls accepted": report["errors"]}
    assert all(report["errors"].values()), report["errors"]  # every bad call raised


def test_overlapped_generation_gives_the_same_tokens(v2_lite, lib_dir):
    report = script("gpu_generate_overlap").run_overlap(
        str(v2_lite.path), lib_dir, prompt_len=1000, tokens=64, consumer_us=(0.0, 100.0), rounds=1
    )
    assert len(report["reference_tokens"]) == 64
    assert report["same_tokens"], report["rows"]

"""The GPU lane's CPU side: its manifest, its options, its markers and the summary writer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from lane_helpers import lane, resolve_options, script  # noqa: E402

summary = script("gpu_lane_summary")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="1"
 tests="4" time="312.5" timestamp="2026-12-03T14:00:00.000000+00:00" hostname="gpu-host">
<properties><property name="gpu" value="NVIDIA H200"/>
<property name="cuda_driver_api" value="13.0"/><property name="builds_commit" value="abc1234"/>
</properties>
<testcase classname="tests.gpu.test_gpu_graphs" name="test_graph_replays_equal_eager_steps"
 time="20.25"/>
<testcase classname="tests.gpu.test_gpu_tiny_numerics" name="test_tiny[B-q0f16]" time="3.5">
<failure message="AssertionError: B-q0f16: forced max |error| 9.1e-01&#10;assert 0.91 &lt;= 0.13">
trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_kernels" name="test_cublas" time="0.0">
<skipped type="pytest.skip" message="the prefill GEMMs are 'tir'">skip</skipped></testcase>
<testcase classname="tests.gpu.test_gpu_artifact" name="test_artifact" time="1.0">
<error message="failed on setup with &quot;RuntimeError: no | device&quot;">err</error>
</testcase></testsuite></testsuites>
"""


def test_summary_counts_and_one_line_per_test(tmp_path):
    xml = tmp_path / "gpu-lane.xml"
    xml.write_text(JUNIT)
    out = tmp_path / "gpu-tests.md"
    assert summary.main([str(xml), "--out", str(out)]) == 1  # a failure and an error
    text = out.read_text()
    assert "| commit | `abc1234` |" in text  # the builds' commit, recorded by the lane
    assert "| date | 2026-12-03T14:00:00.000000+00:00 |" in text
    assert "| GPU | NVIDIA H200 (driver CUDA 13.0) |" in text
    assert "| result | 1 passed, 1 failed, 1 error, 1 skipped of 4 tests, 312 s |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `test_gpu_graphs.py::test_graph_replays_equal_eager_steps` | passed | 20.2 |  |",
        "| `test_gpu_tiny_numerics.py::test_tiny[B-q0f16]` | failed | 3.5 | "
        "AssertionError: B-q0f16: forced max \\|error\\| 9.1e-01 |",
        "| `test_gpu_kernels.py::test_cublas` | skipped | 0.0 | the prefill GEMMs are 'tir' |",
        "| `test_gpu_artifact.py::test_artifact` | error | 1.0 | "
        'failed on setup with "RuntimeError: no \\| device" |',
    ]
    assert summary.main([str(xml), "--out", str(out), "--commit", "fedcba9"]) == 1
    assert "| commit | `fedcba9` |" in out.read_text()


def test_summary_of_a_clean_run_exits_0(tmp_path):
    xml = tmp_path / "ok.xml"
    xml.write_text(
        '<testsuite name="pytest" tests="1" time="1.0" timestamp="t"><testcase '
        'classname="tests.gpu.test_gpu_kernels" name="test_argmax" time="1.0"/></testsuite>'
    )
    run = summary.read_junit(xml)
    assert [(c.name, c.outcome) for c in run.cases] == [
        ("test_gpu_kernels.py::test_argmax", "passed")
    ]
    assert summary.main([str(xml), "--out", str(tmp_path / "s.md"), "--commit", "x"]) == 0


def _fake_build(root: Path, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / "dsv2-mlc.json").write_text("{}")


def test_manifest_reads_builds_and_refuses_what_is_not_there(tmp_path):
    info = {"kind": "tiny", "config": "A", "quantization": "q0f16", "dtype": "float16",
            "pdl": True, "gemm": "cublas"}  # fmt: skip
    data = {"format": lane.FORMAT, "format_version": lane.FORMAT_VERSION, "commit": "abc",
            "builds": {"A-q0f16": info, "B-q0f16": info}}  # fmt: skip
    (tmp_path / lane.MANIFEST).write_text(json.dumps(data))
    _fake_build(tmp_path, "A-q0f16")
    manifest = lane.read_manifest(tmp_path)
    build = manifest.build("A-q0f16")
    assert (build.path, build.dtype, build.pdl, build.gemm) == (
        tmp_path / "A-q0f16",
        "float16",
        True,
        "cublas",
    )
    assert manifest.commit == "abc"
    with pytest.raises(lane.ManifestError, match="no build 'A-q0f32'"):
        manifest.build("A-q0f32")
    with pytest.raises(lane.ManifestError, match="not there"):
        manifest.build("B-q0f16")  # listed, folder missing
    with pytest.raises(lane.ManifestError, match="cannot read"):
        lane.read_manifest(tmp_path / "nothing")
    (tmp_path / lane.MANIFEST).write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(lane.ManifestError, match="not a dsv2-mlc-gpu-lane v1"):
        lane.read_manifest(tmp_path)


def test_lane_options_come_from_the_command_line_then_the_environment(tmp_path):
    env = {"DSV2_GPU_LANE_BUILDS": str(tmp_path / "env"), "DSV2_MLC_TVM_LIB_DIR": "/env/lib"}
    opts = resolve_options(str(tmp_path / "cli"), "cli-lib", env)
    assert (opts.builds, opts.lib_dir) == ((tmp_path / "cli").resolve(), "cli-lib")
    opts = resolve_options(None, None, env)
    assert (opts.builds, opts.lib_dir) == ((tmp_path / "env").resolve(), "/env/lib")
    assert resolve_options(None, None, {}) == type(opts)(None, None)


def test_every_lane_test_is_marked_gpu_and_the_options_are_accepted(tmp_path):
    """Collecting tests/gpu without the ``gpu`` marker leaves nothing (every test carries it);
    ``--builds`` and ``--lib-dir`` are options of the lane's conftest."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "-m", "not gpu", "tests/gpu", "--builds", str(tmp_path),
           "--lib-dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 5, out.stdout + out.stderr  # 5: no test selected
    found = re.search(r"(\d+) deselected", out.stdout)
    assert found, out.stdout
    deselected = int(found.group(1))
    assert deselected >= len(lane.TINY_BUILDS) + 9, out.stdout

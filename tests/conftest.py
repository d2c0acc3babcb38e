"""Session fixtures: tiny random HF checkpoints, compiled once per test session and shared; the
session's random-weight builds (tests/cuda_builds.py); the embedded default model compiled once;
and, on CI (``CI=true``), a test skipped for want of nvcc / g++ fails instead."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cuda_builds import ModelBuilds, use_session_builds  # noqa: E402
from hf_reference import CONFIGS, load_hf, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_checkpoint(root / name, cfg) for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory, checkpoints) -> dict[str, Path]:
    from dsv2_mlc.compiler.compile import compile_model

    root = tmp_path_factory.mktemp("compiled")
    return {
        name: compile_model(ckpt, root / name, progress=False).out_dir
        for name, ckpt in checkpoints.items()
    }


@pytest.fixture(scope="session")
def engines(compiled):
    from dsv2_mlc.runtime.engine import Engine

    return {
        name: Engine(path, context_window=256, max_batch_size=4) for name, path in compiled.items()
    }


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    return {name: load_hf(path) for name, path in checkpoints.items() if name in ("A", "B")}


_SHARED_BUILDS: list[ModelBuilds] = []


@pytest.fixture(scope="session", autouse=True)
def model_builds(tmp_path_factory: pytest.TempPathFactory):
    """One random-weight build per (config, quantization, device, options) in the session,
    shared by every test that asks (``model_builds.get`` or ``cuda_builds.model_build``)."""
    builds = ModelBuilds(lambda: tmp_path_factory.mktemp("builds"))
    use_session_builds(builds)
    _SHARED_BUILDS.append(builds)
    yield builds
    use_session_builds(None)


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory: pytest.TempPathFactory):
    """The embedded default model compiled once for the session, the way a user gets it: the
    first ``dsv2-mlc chat`` (no MODEL) compiles it into a fresh cache. Returns the cache folder
    and that first run (its output and its "compiling" line)."""
    cache = tmp_path_factory.mktemp("default-model") / "cache"
    argv = ["chat", "--prompt", "def ", "--max-tokens", "8", "--cache-dir", str(cache)]
    proc = subprocess.run(
        [sys.executable, "-m", "dsv2_mlc.cli", *argv], capture_output=True, text=True, timeout=600
    )
    return cache, proc


# -- CI: the machine has nvcc and g++, so a test that skips for want of them is a failure --------
TOOLCHAIN_SKIP = re.compile(r"\bnvcc\b|\bg\+\+|\bgcc\b|libcudart")


def _toolchain_required() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _toolchain_required():
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if TOOLCHAIN_SKIP.search(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped on CI, which has nvcc and g++: {reason}"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """List the shared builds the session made (each one compile)."""
    built = [key for builds in _SHARED_BUILDS for key in builds.built]
    if built:
        terminalreporter.write_sep("-", f"{len(built)} shared model builds")
        for cfg, quantization, device, *options in built:
            digest = hashlib.sha256(cfg.encode()).hexdigest()[:8]
            terminalreporter.write_line(f"{device} {quantization} config {digest} {options}")

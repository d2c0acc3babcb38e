"""Helpers of the tests that build whole tiny models (CUDA builds on this GPU-less machine): the
marker for nvcc, and one build per (config, quantization, device, options) in a test session.

A full CUDA build of a tiny config takes about a minute, so every test that needs one asks
:func:`model_build` (or the ``model_builds`` fixture, or :func:`entry_ir`) and gets the session's
build of that key: compiled with random weights (``compile_random_model``), its IR dumped after
every pipeline phase and, for CUDA, the generated CUDA source kept. A test that changes how the
compiler behaves (a monkeypatched module switch) must not use the shared builds: it calls
:func:`build_random_model` for a build of its own.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("gcc") is None,
    reason="CUDA builds need nvcc (and gcc for the driver stub)",
)


@dataclass(frozen=True)
class Build:
    """A compiled tiny model: its output folder, its ``--dump-ir`` folder, its CUDA sources."""

    out_dir: Path
    ir_dir: Path
    cuda_sources: tuple[str, ...]

    def ir(self, phase: str = "02-cleanup.py") -> str:
        """The whole IR after the pipeline ``phase`` (a ``--dump-ir`` file name)."""
        return (self.ir_dir / phase).read_text()

    def entries(
        self,
        entries: tuple[str, ...] = ("batch_decode", "batch_prefill"),
        phase: str = "02-cleanup.py",
    ) -> tuple[str, ...]:
        """The IR text of each Relax function of ``entries`` after ``phase``."""
        ir = self.ir(phase)

        def body(name: str) -> str:
            text = ir[ir.index(f"def {name}(") :]
            return text[: text.find("\n    @R.function")]

        return tuple(body(e) for e in entries)


def build_random_model(
    root: Path, cfg: dict, quantization: str, device: str, **options: Any
) -> Build:
    """Compile ``cfg`` with random weights into ``root`` (CUDA: for sm_90), dumping the IR of
    every phase and keeping the CUDA source TVM generated. ``options``: ``compile_random_model``'s
    (``pdl``, ``gemm``, ...)."""
    import tvm

    from dsv2_mlc.compiler.compile import compile_random_model
    from dsv2_mlc.compiler.cuda import cuda_sources

    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    path.write_text(json.dumps(cfg))
    sources: list[str] = []
    compile_ = tvm.compile

    def keep_sources(*args, **kwargs):
        executable = compile_(*args, **kwargs)
        sources.extend(cuda_sources(executable.mod))
        return executable

    if device == "cuda":
        options = {"arch": "sm_90", **options}
    with mock.patch.object(tvm, "compile", keep_sources):
        out = compile_random_model(
            path,
            root / "out",
            device=device,
            quantization=quantization,
            dump_ir=root / "ir",
            **options,
        ).out_dir
    return Build(out, root / "ir", tuple(sources))


class ModelBuilds:
    """The session's builds, one per (config, quantization, device, options); made on first use
    under the folder ``make_root()`` returns. A build that failed fails every test asking for it
    with the same error, without building again."""

    def __init__(self, make_root: Callable[[], Path]) -> None:
        self._make_root = make_root
        self._root: Path | None = None
        self._builds: dict[tuple, Build | BaseException] = {}

    def get(self, cfg: dict, quantization: str, device: str, **options: Any) -> Build:
        key = (json.dumps(cfg, sort_keys=True), quantization, device, *sorted(options.items()))
        if key not in self._builds:
            if self._root is None:
                self._root = self._make_root()
            folder = self._root / f"{len(self._builds)}-{device}-{quantization}"
            try:
                self._builds[key] = build_random_model(folder, cfg, quantization, device, **options)
            except Exception as err:
                self._builds[key] = err
        build = self._builds[key]
        if isinstance(build, BaseException):
            raise build
        return build

    @property
    def built(self) -> list[tuple]:
        """The keys built so far (for the session summary)."""
        return [k for k, b in self._builds.items() if isinstance(b, Build)]


_SESSION: ModelBuilds | None = None


def use_session_builds(builds: ModelBuilds | None) -> None:
    """Make ``builds`` the cache :func:`model_build` and :func:`entry_ir` use (tests/conftest.py
    sets it for the session)."""
    global _SESSION
    _SESSION = builds


def model_build(cfg: dict, quantization: str, device: str, **options: Any) -> Build:
    """The session's build of ``cfg`` (see :class:`ModelBuilds`)."""
    if _SESSION is None:
        raise RuntimeError("no session builds: tests/conftest.py sets them up")
    return _SESSION.get(cfg, quantization, device, **options)


def entry_ir(
    tmp_path: Path,
    cfg: dict,
    quantization: str,
    device: str,
    entries: tuple[str, ...] = ("batch_decode", "batch_prefill"),
    phase: str = "02-cleanup.py",
) -> tuple[str, ...]:
    """The IR text of each of ``entries`` after the pipeline ``phase`` of the session's build of
    ``cfg`` for ``device`` (CUDA: sm_90). ``tmp_path`` is unused (the build is the session's); it
    stays for the callers."""
    del tmp_path
    return model_build(cfg, quantization, device).entries(entries, phase)

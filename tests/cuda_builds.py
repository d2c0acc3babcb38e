"""Helpers of the tests that build for CUDA on this GPU-less machine: the marker for nvcc, and
the Relax IR of a tiny model's entry points after a pipeline phase."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("gcc") is None,
    reason="CUDA builds need nvcc (and gcc for the driver stub)",
)


def entry_ir(
    tmp_path: Path,
    cfg: dict,
    quantization: str,
    device: str,
    entries: tuple[str, ...] = ("batch_decode", "batch_prefill"),
    phase: str = "02-cleanup.py",
) -> tuple[str, ...]:
    """Compile ``cfg`` with random weights for ``device`` (CUDA: sm_90) and return the IR text of
    each of ``entries`` after the pipeline ``phase`` (a ``--dump-ir`` file name)."""
    from dsv2_mlc.compiler.compile import compile_random_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    dump = tmp_path / "ir"
    arch = {"arch": "sm_90"} if device == "cuda" else {}
    compile_random_model(
        path, tmp_path / "out", device=device, quantization=quantization, dump_ir=dump, **arch
    )
    ir = (dump / phase).read_text()

    def body(name: str) -> str:
        text = ir[ir.index(f"def {name}(") :]
        return text[: text.find("\n    @R.function")]

    return tuple(body(e) for e in entries)

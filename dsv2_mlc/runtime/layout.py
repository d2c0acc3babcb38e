"""The layout of a compiled model folder, shared by the compiler (writer) and runtime (reader)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
BUILD_CONFIG = "dsv2-mlc.json"
LIBRARY = "model.so"
PARAMS_DIR = "params"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class BuildError(ValueError):
    """A compiled model folder that cannot be used (the message names the file and the fix)."""


@dataclass(frozen=True)
class BuildConfig:
    """What ``dsv2-mlc compile`` wrote into ``dsv2-mlc.json``."""

    format_version: int
    model: dict[str, Any]
    dtype: str
    device: str
    target: str
    param_names: list[str] = field(default_factory=list)
    quantization: str = "q0f32"
    tvm_version: str = ""
    tvm_ffi_version: str = ""
    # Programmatic Dependent Launch (CUDA, sm_90+): every kernel starts with griddepcontrol.wait,
    # so decode graphs may use programmatic kernel->kernel edges (runtime/pdl.py); the hand
    # kernels signal griddepcontrol.launch_dependents after their wait, TVM's kernels at exit.
    pdl: bool = False
    # kept so that build configs which record it still read; dsv2-mlc writes False
    pdl_launch_dependents: bool = False
    # who runs the prefill / extend GEMMs: "tir" (kernels in the library) or "cublas" (the library
    # carries runtime/cublas_gemm.cc; runtime/cublas.py finds libcublas when it is loaded)
    gemm: str = "tir"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    @classmethod
    def read(cls, build_dir: str | Path) -> BuildConfig:
        """Read and check ``build_dir/dsv2-mlc.json``."""
        data = read_build_json(
            Path(build_dir) / BUILD_CONFIG,
            "format_version",
            FORMAT_VERSION,
            missing=f"{build_dir}: not a compiled dsv2-mlc model (no {BUILD_CONFIG}); "
            "run `dsv2-mlc compile MODEL_DIR -o OUT_DIR` first",
        )
        return cls(**data)


def read_build_json(path: Path, version_key: str, version: int, missing: str) -> dict[str, Any]:
    """A JSON file of a build folder whose ``version_key`` must equal ``version``; a missing,
    corrupted or other-version file is a :class:`BuildError` (``missing`` is that message)."""
    if not path.is_file():
        raise BuildError(missing)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise BuildError(f"{path}: corrupted ({err}); compile the model again") from err
    if data.get(version_key) != version:
        raise BuildError(
            f"{path}: {version_key} {data.get(version_key)} is not the supported {version}; "
            "compile the model again with this dsv2-mlc"
        )
    return data

"""The layout of a compiled model folder, shared by the compiler (writer) and runtime (reader).

``dsv2-mlc.json`` (:class:`BuildConfig`), the library and weights beside it, the tokenizer files,
and for config-only builds ``random-params.json`` (:func:`write_spec`: how to fill every
parameter; the fill itself is :mod:`dsv2_mlc.runtime.random_params`). ``BuildConfig.files``
records the size and SHA-256 of the library and the weight files (:func:`file_records`), which
the runtime checks before it loads anything (:mod:`dsv2_mlc.runtime.integrity`). The runtime reads
the few model values it needs from the build's config through :class:`ModelInfo`, so it never
imports the model package.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import Dsv2Error

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


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


class BuildError(Dsv2Error, ValueError):
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
    # size and SHA-256 of the library, the weight files and random-params.json as the compiler
    # wrote them ({relative path: {"size": n, "sha256": hex}}); empty in builds made before it
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the latent KV cache's element type: "" for the build's ``dtype``, or "float8_e4m3fn"
    # (``--kv-dtype fp8``: one byte a latent value, read back times ``kv_scale``; the rope part
    # stays in ``dtype``)
    kv_dtype: str = ""
    kv_scale: float = 1.0

    @property
    def cache_dtype(self) -> str:
        """The KV cache's element type (the build's ``dtype`` unless ``kv_dtype`` says)."""
        return self.kv_dtype or self.dtype

    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the KV cache: every layer caches one latent row of
        ``kv_lora_rank + qk_rope_head_dim`` values of :attr:`cache_dtype`; an FP8 cache keeps
        the rope part in the build's ``dtype`` (``kv_lora_rank`` bytes + the rope values)."""
        m = self.model
        lora, rope = int(m["kv_lora_rank"]), int(m["qk_rope_head_dim"])
        if self.cache_dtype.startswith("float8"):
            row = lora + rope * _ITEMSIZE[self.dtype]
        else:
            row = (lora + rope) * _ITEMSIZE[self.cache_dtype]
        return int(m["num_hidden_layers"]) * row

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
        try:
            return cls(**data)
        except TypeError as err:  # a key this version does not know, or one missing
            raise BuildError(
                f"{Path(build_dir) / BUILD_CONFIG}: not a build config of this dsv2-mlc ({err}); "
                "compile the model again"
            ) from err


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


def sha256_file(path: str | Path) -> tuple[int, str]:
    """Size and SHA-256 (hex) of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def file_records(build_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``BuildConfig.files`` of a finished build folder: the library, every file under
    ``params/`` and ``random-params.json``, by relative POSIX path."""
    root = Path(build_dir)
    files = [root / LIBRARY, root / SPEC_FILE]
    if (root / PARAMS_DIR).is_dir():
        files += sorted(p for p in (root / PARAMS_DIR).rglob("*") if p.is_file())
    records = {}
    for path in files:
        if path.is_file():
            size, digest = sha256_file(path)
            records[path.relative_to(root).as_posix()] = {"size": size, "sha256": digest}
    return records


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs of the model config a build records (``BuildConfig.model``)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_build(cls, build: BuildConfig) -> ModelInfo:
        """The values of ``build.model`` (as the compiler wrote it from its model config)."""
        model = build.model
        try:
            return cls(
                vocab_size=int(model["vocab_size"]),
                max_position_embeddings=int(model["max_position_embeddings"]),
                eos_token_id=model.get("eos_token_id"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise BuildError(
                f"{BUILD_CONFIG}: the model config lacks {err}; compile the model again"
            ) from err


# -- config-only builds: how the runtime fills each parameter --------------------------------------
SPEC_FILE = "random-params.json"
SPEC_VERSION = 1
INT4_KERNEL = "dsv2_fill_int4_uint32"
INT4_CODE_VAR = 56.0 / 3.0  # variance of a code uniform on -7..7


def uniform_kernel(dtype: str) -> str:
    """The fill kernel of float tensors of ``dtype`` (must match compiler/random_fill.py)."""
    return f"dsv2_fill_uniform_{dtype}"


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is filled: ``kernel``; for float kernels uniform on center +- half."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kernel: str
    center: float = 0.0
    half: float = 0.0


def _std(name: str, fan_in: int) -> float:
    return 1.0 if name.startswith("model.embed_tokens.") else 1.0 / math.sqrt(fan_in)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def init_spec(params: Iterable[tuple[str, Sequence[int], str]]) -> list[ParamInit]:
    """The fill of every parameter (name, shape, dtype) of a compiled model, in order."""
    params = [(n, tuple(int(s) for s in shape), str(d)) for n, shape, d in params]
    shapes = {n: s for n, s, _ in params}
    spec = []
    for name, shape, dtype in params:
        if dtype == "uint32":
            if not name.endswith("q_weight"):
                raise ValueError(f"{name}: uint32 parameter that is not an INT4 weight")
            spec.append(ParamInit(name, shape, dtype, INT4_KERNEL))
            continue
        if name.endswith("q_scale"):
            fan_in = shapes[name[: -len("q_scale")] + "q_weight"][-1] * 8
            scale = _std(name, fan_in) / math.sqrt(INT4_CODE_VAR)
            spec.append(ParamInit(name, shape, dtype, uniform_kernel(dtype), scale, 0.0))
        elif _is_norm(name):
            spec.append(ParamInit(name, shape, dtype, uniform_kernel(dtype), 1.0, 0.0))
        else:
            half = math.sqrt(3.0) * _std(name, shape[-1])
            spec.append(ParamInit(name, shape, dtype, uniform_kernel(dtype), 0.0, half))
    return spec


def write_spec(path: str | Path, spec: list[ParamInit]) -> None:
    """Write ``random-params.json`` into the build folder ``path``."""
    data = {"version": SPEC_VERSION, "params": [asdict(p) for p in spec]}
    (Path(path) / SPEC_FILE).write_text(json.dumps(data, indent=1))


def has_spec(path: str | Path) -> bool:
    """Whether ``path`` is a config-only build (random weights)."""
    return (Path(path) / SPEC_FILE).is_file()


def read_spec(path: str | Path) -> list[ParamInit]:
    """Read ``random-params.json`` of the build folder ``path``."""
    data = read_build_json(
        Path(path) / SPEC_FILE,
        "version",
        SPEC_VERSION,
        missing=f"{path}: no {SPEC_FILE}; random weights need a build made with "
        "`dsv2-mlc compile CONFIG --random-weights`",
    )
    return [ParamInit(**{**p, "shape": tuple(p["shape"])}) for p in data["params"]]

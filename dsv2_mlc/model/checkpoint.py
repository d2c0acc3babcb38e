"""Read Hugging Face safetensors checkpoints tensor by tensor (single file or index + shards).

The ``safetensors`` package's NumPy backend cannot represent bfloat16, the dtype DeepSeek publishes
in, so this reads the (simple, documented) safetensors layout itself: an 8-byte little-endian header
size, a JSON header, then raw data. A tensor is read from its file only when asked for, straight
into the array returned (bfloat16 through a bounded staging buffer), so converting holds one
conversion's tensors at a time, never a shard or the model. The files are read, not
memory-mapped: the pages of a mapping the converter has touched would stay in its resident set
until the file is closed, growing it by up to a whole shard. Each tensor is read once, so its
pages are dropped from the page cache once read: a checkpoint larger than memory otherwise fills
the cache, and every array the converter allocates first has the kernel reclaim cache pages
(measured on DeepSeek-V2's experts: half the conversion's system time), evicting other
processes' cached files on the way.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import Dsv2Error


class CheckpointError(Dsv2Error, ValueError):
    """A checkpoint that cannot be read (the message names the file and the fix)."""


_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ITEM_SIZES = {"BF16": 2, **{k: np.dtype(v).itemsize for k, v in _NUMPY_DTYPES.items()}}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""The safetensors dtypes a weight may have (the model's parameters are floating point)."""

BF16_STAGING_VALUES = 1 << 20
"""bfloat16 values read per step into the staging buffer before widening to float32 (2 MB)."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The largest JSON header read (the safetensors format's own limit)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype, shape and byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, the parsed JSON header) of one safetensors file, bounded in size."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (size,) = struct.unpack("<Q", raw)
            if size > min(MAX_HEADER_BYTES, file_size - 8):
                raise CheckpointError(
                    f"{path}: the header claims {size} bytes but the file holds {file_size - 8} "
                    f"after its size field (limit {MAX_HEADER_BYTES}); not a safetensors file, or "
                    "truncated: download it again"
                )
            header = json.loads(f.read(size))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return 8 + size, header


def _tensor_info(path: Path, name: str, meta: object, data_start: int, size: int) -> TensorInfo:
    """Validate one header entry: dtype known, shape of non-negative integers, offsets in order
    and inside the file, and a byte range exactly as long as dtype and shape say."""

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: tensor {name!r} {problem}; the file is damaged or not a safetensors "
            "checkpoint: download it again"
        )

    if not isinstance(meta, dict):
        raise bad("has no header entry object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ITEM_SIZES:
        raise bad(f"has unknown dtype {dtype!r} (known: {', '.join(_ITEM_SIZES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"has data_offsets {offsets!r}, not two non-negative integers [begin, end]")
    if offsets[1] > size:
        raise CheckpointError(
            f"{path}: tensor {name!r} extends past the end of the file (truncated "
            "download?); download the shard again"
        )
    count = math.prod(shape)
    if count * _ITEM_SIZES[dtype] != offsets[1] - offsets[0]:
        raise bad(
            f"has {offsets[1] - offsets[0]} bytes for {count} values of {dtype} "
            f"({count * _ITEM_SIZES[dtype]} expected)"
        )
    return TensorInfo(path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_overlap(path: Path, infos: list[tuple[str, TensorInfo]]) -> None:
    """Refuse tensors whose byte ranges overlap (a crafted header aliasing one tensor's bytes)."""
    ranges = sorted((i.begin, i.end, n) for n, i in infos if i.end > i.begin)
    for (_, end, a), (begin, _, b) in itertools.pairwise(ranges):
        if begin < end:
            raise CheckpointError(
                f"{path}: tensors {a!r} and {b!r} share bytes; the file is damaged or crafted: "
                "download it again"
            )


class SafetensorsCheckpoint:
    """All tensors of a Hugging Face checkpoint folder, by name.

    Every header is validated when the checkpoint is opened (dtypes, shapes, offsets inside the
    file, byte counts, no overlap), so a damaged or crafted file is refused before anything is
    converted."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        self._files: dict[Path, int] = {}  # open file descriptors, by path
        for file in self._shard_files():
            data_start, header = _read_header(file)
            size = file.stat().st_size - data_start
            infos = [
                (name, _tensor_info(file, name, meta, data_start, size))
                for name, meta in header.items()
                if name != "__metadata__"
            ]
            _check_overlap(file, infos)
            for name, info in infos:
                if name in self.tensors:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} is also in {self.tensors[name].file.name}; "
                        "a checkpoint holds each tensor once"
                    )
                self.tensors[name] = info

    def _shard_files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: malformed index ({err!r})") from err
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f and Path(f).name == f and f not in (".", "..")
                for f in weight_map.values()
            ):
                raise CheckpointError(
                    f"{index}: weight_map must map tensor names to shard file names inside the "
                    "model folder (no paths); the index is damaged: download it again"
                )
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.model_dir / f).is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.model_dir}: missing shard(s) listed in model.safetensors.index.json: "
                    + ", ".join(missing)
                    + "; download them into the model folder"
                )
            return [self.model_dir / f for f in files]
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.model_dir}: no *.safetensors weights found; point at a Hugging Face "
                "checkpoint folder (config.json + safetensors)"
            )
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name``."""
        return self.tensors[name].shape

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Tensor ``name`` as a NumPy array (bfloat16 is widened to float32, exactly).

        With ``out`` (an array of the tensor's shape; C-contiguous float32 for a bfloat16 or
        float32 tensor to be read into it directly) the values are written there and ``out``
        is returned."""
        info = self.tensors[name]
        if info.dtype != "BF16" and info.dtype not in _NUMPY_DTYPES:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has unsupported dtype {info.dtype}"
            )
        if out is not None and tuple(out.shape) != info.shape:
            raise ValueError(f"{name}: out has shape {out.shape}, the tensor {info.shape}")
        fd = self._files.get(info.file)
        if fd is None:
            fd = self._files[info.file] = os.open(info.file, os.O_RDONLY)
        count = math.prod(info.shape)
        direct = (
            out is not None
            and out.dtype == np.float32
            and out.flags.c_contiguous
            and info.dtype in ("BF16", "F32")
        )
        if info.dtype != "BF16":
            arr = out.reshape(-1) if direct else np.empty(count, _NUMPY_DTYPES[info.dtype])
            self._read(fd, info, info.begin, arr)
        else:
            arr = out.reshape(-1).view(np.uint32) if direct else np.empty(count, np.uint32)
            staging = np.empty(min(count, BF16_STAGING_VALUES), np.uint16)
            for start in range(0, count, BF16_STAGING_VALUES):
                n = min(count - start, BF16_STAGING_VALUES)
                self._read(fd, info, info.begin + 2 * start, staging[:n])
                np.left_shift(staging[:n], 16, out=arr[start : start + n], dtype=np.uint32)
            arr = arr.view(np.float32)
        if hasattr(os, "posix_fadvise"):  # Linux: the page cache need not keep what was read
            os.posix_fadvise(fd, info.begin, info.end - info.begin, os.POSIX_FADV_DONTNEED)
        if out is None:
            return arr.reshape(info.shape)
        if not direct:
            out[...] = arr.reshape(info.shape)
        return out

    @staticmethod
    def _read(fd: int, info: TensorInfo, offset: int, dest: np.ndarray) -> None:
        """Fill ``dest`` with the file's bytes from ``offset`` (refusing a short file)."""
        view = memoryview(dest).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"{info.file}: the file ends before its tensors do (truncated download?); "
                    "download the shard again"
                )
            done += n

    def close(self) -> None:
        """Close the files."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

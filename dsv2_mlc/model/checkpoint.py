"""Read Hugging Face safetensors checkpoints tensor by tensor (single file or index + shards).

The ``safetensors`` package's NumPy backend cannot represent bfloat16, the dtype DeepSeek publishes
in, so this reads the (simple, documented) safetensors layout itself: an 8-byte little-endian header
size, a JSON header, then raw data. Files are memory-mapped; a tensor is copied out only when asked
for, so converting never holds the model twice in memory.
"""

from __future__ import annotations

import json
import mmap
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


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype, shape and byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> tuple[int, dict]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (size,) = struct.unpack("<Q", raw)
            header = json.loads(f.read(size))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from err
    return 8 + size, header


class SafetensorsCheckpoint:
    """All tensors of a Hugging Face checkpoint folder, by name."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for file in self._shard_files():
            data_start, header = _read_header(file)
            file_size = file.stat().st_size
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                begin, end = (data_start + int(o) for o in meta["data_offsets"])
                if end > file_size:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} extends past the end of the file (truncated "
                        "download?); download the shard again"
                    )
                self.tensors[name] = TensorInfo(
                    file, meta["dtype"], tuple(int(s) for s in meta["shape"]), begin, end
                )

    def _shard_files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: malformed index ({err})") from err
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

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a NumPy array (bfloat16 is widened to float32, exactly)."""
        info = self.tensors[name]
        buf = self._maps.get(info.file)
        if buf is None:
            with open(info.file, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[info.file] = buf
        count = int(np.prod(info.shape, dtype=np.int64))
        if info.dtype == "BF16":
            bits = np.frombuffer(buf, np.uint16, count, info.begin).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(info.shape)
        if info.dtype not in _NUMPY_DTYPES:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has unsupported dtype {info.dtype}"
            )
        arr = np.frombuffer(buf, _NUMPY_DTYPES[info.dtype], count, info.begin)
        return arr.reshape(info.shape).copy()

    def close(self) -> None:
        """Unmap the files."""
        for buf in self._maps.values():
            buf.close()
        self._maps.clear()

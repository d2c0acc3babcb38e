"""Write a random bfloat16 Hugging Face checkpoint for a config.json, shard by shard.

Every tensor the weight map reads (:func:`dsv2_mlc.model.weights.weight_map`) is written, with its
shape, into ``model-0000i-of-0000n.safetensors`` shards of about ``--shard-gb`` GB each plus a
``model.safetensors.index.json``, so ``dsv2-mlc compile DIR`` converts it like a downloaded
checkpoint. The values are slices of one random pool of bfloat16 words (normal, std 0.02) taken at
random offsets: writing needs the pool and one tensor's bytes in memory, never a shard or the
model. Used to measure the converter's time and peak memory at DeepSeek-V2's real widths::

    python scripts/gpu_v2_numerics.py --write-config V2_3L/config.json
    python scripts/make_synthetic_checkpoint.py V2_3L
    /usr/bin/time -v dsv2-mlc compile V2_3L -o OUT --device cuda --quantization q4f16_g128
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.model.weights import weight_map

POOL_VALUES = 1 << 24  # 32 MB of bfloat16 words, reused at random offsets
ALIGN = 8


def _pool(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    f = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).view(np.uint32)
    return (f >> 16).astype(np.uint16)  # truncation to bfloat16


def _write_tensor(f, pool: np.ndarray, count: int, rng: np.random.Generator) -> None:
    done = 0
    while done < count:
        n = min(count - done, POOL_VALUES // 2)
        start = int(rng.integers(0, POOL_VALUES - n + 1))
        f.write(pool[start : start + n].tobytes())
        done += n


def _write_shard(path: Path, tensors, pool, rng) -> None:
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, shape in tensors:
            _write_tensor(f, pool, math.prod(shape), rng)


def write_checkpoint(model_dir: Path, shard_gb: float, seed: int) -> int:
    """Write the shards and the index for ``model_dir/config.json``; return the bytes written."""
    cfg = DeepseekV2Config.from_file(model_dir)
    sources = [src for conv in weight_map(cfg) for src in conv.sources]
    cap = int(shard_gb * 1e9)
    shards: list[list] = [[]]
    size = 0
    for name, shape in sources:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > cap:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    pool, rng = _pool(seed), np.random.default_rng(seed + 1)
    weight_index, total = {}, 0
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(model_dir / file, tensors, pool, rng)
        total += (model_dir / file).stat().st_size
        weight_index.update({name: file for name, _ in tensors})
        print(f"wrote {file} ({len(tensors)} tensors)", file=sys.stderr)
    index = {"metadata": {"total_size": total}, "weight_map": weight_index}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="folder holding config.json")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="approximate shard size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    total = write_checkpoint(args.model_dir, args.shard_gb, args.seed)
    print(json.dumps({"model_dir": str(args.model_dir), "bytes": total}))


if __name__ == "__main__":
    main()

"""The decode GEMVs that load their weights before the PDL wait (``schedules/
prefetch_gemv_cuda.py``) run on the CPU against NumPy, no GPU (``tests/cuda_emulation.py``).

References: ``y = x @ dequant(W)^T`` in float64 (the kernel's fp16 partial sums of 16 products
bound the error), and ``y[t, h V + v] = o[t, h] . W_UV[h, v]`` in float64 (the kernel sums
float32 products: within float32 rounding before its one fp16 rounding). Shapes cover fewer
rows than warps, rows left over for a second pass of the grid, several tokens (the weights are
read once for all of them), K not a multiple of 32 lanes' chunks, and a partial last group.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.prefetch_gemv_cuda import (
    absorb_v_decode,
    absorb_v_kernel,
    absorb_v_unsupported,
    gemv_q4_decode,
    gemv_q4_kernel,
    gemv_q4_unsupported,
)
from dsv2_mlc.schedules.tiles import PrefetchGemvTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, random_int4, rel_l2  # noqa: E402


def _blocks(rows: int, tiles: PrefetchGemvTiles) -> int:
    return min(-(-rows // tiles.warps), tiles.max_blocks)


@needs_toolchain
@pytest.mark.parametrize(
    ("out_dim", "in_dim", "group", "n", "max_blocks"),
    [
        (40, 64, 32, 3, 1024),  # 5 blocks, the last with 8 rows; 3 tokens
        (5, 256, 64, 1, 1024),  # fewer rows than warps
        (70, 1280, 128, 2, 3),  # 3 blocks x 8 warps for 70 rows: three passes; 40 chunks
        (16, 2048, 128, 1, 1024),  # the o_proj row length of V2-Lite
        (24, 10944, 128, 2, 1024),  # V2-Lite's dense down_proj rows: 11 chunks a lane, and a
        # last group of 64 (128 does not divide 10944)
        (16, 16384, 128, 1, 1024),  # V2's o_proj rows (128 heads x 128): x fills 32 KB shared
        (24, 12288, 128, 1, 1024),  # V2's dense down_proj rows: 12 chunks a lane
    ],
)
def test_gemv_q4_decode_matches_numpy(
    tmp_path: Path, out_dim: int, in_dim: int, group: int, n: int, max_blocks: int
) -> None:
    tiles = PrefetchGemvTiles(max_blocks=max_blocks)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, in_dim)).astype(np.float16)
    qw, qs, wv = random_int4(rng, (out_dim,), in_dim, group)
    y = np.full((n, out_dim), np.nan, np.float16)
    run = emulate(gemv_q4_kernel(out_dim, in_dim, group, tiles), tmp_path)
    run(_blocks(out_dim, tiles), {"x": x, "qw": qw, "qs": qs, "y": y}, n)
    ref = x.astype(np.float64) @ wv.T
    assert rel_l2(y, ref) < 2e-3, f"y: rel L2 {rel_l2(y, ref):.2e}"


@needs_toolchain
@pytest.mark.parametrize(
    ("heads", "v_dim", "lora", "n", "max_blocks"),
    [
        (2, 12, 64, 3, 1024),  # 3 blocks; rows of two heads in one block
        (3, 8, 520, 1, 2),  # 2 blocks x 8 warps for 24 rows: a second pass; 65 pieces a row
        (16, 8, 512, 2, 1024),  # V2-Lite's L and heads
        (128, 128, 512, 1, 1024),  # V2: 16384 rows, two passes of the 1024-block grid
    ],
)
def test_absorb_v_decode_matches_numpy(
    tmp_path: Path, heads: int, v_dim: int, lora: int, n: int, max_blocks: int
) -> None:
    tiles = PrefetchGemvTiles(max_blocks=max_blocks)
    rng = np.random.default_rng(8)
    o = rng.standard_normal((n, heads, lora)).astype(np.float16)
    w = (rng.standard_normal((heads, v_dim, lora)) / np.sqrt(lora)).astype(np.float16)
    y = np.full((n, heads * v_dim), np.nan, np.float16)
    run = emulate(absorb_v_kernel(heads, v_dim, lora, tiles), tmp_path)
    run(_blocks(heads * v_dim, tiles), {"o": o, "w": w, "y": y}, n)
    ref = np.einsum("thc,hvc->thv", o.astype(np.float64), w.astype(np.float64)).reshape(n, -1)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert (np.abs(y - ref) <= ulp).all(), "beyond one fp16 rounding of float32 sums"


def test_unsupported_shapes_are_named() -> None:
    assert "group" in gemv_q4_unsupported(16, 100, 32)
    assert "shared memory" in gemv_q4_unsupported(16, 32768, 128)
    assert gemv_q4_unsupported(2048, 2048, 128) is None
    assert gemv_q4_unsupported(2048, 10944, 128) is None  # a partial last group
    assert "multiple of 8" in absorb_v_unsupported(16, 128, 500)
    with pytest.raises(ValueError, match="gemv_q4_decode"):
        gemv_q4_decode(16, 100, 32)
    with pytest.raises(ValueError, match="absorb_v_decode"):
        absorb_v_decode(16, 128, 500)

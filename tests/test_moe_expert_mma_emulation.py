"""The expert-major MoE decode kernels on tensor cores (``schedules/moe_expert_mma_cuda.py``) run
on the CPU against float64 NumPy, no GPU.

TVM's CUDA source runs under ``tests/cuda_emulation.py``; the ``mma.sync.m16n8k16`` is emulated
with warp shuffles of the PTX fragments (lane ``(g, t)`` holds rows ``g``, ``g + 8`` of A, column
``g`` of B), so a fragment built from the wrong nibbles, scales or staged activations shows as a
wrong result. Routing comes from the float64 reference router (the kernels take the ids); the
reference is ``h = silu(gate . x) * (up . x)`` per routed slot and for the shared experts, then
each slot's ``down . h`` unweighted. Every element of both outputs starts NaN, so a (token, slot)
no item wrote shows. The cases cover experts chosen by several tokens, chunks split at 8 pairs,
more tokens than a plan's group (two groups), items that end mid-expert, and groups of 32 and 64.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape
from dsv2_mlc.schedules.moe_expert_major_cuda import GROUP_TOKENS
from dsv2_mlc.schedules.moe_expert_mma_cuda import (
    MmaTiles,
    expert_mma_unsupported,
    moe_down_expert_mma,
    moe_gate_up_expert_mma,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import needs_toolchain  # noqa: E402
from test_moe_expert_major_emulation import check_expert_kernels  # noqa: E402

pytestmark = needs_toolchain

# 8 experts of top-2, limited routing, group 32
SMALL = MoeDecodeShape(256, 128, 256, 8, 2, 32, 4, 2, routed_scaling_factor=16.0)
# 4 experts of top-2: with 37 tokens each expert has more than one chunk of 8 pairs
FEW = MoeDecodeShape(128, 128, 128, 4, 2, 64)
# 16 experts of top-4, renormalised, group 64, a shared intermediate twice the routed one
MEDIUM = MoeDecodeShape(384, 128, 256, 16, 4, 64, 4, 2, True)


@pytest.mark.parametrize(
    ("shape", "tiles", "n"),
    [
        # items of one tile, its runs of 128 inputs split among 4 warps (some get none)
        (SMALL, MmaTiles(warps=4, blocks=5, rows=16), 3),
        # two plan groups, experts of several chunks, row blocks of 48 (items end mid-expert), a
        # warp a tile (no split)
        (FEW, MmaTiles(warps=2, blocks=7, rows=48), GROUP_TOKENS + 5),
        # two tiles an item, each split in 2 (3 runs: 1 + 2), one fewer warp than the tiles
        (MEDIUM, MmaTiles(warps=4, blocks=9, rows=32), 6),
        (MEDIUM, MmaTiles(warps=3, blocks=4, rows=64), 5),
    ],
    ids=["small-split4", "two-groups", "medium-split2", "medium-loop"],
)
def test_expert_mma_kernels_match_numpy(
    tmp_path: Path, shape: MoeDecodeShape, tiles: MmaTiles, n: int
) -> None:
    assert expert_mma_unsupported(shape, tiles) is None
    gate_up, down = moe_gate_up_expert_mma(shape, tiles), moe_down_expert_mma(shape, tiles)
    check_expert_kernels(tmp_path, shape, n, gate_up, down, tiles.blocks, seed=5)


def test_expert_mma_refuses_shapes_it_cannot_tile() -> None:
    narrow = MoeDecodeShape(64, 32, 64, 8, 2, 32)  # the tiny test configs' MoE
    assert "multiple of 128" in expert_mma_unsupported(narrow)
    with pytest.raises(ValueError, match="cannot take"):
        moe_gate_up_expert_mma(narrow)
    wide = MoeDecodeShape(256, 128, 32768, 8, 2, 32)
    assert "shared memory" in expert_mma_unsupported(wide)
    assert "bad tiles" in expert_mma_unsupported(SMALL, MmaTiles(rows=24))

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

import numpy as np
import pytest

from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape
from dsv2_mlc.schedules.moe_expert_mma_cuda import (
    GROUP_TOKENS,
    down_expert_mma_kernel,
    expert_mma_unsupported,
    gate_up_expert_mma_kernel,
    moe_down_expert_mma,
    moe_gate_up_expert_mma,
)
from dsv2_mlc.schedules.tiles import MmaTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, rel_l2  # noqa: E402
from test_moe_decode_emulation import TOL, moe_inputs, route_numpy  # noqa: E402

pytestmark = needs_toolchain

# 8 experts of top-2, limited routing, group 32
SMALL = MoeDecodeShape(256, 128, 256, 8, 2, 32, 4, 2, routed_scaling_factor=16.0)
# 4 experts of top-2: with 37 tokens each expert has more than one chunk of 8 pairs
FEW = MoeDecodeShape(128, 128, 128, 4, 2, 64)
# 16 experts of top-4, renormalised, group 64, a shared intermediate twice the routed one
MEDIUM = MoeDecodeShape(384, 128, 256, 16, 4, 64, 4, 2, True)
# every width a multiple of 256 (runs of 256 inputs), group 32 (a scale a lane's uint4)
WIDE = MoeDecodeShape(512, 256, 512, 8, 2, 32)
# odd multiples of 128 (runs of 256 end with one of 128): hidden 384, routed 384, shared 640
TAIL = MoeDecodeShape(384, 384, 640, 8, 2, 64)


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
        # runs in flight from a ring of registers: 2 of the shared experts' 2 runs, 3 of the
        # hidden's 3 (the ring longer than the loop), 2 of 3 with items of two tiles a warp
        (MEDIUM, MmaTiles(warps=3, blocks=4, rows=64, depth=3), 5),
        (MEDIUM, MmaTiles(warps=2, blocks=3, rows=64, depth=2), GROUP_TOKENS + 3),
        # runs of 256 inputs (2 uint4 a lane and row), in a ring and with a K split of 2
        (WIDE, MmaTiles(warps=4, blocks=5, rows=64, depth=2, run=256), 7),
        (WIDE, MmaTiles(warps=4, blocks=6, rows=32, run=256), 4),
        # runs of 256 and a tail of 128, with the next run in flight / a ring of 2
        (TAIL, MmaTiles(warps=4, blocks=5, rows=64, run=256), 6),
        (TAIL, MmaTiles(warps=2, blocks=3, rows=32, depth=2, run=256), 9),
    ],
    ids=[
        "small-split4",
        "two-groups",
        "medium-split2",
        "medium-loop",
        "medium-d3",
        "medium-d2",
        "wide-run256-d2",
        "wide-run256-split2",
        "tail-run256",
        "tail-run256-d2",
    ],
)
def test_expert_mma_kernels_match_numpy(
    tmp_path: Path, shape: MoeDecodeShape, tiles: MmaTiles, n: int
) -> None:
    assert expert_mma_unsupported(shape, tiles) is None
    gate_up = gate_up_expert_mma_kernel(shape, tiles)
    down = down_expert_mma_kernel(shape, tiles)
    check_expert_kernels(tmp_path, shape, n, gate_up, down, tiles.blocks, seed=5)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def check_expert_kernels(
    tmp_path: Path, s: MoeDecodeShape, n: int, gate_up, down, blocks: int, seed: int
) -> None:
    """Run an expert-major gate/up and down kernel pair (``blocks`` blocks each) on ``n`` random
    tokens routed by the float64 router; assert ``h`` and the unweighted ``part`` against
    float64 NumPy (every output element starts NaN)."""
    H, NI, K = s.hidden, s.inter, s.top_k
    x, logits, (w, sc, wv), (sw, ss, swv), (dw, ds, dwv), (sdw, sds, sdwv) = moe_inputs(
        np.random.default_rng(seed), s, n
    )
    args = (s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
    _, ids = route_numpy(logits.astype(np.float64), *args)
    ids = ids.astype(np.int32)

    h = np.full((n, s.total), np.nan, np.float16)
    arrays = {"x": x, "ids": ids, "w": w, "s": sc, "sw": sw, "ss": ss, "hout": h}
    emulate(gate_up, tmp_path, "gate_up")(blocks, arrays, n)
    xf = x.astype(np.float64)
    ref_h = np.empty((n, s.total))
    for t in range(n):
        for j, e in enumerate(ids[t]):
            gate_up_v = wv[e] @ xf[t]
            ref_h[t, j * NI : (j + 1) * NI] = _silu(gate_up_v[:NI]) * gate_up_v[NI:]
        gate_up_v = swv @ xf[t]
        ref_h[t, K * NI :] = _silu(gate_up_v[: s.shared_inter]) * gate_up_v[s.shared_inter :]
    assert rel_l2(h, ref_h) < TOL, f"h: rel L2 {rel_l2(h, ref_h):.2e}"

    part = np.full((n, K + 1, H), np.nan, np.float32)
    arrays = {"h": h, "ids": ids, "w": dw, "s": ds, "sw": sdw, "ss": sds, "part": part}
    emulate(down, tmp_path, "down")(blocks, arrays, n)
    hf = h.astype(np.float64)
    ref = np.empty((n, K + 1, H))
    for t in range(n):
        for j, e in enumerate(ids[t]):
            ref[t, j] = dwv[e] @ hf[t, j * NI : (j + 1) * NI]
        ref[t, K] = sdwv @ hf[t, K * NI :]
    assert rel_l2(part, ref) < TOL, f"part: rel L2 {rel_l2(part, ref):.2e}"


def test_expert_mma_refuses_shapes_it_cannot_tile() -> None:
    narrow = MoeDecodeShape(64, 32, 64, 8, 2, 32)  # the tiny test configs' MoE
    assert "multiple of 128" in expert_mma_unsupported(narrow)
    with pytest.raises(ValueError, match="cannot take"):
        moe_gate_up_expert_mma(narrow)
    with pytest.raises(ValueError, match="cannot take"):
        moe_down_expert_mma(narrow)
    wide = MoeDecodeShape(256, 128, 32768, 8, 2, 32)
    assert "shared memory" in expert_mma_unsupported(wide)
    assert "bad tiles" in expert_mma_unsupported(SMALL, MmaTiles(rows=24))
    # a ring of runs needs the compile-time loop of a warp a tile (no K split)
    assert "depth 2" in expert_mma_unsupported(SMALL, MmaTiles(warps=4, rows=16, depth=2))
    assert "depth 0" in expert_mma_unsupported(SMALL, MmaTiles(depth=0))
    assert "run 512" in expert_mma_unsupported(SMALL, MmaTiles(run=512))
    # V2-Lite's routed intermediate (1408 = 11 x 128) ends runs of 256 with a tail of 128, which
    # a K split cannot share among its warps
    lite = MoeDecodeShape(2048, 1408, 2816, 64, 6, 128)
    with pytest.raises(ValueError, match="inter 1408 leaves a tail"):
        down_expert_mma_kernel(lite, MmaTiles(rows=16, run=256))
    assert expert_mma_unsupported(lite) is None  # the shipped tiles (schedules/tiles.py) take it

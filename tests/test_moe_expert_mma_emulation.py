"""The expert-major MoE decode kernels on tensor cores (``schedules/moe_expert_mma_cuda.py``) run
on the CPU against float64 NumPy, no GPU.

TVM's CUDA source runs under ``tests/cuda_emulation.py``; the ``mma.sync.m16n8k16`` is emulated
with warp shuffles of the PTX fragments (lane ``(g, t)`` holds rows ``g``, ``g + 8`` of A, column
``g`` of B), so a fragment built from the wrong nibbles, scales or staged activations shows as a
wrong result. Routing comes from the float64 reference router (the kernels take the ids); the
reference is ``h = silu(gate . x) * (up . x)`` per routed slot and for the shared experts, then
each slot's ``down . h`` unweighted. Every element of both outputs starts NaN, so a (token, slot)
no item wrote shows. The cases cover experts chosen by several tokens, chunks split at 8 pairs,
more tokens than a plan's group (two groups), items that end mid-expert, and groups of 32 and 64;
plans of 256 tokens (a decode step's whole batch) with uneven expert loads (an expert of every
token, one of none), chunks of 16 and 32 pairs (two and four MMA n-tiles an A fragment), and a
negative control: a plan whose pair order differs between blocks.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
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
from dsv2_mlc.schedules.tiles import MmaTiles, tuned

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


# 8 experts of top-2, narrow widths: a plan of 256 tokens stays quick to emulate
NARROW = MoeDecodeShape(128, 128, 256, 8, 2, 32)


def uneven_ids(rng: np.random.Generator, n: int, experts: int) -> np.ndarray:
    """Top-2 ids with uneven loads: slot 0 expert 0 for every token (a chunk of 8 ... 32 pairs
    per 4 ... 16 tokens, most chunks of the plan), slot 1 a random one of 1 .. E - 2 (expert
    E - 1 has no pair)."""
    return np.stack([np.zeros(n), rng.integers(1, experts - 1, n)], axis=1).astype(np.int32)


@pytest.mark.parametrize(
    ("shape", "tiles", "n"),
    [
        # a plan of 256 tokens for 256 (one group) and for 200 of them, an expert in every token
        (NARROW, MmaTiles(warps=4, blocks=6, rows=64, tokens=256), 256),
        (NARROW, MmaTiles(warps=2, blocks=5, rows=64, tokens=256, chunk=16), 200),
        # plans of 64 tokens for 150 (three groups, the last of 22), chunks of 32 pairs
        (NARROW, MmaTiles(warps=4, blocks=7, rows=64, tokens=64, chunk=32), 150),
    ],
    ids=["plan256", "plan256-chunk16", "plan64-chunk32"],
)
def test_large_plans_with_uneven_experts_match_numpy(
    tmp_path: Path, shape: MoeDecodeShape, tiles: MmaTiles, n: int
) -> None:
    assert expert_mma_unsupported(shape, tiles) is None
    ids = uneven_ids(np.random.default_rng(3), n, shape.experts)
    gate_up = gate_up_expert_mma_kernel(shape, tiles)
    down = down_expert_mma_kernel(shape, tiles)
    check_expert_kernels(tmp_path, shape, n, gate_up, down, tiles.blocks, seed=7, ids=ids)


@pytest.mark.parametrize(
    ("shape", "tiles", "n"),
    [
        # chunks of 16 with a K split of 4 (the n-tiles' partials summed through shared memory)
        (SMALL, MmaTiles(warps=4, blocks=5, rows=16, chunk=16), 21),
        # chunks of 32 in a ring of 2 runs of 256; chunks of 16 with runs of 256 and a tail of 128
        (WIDE, MmaTiles(warps=2, blocks=4, rows=32, depth=2, run=256, chunk=32), 40),
        (TAIL, MmaTiles(warps=4, blocks=5, rows=64, run=256, chunk=16), 11),
    ],
    ids=["small-split4-chunk16", "wide-d2-chunk32", "tail-chunk16"],
)
def test_chunks_of_several_n_tiles_match_numpy(
    tmp_path: Path, shape: MoeDecodeShape, tiles: MmaTiles, n: int
) -> None:
    assert expert_mma_unsupported(shape, tiles) is None
    gate_up = gate_up_expert_mma_kernel(shape, tiles)
    down = down_expert_mma_kernel(shape, tiles)
    check_expert_kernels(tmp_path, shape, n, gate_up, down, tiles.blocks, seed=11)


def test_a_plan_that_differs_between_blocks_fails(tmp_path: Path) -> None:
    """Negative control: odd blocks rank an expert's lanes of a run of 32 pairs in reverse, so
    an expert of more than 8 pairs a run has other pairs in a chunk there: the blocks that share
    a chunk's rows disagree on its pairs, and some (pair, row) is never written."""
    tiles = MmaTiles(warps=4, blocks=6, rows=64, tokens=256)
    ids = uneven_ids(np.random.default_rng(3), 64, NARROW.experts)

    def reverse_in_odd_blocks(src: str) -> str:
        rank = re.search(r"(dsv2_em_popc_\w+)\(m & below\)\] =", src)
        assert rank is not None, "the plan's fill changed: update this control"
        popc = rank.group(1)
        broken = f"(blockIdx.x & 1 ? {popc}(m & ~below & ~(1u << lane)) : {popc}(m & below))] ="
        return src.replace(rank.group(0), broken)

    gate_up = gate_up_expert_mma_kernel(NARROW, tiles)
    down = down_expert_mma_kernel(NARROW, tiles)
    with pytest.raises(AssertionError, match="h: rel L2"):
        check_expert_kernels(
            tmp_path, NARROW, 64, gate_up, down, tiles.blocks, seed=7, ids=ids,
            patch=reverse_in_odd_blocks,
        )  # fmt: skip


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def check_expert_kernels(
    tmp_path: Path,
    s: MoeDecodeShape,
    n: int,
    gate_up,
    down,
    blocks: int,
    seed: int,
    ids: np.ndarray | None = None,
    patch: Callable[[str], str] | None = None,
) -> None:
    """Run an expert-major gate/up and down kernel pair (``blocks`` blocks each) on ``n`` random
    tokens routed by the float64 router (or by ``ids``); assert ``h`` and the unweighted ``part``
    against float64 NumPy (every output element starts NaN). ``patch``: a rewrite of both
    kernels' source (a negative control)."""
    H, NI, K = s.hidden, s.inter, s.top_k
    x, logits, (w, sc, wv), (sw, ss, swv), (dw, ds, dwv), (sdw, sds, sdwv) = moe_inputs(
        np.random.default_rng(seed), s, n
    )
    if ids is None:
        args = (s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
        _, ids = route_numpy(logits.astype(np.float64), *args)
        ids = ids.astype(np.int32)

    h = np.full((n, s.total), np.nan, np.float16)
    arrays = {"x": x, "ids": ids, "w": w, "s": sc, "sw": sw, "ss": ss, "hout": h}
    emulate(gate_up, tmp_path, "gate_up", patch=patch)(blocks, arrays, n)
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
    emulate(down, tmp_path, "down", patch=patch)(blocks, arrays, n)
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
    assert "chunk 12" in expert_mma_unsupported(SMALL, MmaTiles(chunk=12))
    assert "tokens 48" in expert_mma_unsupported(SMALL, MmaTiles(tokens=48))
    assert "plan of 8192 tokens" in expert_mma_unsupported(SMALL, MmaTiles(tokens=8192))
    assert "16-bit" in expert_mma_unsupported(SMALL, MmaTiles(tokens=12000))
    # a decode step's plan of 256 tokens fits V2-Lite and V2 (236B: 160 experts, hidden 5120)
    # with chunks of 8 and 16; 32 staged rows of V2's 5120 do not fit beside it
    v2 = MoeDecodeShape(5120, 1536, 3072, 160, 6, 128)
    for kernel in ("moe_expert_mma_gate_up", "moe_expert_mma_down"):
        for shape in (lite, v2):
            for chunk in (8, 16):
                tiles = dataclasses.replace(tuned(kernel), tokens=256, chunk=chunk)
                assert expert_mma_unsupported(shape, tiles) is None, (kernel, shape, chunk)
        assert expert_mma_unsupported(lite, dataclasses.replace(tuned(kernel), chunk=32)) is None
        big = dataclasses.replace(tuned(kernel), tokens=256, chunk=32)
        assert "32 staged rows of 5120" in expert_mma_unsupported(v2, big)


"""The expert-major MoE decode kernels (``schedules/moe_expert_major_cuda.py``) run on the CPU
against float64 NumPy, no GPU.

TVM's CUDA source runs under ``tests/cuda_emulation.py`` (a ``std::thread`` per CUDA thread, fp16
rounded as the hardware rounds, shared memory 0xff-filled per block, AddressSanitizer). Routing
comes from the float64 reference router (the kernels take the ids); the reference is ``h =
silu(gate . x) * (up . x)`` per routed slot and for the shared experts, then each slot's ``down .
h`` unweighted, within the error of fp16 partial sums. Every element of both outputs starts NaN,
so a (token, slot) no item wrote shows; the cases cover experts chosen by several tokens (chunks
split at ``tokens`` pairs), more tokens than a group (two groups), items that end mid-chunk, and
more blocks than items.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape
from dsv2_mlc.schedules.moe_expert_major_cuda import (
    GROUP_TOKENS,
    ExpertMajorTiles,
    expert_major_unsupported,
    moe_down_expert_major,
    moe_gate_up_expert_major,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, rel_l2  # noqa: E402
from test_moe_decode_emulation import LIMITED, LONG, MEDIUM, TOL, moe_inputs, route_numpy  # noqa: E402

pytestmark = needs_toolchain


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def _route(logits: np.ndarray, s: MoeDecodeShape) -> tuple[np.ndarray, np.ndarray]:
    args = (s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
    return route_numpy(logits.astype(np.float64), *args)


@pytest.mark.parametrize(
    ("shape", "tiles", "n"),
    [
        # 3 tokens, 8 experts of top-2: experts shared by tokens, chunks of 2 pairs
        (LIMITED, ExpertMajorTiles(warps=2, blocks=5, rows=16, tokens=2), 3),
        # more tokens than a group: the kernels plan twice (weights read again for the second)
        (LIMITED, ExpertMajorTiles(warps=2, blocks=7, rows=24, tokens=8), GROUP_TOKENS + 5),
        # 16 experts of top-4, rows not a multiple of the item's: items end mid-expert
        (MEDIUM, ExpertMajorTiles(warps=4, blocks=9, rows=48, tokens=3), 6),
        # 40 chunks a gate/up row (the second of a lane only on lanes 0-7); more blocks than items
        (LONG, ExpertMajorTiles(warps=2, blocks=40, rows=64, tokens=4), 4),
    ],
    ids=["limited", "two-groups", "medium", "long"],
)
def test_expert_major_kernels_match_numpy(
    tmp_path: Path, shape: MoeDecodeShape, tiles: ExpertMajorTiles, n: int
) -> None:
    assert expert_major_unsupported(shape, tiles) is None
    gate_up, down = moe_gate_up_expert_major(shape, tiles), moe_down_expert_major(shape, tiles)
    check_expert_kernels(tmp_path, shape, n, gate_up, down, tiles.blocks, seed=3)


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
    _, ids = _route(logits, s)
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


def test_expert_major_refuses_rows_that_do_not_fit() -> None:
    wide = MoeDecodeShape(64, 32, 64 * 1024, 8, 2, 32)
    assert "shared memory" in expert_major_unsupported(wide)
    with pytest.raises(ValueError, match="cannot take"):
        moe_down_expert_major(wide)
    odd = MoeDecodeShape(64, 48, 64, 8, 2, 32)
    assert "inter 48" in expert_major_unsupported(odd)

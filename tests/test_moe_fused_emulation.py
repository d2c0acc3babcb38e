"""The one-kernel MoE decode (``schedules/moe_fused_decode_cuda.py``) runs on the CPU against
float64 NumPy, no GPU (``tests/cuda_emulation.py``: a ``std::thread`` per CUDA thread, fp16
rounded as the hardware rounds, shared memory 0xff-filled per block, AddressSanitizer).

The reference: DeepSeek-V2's routing in float64 (exact ids), ``h = silu(gate . x) * (up . x)``
from the dequantised INT4 weights, rounded to fp16 (as the kernel and the two-kernel path round
``h``), then ``out_before + sum_j w_j down_j . h_j + shared_down . h_s``: the kernel adds to what
``out`` holds, within the error of fp16 partial sums. Each case runs with warp 0 (the router)
held back at its first collective, so the other warps wait for the routing at the barrier.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape
from dsv2_mlc.schedules.moe_fused_decode_cuda import (
    FusedTiles,
    fused_blocks,
    fused_unsupported,
    moe_fused_decode,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, rel_l2  # noqa: E402
from test_moe_decode_emulation import moe_inputs, route_numpy  # noqa: E402

pytestmark = needs_toolchain

TOL = 2e-3  # relative L2 of the block's output (fp16 partial sums, fp16 h)
# hidden 256: one output a thread of 2 warps, 4 chunks a gate/up row (lanes 0-7 only)
GREEDY = MoeDecodeShape(256, 64, 128, 8, 2, 32)
LIMITED = MoeDecodeShape(256, 128, 256, 8, 2, 64, 4, 2, False, 16.0)
RENORM = MoeDecodeShape(512, 128, 256, 16, 4, 128, norm_topk_prob=True)
# 40 chunks a gate/up row: two a lane, the second only on lanes 0-7
LONG = MoeDecodeShape(1280, 64, 64, 8, 2, 64, routed_scaling_factor=2.5)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize(
    ("shape", "tiles", "n"),
    [
        (GREEDY, FusedTiles(rows=32, warps=2), 3),  # one chunk of a down row a block
        (GREEDY, FusedTiles(rows=64, warps=2, run=8, down_run=16), 2),
        (LIMITED, FusedTiles(rows=128, warps=2, run=4, down_run=4), 3),  # four chunks, 2 groups
        (RENORM, FusedTiles(rows=64, warps=4), 3),  # a slice inside one scale group
        (LONG, FusedTiles(rows=32, warps=1), 2),
        # x staged in shared memory instead of registers
        (LIMITED, FusedTiles(rows=32, warps=2, x_shared=True), 2),
        (LONG, FusedTiles(rows=64, warps=2, x_shared=True), 2),
    ],
    ids=[
        "greedy-r32",
        "greedy-r64",
        "limited-r128",
        "renorm-r64",
        "long-r32",
        "limited-xs",
        "long-xs",
    ],
)
def test_fused_moe_kernel_matches_numpy(
    tmp_path: Path, shape: MoeDecodeShape, tiles: FusedTiles, n: int
) -> None:
    s = shape
    assert fused_unsupported(s, tiles) is None
    H, NI, IS = s.hidden, s.inter, s.shared_inter
    rng = np.random.default_rng(4)
    x, logits, (w, sc, wv), (sw, ss, swv), (dw, ds, dwv), (sdw, sds, sdwv) = moe_inputs(rng, s, n)
    before = rng.standard_normal((n, H)).astype(np.float32)
    out = before.copy()
    arrays = {"x": x, "logits": logits, "w": w, "sc": sc, "sw": sw, "ss": ss,
              "dw": dw, "ds": ds, "sdw": sdw, "sds": sds, "out": out}  # fmt: skip
    run = emulate(moe_fused_decode(s, tiles), tmp_path, "fused")
    run(n * fused_blocks(s, tiles), arrays, n, slow_warp=0)

    args = (s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
    ref_w, ref_ids = route_numpy(logits.astype(np.float64), *args)
    xf = x.astype(np.float64)
    ref = before.astype(np.float64)
    for t in range(n):
        gu = swv @ xf[t]
        h_s = (_silu(gu[:IS]) * gu[IS:]).astype(np.float16).astype(np.float64)
        ref[t] += sdwv @ h_s
        for j, e in enumerate(ref_ids[t]):
            gu = wv[e] @ xf[t]
            h = (_silu(gu[:NI]) * gu[NI:]).astype(np.float16).astype(np.float64)
            ref[t] += ref_w[t, j] * (dwv[e] @ h)
    got = out.astype(np.float64) - before
    want = ref - before
    assert rel_l2(got, want) < TOL, f"out: rel L2 {rel_l2(got, want):.2e}"


def test_fused_moe_kernel_refuses_shapes_it_cannot_split() -> None:
    lite = MoeDecodeShape(2048, 1408, 2816, 64, 6, 128)
    assert fused_unsupported(lite) is None
    assert "rows 96" in fused_unsupported(lite, FusedTiles(rows=96))
    assert "does not divide the intermediate" in fused_unsupported(
        MoeDecodeShape(2048, 1440, 2880, 64, 6, 32), FusedTiles(rows=64)
    )
    assert "hidden" in fused_unsupported(MoeDecodeShape(512, 64, 128, 8, 2, 32))
    with pytest.raises(ValueError, match="moe_fused_decode: rows 96"):
        moe_fused_decode(lite, FusedTiles(rows=96))

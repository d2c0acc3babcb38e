"""``o_proj`` + residual add + RMSNorm + MoE router in one kernel (``schedules/
oproj_router_cuda.py``), and the gate/up kernel that reads its expert ids, on the CPU against
NumPy (``tests/cuda_emulation.py``; the blocks run one after another, so the last ticket is the
last block's, and the partial sums of every block are in by then).

References in float64: ``y = x @ dequant(W)^T`` (the GEMV's fp16 partial sums bound the error),
``s = r + y``; then from the kernel's own ``s``: ``xn = w * fp16(s * rsqrt(mean(s^2) + eps))``
(within an fp16 rounding), the logits ``(G * w) @ s * rsqrt(...)`` (float32 sums), and the routing
of those logits (``route_numpy``: softmax, group limit, top-k with ties to the lowest index) with
exact ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.moe_decode_cuda import (
    DOWN_TILES,
    GateUpTiles,
    MoeDecodeShape,
    moe_down_decode,
    moe_gate_up_decode,
)
from dsv2_mlc.schedules.moe_routing import RouterShape
from dsv2_mlc.schedules.oproj_router_cuda import oproj_router_decode, oproj_router_unsupported

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, random_int4, rel_l2  # noqa: E402
from test_moe_decode_emulation import _check_gate_up, route_numpy  # noqa: E402

EPS = 1e-6


@needs_toolchain
@pytest.mark.parametrize(
    ("N", "K", "G", "route", "n"),
    [
        (64, 64, 32, RouterShape(8, 2), 3),  # 8 blocks, 3 tokens, greedy
        (64, 96, 32, RouterShape(8, 2, 4, 2, False, 16.0), 2),  # group-limited, scaled; 3 chunks
        (128, 256, 64, RouterShape(16, 4, norm_topk_prob=True), 1),  # renormalised
        (64, 128, 128, RouterShape(160, 6, 8, 3, False, 16.0), 2),  # V2's router: 2 G loads a
        # thread (160 experts x 2 float4 > 256 threads)
        (2048, 2048, 128, RouterShape(64, 6), 1),  # V2-Lite: 256 blocks, xn in 2 steps a thread
    ],
    ids=["greedy", "limited", "renorm", "v2-router", "v2-lite"],
)
def test_oproj_router_matches_numpy(
    tmp_path: Path, N: int, K: int, G: int, route: RouterShape, n: int
) -> None:
    rng = np.random.default_rng(N + K + route.experts)
    E, TK = route.experts, route.top_k
    x = rng.standard_normal((n, K)).astype(np.float16)
    qw, qs, wv = random_int4(rng, (N,), K, G)
    r = (3 * rng.standard_normal((n, N))).astype(np.float16)
    nw = (1 + 0.1 * rng.standard_normal(N)).astype(np.float16)
    gw = (rng.standard_normal((E, N)) / np.sqrt(N) * 4).astype(np.float32)
    out = {
        "part": np.full((n, E + 1, N // 8), np.nan, np.float32),
        "s": np.full((n, N), np.nan, np.float16),
        "xn": np.full((n, N), np.nan, np.float16),
        "logits": np.full((n, E), np.nan, np.float32),
        "wout": np.full((n, TK), np.nan, np.float32),
        "iout": np.full((n, TK), -1, np.int32),
    }
    arrays = {"x": x, "qw": qw, "qs": qs, "r": r, "nw": nw, "gw": gw, **out}
    run = emulate(oproj_router_decode(N, K, G, route, EPS), tmp_path, "oproj_router")
    run(N // 8, arrays, n, slow_warp=0)

    # s = r + W x, within the GEMV's fp16 partial sums
    ref_s = r.astype(np.float64) + x.astype(np.float64) @ wv.T
    assert rel_l2(out["s"], ref_s) < 2e-3, f"s: rel L2 {rel_l2(out['s'], ref_s):.2e}"
    # from the kernel's s: the norm, the logits and the routing
    s = out["s"].astype(np.float64)
    inv = 1 / np.sqrt((s * s).mean(-1, keepdims=True) + EPS)
    ref_xn = nw.astype(np.float64) * (s * inv).astype(np.float16)
    np.testing.assert_allclose(out["xn"], ref_xn, rtol=2e-3, atol=1e-6)
    ref_logits = (s * nw.astype(np.float64) * inv) @ gw.astype(np.float64).T
    np.testing.assert_allclose(out["logits"], ref_logits, rtol=1e-4, atol=1e-5)
    args = (TK, route.n_group, route.topk_group, route.norm_topk_prob, route.routed_scaling_factor)
    ref_w, ref_ids = route_numpy(out["logits"].astype(np.float64), *args)
    np.testing.assert_array_equal(out["iout"], ref_ids)
    np.testing.assert_allclose(out["wout"], ref_w, rtol=1e-5, atol=0)


@needs_toolchain
def test_oproj_router_resets_its_ticket_for_the_next_launch(tmp_path: Path) -> None:
    # two launches in one process, each from outputs of NaN: the second finds the counter at 0
    # again (else no block of it would be last, and its logits, routing and xn stay unwritten)
    rng = np.random.default_rng(4)
    N, K, G, route, n = 64, 64, 32, RouterShape(8, 2), 1
    x = rng.standard_normal((n, K)).astype(np.float16)
    qw, qs, _ = random_int4(rng, (N,), K, G)
    arrays = {
        "x": x, "qw": qw, "qs": qs, "r": rng.standard_normal((n, N)).astype(np.float16),
        "nw": np.ones(N, np.float16), "gw": rng.standard_normal((8, N)).astype(np.float32),
        "part": np.zeros((n, 9, N // 8), np.float32), "s": np.zeros((n, N), np.float16),
        "xn": np.full((n, N), np.nan, np.float16), "logits": np.full((n, 8), np.nan, np.float32),
        "wout": np.full((n, 2), np.nan, np.float32), "iout": np.full((n, 2), -1, np.int32),
    }  # fmt: skip
    run = emulate(oproj_router_decode(N, K, G, route, EPS), tmp_path, "ticket")
    run(N // 8, arrays, n, launches=2)
    assert np.isfinite(arrays["logits"]).all() and np.isfinite(arrays["xn"]).all()
    assert ((arrays["iout"] >= 0) & (arrays["iout"] < 8)).all()


def test_oproj_router_names_what_it_cannot_take() -> None:
    assert "32-element" in oproj_router_unsupported(64, 48, 32, 8)
    assert "blocks of 8 rows" in oproj_router_unsupported(60, 64, 32, 8)
    assert "blocks of 8 rows" in oproj_router_unsupported(8 * 1025, 64, 32, 8)
    assert "experts" in oproj_router_unsupported(64, 64, 32, 0)
    assert oproj_router_unsupported(2048, 2048, 128, 64) is None
    with pytest.raises(ValueError, match="oproj_router_decode"):
        oproj_router_decode(60, 64, 32, RouterShape(8, 2), EPS)


@needs_toolchain
@pytest.mark.parametrize(
    ("shape", "gu", "n"),
    [
        (MoeDecodeShape(64, 32, 64, 8, 2, 32), GateUpTiles(2, 3, 16), 3),
        # 80 warps for 128 rows: warps 64-79 start on a routed row and wait for the ids
        (MoeDecodeShape(64, 32, 64, 8, 2, 32, 4, 2, False, 16.0), GateUpTiles(4, 20, 8), 2),
    ],
    ids=["greedy", "routed-rows-first"],
)
def test_gate_up_reads_the_routing_it_is_given(
    tmp_path: Path, shape: MoeDecodeShape, gu: GateUpTiles, n: int
) -> None:
    s = shape
    H, NI, IS, E, K, G = s.hidden, s.inter, s.shared_inter, s.experts, s.top_k, s.group
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, H)).astype(np.float16)
    logits = (2 * rng.standard_normal((n, E))).astype(np.float32)
    args = (K, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
    ref_w, ref_ids = route_numpy(logits.astype(np.float64), *args)
    w, sc, wv = random_int4(rng, (E, 2 * NI), H, G)
    sw, ss, swv = random_int4(rng, (2 * IS,), H, G)
    h = np.full((n, s.total), np.nan, np.float16)
    ids = ref_ids.astype(np.int32)
    arrays = {"x": x, "ids": ids, "w": w, "sc": sc, "sw": sw, "ss": ss, "hout": h}
    run = emulate(moe_gate_up_decode(s, gu, routed=True), tmp_path, "gate_up_routed")
    run(n * gu.blocks, arrays, n, slow_warp=0)
    _check_gate_up(s, x, logits, wv, swv, h, ref_w.astype(np.float32), ids)
    # the down kernel on that h and the same routing
    dw, ds, dwv = random_int4(rng, (E, H), NI, G)
    sdw, sds, sdwv = random_int4(rng, (H,), IS, G)
    out = np.full((n, H), np.nan, np.float16)
    emulate(moe_down_decode(s), tmp_path, "down")(
        n * -(-H // DOWN_TILES.outputs_per_block),
        {"h": h, "wts": ref_w.astype(np.float32), "ids": ids, "w": dw, "sc": ds, "sw": sdw,
         "ss": sds, "out": out},
        n,
    )  # fmt: skip
    hf = h.astype(np.float64)
    ref = np.stack([
        sdwv @ hf[t, K * NI :]
        + sum(ref_w[t, j] * (dwv[e] @ hf[t, j * NI : (j + 1) * NI]) for j, e in enumerate(ids[t]))
        for t in range(n)
    ])  # fmt: skip
    assert rel_l2(out, ref) < 2e-3, f"out: rel L2 {rel_l2(out, ref):.2e}"

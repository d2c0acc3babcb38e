"""The MoE decode kernels (``schedules/moe_decode_cuda.py``) and the GPU router
(``schedules/moe_routing.py: moe_route_gpu``) run on the CPU against NumPy, no GPU.

TVM's CUDA source is run by ``tests/cuda_emulation.py`` (a ``std::thread`` per CUDA thread, warp
collectives exchanged between the warp's threads, fp16 rounded as the hardware rounds, shared
memory 0xff-filled per block, AddressSanitizer). The reference is float64: routing (softmax,
group limit, top-k with ties to the lowest index, renormalise or scale) with exact ids, ``h =
silu(gate . x) * (up . x)`` from the dequantised INT4 weights and ``out = sum_j w_j down_j . h_j
+ shared_down . h_s``, within the error of fp16 partial sums (``dot32_source``). Kernel 1 runs
with warp 0 held back at its first collective, so the other warps reach the routing flag first.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.moe_decode_cuda import (
    MoeDecodeShape,
    down_decode_kernel,
    gate_up_decode_kernel,
)
from dsv2_mlc.schedules.moe_routing import GPU_WARPS_PER_BLOCK, moe_route_gpu
from dsv2_mlc.schedules.tiles import DecodeTiles, GateUpTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, random_int4, rel_l2  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None,
    reason="needs nvcc (TVM's CUDA build here) and g++ (C++20)",
)

TINY = {"hidden": 64, "inter": 32, "shared_inter": 64, "experts": 8, "top_k": 2, "group": 32}
GREEDY = MoeDecodeShape(**TINY)
LIMITED = MoeDecodeShape(**TINY, n_group=4, topk_group=2, routed_scaling_factor=16.0)
RENORM = MoeDecodeShape(**TINY, norm_topk_prob=True)
# 8 scale groups per row of gate/up, 2 per routed down row; limited and renormalised
MEDIUM = MoeDecodeShape(512, 128, 256, 16, 4, 64, 4, 2, True)
# 40 chunks per gate/up row: two per lane, the second only on lanes 0-7
LONG = MoeDecodeShape(1280, 64, 64, 8, 2, 64, routed_scaling_factor=2.5)
TOL = 2e-3  # relative L2: fp16 partial sums and the fp16 output (measured 4e-4 to 9e-4)


def route_numpy(
    logits: np.ndarray, k: int, n_group: int, topk_group: int, norm: bool, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """(weights [n, k] float64, ids [n, k]) of DeepSeek-V2's gate, in float64."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    n, e = p.shape
    if 1 < n_group and topk_group < n_group:
        best = p.reshape(n, n_group, e // n_group).max(-1)
        keep = np.argsort(-best, axis=-1, kind="stable")[:, :topk_group]
        mask = np.zeros_like(best)
        np.put_along_axis(mask, keep, 1.0, axis=-1)
        p = p * np.repeat(mask, e // n_group, axis=-1)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]  # ties: the lowest index first
    w = np.take_along_axis(p, ids, axis=-1)
    if norm and k > 1:
        return w / (w.sum(-1, keepdims=True) + 1e-20), ids
    return w * scale, ids


def _logits(rng: np.random.Generator, n: int, e: int) -> np.ndarray:
    """Random logits; row 1: the first and the last expert tie for the best score; row 2: all
    equal (the lowest indices win, and the lowest groups)."""
    logits = (2 * rng.standard_normal((n, e))).astype(np.float32)
    if n > 1:
        logits[1, [0, e - 1]] = 8.0
    if n > 2:
        logits[2] = 0.5
    return logits


def moe_inputs(rng: np.random.Generator, s: MoeDecodeShape, n: int) -> tuple:
    """Random inputs of an MoE block for ``n`` tokens: ``x [n, H]`` fp16, router logits
    (:func:`_logits`), then ``(packed, scales, float64 values)`` (:func:`random_int4`) of the
    routed gate/up ``[E, 2I, H]``, the shared gate/up ``[2Is, H]``, the routed down ``[E, H, I]``
    and the shared down ``[H, Is]``, drawn from ``rng`` in that order."""
    H, NI, IS, E, G = s.hidden, s.inter, s.shared_inter, s.experts, s.group
    x = rng.standard_normal((n, H)).astype(np.float16)
    logits = _logits(rng, n, E)
    weights = [(E, 2 * NI), H], [(2 * IS,), H], [(E, H), NI], [(H,), IS]
    return x, logits, *(random_int4(rng, rows, k, G) for rows, k in weights)


def _route(logits: np.ndarray, s: MoeDecodeShape) -> tuple[np.ndarray, np.ndarray]:
    args = (s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor)
    return route_numpy(logits.astype(np.float64), *args)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def _check_gate_up(
    s: MoeDecodeShape,
    x: np.ndarray,
    logits: np.ndarray,
    wv: np.ndarray,
    swv: np.ndarray,
    h: np.ndarray,
    weights: np.ndarray,
    ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Assert a gate/up kernel's routing and ``h`` against float64 NumPy; the reference
    routing (weights, ids)."""
    NI, IS, K = s.inter, s.shared_inter, s.top_k
    ref_w, ref_ids = _route(logits, s)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=0)
    xf = x.astype(np.float64)
    ref_h = np.empty((x.shape[0], s.total))
    for t in range(x.shape[0]):
        for j, e in enumerate(ref_ids[t]):
            gate_up = wv[e] @ xf[t]
            ref_h[t, j * NI : (j + 1) * NI] = _silu(gate_up[:NI]) * gate_up[NI:]
        gate_up = swv @ xf[t]
        ref_h[t, K * NI :] = _silu(gate_up[:IS]) * gate_up[IS:]
    assert rel_l2(h, ref_h) < TOL, f"h: rel L2 {rel_l2(h, ref_h):.2e}"
    return ref_w, ref_ids


@pytest.mark.parametrize(
    ("shape", "gu", "dn", "n", "waits"),
    [
        (GREEDY, GateUpTiles(2, 3, 16), DecodeTiles(2, 8, 2, 8), 3, False),
        # 80 warps for 128 rows: warps 64-79 start on a routed row, so they wait for routing
        (LIMITED, GateUpTiles(4, 20, 8), DecodeTiles(4, 32, 3, 16), 3, True),
        (RENORM, GateUpTiles(1, 5, 4), DecodeTiles(1, 2, 1, 4), 3, False),
        (MEDIUM, GateUpTiles(8, 4, 16), DecodeTiles(8, 32, 2, 8), 2, False),
        (MEDIUM, GateUpTiles(4, 7, 8), DecodeTiles(4, 16, 3, 16), 1, False),
        # 40 chunks: the second of a lane only on lanes 0-7
        (LONG, GateUpTiles(4, 3, 16), DecodeTiles(2, 4, 4, 8), 2, False),
    ],
    ids=["greedy", "limited", "renorm", "medium", "medium-b", "long"],
)
def test_moe_decode_kernels_match_numpy(
    tmp_path: Path, shape: MoeDecodeShape, gu: GateUpTiles, dn: DecodeTiles, n: int, waits: bool
) -> None:
    s = shape
    H, NI, K = s.hidden, s.inter, s.top_k
    x, logits, (w, sc, wv), (sw, ss, swv), (dw, ds, dwv), (sdw, sds, sdwv) = moe_inputs(
        np.random.default_rng(1), s, n
    )

    # kernel 1: routing + gate/up + SwiGLU
    h = np.full((n, s.total), np.nan, np.float16)
    weights = np.full((n, K), np.nan, np.float32)
    ids = np.full((n, K), -1, np.int32)
    arrays = {"x": x, "logits": logits, "w": w, "sc": sc, "sw": sw, "ss": ss}
    run = emulate(gate_up_decode_kernel(s, gu), tmp_path, "gate_up")
    stats = run(n * gu.blocks, {**arrays, "hout": h, "wout": weights, "iout": ids}, n, slow_warp=0)
    if waits:
        assert stats["nanosleep"] > 0, "no warp waited for the routing flag"
    assert stats["prefetch_bytes"] == 0  # the gate/up kernel asks L2 for nothing
    ref_w, ref_ids = _check_gate_up(s, x, logits, wv, swv, h, weights, ids)

    # kernel 2: down projections + weighted sum, on kernel 1's h and routing
    out = np.full((n, H), np.nan, np.float16)
    arrays = {"h": h, "w": dw, "sc": ds, "sw": sdw, "ss": sds, "out": out}
    routing = {"wts": weights, "ids": ids}
    emulate(down_decode_kernel(s, dn), tmp_path, "down")(
        n * -(-H // dn.outputs_per_block), {**arrays, **routing}, n
    )
    hf = h.astype(np.float64)
    ref = np.empty((n, H))
    for t in range(n):
        ref[t] = sdwv @ hf[t, K * NI :]
        for j, e in enumerate(ref_ids[t]):
            ref[t] += ref_w[t, j] * (dwv[e] @ hf[t, j * NI : (j + 1) * NI])
    assert rel_l2(out, ref) < TOL, f"out: rel L2 {rel_l2(out, ref):.2e}"


@pytest.mark.parametrize(
    "args",
    [
        (8, 2, 4, 2, False, 16.0),  # the tiny config B: group-limited, scaled
        (8, 2, 1, 1, True, 1.0),  # greedy, renormalised
        (64, 6, 1, 1, False, 1.0),  # V2-Lite: two experts per lane
        (160, 6, 8, 3, False, 16.0),  # V2: five experts per lane, 8 groups of 20
        (16, 1, 1, 1, True, 1.0),  # top-1: norm_topk_prob does not apply
    ],
)
def test_gpu_router_matches_numpy(tmp_path: Path, args: tuple) -> None:
    e, k, n_group, topk_group, norm, scale = args
    rng = np.random.default_rng(2)
    n = 2 * GPU_WARPS_PER_BLOCK + 3  # the last block has one idle warp
    logits = _logits(rng, n, e)
    logits[3] = np.repeat(rng.standard_normal(e // 2), 2)  # pairs of equal scores
    logits[4, :] = -1.0  # groups tie on their max, the best of each group is its first expert
    logits[4, :: e // n_group] = 3.0
    logits[5] = -logits[4]
    weights = np.full((n, k), np.nan, np.float32)
    ids = np.full((n, k), -1, np.int32)
    blocks = -(-n // GPU_WARPS_PER_BLOCK)
    emulate(moe_route_gpu(*args), tmp_path)(
        blocks, {"logits": logits, "weights": weights, "ids": ids}, n
    )
    ref_w, ref_ids = route_numpy(logits.astype(np.float64), k, n_group, topk_group, norm, scale)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=0)


def test_gpu_router_gives_valid_experts_for_nan_scores(tmp_path: Path) -> None:
    # NaN scores break the rank order: slots no rank fills must still hold an expert id that
    # indexes the weights (0, as the CPU router falls back to), never an uninitialised value
    e, k = 64, 6
    rng = np.random.default_rng(3)
    n = GPU_WARPS_PER_BLOCK
    logits = _logits(rng, n, e)
    logits[0, 5] = np.nan
    logits[1, :] = np.nan
    weights = np.full((n, k), np.nan, np.float32)
    ids = np.full((n, k), -1, np.int32)
    emulate(moe_route_gpu(e, k, 1, 1, False, 1.0), tmp_path)(
        1, {"logits": logits, "weights": weights, "ids": ids}, n
    )
    assert ((ids >= 0) & (ids < e)).all(), ids
    ref_w, ref_ids = route_numpy(logits[2:].astype(np.float64), k, 1, 1, False, 1.0)
    np.testing.assert_array_equal(ids[2:], ref_ids)  # rows without NaN: unchanged


def test_dynamic_shared_memory_keeps_its_size_through_compaction() -> None:
    """TVM compacts a block's buffer to the region its TIR touches; a hand kernel reaches its
    dynamic shared memory only through pointers, so the shell passes both ends (else the GPU
    launch gets 4 bytes and the kernel writes out of bounds; the emulation cannot see it)."""
    import re

    import tvm

    from dsv2_mlc.schedules.moe_expert_mma_cuda import moe_gate_up_expert_mma

    # V2's rows of 5120 inputs: the chunk's staged x rows (82 KB) need dynamic shared memory
    v2 = MoeDecodeShape(5120, 1536, 3072, 160, 6, 128, 8, 3, False, 16.0)
    func = moe_gate_up_expert_mma(v2)
    out = tvm.s_tir.transform.CompactBufferAllocation()(tvm.IRModule({"p": func}))
    (halves,) = re.findall(r'T\.sblock_alloc_buffer\(\((\d+),\), "float16", scope="shared\.dyn"\)',
                           out["p"].script())  # fmt: skip
    assert int(halves) * 2 >= 4 * 8 * 2562  # 8 staged rows of 2562 words

"""The residual add + RMSNorm folded into its consumer (``schedules/norm_gemv_cuda.py``) run on
the CPU against NumPy, no GPU.

TVM's CUDA source is run by ``tests/cuda_emulation.py`` (a ``std::thread`` per CUDA thread, warp
shuffles exchanged between the warp's threads, fp16 half2 arithmetic rounded once as on the GPU,
AddressSanitizer). Reference: ``s = fp16(r + d)`` (exact), ``xn = fp16(w * fp16(s * rsqrt(mean(
s^2) + eps)))`` (float64 inside, so within an ulp of the kernel's float32), ``y = xn @
dequant(W)^T`` within the error of fp16 partial sums, router logits ``xn @ G^T`` (float32 ``G``)
within float32 rounding of the kernel's own ``xn``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.norm_gemv_cuda import add_norm_gemv_kernel, add_norm_router_kernel
from dsv2_mlc.schedules.tiles import NormGemvTiles, NormRouterTiles, tuned

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, random_int4, rel_l2  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None,
    reason="needs nvcc (TVM's CUDA build here) and g++ (C++20)",
)


def _inputs(rng: np.random.Generator, n: int, hidden: int) -> tuple[np.ndarray, ...]:
    """(r, d, norm weight): fp16, a residual stream of a few units with a spread of scales."""
    r = (rng.standard_normal((n, hidden)) * rng.uniform(0.5, 4, (n, 1))).astype(np.float16)
    d = rng.standard_normal((n, hidden)).astype(np.float16)
    w = (1 + 0.3 * rng.standard_normal(hidden)).astype(np.float16)
    return r, d, w


def _norm_numpy(r: np.ndarray, d: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, ...]:
    """(s, xn) as fp16 arrays: the fp16 sum and ``w * fp16(s * rsqrt(mean(s^2) + eps))`` with one
    fp16 rounding per step."""
    s = (r.astype(np.float64) + d).astype(np.float16)
    sf = s.astype(np.float64)
    inv = 1 / np.sqrt((sf * sf).mean(-1, keepdims=True) + eps)
    xn = (w.astype(np.float64) * (sf * inv).astype(np.float16)).astype(np.float16)
    return s, xn


def _check_norm(s: np.ndarray, xn: np.ndarray, ref_s: np.ndarray, ref_xn: np.ndarray) -> None:
    np.testing.assert_array_equal(s, ref_s)
    ulp = np.spacing(np.abs(ref_xn))
    off = np.abs(xn.astype(np.float64) - ref_xn) / ulp
    assert off.max() <= 1, f"xn off by {off.max()} ulp"
    assert (off == 0).mean() > 0.98, f"xn: {(off != 0).mean():.1%} of the values off by an ulp"


@pytest.mark.parametrize(
    ("hidden", "out_dim", "group", "eps", "tiles", "n"),
    [
        (64, 40, 32, 1e-6, NormGemvTiles(3, 2, 16), 3),  # 6 warps for 40 rows: uneven shares
        (64, 7, 64, 1e-6, NormGemvTiles(4, 1, 4), 1),  # fewer rows than warps
        (256, 72, 64, 1e-5, NormGemvTiles(5, 3, 8), 3),
        (256, 50, 128, 1e-6, NormGemvTiles(8, 4, 16), 1),
        (1280, 24, 128, 1e-6, NormGemvTiles(2, 3, 16), 1),  # two chunks per lane, one partial
        # V2's qkv_a (q-LoRA 1536 + latent 576) at hidden 5120: five chunks a lane, the shipped
        # tiles
        (5120, 2112, 128, 1e-6, tuned("add_norm_gemv", shape=(5120,)), 1),
    ],
)
def test_add_norm_gemv_q4_matches_numpy(
    tmp_path: Path, hidden: int, out_dim: int, group: int, eps: float, tiles: NormGemvTiles, n: int
) -> None:
    rng = np.random.default_rng(3)
    r, d, w = _inputs(rng, n, hidden)
    qw, qs, wv = random_int4(rng, (out_dim,), hidden, group)
    y = np.full((n, out_dim), np.nan, np.float16)
    s = np.full((n, hidden), np.nan, np.float16)
    run = emulate(add_norm_gemv_kernel(hidden, out_dim, group, eps, tiles), tmp_path)
    run(n * tiles.blocks, {"r": r, "d": d, "nw": w, "qw": qw, "qs": qs, "y": y, "s": s}, n)
    ref_s, ref_xn = _norm_numpy(r, d, w, eps)
    np.testing.assert_array_equal(s, ref_s)
    ref_y = ref_xn.astype(np.float64) @ wv.T
    assert rel_l2(y, ref_y) < 2e-3, f"y: rel L2 {rel_l2(y, ref_y):.2e}"


def _run_router(
    tmp_path: Path, hidden: int, experts: int, eps: float, tiles: NormRouterTiles, n: int,
    patch=None,
) -> None:  # fmt: skip
    """Run the router kernel with ``tiles`` (its source rewritten by ``patch``, if given) and
    assert ``s``, ``xn`` and the float32 logits against NumPy."""
    rng = np.random.default_rng(4)
    r, d, w = _inputs(rng, n, hidden)
    gate = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    logits = np.full((n, experts), np.nan, np.float32)
    xn = np.full((n, hidden), np.nan, np.float16)
    s = np.full((n, hidden), np.nan, np.float16)
    kernel = add_norm_router_kernel(hidden, experts, eps, tiles)
    run = emulate(kernel, tmp_path, patch=patch)
    arrays = {"r": r, "d": d, "nw": w, "gw": gate, "logits": logits, "xn": xn, "s": s}
    run(n * -(-experts // tiles.warps), arrays, n)
    _check_norm(s, xn, *_norm_numpy(r, d, w, eps))
    ref = xn.astype(np.float64) @ gate.T.astype(np.float64)
    scale = np.abs(xn.astype(np.float64)) @ np.abs(gate.T.astype(np.float64))
    assert np.abs(logits - ref).max() <= 1e-6 * scale.max(), "logits beyond float32 rounding"


@pytest.mark.parametrize(
    ("hidden", "experts", "eps", "tiles", "n"),
    [
        (64, 8, 1e-6, NormRouterTiles(4), 3),
        (64, 8, 1e-6, NormRouterTiles(3), 1),  # the last block has one expert for three warps
        (256, 20, 1e-5, NormRouterTiles(3), 3),
        (1280, 6, 1e-6, NormRouterTiles(4), 1),
        # two chunks a lane, the first before the wait, the partial second after
        (1280, 6, 1e-6, NormRouterTiles(4, preload=1), 2),
        (1280, 6, 1e-6, NormRouterTiles(2, preload=0), 1),  # none before the wait
        # V2's router (five chunks a lane) with the shipped tiles: 2 chunks before the wait
        (5120, 160, 1e-6, tuned("add_norm_router", shape=(5120,)), 1),
    ],
)
def test_add_norm_router_matches_numpy(
    tmp_path: Path, hidden: int, experts: int, eps: float, tiles: NormRouterTiles, n: int
) -> None:
    _run_router(tmp_path, hidden, experts, eps, tiles, n)


def test_router_with_late_gate_chunks_misread_fails(tmp_path: Path) -> None:
    """Negative control: the chunks loaded after the wait read the chunk before their own."""

    def misread(src: str) -> str:
        late = "reinterpret_cast<const float4*>(row + c * 32)[k]"
        assert src.count(f": {late}") == 1
        return src.replace(f": {late}", ": reinterpret_cast<const float4*>(row + (c - 32) * 32)[k]")

    with pytest.raises(AssertionError, match="float32 rounding"):
        _run_router(tmp_path, 1280, 6, 1e-6, NormRouterTiles(4, preload=1), 2, patch=misread)

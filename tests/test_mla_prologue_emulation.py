"""The fused MLA prologue kernel (``schedules/mla_prologue_cuda.py``) run on the CPU, no GPU.

TVM's CUDA source of the kernel is compiled as C++20 with g++ and run one block at a time, one
``std::thread`` per CUDA thread (``tests/cuda_emulation.py``: ``__syncthreads`` a ``std::barrier``,
the warp shuffles of TVM's warp sum an exchange between the warp's threads). Both outputs start as
NaN (an unwritten element shows) and are checked against a float64 NumPy reference: the latent-space
query ``[q_nope @ W_UK, rope(q_pe)]`` and the cached latent ``[w * RMSNorm(c_kv), rope(k_pe)]``.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.mla_prologue_cuda import build_mla_prologue
from dsv2_mlc.schedules.tiles import tuned

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None,
    reason="needs nvcc (TVM's CUDA build here) and g++ (C++20)",
)


def _rope(x: np.ndarray, tab: np.ndarray) -> np.ndarray:
    even, odd, cos, sin = x[..., 0::2], x[..., 1::2], tab[..., 0::2], tab[..., 1::2]
    return np.stack([even * cos - odd * sin, odd * cos + even * sin], -1).reshape(x.shape)


@pytest.mark.parametrize(
    ("heads", "nope", "rope", "lora", "q_a", "dtype", "kwargs", "n"),
    [
        (16, 128, 64, 512, None, "float16", {}, 2),  # V2-Lite, the model's kernel
        (16, 128, 64, 512, None, "float16", {"cols": 32, "threads": 256}, 1),
        (4, 16, 8, 32, 24, "float16", {}, 3),  # tiny, q-LoRA: q apart, a partial column tile
        (4, 16, 8, 32, None, "float32", {"cols": 16}, 2),
        (4, 16, 8, 32, 24, "float16", {"threads": 64}, 3),
        # V2 (236B): 128 heads, q-LoRA (q from q_b_proj [n, 128 x 192], the latent from column
        # 1536 of qkv_a's output), the shipped tiles: 1025 blocks a token
        (128, 128, 64, 512, 1536, "float16", {}, 1),
    ],
)
def test_prologue_matches_numpy(tmp_path, heads, nope, rope, lora, q_a, dtype, kwargs, n):
    rng = np.random.default_rng(0)
    qk = heads * (nope + rope)
    kv_offset = qk if q_a is None else q_a
    kv = rng.standard_normal((n, kv_offset + lora + rope)).astype(dtype)
    q = kv if q_a is None else rng.standard_normal((n, qk)).astype(dtype)
    w = (rng.standard_normal((heads, nope, lora)) / np.sqrt(nope)).astype(dtype)
    norm_w = (1 + 0.2 * rng.standard_normal(lora)).astype(dtype)
    angles = rng.random((n, rope // 2)) * 2 * np.pi
    tab = (np.stack([np.cos(angles), np.sin(angles)], -1).reshape(n, rope) * 1.2).astype("f4")
    eps = 1e-6
    func = build_mla_prologue(
        heads, nope, rope, lora, dtype, replace(tuned("mla_prologue"), **kwargs),
        q_width=q.shape[1], kv_width=kv.shape[1], kv_offset=kv_offset, eps=eps,
    )  # fmt: skip
    q_lat = np.full((n, heads, lora + rope), np.nan, dtype)
    latent = np.full((n, lora + rope), np.nan, dtype)
    blocks = 1 + heads * -(-lora // kwargs.get("cols", 64))
    arrays = {"q": q, "kv": kv, "w": w, "norm_w": norm_w, "tab": tab}
    stats = emulate(func, tmp_path)(blocks * n, {**arrays, "q_lat": q_lat, "latent": latent}, n)
    # the W_UK tiles are loaded into registers before the wait, not asked of L2
    assert stats["prefetch_bytes"] == 0

    qh = q.astype(np.float64)[:, :qk].reshape(n, heads, nope + rope)
    q_abs = np.einsum("nhd,hdc->nhc", qh[..., :nope], w.astype(np.float64))
    ref_q = np.concatenate([q_abs, _rope(qh[..., nope:], tab[:, None, :])], -1)
    x = kv.astype(np.float64)[:, kv_offset:]
    c_kv = x[:, :lora]
    inv = 1 / np.sqrt((c_kv * c_kv).mean(-1, keepdims=True) + eps)
    ref_latent = np.concatenate([norm_w * (c_kv * inv), _rope(x[:, lora:], tab)], -1)
    tol = 1e-3 if dtype == "float16" else 1e-6
    for got, ref in ((q_lat, ref_q), (latent, ref_latent)):
        got = got.astype(np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol

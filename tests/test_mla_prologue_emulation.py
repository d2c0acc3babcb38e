"""The fused MLA prologue kernel (``schedules/mla_prologue_cuda.py``) run on the CPU, no GPU.

TVM's CUDA source of the kernel is compiled as C++20 with g++ (``half`` = ``_Float16``) and run
one block at a time, one ``std::thread`` per CUDA thread, ``__syncthreads`` a ``std::barrier`` and
the warp-shuffle sum a barrier-separated sum over the warp's values. Both outputs start as NaN (an
unwritten element shows) and are checked against a float64 NumPy reference: the latent-space
query ``[q_nope @ W_UK, rope(q_pe)]`` and the cached latent ``[w * RMSNorm(c_kv), rope(k_pe)]``.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tvm

from dsv2_mlc.schedules.mla_prologue_cuda import mla_prologue_cuda

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None,
    reason="needs nvcc (TVM's CUDA build here) and g++ (C++20)",
)

_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
typedef _Float16 half;
struct dim3_ { int x; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
thread_local dim3_ threadIdx, blockIdx;
static std::barrier<>* g_bar;
static float g_lanes[1024];
#define __global__
#define __launch_bounds__(x)
#define __forceinline__ inline
#define __device__
#define __syncthreads() g_bar->arrive_and_wait()
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <typename T> T tvm_builtin_cuda_warp_reduce_sum_32(T v) {
  g_lanes[threadIdx.x] = v;
  __syncthreads();
  T s = 0;
  for (int i = threadIdx.x / 32 * 32, e = i + 32; i < e; ++i) s += g_lanes[i];
  __syncthreads();
  return s;
}
"""

_LAUNCH = r"""
extern "C" void launch(int64_t grid, int threads, void** a, int64_t n) {
  for (int64_t b = 0; b < grid; ++b) {
    std::barrier<> bar(threads);
    g_bar = &bar;
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([=]() { blockIdx.x = (int)b; threadIdx.x = t; CALL; });
    for (auto& th : ts) th.join();
  }
}
"""


def _emulated(func, tmp_path: Path):
    """(launch(grid, arrays by buffer name, n), threads per block) of ``func`` on the CPU."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"p": func.with_attr("global_symbol", "p")}), target)
    src = exe.mod.imports_[0].inspect_source("cuda")
    head = re.search(
        r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\) \{', src
    )
    assert head, "kernel signature not found in TVM's CUDA source"
    depth = 0
    for end in range(head.end() - 1, len(src)):
        depth += {"{": 1, "}": -1}.get(src[end], 0)
        if depth == 0:
            break
    kernel = src[head.start() : end + 1].replace("__shared__ alignas(64)", "alignas(64) static")
    assert "__shfl" not in kernel and "asm" not in kernel  # only what the prelude emulates
    params = [p.strip() for p in head.group(3).split(",")]
    buffers = [p.split()[-1].removesuffix("_ptr") for p in params if "*" in p]
    args = []
    for p in params:
        if "*" in p:
            args.append(f"({p.split('*')[0].strip()}*)a[{len(args)}]")
        else:
            args.append("n")
    code = _PRELUDE + kernel + _LAUNCH.replace("CALL", f"{head.group(2)}({', '.join(args)})")
    (tmp_path / "k.cpp").write_text(code)
    so = tmp_path / "k.so"
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-o", str(so), str(tmp_path / "k.cpp")],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(so))
    lib.launch.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    threads = int(head.group(1))

    def launch(grid: int, arrays: dict[str, np.ndarray], n: int) -> None:
        ptrs = (ctypes.c_void_p * len(buffers))(*[arrays[b].ctypes.data for b in buffers])
        lib.launch(grid, threads, ptrs, n)

    return launch


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
    func = mla_prologue_cuda(
        heads, nope, rope, lora, dtype, q_width=q.shape[1], kv_width=kv.shape[1],
        kv_offset=kv_offset, eps=eps, **kwargs,
    )  # fmt: skip
    q_lat = np.full((n, heads, lora + rope), np.nan, dtype)
    latent = np.full((n, lora + rope), np.nan, dtype)
    blocks = 1 + heads * -(-lora // kwargs.get("cols", 64))
    arrays = {"q": q, "kv": kv, "w": w, "norm_w": norm_w, "tab": tab}
    _emulated(func, tmp_path)(blocks * n, {**arrays, "q_lat": q_lat, "latent": latent}, n)

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

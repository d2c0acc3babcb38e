"""The greedy arg-max kernels (``schedules/argmax.py``) against ``np.argmax``, no GPU.

The LLVM kernel is built and run as it is. The CUDA kernel is built for sm_90 (nvcc, as a model
build does), then TVM's CUDA source of it is compiled as C++20 with g++ and run one block at a
time (the chunks of a row in a shuffled order, so any block can take the last ticket), one
``std::thread`` per CUDA thread, ``__syncthreads`` a ``std::barrier`` and ``__shfl_xor_sync`` a
barrier-separated exchange within the warp; rows are given both 16-byte aligned (the ``float4``
path) and not (the scalar path), and more rows than have a ticket counter. Cases: random rows,
ties (first index wins), NaN (the first NaN wins, as in NumPy), infinities, ``-0.0 == +0.0``,
denormals, one-element rows and vocabulary sizes around a chunk and V2's 102,400.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm

from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target
from dsv2_mlc.schedules.argmax import (
    CHUNK,
    GPU_THREADS,
    MAX_CHUNKS,
    MAX_ROWS,
    argmax_chunks,
    argmax_cpu,
    argmax_gpu,
    greedy_argmax,
)

VOCABS = [1, 3, 4, 31, 1023, 1024, 1025, 2049, 4097, 8192, 102400]


def _rows(vocab: int, seed: int) -> np.ndarray:
    """Rows [n, 1, vocab] float32 that cover the cases of the module docstring."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(vocab).astype(np.float32) for _ in range(8)]
    x = rows[1]  # ties: the maximum at several places, the first one wins
    x[rng.choice(vocab, size=min(vocab, 5), replace=False)] = x.max() + 1
    rows[2][:] = 0.5  # all equal
    x = rows[3]  # NaNs: the first one wins
    x[rng.choice(vocab, size=min(vocab, 3), replace=False)] = np.nan
    x = rows[4]  # +inf twice and NaN after: NaN wins
    x[[vocab // 2, vocab - 1]] = np.inf
    if vocab > 2:
        x[vocab * 3 // 4] = -np.float32(np.nan)  # a negative NaN is a NaN too
    rows[5][:] = -np.inf  # all -inf: index 0
    x = rows[6]  # signed zeros and denormals above them
    x[:] = -1.0
    x[[vocab // 3, vocab // 2]] = [-0.0, 0.0]
    if vocab > 4:
        x[vocab - 2] = 1e-42
        x[vocab - 1] = 1e-43
    rows[7] = -np.abs(rows[7])  # all negative
    return np.stack(rows)[:, None, :]


def _check(run, vocab: int, seed: int) -> None:
    x = _rows(vocab, seed)
    got = run(x)
    np.testing.assert_array_equal(got, x[:, 0].argmax(-1), err_msg=f"vocab {vocab}")


@pytest.fixture(scope="module")
def cpu_kernel():
    mod = tvm.IRModule({"main": argmax_cpu().with_attr("global_symbol", "main")})
    lib = tvm.tirx.build(mod, target="llvm")

    def run(x: np.ndarray) -> np.ndarray:
        out = tvm.runtime.tensor(np.full(x.shape[0], -7, np.int32))
        lib["main"](tvm.runtime.tensor(x), out)
        return out.numpy()

    return run


@pytest.mark.parametrize("vocab", VOCABS)
def test_cpu_kernel_equals_numpy_argmax(cpu_kernel, vocab):
    _check(cpu_kernel, vocab, seed=vocab)


def test_cpu_kernel_is_one_build_for_any_shape(cpu_kernel):
    x = np.random.default_rng(1).standard_normal((33, 1, 517)).astype(np.float32)
    np.testing.assert_array_equal(cpu_kernel(x), x[:, 0].argmax(-1))


# -- CUDA ------------------------------------------------------------------------------------------
needs_cuda_tools = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None,
    reason="needs nvcc (TVM's CUDA build here) and g++ (C++20)",
)

_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
using std::max;
using std::min;
struct dim3_ { int x, y; };
struct float4 { float x, y, z, w; };
thread_local dim3_ threadIdx, blockIdx;
static std::barrier<>* g_bar;
static std::barrier<>* g_warp_bar[32];
static unsigned long long g_lanes[1024];
#define __global__
#define __launch_bounds__(x)
#define __forceinline__ inline
#define __device__
#define __shared__ static
#define __syncthreads() g_bar->arrive_and_wait()
#define __threadfence()
static inline unsigned atomicAdd(unsigned* p, unsigned v) {  // one block at a time
  const unsigned o = *p;
  *p = o + v;
  return o;
}
static inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, 4); return u; }
static inline unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int o) {
  const int t = threadIdx.x, w = t >> 5;
  g_lanes[t] = v;
  g_warp_bar[w]->arrive_and_wait();
  const unsigned long long r = g_lanes[(t & ~31) | ((t & 31) ^ o)];
  g_warp_bar[w]->arrive_and_wait();
  return r;
}
"""

_LAUNCH = r"""
extern "C" void launch(int64_t rows, int threads, float* x, int* out, int64_t vocab,
                       const int* order, int chunks) {
  for (int64_t b = 0; b < rows; ++b) {
    for (int k = 0; k < chunks; ++k) {
      std::barrier<> bar(threads);
      g_bar = &bar;
      for (int w = 0; w < threads / 32; ++w) g_warp_bar[w] = new std::barrier<>(32);
      std::vector<std::thread> ts;
      const int c = order[b * chunks + k];
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([=]() { blockIdx.x = c; blockIdx.y = (int)b; threadIdx.x = t; CALL; });
      for (auto& t : ts) t.join();
      for (int w = 0; w < threads / 32; ++w) delete g_warp_bar[w];
    }
  }
}
"""


@pytest.fixture(scope="module")
def cuda_source() -> str:
    target = make_cuda_target("sm_90")
    mod = tvm.IRModule({"argmax": argmax_gpu().with_attr("global_symbol", "argmax")})
    with cuda_codegen(), target:  # nvcc compiles it: the source must build for sm_90
        lib = tvm.compile(mod, target=target)
    return lib.mod.imports[0].inspect_source()


@needs_cuda_tools
def test_cuda_kernel_builds_for_sm90_with_chunks_of_a_row_per_block(cuda_source):
    assert f"__launch_bounds__({GPU_THREADS})" in cuda_source
    assert "__shfl_xor_sync" in cuda_source and "float4" in cuda_source
    assert "atomicAdd" in cuda_source and "__threadfence" in cuda_source


@pytest.fixture(scope="module")
def cuda_kernel_on_cpu(cuda_source, tmp_path_factory):
    """TVM's CUDA kernel, compiled with g++ (see the module docstring): ``run(x, misalign)``."""
    guard = re.search(r"#ifndef (DSV2_ARGMAX_\w+)\n.*?#endif\n", cuda_source, re.S)
    head = re.search(
        r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\) \{', cuda_source
    )
    assert guard and head, "device function or kernel not found in TVM's CUDA source"
    depth = 0
    for end in range(head.end() - 1, len(cuda_source)):
        depth += {"{": 1, "}": -1}.get(cuda_source[end], 0)
        if depth == 0:
            break
    kernel = cuda_source[head.start() : end + 1]
    assert "asm" not in kernel + guard.group(0)  # only what the prelude emulates
    params = [p.strip() for p in head.group(3).split(",")]
    assert params == [
        "float* __restrict__ logits_ptr",
        "int* __restrict__ out_ptr",
        "int64_t n",
        "int64_t vocab",
    ], params
    call = f"{head.group(2)}(x, out, rows, vocab)"
    tmp = tmp_path_factory.mktemp("argmax_emulation")
    code = _PRELUDE + guard.group(0) + kernel + _LAUNCH.replace("CALL", call)
    (tmp / "k.cpp").write_text(code)
    so = tmp / "k.so"
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-o", str(so), str(tmp / "k.cpp")],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(so))
    lib.launch.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
    threads = int(head.group(1))
    assert threads == GPU_THREADS
    rng = np.random.default_rng(0)

    def run(x: np.ndarray, misalign: bool = False) -> np.ndarray:
        n, _, vocab = x.shape
        # 16-byte aligned rows, or rows one float past such a boundary (the scalar path)
        raw = np.zeros(n * vocab + 8, np.float32)
        start = (-raw.ctypes.data % 16) // 4 + (1 if misalign else 0)
        buf = raw[start : start + n * vocab]
        buf[:] = x.reshape(-1)
        out = np.full(n, -7, np.int32)
        chunks = argmax_chunks(vocab)[0]  # the kernel's grid, in a shuffled order per row
        order = np.stack([rng.permutation(chunks) for _ in range(n)]).astype(np.int32)
        lib.launch(n, threads, buf.ctypes.data, out.ctypes.data, vocab, order.ctypes.data, chunks)
        return out

    return run


@needs_cuda_tools
@pytest.mark.parametrize("misalign", [False, True], ids=["float4", "scalar"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_cuda_kernel_equals_numpy_argmax(cuda_kernel_on_cpu, vocab, misalign):
    _check(lambda x: cuda_kernel_on_cpu(x, misalign), vocab, seed=vocab + 1)


@pytest.mark.parametrize("vocab", [*VOCABS, 2048 * 128, 2048 * 128 + 1, 10**6])
def test_chunks_cover_a_row_in_aligned_pieces(vocab):
    chunks, chunk = argmax_chunks(vocab)
    assert 1 <= chunks <= MAX_CHUNKS and chunk % 4 == 0
    assert (chunks - 1) * chunk < vocab <= chunks * chunk  # every block has logits to scan
    assert chunks == MAX_CHUNKS or chunk <= CHUNK


@needs_cuda_tools
def test_cuda_kernel_rows_past_the_ticket_counters(cuda_kernel_on_cpu):
    """Rows past ``MAX_ROWS`` are scanned by one block each; the counters of the others are
    back at 0 after every launch (the next one would pick no or a wrong last block)."""
    vocab = 2049  # two chunks a row
    x = np.concatenate([_rows(vocab, seed) for seed in range(MAX_ROWS // 8 + 1)])
    assert x.shape[0] > MAX_ROWS
    for _ in range(2):
        np.testing.assert_array_equal(cuda_kernel_on_cpu(x), x[:, 0].argmax(-1))


@needs_cuda_tools  # the greedy_argmax kernel of a CUDA target is built with nvcc
def test_kernel_choice_follows_the_target():
    assert "func_call" in str(greedy_argmax(make_cuda_target("sm_90")).script())
    assert "func_call" not in str(greedy_argmax(None).script())
    assert "func_call" not in str(greedy_argmax(tvm.target.Target("llvm")).script())

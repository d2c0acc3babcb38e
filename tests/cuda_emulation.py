"""CUDA kernels run on the CPU, for tests without a GPU (imported by the ``*_emulation`` tests).

CUDA C++ (TVM's generated source, or a hand device function) is compiled as C++20 by g++:
``half`` is ``_Float16``, a thread block is one ``std::thread`` per CUDA thread, blocks run one
after another. :data:`TYPES` holds the thread-free part (CUDA's vector types, the fp16 / half2
intrinsics used by our kernels, each rounded once to fp16 as the hardware does: computed exactly
in double, then converted), :data:`THREADS` the rest: ``__syncthreads`` is a ``std::barrier`` of
the block, every warp collective (``__syncwarp``, ``__shfl_sync``, ``__shfl_xor_sync``,
``__shfl_down_sync``, ``__ballot_sync``; full-warp masks only) a barrier of the warp's 32
threads around an exchange of the lanes' values; ``__nanosleep`` sleeps 1 ms (and is counted),
``__threadfence_block`` (and ``__threadfence``) a sequentially consistent fence, ``atomicAdd`` on
unsigned words an atomic ``fetch_add``. ``__shared__`` variables become
function statics, filled with 0xff bytes (NaN halves and floats, -1 integers) before every block,
so a read of shared memory the block has not written shows. The threads are kept from one block to
the next (a barrier between blocks).

:func:`emulate` builds a TVM PrimFunc for CUDA, takes the generated source (nvcc checks it too),
compiles it with AddressSanitizer into an executable that runs the grid, and returns a launcher:
the arrays go through files, so an out-of-bounds access (ASan) or a deadlock (the timeout) fails
the test instead of taking pytest down. Blocks and grids may have up to three dimensions (a warp is
32 consecutive threads of ``x + blockDim.x * (y + blockDim.y * z)``, as on the GPU; blocks run in
the order x, then y, then z); a PrimFunc of several kernels (a split kernel and its merge) gives
one launcher per kernel (``kernel=``). Emulation limits: no inline PTX outside
``#if defined(__CUDA_ARCH__)`` blocks (whose ``#else`` or ``#elif defined(DSV2_EMULATION)``
branch is compiled instead: the bulk-copy and mbarrier helpers call the ``dsv2_emu_*``
functions, where a copy lands at issue; an L2 prefetch is checked for alignment and bounds and
counted; ``ldmatrix``, ``mma.sync`` m16n8k16, ``wgmma`` m64nNk16 (shared-memory operands; an
MMA computed at its ``wait_group``), ``cp.async`` (a copy lands at its ``wait_group``,
its destination NaN from issue to then) and ``ex2.approx`` have stand-ins too, shared addresses
map back to the ``__shared__`` arrays; these use ``threadIdx.x`` as the lane, so kernels that
use them have one-dimensional blocks), dynamic shared memory as one static array, warp
collectives over the whole warp only, and the threads of a warp are not in lockstep (code that
relies on implicit warp synchronisation, without ``__syncwarp``, is not modelled); the OS
scheduler, not the GPU's, decides the interleaving (``slow_warp``: that warp sleeps 5 ms at its
first collective in every block, so that the others run ahead of it).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

needs_toolchain = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("g++") is None,
    reason="needs nvcc (TVM's CUDA build here) and g++ (C++20)",
)

if TYPE_CHECKING:  # (tvm is imported when a kernel is built: after the CUDA codegen setup)
    import tvm

TYPES = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
typedef _Float16 half;
typedef _Float16 __half;
typedef unsigned int uint;
struct alignas(4) __half2 { half x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) {
  return {a, b, c, d};
}
static inline half __float2half(float f) { return (half)f; }
static inline half __float2half_rn(float f) { return (half)f; }
static inline float __half2float(half h) { return (float)h; }
static inline __half2 __floats2half2_rn(float a, float b) { return {(half)a, (half)b}; }
static inline float2 __half22float2(__half2 h) { return {(float)h.x, (float)h.y}; }
static inline __half2 __half2half2(half h) { return {h, h}; }
// one rounding to fp16 of the exact result (double holds fp16 sums and products exactly)
static inline half emu_h(double v) { return (half)v; }
static inline __half2 __hadd2(__half2 a, __half2 b) {
  return {emu_h((double)a.x + b.x), emu_h((double)a.y + b.y)};
}
static inline half __hadd(half a, half b) { return emu_h((double)a + b); }
static inline __half2 __hsub2(__half2 a, __half2 b) {
  return {emu_h((double)a.x - b.x), emu_h((double)a.y - b.y)};
}
static inline __half2 __hmul2(__half2 a, __half2 b) {
  return {emu_h((double)a.x * b.x), emu_h((double)a.y * b.y)};
}
static inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return {emu_h((double)a.x * b.x + c.x), emu_h((double)a.y * b.y + c.y)};
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline float emu_expf(float x) { return std::exp(x); }
#define __expf(x) emu_expf(x)  // (glibc declares an __expf of its own)
static inline float __fdividef(float a, float b) { return a / b; }
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class A, class B> static inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <class A, class B> static inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}
"""

THREADS = r"""
struct dim3_ { unsigned x = 0, y = 0, z = 0; };
thread_local dim3_ threadIdx, blockIdx;
thread_local unsigned t_lin;  // the thread's linear index in its block (its warp: t_lin / 32)
thread_local bool t_first_collective;
static dim3_ blockDim, gridDim;
static std::barrier<>* g_block_bar;
static std::barrier<>* g_warp_bar[32];
// a warp exchange's values, in one of two buffers taken in turn (t_lane_buf): a lane writes a
// buffer again two exchanges later, after the __syncwarp of the exchange between them, which
// every lane passes only once it has read the buffer; so one __syncwarp an exchange suffices
static uint64_t g_lane_val[2][1024];
thread_local unsigned t_lane_buf;
static int g_slow_warp = -1;
static std::atomic<long long> g_naps{0};
static std::atomic<long long> g_prefetches{0}, g_prefetch_bytes{0};
struct EmuRegion { void* p; size_t n; };
static std::vector<EmuRegion> g_shared;
static void emu_fail(const char* what) { fprintf(stderr, "emulation: %s\n", what); std::abort(); }
// a __shared__ variable's first use: fill it (once; later blocks are filled by emu_run_grid)
static bool emu_shared(void* p, size_t n) {
  memset(p, 0xff, n);
  g_shared.push_back({p, n});
  return true;
}
static inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
// named barriers (bar.sync / bar.arrive id, n; id 0 is __syncthreads'): one std::barrier an id,
// of the thread count its first use names (blocks run one after another, and every phase of a
// correct kernel completes inside its block); bar.arrive arrives without waiting
static std::barrier<>* emu_named_bar(int id, int n) {
  static std::barrier<>* bars[16] = {};
  static int counts[16] = {};
  static std::mutex mu;
  if (id < 1 || id > 15 || n % 32) emu_fail("named barrier id or thread count");
  std::lock_guard<std::mutex> lock(mu);
  if (!bars[id]) { bars[id] = new std::barrier<>(n); counts[id] = n; }
  if (counts[id] != n) emu_fail("a named barrier used with two thread counts");
  return bars[id];
}
static inline void dsv2_emu_bar_sync(int id, int n) { emu_named_bar(id, n)->arrive_and_wait(); }
static inline void dsv2_emu_bar_arrive(int id, int n) {
  auto token = emu_named_bar(id, n)->arrive();
  (void)token;
}
static inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
// an L2 prefetch (cp.async.bulk.prefetch): checked for alignment, and for bounds by reading its
// first and last byte (AddressSanitizer), then counted
static inline void dsv2_emu_l2_prefetch(const void* p, unsigned bytes) {
  if (bytes == 0 || bytes % 16 || (uintptr_t)p % 16) emu_fail("L2 prefetch alignment or size");
  const volatile unsigned char* c = static_cast<const volatile unsigned char*>(p);
  (void)c[0];
  (void)c[bytes - 1];
  ++g_prefetches;
  g_prefetch_bytes += bytes;
}
// 1 ms whatever the argument: a spinning thread must leave the CPU to the threads it waits for
static inline void __nanosleep(unsigned) {
  ++g_naps;
  std::this_thread::sleep_for(std::chrono::microseconds(1000));
}
// Hopper bulk copies and mbarriers (schedules/bulk_copy_cuda.py): a copy lands at issue; a
// barrier completes its phase when its one arrival and every announced byte are in, and a copy
// of bytes not announced before it fails the run (the GPU would complete the phase too early)
struct EmuBar { int pending; long long bytes; unsigned phase; };
static std::mutex g_bar_mu;
static std::map<void*, EmuBar> g_bars;
static void emu_bar_check(EmuBar& b) {
  if (b.bytes < 0) emu_fail("mbarrier: a bulk copy of bytes not announced first");
  if (b.pending == 0 && b.bytes == 0) { b.phase += 1; b.pending = 1; }
}
static inline void dsv2_emu_mbar_init(unsigned long long* bar) {
  std::lock_guard<std::mutex> lock(g_bar_mu);
  g_bars[bar] = EmuBar{1, 0, 0};
}
static inline void dsv2_emu_mbar_expect_arrive(unsigned long long* bar, unsigned bytes) {
  std::lock_guard<std::mutex> lock(g_bar_mu);
  auto it = g_bars.find(bar);
  if (it == g_bars.end()) emu_fail("mbarrier: arrive before init");
  if (it->second.pending != 1) emu_fail("mbarrier: a second arrival in one phase");
  it->second.bytes += bytes;
  it->second.pending -= 1;
  emu_bar_check(it->second);
}
static inline void dsv2_emu_bulk_g2s(void* dst, const void* src, unsigned bytes,
                                     unsigned long long* bar) {
  if (bytes % 16 || (uintptr_t)dst % 16 || (uintptr_t)src % 16) emu_fail("bulk copy alignment");
  memcpy(dst, src, bytes);
  std::lock_guard<std::mutex> lock(g_bar_mu);
  auto it = g_bars.find(bar);
  if (it == g_bars.end()) emu_fail("bulk copy on a barrier never initialised");
  it->second.bytes -= bytes;
  emu_bar_check(it->second);
}
static inline void dsv2_emu_mbar_wait(unsigned long long* bar, unsigned parity) {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(g_bar_mu);
      auto it = g_bars.find(bar);
      if (it == g_bars.end()) emu_fail("mbarrier: wait before init");
      if ((it->second.phase & 1u) != parity) return;
    }
    ++g_naps;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu_fail("partial-warp mask");
  if (t_first_collective && (int)(t_lin >> 5) == g_slow_warp)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  t_first_collective = false;
  g_warp_bar[t_lin >> 5]->arrive_and_wait();
}
static inline unsigned __activemask() { return 0xffffffffu; }  // (whole warps only)
template <class T> static inline T emu_shfl(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8);
  const unsigned t = t_lin;
  uint64_t* vals = g_lane_val[t_lane_buf ^= 1u];
  memcpy(&vals[t], &v, sizeof(T));
  __syncwarp(mask);
  T r;
  memcpy(&r, &vals[(t & ~31u) | (src & 31)], sizeof(T));
  return r;
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  if (width != 32) emu_fail("shfl width");
  return emu_shfl(mask, v, src);
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int o, int width = 32) {
  if (width != 32) emu_fail("shfl width");
  return emu_shfl(mask, v, (int)(t_lin & 31) ^ o);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int w = 32) {
  if (w != 32) emu_fail("shfl width");
  const int lane = t_lin & 31;
  return emu_shfl(mask, v, lane + (int)d < 32 ? lane + (int)d : lane);
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
  const unsigned t = t_lin;
  uint64_t* vals = g_lane_val[t_lane_buf ^= 1u];
  vals[t] = pred != 0;
  __syncwarp(mask);
  unsigned r = 0;
  for (unsigned l = 0; l < 32 && (t & ~31u) + l < blockDim.x * blockDim.y * blockDim.z; ++l)
    r |= (unsigned)vals[(t & ~31u) + l] << l;
  return r;
}
// the grid, block after block (x fastest), on one std::thread per thread of a block (kept across
// blocks)
template <class F> static void emu_run_grid(F call) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const long long grid = (long long)gridDim.x * gridDim.y * gridDim.z;
  std::barrier<> bar(threads);
  std::vector<std::barrier<>*> warps;
  for (int w = 0; w * 32 < threads; ++w)
    warps.push_back(g_warp_bar[w] = new std::barrier<>(std::min(32, threads - 32 * w)));
  g_block_bar = &bar;
  auto refill = []() noexcept { for (const EmuRegion& r : g_shared) memset(r.p, 0xff, r.n); };
  std::barrier<decltype(refill)> next(threads, refill);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t]() {
      t_lin = t;
      threadIdx.x = t % blockDim.x;
      threadIdx.y = t / blockDim.x % blockDim.y;
      threadIdx.z = t / blockDim.x / blockDim.y;
      for (long long b = 0; b < grid; ++b) {
        blockIdx.x = b % gridDim.x;
        blockIdx.y = b / gridDim.x % gridDim.y;
        blockIdx.z = b / gridDim.x / gridDim.y;
        t_first_collective = true;
        call();
        next.arrive_and_wait();
      }
    });
  for (auto& th : ts) th.join();
  for (auto* w : warps) delete w;
}
"""


# -- tensor-core and cp.async stand-ins ----------------------------------------------------------
# (ldmatrix, mma.sync m16n8k16, cp.async, ex2.approx, __cvta_generic_to_shared: what the kernel
# helpers' non-__CUDA_ARCH__ branches call; the exchanges of a warp go through __syncwarp)
THREADS += r"""
typedef __half2 half2;
static inline __half2 __float2half2_rn(float f) { return {(half)f, (half)f}; }
// A shared-memory address (__cvta_generic_to_shared) is (i + 1) << 24 plus the byte offset in
// region i of g_shared (a __shared__ variable, or the dynamic array); dsv2_emu_smem maps one
// back, failing the run unless the `bytes` from it lie in the region
static inline size_t __cvta_generic_to_shared(const void* p) {
  const uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < g_shared.size(); ++i) {
    const uintptr_t b = (uintptr_t)g_shared[i].p;
    if (a >= b && a < b + g_shared[i].n) return ((i + 1) << 24) | (a - b);
  }
  emu_fail("__cvta_generic_to_shared of memory that is not shared");
  return 0;
}
static inline unsigned char* dsv2_emu_smem(unsigned addr, unsigned bytes) {
  const size_t i = (addr >> 24) - 1, off = addr & 0xffffffu;
  if ((addr >> 24) == 0 || i >= g_shared.size() || off + bytes > g_shared[i].n)
    emu_fail("shared-memory access out of bounds");
  return static_cast<unsigned char*>(g_shared[i].p) + off;
}
// cp.async.cg.shared.global, 16 bytes (src_bytes < 16: the rest zero-filled), commit_group and
// wait_group: the source is read at issue; the destination turns to 0xff bytes (NaN) at issue
// and gets the data only when a wait_group completes the copy's group, the latest moment the
// hardware may land it, so a read before the wait, or a copy into a stage that other threads
// still read, shows. Copies of a block not waited for are dropped at the thread's next block.
struct EmuCp { unsigned char* dst; unsigned char data[16]; unsigned n; };
thread_local std::vector<std::vector<EmuCp>> t_cp_groups;  // committed, oldest first
thread_local std::vector<EmuCp> t_cp_open;  // issued since the last commit_group
thread_local unsigned long long t_cp_block = ~0ull;
// whether this thread runs a block other than the one `seen` names (then `seen` is updated): an
// asynchronous queue of the previous block is dropped then
static inline bool emu_new_block(unsigned long long& seen) {
  const unsigned long long b = ((unsigned long long)blockIdx.y << 32) | blockIdx.x;
  if (b == seen) return false;
  seen = b;
  return true;
}
static inline void dsv2_emu_cp_block() {
  if (!emu_new_block(t_cp_block)) return;
  t_cp_groups.clear();
  t_cp_open.clear();
}
// a copy of `n` bytes (16 or 4), `src_bytes` of them read from `src` (the rest zero-filled)
static inline void emu_cp_issue(unsigned dst, const void* src, unsigned n, int src_bytes) {
  if (dst % n || (uintptr_t)src % n) emu_fail("cp.async alignment");
  if (src_bytes < 0 || src_bytes > (int)n) emu_fail("cp.async source size");
  dsv2_emu_cp_block();
  EmuCp cp{dsv2_emu_smem(dst, n), {}, n};
  if (src_bytes) memcpy(cp.data, src, src_bytes);
  memset(cp.dst, 0xff, n);
  t_cp_open.push_back(cp);
}
static inline void dsv2_emu_cp_async(unsigned dst, const void* src, int src_bytes) {
  emu_cp_issue(dst, src, 16, src_bytes);
}
// cp.async.ca.shared.global of 4 bytes (both addresses 4-byte aligned), as above
static inline void dsv2_emu_cp_async4(unsigned dst, const void* src) {
  emu_cp_issue(dst, src, 4, 4);
}
static inline void dsv2_emu_cp_commit() {
  dsv2_emu_cp_block();
  t_cp_groups.push_back(std::move(t_cp_open));
  t_cp_open.clear();
}
static inline void dsv2_emu_cp_wait(int pending) {  // all but the `pending` newest groups land
  dsv2_emu_cp_block();
  const size_t keep = std::min(t_cp_groups.size(), (size_t)pending);
  const size_t done = t_cp_groups.size() - keep;
  for (size_t i = 0; i < done; ++i)
    for (const EmuCp& cp : t_cp_groups[i]) memcpy(cp.dst, cp.data, cp.n);
  t_cp_groups.erase(t_cp_groups.begin(), t_cp_groups.begin() + done);
}
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane 8 i + r gives the address of row r of
// 8 x 8 matrix i (16 bytes, 16-byte aligned); lane l gets in r[i] the halves (l / 4, 2 (l % 4))
// and (l / 4, 2 (l % 4) + 1) of matrix i, with .trans (2 (l % 4), l / 4) and (2 (l % 4) + 1,
// l / 4)
static unsigned g_ldsm_addr[1024];
static inline void dsv2_emu_ldmatrix_x4(unsigned* r, unsigned addr, bool trans) {
  const unsigned t = threadIdx.x, w = t & ~31u, l = t & 31;
  if (addr % 16) emu_fail("ldmatrix row address alignment");
  dsv2_emu_smem(addr, 16);
  g_ldsm_addr[t] = addr;
  __syncwarp();
  for (unsigned i = 0; i < 4; ++i) {
    half h[2];
    for (unsigned e = 0; e < 2; ++e) {
      const unsigned row = trans ? 2 * (l % 4) + e : l / 4;
      const unsigned col = trans ? l / 4 : 2 * (l % 4) + e;
      memcpy(&h[e], dsv2_emu_smem(g_ldsm_addr[w + 8 * i + row] + 2 * col, 2), 2);
    }
    memcpy(&r[i], h, 4);
  }
  __syncwarp();
}
// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, c += A B: every lane publishes its
// fragments, lane (g, t) = (l / 4, l % 4) holding a[0] / a[1] rows g / g + 8 of A at k = 2t,
// 2t + 1 and a[2] / a[3] the same rows at k = 2t + 8, 2t + 9, b[0] / b[1] column g of B at
// those k; it computes its c[2 m + j] (row g + 8 m, column 2t + j): the products exact in
// double, summed in double, rounded once to float (the hardware sums in fp32); the fragments
// in one of two buffers taken in turn, as g_lane_val (one __syncwarp an mma)
static unsigned g_mma_frag[2][1024][6];
thread_local unsigned t_mma_buf;
static inline void dsv2_emu_mma16816(float* c, const unsigned* a, const unsigned* b) {
  const unsigned t = threadIdx.x, w = t & ~31u, l = t & 31, g = l >> 2, tq = l & 3;
  unsigned (*frag)[6] = g_mma_frag[t_mma_buf ^= 1u];
  for (int r = 0; r < 4; ++r) frag[t][r] = a[r];
  frag[t][4] = b[0];
  frag[t][5] = b[1];
  __syncwarp();
  auto f = [](unsigned v, int hi) {
    __half2 h;
    memcpy(&h, &v, 4);
    return (double)(hi ? h.y : h.x);
  };
  double acc[4] = {c[0], c[1], c[2], c[3]};
  for (unsigned q = 0; q < 4; ++q)
    for (unsigned j = 0; j < 2; ++j) {
      const unsigned* B = frag[w + (2 * tq + j) * 4 + q];
      for (unsigned m = 0; m < 2; ++m) {
        const unsigned* A = frag[w + g * 4 + q];
        acc[2 * m + j] += f(A[m], 0) * f(B[4], 0) + f(A[m], 1) * f(B[4], 1) +
                          f(A[2 + m], 0) * f(B[5], 0) + f(A[2 + m], 1) * f(B[5], 1);
      }
    }
  for (int r = 0; r < 4; ++r) c[r] = (float)acc[r];
}
// wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16 (both operands in shared memory, K-major
// rows of 128 bytes with the 128-byte swizzle: the 16-byte chunk bits 4-6 of an address XORed
// with its bits 7-9, 8-row groups 1024 bytes apart; `a` / `b` the shared addresses the
// descriptors start at), commit_group and wait_group: an MMA is queued at issue and computed at
// the wait_group that completes its group, the latest moment the hardware may read its
// operands, so a stage overwritten before the wait, or an accumulator read before it, shows.
// Thread (warp w of its warpgroup, lane (g, t)) computes its d[4 j + v]: D row 16 w + g +
// 8 (v >> 1), column 8 j + 2 t + (v & 1), D = A (64 x 16) B (N x 16)^T, products exact in
// double, rounded once to float.
struct EmuWg {
  float* d; unsigned a, b; int n; bool ra; half ar[2][16];
  bool bmn = false; unsigned lbo = 0, sbo = 0;  // B MN-major (the transpose bit), its strides
};
thread_local std::vector<std::vector<EmuWg>> t_wg_groups;
thread_local std::vector<EmuWg> t_wg_open;
thread_local unsigned long long t_wg_block = ~0ull;
static inline void dsv2_emu_wg_block() {
  if (!emu_new_block(t_wg_block)) return;
  t_wg_groups.clear();
  t_wg_open.clear();
}
static inline double emu_wg_elem(unsigned base, unsigned row, unsigned k) {
  unsigned addr = base + (row >> 3) * 1024u + (row & 7u) * 128u + 2u * k;
  addr ^= ((addr >> 7) & 7u) << 4;
  half h;
  memcpy(&h, dsv2_emu_smem(addr, 2), 2);
  return (double)h;
}
// B MN-major (the descriptor's transpose bit; 16-bit types): element (n, k) of atoms of 64 n
// (128 bytes) x 8 k rows, n-atoms lbo bytes apart and 8-row k groups sbo bytes apart, under
// the same 128-byte swizzle (CUTLASS's canonical GMMA MN-major SW128 layout)
static inline double emu_wg_elem_mn(unsigned base, unsigned n, unsigned k, unsigned lbo,
                                    unsigned sbo) {
  unsigned addr = base + (n >> 6) * lbo + (k >> 3) * sbo + (k & 7u) * 128u + 2u * (n & 63u);
  addr ^= ((addr >> 7) & 7u) << 4;
  half h;
  memcpy(&h, dsv2_emu_smem(addr, 2), 2);
  return (double)h;
}
static inline void emu_wg_run(const EmuWg& op) {
  const unsigned w = (t_lin >> 5) & 3u, l = t_lin & 31u, g = l >> 2, tq = l & 3u;
  for (int j = 0; j < op.n / 8; ++j)
    for (unsigned v = 0; v < 4; ++v) {
      const unsigned m = 16 * w + g + 8 * (v >> 1), c = 8 * j + 2 * tq + (v & 1);
      double acc = op.d[4 * j + v];
      for (unsigned k = 0; k < 16; ++k) {
        const double av = op.ra ? (double)op.ar[v >> 1][k] : emu_wg_elem(op.a, m, k);
        const double bv =
            op.bmn ? emu_wg_elem_mn(op.b, c, k, op.lbo, op.sbo) : emu_wg_elem(op.b, c, k);
        acc += av * bv;
      }
      op.d[4 * j + v] = (float)acc;
    }
}
// A from registers (4 x b32 a thread): lane (g, t) of warp w holds A rows 16 w + g (a[0], a[2])
// and 16 w + g + 8 (a[1], a[3]) at k 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]);
// the warp's fragments are exchanged at issue (one of two buffers, as the mma.sync stand-in),
// each thread keeping its two rows' 16 values for the wait that computes the MMA
static unsigned g_wg_frag[2][1024][4];
thread_local unsigned t_wg_buf;
static inline void dsv2_emu_wgmma_ra(float* d, const unsigned* a, unsigned b, int n) {
  if (b % 16) emu_fail("wgmma descriptor start alignment");
  if (n % 8 || n < 8 || n > 256) emu_fail("wgmma N");
  dsv2_emu_wg_block();
  const unsigned t = t_lin, w = t & ~31u, g = (t & 31u) >> 2;
  unsigned (*frag)[4] = g_wg_frag[t_wg_buf ^= 1u];
  for (int r = 0; r < 4; ++r) frag[t][r] = a[r];
  __syncwarp();
  EmuWg op{d, 0u, b, n, true, {}};
  for (unsigned q = 0; q < 4; ++q)  // lane (g, q) holds k 2q, 2q + 1, 2q + 8, 2q + 9
    for (unsigned r = 0; r < 2; ++r)  // row g (a[0], a[2]) / g + 8 (a[1], a[3])
      for (unsigned hi = 0; hi < 2; ++hi) {
        const unsigned word = frag[w + g * 4 + q][r + 2 * hi];
        half h2[2];
        memcpy(h2, &word, 4);
        op.ar[r][2 * q + 8 * hi] = h2[0];
        op.ar[r][2 * q + 8 * hi + 1] = h2[1];
      }
  t_wg_open.push_back(op);
}
// ... with B MN-major (lbo: bytes between its 64-wide n atoms, sbo: between its 8-row k groups)
static inline void dsv2_emu_wgmma_ra_mn(float* d, const unsigned* a, unsigned b, int n,
                                        unsigned lbo, unsigned sbo) {
  if (lbo % 16 || sbo % 16) emu_fail("wgmma descriptor strides");
  dsv2_emu_wgmma_ra(d, a, b, n);
  EmuWg& op = t_wg_open.back();
  op.bmn = true;
  op.lbo = lbo;
  op.sbo = sbo;
}
static inline void dsv2_emu_wgmma(float* d, unsigned a, unsigned b, int n) {
  if (a % 16 || b % 16) emu_fail("wgmma descriptor start alignment");
  if (n % 8 || n < 8 || n > 256) emu_fail("wgmma N");
  dsv2_emu_wg_block();
  t_wg_open.push_back({d, a, b, n, false, {}});
}
static inline void dsv2_emu_wg_commit() {
  dsv2_emu_wg_block();
  t_wg_groups.push_back(std::move(t_wg_open));
  t_wg_open.clear();
}
static inline void dsv2_emu_wg_wait(int pending) {  // all but the `pending` newest groups
  dsv2_emu_wg_block();
  const size_t keep = std::min(t_wg_groups.size(), (size_t)pending);
  const size_t done = t_wg_groups.size() - keep;
  for (size_t i = 0; i < done; ++i)
    for (const EmuWg& op : t_wg_groups[i]) emu_wg_run(op);
  t_wg_groups.erase(t_wg_groups.begin(), t_wg_groups.begin() + done);
}
// ex2.approx.ftz.f32: 2^x, exact here (the hardware's relative error is about 2^-22), subnormal
// inputs and results flushed to zero
static inline float dsv2_emu_ex2(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
"""
# -- end of the tensor-core and cp.async stand-ins -----------------------------------------------

_MAIN = r"""
// argv: dir grid_x grid_y grid_z slow_warp launches scalars...; buffer i is the file dir/a<i>,
// read before every launch (each starts from the arrays as given) and written back after the
// last; __device__ variables persist from one launch to the next, as on a GPU
int main(int argc, char** argv) {
  if (argc != 7 + $n_scalars) emu_fail("arguments");
  const std::string dir = argv[1];
  gridDim.x = atoll(argv[2]);
  gridDim.y = atoll(argv[3]);
  gridDim.z = atoll(argv[4]);
  g_slow_warp = atoi(argv[5]);
  const int launches = atoi(argv[6]);
  double s[$n_scalars + 1];  // (integers and floats alike; exact for the int32/int64 we pass)
  for (int i = 0; i < $n_scalars; ++i) s[i] = strtod(argv[7 + i], nullptr);
  void* a[$n_buffers + 1];
  size_t bytes[$n_buffers + 1];
  for (int i = 0; i < $n_buffers; ++i) a[i] = nullptr;
  blockDim.x = $block_x;
  blockDim.y = $block_y;
  blockDim.z = $block_z;
  for (int l = 0; l < launches; ++l) {
    for (int i = 0; i < $n_buffers; ++i) {
      const std::string path = dir + "/a" + std::to_string(i);
      FILE* f = fopen(path.c_str(), "rb");
      if (!f) emu_fail("open buffer");
      fseek(f, 0, SEEK_END);
      bytes[i] = ftell(f);
      fseek(f, 0, SEEK_SET);
      if (a[i] == nullptr && posix_memalign(&a[i], 64, bytes[i] ? bytes[i] : 1)) emu_fail("alloc");
      if (fread(a[i], 1, bytes[i], f) != bytes[i]) emu_fail("read buffer");
      fclose(f);
    }
    emu_run_grid([&]() { $call; });
  }
  for (int i = 0; i < $n_buffers; ++i) {
    FILE* f = fopen((dir + "/a" + std::to_string(i)).c_str(), "wb");
    fwrite(a[i], 1, bytes[i], f);
    fclose(f);
    free(a[i]);
  }
  printf("emu: nanosleep %lld\n", g_naps.load());
  printf("emu: prefetches %lld\n", g_prefetches.load());
  printf("emu: prefetch_bytes %lld\n", g_prefetch_bytes.load());
  return 0;
}
"""


# the session's g++ outputs by (flags, source) digest: a source compiled again (the same kernel
# in another test, or a control whose rewrite leaves the source as it was) is copied, not rebuilt
_BUILT: dict[str, Path] = {}


def compile_cpp(source: str, out: Path, *, shared: bool = False, sanitize: bool = False) -> Path:
    """Compile C++20 ``source`` with g++ into ``out`` (an executable, or a shared library); a
    source the session compiled with the same flags before is copied from that build."""
    out.with_suffix(".cpp").write_text(source)
    flags = ["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-w"]
    if shared:
        flags += ["-shared", "-fPIC"]
    if sanitize:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    digest = hashlib.sha256("\0".join([*flags, source]).encode()).hexdigest()
    done = _BUILT.get(digest)
    if done is not None and done.is_file():
        if done.resolve() != out.resolve():
            shutil.copy2(done, out)
        return out
    cmd = ["g++", *flags, "-o", str(out), str(out.with_suffix(".cpp"))]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise AssertionError(f"g++ failed on {out.with_suffix('.cpp')}:\n{run.stderr[-4000:]}")
    _BUILT[digest] = out
    return out


# the session's CUDA sources by PrimFunc (structural equality, which ignores the names TVM makes
# unique from one builder call to the next, plus the names of the parameters, which the source
# and the emulation's buffers carry): one TVM + nvcc build of a kernel however many tests use it
_SOURCES: dict[tuple, str] = {}


def cuda_source(func: tvm.tirx.PrimFunc) -> str:
    """TVM's CUDA source of ``func`` built for sm_90 (the project's CUDA codegen, nvcc); built
    once a session for a given ``func``."""
    import tvm
    import tvm_ffi

    from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target

    func = func.with_attr("global_symbol", "p")
    key = (tvm_ffi.StructuralKey(func), tuple(str(p.name) for p in func.params))
    if key not in _SOURCES:
        target = make_cuda_target("sm_90")
        with cuda_codegen(), target:
            exe = tvm.compile(tvm.IRModule({"p": func}), target)
        _SOURCES[key] = exe.mod.imports_[0].inspect_source("cuda")
    return _SOURCES[key]


DYN_SHARED_BYTES = 232448  # a block's dynamic shared memory in the emulation (sm_90's limit)
_HEADER_END = "#define ushort unsigned short\n#endif\n"  # the last lines of TVM's CUDA header
_KERNEL = re.compile(
    r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, \d+)?\) (\w+)\(([^)]*)\) \{'
)
_SHARED = re.compile(r"__shared__\s+((?:alignas|__align__)\(\d+\)\s+)?([^;=]+?)\s*;")


def _statics(body: str) -> str:
    """``__shared__`` declarations as function statics registered for the 0xff fill."""

    def one(m: re.Match) -> str:
        decl = m.group(2)
        name = re.fullmatch(r"[\w:<>, ]+?\s*\b(\w+)\s*(\[[^;]*\])?", decl)
        assert name, f"unexpected __shared__ declaration: {m.group(0)}"
        var = name.group(1)
        return (
            f"{m.group(1) or ''}static {decl}; static const bool emu_shared_{var}_{m.start()} = "
            f"emu_shared(&{var}, sizeof {var});"
        )

    return _SHARED.sub(one, body)


@dataclass
class Emulated:
    """A CUDA kernel compiled for the CPU: ``threads`` per block (``block``: its x, y, z
    extents), its pointer parameters (``buffers``, TVM's names without ``_ptr``) and scalar ones
    (``scalars``)."""

    exe: Path
    threads: int
    buffers: list[str]
    scalars: list[str]
    block: tuple[int, int, int] = (0, 1, 1)

    def __call__(
        self,
        grid: int | tuple[int, ...],
        arrays: dict[str, np.ndarray],
        *scalars: float,
        slow_warp: int = -1,
        timeout: float = 300,
        launches: int = 1,
    ) -> dict[str, int]:
        """Run ``grid`` blocks (a number, or the grid's x, y[, z] extents) on ``arrays`` (by
        buffer name; contiguous, updated in place) and the scalar arguments (ints, or floats
        for float parameters), ``launches`` times (each launch from the arrays as given, the
        kernel's ``__device__`` variables kept; the arrays as the last launch left them);
        returns counters (``nanosleep``: ``__nanosleep`` calls, ``prefetches`` /
        ``prefetch_bytes``: L2 prefetches and their bytes; over all launches)."""
        assert len(scalars) == len(self.scalars), f"scalars {self.scalars}"
        work = self.exe.parent / f"{self.exe.name}.io"
        work.mkdir(exist_ok=True)
        for i, name in enumerate(self.buffers):
            assert arrays[name].flags.c_contiguous, name
            arrays[name].tofile(work / f"a{i}")
        env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}
        dims = (grid, 1, 1) if isinstance(grid, int) else (*grid, 1, 1)[:3]
        args = [str(self.exe), str(work), *map(str, dims), str(slow_warp), str(launches)]
        args += [
            repr(float(v)) if isinstance(v, (float, np.floating)) else str(int(v)) for v in scalars
        ]
        run = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
        assert run.returncode == 0, f"emulated kernel failed ({run.returncode}):\n{run.stderr}"
        for i, name in enumerate(self.buffers):
            arr = arrays[name]
            arr[...] = np.fromfile(work / f"a{i}", arr.dtype).reshape(arr.shape)
        stats = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("emu: ")]
        return {k: int(v) for k, v in stats}


def block_dims(func: tvm.tirx.PrimFunc, threads: int | None = None) -> tuple[int, int, int]:
    """The (x, y, z) thread extents of ``func``'s kernels (its ``threadIdx`` bindings; every
    kernel of ``func`` must bind each one to the same constant, but for kernels of one-dimensional
    blocks of different sizes: then the block of ``threads``, the chosen kernel's)."""
    binding = r"T\.(?:thread_binding|launch_thread)\((?:T\.int\d+\()?(\d+)\)?, "
    binding += r'(?:thread=)?"threadIdx\.(\w)"'
    found = re.findall(binding, func.script())
    axes = {axis for _, axis in found}
    if axes == {"x"} and threads is not None and int(threads) in {int(e) for e, _ in found}:
        return int(threads), 1, 1
    dims = {}
    for extent, axis in found:
        assert dims.setdefault(axis, int(extent)) == int(extent), f"threadIdx.{axis}: two extents"
    return dims.get("x", 1), dims.get("y", 1), dims.get("z", 1)


def emulate(
    func: tvm.tirx.PrimFunc,
    tmp_path: Path,
    name: str = "kernel",
    *,
    sanitize: bool = True,
    kernel: int | None = None,
    patch: Callable[[str], str] | None = None,
) -> Emulated:
    """Build ``func`` with TVM and compile its source for the CPU, as ``tmp_path / name`` (with
    AddressSanitizer unless ``sanitize`` is False). ``func`` has one CUDA kernel, or ``kernel``
    picks one (in the order of the source: a split kernel before its merge; the host code that
    launches them one after the other is the caller's to do). ``patch``, if given, rewrites the
    kernel source (after the header) before it is compiled: a test's deliberately broken variant
    or its stand-in for a device function."""
    from string import Template

    src = cuda_source(func)
    assert _HEADER_END in src, "TVM's CUDA header changed: update cuda_emulation._HEADER_END"
    body = src[src.index(_HEADER_END) + len(_HEADER_END) :]
    if patch is not None:
        body = patch(body)
    kernels = list(_KERNEL.finditer(body))
    if kernel is None:
        assert len(kernels) == 1, f"expected one kernel, found {len(kernels)}"
        kernel = 0
    # code for the GPU only (PDL's wait, bulk copies; the wgmma bodies of the MoE GEMMs): its CPU
    # branch (#else), if any, instead
    body = re.sub(
        r"#if (?:defined\(__CUDA_ARCH__\)|DSV2_MOE_WGMMA\b)[^\n]*\n(?:(?!#else|#elif|#endif).)*?"
        r"(?:(?:#else|#elif defined\(DSV2_EMULATION\))\n(.*?))?#endif\n",
        lambda m: m.group(1) or "",
        body,
        flags=re.S,
    )
    # dynamic shared memory: a fixed static array (the sm_90 opt-in limit), filled as the others
    body = re.sub(
        r"extern __shared__ (__align__\(\d+\) )?(\w+) (\w+)\[\];",
        lambda m: (
            f"__shared__ __align__(128) {m.group(2)} {m.group(3)}"
            f"[{DYN_SHARED_BYTES} / sizeof({m.group(2)})];"
        ),
        body,
    )
    assert not re.search(r"\basm\b|extern __shared__", body), "inline PTX outside __CUDA_ARCH__"
    head = kernels[kernel]
    params = [p.strip() for p in head.group(3).split(",")]
    buffers, scalars, args = [], [], []
    for p in params:
        pname = p.split()[-1]
        if "*" in p:
            args.append(f"({p.split('*')[0].strip()}*)a[{len(buffers)}]")
            buffers.append(pname.removesuffix("_ptr"))
        else:
            args.append(f"({p.rsplit(maxsplit=1)[0]})s[{len(scalars)}]")
            scalars.append(pname)
    threads = int(head.group(1))
    block = block_dims(func, threads)
    assert block[0] * block[1] * block[2] == threads, f"threads {block} vs launch bounds {threads}"
    main = Template(_MAIN).substitute(
        n_scalars=len(scalars),
        n_buffers=len(buffers),
        block_x=block[0],
        block_y=block[1],
        block_z=block[2],
        call=f"{head.group(2)}({', '.join(args)})",
    )
    exe = compile_cpp(TYPES + THREADS + _statics(body) + main, tmp_path / name, sanitize=sanitize)
    return Emulated(exe, threads, buffers, scalars, block)


def random_int4(
    rng: np.random.Generator, rows: tuple[int, ...], k: int, group: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random INT4 group weight ``[*rows, k]`` as ``dsv2_mlc/quant/packing.py`` lays it out:
    (packed ``[*rows, k / 8]`` uint32, nibble ``i`` of word ``j`` element ``8 j + i``; fp16
    scales ``[*rows, ceil(k / group)]``, the last group partial where ``group`` does not divide
    ``k``; the float64 values ``(q - 8) * scale[k // group]``). The scales vary by a factor 3
    between groups and are sized for dot products of order 1 with standard normal activations."""
    q = rng.integers(0, 16, (*rows, k), dtype=np.uint32)
    groups = -(-k // group)
    scale = (rng.uniform(0.5, 1.5, (*rows, groups)) / (4.6 * np.sqrt(k))).astype(np.float16)
    packed = np.zeros((*rows, k // 8), np.uint32)
    for i in range(8):
        packed |= q[..., i::8] << np.uint32(4 * i)
    per_value = np.repeat(scale.astype(np.float64), group, axis=-1)[..., :k]
    values = (q.astype(np.float64) - 8) * per_value
    return packed, scale, values


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    """``|got - ref| / |ref|`` (L2, float64); NaN anywhere in ``got`` gives infinity."""
    got = np.asarray(got, np.float64)
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

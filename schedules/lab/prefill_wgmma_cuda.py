"""Lab: the ragged prefill flash kernel (:mod:`dsv2_mlc.schedules.prefill_attention_cuda`) with its
scores on Hopper's warpgroup MMA (sm_90a), a first step towards the ~550 TFLOP/s the 128K TTFT
goal needs (schedules/results/prefill_attention.md, "Next"). The product never imports this
module; not yet measured on the GPU.

What changes against the shipped kernel (64 query rows a block, 4 warps = one warpgroup, whose
``wgmma.m64nNk16`` accumulator layout is the ``mma.sync`` C layout the kernel's softmax and P
re-packing already use):

* **Q in shared memory** instead of 48 registers a thread: a 64 x ``Dqk`` tile in
  128-byte-swizzled atoms of 64 columns (1024-byte-aligned base), copied by ``cp.async`` with
  the first K tile; rows past the sequence zero-filled.
* **K tiles swizzled likewise** (``BN`` rows of ``Dqk``), so both operands of S = Q K^T are
  K-major shared tiles: ``Dqk / 16`` ``wgmma.m64n<BN>k16`` (one commit group, one wait) instead
  of ``Dqk / 16 x BN / 16`` ``ldmatrix`` + 2 ``mma.sync`` a warp. ``fence.proxy.async`` after a
  tile's ``cp.async`` wait makes the copies visible to the MMA's (async) proxy.
* ``pv=True``: **O += P V on wgmma too**: A = P from registers (the ``mma.sync`` A fragments
  the kernel already packs, all of a tile's k-steps first: the MMAs read them asynchronously),
  B = the V tile stored in the same swizzled atoms and read **MN-major** (the descriptor's
  transpose bit; its leading byte offset the ``BN * 128`` bytes between 64-column atoms, its
  stride byte offset the 1,024 between 8-key groups, as CUTLASS's canonical SW128 MN-major
  layout); O's 64 accumulators a thread are the kernel's ``o`` in the same layout. Else P V is
  the shipped ``mma.sync`` with ``ldmatrix.trans`` over a padded V tile.
* The softmax, the causal tile skipping and the epilogue are the shipped kernel's text.

Shared memory: ``(64 + BN) Dqk 2 + BN (Dv [+ 8]) 2`` bytes + 1 KB of alignment (65-66 KB at
V2-Lite's 192 / 128 and ``BN`` 64: dynamic shared memory).

:func:`ws_prefill_source` is the next step, warp-specialized (FlashAttention-3's structure
without its ping-pong scheduling): 128-row blocks of 384 threads, a producer warpgroup filling
two stages of K / V (and Q once) by ``cp.async`` and named barriers, two consumer warpgroups of
64 rows running both products on ``wgmma`` (129 KB of shared memory, 149 registers).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from dsv2_mlc.schedules import prefill_attention_cuda as pfa

__all__ = ["ATOM", "build_prefill_wgmma", "shared_bytes", "wgmma_prefill_source"]

ATOM = 64  # columns of a swizzled atom (128 bytes of halves)
_SHIPPED_SOURCE = pfa._cuda_source  # (the builder's is swapped for this module's while it builds)
BLOCK_M = 64  # query rows of a block: wgmma's M, one warpgroup


def _check(DQK: int, BM: int, BN: int, DV: int = ATOM, pv: bool = False) -> None:
    if BM != BLOCK_M or BN not in (64, 128) or DQK % ATOM or (pv and (DV % ATOM or DV > 256)):
        raise ValueError(
            f"the wgmma prefill takes blocks of {BLOCK_M} rows, key tiles of 64 or 128 and Dqk "
            f"(and with P V on wgmma Dv <= 256) a multiple of {ATOM}; got {BM}, {BN}, {DQK}, {DV}"
        )


def shared_bytes(d_qk: int, d_v: int, block_n: int, pv: bool = False) -> int:
    """Shared memory of one block (the Q and K tiles, the V tile: padded rows, or swizzled
    atoms with ``pv``; the base's alignment)."""
    v_row = d_v if pv else d_v + pfa._PAD
    return (BLOCK_M + block_n) * d_qk * 2 + block_n * v_row * 2 + 1024


def _helpers(tag: str, BN: int) -> str:
    """The wgmma primitives (CPU emulation branches: the emulator's stand-ins)."""
    regs = ",".join(f"%{i}" for i in range(BN // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(BN // 2))
    return f"""
__device__ __forceinline__ unsigned pfw_at_{tag}(int r, int c, int rows) {{
  return (unsigned)((c >> 3) * rows * 128 + (r >> 3) * 1024 + (r & 7) * 128 +
                    (((c & 7) ^ (r & 7)) << 4));
}}
__device__ __forceinline__ unsigned long long pfw_desc_{tag}(unsigned addr) {{
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}}
// d (64 x {BN}, f32) += A (64 x 16 at shared a) * B ({BN} x 16 at shared b)^T, both K-major,
// 128-byte swizzle
__device__ __forceinline__ void pfw_wgmma_{tag}(float* d, unsigned a, unsigned b) {{
#if defined(__CUDA_ARCH__)
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{BN // 2 + 2}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.f16.f16 {{{regs}}}, %{BN // 2}, "
      "%{BN // 2 + 1}, p, 1, 1, 0, 0;\\n}}\\n"
      : {outs}
      : "l"(pfw_desc_{tag}(a)), "l"(pfw_desc_{tag}(b)), "r"(1));
#else
  dsv2_emu_wgmma(d, a, b, {BN});
#endif
}}
__device__ __forceinline__ void pfw_fence_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#endif
}}
__device__ __forceinline__ void pfw_commit_wait_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
#else
  dsv2_emu_wg_commit();
  dsv2_emu_wg_wait(0);
#endif
}}
// this thread's completed cp.async copies -> visible to wgmma (the async proxy)
__device__ __forceinline__ void pfw_proxy_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
#endif
}}
"""


def _pv_helper(tag: str, BN: int, DV: int) -> str:
    """``pfw_wgmma_pv``: O (64 x DV) += P (64 x 16, A from registers: the ``mma.sync`` A
    fragments) V (16 keys x DV at shared v, MN-major: the transpose bit; atoms of 64 columns
    ``BN * 128`` bytes apart, 8-key groups 1024 bytes apart)."""
    n = DV // 2
    regs = ",".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    lbo = BN * 128
    return f"""
__device__ __forceinline__ void pfw_wgmma_pv_{tag}(float* d, const unsigned* a, unsigned v) {{
#if defined(__CUDA_ARCH__)
  const unsigned long long desc = (unsigned long long)((v & 0x3FFFFu) >> 4) |
      ((unsigned long long)({lbo} >> 4) << 16) | (64ull << 32) | (1ull << 62);
  asm volatile(
      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 5}, 0;\\n"
      "wgmma.mma_async.sync.aligned.m64n{DV}k16.f32.f16.f16 {{{regs}}}, "
      "{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 1;\\n}}\\n"
      : {outs}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#else
  dsv2_emu_wgmma_ra_mn(d, a, v, {DV}, {lbo}, 1024);
#endif
}}
"""


def _swap(src: str, old: str, new: str, count: int = 1) -> str:
    if src.count(old) != count:
        raise ValueError(f"the shipped kernel's text changed: {old[:60]!r}")
    return src.replace(old, new)


def wgmma_prefill_source(
    tag: str, *, H: int, DQK: int, DV: int, BM: int, BN: int, pv: bool = False
) -> str:
    """CUDA of ``prefill_attn_<tag>`` (module docstring), the shipped kernel's text with Q and K
    in swizzled shared tiles and S on ``wgmma`` (``pv``: O += P V too, V swizzled); the same
    arguments as the shipped ``_cuda_source``."""
    _check(DQK, BM, BN, DV, pv)
    src = _SHIPPED_SOURCE(tag, H=H, DQK=DQK, DV=DV, BM=BM, BN=BN)
    KS, NT, CK, KSTR = DQK // 16, BM // 16 * 32, DQK // 8, DQK + pfa._PAD
    QT, KT = BLOCK_M * DQK * 2, BN * DQK * 2
    fn = f"__device__ __forceinline__ void prefill_attn_{tag}("
    src = _swap(src, fn, _helpers(tag, BN) + fn)
    # Q: no register fragments; the shared tiles from a 1024-byte-aligned base
    i = src.index(f"  unsigned qf[{KS}][4];")
    j = src.index("  const half* kb = ")
    src = (
        src[:i]
        + f"""  const unsigned s0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned q_sa = (s0 + 1023u) & ~1023u;
  const unsigned k_sa = q_sa + {QT};
  const unsigned v_sa = k_sa + {KT};
"""
        + src[j:]
    )
    # Q's rows go with the first K tile's copies (one commit group)
    first = "  if (n_tiles > 0) {\n"
    src = _swap(
        src,
        first,
        first
        + f"""    for (int c = tx; c < {BLOCK_M * CK}; c += {NT}) {{
      const int row = c / {CK}, col = c % {CK};
      const bool ok = m0 + row < q_len;
      pfa_cp_{tag}(q_sa + pfw_at_{tag}(row, col, {BLOCK_M}),
                   ok ? (const void*)(q + ((long long)(q0 + m0 + row) * {H} + head) * {DQK}
                                      + col * 8)
                      : (const void*)q,
                   ok ? 16 : 0);
    }}
""",
    )
    # the K tiles' copies: swizzled rows
    src = _swap(
        src,
        f"pfa_cp_{tag}(k_sa + (row * {KSTR} + col * 8) * 2,",
        f"pfa_cp_{tag}(k_sa + pfw_at_{tag}(row, col, {BN}),",
        count=2,
    )
    # S = Q K^T on wgmma, after the copies are made visible to its proxy
    src = _swap(
        src,
        f"    pfa_wait1_{tag}();  // K(it) has landed\n    __syncthreads();\n",
        f"    pfa_wait1_{tag}();  // Q and K(it) have landed\n    pfw_proxy_{tag}();\n"
        "    __syncthreads();\n",
    )
    a = src.index(f"#pragma unroll\n    for (int ks = 0; ks < {KS}; ++ks) {{")
    b = src.index("    __syncthreads();  // every warp is done with K(it)")
    src = (
        src[:a]
        + f"""    pfw_fence_{tag}();
#pragma unroll
    for (int ks = 0; ks < {KS}; ++ks)
      pfw_wgmma_{tag}(&s[0][0], q_sa + (ks >> 2) * {BLOCK_M * 128} + (ks & 3) * 32,
                      k_sa + (ks >> 2) * {BN * 128} + (ks & 3) * 32);
    pfw_commit_wait_{tag}();
"""
        + src[b:]
    )
    if pv:
        src = _pv_on_wgmma(src, tag, BN, DV)
    return src.replace(f"DSV2_PREFILL_ATTN_{tag}", f"DSV2_PREFILL_WG_{tag}")


def _pv_on_wgmma(src: str, tag: str, BN: int, DV: int) -> str:
    """O += P V as ``wgmma`` with A = P from registers and V MN-major in swizzled atoms."""
    fn = f"__device__ __forceinline__ void prefill_attn_{tag}("
    src = _swap(src, fn, _pv_helper(tag, BN, DV) + fn)
    vstr = DV + pfa._PAD
    src = _swap(
        src,
        f"pfa_cp_{tag}(v_sa + (row * {vstr} + col * 8) * 2,",
        f"pfa_cp_{tag}(v_sa + pfw_at_{tag}(row, col, {BN}),",
        count=2,
    )
    src = _swap(
        src,
        f"    pfa_wait1_{tag}();  // V(it) has landed\n    __syncthreads();\n",
        f"    pfa_wait1_{tag}();  // V(it) has landed\n    pfw_proxy_{tag}();\n"
        "    __syncthreads();\n",
    )
    # P's A fragments of every k-step first (registers the MMAs read asynchronously), then the
    # MMAs, one commit group
    old = "      unsigned a[4];\n      a[0] = "
    src = _swap(src, old, "      unsigned* a = pa[kk];\n      a[0] = ")
    kloop = f"#pragma unroll\n    for (int kk = 0; kk < {BN // 16}; ++kk) {{\n"
    src = _swap(src, kloop, f"    unsigned pa[{BN // 16}][4];\n" + kloop)
    a = src.index(f"#pragma unroll\n      for (int np = 0; np < {DV // 16}; ++np) {{")
    b = src.index("    __syncthreads();  // every warp is done with V(it)")
    return (
        src[:a]
        + f"""    }}
    pfw_fence_{tag}();
#pragma unroll
    for (int kk = 0; kk < {BN // 16}; ++kk)
      pfw_wgmma_pv_{tag}(&o[0][0], pa[kk], v_sa + kk * 2048);
    pfw_commit_wait_{tag}();
"""
        + src[b:]
    )


def build_prefill_wgmma(h_kv, h_q, d_qk, d_v, dtype, tiles, pv: bool = False):
    """:func:`~dsv2_mlc.schedules.prefill_attention_cuda.build_prefill_attention` with this
    module's kernel (``tiles.block_m`` must be 64, ``block_n`` 64 or 128; ``pv``: P V on
    ``wgmma`` too) and its shared memory (dynamic: up to the 227 KB a block may opt into)."""
    _check(d_qk, tiles.block_m, tiles.block_n, d_v, pv)

    def source(tag, **shape):
        return wgmma_prefill_source(tag, **shape, pv=pv)

    def smem(d_qk_, d_v_, block_n):
        return shared_bytes(d_qk_, d_v_, block_n, pv)

    with contextlib.ExitStack() as stack:
        for name, value in (
            ("_cuda_source", source),
            ("_shared_bytes", smem),
            ("_MAX_SHARED_BYTES", 232448),
        ):
            stack.callback(setattr, pfa, name, getattr(pfa, name))
            setattr(pfa, name, value)
        return pfa.build_prefill_attention(h_kv, h_q, d_qk, d_v, dtype, replace(tiles))


# -- warp-specialized: a producer warpgroup, two consumer warpgroups -----------------------------
WS_BLOCK_M = 128  # query rows of a block: two consumer warpgroups of 64
WS_THREADS = 384  # + a producer warpgroup


def ws_shared_bytes(d_qk: int, d_v: int, block_n: int) -> int:
    """Shared memory of the warp-specialized block: Q (128 rows), two stages of K and V
    (swizzled), the base's alignment."""
    return WS_BLOCK_M * d_qk * 2 + 2 * block_n * (d_qk + d_v) * 2 + 1024


def _between(src: str, a: str, b: str) -> str:
    i = src.index(a)
    return src[i : src.index(b, i)]


def ws_prefill_source(tag: str, *, H: int, DQK: int, DV: int, BM: int, BN: int) -> str:
    """CUDA of the warp-specialized ``prefill_attn_<tag>`` (384 threads): warpgroup 2 copies Q
    once and each K / V tile into one of two stages (``cp.async``, then ``fence.proxy.async``
    and ``bar.arrive`` on the stage's "full" barrier; it waits on the stage's "free" barrier
    before refilling it); warpgroups 0 and 1 take 64 query rows each and run S = Q K^T, the
    softmax and O += P V on ``wgmma`` (as ``pv=True``) with no barrier between them. The
    softmax, the causal masks and the epilogue are the shipped kernel's text."""
    if BM != WS_BLOCK_M or BN != 64 or DQK % ATOM or DV % ATOM or DV > 256:
        raise ValueError(
            f"the warp-specialized prefill takes blocks of {WS_BLOCK_M} rows, key tiles of 64 "
            f"and head dims multiples of {ATOM}; got {BM}, {BN}, {DQK}, {DV}"
        )
    ship = _SHIPPED_SOURCE(tag, H=H, DQK=DQK, DV=DV, BM=BM, BN=BN)
    fn = f"__device__ __forceinline__ void prefill_attn_{tag}("
    helpers = ship[: ship.index(fn)]
    preamble = _between(ship, f"  const int head = bid % {H};", "  unsigned qf[")
    softmax = _between(ship, "    const bool need_mask", f"    pfa_wait1_{tag}();  // V(it)")
    epilogue = ship[ship.index("#pragma unroll\n  for (int r = 0; r < 2; ++r) {\n    float dt") :]
    CK, CV, QT, KT, VT = DQK // 8, DV // 8, WS_BLOCK_M * DQK * 2, BN * DQK * 2, BN * DV * 2
    prims = f"""
__device__ __forceinline__ void pfw_bar_sync_{tag}(int id, int n) {{
#if defined(__CUDA_ARCH__)
  asm volatile("bar.sync %0, %1;\\n" ::"r"(id), "r"(n) : "memory");
#else
  dsv2_emu_bar_sync(id, n);
#endif
}}
__device__ __forceinline__ void pfw_bar_arrive_{tag}(int id, int n) {{
#if defined(__CUDA_ARCH__)
  asm volatile("bar.arrive %0, %1;\\n" ::"r"(id), "r"(n) : "memory");
#else
  dsv2_emu_bar_arrive(id, n);
#endif
}}
__device__ __forceinline__ void pfw_wait0_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#else
  dsv2_emu_cp_wait(0);
#endif
}}
"""
    body = f"""{fn}
    const half* __restrict__ q, const half* __restrict__ k, const half* __restrict__ v,
    const int* __restrict__ q_indptr, const int* __restrict__ kv_indptr, half* __restrict__ out,
    float* __restrict__ lse, int batch_size, int causal, float sm_scale, half* smem,
    const half* smem_last, int bid, int tx) {{
{preamble}  const unsigned s0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned q_sa = (s0 + 1023u) & ~1023u;
  const unsigned k_sa = q_sa + {QT};  // stage st: K at k_sa + st * {KT + VT}, then V
  const half* kb = k + (long long)kv0 * {H * DQK} + head * {DQK};
  const half* vb = v + (long long)kv0 * {H * DV} + head * {DV};
  if (tx >= 256) {{  // the producer: Q with the first tile; tile it into stage it % 2
    const int p = tx - 256;
    for (int it = 0; it < n_tiles; ++it) {{
      const int st = it & 1, nn = it * {BN};
      if (it >= 2) pfw_bar_sync_{tag}(4 + st, 384);  // the consumers are done with it - 2
      const unsigned kt = k_sa + st * {KT + VT}, vt = kt + {KT};
      if (it == 0) {{
        for (int c = p; c < {WS_BLOCK_M * CK}; c += 128) {{
          const int row = c / {CK}, col = c % {CK};
          const bool ok = m0 + row < q_len;
          pfa_cp_{tag}(q_sa + pfw_at_{tag}(row, col, {WS_BLOCK_M}),
                       ok ? (const void*)(q + ((long long)(q0 + m0 + row) * {H} + head) * {DQK}
                                          + col * 8)
                          : (const void*)q,
                       ok ? 16 : 0);
        }}
      }}
      for (int c = p; c < {BN * CK}; c += 128) {{
        const int row = c / {CK}, col = c % {CK};
        const bool ok = nn + row < kv_len;
        pfa_cp_{tag}(kt + pfw_at_{tag}(row, col, {BN}),
                     ok ? (const void*)(kb + (long long)(nn + row) * {H * DQK} + col * 8)
                        : (const void*)k,
                     ok ? 16 : 0);
      }}
      for (int c = p; c < {BN * CV}; c += 128) {{
        const int row = c / {CV}, col = c % {CV};
        const bool ok = nn + row < kv_len;
        pfa_cp_{tag}(vt + pfw_at_{tag}(row, col, {BN}),
                     ok ? (const void*)(vb + (long long)(nn + row) * {H * DV} + col * 8)
                        : (const void*)v,
                     ok ? 16 : 0);
      }}
      pfa_commit_{tag}();
      pfw_wait0_{tag}();
      pfw_proxy_{tag}();
      pfw_bar_arrive_{tag}(2 + st, 384);  // stage st is full
    }}
    return;
  }}
  const int wg = tx >> 7;
  float o[{DV // 8}][4];
#pragma unroll
  for (int j = 0; j < {DV // 8}; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {{-INFINITY, -INFINITY}};
  float d[2] = {{0.f, 0.f}};
  for (int it = 0; it < n_tiles; ++it) {{
    const int st = it & 1, n0 = it * {BN};
    const unsigned kt = k_sa + st * {KT + VT}, vt = kt + {KT};
    pfw_bar_sync_{tag}(2 + st, 384);  // the producer has filled stage st
    float s[{BN // 8}][4];
#pragma unroll
    for (int j = 0; j < {BN // 8}; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    pfw_fence_{tag}();
#pragma unroll
    for (int ks = 0; ks < {DQK // 16}; ++ks)
      pfw_wgmma_{tag}(&s[0][0], q_sa + (ks >> 2) * {WS_BLOCK_M * 128} + wg * 8192 + (ks & 3) * 32,
                      kt + (ks >> 2) * {BN * 128} + (ks & 3) * 32);
    pfw_commit_wait_{tag}();
{softmax}    unsigned pa[{BN // 16}][4];
#pragma unroll
    for (int kk = 0; kk < {BN // 16}; ++kk) {{
      pa[kk][0] = pfa_pack_{tag}(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pfa_pack_{tag}(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pfa_pack_{tag}(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pfa_pack_{tag}(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }}
    pfw_fence_{tag}();
#pragma unroll
    for (int kk = 0; kk < {BN // 16}; ++kk)
      pfw_wgmma_pv_{tag}(&o[0][0], pa[kk], vt + kk * 2048);
    pfw_commit_wait_{tag}();
    if (it + 2 < n_tiles) pfw_bar_arrive_{tag}(4 + st, 384);  // stage st is free
  }}
{epilogue}"""
    src = helpers + _helpers(tag, BN) + _pv_helper(tag, BN, DV) + prims + body
    return src.replace(f"DSV2_PREFILL_ATTN_{tag}", f"DSV2_PREFILL_WS_{tag}")


def build_prefill_ws(h_kv, h_q, d_qk, d_v, dtype, tiles):
    """:func:`~dsv2_mlc.schedules.prefill_attention_cuda.build_prefill_attention` with the
    warp-specialized kernel (``tiles.block_m`` 128, ``block_n`` 64; 384 threads, dynamic shared
    memory)."""
    with contextlib.ExitStack() as stack:
        for name, value in (
            ("_cuda_source", ws_prefill_source),
            ("_shared_bytes", ws_shared_bytes),
            ("_block_threads", lambda block_m: WS_THREADS),
            ("_MAX_SHARED_BYTES", 232448),
        ):
            stack.callback(setattr, pfa, name, getattr(pfa, name))
            setattr(pfa, name, value)
        return pfa.build_prefill_attention(h_kv, h_q, d_qk, d_v, dtype, replace(tiles))

"""The FP8 cache's split block on Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a): the CUDA
device function :mod:`~.mla_attention_cuda`'s split kernel calls in place of the pipelined block
(:mod:`~.mla_cuda_helpers`) where its tile says ``block="wgmma"`` (schedules/tiles.py: V2-Lite's
16 heads over an FP8 cache on sm_90). Measured against the pipelined block in
schedules/results/mla_attention.md ("The wgmma block").

Why: the pipelined block is bound by its instructions and their latencies, not by the bytes it
reads (~2,250 warp instructions a 16-token page, ~2.2 us a page a block with either cache
dtype). Most of them are the scores: each of its 8 warps runs ``mma.sync`` over a ninth of the
576 dims, the partial tiles meet in shared memory and 16 lanes a head reduce them; and its FP8
pages are decoded by a shared-memory pass of shifts and masks.

This block takes 64 tokens (4 pages) a step, 256 threads as two warpgroups:

* **Rows staged in registers.** Thread ``tx`` loads the step's 8-byte latent piece ``tx % (L /
  8)`` of rows ``tx / (L / 8) + (2048 / L) k`` and two 16-byte rope chunks one step ahead (no
  shared ring); at the step's start it converts the e4m3 bytes with ``cvt.rn.f16x2.e4m3x2`` (the
  values themselves: the latent scale is ``kv_scale``) and stores them into the step's key tile.
* **Tiles in the wgmma layout.** The key tile is 64 rows x ``D`` halves in 128-byte-swizzled
  atoms of 64 columns (8 KB an atom: rows 128 bytes apart, 8-row groups 1024 bytes apart, the
  16-byte chunk ``c`` of row ``r`` at ``c ^ (r % 8)``), Q (16 heads x ``D``) likewise (2 KB an
  atom), from a 1024-byte-aligned base.
* **Scores S^T = K Q^T as ``wgmma.m64n16k16``** (A = the key tile, M = 64 tokens; B = Q, N =
  16 heads; both K-major from shared memory): warpgroup 0 takes the first ``D / 32`` k-steps
  (latent dims), warpgroup 1 the rest (latent, then rope: its latent sum is multiplied by the
  scale before the rope sum adds) and hands its 8 partial values a thread to the same thread of
  warpgroup 0 through shared memory.
* **Softmax in the accumulator layout** (warpgroup 0): thread ``(w, g, t)`` holds tokens ``16 w
  + g``, ``+ 8`` x heads ``2 t``, ``2 t + 1``, ``2 t + 8``, ``2 t + 9``: a head's maximum by
  three shuffles and a 4-warp exchange (a named barrier of 128 threads), the running sums kept
  per thread and reduced once at the end. P goes to shared memory (16 heads x 64 tokens).
* **P V on ``mma.sync``**: every warp owns ``L / 8`` output columns, P by ``ldmatrix``, V by
  ``ldmatrix.trans`` from the same key tile (its swizzled addresses).

The function's signature is the pipelined block's (``mla_split_pipe_<tag>``, under which the
split kernel calls it): a split of pages ``ids[0, npg)``, tokens from ``tok0``, ``n_vis`` visible
keys; ``final_``: out / lse, else the partial state to the workspace. The first step's rows are
loaded before the PDL wait when all its pages are older than the row's new tokens (``n_early``),
and the function calls the wait. Shared memory: the key tile, Q, the exchange buffers (~98 KB at
V2-Lite's rows); ~190 registers a thread: one block an SM.
"""

from __future__ import annotations

from string import Template

from .cuda_call import WAIT_THEN_RELEASE, grid_wait_source
from .mla_cuda_helpers import _PIPE_PRIMS, SPLIT_STORE

__all__ = [
    "ATOM",
    "BODY",
    "G",
    "PRIMS",
    "TOKENS",
    "check_shape",
    "layout",
    "split_block",
    "wgmma_shared_halves",
    "wgmma_source",
]

G = 4  # pages a step
TOKENS = G * 16  # tokens a step: wgmma's M
ATOM = 64  # columns of a swizzled atom (128 bytes of halves)


def check_shape(D: int, DL: int) -> None:
    """ValueError unless rows of ``D`` values (``DL`` latent) fit the block: whole atoms, 64
    rope values, ``L / 8`` output columns a warp in whole n-tile pairs, 16 | 2048 / L."""
    if D % ATOM or DL % ATOM or D - DL != 64 or (DL // 8) % 16 or 16 % (2048 // DL):
        raise ValueError(
            f"the wgmma split block takes rows of L + 64 values, L a multiple of 128 dividing "
            f"2048; got {DL} + {D - DL}"
        )


def layout(D: int, DL: int) -> dict[str, int]:
    """Byte offsets of the block's shared buffers from its 1024-byte-aligned base, and
    ``bytes`` (the block's shared memory, the base's alignment included)."""
    check_shape(D, DL)
    atoms = D // ATOM
    lay = {"tile": 0, "q": atoms * TOKENS * 128}
    off = lay["q"] + atoms * 16 * 128
    lay["xs"] = off  # warpgroup 1's partial scores: 128 threads x 8 floats
    off += 128 * 8 * 4
    lay["p"] = off  # P: 16 heads x (64 + 8) halves
    off += 16 * (TOKENS + 8) * 2
    lay["red"] = off  # 4 warps x 16 heads: maxima, then the sums
    off += 4 * 16 * 4
    lay["r"] = off  # rescale, max, sum: 3 x 16 floats
    off += 3 * 16 * 4
    lay["bytes"] = off + 1024
    return lay


def wgmma_shared_halves(D: int, DL: int) -> int:
    """Shared memory (halves) of one block."""
    return layout(D, DL)["bytes"] // 2


PRIMS = r"""
__device__ __forceinline__ unsigned long long mlaw_desc_${tag}(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}
// d (64 x 16, f32) += A (64 x 16 at shared a) * B (16 x 16 at shared b)^T, both K-major,
// 128-byte swizzle
__device__ __forceinline__ void mlaw_wgmma_${tag}(float* d, unsigned a, unsigned b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, "
      "p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(mlaw_desc_${tag}(a)), "l"(mlaw_desc_${tag}(b)), "r"(1));
}
__device__ __forceinline__ void mlaw_fence_${tag}() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mlaw_commit_${tag}() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void mlaw_wait0_${tag}() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// this thread's shared stores and completed cp.async -> visible to wgmma (the async proxy)
__device__ __forceinline__ void mlaw_proxy_${tag}() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// bytes 0, 1 of w (e4m3) -> two float16, exact values (sm_89+)
__device__ __forceinline__ unsigned mlaw_cvt_${tag}(unsigned w) {
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)(w & 0xffffu)));
  return r;
}
// warpgroup 0's 128 threads
__device__ __forceinline__ void mlaw_bar0_${tag}() {
  asm volatile("bar.sync 1, 128;\n" ::: "memory");
}
"""

BODY = r"""
// byte offset of (row r, 16-byte chunk c) of a swizzled tile of ${rows} rows (atoms of 64 cols)
__device__ __forceinline__ unsigned mlaw_at_${tag}(int r, int c, int rows) {
  return (unsigned)((c >> 3) * rows * 128 + (r >> 3) * 1024 + (r & 7) * 128 +
                    (((c & 7) ^ (r & 7)) << 4));
}

struct mlaw_raw_${tag} { uint2 l[${lk}]; uint4 r[2]; };
__device__ __forceinline__ void mlaw_load_${tag}(mlaw_raw_${tag}& x,
    const half* __restrict__ pages, const int* __restrict__ ids, int j, int npg, int valid,
    int tx) {
  const char* pb = reinterpret_cast<const char*>(pages);
  int pid[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) pid[u] = j + u < npg ? ids[j + u] : 0;
  const int lp = tx % ${lp}, r0 = tx / ${lp};
#pragma unroll
  for (int k = 0; k < ${lk}; ++k) {
    const int r = r0 + ${rp} * k;  // page ${rp} k / 16
    const char* src = pb + ((size_t)pid[${rp} * k / 16] * 16 + (r & 15)) * ${rowb} + lp * 8;
    x.l[k] = r + j * 16 < valid ? *reinterpret_cast<const uint2*>(src) : make_uint2(0u, 0u);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int qi = tx + 256 * k, r = qi >> 3, c = qi & 7;
    const int id = (tx >> 7) ? pid[2 * k + 1] : pid[2 * k];  // page r / 16
    const char* src = pb + ((size_t)id * 16 + (r & 15)) * ${rowb} + ${dl} + c * 16;
    x.r[k] = r + j * 16 < valid ? *reinterpret_cast<const uint4*>(src)
                                : make_uint4(0u, 0u, 0u, 0u);
  }
}
__device__ __forceinline__ void mlaw_store_${tag}(const mlaw_raw_${tag}& x, char* tile, int tx) {
  const int lp = tx % ${lp}, r0 = tx / ${lp};
#pragma unroll
  for (int k = 0; k < ${lk}; ++k) {
    uint4 h;
    h.x = mlaw_cvt_${tag}(x.l[k].x);
    h.y = mlaw_cvt_${tag}(x.l[k].x >> 16);
    h.z = mlaw_cvt_${tag}(x.l[k].y);
    h.w = mlaw_cvt_${tag}(x.l[k].y >> 16);
    *reinterpret_cast<uint4*>(tile + mlaw_at_${tag}(r0 + ${rp} * k, lp, ${tokens})) = h;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int qi = tx + 256 * k;
    *reinterpret_cast<uint4*>(tile + mlaw_at_${tag}(qi >> 3, ${dl} / 8 + (qi & 7), ${tokens})) =
        x.r[k];
  }
}
__device__ __forceinline__ void mla_split_wg_${tag}(
    const half* __restrict__ q, const half* __restrict__ pages, const int* __restrict__ ids,
    int npg, int tok0, int n_vis, float scale, int final_, half* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse, int ws_row,
    half* smem, const half* smem_last, int tx, int n_early) {
  (void)smem_last;
  ws_o += (size_t)ws_row * ${dl};
  ws_lse += ws_row;
  const int w = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int wg = w >> 2, w4 = w & 3;
  const unsigned s0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned base = (s0 + 1023u) & ~1023u;
  char* gbase = reinterpret_cast<char*>(smem) + (base - s0);
  const unsigned qt = base + ${q_off};
  float* xs = reinterpret_cast<float*>(gbase + ${xs_off});
  half* p_s = reinterpret_cast<half*>(gbase + ${p_off});
  float* red = reinterpret_cast<float*>(gbase + ${red_off});
  float* r_s = reinterpret_cast<float*>(gbase + ${r_off});
  float* m_s = r_s + 16;
  float* d_s = r_s + 32;
  const int nval = min(n_vis - tok0, npg * 16);  // the split's visible rows
  const int ngr = (npg + ${g} - 1) / ${g};
  // Prologue: step 0's rows into registers, before the PDL wait if all its pages are older
  // than the row's new tokens
  mlaw_raw_${tag} x;
  const bool early = ngr > 0 && n_early >= min(${g}, npg);
  if (early) mlaw_load_${tag}(x, pages, ids, 0, npg, nval, tx);
  ${wait_release}  // (PDL) what follows reads the new tokens and Q
  if (ngr > 0 && !early) mlaw_load_${tag}(x, pages, ids, 0, npg, nval, tx);
  // Q (16 heads x ${d}) -> its swizzled tile
  for (int i = tx; i < 16 * ${dch}; i += 256) {
    const int h = i / ${dch}, c = i - h * ${dch};
    *reinterpret_cast<uint4*>(gbase + ${q_off} + mlaw_at_${tag}(h, c, 16)) =
        *reinterpret_cast<const uint4*>(q + h * ${qs} + c * 8);
  }
  float acc[${ntw} * 4];
#pragma unroll
  for (int i = 0; i < ${ntw} * 4; ++i) acc[i] = 0.f;
  float m_run[4], l_run[4];  // warpgroup 0: heads 2t, 2t + 1, 2t + 8, 2t + 9
#pragma unroll
  for (int e = 0; e < 4; ++e) { m_run[e] = -INFINITY; l_run[e] = 0.f; }
  const int lr = lane & 7, lm = lane >> 3;
  // P (x4): heads 0-7 / 8-15 (lm % 2) x tokens +0 / +8 (lm / 2) -> a0..a3 of a k-step
  const unsigned p_addr = base + ${p_off} + (((lm & 1) * 8 + lr) * ${ps} + (lm >> 1) * 8) * 2;
  for (int i = 0; i < ngr; ++i) {
    __syncthreads();  // every warp is past the last step's reads of the tile (and of Q's stores)
    // <decode>
    mlaw_store_${tag}(x, gbase, tx);
    // </decode>
    // <copy>
    if (i + 1 < ngr) mlaw_load_${tag}(x, pages, ids, (i + 1) * ${g}, npg, nval, tx);
    // </copy>
    mlaw_proxy_${tag}();
    __syncthreads();
    const unsigned kt = base;
    // scores: this warpgroup's k-steps
    float sa[8], sr[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { sa[e] = 0.f; sr[e] = 0.f; }
    // <scores>
    mlaw_fence_${tag}();
    if (wg == 0) {
#pragma unroll
      for (int k = 0; k < ${ks0}; ++k)
        mlaw_wgmma_${tag}(sa, kt + (k >> 2) * ${atom_a} + (k & 3) * 32,
                          qt + (k >> 2) * 2048 + (k & 3) * 32);
    } else {
#pragma unroll
      for (int k = ${ks0}; k < ${ksl}; ++k)
        mlaw_wgmma_${tag}(sa, kt + (k >> 2) * ${atom_a} + (k & 3) * 32,
                          qt + (k >> 2) * 2048 + (k & 3) * 32);
#pragma unroll
      for (int k = ${ksl}; k < ${ks}; ++k)
        mlaw_wgmma_${tag}(sr, kt + (k >> 2) * ${atom_a} + (k & 3) * 32,
                          qt + (k >> 2) * 2048 + (k & 3) * 32);
    }
    mlaw_commit_${tag}();
    mlaw_wait0_${tag}();
    // </scores>
    if (wg == 1) {
#pragma unroll
      for (int e = 0; e < 8; ++e) xs[(w4 * 32 + lane) * 8 + e] = sa[e] * ${kscale} + sr[e];
    }
    __syncthreads();
    if (wg == 0) {  // <softmax>
      float sv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int tk = 16 * w4 + g + 8 * ((e & 3) >> 1);
        const float v = sa[e] * ${kscale} + xs[(w4 * 32 + lane) * 8 + e];
        sv[e] = i * ${tokens} + tk < nval ? v * scale : -INFINITY;
      }
      // heads h(e) = 8 (e >> 2) + 2 t + (e & 1): maxima over this thread's two tokens, the
      // warp's 16 (lanes of the same t), then the 4 warps
      float mx[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = (e >> 1) * 4 + (e & 1);
        mx[e] = fmaxf(sv[v], sv[v + 2]);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
          mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], o));
      }
      if (g == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) red[w4 * 16 + 8 * (e >> 1) + 2 * t + (e & 1)] = mx[e];
      }
      mlaw_bar0_${tag}();
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = 8 * (e >> 1) + 2 * t + (e & 1);
        const float bm = fmaxf(fmaxf(red[h], red[16 + h]), fmaxf(red[32 + h], red[48 + h]));
        const float m_new = fmaxf(m_run[e], bm);
        const float rs = m_run[e] == -INFINITY ? 0.f : exp2f(m_run[e] - m_new);
        const int v = (e >> 1) * 4 + (e & 1);
        const float p0 = m_new == -INFINITY ? 0.f : exp2f(sv[v] - m_new);
        const float p1 = m_new == -INFINITY ? 0.f : exp2f(sv[v + 2] - m_new);
        l_run[e] = l_run[e] * rs + p0 + p1;
        m_run[e] = m_new;
        p_s[h * ${ps} + 16 * w4 + g] = __float2half_rn(p0);
        p_s[h * ${ps} + 16 * w4 + g + 8] = __float2half_rn(p1);
        if (w4 == 0 && g == 0) r_s[h] = rs;
      }
      // </softmax>
    }
    __syncthreads();
    // O = O * rescale + P V over this warp's columns [${cw} w, + ${cw}), 4 k-steps of 16 tokens
    const float r0 = r_s[g], r1 = r_s[g + 8];
#pragma unroll
    for (int j = 0; j < ${ntw}; ++j) {
      float* o = acc + 4 * j;
      o[0] *= r0; o[1] *= r0; o[2] *= r1; o[3] *= r1;
    }
    // <pv>
#pragma unroll
    for (int u = 0; u < ${g}; ++u) {
      unsigned a[4];
      mlap_ldsm_${tag}(a, p_addr + u * 32);
      const int tk = u * 16 + (lm & 1) * 8 + lr;
#pragma unroll
      for (int j = 0; j < ${ntw}; j += 2) {
        unsigned b[4];
        const int col = w * ${cw} + j * 8 + (lm >> 1) * 8;
        mlap_ldsm_t_${tag}(b, kt + mlaw_at_${tag}(tk, col >> 3, ${tokens}));
        mlap_mma_${tag}(acc + 4 * j, a, b[0], b[1]);
        mlap_mma_${tag}(acc + 4 * j + 4, a, b[2], b[3]);
      }
    }
    // </pv>
  }
  // Epilogue: warpgroup 0's per-thread sums -> per head; max and sum -> shared
  if (wg == 0) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float l = l_run[e];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      l_run[e] = l;
    }
    mlaw_bar0_${tag}();  // every warp is past its last read of red (the maxima)
    if (g == 0) {
#pragma unroll
      for (int e = 0; e < 4; ++e) red[w4 * 16 + 8 * (e >> 1) + 2 * t + (e & 1)] = l_run[e];
    }
    mlaw_bar0_${tag}();
    if (w4 == 0 && g == 0) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = 8 * (e >> 1) + 2 * t + (e & 1);
        m_s[h] = m_run[e];
        d_s[h] = red[h] + red[16 + h] + red[32 + h] + red[48 + h];
      }
    }
  }
  __syncthreads();
"""
BODY += SPLIT_STORE


def wgmma_source(tag: str, D: int, DL: int, kscale: float, prims: bool = True) -> str:
    """CUDA of ``mla_split_wg_<tag>`` (module docstring) for rows of ``D`` halves (``DL`` latent
    e4m3 bytes, then 64 rope halves) and ``kscale`` = ``256 kv_scale`` (the other blocks' factor
    for bytes decoded as ``value / 256``). ``prims=False`` leaves out the PTX primitives (the
    pipelined block's and this block's), the PDL wait's definition and the include guard, for a
    CPU emulation."""
    lay = layout(D, DL)
    scale = kscale / 256.0  # cvt gives the e4m3 values themselves
    body = BODY
    if prims:
        body = _PIPE_PRIMS + PRIMS + body
        body = f"\n#ifndef MLA_SPLIT_WG_{tag}\n#define MLA_SPLIT_WG_{tag}{body}#endif\n"
    prefix = grid_wait_source() if prims else ""
    prow = DL // 2 + D - DL  # halves a page row
    return prefix + Template(body).substitute(
        tag=tag,
        wait_release=WAIT_THEN_RELEASE,
        wait=0,
        d=D,
        dl=DL,
        dch=D // 8,
        rows=TOKENS,
        tokens=TOKENS,
        g=G,
        q_off=lay["q"],
        xs_off=lay["xs"],
        p_off=lay["p"],
        red_off=lay["red"],
        r_off=lay["r"],
        qs=2 * prow,
        ks=D // 16,
        ksl=DL // 16,
        ks0=D // 32,
        atom_a=TOKENS * 128,
        kscale=f"{scale!r}f",
        ps=TOKENS + 8,
        cw=DL // 8,
        wcols=DL // 8,
        ntw=DL // 64,
        one=f"{scale!r}f",
        lse_final="{ lse[2 * tx] = v; lse[2 * tx + 1] = v; }",
        rowb=prow * 2,
        lp=DL // 8,
        lk=DL // 32,
        rp=2048 // DL,
    )


def split_block(tag: str, D: int, DL: int, kscale: float) -> tuple[str, int]:
    """(CUDA source, shared halves) of the block for the split kernel of
    :mod:`~.mla_attention_cuda`, under the pipelined block's name ``mla_split_pipe_<tag>``."""
    src = wgmma_source(tag, D, DL, kscale)
    return src.replace(f"mla_split_wg_{tag}(", f"mla_split_pipe_{tag}("), wgmma_shared_halves(D, DL)

"""The FP8 cache's split block on Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a): the CUDA
device function :mod:`~.mla_attention_cuda`'s split kernel calls in place of the pipelined block
(:mod:`~.mla_cuda_helpers`) where its tile says ``block="wgmma"`` (schedules/tiles.py: V2-Lite's
16 heads over an FP8 cache on sm_90). Measured against the pipelined block in
schedules/results/mla_wgmma.md.

Why: the pipelined block is bound by its instructions and their latencies, not by the bytes it
reads (~2,250 warp instructions a 16-token page, ~2.2 us a page a block with either cache
dtype). Most of them are the scores: each of its 8 warps runs ``mma.sync`` over a ninth of the
576 dims, the partial tiles meet in shared memory and 16 lanes a head reduce them; and its FP8
pages are decoded by a shared-memory pass of shifts and masks.

This block takes 64 tokens (4 pages) a step, 512 threads as four warpgroups: two producers
(warpgroups 2 and 3, the even and the odd steps) that load and convert the rows, two consumers
(warpgroups 0 and 1) that compute.

* **The producers.** Thread ``p`` of a producer loads its step's 8-byte latent piece ``p % (L /
  8)`` of rows ``p / (L / 8) + (1024 / L) k`` and the 16-byte rope chunk ``p % 8`` of rows ``p /
  8 + 16 k`` into registers two steps ahead, converts the e4m3 bytes with
  ``cvt.rn.f16x2.e4m3x2`` (the values themselves: the latent scale is ``kv_scale``) and stores
  the step into key tile ``i % 2``. Named barriers hand the tiles over: a producer arrives at
  "tile stored" (``bar.arrive``) and waits at "tile free" before it stores its tile again; the
  consumers wait at the first and arrive at the second. So the loads and conversions of the
  next steps run while the consumers compute this one.
* **Tiles in the wgmma layout.** A key tile is 64 rows x ``D`` halves in 128-byte-swizzled
  atoms of 64 columns (8 KB an atom: rows 128 bytes apart, 8-row groups 1024 bytes apart, the
  16-byte chunk ``c`` of row ``r`` at ``c ^ (r % 8)``), Q (16 heads x ``D``) likewise (2 KB an
  atom), from a 1024-byte-aligned base.
* **Scores S^T = K Q^T as ``wgmma.m64n16k16``** (A = the key tile, M = 64 tokens; B = Q, N =
  16 heads; both K-major from shared memory): consumer 0 takes the first ``D / 32`` k-steps
  (latent dims), consumer 1 the rest (latent, then rope: its latent sum is multiplied by the
  scale before the rope sum adds) and hands its 8 partial values a thread to the same thread of
  consumer 0 through shared memory (a named barrier of the 256 consumer threads).
* **Softmax in the accumulator layout** (consumer 0): thread ``(w, g, t)`` holds tokens ``16 w
  + g``, ``+ 8`` x heads ``2 t``, ``2 t + 1``, ``2 t + 8``, ``2 t + 9``: a head's maximum by
  three shuffles and a 4-warp exchange (a named barrier of 128 threads), the running sums kept
  per thread and reduced once at the end. P goes to shared memory (16 heads x 64 tokens).
* **P V on ``mma.sync``**: every consumer warp owns ``L / 8`` output columns, P by
  ``ldmatrix``, V by ``ldmatrix.trans`` from the same key tile (its swizzled addresses).

The function's signature is the pipelined block's (``mla_split_pipe_<tag>``, under which the
split kernel calls it): a split of pages ``ids[0, npg)``, tokens from ``tok0``, ``n_vis`` visible
keys; ``final_``: out / lse, else the partial state to the workspace. A producer loads its first
step's rows before the PDL wait when all their pages are older than the row's new tokens
(``n_early``); every thread calls the wait. Shared memory: two key tiles, Q, the exchange
buffers (~170 KB at V2-Lite's rows), 126 registers a thread: one block an SM. Against the
block before it (the same consumers' work in 256 threads that also loaded and converted the
rows, now the lab's ``wgmmac``): 48.3 against 54.7 us at batch 1, 128K (split kernel, CUPTI).
"""

from __future__ import annotations

from string import Template

from .cuda_call import WAIT_THEN_RELEASE, grid_wait_source
from .mla_cuda_helpers import _PIPE_PRIMS, SPLIT_STORE

__all__ = [
    "ATOM",
    "G",
    "HEAD",
    "LOOP",
    "PRIMS",
    "PRODUCER",
    "PRODUCERS",
    "TAIL",
    "THREADS",
    "TOKENS",
    "check_shape",
    "layout",
    "shared_halves",
    "split_block",
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

# producer warpgroups, 2 and 3 taking the even and the odd steps: the lab's variant of one
# producer is no slower alone (47.1 against 48.3 us at batch 1, 128K) but makes the model's 4K
# decode step ~40 us slower (schedules/results/mla_wgmma.md, "A producer warpgroup")
PRODUCERS = 2
PRODUCER = 128  # threads of a producer warpgroup
THREADS = 256 + PRODUCERS * PRODUCER  # warpgroups 0, 1: the consumers


def layout(D: int, DL: int) -> dict[str, int]:
    """Byte offsets of the block's shared buffers from its 1024-byte-aligned base (two key
    tiles, Q's tile, the scores exchange, P, the softmax's reductions), and ``bytes`` (the
    block's shared memory, the base's alignment included)."""
    check_shape(D, DL)
    if PRODUCER % (DL // 8) or 16 % (PRODUCER // (DL // 8)):
        raise ValueError(f"the producer's 128 threads take whole rows of {DL} latent bytes")
    atoms = D // ATOM
    tile = atoms * TOKENS * 128
    lay = {"tile": 0, "tile_bytes": tile, "q": 2 * tile}
    off = lay["q"] + atoms * 16 * 128
    lay["xs"] = off
    off += 128 * 8 * 4
    lay["p"] = off
    off += 16 * (TOKENS + 8) * 2
    lay["red"] = off
    off += 4 * 16 * 4
    lay["r"] = off
    off += 3 * 16 * 4
    lay["bytes"] = off + 1024
    return lay


PRIMS += r"""
// named barriers (id 0 is __syncthreads'): bar.sync waits, bar.arrive only arrives
__device__ __forceinline__ void mlaw_sync_${tag}(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void mlaw_arrive_${tag}(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
"""

HEAD = r"""
// byte offset of (row r, 16-byte chunk c) of a swizzled tile of ${rows} rows (atoms of 64 cols)
__device__ __forceinline__ unsigned mlaw_at_${tag}(int r, int c, int rows) {
  return (unsigned)((c >> 3) * rows * 128 + (r >> 3) * 1024 + (r & 7) * 128 +
                    (((c & 7) ^ (r & 7)) << 4));
}
// The producer's share of a step's rows (thread p of 128): 8-byte latent piece p % ${lp} of
// rows p / ${lp} + ${rp} k, and the 16-byte rope chunk p % 8 of rows p / 8 + 16 k (page k)
struct mlaw_raw_${tag} { uint2 l[${lk}]; uint4 r[4]; };
__device__ __forceinline__ void mlaw_load_${tag}(mlaw_raw_${tag}& x,
    const half* __restrict__ pages, const int* __restrict__ ids, int j, int npg, int valid,
    int p) {
  const char* pb = reinterpret_cast<const char*>(pages);
  int pid[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) pid[u] = j + u < npg ? ids[j + u] : 0;
  const int lp = p % ${lp}, r0 = p / ${lp};
#pragma unroll
  for (int k = 0; k < ${lk}; ++k) {
    const int r = r0 + ${rp} * k;  // page ${rp} k / 16
    const char* src = pb + ((size_t)pid[${rp} * k / 16] * 16 + (r & 15)) * ${rowb} + lp * 8;
    x.l[k] = r + j * 16 < valid ? *reinterpret_cast<const uint2*>(src) : make_uint2(0u, 0u);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = (p >> 3) + 16 * k;
    const char* src = pb + ((size_t)pid[k] * 16 + (r & 15)) * ${rowb} + ${dl} + (p & 7) * 16;
    x.r[k] = r + j * 16 < valid ? *reinterpret_cast<const uint4*>(src)
                                : make_uint4(0u, 0u, 0u, 0u);
  }
}
// the share, latent bytes converted, -> the key tile at `tile`
__device__ __forceinline__ void mlaw_store_${tag}(const mlaw_raw_${tag}& x, char* tile, int p) {
  const int lp = p % ${lp}, r0 = p / ${lp};
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
  for (int k = 0; k < 4; ++k)
    *reinterpret_cast<uint4*>(tile + mlaw_at_${tag}((p >> 3) + 16 * k, ${dl} / 8 + (p & 7),
                                                     ${tokens})) = x.r[k];
}
// this warpgroup's score k-steps of the key tile at kt against Q (consumer 0: the first half
// of the latent dims; consumer 1: the rest into sa, the rope dims into sr), issued and committed
__device__ __forceinline__ void mlaw_scores_${tag}(float* sa, float* sr, unsigned kt, unsigned qt,
                                                  int wg) {
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
}
__device__ __forceinline__ void mla_split_wg_${tag}(
    const half* __restrict__ q, const half* __restrict__ pages, const int* __restrict__ ids,
    int npg, int tok0, int n_vis, float scale, int final_, half* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse, int ws_row,
    half* smem, const half* smem_last, int tx, int n_early) {
  (void)smem_last;
  ws_o += (size_t)ws_row * ${dl};
  ws_lse += ws_row;
  const unsigned s0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned base = (s0 + 1023u) & ~1023u;
  char* gbase = reinterpret_cast<char*>(smem) + (base - s0);
  const int nval = min(n_vis - tok0, npg * 16);  // the split's visible rows
  const int ngr = (npg + ${g} - 1) / ${g};
  if (tx >= 256) {
    // producer warpgroup pw takes steps pw, pw + ${producers}, ...: thread p of it
    const int pw = (tx - 256) >> 7, p = (tx - 256) & 127;
    // its first step's rows, before the PDL wait if all their pages are older than the row's
    // new tokens
    const bool early = pw < ngr && n_early >= min(${g} * (pw + 1), npg);
    mlaw_raw_${tag} x;
    if (early) mlaw_load_${tag}(x, pages, ids, pw * ${g}, npg, nval, p);
    ${wait_release}  // (PDL) what follows reads the new tokens
    if (pw < ngr && !early) mlaw_load_${tag}(x, pages, ids, pw * ${g}, npg, nval, p);
    // step i's rows -> tile i % 2 once the consumers are past step i - 2; then the rows of
    // this warpgroup's next step into registers
    for (int i = pw; i < ngr; i += ${producers}) {
      if (i >= 2) mlaw_sync_${tag}(4 + (i & 1), 384);
      // <decode>
      mlaw_store_${tag}(x, gbase + (i & 1) * ${tile_bytes}, p);
      // </decode>
      mlaw_proxy_${tag}();
      mlaw_arrive_${tag}(2 + (i & 1), 384);
      // <copy>
      if (i + ${producers} < ngr)
        mlaw_load_${tag}(x, pages, ids, (i + ${producers}) * ${g}, npg, nval, p);
      // </copy>
    }
    return;
  }
  ${wait_release}  // (PDL) Q is the previous kernel's
  const int w = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int wg = w >> 2, w4 = w & 3;
  const unsigned qt = base + ${q_off};
  float* xs = reinterpret_cast<float*>(gbase + ${xs_off});
  half* p_s = reinterpret_cast<half*>(gbase + ${p_off});
  float* red = reinterpret_cast<float*>(gbase + ${red_off});
  float* r_s = reinterpret_cast<float*>(gbase + ${r_off});
  float* m_s = r_s + 16;
  float* d_s = r_s + 32;
  // Q (16 heads x ${d}) -> its swizzled tile (read after the first step's barrier)
  for (int i = tx; i < 16 * ${dch}; i += 256) {
    const int h = i / ${dch}, c = i - h * ${dch};
    *reinterpret_cast<uint4*>(gbase + ${q_off} + mlaw_at_${tag}(h, c, 16)) =
        *reinterpret_cast<const uint4*>(q + h * ${qs} + c * 8);
  }
  mlaw_proxy_${tag}();
  float acc[${ntw} * 4];
#pragma unroll
  for (int i = 0; i < ${ntw} * 4; ++i) acc[i] = 0.f;
  float m_run[4], l_run[4];  // warpgroup 0: heads 2t, 2t + 1, 2t + 8, 2t + 9
#pragma unroll
  for (int e = 0; e < 4; ++e) { m_run[e] = -INFINITY; l_run[e] = 0.f; }
  const int lr = lane & 7, lm = lane >> 3;
  // P (x4): heads 0-7 / 8-15 (lm % 2) x tokens +0 / +8 (lm / 2) -> a0..a3 of a k-step
  const unsigned p_addr = base + ${p_off} + (((lm & 1) * 8 + lr) * ${ps} + (lm >> 1) * 8) * 2;
"""
LOOP = r"""  for (int i = 0; i < ngr; ++i) {
    const unsigned kt = base + (i & 1) * ${tile_bytes};
    mlaw_sync_${tag}(2 + (i & 1), 384);  // the producer has stored step i's tile
    float sa[8], sr[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { sa[e] = 0.f; sr[e] = 0.f; }
    // <scores>
    mlaw_scores_${tag}(sa, sr, kt, qt, wg);
    mlaw_wait0_${tag}();
    // </scores>
    if (wg == 1) {
#pragma unroll
      for (int e = 0; e < 8; ++e) xs[(w4 * 32 + lane) * 8 + e] = sa[e] * ${kscale} + sr[e];
    }
    mlaw_sync_${tag}(6, 256);
    if (wg == 0) {  // <softmax>
      float sv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int tk = 16 * w4 + g + 8 * ((e & 3) >> 1);
        const float v = sa[e] * ${kscale} + xs[(w4 * 32 + lane) * 8 + e];
        sv[e] = i * ${tokens} + tk < nval ? v * scale : -INFINITY;
      }
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
    mlaw_sync_${tag}(6, 256);
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
    if (i + 2 < ngr) mlaw_arrive_${tag}(4 + (i & 1), 384);  // tile i % 2 is free
  }
"""
TAIL = r"""  // Epilogue (the consumers): warpgroup 0's sums a thread -> a head; max, sum -> shared
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
  mlaw_sync_${tag}(6, 256);
"""
TAIL += SPLIT_STORE


def shared_halves(D: int, DL: int) -> int:
    """Shared memory (halves) of one block."""
    return layout(D, DL)["bytes"] // 2


def wgmma_source(
    tag: str,
    D: int,
    DL: int,
    kscale: float,
    prims: bool = True,
    loop: str = LOOP,
    producers: int = PRODUCERS,
) -> str:
    """CUDA of ``mla_split_wg_<tag>`` (module docstring) for rows of ``D`` halves (``DL`` latent
    e4m3 bytes, then 64 rope halves) and ``kscale`` = ``256 kv_scale`` (the other blocks'
    factor for bytes decoded as ``value / 256``). ``prims=False`` leaves out the PTX primitives
    (the pipelined block's and this block's), the PDL wait's definition and the include guard,
    for a CPU emulation; ``loop``: the consumers' loop, ``producers``: 1 or 2 producer
    warpgroups (the lab's variants)."""
    if producers not in (1, 2):
        raise ValueError(f"1 or 2 producer warpgroups, not {producers}")
    lay = layout(D, DL)
    scale = kscale / 256.0  # cvt gives the e4m3 values themselves
    body = HEAD + loop + TAIL
    if prims:
        body = _PIPE_PRIMS + PRIMS + body
        body = f"\n#ifndef MLA_SPLIT_WG_{tag}\n#define MLA_SPLIT_WG_{tag}{body}#endif\n"
    prefix = grid_wait_source() if prims else ""
    prow = DL // 2 + D - DL  # halves a page row
    rp = PRODUCER // (DL // 8)
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
        tile_bytes=lay["tile_bytes"],
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
        rp=rp,
        lk=TOKENS // rp,
        producers=producers,
    )


def split_block(tag: str, D: int, DL: int, kscale: float) -> tuple[str, int]:
    """(CUDA source, shared halves) of the block for the split kernel of
    :mod:`~.mla_attention_cuda` (:data:`THREADS` threads), under the pipelined block's name
    ``mla_split_pipe_<tag>``."""
    src = wgmma_source(tag, D, DL, kscale)
    return src.replace(f"mla_split_wg_{tag}(", f"mla_split_pipe_{tag}("), shared_halves(D, DL)

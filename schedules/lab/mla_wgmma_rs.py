"""Lab: the register-staged wgmma block (256 threads; shipped for sm_90's FP8 cache before the
warp-specialized block of :mod:`dsv2_mlc.schedules.mla_wgmma_cuda`), the base of the variants of
``mla_wgmma_variants.py``, and variants of the shipped block (:func:`build_ws_variant`). Measured
in schedules/results/mla_wgmma.md; the product never imports this module.

* ``BODY`` / :func:`layout`: every one of the 256 threads loads its share of the next step's
  rows into registers, converts and stores them into the one key tile at the step's start; the
  two warpgroups then compute the scores, softmax and P V as the shipped block's consumers do.
  One block an SM (~190 registers a thread).
* ``LOOP_OVERLAP`` (``overlap``): the shipped block's consumers issue step ``i + 1``'s scores
  before step ``i``'s P V and wait for them after it (the next tile is stored by then). Measured
  with one producer: no faster (51.7 against 51.6 us at batch 1, 128K).
* ``producers=1``: one producer warpgroup for every step (384 threads): as fast alone, but the
  model's 4K decode step ~40 us slower.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from dsv2_mlc.schedules.mla_cuda_helpers import SPLIT_STORE
from dsv2_mlc.schedules.mla_wgmma_cuda import ATOM, LOOP, PRODUCERS, TOKENS, check_shape
from dsv2_mlc.schedules.mla_wgmma_cuda import layout as ws_layout
from dsv2_mlc.schedules.mla_wgmma_cuda import wgmma_source as ws_source

__all__ = ["BODY", "LOOP_OVERLAP", "build_ws_variant", "layout", "ws_variant_source"]


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


def _overlap_loop() -> str:
    """The shipped consumers' loop (``LOOP``) with step ``i + 1``'s scores issued before step
    ``i``'s P V and waited for after it: its softmax and P V sections reused as they are."""
    sm_a = LOOP.index("    if (wg == 1) {\n#pragma unroll\n      for (int e = 0; e < 8; ++e) xs[")
    sm_b = LOOP.index("    const float r0 = r_s[g], r1 = r_s[g + 8];")
    pv_b = LOOP.index("    if (i + 2 < ngr) mlaw_arrive_${tag}(4 + (i & 1), 384);")
    return (
        r"""  // step i's scores are in sa / sr as iteration i starts; step i + 1's are
  // issued before step i's P V and waited for after it
  float sa[8], sr[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) { sa[e] = 0.f; sr[e] = 0.f; }
  if (ngr > 0) {
    mlaw_sync_${tag}(2, 384);  // the producer has stored step 0's tile
    mlaw_scores_${tag}(sa, sr, base, qt, wg);
    mlaw_wait0_${tag}();
  }
  for (int i = 0; i < ngr; ++i) {
    const unsigned kt = base + (i & 1) * ${tile_bytes};
"""
        + LOOP[sm_a:sm_b]
        + r"""    float na[8], nr[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { na[e] = 0.f; nr[e] = 0.f; }
    if (i + 1 < ngr) {
      mlaw_sync_${tag}(2 + ((i + 1) & 1), 384);  // step i + 1's tile is stored
      mlaw_scores_${tag}(na, nr, base + ((i + 1) & 1) * ${tile_bytes}, qt, wg);
    }
"""
        + LOOP[sm_b:pv_b]
        + r"""    if (i + 1 < ngr) mlaw_wait0_${tag}();
    if (i + 2 < ngr) mlaw_arrive_${tag}(4 + (i & 1), 384);  // tile i % 2 is free
#pragma unroll
    for (int e = 0; e < 8; ++e) { sa[e] = na[e]; sr[e] = nr[e]; }
  }
"""
    )


LOOP_OVERLAP = _overlap_loop()


def ws_variant_source(
    tag: str,
    D: int,
    DL: int,
    kscale: float,
    prims: bool = True,
    overlap: bool = True,
    producers: int = PRODUCERS,
) -> str:
    """The shipped block's CUDA (:func:`~dsv2_mlc.schedules.mla_wgmma_cuda.wgmma_source`) with
    its consumers' loop swapped (``overlap``: ``LOOP_OVERLAP``) and
    ``producers`` producer warpgroups."""
    loop = LOOP_OVERLAP if overlap else LOOP
    return ws_source(tag, D, DL, kscale, prims=prims, loop=loop, producers=producers)


def build_ws_variant(
    heads,
    latent,
    rope,
    dtype,
    tiles,
    kv_scale,
    overlap: bool = True,
    parts: str | None = None,
    producers: int = PRODUCERS,
):
    """:func:`~dsv2_mlc.schedules.mla_attention_cuda.build_mla_attention` with the shipped
    block's variant of :func:`ws_variant_source`, ``parts`` cut out (the lab's ``ablate``:
    timing studies); ``tiles.block`` must be the shipped ``"wgmma"``."""
    from mla_wgmma_variants import ablate

    from dsv2_mlc.schedules import mla_attention_cuda as mla

    if tiles.block != "wgmma":
        raise ValueError("build_ws_variant takes the shipped wgmma block's tiles")

    def split_block(tag, D, DL, kscale):
        src = ws_variant_source(tag, D, DL, kscale, overlap=overlap, producers=producers)
        src = ablate(src, parts)
        return src.replace(f"mla_split_wg_{tag}(", f"mla_split_pipe_{tag}("), (
            ws_layout(D, DL)["bytes"] // 2
        )

    with contextlib.ExitStack() as stack:
        for name, value in (
            ("split_block", split_block),
            ("WGMMA_THREADS", 256 + 128 * producers),
        ):
            stack.callback(setattr, mla, name, getattr(mla, name))
            setattr(mla, name, value)
        return mla.build_mla_attention(heads, latent, rope, dtype, replace(tiles), kv_scale)

"""The pair kernel of :mod:`.moe_wgmma_cuda` with the roles swapped (sm_90a): the INT4 weights are
the *register* operand A of ``wgmma`` (dequantised straight into fragments, never stored to shared
memory) and the activations the shared operand B. Nsight had the shared-memory version bound by
the L1/shared pipe (82 %: each K step stored the dequantised weights, 16 KB, and both warpgroups
read them); here a step stores only the activations (cp.async, 16 KB) and reads them twice.

A block: tiles ``2p, 2p + 1`` (128 token rows, B) x 128 weight rows of column block ``cb`` (A):
warpgroup ``wg`` takes weight rows ``64 wg + [0, 64)``, warp ``w`` of it a slab of 16 (gate/up:
8 gate columns and the matching 8 up rows, so that SwiGLU is within a thread; down: 16 output
columns). Per K step of 64 and k16 slice ``j``, a thread's fragment is the ``mma.m16n8k16`` A
layout: rows ``g = lane / 4`` and ``g + 8`` of its slab, k ``16 j + 2 t + {0, 1}`` and ``+ 8``
(``t = lane % 4``): byte ``t`` of packed words ``2 j`` and ``2 j + 1`` of each row. Two
``wgmma.m64n64k16`` per slice, one per tile (accumulators ``d[0:32]`` / ``d[32:64]``). A pair
whose tiles belong to two experts runs one pass per expert, the other tile's MMA reading an 8 KB
zero tile (no branch around ``wgmma``). Outputs are stored by column (2-byte stores).
"""

from __future__ import annotations

_D32 = ", ".join(f"%{i}" for i in range(32))
_D32_OUT = ", ".join(f'"+f"(d[{i}])' for i in range(32))

WGRS_COMMON = (
    r"""
#ifndef DSV2_MOE_WGRS_COMMON
#define DSV2_MOE_WGRS_COMMON
#if DSV2_MOE_WGMMA
// d (64 x 64, f32) += A (64 x 16: this thread's fragment a[4]) * B (64 x 16 at descriptor db)^T
__device__ __forceinline__ void moe_wgmma_rs_n64(float* d, const unsigned* a,
                                                 unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"""
    + _D32
    + r"""}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : """
    + _D32_OUT
    + r"""
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// byte `sh / 8` of w (two nibbles, low first) -> half2 (nibble - 8) * s: 1024 + nibble as fp16
// bits, minus 1032 (exact), times the scale (one rounding, as fp16(float(q - 8) * s))
__device__ __forceinline__ unsigned moe_rs_pair(unsigned w, int sh, half2 s2) {
  const unsigned b = w >> sh;
  unsigned v = (b & 0xFu) | ((b & 0xF0u) << 12) | 0x64006400u;
  const half2 h = __hmul2(__hsub2(*reinterpret_cast<half2*>(&v), __float2half2_rn(1032.0f)), s2);
  return *reinterpret_cast<const unsigned*>(&h);
}
#endif
#endif
"""
)

WGRS_PAIR = r"""
#ifndef DSV2_MOE_WGRS_PAIR_{tag}
#define DSV2_MOE_WGRS_PAIR_{tag}
#if DSV2_MOE_WGMMA
__device__ __forceinline__ void moe_wgrs_pair_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long nt, long long t0, int cb, half* smem, int tid) {{
  constexpr int K = {K}, G = {G}, OUT = {OUT}, HALVES = {HALVES}, GATHERED = {GATHERED};
  constexpr int BK = 64, KT = K / BK, KW = K / 8, KG = K / G, OUT_ALL = OUT * HALVES;
  constexpr int ACH = 4, STAGE = 128 * 64;
  const int e0 = tile_expert[t0];
  const int e1 = t0 + 1 < nt ? tile_expert[t0 + 1] : -1;
  if (e0 < 0) return;  // past the last expert's segment (block-uniform; so is t0 + 1)
  const bool same = e1 == e0;
  const int npass = (same || e1 < 0) ? 1 : 2;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, sh = 8 * (lane & 3);
  const int slab = warp;  // (warpgroup warp / 4) x 4 + warp % 4: weight rows 16 slab + [0, 16)
  smem += ((1024u - (moe_smem_addr(smem) & 1023u)) & 1023u) / 2;
  const half* asrc[ACH];
  unsigned adst[ACH];
  moe_a_rows<ACH, 256, K, GATHERED>(x, rows, t0, e1 >= 0 ? 128 : 64, tid, asrc, adst);
  const unsigned b_base = moe_smem_addr(smem), z_base = moe_smem_addr(smem + 2 * STAGE);
  if (npass > 1) {{
#pragma unroll
    for (int i = 0; i < 2; ++i)
      reinterpret_cast<uint4*>(smem + 2 * STAGE)[tid + 256 * i] = make_uint4(0u, 0u, 0u, 0u);
  }}
  // the thread's two weight rows (of OUT_ALL) and its output column(s)
  const int col = HALVES == 2 ? cb * 64 + slab * 8 + g : cb * 128 + slab * 16 + g;
  const int row_lo = col, row_hi = HALVES == 2 ? OUT + col : col + 8;
  float d[64];
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.f;
  for (int pass = 0; pass < npass; ++pass) {{
    const int e = pass == 0 ? e0 : e1;
    const bool lo_on = same || e1 < 0 || pass == 0, hi_on = same || e1 < 0 || pass == 1;
    const uint4* wlo = reinterpret_cast<const uint4*>(qw + ((long long)e * OUT_ALL + row_lo) * KW);
    const uint4* whi = reinterpret_cast<const uint4*>(qw + ((long long)e * OUT_ALL + row_hi) * KW);
    const half* slo = sc + ((long long)e * OUT_ALL + row_lo) * KG;
    const half* shi = sc + ((long long)e * OUT_ALL + row_hi) * KG;
    if (pass > 0) __syncthreads();  // every warp is done with the first pass's stages
    uint4 rq[4];  // step kt's packed words: row lo (2), row hi (2)
    half rs[4];   // its scales: row lo k [0, 32) and [32, 64), row hi the same
    rq[0] = __ldg(wlo), rq[1] = __ldg(wlo + 1), rq[2] = __ldg(whi), rq[3] = __ldg(whi + 1);
    rs[0] = slo[0], rs[1] = slo[32 / G], rs[2] = shi[0], rs[3] = shi[32 / G];
    moe_a_stage<ACH, BK>(b_base, adst, asrc, 0);
    for (int kt = 0; kt < KT; ++kt) {{
      const int st = kt & 1;
      unsigned af[4][4];  // the fragments of the four k16 slices
      {{
        const unsigned* wl = reinterpret_cast<const unsigned*>(&rq[0]);
        const unsigned* wh = reinterpret_cast<const unsigned*>(&rq[2]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {{
          const half2 s_lo = __half2half2(rs[j >> 1]), s_hi = __half2half2(rs[2 + (j >> 1)]);
          af[j][0] = moe_rs_pair(wl[2 * j], sh, s_lo);
          af[j][1] = moe_rs_pair(wh[2 * j], sh, s_hi);
          af[j][2] = moe_rs_pair(wl[2 * j + 1], sh, s_lo);
          af[j][3] = moe_rs_pair(wh[2 * j + 1], sh, s_hi);
        }}
      }}
      if (kt + 1 < KT) {{  // step kt + 1's words while this step runs
        const int w1 = (kt + 1) * 2, k1 = (kt + 1) * BK;
        rq[0] = __ldg(wlo + w1), rq[1] = __ldg(wlo + w1 + 1);
        rq[2] = __ldg(whi + w1), rq[3] = __ldg(whi + w1 + 1);
        rs[0] = slo[k1 / G], rs[1] = slo[(k1 + 32) / G];
        rs[2] = shi[k1 / G], rs[3] = shi[(k1 + 32) / G];
      }}
      moe_cp_wait_all();
      moe_fence_async_smem();
      __syncthreads();
      if (kt + 1 < KT) moe_a_stage<ACH, BK>(b_base + (st ^ 1) * STAGE * 2, adst, asrc, kt + 1);
      const unsigned b_st = b_base + st * STAGE * 2;
      moe_wg_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) {{
        moe_wgmma_rs_n64(d, af[j], moe_wg_desc((lo_on ? b_st : z_base) + 32 * j));
        moe_wgmma_rs_n64(d + 32, af[j], moe_wg_desc((hi_on ? b_st + 8192 : z_base) + 32 * j));
      }}
      moe_wg_commit();
      moe_wg_wait0();
    }}
  }}
  const int t2 = 2 * (lane & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {{
    if (h == 1 && e1 < 0) break;  // tile t0 + 1 is past the last segment: nothing to write
    half* o = out + (t0 + h) * 64 * OUT;
#pragma unroll
    for (int j = 0; j < 8; ++j) {{
#pragma unroll
      for (int q = 0; q < 2; ++q) {{
        const int tok = 8 * j + t2 + q;
        const float lo = d[32 * h + 4 * j + q], hi = d[32 * h + 4 * j + 2 + q];
        if (HALVES == 2) {{
          o[tok * OUT + col] = __float2half_rn(lo * (1.0f / (1.0f + __expf(-lo))) * hi);
        }} else {{
          o[tok * OUT + col] = __float2half_rn(lo);
          o[tok * OUT + col + 8] = __float2half_rn(hi);
        }}
      }}
    }}
  }}
}}
#endif
#endif
"""

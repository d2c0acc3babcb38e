"""The routed experts' grouped GEMMs on Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a): the
CUDA device functions that :mod:`dsv2_mlc.schedules.moe_mma_cuda`'s kernels call instead of their
``mma.sync`` bodies where the build has sm_90a features (``__CUDA_ARCH_FEAT_SM90_ALL``:
``compiler.cuda.cuda_codegen`` compiles ``sm_90`` targets as ``sm_90a``); other archs keep
``mma.sync``.

Same tiles, stages and loads as the ``mma.sync`` kernels (activations by ``cp.async``, INT4
weights by 16-byte loads, dequantised into a shared stage), but the tensor-core work of a K step
is four ``wgmma.m64n128k16`` per warpgroup reading both operands from shared memory: the stages
are already K-major rows of 64 halves (128 bytes) with their 16-byte chunks XOR-swizzled by
``row & 7``, which is the 128-byte swizzle of a wgmma matrix descriptor when a stage starts on a
1024-byte boundary (8-row groups 1024 bytes apart, the k16 slice ``kk`` at byte ``32 kk``). The
MMAs run asynchronously while the threads dequantise the next step's weights (loaded two steps
ahead) into the other stage; ``fence.proxy.async`` before the barrier makes the threads' shared
stores visible to them. One templated body (``moe_wg_tiles_*<NWG>``) serves both kernels.

Accumulators (``m64nNk16``, f32): warp ``w`` of a warpgroup holds rows ``16 w + g`` and ``16 w +
g + 8`` (``g = lane / 4``), ``d[4 j + {0, 1}]`` / ``d[4 j + {2, 3}]`` columns ``8 j + 2 (lane % 4)
+ {0, 1}``; column ``n`` is weight row ``n`` of the stage (gate/up: gate columns 0-63, the
matching up columns 64-127).
"""

from __future__ import annotations

_ACC = ", ".join(f"%{i}" for i in range(64))
_ACC_OUT = ", ".join(f'"+f"(d[{i}])' for i in range(64))

WGMMA_COMMON = (
    r"""
#ifndef DSV2_MOE_WGMMA_COMMON
#define DSV2_MOE_WGMMA_COMMON
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSV2_MOE_WGMMA 1
#else
#define DSV2_MOE_WGMMA 0
#endif
#if DSV2_MOE_WGMMA
// Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups 1024
// bytes apart (stride byte offset), leading byte offset unused (1), start address / 16.
__device__ __forceinline__ unsigned long long moe_wg_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void moe_wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void moe_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void moe_wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// the thread's generic-proxy shared stores (and completed cp.async) -> visible to wgmma
__device__ __forceinline__ void moe_fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// d (64 x 128, f32) += A (64 x 16 at descriptor da) * B (128 x 16 at db)^T, both K-major
__device__ __forceinline__ void moe_wgmma_n128(float* d, unsigned long long da,
                                               unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"""
    + _ACC
    + r"""}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : """
    + _ACC_OUT
    + r"""
      : "l"(da), "l"(db), "r"(1));
}
// one 64-wide K step: four k16 slices of the stages at a_st (64 rows) and b_st (128 rows)
__device__ __forceinline__ void moe_wg_k64(float* d, unsigned a_st, unsigned b_st) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) moe_wgmma_n128(d, moe_wg_desc(a_st + 32 * kk),
                                                moe_wg_desc(b_st + 32 * kk));
}
// warp w4 (of its warpgroup)'s accumulator rows to out rows row0 + 16 w4 + [0, 16) (OUT columns
// a row, column block cb): gate/up as silu(g) * u in float32 then fp16, down as fp16
template <int HALVES, int OUT>
__device__ __forceinline__ void moe_wg_store(const float* d, half* rows0, int cb, int w4,
                                             int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    half* orow = rows0 + (w4 * 16 + g + 8 * hr) * OUT;
    if (HALVES == 2) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float g0 = d[4 * j + 2 * hr], g1 = d[4 * j + 2 * hr + 1];
        const float u0 = d[4 * (j + 8) + 2 * hr], u1 = d[4 * (j + 8) + 2 * hr + 1];
        const float v0 = g0 * (1.0f / (1.0f + __expf(-g0))) * u0;
        const float v1 = g1 * (1.0f / (1.0f + __expf(-g1))) * u1;
        *reinterpret_cast<half2*>(orow + cb * 64 + j * 8 + 2 * t4) = __floats2half2_rn(v0, v1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<half2*>(orow + cb * 128 + j * 8 + 2 * t4) =
            __floats2half2_rn(d[4 * j + 2 * hr], d[4 * j + 2 * hr + 1]);
    }
  }
}
#endif
#endif
"""
)

# NWG warpgroups over tiles t0 .. t0 + NWG - 1 (warpgroup h the rows of tile t0 + h) x the 128
# weight rows of column block cb: NWG = 1 the one-tile kernel (128 threads), 2 the pair kernel (256
# threads; when the two tiles belong to different experts, one pass each, the other warpgroup
# multiplying a zero tile: no branch around wgmma, which ptxas would serialise). `smem`: two
# stages of activations (64 NWG x 64 halves) and of weights (128 x 64), then (NWG = 2) the 8 KB
# zero tile, from its first 1024-byte boundary (the caller allocates 1 KB more).
WGMMA_TILES = r"""
#ifndef DSV2_MOE_WG_TILES_{tag}
#define DSV2_MOE_WG_TILES_{tag}
#if DSV2_MOE_WGMMA
template <int NWG>
__device__ __forceinline__ void moe_wg_tiles_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long nt, long long t0, int cb, half* smem, int tid) {{
  constexpr int K = {K}, G = {G}, OUT = {OUT}, HALVES = {HALVES}, GATHERED = {GATHERED};
  constexpr int BK = 64, KT = K / BK, KW = K / 8, KG = (K + G - 1) / G;
  constexpr int NTH = 128 * NWG, ACH = 4, BCH = 2 / NWG, ASTAGE = 64 * NWG * 64;
  constexpr int BSTAGE = 128 * 64;
  const int e0 = tile_expert[t0];
  const int e1 = (NWG == 2 && t0 + 1 < nt) ? tile_expert[t0 + 1] : -1;
  if (e0 < 0) return;  // past the last expert's segment (block-uniform; so is t0 + 1)
  const bool same = e1 == e0;
  const int npass = (same || e1 < 0) ? 1 : 2;
  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, kh = tid & 1;
  smem += ((1024u - (moe_smem_addr(smem) & 1023u)) & 1023u) / 2;
  const half* asrc[ACH];
  unsigned adst[ACH];
  moe_a_rows<ACH, NTH, K, GATHERED>(x, rows, t0, e1 >= 0 ? 128 : 64, tid, asrc, adst);
  const unsigned a_base = moe_smem_addr(smem), b_base = moe_smem_addr(smem + 2 * ASTAGE);
  const unsigned z_base = moe_smem_addr(smem + 2 * ASTAGE + 2 * BSTAGE);
  half* b_s = smem + 2 * ASTAGE;
  if (npass > 1) {{
#pragma unroll
    for (int i = 0; i < 512 / NTH; ++i)
      reinterpret_cast<uint4*>(b_s + 2 * BSTAGE)[tid + NTH * i] = make_uint4(0u, 0u, 0u, 0u);
  }}
  float d[64];
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.f;
  for (int pass = 0; pass < npass; ++pass) {{
    const int e = pass == 0 ? e0 : e1;
    const bool active = same || (pass == 0) == (wg == 0);  // warpgroup-uniform
    int br[BCH];
    const uint4* bsrc[BCH];
    const half* ssrc[BCH];
    moe_w_srcs<BCH, NTH, OUT, HALVES, KW, KG>(qw, sc, e, cb, tid, br, bsrc, ssrc);
    if (pass > 0) __syncthreads();  // every warp is done with the first pass's stages
    uint4 wq[BCH];
    half ws[BCH];
    moe_w_load<BCH, BK, G>(wq, ws, bsrc, ssrc, 0, KT, kh);
    moe_a_stage<ACH, BK>(a_base, adst, asrc, 0);
#pragma unroll
    for (int i = 0; i < BCH; ++i) moe_store_w(b_s, br[i], kh, wq[i], ws[i]);
    moe_w_load<BCH, BK, G>(wq, ws, bsrc, ssrc, 1, KT, kh);
    for (int kt = 0; kt < KT; ++kt) {{
      const int st = kt & 1;
      moe_cp_wait_all();
      moe_fence_async_smem();
      __syncthreads();
      if (kt + 1 < KT) moe_a_stage<ACH, BK>(a_base + (st ^ 1) * ASTAGE * 2, adst, asrc, kt + 1);
      moe_wg_fence();
      moe_wg_k64(d, active ? a_base + st * ASTAGE * 2 + wg * 8192 : z_base,
                 b_base + st * BSTAGE * 2);
      moe_wg_commit();
      if (kt + 1 < KT) {{  // step kt + 1's weights while the MMAs run, then load step kt + 2's
#pragma unroll
        for (int i = 0; i < BCH; ++i)
          moe_store_w(b_s + (st ^ 1) * BSTAGE, br[i], kh, wq[i], ws[i]);
        moe_w_load<BCH, BK, G>(wq, ws, bsrc, ssrc, kt + 2, KT, kh);
      }}
      moe_wg_wait0();
    }}
  }}
  if (wg == 1 && e1 < 0) return;  // tile t0 + 1 is past the last segment: nothing to write
  moe_wg_store<HALVES, OUT>(d, out + (t0 + wg) * 64 * OUT, cb, warp & 3, lane);
}}
#endif
#endif
"""

"""Tensor-core grouped GEMMs of the routed experts for CUDA prefill (INT4 experts, fp16
activations): the ``mma.sync`` kernels that :func:`dsv2_mlc.schedules.moe_grouped_cuda.
grouped_gemm_cuda` uses wherever :func:`mma_supported` (the tiling, the align and the combine are
in that module's docstring).

Two block shapes over the tiles of ``TM = 64`` expert-sorted rows (``moe_align``), one
PrimFunc (the host picks by the tile count ``nt``):

* from ``GroupedMmaTiles.pair_from`` tiles on (about 2K tokens at top-6 of 64), a block per
  (pair of tiles ``2p, 2p + 1``, 128 weight rows), 4 x 2 warps of 32 x 64: every weight tile a block
  dequantises feeds 128 rows instead of 64. When the two tiles belong to different experts (a
  segment boundary, or the second tile is past the last segment) the block runs two passes, one
  expert each, with the other tile's warps idle. 64 KB of stages in ``shared.dyn``,
  ``__launch_bounds__(256, 2)`` (128 registers: two blocks an SM);
* below, a block per (tile, 128 weight rows), ``2 x warps_n`` warps, 48 KB of static shared
  memory: with few rows per expert most pairs would run two passes.

Both run one templated body (``_MMA_TILES``) on the CUDA helpers of ``_MMA_COMMON`` (the swizzled
weight store, one 64-wide K step of ldmatrix + ``mma.sync.m16n8k16``, the SwiGLU / plain epilogue);
measured in schedules/results/moe_grouped.md. Where the build has sm_90a features (an ``sm_90``
target: ``compiler.cuda.cuda_codegen``) the pair kernel and the one-tile kernel of 2 x 2 warps run
the ``wgmma`` bodies of :mod:`.moe_wgmma_cuda` instead (same tiles and stages, the MMAs asynchronous
while the next stage is dequantised; the pair kernel's ``shared.dyn`` holds 8 KB more for their zero
tile and 1 KB of alignment). The block shapes (``warps_n``, from how many tiles the pairs) are the
``"moe_grouped_mma"`` entry of ``schedules/tiles.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.script import tirx as T

from . import moe_wgmma_cuda as wgmma
from .tiles import GroupedMmaTiles, tuned

OPAQUE = 8  # relax OpPatternKind.kOpaque: FuseOps never fuses these kernels with neighbours

__all__ = ["grouped_gemm_mma", "grouped_mma_kernel", "int4_group", "kernel_attrs", "mma_supported"]


def kernel_attrs(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Scheduled, opaque to fusion, private (the caller names it: ``tensor_ir_op``, a lab)."""
    if func.attrs is not None and "global_symbol" in func.attrs:
        func = func.without_attr("global_symbol")
    return func.with_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})


# -- 2b. grouped GEMM on tensor cores (INT4 experts, fp16 activations) --------------------------
_PAIR_THREADS = 256
# 2 stages x (activations + weights), 128 x 64 halves each; for wgmma + a 64 x 64 zero tile and
# 1 KB to align them
_PAIR_SMEM_HALVES = 2 * 2 * 128 * 64 + 64 * 64 + 512
MMA_BN = 128  # weight rows per block (gate/up: 64 gate + the 64 matching up rows)
MMA_BK = 64  # reduction step (one shared stage: 8 KB activations + 16 KB weights, fp16)

_MMA_COMMON = r"""
#ifndef DSV2_MOE_MMA_COMMON
#define DSV2_MOE_MMA_COMMON
__device__ __forceinline__ unsigned moe_smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void moe_cp_async16(unsigned dst, const void* src) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
#else
  dsv2_emu_cp_async(dst, src, 16);
#endif
}
__device__ __forceinline__ void moe_cp_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#else
  dsv2_emu_cp_commit();
#endif
}
__device__ __forceinline__ void moe_cp_wait_all() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#else
  dsv2_emu_cp_wait(0);
#endif
}
// The thread's ACH 16-byte activation pieces of K step kt (columns kt * BK + ...) into the stage
// at shared address `stage` (cp.async, one commit group).
template <int ACH, int BK>
__device__ __forceinline__ void moe_a_stage(unsigned stage, const unsigned* adst,
                                            const half* const* asrc, int kt) {
#pragma unroll
  for (int i = 0; i < ACH; ++i) moe_cp_async16(stage + adst[i], asrc[i] + kt * BK);
  moe_cp_commit();
}
__device__ __forceinline__ void moe_ldsm_x4(unsigned* r, unsigned addr) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  dsv2_emu_ldmatrix_x4(r, addr, false);
#endif
}
__device__ __forceinline__ void moe_mma16816(float* c, const unsigned* a, unsigned b0,
                                             unsigned b1) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const unsigned b[2] = {b0, b1};
  dsv2_emu_mma16816(c, a, b);
#endif
}
// One packed word (8 nibbles, low first, value nibble - 8) times an fp16 scale -> 8 halves
// (16 bytes, k order): 1024 + nibble as an fp16 bit pattern, minus 1032 (exact), times the scale
// (one rounding, as fp16(float(q - 8) * s)).
__device__ __forceinline__ uint4 moe_dequant8(unsigned w, half2 s) {
  const unsigned ev = w & 0x0F0F0F0Fu, od = (w >> 4) & 0x0F0F0F0Fu;
  const half2 bias = __float2half2_rn(1032.0f);
  uint4 r;
  unsigned* rr = reinterpret_cast<unsigned*>(&r);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    unsigned v = __byte_perm(ev, od, j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12));
    v = (v & 0x000F000Fu) | 0x64006400u;
    half2 h = __hmul2(__hsub2(*reinterpret_cast<half2*>(&v), bias), s);
    rr[j] = *reinterpret_cast<unsigned*>(&h);
  }
  return r;
}
// The dequantised 32 k of one packed 16-byte load (scale ws) into row br, k half kh, of a
// weight stage (64 halves a row, 16-byte chunks XOR-swizzled by the row).
__device__ __forceinline__ void moe_store_w(half* stage, int br, int kh, uint4 wq, half ws) {
  const half2 s2 = __half2half2(ws);
  const unsigned* wv = reinterpret_cast<const unsigned*>(&wq);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = kh * 4 + j;
    *reinterpret_cast<uint4*>(stage + br * 64 + ((c ^ (br & 7)) << 3)) = moe_dequant8(wv[j], s2);
  }
}
// The block's activation loads: rows r = tid / 8 + (NTH / 8) i (i < ACH) of its tiles from t0,
// 16-byte chunk tid % 8: the source (x row t0 * 64 + r, through `rows` when gathered; rows from
// `valid` on read row t0 * 64: a tile that holds no segment) and the swizzled stage offset (bytes).
template <int ACH, int NTH, int K, int GATHERED>
__device__ __forceinline__ void moe_a_rows(const half* x, const int* rows, long long t0, int valid,
                                           int tid, const half** asrc, unsigned* adst) {
  const int ar = tid >> 3, ac = tid & 7;
#pragma unroll
  for (int i = 0; i < ACH; ++i) {
    const int r = ar + (NTH / 8) * i;
    const long long idx = r < valid ? t0 * 64 + r : t0 * 64;
    const long long src_row = GATHERED ? (long long)rows[idx] : idx;
    asrc[i] = x + src_row * K + ac * 8;
    adst[i] = (r * 64 + ((ac ^ (r & 7)) << 3)) * 2;
  }
}
// The row of expert e's packed weights behind stage row br of column block cb (gate/up: gate
// columns [cb * 64, +64), then the matching up rows; down: [cb * 128, +128)).
template <int OUT, int HALVES>
__device__ __forceinline__ long long moe_w_row(int e, int br, int cb) {
  const int grow = HALVES == 2 ? (br >> 6) * OUT + cb * 64 + (br & 63) : cb * 128 + br;
  return (long long)e * OUT * HALVES + grow;
}
// The thread's BCH weight rows br[i] = tid / 2 + (NTH / 2) i of the stage, k half tid % 2: where
// their packed 16-byte pieces and their scales start for expert e (column block cb).
template <int BCH, int NTH, int OUT, int HALVES, int KW, int KG>
__device__ __forceinline__ void moe_w_srcs(const unsigned* qw, const half* sc, int e, int cb,
                                           int tid, int* br, const uint4** bsrc,
                                           const half** ssrc) {
#pragma unroll
  for (int i = 0; i < BCH; ++i) {
    br[i] = (tid >> 1) + (NTH / 2) * i;
    const long long wrow = moe_w_row<OUT, HALVES>(e, br[i], cb);
    bsrc[i] = reinterpret_cast<const uint4*>(qw + wrow * KW) + (tid & 1);
    ssrc[i] = sc + wrow * KG;
  }
}
// The packed words (16 bytes) and scale of K step kt (if kt < KT) of each of the thread's BCH
// weight rows, k half kh.
template <int BCH, int BK, int G>
__device__ __forceinline__ void moe_w_load(uint4* wq, half* ws, const uint4* const* bsrc,
                                           const half* const* ssrc, int kt, int KT, int kh) {
  if (kt >= KT) return;
#pragma unroll
  for (int i = 0; i < BCH; ++i) {
    wq[i] = __ldg(bsrc[i] + kt * 2);
    ws[i] = ssrc[i][(kt * BK + kh * 32) / G];
  }
}
// One 64-wide K step of warp (wm, wn)'s 32 x (128 / WN) tile: A rows wm * 32 + [0, 32) of the
// activation stage at a_st, B rows of the weight stage at b_st (gate/up: the warp's gate n8-tiles
// and the matching up ones, 64 rows apart), ldmatrix.x4 fragments, m16n8k16 MMAs.
template <int WN, int HALVES>
__device__ __forceinline__ void moe_mma_k64(float (*acc)[16 / WN][4], unsigned a_st,
                                            unsigned b_st, int wm, int wn, int lane) {
  constexpr int NJ = 16 / WN;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    unsigned af[2][4], bf[NJ][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = wm * 32 + mi * 16 + (lane & 15);
      const int c = kk * 2 + (lane >> 4);
      moe_ldsm_x4(af[mi], a_st + (r * 64 + ((c ^ (r & 7)) << 3)) * 2);
    }
#pragma unroll
    for (int p = 0; p < NJ / 2; ++p) {
      const int r0 = HALVES == 2 ? (p / (NJ / 4)) * 64 + wn * (64 / WN) + (p % (NJ / 4)) * 16
                                 : wn * (128 / WN) + p * 16;
      const int r = r0 + ((lane >> 4) << 3) + (lane & 7);
      const int c = kk * 2 + ((lane >> 3) & 1);
      unsigned t4[4];
      moe_ldsm_x4(t4, b_st + (r * 64 + ((c ^ (r & 7)) << 3)) * 2);
      bf[2 * p][0] = t4[0];
      bf[2 * p][1] = t4[1];
      bf[2 * p + 1][0] = t4[2];
      bf[2 * p + 1][1] = t4[3];
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj) moe_mma16816(acc[mi][nj], af[mi], bf[nj][0], bf[nj][1]);
  }
}
// Warp (wm, wn)'s C fragments to out rows wm * 32 + [0, 32) from `rows0` (OUT columns a row,
// column block cb): gate/up as silu(g) * u in float32 then fp16, down as fp16.
template <int WN, int HALVES, int OUT>
__device__ __forceinline__ void moe_mma_store(float (*acc)[16 / WN][4], half* rows0, int cb,
                                              int wm, int wn, int lane) {
  constexpr int NJ = 16 / WN;
  const int g = lane >> 2, t4 = lane & 3;  // C layout: rows g, g + 8; columns 2 * t4 + {0, 1}
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      half* orow = rows0 + (wm * 32 + mi * 16 + g + 8 * hr) * OUT;
      if (HALVES == 2) {
#pragma unroll
        for (int jj = 0; jj < NJ / 2; ++jj) {
          const float g0 = acc[mi][jj][2 * hr], g1 = acc[mi][jj][2 * hr + 1];
          const float u0 = acc[mi][jj + NJ / 2][2 * hr], u1 = acc[mi][jj + NJ / 2][2 * hr + 1];
          const float v0 = g0 * (1.0f / (1.0f + __expf(-g0))) * u0;
          const float v1 = g1 * (1.0f / (1.0f + __expf(-g1))) * u1;
          *reinterpret_cast<half2*>(orow + cb * 64 + wn * (64 / WN) + jj * 8 + 2 * t4) =
              __floats2half2_rn(v0, v1);
        }
      } else {
#pragma unroll
        for (int nj = 0; nj < NJ; ++nj)
          *reinterpret_cast<half2*>(orow + cb * 128 + wn * (128 / WN) + nj * 8 + 2 * t4) =
              __floats2half2_rn(acc[mi][nj][2 * hr], acc[mi][nj][2 * hr + 1]);
      }
    }
  }
}
#endif
"""

# The mma.sync body of both kernels (where the build has no sm_90a features): WM x WN warps, WM = 2
# the one-tile kernel (tile t0, 2 x warps_n warps), WM = 4 the pair kernel (tiles t0, t0 + 1, 4 x 2
# warps); warp (wm, wn) a 32 x (128 / WN) tile: NJ = 16 / WN n8-tiles (gate/up: the first NJ / 2
# gate, the rest the matching up columns). K in steps of 64 through two stages of `smem`
# (activations 32 WM x 64 halves, weights 128 x 64): activations by cp.async (gathered rows),
# weights by 16-byte global loads one step ahead, dequantised into the other stage after this
# step's MMAs; XOR-swizzled 128-byte rows. A pair whose tiles belong to different experts runs one
# pass per tile (its expert's weights), the other tile's warps skipping the MMAs; a tile past the
# last segment (or past nt) is skipped.
_MMA_TILES = r"""
#ifndef DSV2_MOE_MMA_TILES_{tag}
#define DSV2_MOE_MMA_TILES_{tag}
template <int WM, int WN>
__device__ __forceinline__ void moe_mma_tiles_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long nt, long long t0, int cb, half* smem, int tid) {{
  constexpr int K = {K}, G = {G}, OUT = {OUT}, HALVES = {HALVES}, GATHERED = {GATHERED};
  constexpr int BK = 64, KT = K / BK, KW = K / 8, KG = (K + G - 1) / G;
  constexpr int NTH = 32 * WM * WN, NJ = 16 / WN, ACH = 256 * WM / NTH, BCH = 256 / NTH;
  constexpr int ASTAGE = 32 * WM * 64, BSTAGE = 128 * 64;
  const int e0 = tile_expert[t0];
  const int e1 = (WM == 4 && t0 + 1 < nt) ? tile_expert[t0 + 1] : -1;
  if (e0 < 0) return;  // past the last expert's segment (block-uniform; so is t0 + 1)
  const bool same = e1 == e0;
  const int npass = (same || e1 < 0) ? 1 : 2;
  const int lane = tid & 31, warp = tid >> 5, wm = warp / WN, wn = warp % WN, kh = tid & 1;
  const half* asrc[ACH];
  unsigned adst[ACH];
  moe_a_rows<ACH, NTH, K, GATHERED>(x, rows, t0, e1 >= 0 ? 128 : 64, tid, asrc, adst);
  const unsigned a_base = moe_smem_addr(smem), b_base = moe_smem_addr(smem + 2 * ASTAGE);
  half* b_s = smem + 2 * ASTAGE;
  float acc[2][NJ][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
  for (int pass = 0; pass < npass; ++pass) {{
    const int e = pass == 0 ? e0 : e1;
    const bool active = same || (pass == 0) == (wm < 2);  // warp-uniform
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
    for (int kt = 0; kt < KT; ++kt) {{
      const int st = kt & 1;
      moe_cp_wait_all();
      __syncthreads();
      if (kt + 1 < KT) moe_a_stage<ACH, BK>(a_base + (st ^ 1) * ASTAGE * 2, adst, asrc, kt + 1);
      moe_w_load<BCH, BK, G>(wq, ws, bsrc, ssrc, kt + 1, KT, kh);
      if (active) {{
        moe_mma_k64<WN, HALVES>(acc, a_base + st * ASTAGE * 2, b_base + st * BSTAGE * 2, wm, wn,
                                lane);
      }}
      if (kt + 1 < KT) {{
#pragma unroll
        for (int i = 0; i < BCH; ++i)
          moe_store_w(b_s + (st ^ 1) * BSTAGE, br[i], kh, wq[i], ws[i]);
      }}
    }}
  }}
  if (wm >= 2 && e1 < 0) return;  // tile t0 + 1 is past the last segment: nothing to write
  moe_mma_store<WN, HALVES, OUT>(acc, out + t0 * 64 * OUT, cb, wm, wn, lane);
}}
#endif
"""

# Block (tile, cb) of the one-tile kernel: 2 x WN warps, 48 KB of static shared memory.
_MMA_GEMM = r"""
#ifndef DSV2_MOE_MMA_GEMM_{tag}
#define DSV2_MOE_MMA_GEMM_{tag}
__device__ __forceinline__ void moe_mma_gemm_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long tile, int cb, int tid) {{
  __shared__ __align__(1024) half s[2 * 64 * 64 + 2 * 128 * 64];
#if DSV2_MOE_WGMMA && {WN} == 2
  moe_wg_tiles_{body}<1>(x, rows, tile_expert, qw, sc, out, 0, tile, cb, s, tid);
#else
  moe_mma_tiles_{body}<2, {WN}>(x, rows, tile_expert, qw, sc, out, 0, tile, cb, s, tid);
#endif
}}
#endif
"""

# Block (pair p, cb) of the pair kernel: tiles 2p, 2p + 1, 256 threads, `smem` in shared.dyn.
_MMA_PAIR = r"""
#ifndef DSV2_MOE_MMA_PAIR_{tag}
#define DSV2_MOE_MMA_PAIR_{tag}
__device__ __forceinline__ void moe_mma_pair_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long nt, long long pair, int cb, half* smem, const half* smem_last, int tid) {{
  (void)smem_last;  // only keeps the extent of the shared.dyn buffer in the TIR caller
#if DSV2_MOE_WGMMA
  {wg_pair}(x, rows, tile_expert, qw, sc, out, nt, 2 * pair, cb, smem, tid);
#else
  moe_mma_tiles_{body}<4, 2>(x, rows, tile_expert, qw, sc, out, nt, 2 * pair, cb, smem, tid);
#endif
}}
#endif
"""


def int4_group(weights: Sequence[te.Tensor], red: int) -> int | None:
    """The INT4 group size of ``weights`` (packed ``uint32 [E, out, red / 8]`` + ``float16``
    scales ``[E, out, ceil(red / group)]``, the layout that
    :func:`dsv2_mlc.quant.modules.dequantize_expr` reads), or None for any other format.

    The group is read from the shapes: ``red / groups`` where that divides, else (a last,
    shorter group: V2-Lite's dense ``down_proj``, 10,944 = 85.5 groups of 128) the multiple of
    32 whose ceiling division gives the scale count. Shapes cannot tell a shorter last group
    whose count divides the reduction (192 in groups of 128 reads as 2 groups of 96): a caller
    that knows its group compares it with this one."""
    if len(weights) != 2:
        return None
    qw, sc = weights
    if qw.dtype != "uint32" or sc.dtype != "float16" or len(qw.shape) != 3 or len(sc.shape) != 3:
        return None
    groups = int(sc.shape[-1])
    if int(qw.shape[-1]) * 8 != red or groups < 1:
        return None
    if red % groups == 0:
        return red // groups
    least = -(-red // groups)  # a group at least this long covers the reduction
    group = -(-least // 32) * 32
    return group if -(-red // group) == groups else None


def mma_supported(
    x: te.Tensor, rows: te.Tensor, weights: Sequence[te.Tensor], out_dim: int, halves: int
) -> bool:
    """Whether :func:`grouped_gemm_mma` takes these shapes: fp16 activations, INT4 experts with a
    group that is a multiple of 32, ``TM = 64`` rows per tile, a reduction that is a multiple of
    64, ``out_dim`` a multiple of 64 (gate/up) or 128 (down)."""
    red = int(x.shape[-1])
    group = int4_group(weights, red)
    return (
        x.dtype == "float16"
        and int(rows.shape[1]) == 64
        and group is not None
        and group % 32 == 0
        and red % MMA_BK == 0
        and halves in (1, 2)
        and out_dim % (MMA_BN // halves) == 0
        and int(weights[0].shape[1]) == out_dim * halves
    )


def grouped_gemm_mma(
    x: te.Tensor,
    rows: te.Tensor,
    tile_expert: te.Tensor,
    weights: Sequence[te.Tensor],
    out_dim: int,
    halves: int,
    gathered: bool,
    name: str,
) -> tirx.PrimFunc:
    """The grouped GEMM of :func:`grouped_gemm_te` (INT4 weights) on tensor cores:
    ``f(x, rows, tile_expert, qweight, scales, out)``, ``mma.sync.m16n8k16`` fp16 x fp16 -> fp32
    (module docstring), with the block shapes of ``schedules/tiles.py``. Tiles with
    ``tile_expert < 0`` are skipped (their output rows are left unwritten: nothing reads them).
    Only for :func:`mma_supported` shapes."""
    tiles = tuned("moe_grouped_mma")
    return grouped_mma_kernel(x, rows, tile_expert, weights, out_dim, halves, gathered, name, tiles)


def grouped_mma_kernel(
    x: te.Tensor,
    rows: te.Tensor,
    tile_expert: te.Tensor,
    weights: Sequence[te.Tensor],
    out_dim: int,
    halves: int,
    gathered: bool,
    name: str,
    tiles: GroupedMmaTiles,
) -> tirx.PrimFunc:
    """:func:`grouped_gemm_mma` with the given ``tiles``: ``pair_from`` 0 a block of 4 x 2 warps
    per (pair of tiles, 128 weight rows), None a block of ``2 x warps_n`` warps (2 or 4) per
    (tile, 128 weight rows), a number the first from that many tiles on and the second below
    (one PrimFunc, the host picks the kernel by the tile count)."""
    if not mma_supported(x, rows, weights, out_dim, halves):
        raise ValueError(f"grouped_gemm_mma does not take {name}: {x.shape} -> {out_dim}x{halves}")
    if tiles.warps_n not in (2, 4):
        raise ValueError(f"warps_n must be 2 or 4, got {tiles.warps_n}")
    red = int(x.shape[-1])
    group = int4_group(weights, red)
    num_experts = int(weights[0].shape[0])
    return _gemm_prim_func(
        red, group, num_experts, out_dim, halves, gathered, tiles.warps_n, tiles.pair_from
    )


def _gemm_prim_func(
    red: int,
    group: int,
    num_experts: int,
    out_dim: int,
    halves: int,
    gathered: bool,
    warps_n: int,
    pair_from: int | None,
) -> tirx.PrimFunc:
    """The PrimFunc: pairs of tiles (``pair_from == 0``), one tile a block (``None``), or both
    kernels with the host picking pairs when ``nt >= pair_from``. Pairs: grid ``(ceil(nt / 2),
    out_all / 128)``, 256 threads, 64 KB of ``shared.dyn`` (its last element is passed too, or
    TVM compacts the buffer to the one element it sees), ``__launch_bounds__(256, 2)``; one
    tile: grid ``(nt, out_all / 128)``, ``64 * warps_n`` threads, 48 KB static shared memory."""
    out_all = out_dim * halves
    col_blocks = out_all // MMA_BN
    one = f"{halves}_{out_dim}_{red}_{group}_{int(gathered)}_{warps_n}"
    two = f"{halves}_{out_dim}_{red}_{group}_{int(gathered)}"
    fmt = dict(K=red, G=group, OUT=out_dim, HALVES=halves, GATHERED=int(gathered))
    # one source per device function (TVM keys a func_call's source by the function's name and
    # rejects two different texts for one name)
    common = (
        _MMA_COMMON + _MMA_TILES.format(tag=two, **fmt) + wgmma.WGMMA_COMMON
        + wgmma.WGMMA_TILES.format(tag=two, **fmt)
    )  # fmt: skip
    src_one = common + _MMA_GEMM.format(tag=one, body=two, WN=warps_n)
    src_two = common + _MMA_PAIR.format(tag=two, body=two, wg_pair=f"moe_wg_tiles_{two}<2>")
    f_one, f_two = f"moe_mma_gemm_{one}", f"moe_mma_pair_{two}"
    K, G, E, TMR, SM = red, group, num_experts, 64, _PAIR_SMEM_HALVES
    NT1, NT2, GATHERED = 64 * warps_n, _PAIR_THREADS, gathered
    MODE, MIN = (0, 0) if pair_from == 0 else (1, 0) if pair_from is None else (2, pair_from)
    # Block order: the down projection's activations (the SwiGLU rows, 69 MB at 4K tokens) do not
    # stay in L2, so its column blocks go first (blockIdx.x): the blocks of one tile run together
    # and read its rows from DRAM once, not once per column block (-15 % at 4K tokens); gate/up
    # gathers x (16 MB at 4K, L2-resident) and keeps the tiles first
    # (schedules/results/moe_grouped.md).
    COLS_FIRST = not gathered

    @T.macro
    def pairs(xb, rb, teb, qb, sb, ob, nt):  # noqa: ANN001
        g0 = T.meta_var(col_blocks if COLS_FIRST else (nt + 1) // 2)
        g1 = T.meta_var((nt + 1) // 2 if COLS_FIRST else col_blocks)
        for b0 in T.thread_binding(g0, thread="blockIdx.x"):
            for b1 in T.thread_binding(g1, thread="blockIdx.y"):
                for tx in T.thread_binding(NT2, thread="threadIdx.x"):
                    with T.sblock("moe_mma_pair"):
                        T.reads()
                        T.writes()
                        smem = T.sblock_alloc_buffer((SM,), "float16", scope="shared.dyn")
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 2)
                        pair = T.meta_var(b1 if COLS_FIRST else b0)
                        cb = T.meta_var(b0 if COLS_FIRST else b1)
                        T.cuda.func_call(
                            f_two, xb.data, rb.data, teb.data, qb.data, sb.data, ob.data, nt,
                            pair, cb, T.address_of(smem[0]), T.address_of(smem[SM - 1]), tx,
                            source_code=src_two,
                        )  # fmt: skip

    @T.macro
    def tiles(xb, rb, teb, qb, sb, ob, nt):  # noqa: ANN001
        g0 = T.meta_var(col_blocks if COLS_FIRST else nt)
        g1 = T.meta_var(nt if COLS_FIRST else col_blocks)
        for b0 in T.thread_binding(g0, thread="blockIdx.x"):
            for b1 in T.thread_binding(g1, thread="blockIdx.y"):
                for tx in T.thread_binding(NT1, thread="threadIdx.x"):
                    with T.sblock("moe_mma_gemm"):
                        T.reads()
                        T.writes()
                        tile = T.meta_var(b1 if COLS_FIRST else b0)
                        cb = T.meta_var(b0 if COLS_FIRST else b1)
                        T.cuda.func_call(
                            f_one, xb.data, rb.data, teb.data, qb.data, sb.data, ob.data,
                            tile, cb, tx, source_code=src_one,
                        )  # fmt: skip

    @T.prim_func(private=True, s_tir=True)
    def moe_mma(
        var_x: T.handle, var_rows: T.handle, var_te: T.handle, var_qw: T.handle,
        var_sc: T.handle, var_out: T.handle,
    ):  # fmt: skip
        n = T.int64()
        nt = T.int64()
        if GATHERED:
            xb = T.match_buffer(var_x, (n, K), "float16")
        else:
            xb = T.match_buffer(var_x, (nt, TMR, K), "float16")
        rb = T.match_buffer(var_rows, (nt, TMR), "int32")
        teb = T.match_buffer(var_te, (nt,), "int32")
        qb = T.match_buffer(var_qw, (E, out_all, K // 8), "uint32")
        sb = T.match_buffer(var_sc, (E, out_all, -(-K // G)), "float16")
        ob = T.match_buffer(var_out, (nt, TMR, out_dim), "float16")
        if MODE == 0:
            pairs(xb, rb, teb, qb, sb, ob, nt)
        elif MODE == 1:
            tiles(xb, rb, teb, qb, sb, ob, nt)
        elif nt >= MIN:
            pairs(xb, rb, teb, qb, sb, ob, nt)
        else:
            tiles(xb, rb, teb, qb, sb, ob, nt)

    return kernel_attrs(moe_mma)

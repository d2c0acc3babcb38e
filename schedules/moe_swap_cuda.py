"""Expert-sorted grouped GEMMs of decode batches on Hopper's ``wgmma``: weights as M, tokens as N.

In a decode step of ``n`` sequences each of ``E`` experts gets about ``n * top_k / E`` of the
(token, slot) pairs (24 at 256 sequences of V2-Lite): too few rows for the grouped GEMMs of
:mod:`.moe_mma_cuda`, whose tiles are 64 token rows (``wgmma`` M is at least 64), so most of their
tensor-core work multiplies padding and the step is bound by it (280 us a layer for gate/up at
256 sequences, schedules/results/decode_batches.md). Here the operands swap (``D^T = W X^T``):
the dequantised weights are ``wgmma``'s A (M = 64 weight rows), the tile's tokens its B (N =
``SwapTiles.tokens``: 16, 32 or 64), so a tile pads an expert's pairs to 16-64, not 64, and every
expert the step selects is read once per tile of its pairs (one tile for most experts).

The bookkeeping is the grouped path's (:mod:`.moe_grouped_cuda`): ``moe_align`` with ``TM`` =
the token tile sorts the pairs by expert, this kernel runs for gate/up (SwiGLU epilogue, ``x``
gathered by ``rows``) and for down (the padded rows in order), then ``combine``. A block is one
warpgroup (128 threads) for (tile ``t``, column block ``cb``): 128 weight rows (gate/up: gate rows
``[64 cb, +64)`` and the matching up rows; down: rows ``[128 cb, +128)``) x the tile's tokens.
``blockIdx.x`` is the tile, so an expert's tiles run together and share its weights in L2.

The K loop, in steps of 64: a ring of ``stages`` shared slots, each the step's packed weights
(128 rows x 32 bytes) and the tile's activations (``N`` rows x 64 halves, 128-byte rows with their
16-byte chunks XOR-swizzled by ``row & 7``: the 128-byte swizzle of a ``wgmma`` descriptor), both
by ``cp.async`` ``stages - 2`` steps ahead; the scales of the block's rows are loaded once. At step
``k`` the threads dequantise slot ``k``'s weights (a row a thread, ``1024 + nibble`` as an fp16
bit pattern, minus 1032, times the fp16 scale: :func:`moe_dequant8`) into one of two fp16 weight
stages (128 x 64, same swizzle), then issue eight ``wgmma.m64nNk16`` (two 64-row halves x four
k16 slices; both operands from shared memory) and wait for the previous step's, so that step
``k``'s MMAs run while step ``k + 1`` is dequantised. Two barriers a step. The epilogue goes
through shared memory: the accumulators (``silu(gate) * up`` for gate/up) as fp16, transposed to
token rows, written 16 bytes at a time.

Only for builds with sm_90a features (``wgmma``; ``compiler.cuda.cuda_codegen`` builds ``sm_90``
targets so): :func:`swap_supported` says where. Other archs get a kernel that traps, which the
model never selects. On the CPU the ``wgmma`` and ``cp.async`` stand-ins of
``tests/cuda_emulation.py`` run it (an MMA reads its operands at the ``wait_group`` that completes
it, so a stage reused too early shows). Measured in schedules/results/moe_swap.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.script import tirx as T
from tvm.target import Target

from . import moe_wgmma_cuda as wgmma
from .moe_mma_cuda import _MMA_COMMON, int4_group, kernel_attrs
from .tiles import SwapTiles, tuned

__all__ = ["SWAP_TOKENS", "grouped_gemm_swap", "swap_kernel", "swap_supported", "swap_tiles"]

SWAP_TOKENS = (16, 32, 64)  # the token tiles (wgmma N) the kernel is instantiated for
SWAP_THREADS = 128  # one warpgroup a block
_BK = 64  # a K step


def swap_tiles() -> SwapTiles:
    """The tile table's ``moe_swap`` entry (``schedules/tiles.py``)."""
    return tuned("moe_swap")


def _sm90a() -> bool:
    target = Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda":
        return False
    arch = str(target.attrs.get("arch", ""))
    return arch in ("sm_90", "sm_90a")


def swap_supported(
    x: te.Tensor, weights: Sequence[te.Tensor], out_dim: int, halves: int, target: bool = True
) -> bool:
    """Whether :func:`grouped_gemm_swap` takes these shapes: fp16 activations, INT4 experts with a
    group that is a multiple of 32 (a packed word's 8 inputs share a scale), a reduction that is a
    multiple of 64, ``out_dim`` a multiple of 64 (gate/up) or 128 (down); with ``target``, also an
    ``sm_90`` CUDA target (``Target.current()``: ``wgmma``)."""
    red = int(x.shape[-1])
    group = int4_group(weights, red)
    return (
        (not target or _sm90a())
        and x.dtype == "float16"
        and group is not None
        and group % 32 == 0
        and red % _BK == 0
        and halves in (1, 2)
        and out_dim % (128 // halves) == 0
        and int(weights[0].shape[1]) == out_dim * halves
    )


def _acc(n: int) -> tuple[str, str]:
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return regs, outs


def _wgmma_ra_asm(tn: int) -> str:
    """The ``wgmma.m64n{tn}k16`` wrapper with A from registers (4 x b32 a thread: rows g, g + 8
    of its warp's 16 at k 2t, 2t + 1 and 2t + 8, 2t + 9), B K-major in shared memory."""
    n = tn // 2
    regs, outs = _acc(n)
    return (
        f"template <> __device__ __forceinline__ void swap_wgmma_ra<{tn}>(float* d, const "
        "unsigned* a, unsigned b) {\n"
        '  asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(n + 5) + ', 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{tn}k16.f32.f16.f16 {{{regs}}}, '
        f'{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n"\n'
        f"      : {outs}\n"
        '      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(swap_desc(b)), "r"(1));\n'
        "}\n"
    )


def _wgmma_asm(tn: int) -> str:
    """The ``wgmma.m64n{tn}k16`` wrapper (accumulate; both operands K-major, 128-byte swizzle)."""
    n = tn // 2
    regs, outs = _acc(n)
    return (
        f"template <> __device__ __forceinline__ void swap_wgmma<{tn}>(float* d, unsigned a, "
        "unsigned b) {\n"
        '  asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(n + 2) + ', 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{tn}k16.f32.f16.f16 {{{regs}}}, %{n}, '
        f'%{n + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
        f"      : {outs}\n"
        '      : "l"(swap_desc(a)), "l"(swap_desc(b)), "r"(1));\n'
        "}\n"
    )


# The wgmma and cp.async helpers: the hardware's where the build has sm_90a features, the
# emulator's (tests/cuda_emulation.py) on the CPU, traps on other GPUs (never selected there).
SWAP_COMMON = (
    r"""
#ifndef DSV2_MOE_SWAP_COMMON
#define DSV2_MOE_SWAP_COMMON
template <int N>
__device__ __forceinline__ void swap_cp_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  dsv2_emu_cp_wait(N);
#endif
}
template <int TN> __device__ __forceinline__ void swap_wgmma(float* d, unsigned a, unsigned b);
template <int TN>
__device__ __forceinline__ void swap_wgmma_ra(float* d, const unsigned* a, unsigned b);
// cp.async of 4 bytes (cp.async.ca: .cg copies 16 bytes only)
__device__ __forceinline__ void swap_cp_async4(unsigned dst, const void* src) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
#else
  dsv2_emu_cp_async4(dst, src);
#endif
}
// the XOR of the 16-byte pieces of packed row `br` in a super-slot of RAWK steps (2 RAWK pieces a
// row): rows br and br + 1 .. br + 7 of a quarter-warp land in distinct bank groups
template <int RAWK>
__device__ __forceinline__ int swap_raw_swz(int br) {
  return RAWK == 4 ? (br & 7) : RAWK == 2 ? ((br >> 1) & 3) : ((br >> 2) & 1);
}
#if DSV2_MOE_WGMMA
// shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups
// 1024 bytes apart, start address / 16
__device__ __forceinline__ unsigned long long swap_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void swap_wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void swap_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void swap_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void swap_fence_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
"""
    + "".join(_wgmma_asm(tn) + _wgmma_ra_asm(tn) for tn in SWAP_TOKENS)
    + r"""#elif defined(DSV2_EMULATION)
template <int TN>
__device__ __forceinline__ void swap_wgmma(float* d, unsigned a, unsigned b) {
  dsv2_emu_wgmma(d, a, b, TN);
}
template <int TN>
__device__ __forceinline__ void swap_wgmma_ra(float* d, const unsigned* a, unsigned b) {
  dsv2_emu_wgmma_ra(d, a, b, TN);
}
__device__ __forceinline__ void swap_wg_fence() {}
__device__ __forceinline__ void swap_wg_commit() { dsv2_emu_wg_commit(); }
template <int N>
__device__ __forceinline__ void swap_wg_wait() { dsv2_emu_wg_wait(N); }
__device__ __forceinline__ void swap_fence_async() {}
#endif
#if defined(__CUDA_ARCH__) && !DSV2_MOE_WGMMA
template <int TN>
__device__ __forceinline__ void swap_wgmma(float*, unsigned, unsigned) { __trap(); }
template <int TN>
__device__ __forceinline__ void swap_wgmma_ra(float*, const unsigned*, unsigned) { __trap(); }
__device__ __forceinline__ void swap_wg_fence() {}
__device__ __forceinline__ void swap_wg_commit() {}
template <int N>
__device__ __forceinline__ void swap_wg_wait() {}
__device__ __forceinline__ void swap_fence_async() {}
#endif
#endif
"""
)

# Block (tile, cb): see the module docstring. `smem` (shared.dyn, from its first 1024-byte
# boundary): two fp16 weight stages (128 x 64), `S` activation slots (TN x 64), `S` packed weight
# slots (128 x 32 bytes), the block's scales (128 x KG).
_SWAP_BODY = r"""
#ifndef DSV2_MOE_SWAP_{tag}
#define DSV2_MOE_SWAP_{tag}
__device__ __forceinline__ void moe_swap_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long tile, int cb, half* smem, const half* smem_last, int tid) {{
  (void)smem_last;  // only keeps the extent of the shared.dyn buffer in the TIR caller
  constexpr int K = {K}, G = {G}, OUT = {OUT}, HALVES = {HALVES}, GATHERED = {GATHERED};
  constexpr int TN = {TN}, S = {S}, RAWK = {RAWK};
  constexpr int RS = 1 + (S - 2 + RAWK - 1) / RAWK;  // packed super-slots (RAWK steps each)
  constexpr int KT = K / 64, KW = K / 8, KG = (K + G - 1) / G;
  constexpr int W16 = 128 * 64, ACT = TN * 64, RAW = 128 * 16 * RAWK;  // halves a stage / slot
  constexpr int ACH = TN * 8 / 128;  // 16-byte activation pieces a thread a step
  constexpr int COLS = 128 / HALVES;  // output columns of the block
  const int e = tile_expert[tile];
  if (e < 0) return;  // past the last expert's segment (block-uniform)
  smem += ((1024u - (moe_smem_addr(smem) & 1023u)) & 1023u) / 2;
  half* w16 = smem;
  half* act = smem + 2 * W16;
  half* raw = act + S * ACT;
  half* scs = raw + RS * RAW;
  const unsigned w16_a = moe_smem_addr(w16), act_a = moe_smem_addr(act);
  const unsigned raw_a = moe_smem_addr(raw);
  // this thread's copies: packed weight pieces p = tid + 128 i, 2 RAWK a row (a super-slot holds
  // RAWK steps: row p / (2 RAWK), 16-byte piece p % (2 RAWK), so 2 RAWK consecutive threads copy
  // 32 RAWK contiguous bytes of a row), piece `sub` of row br stored at sub ^ swz(br) so that the
  // 8 rows a quarter-warp dequantises read distinct banks; activation pieces c = tid + 128 i (row
  // c >> 3, chunk c & 7)
  const unsigned* wsrc[2 * RAWK];
  unsigned wdst[2 * RAWK];
#pragma unroll
  for (int i = 0; i < 2 * RAWK; ++i) {{
    const int p = tid + 128 * i, br = p / (2 * RAWK), sub = p % (2 * RAWK);
    const int grow = HALVES == 2 ? (br >> 6) * OUT + cb * 64 + (br & 63) : cb * 128 + br;
    wsrc[i] = qw + ((long long)e * OUT * HALVES + grow) * KW + sub * 4;
    wdst[i] = (br * 16 * RAWK + (sub ^ swap_raw_swz<RAWK>(br)) * 8) * 2;
  }}
  const half* asrc[ACH];
  unsigned adst[ACH];
#pragma unroll
  for (int i = 0; i < ACH; ++i) {{
    const int c = tid + 128 * i, r = c >> 3, ac = c & 7;
    const long long srow = GATHERED ? (long long)rows[tile * TN + r] : tile * TN + r;
    asrc[i] = x + srow * K + ac * 8;
    adst[i] = (r * 64 + ((ac ^ (r & 7)) << 3)) * 2;
  }}
  {{  // the scales of this thread's weight row (row tid), once, group-major (no bank conflicts)
    const int grow = HALVES == 2 ? (tid >> 6) * OUT + cb * 64 + (tid & 63) : cb * 128 + tid;
    const half* s = sc + ((long long)e * OUT * HALVES + grow) * KG;
#pragma unroll 4
    for (int q = 0; q < KG; ++q) scs[q * 128 + tid] = s[q];
  }}
  auto issue = [&](int kt) {{
    if (kt < KT) {{
      const int slot = kt % S;
      if (kt % RAWK == 0) {{  // the packed weights of steps kt .. kt + RAWK - 1
        const int rslot = (kt / RAWK) % RS;
#pragma unroll
        for (int i = 0; i < 2 * RAWK; ++i) {{
          if (RAWK == 1 || kt + (i * 128 + tid) % (2 * RAWK) / 2 < KT)
            moe_cp_async16(raw_a + rslot * RAW * 2 + wdst[i], wsrc[i] + kt * 8);
        }}
      }}
#pragma unroll
      for (int i = 0; i < ACH; ++i)
        moe_cp_async16(act_a + slot * ACT * 2 + adst[i], asrc[i] + kt * 64);
    }}
    moe_cp_commit();  // (empty past the end: the group count stays one a step)
  }};
#pragma unroll
  for (int s = 0; s < S - 2; ++s) issue(s);
  float d0[TN / 2], d1[TN / 2];
#pragma unroll
  for (int v = 0; v < TN / 2; ++v) d0[v] = d1[v] = 0.f;
  for (int kt = 0; kt < KT; ++kt) {{
    swap_cp_wait<S - 3>();  // this thread's copies of step kt have landed
    __syncthreads();        // everyone's; and step kt - 2's MMAs are done (waited below)
    issue(kt + S - 2);      // into step kt - 2's slot
    {{  // dequantise row tid of step kt into weight stage kt & 1 (step kt - 2's MMAs are done)
      const uint4* rw =
          reinterpret_cast<const uint4*>(raw + (kt / RAWK) % RS * RAW) + tid * 2 * RAWK;
      const int sw = swap_raw_swz<RAWK>(tid), sub = (kt % RAWK) * 2;
      const uint4 q0 = rw[sub ^ sw], q1 = rw[(sub + 1) ^ sw];
      const unsigned wv[8] = {{q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w}};
      half* ws = w16 + (kt & 1) * W16 + tid * 64;
      // the step's 64 inputs lie in one group, or two (G >= 32)
      const half2 s_lo = __half2half2(scs[(kt * 64) / G * 128 + tid]);
      const half2 s_hi = __half2half2(scs[(kt * 64 + 32) / G * 128 + tid]);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<uint4*>(ws + ((j ^ (tid & 7)) << 3)) =
            moe_dequant8(wv[j], j < 4 ? s_lo : s_hi);
    }}
    swap_fence_async();
    __syncthreads();
    swap_wg_fence();
    const unsigned wa = w16_a + (kt & 1) * W16 * 2, xa = act_a + (kt % S) * ACT * 2;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {{
      swap_wgmma<TN>(d0, wa + 32 * kk, xa + 32 * kk);
      swap_wgmma<TN>(d1, wa + 8192 + 32 * kk, xa + 32 * kk);
    }}
    swap_wg_commit();
    swap_wg_wait<1>();  // step kt - 1's MMAs
  }}
  swap_wg_wait<0>();
  __syncthreads();  // every MMA has read its stages: the weight stages hold the transposed tile
  // accumulators: warp w, lane (g, t): d[4 j + v] at weight row 16 w + g + 8 (v >> 1), token
  // 8 j + 2 t + (v & 1) of its 64-row half; to tr[token][column] (COLS + 8 halves a row)
  constexpr int TRS = COLS + 8;
  half* tr = w16;
  {{
    const int w = tid >> 5, g = (tid & 31) >> 2, t4 = tid & 3;
#pragma unroll
    for (int j = 0; j < TN / 8; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) {{
        const int m = 16 * w + g + 8 * (v >> 1), tok = 8 * j + 2 * t4 + (v & 1);
        if (HALVES == 2) {{
          const float gv = d0[4 * j + v], uv = d1[4 * j + v];
          tr[tok * TRS + m] = __float2half(gv * (1.0f / (1.0f + __expf(-gv))) * uv);
        }} else {{
          tr[tok * TRS + m] = __float2half(d0[4 * j + v]);
          tr[tok * TRS + 64 + m] = __float2half(d1[4 * j + v]);
        }}
      }}
  }}
  __syncthreads();
  constexpr int CH = COLS / 8;  // 16-byte pieces of a token's columns
#pragma unroll
  for (int i = 0; i < TN * CH / 128; ++i) {{
    const int c = tid + 128 * i, tok = c / CH, p = c % CH;
    *reinterpret_cast<uint4*>(out + (tile * TN + tok) * OUT + cb * COLS + p * 8) =
        *reinterpret_cast<const uint4*>(tr + tok * TRS + p * 8);
  }}
}}
#endif
"""


# Block (tile, cb) with A from registers (``SwapTiles.operand_a == "regs"``): warp w, lane (g, t)
# holds stage rows 64 h + 16 w + g + 8 m (h: the 64-row half, m = 0, 1): per K step it loads
# words 2t, 2t + 1 of each (16 consecutive inputs: the "lo" and "hi" word) `PD` steps ahead into
# registers, with the rows' scales; the MMA's k16 slice s takes pair s of the lo word as its
# inputs (2t, 2t + 1) and pair s of the hi word as (2t + 8, 2t + 9). So slice s, logical input
# 16 s + 2 t + 8 hh + e is physical input 16 t + 8 hh + 2 s + e of the step, and the activations
# are staged in that order: 4-byte pairs by cp.async into `S` slots (TN rows x 64 halves, 128-byte
# swizzle), `S - 1` steps ahead. `smem` (shared.dyn, from its first 1024-byte boundary): the slots.
_SWAP_RA_BODY = r"""
#ifndef DSV2_MOE_SWAP_RA_{tag}
#define DSV2_MOE_SWAP_RA_{tag}
__device__ __forceinline__ void moe_swap_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long tile, int cb, half* smem, const half* smem_last, int tid) {{
  (void)smem_last;  // only keeps the extent of the shared.dyn buffer in the TIR caller
  constexpr int K = {K}, G = {G}, OUT = {OUT}, HALVES = {HALVES}, GATHERED = {GATHERED};
  constexpr int TN = {TN}, S = {S}, PD = {PD};
  constexpr int KT = K / 64, KW = K / 8, KG = (K + G - 1) / G;
  constexpr int ACT = TN * 64;        // halves an activation slot
  constexpr int ACP = TN * 32 / 128;  // 4-byte activation pairs a thread a step
  constexpr int COLS = 128 / HALVES;  // output columns of the block
  const int e = tile_expert[tile];
  if (e < 0) return;  // past the last expert's segment (block-uniform)
  smem += ((1024u - (moe_smem_addr(smem) & 1023u)) & 1023u) / 2;
  const unsigned act_a = moe_smem_addr(smem);
  const int w = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
  // weight rows (h, m) of this thread: packed words from 2t, scales
  const unsigned* wp[2][2];
  const half* sp[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int m = 0; m < 2; ++m) {{
      const int br = 64 * h + 16 * w + g + 8 * m;
      const int grow = HALVES == 2 ? (br >> 6) * OUT + cb * 64 + (br & 63) : cb * 128 + br;
      const long long row = (long long)e * OUT * HALVES + grow;
      wp[h][m] = qw + row * KW + 2 * t;
      sp[h][m] = sc + row * KG;
    }}
  // activation pairs c = tid + 128 i: token row c >> 5, pair pr = c & 31 = (t', hh, s) as
  // t' * 8 + hh * 4 + s: physical inputs 16 t' + 8 hh + 2 s (+1) -> logical 16 s + 2 t' + 8 hh
  const half* asrc[ACP];
  unsigned adst[ACP];
#pragma unroll
  for (int i = 0; i < ACP; ++i) {{
    const int c = tid + 128 * i, r = c >> 5, pr = c & 31;
    const int tp = pr >> 3, hh = (pr >> 2) & 1, sl = pr & 3;
    const long long srow = GATHERED ? (long long)rows[tile * TN + r] : tile * TN + r;
    asrc[i] = x + srow * K + 16 * tp + 8 * hh + 2 * sl;
    adst[i] = r * 128 + (((2 * sl + hh) ^ (r & 7)) << 4) + 4 * tp;
  }}
  auto issue = [&](int kt) {{
    if (kt < KT) {{
      const unsigned slot = act_a + (kt % S) * ACT * 2;
#pragma unroll
      for (int i = 0; i < ACP; ++i) swap_cp_async4(slot + adst[i], asrc[i] + kt * 64);
    }}
    moe_cp_commit();  // (empty past the end: the group count stays one a step)
  }};
  uint2 wq[PD][2][2];
  half ws[PD][2][2];
  auto load = [&](int q, int kt) {{  // step kt's words and scales into ring entry q
    if (kt < KT) {{
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int m = 0; m < 2; ++m) {{
          wq[q][h][m] = __ldg(reinterpret_cast<const uint2*>(wp[h][m] + kt * 8));
          ws[q][h][m] = sp[h][m][(kt * 64 + 16 * t) / G];
        }}
    }}
  }};
#pragma unroll
  for (int q = 0; q < PD; ++q) load(q, q);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) issue(st);
  float d0[TN / 2], d1[TN / 2];
#pragma unroll
  for (int v = 0; v < TN / 2; ++v) d0[v] = d1[v] = 0.f;
  for (int k0 = 0; k0 < KT; k0 += PD) {{
#pragma unroll
    for (int q = 0; q < PD; ++q) {{
      const int kt = k0 + q;
      if (kt < KT) {{
        swap_cp_wait<S - 2>();  // this thread's pairs of step kt have landed
        swap_fence_async();
        __syncthreads();  // everyone's; step kt - 1's MMAs are done (waited below)
        issue(kt + S - 1);  // into step kt - 1's slot
        unsigned a[2][4][4];  // [half][slice][fragment register]
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int m = 0; m < 2; ++m) {{
            const half2 s2 = __half2half2(ws[q][h][m]);
            const uint4 lo = moe_dequant8(wq[q][h][m].x, s2), hi = moe_dequant8(wq[q][h][m].y, s2);
            const unsigned* lv = reinterpret_cast<const unsigned*>(&lo);
            const unsigned* hv = reinterpret_cast<const unsigned*>(&hi);
#pragma unroll
            for (int sl = 0; sl < 4; ++sl) {{
              a[h][sl][m] = lv[sl];
              a[h][sl][2 + m] = hv[sl];
            }}
          }}
        load(q, kt + PD);
        const unsigned xa = act_a + (kt % S) * ACT * 2;
        swap_wg_fence();
#pragma unroll
        for (int sl = 0; sl < 4; ++sl) {{
          swap_wgmma_ra<TN>(d0, a[0][sl], xa + 32 * sl);
          swap_wgmma_ra<TN>(d1, a[1][sl], xa + 32 * sl);
        }}
        swap_wg_commit();
        swap_wg_wait<0>();
      }}
    }}
  }}
  swap_cp_wait<0>();
  __syncthreads();  // every MMA is done and every copy landed: the slots hold the transposed tile
  constexpr int TRS = COLS + 8;
  half* tr = smem;
#pragma unroll
  for (int j = 0; j < TN / 8; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) {{
      const int mrow = 16 * w + g + 8 * (v >> 1), tok = 8 * j + 2 * t + (v & 1);
      if (HALVES == 2) {{
        const float gv = d0[4 * j + v], uv = d1[4 * j + v];
        tr[tok * TRS + mrow] = __float2half(gv * (1.0f / (1.0f + __expf(-gv))) * uv);
      }} else {{
        tr[tok * TRS + mrow] = __float2half(d0[4 * j + v]);
        tr[tok * TRS + 64 + mrow] = __float2half(d1[4 * j + v]);
      }}
    }}
  __syncthreads();
  constexpr int CH = COLS / 8;  // 16-byte pieces of a token's columns
#pragma unroll
  for (int i = 0; i < TN * CH / 128; ++i) {{
    const int c = tid + 128 * i, tok = c / CH, p = c % CH;
    *reinterpret_cast<uint4*>(out + (tile * TN + tok) * OUT + cb * COLS + p * 8) =
        *reinterpret_cast<const uint4*>(tr + tok * TRS + p * 8);
  }}
}}
#endif
"""


def smem_halves(tiles: SwapTiles, red: int, group: int) -> int:
    """``shared.dyn`` a block asks for (halves): the stages and slots, the scales and 1 KB of
    alignment."""
    kg = -(-red // group)
    if tiles.operand_a == "regs":  # the activation slots (at least the transposed tile)
        return max(tiles.stages * tiles.tokens * 64, tiles.tokens * 136) + 512
    supers = 1 + -(-(tiles.stages - 2) // tiles.line_steps)
    raw = supers * 128 * 16 * tiles.line_steps
    return 2 * 128 * 64 + tiles.stages * tiles.tokens * 64 + raw + 128 * kg + 512


def grouped_gemm_swap(
    x: te.Tensor,
    rows: te.Tensor,
    tile_expert: te.Tensor,
    weights: Sequence[te.Tensor],
    out_dim: int,
    halves: int,
    gathered: bool,
    name: str,
) -> tirx.PrimFunc:
    """The grouped GEMM of :func:`~.moe_grouped_cuda.grouped_gemm_te` (INT4 weights) with the
    tile table's ``moe_swap`` tiles: ``f(x, rows, tile_expert, qweight, scales, out)`` over tiles
    of ``rows.shape[1]`` (= the tiles' ``tokens``) rows. Only for :func:`swap_supported` shapes."""
    tiles = swap_tiles()
    if int(rows.shape[1]) != tiles.tokens:
        raise ValueError(f"{name}: tiles of {rows.shape[1]} rows, the table's are {tiles.tokens}")
    return swap_kernel(x, weights, out_dim, halves, gathered, name, tiles)


def swap_kernel(
    x: te.Tensor,
    weights: Sequence[te.Tensor],
    out_dim: int,
    halves: int,
    gathered: bool,
    name: str,
    tiles: SwapTiles,
    target: bool = True,
) -> tirx.PrimFunc:
    """:func:`grouped_gemm_swap` with the given ``tiles`` (the lab's and the tests' entry;
    ``target`` False skips the sm_90 check: CPU emulation). Grid ``(nt, out_all / 128)``, 128
    threads, ``__launch_bounds__(128, 3)``."""
    if not swap_supported(x, weights, out_dim, halves, target):
        raise ValueError(f"grouped_gemm_swap does not take {name}: {x.shape} -> {out_dim}x{halves}")
    if (
        tiles.tokens not in SWAP_TOKENS
        or tiles.stages < 3
        or tiles.line_steps not in (1, 2, 4)
        or tiles.operand_a not in ("smem", "regs")
    ):
        raise ValueError(
            f"bad moe_swap tiles {tiles}: tokens in {SWAP_TOKENS}, stages >= 3, line_steps 1, 2 "
            "or 4"
        )
    red = int(x.shape[-1])
    group = int4_group(weights, red)
    E = int(weights[0].shape[0])
    tag = f"{halves}_{out_dim}_{red}_{group}_{int(gathered)}_{tiles.name}"
    fmt = dict(
        K=red, G=group, OUT=out_dim, HALVES=halves, GATHERED=int(gathered), TN=tiles.tokens,
        S=tiles.stages, RAWK=tiles.line_steps, PD=tiles.line_steps,
    )  # fmt: skip
    body = _SWAP_RA_BODY if tiles.operand_a == "regs" else _SWAP_BODY
    src = _MMA_COMMON + wgmma.WGMMA_COMMON + SWAP_COMMON + body.format(tag=tag, **fmt)
    fname = f"moe_swap_{tag}"
    K, G, TN, SM = red, group, tiles.tokens, smem_halves(tiles, red, group)
    out_all = out_dim * halves
    col_blocks, NTH, GATHERED = out_all // 128, SWAP_THREADS, gathered

    @T.prim_func(private=True, s_tir=True)
    def moe_swap(
        var_x: T.handle, var_rows: T.handle, var_te: T.handle, var_qw: T.handle,
        var_sc: T.handle, var_out: T.handle,
    ):  # fmt: skip
        n = T.int64()
        nt = T.int64()
        if GATHERED:
            xb = T.match_buffer(var_x, (n, K), "float16")
        else:
            xb = T.match_buffer(var_x, (nt, TN, K), "float16")
        rb = T.match_buffer(var_rows, (nt, TN), "int32")
        teb = T.match_buffer(var_te, (nt,), "int32")
        qb = T.match_buffer(var_qw, (E, out_all, K // 8), "uint32")
        sb = T.match_buffer(var_sc, (E, out_all, -(-K // G)), "float16")
        ob = T.match_buffer(var_out, (nt, TN, out_dim), "float16")
        for b0 in T.thread_binding(nt, thread="blockIdx.x"):
            for b1 in T.thread_binding(col_blocks, thread="blockIdx.y"):
                for tx in T.thread_binding(NTH, thread="threadIdx.x"):
                    with T.sblock("moe_swap"):
                        T.reads()
                        T.writes()
                        smem = T.sblock_alloc_buffer((SM,), "float16", scope="shared.dyn")
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 3)
                        T.cuda.func_call(
                            fname, xb.data, rb.data, teb.data, qb.data, sb.data, ob.data, b0,
                            b1, T.address_of(smem[0]), T.address_of(smem[SM - 1]), tx,
                            source_code=src,
                        )  # fmt: skip

    return kernel_attrs(moe_swap)

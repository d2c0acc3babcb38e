"""Expert-sorted grouped GEMMs of decode batches on Hopper's ``wgmma``: weights as M, tokens as N.

In a decode step of ``n`` sequences each of ``E`` experts gets about ``n * top_k / E`` of the
(token, slot) pairs (24 at 256 sequences of V2-Lite): too few rows for the grouped GEMMs of
:mod:`.moe_mma_cuda`, whose tiles are 64 token rows (``wgmma`` M is at least 64), so most of their
tensor-core work multiplies padding (280 us a layer for gate/up at 256 sequences,
schedules/results/decode_batches.md). Here the operands swap (``D^T = W X^T``): the dequantised
weights are ``wgmma``'s A (M = 64 weight rows), the tile's tokens its B (N =
``SwapTiles.tokens``: 16, 32 or 64), so a tile pads an expert's pairs to 16-64, not 64, and every
expert the step selects is read once per tile of its pairs (one tile for most experts).

The bookkeeping is the grouped path's (:mod:`.moe_grouped_cuda`): ``moe_align`` with ``TM`` =
the token tile sorts the pairs by expert, this kernel runs for gate/up (SwiGLU epilogue, ``x``
gathered by ``rows``) and for down (the padded rows in order), then ``combine``. A block of one or
two warpgroups (``SwapTiles.warpgroups``) computes (tile ``t``, column block ``cb``): 128 weight
rows (gate/up: gate rows ``[64 cb, +64)`` and the matching up rows; down: rows ``[128 cb, +128)``)
x the tile's tokens. ``blockIdx.x`` is the tile, so an expert's tiles run together and share its
weights in L2.

**A from registers.** The dequantised weights never touch shared memory: a lane's ``wgmma`` A
fragment (rows ``g``, ``g + 8`` of its warp's 16 at inputs ``2t, 2t + 1, 2t + 8, 2t + 9`` of a k16
slice) is filled from the packed words it loads itself, each K step (64 inputs) the lane's words
``2t`` and ``2t + 1`` of its rows, loaded ``SwapTiles.ahead`` steps ahead into registers with the
rows' scales and dequantised with :func:`moe_dequant8` (``1024 + nibble`` as an fp16 bit pattern,
minus 1032, times the fp16 scale). Word ``2t``'s pair ``s`` feeds slice ``s``'s inputs ``(2t, 2t +
1)``, word ``2t + 1``'s pair ``s`` its inputs ``(2t + 8, 2t + 9)``: the reduction runs in a
permuted input order, which the activations (B, K-major rows of 64 halves, 128-byte swizzle) follow:
they are staged by 4-byte ``cp.async`` pairs into a ring of ``SwapTiles.stages`` shared slots,
``stages - 1`` steps ahead, one barrier a step. A step's eight (or four a warpgroup) MMAs are
waited for before the next step's dequantisation rewrites the A registers. The epilogue goes
through shared memory: the accumulators (``silu(gate) * up`` for gate/up; with two warpgroups the
gate half's values pass as floats) as fp16, transposed to token rows, written 16 bytes at a time.
Against A dequantised into a shared stage (the design before, in git at ``6a8834e``) this reads
and writes ~40 KB less shared memory a block and step, which bounded it (ncu: L1 89 % busy, short
scoreboard stalls): 124 + 65 against 217 + 123 us a layer (gate/up + down) at 256 tokens
(schedules/results/moe_swap.md).

Only for builds with sm_90a features (``wgmma``; ``compiler.cuda.cuda_codegen`` builds ``sm_90``
targets so): :func:`swap_supported` / :func:`swap_target` say where. Other archs get a kernel that
traps, which the model never selects. On the CPU the ``wgmma`` (A from registers, exchanged in
the warp at issue; B read through the swizzle at the ``wait_group`` that completes it) and
``cp.async`` stand-ins of ``tests/cuda_emulation.py`` run it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.script import tirx as T
from tvm.target import Target

from . import moe_wgmma_cuda as wgmma
from .moe_mma_cuda import _MMA_COMMON, int4_group, kernel_attrs
from .tiles import SwapTiles, tuned

__all__ = [
    "SWAP_TOKENS",
    "grouped_gemm_swap",
    "swap_kernel",
    "swap_supported",
    "swap_target",
    "swap_tiles",
]

SWAP_TOKENS = (16, 32, 64)  # the token tiles (wgmma N) the kernel is instantiated for
SWAP_THREADS = 128  # a warpgroup (SwapTiles.warpgroups of them a block)
_BK = 64  # a K step


def swap_tiles() -> SwapTiles:
    """The tile table's ``moe_swap`` entry (``schedules/tiles.py``)."""
    return tuned("moe_swap")


def swap_target(target: Target | None = None) -> bool:
    """Whether ``target`` (None: ``Target.current()``) runs these kernels: CUDA ``sm_90``, which
    ``compiler.cuda.cuda_codegen`` builds with the sm_90a features (``wgmma``)."""
    target = target or Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda":
        return False
    return str(target.attrs.get("arch", "")) in ("sm_90", "sm_90a")


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
        (not target or swap_target())
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
#if DSV2_MOE_WGMMA
// (moe_wgmma_cuda's helpers: the descriptor of K-major 128-byte rows with the 128-byte swizzle,
// fences, commit, wait)
__device__ __forceinline__ unsigned long long swap_desc(unsigned addr) { return moe_wg_desc(addr); }
__device__ __forceinline__ void swap_wg_fence() { moe_wg_fence(); }
__device__ __forceinline__ void swap_wg_commit() { moe_wg_commit(); }
__device__ __forceinline__ void swap_wg_wait0() { moe_wg_wait0(); }
__device__ __forceinline__ void swap_fence_async() { moe_fence_async_smem(); }
"""
    + "".join(_wgmma_ra_asm(tn) for tn in SWAP_TOKENS)
    + r"""#elif defined(DSV2_EMULATION)
template <int TN>
__device__ __forceinline__ void swap_wgmma_ra(float* d, const unsigned* a, unsigned b) {
  dsv2_emu_wgmma_ra(d, a, b, TN);
}
__device__ __forceinline__ void swap_wg_fence() {}
__device__ __forceinline__ void swap_wg_commit() { dsv2_emu_wg_commit(); }
__device__ __forceinline__ void swap_wg_wait0() { dsv2_emu_wg_wait(0); }
__device__ __forceinline__ void swap_fence_async() {}
#endif
#if defined(__CUDA_ARCH__) && !DSV2_MOE_WGMMA
template <int TN>
__device__ __forceinline__ void swap_wgmma_ra(float*, const unsigned*, unsigned) { __trap(); }
__device__ __forceinline__ void swap_wg_fence() {}
__device__ __forceinline__ void swap_wg_commit() {}
__device__ __forceinline__ void swap_wg_wait0() {}
__device__ __forceinline__ void swap_fence_async() {}
#endif
#endif
"""
)

# Block (tile, cb), NWG warpgroups (SwapTiles.warpgroups): warpgroup wg takes the 64-row halves
# h = wg * HP + [0, HP) (HP = 2 / NWG; gate/up: half 0 the gate rows, half 1 the up rows). Warp w
# of its warpgroup, lane (g, t), holds stage rows 64 h + 16 w + g + 8 m (m = 0, 1): per K step it
# loads words 2t, 2t + 1 of each (16 consecutive inputs: the "lo" and "hi" word) PD
# (SwapTiles.ahead) steps ahead into registers, with the rows' scales; the MMA's k16 slice s takes
# pair s of the lo word as its inputs (2t, 2t + 1) and pair s of the hi word as (2t + 8, 2t + 9).
# So slice s, logical input 16 s + 2 t + 8 hh + e is physical input 16 t + 8 hh + 2 s + e of the
# step, and the activations are staged in that order: 4-byte pairs by cp.async into S slots (TN
# rows x 64 halves, 128-byte swizzle), S - 1 steps ahead, shared by the warpgroups. A step's MMAs
# are waited for before the next step's dequantisation writes the A registers again (waiting one
# step later, with two sets of A registers, measured no faster and computed wrong results on the
# GPU: schedules/results/moe_swap.md). `smem` (shared.dyn, from its first 1024-byte boundary):
# the slots.
_SWAP_BODY = r"""
#ifndef DSV2_MOE_SWAP_{tag}
#define DSV2_MOE_SWAP_{tag}
__device__ __forceinline__ void moe_swap_{tag}(
    const half* __restrict__ x, const int* __restrict__ rows, const int* __restrict__ tile_expert,
    const unsigned* __restrict__ qw, const half* __restrict__ sc, half* __restrict__ out,
    long long tile, int cb, half* smem, const half* smem_last, int tid) {{
  (void)smem_last;  // only keeps the extent of the shared.dyn buffer in the TIR caller
  constexpr int K = {K}, G = {G}, OUT = {OUT}, HALVES = {HALVES}, GATHERED = {GATHERED};
  constexpr int TN = {TN}, S = {S}, PD = {PD}, NWG = {NWG}, HP = 2 / NWG, NTH = 128 * NWG;
  constexpr int KT = K / 64, KW = K / 8, KG = (K + G - 1) / G;
  constexpr int ACT = TN * 64;        // halves an activation slot
  constexpr int ACP = TN * 32 / NTH;  // 4-byte activation pairs a thread a step
  constexpr int COLS = 128 / HALVES;  // output columns of the block
  const int e = tile_expert[tile];
  if (e < 0) return;  // past the last expert's segment (block-uniform)
  smem += ((1024u - (moe_smem_addr(smem) & 1023u)) & 1023u) / 2;
  const unsigned act_a = moe_smem_addr(smem);
  const int wg = tid >> 7, w = (tid >> 5) & 3, g = (tid & 31) >> 2, t = tid & 3;
  // weight rows (hp, m) of this thread: packed words from 2t, scales
  const unsigned* wp[HP][2];
  const half* sp[HP][2];
#pragma unroll
  for (int hp = 0; hp < HP; ++hp)
#pragma unroll
    for (int m = 0; m < 2; ++m) {{
      const int br = 64 * (wg * HP + hp) + 16 * w + g + 8 * m;
      const int grow = HALVES == 2 ? (br >> 6) * OUT + cb * 64 + (br & 63) : cb * 128 + br;
      const long long row = (long long)e * OUT * HALVES + grow;
      wp[hp][m] = qw + row * KW + 2 * t;
      sp[hp][m] = sc + row * KG;
    }}
  // activation pairs c = tid + NTH i: token row c >> 5, pair pr = c & 31 = (t', hh, s) as
  // t' * 8 + hh * 4 + s: physical inputs 16 t' + 8 hh + 2 s (+1) -> logical 16 s + 2 t' + 8 hh
  const half* asrc[ACP];
  unsigned adst[ACP];
#pragma unroll
  for (int i = 0; i < ACP; ++i) {{
    const int c = tid + NTH * i, r = c >> 5, pr = c & 31;
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
  uint2 wq[PD][HP][2];
  half ws[PD][HP][2];
  auto load = [&](int q, int kt) {{  // step kt's words and scales into ring entry q
    if (kt < KT) {{
#pragma unroll
      for (int hp = 0; hp < HP; ++hp)
#pragma unroll
        for (int m = 0; m < 2; ++m) {{
          wq[q][hp][m] = __ldg(reinterpret_cast<const uint2*>(wp[hp][m] + kt * 8));
          ws[q][hp][m] = sp[hp][m][(kt * 64 + 16 * t) / G];
        }}
    }}
  }};
#pragma unroll
  for (int q = 0; q < PD; ++q) load(q, q);
#pragma unroll
  for (int st = 0; st < S - 1; ++st) issue(st);
  float d[HP][TN / 2];
#pragma unroll
  for (int hp = 0; hp < HP; ++hp)
#pragma unroll
    for (int v = 0; v < TN / 2; ++v) d[hp][v] = 0.f;
  for (int k0 = 0; k0 < KT; k0 += PD) {{
#pragma unroll
    for (int q = 0; q < PD; ++q) {{
      const int kt = k0 + q;
      if (kt < KT) {{
        swap_cp_wait<S - 2>();  // this thread's pairs of step kt have landed
        swap_fence_async();
        __syncthreads();  // everyone's; step kt - 1's MMAs are done (waited below)
        issue(kt + S - 1);  // into step kt - 1's slot
        unsigned a[HP][4][4];  // [half][slice][fragment register]
#pragma unroll
        for (int hp = 0; hp < HP; ++hp)
#pragma unroll
          for (int m = 0; m < 2; ++m) {{
            const half2 s2 = __half2half2(ws[q][hp][m]);
            const uint4 lo = moe_dequant8(wq[q][hp][m].x, s2);
            const uint4 hi = moe_dequant8(wq[q][hp][m].y, s2);
            const unsigned* lv = reinterpret_cast<const unsigned*>(&lo);
            const unsigned* hv = reinterpret_cast<const unsigned*>(&hi);
#pragma unroll
            for (int sl = 0; sl < 4; ++sl) {{
              a[hp][sl][m] = lv[sl];
              a[hp][sl][2 + m] = hv[sl];
            }}
          }}
        load(q, kt + PD);
        const unsigned xa = act_a + (kt % S) * ACT * 2;
        swap_wg_fence();
#pragma unroll
        for (int sl = 0; sl < 4; ++sl)
#pragma unroll
          for (int hp = 0; hp < HP; ++hp) swap_wgmma_ra<TN>(d[hp], a[hp][sl], xa + 32 * sl);
        swap_wg_commit();
        swap_wg_wait0();
      }}
    }}
  }}
  swap_cp_wait<0>();
  __syncthreads();  // every MMA is done and every copy landed: the slots are free
  // accumulators: d[hp][4 j + v] at row 16 w + g + 8 (v >> 1) of half wg * HP + hp, token
  // 8 j + 2 t + (v & 1); to tr[token][column] (COLS + 8 halves a row). Gate/up with two
  // warpgroups: the gate warpgroup's values go through gf[token][row] (floats) first.
  constexpr int TRS = COLS + 8;
  half* tr = smem;
  float* gf = reinterpret_cast<float*>(smem + TN * TRS);
  if (HALVES == 2 && NWG == 2) {{
    if (wg == 0) {{
#pragma unroll
      for (int j = 0; j < TN / 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v)
          gf[(8 * j + 2 * t + (v & 1)) * 65 + 16 * w + g + 8 * (v >> 1)] = d[0][4 * j + v];
    }}
    __syncthreads();
  }}
#pragma unroll
  for (int j = 0; j < TN / 8; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) {{
      const int mrow = 16 * w + g + 8 * (v >> 1), tok = 8 * j + 2 * t + (v & 1);
      if (HALVES == 2) {{
        if (NWG == 1 || wg == 1) {{
          const float gv = NWG == 1 ? d[0][4 * j + v] : gf[tok * 65 + mrow];
          const float uv = d[HP - 1][4 * j + v];
          tr[tok * TRS + mrow] = __float2half(gv * (1.0f / (1.0f + __expf(-gv))) * uv);
        }}
      }} else {{
#pragma unroll
        for (int hp = 0; hp < HP; ++hp)
          tr[tok * TRS + 64 * (wg * HP + hp) + mrow] = __float2half(d[hp][4 * j + v]);
      }}
    }}
  __syncthreads();
  constexpr int CH = COLS / 8;  // 16-byte pieces of a token's columns
#pragma unroll
  for (int i = 0; i < (TN * CH + NTH - 1) / NTH; ++i) {{
    const int c = tid + NTH * i, tok = c / CH, p = c % CH;
    if (TN * CH % NTH == 0 || c < TN * CH)
      *reinterpret_cast<uint4*>(out + (tile * TN + tok) * OUT + cb * COLS + p * 8) =
          *reinterpret_cast<const uint4*>(tr + tok * TRS + p * 8);
  }}
}}
#endif
"""


def smem_halves(tiles: SwapTiles) -> int:
    """``shared.dyn`` a block asks for (halves): the activation slots, at least the epilogue's
    transposed tile and gate floats, and 1 KB of alignment."""
    return max(tiles.stages * tiles.tokens * 64, tiles.tokens * (136 + 2 * 65)) + 512


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
        or tiles.stages < 2
        or tiles.ahead < 1
        or tiles.warpgroups not in (1, 2)
    ):
        raise ValueError(
            f"bad moe_swap tiles {tiles}: tokens in {SWAP_TOKENS}, stages >= 2, ahead >= 1, "
            "warpgroups 1 or 2"
        )
    red = int(x.shape[-1])
    group = int4_group(weights, red)
    E = int(weights[0].shape[0])
    tag = f"{halves}_{out_dim}_{red}_{group}_{int(gathered)}_{tiles.name}"
    fmt = dict(
        K=red, G=group, OUT=out_dim, HALVES=halves, GATHERED=int(gathered), TN=tiles.tokens,
        S=tiles.stages, PD=tiles.ahead, NWG=tiles.warpgroups,
    )  # fmt: skip
    src = _MMA_COMMON + wgmma.WGMMA_COMMON + SWAP_COMMON + _SWAP_BODY.format(tag=tag, **fmt)
    fname = f"moe_swap_{tag}"
    K, G, TN, SM = red, group, tiles.tokens, smem_halves(tiles)
    out_all = out_dim * halves
    col_blocks, GATHERED = out_all // 128, gathered
    NTH = SWAP_THREADS * tiles.warpgroups
    MINB = 3 if NTH == SWAP_THREADS else 2

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
                        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MINB)
                        T.cuda.func_call(
                            fname, xb.data, rb.data, teb.data, qb.data, sb.data, ob.data, b0,
                            b1, T.address_of(smem[0]), T.address_of(smem[SM - 1]), tx,
                            source_code=src,
                        )  # fmt: skip

    return kernel_attrs(moe_swap)

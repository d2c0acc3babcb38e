"""DeepSeekMoE decode of a batch on CUDA, expert-major on tensor cores (batches of 16 and more).

The fused decode kernels of :mod:`.moe_decode_cuda` are token-major: each token's blocks route it
and read its ``top_k`` routed experts and the shared ones, so a batch of ``n`` reads ``n`` x
(``top_k`` + shared) experts' weights a layer. The experts a batch selects overlap, and the shared
experts are every token's: here every expert's rows are read once for all the tokens that chose
it. Two kernels (after the router's ``moe_route``), each a fixed grid of ``blocks`` blocks of
``warps`` warps that loops over the tokens in groups of ``MmaTiles.tokens`` (32 by default: a
group reads its experts' weights again, so a plan of 256 tokens reads them once for a step of up
to 256), each block first building the group's **plan** in shared memory: from ``ids [n, top_k]``
the (token, slot) pairs of every expert in (token, slot) order, the shared experts as expert ``E``
with one pair (token, ``top_k``) per token; an expert's pairs in *chunks* of at most
``MmaTiles.chunk`` (8 by default). The plan is the same in every block: each warp counts then
places the pairs of its contiguous segment of ``ids``, 32 at a time, the lanes of one expert
found by ballots over the bits of its id, their ranks by popcounts (no atomics), with a scan over
the warps and one over the experts in between. The work items
are (chunk, block of ``rows`` weight rows): the routed chunks' first, expert by expert, then the
shared chunks'. Block ``b`` takes the contiguous run ``[b * items / blocks, (b + 1) * items /
blocks)``, so consecutive items mostly share their chunk and the blocks' shares differ by one item
at most. An item goes through ``mma.sync.m16n8k16`` with the weights as A (16 rows) and the
chunk's tokens as B (N = 8): one MMA is 16 rows x 16 inputs x 8 tokens, and a weight is
dequantised once for all the chunk's tokens (SIMT dot products, ~640 instructions a weight row,
lost to the token-major kernels: schedules/results/moe_decode.md). A chunk of 16 or 32 pairs is
two or four such n-tiles, each dequantised A fragment multiplied with all of them.

**In the model:** ``batch_decode_expert_major`` (``GroupQuantExperts.expert_major_decode``: the
router's ``moe_route``, these two kernels, the float32 weighted sum), which the engine runs for
decode steps of ``EXPERT_MAJOR_FROM`` (16) sequences and more: from there on it decodes faster
than the token-major kernels, below that slower, at batch 1 about half as fast
(schedules/results/moe_decode.md, docs/benchmarks.md "Decode batches"). ``batch_decode_gemm``
(the large batches) runs them instead of the grouped GEMMs where the tile table's
``decode_gemm`` entry says ``moe="expert_major"``.

**The fragments from the INT4 layout as it is.** The weights stay in the layout of
:mod:`dsv2_mlc.quant.packing` (``[rows, K/8]`` words, element ``8 j + i`` in nibble ``i``
of word ``j``), which the token-major kernels read too. An MMA's reduction order over its 16
inputs does not matter as long as A and B agree, so each lane takes 32 *consecutive* inputs of its
rows: in a run of 128 inputs, lane ``(g, t)`` (``g = lane / 4``, ``t = lane % 4``) loads the 16
bytes ``[16 t, 16 t + 16)`` of rows ``g`` and ``g + 8`` (one ``uint4`` each: 4 words), and word
``i`` feeds two MMA steps. A word dequantises (the exact ``1024 + nibble`` trick of
:func:`~.decode_gemv_cuda.dot32_source`) to the half2 pairs ``(n0, n4), (n1, n5), (n2, n6), (n3,
n7)``, times the group's scale (one fp16 rounding, as the prefill MMA kernels do); step ``2 i``
takes pairs 0 and 1 as its logical inputs ``(2t, 2t+1)`` and ``(2t+8, 2t+9)``, step ``2 i + 1``
pairs 2 and 3. The chunk's activations are staged in shared memory in the same pair order
(``dsv2_pair8``), so B is one 8-byte load per step; rows are padded so that the warp's 32 loads
hit every bank pair twice (two wavefronts, the minimum for 256 bytes). With runs of 256
(``MmaTiles.run``) a lane takes 64 consecutive inputs, two ``uint4`` a row, so a row's 4 lanes
read one whole 128-byte line a run: that, not the bytes in flight, is what the gate/up kernel
needs (schedules/results/moe_decode.md).

1. :func:`moe_gate_up_expert_mma`: per item, the chunk's ``x`` rows in shared memory; each warp a
   16-row tile of gate rows and the matching up rows (two MMAs per B fragment), the next run's
   words loaded before this run's MMAs (runs of 256 by default); ``h = silu(gate) * up`` from the
   float32 accumulators, written for the chunk's pairs (the layout of the token-major kernels).
2. :func:`moe_down_expert_mma`: per item, the chunk's pairs' ``h`` slices in shared memory; each
   warp a 16-row tile of output rows (two runs of 128 in flight by default), ``part[t, slot, o]``
   in float32 (unweighted, every element written by one item: the weighted sum stays
   deterministic).

**Activations in K slices** (``MmaTiles.stage_k`` > 0; 0 stages the whole chunk as above): an
item's chunk x full width of activations (64 KB at chunk 16 and hidden 2048, 128 KB at chunk 32:
one block an SM) is staged ``stage_k`` inputs at a time (a multiple of the run) in a ring of two
buffers of ``chunk`` padded rows (``2 x chunk x stage_k x 2`` bytes: 33 KB at chunk 32 and 256),
with the same pair order and strides. The item's tiles go in rounds of a tile a warp; in a round
slice ``sl + 1`` is copied (``cp.async``, 8 bytes at a time: padded rows are 8-byte aligned)
while the warps multiply slice ``sl``, then each thread puts the pieces it copied in pair order,
one barrier a slice. A warp's next run of weights is loaded before this run's MMAs across the
slices (depth 1; no K split). Every item stages its own slices.

Shapes: ``hidden``, ``inter`` and the shared intermediate multiples of 128, the group a multiple
of 32 (a lane's 32 inputs share a scale), ``rows`` a multiple of 16. The reference is float64
NumPy (``tests/test_moe_expert_mma_emulation.py``; the MMA emulated with warp shuffles).
"""

from __future__ import annotations

from tvm import tirx

from ..errors import UsageError
from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .moe_decode_cuda import MoeDecodeShape
from .tiles import MmaTiles, tuned

__all__ = [
    "DECODE_GEMM_MOE",
    "GROUP_TOKENS",
    "MMA_TOKENS",
    "decode_gemm_expert_major",
    "down_expert_mma_kernel",
    "expert_mma_unsupported",
    "gate_up_expert_mma_kernel",
    "moe_down_expert_mma",
    "moe_gate_up_expert_mma",
]

GROUP_TOKENS = 32  # tokens planned together by default (``MmaTiles.tokens``)
MMA_TOKENS = 8  # pairs of a chunk by default (``MmaTiles.chunk``): the MMA's N
_CHUNKS = (8, 16, 32)  # chunks of one, two or four n-tiles
DECODE_GEMM_MOE = ("grouped", "expert_major")  # DecodeGemmTiles.moe


def decode_gemm_expert_major() -> bool:
    """Whether ``batch_decode_gemm`` runs a MoE layer's experts through these kernels (where they
    take its shape) rather than the grouped GEMMs: the tile table's ``decode_gemm`` entry."""
    moe = tuned("decode_gemm").moe
    if moe not in DECODE_GEMM_MOE:
        raise UsageError(
            f"decode_gemm tiles: moe={moe!r} is not one of {DECODE_GEMM_MOE} (schedules/tiles.py)"
        )
    return moe == "expert_major"


_RUN = 128  # inputs a warp's 4 lanes of a row cover per uint4 a lane (16 bytes)
_SHARED_LIMIT = 227 * 1024  # an sm_90 block's shared memory (dynamic past 48 KB)


def plan_bytes(s: MoeDecodeShape, tiles: MmaTiles) -> int:
    """Bytes of a block's plan (:func:`plan_source`) with ``tiles``' warps and tokens."""
    e, k, g = s.experts, s.top_k, tiles.tokens
    return _id_bytes(s) * g * k + 2 * tiles.warps * e + 12 * (e + 2) + 4 * g * (k + 1) + 16


def _id_bytes(s: MoeDecodeShape) -> int:
    """Bytes of an expert id in the plan's copy of ``ids`` (a byte below 255 experts)."""
    return 1 if s.experts < 255 else 2


def _stride(width: int) -> int:
    """Words (half2) of a staged row of ``width`` values: padded to 2 mod 32 (conflict-free B)."""
    return width // 2 + (2 - width // 2) % 32


def expert_mma_unsupported(s: MoeDecodeShape, tiles: MmaTiles | None = None) -> str | None:
    """Why these kernels cannot run shape ``s`` with ``tiles`` (None: they can; ``tiles`` None:
    both kernels with the tiles of ``schedules/tiles.py``)."""
    if tiles is None:
        return expert_mma_unsupported(s, tuned("moe_expert_mma_gate_up")) or (
            expert_mma_unsupported(s, tuned("moe_expert_mma_down"))
        )
    if tiles.warps < 1 or tiles.blocks < 1 or tiles.rows < 16 or tiles.rows % 16:
        return f"bad tiles {tiles}"
    if tiles.depth < 1 or (tiles.depth > 1 and _parts(tiles) > 1):
        return f"depth {tiles.depth} needs 1 <= depth, and depth 1 with a K split ({tiles})"
    if tiles.run not in (_RUN, 2 * _RUN):
        return f"run {tiles.run} is not {_RUN} or {2 * _RUN}"
    if tiles.chunk not in _CHUNKS:
        return f"chunk {tiles.chunk} is not one of {_CHUNKS} pairs"
    if tiles.stage_k and (tiles.stage_k < 0 or tiles.stage_k % tiles.run):
        return f"stage_k {tiles.stage_k} is not 0 or a positive multiple of the run ({tiles.run})"
    if tiles.stage_k and (tiles.depth > 1 or _parts(tiles) > 1):
        return (
            f"stage_k {tiles.stage_k} (activations staged in K slices) needs depth 1 and no K "
            f"split: rows {tiles.rows} of at least {16 * tiles.warps} ({tiles})"
        )
    if tiles.tokens < 32 or tiles.tokens % 32 or tiles.tokens * (s.top_k + 1) > 32767:
        return (
            f"tokens {tiles.tokens} is not a positive multiple of 32 whose {s.top_k + 1} pairs a "
            "token a plan's 16-bit indices can count (tokens * (top_k + 1) <= 32767)"
        )
    for name, dim in (("hidden", s.hidden), ("inter", s.inter), ("shared", s.shared_inter)):
        if dim <= 0 or dim % _RUN:
            return f"{name} {dim} is not a positive multiple of {_RUN}"
        if dim % tiles.run and _parts(tiles) > 1:
            return f"{name} {dim} leaves a tail of the run ({tiles.run}), which needs no K split"
    if s.group % 32 or s.hidden % s.group or s.inter % s.group or s.shared_inter % s.group:
        return f"group {s.group} is not a multiple of 32 dividing every width"
    widest = max(s.hidden, s.inter, s.shared_inter)
    plan = plan_bytes(s, tiles)
    if plan + 1024 > 48 * 1024:
        return (
            f"the plan of {tiles.tokens} tokens ({plan} bytes at {s.experts} experts, top-"
            f"{s.top_k}, {tiles.warps} warps) does not fit a block's 48 KB of static shared memory"
        )
    if _smem_bytes(tiles, widest, 2) + plan + 256 > _SHARED_LIMIT:
        return (
            f"{tiles.chunk} staged rows of {widest} fp16 values and the plan of {tiles.tokens} "
            f"tokens ({plan} bytes) do not fit in shared memory ({_SHARED_LIMIT} bytes)"
        )
    return None


def plan_source(s: MoeDecodeShape, tag: str, tiles: MmaTiles) -> str:
    """CUDA: the plan (module docstring) and the item lookup, for the block of ``tiles``."""
    E, K, GT, W = s.experts, s.top_k, tiles.tokens, tiles.warps
    T, bits, per = 32 * W, E.bit_length(), -(-(E + 1) // 32)
    id_t = "unsigned char" if _id_bytes(s) == 1 else "unsigned short"
    return f"""
#ifndef DSV2_EM_PLAN_{tag}
#define DSV2_EM_PLAN_{tag}
struct dsv2_em_plan_{tag} {{
  {id_t} ids[{GT * K}];  // the group's ids (>= {E}: no expert)
  short wcnt[{W * E}];  // [warp][e]: expert e's pairs in the warp's segment, then its first rank
  int cnt[{E + 1}];   // pairs of expert e (e = {E}: the shared experts, one a token)
  int off[{E + 2}];   // expert e's first pair in pair[]
  int coff[{E + 2}];  // expert e's first chunk
  short pair[{GT * (K + 1)}];  // local token * {K + 1} + slot, expert by expert
  short expert[{GT * (K + 1)}];  // chunk -> its expert
}};
__device__ __forceinline__ unsigned dsv2_em_popc_{tag}(unsigned v) {{
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}}
// the lanes whose e equals this lane's (e in [-1, {E}); -1, all {bits} bits set, is no expert):
// {bits} ballots, one a bit of e
__device__ __forceinline__ unsigned dsv2_em_peers_{tag}(int e) {{
  unsigned m = 0xffffffffu;
#pragma unroll
  for (int b = 0; b < {bits}; ++b) {{
    const unsigned v = __ballot_sync(0xffffffffu, (e >> b) & 1);
    m &= (e >> b) & 1 ? v : ~v;
  }}
  return m;
}}
// the plan of tokens [t0, t0 + nt) (every thread of the block; ends with a barrier). Warp w
// takes the w-th contiguous segment of the nt * {K} pairs, 32 at a time: the lanes of one expert
// (dsv2_em_peers) are counted by the lowest of them (pass 1), then each lane takes the expert's
// offset + the warp's first rank + its rank among them (pass 2): (token, slot) order, the same
// plan in every block, no atomics.
__device__ __forceinline__ void dsv2_em_plan_build_{tag}(dsv2_em_plan_{tag}& P,
    const int* __restrict__ ids, long long t0, int nt, int tm, int tid) {{
  const int warp = tid >> 5, lane = tid & 31;
  const unsigned below = (1u << lane) - 1u;
  const int* __restrict__ gid = ids + t0 * {K};
  const int seg = (nt * {K} + {W - 1}) / {W};
  const int lo = min(nt * {K}, warp * seg), hi = min(nt * {K}, lo + seg);
  for (int i = tid; i < nt * {K}; i += {T}) {{
    const int v = gid[i];
    P.ids[i] = ({id_t})(v >= 0 && v < {E} ? v : {E});
  }}
  for (int i = tid; i < {W * E}; i += {T}) P.wcnt[i] = 0;
  __syncthreads();
  for (int b = lo; b < hi; b += 32) {{
    const int p = b + lane;
    const int v = p < hi ? P.ids[p] : {E};
    const int e = v < {E} ? v : -1;
    const unsigned m = dsv2_em_peers_{tag}(e);
    if (e >= 0 && !(m & below)) P.wcnt[warp * {E} + e] += dsv2_em_popc_{tag}(m);
  }}
  __syncthreads();
  for (int e = tid; e < {E}; e += {T}) {{  // expert e: exclusive scan over the warps
    int c = 0;
    for (int v = 0; v < {W}; ++v) {{
      const int k = P.wcnt[v * {E} + e];
      P.wcnt[v * {E} + e] = (short)c;
      c += k;
    }}
    P.cnt[e] = c;
  }}
  if (tid == 0) P.cnt[{E}] = nt;
  __syncthreads();
  if (warp == 0) {{  // off, coff: lane l scans experts [{per} l, {per} l + {per}), then the warp
    const int e0 = min({E + 1}, {per} * lane), e1 = min({E + 1}, e0 + {per});
    int o = 0, ch = 0;
    for (int e = e0; e < e1; ++e) {{
      o += P.cnt[e];
      ch += (P.cnt[e] + tm - 1) / tm;
    }}
    int oi = o, ci = ch;  // inclusive sums over the lanes
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {{
      const int po = __shfl_sync(0xffffffffu, oi, (lane - d) & 31);
      const int pc = __shfl_sync(0xffffffffu, ci, (lane - d) & 31);
      if (lane >= d) {{
        oi += po;
        ci += pc;
      }}
    }}
    o = oi - o;
    ch = ci - ch;
    for (int e = e0; e < e1; ++e) {{
      P.off[e] = o;
      P.coff[e] = ch;
      o += P.cnt[e];
      ch += (P.cnt[e] + tm - 1) / tm;
    }}
    if (lane == 31) {{
      P.off[{E + 1}] = oi;
      P.coff[{E + 1}] = ci;
    }}
  }}
  __syncthreads();
  for (int b = lo; b < hi; b += 32) {{
    const int p = b + lane;
    const int v = p < hi ? P.ids[p] : {E};
    const int e = v < {E} ? v : -1;
    const unsigned m = dsv2_em_peers_{tag}(e);
    if (e >= 0)
      P.pair[P.off[e] + P.wcnt[warp * {E} + e] + dsv2_em_popc_{tag}(m & below)] =
          (short)((p / {K}) * {K + 1} + p % {K});
    __syncwarp();
    if (e >= 0 && !(m & below)) P.wcnt[warp * {E} + e] += dsv2_em_popc_{tag}(m);
    __syncwarp();
  }}
  for (int t = tid; t < nt; t += {T}) P.pair[P.off[{E}] + t] = (short)(t * {K + 1} + {K});
  for (int e = tid; e <= {E}; e += {T})
    for (int c = P.coff[e]; c < P.coff[e + 1]; ++c) P.expert[c] = (short)e;
  __syncthreads();
}}
// items: the routed chunks x rbr row blocks, then the shared chunks x rbs
__device__ __forceinline__ int dsv2_em_items_{tag}(const dsv2_em_plan_{tag}& P, int rbr, int rbs) {{
  return P.coff[{E}] * rbr + (P.coff[{E + 1}] - P.coff[{E}]) * rbs;
}}
// item i -> its expert e, chunk c, row block rb, first pair and pair count
__device__ __forceinline__ void dsv2_em_item_{tag}(const dsv2_em_plan_{tag}& P, int i, int rbr,
    int rbs, int tm, int& e, int& c, int& rb, int& first, int& np) {{
  if (i < P.coff[{E}] * rbr) {{
    c = i / rbr;
    rb = i - c * rbr;
    e = P.expert[c];
  }} else {{
    const int j = i - P.coff[{E}] * rbr;
    c = P.coff[{E}] + j / rbs;
    rb = j - (j / rbs) * rbs;
    e = {E};
  }}
  first = P.off[e] + (c - P.coff[e]) * tm;
  np = min(tm, P.off[e] + P.cnt[e] - first);
}}
#endif
"""


def items_head(tag: str, tm: int, blocks: int, tokens: int) -> str:
    """CUDA: the loop heads both kernels share, over the groups of ``tokens`` tokens (the plan
    of each) and the block's items (``e, c, rb, first, np`` of item ``i``; ``rbr`` / ``rbs`` row
    blocks of a routed / shared chunk declared before)."""
    return f"""  for (long long t0 = 0; t0 < n; t0 += {tokens}) {{
    const int nt = n - t0 < {tokens} ? (int)(n - t0) : {tokens};
    dsv2_em_plan_build_{tag}(P, ids, t0, nt, {tm}, tid);
    const int items = dsv2_em_items_{tag}(P, rbr, rbs);
    // an even share of the items: blocks differ by one item at most
    const int i1 = (int)((long long)(blk + 1) * items / {blocks});
    int staged = -1;
    for (int i = (int)((long long)blk * items / {blocks}); i < i1; ++i) {{
      int e, c, rb, first, np;
      dsv2_em_item_{tag}(P, i, rbr, rbs, {tm}, e, c, rb, first, np);
"""


def _mma_source() -> str:
    """CUDA: ``dsv2_mma16816(c, a, b)`` (``c += A B``, fp16 in, fp32 accumulators; off the GPU
    the emulation's ``dsv2_emu_mma16816``), ``dsv2_emm_deq8(q, scale, hv)`` (a word's 8 nibbles as
    the pairs ``(n0, n4) .. (n3, n7)`` minus 8, times ``scale``) and ``dsv2_emm_stage`` (a staged
    row)."""
    return """
#ifndef DSV2_EMM_MMA
#define DSV2_EMM_MMA
__device__ __forceinline__ void dsv2_mma16816(float* c, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  dsv2_emu_mma16816(c, a, b);
#endif
}
__device__ __forceinline__ unsigned dsv2_emm_h2u(__half2 v) {
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ __half2 dsv2_emm_u2h(unsigned v) {
  return *reinterpret_cast<__half2*>(&v);
}
__device__ __forceinline__ void dsv2_emm_deq8(unsigned q, __half2 scale, unsigned* hv) {
  const unsigned q8 = q >> 8;
  const __half2 lo_b = dsv2_emm_u2h(0x64086408u), hi_m = dsv2_emm_u2h(0x2c002c00u);
  const __half2 hi_b = dsv2_emm_u2h(0xd480d480u);
  hv[0] = dsv2_emm_h2u(__hmul2(__hsub2(dsv2_emm_u2h((q & 0x000f000fu) | 0x64006400u), lo_b),
                                scale));
  hv[1] = dsv2_emm_h2u(__hmul2(__hfma2(dsv2_emm_u2h((q & 0x00f000f0u) | 0x64006400u), hi_m,
                                        hi_b), scale));
  hv[2] = dsv2_emm_h2u(__hmul2(__hsub2(dsv2_emm_u2h((q8 & 0x000f000fu) | 0x64006400u), lo_b),
                                scale));
  hv[3] = dsv2_emm_h2u(__hmul2(__hfma2(dsv2_emm_u2h((q8 & 0x00f000f0u) | 0x64006400u), hi_m,
                                        hi_b), scale));
}
// 8 values of a row into its staged copy (pair order), 8-byte stores: `dst` word 4 v
__device__ __forceinline__ void dsv2_emm_stage(unsigned* dst, uint4 v) {
  const uint4 p = dsv2_pair8(v);
  reinterpret_cast<uint2*>(dst)[0] = make_uint2(p.x, p.y);
  reinterpret_cast<uint2*>(dst)[1] = make_uint2(p.z, p.w);
}
#endif
"""


def _tile_loop(
    rows_words: str,
    width: int,
    tiles_a: int,
    group: int,
    depth: int = 1,
    words: int = 1,
    ntiles: int = 1,
) -> str:
    """CUDA: the K loop of a warp's 16-row tile over the runs ``[g0, g1)`` (``128 words`` of
    ``width`` inputs each) for ``tiles_a`` A tiles (gate and up: 2; down: 1) sharing each B
    fragment, then, where ``width`` is not a multiple of the run, its last 128 inputs (the
    *tail*, loaded before the loop; only without a K split). Expects ``wr[m]`` (tile m's row
    ``g`` words; row ``g + 8`` is ``rows_words`` further on), ``sr[m]`` (its scales, ``width /
    group`` a row), ``xs`` (the staged rows, ``XS`` words each), ``acc[m * ntiles + j][4]``,
    ``g``, ``t``, ``g0``, ``g1`` (compile-time constants for ``depth`` > 1: :func:`_ring_loop`);
    ``ntiles``: n-tiles of 8 staged rows each A fragment serves."""
    loop = (
        _ring_loop(rows_words, width, tiles_a, group, depth, words, ntiles)
        if depth > 1
        else _pair_loop(rows_words, width, tiles_a, group, words, ntiles)
    )
    start = width - width % (_RUN * words)
    if start == width:
        return loop
    return f"""
        uint4 tq[{tiles_a}][2][1];
        __half2 ts[{tiles_a}][2][1];
        {{
{_load_lambda(rows_words, width, tiles_a, group, 1, f"{start} + t * 32")}          load(0, tq, ts);
        }}
{loop}        {{
{_mma_run(tiles_a, "tq", "ts", 1, f"{start // 2} + t * 16", ntiles)}        }}
"""


def _pair_loop(
    rows_words: str, width: int, tiles_a: int, group: int, words: int, ntiles: int = 1
) -> str:
    """CUDA: :func:`_tile_loop`'s runs with the next run's words in flight (two buffers)."""
    return f"""
        uint4 wq[{tiles_a}][2][{words}], nq[{tiles_a}][2][{words}];
        __half2 sc[{tiles_a}][2][{words}], ns[{tiles_a}][2][{words}];
{_load_lambda(rows_words, width, tiles_a, group, words)}        if (g0 < g1) load(g0, wq, sc);
        for (int gi = g0; gi < g1; ++gi) {{
          if (gi + 1 < g1) load(gi + 1, nq, ns);
{_mma_run(tiles_a, "wq", "sc", words, None, ntiles)}          if (gi + 1 < g1) {{
#pragma unroll
            for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
              for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int u = 0; u < {words}; ++u) {{
                  wq[m][h][u] = nq[m][h][u];
                  sc[m][h][u] = ns[m][h][u];
                }}
          }}
        }}
"""


def _load_lambda(
    rows_words: str, width: int, tiles_a: int, group: int, words: int, first: str | None = None
) -> str:
    """CUDA: ``load(gi, q, sv)``, a lane's ``words`` uint4 (32 inputs each: one scale) of run
    ``gi`` for its two rows of each of the ``tiles_a`` A tiles; ``first``: the lane's first input
    (default: its share of run ``gi``)."""
    bufs = f"uint4 (&q)[{tiles_a}][2][{words}], __half2 (&sv)[{tiles_a}][2][{words}]"
    first = first or f"gi * {_RUN * words} + t * {32 * words}"
    return f"""        auto load = [&](int gi, {bufs}) {{
#pragma unroll
          for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int u = 0; u < {words}; ++u) {{
                const int col = {first} + 32 * u;
                const long long row = (long long)h * 8;
                q[m][h][u] =
                    reinterpret_cast<const uint4*>(wr[m] + row * {rows_words} + col / 8)[0];
                sv[m][h][u] = __half2half2(sr[m][row * {width // group} + col / {group}]);
              }}
        }};
"""


def _mma_run(
    tiles_a: int,
    q: str,
    sc: str,
    words: int,
    span: str | None = None,
    ntiles: int = 1,
    base: str = "xs",
) -> str:
    """CUDA: the MMAs of a run with the words ``q`` and scales ``sc`` (``[tiles_a][2][words]``):
    a lane's ``32 words`` inputs from its staged word ``span`` (default: its share of run ``gi``
    at ``[t * 32 words, (t + 1) * 32 words)``), 8 a word; with ``ntiles`` > 1 each A fragment
    serves that many n-tiles of 8 staged rows (``acc[m * ntiles + j]``: A tile m, n-tile j);
    ``base``: the staged rows."""
    span = span or f"gi * {_RUN // 2 * words} + t * {16 * words}"
    if ntiles > 1:
        return _mma_run_tiles(tiles_a, q, sc, words, span, ntiles, base)
    return f"""          const unsigned* xb = {base} + g * XS + {span};
#pragma unroll
          for (int i = 0; i < {4 * words}; ++i) {{
            unsigned hv[{tiles_a}][2][4];
#pragma unroll
            for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                dsv2_emm_deq8(reinterpret_cast<const unsigned*>(&{q}[m][h][i / 4])[i % 4],
                              {sc}[m][h][i / 4], hv[m][h]);
#pragma unroll
            for (int p = 0; p < 2; ++p) {{
              const uint2 bx = reinterpret_cast<const uint2*>(xb + 4 * i + 2 * p)[0];
              const unsigned b[2] = {{bx.x, bx.y}};
#pragma unroll
              for (int m = 0; m < {tiles_a}; ++m) {{
                const unsigned a[4] = {{hv[m][0][2 * p], hv[m][1][2 * p], hv[m][0][2 * p + 1],
                                       hv[m][1][2 * p + 1]}};
                dsv2_mma16816(acc[m], a, b);
              }}
            }}
          }}
"""


def _mma_run_tiles(
    tiles_a: int, q: str, sc: str, words: int, span: str, ntiles: int, base: str = "xs"
) -> str:
    """CUDA: :func:`_mma_run` of ``ntiles`` n-tiles (the B fragments of n-tile j from staged
    rows ``8 j .. 8 j + 7``)."""
    return f"""          const unsigned* xb = {base} + g * XS + {span};
#pragma unroll
          for (int i = 0; i < {4 * words}; ++i) {{
            unsigned hv[{tiles_a}][2][4];
#pragma unroll
            for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                dsv2_emm_deq8(reinterpret_cast<const unsigned*>(&{q}[m][h][i / 4])[i % 4],
                              {sc}[m][h][i / 4], hv[m][h]);
#pragma unroll
            for (int p = 0; p < 2; ++p) {{
              unsigned b[{ntiles}][2];
#pragma unroll
              for (int j = 0; j < {ntiles}; ++j) {{
                const uint2 bx =
                    reinterpret_cast<const uint2*>(xb + j * 8 * XS + 4 * i + 2 * p)[0];
                b[j][0] = bx.x;
                b[j][1] = bx.y;
              }}
#pragma unroll
              for (int m = 0; m < {tiles_a}; ++m) {{
                const unsigned a[4] = {{hv[m][0][2 * p], hv[m][1][2 * p], hv[m][0][2 * p + 1],
                                       hv[m][1][2 * p + 1]}};
#pragma unroll
                for (int j = 0; j < {ntiles}; ++j) dsv2_mma16816(acc[m * {ntiles} + j], a, b[j]);
              }}
            }}
          }}
"""


def _ring_loop(
    rows_words: str, width: int, tiles_a: int, group: int, depth: int, words: int, ntiles: int = 1
) -> str:
    """CUDA: :func:`_tile_loop`'s runs with ``depth`` in flight: a ring of ``depth + 1`` register
    buffers, the loop over the compile-time runs ``[g0, g1)`` fully unrolled so that every ring
    index is a constant."""
    slots = depth + 1
    run = _mma_run(
        tiles_a, f"wq[(gi - g0) % {slots}]", f"sc[(gi - g0) % {slots}]", words, None, ntiles
    )
    return f"""
        uint4 wq[{slots}][{tiles_a}][2][{words}];
        __half2 sc[{slots}][{tiles_a}][2][{words}];
{_load_lambda(rows_words, width, tiles_a, group, words)}#pragma unroll
        for (int d = 0; d < {depth}; ++d)
          if (g0 + d < g1) load(g0 + d, wq[d], sc[d]);
#pragma unroll
        for (int gi = g0; gi < g1; ++gi) {{
          if (gi + {depth} < g1) load(gi + {depth}, wq[(gi - g0 + {depth}) % {slots}],
                                    sc[(gi - g0 + {depth}) % {slots}]);
{run}        }}
"""


def _parts(tiles: MmaTiles) -> int:
    """Warps a 16-row tile's runs of 128 inputs are split among: 1 unless an item has fewer
    tiles than the block has warps."""
    return max(1, tiles.warps // (tiles.rows // 16))


def _units(
    first: str, last: str, tiles: MmaTiles, runs: int, tiles_a: int, body: str, emit: str
) -> str:
    """CUDA: an item's rows ``[first, last)`` as 16-row tiles, a warp each; with fewer tiles than
    warps (:func:`_parts` > 1) each tile's ``runs`` runs of 128 inputs split among the warps
    (``g0``, ``g1``), their accumulators summed through shared memory (``red``) in a fixed order.
    ``body`` computes ``acc`` for the tile at row ``r``; ``emit`` writes ``acc`` of that tile
    (``tiles_a`` A tiles x ``tiles.ntiles`` n-tiles of accumulators)."""
    W, parts = tiles.warps, _parts(tiles)
    tiles_a *= tiles.ntiles
    if parts == 1:
        return f"""      for (int u = warp; u < ({last} - {first}) / 16; u += {W}) {{
        const int r = {first} + 16 * u;
        constexpr int g0 = 0, g1 = {runs};
        float acc[{tiles_a}][4] = {{}};
{body}
{emit}
      }}
"""
    per = tiles_a * 4 * 32
    return f"""      {{
        const int nt = ({last} - {first}) / 16;  // (nt * {parts} <= {W})
        for (int u = warp; u < nt * {parts}; u += {W}) {{
          const int r = {first} + 16 * (u % nt), kp = u / nt;
          const int g0 = kp * {runs} / {parts}, g1 = (kp + 1) * {runs} / {parts};
          float acc[{tiles_a}][4] = {{}};
{body}
#pragma unroll
          for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) red[u * {per} + (m * 4 + j) * 32 + lane] = acc[m][j];
        }}
        __syncthreads();  // the first warp of each tile sums its parts in order
        for (int u = warp; u < nt; u += {W}) {{
          const int r = {first} + 16 * u;
          float acc[{tiles_a}][4];
#pragma unroll
          for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) {{
              float v = 0.f;
              for (int kp = 0; kp < {parts}; ++kp)
                v += red[(kp * nt + u) * {per} + (m * 4 + j) * 32 + lane];
              acc[m][j] = v;
            }}
{emit}
        }}
        __syncthreads();  // red is the next item's
      }}
"""


def _copy_source() -> str:
    """CUDA: ``dsv2_emm_cp16(dst, src)`` (16 bytes of a row into a staged row as two 8-byte
    copies: a padded row is 8-byte aligned; ``cp.async`` on the GPU, a plain copy off it),
    ``dsv2_emm_cp_wait()`` (this thread's copies landed) and ``dsv2_emm_pair_in_place(p)`` (a
    16-byte piece this thread copied, into pair order)."""
    return """
#ifndef DSV2_EMM_CP
#define DSV2_EMM_CP
__device__ __forceinline__ void dsv2_emm_cp16(unsigned* dst, const uint4* src) {
#if defined(__CUDA_ARCH__)
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  const char* p = reinterpret_cast<const char*>(src);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\\n" ::"r"(d), "l"(p));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\\n" ::"r"(d + 8), "l"(p + 8));
#else
  const uint2* s2 = reinterpret_cast<const uint2*>(src);
  reinterpret_cast<uint2*>(dst)[0] = s2[0];
  reinterpret_cast<uint2*>(dst)[1] = s2[1];
#endif
}
__device__ __forceinline__ void dsv2_emm_cp_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_all;\\n" ::: "memory");
#endif
}
__device__ __forceinline__ void dsv2_emm_pair_in_place(unsigned* p) {
  const uint2 a = reinterpret_cast<const uint2*>(p)[0];
  const uint2 b = reinterpret_cast<const uint2*>(p)[1];
  uint4 v;
  v.x = a.x;
  v.y = a.y;
  v.z = b.x;
  v.w = b.y;
  dsv2_emm_stage(p, v);
}
#endif
"""


def _sliced_units(
    first: str,
    last: str,
    tiles: MmaTiles,
    width: int,
    tiles_a: int,
    group: int,
    rows: str,
    src_row: str,
    emit: str,
) -> str:
    """CUDA: an item's rows ``[first, last)`` as 16-row tiles with the chunk's activations staged
    in slices of ``tiles.stage_k`` inputs (of ``width``): in rounds of a tile a warp (every warp
    at every barrier, some without a tile), slice ``sl + 1`` copied into buffer ``(sl + 1) & 1``
    (``cp.async``) while the warps multiply slice ``sl``, then put in pair order by the threads
    that copied it, one barrier a slice. The weights of the next run are loaded before this run's
    MMAs, across slices; a width that is an odd number of 128 with runs of 256 ends its last
    slice with a run of 128 (the tail, loaded first). ``rows``: CUDA declaring ``wr``, ``sr``
    for the tile at row ``r`` (:func:`_tile_loop`); ``src_row``: the ``const half*`` row of the
    chunk's pair ``k``; ``emit`` writes ``acc``."""
    W, TM, NT, SK, words = tiles.warps, tiles.chunk, tiles.ntiles, tiles.stage_k, tiles.words
    T, run = 32 * W, tiles.run
    slices, runs, rps = -(-width // SK), width // run, SK // run
    tail = width - runs * run  # 0 or 128
    last_sl = slices - 1
    t_span = f"{(width - tail - last_sl * SK) // 2} + t * 16"
    tail_load = tail_mma = ""
    if tail:
        tail_load = f"""          uint4 tq[{tiles_a}][2][1];
          __half2 ts[{tiles_a}][2][1];
          {{
  {_load_lambda(str(width // 8), width, tiles_a, group, 1, f"{width - tail} + t * 32")}
            if (act) load(0, tq, ts);
          }}
"""
        tail_mma = f"""            if (sl == {last_sl}) {{
{_mma_run(tiles_a, "tq", "ts", 1, t_span, NT, "xb0")}            }}
"""
    load = _load_lambda(str(width // 8), width, tiles_a, group, words)
    span = f"(gi - sl * {rps}) * {64 * words} + t * {16 * words}"
    mma = _mma_run(tiles_a, "wq", "sc", words, span, NT, "xb0")
    pieces = f"""        const int c0 = sl * {SK // 8}, sw = min({SK // 8}, {width // 8} - c0);
        for (int v = tid; v < np * sw; v += {T}) {{
          const int k = v / sw, q = v - k * sw;"""
    return f"""      {{
        auto stage = [&](int sl, unsigned* buf) {{  // the raw 16-byte pieces of slice sl
{pieces}
          const half* row = {src_row};
          dsv2_emm_cp16(buf + k * XS + 4 * q, reinterpret_cast<const uint4*>(row) + c0 + q);
        }}
      }};
      auto pair = [&](int sl, unsigned* buf) {{  // this thread's pieces into pair order
        dsv2_emm_cp_wait();
{pieces}
          dsv2_emm_pair_in_place(buf + k * XS + 4 * q);
        }}
      }};
      const int nu = ({last} - {first}) / 16;
      for (int u0 = 0; u0 < nu; u0 += {W}) {{  // a round: a tile a warp
        const bool act = u0 + warp < nu;
        const int r = {first} + 16 * (act ? u0 + warp : 0);
        float acc[{tiles_a * NT}][4] = {{}};
{rows}
        uint4 wq[{tiles_a}][2][{words}], nq[{tiles_a}][2][{words}];
        __half2 sc[{tiles_a}][2][{words}], ns[{tiles_a}][2][{words}];
{load}{tail_load}        if (act && {runs} > 0) load(0, wq, sc);
        stage(0, xs);
        pair(0, xs);
        __syncthreads();
#pragma unroll 1
        for (int sl = 0; sl < {slices}; ++sl) {{
          if (sl + 1 < {slices}) stage(sl + 1, xs + ((sl + 1) & 1) * {TM} * XS);
          if (act) {{
            const unsigned* xb0 = xs + (sl & 1) * {TM} * XS;
            const int ge = min({runs}, (sl + 1) * {rps});
            for (int gi = sl * {rps}; gi < ge; ++gi) {{
              if (gi + 1 < {runs}) load(gi + 1, nq, ns);
{mma}              if (gi + 1 < {runs}) {{
#pragma unroll
                for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
                  for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int u = 0; u < {words}; ++u) {{
                      wq[m][h][u] = nq[m][h][u];
                      sc[m][h][u] = ns[m][h][u];
                    }}
              }}
            }}
{tail_mma}          }}
          if (sl + 1 < {slices}) pair(sl + 1, xs + ((sl + 1) & 1) * {TM} * XS);
          __syncthreads();  // slice sl + 1 staged; buffer sl & 1 is the next slice's
        }}
        if (act) {{
{emit}
        }}
      }}
      }}
"""


def _smem_bytes(tiles: MmaTiles, width: int, tiles_a: int) -> int:
    """Shared memory besides the plan: the chunk's staged rows of ``width`` values, then (with a
    K split) its partial accumulators (``tiles_a`` A tiles x the n-tiles, a float per lane and
    fragment, per warp); with ``stage_k``, two buffers of the chunk's rows of a slice."""
    if tiles.stage_k:  # two slice buffers (no K split)
        return 8 * tiles.chunk * _stride(tiles.stage_k)
    red = 4 * tiles.warps * tiles_a * tiles.ntiles * 4 * 32 if _parts(tiles) > 1 else 0
    return 4 * tiles.chunk * _stride(width) + red


def _dyn_request(s: MoeDecodeShape, tiles: MmaTiles, width: int, tiles_a: int) -> int:
    """Dynamic shared memory to ask for: none where the block's shared memory fits the static 48
    KB, else :func:`_smem_bytes` and at least 48 KB (TVM's launcher raises a kernel's dynamic
    limit only for requests of 48 KB and more)."""
    need = _smem_bytes(tiles, width, tiles_a)
    return 0 if need + plan_bytes(s, tiles) + 1024 <= 48 * 1024 else max(need, 48 * 1024)


def _head(name: str, params: str, tag: str, width: int, dyn: bool, red_floats: int, tm: int) -> str:
    """CUDA: a kernel's device function head: the plan, the staged rows ``xs`` and ``red`` (static,
    or in the module's fp16 dynamic shared memory with ``dyn``), the lane's fragment coordinates,
    the PDL wait."""
    XS = _stride(width)
    if dyn:
        smem = f"""half* __restrict__ smem_h,
    half* smem_end, long long n, int blk, int tid) {{
  __shared__ dsv2_em_plan_{tag} P;
  unsigned* xs = reinterpret_cast<unsigned*>(smem_h);  // [{tm}][XS], pair order
  float* red = reinterpret_cast<float*>(xs + {tm * XS});  // the K split's partials"""
    else:
        smem = f"""long long n, int blk, int tid) {{
  __shared__ dsv2_em_plan_{tag} P;
  __shared__ __align__(16) unsigned xs[{tm * XS}];  // [{tm}][XS], pair order
  __shared__ float red[{max(red_floats, 1)}];  // the K split's partials"""
    return f"""
__device__ __forceinline__ void {name}({params}, {smem}
  constexpr int XS = {XS};
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  (void)red;
  {WAIT_THEN_RELEASE}
"""


def gate_up_source(s: MoeDecodeShape, tiles: MmaTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of :func:`moe_gate_up_expert_mma`."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB, R = tiles.warps, tiles.blocks, tiles.rows
    T, TM, NT = 32 * W, tiles.chunk, tiles.ntiles
    tag = f"h{H}_i{NI}_s{IS}_e{E}_k{K}_g{G}_{tiles.name}_mma"
    name = f"dsv2_emm_gu_{tag}"
    total = K * NI + IS
    dyn = _dyn_request(s, tiles, H, 2) > 0
    red = (_smem_bytes(tiles, H, 2) - 4 * TM * _stride(H)) // 4
    params = """const half* __restrict__ x, const int* __restrict__ ids,
    const unsigned* __restrict__ w, const half* __restrict__ s, const unsigned* __restrict__ sw,
    const half* __restrict__ ss, half* __restrict__ hout"""
    rows = f"""          const unsigned* wr[2] = {{ew + (r + g) * {H // 8},
                                    ew + (r + up + g) * {H // 8}}};
          const half* sr[2] = {{es + (r + g) * {H // G}, es + (r + up + g) * {H // G}}};"""
    body = f"""{rows}
{_tile_loop(str(H // 8), H, 2, G, tiles.depth, tiles.words, NT)}"""
    emit = f"""#pragma unroll
            for (int j = 0; j < 4; ++j) {{  // row r + g (+ 8), pair 2 t (+ 1)
              const int k = 2 * t + (j & 1);
              if (k < np) {{
                const int pr = P.pair[first + k], tok = pr / {K + 1}, slot = pr - tok * {K + 1};
                const float gv = acc[0][j], uv = acc[1][j];
                hout[(t0 + tok) * {total} + slot * {NI} + r + g + 8 * (j >> 1)] =
                    __float2half(gv / (1.f + __expf(-gv)) * uv);
              }}
            }}"""
    if NT > 1:  # n-tile jn: pairs 8 jn .. 8 jn + 7 (acc[jn]: gate, acc[NT + jn]: up)
        emit = f"""#pragma unroll
            for (int jn = 0; jn < {NT}; ++jn)
#pragma unroll
              for (int j = 0; j < 4; ++j) {{  // row r + g (+ 8), pair 8 jn + 2 t (+ 1)
                const int k = 8 * jn + 2 * t + (j & 1);
                if (k < np) {{
                  const int pr = P.pair[first + k], tok = pr / {K + 1};
                  const int slot = pr - tok * {K + 1};
                  const float gv = acc[jn][j], uv = acc[{NT} + jn][j];
                  hout[(t0 + tok) * {total} + slot * {NI} + r + g + 8 * (j >> 1)] =
                      __float2half(gv / (1.f + __expf(-gv)) * uv);
                }}
              }}"""
    loop_head = items_head(tag, TM, NB, tiles.tokens)
    if tiles.stage_k:
        src_row = f"x + (t0 + P.pair[first + k] / {K + 1}) * {H}"
        units = _sliced_units("r0", "r1", tiles, H, 2, G, rows, src_row, emit)
        src = f"""
#ifndef DSV2_EMM_GU_{tag}
#define DSV2_EMM_GU_{tag}
{_head(name, params, tag, tiles.stage_k, dyn, 0, 2 * TM)}  // row blocks of a routed / shared chunk
  const int rbr = {-(-NI // R)}, rbs = {-(-IS // R)};
{loop_head}      (void)staged;  // every item stages its slices
      const bool sh = e == {E};
      const unsigned* ew = sh ? sw : w + (long long)e * {2 * NI * (H // 8)};
      const half* es = sh ? ss : s + (long long)e * {2 * NI * (H // G)};
      const long long up = sh ? {IS} : {NI};
      const int r0 = rb * {R}, r1 = min(sh ? {IS} : {NI}, r0 + {R});
{units}    }}
    __syncthreads();  // this group's plan is read no more
  }}
}}
#endif
"""
        head = dot32_source(16) + _mma_source() + _copy_source() + grid_wait_source()
        return name, head + plan_source(s, tag, tiles) + src
    src = f"""
#ifndef DSV2_EMM_GU_{tag}
#define DSV2_EMM_GU_{tag}
{_head(name, params, tag, H, dyn, red, TM)}  // row blocks of a routed / shared chunk
  const int rbr = {-(-NI // R)}, rbs = {-(-IS // R)};
{loop_head}      if (c != staged) {{  // the chunk's tokens' x rows, pair order
        __syncthreads();
        for (int v = tid; v < np * {H // 8}; v += {T}) {{
          const int k = v / {H // 8}, q = v - k * {H // 8};
          const uint4* row = reinterpret_cast<const uint4*>(
              x + (t0 + P.pair[first + k] / {K + 1}) * {H});
          dsv2_emm_stage(xs + k * XS + 4 * q, row[q]);
        }}
        __syncthreads();
        staged = c;
      }}
      const bool sh = e == {E};
      const unsigned* ew = sh ? sw : w + (long long)e * {2 * NI * (H // 8)};
      const half* es = sh ? ss : s + (long long)e * {2 * NI * (H // G)};
      const long long up = sh ? {IS} : {NI};
      const int r0 = rb * {R}, r1 = min(sh ? {IS} : {NI}, r0 + {R});
{_units("r0", "r1", tiles, H // tiles.run, 2, body, emit)}    }}
    __syncthreads();  // this group's plan and rows are read no more
  }}
}}
#endif
"""
    head = dot32_source(16) + _mma_source() + grid_wait_source()
    return name, head + plan_source(s, tag, tiles) + src


def down_source(s: MoeDecodeShape, tiles: MmaTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of :func:`moe_down_expert_mma`."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB, R = tiles.warps, tiles.blocks, tiles.rows
    T, TM, NT = 32 * W, tiles.chunk, tiles.ntiles
    tag = f"h{H}_i{NI}_s{IS}_e{E}_k{K}_g{G}_{tiles.name}_mma"
    name = f"dsv2_emm_dn_{tag}"
    total = K * NI + IS
    widest = max(NI, IS)
    dyn = _dyn_request(s, tiles, widest, 1) > 0
    red = (_smem_bytes(tiles, widest, 1) - 4 * TM * _stride(widest)) // 4
    params = """const half* __restrict__ h, const int* __restrict__ ids,
    const unsigned* __restrict__ w, const half* __restrict__ s, const unsigned* __restrict__ sw,
    const half* __restrict__ ss, float* __restrict__ part"""

    def rows(width: int) -> str:
        return f"""          const unsigned* wr[1] = {{ew + (long long)(r + g) * {width // 8}}};
          const half* sr[1] = {{es + (long long)(r + g) * {width // G}}};"""

    def body(width: int) -> str:
        return f"""{rows(width)}
{_tile_loop(str(width // 8), width, 1, G, tiles.depth, tiles.words, NT)}"""

    emit = f"""#pragma unroll
            for (int j = 0; j < 4; ++j) {{  // output r + g (+ 8), pair 2 t (+ 1)
              const int k = 2 * t + (j & 1);
              if (k < np) {{
                const int pr = P.pair[first + k], tok = pr / {K + 1}, slot = pr - tok * {K + 1};
                part[((t0 + tok) * {K + 1} + slot) * {H} + r + g + 8 * (j >> 1)] = acc[0][j];
              }}
            }}"""
    if NT > 1:  # n-tile jn: pairs 8 jn .. 8 jn + 7 (acc[jn])
        emit = f"""#pragma unroll
            for (int jn = 0; jn < {NT}; ++jn)
#pragma unroll
              for (int j = 0; j < 4; ++j) {{  // output r + g (+ 8), pair 8 jn + 2 t (+ 1)
                const int k = 8 * jn + 2 * t + (j & 1);
                if (k < np) {{
                  const int pr = P.pair[first + k], tok = pr / {K + 1};
                  const int slot = pr - tok * {K + 1};
                  part[((t0 + tok) * {K + 1} + slot) * {H} + r + g + 8 * (j >> 1)] = acc[jn][j];
                }}
              }}"""
    units = f"""      if (sh) {{
{_units("r0", "r1", tiles, IS // tiles.run, 1, body(IS), emit)}      }} else {{
{_units("r0", "r1", tiles, NI // tiles.run, 1, body(NI), emit)}      }}
"""
    if tiles.stage_k:
        src_row = (
            f"h + (t0 + P.pair[first + k] / {K + 1}) * {total} + "
            f"(P.pair[first + k] % {K + 1}) * {NI}"
        )
        units = f"""      if (sh) {{
{_sliced_units("r0", "r1", tiles, IS, 1, G, rows(IS), src_row, emit)}      }} else {{
{_sliced_units("r0", "r1", tiles, NI, 1, G, rows(NI), src_row, emit)}      }}
"""
        src = f"""
#ifndef DSV2_EMM_DN_{tag}
#define DSV2_EMM_DN_{tag}
{_head(name, params, tag, tiles.stage_k, dyn, 0, 2 * TM)}  const int rbr = {-(-H // R)}, rbs = rbr;
{items_head(tag, TM, NB, tiles.tokens)}      (void)staged;  // every item stages its slices
      const bool sh = e == {E};
      const unsigned* ew = sh ? sw : w + (long long)e * {H * (NI // 8)};
      const half* es = sh ? ss : s + (long long)e * {H * (NI // G)};
      const int r0 = rb * {R}, r1 = min({H}, r0 + {R});
{units}    }}
    __syncthreads();  // this group's plan is read no more
  }}
}}
#endif
"""
        head = dot32_source(16) + _mma_source() + _copy_source() + grid_wait_source()
        return name, head + plan_source(s, tag, tiles) + src
    src = f"""
#ifndef DSV2_EMM_DN_{tag}
#define DSV2_EMM_DN_{tag}
{_head(name, params, tag, widest, dyn, red, TM)}  const int rbr = {-(-H // R)}, rbs = rbr;
{items_head(tag, TM, NB, tiles.tokens)}      const bool sh = e == {E};
      const int width = sh ? {IS} : {NI};
      if (c != staged) {{  // the chunk's pairs' h slices, pair order
        __syncthreads();
        for (int v = tid; v < np * (width / 8); v += {T}) {{
          const int k = v / (width / 8), q = v - k * (width / 8);
          const int pr = P.pair[first + k], tok = pr / {K + 1}, slot = pr - tok * {K + 1};
          const uint4* row = reinterpret_cast<const uint4*>(h + (t0 + tok) * {total} + slot * {NI});
          dsv2_emm_stage(xs + k * XS + 4 * q, row[q]);
        }}
        __syncthreads();
        staged = c;
      }}
      const unsigned* ew = sh ? sw : w + (long long)e * {H * (NI // 8)};
      const half* es = sh ? ss : s + (long long)e * {H * (NI // G)};
      const int r0 = rb * {R}, r1 = min({H}, r0 + {R});
{units}    }}
    __syncthreads();  // this group's plan and rows are read no more
  }}
}}
#endif
"""
    head = dot32_source(16) + _mma_source() + grid_wait_source()
    return name, head + plan_source(s, tag, tiles) + src


def gate_up_params(s: MoeDecodeShape) -> list:
    """The gate/up kernel's buffers (``token_grid_call`` parameters)."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    return [
        ("x", (TOKENS, H), "float16"),
        ("ids", (TOKENS, K), "int32"),
        ("w", (E, 2 * NI, H // 8), "uint32"),
        ("s", (E, 2 * NI, H // G), "float16"),
        ("sw", (2 * IS, H // 8), "uint32"),
        ("ss", (2 * IS, H // G), "float16"),
        ("hout", (TOKENS, K * NI + IS), "float16"),
    ]


def down_params(s: MoeDecodeShape) -> list:
    """The down kernel's buffers (``token_grid_call`` parameters)."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    return [
        ("h", (TOKENS, K * NI + IS), "float16"),
        ("ids", (TOKENS, K), "int32"),
        ("w", (E, H, NI // 8), "uint32"),
        ("s", (E, H, NI // G), "float16"),
        ("sw", (H, IS // 8), "uint32"),
        ("ss", (H, IS // G), "float16"),
        ("part", (TOKENS, K + 1, H), "float32"),
    ]


def _check(s: MoeDecodeShape, tiles: MmaTiles) -> None:
    why = expert_mma_unsupported(s, tiles)
    if why is not None:
        raise ValueError(f"the expert-major MMA MoE kernels cannot take {s}: {why}")


def moe_gate_up_expert_mma(s: MoeDecodeShape) -> tirx.PrimFunc:
    """``f(x [n, H] fp16, ids [n, K] int32, w [E, 2I, H/8] uint32, s [E, 2I, H/G] fp16,
    sw [2Is, H/8] uint32, ss [2Is, H/G] fp16, hout [n, K*I + Is] fp16)``: the routed slots'
    and the shared experts' SwiGLU intermediates (the layout of the token-major kernels), every
    expert's rows read once for its tokens, on tensor cores (module docstring, 1.), with the
    tiles of ``schedules/tiles.py``."""
    return gate_up_expert_mma_kernel(s, tuned("moe_expert_mma_gate_up"))


def gate_up_expert_mma_kernel(s: MoeDecodeShape, tiles: MmaTiles) -> tirx.PrimFunc:
    """:func:`moe_gate_up_expert_mma` with the given ``tiles``."""
    _check(s, tiles)
    name, src = gate_up_source(s, tiles)
    return token_grid_call(
        "moe_expert_mma_gate_up",
        name,
        src,
        gate_up_params(s),
        tiles.blocks,
        32 * tiles.warps,
        per_token=False,
        dyn_shared_bytes=_dyn_request(s, tiles, s.hidden, 2),
        dyn_dtype="float16",
    )


def moe_down_expert_mma(s: MoeDecodeShape) -> tirx.PrimFunc:
    """``f(h [n, K*I + Is] fp16, ids [n, K] int32, w [E, H, I/8] uint32, s [E, H, I/G] fp16,
    sw [H, Is/8] uint32, ss [H, Is/G] fp16, part [n, K + 1, H] float32)``: each routed slot's
    down projection ``part[t, j] = down_{ids[t, j]} . h[t, j]`` and the shared experts'
    ``part[t, K]``, unweighted, in float32, on tensor cores (module docstring, 2.), with the
    tiles of ``schedules/tiles.py``."""
    return down_expert_mma_kernel(s, tuned("moe_expert_mma_down"))


def down_expert_mma_kernel(s: MoeDecodeShape, tiles: MmaTiles) -> tirx.PrimFunc:
    """:func:`moe_down_expert_mma` with the given ``tiles``."""
    _check(s, tiles)
    name, src = down_source(s, tiles)
    return token_grid_call(
        "moe_expert_mma_down",
        name,
        src,
        down_params(s),
        tiles.blocks,
        32 * tiles.warps,
        per_token=False,
        dyn_shared_bytes=_dyn_request(s, tiles, max(s.inter, s.shared_inter), 1),
        dyn_dtype="float16",
    )

"""The plan of the expert-major MoE decode kernels (:mod:`.moe_expert_mma_cuda`), as CUDA.

Every block of both kernels builds the same plan of a group of ``MmaTiles.tokens`` tokens in
shared memory: from ``ids [n, top_k]`` the (token, slot) pairs of every expert in (token, slot)
order, the shared experts as expert ``E`` with one pair (token, ``top_k``) per token, an expert's
pairs in chunks of at most ``MmaTiles.chunk``. Each warp counts then places the pairs of its
contiguous segment of ``ids``, 32 at a time, the lanes of one expert found by ballots over the
bits of its id, their ranks by popcounts (no atomics), with a scan over the warps and one over
the experts in between. The work items are (chunk, block of ``rows`` weight rows): the routed
chunks' first, expert by expert, then the shared chunks'; :func:`items_head` gives each block an
even, contiguous share of them.
"""

from __future__ import annotations

from .moe_decode_cuda import MoeDecodeShape
from .tiles import MmaTiles

__all__ = ["items_head", "plan_bytes", "plan_source"]


def plan_bytes(s: MoeDecodeShape, tiles: MmaTiles) -> int:
    """Bytes of a block's plan (:func:`plan_source`) with ``tiles``' warps and tokens."""
    e, k, g = s.experts, s.top_k, tiles.tokens
    return _id_bytes(s) * g * k + 2 * tiles.warps * e + 12 * (e + 2) + 4 * g * (k + 1) + 16


def _id_bytes(s: MoeDecodeShape) -> int:
    """Bytes of an expert id in the plan's copy of ``ids`` (a byte below 255 experts)."""
    return 1 if s.experts < 255 else 2


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

"""DeepSeekMoE decode of a batch on CUDA, expert-major: each expert the batch selects read once.

The fused decode kernels of :mod:`.moe_decode_cuda` are token-major: each token's blocks route it
and read its ``top_k`` routed experts and the shared ones, so a batch of ``n`` reads ``n`` x
(``top_k`` + shared) experts' weights a layer (a V2-Lite decode step costs ~0.5 ms more per
sequence on an H200: docs/benchmarks.md, "Decode batches"). The experts a batch selects overlap,
and the shared experts are every token's: here every expert's rows are read once for all the
tokens that chose it. Two kernels (after the router's ``moe_route``), each a fixed grid of
``blocks`` blocks of ``warps`` warps that loops over the tokens in groups of :data:`GROUP_TOKENS`:

1. **Plan** (every block, in shared memory, for its group of tokens): from ``ids [n, top_k]`` the
   (token, slot) pairs of every expert in (token, slot) order, the shared experts as expert ``E``
   with one pair (token, ``top_k``) per token; an expert's pairs in *chunks* of at most
   ``tokens``. The work items are (chunk, block of ``rows`` weight rows): the routed chunks'
   first, expert by expert, then the shared chunks'. Block ``b`` takes the contiguous run
   ``[b * items / blocks, (b + 1) * items / blocks)``, so consecutive items mostly share their
   chunk and the blocks' shares differ by one item at most.
2. :func:`moe_gate_up_expert_major`: per item, the chunk's tokens' ``x`` rows in shared memory
   (pair order, swizzled: :func:`~.decode_gemv_cuda.dot32_source`), then each warp a strided
   share of the item's rows: gate row ``r`` and up row ``r`` of the expert (the next row's loads
   issued before this row's dot products), for every pair of the chunk ``h[t, slot * I + r] =
   silu(gate_r . x_t) * (up_r . x_t)`` (shared experts: ``h[t, top_k * I + r]``), as
   :func:`~.moe_decode_cuda.moe_gate_up_decode` computes it: the same ``h`` layout, dot
   products and rounding.
3. :func:`moe_down_expert_major`: per item, the chunk's pairs' ``h`` slices in shared memory, then
   each warp a strided share of the item's output rows ``o``: ``part[t, slot, o] = down_o . h``
   in float32. Every (token, slot, output) is written by exactly one item, so the weighted sum
   ``out[t] = sum_j w[t, j] part[t, j] + part[t, top_k]`` (the model's, in float32, a fixed
   order) is deterministic: a CUDA graph's replay gives the eager step's bits.

**Status: a lab kernel, not in the model** (schedules/results/moe_decode.md, round 10). Wired as a
second decode entry point (the patch in ``docs/bench-results/kl15/expert_major/``) it is correct
(tiny configs against HF, graph replays bit-exact) and slower than the fused kernels at every
batch on an H200 (V2-Lite, batch 8: 90.6 + 115.9 us a layer; 1,065 against 1,615 tok/s; batch
31: 1,750 against 1,856): it runs ~640 instructions per weight row where the fused kernels run
~110, at 0.8 eligible warps per scheduler (Nsight Compute), so it never nears the bandwidth its
fewer bytes would allow. Rows are dequantised once per chunk (``dsv2_em_deq32``) and the chunk's
tokens unrolled, the gate/up blocks of 4 warps (147 registers), the down blocks of 8.

INT4 group weights as :mod:`dsv2_mlc.passes.quantize_int4` stores them (those of the fused
kernels: routed gate/up ``[E, 2I, H/8]`` with gate rows first, down ``[E, H, I/8]``, the shared
experts' fused gate/up ``[2Is, H/8]`` and down ``[H, Is/8]``, fp16 scales per ``group``). The
reference is float64 NumPy (``tests/test_moe_expert_major_emulation.py``); the kernels compute
the fused kernels' ``h`` and, but for the order of the float32 sums, their output.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .moe_decode_cuda import MoeDecodeShape

__all__ = [
    "DOWN_TILES",
    "GATE_UP_TILES",
    "GROUP_TOKENS",
    "ExpertMajorTiles",
    "down_params",
    "expert_major_unsupported",
    "gate_up_params",
    "items_head",
    "moe_down_expert_major",
    "moe_gate_up_expert_major",
    "plan_bytes",
    "plan_source",
]

GROUP_TOKENS = 32  # tokens planned together (a larger batch runs as several groups)
_CHUNK = 32  # INT4 values per 16-byte load
_SHARED_LIMIT = 48 * 1024  # static shared memory of a block


@dataclass(frozen=True)
class ExpertMajorTiles:
    """``blocks`` of ``warps`` warps; an item is ``rows`` weight rows of one expert for a chunk
    of at most ``tokens`` (token, slot) pairs; ``run_gate_up`` / ``run_down`` products per fp16
    partial sum of the INT4 dot products (those of the fused decode kernels)."""

    warps: int = 8
    blocks: int = 264
    rows: int = 128
    tokens: int = 4
    run_gate_up: int = 16
    run_down: int = 8

    @property
    def name(self) -> str:
        return f"w{self.warps}_b{self.blocks}_r{self.rows}_t{self.tokens}"


# Defaults: gate/up keeps two dequantised rows (gate, up) of a lane's chunks in registers (147
# registers at V2-Lite's shape): blocks of 4 warps, 3 an SM; down one row (127): 8 warps, 2 an SM.
GATE_UP_TILES = ExpertMajorTiles(warps=4, blocks=396, rows=32)
DOWN_TILES = ExpertMajorTiles(warps=8, blocks=264, rows=64)


def plan_bytes(s: MoeDecodeShape) -> int:
    e, k, g = s.experts, s.top_k, GROUP_TOKENS
    return 4 * (g * k + 3 * (e + 2)) + 4 * g * (k + 1) + 16


def _staged_tokens(s: MoeDecodeShape, tiles: ExpertMajorTiles, width: int) -> int:
    """Pairs a chunk stages in shared memory at ``width`` fp16 values each (at most ``tokens``)."""
    room = (_SHARED_LIMIT - plan_bytes(s) - 256) // (2 * width)
    return max(0, min(tiles.tokens, room))


def expert_major_unsupported(s: MoeDecodeShape, tiles: ExpertMajorTiles = DOWN_TILES) -> str | None:
    """Why these kernels cannot run shape ``s`` with ``tiles`` (None: they can)."""
    for name, dim in (("hidden", s.hidden), ("inter", s.inter), ("shared", s.shared_inter)):
        if dim <= 0 or dim % _CHUNK or dim % s.group:
            return f"{name} {dim} is not a positive multiple of 32 and of the group {s.group}"
    if s.group % _CHUNK:
        return f"group {s.group} is not a multiple of {_CHUNK}"
    if tiles.warps < 1 or tiles.blocks < 1 or tiles.rows < 1 or tiles.tokens < 1:
        return f"bad tiles {tiles}"
    widest = max(s.hidden, s.inter, s.shared_inter)
    if _staged_tokens(s, tiles, widest) < 1:
        return f"a row of {widest} fp16 values does not fit in shared memory"
    return None


def plan_source(s: MoeDecodeShape, tag: str, threads: int) -> str:
    """CUDA: the plan (module docstring, 1.) and the item lookup, for ``threads`` threads."""
    E, K, GT = s.experts, s.top_k, GROUP_TOKENS
    return f"""
#ifndef DSV2_EM_PLAN_{tag}
#define DSV2_EM_PLAN_{tag}
struct dsv2_em_plan_{tag} {{
  int ids[{GT * K}];
  int cnt[{E + 1}];   // pairs of expert e (e = {E}: the shared experts, one a token)
  int off[{E + 2}];   // expert e's first pair in pair[]
  int coff[{E + 2}];  // expert e's first chunk
  short pair[{GT * (K + 1)}];  // local token * {K + 1} + slot, expert by expert
  short expert[{GT * (K + 1)}];  // chunk -> its expert
}};
// the plan of tokens [t0, t0 + nt) (every thread of the block; ends with a barrier)
__device__ __forceinline__ void dsv2_em_plan_build_{tag}(dsv2_em_plan_{tag}& P,
    const int* __restrict__ ids, long long t0, int nt, int tm, int tid) {{
  for (int i = tid; i < nt * {K}; i += {threads}) P.ids[i] = ids[t0 * {K} + i];
  __syncthreads();
  for (int e = tid; e < {E}; e += {threads}) {{
    int c = 0;
    for (int i = 0; i < nt * {K}; ++i) c += P.ids[i] == e;
    P.cnt[e] = c;
  }}
  if (tid == 0) P.cnt[{E}] = nt;
  __syncthreads();
  if (tid == 0) {{
    int o = 0, ch = 0;
    for (int e = 0; e <= {E}; ++e) {{
      P.off[e] = o;
      P.coff[e] = ch;
      o += P.cnt[e];
      ch += (P.cnt[e] + tm - 1) / tm;
    }}
    P.off[{E + 1}] = o;
    P.coff[{E + 1}] = ch;
  }}
  __syncthreads();
  for (int e = tid; e < {E}; e += {threads}) {{
    int k = P.off[e];
    for (int i = 0; i < nt * {K}; ++i)
      if (P.ids[i] == e) P.pair[k++] = (short)((i / {K}) * {K + 1} + i % {K});
  }}
  for (int t = tid; t < nt; t += {threads}) P.pair[P.off[{E}] + t] = (short)(t * {K + 1} + {K});
  for (int e = tid; e <= {E}; e += {threads})
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


def _weights_source(run: int) -> str:
    """CUDA: ``dsv2_em_deq32(w, hv)``, the 32 INT4 values of ``w[0..3]`` as the 16 half2
    ``(n0, n4), (n1, n5), (n2, n6), (n3, n7)`` of each word minus 8 (exact; the pairing of
    ``dot32_source``), and ``dsv2_em_dot32w_h{run}(hv, xp, scale)``: the dot product of those
    with 32 paired activations, the products and fp16 partial sums of ``dsv2_dot32p_int4_h{run}``
    in the same order (bit for bit), so a row dequantised once serves every token of a chunk."""
    words = run // 4
    return f"""
#ifndef DSV2_EM_DEQ32
#define DSV2_EM_DEQ32
__device__ __forceinline__ void dsv2_em_deq32(const unsigned* w, __half2* hv) {{
  const __half2 lo_b = dsv2_u2h2_h{run}(0x64086408u);
  const __half2 hi_m = dsv2_u2h2_h{run}(0x2c002c00u);
  const __half2 hi_b = dsv2_u2h2_h{run}(0xd480d480u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const unsigned q = w[i], q8 = q >> 8;
    hv[4 * i] = __hsub2(dsv2_u2h2_h{run}((q & 0x000f000fu) | 0x64006400u), lo_b);
    hv[4 * i + 1] = __hfma2(dsv2_u2h2_h{run}((q & 0x00f000f0u) | 0x64006400u), hi_m, hi_b);
    hv[4 * i + 2] = __hsub2(dsv2_u2h2_h{run}((q8 & 0x000f000fu) | 0x64006400u), lo_b);
    hv[4 * i + 3] = __hfma2(dsv2_u2h2_h{run}((q8 & 0x00f000f0u) | 0x64006400u), hi_m, hi_b);
  }}
}}
#endif
#ifndef DSV2_EM_DOT32W_H{run}
#define DSV2_EM_DOT32W_H{run}
__device__ __forceinline__ float dsv2_em_dot32w_h{run}(const __half2* hv, const uint4* xp,
                                                      half scale) {{
  float total = 0.f;
  __half2 acc;
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const uint4 p = xp[i];
    acc = (i % {words} == 0) ? __hmul2(hv[4 * i], dsv2_u2h2_h{run}(p.x))
                             : __hfma2(hv[4 * i], dsv2_u2h2_h{run}(p.x), acc);
    acc = __hfma2(hv[4 * i + 1], dsv2_u2h2_h{run}(p.y), acc);
    acc = __hfma2(hv[4 * i + 2], dsv2_u2h2_h{run}(p.z), acc);
    acc = __hfma2(hv[4 * i + 3], dsv2_u2h2_h{run}(p.w), acc);
    if (i % {words} == {words - 1}) {{
      const float2 f = __half22float2(acc);
      total += f.x + f.y;
    }}
  }}
  return total * __half2float(scale);
}}
#endif
"""


def items_head(tag: str, tm: int, blocks: int) -> str:
    """CUDA: the loop heads both kernels share, over the token groups (the plan of each) and the
    block's items (``e, c, rb, first, np`` of item ``i``; ``rbr`` / ``rbs`` row blocks of a
    routed / shared chunk declared before)."""
    return f"""  for (long long t0 = 0; t0 < n; t0 += {GROUP_TOKENS}) {{
    const int nt = n - t0 < {GROUP_TOKENS} ? (int)(n - t0) : {GROUP_TOKENS};
    dsv2_em_plan_build_{tag}(P, ids, t0, nt, {tm}, tid);
    const int items = dsv2_em_items_{tag}(P, rbr, rbs);
    // an even share of the items: blocks differ by one item at most
    const int i1 = (int)((long long)(blk + 1) * items / {blocks});
    int staged = -1;
    for (int i = (int)((long long)blk * items / {blocks}); i < i1; ++i) {{
      int e, c, rb, first, np;
      dsv2_em_item_{tag}(P, i, rbr, rbs, {tm}, e, c, rb, first, np);
"""


def _reduce(var: str) -> str:
    return " ".join(f"{var} += __shfl_xor_sync(0xffffffffu, {var}, {o});" for o in (16, 8, 4, 2, 1))


def gate_up_source(s: MoeDecodeShape, tiles: ExpertMajorTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of :func:`moe_gate_up_expert_major`."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB, R, run = tiles.warps, tiles.blocks, tiles.rows, tiles.run_gate_up
    T = 32 * W
    TM = _staged_tokens(s, tiles, H)
    nch = H // _CHUNK
    cpl = -(-nch // 32)
    exact = "true" if nch % 32 == 0 else "false"
    tag = f"h{H}_i{NI}_s{IS}_e{E}_k{K}_g{G}_{tiles.name}"
    name = f"dsv2_em_gu_{tag}"
    total = K * NI + IS
    src = f"""
#ifndef DSV2_EM_GU_{tag}
#define DSV2_EM_GU_{tag}
struct dsv2_em_gu_buf_{tag} {{
  uint4 g[{cpl}], u[{cpl}];
  half sg[{cpl}], su[{cpl}];
}};
// gate row r and up row r (the up rows `up` rows further on) of an expert's weights / scales
__device__ __forceinline__ void dsv2_em_gu_load_{tag}(dsv2_em_gu_buf_{tag}& b,
    const unsigned* __restrict__ w, const half* __restrict__ s, long long r, long long up,
    int lane) {{
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if ({exact} || c < {nch}) {{
      b.g[j] = reinterpret_cast<const uint4*>(w + r * {H // 8})[c];
      b.u[j] = reinterpret_cast<const uint4*>(w + (r + up) * {H // 8})[c];
      b.sg[j] = s[r * {H // G} + c * {_CHUNK} / {G}];
      b.su[j] = s[(r + up) * {H // G} + c * {_CHUNK} / {G}];
    }}
  }}
}}
__device__ __forceinline__ void {name}(const half* __restrict__ x, const int* __restrict__ ids,
    const unsigned* __restrict__ w, const half* __restrict__ s, const unsigned* __restrict__ sw,
    const half* __restrict__ ss, half* __restrict__ hout, long long n, int blk, int tid) {{
  __shared__ dsv2_em_plan_{tag} P;
  __shared__ __align__(16) uint4 rs[{TM}][{H // 8}];
  const int warp = tid >> 5, lane = tid & 31;
  const int rbr = {-(-NI // R)}, rbs = {-(-IS // R)};  // row blocks of a routed / shared chunk
  {WAIT_THEN_RELEASE}
{items_head(tag, TM, NB)}      if (c != staged) {{  // the chunk's tokens' x rows
        __syncthreads();
        for (int v = tid; v < np * {H // 8}; v += {T}) {{
          const int k = v / {H // 8}, q = v - k * {H // 8};
          const uint4* row = reinterpret_cast<const uint4*>(
              x + (t0 + P.pair[first + k] / {K + 1}) * {H});
          rs[k][dsv2_swz(q >> 2, q & 3)] = dsv2_pair8(row[q]);
        }}
        __syncthreads();
        staged = c;
      }}
      const bool sh = e == {E};
      const unsigned* ew = sh ? sw : w + (long long)e * {2 * NI * (H // 8)};
      const half* es = sh ? ss : s + (long long)e * {2 * NI * (H // G)};
      const long long up = sh ? {IS} : {NI};
      const int r1 = min(sh ? {IS} : {NI}, (rb + 1) * {R});
      int r = rb * {R} + warp;
      dsv2_em_gu_buf_{tag} b, nb;
      if (r < r1) dsv2_em_gu_load_{tag}(b, ew, es, r, up, lane);
      for (; r < r1; r += {W}) {{
        if (r + {W} < r1) dsv2_em_gu_load_{tag}(nb, ew, es, r + {W}, up, lane);
        __half2 hg[{cpl}][16], hu[{cpl}][16];  // the row's chunks, dequantised once
#pragma unroll
        for (int j = 0; j < {cpl}; ++j) {{
          dsv2_em_deq32(reinterpret_cast<const unsigned*>(&b.g[j]), hg[j]);
          dsv2_em_deq32(reinterpret_cast<const unsigned*>(&b.u[j]), hu[j]);
        }}
        float g[{TM}], u[{TM}];
#pragma unroll
        for (int k = 0; k < {TM}; ++k) {{
          g[k] = 0.f;
          u[k] = 0.f;
          if (k < np) {{
#pragma unroll
            for (int j = 0; j < {cpl}; ++j) {{
              const int q = lane + 32 * j;
              if ({exact} || q < {nch}) {{
                uint4 xq[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) xq[p] = rs[k][dsv2_swz(q, p)];
                g[k] += dsv2_em_dot32w_h{run}(hg[j], xq, b.sg[j]);
                u[k] += dsv2_em_dot32w_h{run}(hu[j], xq, b.su[j]);
              }}
            }}
          }}
        }}
#pragma unroll
        for (int k = 0; k < {TM}; ++k) {{
          if (k < np) {{
            {_reduce("g[k]")}
            {_reduce("u[k]")}
            if (lane == 0) {{
              const int pr = P.pair[first + k], t = pr / {K + 1}, slot = pr - t * {K + 1};
              hout[(t0 + t) * {total} + slot * {NI} + r] =
                  __float2half(g[k] / (1.f + __expf(-g[k])) * u[k]);
            }}
          }}
        }}
        b = nb;
      }}
    }}
    __syncthreads();  // this group's plan and rows are read no more
  }}
}}
#endif
"""
    head = dot32_source(run) + _weights_source(run) + grid_wait_source()
    return name, head + plan_source(s, tag, T) + src


def down_source(s: MoeDecodeShape, tiles: ExpertMajorTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of :func:`moe_down_expert_major`."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB, R, run = tiles.warps, tiles.blocks, tiles.rows, tiles.run_down
    T = 32 * W
    widest = max(NI, IS)
    TM = _staged_tokens(s, tiles, widest)
    cpl = -(-(widest // _CHUNK) // 32)
    tag = f"h{H}_i{NI}_s{IS}_e{E}_k{K}_g{G}_{tiles.name}_tm{TM}"
    name = f"dsv2_em_dn_{tag}"
    total = K * NI + IS
    src = f"""
#ifndef DSV2_EM_DN_{tag}
#define DSV2_EM_DN_{tag}
struct dsv2_em_dn_buf_{tag} {{
  uint4 w[{cpl}];
  half s[{cpl}];
}};
// row o of a down weight of `width` inputs (`nch` chunks): lane l takes chunks l + 32 j
__device__ __forceinline__ void dsv2_em_dn_load_{tag}(dsv2_em_dn_buf_{tag}& b,
    const unsigned* __restrict__ w, const half* __restrict__ s, long long o, int width, int nch,
    int lane) {{
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < nch) {{
      b.w[j] = reinterpret_cast<const uint4*>(w + o * (width / 8))[c];
      b.s[j] = s[o * (width / {G}) + c * {_CHUNK} / {G}];
    }}
  }}
}}
__device__ __forceinline__ void {name}(const half* __restrict__ h, const int* __restrict__ ids,
    const unsigned* __restrict__ w, const half* __restrict__ s, const unsigned* __restrict__ sw,
    const half* __restrict__ ss, float* __restrict__ part, long long n, int blk, int tid) {{
  __shared__ dsv2_em_plan_{tag} P;
  __shared__ __align__(16) uint4 rs[{TM}][{widest // 8}];
  const int warp = tid >> 5, lane = tid & 31;
  const int rbr = {-(-H // R)}, rbs = rbr;  // row blocks of a chunk (H outputs)
  {WAIT_THEN_RELEASE}
{items_head(tag, TM, NB)}      const bool sh = e == {E};
      const int width = sh ? {IS} : {NI}, nch = width / {_CHUNK};
      if (c != staged) {{  // the chunk's pairs' h slices
        __syncthreads();
        for (int v = tid; v < np * (width / 8); v += {T}) {{
          const int k = v / (width / 8), q = v - k * (width / 8);
          const int pr = P.pair[first + k], t = pr / {K + 1}, slot = pr - t * {K + 1};
          const uint4* row = reinterpret_cast<const uint4*>(h + (t0 + t) * {total} + slot * {NI});
          rs[k][dsv2_swz(q >> 2, q & 3)] = dsv2_pair8(row[q]);
        }}
        __syncthreads();
        staged = c;
      }}
      const unsigned* ew = sh ? sw : w + (long long)e * {H * (NI // 8)};
      const half* es = sh ? ss : s + (long long)e * {H * (NI // G)};
      const int o1 = min({H}, (rb + 1) * {R});
      int o = rb * {R} + warp;
      dsv2_em_dn_buf_{tag} b, nb;
      if (o < o1) dsv2_em_dn_load_{tag}(b, ew, es, o, width, nch, lane);
      for (; o < o1; o += {W}) {{
        if (o + {W} < o1) dsv2_em_dn_load_{tag}(nb, ew, es, o + {W}, width, nch, lane);
        __half2 hw[{cpl}][16];  // the row's chunks, dequantised once
#pragma unroll
        for (int j = 0; j < {cpl}; ++j)
          if (lane + 32 * j < nch) dsv2_em_deq32(reinterpret_cast<const unsigned*>(&b.w[j]), hw[j]);
        float v[{TM}];
#pragma unroll
        for (int k = 0; k < {TM}; ++k) {{
          v[k] = 0.f;
          if (k < np) {{
#pragma unroll
            for (int j = 0; j < {cpl}; ++j) {{
              const int q = lane + 32 * j;
              if (q < nch) {{
                uint4 xq[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) xq[p] = rs[k][dsv2_swz(q, p)];
                v[k] += dsv2_em_dot32w_h{run}(hw[j], xq, b.s[j]);
              }}
            }}
          }}
        }}
#pragma unroll
        for (int k = 0; k < {TM}; ++k) {{
          if (k < np) {{
            {_reduce("v[k]")}
            if (lane == 0) {{
              const int pr = P.pair[first + k], t = pr / {K + 1}, slot = pr - t * {K + 1};
              part[((t0 + t) * {K + 1} + slot) * {H} + o] = v[k];
            }}
          }}
        }}
        b = nb;
      }}
    }}
    __syncthreads();  // this group's plan and rows are read no more
  }}
}}
#endif
"""
    head = dot32_source(run) + _weights_source(run) + grid_wait_source()
    return name, head + plan_source(s, tag, T) + src


def gate_up_params(s: MoeDecodeShape) -> list:
    """The gate/up kernels' buffers (this module's and :mod:`.moe_expert_mma_cuda`'s)."""
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
    """The down kernels' buffers (this module's and :mod:`.moe_expert_mma_cuda`'s)."""
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


def _check(s: MoeDecodeShape, tiles: ExpertMajorTiles) -> None:
    why = expert_major_unsupported(s, tiles)
    if why is not None:
        raise ValueError(f"the expert-major MoE kernels cannot take {s}: {why}")


def moe_gate_up_expert_major(
    s: MoeDecodeShape, tiles: ExpertMajorTiles = GATE_UP_TILES
) -> tirx.PrimFunc:
    """``f(x [n, H] fp16, ids [n, K] int32, w [E, 2I, H/8] uint32, s [E, 2I, H/G] fp16,
    sw [2Is, H/8] uint32, ss [2Is, H/G] fp16, hout [n, K*I + Is] fp16)``: the routed slots'
    and the shared experts' SwiGLU intermediates, every expert's rows read once for its tokens
    (module docstring, 2.)."""
    _check(s, tiles)
    name, src = gate_up_source(s, tiles)
    return token_grid_call(
        "moe_expert_major_gate_up",
        name,
        src,
        gate_up_params(s),
        tiles.blocks,
        32 * tiles.warps,
        per_token=False,
    )


def moe_down_expert_major(s: MoeDecodeShape, tiles: ExpertMajorTiles = DOWN_TILES) -> tirx.PrimFunc:
    """``f(h [n, K*I + Is] fp16, ids [n, K] int32, w [E, H, I/8] uint32, s [E, H, I/G] fp16,
    sw [H, Is/8] uint32, ss [H, Is/G] fp16, part [n, K + 1, H] float32)``: each routed slot's
    down projection ``part[t, j] = down_{ids[t, j]} . h[t, j]`` and the shared experts'
    ``part[t, K]``, unweighted (module docstring, 3.)."""
    _check(s, tiles)
    name, src = down_source(s, tiles)
    return token_grid_call(
        "moe_expert_major_down",
        name,
        src,
        down_params(s),
        tiles.blocks,
        32 * tiles.warps,
        per_token=False,
    )

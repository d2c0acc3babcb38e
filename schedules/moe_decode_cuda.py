"""DeepSeekMoE for decode on CUDA in two kernels: routing + every expert's gate/up + SwiGLU, then
every expert's down projection + the weighted sum.

At batch 1 the MoE block of a layer as separate kernels is nine launches (router gate, route,
shared gate/up, SwiGLU, shared down, routed gate/up, SwiGLU, routed down, weighted sum) for ~35
MB of INT4 weights, several times their HBM time, most of it launch latency and partly-occupied
GEMVs (schedules/results/moe_decode.md). Here, after the router's logits GEMV:

1. :func:`moe_gate_up_decode` — ``blocks`` blocks per token (one wave on the GPU: 264 = 2 per
   SM of an H100/H200), each warp a strided share of the ``top_k * I + Is`` outputs
   ``h[o] = silu(gate_o . x) * (up_o . x)``, one output per warp step with the next step's
   weight loads issued before this step's dot products (two in flight per lane; deeper register
   rings are slower: schedules/results/moe_decode.md). The shared experts' rows
   (``Is = n_shared * I``, the fused ``gate_up_proj`` of the shared MLP) come first: they need
   no routing, so they load (before the PDL wait: overlapping the previous kernel in a ``--pdl``
   build) while warp 0 of each block routes the token (the
   warp router of :mod:`dsv2_mlc.schedules.moe_routing`: softmax, group limit, top-k by ranks,
   renormalise or scale; recomputed per block instead of a launch); a warp waits for that
   block's routing (a shared-memory flag) only at its first routed row (slot ``o // I``, expert
   ``ids[slot]``). Writes ``h [n, top_k * I + Is]`` (routed slots first) and, from block 0, the
   routing ``weights [n, top_k]`` / ``ids [n, top_k]``.
2. :func:`moe_down_decode` — grid ``(token, block)``. The block stages ``h`` of its token in
   shared memory (16-byte pieces XOR-swizzled so that lanes reading consecutive 64-byte chunks do
   not collide on banks), then each group of ``lanes`` lanes computes ``rows`` outputs
   ``out[o] = sum_j w_j * (down_{ids[j]}[o] . h_j) + shared_down[o] . h_s`` over one flattened
   range of 32-element chunks (``top_k * I / 32`` routed, then ``Is / 32`` shared).

INT4 group weights as :mod:`dsv2_mlc.quant.packing` stores them (``[rows, K / 8]`` uint32,
nibble ``i`` of word ``j`` is element ``8 j + i``, value ``(q - 8) * scale[k // group]``). Each
32-element chunk (one 16-byte load, one scale) is one call of the half2 dot product of
:func:`dsv2_mlc.schedules.decode_gemv_cuda.dot32_source` (fp16 partial sums of ``run``
products, float32 across chunks). SiLU and the products are float32; ``h`` is rounded to fp16
once (the Relax composition rounds gate and up first). The reference is that composition
(``DeepseekV2MoE`` on the CPU, checked against Hugging Face in CI);
``schedules/lab/kernel_lab_moe_decode.py`` checks these kernels against a torch float32
reference on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .cuda_call import (
    TOKENS,
    WAIT_THEN_RELEASE,
    grid_wait_source,
    token_grid_call,
)
from .decode_gemv_cuda import dot32_source
from .moe_routing import RouterShape
from .tiles import DecodeTiles, GateUpTiles, tuned

__all__ = [
    "MoeDecodeShape",
    "down_decode_kernel",
    "gate_up_decode_kernel",
    "moe_down_decode",
    "moe_gate_up_decode",
]

_CHUNK = 32  # INT4 values per 16-byte load
_SHARED_LIMIT = 48 * 1024  # static shared memory of a block


@dataclass(frozen=True)
class MoeDecodeShape:
    """The MoE block of one layer as these kernels see it."""

    hidden: int  # H
    inter: int  # I, one routed expert's intermediate size
    shared_inter: int  # Is = n_shared_experts * I
    experts: int  # E
    top_k: int  # K
    group: int  # quantization group size
    n_group: int = 1  # routing groups (1: greedy)
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @property
    def router(self) -> RouterShape:
        """The router's part of the shape (the warp router's parameters)."""
        return RouterShape(
            self.experts, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
            self.routed_scaling_factor,
        )  # fmt: skip

    @property
    def total(self) -> int:
        """Width of ``h``: the routed slots' intermediates, then the shared experts'."""
        return self.top_k * self.inter + self.shared_inter

    def unsupported(self) -> str | None:
        """Why these kernels cannot run this shape (None: they can)."""
        for name, dim in (("hidden", self.hidden), ("inter", self.inter)):
            if dim % _CHUNK:
                return f"{name} {dim} is not a multiple of {_CHUNK}"
        if self.shared_inter <= 0 or self.shared_inter % _CHUNK:
            return f"shared intermediate {self.shared_inter} is not a positive multiple of 32"
        if not 1 <= self.top_k <= 32:
            return f"top_k {self.top_k} is not in [1, 32]"
        if self.group % _CHUNK:
            return f"group {self.group} is not a multiple of {_CHUNK}"
        for name, dim in (("hidden", self.hidden), ("inter", self.inter)):
            if dim % self.group:
                return f"{name} {dim} is not a multiple of the group {self.group}"
        if self.shared_inter % self.group:
            return f"shared intermediate {self.shared_inter} is not a multiple of the group"
        if self.total * 2 + 64 > _SHARED_LIMIT:
            return f"h ({self.total} fp16) does not fit in shared memory"
        return None


def _check_tiles(tiles: DecodeTiles) -> None:
    if tiles.lanes not in (1, 2, 4, 8, 16, 32) or tiles.warps < 1 or tiles.rows < 1:
        raise ValueError(f"bad tiles {tiles}")


def _reduce(var: str, lanes: int) -> str:
    """CUDA: sum ``var`` over the ``lanes`` lanes of its group (xor shuffles)."""
    steps, off = [], lanes // 2
    while off:
        steps.append(f"{var} += __shfl_xor_sync(0xffffffffu, {var}, {off});")
        off //= 2
    return " ".join(steps)


def x_lanes_source(hidden: int) -> str:
    """CUDA: ``uint4 xv[cpl][4]``, the chunks ``lane + 32 j`` of the token's ``x`` (``x + t * H``)
    in each lane's registers, in pair order (``dsv2_pair8``; ``cpl`` chunks a lane)."""
    nch = hidden // _CHUNK
    cpl, exact = -(-nch // 32), "true" if nch % 32 == 0 else "false"
    return f"""  uint4 xv[{cpl}][4];
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if ({exact} || c < {nch}) {{
      const uint4* p = reinterpret_cast<const uint4*>(x + t * {hidden} + c * {_CHUNK});
#pragma unroll
      for (int k = 0; k < 4; ++k) xv[j][k] = dsv2_pair8(p[k]);  // pair order, once
    }}
  }}"""


def swiglu_dots_source(hidden: int, run: int) -> tuple[str, str]:
    """(parameter, body) of the dot products of one gate/up row in a warp. The parameter is
    ``x``, named ``xv``: each lane's chunks ``lane + 32 j`` in its registers (``uint4
    xv[cpl][4]``, :func:`x_lanes_source`). The body declares ``float g, u``: the dot products of
    the row buffer ``b`` (``b.g[j]`` / ``b.u[j]``, scales ``b.sg[j]`` / ``b.su[j]`` of the lane's
    chunks) with ``x``, summed over the warp."""
    nch = hidden // _CHUNK
    cpl, exact = -(-nch // 32), "true" if nch % 32 == 0 else "false"
    param, arg = f"const uint4 (&xv)[{cpl}][4]", "xv[j]"
    body = f"""  float g = 0.f, u = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if ({exact} || c < {nch}) {{
      g += dsv2_dot32p_int4_h{run}(reinterpret_cast<const unsigned*>(&b.g[j]), {arg},
                                         b.sg[j]);
      u += dsv2_dot32p_int4_h{run}(reinterpret_cast<const unsigned*>(&b.u[j]), {arg},
                                         b.su[j]);
    }}
  }}
  {_reduce("g", 32)}
  {_reduce("u", 32)}"""
    return param, body


def gate_up_source(s: MoeDecodeShape, tiles: GateUpTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of kernel 1 (module docstring)."""
    route_name, route_src = s.router.warp_source()
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB = tiles.warps, tiles.blocks
    nch = H // _CHUNK  # chunks of a row
    cpl = -(-nch // 32)  # chunks per lane
    exact = "true" if nch % 32 == 0 else "false"
    items = s.total  # outputs: the shared experts' first, then the routed slots'
    stride = NB * W
    tag = f"h{H}_i{NI}_s{IS}_k{K}_g{G}_{route_name}_{tiles.name}"
    name = f"dsv2_moe_gu_{tag}"
    # warp 0 of every block routes the logits; the others load their first (shared) row first
    early = f"i < {IS} && warp != 0"
    route_body = f"""
    {route_name}(logits + t * {E}, s_w, s_ids, lane, s_p);
    if (blk == 0 && lane < {K}) {{
      wout[t * {K} + lane] = s_w[lane];
      iout[t * {K} + lane] = s_ids[lane];
    }}"""
    x_param, dots = swiglu_dots_source(H, tiles.run)
    x_stage = x_lanes_source(H)
    src = f"""
#ifndef DSV2_MOE_GU_{tag}
#define DSV2_MOE_GU_{tag}
struct dsv2_gu_buf_{tag} {{
  uint4 g[{cpl}], u[{cpl}];
  half sg[{cpl}], su[{cpl}];
}};
// item i: output o = K*I + i (shared expert row i) for i < Is, else o = i - Is (routed slot row)
__device__ __forceinline__ int dsv2_gu_out_{tag}(int i) {{
  return i < {IS} ? {K * NI} + i : i - {IS};
}}
// until warp 0 has routed the block's token (s_ids / s_w written, then the flag)
__device__ __forceinline__ void dsv2_gu_routed_{tag}(volatile int* ready) {{
  while (*ready == 0) __nanosleep(20);
  __threadfence_block();
}}
// the gate row of item i (shared expert row i < Is, else routed slot row i - Is, after waiting
// for the block's routing if `wait`) and the offsets of its up row
struct dsv2_gu_row_{tag} {{
  const unsigned* gp;
  const half* gs;
  long long up_w, up_s;
}};
__device__ __forceinline__ dsv2_gu_row_{tag} dsv2_gu_row_at_{tag}(int i,
    const unsigned* __restrict__ w, const half* __restrict__ s,
    const unsigned* __restrict__ sw, const half* __restrict__ ss, const int* ids, bool wait,
    volatile int* ready) {{
  dsv2_gu_row_{tag} p;
  if (i < {IS}) {{
    p.gp = sw + (long long)i * {H // 8};
    p.gs = ss + (long long)i * {H // G};
    p.up_w = (long long){IS} * {H // 8};
    p.up_s = (long long){IS} * {H // G};
  }} else {{
    if (wait) dsv2_gu_routed_{tag}(ready);
    const int o = i - {IS};
    const int j = o / {NI}, r = o - j * {NI};
    const long long row = (long long)ids[j] * {2 * NI} + r;
    p.gp = w + row * {H // 8};
    p.gs = s + row * {H // G};
    p.up_w = (long long){NI} * {H // 8};
    p.up_s = (long long){NI} * {H // G};
  }}
  return p;
}}
__device__ __forceinline__ void dsv2_gu_load_{tag}(dsv2_gu_buf_{tag}& b, int i, int lane,
    const unsigned* __restrict__ w, const half* __restrict__ s,
    const unsigned* __restrict__ sw, const half* __restrict__ ss, const int* ids,
    volatile int* ready) {{
  const dsv2_gu_row_{tag} p = dsv2_gu_row_at_{tag}(i, w, s, sw, ss, ids, true, ready);
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if ({exact} || c < {nch}) {{
      b.g[j] = reinterpret_cast<const uint4*>(p.gp)[c];
      b.u[j] = reinterpret_cast<const uint4*>(p.gp + p.up_w)[c];
      b.sg[j] = p.gs[c * {_CHUNK} / {G}];
      b.su[j] = p.gs[p.up_s + c * {_CHUNK} / {G}];
    }}
  }}
}}
__device__ __forceinline__ void dsv2_gu_store_{tag}(const dsv2_gu_buf_{tag}& b, int i, int lane,
    {x_param}, half* __restrict__ hrow) {{
{dots}
  if (lane == 0) hrow[dsv2_gu_out_{tag}(i)] = __float2half(g / (1.f + __expf(-g)) * u);
}}
__device__ __forceinline__ void {name}(const half* __restrict__ x,
    const float* __restrict__ logits, const unsigned* __restrict__ w,
    const half* __restrict__ s, const unsigned* __restrict__ sw, const half* __restrict__ ss,
    half* __restrict__ hout, float* __restrict__ wout, int* __restrict__ iout,
    long long t, int blk, int tid) {{
  __shared__ float s_w[{K}];
  __shared__ int s_ids[{K}];
  __shared__ float s_p[{E}];
  __shared__ int s_ready;
  const int warp = tid >> 5, lane = tid & 31;
  if (tid == 0) s_ready = 0;
  __syncthreads();
  half* hrow = hout + t * {items};
  volatile int* ready = &s_ready;
  // items blk * W + warp + k * {stride}, two in flight: load the next before reducing this one
  dsv2_gu_buf_{tag} a, b;
  int i = blk * {W} + warp;
  // a first row of a shared expert needs no routing: but for warp 0 (which routes) its weights
  // load before the wait (PDL: overlapping the previous kernel), the logits are read after it
  const bool early = {early};
  if (early) dsv2_gu_load_{tag}(a, i, lane, w, s, sw, ss, s_ids, ready);
  {WAIT_THEN_RELEASE}
  if (warp != 0 && !early && i < {items})
    dsv2_gu_load_{tag}(a, i, lane, w, s, sw, ss, s_ids, ready);
  if (warp == 0) {{{route_body}
    __threadfence_block();
    __syncwarp();
    if (lane == 0) *((volatile int*)&s_ready) = 1;
    if (i < {items}) dsv2_gu_load_{tag}(a, i, lane, w, s, sw, ss, s_ids, ready);
  }}
{x_stage}
  while (i < {items}) {{
    const int i1 = i + {stride};
    if (i1 < {items}) dsv2_gu_load_{tag}(b, i1, lane, w, s, sw, ss, s_ids, ready);
    dsv2_gu_store_{tag}(a, i, lane, xv, hrow);
    if (i1 >= {items}) break;
    const int i2 = i1 + {stride};
    if (i2 < {items}) dsv2_gu_load_{tag}(a, i2, lane, w, s, sw, ss, s_ids, ready);
    dsv2_gu_store_{tag}(b, i1, lane, xv, hrow);
    i = i2;
  }}
}}
#endif
"""
    pre = grid_wait_source() + dot32_source(tiles.run)
    return name, pre + route_src + src


def down_source(s: MoeDecodeShape, tiles: DecodeTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of kernel 2 (module docstring)."""
    _check_tiles(tiles)
    H, NI, IS, K, G, TOT = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.total
    L, R, W = tiles.lanes, tiles.rows, tiles.warps
    ci = NI // _CHUNK  # chunks of one routed slot
    kci = K * ci
    nc = kci + IS // _CHUNK  # chunks of one output row, all experts
    cpl = -(-nc // L)
    exact = "true" if nc % L == 0 else "false"
    threads = W * 32
    tag = f"h{H}_i{NI}_s{IS}_k{K}_g{G}_{tiles.name}"
    name = f"dsv2_moe_dn_{tag}"
    routed_loads = f"""
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int q = gl + {L} * j;
    if (q < {kci}) {{
      const int slot = q / {ci};
      const int col = q - slot * {ci};
      const long long e = s_ids[slot];
      const unsigned* base = dw + e * {H} * {NI // 8};
      const half* sbase = ds + e * {H} * {NI // G};
#pragma unroll
      for (int r = 0; r < {R}; ++r) {{
        const long long o = min(o0 + r, {H - 1});
        wq[j][r] = reinterpret_cast<const uint4*>(base + o * {NI // 8})[col];
        sc[j][r] = sbase[o * {NI // G} + col * {_CHUNK} / {G}];
      }}
    }}
  }}"""
    src = f"""
#ifndef DSV2_MOE_DN_{tag}
#define DSV2_MOE_DN_{tag}
__device__ __forceinline__ void {name}(const half* __restrict__ h,
    const float* __restrict__ wts, const int* __restrict__ ids,
    const unsigned* __restrict__ dw, const half* __restrict__ ds,
    const unsigned* __restrict__ sdw, const half* __restrict__ sds, half* __restrict__ out,
    long long t, int blk, int tid) {{
  // h of the token: 16-byte piece p of chunk c at dsv2_swz(c, p)
  __shared__ __align__(16) uint4 hs[{TOT // 8}];
  __shared__ float s_w[{K}];
  __shared__ int s_ids[{K}];
  const int warp = tid >> 5, lane = tid & 31;
  const int grp = lane / {L}, gl = lane % {L};
  const int o0 = ((blk * {W} + warp) * {32 // L} + grp) * {R};
  uint4 wq[{cpl}][{R}];
  half sc[{cpl}][{R}];
  // the shared experts' chunks need no expert id: in flight while h is staged
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int q = gl + {L} * j;
    if (q >= {kci} && ({exact} || q < {nc})) {{
      const int col = q - {kci};
#pragma unroll
      for (int r = 0; r < {R}; ++r) {{
        const long long o = min(o0 + r, {H - 1});
        wq[j][r] = reinterpret_cast<const uint4*>(sdw + o * {IS // 8})[col];
        sc[j][r] = sds[o * {IS // G} + col * {_CHUNK} / {G}];
      }}
    }}
  }}
  {WAIT_THEN_RELEASE}  // (PDL) the loads above overlap the previous kernel, which wrote h
  const uint4* hrow = reinterpret_cast<const uint4*>(h + t * {TOT});
  for (int v = tid; v < {TOT // 8}; v += {threads}) {{
    const int c = v >> 2, p = v & 3;
    hs[dsv2_swz(c, p)] = dsv2_pair8(hrow[v]);  // pair order, once
  }}
  if (tid < {K}) {{
    s_w[tid] = wts[t * {K} + tid];
    s_ids[tid] = ids[t * {K} + tid];
  }}
  __syncthreads();{routed_loads}
  float acc[{R}];
#pragma unroll
  for (int r = 0; r < {R}; ++r) acc[r] = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int q = gl + {L} * j;
    if ({exact} || q < {nc}) {{
      const float wt = q < {kci} ? s_w[q / {ci}] : 1.f;
      uint4 xq[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) xq[p] = hs[dsv2_swz(q, p)];
#pragma unroll
      for (int r = 0; r < {R}; ++r)
        acc[r] += wt * dsv2_dot32p_int4_h{tiles.run}(
            reinterpret_cast<const unsigned*>(&wq[j][r]), xq, sc[j][r]);
    }}
  }}
#pragma unroll
  for (int r = 0; r < {R}; ++r) {{
    float a = acc[r];
    {_reduce("a", L)}
    const int o = o0 + r;
    if (gl == 0 && o < {H}) out[t * {H} + o] = __float2half(a);
  }}
}}
#endif
"""
    return name, grid_wait_source() + dot32_source(tiles.run) + src


def _blocks(outputs: int, tiles: DecodeTiles) -> int:
    return -(-outputs // tiles.outputs_per_block)


def moe_gate_up_decode(s: MoeDecodeShape) -> tirx.PrimFunc:
    """``f(x [n, H] f16, logits [n, E] f32, w [E, 2I, H/8] u32, s [E, 2I, H/g] f16,
    shared_w [2 Is, H/8] u32, shared_s [2 Is, H/g] f16) -> (h [n, K I + Is] f16,
    weights [n, K] f32, ids [n, K] i32)`` (module docstring, kernel 1), with the tiles of
    ``schedules/tiles.py`` (keyed by the hidden size, which sets the registers a thread holds
    the token's ``x`` in)."""
    return gate_up_decode_kernel(s, tuned("moe_decode_gate_up", shape=(s.hidden,)))


def gate_up_decode_kernel(s: MoeDecodeShape, tiles: GateUpTiles) -> tirx.PrimFunc:
    """:func:`moe_gate_up_decode` with the given ``tiles``."""
    why = s.unsupported()
    if why:
        raise ValueError(f"moe_gate_up_decode: {why}")
    if tiles.warps < 1 or tiles.blocks < 1:
        raise ValueError(f"bad tiles {tiles}")
    fname, src = gate_up_source(s, tiles)
    return token_grid_call(
        "moe_gate_up",
        fname,
        src,
        gate_up_params(s),
        tiles.blocks,
        tiles.warps * 32,
        min_blocks=tiles.min_blocks,
    )


def gate_up_params(s: MoeDecodeShape) -> list[tuple]:
    """The buffers of the gate/up kernel (``token_grid_call`` parameters), see
    :func:`moe_gate_up_decode`."""
    H, NI, IS, E, K, G = s.hidden, s.inter, s.shared_inter, s.experts, s.top_k, s.group
    return [
        ("x", (TOKENS, H), "float16"),
        ("logits", (TOKENS, E), "float32"),
        ("w", (E, 2 * NI, H // 8), "uint32"),
        ("sc", (E, 2 * NI, H // G), "float16"),
        ("sw", (2 * IS, H // 8), "uint32"),
        ("ss", (2 * IS, H // G), "float16"),
        ("hout", (TOKENS, K * NI + IS), "float16"),
        ("wout", (TOKENS, K), "float32"),
        ("iout", (TOKENS, K), "int32"),
    ]


def moe_down_decode(s: MoeDecodeShape) -> tirx.PrimFunc:
    """``f(h [n, K I + Is] f16, weights [n, K] f32, ids [n, K] i32, w [E, H, I/8] u32,
    s [E, H, I/g] f16, shared_w [H, Is/8] u32, shared_s [H, Is/g] f16) -> out [n, H] f16``
    (module docstring, kernel 2), with the tiles of ``schedules/tiles.py``."""
    return down_decode_kernel(s, tuned("moe_decode_down", shape=(s.hidden,)))


def down_decode_kernel(s: MoeDecodeShape, tiles: DecodeTiles) -> tirx.PrimFunc:
    """:func:`moe_down_decode` with the given ``tiles``."""
    why = s.unsupported()
    if why:
        raise ValueError(f"moe_down_decode: {why}")
    H, NI, IS, E, K, G = s.hidden, s.inter, s.shared_inter, s.experts, s.top_k, s.group
    fname, src = down_source(s, tiles)
    return token_grid_call(
        "moe_down",
        fname,
        src,
        [
            ("h", (TOKENS, K * NI + IS), "float16"),
            ("wts", (TOKENS, K), "float32"),
            ("ids", (TOKENS, K), "int32"),
            ("w", (E, H, NI // 8), "uint32"),
            ("sc", (E, H, NI // G), "float16"),
            ("sw", (H, IS // 8), "uint32"),
            ("ss", (H, IS // G), "float16"),
            ("out", (TOKENS, H), "float16"),
        ],
        _blocks(H, tiles),
        tiles.warps * 32,
        min_blocks=tiles.min_blocks,
    )

"""DeepSeekMoE for decode on CUDA in two kernels: routing + every expert's gate/up + SwiGLU, then
every expert's down projection + the weighted sum.

At batch 1 the MoE block of a layer was nine launches (router gate, route, shared gate/up,
SwiGLU, shared down, routed gate/up, SwiGLU, routed down, weighted sum): ~35 us on the H200 for
~35 MB of INT4 weights (7 us at HBM speed), most of it launch latency and partly-occupied GEMVs.
Here, after the router's logits GEMV:

1. :func:`moe_gate_up_decode` — ``blocks`` blocks per token (one wave on the GPU: 264 = 2 per
   SM of an H100/H200), each warp a strided share of the ``top_k * I + Is`` outputs
   ``h[o] = silu(gate_o . x) * (up_o . x)``, one output per warp step with the next step's
   weight loads issued before this step's dot products (two in flight per lane; deeper register
   rings measured slower: schedules/results/moe_decode.md, round 4). The shared experts' rows
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

**Routed elsewhere, lab variant** (``moe_gate_up_decode(..., routed=True)``, off): kernel 1
takes the expert ids ``[n, top_k]`` of :mod:`dsv2_mlc.schedules.oproj_router_cuda` (``o_proj``
with the router folded in) instead of the logits, no block routes, and warp 0 too loads its
first shared row before the wait; it writes ``h`` alone. On the H200 it took 9.1 us of a
replayed step against 10.8, but the kernel that routes for it cost more than that
(schedules/results/moe_decode.md, round 8).

**Routing again in the down kernel, lab variant** (``DecodeTiles.early_route``, off by default):
the down kernel takes the router's logits instead of kernel 1's ids and weights, routes them
itself (the same warp router, so the same experts) and issues *every* weight load before its PDL
wait, not only the shared experts'. The logits are two kernels back, complete before the kernel
starts (kernel 1 releases its dependents only after its own wait:
:func:`~dsv2_mlc.schedules.cuda_call.grid_wait_source`), so this is safe; whether it pays depends
on how early the down blocks start while kernel 1 runs (one fits next to one gate/up block on an
SM at 157 registers, the default kernel's; this variant takes 164 with the loads live across
the staging of ``h``, 159 with that loop not unrolled). Unmeasured on the GPU yet.

**L2 prefetches, lab variants** (``GateUpTiles.l2_rows`` / ``l2_down``, off by default;
``cp.async.bulk.prefetch`` through :func:`~dsv2_mlc.schedules.cuda_call.l2_prefetch_source`):
``l2_rows`` has each gate/up warp ask L2 for its later shared-expert rows before its PDL wait and,
once routed, for all its routed rows (lane ``m`` the ``m``-th); ``l2_down`` has each warp, after
its last row, ask L2 for its ``1 / (blocks * warps)`` piece of each selected expert's down rows,
on behalf of the down kernel (which cannot load them before its wait: the ids come from this
kernel). On the H200 in the model the first made gate/up 1.9 us slower; the second moved ~1.4 us
from the down kernel into gate/up, whose blocks then end later (schedules/results/moe_decode.md,
round 6).

INT4 group weights as :mod:`dsv2_mlc.passes.quantize_int4` stores them (``[rows, K / 8]`` uint32,
nibble ``i`` of word ``j`` is element ``8 j + i``, value ``(q - 8) * scale[k // group]``). Each
32-element chunk (one 16-byte load, one scale) is one call of the half2 dot product of
:func:`dsv2_mlc.schedules.decode_gemv_cuda.dot32_source` (fp16 partial sums of ``run``
products, float32 across chunks). SiLU and the products are float32; ``h`` is rounded to fp16
once (the Relax composition rounds gate and up first). The reference is that composition
(``DeepseekV2MoE`` on the CPU, checked against Hugging Face in CI); ``scripts/
kernel_lab_moe_decode.py`` checks these kernels against a torch float32 reference on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .cuda_call import (
    L2_PREFETCH,
    TOKENS,
    WAIT_THEN_RELEASE,
    grid_wait_source,
    l2_prefetch_source,
    token_grid_call,
)
from .decode_gemv_cuda import dot32_source
from .moe_routing import RouterShape

__all__ = [
    "DOWN_TILES",
    "GATE_UP_TILES",
    "DecodeTiles",
    "GateUpTiles",
    "MoeDecodeShape",
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


@dataclass(frozen=True)
class DecodeTiles:
    """Work split of one kernel: ``warps`` per block, ``lanes`` per output (a power of two
    <= 32), ``rows`` outputs per group of lanes, ``run`` products per fp16 partial sum."""

    warps: int
    lanes: int
    rows: int
    run: int = 16
    min_blocks: int = 0  # __launch_bounds__ blocks an SM (caps the registers), 0: none
    early_route: bool = False  # down: route from the logits and load every row before the wait

    @property
    def outputs_per_block(self) -> int:
        return self.warps * (32 // self.lanes) * self.rows

    @property
    def name(self) -> str:
        bound = f"_m{self.min_blocks}" if self.min_blocks else ""
        early = "_er" if self.early_route else ""
        return f"w{self.warps}_l{self.lanes}_r{self.rows}_h{self.run}{bound}{early}"


@dataclass(frozen=True)
class GateUpTiles:
    """Work split of the gate/up kernel: ``blocks`` per token of ``warps`` warps; each warp
    takes every ``blocks * warps``-th output (a warp per output, two in flight); ``run``
    products per fp16 partial sum."""

    warps: int
    blocks: int
    run: int = 16
    min_blocks: int = 0  # __launch_bounds__ blocks an SM (caps the registers), 0: none
    l2_rows: bool = False  # L2-prefetch a warp's later rows (module docstring; slower)
    l2_down: bool = False  # L2-prefetch the routed down rows for the next kernel (no net gain)
    x_shared: bool = False  # each warp's copy of x in shared memory instead of its registers

    @property
    def name(self) -> str:
        bound = f"_m{self.min_blocks}" if self.min_blocks else ""
        pf = ("_pr" if self.l2_rows else "") + ("_pd" if self.l2_down else "")
        pf += "_xs" if self.x_shared else ""
        return f"w{self.warps}_b{self.blocks}_h{self.run}{bound}{pf}"


# Defaults (the kernel lab's candidates: schedules/lab/kernel_lab_moe_decode.py).
GATE_UP_TILES = GateUpTiles(warps=8, blocks=264, run=16)
DOWN_TILES = DecodeTiles(warps=8, lanes=32, rows=2, run=8)


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


def swiglu_dots_source(hidden: int, run: int, x_shared: bool) -> tuple[str, str]:
    """(parameter, body) of the dot products of one gate/up row in a warp. The parameter is
    ``x``, named ``xv``: each lane's chunks ``lane + 32 j`` in its registers (``uint4
    xv[cpl][4]``, :func:`x_lanes_source`) or, with ``x_shared``, a pointer to the whole row in
    shared memory (pair order, piece ``p`` of chunk ``c`` at ``dsv2_swz(c, p)``). The body
    declares ``float g, u``: the dot products of the row buffer ``b`` (``b.g[j]`` / ``b.u[j]``,
    scales ``b.sg[j]`` / ``b.su[j]`` of the lane's chunks) with ``x``, summed over the warp."""
    nch = hidden // _CHUNK
    cpl, exact = -(-nch // 32), "true" if nch % 32 == 0 else "false"
    if x_shared:
        param, arg = "const uint4* __restrict__ xv", "xq"
        chunk = """
      uint4 xq[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) xq[p] = xv[dsv2_swz(c, p)];"""
    else:
        param, arg, chunk = f"const uint4 (&xv)[{cpl}][4]", "xv[j]", ""
    body = f"""  float g = 0.f, u = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if ({exact} || c < {nch}) {{{chunk}
      g += dsv2_dot32p_int4_h{run}(reinterpret_cast<const unsigned*>(&b.g[j]), {arg},
                                         b.sg[j]);
      u += dsv2_dot32p_int4_h{run}(reinterpret_cast<const unsigned*>(&b.u[j]), {arg},
                                         b.su[j]);
    }}
  }}
  {_reduce("g", 32)}
  {_reduce("u", 32)}"""
    return param, body


def gate_up_source(s: MoeDecodeShape, tiles: GateUpTiles, routed: bool = False) -> tuple[str, str]:
    """(device function name, CUDA source) of kernel 1 (module docstring); ``routed``: it reads
    the expert ids instead of routing the logits (:func:`moe_gate_up_decode`)."""
    route_name, route_src = s.router.warp_source()
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB = tiles.warps, tiles.blocks
    nch = H // _CHUNK  # chunks of a row
    cpl = -(-nch // 32)  # chunks per lane
    exact = "true" if nch % 32 == 0 else "false"
    items = s.total  # outputs: the shared experts' first, then the routed slots'
    stride = NB * W
    tag = f"h{H}_i{NI}_s{IS}_k{K}_g{G}_{'ri' if routed else route_name}_{tiles.name}"
    name = f"dsv2_moe_gu_{tag}"
    L2R = "true" if tiles.l2_rows else "false"
    srow_ok = "true" if (H // G * 2) % 16 == 0 else "false"
    # l2_down: after its last row, each warp asks L2 for its 16-byte-aligned piece of each
    # selected expert's down rows (bytes of one expert's weights / scales, of a warp's piece)
    down_w, down_s = H * NI // 2, H * (NI // G) * 2
    piece_w, piece_s = (-(-b // (NB * W * 16)) * 16 for b in (down_w, down_s))
    down_tail = (
        f"""
  // after its last row, the next kernel's routed down rows: warp w takes part w of this
  // block's slice of each selected expert's weights (q < K) and scales (q >= K), lane q
  dsv2_gu_routed_{tag}(ready);
  for (int q = lane; q < {2 * K}; q += 32) {{
    const bool sc = q >= {K};
    const long long e = s_ids[sc ? q - {K} : q];
    const long long total = sc ? {down_s} : {down_w}, piece = sc ? {piece_s} : {piece_w};
    const long long off = (long long)(blk * {W} + warp) * piece;
    const char* base = sc ? reinterpret_cast<const char*>(ds + e * {H * (NI // G)})
                          : reinterpret_cast<const char*>(dw + e * {H * NI // 8});
    if (off < total) {L2_PREFETCH}(base + off, (unsigned)min(piece, total - off));
  }}
"""
        if tiles.l2_down
        else ""
    )
    # the down rows' buffers: parameters only of the l2_down variant
    down_params = (
        "const unsigned* __restrict__ dw, const half* __restrict__ ds,\n    "
        if tiles.l2_down
        else ""
    )
    # routed: the ids come from the kernel before (oproj_router_cuda), which also writes the
    # weights the down kernel reads; else warp 0 of every block routes the logits
    routing_in = "const int* __restrict__ rids" if routed else "const float* __restrict__ logits"
    routing_out = "" if routed else ", float* __restrict__ wout, int* __restrict__ iout"
    shared_routing = (
        f"__shared__ int s_ids[{K}];"
        if routed
        else f"__shared__ float s_w[{K}];\n  __shared__ int s_ids[{K}];\n"
        f"  __shared__ float s_p[{E}];"
    )
    # routed, warp 0 too loads its first shared row before the wait (it has no routing to do)
    early = f"i < {IS}" if routed else f"i < {IS} && warp != 0"
    warp0_late = "!early && " if routed else ""
    route_body = (
        f"""
    if (lane < {K}) s_ids[lane] = rids[t * {K} + lane];"""
        if routed
        else f"""
    {route_name}(logits + t * {E}, s_w, s_ids, lane, s_p);
    if (blk == 0 && lane < {K}) {{
      wout[t * {K} + lane] = s_w[lane];
      iout[t * {K} + lane] = s_ids[lane];
    }}"""
    )
    x_param, dots = swiglu_dots_source(H, tiles.run, tiles.x_shared)
    if tiles.x_shared:  # the warp's own copy of x in shared memory: piece p of chunk c at swz
        x_stage = f"""  __shared__ __align__(16) uint4 xs[{W}][{H // 8}];
  uint4* xv = xs[warp];
  const uint4* xrow = reinterpret_cast<const uint4*>(x + t * {H});
  for (int v = lane; v < {H // 8}; v += 32) xv[dsv2_swz(v >> 2, v & 3)] = dsv2_pair8(xrow[v]);
  __syncwarp();"""
    else:
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
// L2 prefetch of the gate and up rows (weights, scales) of item i + lane * {stride}, if it is a
// shared item (shared = true) or a routed one (false; ids must be ready)
__device__ __forceinline__ void dsv2_gu_prefetch_{tag}(int i, int lane, bool shared,
    const unsigned* __restrict__ w, const half* __restrict__ s,
    const unsigned* __restrict__ sw, const half* __restrict__ ss, const int* ids) {{
  const int it = i + lane * {stride};
  if (it >= {items} || (shared && it >= {IS}) || (!shared && it < {IS})) return;
  const dsv2_gu_row_{tag} p = dsv2_gu_row_at_{tag}(it, w, s, sw, ss, ids, false, nullptr);
  {L2_PREFETCH}(p.gp, {H // 2});
  {L2_PREFETCH}(p.gp + p.up_w, {H // 2});
  if ({srow_ok}) {{  // a row's scales, where they are whole 16-byte pieces
    {L2_PREFETCH}(p.gs, {H // G * 2});
    {L2_PREFETCH}(p.gs + p.up_s, {H // G * 2});
  }}
}}
__device__ __forceinline__ void dsv2_gu_store_{tag}(const dsv2_gu_buf_{tag}& b, int i, int lane,
    {x_param}, half* __restrict__ hrow) {{
{dots}
  if (lane == 0) hrow[dsv2_gu_out_{tag}(i)] = __float2half(g / (1.f + __expf(-g)) * u);
}}
__device__ __forceinline__ void {name}(const half* __restrict__ x,
    {routing_in}, const unsigned* __restrict__ w,
    const half* __restrict__ s, const unsigned* __restrict__ sw, const half* __restrict__ ss,
    {down_params}half* __restrict__ hout{routing_out},
    long long t, int blk, int tid) {{
  {shared_routing}
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
  if ({L2R}) dsv2_gu_prefetch_{tag}(i + {stride}, lane, true, w, s, sw, ss, s_ids);
  {WAIT_THEN_RELEASE}
  if (warp != 0 && !early && i < {items})
    dsv2_gu_load_{tag}(a, i, lane, w, s, sw, ss, s_ids, ready);
  if (warp == 0) {{{route_body}
    __threadfence_block();
    __syncwarp();
    if (lane == 0) *((volatile int*)&s_ready) = 1;
    if ({warp0_late}i < {items}) dsv2_gu_load_{tag}(a, i, lane, w, s, sw, ss, s_ids, ready);
  }}
{x_stage}
  bool routed_pf = !{L2R};  // the warp's routed rows: prefetched at its first routed load
  while (i < {items}) {{
    const int i1 = i + {stride};
    if (!routed_pf && i1 >= {IS}) {{
      dsv2_gu_routed_{tag}(ready);
      dsv2_gu_prefetch_{tag}(i1, lane, false, w, s, sw, ss, s_ids);
      routed_pf = true;
    }}
    if (i1 < {items}) dsv2_gu_load_{tag}(b, i1, lane, w, s, sw, ss, s_ids, ready);
    dsv2_gu_store_{tag}(a, i, lane, xv, hrow);
    if (i1 >= {items}) break;
    const int i2 = i1 + {stride};
    if (i2 < {items}) dsv2_gu_load_{tag}(a, i2, lane, w, s, sw, ss, s_ids, ready);
    dsv2_gu_store_{tag}(b, i1, lane, xv, hrow);
    i = i2;
  }}{down_tail}
}}
#endif
"""
    pre = grid_wait_source() + l2_prefetch_source() + dot32_source(tiles.run)
    return name, pre + ("" if routed else route_src) + src


def down_source(s: MoeDecodeShape, tiles: DecodeTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of kernel 2 (module docstring); with
    ``tiles.early_route`` it takes the router's ``logits`` instead of kernel 1's routing."""
    _check_tiles(tiles)
    H, NI, IS, K, G, TOT = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.total
    E = s.experts
    L, R, W = tiles.lanes, tiles.rows, tiles.warps
    ci = NI // _CHUNK  # chunks of one routed slot
    kci = K * ci
    nc = kci + IS // _CHUNK  # chunks of one output row, all experts
    cpl = -(-nc // L)
    exact = "true" if nc % L == 0 else "false"
    threads = W * 32
    early = tiles.early_route
    route_name, route_src = s.router.warp_source() if early else ("", "")
    tag = f"h{H}_i{NI}_s{IS}_k{K}_g{G}_{route_name + '_' if early else ''}{tiles.name}"
    name = f"dsv2_moe_dn_{tag}"
    routing_in = (
        "const float* __restrict__ logits," if early
        else "const float* __restrict__ wts, const int* __restrict__ ids,"
    )  # fmt: skip
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
    scratch = f"\n  __shared__ float s_p[{E}];  // the router's scratch" if early else ""
    if early:
        # The logits are two kernels back (router -> gate/up -> down): complete before this
        # kernel starts, since gate/up releases its dependents only after its own wait
        # (cuda_call.grid_wait_source). The routing is the same function on the same logits as
        # kernel 1's, so the same experts and weights.
        route_first = f"""
  // routed first (no weight in flight yet: fewer registers live than around the loads)
  if (warp == 0) {route_name}(logits + t * {E}, s_w, s_ids, lane, s_p);
  __syncthreads();"""
        before_wait = routed_loads
        after_stage, after_sync = "", ""
    else:
        route_first, before_wait = "", ""
        after_stage = f"""
  if (tid < {K}) {{
    s_w[tid] = wts[t * {K} + tid];
    s_ids[tid] = ids[t * {K} + tid];
  }}"""
        after_sync = routed_loads
    src = f"""
#ifndef DSV2_MOE_DN_{tag}
#define DSV2_MOE_DN_{tag}
__device__ __forceinline__ void {name}(const half* __restrict__ h,
    {routing_in}
    const unsigned* __restrict__ dw, const half* __restrict__ ds,
    const unsigned* __restrict__ sdw, const half* __restrict__ sds, half* __restrict__ out,
    long long t, int blk, int tid) {{
  // h of the token: 16-byte piece p of chunk c at dsv2_swz(c, p)
  __shared__ __align__(16) uint4 hs[{TOT // 8}];
  __shared__ float s_w[{K}];
  __shared__ int s_ids[{K}];{scratch}
  const int warp = tid >> 5, lane = tid & 31;
  const int grp = lane / {L}, gl = lane % {L};
  const int o0 = ((blk * {W} + warp) * {32 // L} + grp) * {R};
  uint4 wq[{cpl}][{R}];
  half sc[{cpl}][{R}];{route_first}
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
  }}{before_wait}
  {WAIT_THEN_RELEASE}  // (PDL) the loads above overlap the previous kernel, which wrote h
  const uint4* hrow = reinterpret_cast<const uint4*>(h + t * {TOT});
  for (int v = tid; v < {TOT // 8}; v += {threads}) {{
    const int c = v >> 2, p = v & 3;
    hs[dsv2_swz(c, p)] = dsv2_pair8(hrow[v]);  // pair order, once
  }}{after_stage}
  __syncthreads();{after_sync}
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
    return name, grid_wait_source() + dot32_source(tiles.run) + route_src + src


def _blocks(outputs: int, tiles: DecodeTiles) -> int:
    return -(-outputs // tiles.outputs_per_block)


def moe_gate_up_decode(
    s: MoeDecodeShape, tiles: GateUpTiles = GATE_UP_TILES, routed: bool = False
) -> tirx.PrimFunc:
    """``f(x [n, H] f16, logits [n, E] f32, w [E, 2I, H/8] u32, s [E, 2I, H/g] f16,
    shared_w [2 Is, H/8] u32, shared_s [2 Is, H/g] f16[, down_w [E, H, I/8] u32, down_s [E, H,
    I/g] f16]) -> (h [n, K I + Is] f16, weights [n, K] f32, ids [n, K] i32)`` (module docstring,
    kernel 1; the down rows only with ``tiles.l2_down``). With ``routed`` it takes the expert
    ids ``[n, K] i32`` of the kernel before (:mod:`~dsv2_mlc.schedules.oproj_router_cuda`)
    instead of the logits and returns ``h`` alone: no block routes, and warp 0 too loads its
    first shared row before the PDL wait."""
    why = s.unsupported()
    if why:
        raise ValueError(f"moe_gate_up_decode: {why}")
    if tiles.warps < 1 or tiles.blocks < 1:
        raise ValueError(f"bad tiles {tiles}")
    if tiles.x_shared and tiles.warps * s.hidden * 2 + 4 * s.experts + 64 > _SHARED_LIMIT:
        raise ValueError(f"moe_gate_up_decode: {tiles.warps} copies of x do not fit in 48 KB")
    NB, THREADS = tiles.blocks, tiles.warps * 32
    fname, src = gate_up_source(s, tiles, routed)

    return token_grid_call(
        "moe_gate_up",
        fname,
        src,
        gate_up_params(s, tiles.l2_down, routed),
        NB,
        THREADS,
        min_blocks=tiles.min_blocks,
    )


def gate_up_params(s: MoeDecodeShape, down: bool = False, routed: bool = False) -> list[tuple]:
    """The buffers of a gate/up kernel (``token_grid_call`` parameters), see
    :func:`moe_gate_up_decode`; ``down``: with the down rows' (``GateUpTiles.l2_down``);
    ``routed``: the expert ids in, ``h`` alone out."""
    H, NI, IS, E, K, G = s.hidden, s.inter, s.shared_inter, s.experts, s.top_k, s.group
    routing_out = (
        [] if routed else [("wout", (TOKENS, K), "float32"), ("iout", (TOKENS, K), "int32")]
    )
    return [
        ("x", (TOKENS, H), "float16"),
        ("ids", (TOKENS, K), "int32") if routed else ("logits", (TOKENS, E), "float32"),
        ("w", (E, 2 * NI, H // 8), "uint32"),
        ("sc", (E, 2 * NI, H // G), "float16"),
        ("sw", (2 * IS, H // 8), "uint32"),
        ("ss", (2 * IS, H // G), "float16"),
        *([("dw", (E, H, NI // 8), "uint32"), ("ds", (E, H, NI // G), "float16")] if down else []),
        ("hout", (TOKENS, K * NI + IS), "float16"),
        *routing_out,
    ]


def moe_down_decode(s: MoeDecodeShape, tiles: DecodeTiles = DOWN_TILES) -> tirx.PrimFunc:
    """``f(h [n, K I + Is] f16, weights [n, K] f32, ids [n, K] i32, w [E, H, I/8] u32,
    s [E, H, I/g] f16, shared_w [H, Is/8] u32, shared_s [H, Is/g] f16) -> out [n, H] f16``
    (module docstring, kernel 2); with ``tiles.early_route``, ``logits [n, E] f32`` (the
    router's, as kernel 1 takes them) instead of ``weights`` and ``ids``."""
    why = s.unsupported()
    if why:
        raise ValueError(f"moe_down_decode: {why}")
    H, NI, IS, E, K, G = s.hidden, s.inter, s.shared_inter, s.experts, s.top_k, s.group
    NB, THREADS = _blocks(H, tiles), tiles.warps * 32
    fname, src = down_source(s, tiles)

    routing = (
        [("logits", (TOKENS, E), "float32")]
        if tiles.early_route
        else [("wts", (TOKENS, K), "float32"), ("ids", (TOKENS, K), "int32")]
    )
    return token_grid_call(
        "moe_down",
        fname,
        src,
        [
            ("h", (TOKENS, K * NI + IS), "float16"),
            *routing,
            ("w", (E, H, NI // 8), "uint32"),
            ("sc", (E, H, NI // G), "float16"),
            ("sw", (H, IS // 8), "uint32"),
            ("ss", (H, IS // G), "float16"),
            ("out", (TOKENS, H), "float16"),
        ],
        NB,
        THREADS,
        min_blocks=tiles.min_blocks,
    )

"""MoE decode gate/up + SwiGLU on Hopper with the expert rows moved by bulk copies (TMA).

The register design of :func:`dsv2_mlc.schedules.moe_decode_cuda.moe_gate_up_decode` reads
~24 MB at ~2 TB/s on the H200: Nsight Compute shows 2 blocks of 8 warps per SM (96 registers a
thread), ~1 eligible warp per scheduler and DRAM at 40 % of peak; every warp has two outputs in
flight, so the bytes requested at a time are bounded by the warps' registers. Here each block
owns a contiguous range of ``rows`` outputs (``items`` as in that kernel: the shared experts'
rows, then the routed slots' rows) and copies the gate rows, up rows and their scales straight
into shared memory with ``cp.async.bulk`` (:mod:`~dsv2_mlc.schedules.bulk_copy_cuda`), in
*stages* of ``stage_rows`` outputs, one ``mbarrier`` each: the whole range is requested at once
(~180 KB a block at V2-Lite, one block per SM), and the warps compute each output as soon as its
stage has landed.

* Stages are cut at multiples of ``stage_rows`` in the global output index; ``stage_rows``
  divides the routed intermediate size ``I`` and the shared width ``Is``, so a stage is one
  contiguous run of one expert's rows (four bulk copies: gate, up, their scales).
* The shared experts' stages need no routing: thread 32 issues them before the kernel's PDL wait
  (:func:`~dsv2_mlc.schedules.cuda_call.grid_wait_source`); after the wait warp 0 routes the
  token (the warp router of :mod:`~dsv2_mlc.schedules.moe_routing`) and its lane 0 issues the
  routed stages. Block 0 writes the routing ``weights`` / ``ids``.
* Output ``l`` of the block is computed by warp ``l % warps``: it waits for the stage's barrier,
  reads the row's 16-byte chunks from shared memory (lane ``c`` takes chunks ``c, c + 32, ...``)
  against ``x`` in registers, the half2 INT4 dot product of
  :func:`~dsv2_mlc.schedules.decode_gemv_cuda.dot32_source`, SiLU(gate) * up in float32, one
  fp16 rounding: the same arithmetic as the register kernel.

Same signature as ``moe_gate_up_decode``; sm_90 or newer only (bulk copies, mbarrier
transactions). Reference: the register kernel's (the Relax composition on the CPU, checked
against Hugging Face in CI); ``tests/test_moe_decode_emulation.py`` runs this kernel's CUDA on the
CPU against NumPy, ``schedules/lab/kernel_lab_moe_decode.py`` times it on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .bulk_copy_cuda import bulk_copy_source
from .cuda_call import GRID_WAIT, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .moe_decode_cuda import MoeDecodeShape, gate_up_params
from .moe_routing import route_warp_source

__all__ = ["BULK_TILES", "BulkTiles", "bulk_unsupported", "moe_gate_up_bulk"]

_CHUNK = 32
_DYN_SHARED_LIMIT = 227 * 1024  # sm_90 opt-in limit of one block
_BAR_BYTES_ALIGN = 128


@dataclass(frozen=True)
class BulkTiles:
    """``blocks`` per token of ``warps`` warps; ``stage_rows`` outputs per bulk-copy stage;
    ``run`` products per fp16 partial sum."""

    warps: int = 16
    blocks: int = 132
    stage_rows: int = 8
    run: int = 16

    @property
    def name(self) -> str:
        return f"w{self.warps}_b{self.blocks}_s{self.stage_rows}_h{self.run}"


BULK_TILES = BulkTiles()


def _layout(s: MoeDecodeShape, tiles: BulkTiles) -> tuple[int, int, int, int]:
    """(outputs per block, stages per block at most, barrier bytes, dynamic shared bytes)."""
    rows = -(-s.total // tiles.blocks)
    stages = rows // tiles.stage_rows + 2
    bar_bytes = -(-stages * 8 // _BAR_BYTES_ALIGN) * _BAR_BYTES_ALIGN
    row_bytes = 2 * (s.hidden // 2) + 2 * (s.hidden // s.group) * 2
    return rows, stages, bar_bytes, bar_bytes + rows * row_bytes


def bulk_unsupported(s: MoeDecodeShape, tiles: BulkTiles = BULK_TILES) -> str | None:
    """Why :func:`moe_gate_up_bulk` cannot take ``s`` with ``tiles`` (None: it can)."""
    why = s.unsupported()
    if why:
        return why
    sr = tiles.stage_rows
    if sr < 1 or s.inter % sr or s.shared_inter % sr:
        return f"stage_rows {sr} does not divide I={s.inter} and Is={s.shared_inter}"
    if (s.hidden // s.group) * 2 % 16:
        return f"a row's scales ({s.hidden // s.group} fp16) are not whole 16-byte pieces"
    if tiles.warps < 2 or tiles.blocks < 1:
        return f"bad tiles {tiles}"
    smem = _layout(s, tiles)[3]
    if smem > _DYN_SHARED_LIMIT:
        return f"{smem} bytes of shared memory a block (limit {_DYN_SHARED_LIMIT}): more blocks"
    return None


def bulk_source(s: MoeDecodeShape, tiles: BulkTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of the kernel (module docstring)."""
    route_name, route_src = route_warp_source(
        s.experts, s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor
    )
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, SR, ITEMS = tiles.warps, tiles.stage_rows, s.total
    ROWB, SROWB = H // 2, (H // G) * 2  # bytes of a weight row and of its scales
    RPB, _, BAR_BYTES, _ = _layout(s, tiles)
    nch = H // _CHUNK
    cpl = -(-nch // 32)
    tag = f"h{H}_i{NI}_s{IS}_k{K}_g{G}_{route_name}_{tiles.name}"
    name = f"dsv2_moe_gu_bulk_{tag}"
    src = f"""
#ifndef DSV2_MOE_GU_BULK_{tag}
#define DSV2_MOE_GU_BULK_{tag}
// stage m (global) = outputs [m * {SR}, (m + 1) * {SR}) of one expert; issue the block's part
__device__ __forceinline__ void dsv2_gub_issue_{tag}(int m, int r0, int r1,
    unsigned long long* bars, unsigned char* gbuf, unsigned char* ubuf, unsigned char* sgbuf,
    unsigned char* subuf, const unsigned* __restrict__ w, const half* __restrict__ sc,
    const unsigned* __restrict__ sw, const half* __restrict__ ss, const int* ids) {{
  const int a = max(m * {SR}, r0), b = min((m + 1) * {SR}, r1);
  const unsigned nrow = b - a;
  const unsigned char *gp, *up, *gs, *us;
  if (a < {IS}) {{  // the shared experts' fused gate_up_proj: gate rows [0, Is), up [Is, 2 Is)
    gp = reinterpret_cast<const unsigned char*>(sw) + (long long)a * {ROWB};
    up = gp + (long long){IS} * {ROWB};
    gs = reinterpret_cast<const unsigned char*>(ss) + (long long)a * {SROWB};
    us = gs + (long long){IS} * {SROWB};
  }} else {{  // routed slot j, row r of expert ids[j]: gate rows [0, I), up [I, 2 I)
    const int o = a - {IS};
    const int j = o / {NI}, r = o - j * {NI};
    const long long row = (long long)ids[j] * {2 * NI} + r;
    gp = reinterpret_cast<const unsigned char*>(w) + row * {ROWB};
    up = gp + (long long){NI} * {ROWB};
    gs = reinterpret_cast<const unsigned char*>(sc) + row * {SROWB};
    us = gs + (long long){NI} * {SROWB};
  }}
  unsigned long long* bar = bars + (m - r0 / {SR});
  const int l = a - r0;
  dsv2_mbar_expect_arrive(bar, nrow * {2 * ROWB + 2 * SROWB});
  dsv2_bulk_g2s(gbuf + l * {ROWB}, gp, nrow * {ROWB}, bar);
  dsv2_bulk_g2s(ubuf + l * {ROWB}, up, nrow * {ROWB}, bar);
  dsv2_bulk_g2s(sgbuf + l * {SROWB}, gs, nrow * {SROWB}, bar);
  dsv2_bulk_g2s(subuf + l * {SROWB}, us, nrow * {SROWB}, bar);
}}
__device__ __forceinline__ void {name}(const half* __restrict__ x,
    const float* __restrict__ logits, const unsigned* __restrict__ w,
    const half* __restrict__ sc, const unsigned* __restrict__ sw, const half* __restrict__ ss,
    half* __restrict__ hout, float* __restrict__ wout, int* __restrict__ iout,
    unsigned* __restrict__ smem, const unsigned* smem_end, long long t, int blk, int tid) {{
  __shared__ float s_w[{K}];
  __shared__ int s_ids[{K}];
  __shared__ float s_p[{E}];
  const int warp = tid >> 5, lane = tid & 31;
  const int r0 = blk * {RPB}, r1 = min(r0 + {RPB}, {ITEMS});
  const int m0 = r0 / {SR}, m1 = r1 > r0 ? (r1 - 1) / {SR} + 1 : m0;  // the block's stages
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem);
  unsigned char* gbuf = reinterpret_cast<unsigned char*>(smem) + {BAR_BYTES};
  unsigned char* ubuf = gbuf + {RPB * ROWB};
  unsigned char* sgbuf = ubuf + {RPB * ROWB};
  unsigned char* subuf = sgbuf + {RPB * SROWB};
  if (tid == 0) {{
    for (int m = m0; m < m1; ++m) dsv2_mbar_init(bars + (m - m0));
    dsv2_mbar_fence_init();
  }}
  __syncthreads();
  // the shared experts' stages need no routing: requested before the wait (PDL)
  if (tid == 32) {{
    for (int m = m0; m < m1 && m * {SR} < {IS}; ++m)
      dsv2_gub_issue_{tag}(m, r0, r1, bars, gbuf, ubuf, sgbuf, subuf, w, sc, sw, ss, s_ids);
  }}
  {GRID_WAIT}();
  if (warp == 0) {{
    {route_name}(logits + t * {E}, s_w, s_ids, lane, s_p);
    if (blk == 0 && lane < {K}) {{
      wout[t * {K} + lane] = s_w[lane];
      iout[t * {K} + lane] = s_ids[lane];
    }}
    __syncwarp();
    if (lane == 0) {{
      for (int m = max(m0, {IS // SR}); m < m1; ++m)
        dsv2_gub_issue_{tag}(m, r0, r1, bars, gbuf, ubuf, sgbuf, subuf, w, sc, sw, ss, s_ids);
    }}
  }}
  uint4 xv[{cpl}][4];
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      const uint4* p = reinterpret_cast<const uint4*>(x + t * {H} + c * {_CHUNK});
#pragma unroll
      for (int k = 0; k < 4; ++k) xv[j][k] = dsv2_pair8(p[k]);  // pair order, once
    }}
  }}
  half* hrow = hout + t * {ITEMS};
  for (int l = warp; l < r1 - r0; l += {W}) {{
    const int i = r0 + l;
    dsv2_mbar_wait(bars + (i / {SR} - m0), 0);
    const uint4* gq = reinterpret_cast<const uint4*>(gbuf + l * {ROWB});
    const uint4* uq = reinterpret_cast<const uint4*>(ubuf + l * {ROWB});
    const half* gsc = reinterpret_cast<const half*>(sgbuf + l * {SROWB});
    const half* usc = reinterpret_cast<const half*>(subuf + l * {SROWB});
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int j = 0; j < {cpl}; ++j) {{
      const int c = lane + 32 * j;
      if (c < {nch}) {{
        const uint4 gw = gq[c], uw = uq[c];
        g += dsv2_dot32p_int4_h{tiles.run}(reinterpret_cast<const unsigned*>(&gw), xv[j],
                                           gsc[c * {_CHUNK} / {G}]);
        u += dsv2_dot32p_int4_h{tiles.run}(reinterpret_cast<const unsigned*>(&uw), xv[j],
                                           usc[c * {_CHUNK} / {G}]);
      }}
    }}
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {{
      g += __shfl_xor_sync(0xffffffffu, g, o);
      u += __shfl_xor_sync(0xffffffffu, u, o);
    }}
    if (lane == 0) {{
      const int out = i < {IS} ? {K * NI} + i : i - {IS};
      hrow[out] = __float2half(g / (1.f + __expf(-g)) * u);
    }}
  }}
}}
#endif
"""
    return name, grid_wait_source() + bulk_copy_source() + dot32_source(tiles.run) + route_src + src


def moe_gate_up_bulk(s: MoeDecodeShape, tiles: BulkTiles = BULK_TILES) -> tirx.PrimFunc:
    """``f(x [n, H] f16, logits [n, E] f32, w [E, 2I, H/8] u32, s [E, 2I, H/g] f16,
    shared_w [2 Is, H/8] u32, shared_s [2 Is, H/g] f16) -> (h [n, K I + Is] f16,
    weights [n, K] f32, ids [n, K] i32)``, as ``moe_gate_up_decode`` (module docstring)."""
    why = bulk_unsupported(s, tiles)
    if why:
        raise ValueError(f"moe_gate_up_bulk: {why}")
    fname, src = bulk_source(s, tiles)
    return token_grid_call(
        "moe_gate_up_bulk",
        fname,
        src,
        gate_up_params(s),
        tiles.blocks,
        tiles.warps * 32,
        dyn_shared_bytes=_layout(s, tiles)[3],
    )

"""DeepSeekMoE decode in one kernel (lab): routing, every expert's gate/up + SwiGLU and its down
projection, the weighted sum by float32 reductions in L2.

:mod:`~dsv2_mlc.schedules.moe_decode_cuda` runs a layer's MoE block at batch 1 as two kernels,
gate/up then down, with a dependent launch between them (an output of the down projection needs
every expert's whole ``h``): 10.8 + 6.95 us of a replayed V2-Lite decode step on the H200 for
35.7 MB of INT4 weights. The earlier attempts to remove a boundary moved a cross-block reduction
into a kernel's tail (a ticket, then the last block reading the others' partials: a dependent
round trip as long as the boundary). This kernel has none: a block owns ``rows`` rows of one
expert's intermediate (a slice of ``h``), computes them (gate/up rows, SwiGLU, rounded to fp16 as
the two-kernel path rounds ``h``) into shared memory, and multiplies them at once by the same
slice of that expert's down columns. Its partial of all ``H`` outputs, times the expert's routing
weight, is added to the float32 output by ``atomicAdd`` on ``float4`` (a ``red.global.add``:
fire and forget, no block waits for another; the next kernel's PDL wait covers their
completion). The down columns of the slice (``H`` rows x ``rows / 32`` 16-byte chunks, stored
XOR-swizzled) are copied into shared memory by ``cp.async`` as soon as the block knows its
expert, so they stream together with the gate/up rows; each thread keeps the scales of its
``H / threads`` outputs in registers.

Grid per token: ``Is / rows`` shared-expert blocks (weight 1, no routing: their first gate/up
rows, their down columns and scales are in flight before the PDL wait), then ``K * I / rows``
routed blocks (slot ``j = (b - Is / rows) // (I / rows)``): warp 0 routes (the warp router of
:mod:`~dsv2_mlc.schedules.moe_routing`, as kernel 1 of the two-kernel path does) while the other
warps stage ``x`` in pair order. Each warp takes rows ``w, w + warps, ...`` of the slice, two in
flight (the gate/up kernel's ring). ``out [n, H]`` float32 must be zero when the kernel starts
(the kernel before zeroes it); the sum's order across blocks is the L2's, so the output is not
bit-reproducible from one run to the next (float32 rounding; the fp16 ``h`` and the fp16 partial
products are those of the two-kernel path). Needs sm_90 (``atomicAdd`` on ``float4``).

Checked on the CPU against float64 NumPy (``tests/test_moe_fused_emulation.py``); timed against
the two kernels in ``schedules/lab/kernel_lab_moe_decode.py``. On the H200 (V2-Lite shape,
schedules/results/moe_decode.md, round 9) it is slower at batch 1 (best tiles, 352 blocks with
``x`` in shared memory: 17.8 us of kernel time against the pair's 16.7) and faster at batch 4
(58.8 against 62.6): it streams at the pair's rate, so the model keeps the pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .moe_decode_cuda import MoeDecodeShape, swiglu_dots_source, x_lanes_source

__all__ = ["FUSED_TILES", "FusedTiles", "fused_unsupported", "moe_fused_decode"]

_CHUNK = 32  # INT4 values per 16-byte load


@dataclass(frozen=True)
class FusedTiles:
    """Work split of the fused kernel: ``rows`` of ``h`` a block (32, 64 or 128: one to four
    16-byte chunks of each down row), ``warps`` per block, ``run`` / ``down_run`` products per
    fp16 partial sum of the gate/up and down dot products, ``min_blocks`` blocks an SM for
    ``__launch_bounds__`` (0: none), ``x_shared``: ``x`` staged in shared memory (pair order,
    swizzled) instead of each lane's registers."""

    rows: int = 64
    warps: int = 8
    run: int = 16
    down_run: int = 8
    min_blocks: int = 2
    x_shared: bool = False  # x staged in shared memory (fewer registers) instead of registers

    @property
    def name(self) -> str:
        bound = f"_m{self.min_blocks}" if self.min_blocks else ""
        xs = "_xs" if self.x_shared else ""
        return f"r{self.rows}_w{self.warps}_h{self.run}_d{self.down_run}{bound}{xs}"


FUSED_TILES = FusedTiles()


def fused_unsupported(s: MoeDecodeShape, tiles: FusedTiles = FUSED_TILES) -> str | None:
    """Why :func:`moe_fused_decode` cannot run this shape and split (None: it can)."""
    why = s.unsupported()
    if why:
        return why
    r, threads = tiles.rows, tiles.warps * 32
    if r not in (32, 64, 128):
        return f"rows {r} is not 32, 64 or 128"
    if s.inter % r or s.shared_inter % r:
        return f"rows {r} does not divide the intermediate sizes {s.inter} / {s.shared_inter}"
    if tiles.warps < 1 or r % tiles.warps:
        return f"warps {tiles.warps} does not divide rows {r}"
    if s.hidden % (4 * threads):
        return f"hidden {s.hidden} is not a multiple of 4 x {threads} threads"
    dyn = _dyn_bytes(s, tiles)
    if dyn > 227 * 1024:
        return f"{dyn} bytes of shared memory"
    return None


def _dyn_bytes(s: MoeDecodeShape, tiles: FusedTiles) -> int:
    """Dynamic shared memory: the slice's down columns (16 bytes a chunk), the partial sums."""
    return s.hidden * (tiles.rows // _CHUNK) * 16 + s.hidden * 4


def fused_source(s: MoeDecodeShape, tiles: FusedTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of the fused kernel (module docstring)."""
    route_name, route_src = s.router.warp_source()
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    R, W = tiles.rows, tiles.warps
    T = W * 32
    nch = H // _CHUNK  # chunks of a gate/up row
    cpl = -(-nch // 32)  # chunks per lane
    exact = "true" if nch % 32 == 0 else "false"
    rc = R // _CHUNK  # chunks of a down row in the slice
    swz_shift = {1: 0, 2: 2, 4: 1}[rc]  # 8 lanes' rows on 8 distinct 16-byte bank groups
    nsh, spe = IS // R, NI // R  # shared blocks, blocks of a routed slot
    opt = H // T  # outputs a thread in the down phase
    tag = f"h{H}_i{NI}_s{IS}_k{K}_g{G}_{route_name}_{tiles.name}"
    name = f"dsv2_moe_fused_{tag}"
    x_param, dots = swiglu_dots_source(H, tiles.run, tiles.x_shared)
    if tiles.x_shared:  # x in shared memory, piece p of chunk c at dsv2_swz(c, p)
        x_stage = f"""
  __shared__ __align__(16) uint4 xs[{H // 8}];
  const uint4* xrow = reinterpret_cast<const uint4*>(x + t * {H});
  for (int v = tid; v < {H // 8}; v += {T}) xs[dsv2_swz(v >> 2, v & 3)] = dsv2_pair8(xrow[v]);
  __syncthreads();  // x (and the routing)
  const uint4* xv = xs;"""
    else:  # x in each lane's registers: its chunks lane + 32 j
        x_stage = f"""
{x_lanes_source(H)}
  __syncthreads();  // the routing"""
    src = f"""
#ifndef DSV2_MOE_FUSED_{tag}
#define DSV2_MOE_FUSED_{tag}
struct dsv2_mf_buf_{tag} {{
  uint4 g[{cpl}], u[{cpl}];
  half sg[{cpl}], su[{cpl}];
}};
// one 16-byte copy into shared memory (cp.async: no register holds it); lands by dsv2_mf_land
__device__ __forceinline__ void dsv2_mf_cp_{tag}(void* dst, const void* src) {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#else
  memcpy(dst, src, 16);
#endif
}}
__device__ __forceinline__ void dsv2_mf_land_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}}
// out[0..3] += v in L2 (a reduction, nothing returned)
__device__ __forceinline__ void dsv2_mf_red4_{tag}(float* p, float4 v) {{
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<float4*>(p), v);
#else
  std::atomic_ref<float>(p[0]).fetch_add(v.x);
  std::atomic_ref<float>(p[1]).fetch_add(v.y);
  std::atomic_ref<float>(p[2]).fetch_add(v.z);
  std::atomic_ref<float>(p[3]).fetch_add(v.w);
#endif
}}
// where chunk c of down row o sits in shared memory
__device__ __forceinline__ int dsv2_mf_swz_{tag}(int o, int c) {{
  return o * {rc} + (c ^ ((o >> {swz_shift}) & {rc - 1}));
}}
__device__ __forceinline__ void dsv2_mf_load_{tag}(dsv2_mf_buf_{tag}& b, int i, int lane,
    const unsigned* gw, const half* gs, long long up_w, long long up_s) {{
  const unsigned* gp = gw + (long long)i * {H // 8};
  const half* sp = gs + (long long)i * {H // G};
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if ({exact} || c < {nch}) {{
      b.g[j] = reinterpret_cast<const uint4*>(gp)[c];
      b.u[j] = reinterpret_cast<const uint4*>(gp + up_w)[c];
      b.sg[j] = sp[c * {_CHUNK} / {G}];
      b.su[j] = sp[up_s + c * {_CHUNK} / {G}];
    }}
  }}
}}
__device__ __forceinline__ void dsv2_mf_store_{tag}(const dsv2_mf_buf_{tag}& b, int i, int lane,
    {x_param}, half* hs) {{
{dots}
  if (lane == 0) hs[i] = __float2half(g / (1.f + __expf(-g)) * u);
}}
__device__ __forceinline__ void {name}(const half* __restrict__ x,
    const float* __restrict__ logits, const unsigned* __restrict__ w,
    const half* __restrict__ s, const unsigned* __restrict__ sw, const half* __restrict__ ss,
    const unsigned* __restrict__ dw, const half* __restrict__ ds,
    const unsigned* __restrict__ sdw, const half* __restrict__ sds, float* __restrict__ out,
    unsigned* __restrict__ smem, unsigned* smem_end, long long t, int blk, int tid) {{
  __shared__ float s_w[{K}];
  __shared__ int s_ids[{K}];
  __shared__ float s_p[{E}];
  __shared__ __align__(16) half s_h[{R}];
  uint4* s_dw = reinterpret_cast<uint4*>(smem);  // [H][rows / 32], swizzled
  float* s_part = reinterpret_cast<float*>(smem + {H * rc * 4});  // [H]
  const int warp = tid >> 5, lane = tid & 31;
  const bool shared = blk < {nsh};
  const int slot = shared ? 0 : (blk - {nsh}) / {spe};
  const int r0 = shared ? blk * {R} : (blk - {nsh} - slot * {spe}) * {R};
  dsv2_mf_buf_{tag} a, b;
  half dsc[{opt}][{rc}];
  const unsigned* gw = nullptr;
  const half* gs = nullptr;
  long long up_w = 0, up_s = 0;
  float wt = 1.f;
  // this block's rows of gate/up and columns of down (the shared experts' before the wait)
  auto start = [&](long long e) {{
    const unsigned* dbase;
    const half* dsb;
    int dstride, sstride;
    if (shared) {{
      gw = sw + (long long)r0 * {H // 8};
      gs = ss + (long long)r0 * {H // G};
      up_w = (long long){IS} * {H // 8};
      up_s = (long long){IS} * {H // G};
      dbase = sdw + r0 / 8;
      dsb = sds;
      dstride = {IS // 8};
      sstride = {IS // G};
    }} else {{
      const long long row = e * {2 * NI} + r0;
      gw = w + row * {H // 8};
      gs = s + row * {H // G};
      up_w = (long long){NI} * {H // 8};
      up_s = (long long){NI} * {H // G};
      dbase = dw + e * {H * NI // 8} + r0 / 8;
      dsb = ds + e * {H * (NI // G)};
      dstride = {NI // 8};
      sstride = {NI // G};
    }}
    if (warp < {R}) dsv2_mf_load_{tag}(a, warp, lane, gw, gs, up_w, up_s);
#pragma unroll
    for (int k = 0; k < {opt * rc}; ++k) {{
      const int q = tid + {T} * k;
      const int o = q / {rc}, c = q - o * {rc};
      dsv2_mf_cp_{tag}(s_dw + dsv2_mf_swz_{tag}(o, c), dbase + (long long)o * dstride + 4 * c);
    }}
#pragma unroll
    for (int k = 0; k < {opt}; ++k) {{
#pragma unroll
      for (int c = 0; c < {rc}; ++c)
        dsc[k][c] = dsb[(long long)(tid + {T} * k) * sstride + (r0 + {_CHUNK} * c) / {G}];
    }}
  }};
  if (shared) start(0);
  {WAIT_THEN_RELEASE}  // (PDL) the loads above overlap the previous kernel, which wrote x, logits
  if (!shared) {{
    if (warp == 0) {route_name}(logits + t * {E}, s_w, s_ids, lane, s_p);
  }}
{x_stage}
  if (!shared) {{
    wt = s_w[slot];
    start(s_ids[slot]);
  }}
  // rows warp, warp + W, ... of the slice, two in flight
  for (int i = warp; i < {R}; i += {2 * W}) {{
    const int i1 = i + {W};
    if (i1 < {R}) dsv2_mf_load_{tag}(b, i1, lane, gw, gs, up_w, up_s);
    dsv2_mf_store_{tag}(a, i, lane, xv, s_h);
    if (i1 >= {R}) break;
    if (i1 + {W} < {R}) dsv2_mf_load_{tag}(a, i1 + {W}, lane, gw, gs, up_w, up_s);
    dsv2_mf_store_{tag}(b, i1, lane, xv, s_h);
  }}
  dsv2_mf_land_{tag}();
  __syncthreads();  // h of the slice and the down columns in shared memory
  uint4 hq[{rc}][4];
#pragma unroll
  for (int c = 0; c < {rc}; ++c) {{
#pragma unroll
    for (int p = 0; p < 4; ++p)
      hq[c][p] = dsv2_pair8(reinterpret_cast<const uint4*>(s_h)[4 * c + p]);
  }}
#pragma unroll
  for (int k = 0; k < {opt}; ++k) {{
    const int o = tid + {T} * k;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < {rc}; ++c)
      acc += dsv2_dot32p_int4_h{tiles.down_run}(
          reinterpret_cast<const unsigned*>(s_dw + dsv2_mf_swz_{tag}(o, c)), hq[c], dsc[k][c]);
    s_part[o] = wt * acc;
  }}
  __syncthreads();
  const float4* part4 = reinterpret_cast<const float4*>(s_part);
#pragma unroll
  for (int v = tid; v < {H // 4}; v += {T})
    dsv2_mf_red4_{tag}(out + t * {H} + 4 * v, part4[v]);
}}
#endif
"""
    pre = grid_wait_source() + dot32_source(tiles.run)
    if tiles.down_run != tiles.run:
        pre += dot32_source(tiles.down_run)
    return name, pre + route_src + src


def fused_blocks(s: MoeDecodeShape, tiles: FusedTiles = FUSED_TILES) -> int:
    """Blocks a token: the shared experts' slices, then every routed slot's."""
    return (s.shared_inter + s.top_k * s.inter) // tiles.rows


def moe_fused_decode(s: MoeDecodeShape, tiles: FusedTiles = FUSED_TILES) -> tirx.PrimFunc:
    """``f(x [n, H] f16, logits [n, E] f32, w [E, 2I, H/8] u32, s [E, 2I, H/g] f16, shared_w
    [2 Is, H/8] u32, shared_s [2 Is, H/g] f16, down_w [E, H, I/8] u32, down_s [E, H, I/g] f16,
    shared_down_w [H, Is/8] u32, shared_down_s [H, Is/g] f16, out [n, H] f32)``: ``out +=`` the
    MoE block's output (module docstring; ``out`` zero before)."""
    why = fused_unsupported(s, tiles)
    if why:
        raise ValueError(f"moe_fused_decode: {why}")
    H, NI, IS, E, G = s.hidden, s.inter, s.shared_inter, s.experts, s.group
    fname, src = fused_source(s, tiles)
    return token_grid_call(
        "moe_fused",
        fname,
        src,
        [
            ("x", (TOKENS, H), "float16"),
            ("logits", (TOKENS, E), "float32"),
            ("w", (E, 2 * NI, H // 8), "uint32"),
            ("sc", (E, 2 * NI, H // G), "float16"),
            ("sw", (2 * IS, H // 8), "uint32"),
            ("ss", (2 * IS, H // G), "float16"),
            ("dw", (E, H, NI // 8), "uint32"),
            ("ds", (E, H, NI // G), "float16"),
            ("sdw", (H, IS // 8), "uint32"),
            ("sds", (H, IS // G), "float16"),
            ("out", (TOKENS, H), "float32"),
        ],
        fused_blocks(s, tiles),
        tiles.warps * 32,
        dyn_shared_bytes=_dyn_bytes(s, tiles),
        min_blocks=tiles.min_blocks,
    )

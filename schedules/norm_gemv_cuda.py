"""Decode on CUDA: the residual add + RMSNorm folded into the kernel that consumes the norm.

At batch 1 every decoder layer would run ``s = residual + delta; y = RMSNorm(s)`` as its own kernel
twice (``fused_add_rms_norm_rows``, a launch each) right before a GEMV that reads ``y``. The norm of
one row is cheap to form again wherever it is read:

* :func:`add_norm_gemv_q4`: ``y = RMSNorm(r + d) @ W^T`` for an INT4 group weight ``W [N, H]``
  (the attention's fused ``qkv_a_proj``). Each block forms ``s`` and its norm once into shared
  memory (the first two rows' weights already loading), then a persistent grid of warps takes
  every ``blocks * warps``-th output row, two rows in flight (as ``moe_decode_cuda``'s gate/up
  kernel); block 0 also writes ``s`` (the next residual). The norm is formed once a block, not
  in every warp's registers: 2112 warps each reading the 12 KB row from L2 would be no faster
  than the two kernels this one replaces.
* :func:`add_norm_router`: the MoE router's float32 logits ``RMSNorm(r + d) @ G^T`` (``G [E,
  H]`` float32), a warp per expert, each forming the norm in its registers (lane ``l`` holds the
  32-element chunks ``l, l + 32, ...`` of the row, so a warp reduction gives the sum of squares;
  64 warps at V2-Lite); also writes ``s`` and the normalised row (the experts' input).

Numerics as the fused add + RMSNorm they replace (``passes/fuse_add_rms_norm.py``): ``s`` is the
fp16 sum, the sum of squares float32, ``y = w * fp16(s * rsqrt(mean(s^2) + eps))`` in fp16; the
INT4 dot products are :func:`dsv2_mlc.schedules.decode_gemv_cuda.dot32_source`'s (fp16 partial
sums of ``run`` products, float32 across chunks), the router's dot products float32.
"""

from __future__ import annotations

from tvm import tirx

from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .tiles import NormGemvTiles, NormRouterTiles, tuned

__all__ = [
    "add_norm_gemv_kernel",
    "add_norm_gemv_q4",
    "add_norm_router",
    "add_norm_router_kernel",
    "add_norm_unsupported",
    "eps_tag",
]

_CHUNK = 32  # fp16 values of one lane's chunk (one 16-byte load of INT4 weights)


def add_norm_unsupported(hidden: int, group: int | None = None) -> str | None:
    """Why these kernels cannot take a row of ``hidden`` (and INT4 ``group``); None: they can."""
    if hidden % _CHUNK:
        return f"hidden {hidden} is not a multiple of {_CHUNK}"
    if group is not None and (group % _CHUNK or hidden % group):
        return f"group {group} does not split hidden {hidden} into 32-element chunks"
    return None


def eps_tag(eps: float) -> str:
    """The exact epsilon as a name part (kernels of different epsilons differ by name)."""
    return "e" + repr(float(eps)).replace(".", "p").replace("-", "m").replace("+", "")


def _norm_source(tag: str, H: int, eps: float) -> str:
    """CUDA: ``dsv2_add_norm_<tag>(r, d, w, xv, s_out, lane)``: the warp forms ``s = r + d``
    (writing it to ``s_out`` unless null), then ``xv = w * fp16(s * rsqrt(mean(s^2) + eps))``,
    lane ``l`` holding chunks ``l + 32 j`` (``xv[j]``: 32 fp16 values)."""
    nch = H // _CHUNK
    cpl = -(-nch // 32)
    return f"""
#ifndef DSV2_ADD_NORM_{tag}
#define DSV2_ADD_NORM_{tag}
__device__ __forceinline__ void dsv2_add_norm_{tag}(const half* __restrict__ r,
    const half* __restrict__ d, const half* __restrict__ w, uint4 (&xv)[{cpl}][4],
    half* __restrict__ s_out, int lane) {{
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      const uint4* rp = reinterpret_cast<const uint4*>(r + c * {_CHUNK});
      const uint4* dp = reinterpret_cast<const uint4*>(d + c * {_CHUNK});
#pragma unroll
      for (int p = 0; p < 4; ++p) {{
        uint4 a = rp[p], b = dp[p];
        __half2* ah = reinterpret_cast<__half2*>(&a);
        const __half2* bh = reinterpret_cast<const __half2*>(&b);
#pragma unroll
        for (int k = 0; k < 4; ++k) {{
          ah[k] = __hadd2(ah[k], bh[k]);
          const float2 f = __half22float2(ah[k]);
          ss += f.x * f.x + f.y * f.y;
        }}
        xv[j][p] = a;
        if (s_out != nullptr) reinterpret_cast<uint4*>(s_out + c * {_CHUNK})[p] = a;
      }}
    }}
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float inv = rsqrtf(ss / {float(H)!r}f + {float(eps)!r}f);
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      const uint4* wp = reinterpret_cast<const uint4*>(w + c * {_CHUNK});
#pragma unroll
      for (int p = 0; p < 4; ++p) {{
        uint4 wv = wp[p];
        const __half2* wh = reinterpret_cast<const __half2*>(&wv);
        __half2* xh = reinterpret_cast<__half2*>(&xv[j][p]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {{
          const float2 f = __half22float2(xh[k]);
          xh[k] = __hmul2(wh[k], __floats2half2_rn(f.x * inv, f.y * inv));
        }}
      }}
    }}
  }}
}}
#endif
"""


def _gemv_source(tag: str, H: int, N: int, G: int, eps: float, tiles: NormGemvTiles) -> str:
    """CUDA: ``dsv2_norm_gemv_<tag>(...)``: the block's add + RMSNorm into shared memory, then
    the persistent INT4 GEMV."""
    nch = H // _CHUNK
    cpl = -(-nch // 32)
    W, NB = tiles.warps, tiles.blocks
    stride = W * NB
    return f"""
#ifndef DSV2_NORM_GEMV_{tag}
#define DSV2_NORM_GEMV_{tag}
struct dsv2_ng_buf_{tag} {{
  uint4 q[{cpl}];
  half s[{cpl}];
}};
__device__ __forceinline__ void dsv2_ng_load_{tag}(dsv2_ng_buf_{tag}& b, int o, int lane,
    const unsigned* __restrict__ qw, const half* __restrict__ qs) {{
  const unsigned* row = qw + (long long)o * {H // 8};
  const half* srow = qs + (long long)o * {H // G};
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      b.q[j] = reinterpret_cast<const uint4*>(row)[c];
      b.s[j] = srow[c * {_CHUNK} / {G}];
    }}
  }}
}}
__device__ __forceinline__ void dsv2_ng_store_{tag}(const dsv2_ng_buf_{tag}& b, int o, int lane,
    const uint4 (&xv)[{cpl}][4], half* __restrict__ yrow) {{
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch})
      acc += dsv2_dot32p_int4_h{tiles.run}(reinterpret_cast<const unsigned*>(&b.q[j]), xv[j],
                                           b.s[j]);
  }}
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) yrow[o] = __float2half(acc);
}}
__device__ __forceinline__ void dsv2_norm_gemv_{tag}(const half* __restrict__ r,
    const half* __restrict__ d, const half* __restrict__ nw, const unsigned* __restrict__ qw,
    const half* __restrict__ qs, half* __restrict__ y, half* __restrict__ s_out, long long t,
    int blk, int tid) {{
  // the block forms s = r + d and its norm once, in shared memory (16-byte piece p of chunk c
  // at dsv2_swz(c, p), so that lanes reading consecutive chunks miss no bank)
  __shared__ __align__(16) uint4 xs[{H // 8}];
  __shared__ float red[{W}];
  const int warp = tid >> 5, lane = tid & 31;
  half* yrow = y + t * {N};
  dsv2_ng_buf_{tag} a, b;
  // the first two rows' weights are in flight while the block forms the norm
  int o = blk * {W} + warp;
  if (o < {N}) dsv2_ng_load_{tag}(a, o, lane, qw, qs);
  if (o + {stride} < {N}) dsv2_ng_load_{tag}(b, o + {stride}, lane, qw, qs);
  {WAIT_THEN_RELEASE}  // (PDL) the weights above overlap the previous kernel; r and d are its
  const uint4* rrow = reinterpret_cast<const uint4*>(r + t * {H});
  const uint4* drow = reinterpret_cast<const uint4*>(d + t * {H});
  float ss = 0.f;
  for (int v = tid; v < {H // 8}; v += {W * 32}) {{
    uint4 sv = rrow[v];
    const uint4 dv = drow[v];
    __half2* sh = reinterpret_cast<__half2*>(&sv);
    const __half2* dh = reinterpret_cast<const __half2*>(&dv);
#pragma unroll
    for (int k = 0; k < 4; ++k) {{
      sh[k] = __hadd2(sh[k], dh[k]);
      const float2 f = __half22float2(sh[k]);
      ss += f.x * f.x + f.y * f.y;
    }}
    if (blk == 0) reinterpret_cast<uint4*>(s_out + t * {H})[v] = sv;
    xs[dsv2_swz(v >> 2, v & 3)] = sv;
  }}
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, k);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < {W}; ++k) total += red[k];
  const float inv = rsqrtf(total / {float(H)!r}f + {float(eps)!r}f);
  for (int v = tid; v < {H // 8}; v += {W * 32}) {{
    const int at = dsv2_swz(v >> 2, v & 3);
    uint4 xv4 = xs[at];
    const uint4 wv = reinterpret_cast<const uint4*>(nw)[v];
    __half2* xh = reinterpret_cast<__half2*>(&xv4);
    const __half2* wh = reinterpret_cast<const __half2*>(&wv);
#pragma unroll
    for (int k = 0; k < 4; ++k) {{
      const float2 f = __half22float2(xh[k]);
      xh[k] = __hmul2(wh[k], __floats2half2_rn(f.x * inv, f.y * inv));
    }}
    xs[at] = dsv2_pair8(xv4);  // pair order (dsv2_dot32p), once
  }}
  __syncthreads();
  uint4 xv[{cpl}][4];
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
#pragma unroll
      for (int p = 0; p < 4; ++p) xv[j][p] = xs[dsv2_swz(c, p)];
    }}
  }}
  while (o < {N}) {{
    const int o1 = o + {stride};
    dsv2_ng_store_{tag}(a, o, lane, xv, yrow);
    if (o1 >= {N}) break;
    const int o2 = o1 + {stride};
    if (o2 < {N}) dsv2_ng_load_{tag}(a, o2, lane, qw, qs);
    dsv2_ng_store_{tag}(b, o1, lane, xv, yrow);
    if (o2 + {stride} < {N}) dsv2_ng_load_{tag}(b, o2 + {stride}, lane, qw, qs);
    o = o2;
  }}
}}
#endif
"""


def add_norm_gemv_q4(hidden: int, out_dim: int, group: int, eps: float) -> tirx.PrimFunc:
    """``f(r [n, H] f16, d [n, H] f16, norm_w [H] f16, qw [N, H/8] u32, qs [N, H/g] f16) ->
    (y [n, N] f16, s [n, H] f16)`` with ``s = r + d``, ``y = RMSNorm(s) @ W^T`` (module
    docstring), with the tiles of ``schedules/tiles.py`` (keyed by the hidden size, which sets
    the registers a lane holds the normed row in)."""
    tiles = tuned("add_norm_gemv", shape=(hidden,))
    return add_norm_gemv_kernel(hidden, out_dim, group, eps, tiles)


def add_norm_gemv_kernel(
    hidden: int, out_dim: int, group: int, eps: float, tiles: NormGemvTiles
) -> tirx.PrimFunc:
    """:func:`add_norm_gemv_q4` with the given ``tiles``."""
    why = add_norm_unsupported(hidden, group)
    if why:
        raise ValueError(f"add_norm_gemv_q4: {why}")
    H, N, G = hidden, out_dim, group
    NB, THREADS = tiles.blocks, tiles.warps * 32
    tag = f"h{H}_n{N}_g{G}_{tiles.name}_{eps_tag(eps)}"
    src = grid_wait_source() + dot32_source(tiles.run) + _gemv_source(tag, H, N, G, eps, tiles)

    params = [
        ("r", (TOKENS, H), "float16"),
        ("d", (TOKENS, H), "float16"),
        ("nw", (H,), "float16"),
        ("qw", (N, H // 8), "uint32"),
        ("qs", (N, H // G), "float16"),
        ("y", (TOKENS, N), "float16"),
        ("s", (TOKENS, H), "float16"),
    ]
    return token_grid_call("add_norm_gemv", f"dsv2_norm_gemv_{tag}", src, params, NB, THREADS)


def _router_source(tag: str, H: int, E: int, W: int, preload: int | None = None) -> str:
    """CUDA: ``dsv2_norm_router_<tag>(...)``: a warp's logit for one expert. A lane holds its
    ``cpl`` chunks of the normed row (``xv``) and of the expert's gate row (``g``) in registers;
    the first ``preload`` chunks of ``g`` (None: all) load before the PDL wait, while the norm
    forms, the others where the dot product reaches them (past ~3 chunks the whole row spills)."""
    nch = H // _CHUNK
    cpl = -(-nch // 32)
    pre = cpl if preload is None else max(0, min(preload, cpl))
    gk = "g[j][k]"
    if pre < cpl:  # chunks j >= pre from memory (the index keeps g's in bounds where unused)
        late = f"reinterpret_cast<const float4*>(row + c * {_CHUNK})[k]"
        gk = f"j < {pre} ? g[j < {pre} ? j : 0][k] : {late}"
    return f"""
#ifndef DSV2_NORM_ROUTER_{tag}
#define DSV2_NORM_ROUTER_{tag}
__device__ __forceinline__ void dsv2_norm_router_{tag}(const half* __restrict__ r,
    const half* __restrict__ d, const half* __restrict__ nw, const float* __restrict__ gw,
    float* __restrict__ logits, half* __restrict__ xn, half* __restrict__ s_out, long long t,
    int blk, int tid) {{
  const int warp = tid >> 5, lane = tid & 31;
  // this warp's gate row is in flight while it forms the norm
  const int e = min(blk * {W} + warp, {E - 1});
  const float* row = gw + (long long)e * {H};
  float4 g[{max(pre, 1)}][8];
#pragma unroll
  for (int j = 0; j < {pre}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
#pragma unroll
      for (int k = 0; k < 8; ++k) g[j][k] = reinterpret_cast<const float4*>(row + c * {_CHUNK})[k];
    }}
  }}
  {WAIT_THEN_RELEASE}  // (PDL) the gate row above overlaps the previous kernel
  uint4 xv[{cpl}][4];
  const bool writer = blk == 0 && warp == 0;
  dsv2_add_norm_{tag}(r + t * {H}, d + t * {H}, nw, xv, writer ? s_out + t * {H} : nullptr,
                      lane);
  if (writer) {{
#pragma unroll
    for (int j = 0; j < {cpl}; ++j) {{
      const int c = lane + 32 * j;
      if (c < {nch}) {{
#pragma unroll
        for (int p = 0; p < 4; ++p)
          reinterpret_cast<uint4*>(xn + t * {H} + c * {_CHUNK})[p] = xv[j][p];
      }}
    }}
  }}
  if (blk * {W} + warp >= {E}) return;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      const __half2* xh = reinterpret_cast<const __half2*>(xv[j]);
#pragma unroll
      for (int k = 0; k < 8; ++k) {{
        const float4 gk = {gk};
        const float2 a = __half22float2(xh[2 * k]), b = __half22float2(xh[2 * k + 1]);
        acc += a.x * gk.x + a.y * gk.y + b.x * gk.z + b.y * gk.w;
      }}
    }}
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) logits[t * {E} + e] = acc;
}}
#endif
"""


def add_norm_router(hidden: int, experts: int, eps: float) -> tirx.PrimFunc:
    """``f(r [n, H] f16, d [n, H] f16, norm_w [H] f16, gate_w [E, H] f32) -> (logits [n, E]
    f32, xn [n, H] f16, s [n, H] f16)`` with ``s = r + d``, ``xn = RMSNorm(s)``, ``logits = xn
    @ gate_w^T`` in float32 (module docstring), with the tiles of ``schedules/tiles.py``."""
    tiles = tuned("add_norm_router", shape=(hidden,))  # (hidden,): the registers of a lane
    return add_norm_router_kernel(hidden, experts, eps, tiles)


def add_norm_router_kernel(
    hidden: int, experts: int, eps: float, tiles: NormRouterTiles
) -> tirx.PrimFunc:
    """:func:`add_norm_router` with the given ``tiles``."""
    why = add_norm_unsupported(hidden)
    if why:
        raise ValueError(f"add_norm_router: {why}")
    H, E, W = hidden, experts, tiles.warps
    NB, THREADS = -(-E // W), W * 32
    tag = f"h{H}_r{E}_{tiles.name}_{eps_tag(eps)}"
    src = grid_wait_source() + _norm_source(tag, H, eps)
    src += _router_source(tag, H, E, W, tiles.preload)

    params = [
        ("r", (TOKENS, H), "float16"),
        ("d", (TOKENS, H), "float16"),
        ("nw", (H,), "float16"),
        ("gw", (E, H), "float32"),
        ("logits", (TOKENS, E), "float32"),
        ("xn", (TOKENS, H), "float16"),
        ("s", (TOKENS, H), "float16"),
    ]
    return token_grid_call("add_norm_router", f"dsv2_norm_router_{tag}", src, params, NB, THREADS)

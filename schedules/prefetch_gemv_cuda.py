"""Decode GEMVs on CUDA whose weights are in registers before the kernel waits for its input.

At batch 1 a decode step is a chain of short kernels, each reading its weights only once it has
started, i.e. after the previous kernel finished: a 2 MB GEMV (``o_proj``, the absorbed ``W_UV``)
takes several times its HBM time, most of it that first DRAM round trip and the launch
(schedules/results/prefetch_gemv.md). Here the weights do not depend on the previous kernel, so each
warp loads its rows first and only then calls ``griddepcontrol.wait``
(:func:`dsv2_mlc.schedules.cuda_call.grid_wait_source`): in a ``--pdl`` build, whose decode graphs
launch a kernel before its predecessor ends, the weight loads overlap the predecessor.

* :func:`gemv_q4_decode`: ``y[t] = W x[t]`` for an INT4 group weight ``W [N, K]`` (``o_proj``,
  the dense MLP's ``down_proj``, the first layer's ``qkv_a``: :mod:`dsv2_mlc.quant.decode_linear`).
  ``ceil(N / warps)`` blocks (at most ``max_blocks``: ``PrefetchGemvTiles`` of
  ``schedules/tiles.py``), a warp per output row (strided over the
  grid when there are more rows than warps); the block stages ``x[t]`` in shared memory (16-byte
  pieces XOR-swizzled as in :mod:`~dsv2_mlc.schedules.norm_gemv_cuda`) for each token in turn,
  so the weights are read once for all ``n`` tokens. The dot product is
  :func:`~dsv2_mlc.schedules.decode_gemv_cuda.dot32_source`'s (fp16 partial sums of ``run``
  products, float32 across 32-element chunks), as the TIR GEMV schedule it replaces.
* :func:`absorb_v_decode`: the absorbed value projection ``y[t, h V + v] = sum_c o[t, h, c] *
  W_UV[h, v, c]`` (fp16 ``W_UV [H, V, L]``), a warp per row ``(h, v)`` reading its head's
  ``o[t, h]`` (``L`` values, from L2) itself; float32 products and sums, one rounding, as the TE
  kernel (``dsv2_mlc.model.mla_ops.absorb_value``) it replaces.

Both write only after the wait and read nothing an earlier kernel writes before it. The
reference is the Relax / TE composition of the CPU path; ``tests/test_prefetch_gemv_emulation.py``
runs the generated CUDA on the CPU against NumPy.
"""

from __future__ import annotations

from tvm import tirx

from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .tiles import PrefetchGemvTiles, tuned

__all__ = [
    "absorb_v_decode",
    "absorb_v_kernel",
    "absorb_v_unsupported",
    "gemv_q4_decode",
    "gemv_q4_kernel",
    "gemv_q4_rows_per_pass",
    "gemv_q4_unsupported",
]

_CHUNK = 32  # INT4 values per 16-byte load
_SHARED_LIMIT = 48 * 1024


def gemv_q4_rows_per_pass() -> int:
    """The output rows :func:`gemv_q4_decode` covers in one pass of its grid (a warp a row);
    taller weights take several passes, each waiting for its own loads."""
    tiles = tuned("prefetch_gemv")
    return tiles.warps * tiles.max_blocks


def gemv_q4_unsupported(out_dim: int, in_dim: int, group: int) -> str | None:
    """Why :func:`gemv_q4_decode` cannot take this shape (None: it can)."""
    if in_dim % _CHUNK or group % _CHUNK:
        return f"K={in_dim}, group={group}: not whole 32-element chunks"
    if in_dim * 2 > _SHARED_LIMIT - 1024:
        return f"K={in_dim}: x does not fit in shared memory"
    if out_dim < 1:
        return f"N={out_dim}"
    return None


def _gemv_q4_load_source(tag: str, N: int, K: int, G: int, groups: int, run: int) -> str:
    """CUDA: ``dsv2_pf_gemv_load_<tag>(q, sc, o, lane, qw, qs)``: lane ``lane``'s 16-byte
    pieces (chunks ``lane + 32 j``) of row ``o`` of an INT4 group weight ``[N, K]`` and their
    scales, into registers (``groups`` scales a row); ``dsv2_pf_gemv_dot_<tag>(q, sc, xs,
    lane)``: the lane's share of that row's dot product with ``x`` staged in shared memory (the
    sum of the warp's lanes is the output; needs ``dot32_source(run)`` and ``dsv2_swz``)."""
    nch = K // _CHUNK
    cpl = -(-nch // 32)  # chunks per lane
    return f"""
#ifndef DSV2_PF_GEMV_LOAD_{tag}
#define DSV2_PF_GEMV_LOAD_{tag}
__device__ __forceinline__ void dsv2_pf_gemv_load_{tag}(uint4 (&q)[{cpl}], half (&sc)[{cpl}],
    int o, int lane, const unsigned* __restrict__ qw, const half* __restrict__ qs) {{
  const uint4* row = reinterpret_cast<const uint4*>(qw + (long long)o * {K // 8});
  const half* srow = qs + (long long)o * {groups};
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      q[j] = row[c];
      sc[j] = srow[c * {_CHUNK} / {G}];
    }}
  }}
}}
// lane's share of the dot product of the row in (q, sc) with x staged in shared memory by
// 16-byte pieces, piece p of chunk c at xs[dsv2_swz(c, p)] (pair order)
__device__ __forceinline__ float dsv2_pf_gemv_dot_{tag}(const uint4 (&q)[{cpl}],
    const half (&sc)[{cpl}], const uint4* xs, int lane) {{
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < {cpl}; ++j) {{
    const int c = lane + 32 * j;
    if (c < {nch}) {{
      uint4 xv[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) xv[p] = xs[dsv2_swz(c, p)];
      acc += dsv2_dot32p_int4_h{run}(reinterpret_cast<const unsigned*>(&q[j]), xv, sc[j]);
    }}
  }}
  return acc;
}}
#endif
"""


def _gemv_q4_source(
    tag: str, N: int, K: int, G: int, W: int, NB: int, groups: int, run: int
) -> str:
    nch = K // _CHUNK
    cpl = -(-nch // 32)  # chunks per lane
    stride = NB * W
    return (
        _gemv_q4_load_source(tag, N, K, G, groups, run)
        + f"""
#ifndef DSV2_PF_GEMV_{tag}
#define DSV2_PF_GEMV_{tag}
__device__ __forceinline__ void dsv2_pf_gemv_{tag}(const half* __restrict__ x,
    const unsigned* __restrict__ qw, const half* __restrict__ qs, half* __restrict__ y,
    long long n, int blk, int tid) {{
  // x[t] of the block: 16-byte piece p of chunk c at dsv2_swz(c, p)
  __shared__ __align__(16) uint4 xs[{K // 8}];
  const int warp = tid >> 5, lane = tid & 31;
  uint4 q[{cpl}];
  half sc[{cpl}];
  if (blk * {W} + warp < {N}) dsv2_pf_gemv_load_{tag}(q, sc, blk * {W} + warp, lane, qw, qs);
  {WAIT_THEN_RELEASE}  // (PDL) the first row's weights overlap the previous kernel, which wrote x
  // rows base + warp; the block's barriers need all its warps in every pass
  for (int base = blk * {W}; base < {N}; base += {stride}) {{
    const int o = base + warp;
    if (base != blk * {W} && o < {N}) dsv2_pf_gemv_load_{tag}(q, sc, o, lane, qw, qs);
    for (long long t = 0; t < n; ++t) {{
      const uint4* xrow = reinterpret_cast<const uint4*>(x + t * {K});
      __syncthreads();  // the previous token's x is read
      for (int v = tid; v < {K // 8}; v += {W * 32})
        xs[dsv2_swz(v >> 2, v & 3)] = dsv2_pair8(xrow[v]);  // pair order
      __syncthreads();
      if (o < {N}) {{
        float acc = dsv2_pf_gemv_dot_{tag}(q, sc, xs, lane);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) y[t * {N} + o] = __float2half(acc);
      }}
    }}
  }}
}}
#endif
"""
    )


def gemv_q4_decode(out_dim: int, in_dim: int, group: int) -> tirx.PrimFunc:
    """``f(x [n, K] f16, qw [N, K/8] u32, qs [N, ceil(K/g)] f16) -> y [n, N] f16``, ``y = x
    @ dequant(W)^T`` (module docstring), with the tiles of ``schedules/tiles.py``. Raises
    ``ValueError`` for shapes it does not take."""
    return gemv_q4_kernel(out_dim, in_dim, group, tuned("prefetch_gemv"))


def gemv_q4_kernel(
    out_dim: int, in_dim: int, group: int, tiles: PrefetchGemvTiles
) -> tirx.PrimFunc:
    """:func:`gemv_q4_decode` with the given ``tiles``."""
    why = gemv_q4_unsupported(out_dim, in_dim, group)
    if why:
        raise ValueError(f"gemv_q4_decode: {why}")
    N, K, G, W = out_dim, in_dim, group, tiles.warps
    NB = min(-(-N // W), tiles.max_blocks)
    tag = f"n{N}_k{K}_g{G}_w{W}_b{NB}"
    # the INT4 layout: 8 values a word, a scale a group (the last partial where G does not divide K)
    w_shape, s_shape = (N, -(-K // 8)), (N, -(-K // G))
    gemv = _gemv_q4_source(tag, N, K, G, W, NB, s_shape[-1], tiles.run)
    src = grid_wait_source() + dot32_source(tiles.run) + gemv
    params = [
        ("x", (TOKENS, K), "float16"),
        ("qw", w_shape, "uint32"),
        ("qs", s_shape, "float16"),
        ("y", (TOKENS, N), "float16"),
    ]
    return token_grid_call(
        "gemv_q4_decode", f"dsv2_pf_gemv_{tag}", src, params, NB, W * 32, per_token=False
    )


def absorb_v_unsupported(heads: int, v_dim: int, lora: int) -> str | None:
    """Why :func:`absorb_v_decode` cannot take this shape (None: it can)."""
    if lora % 8 or heads < 1 or v_dim < 1:
        return f"H={heads}, V={v_dim}, L={lora}: L must be a multiple of 8"
    return None


def _absorb_v_source(tag: str, H: int, V: int, L: int, W: int, NB: int) -> str:
    nv = L // 8  # 16-byte pieces of a row
    cpl = -(-nv // 32)
    N, stride = H * V, NB * W
    return f"""
#ifndef DSV2_PF_ABSORB_V_{tag}
#define DSV2_PF_ABSORB_V_{tag}
__device__ __forceinline__ void dsv2_pf_absorb_v_{tag}(const half* __restrict__ o_lat,
    const half* __restrict__ w, half* __restrict__ y, long long n, int blk, int tid) {{
  const int warp = tid >> 5, lane = tid & 31;
  int o = blk * {W} + warp;  // row h * V + v of W_UV
  uint4 wv[{cpl}];
  const uint4* wrow = reinterpret_cast<const uint4*>(w);
#pragma unroll
  for (int j = 0; j < {cpl}; ++j)
    if (o < {N} && lane + 32 * j < {nv}) wv[j] = wrow[(long long)o * {nv} + lane + 32 * j];
  {WAIT_THEN_RELEASE}  // (PDL) the first row's weights overlap the previous kernel, which wrote o
  for (bool first = true; o < {N}; first = false, o += {stride}) {{
    if (!first) {{
#pragma unroll
      for (int j = 0; j < {cpl}; ++j)
        if (lane + 32 * j < {nv}) wv[j] = wrow[(long long)o * {nv} + lane + 32 * j];
    }}
    const int h = o / {V};
    for (long long t = 0; t < n; ++t) {{
      const uint4* xrow = reinterpret_cast<const uint4*>(o_lat + (t * {H} + h) * {L});
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < {cpl}; ++j) {{
        if (lane + 32 * j < {nv}) {{
          const uint4 xv = xrow[lane + 32 * j];
          const __half2* xh = reinterpret_cast<const __half2*>(&xv);
          const __half2* wh = reinterpret_cast<const __half2*>(&wv[j]);
#pragma unroll
          for (int k = 0; k < 4; ++k) {{
            const float2 a = __half22float2(xh[k]), b = __half22float2(wh[k]);
            acc += a.x * b.x + a.y * b.y;
          }}
        }}
      }}
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (lane == 0) y[t * {N} + o] = __float2half(acc);
    }}
  }}
}}
#endif
"""


def absorb_v_decode(heads: int, v_dim: int, lora: int) -> tirx.PrimFunc:
    """``f(o [n, H, L] f16, w_uv [H, V, L] f16) -> y [n, H * V] f16`` (module docstring), with
    the tiles of ``schedules/tiles.py``. Raises ``ValueError`` for shapes it does not take."""
    return absorb_v_kernel(heads, v_dim, lora, tuned("prefetch_gemv"))


def absorb_v_kernel(heads: int, v_dim: int, lora: int, tiles: PrefetchGemvTiles) -> tirx.PrimFunc:
    """:func:`absorb_v_decode` with the given ``tiles``."""
    why = absorb_v_unsupported(heads, v_dim, lora)
    if why:
        raise ValueError(f"absorb_v_decode: {why}")
    H, V, L, W = heads, v_dim, lora, tiles.warps
    NB = min(-(-H * V // W), tiles.max_blocks)
    tag = f"h{H}_v{V}_l{L}_w{W}_b{NB}"
    src = grid_wait_source() + _absorb_v_source(tag, H, V, L, W, NB)
    params = [
        ("o", (TOKENS, H, L), "float16"),
        ("w", (H, V, L), "float16"),
        ("y", (TOKENS, H * V), "float16"),
    ]
    return token_grid_call(
        "absorb_v_decode", f"dsv2_pf_absorb_v_{tag}", src, params, NB, W * 32, per_token=False
    )

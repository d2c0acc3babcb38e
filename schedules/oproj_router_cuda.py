"""Decode on CUDA, lab variant (measured slower, off): ``o_proj``, the residual add, the
post-attention RMSNorm and the MoE routing in one kernel, so that the MoE block would start from
routed experts instead of from a router launch.

At batch 1 a MoE layer's chain runs ``o_proj`` (a GEMV, 1.5 us of a replayed step on the H200),
then ``add_norm_router`` (the residual add, RMSNorm and the float32 router logits, 3.5 us, most
of it a launch boundary), then routes in every block of the gate/up kernel (warp 0 of 264 blocks,
~1.7 us of that kernel). The logits are linear in the residual sum ``s`` but for the norm's
scale::

    logits[e] = sum_j G[e, j] * w[j] * s[j] * inv,   inv = rsqrt(mean(s^2) + eps)

so the ``o_proj`` blocks, which produce ``s`` a slice of rows at a time, can each add their
rows' share: :func:`oproj_router_decode`. Block ``b`` (a warp per output row, the weights of
that row and the block's router columns ``G[:, rows]`` loaded before the PDL wait, as
:func:`~dsv2_mlc.schedules.prefetch_gemv_cuda.gemv_q4_decode`) computes ``y = W x`` for its rows,
writes ``s = r + y`` (fp16, as the add it replaces), and its partial sums ``sum_rows G[e, j] *
w[j] * s[j]`` (float32) and ``sum_rows s[j]^2`` into a workspace ``part[t, e, b]``. Then it takes
a ticket from a device-global counter (one ``atom.add.acq_rel.gpu`` after a barrier: the
pattern of CUDA's ``threadFenceReduction`` sample, as :mod:`dsv2_mlc.schedules.argmax`); the
block that takes the last one loads all the partial sums and its pieces of ``s`` at once, sums
them in a fixed order (the result does not depend on which block is last), forms the logits,
routes the token with one warp (the warp router of :mod:`dsv2_mlc.schedules.moe_routing`, the
gate/up kernel's) and writes the experts' input ``xn = w * fp16(s * inv)``, then resets the
counter for the next launch. The gate/up kernel then reads the expert ids instead of routing
(:func:`~dsv2_mlc.schedules.moe_decode_cuda.moe_gate_up_decode` with ``routed=True``).

**Measured on the H200 (V2-Lite, decode graph replays at context ~4,000; schedules/results/
moe_decode.md, round 8): slower, so** :data:`ROUTE_IN_OPROJ` **is off.** The gate/up kernel
gains what routing cost it (increment 10.8 -> 9.1 us), but this kernel takes 10.7-11.2 us
(increment 9.4-9.9) where ``o_proj`` and the router kernel took 1.5 + 3.5: the ticket's tail is
a chain of dependent round trips (the residual, the atomic, the partial sums, the routing) that
costs more than the launch boundary it removes. A step's replay: 1,286-1,288 -> 1,349-1,361 us.

Numerics: ``y`` and ``s`` as the kernels they replace (``y`` the GEMV's fp16 result, ``s`` its
fp16 sum with the residual); the logits are the exact float32 sum of ``G * w * s`` times ``inv``
instead of ``G`` times the fp16-rounded ``xn``: within that rounding (~1e-3 relative per term)
of the other kernel's. The sums of squares are float32 in another order, so ``inv`` (and
``xn``) may differ from the other kernel's in the last bit.
"""

from __future__ import annotations

from tvm import tirx

from ..quantization import packed_shape
from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .moe_routing import RouterShape
from .norm_gemv_cuda import eps_tag
from .prefetch_gemv_cuda import gemv_q4_load_source, gemv_q4_unsupported

__all__ = ["ROUTE_IN_OPROJ", "oproj_router_decode", "oproj_router_unsupported"]

_CHUNK = 32  # INT4 values per 16-byte load
_WARPS = 8  # a warp per output row
_MAX_BLOCKS = 1024  # one pass of the grid: every block owns W rows
_RUN = 16  # products per fp16 partial sum (as gemv_q4_decode)

# Whether the model's decode uses this kernel (``DeepseekV2MoE.oproj_router``): off, measured
# slower (module docstring); the lab switch, as ``DecodeTiles.early_route`` is the down kernel's.
ROUTE_IN_OPROJ = False


def oproj_router_unsupported(hidden: int, in_dim: int, group: int, experts: int) -> str | None:
    """Why :func:`oproj_router_decode` cannot take this shape (None: it can)."""
    why = gemv_q4_unsupported(hidden, in_dim, group)
    if why:
        return why
    if hidden % _WARPS or hidden % 8 or hidden > _WARPS * _MAX_BLOCKS:
        return f"hidden {hidden}: not whole blocks of {_WARPS} rows in one pass of the grid"
    if not 1 <= experts <= 1024:
        return f"{experts} experts"
    return None


def _source(
    tag: str, N: int, K: int, G: int, groups: int, route: RouterShape, eps: float
) -> tuple[str, str]:
    route_name, route_src = route.warp_source()
    E, TK, W = route.experts, route.top_k, _WARPS
    NB, T = N // W, W * 32
    nch = K // _CHUNK
    cpl = -(-nch // 32)
    G4 = W // 4  # float4 of router columns a row of G has in a block
    GQ = E * G4  # float4 of G a block loads
    GPT = -(-GQ // T)  # ... a thread
    XPT = -(-(N // 8) // T)  # the last block: 8-value pieces of s / xn a thread
    EPW = -(-(E + 1) // W)  # ... partial sums (logits and the sum of squares) a warp
    BPL = -(-NB // 32)  # ... blocks' partials a lane
    name = f"dsv2_oproj_router_{tag}"
    src = f"""
#ifndef DSV2_TICKET_ACQ_REL
#define DSV2_TICKET_ACQ_REL
// atomicAdd(p, 1) with acquire-release semantics at GPU scope
__device__ __forceinline__ unsigned dsv2_ticket_acq_rel(unsigned* p) {{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
#else
  __threadfence();
  const unsigned old = atomicAdd(p, 1u);
  __threadfence();
  return old;
#endif
}}
#endif
#ifndef DSV2_OPROJ_ROUTER_{tag}
#define DSV2_OPROJ_ROUTER_{tag}
__device__ unsigned int dsv2_oproj_router_ticket_{tag};
__device__ __forceinline__ void {name}(const half* __restrict__ x,
    const unsigned* __restrict__ qw, const half* __restrict__ qs, const half* __restrict__ r,
    const half* __restrict__ nw, const float* __restrict__ gw, float* __restrict__ part,
    half* __restrict__ s_out, half* __restrict__ xn, float* __restrict__ logits,
    float* __restrict__ wout, int* __restrict__ iout, long long n, int blk, int tid) {{
  __shared__ __align__(16) uint4 xs[{K // 8}];
  __shared__ float s_ws[{W}], s_sq[{W}];  // w[o] * s[o] and s[o]^2 of the block's rows
  __shared__ float s_red[{E + 1}];  // the last block: logits, then the sum of squares
  __shared__ float s_wt[{TK}], s_p[{E}];
  __shared__ int s_id[{TK}];
  __shared__ int s_last;
  const int warp = tid >> 5, lane = tid & 31;
  const int o = blk * {W} + warp;
  uint4 q[{cpl}];
  half sc[{cpl}];
  dsv2_pf_gemv_load_{tag}(q, sc, o, lane, qw, qs);
  // the block's router columns G[e, blk * W + 4 c4 ...]: float4 g = e * {G4} + c4
  float4 gq[{GPT}];
#pragma unroll
  for (int k = 0; k < {GPT}; ++k) {{
    const int g = tid + k * {T};
    if (g < {GQ})
      gq[k] = reinterpret_cast<const float4*>(gw + (long long)(g / {G4}) * {N} + blk * {W})
          [g % {G4}];
  }}
  const float w_o = __half2float(nw[o]);
  {WAIT_THEN_RELEASE}  // (PDL) the loads above overlap the previous kernel, which wrote x
  for (long long t = 0; t < n; ++t) {{
    const uint4* xrow = reinterpret_cast<const uint4*>(x + t * {K});
    __syncthreads();  // the previous token's x and s_ws are read
    for (int v = tid; v < {K // 8}; v += {T}) xs[dsv2_swz(v >> 2, v & 3)] = dsv2_pair8(xrow[v]);
    __syncthreads();
    float acc = dsv2_pf_gemv_dot_{tag}(q, sc, xs, lane);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {{
      const half sv = __hadd(r[t * {N} + o], __float2half(acc));
      s_out[t * {N} + o] = sv;
      const float f = __half2float(sv);
      s_ws[warp] = w_o * f;
      s_sq[warp] = f * f;
    }}
    __syncthreads();
    // this block's share of every logit (G4 threads a logit, then summed by shuffles)
    float* pt = part + t * {(E + 1) * NB};
#pragma unroll
    for (int k = 0; k < {GPT}; ++k) {{
      const int g = tid + k * {T};
      float p = 0.f;
      if (g < {GQ}) {{
        const int c = (g % {G4}) * 4;
        p = gq[k].x * s_ws[c] + gq[k].y * s_ws[c + 1] + gq[k].z * s_ws[c + 2] +
            gq[k].w * s_ws[c + 3];
      }}
#pragma unroll
      for (int off = {G4} / 2; off > 0; off >>= 1) p += __shfl_xor_sync(0xffffffffu, p, off);
      if (g < {GQ} && g % {G4} == 0) pt[(g / {G4}) * {NB} + blk] = p;
    }}
    if (tid == {T - 1}) {{
      float q2 = 0.f;
      for (int i = 0; i < {W}; ++i) q2 += s_sq[i];
      pt[{E * NB} + blk] = q2;
    }}
  }}
  __syncthreads();
  // the ticket: a release of the block's s and partial sums (cumulative over the barrier
  // above) and an acquire of every earlier block's, in one atomic
  if (tid == 0) s_last = dsv2_ticket_acq_rel(&dsv2_oproj_router_ticket_{tag}) == {NB - 1}u;
  __syncthreads();
  if (!s_last) return;
  if (tid == 0) dsv2_oproj_router_ticket_{tag} = 0u;  // ready for the next launch
  const uint4* nw4 = reinterpret_cast<const uint4*>(nw);
  for (long long t = 0; t < n; ++t) {{
    // every load of the tail at once (one L2 round trip, not one per logit): this thread's
    // pieces of s and of the norm weight (for xn), and its lane's partial sums of the logits
    // e = warp + W k (the blocks in a fixed order, so the sums do not depend on which is last)
    const float* pt = part + t * {(E + 1) * NB};
    const uint4* srow = reinterpret_cast<const uint4*>(s_out + t * {N});
    uint4 sv[{XPT}], wv[{XPT}];
#pragma unroll
    for (int k = 0; k < {XPT}; ++k) {{
      const int v = tid + k * {T};
      if (v < {N // 8}) {{
        sv[k] = __ldcg(srow + v);
        wv[k] = nw4[v];
      }}
    }}
    float a[{EPW}];
#pragma unroll
    for (int k = 0; k < {EPW}; ++k) {{
      const int e = warp + k * {W};
      a[k] = 0.f;
#pragma unroll
      for (int j = 0; j < {BPL}; ++j)
        if (e <= {E} && lane + 32 * j < {NB}) a[k] += __ldcg(pt + e * {NB} + lane + 32 * j);
    }}
#pragma unroll
    for (int k = 0; k < {EPW}; ++k) {{
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) a[k] += __shfl_xor_sync(0xffffffffu, a[k], off);
      if (lane == 0 && warp + k * {W} <= {E}) s_red[warp + k * {W}] = a[k];
    }}
    __syncthreads();
    const float inv = rsqrtf(s_red[{E}] / {float(N)!r}f + {float(eps)!r}f);
    if (warp == 0) {{
      for (int e = lane; e < {E}; e += 32) {{
        s_red[e] *= inv;
        logits[t * {E} + e] = s_red[e];
      }}
      __syncwarp();
      {route_name}(s_red, s_wt, s_id, lane, s_p);
      __syncwarp();
      if (lane < {TK}) {{
        wout[t * {TK} + lane] = s_wt[lane];
        iout[t * {TK} + lane] = s_id[lane];
      }}
    }}
    // the experts' input xn = w * fp16(s * inv)
#pragma unroll
    for (int k = 0; k < {XPT}; ++k) {{
      const int v = tid + k * {T};
      if (v < {N // 8}) {{
        const __half2* wh = reinterpret_cast<const __half2*>(&wv[k]);
        __half2* sh = reinterpret_cast<__half2*>(&sv[k]);
#pragma unroll
        for (int q = 0; q < 4; ++q) {{
          const float2 f = __half22float2(sh[q]);
          sh[q] = __hmul2(wh[q], __floats2half2_rn(f.x * inv, f.y * inv));
        }}
        reinterpret_cast<uint4*>(xn + t * {N})[v] = sv[k];
      }}
    }}
    __syncthreads();  // s_red is the next token's
  }}
}}
#endif
"""
    pre = grid_wait_source() + dot32_source(_RUN) + gemv_q4_load_source(tag, N, K, G, groups)
    return name, pre + route_src + src


def oproj_router_decode(
    hidden: int, in_dim: int, group: int, route: RouterShape, eps: float
) -> tirx.PrimFunc:
    """``f(x [n, K] f16, qw [N, K/8] u32, qs [N, K/g] f16, r [n, N] f16, norm_w [N] f16,
    gate_w [E, N] f32) -> (part [n, E + 1, N / 8] f32 (workspace), s [n, N] f16, xn [n, N]
    f16, logits [n, E] f32, weights [n, k] f32, ids [n, k] i32)`` with ``s = r + x @
    dequant(W)^T``, ``xn = RMSNorm(s)``, the router's logits of ``xn`` and its routing (module
    docstring). Raises ``ValueError`` for shapes it does not take."""
    why = oproj_router_unsupported(hidden, in_dim, group, route.experts)
    if why:
        raise ValueError(f"oproj_router_decode: {why}")
    N, K, G, E, TK = hidden, in_dim, group, route.experts, route.top_k
    NB = N // _WARPS
    w_shape, s_shape = packed_shape((N, K), G)
    route_tag = route.warp_source()[0].removeprefix("dsv2_route_")
    tag = f"n{N}_k{K}_g{G}_{route_tag}_{eps_tag(eps)}"
    fname, src = _source(tag, N, K, G, s_shape[-1], route, eps)
    params = [
        ("x", (TOKENS, K), "float16"),
        ("qw", w_shape, "uint32"),
        ("qs", s_shape, "float16"),
        ("r", (TOKENS, N), "float16"),
        ("nw", (N,), "float16"),
        ("gw", (E, N), "float32"),
        ("part", (TOKENS, E + 1, NB), "float32"),
        ("s", (TOKENS, N), "float16"),
        ("xn", (TOKENS, N), "float16"),
        ("logits", (TOKENS, E), "float32"),
        ("wout", (TOKENS, TK), "float32"),
        ("iout", (TOKENS, TK), "int32"),
    ]
    return token_grid_call("oproj_router", fname, src, params, NB, _WARPS * 32, per_token=False)

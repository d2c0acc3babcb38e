"""The query and key rows of prefill's (non-absorbed) attention, each one CUDA kernel with 16-byte
loads and stores.

Prefill attends over the new tokens with full heads: ``query [n, H, nope + R]`` is the query
heads with RoPE on their last ``R`` values, ``key`` the decompressed ``k_nope [n, H * nope]`` with
the token's roped ``k_pe`` (the last ``R`` values of the cached latent) appended to every head.
As Relax ops that is a split of the ``qkv_a_proj`` output, a split + RoPE + concatenate and a
broadcast + concatenate, three kernels of dlight's ``Fallback`` (a thread per value, 2-byte
accesses; schedules/results/prefill_small_kernels.md). The TEs
(``dsv2_mlc.model.mla_ops.prefill_query`` / ``prefill_key``) read their sources in place and are
tagged ``QUERY_ATTR`` / ``KEY_ATTR``; on CUDA the kernels below replace them
(``passes/schedule_decode_kernels.py``).

A thread owns 8 consecutive values of one ``(token, head)`` row: a copied chunk is one 16-byte
load and store; a roped chunk (4 pairs) loads 8 values and their 8 cos/sin entries
(``rope_table``: cos of pair ``p`` at column ``2p``, sin at ``2p + 1``) and computes
``(e cos - o sin, o cos + e sin)`` in float32, rounded to fp16 once, as the TE does.
"""

from __future__ import annotations

from tvm import tirx

from .cuda_call import TOKENS, buffer_dims, token_grid_call

__all__ = [
    "KEY_ATTR",
    "QUERY_ATTR",
    "THREADS",
    "prefill_key_cuda",
    "prefill_key_kernel",
    "prefill_query_cuda",
    "prefill_query_kernel",
]

QUERY_ATTR = "dsv2_mlc.prefill_query"  # PrimFunc attribute of the query TE: its source width
KEY_ATTR = "dsv2_mlc.prefill_key"  # PrimFunc attribute of the key TE
THREADS = 64


def _chunk_kernel(name: str, args: str, heads: int, qk: int, body: str) -> tuple[str, int]:
    """CUDA source of device function ``name(args..., t, blk, tid)`` whose thread owns the 8
    values at ``d0`` of head ``h`` of token ``t`` (``body`` runs with those set), and the
    blocks per token of its grid."""
    chunks = heads * qk // 8
    src = f"""
#ifndef DSV2_{name.upper()}
#define DSV2_{name.upper()}
__device__ __forceinline__ void {name}({args}, long long t, int blk, int tid) {{
  const int c = blk * {THREADS} + tid;
  if (c >= {chunks}) return;
  const int h = c / {qk // 8}, d0 = (c - h * {qk // 8}) * 8;
{body}}}
#endif
"""
    return src, -(-chunks // THREADS)


def prefill_query_cuda(heads: int, nope: int, rope: int, src_width: int) -> tirx.PrimFunc:
    """``f(x [n, src_width] fp16, tab [n, rope] f32, out [n, heads, nope + rope] fp16)``: the
    query heads at columns ``[0, heads * (nope + rope))`` of ``x``, RoPE on each head's last
    ``rope`` values."""
    qk = nope + rope
    name = f"dsv2_prefill_q_h{heads}_n{nope}_r{rope}_w{src_width}"
    args = "const half* __restrict__ x, const float* __restrict__ tab, half* __restrict__ out"
    body = f"""\
  const uint4 raw = *reinterpret_cast<const uint4*>(x + t * {src_width} + h * {qk} + d0);
  uint4* dst = reinterpret_cast<uint4*>(out + (t * {heads} + h) * {qk} + d0);
  if (d0 < {nope}) {{
    *dst = raw;
    return;
  }}
  const half* v = reinterpret_cast<const half*>(&raw);
  const float4* cs = reinterpret_cast<const float4*>(tab + t * {rope} + (d0 - {nope}));
  const float4 a = cs[0], b = cs[1];
  const float cos_[4] = {{a.x, a.z, b.x, b.z}}, sin_[4] = {{a.y, a.w, b.y, b.w}};
  __align__(16) half r[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {{
    const float e = __half2float(v[2 * j]), o = __half2float(v[2 * j + 1]);
    r[2 * j] = __float2half_rn(e * cos_[j] - o * sin_[j]);
    r[2 * j + 1] = __float2half_rn(o * cos_[j] + e * sin_[j]);
  }}
  *dst = *reinterpret_cast<const uint4*>(r);
"""
    src, bpt = _chunk_kernel(name, args, heads, qk, body)
    params = [
        ("x", [TOKENS, src_width], "float16"),
        ("tab", [TOKENS, rope], "float32"),
        ("out", [TOKENS, heads, qk], "float16"),
    ]
    return token_grid_call("prefill_query", name, src, params, bpt, THREADS)


def prefill_key_cuda(heads: int, nope: int, rope: int, lora: int) -> tirx.PrimFunc:
    """``f(k_nope [n, heads * nope] fp16, latent [n, lora + rope] fp16, out [n, heads, nope +
    rope] fp16)``: each head's ``k_nope`` then the token's ``k_pe`` (``latent[:, lora:]``)."""
    qk = nope + rope
    name = f"dsv2_prefill_k_h{heads}_n{nope}_r{rope}_l{lora}"
    args = "const half* __restrict__ kn, const half* __restrict__ lat, half* __restrict__ out"
    body = f"""\
  const half* src = d0 < {nope} ? kn + t * {heads * nope} + h * {nope} + d0
                              : lat + t * {lora + rope} + {lora} + (d0 - {nope});
  *reinterpret_cast<uint4*>(out + (t * {heads} + h) * {qk} + d0) =
      *reinterpret_cast<const uint4*>(src);
"""
    src, bpt = _chunk_kernel(name, args, heads, qk, body)
    params = [
        ("kn", [TOKENS, heads * nope], "float16"),
        ("lat", [TOKENS, lora + rope], "float16"),
        ("out", [TOKENS, heads, qk], "float16"),
    ]
    return token_grid_call("prefill_key", name, src, params, bpt, THREADS)


def prefill_query_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """:func:`prefill_query_cuda` for a query TE (tagged ``QUERY_ATTR``) whose widths are
    multiples of 8; None otherwise (dlight's schedule then)."""
    if func.attrs is None or QUERY_ATTR not in func.attrs:
        return None
    dims = buffer_dims(func, [("float16", 2), ("float32", 2), ("float16", 3)])
    if dims is None:
        return None
    (_, width), (_, rope), (_, heads, qk) = dims
    if None in (width, rope, heads, qk):
        return None
    nope = qk - rope
    if min(width, rope, nope) <= 0 or any(v % 8 for v in (width, rope, nope)):
        return None
    return prefill_query_cuda(heads, nope, rope, width)


def prefill_key_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """:func:`prefill_key_cuda` for a key TE (tagged ``KEY_ATTR``) whose widths are multiples
    of 8; None otherwise."""
    if func.attrs is None or KEY_ATTR not in func.attrs:
        return None
    dims = buffer_dims(func, [("float16", 2), ("float16", 2), ("float16", 3)])
    if dims is None:
        return None
    (_, kn_width), (_, lat_width), (_, heads, qk) = dims
    if None in (kn_width, lat_width, heads, qk) or heads <= 0 or kn_width % heads:
        return None
    nope = kn_width // heads
    rope = qk - nope
    lora = lat_width - rope
    if min(nope, rope, lora) <= 0 or any(v % 8 for v in (nope, rope, lora)):
        return None
    return prefill_key_cuda(heads, nope, rope, lora)

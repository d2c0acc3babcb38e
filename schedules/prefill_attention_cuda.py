"""A tensor-core flash-attention kernel for the causal ragged prefill (MLA ``self_attention``).

TVM 0.27's ``TIRPagedKVCache`` puts ``_attention_prefill_ragged(h_q, h_q, 192, 128, ...)``
(``batch_prefill_ragged_kv``, global ``tir_attention_prefill_ragged``) in the ragged-prefill slot
of ``vm.builtin.paged_attention_kv_cache_create`` for ``attn_kind="mla"``. It is a SIMT kernel
(fp32 FMA through shared memory, 16 thread blocks, every KV tile of the sequence for every query
tile, no causal skipping), far slower than a tensor-core kernel
(schedules/results/prefill_attention.md).
This kernel has the same ABI::

    f(q[n, H, Dqk], q_indptr[b+1] int32, k[m, H, Dqk], v[m, H, Dv], kv_indptr[b+1] int32,
      q_rope_position[n] int32, k_rope_pos_offset[b] int32, out[n, H, Dv], lse[n, H] float32,
      causal: int32, rotary_mode: int32, rope_scale: float32, rope_theta: float32,
      sm_scale: float32)

and the same semantics (``TIRRaggedPrefillFunc::MHA`` in TVM's ``attn_backend.h``; the MLA self
attention always passes ``q_indptr == kv_indptr``, ``causal=1`` and ``rotary_mode=0``):

* sequence ``i`` has rows ``q_indptr[i] .. q_indptr[i+1]`` of ``q``/``out``/``lse`` and rows
  ``kv_indptr[i] .. kv_indptr[i+1]`` of ``k``/``v``; with ``causal`` query ``r`` of a ``q_len``-row
  sequence sees the keys ``< kv_len - q_len + r + 1`` (bottom-right aligned), else all keys;
* scores ``q . k * sm_scale * log2(e)`` and base-2 softmax; ``lse = m + log2(sum 2^(s - m))`` in
  base 2 (what ``merge_attn_output_inplace`` expects);
* ``rotary_mode`` must be 0 (the model applies RoPE itself): the host code asserts it;
  ``q_rope_position``, ``k_rope_pos_offset``, ``rope_scale``, ``rope_theta`` are unused.
* One deliberate difference: a row that sees no key (only with ``causal`` and ``q_len > kv_len``,
  which the cache never passes) gets ``out = 0`` and ``lse = -inf`` (the merge-neutral state, as
  our other kernels); TVM's kernel leaves an unnormalised average there.

Design (FlashAttention-2 style, ``mma.sync.m16n8k16`` fp16 -> fp32; the body is a CUDA device
function passed as source through ``T.cuda.func_call``, the PrimFunc only binds the grid and
allocates the shared memory):

* Grid ``H * (ceil(n / BM) + b)`` one-dimensional blocks, heads fastest; block ``x`` is query
  tile ``x // H`` of the ragged batch (a scan of ``q_indptr`` maps it to a sequence) for head
  ``x % H``. Within a sequence the tiles run last-first, so the causally longest tiles start
  first and short ones fill the tail. ``BM / 16`` warps, each owns 16 query rows.
* Q stays in registers as A fragments for the whole block (``Dqk / 16`` k-steps x 4 registers,
  loaded once from global memory). K and V tiles of ``BN`` tokens go to shared memory with
  ``cp.async`` (16-byte chunks, rows past the sequence zero-filled), rows padded by 8 halves so
  ``ldmatrix`` is conflict-free. K fragments come from ``ldmatrix.x4``, V fragments from
  ``ldmatrix.x4.trans``.
* Pipeline per KV tile (one buffer each, the two ``cp.async`` groups overlap): wait K(j), S = Q
  K^T, then K(j+1) is issued while the softmax runs; wait V(j), O += P V, then V(j+1) is issued.
* Online softmax in registers (C-fragment layout: each thread has 2 rows, the 4 threads of a quad
  share a row, reductions by 2 shuffles; row sums stay per-thread until the end). P is re-packed
  from the S accumulators into A fragments (fp16) without shared memory.
* Causal tile skipping: a query tile reads only the KV tiles up to its last visible key; the
  mask is evaluated only on tiles that cross the diagonal or the sequence end.

The tile (:data:`~.tiles.TABLE`, ``"prefill_attention"``): ``BM = 64`` rows (4 warps) x ``BN =
32`` keys: per thread Q 48 + O 64 + S 16 accumulators (242 registers, no spills, 2 blocks per
SM), ``BN * (Dqk + 8 + Dv + 8) * 2`` = 21.5 KB of static shared memory; the larger and smaller
tiles measured were slower (schedules/results/prefill_attention.md, which also has the times
against TVM's kernel and the errors against a float32 reference: P is rounded to fp16 for the
PV MMA, as in FlashAttention).
"""

import math

from tvm import tirx
from tvm.script import tirx as T

from .tiles import PrefillAttentionTiles, tuned

__all__ = ["build_prefill_attention", "prefill_attention_cuda", "prefill_attention_cuda_supports"]

_LOG2E = math.log2(math.e)
_STATIC_SHARED_BYTES = 49152  # static shared memory of one block (no opt-in)
_MAX_SHARED_BYTES = _STATIC_SHARED_BYTES  # this kernel's limit (the lab's variants go beyond)
_PAD = 8  # halves of padding per shared row (16 bytes): ldmatrix rows hit distinct banks


def prefill_attention_cuda_supports(
    h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str = "float16"
) -> bool:
    """Whether :func:`prefill_attention_cuda` handles these shapes (else it raises)."""
    try:
        prefill_attention_cuda(h_kv, h_q, d_qk, d_v, dtype)
    except ValueError:
        return False
    return True


def _block_threads(block_m: int) -> int:
    """Threads of a block: a warp for every 16 query rows."""
    return block_m // 16 * 32


def _shared_bytes(d_qk: int, d_v: int, block_n: int) -> int:
    """Shared memory of one block: a K and a V tile of ``block_n`` padded rows."""
    return block_n * (d_qk + _PAD + d_v + _PAD) * 2


def _cuda_source(tag: str, *, H: int, DQK: int, DV: int, BM: int, BN: int) -> str:
    """The CUDA device code of the kernel (module docstring), specialised for the shapes."""
    NT = _block_threads(BM)
    KS = DQK // 16  # k-steps of S = Q K^T
    KSTR = DQK + _PAD
    VSTR = DV + _PAD
    CK = DQK // 8  # 16-byte chunks of a K row
    CV = DV // 8
    K_IT = (BN * CK + NT - 1) // NT
    V_IT = (BN * CV + NT - 1) // NT
    K_EXACT = int(K_IT * NT == BN * CK)
    V_EXACT = int(V_IT * NT == BN * CV)
    return f"""
#ifndef DSV2_PREFILL_ATTN_{tag}
#define DSV2_PREFILL_ATTN_{tag}
__device__ __forceinline__ void pfa_mma_{tag}(float* c, const unsigned* a, unsigned b0,
                                              unsigned b1) {{
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, "
      "{{%8,%9}}, {{%0,%1,%2,%3}};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const unsigned b[2] = {{b0, b1}};
  dsv2_emu_mma16816(c, a, b);
#endif
}}
__device__ __forceinline__ void pfa_ldsm_{tag}(unsigned* r, unsigned addr) {{
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#else
  dsv2_emu_ldmatrix_x4(r, addr, false);
#endif
}}
__device__ __forceinline__ void pfa_ldsm_t_{tag}(unsigned* r, unsigned addr) {{
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#else
  dsv2_emu_ldmatrix_x4(r, addr, true);
#endif
}}
__device__ __forceinline__ void pfa_cp_{tag}(unsigned dst, const void* src, int bytes) {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes));
#else
  dsv2_emu_cp_async(dst, src, bytes);
#endif
}}
__device__ __forceinline__ void pfa_commit_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::);
#else
  dsv2_emu_cp_commit();
#endif
}}
__device__ __forceinline__ void pfa_wait1_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group 1;" ::: "memory");
#else
  dsv2_emu_cp_wait(1);
#endif
}}
__device__ __forceinline__ float pfa_exp2_{tag}(float x) {{
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return dsv2_emu_ex2(x);
#endif
}}
__device__ __forceinline__ unsigned pfa_pack_{tag}(float lo, float hi) {{
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}}
__device__ __forceinline__ void prefill_attn_{tag}(
    const half* __restrict__ q, const half* __restrict__ k, const half* __restrict__ v,
    const int* __restrict__ q_indptr, const int* __restrict__ kv_indptr, half* __restrict__ out,
    float* __restrict__ lse, int batch_size, int causal, float sm_scale, half* smem,
    const half* smem_last, int bid, int tx) {{
  const int head = bid % {H};
  int rem = bid / {H};
  int b = 0, nt = 0;
  for (; b < batch_size; ++b) {{
    nt = (q_indptr[b + 1] - q_indptr[b] + {BM - 1}) / {BM};
    if (rem < nt) break;
    rem -= nt;
  }}
  if (b >= batch_size) return;
  const int q0 = q_indptr[b];
  const int q_len = q_indptr[b + 1] - q0;
  const int kv0 = kv_indptr[b];
  const int kv_len = kv_indptr[b + 1] - kv0;
  const int m0 = (nt - 1 - rem) * {BM};  // longest (causal) tiles first
  const int off = kv_len - q_len;
  const int kv_end = causal ? min(kv_len, off + min(m0 + {BM}, q_len)) : kv_len;
  const int n_tiles = kv_end > 0 ? (kv_end + {BN - 1}) / {BN} : 0;
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int row_base = m0 + warp * 16;
  const float sl2 = sm_scale * {_LOG2E!r}f;

  unsigned qf[{KS}][4];
  {{
    const int r0 = row_base + g, r1 = r0 + 8;
    const half* p0 = q + ((long long)(q0 + r0) * {H} + head) * {DQK} + t * 2;
    const half* p1 = q + ((long long)(q0 + r1) * {H} + head) * {DQK} + t * 2;
#pragma unroll
    for (int ks = 0; ks < {KS}; ++ks) {{
      qf[ks][0] = r0 < q_len ? *reinterpret_cast<const unsigned*>(p0 + ks * 16) : 0u;
      qf[ks][1] = r1 < q_len ? *reinterpret_cast<const unsigned*>(p1 + ks * 16) : 0u;
      qf[ks][2] = r0 < q_len ? *reinterpret_cast<const unsigned*>(p0 + ks * 16 + 8) : 0u;
      qf[ks][3] = r1 < q_len ? *reinterpret_cast<const unsigned*>(p1 + ks * 16 + 8) : 0u;
    }}
  }}
  const unsigned k_sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned v_sa = k_sa + {BN * KSTR * 2};
  const unsigned q_sa = v_sa + {BN * VSTR * 2};
  const half* kb = k + (long long)kv0 * {H * DQK} + head * {DQK};
  const half* vb = v + (long long)kv0 * {H * DV} + head * {DV};

  float o[{DV // 8}][4];
#pragma unroll
  for (int j = 0; j < {DV // 8}; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {{-INFINITY, -INFINITY}};
  float d[2] = {{0.f, 0.f}};

  if (n_tiles > 0) {{
#pragma unroll
    for (int i = 0; i < {K_IT}; ++i) {{
      const int c = i * {NT} + tx;
      if ({K_EXACT} || c < {BN * CK}) {{
        const int row = c / {CK}, col = c % {CK};
        const bool ok = row < kv_len;
        pfa_cp_{tag}(k_sa + (row * {KSTR} + col * 8) * 2,
                     ok ? (const void*)(kb + (long long)row * {H * DQK} + col * 8) : (const void*)k,
                     ok ? 16 : 0);
      }}
    }}
    pfa_commit_{tag}();
#pragma unroll
    for (int i = 0; i < {V_IT}; ++i) {{
      const int c = i * {NT} + tx;
      if ({V_EXACT} || c < {BN * CV}) {{
        const int row = c / {CV}, col = c % {CV};
        const bool ok = row < kv_len;
        pfa_cp_{tag}(v_sa + (row * {VSTR} + col * 8) * 2,
                     ok ? (const void*)(vb + (long long)row * {H * DV} + col * 8) : (const void*)v,
                     ok ? 16 : 0);
      }}
    }}
    pfa_commit_{tag}();
  }}

  for (int it = 0; it < n_tiles; ++it) {{
    const int n0 = it * {BN};
    pfa_wait1_{tag}();  // K(it) has landed
    __syncthreads();
    float s[{BN // 8}][4];
#pragma unroll
    for (int j = 0; j < {BN // 8}; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < {KS}; ++ks) {{
      
#pragma unroll
      for (int np = 0; np < {BN // 16}; ++np) {{
        unsigned r[4];
        pfa_ldsm_{tag}(r, k_sa + ((np * 16 + (lane >> 4) * 8 + (lane & 7)) * {KSTR} + ks * 16
                                  + ((lane >> 3) & 1) * 8) * 2);
        pfa_mma_{tag}(s[2 * np], qf[ks], r[0], r[1]);
        pfa_mma_{tag}(s[2 * np + 1], qf[ks], r[2], r[3]);
      }}
    }}
    __syncthreads();  // every warp is done with K(it)
    if (it + 1 < n_tiles) {{
      const int nn = n0 + {BN};
#pragma unroll
      for (int i = 0; i < {K_IT}; ++i) {{
        const int c = i * {NT} + tx;
        if ({K_EXACT} || c < {BN * CK}) {{
          const int row = c / {CK}, col = c % {CK};
          const bool ok = nn + row < kv_len;
          pfa_cp_{tag}(k_sa + (row * {KSTR} + col * 8) * 2,
                       ok ? (const void*)(kb + (long long)(nn + row) * {H * DQK} + col * 8)
                          : (const void*)k,
                       ok ? 16 : 0);
        }}
      }}
    }}
    pfa_commit_{tag}();

    const bool need_mask = (n0 + {BN} > kv_len) || (causal && n0 + {BN} > off + row_base + 1);
#pragma unroll
    for (int r = 0; r < 2; ++r) {{
      const int lim = causal ? min(kv_len, off + row_base + g + 8 * r + 1) : kv_len;
      float mx = m[r];
#pragma unroll
      for (int j = 0; j < {BN // 8}; ++j) {{
#pragma unroll
        for (int e = 0; e < 2; ++e) {{
          float x = s[j][2 * r + e] * sl2;
          if (need_mask && n0 + j * 8 + t * 2 + e >= lim) x = -INFINITY;
          s[j][2 * r + e] = x;
          mx = fmaxf(mx, x);
        }}
      }}
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mu = mx == -INFINITY ? 0.f : mx;
      const float alpha = pfa_exp2_{tag}(m[r] - mu);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < {BN // 8}; ++j) {{
#pragma unroll
        for (int e = 0; e < 2; ++e) {{
          const float p = pfa_exp2_{tag}(s[j][2 * r + e] - mu);
          s[j][2 * r + e] = p;
          sum += p;
        }}
      }}
      d[r] = d[r] * alpha + sum;
      m[r] = mx;
#pragma unroll
      for (int j = 0; j < {DV // 8}; ++j) {{
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }}
    }}

    pfa_wait1_{tag}();  // V(it) has landed
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < {BN // 16}; ++kk) {{
      unsigned a[4];
      a[0] = pfa_pack_{tag}(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pfa_pack_{tag}(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pfa_pack_{tag}(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pfa_pack_{tag}(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < {DV // 16}; ++np) {{
        unsigned r[4];
        pfa_ldsm_t_{tag}(r, v_sa + ((kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * {VSTR}
                                    + np * 16 + (lane >> 4) * 8) * 2);
        pfa_mma_{tag}(o[2 * np], a, r[0], r[1]);
        pfa_mma_{tag}(o[2 * np + 1], a, r[2], r[3]);
      }}
    }}
    __syncthreads();  // every warp is done with V(it)
    if (it + 1 < n_tiles) {{
      const int nn = n0 + {BN};
#pragma unroll
      for (int i = 0; i < {V_IT}; ++i) {{
        const int c = i * {NT} + tx;
        if ({V_EXACT} || c < {BN * CV}) {{
          const int row = c / {CV}, col = c % {CV};
          const bool ok = nn + row < kv_len;
          pfa_cp_{tag}(v_sa + (row * {VSTR} + col * 8) * 2,
                       ok ? (const void*)(vb + (long long)(nn + row) * {H * DV} + col * 8)
                          : (const void*)v,
                       ok ? 16 : 0);
        }}
      }}
    }}
    pfa_commit_{tag}();
  }}

#pragma unroll
  for (int r = 0; r < 2; ++r) {{
    float dt = d[r];
    dt += __shfl_xor_sync(0xffffffffu, dt, 1);
    dt += __shfl_xor_sync(0xffffffffu, dt, 2);
    const int row = row_base + g + 8 * r;
    if (row < q_len) {{
      const float inv = dt > 0.f ? 1.f / dt : 0.f;
      half* po = out + ((long long)(q0 + row) * {H} + head) * {DV} + t * 2;
#pragma unroll
      for (int j = 0; j < {DV // 8}; ++j) {{
        *reinterpret_cast<__half2*>(po + j * 8) =
            __floats2half2_rn(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
      }}
      if (t == 0) lse[(long long)(q0 + row) * {H} + head] = dt > 0.f ? m[r] + log2f(dt) : -INFINITY;
    }}
  }}
}}
#endif
"""


def prefill_attention_cuda(
    h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str = "float16"
) -> tirx.PrimFunc:
    """The ragged prefill attention PrimFunc (module docstring), the ABI of TVM's
    ``_attention_prefill_ragged(h_kv, h_q, d_qk, d_v, ...)``, with the tiles of
    :data:`~.tiles.TABLE`. Raises ``ValueError`` for shapes it does not handle (the cache then
    keeps TVM's kernel)."""
    tiles = tuned("prefill_attention", shape=(h_q, d_qk, d_v, dtype))
    return build_prefill_attention(h_kv, h_q, d_qk, d_v, dtype, tiles)


def build_prefill_attention(
    h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str, tiles: PrefillAttentionTiles
) -> tirx.PrimFunc:
    """:func:`prefill_attention_cuda` with the tiles given (the lab sweeps them).

    Needs ``h_kv == h_q`` (what the MLA slot uses), float16, ``d_qk`` and ``d_v`` multiples of
    16, and ``block_n * (d_qk + d_v + 16) * 2`` bytes of shared memory at most 48 KB;
    ``block_m`` (query rows per block, 16 per warp) in 32, 64, 128 and ``block_n`` (keys per
    tile) in 16, 32, 64, 128.
    """
    block_m, block_n = tiles.block_m, tiles.block_n
    if dtype != "float16":
        raise ValueError(f"prefill_attention_cuda supports float16 only, got {dtype}")
    if h_kv != h_q:
        raise ValueError(f"prefill_attention_cuda needs h_kv == h_q, got {h_kv} and {h_q}")
    if d_qk % 16 or d_v % 16:
        raise ValueError(f"head dims must be multiples of 16, got {d_qk} and {d_v}")
    if block_m not in (32, 64, 128) or block_n not in (16, 32, 64, 128):
        raise ValueError(
            f"block_m in (32, 64, 128), block_n in (16, 32, 64, 128): got {block_m}, {block_n}"
        )
    smem = _shared_bytes(d_qk, d_v, block_n)
    if smem > _MAX_SHARED_BYTES:
        raise ValueError(f"prefill_attention_cuda needs {smem} bytes of shared memory")
    smem_scope = "shared.dyn" if smem > _STATIC_SHARED_BYTES else "shared"
    H, BM, BN = h_q, block_m, block_n
    NT = _block_threads(BM)
    tag = f"{H}_{d_qk}_{d_v}_{BM}_{BN}"
    src = _cuda_source(tag, H=H, DQK=d_qk, DV=d_v, BM=BM, BN=BN)
    SMEM_N = smem // 2

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv_mma(
        var_q: T.handle,  # [total_len, h_q, d_qk]
        var_q_indptr: T.handle,  # [batch_size + 1]
        var_k: T.handle,  # [total_len, h_kv, d_qk]
        var_v: T.handle,  # [total_len, h_kv, d_v]
        var_kv_indptr: T.handle,  # [batch_size + 1]
        var_q_rope_position: T.handle,  # [total_q_len] (unused: rotary_mode 0)
        var_k_rope_pos_offset: T.handle,  # [b] (unused)
        var_output: T.handle,  # [total_len, h_q, d_v]
        var_lse: T.handle,  # [total_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()

        q = T.match_buffer(var_q, (qo_len, H, d_qk), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        k = T.match_buffer(var_k, (kv_len, H, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_len, H, d_v), dtype)
        kv_indptr = T.match_buffer(
            var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset
        )
        T.match_buffer(
            var_q_rope_position, (qo_len,), "int32", elem_offset=q_rope_position_elem_offset
        )
        T.match_buffer(
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_pos_offset_elem_offset
        )
        output = T.match_buffer(var_output, (qo_len, H, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_len, H), "float32")

        assert rotary_mode == 0, "prefill_attention_cuda: inline RoPE (rotary_mode 1) unsupported"
        for bx in T.thread_binding(
            H * (T.floordiv(qo_len + BM - 1, BM) + batch_size), thread="blockIdx.x"
        ):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    smem = T.sblock_alloc_buffer((SMEM_N,), dtype, scope=smem_scope)
                    T.cuda.func_call(
                        f"prefill_attn_{tag}",
                        T.address_of(q[0, 0, 0]),
                        T.address_of(k[0, 0, 0]),
                        T.address_of(v[0, 0, 0]),
                        T.address_of(q_indptr[0]),
                        T.address_of(kv_indptr[0]),
                        T.address_of(output[0, 0, 0]),
                        T.address_of(lse[0, 0]),
                        batch_size,
                        causal,
                        sm_scale,
                        T.address_of(smem[0]),
                        # the last element too: keeps buffer compaction from shrinking smem
                        T.address_of(smem[SMEM_N - 1]),
                        bx,
                        tx,
                        source_code=src,
                    )

    return batch_prefill_ragged_kv_mma

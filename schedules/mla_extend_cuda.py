"""A row-tiled absorbed MLA attention kernel for extends (chunked prefill), for CUDA.

The cache's MLA slot (``TIRPagedPrefillFunc::MLA``, ABI in :mod:`.mla_attention_cuda`) runs the
cross-attention of every extend chunk over the cached prefix (``causal=0``: each query row sees
the whole prefix). The split-KV kernel gives a block one query row x 16 heads, so an 8K-token
chunk reads the prefix's latent pages 8K times and its tensor cores work on 16-row tiles with a
k-split reduction per page (92 TFLOP/s, schedules/results/long_prefill.md). This kernel tiles
query rows instead (FlashMLA-style):

* **Block** (256 threads, grid ``(total // 4 + batch, H / 16)``): ``4`` consecutive query tokens
  of one sequence x 16 heads = 64 rows of ``mma.sync.m16n8k16``; row tile ``j`` (16 rows) is
  token ``j``'s 16 heads. Block ``i`` belongs to the sequence ``b`` with the largest
  ``q_indptr[b] // 4 + b <= i`` (each sequence owns ``ceil(q_len / 4)`` consecutive blocks from
  there: no host-side planning; at most ``batch`` blocks are idle).
* **Operands**: Q of the 64 rows in shared memory (``cp.async``, loaded once); the prefix walked
  in key tiles of 32 latent rows (2 pages, ``[32, L + R]`` fp16) through a ring of ``stages``
  shared buffers (``cp.async`` ``stages - 1`` tiles ahead, rows past the visible keys
  zero-filled). Every tile is used by all 64 rows: the prefix is read ``ceil(q_len / 4)`` times
  instead of ``q_len`` times.
* **Per tile**: ``S = Q K^T`` ``[64, 32]`` by 8 warps, warp ``w`` = row tile ``w % 4`` x half
  ``w / 4`` of the 36 k-steps (A and B fragments by ``ldmatrix``), the two halves summed in
  shared memory; the online softmax (fp32, base 2), 4 threads a row (warp shuffles), P as fp16;
  ``O += P V`` with ``V = K[:, :L]``: warp ``w`` = row tile ``w % 4`` x column half ``w / 4``
  (``L / 2`` columns, fp32 accumulators in registers: 128 a thread for ``L = 512``), V fragments
  by ``ldmatrix.trans``. Three barriers a tile.
* **Epilogue**: ``out = O / l`` (fp16, latent space), ``lse = m + log2 l`` (base 2); a row that
  sees no key gets ``out = 0``, ``lse = -inf`` (:mod:`.mla_cpu`'s convention). ``causal=1`` is
  honoured per row (token ``r`` of a ``q_len``-row chunk sees ``kv_len - q_len + r + 1`` keys).

Why 4 tokens: 64 rows keep the tile's operands (Q 73 KB + ``stages`` x 36.5 KB of keys) in one
SM's shared memory with 3 stages (210 KB) and the output accumulators at 128 registers a thread;
8 tokens would need twice of both. One block an SM; an 8K chunk is 2,048 blocks (15 waves).

FLOPs (V2-Lite, one layer): ``2 x rows x P x 16 x (576 + 512)``; an 8K chunk over a 64K prefix:
18.7 TFLOP. Shared-memory traffic a tile and warp: 54 ``ldmatrix.x4`` for the 72 score MMAs and
34 for the 64 PV MMAs (the score phase is bound near 1:1).

**FP8 cache** (``kv_scale`` given; :mod:`.kv_fp8`'s storage, the contract of the split-KV
kernel's FP8 variant): the query is ``[n, 2H, L/2 + R]`` (head ``h``'s ``L + R`` values at the
start of pseudo-heads ``2h, 2h + 1``, the padding never read), a page row ``L/2 + R`` float16
slots (the latent's ``L`` e4m3 bytes, then the rope values), the output ``[n, 2H, L/2]`` (a
reshape of ``[n, H, L]``) and the lse ``[n, 2H]`` (a head's on both pseudo-heads). The ring
stages a tile's raw rows (``cp.async``, 640 B a row: 20 KB a stage instead of 36.5), and after
the tile's barrier the block decodes it into one float16 key tile of the layout above (a byte
``b`` -> the half ``(b & 0x80) << 8 | (b & 0x7f) << 7`` = ``value(b) / 256``, two bytes a 32-bit
word by shifts and masks; the rope halves copied), then one more barrier (4 a tile). The score
k-steps of the latent part accumulate first, are multiplied by ``256 kv_scale``, then the rope
part's k-steps add unscaled (``sm (s q_L . c + q_R . k_pe)``, as the split-KV reader); ``out =
256 kv_scale O / l``. Shared memory at V2-Lite's shapes, 3 stages: 193 KB.

:func:`with_extend_path` returns the cache's slot function: the split-KV PrimFunc with a host
branch that launches this kernel instead when ``total_len >= min_rows * batch_size`` (tiles:
``"mla_extend"``). The split-KV kernels' device code is unchanged (the branch only adds kernels);
decode (one row a sequence) never takes the branch.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .kv_fp8 import fp8_cache_dims, read_scale
from .tiles import MLAExtendTiles, tuned

__all__ = [
    "build_mla_extend",
    "mla_extend_cuda",
    "mla_extend_cuda_supports",
    "with_extend_path",
]

PAGE = 16  # tokens a page (the cache's CUDA page size)
TOKENS = 4  # query tokens a block (module docstring)
HEADS = 16  # heads a block: the rows of one mma row tile
KEYS = 32  # latent rows of a key tile (2 pages)
THREADS = 256
_PAD = 8  # halves appended to a shared row (16-byte aligned, conflict-free ldmatrix)
_PS = KEYS + 8  # P tile row stride (halves)
_SS = KEYS + 4  # score row stride (floats): conflict-free float4 reads
_MAX_DYN_SHARED_BYTES = 232448  # sm_90's opt-in limit of one block
_LOG2E = math.log2(math.e)


def _shared_halves(D: int, stages: int, DL: int = 0, fp8: bool = False) -> int:
    """Shared memory (halves) of a block: Q (64 rows), the key ring, two score halves (fp32), the
    P tile and the per-row rescale / max / sum (fp32). FP8 (latent width ``DL``): the ring holds
    raw rows (``DL / 2 + R`` halves) and the decoded key tile follows it."""
    rows = TOKENS * HEADS
    ring = (
        stages * KEYS * (DL // 2 + D - DL) + KEYS * (D + _PAD)
        if fp8
        else stages * KEYS * (D + _PAD)
    )
    return rows * (D + _PAD) + ring + 2 * rows * _SS * 2 + rows * _PS + 3 * rows * 2


def _check(
    num_heads: int, latent_dim: int, rope_dim: int, dtype: str, stages: int, fp8: bool = False
) -> None:
    D = latent_dim + rope_dim
    if dtype != "float16":
        raise ValueError(f"mla_extend_cuda supports float16 only, got {dtype}")
    if fp8 and (rope_dim % 16 or latent_dim % 128):
        # (whole k-steps of each part; latent % 128: the split-KV kernel's FP8 block is then its
        # tensor-core one, whose body composes under the slot's branch without barriers in TIR)
        raise ValueError(
            "mla_extend_cuda over an FP8 cache needs rope % 16 == 0 and latent % 128 == 0, got "
            f"{latent_dim} + {rope_dim}"
        )
    if num_heads % HEADS:
        raise ValueError(f"mla_extend_cuda needs a multiple of {HEADS} heads, got {num_heads}")
    if D % 16 or latent_dim % 32 or latent_dim > 512:
        raise ValueError(
            "mla_extend_cuda needs (latent + rope) % 16 == 0 and latent % 32 == 0, latent <= 512"
            f" (registers), got {latent_dim} + {rope_dim}"
        )
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    smem = _shared_halves(D, stages, latent_dim, fp8) * 2
    if smem > _MAX_DYN_SHARED_BYTES:
        raise ValueError(f"mla_extend_cuda needs {smem} bytes of shared memory ({stages} stages)")


def mla_extend_cuda_supports(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str = "float16",
    kv_scale: float | None = None,
) -> bool:
    """Whether :func:`mla_extend_cuda` handles these shapes (float16, 16-head groups; with
    ``kv_scale``: over an FP8 cache)."""
    try:
        fp8 = kv_scale is not None
        _check(num_heads, latent_dim, rope_dim, dtype, tuned("mla_extend").stages, fp8)
    except ValueError:
        return False
    return True


def _cuda_source(
    tag: str, H: int, D: int, DL: int, stages: int, kscale: float | None = None
) -> str:
    """CUDA of ``mla_extend_<tag>`` (module docstring) and its PTX primitives (each with the CPU
    emulation's stand-in in its ``#else`` branch). ``kscale``: the FP8 cache's variant (module
    docstring, "FP8 cache"), its decode factor ``256 kv_scale``."""
    ks = D // 16
    fp8 = kscale is not None
    K, PD = (2, DL // 2 + D - DL) if fp8 else (1, D)  # slots a page row (the cache's width)
    QS = K * PD  # halves between the heads of a query row (FP8: a head's K pseudo-heads)
    RROW = PD if fp8 else D + _PAD  # halves a row of the cp.async ring
    RING = KEYS * RROW * 2  # bytes a ring buffer
    CONV = KEYS * (D + _PAD) if fp8 else 0  # halves of the FP8 variant's decoded key tile
    s_off = TOKENS * HEADS * (D + _PAD) + stages * KEYS * RROW + CONV  # the scores (halves)
    one = f"{kscale!r}f" if fp8 else "1.f"  # the output's factor (FP8: the latent's decode)
    decode, key_tile, scores = "", f"    const unsigned kvb = kv0 + (it % {stages}) * {RING};", ""
    if fp8:
        decode = _decode_source(tag, D, DL, PD)
        q_end = TOKENS * HEADS * (D + _PAD)  # halves: Q, then the ring, then the decoded tile
        key_tile = f"""    // tile it decoded (free: every warp is past the barrier above)
    mlae_decode_{tag}(smem + {q_end + stages * KEYS * RROW},
                      smem + {q_end} + (it % {stages}) * {KEYS * RROW}, tx);
    __syncthreads();
    const unsigned kvb = kv0 + {stages * RING};"""
        scores = (
            _score_loop(tag, "hf", DL // 16, D)
            + "    // the latent part's sums times 256 kv_scale; the rope part's k-steps unscaled\n"
            + "#pragma unroll\n"
            + f"    for (int i = 0; i < 16; ++i) c[i] *= {kscale!r}f;\n"
            + _score_loop(tag, f"{DL // 16} + hf", ks, D)
        )
    else:
        scores = _score_loop(tag, "hf", ks, D)
    lse_base = f"(size_t)(q_indptr[b] + pos0) * {H} + by * {HEADS}"
    if fp8:
        lse_base = f"({lse_base}) * {K}"
    # the row's lse (FP8: to each of its head's K pseudo-heads)
    lse_idx = (
        [f"((sr >> 4) * {H} + (sr & 15)) * {K} + {i}" for i in range(K)]
        if fp8
        else [f"(sr >> 4) * {H} + (sr & 15)"]
    )
    lse_store = "\n".join(
        f"      lb[{i}] = d_run > 0.f ? m_run + log2f(d_run) : -INFINITY;" for i in lse_idx
    )
    if fp8:  # (one statement under the token's if)
        lse_store = "    {\n" + lse_store + "\n    }"
    return f"""
#ifndef DSV2_MLA_EXTEND_{tag}
#define DSV2_MLA_EXTEND_{tag}
__device__ __forceinline__ void mlae_mma_{tag}(float* c, const unsigned* a, unsigned b0,
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
__device__ __forceinline__ void mlae_ldsm_{tag}(unsigned* r, unsigned addr) {{
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#else
  dsv2_emu_ldmatrix_x4(r, addr, false);
#endif
}}
__device__ __forceinline__ void mlae_ldsm_t_{tag}(unsigned* r, unsigned addr) {{
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#else
  dsv2_emu_ldmatrix_x4(r, addr, true);
#endif
}}
__device__ __forceinline__ void mlae_cp_{tag}(unsigned dst, const void* src, int bytes) {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(bytes) : "memory");
#else
  dsv2_emu_cp_async(dst, src, bytes);
#endif
}}
__device__ __forceinline__ void mlae_commit_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  dsv2_emu_cp_commit();
#endif
}}
__device__ __forceinline__ void mlae_wait_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group {stages - 2};" ::: "memory");
#else
  dsv2_emu_cp_wait({stages - 2});
#endif
}}
__device__ __forceinline__ void mlae_wait_all_{tag}() {{
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#else
  dsv2_emu_cp_wait(0);
#endif
}}
// Key tile `it` (32 latent rows: pages ids[2 it], ids[2 it + 1]) -> the shared buffer at dst;
// rows at or past n_keys are zero-filled without a global read.
__device__ __forceinline__ void mlae_tile_{tag}(unsigned dst, const half* __restrict__ pages,
                                                const int* __restrict__ ids, int it, int n_keys,
                                                int tx) {{
  for (int i = tx; i < {KEYS * (PD // 8)}; i += {THREADS}) {{
    const int r = i / {PD // 8}, c = i - r * {PD // 8};
    const int key = it * {KEYS} + r;
    const bool ok = key < n_keys;
    const half* src = ok ? pages + ((size_t)ids[key >> 4] * {PAGE} + (key & 15)) * {PD} + c * 8
                         : pages;
    mlae_cp_{tag}(dst + (r * {RROW} + c * 8) * 2, src, ok ? 16 : 0);
  }}
}}
{decode}// One block: 4 query tokens of one sequence x 16 heads (head group by) over the sequence's
// cached latent rows (module docstring).
__device__ __forceinline__ void mla_extend_{tag}(
    const half* __restrict__ q, const int* __restrict__ q_indptr,
    const half* __restrict__ pages, const int* __restrict__ page_indptr,
    const int* __restrict__ page_values, const int* __restrict__ length_info,
    half* __restrict__ out, float* __restrict__ lse, int batch_size, int causal, float sm_scale,
    half* smem, const half* smem_last, int bx, int by, int tx) {{
  const float scale = sm_scale * {_LOG2E!r}f;  // scores in base 2
  // the block's sequence: the largest b with q_indptr[b] / 4 + b <= bx
  int lo = 0, hi = batch_size;
  while (hi - lo > 1) {{
    const int mid = (lo + hi) >> 1;
    if (q_indptr[mid] / {TOKENS} + mid <= bx) lo = mid; else hi = mid;
  }}
  const int b = lo;
  const int q_len = q_indptr[b + 1] - q_indptr[b];
  const int pos0 = (bx - (q_indptr[b] / {TOKENS} + b)) * {TOKENS};  // first token in the chunk
  if (pos0 >= q_len) return;  // (an idle block)
  const int n_tok = min({TOKENS}, q_len - pos0);
  const int np = page_indptr[b + 1] - page_indptr[b];
  const int kv_len = np > 0 ? (np - 1) * {PAGE} + length_info[b] : 0;
  const int* ids = page_values + page_indptr[b];
  // keys token j sees; n_keys: the most any token of the tile sees (the last, if causal)
  auto vis = [&](int j) {{
    return causal > 0 ? max(min(kv_len, kv_len - q_len + pos0 + j + 1), 0) : kv_len;
  }};
  const int n_keys = vis(n_tok - 1);
  const int ntile = (n_keys + {KEYS - 1}) / {KEYS};
  const half* qb = q + ((size_t)(q_indptr[b] + pos0) * {H} + by * {HEADS}) * {QS};
  half* ob = out + ((size_t)(q_indptr[b] + pos0) * {H} + by * {HEADS}) * {DL};
  float* lb = lse + {lse_base};

  float* s_part = reinterpret_cast<float*>(smem + {s_off});
  half* p_s = reinterpret_cast<half*>(s_part + {2 * TOKENS * HEADS * _SS});
  float* r_s = reinterpret_cast<float*>(p_s + {TOKENS * HEADS * _PS});
  float* m_s = r_s + {TOKENS * HEADS};
  float* d_s = m_s + {TOKENS * HEADS};
  const unsigned q0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned kv0 = q0 + {TOKENS * HEADS * (D + _PAD) * 2};
  // Q (rows of tokens past n_tok zero-filled) -> shared, in the first commit group
  for (int i = tx; i < {TOKENS * HEADS * (D // 8)}; i += {THREADS}) {{
    const int r = i / {D // 8}, c = i - r * {D // 8};
    const int tok = r >> 4, head = r & 15;
    const bool ok = tok < n_tok;
    mlae_cp_{tag}(q0 + (r * {D + _PAD} + c * 8) * 2,
                  ok ? qb + ((size_t)tok * {H} + head) * {QS} + c * 8 : qb, ok ? 16 : 0);
  }}
#pragma unroll
  for (int s = 0; s < {stages - 1}; ++s) {{
    if (s < ntile) mlae_tile_{tag}(kv0 + s * {RING}, pages, ids, s, n_keys, tx);
    mlae_commit_{tag}();
  }}
  const int w = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int rt = w & 3, hf = w >> 2;  // row tile (token); k-step half / column half
  const int lr = lane & 7, lm = lane >> 3;
  // ldmatrix row addresses (bytes): A of Q (rows +0 / +8 (lm % 2) x k +0 / +8 (lm / 2)),
  // B of K (keys +0 / +8 (lm / 2) x k +0 / +8 (lm % 2)), B of V (.trans: keys +0 / +8 (lm % 2)
  // x columns +0 / +8 (lm / 2)), A of P (as Q's)
  const unsigned a_off = q0 + ((rt * 16 + (lm & 1) * 8 + lr) * {D + _PAD} + (lm >> 1) * 8) * 2;
  const unsigned k_off = (((lm >> 1) * 8 + lr) * {D + _PAD} + (lm & 1) * 8) * 2;
  const unsigned v_off = (((lm & 1) * 8 + lr) * {D + _PAD} + (lm >> 1) * 8 + hf * {DL // 2}) * 2;
  const unsigned p_off = static_cast<unsigned>(__cvta_generic_to_shared(p_s)) +
                         ((rt * 16 + (lm & 1) * 8 + lr) * {_PS} + (lm >> 1) * 8) * 2;
  // softmax thread: row sr (token sr / 16, head sr % 16), keys kq * 8 .. kq * 8 + 7
  const int sr = tx >> 2, kq = tx & 3;
  const int vis_r = vis(sr >> 4);
  float m_run = -INFINITY, d_run = 0.f;
  float acc[{DL // 16} * 4];
#pragma unroll
  for (int i = 0; i < {DL // 16} * 4; ++i) acc[i] = 0.f;
  for (int it = 0; it < ntile; ++it) {{
    mlae_wait_{tag}();  // tile it (and Q) have landed (this thread's copies)
    __syncthreads();    // ... everyone's; the buffer of tile it - 1 is free again
    {{
      const int j = it + {stages - 1};
      if (j < ntile)
        mlae_tile_{tag}(kv0 + (j % {stages}) * {RING}, pages, ids, j, n_keys, tx);
      mlae_commit_{tag}();
    }}
{key_tile}
    // S[16 rows of token rt, 32 keys] over this warp's k-steps hf, hf + 2, ...
    float c[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) c[i] = 0.f;
{scores}#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {{
      float* r0 = s_part + (hf * {TOKENS * HEADS} + rt * 16 + g) * {_SS} + nt * 8 + t * 2;
      *reinterpret_cast<float2*>(r0) = make_float2(c[4 * nt], c[4 * nt + 1]);
      *reinterpret_cast<float2*>(r0 + {8 * _SS}) = make_float2(c[4 * nt + 2], c[4 * nt + 3]);
    }}
    __syncthreads();
    // online softmax of row sr over its 8 keys (base 2); the row's 4 threads agree on m, l
    {{
      const int k0 = kq * 8, vis_t = vis_r - it * {KEYS};
      float sv[8];
      float mx = -INFINITY;
#pragma unroll
      for (int h = 0; h < 2; ++h) {{
        const float4 x = *reinterpret_cast<const float4*>(s_part + sr * {_SS} + k0 + 4 * h);
        const float4 y = *reinterpret_cast<const float4*>(
            s_part + ({TOKENS * HEADS} + sr) * {_SS} + k0 + 4 * h);
        sv[4 * h] = x.x + y.x; sv[4 * h + 1] = x.y + y.y;
        sv[4 * h + 2] = x.z + y.z; sv[4 * h + 3] = x.w + y.w;
      }}
#pragma unroll
      for (int e = 0; e < 8; ++e) {{
        sv[e] = k0 + e < vis_t ? sv[e] * scale : -INFINITY;
        mx = fmaxf(mx, sv[e]);
      }}
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float rs = m_run == -INFINITY ? 0.f : exp2f(m_run - m_new);
      float ps = 0.f;
      unsigned ph[4];
#pragma unroll
      for (int e = 0; e < 8; e += 2) {{
        const float p0 = m_new == -INFINITY ? 0.f : exp2f(sv[e] - m_new);
        const float p1 = m_new == -INFINITY ? 0.f : exp2f(sv[e + 1] - m_new);
        ps += p0 + p1;
        __half2 h2 = __floats2half2_rn(p0, p1);
        ph[e / 2] = *reinterpret_cast<unsigned*>(&h2);
      }}
      uint4 pv;
      pv.x = ph[0]; pv.y = ph[1]; pv.z = ph[2]; pv.w = ph[3];
      *reinterpret_cast<uint4*>(p_s + sr * {_PS} + k0) = pv;
      ps += __shfl_xor_sync(0xffffffffu, ps, 1);
      ps += __shfl_xor_sync(0xffffffffu, ps, 2);
      d_run = d_run * rs + ps;
      m_run = m_new;
      if (kq == 0) r_s[sr] = rs;
    }}
    __syncthreads();
    // O[16 rows of token rt, this warp's {DL // 2} columns] = O * rescale + P V
    const float r0 = r_s[rt * 16 + g], r1 = r_s[rt * 16 + g + 8];
#pragma unroll
    for (int j = 0; j < {DL // 16}; ++j) {{
      acc[4 * j] *= r0; acc[4 * j + 1] *= r0; acc[4 * j + 2] *= r1; acc[4 * j + 3] *= r1;
    }}
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {{
      unsigned a[4];
      mlae_ldsm_{tag}(a, p_off + kk * 32);
#pragma unroll
      for (int j = 0; j < {DL // 16}; j += 2) {{
        unsigned vb[4];
        mlae_ldsm_t_{tag}(vb, kvb + v_off + kk * {16 * (D + _PAD) * 2} + j * 16);
        mlae_mma_{tag}(acc + 4 * j, a, vb[0], vb[1]);
        mlae_mma_{tag}(acc + 4 * j + 4, a, vb[2], vb[3]);
      }}
    }}
  }}
  mlae_wait_all_{tag}();  // (nothing is in flight past the last tile; Q's copies if no tile)
  if (kq == 0) {{
    m_s[sr] = m_run;
    d_s[sr] = d_run;
    if ((sr >> 4) < n_tok)
{lse_store}
  }}
  __syncthreads();
  if (rt < n_tok) {{
    const float d0 = d_s[rt * 16 + g], d1 = d_s[rt * 16 + g + 8];
    const float i0 = d0 > 0.f ? {one} / d0 : 0.f, i1 = d1 > 0.f ? {one} / d1 : 0.f;
    half* o = ob + (size_t)rt * {H * DL};
#pragma unroll
    for (int j = 0; j < {DL // 16}; ++j) {{
      const int col = hf * {DL // 2} + j * 8 + t * 2;
      *reinterpret_cast<__half2*>(o + g * {DL} + col) =
          __floats2half2_rn(acc[4 * j] * i0, acc[4 * j + 1] * i0);
      *reinterpret_cast<__half2*>(o + (g + 8) * {DL} + col) =
          __floats2half2_rn(acc[4 * j + 2] * i1, acc[4 * j + 3] * i1);
    }}
  }}
}}
#endif
"""


def _score_loop(tag: str, first: str, end: int, D: int) -> str:
    """CUDA: this warp's k-steps ``first, first + 2, .. < end`` of ``S = Q K^T`` into ``c``."""
    return f"""#pragma unroll 2
    for (int ks = {first}; ks < {end}; ks += 2) {{
      unsigned a[4], kb[4];
      mlae_ldsm_{tag}(a, a_off + ks * 32);
      mlae_ldsm_{tag}(kb, kvb + k_off + ks * 32);
      mlae_mma_{tag}(c, a, kb[0], kb[1]);
      mlae_mma_{tag}(c + 4, a, kb[2], kb[3]);
      mlae_ldsm_{tag}(kb, kvb + k_off + {16 * (D + _PAD) * 2} + ks * 32);
      mlae_mma_{tag}(c + 8, a, kb[0], kb[1]);
      mlae_mma_{tag}(c + 12, a, kb[2], kb[3]);
    }}
"""


def _decode_source(tag: str, D: int, DL: int, PD: int) -> str:
    """CUDA of the FP8 variant's ``mlae_decode_<tag>(dec, raw, tx)``: a ring buffer's 32 raw
    rows (``PD`` halves: ``DL`` e4m3 bytes, then the rope halves) -> the decoded key tile
    (rows of ``D + 8`` halves). Byte ``b`` becomes the half ``(b & 0x80) << 8 | (b & 0x7f) <<
    7`` = ``value(b) / 256`` (:func:`~.kv_fp8.e4m3_byte_f16`), two bytes a 32-bit word; 8
    bytes (one 16-byte store) a thread and step, then one 16-byte rope piece."""
    R = D - DL
    return f"""__device__ __forceinline__ unsigned mlae_e4m3x2_{tag}(unsigned w) {{
  const unsigned u = ((w & 0xffu) << 8) | ((w & 0xff00u) << 16);  // bytes 0, 1 -> bits 8, 24
  return (u & 0x80008000u) | ((u & 0x7f007f00u) >> 1);
}}
__device__ __forceinline__ void mlae_decode_{tag}(half* __restrict__ dec,
                                                  const half* __restrict__ raw, int tx) {{
  for (int i = tx; i < {KEYS * DL // 8}; i += {THREADS}) {{
    const int r = i / {DL // 8}, c = i - r * {DL // 8};
    const uint2 w = *reinterpret_cast<const uint2*>(raw + r * {PD} + c * 4);
    uint4 h;
    h.x = mlae_e4m3x2_{tag}(w.x);
    h.y = mlae_e4m3x2_{tag}(w.x >> 16);
    h.z = mlae_e4m3x2_{tag}(w.y);
    h.w = mlae_e4m3x2_{tag}(w.y >> 16);
    *reinterpret_cast<uint4*>(dec + r * {D + _PAD} + c * 8) = h;
  }}
  for (int i = tx; i < {KEYS * R // 8}; i += {THREADS}) {{
    const int r = i / {R // 8}, c = i - r * {R // 8};
    *reinterpret_cast<uint4*>(dec + r * {D + _PAD} + {DL} + c * 8) =
        *reinterpret_cast<const uint4*>(raw + r * {PD} + {DL // 2} + c * 8);
  }}
}}
"""


@T.macro
def _extend_launch(
    q, q_indptr, pages, page_indptr, page_values, length_info, output, lse, causal, sm_scale,
    total_len, batch_size, n_hg, smem_n, name, src,
):  # fmt: skip
    for bx in T.thread_binding(total_len // TOKENS + batch_size, thread="blockIdx.x"):
        for by in T.thread_binding(n_hg, thread="blockIdx.y"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.sblock("mla_extend"):
                    T.reads()
                    T.writes()
                    smem = T.sblock_alloc_buffer((smem_n,), "float16", scope="shared.dyn")
                    T.cuda.func_call(
                        name,
                        T.address_of(q[0, 0, 0]),
                        T.address_of(q_indptr[0]),
                        T.address_of(pages[0, 0, 0]),
                        T.address_of(page_indptr[0]),
                        T.address_of(page_values[0]),
                        T.address_of(length_info[0]),
                        T.address_of(output[0, 0, 0]),
                        T.address_of(lse[0, 0]),
                        batch_size,
                        causal,
                        sm_scale,  # (times log2 e in the kernel: a host-side product would
                        # be shared with the split-KV kernel's and change its parameters)
                        T.address_of(smem[0]),
                        # the last element too: keeps buffer compaction from shrinking smem
                        T.address_of(smem[smem_n - 1]),
                        bx,
                        by,
                        tx,
                        source_code=src,
                    )


def _header(name: str, QH: int, QD: int, PD: int, ODL: int) -> str:
    """TVMScript of the slot function's signature and buffers (the split-KV kernel's): ``QH``
    query heads of ``QD`` values, page rows of ``PD``, outputs of ``ODL`` (the FP8 cache's
    pseudo-heads and slots: :func:`~.kv_fp8.fp8_cache_dims`)."""
    return f"""
@T.prim_func(s_tir=True)
def {name}(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
        var_page_indptr: T.handle, var_page_values: T.handle, var_length_info: T.handle,
        var_output: T.handle, var_lse: T.handle, causal: T.int32, sm_scale: T.float32):
    T.func_attr({{"tirx.is_scheduled": True, "tirx.noalias": True}})
    batch_size = T.int32()
    total_len = T.int32()
    nnz_pages = T.int32()
    max_num_pages = T.int32()
    q_indptr_elem_offset = T.int32()
    page_indptr_elem_offset = T.int32()
    page_values_elem_offset = T.int32()
    length_info_elem_offset = T.int32()
    q = T.match_buffer(var_q, (total_len, {QH}, {QD}), "float16")
    q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                              elem_offset=q_indptr_elem_offset)
    pages = T.match_buffer(var_pages, (max_num_pages, {PAGE}, {PD}), "float16")
    page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                 elem_offset=page_indptr_elem_offset)
    page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32",
                                 elem_offset=page_values_elem_offset)
    length_info = T.match_buffer(var_length_info, (batch_size,), "int32",
                                 elem_offset=length_info_elem_offset)
    output = T.match_buffer(var_output, (total_len, {QH}, {ODL}), "float16")
    lse = T.match_buffer(var_lse, (total_len, {QH}), "float32")
"""


_CALL = (
    "extend(q, q_indptr, pages, page_indptr, page_values, length_info, output, lse, causal, "
    "sm_scale, total_len, batch_size, {n_hg}, {smem_n}, name, src)"
)


def _parts(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    tiles: MLAExtendTiles,
    kv_scale: float | None = None,
):
    """(buffer dims for :func:`_header`, kernel name, CUDA, launch call) of these shapes."""
    D = latent_dim + rope_dim
    fp8 = kv_scale is not None
    tag = f"{num_heads}_{latent_dim}_{D}_s{tiles.stages}" + ("_fp8" if fp8 else "")
    name = f"mla_extend_{tag}"
    kscale = read_scale(kv_scale) if fp8 else None
    src = _cuda_source(tag, num_heads, D, latent_dim, tiles.stages, kscale)
    smem_n = _shared_halves(D, tiles.stages, latent_dim, fp8)
    call = _CALL.format(n_hg=num_heads // HEADS, smem_n=smem_n)
    if fp8:
        qh, qd, odl = fp8_cache_dims(num_heads, latent_dim, rope_dim, "float16")
        dims = (qh, qd, qd, odl)
    else:
        dims = (num_heads, D, D, latent_dim)
    return dims, name, src, call


def build_mla_extend(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str,
    tiles: MLAExtendTiles,
    kv_scale: float | None = None,
) -> tirx.PrimFunc:
    """The row-tiled kernel alone, with the slot's signature (tests and the lab); with
    ``kv_scale``, the variant over an FP8 cache (:mod:`~.kv_fp8`'s storage)."""
    _check(num_heads, latent_dim, rope_dim, dtype, tiles.stages, kv_scale is not None)
    dims, name, src, call = _parts(num_heads, latent_dim, rope_dim, tiles, kv_scale)
    text = _header("batch_mla_paged_attention_extend", *dims) + "    " + call
    return tvm.script.from_source(
        text, extra_vars={"T": T, "extend": _extend_launch, "name": name, "src": src}
    )


def mla_extend_cuda(
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str = "float16",
    kv_scale: float | None = None,
) -> tirx.PrimFunc:
    """:func:`build_mla_extend` with the tiles of :data:`~.tiles.TABLE` (``"mla_extend"``)."""
    tiles = tuned("mla_extend")
    return build_mla_extend(num_heads, latent_dim, rope_dim, dtype, tiles, kv_scale)


_ROOT = '    # with T.sblock("root"):'


def with_extend_path(
    split_kv: tirx.PrimFunc,
    num_heads: int,
    latent_dim: int,
    rope_dim: int,
    dtype: str,
    tiles: MLAExtendTiles | None = None,
    kv_scale: float | None = None,
) -> tirx.PrimFunc:
    """The slot function: ``split_kv`` (:func:`~.mla_attention_cuda.mla_attention_cuda` for
    these shapes) when ``total_len < tiles.min_rows * batch_size``, this module's kernel
    otherwise (a host branch). ``split_kv`` comes back unchanged where this kernel does not
    support the shapes or the dtype (its pages are not float16). ``kv_scale``: ``split_kv`` is
    the FP8 cache's (built with that scale), and so is the added kernel.

    The branch is composed in TVMScript: ``split_kv``'s printed body under the ``if``, the same
    buffer declarations as its builder's, so its kernels lower to the same device code."""
    tiles = tiles or tuned("mla_extend")
    if not mla_extend_cuda_supports(num_heads, latent_dim, rope_dim, dtype, kv_scale):
        return split_kv
    dims, name, src, call = _parts(num_heads, latent_dim, rope_dim, tiles, kv_scale)
    text = split_kv.script()
    lines = text.splitlines()
    sig = next((ln for ln in lines if ln.startswith("def ")), "")
    fp16_pages = f'pages: T.Buffer(("max_num_pages", {PAGE}, {dims[2]}), "float16")'
    if _ROOT not in lines or fp16_pages not in sig:
        return split_kv  # (another page dtype or layout: keep the split-KV kernel alone)
    body = lines[lines.index(_ROOT) + 1 :]
    fname = sig[4 : sig.index("(")]
    composed = (
        _header(fname, *dims)
        + f"    if total_len < {tiles.min_rows} * batch_size:\n"
        + "\n".join("    " + ln if ln else ln for ln in body)
        + "\n    else:\n        "
        + call
        + "\n"
    )
    return tvm.script.from_source(
        composed, extra_vars={"T": T, "extend": _extend_launch, "name": name, "src": src}
    )

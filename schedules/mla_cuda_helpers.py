"""CUDA device code of the pipelined split block of :mod:`dsv2_mlc.schedules.mla_attention_cuda`.

:func:`pipe_source`: the whole split block of the tensor-core path, called through
``T.cuda.func_call`` (the source travels with every call site; an ``#ifndef`` guard keeps one
definition). A block walks the pages of its split with ``cp.async`` copies ``stages - 1`` pages
ahead into a ring of shared page buffers, takes K/V fragments by ``ldmatrix`` for
``mma.sync.m16n8k16`` (fp16 -> fp32), and writes the final or partial state. It copies the pages
that no kernel of the step writes before its PDL wait, which it calls itself.
"""

from string import Template

from .cuda_call import L2_PREFETCH, WAIT_THEN_RELEASE, grid_wait_source, l2_prefetch_source

__all__ = [
    "WAIT_RELEASE",
    "pipe_shared_halves",
    "pipe_source",
    "prefetch_source",
    "wait_release_source",
]

P = 16  # page size (tokens)
PS = 24  # P tile row stride (halves): conflict-free ldmatrix rows


def pipe_shared_halves(D: int, stages: int, fp8_latent: int = 0, pages_per_step: int = 1) -> int:
    """Shared memory (halves) of one block of the pipelined path: ``stages`` page buffers of 16
    rows x ``D + 8`` halves, the 8 warps' partial scores (16 heads x ``T`` tokens fp32 each,
    ``T = 16 pages_per_step``), the P tile (16 x ``T + 8`` fp16) and the per-head rescale / max /
    sum (3 x 16 fp32). ``fp8_latent`` (``L``; an FP8 cache): the buffers hold raw rows of ``L / 2
    + R`` halves, and ``pages_per_step`` decoded pages of ``D + 8`` halves a row follow them."""
    T = P * pages_per_step
    if fp8_latent:
        ring = stages * P * (fp8_latent // 2 + D - fp8_latent) + T * (D + 8)
    else:
        ring = stages * P * (D + 8)
    return ring + 8 * 16 * T * 2 + 16 * (T + 8) + 3 * 16 * 2


# The PTX primitives of the pipelined block (tests/test_mla_pipe_emulation.py swaps in CPU
# emulations of exactly these seven functions).
_PIPE_PRIMS = r"""
__device__ __forceinline__ void mlap_mma_${tag}(float* c, const unsigned* a, unsigned b0,
                                               unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mlap_ldsm_${tag}(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void mlap_ldsm_t_${tag}(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void mlap_ldsm_t2_${tag}(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void mlap_cp_${tag}(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mlap_commit_${tag}() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void mlap_wait_${tag}() {
  asm volatile("cp.async.wait_group ${wait};" ::: "memory");
}
"""

# the copy of an old page before the PDL wait (one source line, longer than this file's)
# (the comments of the CUDA below are part of the generated source; they are kept as they were
# when the kernel was measured, so that the source stays byte-identical)
_EARLY_COPY = (
    "    mlap_page_${tag}(kv0 + s0 * ${buf_bytes}, pages + (size_t)ids[s0] * ${page_elems},"
    " valid0 - s0 * 16, tx);"
)

# The end of a split block (the pipelined blocks and mla_wgmma_cuda's): the normalised output
# (mma C layout: heads g, g + 8; columns 2t, 2t + 1 of each of the warp's ${ntw} n-tiles from
# column w * ${wcols}) to out or the workspace, and the lse.
SPLIT_STORE = r"""  const float d0 = d_s[g], d1 = d_s[g + 8];
  const float i0 = d0 > 0.f ? ${one} / d0 : 0.f, i1 = d1 > 0.f ? ${one} / d1 : 0.f;
#pragma unroll
  for (int j = 0; j < ${ntw}; ++j) {
    const int col = w * ${wcols} + j * 8 + t * 2;
    const float* o = acc + 4 * j;
    if (final_) {
      *reinterpret_cast<__half2*>(out + g * ${dl} + col) = __floats2half2_rn(o[0] * i0, o[1] * i0);
      *reinterpret_cast<__half2*>(out + (g + 8) * ${dl} + col) =
          __floats2half2_rn(o[2] * i1, o[3] * i1);
    } else {
      *reinterpret_cast<float2*>(ws_o + g * ${dl} + col) = make_float2(o[0] * i0, o[1] * i0);
      *reinterpret_cast<float2*>(ws_o + (g + 8) * ${dl} + col) =
          make_float2(o[2] * i1, o[3] * i1);
    }
  }
  if (tx < 16) {
    const float v = d_s[tx] > 0.f ? m_s[tx] + log2f(d_s[tx]) : -INFINITY;
    if (final_) ${lse_final} else ws_lse[tx] = v;
  }
}
"""
_PIPE_BODY = r"""
// One page (16 rows of ${prow} halves at src) -> the shared buffer at dst (rows of ${rrow}
// halves), 16-byte cp.async copies; rows >= valid are zero-filled (no global read).
__device__ __forceinline__ void mlap_page_${tag}(unsigned dst, const half* src, int valid,
                                                int tx) {
#pragma unroll
  for (int it = 0; it < ${load_iters}; ++it) {
    const int i = it * 256 + tx;
    if (i < ${page_vecs}) {
      const int r = i / ${dv};
      const int c = i - r * ${dv};
      mlap_cp_${tag}(dst + (r * ${rrow} + c * 8) * 2, src + r * ${prow} + c * 8,
                     r < valid ? 16 : 0);
    }
  }
}${decode_fn}
// One split block (256 threads, 16 heads): pages ids[0, npg) of the row (tokens tok0...),
// n_vis visible keys; q: the 16 heads x ${d} of the row; final_: write out (16 x ${dl},
// head stride ${dl}) and lse (16), else the partial state to ws_o / ws_lse; n_early: only
// with an early build (pipe_source(early=True)).
// Pages [0, n_early) are older than the row's new tokens: their copies are issued
// before the PDL wait, which this function calls (the caller has not waited).
__device__ __forceinline__ void mla_split_pipe_${tag}(
    const half* __restrict__ q, const half* __restrict__ pages, const int* __restrict__ ids,
    int npg, int tok0, int n_vis, float scale, int final_, half* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse, int ws_row,
    half* smem, const half* smem_last, int tx, int n_early) {
  ws_o += (size_t)ws_row * ${dl};  // this block's 16 heads (row ws_row of the workspace)
  ws_lse += ws_row;
  float* s_part = reinterpret_cast<float*>(smem + ${kv_halves});
  half* p_s = reinterpret_cast<half*>(s_part + 2048);
  float* r_s = reinterpret_cast<float*>(p_s + ${p_halves});
  float* m_s = r_s + 16;
  float* d_s = r_s + 32;
  const int w = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const unsigned kv0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int valid0 = n_vis - tok0;  // visible rows from the first page of the split on
  // Prologue: pages 0 .. ${stages} - 2 in flight (one commit group each, empty past npg).
  int s0 = 0;
  for (; s0 < ${stages} - 1 && s0 < n_early && s0 < npg; ++s0) {
${early_copy}
    mlap_commit_${tag}();
  }
  ${wait_release}  // (PDL) what follows reads the new tokens and Q
#pragma unroll
  for (int s = s0; s < ${stages} - 1; ++s) {
    if (s < npg) {
      mlap_page_${tag}(kv0 + s * ${buf_bytes}, pages + (size_t)ids[s] * ${page_elems},
                       valid0 - s * 16, tx);
    }
    mlap_commit_${tag}();
  }
  int nid = ${stages} - 1 < npg ? ids[${stages} - 1] : 0;  // the next page to issue
  // Q -> mma A fragments of this warp's k-steps w, w + 8, ... (registers, whole block).
  unsigned qf[${ksw} * 4];
#pragma unroll
  for (int i = 0; i < ${ksw}; ++i) {
    const int ks = w + 8 * i;
    if (ks < ${ks}) {
      const half* p0 = q + g * ${qs} + ks * 16 + t * 2;
      const half* p1 = p0 + 8 * ${qs};
      qf[4 * i + 0] = *reinterpret_cast<const unsigned*>(p0);
      qf[4 * i + 1] = *reinterpret_cast<const unsigned*>(p1);
      qf[4 * i + 2] = *reinterpret_cast<const unsigned*>(p0 + 8);
      qf[4 * i + 3] = *reinterpret_cast<const unsigned*>(p1 + 8);
    } else {
      qf[4 * i + 0] = 0u; qf[4 * i + 1] = 0u; qf[4 * i + 2] = 0u; qf[4 * i + 3] = 0u;
    }
  }
  float acc[${ntw} * 4];
#pragma unroll
  for (int i = 0; i < ${ntw} * 4; ++i) acc[i] = 0.f;
  float m_run = -INFINITY, d_run = 0.f;  // of head sh, the same in its 16 lanes
  const int sh = tx >> 4, st = tx & 15;
  // ldmatrix row addresses (lane -> matrix lane / 8, row lane % 8), bytes.
  const int lr = lane & 7, lm = lane >> 3;
  // K (x4): tokens 0-7 / 8-15 (lm / 2) x dims +0 / +8 (lm % 2) -> b0, b1 of n-tiles 0, 1.
  const unsigned k_off = (((lm >> 1) * 8 + lr) * ${srow} + (lm & 1) * 8) * 2;
  // V (x4.trans): tokens 0-7 / 8-15 (lm % 2) x columns +0 / +8 (lm / 2) -> b0, b1 of two
  // n-tiles; this warp's columns start at w * ${wcols}.
  const unsigned v_off = (((lm & 1) * 8 + lr) * ${srow} + (lm >> 1) * 8 + w * ${wcols}) * 2;
  // P (x4): heads 0-7 / 8-15 (lm % 2) x tokens +0 / +8 (lm / 2) -> a0..a3.
  const unsigned p_addr = static_cast<unsigned>(__cvta_generic_to_shared(p_s)) +
                          (((lm & 1) * 8 + lr) * ${ps} + (lm >> 1) * 8) * 2;
  for (int i = 0; i < npg; ++i) {
    mlap_wait_${tag}();  // page i has landed (this thread's copies)
    __syncthreads();     // ... everyone's; and buffer (i - 1) % ${stages} is free again
    {
      const int j = i + ${stages} - 1;
      if (j < npg) {
        mlap_page_${tag}(kv0 + (j % ${stages}) * ${buf_bytes},
                         pages + (size_t)nid * ${page_elems}, valid0 - j * 16, tx);
      }
      mlap_commit_${tag}();
      if (j + 1 < npg) nid = ids[j + 1];
    }
${key_tile}
    // Partial scores of this warp's k-steps: S[16 heads, 16 tokens].
    float c[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) c[k] = 0.f;
#pragma unroll
    for (int k = 0; k < ${ksw}; ++k) {
${rope_scale}      const int ks = w + 8 * k;
      if (ks < ${ks}) {
        unsigned b[4];
        mlap_ldsm_${tag}(b, kvb + k_off + ks * 32);
        mlap_mma_${tag}(c, qf + 4 * k, b[0], b[1]);
        mlap_mma_${tag}(c + 4, qf + 4 * k, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float* r0 = s_part + (w * 16 + g) * 16 + nt * 8 + t * 2;
      *reinterpret_cast<float2*>(r0) = make_float2(c[4 * nt], c[4 * nt + 1]);
      *reinterpret_cast<float2*>(r0 + 128) = make_float2(c[4 * nt + 2], c[4 * nt + 3]);
    }
    __syncthreads();
    // Online softmax: thread (head sh, token st), base 2.
    float sv = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) sv += s_part[(k * 16 + sh) * 16 + st];
    sv = st < valid0 - i * 16 ? sv * scale : -INFINITY;
    float mx = sv;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m_run, mx);
    const float p = m_new == -INFINITY ? 0.f : exp2f(sv - m_new);
    const float rs = m_run == -INFINITY ? 0.f : exp2f(m_run - m_new);
    float ps = p;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    d_run = d_run * rs + ps;
    m_run = m_new;
    p_s[sh * ${ps} + st] = __float2half_rn(p);
    if (st == 0) r_s[sh] = rs;
    __syncthreads();
    // O = O * rescale + P @ V over this warp's ${ntw} n-tiles.
    const float r0 = r_s[g], r1 = r_s[g + 8];
    unsigned a[4];
    mlap_ldsm_${tag}(a, p_addr);
#pragma unroll
    for (int j = 0; j + 1 < ${ntw}; j += 2) {
      unsigned b[4];
      mlap_ldsm_t_${tag}(b, kvb + v_off + j * 16);
      float* o = acc + 4 * j;
      o[0] *= r0; o[1] *= r0; o[2] *= r1; o[3] *= r1;
      o[4] *= r0; o[5] *= r0; o[6] *= r1; o[7] *= r1;
      mlap_mma_${tag}(o, a, b[0], b[1]);
      mlap_mma_${tag}(o + 4, a, b[2], b[3]);
    }
    if (${ntw} % 2) {
      unsigned b[2];
      mlap_ldsm_t2_${tag}(b, kvb + v_off + (${ntw} - 1) * 16);
      float* o = acc + 4 * (${ntw} - 1);
      o[0] *= r0; o[1] *= r0; o[2] *= r1; o[3] *= r1;
      mlap_mma_${tag}(o, a, b[0], b[1]);
    }
  }
  // Epilogue (mma C layout: heads g, g + 8; columns 2t, 2t + 1 of each n-tile).
  if (st == 0) {
    m_s[sh] = m_run;
    d_s[sh] = d_run;
  }
  __syncthreads();
"""
_PIPE_BODY += SPLIT_STORE


def pipe_source(
    tag: str,
    D: int,
    DL: int,
    stages: int,
    prims: bool = True,
    kscale: float | None = None,
    pages_per_step: int = 1,
) -> str:
    """CUDA source of ``mla_split_pipe_<tag>`` (module docstring), the split block of the
    tensor-core path for 16 heads, rows of ``D`` (latent + rope) halves, ``DL`` output columns
    (``D % 16 == 0``, ``DL % 64 == 0``) and ``stages`` (>= 2) page buffers; partial outputs in
    a float32 workspace. The function's last argument, ``n_early``, counts the leading pages of
    the split that no kernel of this step writes (every token of them older than the row's new
    tokens); it issues the copies of those among its first ``stages - 1`` pages, then calls the
    PDL wait and releases its dependents (:data:`~.cuda_call.WAIT_THEN_RELEASE`) before it
    issues the others and reads Q: the caller must not have waited. ``prims=False`` leaves out
    the PTX primitives (``mlap_{mma,ldsm,ldsm_t,ldsm_t2,cp,commit,wait}_<tag>``), the PDL
    wait's definition and the include guard, for a CPU emulation.

    ``kscale`` (``256 kv_scale``; ``DL % 128 == 0``, rope ``% 16 == 0``): the block over an FP8
    cache (:mod:`~.kv_fp8`'s storage). ``q`` is head ``h``'s values at ``2h`` pseudo-heads of
    ``DL / 2 + R`` (a head stride of ``DL + 2R`` halves), ``lse`` two per head; the ring holds
    raw rows (``DL`` e4m3 bytes, then the rope halves), each page decoded into one float16 page
    (:func:`_decode_source`) after its barrier, then one more barrier; each warp's latent
    k-steps (``k < DL / 128``) are multiplied by ``kscale`` before its rope k-step adds, and the
    output (or the partial one) by ``kscale``.

    ``pages_per_step`` (``G``, 1 to 4; ``stages`` a multiple of ``G``, at least ``2 G``): the
    block takes ``G`` pages a step (:data:`_GROUP_BODY`): the ring is ``stages / G`` slots of
    ``G`` page buffers, one commit group a slot, ``stages / G - 1`` slots in flight; a step is
    one wait and barrier, QK^T over ``16 G`` tokens (``2 G`` n-tiles a warp), one reduction of
    the partial scores, the softmax (``G`` tokens a thread), one barrier and PV with ``G``
    k-steps (FP8: ``G`` pages decoded, one barrier). A split's last group may hold fewer pages:
    the others are zero-filled (no global read) and their tokens masked. The pages copied
    before the PDL wait are those of ``n_early`` among the first ``stages - G``. ``G = 1`` is
    the one-page block above."""
    if not 1 <= pages_per_step <= 4 or stages % pages_per_step or stages < 2 * pages_per_step:
        raise ValueError(
            f"pages_per_step {pages_per_step} with {stages} stages: pages_per_step must be 1 "
            "to 4 and stages a multiple of it, at least twice it"
        )
    if pages_per_step > 1:
        return _group_source(tag, D, DL, stages, prims, kscale, pages_per_step)
    srow = D + 8
    ks = D // 16
    fp8 = kscale is not None
    prow = DL // 2 + D - DL if fp8 else D  # halves a page row in global memory
    rrow = prow if fp8 else srow  # ... and in a ring buffer
    dv = prow // 8
    buf_bytes = P * rrow * 2
    if fp8:
        dec = stages * P * rrow  # halves: the decoded page after the ring
        decode_fn = "\n" + _decode_source(tag, D, DL, prow).rstrip("\n")
        key_tile = f"""    // page i decoded (free: every warp is past the barrier above)
    mlap_decode_{tag}(smem + {dec}, smem + (i % {stages}) * {P * rrow}, tx);
    __syncthreads();
    const unsigned kvb = kv0 + {dec * 2};"""
        rope_scale = f"""      if (k == {DL // 128}) {{  // the latent k-steps' sums times s
#pragma unroll
        for (int e = 0; e < 8; ++e) c[e] *= {kscale!r}f;
      }}
"""
        one, lse_final = f"{kscale!r}f", "{ lse[2 * tx] = v; lse[2 * tx + 1] = v; }"
        kv_halves = dec + P * srow
    else:
        decode_fn, rope_scale, one, lse_final = "", "", "1.f", "lse[tx] = v;"
        key_tile = "    const unsigned kvb = kv0 + (i % ${stages}) * ${buf_bytes};"
        kv_halves = stages * P * srow
    body = _PIPE_BODY.replace("${early_copy}", _EARLY_COPY).replace("${key_tile}", key_tile)
    body = _PIPE_PRIMS + body if prims else body
    if prims:
        body = f"\n#ifndef MLA_SPLIT_PIPE_{tag}\n#define MLA_SPLIT_PIPE_{tag}{body}#endif\n"
    prefix = grid_wait_source() if prims else ""
    return prefix + Template(body).substitute(
        tag=tag,
        wait_release=WAIT_THEN_RELEASE,
        d=D,
        dl=DL,
        srow=srow,
        prow=prow,
        rrow=rrow,
        qs=2 * prow if fp8 else D,
        decode_fn=decode_fn,
        rope_scale=rope_scale,
        one=one,
        lse_final=lse_final,
        dv=dv,
        ps=PS,
        stages=stages,
        wait=stages - 2,
        ks=ks,
        ksw=(ks + 7) // 8,
        ntw=DL // 64,
        wcols=DL // 8,
        load_iters=(P * dv + 255) // 256,
        page_vecs=P * dv,
        page_elems=P * prow,
        buf_bytes=buf_bytes,
        kv_halves=kv_halves,
        p_halves=16 * PS,
    )


def _decode_source(tag: str, D: int, DL: int, prow: int) -> str:
    """CUDA of ``mlap_decode_<tag>(dec, raw, tx)``: a ring buffer's 16 raw rows (``prow``
    halves: ``DL`` e4m3 bytes, then the rope halves) -> one decoded page (rows of ``D + 8``
    halves). A byte ``b`` becomes the half ``(b & 0x80) << 8 | (b & 0x7f) << 7`` =
    ``value(b) / 256`` (:func:`~.kv_fp8.e4m3_byte_f16`), two bytes a 32-bit word, 8 bytes (one
    16-byte store) a thread and step; then the rope halves, 16 bytes a thread."""
    R = D - DL
    return f"""__device__ __forceinline__ unsigned mlap_e4m3x2_{tag}(unsigned w) {{
  const unsigned u = ((w & 0xffu) << 8) | ((w & 0xff00u) << 16);  // bytes 0, 1 -> bits 8, 24
  return (u & 0x80008000u) | ((u & 0x7f007f00u) >> 1);
}}
__device__ __forceinline__ void mlap_decode_{tag}(half* __restrict__ dec,
                                                  const half* __restrict__ raw, int tx) {{
  for (int i = tx; i < {P * DL // 8}; i += 256) {{
    const int r = i / {DL // 8}, c = i - r * {DL // 8};
    const uint2 w = *reinterpret_cast<const uint2*>(raw + r * {prow} + c * 4);
    uint4 h;
    h.x = mlap_e4m3x2_{tag}(w.x);
    h.y = mlap_e4m3x2_{tag}(w.x >> 16);
    h.z = mlap_e4m3x2_{tag}(w.y);
    h.w = mlap_e4m3x2_{tag}(w.y >> 16);
    *reinterpret_cast<uint4*>(dec + r * {D + 8} + c * 8) = h;
  }}
  for (int i = tx; i < {P * R // 8}; i += 256) {{
    const int r = i / {R // 8}, c = i - r * {R // 8};
    *reinterpret_cast<uint4*>(dec + r * {D + 8} + {DL} + c * 8) =
        *reinterpret_cast<const uint4*>(raw + r * {prow} + {DL // 2} + c * 8);
  }}
}}
"""


# The block of pipe_source(pages_per_step=G > 1): the ring's G-page slots, G pages a step.
_GROUP_BODY = r"""
// One page (16 rows of ${prow} halves at src) -> the shared buffer at dst (rows of ${rrow}
// halves), 16-byte cp.async copies; rows >= valid are zero-filled (no global read).
__device__ __forceinline__ void mlap_page_${tag}(unsigned dst, const half* src, int valid,
                                                int tx) {
#pragma unroll
  for (int it = 0; it < ${load_iters}; ++it) {
    const int i = it * 256 + tx;
    if (i < ${page_vecs}) {
      const int r = i / ${dv};
      const int c = i - r * ${dv};
      mlap_cp_${tag}(dst + (r * ${rrow} + c * 8) * 2, src + r * ${prow} + c * 8,
                     r < valid ? 16 : 0);
    }
  }
}${decode_fn}
// One split block (256 threads, 16 heads) that takes the pages ids[0, npg) of the row (tokens
// tok0...; n_vis visible keys) ${g} at a time: a group is one ring slot of ${g} page buffers
// (${slots} slots), one commit group, ${t} tokens of one QK^T, softmax and PV step. The pages of
// the last group past npg are zero-filled without a global read and their tokens masked.
// q: the 16 heads x ${d} of the row; final_: write out (16 x ${dl}, head stride ${dl}) and lse
// (16), else the partial state to ws_o / ws_lse. Pages [0, n_early) are older than the row's
// new tokens: those among the first ${pre} are copied before the PDL wait, which this function
// calls (the caller has not waited).
__device__ __forceinline__ void mla_split_pipe_${tag}(
    const half* __restrict__ q, const half* __restrict__ pages, const int* __restrict__ ids,
    int npg, int tok0, int n_vis, float scale, int final_, half* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse, int ws_row,
    half* smem, const half* smem_last, int tx, int n_early) {
  ws_o += (size_t)ws_row * ${dl};  // this block's 16 heads (row ws_row of the workspace)
  ws_lse += ws_row;
  float* s_part = reinterpret_cast<float*>(smem + ${kv_halves});
  half* p_s = reinterpret_cast<half*>(s_part + ${spart});
  float* r_s = reinterpret_cast<float*>(p_s + ${p_halves});
  float* m_s = r_s + 16;
  float* d_s = r_s + 32;
  const int w = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const unsigned kv0 = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int nval = min(n_vis - tok0, npg * 16);  // the split's visible rows
  const int ngr = (npg + ${g} - 1) / ${g};        // its groups
  // Prologue: groups 0 .. ${slots} - 2 (pages 0 .. ${pre} - 1) in flight, one commit group
  // each (empty past the last group); the last group's pages past npg zero-filled.
  int s0 = 0;
  for (; s0 < ${pre} && s0 < n_early && s0 < npg; ++s0) {
    mlap_page_${tag}(kv0 + s0 * ${buf_bytes}, pages + (size_t)ids[s0] * ${page_elems},
                     nval - s0 * 16, tx);
    if (s0 % ${g} == ${g} - 1) mlap_commit_${tag}();
  }
  ${wait_release}  // (PDL) what follows reads the new tokens and Q
  for (int s = s0; s < ${pre}; ++s) {
    if (s < ngr * ${g}) {
      const int id = s < npg ? ids[s] : 0;
      mlap_page_${tag}(kv0 + s * ${buf_bytes}, pages + (size_t)id * ${page_elems},
                       nval - s * 16, tx);
    }
    if (s % ${g} == ${g} - 1) mlap_commit_${tag}();
  }
  int nid[${g}];  // the pages of the next group to issue (group ${slots} - 1)
#pragma unroll
  for (int u = 0; u < ${g}; ++u) nid[u] = ${pre} + u < npg ? ids[${pre} + u] : 0;
  // Q -> mma A fragments of this warp's k-steps w, w + 8, ... (registers, whole block).
  unsigned qf[${ksw} * 4];
#pragma unroll
  for (int i = 0; i < ${ksw}; ++i) {
    const int ks = w + 8 * i;
    if (ks < ${ks}) {
      const half* p0 = q + g * ${qs} + ks * 16 + t * 2;
      const half* p1 = p0 + 8 * ${qs};
      qf[4 * i + 0] = *reinterpret_cast<const unsigned*>(p0);
      qf[4 * i + 1] = *reinterpret_cast<const unsigned*>(p1);
      qf[4 * i + 2] = *reinterpret_cast<const unsigned*>(p0 + 8);
      qf[4 * i + 3] = *reinterpret_cast<const unsigned*>(p1 + 8);
    } else {
      qf[4 * i + 0] = 0u; qf[4 * i + 1] = 0u; qf[4 * i + 2] = 0u; qf[4 * i + 3] = 0u;
    }
  }
  float acc[${ntw} * 4];
#pragma unroll
  for (int i = 0; i < ${ntw} * 4; ++i) acc[i] = 0.f;
  float m_run = -INFINITY, d_run = 0.f;  // of head sh, the same in its 16 lanes
  const int sh = tx >> 4, st = tx & 15;
  // ldmatrix row addresses (lane -> matrix lane / 8, row lane % 8), bytes; a group's pages are
  // consecutive tiles of 16 rows (${tile_bytes} bytes each).
  const int lr = lane & 7, lm = lane >> 3;
  // K (x4): tokens 0-7 / 8-15 (lm / 2) x dims +0 / +8 (lm % 2) -> b0, b1 of n-tiles 0, 1.
  const unsigned k_off = (((lm >> 1) * 8 + lr) * ${srow} + (lm & 1) * 8) * 2;
  // V (x4.trans): tokens 0-7 / 8-15 (lm % 2) x columns +0 / +8 (lm / 2) -> b0, b1 of two
  // n-tiles; this warp's columns start at w * ${wcols}.
  const unsigned v_off = (((lm & 1) * 8 + lr) * ${srow} + (lm >> 1) * 8 + w * ${wcols}) * 2;
  // P (x4): heads 0-7 / 8-15 (lm % 2) x tokens +0 / +8 (lm / 2) -> a0..a3 of k-step 0.
  const unsigned p_addr = static_cast<unsigned>(__cvta_generic_to_shared(p_s)) +
                          (((lm & 1) * 8 + lr) * ${ps} + (lm >> 1) * 8) * 2;
  for (int i = 0; i < ngr; ++i) {
    mlap_wait_${tag}();  // group i has landed (this thread's copies)
    __syncthreads();     // ... everyone's; and slot (i - 1) % ${slots} is free again
    {
      const int j = (i + ${slots} - 1) * ${g};  // the first page of group i + ${slots} - 1
      if (j < npg) {  // (the group's pages past npg: zero-filled)
        const unsigned dst = kv0 + ((i + ${slots} - 1) % ${slots}) * ${slot_bytes};
#pragma unroll
        for (int u = 0; u < ${g}; ++u) {
          mlap_page_${tag}(dst + u * ${buf_bytes}, pages + (size_t)nid[u] * ${page_elems},
                           nval - (j + u) * 16, tx);
        }
      }
      mlap_commit_${tag}();
#pragma unroll
      for (int u = 0; u < ${g}; ++u) nid[u] = j + ${g} + u < npg ? ids[j + ${g} + u] : 0;
    }
${key_tile}
    // Partial scores of this warp's k-steps: S[16 heads, ${t} tokens] (${nt} n-tiles).
    float c[${nt} * 4];
#pragma unroll
    for (int k = 0; k < ${nt} * 4; ++k) c[k] = 0.f;
#pragma unroll
    for (int k = 0; k < ${ksw}; ++k) {
${rope_scale}      const int ks = w + 8 * k;
      if (ks < ${ks}) {
#pragma unroll
        for (int u = 0; u < ${g}; ++u) {
          unsigned b[4];
          mlap_ldsm_${tag}(b, kvb + u * ${tile_bytes} + k_off + ks * 32);
          mlap_mma_${tag}(c + 8 * u, qf + 4 * k, b[0], b[1]);
          mlap_mma_${tag}(c + 8 * u + 4, qf + 4 * k, b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < ${nt}; ++nt) {
      float* r0 = s_part + (w * 16 + g) * ${t} + nt * 8 + t * 2;
      *reinterpret_cast<float2*>(r0) = make_float2(c[4 * nt], c[4 * nt + 1]);
      *reinterpret_cast<float2*>(r0 + 8 * ${t}) = make_float2(c[4 * nt + 2], c[4 * nt + 3]);
    }
    __syncthreads();
    // Online softmax: thread (head sh, tokens st + 16 u), base 2.
    float sv[${g}];
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < ${g}; ++u) {
      const int tk = u * 16 + st;
      float v = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) v += s_part[(k * 16 + sh) * ${t} + tk];
      sv[u] = i * ${t} + tk < nval ? v * scale : -INFINITY;
      mx = fmaxf(mx, sv[u]);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m_run, mx);
    const float rs = m_run == -INFINITY ? 0.f : exp2f(m_run - m_new);
    float ps = 0.f;
#pragma unroll
    for (int u = 0; u < ${g}; ++u) {
      const float p = m_new == -INFINITY ? 0.f : exp2f(sv[u] - m_new);
      ps += p;
      p_s[sh * ${ps} + u * 16 + st] = __float2half_rn(p);
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    d_run = d_run * rs + ps;
    m_run = m_new;
    if (st == 0) r_s[sh] = rs;
    __syncthreads();
    // O = O * rescale + P @ V over this warp's ${ntw} n-tiles, ${g} k-steps of 16 tokens.
    const float r0 = r_s[g], r1 = r_s[g + 8];
#pragma unroll
    for (int j = 0; j < ${ntw}; ++j) {
      float* o = acc + 4 * j;
      o[0] *= r0; o[1] *= r0; o[2] *= r1; o[3] *= r1;
    }
#pragma unroll
    for (int u = 0; u < ${g}; ++u) {
      unsigned a[4];
      mlap_ldsm_${tag}(a, p_addr + u * 32);
      const unsigned vb = kvb + u * ${tile_bytes} + v_off;
#pragma unroll
      for (int j = 0; j + 1 < ${ntw}; j += 2) {
        unsigned b[4];
        mlap_ldsm_t_${tag}(b, vb + j * 16);
        mlap_mma_${tag}(acc + 4 * j, a, b[0], b[1]);
        mlap_mma_${tag}(acc + 4 * j + 4, a, b[2], b[3]);
      }
      if (${ntw} % 2) {
        unsigned b[2];
        mlap_ldsm_t2_${tag}(b, vb + (${ntw} - 1) * 16);
        mlap_mma_${tag}(acc + 4 * (${ntw} - 1), a, b[0], b[1]);
      }
    }
  }
  // Epilogue (mma C layout: heads g, g + 8; columns 2t, 2t + 1 of each n-tile).
  if (st == 0) {
    m_s[sh] = m_run;
    d_s[sh] = d_run;
  }
  __syncthreads();
"""
_GROUP_BODY += SPLIT_STORE


def _group_source(
    tag: str, D: int, DL: int, stages: int, prims: bool, kscale: float | None, G: int
) -> str:
    """:func:`pipe_source` for ``pages_per_step = G > 1`` (:data:`_GROUP_BODY`)."""
    srow = D + 8
    ks = D // 16
    T = P * G  # tokens a step
    slots = stages // G
    fp8 = kscale is not None
    prow = DL // 2 + D - DL if fp8 else D  # halves a page row in global memory
    rrow = prow if fp8 else srow  # ... and in a ring buffer
    dv = prow // 8
    buf_bytes = P * rrow * 2
    tile_bytes = P * srow * 2  # a page of the tile the MMAs read (ring or decoded)
    if fp8:
        dec = stages * P * rrow  # halves: the G decoded pages after the ring
        decode_fn = "\n" + _decode_source(tag, D, DL, prow).rstrip("\n")
        key_tile = f"""    // group i decoded (free: every warp is past the barrier above)
#pragma unroll
    for (int u = 0; u < {G}; ++u) {{
      mlap_decode_{tag}(smem + {dec} + u * {P * srow},
                        smem + ((i % {slots}) * {G} + u) * {P * rrow}, tx);
    }}
    __syncthreads();
    const unsigned kvb = kv0 + {dec * 2};"""
        rope_scale = f"""      if (k == {DL // 128}) {{  // the latent k-steps' sums times s
#pragma unroll
        for (int e = 0; e < {8 * G}; ++e) c[e] *= {kscale!r}f;
      }}
"""
        one, lse_final = f"{kscale!r}f", "{ lse[2 * tx] = v; lse[2 * tx + 1] = v; }"
        kv_halves = dec + T * srow
    else:
        decode_fn, rope_scale, one, lse_final = "", "", "1.f", "lse[tx] = v;"
        key_tile = f"    const unsigned kvb = kv0 + (i % {slots}) * {G * buf_bytes};"
        kv_halves = stages * P * srow
    body = _GROUP_BODY.replace("${key_tile}", key_tile)
    body = _PIPE_PRIMS + body if prims else body
    if prims:
        body = f"\n#ifndef MLA_SPLIT_PIPE_{tag}\n#define MLA_SPLIT_PIPE_{tag}{body}#endif\n"
    prefix = grid_wait_source() if prims else ""
    return prefix + Template(body).substitute(
        tag=tag,
        wait_release=WAIT_THEN_RELEASE,
        d=D,
        dl=DL,
        srow=srow,
        prow=prow,
        rrow=rrow,
        qs=2 * prow if fp8 else D,
        decode_fn=decode_fn,
        rope_scale=rope_scale,
        one=one,
        lse_final=lse_final,
        dv=dv,
        ps=T + 8,
        g=G,
        t=T,
        nt=2 * G,
        slots=slots,
        pre=stages - G,
        wait=slots - 2,
        ks=ks,
        ksw=(ks + 7) // 8,
        ntw=DL // 64,
        wcols=DL // 8,
        load_iters=(P * dv + 255) // 256,
        page_vecs=P * dv,
        page_elems=P * prow,
        buf_bytes=buf_bytes,
        slot_bytes=G * buf_bytes,
        tile_bytes=tile_bytes,
        kv_halves=kv_halves,
        spart=8 * 16 * T,
        p_halves=16 * (T + 8),
    )


def prefetch_source(tag: str, page_bytes: int, threads: int) -> tuple[str, str]:
    """(name, CUDA) of ``mla_prefetch_<tag>(pages, page_ids, first, count, tid)``: the block's
    threads ask L2 for pages ``page_ids[first:first + count]`` (``cp.async.bulk.prefetch``, one
    page of ``page_bytes`` each). Safe before the PDL wait: a prefetch reads nothing into the
    block, and the rows the previous kernel appends are read after the wait."""
    name = f"mla_prefetch_{tag}"
    # (the blank line before the closing brace keeps the generated source as it was)
    return name, (
        grid_wait_source()
        + l2_prefetch_source()
        + f"""
#ifndef {name.upper()}
#define {name.upper()}
__device__ __forceinline__ void {name}(const half* pages, const int* page_ids,
    int first, int count, int tid) {{
  for (int i = tid; i < count; i += {threads})
    {L2_PREFETCH}(reinterpret_cast<const char*>(pages) + (long long)page_ids[first + i] *
                  {page_bytes}, {page_bytes});
"""
        + "  \n"
        + """}
#endif
"""
    )


WAIT_RELEASE = "mla_wait_release"


def wait_release_source() -> str:
    """CUDA: ``mla_wait_release()``, the PDL wait, then the release of the dependents."""
    return (
        grid_wait_source()
        + f"""
#ifndef MLA_WAIT_RELEASE
#define MLA_WAIT_RELEASE
__device__ __forceinline__ void {WAIT_RELEASE}() {{
  {WAIT_THEN_RELEASE}
}}
#endif
"""
    )

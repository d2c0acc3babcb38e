"""Lab: a *streams* split block for :mod:`dsv2_mlc.schedules.mla_attention_cuda` (not shipped).

Measured against the shipped pipelined block in ``schedules/results/mla_attention.md`` ("The
streams block"): about 10 % faster with the float16 cache at batch 1 past 32K context, slower
with the FP8 cache and at short contexts, so the product keeps the pipelined block. The product
never imports this module; :func:`build_streams_variant` builds the split kernel with this
block for the kernel lab (``kernel_lab_mla.py --kv fp8``).

The pipelined block (:mod:`~.mla_cuda_helpers`) walks a split's pages one at a time with all 8
warps: each warp computes the scores over a share of the 576 dims, the shares meet in shared
memory, one set of threads does the softmax, and every warp multiplies the probabilities into
its 64 output columns, three block barriers a page. At batch 1 and long contexts that block is
bound by the latency of this chain, not by the bytes it reads: ~2.2 us a 16-token page a block
whatever the cache dtype, 1.2 TB/s with the FP8 cache and 2.1 with float16
(schedules/results/mla_attention.md, "The FP8 cache's split kernel at batch 1").

This block runs ``8 / W`` independent *streams* of ``W`` warps (``W`` = ``stream_warps``, 2 or
4). Stream ``s`` takes the split's pages ``s, s + S, s + 2S, ...`` (``S`` streams) with its own
``cp.async`` ring, its own online softmax and its own output accumulators; its ``W`` warps meet
only at a named barrier of ``32 W`` threads (``bar.sync``), twice a page: once when the page
has landed (and the ring slot read a page earlier is free), once to exchange their partial
scores. A warp computes the scores over ``ceil(36 / W)`` k-steps (two or three independent
``mma.sync`` chains), adds the stream's ``W`` partial score tiles in a fixed order (so every
warp holds the same scores), does the softmax itself in the MMA's accumulator layout (rows ``g``
and ``g + 8``, the row's four lanes reduced by shuffles) and turns the probabilities into the A
operand of P V in registers (no shared-memory P tile), over ``512 / W`` output columns. Q waits
in shared memory (``ldmatrix`` a k-step). At the end the streams' states merge through shared
memory (the ring's space): the block's max per head, each stream's output scaled by
``2^(m_s - m)``, summed, divided by the block's sum.

An FP8 cache (``kscale``, :mod:`~.kv_fp8`'s storage): each stream decodes its page into a float16
page of its own after the page has landed (one more stream barrier), the latent k-steps' sums
are multiplied by ``kscale`` before the rope k-steps add, and the output by ``kscale``.

The function's signature is the pipelined block's (``mla_split_pipe_<tag>``), so the split
kernel calls either. Pages among each stream's first ``stages - 1`` that are older than the
row's new tokens (``n_early``) are copied before the PDL wait, which the function calls.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from string import Template

from dsv2_mlc.schedules.cuda_call import WAIT_THEN_RELEASE, grid_wait_source
from dsv2_mlc.schedules.mla_cuda_helpers import _PIPE_PRIMS, P

__all__ = ["STREAM_WARPS", "build_streams_variant", "streams_shared_halves", "streams_source"]

THREADS = 256
STREAM_WARPS = (2, 4)  # warps a stream: 4 or 2 streams a block


def _check(D: int, DL: int, stages: int, warps: int, fp8: bool) -> None:
    if warps not in STREAM_WARPS:
        raise ValueError(f"stream_warps {warps}: one of {STREAM_WARPS}")
    if stages < 2:
        raise ValueError(f"stages {stages}: at least 2")
    if D % 16 or DL % (16 * warps) or (DL // warps // 8) % 2:
        raise ValueError(f"rows of {D} ({DL} latent) do not split into whole tiles of {warps}")
    if fp8 and (DL % 128 or (D - DL) % 16):
        raise ValueError(f"an FP8 cache's rows of {DL} latent + {D - DL} rope are not whole tiles")


def _layout(D: int, DL: int, stages: int, warps: int, fp8: bool) -> dict[str, int]:
    """Offsets and sizes (halves) of the block's shared memory: Q (16 rows of ``D + 8``), the
    streams' rings, (FP8) their decoded pages, the merge area over those, the partial-score
    exchange and the streams' (max, sum) per head."""
    streams = 8 // warps
    srow = D + 8
    prow = DL // 2 + D - DL if fp8 else D
    rrow = prow if fp8 else srow
    qh = 16 * srow
    ring = streams * stages * P * rrow
    dec = streams * P * srow if fp8 else 0
    merge = streams * 16 * DL * 2  # float32 partial outputs
    area = max(ring + dec, merge)
    xs = streams * warps * 32 * 8 * 2  # float32: 8 scores a lane
    md = streams * 2 * 16 * 2  # float32
    return dict(
        streams=streams, srow=srow, prow=prow, rrow=rrow, qh=qh, ring=ring, dec_off=qh + ring,
        xs_off=qh + area, md_off=qh + area + xs, total=qh + area + xs + md,
    )  # fmt: skip


def streams_shared_halves(D: int, DL: int, stages: int, warps: int, fp8: bool = False) -> int:
    """Shared memory (halves) of one streams block (module docstring)."""
    _check(D, DL, stages, warps, fp8)
    return _layout(D, DL, stages, warps, fp8)["total"]


# the pipelined block's PTX primitives (mma, ldmatrix, cp.async) and a stream's named barrier
_PRIMS = (
    _PIPE_PRIMS
    + r"""__device__ __forceinline__ void mlap_bar_${tag}(int id) {
  asm volatile("bar.sync %0, ${gthreads};" :: "r"(id) : "memory");
}
"""
)

_DECODE = r"""
__device__ __forceinline__ unsigned mlas_e4m3x2_${tag}(unsigned w) {
  const unsigned u = ((w & 0xffu) << 8) | ((w & 0xff00u) << 16);  // bytes 0, 1 -> bits 8, 24
  return (u & 0x80008000u) | ((u & 0x7f007f00u) >> 1);
}
// A stream's raw page (16 rows of ${prow} halves: ${dl} e4m3 bytes, then the rope halves) ->
// its decoded page (rows of ${srow} halves); a byte b becomes value(b) / 256 as a half.
__device__ __forceinline__ void mlas_decode_${tag}(half* __restrict__ dec,
                                                  const half* __restrict__ raw, int lt) {
  for (int i = lt; i < ${dec_vecs}; i += ${gthreads}) {
    const int r = i / ${dlv}, c = i - r * ${dlv};
    const uint2 w = *reinterpret_cast<const uint2*>(raw + r * ${prow} + c * 4);
    uint4 h;
    h.x = mlas_e4m3x2_${tag}(w.x);
    h.y = mlas_e4m3x2_${tag}(w.x >> 16);
    h.z = mlas_e4m3x2_${tag}(w.y);
    h.w = mlas_e4m3x2_${tag}(w.y >> 16);
    *reinterpret_cast<uint4*>(dec + r * ${srow} + c * 8) = h;
  }
  for (int i = lt; i < ${rope_vecs}; i += ${gthreads}) {
    const int r = i / ${rv}, c = i - r * ${rv};
    *reinterpret_cast<uint4*>(dec + r * ${srow} + ${dl} + c * 8) =
        *reinterpret_cast<const uint4*>(raw + r * ${prow} + ${dl} / 2 + c * 8);
  }
}
"""

_BODY = r"""
// One page (16 rows of ${prow} halves at src) -> a ring slot at dst (rows of ${rrow} halves) by
// the ${gthreads} threads of a stream (lt: the thread's index in it); rows >= valid are
// zero-filled without a global read. Vector i = it * ${gthreads} + lt of the page is row
// i / ${dv}, column i % ${dv}: stepped, not divided, so that a page costs few instructions.
__device__ __forceinline__ void mlas_page_${tag}(unsigned dst, const half* src, int valid,
                                                int lt) {
  int r = lt / ${dv}, c = lt - r * ${dv};
#pragma unroll
  for (int it = 0; it < ${load_iters}; ++it) {
    if (it * ${gthreads} + lt < ${page_vecs}) {
      mlap_cp_${tag}(dst + (r * ${rrow} + c * 8) * 2, src + r * ${prow} + c * 8,
                     r < valid ? 16 : 0);
    }
    r += ${step_r};
    c += ${step_c};
    if (c >= ${dv}) {
      c -= ${dv};
      ++r;
    }
  }
}
__device__ __forceinline__ unsigned mlas_pack_${tag}(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
// One split block (256 threads, 16 heads, ${streams} streams of ${warps} warps): the arguments
// of mla_split_pipe (mla_cuda_helpers.py). Stream s takes pages s, s + ${streams}, ... of
// ids[0, npg) (tokens tok0... of the row; n_vis visible keys).
__device__ __forceinline__ void mla_split_streams_${tag}(
    const half* __restrict__ q, const half* __restrict__ pages, const int* __restrict__ ids,
    int npg, int tok0, int n_vis, float scale, int final_, half* __restrict__ out,
    float* __restrict__ lse, float* __restrict__ ws_o, float* __restrict__ ws_lse, int ws_row,
    half* smem, const half* smem_last, int tx, int n_early) {
  ws_o += (size_t)ws_row * ${dl};
  ws_lse += ws_row;
  const int w = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int s = w / ${warps}, hw = w - s * ${warps}, lt = tx - s * ${gthreads};
  float* xs = reinterpret_cast<float*>(smem + ${xs_off});
  float* md = reinterpret_cast<float*>(smem + ${md_off});
  const unsigned sbase = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned ring0 = sbase + (${qh} + s * ${stages} * ${slot_halves}) * 2;
  const int valid0 = n_vis - tok0;  // visible rows from the split's first page on
  const int nps = npg > s ? (npg - s + ${streams} - 1) / ${streams} : 0;
  // Prologue: this stream's pages 0 .. ${stages} - 2 in flight, the old ones before the wait.
  int j0 = 0;
  for (; j0 < ${stages} - 1 && j0 < nps && s + ${streams} * j0 < n_early; ++j0) {
    const int p = s + ${streams} * j0;
    mlas_page_${tag}(ring0 + j0 * ${slot_bytes}, pages + (size_t)ids[p] * ${page_elems},
                     valid0 - p * 16, lt);
    mlap_commit_${tag}();
  }
  ${wait_release}  // (PDL) what follows reads the new tokens and Q
  for (int j = j0; j < ${stages} - 1; ++j) {
    if (j < nps) {
      const int p = s + ${streams} * j;
      mlas_page_${tag}(ring0 + j * ${slot_bytes}, pages + (size_t)ids[p] * ${page_elems},
                       valid0 - p * 16, lt);
    }
    mlap_commit_${tag}();
  }
  // Q (16 heads x ${d}) -> shared rows of ${srow} halves.
  for (int i = tx; i < 16 * ${dqv}; i += 256) {
    const int h = i / ${dqv}, c = i - h * ${dqv};
    *reinterpret_cast<uint4*>(smem + h * ${srow} + c * 8) =
        *reinterpret_cast<const uint4*>(q + h * ${qs} + c * 8);
  }
  __syncthreads();
  const int lr = lane & 7, lm = lane >> 3;
  // Q (A, x4): heads 0-7 / 8-15 (lm % 2) x dims +0 / +8 (lm / 2) -> a0..a3 of a k-step.
  const unsigned q_addr = sbase + (((lm & 1) * 8 + lr) * ${srow} + (lm >> 1) * 8) * 2;
  // K (B, x4): tokens 0-7 / 8-15 (lm / 2) x dims +0 / +8 (lm % 2) -> b0, b1 of n-tiles 0, 1.
  const unsigned k_off = (((lm >> 1) * 8 + lr) * ${srow} + (lm & 1) * 8) * 2;
  // V (B, x4.trans): tokens 0-7 / 8-15 (lm % 2) x columns +0 / +8 (lm / 2) -> two n-tiles;
  // this warp's columns start at hw * ${wcols}.
  const unsigned v_off = (((lm & 1) * 8 + lr) * ${srow} + (lm >> 1) * 8 + hw * ${wcols}) * 2;
  const int k_lo = hw * ${ksw};  // this warp's k-steps [k_lo, k_lo + ${ksw}) of ${ks}
${dec_ptr}
  float acc[${ntw} * 4];
#pragma unroll
  for (int i = 0; i < ${ntw} * 4; ++i) acc[i] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, d0 = 0.f, d1 = 0.f;  // heads g, g + 8
  for (int j = 0; j < nps; ++j) {
    const int p = s + ${streams} * j;
    mlap_wait_${tag}();        // page j has landed (this thread's copies)
    mlap_bar_${tag}(1 + s);    // ... the stream's; and the slot of page j - 1 is free again
    {
      const int jn = j + ${stages} - 1;
      if (jn < nps) {
        const int pn = s + ${streams} * jn;
        mlas_page_${tag}(ring0 + (jn % ${stages}) * ${slot_bytes},
                         pages + (size_t)ids[pn] * ${page_elems}, valid0 - pn * 16, lt);
      }
      mlap_commit_${tag}();
    }
${key_tile}
    // Partial scores over this warp's k-steps: S[16 heads, 16 tokens], independent chains.
    float c0[8], c1[8], c2[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { c0[e] = 0.f; c1[e] = 0.f; c2[e] = 0.f; }
#pragma unroll
    for (int k = 0; k < ${ksw}; ++k) {
      const int ks = k_lo + k;
      if (${whole_ks} || ks < ${ks}) {
        unsigned a[4], b[4];
        mlap_ldsm_${tag}(a, q_addr + ks * 32);
        mlap_ldsm_${tag}(b, kvb + k_off + ks * 32);
${mma_block}
      }
    }
    {
      float* xw = xs + ((s * ${warps} + hw) * 32 + lane) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) xw[e] = ${combine};
    }
    mlap_bar_${tag}(1 + s);  // the stream's partial scores are in
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = 0.f;
#pragma unroll
    for (int o = 0; o < ${warps}; ++o) {  // one order in every warp: the same sums
      const float* xo = xs + ((s * ${warps} + o) * 32 + lane) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] += xo[e];
    }
    // Online softmax in the accumulator layout: x[0, 1] head g, tokens 2t, 2t + 1; x[2, 3]
    // head g + 8, the same tokens; x[4..7] likewise for tokens 8 + 2t, 9 + 2t. Base 2.
    const int lim = valid0 - p * 16;  // this page's visible tokens
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int tok = 2 * t + (e & 1) + 8 * (e >> 2);
      x[e] = tok < lim ? x[e] * scale : -INFINITY;
    }
    float mx0 = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[4], x[5]));
    float mx1 = fmaxf(fmaxf(x[2], x[3]), fmaxf(x[6], x[7]));
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float r0 = m0 == -INFINITY ? 0.f : exp2f(m0 - n0);
    const float r1 = m1 == -INFINITY ? 0.f : exp2f(m1 - n1);
    float pr[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float n = (e & 2) ? n1 : n0;
      pr[e] = n == -INFINITY ? 0.f : exp2f(x[e] - n);
    }
    float s0 = (pr[0] + pr[1]) + (pr[4] + pr[5]);
    float s1 = (pr[2] + pr[3]) + (pr[6] + pr[7]);
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      s0 += __shfl_xor_sync(0xffffffffu, s0, o);
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    d0 = d0 * r0 + s0;
    d1 = d1 * r1 + s1;
    m0 = n0;
    m1 = n1;
    // P (A of P V): heads g / g + 8 x tokens 2t, 2t + 1 / 8 + 2t, 9 + 2t.
    unsigned a[4];
    a[0] = mlas_pack_${tag}(pr[0], pr[1]);
    a[1] = mlas_pack_${tag}(pr[2], pr[3]);
    a[2] = mlas_pack_${tag}(pr[4], pr[5]);
    a[3] = mlas_pack_${tag}(pr[6], pr[7]);
    // O = O * rescale + P @ V over this warp's ${ntw} n-tiles (no rescale where no head of
    // the warp has a new maximum: most pages, once the maxima settle).
    if (!__all_sync(0xffffffffu, r0 == 1.f && r1 == 1.f)) {
#pragma unroll
      for (int i = 0; i < ${ntw} * 4; i += 4) {
        acc[i] *= r0; acc[i + 1] *= r0; acc[i + 2] *= r1; acc[i + 3] *= r1;
      }
    }
#pragma unroll
    for (int jt = 0; jt < ${ntw}; jt += 2) {
      unsigned b[4];
      mlap_ldsm_t_${tag}(b, kvb + v_off + jt * 16);
      mlap_mma_${tag}(acc + 4 * jt, a, b[0], b[1]);
      mlap_mma_${tag}(acc + 4 * jt + 4, a, b[2], b[3]);
    }
  }
  // Merge the streams: (max, sum) per head, then each stream's output scaled to the block's max.
  if (hw == 0 && t == 0) {
    md[s * 32 + g] = m0;
    md[s * 32 + g + 8] = m1;
    md[s * 32 + 16 + g] = d0;
    md[s * 32 + 24 + g] = d1;
  }
  __syncthreads();  // every stream is past its pages: the ring's space is the merge area
  float M0 = -INFINITY, M1 = -INFINITY;
#pragma unroll
  for (int o = 0; o < ${streams}; ++o) {
    M0 = fmaxf(M0, md[o * 32 + g]);
    M1 = fmaxf(M1, md[o * 32 + g + 8]);
  }
  const float f0 = m0 == -INFINITY ? 0.f : exp2f(m0 - M0);
  const float f1 = m1 == -INFINITY ? 0.f : exp2f(m1 - M1);
  float* mo = reinterpret_cast<float*>(smem + ${qh}) + s * ${head_floats};
#pragma unroll
  for (int jt = 0; jt < ${ntw}; ++jt) {
    const int col = hw * ${wcols} + jt * 8 + t * 2;
    const float* o = acc + 4 * jt;
    *reinterpret_cast<float2*>(mo + g * ${dl} + col) = make_float2(o[0] * f0, o[1] * f0);
    *reinterpret_cast<float2*>(mo + (g + 8) * ${dl} + col) = make_float2(o[2] * f1, o[3] * f1);
  }
  __syncthreads();
  const float* mo0 = reinterpret_cast<const float*>(smem + ${qh});
  for (int i = tx; i < 4 * ${dl}; i += 256) {  // 16 heads x ${dl} columns, 4 at a time
    const int h = i / ${dlq}, col = (i - h * ${dlq}) * 4;
    float M = -INFINITY, den = 0.f;
#pragma unroll
    for (int o = 0; o < ${streams}; ++o) M = fmaxf(M, md[o * 32 + h]);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int o = 0; o < ${streams}; ++o) {
      const float mo_ = md[o * 32 + h];
      den += mo_ == -INFINITY ? 0.f : md[o * 32 + 16 + h] * exp2f(mo_ - M);
      const float4 u = *reinterpret_cast<const float4*>(mo0 + o * ${head_floats} + h * ${dl} + col);
      v.x += u.x; v.y += u.y; v.z += u.z; v.w += u.w;
    }
    const float inv = den > 0.f ? ${one} / den : 0.f;
    if (final_) {
      *reinterpret_cast<__half2*>(out + h * ${dl} + col) = __floats2half2_rn(v.x * inv, v.y * inv);
      *reinterpret_cast<__half2*>(out + h * ${dl} + col + 2) =
          __floats2half2_rn(v.z * inv, v.w * inv);
    } else {
      *reinterpret_cast<float4*>(ws_o + h * ${dl} + col) =
          make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
    }
  }
  if (tx < 16) {
    float M = -INFINITY, den = 0.f;
    for (int o = 0; o < ${streams}; ++o) M = fmaxf(M, md[o * 32 + tx]);
    for (int o = 0; o < ${streams}; ++o) {
      const float mo_ = md[o * 32 + tx];
      den += mo_ == -INFINITY ? 0.f : md[o * 32 + 16 + tx] * exp2f(mo_ - M);
    }
    const float v = den > 0.f ? M + log2f(den) : -INFINITY;
    if (final_) ${lse_final} else ws_lse[tx] = v;
  }
}
"""


_MMA2 = "{i}mlap_mma_{t}({c}, a, b[0], b[1]);\n{i}mlap_mma_{t}({c} + 4, a, b[2], b[3]);\n"


def streams_source(
    tag: str,
    D: int,
    DL: int,
    stages: int,
    warps: int,
    prims: bool = True,
    kscale: float | None = None,
) -> str:
    """CUDA source of ``mla_split_streams_<tag>`` (module docstring): 16 heads, rows of ``D``
    (latent + rope) halves, ``DL`` output columns, ``stages`` ring slots a stream (``stages -
    1`` pages in flight), ``warps`` warps a stream. ``kscale`` (``256 kv_scale``): over an FP8
    cache (:mod:`~.kv_fp8`; ``q`` at a head stride of ``DL + 2R`` halves, two ``lse`` a head).
    ``prims=False`` leaves out the PTX primitives (``mlap_{mma,ldsm,ldsm_t,cp,commit,wait,bar}
    _<tag>``), the PDL wait's definition and the include guard, for a CPU emulation."""
    fp8 = kscale is not None
    _check(D, DL, stages, warps, fp8)
    lay = _layout(D, DL, stages, warps, fp8)
    srow, prow, rrow = lay["srow"], lay["prow"], lay["rrow"]
    ks = D // 16
    ksw = -(-ks // warps)
    gthreads = 32 * warps
    dv = prow // 8
    if fp8:
        decode = Template(_DECODE).substitute(
            tag=tag, prow=prow, srow=srow, dl=DL, gthreads=gthreads, dlv=DL // 8,
            dec_vecs=P * DL // 8, rv=(D - DL) // 8, rope_vecs=P * (D - DL) // 8,
        )  # fmt: skip
        dec_ptr = (
            f"  half* dec_s = smem + {lay['dec_off']} + s * {P * srow};\n"
            "  const unsigned kvb = static_cast<unsigned>(__cvta_generic_to_shared(dec_s));"
        )
        key_tile = (
            f"    mlas_decode_{tag}(dec_s, smem + {lay['qh']} + (s * {stages} + j % {stages}) * "
            f"{P * rrow}, lt);\n    mlap_bar_{tag}(1 + s);  // the decoded page is in"
        )
        lat, rope = (_MMA2.format(t=tag, c=c, i=" " * 10) for c in ("cc", "c2"))
        mma_block = (
            f"        if (ks < {DL // 16}) {{  // latent k-steps (two chains), then the rope's\n"
            f"          float* cc = (k & 1) ? c1 : c0;\n{lat}        }} else {{\n{rope}        }}"
        )
        combine = f"{kscale!r}f * (c0[e] + c1[e]) + c2[e]"
        one, lse_final = f"{kscale!r}f", "{ lse[2 * tx] = v; lse[2 * tx + 1] = v; }"
    else:
        decode, dec_ptr = "", ""
        key_tile = f"    const unsigned kvb = ring0 + (j % {stages}) * {P * rrow * 2};"
        mma_block = "        float* cc = (k & 1) ? c1 : c0;\n" + _MMA2.format(
            t=tag, c="cc", i="        "
        )
        combine = "c0[e] + c1[e]"
        one, lse_final = "1.f", "lse[tx] = v;"
    body = decode + _BODY
    if prims:
        body = Template(_PRIMS).substitute(tag=tag, wait=stages - 2, gthreads=gthreads) + body
        body = f"\n#ifndef MLA_SPLIT_STREAMS_{tag}\n#define MLA_SPLIT_STREAMS_{tag}{body}#endif\n"
    prefix = grid_wait_source() if prims else ""
    return prefix + Template(body).substitute(
        tag=tag, d=D, dl=DL, srow=srow, prow=prow, rrow=rrow, dv=dv, dqv=D // 8,
        qs=2 * prow if fp8 else D, stages=stages, streams=lay["streams"], warps=warps,
        gthreads=gthreads, load_iters=-(-P * dv // gthreads), page_vecs=P * dv,
        step_r=gthreads // dv, step_c=gthreads % dv, whole_ks=int(ks % warps == 0),
        page_elems=P * prow, slot_halves=P * rrow, slot_bytes=P * rrow * 2, qh=lay["qh"],
        xs_off=lay["xs_off"], md_off=lay["md_off"], ks=ks, ksw=ksw, ntw=DL // warps // 8,
        wcols=DL // warps, head_floats=16 * DL, dlq=DL // 4, key_tile=key_tile,
        mma_block=mma_block.rstrip(),
        combine=combine, dec_ptr=dec_ptr, one=one, lse_final=lse_final,
        wait_release=WAIT_THEN_RELEASE,
    )  # fmt: skip


def build_streams_variant(heads, latent, rope, dtype, tiles, stream_warps: int, kv_scale=None):
    """:func:`~dsv2_mlc.schedules.mla_attention_cuda.build_mla_attention` with this block in
    place of the pipelined one (``tiles.pages_per_step`` must be 1): the builder's block source
    and shared-memory size are swapped for the build, under the pipelined block's name."""
    from dsv2_mlc.schedules import mla_attention_cuda as mla

    if tiles.pages_per_step != 1:
        raise ValueError("the streams block takes one page a step: pages_per_step must be 1")

    def source(tag, D, DL, stages, kscale=None, pages_per_step=1):
        src = streams_source(tag, D, DL, stages, stream_warps, kscale=kscale)
        return src.replace(f"mla_split_streams_{tag}(", f"mla_split_pipe_{tag}(")

    def halves(D, stages, fp8_latent=0, pages_per_step=1):
        return streams_shared_halves(D, D - rope, stages, stream_warps, bool(fp8_latent))

    with contextlib.ExitStack() as stack:
        for name, value in (("pipe_source", source), ("pipe_shared_halves", halves)):
            stack.callback(setattr, mla, name, getattr(mla, name))
            setattr(mla, name, value)
        return mla.build_mla_attention(heads, latent, rope, dtype, replace(tiles), kv_scale)

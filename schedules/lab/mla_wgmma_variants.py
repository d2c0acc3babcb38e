"""Lab: variants of the register-staged wgmma split block (``mla_wgmma_rs.py``; shipped before the
warp-specialized block of :mod:`dsv2_mlc.schedules.mla_wgmma_cuda`), for the kernel lab
(``kernel_lab_mla.py --kv fp8``, variants ``*_wg*``). Measured in
schedules/results/mla_wgmma.md; the product never imports this module.

* ``ring=True``: the block's first design. The step's pages go by ``cp.async`` into a shared
  ring of ``stages / 4`` slots: swizzled key tiles for a float16 cache, raw slots (4 pages of
  raw rows) for an FP8 cache, each step decoded by a shared-memory pass into the one key tile.
  One block an SM (its shared memory), and the copies' issue and the decode pass dominated:
  slower than the pipelined block.
* ``cvt=False``: the e4m3 bytes decoded by shifts and masks (``value / 256``,
  :func:`~dsv2_mlc.schedules.kv_fp8.e4m3_byte_f16`) instead of ``cvt.rn.f16x2.e4m3x2``.
* :func:`ablate`: sections of the source cut out, for timing studies (wrong results).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace
from string import Template

from mla_wgmma_rs import BODY, layout

from dsv2_mlc.schedules.cuda_call import WAIT_THEN_RELEASE, grid_wait_source
from dsv2_mlc.schedules.mla_cuda_helpers import _PIPE_PRIMS, P
from dsv2_mlc.schedules.mla_wgmma_cuda import ATOM, PRIMS, TOKENS, G

__all__ = [
    "BLOCKS",
    "CUT_OUT",
    "ablate",
    "block_shared_halves",
    "build_wgmma_variant",
    "wgmma_shared_halves",
    "wgmma_source",
]


# Timing studies for the kernel lab (kernel_lab_mla.py prepare --kv fp8 --only NAMES; not compiled
# by the tests): the block with sections of its source cut out (:func:`ablate`; the results are
# wrong and flagged), name -> (FP8 or float16 cache, the split kernel's fields)
_WG = dict(pages_per_step=4, stages=8, target_blocks=132, max_split=132)
CUT_OUT: dict[str, tuple[bool, dict]] = {
    **{
        f"f8_wgc_no_{part.replace('+', '_')}": (True, dict(_WG, block="wgmmac", ablate=part))
        for part in ("copy", "decode", "scores", "softmax", "pv", "scores+softmax+pv")
    },
    **{
        f"f16_wg_no_{part.replace('+', '_')}": (False, dict(_WG, block="wgmma", ablate=part))
        for part in ("copy", "scores", "softmax", "pv", "scores+softmax+pv")
    },
    "f8_wg_no_decode": (True, dict(_WG, block="wgmma", ablate="decode")),
    # the shipped block (schedules/lab/mla_wgmma_rs.py's build_ws_variant): its producer's loads
    # and conversions, its consumers' parts
    **{
        f"f8_ws_no_{part.replace('+', '_')}": (True, dict(_WG, block="ws_plain", ablate=part))
        for part in ("copy", "decode", "copy+decode", "scores", "softmax", "pv",
                     "scores+softmax+pv")
    },
}  # fmt: skip

# The kernel lab's names of the variants (kernel_lab_mla.py's ``block=``), as the options of
# :func:`wgmma_source`: the ring design, rows staged in registers (shifts and masks), the same
# with cvt (the shipped block), + two key tiles, + two accumulator chains a warpgroup, + 16-byte
# latent pieces, + the softmax split by head blocks, + both
BLOCKS: dict[str, dict] = {
    "wgmma": dict(ring=True),
    "wgmmas": dict(ring=False),
    "wgmmac": dict(ring=False, cvt=True),
    "wgmmad": dict(ring=False, cvt=True, dbuf=True),
    "wgmma2": dict(ring=False, cvt=True, chains=2),
    "wgmmaw": dict(ring=False, cvt=True, wide=True),
    "wgmmah": dict(ring=False, cvt=True, hsplit=True),
    "wgmmahw": dict(ring=False, cvt=True, wide=True, hsplit=True),
}


def _check(D: int, DL: int, stages: int) -> None:
    if stages % G or stages < 2 * G:
        raise ValueError(f"stages {stages}: a multiple of {G}, at least {2 * G}")
    if D % ATOM or DL % ATOM or (DL // 8) % 16:
        raise ValueError(f"rows of {D} ({DL} latent): multiples of {ATOM}, DL / 8 of 16")


def _ring_layout(D: int, DL: int, stages: int, fp8: bool) -> dict[str, int]:
    """Byte offsets of the ring block's shared buffers from its 1024-byte-aligned base."""
    slots = stages // G
    atoms = D // ATOM
    tile = atoms * TOKENS * 128
    prow = DL // 2 + D - DL if fp8 else D
    ring = slots * (G * P * prow * 2 if fp8 else tile)
    lay = {"ring": 0, "slot": G * P * prow * 2 if fp8 else tile}
    lay["tile"] = -(-ring // 1024) * 1024 if fp8 else 0  # FP8: the decoded tile after the ring
    off = lay["tile"] + tile if fp8 else ring
    lay["q"] = -(-off // 1024) * 1024
    off = lay["q"] + atoms * 16 * 128
    lay["xs"] = off
    off += 128 * 8 * 4
    lay["p"] = off
    off += 16 * (TOKENS + 8) * 2
    lay["red"] = off
    off += 4 * 16 * 4
    lay["r"] = off
    off += 3 * 16 * 4
    lay["bytes"] = off + 1024
    return lay


def wgmma_shared_halves(
    D: int, DL: int, stages: int, fp8: bool, ring: bool = True, dbuf: bool = False
) -> int:
    """Shared memory (halves) of one block of the variant."""
    _check(D, DL, stages)
    lay = _ring_layout(D, DL, stages, fp8) if ring else layout(D, DL)
    return (lay["bytes"] + (D // ATOM * TOKENS * 128 if dbuf else 0)) // 2


def block_shared_halves(block: str, D: int, DL: int, stages: int, fp8: bool) -> int:
    """:func:`wgmma_shared_halves` of the variant ``block`` (:data:`BLOCKS`)."""
    opts = BLOCKS[block]
    return wgmma_shared_halves(D, DL, stages, fp8, opts["ring"], opts.get("dbuf", False))


_E4M3X2 = r"""
__device__ __forceinline__ unsigned mlaw_e4m3x2_${tag}(unsigned w) {
  const unsigned u = ((w & 0xffu) << 8) | ((w & 0xff00u) << 16);  // bytes 0, 1 -> bits 8, 24
  return (u & 0x80008000u) | ((u & 0x7f007f00u) >> 1);
}"""

_RING_FN = r"""
// the 4 pages ids[j .. j + 3] (rows past `valid` zero-filled, no global read) -> ring slot dst
__device__ __forceinline__ void mlaw_pages_${tag}(unsigned dst, const half* __restrict__ pages,
                                                  const int* __restrict__ ids, int j, int npg,
                                                  int valid, int tx) {
#pragma unroll 1
  for (int i = tx; i < ${tokens} * ${pch}; i += 256) {
    const int tr = i / ${pch}, c = i - tr * ${pch};
    const int pg = j + (tr >> 4);
    const half* src = pages + ((size_t)(pg < npg ? ids[pg] : 0) * 16 + (tr & 15)) * ${prow} +
                      c * 8;
    mlap_cp_${tag}(dst + ${page_dst}, src, tr + j * 16 < valid ? 16 : 0);
  }
}"""

_RING_PROLOGUE = r"""
  // Prologue: slots 0 .. ${slots} - 2 in flight, one commit group each; the pages older than
  // the row's new tokens first, before the PDL wait.
  for (int s = 0; s < ${pre} && s < n_early && s < npg; ++s) {
    const unsigned dst = ring + (s / ${g}) * ${slot_bytes};
#pragma unroll 1
    for (int i = tx; i < 16 * ${pch}; i += 256) {
      const int r = i / ${pch}, c = i - r * ${pch};
      const int tr = (s % ${g}) * 16 + r;
      mlap_cp_${tag}(dst + ${page_dst}, pages + ((size_t)ids[s] * 16 + r) * ${prow} + c * 8,
                     s * 16 + r < nval ? 16 : 0);
    }
  }
  const int n_pre = min(min(${pre}, n_early), npg);
  ${wait_release}  // (PDL) what follows reads the new tokens and Q
  for (int sl = 0; sl < ${slots} - 1; ++sl) {
    const int j = sl * ${g};
    if (j < ngr * ${g}) {
      const unsigned dst = ring + sl * ${slot_bytes};
#pragma unroll 1
      for (int i = tx; i < ${tokens} * ${pch}; i += 256) {
        const int tr = i / ${pch}, c = i - tr * ${pch};
        const int pg = j + (tr >> 4);
        if (pg < n_pre) continue;  // copied before the wait
        const half* src = pages + ((size_t)(pg < npg ? ids[pg] : 0) * 16 + (tr & 15)) *
                          ${prow} + c * 8;
        mlap_cp_${tag}(dst + ${page_dst}, src, tr + j * 16 < nval ? 16 : 0);
      }
    }
    mlap_commit_${tag}();
  }
"""

_RING_HEAD = r"""
    mlap_wait_${tag}();  // slot i has landed (this thread's copies)
    mlaw_proxy_${tag}();
    __syncthreads();     // ... everyone's; slot (i - 1) % ${slots} and the tile are free
    {  // <copy>
      const int j = (i + ${slots} - 1) * ${g};
      if (j < ngr * ${g})
        mlaw_pages_${tag}(ring + ((i + ${slots} - 1) % ${slots}) * ${slot_bytes}, pages, ids, j,
                          npg, nval, tx);
      // </copy>
      mlap_commit_${tag}();
    }
${key_tile}
"""


# 16-byte latent pieces (``wide=True``): thread tx loads piece tx % (L / 16) of rows
# tx / (L / 16) + (4096 / L) k, converts it into two 16-byte chunks of the key tile
_WIDE_FNS = r"""struct mlaw_raw_${tag} { uint4 l[${lk16}]; uint4 r[2]; };
__device__ __forceinline__ void mlaw_load_${tag}(mlaw_raw_${tag}& x,
    const half* __restrict__ pages, const int* __restrict__ ids, int j, int npg, int valid,
    int tx) {
  const char* pb = reinterpret_cast<const char*>(pages);
  int pid[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) pid[u] = j + u < npg ? ids[j + u] : 0;
  const int lp = tx % ${lp16}, r0 = tx / ${lp16};
#pragma unroll
  for (int k = 0; k < ${lk16}; ++k) {
    const int r = r0 + ${rp16} * k;  // page ${rp16} k / 16
    const char* src = pb + ((size_t)pid[${rp16} * k / 16] * 16 + (r & 15)) * ${rowb} + lp * 16;
    x.l[k] = r + j * 16 < valid ? *reinterpret_cast<const uint4*>(src)
                                : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int qi = tx + 256 * k, r = qi >> 3, c = qi & 7;
    const int id = (tx >> 7) ? pid[2 * k + 1] : pid[2 * k];  // page r / 16
    const char* src = pb + ((size_t)id * 16 + (r & 15)) * ${rowb} + ${dl} + c * 16;
    x.r[k] = r + j * 16 < valid ? *reinterpret_cast<const uint4*>(src)
                                : make_uint4(0u, 0u, 0u, 0u);
  }
}
__device__ __forceinline__ void mlaw_store_${tag}(const mlaw_raw_${tag}& x, char* tile, int tx) {
  const int lp = tx % ${lp16}, r0 = tx / ${lp16};
#pragma unroll
  for (int k = 0; k < ${lk16}; ++k) {
    const uint4 v = x.l[k];
    uint4 h0, h1;
    h0.x = mlaw_cvt_${tag}(v.x);
    h0.y = mlaw_cvt_${tag}(v.x >> 16);
    h0.z = mlaw_cvt_${tag}(v.y);
    h0.w = mlaw_cvt_${tag}(v.y >> 16);
    h1.x = mlaw_cvt_${tag}(v.z);
    h1.y = mlaw_cvt_${tag}(v.z >> 16);
    h1.z = mlaw_cvt_${tag}(v.w);
    h1.w = mlaw_cvt_${tag}(v.w >> 16);
    const int r = r0 + ${rp16} * k;
    *reinterpret_cast<uint4*>(tile + mlaw_at_${tag}(r, 2 * lp, ${tokens})) = h0;
    *reinterpret_cast<uint4*>(tile + mlaw_at_${tag}(r, 2 * lp + 1, ${tokens})) = h1;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int qi = tx + 256 * k;
    *reinterpret_cast<uint4*>(tile + mlaw_at_${tag}(qi >> 3, ${dl} / 8 + (qi & 7), ${tokens})) =
        x.r[k];
  }
}
"""


# The softmax split by head blocks (``hsplit=True``): warpgroup wg takes heads 8 wg .. 8 wg + 7
# (its threads' accumulator values 4 wg .. 4 wg + 3), the two exchanging the partial scores of
# each other's heads, each with its own named barrier (id 1 + wg)
_HSPLIT_PRIM = r"""
__device__ __forceinline__ void mlaw_barw_${tag}(int id) {
  asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory");
}
"""
_HSPLIT_SOFTMAX = r"""    {
      const int ob = 1 - wg;  // the other warpgroup's head block
#pragma unroll
      for (int v = 0; v < 4; ++v)
        xs[(w4 * 32 + lane) * 8 + 4 * ob + v] = sa[4 * ob + v] * ${kscale} + sr[4 * ob + v];
    }
    __syncthreads();
    {  // <softmax>
      float sv[4];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int tk = 16 * w4 + g + 8 * (v >> 1);
        const float own = sa[4 * wg + v] * ${kscale} + sr[4 * wg + v];
        const float s = own + xs[(w4 * 32 + lane) * 8 + 4 * wg + v];
        sv[v] = i * ${tokens} + tk < nval ? s * scale : -INFINITY;
      }
      float mx[2];
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        mx[b] = fmaxf(sv[b], sv[b + 2]);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
          mx[b] = fmaxf(mx[b], __shfl_xor_sync(0xffffffffu, mx[b], o));
      }
      if (g == 0) {
#pragma unroll
        for (int b = 0; b < 2; ++b) red[w4 * 16 + 8 * wg + 2 * t + b] = mx[b];
      }
      mlaw_barw_${tag}(1 + wg);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int h = 8 * wg + 2 * t + b;
        const float bm = fmaxf(fmaxf(red[h], red[16 + h]), fmaxf(red[32 + h], red[48 + h]));
        const float m_new = fmaxf(m_run[b], bm);
        const float rs = m_run[b] == -INFINITY ? 0.f : exp2f(m_run[b] - m_new);
        const float p0 = m_new == -INFINITY ? 0.f : exp2f(sv[b] - m_new);
        const float p1 = m_new == -INFINITY ? 0.f : exp2f(sv[b + 2] - m_new);
        l_run[b] = l_run[b] * rs + p0 + p1;
        m_run[b] = m_new;
        p_s[h * ${ps} + 16 * w4 + g] = __float2half_rn(p0);
        p_s[h * ${ps} + 16 * w4 + g + 8] = __float2half_rn(p1);
        if (w4 == 0 && g == 0) r_s[h] = rs;
      }
      // </softmax>
    }
"""
_HSPLIT_EPILOGUE = r"""  // Epilogue: each warpgroup's per-thread sums of its heads -> per head
  {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float l = l_run[b];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      l_run[b] = l;
    }
    mlaw_barw_${tag}(1 + wg);  // every warp of it is past its last read of red (the maxima)
    if (g == 0) {
#pragma unroll
      for (int b = 0; b < 2; ++b) red[w4 * 16 + 8 * wg + 2 * t + b] = l_run[b];
    }
    mlaw_barw_${tag}(1 + wg);
    if (w4 == 0 && g == 0) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int h = 8 * wg + 2 * t + b;
        m_s[h] = m_run[b];
        d_s[h] = red[h] + red[16 + h] + red[32 + h] + red[48 + h];
      }
    }
  }
"""


def _hsplit(body: str) -> str:
    """The shipped body with the softmax split by head blocks (``_HSPLIT_SOFTMAX``)."""
    start = "    if (wg == 1) {\n#pragma unroll\n      for (int e = 0; e < 8; ++e) xs["
    i, j = _between(body, start, "      // </softmax>\n    }\n")
    body = body[:i] + _HSPLIT_SOFTMAX + body[j + len("      // </softmax>\n    }\n") :]
    i, j = _between(body, "  // Epilogue: warpgroup 0's", "  __syncthreads();\n")
    return body[:i] + _HSPLIT_EPILOGUE + body[j:]


def _decode_fn(tag: str, D: int, DL: int, prow: int) -> str:
    """``mlaw_decode_<tag>(tile, raw, tx)``: a raw slot (64 rows of ``prow`` halves: ``DL``
    e4m3 bytes, then the rope halves) -> the swizzled float16 tile."""
    lch, rch = DL // 8, (D - DL) // 8
    return f"""
__device__ __forceinline__ void mlaw_decode_{tag}(char* tile, const char* raw, int tx) {{
#pragma unroll 1
  for (int i = tx; i < {TOKENS * (lch + rch)}; i += 256) {{
    const int r = i / {lch + rch}, c = i - r * {lch + rch};
    uint4 h;
    if (c < {lch}) {{
      const uint2 v = *reinterpret_cast<const uint2*>(raw + r * {prow * 2} + c * 8);
      h.x = mlaw_e4m3x2_{tag}(v.x);
      h.y = mlaw_e4m3x2_{tag}(v.x >> 16);
      h.z = mlaw_e4m3x2_{tag}(v.y);
      h.w = mlaw_e4m3x2_{tag}(v.y >> 16);
    }} else {{
      h = *reinterpret_cast<const uint4*>(raw + r * {prow * 2} + {DL} + (c - {lch}) * 16);
    }}
    *reinterpret_cast<uint4*>(tile + mlaw_at_{tag}(r, c, {TOKENS})) = h;
  }}
}}"""


def _between(s: str, a: str, b: str) -> tuple[int, int]:
    i = s.index(a)
    return i, s.index(b, i)


def _ring_body(fp8: bool, tag_decode: str) -> str:
    """The shipped body with the ring's copies (and FP8 decode pass) in place of its
    register-staged rows."""
    body = BODY
    i, j = _between(body, "struct mlaw_raw_${tag}", "__device__ __forceinline__ void mla_split_wg_")
    body = body[:i] + _RING_FN.lstrip("\n") + tag_decode + "\n" + body[j:]
    i, j = _between(body, "  // Prologue: step 0's rows", "  // Q (16 heads")
    body = body[:i] + _RING_PROLOGUE.lstrip("\n") + body[j:]
    kt = "    const unsigned kt = base;\n"
    i, j = _between(body, "    __syncthreads();  // every warp is past", kt)
    body = body[:i] + _RING_HEAD.lstrip("\n") + body[j + len(kt) :]
    qt = "  const unsigned qt = base + ${q_off};"
    return body.replace(qt, "  const unsigned ring = base, qt = base + ${q_off};")


def wgmma_source(
    tag: str,
    D: int,
    DL: int,
    stages: int,
    kscale: float | None = None,
    prims: bool = True,
    ring: bool = True,
    cvt: bool = False,
    dbuf: bool = False,
    chains: int = 1,
    wide: bool = False,
    hsplit: bool = False,
) -> str:
    """CUDA of ``mla_split_wg_<tag>``, a variant of the shipped block (module docstring) for rows
    of ``D`` halves (``DL`` latent) and a ring of ``stages / 4`` slots; ``kscale`` (``256
    kv_scale``): the FP8 cache (``ring=False``: FP8 only, the shipped register-staged rows)."""
    _check(D, DL, stages)
    fp8 = kscale is not None
    if not (ring or fp8) or (cvt and ring):
        raise ValueError("register-staged rows are FP8 only; cvt goes with them")
    lay = _ring_layout(D, DL, stages, fp8) if ring else layout(D, DL)
    if dbuf and ring:
        raise ValueError("dbuf: the register-staged block only")
    tile_bytes = D // ATOM * TOKENS * 128
    if dbuf:  # a second key tile before Q and the rest
        lay = {k: v + (tile_bytes if k != "tile" else 0) for k, v in lay.items()}
    slots = stages // G
    prow = DL // 2 + D - DL if fp8 else D
    if ring and fp8:
        key_tile = f"""    // slot i decoded into the tile (every warp is past the barrier above)
    // <decode>
    mlaw_decode_{tag}(gbase + {lay["tile"]}, gbase + (i % {slots}) * {lay["slot"]}, tx);
    // </decode>
    mlaw_proxy_{tag}();
    __syncthreads();
    const unsigned kt = base + {lay["tile"]};"""
        page_dst = f"(unsigned)((tr * {prow} + c * 8) * 2)"
    elif ring:
        key_tile = f"    const unsigned kt = ring + (i % {slots}) * {lay['slot']};"
        page_dst = f"mlaw_at_{tag}(tr, c, {TOKENS})"
    if ring:
        decode = (_E4M3X2 + _decode_fn(tag, D, DL, prow)) if fp8 else ""
        body = _ring_body(fp8, decode.replace("${tag}", tag)).replace("${key_tile}", key_tile)
    else:
        body = BODY if cvt else _E4M3X2 + BODY.replace("mlaw_cvt_${tag}(", "mlaw_e4m3x2_${tag}(")
        if hsplit:
            body = _hsplit(body)
        if wide:  # 16-byte latent pieces
            struct = "struct mlaw_raw_${tag}"
            i, j = _between(body, struct, "__device__ __forceinline__ void mla_split")
            body = body[:i] + _WIDE_FNS + body[j:]
        if chains == 2:  # alternate k-steps on two accumulators, summed after the wait
            for old, new in (
                ("mlaw_wgmma_${tag}(sa,", "mlaw_wgmma_${tag}((k & 1) ? sb : sa,"),
                ("    float sa[8], sr[8];", "    float sa[8], sb[8], sr[8];"),
                ("{ sa[e] = 0.f; sr[e] = 0.f; }", "{ sa[e] = 0.f; sb[e] = 0.f; sr[e] = 0.f; }"),
                ("    mlaw_wait0_${tag}();\n    // </scores>",
                 "    mlaw_wait0_${tag}();\n#pragma unroll\n    for (int e = 0; e < 8; ++e) "
                 "sa[e] += sb[e];\n    // </scores>"),
            ):  # fmt: skip
                assert old in body, old
                body = body.replace(old, new)
        if dbuf:
            for old, new in (
                ("    __syncthreads();  // every warp is past the last step's reads of the tile "
                 "(and of Q's stores)\n", ""),
                ("mlaw_store_${tag}(x, gbase, tx);",
                 f"mlaw_store_${{tag}}(x, gbase + (i & 1) * {tile_bytes}, tx);"),
                ("const unsigned kt = base;",
                 f"const unsigned kt = base + (i & 1) * {tile_bytes};"),
            ):  # fmt: skip
                assert old in body, old
                body = body.replace(old, new)
    scale = kscale / 256.0 if cvt else kscale
    if prims:
        body = _PIPE_PRIMS + PRIMS + (_HSPLIT_PRIM if hsplit else "") + body
        body = f"\n#ifndef MLA_SPLIT_WG_{tag}\n#define MLA_SPLIT_WG_{tag}{body}#endif\n"
    prefix = grid_wait_source() if prims else ""
    return prefix + Template(body).substitute(
        tag=tag,
        wait_release=WAIT_THEN_RELEASE,
        wait=max(slots - 2, 0),
        d=D,
        dl=DL,
        dch=D // 8,
        prow=prow,
        pch=prow // 8,
        page_dst=page_dst if ring else "",
        rows=TOKENS,
        tokens=TOKENS,
        g=G,
        slots=slots,
        pre=(slots - 1) * G,
        slot_bytes=lay.get("slot", 0),
        q_off=lay["q"],
        xs_off=lay["xs"],
        p_off=lay["p"],
        red_off=lay["red"],
        r_off=lay["r"],
        qs=2 * prow if fp8 else D,
        ks=D // 16,
        ksl=DL // 16,
        ks0=D // 32,
        atom_a=TOKENS * 128,
        kscale=f"{scale!r}f" if fp8 else "1.f",
        ps=TOKENS + 8,
        cw=DL // 8,
        wcols=DL // 8,
        ntw=DL // 64,
        one=f"{scale!r}f" if fp8 else "1.f",
        lse_final="{ lse[2 * tx] = v; lse[2 * tx + 1] = v; }" if fp8 else "lse[tx] = v;",
        rowb=prow * 2,
        lp=DL // 8,
        lk=DL // 32,
        rp=2048 // DL,
        lp16=DL // 16,
        lk16=DL // 64,
        rp16=4096 // DL,
    )


def ablate(src: str, parts: str | None) -> str:
    """``src`` with the marked sections ``parts`` (``+``-separated: copy, decode, scores,
    softmax, pv) cut out: timing studies of what each costs (the results are wrong)."""
    for part in (parts or "").split("+"):
        if part:
            src, n = re.subn(rf"// <{part}>.*?// </{part}>", "", src, flags=re.S)
            if not n:
                raise ValueError(f"no section {part!r} to ablate")
    return src


def build_wgmma_variant(heads, latent, rope, dtype, tiles, block, kv_scale=None, parts=None):
    """:func:`~dsv2_mlc.schedules.mla_attention_cuda.build_mla_attention` with the variant
    ``block`` (:data:`BLOCKS`) in place of the pipelined block (``tiles.pages_per_step`` must be
    4), ``parts`` cut out (:func:`ablate`): the builder's block source and shared-memory size are
    swapped for the build, under the pipelined block's name."""
    opts = BLOCKS[block]
    from dsv2_mlc.schedules import mla_attention_cuda as mla

    if tiles.pages_per_step != G:
        raise ValueError(f"the wgmma block takes {G} pages a step: pages_per_step must be {G}")

    def source(tag, D, DL, stages, kscale=None, pages_per_step=G):
        src = wgmma_source(tag, D, DL, stages, kscale=kscale, **opts)
        return ablate(src, parts).replace(f"mla_split_wg_{tag}(", f"mla_split_pipe_{tag}(")

    def halves(D, stages, fp8_latent=0, pages_per_step=G):
        return block_shared_halves(block, D, D - rope, stages, bool(fp8_latent))

    with contextlib.ExitStack() as stack:
        for name, value in (("pipe_source", source), ("pipe_shared_halves", halves)):
            stack.callback(setattr, mla, name, getattr(mla, name))
            setattr(mla, name, value)
        return mla.build_mla_attention(heads, latent, rope, dtype, replace(tiles), kv_scale)

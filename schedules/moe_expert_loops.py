"""The inner loops of the expert-major MoE decode kernels (:mod:`.moe_expert_mma_cuda`), as CUDA.

An item's weight rows in 16-row tiles, each lane loading 32 consecutive inputs of its rows from
the INT4 layout as it is, dequantised (the exact ``1024 + nibble`` trick) into
``mma.sync.m16n8k16`` A fragments against the chunk's staged activations as B: runs of
``MmaTiles.run`` inputs with the next run's words loaded before this run's MMAs (``depth``
runs in flight), a tile's runs split among warps where an item has fewer tiles than the block
has warps (partial sums reduced in a fixed order), against the chunk's activations staged whole.
The module docstring of :mod:`.moe_expert_mma_cuda` says why.
"""

from __future__ import annotations

from .tiles import MmaTiles

__all__ = [
    "RUN",
    "item_units",
    "mma_source",
    "split_parts",
    "tile_loop",
]

RUN = 128  # inputs a warp's 4 lanes of a row cover per uint4 a lane (16 bytes)


def mma_source() -> str:
    """CUDA: ``dsv2_mma16816(c, a, b)`` (``c += A B``, fp16 in, fp32 accumulators; off the GPU
    the emulation's ``dsv2_emu_mma16816``), ``dsv2_emm_deq8(q, scale, hv)`` (a word's 8 nibbles as
    the pairs ``(n0, n4) .. (n3, n7)`` minus 8, times ``scale``) and ``dsv2_emm_stage`` (a staged
    row)."""
    return """
#ifndef DSV2_EMM_MMA
#define DSV2_EMM_MMA
__device__ __forceinline__ void dsv2_mma16816(float* c, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  dsv2_emu_mma16816(c, a, b);
#endif
}
__device__ __forceinline__ unsigned dsv2_emm_h2u(__half2 v) {
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ __half2 dsv2_emm_u2h(unsigned v) {
  return *reinterpret_cast<__half2*>(&v);
}
__device__ __forceinline__ void dsv2_emm_deq8(unsigned q, __half2 scale, unsigned* hv) {
  const unsigned q8 = q >> 8;
  const __half2 lo_b = dsv2_emm_u2h(0x64086408u), hi_m = dsv2_emm_u2h(0x2c002c00u);
  const __half2 hi_b = dsv2_emm_u2h(0xd480d480u);
  hv[0] = dsv2_emm_h2u(__hmul2(__hsub2(dsv2_emm_u2h((q & 0x000f000fu) | 0x64006400u), lo_b),
                                scale));
  hv[1] = dsv2_emm_h2u(__hmul2(__hfma2(dsv2_emm_u2h((q & 0x00f000f0u) | 0x64006400u), hi_m,
                                        hi_b), scale));
  hv[2] = dsv2_emm_h2u(__hmul2(__hsub2(dsv2_emm_u2h((q8 & 0x000f000fu) | 0x64006400u), lo_b),
                                scale));
  hv[3] = dsv2_emm_h2u(__hmul2(__hfma2(dsv2_emm_u2h((q8 & 0x00f000f0u) | 0x64006400u), hi_m,
                                        hi_b), scale));
}
// 8 values of a row into its staged copy (pair order), 8-byte stores: `dst` word 4 v
__device__ __forceinline__ void dsv2_emm_stage(unsigned* dst, uint4 v) {
  const uint4 p = dsv2_pair8(v);
  reinterpret_cast<uint2*>(dst)[0] = make_uint2(p.x, p.y);
  reinterpret_cast<uint2*>(dst)[1] = make_uint2(p.z, p.w);
}
#endif
"""


def tile_loop(
    rows_words: str,
    width: int,
    tiles_a: int,
    group: int,
    depth: int = 1,
    words: int = 1,
    ntiles: int = 1,
) -> str:
    """CUDA: the K loop of a warp's 16-row tile over the runs ``[g0, g1)`` (``128 words`` of
    ``width`` inputs each) for ``tiles_a`` A tiles (gate and up: 2; down: 1) sharing each B
    fragment, then, where ``width`` is not a multiple of the run, its last 128 inputs (the
    *tail*, loaded before the loop; only without a K split). Expects ``wr[m]`` (tile m's row
    ``g`` words; row ``g + 8`` is ``rows_words`` further on), ``sr[m]`` (its scales, ``width /
    group`` a row), ``xs`` (the staged rows, ``XS`` words each), ``acc[m * ntiles + j][4]``,
    ``g``, ``t``, ``g0``, ``g1`` (compile-time constants for ``depth`` > 1: :func:`_ring_loop`);
    ``ntiles``: n-tiles of 8 staged rows each A fragment serves."""
    loop = (
        _ring_loop(rows_words, width, tiles_a, group, depth, words, ntiles)
        if depth > 1
        else _pair_loop(rows_words, width, tiles_a, group, words, ntiles)
    )
    start = width - width % (RUN * words)
    if start == width:
        return loop
    return f"""
        uint4 tq[{tiles_a}][2][1];
        __half2 ts[{tiles_a}][2][1];
        {{
{_load_lambda(rows_words, width, tiles_a, group, 1, f"{start} + t * 32")}          load(0, tq, ts);
        }}
{loop}        {{
{_mma_run(tiles_a, "tq", "ts", 1, f"{start // 2} + t * 16", ntiles)}        }}
"""


def _pair_loop(
    rows_words: str, width: int, tiles_a: int, group: int, words: int, ntiles: int = 1
) -> str:
    """CUDA: :func:`tile_loop`'s runs with the next run's words in flight (two buffers)."""
    return f"""
        uint4 wq[{tiles_a}][2][{words}], nq[{tiles_a}][2][{words}];
        __half2 sc[{tiles_a}][2][{words}], ns[{tiles_a}][2][{words}];
{_load_lambda(rows_words, width, tiles_a, group, words)}        if (g0 < g1) load(g0, wq, sc);
        for (int gi = g0; gi < g1; ++gi) {{
          if (gi + 1 < g1) load(gi + 1, nq, ns);
{_mma_run(tiles_a, "wq", "sc", words, None, ntiles)}          if (gi + 1 < g1) {{
#pragma unroll
            for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
              for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int u = 0; u < {words}; ++u) {{
                  wq[m][h][u] = nq[m][h][u];
                  sc[m][h][u] = ns[m][h][u];
                }}
          }}
        }}
"""


def _load_lambda(
    rows_words: str, width: int, tiles_a: int, group: int, words: int, first: str | None = None
) -> str:
    """CUDA: ``load(gi, q, sv)``, a lane's ``words`` uint4 (32 inputs each: one scale) of run
    ``gi`` for its two rows of each of the ``tiles_a`` A tiles; ``first``: the lane's first input
    (default: its share of run ``gi``)."""
    bufs = f"uint4 (&q)[{tiles_a}][2][{words}], __half2 (&sv)[{tiles_a}][2][{words}]"
    first = first or f"gi * {RUN * words} + t * {32 * words}"
    return f"""        auto load = [&](int gi, {bufs}) {{
#pragma unroll
          for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int u = 0; u < {words}; ++u) {{
                const int col = {first} + 32 * u;
                const long long row = (long long)h * 8;
                q[m][h][u] =
                    reinterpret_cast<const uint4*>(wr[m] + row * {rows_words} + col / 8)[0];
                sv[m][h][u] = __half2half2(sr[m][row * {width // group} + col / {group}]);
              }}
        }};
"""


def _mma_run(
    tiles_a: int,
    q: str,
    sc: str,
    words: int,
    span: str | None = None,
    ntiles: int = 1,
    base: str = "xs",
) -> str:
    """CUDA: the MMAs of a run with the words ``q`` and scales ``sc`` (``[tiles_a][2][words]``):
    a lane's ``32 words`` inputs from its staged word ``span`` (default: its share of run ``gi``
    at ``[t * 32 words, (t + 1) * 32 words)``), 8 a word; with ``ntiles`` > 1 each A fragment
    serves that many n-tiles of 8 staged rows (``acc[m * ntiles + j]``: A tile m, n-tile j);
    ``base``: the staged rows."""
    span = span or f"gi * {RUN // 2 * words} + t * {16 * words}"
    if ntiles > 1:
        return _mma_run_tiles(tiles_a, q, sc, words, span, ntiles, base)
    return f"""          const unsigned* xb = {base} + g * XS + {span};
#pragma unroll
          for (int i = 0; i < {4 * words}; ++i) {{
            unsigned hv[{tiles_a}][2][4];
#pragma unroll
            for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                dsv2_emm_deq8(reinterpret_cast<const unsigned*>(&{q}[m][h][i / 4])[i % 4],
                              {sc}[m][h][i / 4], hv[m][h]);
#pragma unroll
            for (int p = 0; p < 2; ++p) {{
              const uint2 bx = reinterpret_cast<const uint2*>(xb + 4 * i + 2 * p)[0];
              const unsigned b[2] = {{bx.x, bx.y}};
#pragma unroll
              for (int m = 0; m < {tiles_a}; ++m) {{
                const unsigned a[4] = {{hv[m][0][2 * p], hv[m][1][2 * p], hv[m][0][2 * p + 1],
                                       hv[m][1][2 * p + 1]}};
                dsv2_mma16816(acc[m], a, b);
              }}
            }}
          }}
"""


def _mma_run_tiles(
    tiles_a: int, q: str, sc: str, words: int, span: str, ntiles: int, base: str = "xs"
) -> str:
    """CUDA: :func:`_mma_run` of ``ntiles`` n-tiles (the B fragments of n-tile j from staged
    rows ``8 j .. 8 j + 7``)."""
    return f"""          const unsigned* xb = {base} + g * XS + {span};
#pragma unroll
          for (int i = 0; i < {4 * words}; ++i) {{
            unsigned hv[{tiles_a}][2][4];
#pragma unroll
            for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                dsv2_emm_deq8(reinterpret_cast<const unsigned*>(&{q}[m][h][i / 4])[i % 4],
                              {sc}[m][h][i / 4], hv[m][h]);
#pragma unroll
            for (int p = 0; p < 2; ++p) {{
              unsigned b[{ntiles}][2];
#pragma unroll
              for (int j = 0; j < {ntiles}; ++j) {{
                const uint2 bx =
                    reinterpret_cast<const uint2*>(xb + j * 8 * XS + 4 * i + 2 * p)[0];
                b[j][0] = bx.x;
                b[j][1] = bx.y;
              }}
#pragma unroll
              for (int m = 0; m < {tiles_a}; ++m) {{
                const unsigned a[4] = {{hv[m][0][2 * p], hv[m][1][2 * p], hv[m][0][2 * p + 1],
                                       hv[m][1][2 * p + 1]}};
#pragma unroll
                for (int j = 0; j < {ntiles}; ++j) dsv2_mma16816(acc[m * {ntiles} + j], a, b[j]);
              }}
            }}
          }}
"""


def _ring_loop(
    rows_words: str, width: int, tiles_a: int, group: int, depth: int, words: int, ntiles: int = 1
) -> str:
    """CUDA: :func:`tile_loop`'s runs with ``depth`` in flight: a ring of ``depth + 1`` register
    buffers, the loop over the compile-time runs ``[g0, g1)`` fully unrolled so that every ring
    index is a constant."""
    slots = depth + 1
    run = _mma_run(
        tiles_a, f"wq[(gi - g0) % {slots}]", f"sc[(gi - g0) % {slots}]", words, None, ntiles
    )
    return f"""
        uint4 wq[{slots}][{tiles_a}][2][{words}];
        __half2 sc[{slots}][{tiles_a}][2][{words}];
{_load_lambda(rows_words, width, tiles_a, group, words)}#pragma unroll
        for (int d = 0; d < {depth}; ++d)
          if (g0 + d < g1) load(g0 + d, wq[d], sc[d]);
#pragma unroll
        for (int gi = g0; gi < g1; ++gi) {{
          if (gi + {depth} < g1) load(gi + {depth}, wq[(gi - g0 + {depth}) % {slots}],
                                    sc[(gi - g0 + {depth}) % {slots}]);
{run}        }}
"""


def split_parts(tiles: MmaTiles) -> int:
    """Warps a 16-row tile's runs of 128 inputs are split among: 1 unless an item has fewer
    tiles than the block has warps."""
    return max(1, tiles.warps // (tiles.rows // 16))


def item_units(
    first: str, last: str, tiles: MmaTiles, runs: int, tiles_a: int, body: str, emit: str
) -> str:
    """CUDA: an item's rows ``[first, last)`` as 16-row tiles, a warp each; with fewer tiles than
    warps (:func:`split_parts` > 1) each tile's ``runs`` runs of 128 inputs split among the warps
    (``g0``, ``g1``), their accumulators summed through shared memory (``red``) in a fixed order.
    ``body`` computes ``acc`` for the tile at row ``r``; ``emit`` writes ``acc`` of that tile
    (``tiles_a`` A tiles x ``tiles.ntiles`` n-tiles of accumulators)."""
    W, parts = tiles.warps, split_parts(tiles)
    tiles_a *= tiles.ntiles
    if parts == 1:
        return f"""      for (int u = warp; u < ({last} - {first}) / 16; u += {W}) {{
        const int r = {first} + 16 * u;
        constexpr int g0 = 0, g1 = {runs};
        float acc[{tiles_a}][4] = {{}};
{body}
{emit}
      }}
"""
    per = tiles_a * 4 * 32
    return f"""      {{
        const int nt = ({last} - {first}) / 16;  // (nt * {parts} <= {W})
        for (int u = warp; u < nt * {parts}; u += {W}) {{
          const int r = {first} + 16 * (u % nt), kp = u / nt;
          const int g0 = kp * {runs} / {parts}, g1 = (kp + 1) * {runs} / {parts};
          float acc[{tiles_a}][4] = {{}};
{body}
#pragma unroll
          for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) red[u * {per} + (m * 4 + j) * 32 + lane] = acc[m][j];
        }}
        __syncthreads();  // the first warp of each tile sums its parts in order
        for (int u = warp; u < nt; u += {W}) {{
          const int r = {first} + 16 * u;
          float acc[{tiles_a}][4];
#pragma unroll
          for (int m = 0; m < {tiles_a}; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) {{
              float v = 0.f;
              for (int kp = 0; kp < {parts}; ++kp)
                v += red[(kp * nt + u) * {per} + (m * 4 + j) * 32 + lane];
              acc[m][j] = v;
            }}
{emit}
        }}
        __syncthreads();  // red is the next item's
      }}
"""

"""DeepSeekMoE decode of a batch on CUDA, expert-major on tensor cores (batches of 16 and more).

The fused decode kernels of :mod:`.moe_decode_cuda` are token-major: each token's blocks route it
and read its ``top_k`` routed experts and the shared ones, so a batch of ``n`` reads ``n`` x
(``top_k`` + shared) experts' weights a layer. The experts a batch selects overlap, and the shared
experts are every token's: here every expert's rows are read once for all the tokens that chose
it. Two kernels (after the router's ``moe_route``), each a fixed grid of ``blocks`` blocks of
``warps`` warps that loops over the tokens in groups of ``MmaTiles.tokens`` (32 by default: a
group reads its experts' weights again, so a plan of 256 tokens reads them once for a step of up
to 256), each block first building the group's **plan** in shared memory: from ``ids [n, top_k]``
the (token, slot) pairs of every expert in (token, slot) order, the shared experts as expert ``E``
with one pair (token, ``top_k``) per token; an expert's pairs in *chunks* of at most
``MmaTiles.chunk`` (8 by default). The plan is the same in every block: each warp counts then
places the pairs of its contiguous segment of ``ids``, 32 at a time, the lanes of one expert
found by ballots over the bits of its id, their ranks by popcounts (no atomics), with a scan over
the warps and one over the experts in between. The work items
are (chunk, block of ``rows`` weight rows): the routed chunks' first, expert by expert, then the
shared chunks'. Block ``b`` takes the contiguous run ``[b * items / blocks, (b + 1) * items /
blocks)``, so consecutive items mostly share their chunk and the blocks' shares differ by one item
at most. An item goes through ``mma.sync.m16n8k16`` with the weights as A (16 rows) and the
chunk's tokens as B (N = 8): one MMA is 16 rows x 16 inputs x 8 tokens, and a weight is
dequantised once for all the chunk's tokens (SIMT dot products, ~640 instructions a weight row,
lost to the token-major kernels: schedules/results/moe_decode.md). A chunk of 16 or 32 pairs is
two or four such n-tiles, each dequantised A fragment multiplied with all of them.

**In the model:** ``batch_decode_expert_major`` (``GroupQuantExperts.expert_major_decode``: the
router's ``moe_route``, these two kernels, the float32 weighted sum), which the engine runs for
decode steps of ``EXPERT_MAJOR_FROM`` (16) sequences and more: from there on it decodes faster
than the token-major kernels, below that slower, at batch 1 about half as fast
(schedules/results/moe_decode.md, docs/benchmarks.md "Decode batches"). ``batch_decode_gemm``
(the large batches) runs them instead of the grouped GEMMs where the tile table's
``decode_gemm`` entry says ``moe="expert_major"``.

**The fragments from the INT4 layout as it is.** The weights stay in the layout of
:mod:`dsv2_mlc.quant.packing` (``[rows, K/8]`` words, element ``8 j + i`` in nibble ``i``
of word ``j``), which the token-major kernels read too. An MMA's reduction order over its 16
inputs does not matter as long as A and B agree, so each lane takes 32 *consecutive* inputs of its
rows: in a run of 128 inputs, lane ``(g, t)`` (``g = lane / 4``, ``t = lane % 4``) loads the 16
bytes ``[16 t, 16 t + 16)`` of rows ``g`` and ``g + 8`` (one ``uint4`` each: 4 words), and word
``i`` feeds two MMA steps. A word dequantises (the exact ``1024 + nibble`` trick of
:func:`~.decode_gemv_cuda.dot32_source`) to the half2 pairs ``(n0, n4), (n1, n5), (n2, n6), (n3,
n7)``, times the group's scale (one fp16 rounding, as the prefill MMA kernels do); step ``2 i``
takes pairs 0 and 1 as its logical inputs ``(2t, 2t+1)`` and ``(2t+8, 2t+9)``, step ``2 i + 1``
pairs 2 and 3. The chunk's activations are staged in shared memory in the same pair order
(``dsv2_pair8``), so B is one 8-byte load per step; rows are padded so that the warp's 32 loads
hit every bank pair twice (two wavefronts, the minimum for 256 bytes). With runs of 256
(``MmaTiles.run``) a lane takes 64 consecutive inputs, two ``uint4`` a row, so a row's 4 lanes
read one whole 128-byte line a run: that, not the bytes in flight, is what the gate/up kernel
needs (schedules/results/moe_decode.md).

1. :func:`moe_gate_up_expert_mma`: per item, the chunk's ``x`` rows in shared memory; each warp a
   16-row tile of gate rows and the matching up rows (two MMAs per B fragment), the next run's
   words loaded before this run's MMAs (runs of 256 by default); ``h = silu(gate) * up`` from the
   float32 accumulators, written for the chunk's pairs (the layout of the token-major kernels).
2. :func:`moe_down_expert_mma`: per item, the chunk's pairs' ``h`` slices in shared memory; each
   warp a 16-row tile of output rows (two runs of 128 in flight by default), ``part[t, slot, o]``
   in float32 (unweighted, every element written by one item: the weighted sum stays
   deterministic).

**Activations in K slices** (a ring of two slice buffers so that chunks of 32 pairs leave room
for several blocks an SM) measured slower at every batch and tiling tried and was removed: it is
in git at ``ef59bc7`` (``MmaTiles.stage_k``), its figures in schedules/results/decode_batches.md.

Shapes: ``hidden``, ``inter`` and the shared intermediate multiples of 128, the group a multiple
of 32 (a lane's 32 inputs share a scale), ``rows`` a multiple of 16. The reference is float64
NumPy (``tests/test_moe_expert_mma_emulation.py``; the MMA emulated with warp shuffles).
"""

from __future__ import annotations

from tvm import tirx

from ..errors import UsageError
from .cuda_call import TOKENS, WAIT_THEN_RELEASE, grid_wait_source, token_grid_call
from .decode_gemv_cuda import dot32_source
from .moe_decode_cuda import MoeDecodeShape
from .moe_expert_loops import (
    RUN,
    item_units,
    mma_source,
    split_parts,
    tile_loop,
)
from .moe_expert_plan import items_head, plan_bytes, plan_source
from .tiles import MmaTiles, tuned

__all__ = [
    "DECODE_GEMM_MOE",
    "GROUP_TOKENS",
    "MMA_TOKENS",
    "decode_gemm_expert_major",
    "down_expert_mma_kernel",
    "expert_mma_unsupported",
    "gate_up_expert_mma_kernel",
    "moe_down_expert_mma",
    "moe_gate_up_expert_mma",
]

GROUP_TOKENS = 32  # tokens planned together by default (``MmaTiles.tokens``)
MMA_TOKENS = 8  # pairs of a chunk by default (``MmaTiles.chunk``): the MMA's N
_CHUNKS = (8, 16, 32)  # chunks of one, two or four n-tiles
DECODE_GEMM_MOE = ("grouped", "expert_major")  # DecodeGemmTiles.moe


def decode_gemm_expert_major() -> bool:
    """Whether ``batch_decode_gemm`` runs a MoE layer's experts through these kernels (where they
    take its shape) rather than the grouped GEMMs: the tile table's ``decode_gemm`` entry."""
    moe = tuned("decode_gemm").moe
    if moe not in DECODE_GEMM_MOE:
        raise UsageError(
            f"decode_gemm tiles: moe={moe!r} is not one of {DECODE_GEMM_MOE} (schedules/tiles.py)"
        )
    return moe == "expert_major"


_SHARED_LIMIT = 227 * 1024  # an sm_90 block's shared memory (dynamic past 48 KB)


def _stride(width: int) -> int:
    """Words (half2) of a staged row of ``width`` values: padded to 2 mod 32 (conflict-free B)."""
    return width // 2 + (2 - width // 2) % 32


def expert_mma_unsupported(s: MoeDecodeShape, tiles: MmaTiles | None = None) -> str | None:
    """Why these kernels cannot run shape ``s`` with ``tiles`` (None: they can; ``tiles`` None:
    both kernels with the tiles of ``schedules/tiles.py``)."""
    if tiles is None:
        return expert_mma_unsupported(s, tuned("moe_expert_mma_gate_up")) or (
            expert_mma_unsupported(s, tuned("moe_expert_mma_down"))
        )
    if tiles.warps < 1 or tiles.blocks < 1 or tiles.rows < 16 or tiles.rows % 16:
        return f"bad tiles {tiles}"
    if tiles.depth < 1 or (tiles.depth > 1 and split_parts(tiles) > 1):
        return f"depth {tiles.depth} needs 1 <= depth, and depth 1 with a K split ({tiles})"
    if tiles.run not in (RUN, 2 * RUN):
        return f"run {tiles.run} is not {RUN} or {2 * RUN}"
    if tiles.chunk not in _CHUNKS:
        return f"chunk {tiles.chunk} is not one of {_CHUNKS} pairs"
    if tiles.tokens < 32 or tiles.tokens % 32 or tiles.tokens * (s.top_k + 1) > 32767:
        return (
            f"tokens {tiles.tokens} is not a positive multiple of 32 whose {s.top_k + 1} pairs a "
            "token a plan's 16-bit indices can count (tokens * (top_k + 1) <= 32767)"
        )
    for name, dim in (("hidden", s.hidden), ("inter", s.inter), ("shared", s.shared_inter)):
        if dim <= 0 or dim % RUN:
            return f"{name} {dim} is not a positive multiple of {RUN}"
        if dim % tiles.run and split_parts(tiles) > 1:
            return f"{name} {dim} leaves a tail of the run ({tiles.run}), which needs no K split"
    if s.group % 32 or s.hidden % s.group or s.inter % s.group or s.shared_inter % s.group:
        return f"group {s.group} is not a multiple of 32 dividing every width"
    widest = max(s.hidden, s.inter, s.shared_inter)
    plan = plan_bytes(s, tiles)
    if plan + 1024 > 48 * 1024:
        return (
            f"the plan of {tiles.tokens} tokens ({plan} bytes at {s.experts} experts, top-"
            f"{s.top_k}, {tiles.warps} warps) does not fit a block's 48 KB of static shared memory"
        )
    if _smem_bytes(tiles, widest, 2) + plan + 256 > _SHARED_LIMIT:
        return (
            f"{tiles.chunk} staged rows of {widest} fp16 values and the plan of {tiles.tokens} "
            f"tokens ({plan} bytes) do not fit in shared memory ({_SHARED_LIMIT} bytes)"
        )
    return None


def _smem_bytes(tiles: MmaTiles, width: int, tiles_a: int) -> int:
    """Shared memory besides the plan: the chunk's staged rows of ``width`` values, then (with a
    K split) its partial accumulators (``tiles_a`` A tiles x the n-tiles, a float per lane and
    fragment, per warp)."""
    red = 4 * tiles.warps * tiles_a * tiles.ntiles * 4 * 32 if split_parts(tiles) > 1 else 0
    return 4 * tiles.chunk * _stride(width) + red


def _dyn_request(s: MoeDecodeShape, tiles: MmaTiles, width: int, tiles_a: int) -> int:
    """Dynamic shared memory to ask for: none where the block's shared memory fits the static 48
    KB, else :func:`_smem_bytes` and at least 48 KB (TVM's launcher raises a kernel's dynamic
    limit only for requests of 48 KB and more)."""
    need = _smem_bytes(tiles, width, tiles_a)
    return 0 if need + plan_bytes(s, tiles) + 1024 <= 48 * 1024 else max(need, 48 * 1024)


def _head(name: str, params: str, tag: str, width: int, dyn: bool, red_floats: int, tm: int) -> str:
    """CUDA: a kernel's device function head: the plan, the staged rows ``xs`` and ``red`` (static,
    or in the module's fp16 dynamic shared memory with ``dyn``), the lane's fragment coordinates,
    the PDL wait."""
    XS = _stride(width)
    if dyn:
        smem = f"""half* __restrict__ smem_h,
    half* smem_end, long long n, int blk, int tid) {{
  __shared__ dsv2_em_plan_{tag} P;
  unsigned* xs = reinterpret_cast<unsigned*>(smem_h);  // [{tm}][XS], pair order
  float* red = reinterpret_cast<float*>(xs + {tm * XS});  // the K split's partials"""
    else:
        smem = f"""long long n, int blk, int tid) {{
  __shared__ dsv2_em_plan_{tag} P;
  __shared__ __align__(16) unsigned xs[{tm * XS}];  // [{tm}][XS], pair order
  __shared__ float red[{max(red_floats, 1)}];  // the K split's partials"""
    return f"""
__device__ __forceinline__ void {name}({params}, {smem}
  constexpr int XS = {XS};
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  (void)red;
  {WAIT_THEN_RELEASE}
"""


def gate_up_source(s: MoeDecodeShape, tiles: MmaTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of :func:`moe_gate_up_expert_mma`."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB, R = tiles.warps, tiles.blocks, tiles.rows
    T, TM, NT = 32 * W, tiles.chunk, tiles.ntiles
    tag = f"h{H}_i{NI}_s{IS}_e{E}_k{K}_g{G}_{tiles.name}_mma"
    name = f"dsv2_emm_gu_{tag}"
    total = K * NI + IS
    dyn = _dyn_request(s, tiles, H, 2) > 0
    red = (_smem_bytes(tiles, H, 2) - 4 * TM * _stride(H)) // 4
    params = """const half* __restrict__ x, const int* __restrict__ ids,
    const unsigned* __restrict__ w, const half* __restrict__ s, const unsigned* __restrict__ sw,
    const half* __restrict__ ss, half* __restrict__ hout"""
    rows = f"""          const unsigned* wr[2] = {{ew + (r + g) * {H // 8},
                                    ew + (r + up + g) * {H // 8}}};
          const half* sr[2] = {{es + (r + g) * {H // G}, es + (r + up + g) * {H // G}}};"""
    body = f"""{rows}
{tile_loop(str(H // 8), H, 2, G, tiles.depth, tiles.words, NT)}"""
    emit = f"""#pragma unroll
            for (int j = 0; j < 4; ++j) {{  // row r + g (+ 8), pair 2 t (+ 1)
              const int k = 2 * t + (j & 1);
              if (k < np) {{
                const int pr = P.pair[first + k], tok = pr / {K + 1}, slot = pr - tok * {K + 1};
                const float gv = acc[0][j], uv = acc[1][j];
                hout[(t0 + tok) * {total} + slot * {NI} + r + g + 8 * (j >> 1)] =
                    __float2half(gv / (1.f + __expf(-gv)) * uv);
              }}
            }}"""
    if NT > 1:  # n-tile jn: pairs 8 jn .. 8 jn + 7 (acc[jn]: gate, acc[NT + jn]: up)
        emit = f"""#pragma unroll
            for (int jn = 0; jn < {NT}; ++jn)
#pragma unroll
              for (int j = 0; j < 4; ++j) {{  // row r + g (+ 8), pair 8 jn + 2 t (+ 1)
                const int k = 8 * jn + 2 * t + (j & 1);
                if (k < np) {{
                  const int pr = P.pair[first + k], tok = pr / {K + 1};
                  const int slot = pr - tok * {K + 1};
                  const float gv = acc[jn][j], uv = acc[{NT} + jn][j];
                  hout[(t0 + tok) * {total} + slot * {NI} + r + g + 8 * (j >> 1)] =
                      __float2half(gv / (1.f + __expf(-gv)) * uv);
                }}
              }}"""
    loop_head = items_head(tag, TM, NB, tiles.tokens)
    src = f"""
#ifndef DSV2_EMM_GU_{tag}
#define DSV2_EMM_GU_{tag}
{_head(name, params, tag, H, dyn, red, TM)}  // row blocks of a routed / shared chunk
  const int rbr = {-(-NI // R)}, rbs = {-(-IS // R)};
{loop_head}      if (c != staged) {{  // the chunk's tokens' x rows, pair order
        __syncthreads();
        for (int v = tid; v < np * {H // 8}; v += {T}) {{
          const int k = v / {H // 8}, q = v - k * {H // 8};
          const uint4* row = reinterpret_cast<const uint4*>(
              x + (t0 + P.pair[first + k] / {K + 1}) * {H});
          dsv2_emm_stage(xs + k * XS + 4 * q, row[q]);
        }}
        __syncthreads();
        staged = c;
      }}
      const bool sh = e == {E};
      const unsigned* ew = sh ? sw : w + (long long)e * {2 * NI * (H // 8)};
      const half* es = sh ? ss : s + (long long)e * {2 * NI * (H // G)};
      const long long up = sh ? {IS} : {NI};
      const int r0 = rb * {R}, r1 = min(sh ? {IS} : {NI}, r0 + {R});
{item_units("r0", "r1", tiles, H // tiles.run, 2, body, emit)}    }}
    __syncthreads();  // this group's plan and rows are read no more
  }}
}}
#endif
"""
    head = dot32_source(16) + mma_source() + grid_wait_source()
    return name, head + plan_source(s, tag, tiles) + src


def down_source(s: MoeDecodeShape, tiles: MmaTiles) -> tuple[str, str]:
    """(device function name, CUDA source) of :func:`moe_down_expert_mma`."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    W, NB, R = tiles.warps, tiles.blocks, tiles.rows
    T, TM, NT = 32 * W, tiles.chunk, tiles.ntiles
    tag = f"h{H}_i{NI}_s{IS}_e{E}_k{K}_g{G}_{tiles.name}_mma"
    name = f"dsv2_emm_dn_{tag}"
    total = K * NI + IS
    widest = max(NI, IS)
    dyn = _dyn_request(s, tiles, widest, 1) > 0
    red = (_smem_bytes(tiles, widest, 1) - 4 * TM * _stride(widest)) // 4
    params = """const half* __restrict__ h, const int* __restrict__ ids,
    const unsigned* __restrict__ w, const half* __restrict__ s, const unsigned* __restrict__ sw,
    const half* __restrict__ ss, float* __restrict__ part"""

    def rows(width: int) -> str:
        return f"""          const unsigned* wr[1] = {{ew + (long long)(r + g) * {width // 8}}};
          const half* sr[1] = {{es + (long long)(r + g) * {width // G}}};"""

    def body(width: int) -> str:
        return f"""{rows(width)}
{tile_loop(str(width // 8), width, 1, G, tiles.depth, tiles.words, NT)}"""

    emit = f"""#pragma unroll
            for (int j = 0; j < 4; ++j) {{  // output r + g (+ 8), pair 2 t (+ 1)
              const int k = 2 * t + (j & 1);
              if (k < np) {{
                const int pr = P.pair[first + k], tok = pr / {K + 1}, slot = pr - tok * {K + 1};
                part[((t0 + tok) * {K + 1} + slot) * {H} + r + g + 8 * (j >> 1)] = acc[0][j];
              }}
            }}"""
    if NT > 1:  # n-tile jn: pairs 8 jn .. 8 jn + 7 (acc[jn])
        emit = f"""#pragma unroll
            for (int jn = 0; jn < {NT}; ++jn)
#pragma unroll
              for (int j = 0; j < 4; ++j) {{  // output r + g (+ 8), pair 8 jn + 2 t (+ 1)
                const int k = 8 * jn + 2 * t + (j & 1);
                if (k < np) {{
                  const int pr = P.pair[first + k], tok = pr / {K + 1};
                  const int slot = pr - tok * {K + 1};
                  part[((t0 + tok) * {K + 1} + slot) * {H} + r + g + 8 * (j >> 1)] = acc[jn][j];
                }}
              }}"""
    units = f"""      if (sh) {{
{item_units("r0", "r1", tiles, IS // tiles.run, 1, body(IS), emit)}      }} else {{
{item_units("r0", "r1", tiles, NI // tiles.run, 1, body(NI), emit)}      }}
"""
    src = f"""
#ifndef DSV2_EMM_DN_{tag}
#define DSV2_EMM_DN_{tag}
{_head(name, params, tag, widest, dyn, red, TM)}  const int rbr = {-(-H // R)}, rbs = rbr;
{items_head(tag, TM, NB, tiles.tokens)}      const bool sh = e == {E};
      const int width = sh ? {IS} : {NI};
      if (c != staged) {{  // the chunk's pairs' h slices, pair order
        __syncthreads();
        for (int v = tid; v < np * (width / 8); v += {T}) {{
          const int k = v / (width / 8), q = v - k * (width / 8);
          const int pr = P.pair[first + k], tok = pr / {K + 1}, slot = pr - tok * {K + 1};
          const uint4* row = reinterpret_cast<const uint4*>(h + (t0 + tok) * {total} + slot * {NI});
          dsv2_emm_stage(xs + k * XS + 4 * q, row[q]);
        }}
        __syncthreads();
        staged = c;
      }}
      const unsigned* ew = sh ? sw : w + (long long)e * {H * (NI // 8)};
      const half* es = sh ? ss : s + (long long)e * {H * (NI // G)};
      const int r0 = rb * {R}, r1 = min({H}, r0 + {R});
{units}    }}
    __syncthreads();  // this group's plan and rows are read no more
  }}
}}
#endif
"""
    head = dot32_source(16) + mma_source() + grid_wait_source()
    return name, head + plan_source(s, tag, tiles) + src


def gate_up_params(s: MoeDecodeShape) -> list:
    """The gate/up kernel's buffers (``token_grid_call`` parameters)."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    return [
        ("x", (TOKENS, H), "float16"),
        ("ids", (TOKENS, K), "int32"),
        ("w", (E, 2 * NI, H // 8), "uint32"),
        ("s", (E, 2 * NI, H // G), "float16"),
        ("sw", (2 * IS, H // 8), "uint32"),
        ("ss", (2 * IS, H // G), "float16"),
        ("hout", (TOKENS, K * NI + IS), "float16"),
    ]


def down_params(s: MoeDecodeShape) -> list:
    """The down kernel's buffers (``token_grid_call`` parameters)."""
    H, NI, IS, K, G, E = s.hidden, s.inter, s.shared_inter, s.top_k, s.group, s.experts
    return [
        ("h", (TOKENS, K * NI + IS), "float16"),
        ("ids", (TOKENS, K), "int32"),
        ("w", (E, H, NI // 8), "uint32"),
        ("s", (E, H, NI // G), "float16"),
        ("sw", (H, IS // 8), "uint32"),
        ("ss", (H, IS // G), "float16"),
        ("part", (TOKENS, K + 1, H), "float32"),
    ]


def _check(s: MoeDecodeShape, tiles: MmaTiles) -> None:
    why = expert_mma_unsupported(s, tiles)
    if why is not None:
        raise ValueError(f"the expert-major MMA MoE kernels cannot take {s}: {why}")


def moe_gate_up_expert_mma(s: MoeDecodeShape) -> tirx.PrimFunc:
    """``f(x [n, H] fp16, ids [n, K] int32, w [E, 2I, H/8] uint32, s [E, 2I, H/G] fp16,
    sw [2Is, H/8] uint32, ss [2Is, H/G] fp16, hout [n, K*I + Is] fp16)``: the routed slots'
    and the shared experts' SwiGLU intermediates (the layout of the token-major kernels), every
    expert's rows read once for its tokens, on tensor cores (module docstring, 1.), with the
    tiles of ``schedules/tiles.py``."""
    return gate_up_expert_mma_kernel(s, tuned("moe_expert_mma_gate_up"))


def gate_up_expert_mma_kernel(s: MoeDecodeShape, tiles: MmaTiles) -> tirx.PrimFunc:
    """:func:`moe_gate_up_expert_mma` with the given ``tiles``."""
    _check(s, tiles)
    name, src = gate_up_source(s, tiles)
    return token_grid_call(
        "moe_expert_mma_gate_up",
        name,
        src,
        gate_up_params(s),
        tiles.blocks,
        32 * tiles.warps,
        per_token=False,
        dyn_shared_bytes=_dyn_request(s, tiles, s.hidden, 2),
        dyn_dtype="float16",
    )


def moe_down_expert_mma(s: MoeDecodeShape) -> tirx.PrimFunc:
    """``f(h [n, K*I + Is] fp16, ids [n, K] int32, w [E, H, I/8] uint32, s [E, H, I/G] fp16,
    sw [H, Is/8] uint32, ss [H, Is/G] fp16, part [n, K + 1, H] float32)``: each routed slot's
    down projection ``part[t, j] = down_{ids[t, j]} . h[t, j]`` and the shared experts'
    ``part[t, K]``, unweighted, in float32, on tensor cores (module docstring, 2.), with the
    tiles of ``schedules/tiles.py``."""
    return down_expert_mma_kernel(s, tuned("moe_expert_mma_down"))


def down_expert_mma_kernel(s: MoeDecodeShape, tiles: MmaTiles) -> tirx.PrimFunc:
    """:func:`moe_down_expert_mma` with the given ``tiles``."""
    _check(s, tiles)
    name, src = down_source(s, tiles)
    return token_grid_call(
        "moe_expert_mma_down",
        name,
        src,
        down_params(s),
        tiles.blocks,
        32 * tiles.warps,
        per_token=False,
        dyn_shared_bytes=_dyn_request(s, tiles, max(s.inter, s.shared_inter), 1),
        dyn_dtype="float16",
    )

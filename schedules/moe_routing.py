"""The DeepSeekMoE router in one kernel: softmax, (group limit), top-k, renormalise or scale.

One row (token) per iteration, rows in parallel (CPU: a parallel loop over ``_route_row``; GPU:
one warp per token, the same selection by warp reductions and ranks, :func:`moe_route_gpu`;
:func:`moe_route` picks by target). Replaces Relax ``softmax`` + ``topk`` (whose LLVM lowering
calls ``tvm.contrib.sort.topk``, a function of the TVM *compiler* library that a runtime-only
deployment does not have) and the group mask with a single pass over the scores.

Semantics (original DeepSeek-V2 ``MoEGate``): ``p = softmax(logits)`` in float32; with
``group_limited_greedy``, groups are ranked by their max score, experts outside the ``topk_group``
best groups get score 0; the ``top_k`` best experts are chosen (ties: lowest index); weights are
renormalised (``norm_topk_prob`` and ``top_k > 1``, denominator + 1e-20) or multiplied by
``routed_scaling_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target


def _route_row(
    num_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
):  # -> a TVMScript macro
    """The routing of one row ``t``, shared by the CPU and GPU kernels.

    Scratch (per row): ``p[E]`` scores, ``taken[E]``, ``gtaken[G]``, ``acc[3]`` (max, sum, best
    score) and ``best[1]``.
    """
    E, K, G = num_experts, top_k, n_group
    per_group = E // G
    group_limited = G > 1 and topk_group < G
    TG = topk_group if group_limited else 1
    renorm = norm_topk_prob and K > 1
    scale = float(routed_scaling_factor)
    neg_inf = -3.0e38

    @T.macro
    def route_row(logits, weights, ids, t, p, taken, gtaken, acc, best):
        # softmax
        acc[0] = T.float32(neg_inf)
        for e in range(E):
            acc[0] = T.max(acc[0], logits[t, e])
        acc[1] = T.float32(0)
        for e in range(E):
            p[e] = T.exp(logits[t, e] - acc[0])
            acc[1] = acc[1] + p[e]
        for e in range(E):
            p[e] = p[e] / acc[1]
            taken[e] = 0
        # group limit: keep the experts of the topk_group groups with the best max score
        if group_limited:
            for g in range(G):
                gtaken[g] = 0
            for _j in range(TG):
                acc[2] = T.float32(neg_inf)
                best[0] = 0
                for g in range(G):
                    if gtaken[g] == 0:
                        for e in range(per_group):
                            if p[g * per_group + e] > acc[2]:
                                acc[2] = p[g * per_group + e]
                                best[0] = g
                gtaken[best[0]] = 1
            for e in range(E):
                if gtaken[e // per_group] == 0:
                    p[e] = T.float32(0)
        # top-k by repeated selection
        acc[1] = T.float32(0)
        for j in range(K):
            acc[2] = T.float32(neg_inf)
            best[0] = 0
            for e in range(E):
                if taken[e] == 0 and p[e] > acc[2]:
                    acc[2] = p[e]
                    best[0] = e
            taken[best[0]] = 1
            ids[t, j] = best[0]
            weights[t, j] = acc[2]
            acc[1] = acc[1] + acc[2]
        for j in range(K):
            if renorm:
                weights[t, j] = weights[t, j] / (acc[1] + T.float32(1e-20))
            else:
                weights[t, j] = weights[t, j] * T.float32(scale)

    return route_row


def moe_route_cpu(
    num_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tirx.PrimFunc:
    """``f(logits[n, E] f32, weights[n, k] f32, ids[n, k] i32)`` for the LLVM target."""
    E, K, G = num_experts, top_k, n_group
    route_row = _route_row(E, K, G, topk_group, norm_topk_prob, routed_scaling_factor)

    @T.prim_func(private=True, s_tir=True)
    def moe_route(var_logits: T.handle, var_weights: T.handle, var_ids: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, E), "float32")
        weights = T.match_buffer(var_weights, (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, K), "int32")
        for t in T.parallel(n):
            with T.sblock("route"):
                T.reads()
                T.writes()
                p = T.sblock_alloc_buffer((E,), "float32")
                taken = T.sblock_alloc_buffer((E,), "int32")
                gtaken = T.sblock_alloc_buffer((G,), "int32")
                acc = T.sblock_alloc_buffer((3,), "float32")
                best = T.sblock_alloc_buffer((1,), "int32")
                route_row(logits, weights, ids, t, p, taken, gtaken, acc, best)

    return moe_route


GPU_WARPS_PER_BLOCK = 4


def _route_warp_source(
    tag: str, E: int, K: int, G: int, TG: int, renorm: bool, scale: float
) -> str:
    """CUDA source of ``dsv2_route_<tag>(logits_row, weights_row, ids_row, lane, scratch)``:
    the routing of one token by one warp (``_route_row``'s semantics), ``scratch`` E floats of
    shared memory of the warp. Softmax by warp reductions; the group limit and the top-k by
    ranks instead of k rounds of arg-max reductions: every lane ranks its own experts against
    all E scores in shared memory (``rank = #{f: p_f > p_e or (p_f == p_e and f < e)}``, the
    selection order of ``_route_row``, ties to the lowest index), and the expert of rank
    ``j < K`` is written to slot ``j``: independent loads instead of k chains of shuffles."""
    per = E // G
    npl = (E + 31) // 32
    limited = G > 1 and TG < G
    group_limit = (
        f"""
  {{
    float gm = NEG;
    if (lane < {G}) {{
      for (int f = lane * {per}; f < (lane + 1) * {per}; ++f) gm = fmaxf(gm, sp[f]);
    }}
    int grank = 0;
    for (int g = 0; g < {G}; ++g) {{
      const float v = __shfl_sync(0xffffffffu, gm, g);
      grank += (v > gm || (v == gm && g < lane)) ? 1 : 0;
    }}
    const unsigned keep = __ballot_sync(0xffffffffu, lane < {G} && grank < {TG});
    __syncwarp();
#pragma unroll
    for (int i = 0; i < {npl}; ++i) {{
      const int e = lane + 32 * i;
      if (e < {E} && !((keep >> (e / {per})) & 1u)) {{ p[i] = 0.f; sp[e] = 0.f; }}
    }}
    __syncwarp();
  }}"""
        if limited
        else ""
    )
    finish = "w[j] / (total + 1e-20f)" if renorm else f"w[j] * {scale!r}f"
    return f"""
#ifndef DSV2_ROUTE_{tag}
#define DSV2_ROUTE_{tag}
__device__ __forceinline__ void dsv2_route_{tag}(const float* __restrict__ lg,
    float* __restrict__ w, int* __restrict__ ids, int lane, float* __restrict__ sp) {{
  const float NEG = -3.0e38f;
  float p[{npl}];
  float m = NEG;
#pragma unroll
  for (int i = 0; i < {npl}; ++i) {{
    const int e = lane + 32 * i;
    p[i] = e < {E} ? lg[e] : NEG;
    m = fmaxf(m, p[i]);
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < {npl}; ++i) {{
    p[i] = lane + 32 * i < {E} ? expf(p[i] - m) : 0.f;
    s += p[i];
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
#pragma unroll
  for (int i = 0; i < {npl}; ++i) {{
    p[i] = p[i] / s;
    if (lane + 32 * i < {E}) sp[lane + 32 * i] = p[i];
  }}
  // slots no rank fills (NaN scores break the order) keep expert 0 with weight 0, as the CPU
  // router would pick expert 0: never an uninitialised id
  if (lane < {K}) {{ ids[lane] = 0; w[lane] = 0.f; }}
  __syncwarp();{group_limit}
  int rank[{npl}];
#pragma unroll
  for (int i = 0; i < {npl}; ++i) rank[i] = 0;
  for (int f = 0; f < {E}; ++f) {{
    const float v = sp[f];
#pragma unroll
    for (int i = 0; i < {npl}; ++i)
      rank[i] += (v > p[i] || (v == p[i] && f < lane + 32 * i)) ? 1 : 0;
  }}
#pragma unroll
  for (int i = 0; i < {npl}; ++i) {{
    if (lane + 32 * i < {E} && rank[i] < {K}) {{
      ids[rank[i]] = lane + 32 * i;
      w[rank[i]] = p[i];
    }}
  }}
  __syncwarp();
  if (lane == 0) {{
    float total = 0.f;
    for (int j = 0; j < {K}; ++j) total += w[j];
    for (int j = 0; j < {K}; ++j) w[j] = {finish};
  }}
  __syncwarp();
}}
#endif
"""


def route_warp_source(
    num_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[str, str]:
    """(name, CUDA source) of the device function ``name(logits_row, weights_row, ids_row,
    lane, scratch)`` that routes one token with one warp (``scratch``: ``num_experts`` floats of
    shared memory for the warp); the router of :func:`moe_route_gpu`, and of kernels that route
    inside (:mod:`dsv2_mlc.schedules.moe_decode_cuda`)."""
    G = n_group
    TG = topk_group if (G > 1 and topk_group < G) else G
    if TG < G and G > 32:
        raise ValueError(f"the warp router ranks at most 32 groups, not {G}")
    renorm = norm_topk_prob and top_k > 1
    scale_tag = repr(float(routed_scaling_factor)).replace(".", "p").replace("-", "m")
    scale_tag = scale_tag.replace("+", "")  # the exact constant: kernels differ by their name
    tag = f"e{num_experts}_k{top_k}_g{G}_t{TG}_{'n' if renorm else 's' + scale_tag}"
    src = _route_warp_source(tag, num_experts, top_k, G, TG, renorm, float(routed_scaling_factor))
    return f"dsv2_route_{tag}", src


@dataclass(frozen=True)
class RouterShape:
    """The router of one MoE layer: what the warp router (:func:`route_warp_source`) takes."""

    experts: int  # E
    top_k: int  # K
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def warp_source(self) -> tuple[str, str]:
        """(name, CUDA source) of the warp router for this router (:func:`route_warp_source`)."""
        return route_warp_source(
            self.experts, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
            self.routed_scaling_factor,
        )  # fmt: skip


def moe_route_gpu(
    num_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tirx.PrimFunc:
    """The same routing for GPU targets: one warp per token (``GPU_WARPS_PER_BLOCK`` tokens per
    block); softmax by warp reductions, the group limit and the top-k by ranks over the scores
    in shared memory (CUDA source through ``T.cuda.func_call``, :func:`route_warp_source`). At
    batch 1 this is 32 lanes instead of one thread serially scanning the experts k times."""
    E, K = num_experts, top_k
    WPB = GPU_WARPS_PER_BLOCK
    route, src = route_warp_source(
        num_experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
    )
    # the warps' scratch is declared in CUDA: a TIR buffer seen only through address_of would be
    # shrunk to the elements TIR sees indexed
    fname = f"{route}_block{WPB}"
    src += f"""
#ifndef {fname.upper()}
#define {fname.upper()}
__device__ __forceinline__ void {fname}(const float* __restrict__ lg, float* __restrict__ w,
    int* __restrict__ ids, int tid) {{
  __shared__ float scratch[{WPB * E}];
  {route}(lg, w, ids, tid & 31, scratch + (tid >> 5) * {E});
}}
#endif
"""

    @T.prim_func(private=True, s_tir=True)
    def moe_route(var_logits: T.handle, var_weights: T.handle, var_ids: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, E), "float32")
        weights = T.match_buffer(var_weights, (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, K), "int32")
        for bx in T.thread_binding((n + WPB - 1) // WPB, thread="blockIdx.x"):
            for tx in T.thread_binding(WPB * 32, thread="threadIdx.x"):
                with T.sblock("route"):
                    T.reads()
                    T.writes()
                    if bx * WPB + tx // 32 < n:
                        T.cuda.func_call(
                            fname,
                            T.address_of(logits[bx * WPB + tx // 32, 0]),
                            T.address_of(weights[bx * WPB + tx // 32, 0]),
                            T.address_of(ids[bx * WPB + tx // 32, 0]),
                            tx,
                            source_code=src,
                        )

    return moe_route


def moe_route(
    target: Target | None,
    num_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tirx.PrimFunc:
    """The router kernel for ``target``: :func:`moe_route_gpu` if it has the ``gpu`` key, else
    :func:`moe_route_cpu` (also for ``target=None``)."""
    gpu = target is not None and "gpu" in target.keys
    make = moe_route_gpu if gpu else moe_route_cpu
    return make(num_experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)

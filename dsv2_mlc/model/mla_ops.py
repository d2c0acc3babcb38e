"""MLA's small per-token operators as single kernels: latent norm + RoPE, and the two absorptions.

Each replaces a chain of Relax ops (and launches) that decode runs 27 times per token:

* :func:`latent_norm_rope`: the ``[c_kv, k_pe]`` columns of the fused ``qkv_a_proj`` output ->
  the cached latent ``[RMSNorm(c_kv), rope(k_pe)]`` in one kernel (was split + rms_norm + rope +
  concatenate);
* :func:`absorb_query`: the query heads ``[n, H * (nope + R)]`` -> the latent-space query
  ``[q_nope @ W_UK, rope(q_pe)]`` ``[n, H, L + R]`` as the Relax composition (split, transpose,
  batched matmul, rope, concatenate);
* :func:`mla_prologue`: on CUDA, both of the above (the latent-space query and the cached latent)
  in one hand kernel (:mod:`dsv2_mlc.schedules.mla_prologue_cuda`), for decode and extend;
* :func:`absorb_value`: the attention output over latents ``[n, H, L]`` -> ``o @ W_UV^T``
  ``[n, H * V]`` as one GEMV-shaped reduction tagged for the decode GEMV schedule (was transpose,
  batched matmul, transpose); on CUDA at decode a hand kernel whose weights load before it
  waits for its input (:mod:`dsv2_mlc.schedules.prefetch_gemv_cuda`).

All accumulate in float32 and round once, as the compositions they replace do.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..schedules.decode_gemv_cuda import DECODE_GEMV
from ..schedules.mla_prologue_cuda import mla_prologue_cuda
from ..schedules.prefetch_gemv_cuda import absorb_v_decode, absorb_v_unsupported
from .config import DeepseekV2Config
from .rope import apply_rope, rotate_pair

__all__ = [
    "absorb_query",
    "absorb_value",
    "has_prologue_kernel",
    "latent_norm_rope",
    "latent_norm_rope_te",
    "mla_prologue",
]


def latent_norm_rope_te(
    x: te.Tensor, w: te.Tensor, tab: te.Tensor, lora: int, eps: float, offset: int = 0
) -> te.Tensor:
    """The TE of :func:`latent_norm_rope`: ``[w * RMSNorm(c_kv), rope(k_pe)]`` ``[n, L + R]``
    from the columns ``[offset, offset + L + R)`` of ``x``, ``tab`` the cos/sin table."""
    latent_dim = lora + tab.shape[1]
    r = te.reduce_axis((0, lora), name="r")
    sq = te.compute(
        (x.shape[0],),
        lambda t: te.sum(
            x[t, offset + r].astype("float32") * x[t, offset + r].astype("float32"), axis=r
        ),
        name="latent_sq",
    )

    def f(t: Expr, c: Expr) -> Expr:
        inv = tirx.rsqrt(sq[t] / tirx.const(lora, "float32") + tirx.const(eps, "float32"))
        xc = x[t, offset + c].astype("float32")
        normed = w[tirx.min(c, lora - 1)] * (xc * inv).astype(x.dtype)
        d = tirx.max(c - lora, 0)
        pair = d // 2
        cos, sin = tab[t, pair * 2], tab[t, pair * 2 + 1]
        even = x[t, offset + lora + pair * 2].astype("float32")
        odd = x[t, offset + lora + pair * 2 + 1].astype("float32")
        rotated = rotate_pair(d, even, odd, cos, sin).astype(x.dtype)
        return tirx.Select(c < lora, normed, rotated)

    return te.compute((x.shape[0], latent_dim), f, name="latent_norm_rope")


def latent_norm_rope(
    kv: Tensor, offset: int, weight: Tensor, rope: Tensor, cfg: DeepseekV2Config, eps: float
) -> Tensor:
    """``[c_kv, k_pe]`` at columns ``[offset, offset + L + R)`` of ``kv`` -> ``[n, L + R]``
    ``[weight * RMSNorm(c_kv), rope(k_pe)]`` (same dtype); ``rope`` is the tokens'
    :func:`~dsv2_mlc.model.rope.rope_table`. Reading at an offset lets it take the fused
    ``qkv_a_proj`` output as it is (no split kernel)."""
    lora = cfg.kv_lora_rank

    def compute(x: te.Tensor, w: te.Tensor, tab: te.Tensor) -> te.Tensor:
        return latent_norm_rope_te(x, w, tab, lora, eps, offset)

    return nn.tensor_expr_op(compute, "latent_norm_rope", [kv, weight, rope])


def absorb_query(q: Tensor, w_uk: Tensor, rope: Tensor, cfg: DeepseekV2Config) -> Tensor:
    """``q [n, H * (nope + R)]`` -> ``[q_nope @ W_UK, rope(q_pe)]`` ``[n, H, L + R]`` (``rope``:
    the tokens' :func:`~dsv2_mlc.model.rope.rope_table`)."""
    n, heads = q.shape[0], cfg.num_attention_heads
    nope, rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope, q_pe = op.split(op.reshape(q, (n, heads, nope + rope_dim)), [nope], axis=2)
    q_pe = apply_rope(q_pe, rope, "rope_q")
    q_abs = op.permute_dims(op.matmul(op.permute_dims(q_nope, [1, 0, 2]), w_uk), [1, 0, 2])
    return op.concat([q_abs, q_pe], dim=2)


def has_prologue_kernel(target: Target | None) -> bool:
    """Whether :func:`mla_prologue` can run for ``target`` (CUDA)."""
    return target is not None and target.kind.name == "cuda"


def mla_prologue(
    q: Tensor,
    kv: Tensor,
    kv_offset: int,
    w_uk: Tensor,
    norm_weight: Tensor,
    rope: Tensor,
    cfg: DeepseekV2Config,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """One CUDA kernel for :func:`absorb_query` of the query heads at columns ``[0, H * (nope +
    R))`` of ``q`` and :func:`latent_norm_rope` of ``kv`` from column ``kv_offset``: returns
    ``(q_lat [n, H, L + R], latent [n, L + R])`` (``q`` and ``kv`` may be the same tensor)."""
    n, heads, lora = q.shape[0], cfg.num_attention_heads, cfg.kv_lora_rank
    kernel = mla_prologue_cuda(
        heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        lora,
        q.dtype,
        q_width=int(q.shape[1]),
        kv_width=int(kv.shape[1]),
        kv_offset=kv_offset,
        eps=eps,
    )
    q_lat, latent = op.tensor_ir_op(
        kernel,
        "mla_prologue",
        args=[q, kv, w_uk, norm_weight, rope],
        out=[
            Tensor.placeholder((n, heads, cfg.latent_dim), q.dtype),
            Tensor.placeholder((n, cfg.latent_dim), q.dtype),
        ],
    )
    return q_lat, latent


def absorb_value(o_lat: Tensor, w_uv: Tensor, decode: bool) -> Tensor:
    """``o_lat [n, H, L]`` x ``W_UV [H, V, L]`` -> ``[n, H * V]`` (``out[t, h*V + v] =
    sum_c o_lat[t, h, c] * W_UV[h, v, c]``). ``decode``: one GEMV-shaped kernel for the decode
    schedule; otherwise (extend: many rows) the batched matmul, which dlight tiles."""
    heads, v_dim, lora = (int(d) for d in w_uv.shape)
    cuda = has_prologue_kernel(Target.current(allow_none=True))
    if decode and cuda and o_lat.dtype == "float16" and w_uv.dtype == "float16":
        if absorb_v_unsupported(heads, v_dim, lora) is None:
            # weights loaded before the kernel waits for o_lat (prefetch_gemv_cuda)
            return op.tensor_ir_op(
                absorb_v_decode(heads, v_dim, lora),
                "absorb_v_decode",
                args=[o_lat, w_uv],
                out=Tensor.placeholder((o_lat.shape[0], heads * v_dim), o_lat.dtype),
            )
    if not decode:
        n, heads, _ = o_lat.shape
        out = op.matmul(op.permute_dims(o_lat, [1, 0, 2]), op.permute_dims(w_uv, [0, 2, 1]))
        return op.reshape(op.permute_dims(out, [1, 0, 2]), (n, heads * w_uv.shape[1]))

    def compute(o: te.Tensor, w: te.Tensor) -> te.Tensor:
        n, heads, lora = o.shape
        v_dim = w.shape[1]
        r = te.reduce_axis((0, lora), name="r")
        acc = te.compute(
            (n, heads * v_dim),
            lambda t, hv: te.sum(
                o[t, hv // v_dim, r].astype("float32")
                * w[hv // v_dim, hv % v_dim, r].astype("float32"),
                axis=r,
            ),
            name="absorb_v_acc",
            attrs=dict([DECODE_GEMV]),
        )
        if o.dtype == "float32":
            return acc
        return te.compute(acc.shape, lambda *i: acc(*i).astype(o.dtype), name="absorb_v")

    return nn.tensor_expr_op(compute, "absorb_v", [o_lat, w_uv])

"""MLA's small per-token operators as single kernels: latent norm + RoPE, and the two absorptions.

Each replaces a chain of Relax ops (and launches) that decode runs 27 times per token:

* :func:`latent_norm_rope`: the ``[c_kv, k_pe]`` columns of the fused ``qkv_a_proj`` output ->
  the cached latent ``[RMSNorm(c_kv), rope(k_pe)]`` in one kernel (instead of split + rms_norm
  + rope + concatenate);
* :func:`absorb_query`: the query heads ``[n, H * (nope + R)]`` -> the latent-space query
  ``[q_nope @ W_UK, rope(q_pe)]`` ``[n, H, L + R]`` as the Relax composition (split, transpose,
  batched matmul, rope, concatenate);
* :func:`mla_prologue`: on CUDA, both of the above (the latent-space query and the cached latent)
  in one hand kernel (:mod:`dsv2_mlc.schedules.mla_prologue_cuda`), for decode and extend;
* :func:`prefill_query` / :func:`prefill_key`: prefill's full-head query (RoPE on each head's
  last ``R`` values) and key (``k_nope`` + the token's ``k_pe``) read in place from their
  sources (instead of split, split + rope + concatenate, broadcast + concatenate); on CUDA each is a
  vectorised hand kernel (:mod:`dsv2_mlc.schedules.prefill_qk_cuda`);
* :func:`absorb_value`: the attention output over latents ``[n, H, L]`` -> ``o @ W_UV^T``
  ``[n, H * V]`` as one GEMV-shaped reduction tagged for the decode GEMV schedule (instead of
  transpose, batched matmul, transpose); on CUDA at decode a hand kernel whose weights load
  before it waits for its input (:mod:`dsv2_mlc.schedules.prefetch_gemv_cuda`).

All accumulate in float32 and round once, as the compositions they replace do.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..rope import apply_rope, rotate_pair
from ..schedules.decode_gemv_cuda import DECODE_GEMV
from ..schedules.mla_prologue_cuda import mla_prologue_cuda
from ..schedules.prefetch_gemv_cuda import absorb_v_decode, absorb_v_unsupported
from ..schedules.prefill_qk_cuda import KEY_ATTR, QUERY_ATTR
from .config import DeepseekV2Config

__all__ = [
    "absorb_query",
    "absorb_value",
    "has_prologue_kernel",
    "latent_norm_rope",
    "latent_norm_rope_te",
    "mla_prologue",
    "prefill_key",
    "prefill_key_te",
    "prefill_query",
    "prefill_query_te",
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
    :func:`~dsv2_mlc.rope.rope_table`. Reading at an offset lets it take the fused
    ``qkv_a_proj`` output as it is (no split kernel)."""
    lora = cfg.kv_lora_rank

    def compute(x: te.Tensor, w: te.Tensor, tab: te.Tensor) -> te.Tensor:
        return latent_norm_rope_te(x, w, tab, lora, eps, offset)

    return nn.tensor_expr_op(compute, "latent_norm_rope", [kv, weight, rope])


def absorb_query(q: Tensor, w_uk: Tensor, rope: Tensor, cfg: DeepseekV2Config) -> Tensor:
    """``q [n, H * (nope + R)]`` -> ``[q_nope @ W_UK, rope(q_pe)]`` ``[n, H, L + R]`` (``rope``:
    the tokens' :func:`~dsv2_mlc.rope.rope_table`)."""
    n, heads = q.shape[0], cfg.num_attention_heads
    nope, rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope, q_pe = op.split(op.reshape(q, (n, heads, nope + rope_dim)), [nope], axis=2)
    q_pe = apply_rope(q_pe, rope, "rope_q")
    q_abs = op.permute_dims(op.matmul(op.permute_dims(q_nope, [1, 0, 2]), w_uk), [1, 0, 2])
    return op.concat([q_abs, q_pe], dim=2)


def prefill_query_te(x: te.Tensor, tab: te.Tensor, heads: int, nope: int) -> te.Tensor:
    """The TE of :func:`prefill_query` (``tab``: ``[n, R]`` cos/sin)."""
    qk, dtype = nope + int(tab.shape[1]), x.dtype

    def f(t: Expr, h: Expr, d: Expr) -> Expr:
        p = tirx.max(d - nope, 0)  # the index in the roped part
        pair = p // 2
        cos, sin = tab[t, pair * 2], tab[t, pair * 2 + 1]
        even = x[t, h * qk + nope + pair * 2].astype("float32")
        odd = x[t, h * qk + nope + pair * 2 + 1].astype("float32")
        rotated = rotate_pair(p, even, odd, cos, sin).astype(dtype)
        return tirx.Select(d < nope, x[t, h * qk + d], rotated)

    return te.compute((x.shape[0], heads, qk), f, name="prefill_query")


def prefill_query(q: Tensor, rope: Tensor, cfg: DeepseekV2Config) -> Tensor:
    """The query heads at columns ``[0, H * (nope + R))`` of ``q`` -> ``[n, H, nope + R]`` with
    RoPE on each head's last ``R`` values (``rope``: the tokens' ``rope_table``), as
    ``apply_rope`` computes it (float32, one rounding)."""
    heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim

    def compute(x: te.Tensor, tab: te.Tensor) -> te.Tensor:
        return prefill_query_te(x, tab, heads, nope)

    width = int(q.shape[1])
    return nn.tensor_expr_op(compute, "prefill_query", [q, rope], attrs={QUERY_ATTR: width})


def prefill_key_te(kn: te.Tensor, lat: te.Tensor, heads: int, rope_dim: int) -> te.Tensor:
    """The TE of :func:`prefill_key`."""
    nope = int(kn.shape[1]) // heads
    lora = int(lat.shape[1]) - rope_dim

    def f(t: Expr, h: Expr, d: Expr) -> Expr:
        own = kn[t, h * nope + tirx.min(d, nope - 1)]
        return tirx.Select(d < nope, own, lat[t, lora + tirx.max(d - nope, 0)])

    return te.compute((kn.shape[0], heads, nope + rope_dim), f, name="prefill_key")


def prefill_key(k_nope: Tensor, latent: Tensor, cfg: DeepseekV2Config) -> Tensor:
    """``k_nope [n, H * nope]`` and the cached latent ``[n, L + R]`` -> the key ``[n, H, nope +
    R]``: each head's ``k_nope``, then the token's roped ``k_pe`` (``latent[:, L:]``)."""
    heads, rope_dim = cfg.num_attention_heads, cfg.qk_rope_head_dim

    def compute(kn: te.Tensor, lat: te.Tensor) -> te.Tensor:
        return prefill_key_te(kn, lat, heads, rope_dim)

    return nn.tensor_expr_op(compute, "prefill_key", [k_nope, latent], attrs={KEY_ATTR: 1})


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

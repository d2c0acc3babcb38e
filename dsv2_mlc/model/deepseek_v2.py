"""The DeepSeek-V2 graph in ``tvm.relax.frontend.nn``: MLA (optional q-LoRA), DeepSeekMoE, YaRN.

Entry points (all batched over sequences; the paged KV cache knows which sequences are in the
batch from ``begin_forward``):

* ``batch_prefill(input_ids[1, n], logit_positions[m], cache)``: new sequences only. Non-absorbed
  attention over the new tokens (ragged, causal). Returns logits ``[1, m, vocab]`` (float32) at the
  given flat token positions.
* ``batch_extend(...)``: same signature, for batches where some sequence already has cached
  tokens (chunked prefill, multi-turn): the ragged attention is merged with absorbed attention over
  the cached latent pages.
* ``batch_decode(input_ids[b, 1], cache)``: one new token per sequence; absorbed attention
  (``q_nope . W_UK``, attention over latent pages, ``. W_UV``). Returns ``[b, 1, vocab]``.
* ``batch_decode_expert_major(input_ids[b, 1], cache)`` (CUDA builds): the same step with the
  MoE blocks' expert-major kernels instead of the fused per-token ones, for batches (each expert
  the batch selects read once for all its tokens).
* ``batch_decode_gemm(input_ids[b, 1], cache)``: the same step for large batches (on CUDA):
  the absorbed attention of ``batch_decode``, everything else as ``batch_extend`` runs it (dense
  projections as GEMMs, the routed experts as expert-sorted grouped GEMMs on tensor cores, or,
  where the tile table's ``decode_gemm`` entry says ``moe="expert_major"``, the MoE blocks as
  ``batch_decode_expert_major`` runs them).
* ``batch_decode_swap(input_ids[b, 1], cache)`` (sm_90 CUDA builds): ``batch_decode_gemm``
  with the routed experts as expert-sorted grouped GEMMs over tiles of a few tokens, the weights
  as the MMA's M (the largest batches).
* ``create_paged_kv_cache(...)``: the MLA latent cache (only ``kv_lora_rank + rope`` values per
  token per layer), in pages of 16 tokens.

Parameter names are the Hugging Face names, except where a checkpoint tensor is stored
transformed (see ``weights.py``): fused ``gate_up_proj``, ``self_attn.qkv_a_proj`` (``q_proj`` or
``q_a_proj`` rows, then ``kv_a_proj_with_mqa`` rows), stacked routed experts, and ``kv_b_proj``
split into ``kv_b_proj.w_uk`` / ``kv_b_proj.w_uv``.
"""

from __future__ import annotations

from typing import Any, Literal

from tvm import te, tirx
from tvm.ir import IRModule
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache
from tvm.target import Target

from ..quant.decode_linear import int4_decode_gemv, int4_group
from ..rope import rope_table
from ..schedules.argmax import greedy_argmax
from ..schedules.moe_swap_cuda import swap_target
from ..schedules.norm_gemv_cuda import add_norm_gemv_q4, add_norm_router, add_norm_unsupported
from ..schedules.rms_norm_cuda import RMS_NORM_ATTR  # the RMSNorm kernels' tag (epsilon)
from .attrs import ENTRY_KIND_ATTR
from .config import DeepseekV2Config
from .kv_cache import KVFormat, MLAPagedKVCache
from .mla_ops import (
    absorb_query,
    absorb_value,
    has_prologue_kernel,
    latent_norm_rope,
    mla_prologue,
    prefill_key,
    prefill_query,
)
from .moe import DeepseekV2MLP, DeepseekV2MoE

# "decode_gemm": a decode step (absorbed attention over the pages, which already hold the new
# token) whose projections and experts run the prefill path's GEMMs (``batch_decode_gemm``).
Mode = Literal["prefill", "extend", "decode", "decode_gemm"]
# How a MoE layer's experts run in a decode step: "auto" as the mode runs them (decode: the fused
# per-token kernels; decode_gemm: the tile table's ``decode_gemm`` entry), "expert_major" (each
# expert the batch selects read once: ``batch_decode_expert_major``), "swap" (grouped GEMMs with
# the weights as the MMA's M: ``batch_decode_swap``).
MoePath = Literal["auto", "expert_major", "swap"]

# DeepSeek's q_a_layernorm / kv_a_layernorm use a fixed epsilon, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def rms_norm_te(x: te.Tensor, weight: te.Tensor, eps: float, name: str = "rms_norm") -> te.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last axis, reduced in float32."""
    d = x.shape[-1]
    r = te.reduce_axis((0, d), name="r")
    sq = te.compute(
        x.shape[:-1],
        lambda *i: te.sum(x(*i, r).astype("float32") * x(*i, r).astype("float32"), r),
        name=f"{name}_sq",
    )

    def f(*i: Expr) -> Expr:
        inv = tirx.rsqrt(sq(*i[:-1]) / d.astype("float32") + tirx.const(eps, "float32"))
        return weight[i[-1]] * (x(*i).astype("float32") * inv).astype(x.dtype)

    return te.compute(x.shape, f, name=name)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis in float32: ``weight * (x * rsqrt(mean(x^2) + eps))``."""

    def __init__(self, dim: int, eps: float, dtype: str):
        self.weight = nn.Parameter((dim,), dtype)
        self.eps = eps

    def forward(self, x: Tensor, cols: int | None = None) -> Tensor:
        """The norm of ``x``, or with ``cols`` of its leading ``cols`` columns only (read in
        place from a wider ``x``: no split kernel)."""
        eps = self.eps
        if cols is None:
            return nn.tensor_expr_op(
                lambda xt, wt: rms_norm_te(xt, wt, eps),
                "rms_norm",
                [x, self.weight],
                attrs={RMS_NORM_ATTR: eps},
            )

        def leading(xt: te.Tensor, wt: te.Tensor) -> te.Tensor:
            head = te.compute((*xt.shape[:-1], cols), lambda *i: xt(*i), name="leading")
            return rms_norm_te(head, wt, eps)

        return nn.tensor_expr_op(leading, "rms_norm_leading", [x, self.weight])


class KVBProj(nn.Module):
    """``kv_b_proj`` split per head into the up-projections of the latent: W_UK and W_UV."""

    def __init__(self, cfg: DeepseekV2Config, dtype: str):
        h, c = cfg.num_attention_heads, cfg.kv_lora_rank
        self.w_uk = nn.Parameter((h, cfg.qk_nope_head_dim, c), dtype)
        self.w_uv = nn.Parameter((h, cfg.v_head_dim, c), dtype)


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention with the latent kept in a paged cache."""

    def __init__(self, cfg: DeepseekV2Config, layer_id: int, dtype: str):
        self.cfg = cfg
        self.layer_id = layer_id
        self.kv = KVFormat()  # the cache's format (DeepseekV2ForCausalLM sets it)
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        # q_proj (or q-LoRA's q_a_proj) and kv_a_proj_with_mqa read the same x: one matmul,
        # query rows first (weights.py).
        self.qkv_a_proj = nn.Linear(h, cfg.q_a_dim + cfg.latent_dim, bias=False, dtype=dtype)
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = nn.Linear(
                cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False, dtype=dtype
            )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = KVBProj(cfg, dtype)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False, dtype=dtype)

    def forward(
        self,
        x: Tensor,
        rope: Tensor,
        cache: PagedKVCache,
        mode: Mode,
        qkv: Tensor | None = None,
    ) -> tuple[Tensor, PagedKVCache]:
        """x: [n, hidden] (all tokens of the batch), rope: [n, R] float32 (the tokens'
        ``rope_table``) -> ([n, hidden], cache). ``qkv``: ``qkv_a_proj(x)`` when the caller
        computed it (with the norm folded in: ``DeepseekV2DecoderLayer.forward_decode``)."""
        cfg = self.cfg
        n = x.shape[0]
        heads = cfg.num_attention_heads
        lora, v_dim, scale = cfg.kv_lora_rank, cfg.v_head_dim, cfg.softmax_scale

        # [n, q_a_dim + L + R]: the query heads (q-LoRA: q_a), then c_kv and k_pe
        if qkv is None:
            qkv = self.qkv_a_proj(x)
        if cfg.q_lora_rank is None:
            q_src = qkv  # the query heads at columns [0, H * (nope + R))
        else:
            q_src = self.q_b_proj(self.q_a_layernorm(qkv, cols=cfg.q_lora_rank))
        norm_w = self.kv_a_layernorm.weight
        fused = mode != "prefill" and has_prologue_kernel(Target.current(allow_none=True))
        if fused:  # the latent-space query and the cached latent in one kernel (mla_ops)
            q_lat, latent = mla_prologue(
                q_src, qkv, cfg.q_a_dim, self.kv_b_proj.w_uk, norm_w, rope, cfg, LORA_NORM_EPS
            )
        else:  # the cached latent [RMSNorm(c_kv), rope(k_pe)], one kernel (mla_ops)
            latent = latent_norm_rope(qkv, cfg.q_a_dim, norm_w, rope, cfg, LORA_NORM_EPS)
        cache = self.kv.append(cache, self.layer_id, latent, lora)
        if mode != "prefill" and not fused:  # the query heads alone [n, H * (nope + R)]
            q = q_src if cfg.q_lora_rank is not None else op.split(qkv, [cfg.q_a_dim], axis=1)[0]

        out = None
        if mode not in ("decode", "decode_gemm"):
            # Non-absorbed (prefill) attention over the new tokens: decompress the latent.
            c_kv = op.split(latent, [lora], axis=1)[0]
            k_nope = op.matmul(c_kv, op.permute_dims(op.reshape(self.kv_b_proj.w_uk, (-1, lora))))
            value = op.matmul(c_kv, op.permute_dims(op.reshape(self.kv_b_proj.w_uv, (-1, lora))))
            value = op.reshape(value, (1, n, heads, v_dim))
            # [n, H, nope + R] each, read in place (mla_ops; on CUDA one hand kernel each)
            key = op.reshape(prefill_key(k_nope, latent, cfg), (1, n, heads, cfg.qk_head_dim))
            query = op.reshape(prefill_query(q_src, rope, cfg), (1, n, heads, cfg.qk_head_dim))
            out, lse = cache.self_attention(self.layer_id, query, key, value, scale)
        if mode != "prefill":
            # Absorbed attention over the cached latent pages.
            if not fused:
                q_lat = absorb_query(q, self.kv_b_proj.w_uk, rope, cfg)
            q_lat = op.reshape(q_lat, (1, n, heads, cfg.latent_dim))
            o_lat, lse_lat = self.kv.cross_attention(cache, self.layer_id, q_lat, lora, scale)
            o_cross = absorb_value(
                op.reshape(o_lat, (n, heads, lora)), self.kv_b_proj.w_uv, mode == "decode"
            )
            o_cross = op.reshape(o_cross, (1, n, heads, v_dim))
            if out is None:
                out = o_cross
            else:
                out, _ = cache.merge_attn_output_inplace(out, lse, o_cross, lse_lat)
        out = op.reshape(out, (n, heads * v_dim))
        proj = int4_decode_gemv(self.o_proj, out, "o_proj_decode") if mode == "decode" else None
        return (self.o_proj(out) if proj is None else proj), cache


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm decoder layer: MLA, then the dense MLP or DeepSeekMoE."""

    def __init__(self, cfg: DeepseekV2Config, layer_id: int, dtype: str):
        self.self_attn = DeepseekV2Attention(cfg, layer_id, dtype)
        if cfg.is_moe_layer(layer_id):
            self.mlp = DeepseekV2MoE(cfg, dtype)
        else:
            self.mlp = DeepseekV2MLP(cfg.hidden_size, cfg.intermediate_size, dtype, dense=True)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: Tensor, rope: Tensor, cache: PagedKVCache, mode: Mode, moe: MoePath = "auto"
    ) -> tuple[Tensor, PagedKVCache]:
        """``moe``: how a MoE layer's experts run (:data:`MoePath`)."""
        attn, cache = self.self_attn(self.input_layernorm(x), rope, cache, mode)
        x = x + attn
        xn = self.post_attention_layernorm(x)
        is_moe = isinstance(self.mlp, DeepseekV2MoE)
        x = x + (self.mlp(xn, mode, moe) if is_moe else self.mlp(xn, mode))
        return x, cache

    def forward_decode(
        self,
        r: Tensor,
        d: Tensor | None,
        rope: Tensor,
        cache: PagedKVCache,
        moe: MoePath = "auto",
    ) -> tuple[Tensor, Tensor, PagedKVCache]:
        """Decode on CUDA (fp16) with each residual add + RMSNorm folded into the kernel that
        reads the norm (:mod:`dsv2_mlc.schedules.norm_gemv_cuda`): the INT4 ``qkv_a_proj`` and
        the MoE router. The hidden state is ``r + d`` (``d``: the previous
        layer's output, None before the first layer); returns ``(r', d', cache)``, the next
        layer's. ``moe``: how the experts run (:data:`MoePath`)."""
        proj, norm = self.self_attn.qkv_a_proj, self.input_layernorm
        n, h = r.shape
        q4 = int4_group(proj)
        if q4 is not None and add_norm_unsupported(proj.in_features, q4):
            q4 = None  # the add + RMSNorm GEMV does not take this row length
        if d is not None and q4 is not None:
            qkv, s = op.tensor_ir_op(
                add_norm_gemv_q4(h, proj.out_features, q4, norm.eps),
                "add_norm_qkv_a",
                args=[r, d, norm.weight, proj.q_weight, proj.q_scale],
                out=[
                    Tensor.placeholder((n, proj.out_features), r.dtype),
                    Tensor.placeholder((n, h), r.dtype),
                ],
            )
        else:
            s = r if d is None else r + d
            xn = norm(s)
            qkv = int4_decode_gemv(proj, xn, "qkv_a_decode")
            qkv = proj(xn) if qkv is None else qkv
        mlp, post = self.mlp, self.post_attention_layernorm
        attn, cache = self.self_attn(s, rope, cache, "decode", qkv=qkv)
        if not isinstance(mlp, DeepseekV2MoE):
            s = s + attn
            return s, mlp(post(s), "decode"), cache
        experts = mlp.gate.weight.shape[0]
        logits, xn, s = op.tensor_ir_op(
            add_norm_router(h, experts, post.eps),
            "add_norm_router",
            args=[s, attn, post.weight, mlp.gate.weight],
            out=[
                Tensor.placeholder((n, experts), "float32"),
                Tensor.placeholder((n, h), r.dtype),
                Tensor.placeholder((n, h), r.dtype),
            ],
        )
        return s, mlp.forward_with_logits(xn, logits, "decode", moe), cache


class DeepseekV2Model(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.*``)."""

    def __init__(self, cfg: DeepseekV2Config, dtype: str):
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            [DeepseekV2DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV2ForCausalLM(nn.Module):
    """The whole model with its entry points (see the module docstring)."""

    def __init__(
        self, cfg: DeepseekV2Config, dtype: str, target: Target, kv: KVFormat | None = None
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.target = target
        self.kv = kv or KVFormat()  # the latent cache's element format
        self.model = DeepseekV2Model(cfg, dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        for layer in self.model.layers:
            layer.self_attn.kv = self.kv

    def _body(
        self, input_ids: Tensor, cache: PagedKVCache, mode: Mode, moe: MoePath = "auto"
    ) -> tuple[Tensor, Any]:
        n = input_ids.shape[0] * input_ids.shape[1]
        x = op.reshape(self.model.embed_tokens(op.reshape(input_ids, (n,))), (n, -1))
        # One RoPE cos/sin table per forward pass, read by every layer.
        positions = cache.get_query_positions(n)
        rope = rope_table(positions, self.cfg.rope, self.cfg.qk_rope_head_dim)
        if mode == "decode" and self._fold_norms(x):
            r, d = x, None
            for layer in self.model.layers:
                r, d, cache = layer.forward_decode(r, d, rope, cache, moe)
            return r + d, cache
        for layer in self.model.layers:
            x, cache = layer(x, rope, cache, mode, moe)
        return x, cache

    def _fold_norms(self, x: Tensor) -> bool:
        """Whether decode folds the residual adds + RMSNorms into the kernels that read them
        (``DeepseekV2DecoderLayer.forward_decode``): CUDA, fp16, a hidden size they take."""
        target = Target.current(allow_none=True)
        cuda = target is not None and target.kind.name == "cuda"
        return cuda and x.dtype == "float16" and add_norm_unsupported(x.shape[-1]) is None

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(x)).astype("float32")

    def _prefill(
        self, input_ids: Tensor, logit_positions: Tensor, cache: PagedKVCache, mode: Mode
    ) -> tuple[Tensor, PagedKVCache]:
        x, cache = self._body(input_ids, cache, mode)
        x = op.take(x, logit_positions, axis=0)
        logits = self._logits(x)
        return op.reshape(logits, (1, logit_positions.shape[0], self.cfg.vocab_size)), cache

    def batch_prefill(
        self, input_ids: Tensor, logit_positions: Tensor, paged_kv_cache: PagedKVCache
    ) -> tuple[Tensor, PagedKVCache]:
        """Prefill of sequences with nothing cached yet (see module docstring)."""
        return self._prefill(input_ids, logit_positions, paged_kv_cache, "prefill")

    def batch_extend(
        self, input_ids: Tensor, logit_positions: Tensor, paged_kv_cache: PagedKVCache
    ) -> tuple[Tensor, PagedKVCache]:
        """Prefill of a chunk for sequences that may already have cached tokens."""
        return self._prefill(input_ids, logit_positions, paged_kv_cache, "extend")

    def batch_decode(
        self, input_ids: Tensor, paged_kv_cache: PagedKVCache
    ) -> tuple[Tensor, PagedKVCache]:
        """One token for each sequence of the batch (absorbed attention)."""
        return self._decode(input_ids, paged_kv_cache, "auto")

    def batch_decode_gemm(
        self, input_ids: Tensor, paged_kv_cache: PagedKVCache
    ) -> tuple[Tensor, PagedKVCache]:
        """``batch_decode`` for large batches: the absorbed attention over the
        pages as there, the projections, ``lm_head`` and the routed experts as the prefill path
        runs them (GEMMs that read each weight once for the batch's tokens); the engine runs it
        for decode steps of ``Engine.gemm_decode_from`` sequences and more."""
        return self._decode_gemm(input_ids, paged_kv_cache, "auto")

    def batch_decode_swap(
        self, input_ids: Tensor, paged_kv_cache: PagedKVCache
    ) -> tuple[Tensor, PagedKVCache]:
        """``batch_decode_gemm`` with the routed experts as the grouped GEMMs whose MMAs take
        the weights as M and a few tokens as N (:mod:`dsv2_mlc.schedules.moe_swap_cuda`, sm_90
        builds with INT4 experts; elsewhere the same step as ``batch_decode_gemm``): the engine
        runs it for decode steps of ``Engine.swap_decode_from`` sequences and more."""
        return self._decode_gemm(input_ids, paged_kv_cache, "swap")

    def _decode_gemm(
        self, input_ids: Tensor, cache: PagedKVCache, moe: MoePath
    ) -> tuple[Tensor, PagedKVCache]:
        x, cache = self._body(input_ids, cache, "decode_gemm", moe)
        logits = self._logits(x)
        return op.reshape(logits, (input_ids.shape[0], 1, self.cfg.vocab_size)), cache

    def batch_decode_expert_major(
        self, input_ids: Tensor, paged_kv_cache: PagedKVCache
    ) -> tuple[Tensor, PagedKVCache]:
        """``batch_decode`` with the MoE blocks' expert-major kernels (CUDA builds only): each
        expert the batch selects is read once for all its tokens, where the fused decode
        kernels read every token's experts; the engine runs it for batches of
        ``Engine.expert_major_from`` sequences and more."""
        return self._decode(input_ids, paged_kv_cache, "expert_major")

    def _decode(
        self, input_ids: Tensor, cache: PagedKVCache, moe: MoePath
    ) -> tuple[Tensor, PagedKVCache]:
        x, cache = self._body(input_ids, cache, "decode", moe)
        logits = self._logits(x)
        return op.reshape(logits, (input_ids.shape[0], 1, self.cfg.vocab_size)), cache

    def greedy_tokens(self, logits: Tensor) -> Tensor:
        """Greedy decoding on the device: ``logits`` [b, 1, vocab] float32 (``batch_decode``'s
        output) -> the arg-max token of each row [b] int32 (``np.argmax``: ties to the lowest
        id, a NaN above every number); 4 bytes per sequence to copy to the host."""
        return op.tensor_ir_op(
            greedy_argmax(self.target),
            "greedy_argmax",
            args=[logits],
            out=Tensor.placeholder((logits.shape[0],), "int32"),
        )

    def create_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        """The MLA latent cache for every layer."""
        cfg = self.cfg
        return MLAPagedKVCache(
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            dtype=self.dtype,
            target=self.target,
            kv_dtype=self.kv.kv_dtype,
            kv_scale=self.kv.kv_scale,
        )

    # What each entry point runs; passes read it from the function attribute ENTRY_KIND_ATTR.
    ENTRY_KINDS = {
        "batch_prefill": "prefill",
        "batch_extend": "extend",
        "batch_decode": "decode",
        "batch_decode_expert_major": "decode",
        # the passes give it the extend path's GEMMs (cuBLAS, dequantised weights, lm_head too)
        "batch_decode_gemm": "decode_gemm",
        "batch_decode_swap": "decode_gemm",
    }

    def _swap_applies(self) -> bool:
        """Whether ``batch_decode_swap`` would differ from ``batch_decode_gemm``: the MoE layers'
        experts take the grouped GEMMs of decode batches (INT4 at shapes they take, under the
        current target); elsewhere the entry is not exported."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV2MoE):
                takes = getattr(layer.mlp.experts, "swap_takes", None)
                return takes is not None and takes(self.dtype)
        return False

    def annotate_entries(self, mod: IRModule) -> IRModule:
        """``mod`` (this model's export) with each entry point's kind as a function attribute."""
        for gv, func in list(mod.functions_items()):
            if gv.name_hint in self.ENTRY_KINDS:
                mod[gv] = func.with_attr(ENTRY_KIND_ATTR, self.ENTRY_KINDS[gv.name_hint])
        return mod

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        """The export spec of the entry points."""
        cache = nn.spec.Object(object_type=PagedKVCache)
        packed = {"param_mode": "packed", "effect_mode": "none"}
        prefill = {
            "input_ids": nn.spec.Tensor([1, "seq_len"], "int32"),
            "logit_positions": nn.spec.Tensor(["num_logits"], "int32"),
            "paged_kv_cache": cache,
            "$": packed,
        }
        decode = {
            "input_ids": nn.spec.Tensor(["batch_size", 1], "int32"),
            "paged_kv_cache": cache,
            "$": packed,
        }
        spec = {
            "batch_prefill": prefill,
            "batch_extend": dict(prefill),
            "batch_decode": decode,
            "batch_decode_gemm": dict(decode),
            "create_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
            "greedy_tokens": {
                "logits": nn.spec.Tensor(["batch_size", 1, self.cfg.vocab_size], "float32"),
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        if self.target.kind.name == "cuda":  # (elsewhere no such kernels: it would be a copy)
            spec["batch_decode_expert_major"] = dict(decode)
        if swap_target(self.target) and self._swap_applies():  # (wgmma kernels: sm_90, INT4)
            spec["batch_decode_swap"] = dict(decode)
        return nn.spec.ModuleSpec.from_raw(spec, self)

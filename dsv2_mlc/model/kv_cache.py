"""The paged KV cache for DeepSeek-V2 MLA (multi-head latent attention).

Only the latent is cached: per token and layer one row ``[compressed_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]``. The cache object is TVM's C++ ``PagedAttentionKVCache``
(``vm.builtin.paged_attention_kv_cache_create``); this module chooses its kernels:

* LLVM target: the CPU kernels of :mod:`dsv2_mlc.schedules.mla_cpu` (TVM 0.27 has no MLA kernels
  for LLVM) plus TVM's ``_attention_prefill_ragged_cpu`` for the non-absorbed self-attention.
* CUDA target: TVM's own ``TIRPagedKVCache(attn_kind="mla")`` with three of its kernels replaced
  by ours where they support the shapes (TVM's stay where they do not): the MLA attention slot
  (absorbed decode and the cross-attention of extend) by the split-KV kernel of
  :mod:`dsv2_mlc.schedules.mla_attention_cuda` (schedules/results/mla_attention.md), which
  gives extends of many rows a sequence to the row-tiled kernel of
  :mod:`dsv2_mlc.schedules.mla_extend_cuda` (schedules/results/mla_extend.md); the
  ragged-prefill slot (the causal ``self_attention``) by the tensor-core flash-attention kernel
  of :mod:`dsv2_mlc.schedules.prefill_attention_cuda` (float16, head dims multiples of 16;
  schedules/results/prefill_attention.md); the latent append (``f_transpose_append_mla``) by
  :mod:`dsv2_mlc.schedules.mla_append_cuda`'s, which lets the split-KV kernel start while it
  waits.

**FP8 cache** (``kv_dtype="float8_e4m3fn"``, ``--kv-dtype fp8``): the latent part of a row in
e4m3 bytes (read as ``byte * kv_scale``), the rope part in the build's dtype. The C++ cache
needs the query, output and appended rows in the pages' dtype, so it is told the build's dtype
with ``k`` latent bytes a slot, ``k H`` heads and rows of ``L / k + R`` slots
(:mod:`dsv2_mlc.schedules.kv_fp8`); :class:`KVFormat` is the model's side of it (build the rows
before ``append_mla_kv``, pad and reshape the query / reshape the output to those pseudo-heads).
Its kernels: the FP8 variants of the MLA attention (CPU: ``mla_paged_attention_fp8_cpu``; CUDA:
the split-KV kernel's FP8 block, on V2's shapes its tensor-core block, which decodes each page
in shared memory before its MMAs, and for long extends the row-tiled kernel's FP8 variant, which
does the same a key tile), the byte-copying
append / page copy / compaction at the slot width, TVM's merge of partial states at the
pseudo-heads (exact: each head's ``lse`` is written to all its pseudo-heads), and for the
ragged (self-attention) slot and ``merge_attn_output_inplace`` the kernels of the real head
count (the self-attention reads the new tokens' unrounded latents, not the cache).

Use it through the fine-grained ``PagedKVCache`` API (the model applies RoPE itself):

* ``append_mla_kv(layer, kv[b, s, 1, kv_lora_rank + rope])`` writes the rows at once;
* ``self_attention(layer, q, k, v, sm_scale)``: causal, non-absorbed, over the new tokens only,
  ``q/k[b, s, H, nope + rope]``, ``v[b, s, H, v_head_dim]``;
* ``cross_attention(layer, q_absorbed[b, s, H, kv_lora_rank + rope], kv_lora_rank, sm_scale)``:
  non-causal, over the cached pages; the output is in latent space (project it with W_UV);
* ``merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)`` at width ``v_head_dim``.

Runtime rules (read from ``paged_kv_cache.cc``, checked in ``tests/test_mla_kv_cache.py``):

* Cross-attention sees the new tokens only when the runtime *appends before attention*: every
  append length of ``begin_forward`` is 1, no sliding window, and at the last block depth the
  batch's block pages over the pages after coalescing consecutive equal blocks is < 32 (it is
  not when 32+ consecutive sequences of the batch share their second block). Then
  ``append_mla_kv`` must run before ``cross_attention``. Otherwise the page table is the one
  before the append and the new tokens must come from ``self_attention`` (+ merge).
* If no sequence in the batch has a cached page, ``cross_attention`` runs no kernel and leaves
  its outputs uninitialised: do not call it for a batch of fresh sequences. In a mixed batch the
  rows of fresh sequences get ``out = 0`` and ``lse = -inf``, which the merges handle.
* ``lse`` is in base 2. The CPU kernels take the page size from the pages (any size works); on
  CUDA, TVM's kernels need ``page_size == 16``. ``support_sliding_window`` must be 0.
"""

from dataclasses import dataclass
from typing import Any

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import (
    AttnKind,
    PagedKVCache,
    RopeMode,
    TIRPagedKVCache,
    _attention_prefill_ragged,
    _attention_prefill_ragged_cpu,
    _kv_cache_debug_get_kv_mla,
    _merge_state_inplace,
)
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map
from tvm.target import Target

from dsv2_mlc.schedules.kv_fp8 import (
    FP8_KV_DTYPE,
    fp8_cache_dims,
    fp8_query_width,
    quantize_latent,
    slot_values,
)
from dsv2_mlc.schedules.mla_append_cuda import mla_append_cuda, mla_append_cuda_supports
from dsv2_mlc.schedules.mla_attention_cuda import (
    mla_attention_cuda,
    mla_attention_cuda_supports,
)
from dsv2_mlc.schedules.mla_cpu import (
    compact_kv_copy_mla_cpu,
    copy_single_page_mla_cpu,
    kv_cache_transpose_append_mla_cpu,
    merge_state_inplace_cpu,
    mla_paged_attention_cpu,
    mla_paged_attention_fp8_cpu,
)
from dsv2_mlc.schedules.mla_extend_cuda import with_extend_path
from dsv2_mlc.schedules.prefill_attention_cuda import (
    prefill_attention_cuda,
    prefill_attention_cuda_supports,
)

__all__ = ["KVFormat", "MLAPagedKVCache"]

IntLike = int | tvm.ir.Expr
# The names TIRPagedKVCache gives the kernels of the slots we replace.
_TVM_MLA_SLOT_FUNC = "tir_attention_prefill_mla"
_TVM_RAGGED_SLOT_FUNC = "tir_attention_prefill_ragged"
_TVM_APPEND_FUNC = "kv_cache_transpose_append_mla"  # f_transpose_append_mla (a bare function)
_TVM_MERGE_V_FUNC = "tir_attention_merge_state_mla"  # the merge at v_head_dim width


@dataclass(frozen=True)
class KVFormat:
    """The latent cache's element format: ``kv_dtype`` "" (the build's dtype) or
    ``float8_e4m3fn`` with the static ``kv_scale`` (:mod:`dsv2_mlc.schedules.kv_fp8`). Its
    methods are the model's side of the cache calls that depend on it."""

    kv_dtype: str = ""
    kv_scale: float = 1.0

    @property
    def fp8(self) -> bool:
        """Whether the cache stores e4m3 bytes."""
        return self.kv_dtype == FP8_KV_DTYPE

    def append(self, cache: PagedKVCache, layer_id: int, latent: Tensor, lora: int) -> PagedKVCache:
        """``append_mla_kv`` of the rows ``latent [n, lora + R]`` (FP8: the cache's rows built
        first, the latent encoded and packed into slots of the activation dtype, the rope part
        copied; kv_fp8's storage)."""
        n, width = latent.shape
        if self.fp8:
            target = Target.current(allow_none=True)
            cuda = target is not None and target.kind.name != "llvm"
            rope = int(width) - lora
            _, width, _ = fp8_cache_dims(1, lora, rope, latent.dtype)
            latent = op.tensor_ir_op(
                quantize_latent(lora, rope, latent.dtype, self.kv_scale, cuda),
                "quantize_latent_e4m3",
                args=[latent],
                out=Tensor.placeholder((n, width), latent.dtype),
            )
        return cache.append_mla_kv(layer_id, op.reshape(latent, (1, n, 1, width)))

    def cross_attention(
        self, cache: PagedKVCache, layer_id: int, q_lat: Tensor, lora: int, sm_scale: float
    ) -> tuple[Tensor, Tensor]:
        """``cross_attention`` of ``q_lat [1, n, H, L + R]``: ``(o [1, n, H, L], lse [1, n,
        H])`` (FP8: through the cache's pseudo-heads, the query padded; kv_fp8's storage)."""
        if not self.fp8:
            return cache.cross_attention(layer_id, q_lat, lora, sm_scale)
        _, n, heads, width = q_lat.shape
        rope = int(width) - lora
        k = slot_values(q_lat.dtype)
        _, row, _ = fp8_cache_dims(1, lora, rope, q_lat.dtype)
        q = op.pad(q_lat, [0, 0, 0, 0, 0, 0, 0, fp8_query_width(lora, rope, q_lat.dtype) - width])
        q = op.reshape(q, (1, n, heads * k, row))
        o, lse = cache.cross_attention(layer_id, q, lora // k, sm_scale)
        lse = op.split(op.reshape(lse, (1, n, heads, k)), k, axis=3)[0]
        return op.reshape(o, (1, n, heads, lora)), op.reshape(lse, (1, n, heads))


def _replace_slot(create: rx.Call, slot_func: str, slot: rx.Tuple | rx.GlobalVar) -> rx.Call:
    """``create`` (the ``paged_attention_kv_cache_create`` call of ``TIRPagedKVCache``) with its
    kernel slot ``("tirx", <slot_func>)`` (or its bare function argument ``<slot_func>``, given
    a GlobalVar) replaced by ``slot``."""

    if slot_func == _TVM_MERGE_V_FUNC:  # a field of the merge-function tuple
        merge = [
            i
            for i, arg in enumerate(create.args)
            if isinstance(arg, rx.Tuple)
            and any(isinstance(f, rx.GlobalVar) and f.name_hint == slot_func for f in arg.fields)
        ]
        if len(merge) != 1:
            raise RuntimeError(f"TIRPagedKVCache: expected one {slot_func} tuple")
        args = list(create.args)
        fields = [
            slot if isinstance(f, rx.GlobalVar) and f.name_hint == slot_func else f
            for f in args[merge[0]].fields
        ]
        args[merge[0]] = rx.Tuple(fields)
        return rx.Call(create.op, args, create.attrs, create.ty_args)

    def is_slot(arg: rx.Expr) -> bool:
        if isinstance(slot, rx.GlobalVar):
            return isinstance(arg, rx.GlobalVar) and arg.name_hint == slot_func
        return (
            isinstance(arg, rx.Tuple)
            and len(arg.fields) == 2
            and isinstance(arg.fields[1], rx.GlobalVar)
            and arg.fields[1].name_hint == slot_func
        )

    hits = [i for i, arg in enumerate(create.args) if is_slot(arg)]
    if len(hits) != 1:
        raise RuntimeError(
            f"TIRPagedKVCache: expected one {slot_func} slot, found {len(hits)} "
            "(TVM's kv_cache.py changed?)"
        )
    args = list(create.args)
    args[hits[0]] = slot
    return rx.Call(create.op, args, create.attrs, create.ty_args)


def _tir_cache_class(slots: dict[str, rx.Tuple | rx.GlobalVar]) -> type[TIRPagedKVCache]:
    """``TIRPagedKVCache``, or with ``slots`` (TVM's slot function name -> our slot): a subclass
    whose create call gets those slots. ``TIRPagedKVCache.__init__`` ends in
    ``super().__init__(_expr=<create call>)``; the hook class sits next in the MRO, so it sees
    the call before it is emitted."""
    if not slots:
        return TIRPagedKVCache

    class _SlotHook(PagedKVCache):  # pylint: disable=too-few-public-methods
        def __init__(self, _expr: rx.Expr, _name: str) -> None:
            for slot_func, slot in slots.items():
                _expr = _replace_slot(_expr, slot_func, slot)
            super().__init__(_expr=_expr, _name=_name)

    class _TIRPagedKVCacheOurs(TIRPagedKVCache, _SlotHook):  # pylint: disable=too-few-public-methods
        pass

    return _TIRPagedKVCacheOurs


class MLAPagedKVCache(PagedKVCache):  # pylint: disable=too-few-public-methods
    """A paged MLA latent cache, built for an LLVM (CPU kernels) or a CUDA target.

    Construct it inside the exported ``create_paged_kv_cache`` method. The first five arguments
    are that method's runtime ints (``tirx.Var``) or Python ints. ``page_size`` must be 16 on
    CUDA (TVM's kernels hard-code it); the CPU kernels read it from the page tensor.
    ``support_sliding_window`` must be 0 at runtime (the C++ cache rejects sliding window for MLA).
    On CUDA the attention, ragged-prefill and append kernels are ours where
    ``mla_attention_cuda_supports``, ``prefill_attention_cuda_supports`` and
    ``mla_append_cuda_supports`` accept the shapes, TVM's otherwise (module docstring).
    """

    def __init__(  # pylint: disable=too-many-arguments,too-many-locals
        self,
        *,
        max_batch_size: IntLike,
        max_total_seq_len: IntLike,
        prefill_chunk_size: IntLike,
        page_size: IntLike,
        support_sliding_window: IntLike,
        num_hidden_layers: int,
        num_attention_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        dtype: str,
        target: Target,
        name: str = "paged_kv_cache",
        kv_dtype: str = "",
        kv_scale: float = 1.0,
    ) -> None:
        d_qk = kv_lora_rank + qk_rope_head_dim
        heads = num_attention_heads
        fp8 = kv_dtype == FP8_KV_DTYPE
        if kv_dtype not in ("", dtype, FP8_KV_DTYPE):
            raise ValueError(f"KV cache dtype {kv_dtype!r}: use {dtype} or {FP8_KV_DTYPE}")
        # What the C++ cache is told: for FP8, kv_fp8's storage (slots of e4m3 bytes)
        heads_c, d_c, lora_c = (
            fp8_cache_dims(heads, kv_lora_rank, qk_rope_head_dim, dtype)
            if fp8
            else (heads, d_qk, kv_lora_rank)
        )
        if target.kind.name != "llvm":
            slots: dict[str, rx.Tuple | rx.GlobalVar] = {}
            d_orig = qk_nope_head_dim + qk_rope_head_dim
            bb = rx.BlockBuilder.current()
            if target.kind.name == "cuda" and prefill_attention_cuda_supports(
                heads, heads, d_orig, v_head_dim, dtype
            ):
                func = prefill_attention_cuda(heads, heads, d_orig, v_head_dim, dtype)
                gv = bb.add_func(func, "tir_attention_prefill_ragged_flash")
                slots[_TVM_RAGGED_SLOT_FUNC] = rx.Tuple([tvm.ir.StringImm("tirx"), gv])
            elif fp8:  # TVM's, for the real head count (TIRPagedKVCache's would take heads_c)
                func = _attention_prefill_ragged(
                    heads, heads, d_orig, v_head_dim, dtype, {}, target
                )
                gv = bb.add_func(func, "tir_attention_prefill_ragged_fp8_cache")
                slots[_TVM_RAGGED_SLOT_FUNC] = rx.Tuple([tvm.ir.StringImm("tirx"), gv])
            mla_kv = {"kv_scale": kv_scale} if fp8 else {}
            arch = str(target.attrs.get("arch", "")) or None  # the tiles by architecture
            if mla_attention_cuda_supports(
                heads, kv_lora_rank, qk_rope_head_dim, dtype, **mla_kv, arch=arch
            ):
                func = mla_attention_cuda(
                    heads, kv_lora_rank, qk_rope_head_dim, dtype, **mla_kv, arch=arch
                )
                if target.kind.name == "cuda":  # long extends: the row-tiled kernel
                    func = with_extend_path(
                        func, heads, kv_lora_rank, qk_rope_head_dim, dtype, **mla_kv
                    )
                gv = bb.add_func(func, "tir_attention_mla_split_kv")
                slots[_TVM_MLA_SLOT_FUNC] = rx.Tuple([tvm.ir.StringImm("tirx"), gv])
            elif fp8:
                raise ValueError(
                    f"an FP8 KV cache needs the split-KV MLA kernel, which does not take "
                    f"{heads} heads of {kv_lora_rank} + {qk_rope_head_dim} {dtype} values"
                )
            if target.kind.name == "cuda" and mla_append_cuda_supports(d_c, dtype):
                # the append that releases the split kernel before its wait (mla_append_cuda)
                slots[_TVM_APPEND_FUNC] = bb.add_func(
                    mla_append_cuda(d_c, dtype), "mla_append_release_first"
                )
            if fp8:  # the merge of merge_attn_output_inplace, for the real head count
                func = _merge_state_inplace(
                    heads, v_head_dim, dtype, target, "tir_attention_merge_state_v"
                )
                slots[_TVM_MERGE_V_FUNC] = bb.add_func(func, "tir_attention_merge_state_v")
            tir_cache = _tir_cache_class(slots)(
                attn_kind="mla",
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=support_sliding_window,
                layer_partition=rx.ShapeExpr([0, num_hidden_layers]),
                num_hidden_layers=num_hidden_layers,
                num_attention_heads=heads_c,
                num_key_value_heads=1,
                qk_head_dim=d_c,
                v_head_dim=lora_c,
                mla_original_qk_head_dim=qk_nope_head_dim + qk_rope_head_dim,
                mla_original_v_head_dim=v_head_dim,
                rope_mode=RopeMode.NONE,
                rope_scale=1,
                rope_theta=10000,
                rope_scaling={},
                rope_ext_factors=rx.prim_value(0),
                rotary_dim=qk_rope_head_dim,
                enable_disaggregation=False,
                dtype=dtype,
                target=target,
                name=name,
            )
            super().__init__(_expr=tir_cache._expr, _name=name)  # pylint: disable=protected-access
            return

        bb = rx.BlockBuilder.current()

        def tir(func: tirx.PrimFunc, func_name: str) -> rx.GlobalVar:
            return bb.add_func(func, func_name)

        def tir_slot(func: tirx.PrimFunc, func_name: str) -> rx.Tuple:
            return rx.Tuple([tvm.ir.StringImm("tirx"), tir(func, func_name)])

        ragged = _attention_prefill_ragged_cpu(
            heads, heads, qk_nope_head_dim + qk_rope_head_dim, v_head_dim, dtype, {}
        )
        args: list[Any] = [
            rx.ShapeExpr(
                [
                    max_batch_size,
                    max_total_seq_len,
                    prefill_chunk_size,
                    page_size,
                    support_sliding_window,
                ]
            ),
            rx.ShapeExpr([0, num_hidden_layers]),  # layer_indptr (no pipeline parallelism)
            rx.prim_value(heads_c),  # num_qo_heads
            rx.prim_value(1),  # num_kv_heads: one shared latent "head"
            rx.prim_value(d_c),  # qk_head_dim: width of a cached row
            rx.prim_value(lora_c),  # v_head_dim: width of the cross-attention output
            rx.ShapeExpr([int(AttnKind.MLA)] * num_hidden_layers),
            rx.prim_value(False),  # enable_kv_transfer
            rx.prim_value(int(RopeMode.NONE)),  # the model applies RoPE itself
            rx.prim_value(1.0),  # rotary_scale (unused)
            rx.prim_value(10000.0),  # rotary_theta (unused)
            rx.prim_value(0),  # rope_ext_factors: none
            rx.op.zeros((), dtype),  # gives the cache its dtype and device
            rx.prim_value(0),  # f_transpose_append_mha: none
            tir(kv_cache_transpose_append_mla_cpu(d_c, dtype), "kv_cache_append_mla_cpu"),
            tir_slot(ragged, "tir_attention_prefill_ragged_mla_cpu"),
            *[rx.Tuple([]) for _ in range(6)],  # MHA paged prefill/decode/sliding/tree slots
            tir_slot(
                mla_paged_attention_fp8_cpu(heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_scale)
                if fp8
                else mla_paged_attention_cpu(heads, kv_lora_rank, qk_rope_head_dim, dtype),
                "tir_attention_paged_mla_cpu",
            ),
            rx.Tuple(
                [
                    # [0]: merges cross-attention depths (latent width),
                    # [1]: merge_attn_output_inplace (v_head_dim width).
                    tir(merge_state_inplace_cpu(dtype, lora_c), "tir_merge_state_latent_cpu"),
                    tir(merge_state_inplace_cpu(dtype, v_head_dim), "tir_merge_state_v_cpu"),
                ]
            ),
            # f_split_rotary: only used by attention_with_fused_qkv (MHA); never called for MLA.
            tir(
                llama_rope_with_position_map(
                    10000.0, 1.0, d_qk, heads, 1, dtype, {}, qk_rope_head_dim
                ),
                "tir_split_rotary_unused",
            ),
            tir(copy_single_page_mla_cpu(d_c, dtype), "kv_cache_copy_single_page_mla_cpu"),
            tir(_kv_cache_debug_get_kv_mla(num_hidden_layers, d_c, dtype), "kv_cache_debug_mla"),
            tir(compact_kv_copy_mla_cpu(d_c, dtype), "kv_cache_compact_kv_copy_mla_cpu"),
        ]
        super().__init__(
            _expr=rx.call_pure_packed(
                "vm.builtin.paged_attention_kv_cache_create", *args, ty_args=rx.AnyType()
            ),
            _name=name,
        )

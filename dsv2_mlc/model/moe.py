"""DeepSeekMoE: fp32 softmax gate, greedy / group-limited top-k routing, routed + shared experts.

Routed experts are stacked per layer (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I], the layout transformers keeps internally) and addressed through the top-k expert ids,
so the expert kernels read weights by indirection (expert id -> weights), never as 64 separate
parameters. Routing (one kernel: softmax, group limit, top-k, renormalise or scale) follows the
original DeepSeek-V2 code, including ``norm_topk_prob`` (renormalise, and then *no*
``routed_scaling_factor``), which Hugging Face ignores.

The experts' INT4 form (:class:`GroupQuantExperts`: packed weights read inside the gather, grouped
and fused decode kernels) lives here with them: :class:`DeepseekV2Experts` hands it to the
quantizer through ``int4_form`` (:mod:`dsv2_mlc.quant.mutator`), which knows no model class.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx
from tvm.ir.expr import Expr
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.target import Target

from ..quant.decode_linear import int4_decode_gemv
from ..quant.modules import GroupQuantLinear, dequantize_expr
from ..quant.packing import packed_shape
from ..quant.spec import Quantization
from ..schedules import moe_grouped_cuda as grouped
from ..schedules.decode_gemv_cuda import DECODE_GEMV
from ..schedules.moe_decode_cuda import MoeDecodeShape, moe_down_decode, moe_gate_up_decode
from ..schedules.moe_expert_mma_cuda import (
    decode_gemm_expert_major,
    expert_mma_unsupported,
    moe_down_expert_mma,
    moe_gate_up_expert_mma,
)
from ..schedules.moe_routing import moe_route
from ..schedules.moe_swap_cuda import grouped_gemm_swap, swap_supported, swap_tiles
from .config import DeepseekV2Config

WeightReader = Callable[[list[te.Tensor], Expr, Expr, Expr], Expr]


def read_float_weight(ws: list[te.Tensor], e: Expr, o: Expr, r: Expr):
    """Element ``[e, o, r]`` of a float weight ``ws[0]`` [E, out, in], as float32."""
    return ws[0][e, o, r].astype("float32")


def int4_weight_reader(group: int) -> WeightReader:
    """The reader of stacked INT4-group weights ``ws = [packed, scales]``: element ``[e, o,
    r]`` dequantised (:func:`dsv2_mlc.quant.modules.dequantize_expr`)."""

    def read(ws: list[te.Tensor], e: Expr, o: Expr, r: Expr) -> Expr:
        return dequantize_expr(ws[0], ws[1], (e, o), r, group)

    return read


def gather_matmul_te(
    xt: te.Tensor,
    it: te.Tensor,
    wts: list[te.Tensor],
    out_dim: int,
    name: str,
    read: WeightReader = read_float_weight,
) -> te.Tensor:
    """The TE of :func:`gather_matmul` (``xt`` [n, d] or [n, k, d], ``it`` [n, k] int32)."""
    per_slot = len(xt.shape) == 3
    red_dim = int(xt.shape[-1])
    n, k = it.shape
    r = te.reduce_axis((0, red_dim), name="r")

    def f(t: Expr, j: Expr, o: Expr) -> Expr:
        xv = xt[t, j, r] if per_slot else xt[t, r]
        return te.sum(xv.astype("float32") * read(list(wts), it[t, j], o, r), axis=r)

    acc = te.compute((n, k, out_dim), f, name=f"{name}_acc", attrs=dict([DECODE_GEMV]))
    return te.compute(acc.shape, lambda *i: acc(*i).astype(xt.dtype), name=name)


def gather_matmul(
    x: Tensor,
    weights: list[Tensor],
    idx: Tensor,
    out_dim: int,
    name: str,
    read: WeightReader = read_float_weight,
) -> Tensor:
    """y[t, j, :] = W[idx[t, j]] @ x[t, (j), :] with float32 accumulation.

    ``x`` is [n, d] (shared by the k selected experts) or [n, k, d]; the expert weights are
    ``weights`` (one float tensor [E, out, d], or packed INT4 + scales), read element by element
    through ``read`` so a dequantised weight is never materialised; ``idx`` is [n, k] int32.
    Returns [n, k, out_dim] in the dtype of ``x``.
    """

    def compute(xt: te.Tensor, it: te.Tensor, *wts: te.Tensor) -> te.Tensor:
        return gather_matmul_te(xt, it, list(wts), out_dim, name, read)

    return nn.tensor_expr_op(compute, name, [x, idx, *weights])


def use_grouped_experts(mode: str | None) -> bool:
    """Whether the routed experts run as grouped GEMMs (:mod:`dsv2_mlc.schedules.moe_grouped_cuda`):
    prefill / extend and the large-batch decode (``decode_gemm``) on a CUDA target
    (``Target.current()``); decode and the CPU keep the gather kernels."""
    target = Target.current(allow_none=True)
    cuda = target is not None and target.kind.name == "cuda"
    return cuda and mode in ("prefill", "extend", "decode_gemm")


def grouped_experts(
    x: Tensor,
    weights: Tensor,
    idx: Tensor,
    gate_up: list[Tensor],
    down: list[Tensor],
    num_experts: int,
    intermediate: int,
    name: str,
    read: WeightReader = read_float_weight,
    swap: bool = False,
) -> Tensor:
    """``sum_j weights[:, j] * expert_{idx[:, j]}(x)`` through the expert-sorted grouped GEMMs:
    align (sort the (token, slot) pairs by expert), gate/up with SwiGLU, down, combine.

    ``gate_up`` / ``down`` are the stacked weights (one float tensor, or packed INT4 + scales,
    read through ``read``), ``[E, 2I, H]`` / ``[E, H, I]`` in the float layout. ``swap``: the
    GEMMs of :mod:`dsv2_mlc.schedules.moe_swap_cuda` (INT4; tiles of the table's few tokens, the
    weights as the MMA's M: decode batches) instead of the tiles of ``grouped.TM`` rows.
    """
    n, k = idx.shape
    h = int(x.shape[-1])
    tm = swap_tiles().tokens if swap else grouped.TM
    tiles = grouped.num_tiles(n, k, num_experts, tm)
    rows, tile_expert, inv, _counts = op.tensor_ir_op(
        grouped.moe_align(num_experts, int(k), tm),
        "moe_align",
        args=[idx],
        out=[
            Tensor.placeholder((tiles, tm), "int32"),
            Tensor.placeholder((tiles,), "int32"),
            Tensor.placeholder((n, k), "int32"),
            Tensor.placeholder((num_experts,), "int32"),
        ],
    )

    def te_args(tensors: list[Tensor]) -> list[te.Tensor]:
        return [te.placeholder(t.shape, t.dtype, name=f"w{i}") for i, t in enumerate(tensors)]

    nt = tirx.Var("num_tiles", "int64")
    nv = tirx.Var("n", "int64")
    rows_te = te.placeholder((nt, tm), "int32", name="rows")
    te_te = te.placeholder((nt,), "int32", name="tile_expert")
    x_te = te.placeholder((nv, h), x.dtype, name="x")
    gu_te = te_args(gate_up)

    def gemm(xt: te.Tensor, ws: list[te.Tensor], out_dim: int, halves: int, tag: str):
        if swap:
            return grouped_gemm_swap(xt, rows_te, te_te, ws, out_dim, halves, halves == 2, tag)
        return grouped.grouped_gemm_cuda(
            xt, rows_te, te_te, ws, read, out_dim, halves, halves == 2, tag
        )

    gate_up_fn = gemm(x_te, gu_te, intermediate, 2, f"{name}_gate_up")
    hidden = op.tensor_ir_op(
        gate_up_fn, f"{name}_gate_up", args=[x, rows, tile_expert, *gate_up],
        out=Tensor.placeholder((tiles, tm, intermediate), x.dtype),
    )  # fmt: skip
    h_te = te.placeholder((nt, tm, intermediate), x.dtype, name="hidden")
    down_fn = gemm(h_te, te_args(down), h, 1, f"{name}_down")
    rows_out = op.tensor_ir_op(
        down_fn, f"{name}_down", args=[hidden, rows, tile_expert, *down],
        out=Tensor.placeholder((tiles, tm, h), x.dtype),
    )  # fmt: skip
    d_te = te.placeholder((nt, tm, h), x.dtype, name="down")
    inv_te = te.placeholder((nv, int(k)), "int32", name="inv")
    w_te = te.placeholder((nv, int(k)), "float32", name="weights")
    combine_fn = grouped.combine_cuda(d_te, inv_te, w_te, f"{name}_combine")
    return op.tensor_ir_op(
        combine_fn, f"{name}_combine", args=[rows_out, inv, weights],
        out=Tensor.placeholder((n, h), x.dtype),
    )  # fmt: skip


def dense_int4_grouped(x: Tensor, gate_up: nn.Module, down: nn.Module) -> Tensor | None:
    """``down(silu(gate) * up)`` of a dense SwiGLU MLP with INT4 weights, computed as the one
    expert of the grouped tensor-core GEMMs (:func:`grouped_experts`, every token routed to it
    with weight 1): the weights are read packed, so no float copy of them is written. For the
    prefill and extend of CUDA builds: V2-Lite's dense layer would otherwise dequantise 134 MB
    of ``gate_up_proj`` and ``down_proj`` for each chunk, buffers the pooled allocator keeps
    for the process (the larger part of a long-context plan's fixed workspace). None where the
    tensor-core kernel does not take the shapes (then the caller's GEMMs run)."""
    lin = (gate_up, down)
    if not use_grouped_experts("prefill") or x.dtype != "float16" or len(x.shape) != 2:
        return None
    if not all(isinstance(m, GroupQuantLinear) for m in lin):
        return None
    hidden, inter = int(x.shape[-1]), down.in_features
    rows = te.placeholder((1, grouped.TM), "int32")

    def takes(red: int, weights: tuple[Tensor, Tensor], out_dim: int, halves: int) -> bool:
        ws = [te.placeholder((1, *w.shape), w.dtype) for w in weights]
        xt = te.placeholder((1, red), x.dtype)
        group = grouped.int4_group(ws, red)  # (read from the shapes: must be the module's)
        ok = group == gate_up.group_size == down.group_size
        return ok and grouped.mma_supported(xt, rows, ws, out_dim, halves)

    if not (
        takes(hidden, (gate_up.q_weight, gate_up.q_scale), inter, 2)
        and takes(inter, (down.q_weight, down.q_scale), hidden, 1)
    ):
        return None
    n = x.shape[0]

    def stacked(t: Tensor) -> Tensor:
        return op.reshape(t, (1, *t.shape))

    return grouped_experts(
        x, op.ones((n, 1), "float32"), op.zeros((n, 1), "int32"),
        [stacked(gate_up.q_weight), stacked(gate_up.q_scale)],
        [stacked(down.q_weight), stacked(down.q_scale)], 1, inter, "mlp_grouped_q4",
        int4_weight_reader(gate_up.group_size),
    )  # fmt: skip


def gate_logits_te(x: te.Tensor, w: te.Tensor) -> te.Tensor:
    """Router logits ``x [n, H] @ w[E, H]^T`` in float32: an NT GEMV tagged for decode.

    The reduction's extent keeps the dtype of ``x``'s shape (int64 from Relax): with an int32
    one, dlight's ``Matmul`` rule raised on the mixed index types and the kernel fell to
    ``Fallback`` (a thread per logit, accumulating in global memory). On a GPU, fp16
    activations take :func:`split_weight_logits` instead."""
    r = te.reduce_axis((0, x.shape[-1]), name="r")
    return te.compute(
        (x.shape[0], w.shape[0]),
        lambda t, e: te.sum(x[t, r].astype("float32") * w[e, r], axis=r),
        name="moe_gate_logits",
        attrs=dict([DECODE_GEMV]),
    )


def split_weight_logits(x: Tensor, w: Tensor) -> Tensor:
    """``x [n, H] (fp16) @ w[E, H]^T (fp32)`` as one fp16 tensor-core GEMM against ``[hi; lo]``.

    ``w = hi + lo`` with ``hi = fp16(w)`` and ``lo = fp16(w - hi)``: ``x`` is exact in fp16, so
    the two products, accumulated in float32, carry about 21 of float32's 24 mantissa bits of
    ``w`` (the float32 reference: ``gate_logits_te``; tests/test_router_logits.py). One GEMM of
    2E columns on tensor cores is about 3x faster in prefill than the float32 logits as a SIMT
    kernel (schedules/results/prefill_small_kernels.md)."""
    hi = op.astype(w, "float16")
    lo = op.astype(op.subtract(w, op.astype(hi, "float32")), "float16")
    both = op.matmul(x, op.permute_dims(op.concat([hi, lo], dim=0)), out_dtype="float32")
    a, b = op.split(both, 2, axis=-1)
    return op.add(a, b)


class DeepseekV2MLP(nn.Module):
    """SwiGLU MLP (the dense layers and the shared experts) over a fused gate/up projection."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: str, dense: bool = False
    ):
        # gate_proj and up_proj are concatenated at conversion (gate rows first): one matmul.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.dense = dense  # a dense layer's MLP (not the shared experts)

    def forward(self, x: Tensor, mode: str | None = None) -> Tensor:
        """``mode``: the entry point's (see ``DeepseekV2MoE``). A CUDA decode step runs the INT4
        ``down_proj`` as the GEMV that loads its weights before it waits
        (:mod:`dsv2_mlc.quant.decode_linear`), faster than the TIR GEMV for V2-Lite's
        2048 x 10944; ``gate_up_proj`` (21888 x 2048) stays on the TIR GEMV, the faster of the
        two for that shape (schedules/results/decode_kernels.md). A dense layer's prefill and
        extend on CUDA read the INT4 weights in the grouped tensor-core GEMMs
        (:func:`dense_int4_grouped`)."""
        if self.dense and mode in ("prefill", "extend"):
            out = dense_int4_grouped(x, self.gate_up_proj, self.down_proj)
            if out is not None:
                return out
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        hidden = op.silu(gate) * up
        gemv = mode == "decode"
        down = int4_decode_gemv(self.down_proj, hidden, "mlp_down_decode") if gemv else None
        return self.down_proj(hidden) if down is None else down


class DeepseekV2Gate(nn.Module):
    """The router: an fp32 linear gate, softmax, then greedy or group-limited top-k."""

    def __init__(self, cfg: DeepseekV2Config):
        self.cfg = cfg
        self.weight = nn.Parameter((cfg.n_routed_experts, cfg.hidden_size), "float32")

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [n, H] -> (weights [n, k] float32, expert ids [n, k] int32).

        The router kernel follows the target being traced for (``with target:``; none: CPU).
        """
        return self.route(self.logits(x))

    def logits(self, x: Tensor) -> Tensor:
        """x: [n, H] -> router logits [n, E] float32 (fp16 activations on a GPU: on tensor
        cores, :func:`split_weight_logits`)."""
        target = Target.current(allow_none=True)
        if x.dtype == "float16" and target is not None and "gpu" in target.keys:
            return split_weight_logits(x, self.weight)
        return nn.tensor_expr_op(gate_logits_te, "moe_gate_logits", [x, self.weight])

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """logits [n, E] -> (weights [n, k] float32, expert ids [n, k] int32)."""
        cfg = self.cfg
        n, k = logits.shape[0], cfg.num_experts_per_tok
        route = moe_route(
            Target.current(allow_none=True),
            cfg.n_routed_experts,
            k,
            cfg.n_group if cfg.topk_method == "group_limited_greedy" else 1,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        weights, idx = op.tensor_ir_op(
            route,
            "moe_route",
            args=[logits],
            out=[
                Tensor.placeholder((n, k), "float32"),
                Tensor.placeholder((n, k), "int32"),
            ],
        )
        return weights, idx


class DeepseekV2Experts(nn.Module):
    """The routed experts of one layer, stacked: gate/up fused per expert, then down."""

    def __init__(self, cfg: DeepseekV2Config, dtype: str):
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.intermediate = e, i
        self.gate_up_proj = nn.Parameter((e, 2 * i, h), dtype)
        self.down_proj = nn.Parameter((e, h, i), dtype)

    def int4_form(self, q: Quantization) -> tuple[nn.Module, dict[str, str]]:
        """These experts as INT4 groups for ``q`` (:class:`GroupQuantExperts`) and, per float
        parameter, the prefix of its packed weights and scales (the protocol of
        :class:`dsv2_mlc.quant.mutator.QuantizeInt4`)."""
        return GroupQuantExperts(self, q), {"gate_up_proj": "gate_up_", "down_proj": "down_"}

    def decode_shape(
        self, x: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> MoeDecodeShape | None:
        """The shape of the fused decode kernels for this layer where this layout has them
        (INT4 experts on CUDA: ``GroupQuantExperts``); None here (float weights)."""
        return None

    def fused_decode(
        self, x: Tensor, logits: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> Tensor | None:
        """Routing + routed + shared experts in fused decode kernels, where this layout has
        them (INT4 experts on CUDA: ``GroupQuantExperts``); None here (float weights)."""
        return None

    def expert_major_decode(
        self, x: Tensor, logits: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> Tensor | None:
        """Routing, then the routed and shared experts with each expert the batch selects read
        once, where this layout has such kernels (INT4 experts on CUDA: ``GroupQuantExperts``);
        None here (float weights)."""
        return None

    def forward(
        self, x: Tensor, weights: Tensor, idx: Tensor, mode: str | None = None, swap: bool = False
    ) -> Tensor:
        """x [n, H], weights [n, k] fp32, idx [n, k] -> sum_j weights[:, j] * expert_j(x).

        Prefill / extend on CUDA: grouped GEMMs (:func:`grouped_experts`); otherwise gathers.
        ``swap`` (the grouped GEMMs of decode batches) needs INT4 experts: ignored here."""
        if use_grouped_experts(mode):
            return grouped_experts(
                x, weights, idx, [self.gate_up_proj], [self.down_proj], self.num_experts,
                self.intermediate, "moe_grouped",
            )  # fmt: skip
        i2, h = 2 * self.intermediate, x.shape[-1]
        gate_up = gather_matmul(x, [self.gate_up_proj], idx, i2, "moe_gate_up")
        gate, up = op.split(gate_up, 2, axis=-1)
        hidden = op.silu(gate) * up
        down = gather_matmul(hidden, [self.down_proj], idx, h, "moe_down")  # [n, k, H]
        weighted = down.astype("float32") * op.unsqueeze(weights, -1)
        return op.sum(weighted, axis=1).astype(x.dtype)


def expert_major_combine_te(part: te.Tensor, weights: te.Tensor, dtype: str) -> te.Tensor:
    """``out[t, o] = sum_j weights[t, j] * part[t, j, o] + part[t, K, o]`` in float32, the
    slots in order then the shared experts (one elementwise kernel, a fixed order: replays give
    the eager step's bits), cast to ``dtype``."""
    n, k1, h = part.shape
    k = int(k1) - 1

    def out(t: Expr, o: Expr) -> Expr:
        acc = weights[t, 0] * part[t, 0, o]
        for j in range(1, k):
            acc = acc + weights[t, j] * part[t, j, o]
        return (acc + part[t, k, o]).astype(dtype)

    return te.compute((n, h), out, name="moe_expert_major_combine")


class GroupQuantExperts(nn.Module):
    """Stacked routed experts with INT4-group weights, dequantised inside the gather kernels."""

    def __init__(self, experts: DeepseekV2Experts, q: Quantization):
        e, i2, h = experts.gate_up_proj.shape
        self.num_experts, self.intermediate, self.hidden = int(e), experts.intermediate, int(h)
        self.group_size = q.group_size
        gu_w, gu_s = packed_shape((e, i2, h), q.group_size)
        dn_w, dn_s = packed_shape((e, h, experts.intermediate), q.group_size)
        self.gate_up_q_weight = nn.Parameter(gu_w, "uint32")
        self.gate_up_q_scale = nn.Parameter(gu_s, q.scale_dtype)
        self.down_q_weight = nn.Parameter(dn_w, "uint32")
        self.down_q_scale = nn.Parameter(dn_s, q.scale_dtype)

    def decode_shape(
        self, x: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> MoeDecodeShape | None:
        """The shape of the fused decode kernels for this layer, or None where they do not
        apply: not a CUDA target, not fp16, shared experts not INT4 with this group, or a shape
        the kernels do not take (``MoeDecodeShape.unsupported``)."""
        target = Target.current(allow_none=True)
        if target is None or target.kind.name != "cuda" or x.dtype != "float16":
            return None
        lin = (shared.gate_up_proj, shared.down_proj)
        if not all(isinstance(m, GroupQuantLinear) for m in lin):
            return None
        if any(m.group_size != self.group_size or m.q_scale.dtype != "float16" for m in lin):
            return None
        if self.gate_up_q_scale.dtype != "float16":
            return None
        cfg = gate.cfg
        limited = cfg.topk_method == "group_limited_greedy"
        shape = MoeDecodeShape(
            hidden=self.hidden,
            inter=self.intermediate,
            shared_inter=shared.down_proj.in_features,
            experts=self.num_experts,
            top_k=cfg.num_experts_per_tok,
            group=self.group_size,
            n_group=cfg.n_group if limited else 1,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        return None if shape.unsupported() else shape

    def fused_decode(
        self, x: Tensor, logits: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> Tensor | None:
        """Decode on CUDA: routing + routed and shared gate/up + SwiGLU in one kernel, the
        down projections + weighted sum in another (:mod:`dsv2_mlc.schedules.moe_decode_cuda`);
        None where :meth:`decode_shape` says they do not apply."""
        shape = self.decode_shape(x, gate, shared)
        if shape is None:
            return None
        n, k = x.shape[0], shape.top_k
        su = shared.gate_up_proj
        hidden, weights, idx = op.tensor_ir_op(
            moe_gate_up_decode(shape),
            "moe_decode_gate_up",
            args=[x, logits, self.gate_up_q_weight, self.gate_up_q_scale, su.q_weight, su.q_scale],
            out=[
                Tensor.placeholder((n, shape.total), x.dtype),
                Tensor.placeholder((n, k), "float32"),
                Tensor.placeholder((n, k), "int32"),
            ],
        )
        sd = shared.down_proj
        return op.tensor_ir_op(
            moe_down_decode(shape),
            "moe_decode_down",
            args=[hidden, weights, idx, self.down_q_weight, self.down_q_scale, sd.q_weight,
                  sd.q_scale],
            out=Tensor.placeholder((n, shape.hidden), x.dtype),
        )  # fmt: skip

    def swap_takes(self, dtype: str) -> bool:
        """Whether the grouped GEMMs of :mod:`dsv2_mlc.schedules.moe_swap_cuda` take this
        layer's experts: both shapes, INT4, an sm_90 target."""
        h, i = self.hidden, self.intermediate

        def takes(red: int, pair: tuple[nn.Parameter, nn.Parameter], out_dim: int, halves: int):
            ws = [te.placeholder(t.shape, t.dtype) for t in pair]
            return swap_supported(te.placeholder((1, red), dtype), ws, out_dim, halves)

        return takes(h, (self.gate_up_q_weight, self.gate_up_q_scale), i, 2) and takes(
            i, (self.down_q_weight, self.down_q_scale), h, 1
        )

    def expert_major_decode(
        self, x: Tensor, logits: Tensor, gate: DeepseekV2Gate, shared: DeepseekV2MLP
    ) -> Tensor | None:
        """Decode of a batch on CUDA: routing (``moe_route``), then every expert the batch
        selects read once for its tokens (:mod:`dsv2_mlc.schedules.moe_expert_mma_cuda`: the
        routed and shared gate/up + SwiGLU, then their down projections, unweighted), then the
        weighted sum in float32; None where :meth:`decode_shape` or the kernels do not apply."""
        shape = self.decode_shape(x, gate, shared)
        if shape is None or expert_mma_unsupported(shape) is not None:
            return None
        n, k, h = x.shape[0], shape.top_k, shape.hidden
        weights, idx = gate.route(logits)
        su, sd = shared.gate_up_proj, shared.down_proj
        hidden = op.tensor_ir_op(
            moe_gate_up_expert_mma(shape),
            "moe_expert_major_gate_up",
            args=[x, idx, self.gate_up_q_weight, self.gate_up_q_scale, su.q_weight, su.q_scale],
            out=Tensor.placeholder((n, shape.total), x.dtype),
        )
        part = op.tensor_ir_op(
            moe_down_expert_mma(shape),
            "moe_expert_major_down",
            args=[hidden, idx, self.down_q_weight, self.down_q_scale, sd.q_weight, sd.q_scale],
            out=Tensor.placeholder((n, k + 1, h), "float32"),
        )
        return nn.tensor_expr_op(
            lambda p, w: expert_major_combine_te(p, w, x.dtype),
            "moe_expert_major_combine",
            [part, weights],
        )

    def forward(
        self, x: Tensor, weights: Tensor, idx: Tensor, mode: str | None = None, swap: bool = False
    ) -> Tensor:
        """As ``DeepseekV2Experts.forward``: grouped GEMMs for prefill / extend on CUDA; with
        ``swap``, a ``decode_gemm`` step's grouped GEMMs are :mod:`~dsv2_mlc.schedules.
        moe_swap_cuda`'s where they take the layer (:meth:`swap_takes`)."""
        read = int4_weight_reader(self.group_size)
        if use_grouped_experts(mode):
            gate_up = [self.gate_up_q_weight, self.gate_up_q_scale]
            down = [self.down_q_weight, self.down_q_scale]
            swap = swap and mode == "decode_gemm" and self.swap_takes(x.dtype)
            return grouped_experts(
                x, weights, idx, gate_up, down, self.num_experts, self.intermediate,
                "moe_swap_q4" if swap else "moe_grouped_q4", read, swap,
            )  # fmt: skip

        gate_up = gather_matmul(
            x, [self.gate_up_q_weight, self.gate_up_q_scale], idx, 2 * self.intermediate,
            "moe_gate_up_q4", read,
        )  # fmt: skip
        gate, up = op.split(gate_up, 2, axis=-1)
        down = gather_matmul(
            op.silu(gate) * up, [self.down_q_weight, self.down_q_scale], idx, self.hidden,
            "moe_down_q4", read,
        )  # fmt: skip
        weighted = down.astype("float32") * op.unsqueeze(weights, -1)
        return op.sum(weighted, axis=1).astype(x.dtype)


class DeepseekV2MoE(nn.Module):
    """Router + routed experts + always-on shared experts."""

    def __init__(self, cfg: DeepseekV2Config, dtype: str):
        self.gate = DeepseekV2Gate(cfg)
        self.experts = DeepseekV2Experts(cfg, dtype)
        self.shared_experts = (
            DeepseekV2MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: Tensor, mode: str | None = None, moe: str = "auto") -> Tensor:
        """x: [n, H] (the tokens of the batch, flattened) -> [n, H].

        ``mode`` is the entry point's ("prefill" | "extend" | "decode"): the routed experts of
        prefill and extend on CUDA run as grouped GEMMs; decode runs the experts' fused kernels
        where they have them (``fused_decode``: routing, routed and shared experts in two
        launches), the rest keeps the gather kernels. ``moe="expert_major"`` (decode of a batch,
        ``batch_decode_expert_major``): the experts' expert-major kernels where they have them
        (``expert_major_decode``: each expert the batch selects read once). ``"decode_gemm"``
        (``batch_decode_gemm``) runs the grouped GEMMs, or the expert-major kernels where the
        tile table's ``decode_gemm`` entry says so (``decode_gemm_expert_major``); with
        ``moe="swap"`` (``batch_decode_swap``) the grouped GEMMs of decode batches
        (:mod:`dsv2_mlc.schedules.moe_swap_cuda`) and the shared experts' GEMMs."""
        return self.forward_with_logits(x, self.gate.logits(x), mode, moe)

    def forward_with_logits(
        self, x: Tensor, logits: Tensor, mode: str | None = None, moe: str = "auto"
    ) -> Tensor:
        """:meth:`forward` with the router's logits ``[n, E]`` already computed (decode on
        CUDA computes them with the RMSNorm that produces ``x``: ``norm_gemv_cuda``)."""
        if mode in ("decode", "decode_gemm") and self.shared_experts is not None:
            experts, shared = self.experts, self.shared_experts
            expert_major = moe == "expert_major" or (
                mode == "decode_gemm" and moe == "auto" and decode_gemm_expert_major()
            )
            out = (
                experts.expert_major_decode(x, logits, self.gate, shared) if expert_major else None
            )
            if out is None and mode == "decode":
                out = experts.fused_decode(x, logits, self.gate, shared)
            if out is not None:
                return out
        weights, idx = self.gate.route(logits)
        out = self.experts(x, weights, idx, mode, moe == "swap")
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

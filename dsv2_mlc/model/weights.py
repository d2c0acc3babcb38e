"""Declarative map from Hugging Face checkpoint tensors to the compiled model's parameters.

Each :class:`Conversion` names the checkpoint tensors it reads (with the shape the config implies),
the parameters it produces, and the transform between them. Most are the identity under the same
name; four are not:

* ``mlp.{gate,up}_proj.weight`` (dense layers, shared experts) are concatenated, gate rows first,
  into ``mlp.gate_up_proj.weight`` [2I, H] (one matmul, then SiLU(gate) * up);
* ``self_attn.q_proj.weight`` (with q-LoRA: ``q_a_proj.weight``) and
  ``self_attn.kv_a_proj_with_mqa.weight``, which read the same normed hidden state, are
  concatenated, query rows first, into ``self_attn.qkv_a_proj.weight`` [q_a_dim + L + R, H]
  (one matmul; the forward pass reads the query and the latent at their column offsets);
* routed experts ``mlp.experts.E.{gate,up,down}_proj.weight`` are stacked into
  ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] (these
  conversions work expert by expert: see :class:`ExpertStack`);
* ``self_attn.kv_b_proj.weight`` [heads * (nope + v), kv_lora_rank] is split per head into
  ``kv_b_proj.w_uk`` [heads, nope, lora] and ``kv_b_proj.w_uv`` [heads, v, lora] (absorbed decode
  multiplies by them; prefill decompresses with the same matrices).

:func:`check_checkpoint` verifies, before anything is written, that every expected tensor is
present with its shape and that every checkpoint tensor is consumed, listing all problems at once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import Dsv2Error
from .checkpoint import FLOAT_DTYPES, SafetensorsCheckpoint
from .config import DeepseekV2Config

Transform = Callable[[list[np.ndarray]], list[np.ndarray]]


class WeightMapError(Dsv2Error, ValueError):
    """The checkpoint does not match the config (every problem is listed in the message)."""


@dataclass(frozen=True)
class Conversion:
    """Checkpoint tensors ``sources`` (name, expected shape) -> parameters ``targets``.

    With ``experts`` > 0 the sources are that many equal groups, one per expert, whose rows are
    concatenated (in order) into that expert's block; the single target is the stack of the
    blocks [experts, ...] and ``transform`` is unused.
    """

    sources: tuple[tuple[str, tuple[int, ...]], ...]
    targets: tuple[str, ...]
    transform: Transform | None = None
    experts: int = 0

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Run the transform (identity when there is none) on all sources at once."""
        if self.experts:
            per = len(arrays) // self.experts
            blocks = [_concat_rows(arrays[e * per : (e + 1) * per])[0] for e in range(self.experts)]
            return [np.stack(blocks)]
        return arrays if self.transform is None else self.transform(arrays)


class ExpertStack:
    """The stacked parameter of an expert :class:`Conversion`, read one expert at a time.

    ``shape``, ``ndim`` and ``dtype`` (float32) describe the whole ``[experts, ...]`` array;
    ``stack[e]`` reads expert ``e``'s checkpoint tensors straight into the rows of a new block.
    Converting a DeepSeek-V2 MoE layer through the whole stack would hold 160 experts in float32
    at once (10 GB for ``gate_up_proj``); consumers that work block by block (the INT4
    quantizer, or :meth:`materialize` into the final dtype) hold one expert's block at a time.
    """

    dtype = np.dtype(np.float32)

    def __init__(self, conv: Conversion, ckpt: SafetensorsCheckpoint):
        self.conv, self.ckpt = conv, ckpt
        self.per = len(conv.sources) // conv.experts
        group = conv.sources[: self.per]
        rows = sum(shape[0] for _, shape in group)
        self.shape = (conv.experts, rows, *group[0][1][1:])
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> np.ndarray:
        return self.read(e)

    def read(self, e: int, out: np.ndarray | None = None) -> np.ndarray:
        """Expert ``e``'s block, read into ``out`` (C-contiguous float32) or a new array."""
        if not 0 <= e < len(self):
            raise IndexError(f"expert {e} out of range [0, {len(self)})")
        block = np.empty(self.shape[1:], np.float32) if out is None else out
        row = 0
        for name, shape in self.conv.sources[e * self.per : (e + 1) * self.per]:
            self.ckpt.get(name, out=block[row : row + shape[0]])
            row += shape[0]
        return block

    def materialize(self, dtype: str) -> np.ndarray:
        """The whole stack as one contiguous array of ``dtype``, filled expert by expert."""
        out = np.empty(self.shape, dtype)
        for e in range(len(self)):
            if out.dtype == np.float32:
                self.read(e, out=out[e])
            else:
                out[e] = self.read(e)
        return out


def _same(name: str, shape: tuple[int, ...]) -> Conversion:
    return Conversion(((name, shape),), (name,))


def _split_kv_b(cfg: DeepseekV2Config) -> Transform:
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

    def split(arrays: list[np.ndarray]) -> list[np.ndarray]:
        w = arrays[0].reshape(heads, nope + v, cfg.kv_lora_rank)
        return [np.ascontiguousarray(w[:, :nope]), np.ascontiguousarray(w[:, nope:])]

    return split


def _concat_rows(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [np.concatenate(arrays, axis=0)]


def _mlp(prefix: str, hidden: int, inter: int) -> list[Conversion]:
    gate_up = (
        (f"{prefix}.gate_proj.weight", (inter, hidden)),
        (f"{prefix}.up_proj.weight", (inter, hidden)),
    )
    return [
        Conversion(gate_up, (f"{prefix}.gate_up_proj.weight",), _concat_rows),
        _same(f"{prefix}.down_proj.weight", (hidden, inter)),
    ]


def _attention(cfg: DeepseekV2Config, p: str) -> list[Conversion]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_name = f"{p}.q_proj.weight" if cfg.q_lora_rank is None else f"{p}.q_a_proj.weight"
    qkv_a = ((q_name, (cfg.q_a_dim, h)), (f"{p}.kv_a_proj_with_mqa.weight", (cfg.latent_dim, h)))
    convs = [Conversion(qkv_a, (f"{p}.qkv_a_proj.weight",), _concat_rows)]
    if cfg.q_lora_rank is not None:
        convs += [
            _same(f"{p}.q_a_layernorm.weight", (cfg.q_lora_rank,)),
            _same(f"{p}.q_b_proj.weight", (heads * cfg.qk_head_dim, cfg.q_lora_rank)),
        ]
    kv_b_shape = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    convs += [
        _same(f"{p}.kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        Conversion(
            ((f"{p}.kv_b_proj.weight", kv_b_shape),),
            (f"{p}.kv_b_proj.w_uk", f"{p}.kv_b_proj.w_uv"),
            _split_kv_b(cfg),
        ),
        _same(f"{p}.o_proj.weight", (h, heads * cfg.v_head_dim)),
    ]
    return convs


def _moe(cfg: DeepseekV2Config, p: str) -> list[Conversion]:
    h, inter, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    gate_up = tuple(
        (f"{p}.experts.{e}.{proj}.weight", (inter, h))
        for e in range(n)
        for proj in ("gate_proj", "up_proj")
    )
    down = tuple((f"{p}.experts.{e}.down_proj.weight", (h, inter)) for e in range(n))
    convs = [
        _same(f"{p}.gate.weight", (n, h)),
        # per expert: [gate_e; up_e] -> [2I, H] (gate rows first); down_e as it is
        Conversion(gate_up, (f"{p}.experts.gate_up_proj",), experts=n),
        Conversion(down, (f"{p}.experts.down_proj",), experts=n),
    ]
    if cfg.n_shared_experts:
        convs += _mlp(f"{p}.shared_experts", h, inter * cfg.n_shared_experts)
    return convs


def weight_map(cfg: DeepseekV2Config) -> list[Conversion]:
    """Every conversion needed for ``cfg``, in parameter order (layer by layer)."""
    h = cfg.hidden_size
    convs = [_same("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        convs += _attention(cfg, f"{p}.self_attn")
        if cfg.is_moe_layer(i):
            convs += _moe(cfg, f"{p}.mlp")
        else:
            convs += _mlp(f"{p}.mlp", h, cfg.intermediate_size)
        convs += [
            _same(f"{p}.input_layernorm.weight", (h,)),
            _same(f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    convs += [
        _same("model.norm.weight", (h,)),
        _same("lm_head.weight", (cfg.vocab_size, h)),
    ]
    return convs


def check_checkpoint(convs: list[Conversion], ckpt: SafetensorsCheckpoint) -> None:
    """Raise :class:`WeightMapError` listing every missing, mis-shaped, non-float or unexpected
    tensor."""
    expected = {name: shape for conv in convs for name, shape in conv.sources}
    missing = sorted(name for name in expected if name not in ckpt)
    misshaped = sorted(
        f"{name}: expected {list(shape)}, found {list(ckpt.shape(name))}"
        for name, shape in expected.items()
        if name in ckpt and tuple(ckpt.shape(name)) != tuple(shape)
    )
    unexpected = sorted(name for name in ckpt.tensors if name not in expected)
    not_float = sorted(
        f"{name}: {ckpt.tensors[name].dtype}"
        for name in expected
        if name in ckpt and ckpt.tensors[name].dtype not in FLOAT_DTYPES
    )
    problems = []
    for title, items in (
        ("missing tensors", missing),
        ("tensors with the wrong shape", misshaped),
        (f"tensors that are not floating point ({', '.join(FLOAT_DTYPES)})", not_float),
        ("unexpected tensors (not consumed by the model)", unexpected),
    ):
        if items:
            shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
            problems.append(f"{title} ({len(items)}):\n  " + "\n  ".join(shown))
    if problems:
        raise WeightMapError(
            f"checkpoint {ckpt.model_dir} does not match its config.json:\n" + "\n".join(problems)
        )


def convert(
    convs: list[Conversion],
    ckpt: SafetensorsCheckpoint,
    dtypes: dict[str, str],
    blockwise: Collection[str] = (),
) -> Iterator[tuple[str, np.ndarray | ExpertStack]]:
    """Yield ``(parameter name, array)`` in order, cast to ``dtypes[name]``, one at a time.

    A stacked expert parameter named in ``blockwise`` is yielded as an :class:`ExpertStack` for
    the consumer to read expert by expert (the INT4 quantizer does); any other is built in its
    final dtype one expert at a time. Either way the largest transient is one expert's float32
    block (or, for the other parameters, one conversion's checkpoint tensors)."""
    for conv in convs:
        if conv.experts:
            (name,) = conv.targets
            stack = ExpertStack(conv, ckpt)
            yield name, stack if name in blockwise else stack.materialize(dtypes[name])
            continue
        outputs = conv.apply([ckpt.get(name) for name, _ in conv.sources])
        if len(outputs) != len(conv.targets):
            raise AssertionError(f"{conv.targets}: the transform made {len(outputs)} arrays")
        for name in conv.targets:
            # drop each reference before yielding / resuming, so a consumer that lets go of an
            # array frees it (the float32 source of a cast output is freed as it is yielded)
            out = np.ascontiguousarray(outputs.pop(0).astype(dtypes[name], copy=False))
            yield name, out
            del out

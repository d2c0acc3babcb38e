"""A compiled model's weights as a Hugging Face DeepSeek-V2 model: on disk, or straight into
transformers (for same-weights comparisons, e.g. ``dsv2-mlc bench --compare-hf``).

The inverse of :mod:`dsv2_mlc.model.weights`: every conversion of the weight map is undone
(fused gate/up and ``qkv_a_proj`` split, stacked experts unstacked, ``kv_b_proj`` re-joined),
INT4 weights are dequantised (``(nibble - 8) * scale``), and the result is named in the published
(hub) key layout.

* :func:`save_hf_checkpoint` writes ``config.json`` (published spelling: ``rope_scaling`` +
  ``rope_theta``) and safetensors shards plus ``model.safetensors.index.json``, in bfloat16 (the
  published dtype) or float32/float16. NumPy only: no torch (bfloat16 is rounded to nearest even
  by hand and the safetensors files are written directly).
* :func:`load_into_hf` builds a transformers model from the config on a torch device and copies
  the weights into it without touching the disk; on CUDA the parameters go device to device
  (DLPack) and are dequantised there with torch. torch and transformers are imported only here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .model.config import DeepseekV2Config
from .model.weights import weight_map
from .quant import get_quantization

if TYPE_CHECKING:
    from .runtime.engine import Engine

INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def hf_config(cfg: DeepseekV2Config, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """``cfg`` as a ``config.json`` in the published DeepSeek-V2 spelling."""
    rope = cfg.rope
    rope_scaling = None
    if rope.kind == "yarn":
        rope_scaling = {
            "type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "mscale": rope.mscale,
            "mscale_all_dim": rope.mscale_all_dim,
        }
    elif rope.kind != "default":
        raise ValueError(f"RoPE kind {rope.kind!r} has no HF spelling here")
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": 1,
        "topk_method": cfg.topk_method,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "scoring_func": "softmax",
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": rope.theta,
        "rope_scaling": rope_scaling,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }


class _Ops:
    """The few array operations the inversion needs, for NumPy (host) or torch (any device)."""

    def __init__(self, fetch: Callable[[str], Any], group: int, use_torch: bool):
        self.fetch, self.group, self.torch = fetch, group, use_torch

    def cat1(self, a: Any, b: Any) -> Any:
        if self.torch:
            import torch

            return torch.cat([a, b], dim=1)
        return np.concatenate([a, b], axis=1)

    def to_f32(self, a: Any) -> Any:
        if self.torch:
            import torch

            return a.to(torch.float32)
        return np.asarray(a, np.float32)

    def dequantize(self, packed: Any, scale: Any) -> Any:
        """float32 weights ``[..., K]`` from uint32 words ``[..., K/8]`` and scales."""
        if not self.torch:
            from .quant import dequantize_int4

            return dequantize_int4(packed, scale, self.group)
        import torch

        words = packed.view(torch.int32) if packed.dtype != torch.int32 else packed
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
        codes = (words.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask drops the sign
        k = words.shape[-1] * 8
        q = codes.reshape(*words.shape[:-1], k).to(torch.float32) - 8.0
        s = scale.to(torch.float32).repeat_interleave(self.group, dim=-1)[..., :k]
        return q * s


class _FloatParams:
    """Our parameters as float32 weights under their unquantized names."""

    def __init__(self, names: list[str], ops: _Ops):
        self.names, self.ops = set(names), ops
        self._cache: dict[str, Any] = {}

    def _get(self, name: str) -> Any:
        """Fetched once while in use (stacked experts are sliced many times)."""
        if name not in self._cache:
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[name] = self.ops.fetch(name)
        return self._cache[name]

    def _quantized(self, name: str) -> str | None:
        stem = name[: -len("weight")] if name.endswith(".weight") else name[: -len("proj")]
        return stem if f"{stem}q_weight" in self.names else None

    def length(self, name: str) -> int:
        """Leading extent of a stacked parameter."""
        stem = None if name in self.names else self._quantized(name)
        return int(self._get(name if stem is None else f"{stem}q_weight").shape[0])

    def get(self, name: str, index: int | None = None) -> Any:
        """The float32 weight ``name`` (or its ``index``-th slice along the first axis)."""
        if name in self.names:
            arr = self._get(name)
            return self.ops.to_f32(arr if index is None else arr[index])
        stem = self._quantized(name)
        if stem is None:
            raise KeyError(f"{name}: not a parameter of this build")
        packed, scale = self._get(f"{stem}q_weight"), self._get(f"{stem}q_scale")
        if index is not None:
            packed, scale = packed[index], scale[index]
        return self.ops.dequantize(packed, scale)


def _hub_tensors(cfg: DeepseekV2Config, params: _FloatParams) -> Iterator[tuple[str, Any]]:
    """(hub name, float32 tensor) for every checkpoint tensor, inverting the weight map."""
    for conv in weight_map(cfg):
        sources, targets = conv.sources, conv.targets
        if len(targets) == 2:  # kv_b_proj -> (w_uk [h, nope, c], w_uv [h, v, c]): re-join per head
            ((name, shape),) = sources
            joined = params.ops.cat1(params.get(targets[0]), params.get(targets[1]))
            out = [(name, joined.reshape(shape))]
        elif len(sources) == 1:
            ((name, shape),) = sources
            out = [(name, params.get(targets[0]).reshape(shape))]
        elif targets[0].endswith((".experts.gate_up_proj", ".experts.down_proj")):  # stacked
            n = params.length(targets[0])
            per = len(sources) // n  # 2: gate + up rows of one expert; 1: down
            out = []
            for e in range(n):
                w = params.get(targets[0], e)
                rows = 0
                for name, shape in sources[e * per : (e + 1) * per]:
                    out.append((name, w[rows : rows + shape[0]]))
                    rows += shape[0]
        else:  # rows concatenated (fused gate/up of dense MLPs and shared experts, qkv_a_proj)
            w, rows, out = params.get(targets[0]), 0, []
            for name, shape in sources:
                out.append((name, w[rows : rows + shape[0]]))
                rows += shape[0]
        for (name, shape), (out_name, tensor) in zip(sources, out, strict=True):
            if name != out_name or tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{name}: inverted to {tuple(tensor.shape)}, expected {shape}")
            yield name, tensor


def _model_config(engine: Engine) -> DeepseekV2Config:
    """The model config the engine's build was compiled from."""
    return DeepseekV2Config.from_dict(engine.build.model)


def _engine_group(engine: Engine) -> int:
    return get_quantization(engine.build.quantization).group_size


def hf_state(engine: Engine) -> Iterator[tuple[str, np.ndarray]]:
    """The model's weights as float32 NumPy arrays under the hub names, one tensor at a time
    (each copied from the device on demand)."""
    from .runtime.device import to_numpy

    tensors = dict(engine.named_params())
    ops = _Ops(lambda name: to_numpy(tensors[name]), _engine_group(engine), use_torch=False)
    yield from _hub_tensors(_model_config(engine), _FloatParams(list(tensors), ops))


# -- safetensors on disk (NumPy only) -------------------------------------------------------------
def to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _encode(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return to_bfloat16_bits(a).tobytes()
    return np.ascontiguousarray(a, dtype).tobytes()


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], bytes]], dtype: str):
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, data in tensors:
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, _, data in tensors:
            f.write(data)


def save_hf_checkpoint(
    engine: Engine,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write the engine's weights as an HF checkpoint folder (config.json, safetensors shards and
    their index) that ``DeepseekV2ForCausalLM.from_pretrained`` reads. Returns the folder."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose {', '.join(_ST_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    shards: list[list[tuple[str, tuple[int, ...], bytes]]] = [[]]
    size = total = 0
    parts: list[Path] = []

    def flush() -> None:
        part = out / f".shard-{len(parts)}.partial"
        _write_safetensors(part, shards[-1], dtype)
        parts.append(part)
        shards[-1] = []

    index: dict[str, int] = {}
    for name, tensor in hf_state(engine):
        nbytes = math.prod(tensor.shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1].append((name, tuple(tensor.shape), _encode(tensor, dtype)))
        index[name] = len(parts)
        size += nbytes
        total += nbytes
    flush()
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for part, name in zip(parts, names, strict=True):
        os.replace(part, out / name)
    weight_index = {tensor: names[i] for tensor, i in index.items()}
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_index}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(hf_config(_model_config(engine), dtype), indent=1))
    return out


# -- straight into transformers (torch) -----------------------------------------------------------
def _torch_fetch(engine: Engine, device: str) -> Callable[[str], Any]:
    import torch

    from .runtime.tvm_runtime import global_func

    tensors = dict(engine.named_params())
    view = global_func("runtime.TVMTensorCreateView")
    same_device = torch.device(device).type == engine.device  # "cpu" or "cuda"

    def fetch(name: str) -> Any:
        t = tensors[name]
        if str(t.dtype) == "uint32":  # torch has few uint32 ops: read the words as int32
            import tvm_ffi

            t = view(t, t.shape, tvm_ffi.dtype("int32"), 0)
        if same_device:
            return torch.from_dlpack(t)  # zero-copy
        from .runtime.device import to_numpy

        return torch.from_numpy(to_numpy(t)).to(device)

    return fetch


def load_into_hf(
    engine: Engine,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str = "eager",
) -> Any:
    """A ``transformers`` ``DeepseekV2ForCausalLM`` on ``device`` holding the engine's weights
    (INT4 dequantised, then cast to ``dtype``), built from the config, no disk involved."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch_dtype = getattr(torch, dtype)
    cfg = _model_config(engine)
    config = DeepseekV2Config(**hf_config(cfg, dtype))
    with torch.device(device):
        model = DeepseekV2ForCausalLM._from_config(
            config, dtype=torch_dtype, attn_implementation=attn_implementation
        )
    model.eval()
    ops = _Ops(_torch_fetch(engine, device), _engine_group(engine), use_torch=True)
    own = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in _hub_tensors(cfg, _FloatParams(_names(engine), ops)):
            dest, rows = _hf_param(name, own, cfg.moe_intermediate_size)
            (own[dest] if rows is None else own[dest][rows]).copy_(tensor)
            filled.add(dest)
    missing = sorted(set(own) - filled)
    if missing:
        raise AssertionError(f"HF parameters not filled from the build: {missing[:5]}")
    if device != "cpu":
        torch.cuda.synchronize()
    return model


def _names(engine: Engine) -> list[str]:
    return list(engine.build.param_names)


def _hf_param(name: str, own: dict[str, Any], inter: int) -> tuple[str, Any]:
    """Where hub tensor ``name`` lives in the model: (parameter, index or None). transformers 5
    keeps routed experts stacked (``experts.gate_up_proj`` [E, 2I, H], gate rows first;
    ``experts.down_proj`` [E, H, I]); older versions per expert under the hub names."""
    if name in own:
        return name, None
    head, sep, tail = name.partition(".experts.")
    if sep:
        expert, proj = tail.split(".")[:2]
        e = int(expert)
        if proj == "down_proj":
            return f"{head}.experts.down_proj", e
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return f"{head}.experts.gate_up_proj", (e, rows)
    raise KeyError(f"{name}: no such parameter in the transformers model")

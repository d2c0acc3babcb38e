"""Tiny random DeepSeek-V2 checkpoints made with Hugging Face transformers (the reference)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}

BASE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "softmax",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": YARN,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "norm_topk_prob": False,
}

# A: V2-Lite-like (no q-LoRA, greedy routing, 1 dense + 2 MoE layers, YaRN factor 40).
CONFIG_A = {**BASE, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1}
# B: V2-like (q-LoRA, group-limited greedy over 4 groups, routed_scaling_factor 16, YaRN).
CONFIG_B = {
    **BASE,
    "q_lora_rank": 24,
    "topk_method": "group_limited_greedy",
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 16.0,
}

# The session's tiny checkpoints (tests/conftest.py); C: V2-like routing with norm_topk_prob=True
# (HF ignores it; checked against NumPy).
CONFIGS = {"A": CONFIG_A, "B": CONFIG_B, "C": {**CONFIG_B, "norm_topk_prob": True}}

PROMPT = [0, 17, 301, 44, 9, 250, 111, 7, 480, 66, 23, 5]


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise for O(1) activations: norms 1+0.2N, embeddings N, linears N/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def make_checkpoint(path: Path, config: dict[str, Any], seed: int = 1234) -> Path:
    """Save a random HF model with ``config`` to ``path`` (``save_pretrained``); returns path."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**config)).eval()
    init_weights(model, seed)
    model.save_pretrained(path)
    # Keep config.json in the published spelling (rope_scaling + rope_theta), as real checkpoints.
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def load_hf(path: Path) -> torch.nn.Module:
    """The HF reference model in float32."""
    from transformers import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """HF logits for every position, float32 ``[len(ids), vocab]``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """HF ``generate`` greedy continuation of exactly ``n`` tokens (EOS does not stop it)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def routing_margin(model: torch.nn.Module, ids: list[int]) -> float:
    """The smallest margin of the router's decisions over ``ids`` (one forward, every MoE layer
    and position), in softmax probability: the gap between the last group kept and the first
    dropped (group-limited routing), and between the ``k``-th and ``k+1``-th expert. A reference
    whose margin is below fp16 resolution (~1e-3) cannot judge an fp16 build: a rounding flips
    an expert and the logits with it, whichever side is more accurate."""
    cfg = model.config
    k, groups, keep = cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1
    limited = cfg.topk_method == "group_limited_greedy"
    margins: list[float] = []

    def hook(_module, _inp, out) -> None:  # noqa: ANN001
        scores = out[0].float().softmax(-1)
        if limited:
            best = scores.view(len(scores), groups, -1).max(-1).values
            ranked = best.sort(-1, descending=True).values
            margins.append(float((ranked[:, keep - 1] - ranked[:, keep]).min()))
            mask = torch.zeros_like(best).scatter_(1, best.topk(keep, -1).indices, 1)
            scores = scores * mask.repeat_interleave(scores.shape[-1] // groups, -1)
        ranked = scores.sort(-1, descending=True).values
        margins.append(float((ranked[:, k - 1] - ranked[:, k]).min()))

    hooks = [
        layer.mlp.gate.register_forward_hook(hook)
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return min(margins)

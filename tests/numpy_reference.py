"""An independent float64 NumPy forward pass with the ORIGINAL DeepSeek-V2 semantics.

Written from DeepSeek's ``modeling_deepseek.py`` (not from HF transformers and not from our Relax
model): RoPE de-interleaves q_pe/k_pe and uses rotate_half; the MoE gate honours
``norm_topk_prob`` (renormalise and skip ``routed_scaling_factor``), which HF ignores.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from safetensors.numpy import load_file


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_cos_sin(cfg: dict[str, Any], n: int) -> tuple[np.ndarray, np.ndarray, float]:
    dim, base = cfg["qk_rope_head_dim"], float(cfg.get("rope_theta", 10000))
    rs = cfg.get("rope_scaling")
    freq_extra = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    scale = (cfg["qk_nope_head_dim"] + dim) ** -0.5
    mscale = 1.0
    inv_freq = freq_extra
    if rs:
        f, orig = rs["factor"], rs["original_max_position_embeddings"]
        freq_inter = freq_extra / f

        def corr(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(rs.get("beta_fast", 32))), 0)
        high = min(math.ceil(corr(rs.get("beta_slow", 1))), dim - 1)
        ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
        mask = 1.0 - ramp
        inv_freq = freq_inter * (1 - mask) + freq_extra * mask
        mscale = _mscale(f, rs.get("mscale", 1)) / _mscale(f, rs.get("mscale_all_dim", 0))
        if rs.get("mscale_all_dim"):
            scale *= _mscale(f, rs["mscale_all_dim"]) ** 2
    freqs = np.outer(np.arange(n), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb) * mscale, np.sin(emb) * mscale, scale


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x: [..., s, d] with interleaved pairs; de-interleave, then rotate_half (original code).
    d = x.shape[-1]
    x = x.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def _gate(cfg: dict[str, Any], w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scores = _softmax(x @ w.T)
    k, n_exp = cfg["num_experts_per_tok"], w.shape[0]
    if cfg.get("topk_method", "greedy") == "group_limited_greedy":
        g = cfg["n_group"]
        group_scores = scores.reshape(len(x), g, n_exp // g).max(-1)
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, : cfg["topk_group"]]
        mask = np.zeros_like(group_scores)
        np.put_along_axis(mask, keep, 1.0, axis=-1)
        scores = scores * np.repeat(mask, n_exp // g, axis=-1)
    idx = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    weight = np.take_along_axis(scores, idx, axis=-1)
    if k > 1 and cfg.get("norm_topk_prob", False):
        weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
    else:
        weight = weight * cfg.get("routed_scaling_factor", 1.0)
    return weight, idx


def _mlp(p: dict[str, np.ndarray], prefix: str, x: np.ndarray) -> np.ndarray:
    gate = x @ p[f"{prefix}.gate_proj.weight"].T
    up = x @ p[f"{prefix}.up_proj.weight"].T
    return (_silu(gate) * up) @ p[f"{prefix}.down_proj.weight"].T


def forward(cfg: dict[str, Any], weights_file: str, ids: list[int]) -> np.ndarray:
    """Float64 logits ``[len(ids), vocab]`` of the original DeepSeek-V2 model."""
    p = {k: v.astype(np.float64) for k, v in load_file(weights_file).items()}
    n, heads = len(ids), cfg["num_attention_heads"]
    dn, dr, dv, c = (
        cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    eps = cfg.get("rms_norm_eps", 1e-6)
    cos, sin, scale = _yarn_cos_sin(cfg, n)
    causal = np.triu(np.full((n, n), -np.inf), 1)
    x = p["model.embed_tokens.weight"][ids]
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        a = f"{pre}.self_attn"
        h = _rms(x, p[f"{pre}.input_layernorm.weight"], eps)
        if cfg.get("q_lora_rank"):
            q = _rms(h @ p[f"{a}.q_a_proj.weight"].T, p[f"{a}.q_a_layernorm.weight"], 1e-6)
            q = q @ p[f"{a}.q_b_proj.weight"].T
        else:
            q = h @ p[f"{a}.q_proj.weight"].T
        q = q.reshape(n, heads, dn + dr).transpose(1, 0, 2)
        ckv = h @ p[f"{a}.kv_a_proj_with_mqa.weight"].T
        latent = _rms(ckv[:, :c], p[f"{a}.kv_a_layernorm.weight"], 1e-6)
        kv = (latent @ p[f"{a}.kv_b_proj.weight"].T).reshape(n, heads, dn + dv).transpose(1, 0, 2)
        q_pe = _rope(q[..., dn:], cos, sin)
        k_pe = _rope(ckv[None, :, c:], cos, sin)
        qf = np.concatenate([q[..., :dn], q_pe], -1)
        kf = np.concatenate([kv[..., :dn], np.broadcast_to(k_pe, (heads, n, dr))], -1)
        att = _softmax(qf @ kf.transpose(0, 2, 1) * scale + causal)
        o = (att @ kv[..., dn:]).transpose(1, 0, 2).reshape(n, heads * dv)
        x = x + o @ p[f"{a}.o_proj.weight"].T
        h = _rms(x, p[f"{pre}.post_attention_layernorm.weight"], eps)
        m = f"{pre}.mlp"
        if layer >= cfg["first_k_dense_replace"] and cfg.get("n_routed_experts"):
            weight, idx = _gate(cfg, p[f"{m}.gate.weight"], h)
            out = np.zeros_like(h)
            for t in range(n):
                for j in range(idx.shape[1]):
                    out[t] += weight[t, j] * _mlp(p, f"{m}.experts.{idx[t, j]}", h[t : t + 1])[0]
            if cfg.get("n_shared_experts"):
                out = out + _mlp(p, f"{m}.shared_experts", h)
        else:
            out = _mlp(p, m, h)
        x = x + out
    x = _rms(x, p["model.norm.weight"], eps)
    return x @ p["lm_head.weight"].T

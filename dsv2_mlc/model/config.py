"""DeepSeek-V2 model configuration, built from a Hugging Face ``config.json``.

Accepts both the published spelling (``rope_scaling`` with ``type: yarn`` plus ``rope_theta``) and
the one transformers >= 5 writes (``rope_parameters`` with ``rope_type``). Every value the compiler
cannot honour is rejected with an error that names the key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Dsv2Error
from ..rope import RopeConfig, yarn_get_mscale


class ConfigError(Dsv2Error, ValueError):
    """A ``config.json`` value this compiler does not support (the message names the key)."""


@dataclass(frozen=True)
class DeepseekV2Config:
    """The architecture hyper-parameters of DeepSeek-V2 / V2-Lite / Coder-V2(-Lite)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the non-absorbed attention (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_a_dim(self) -> int:
        """Query rows of the fused ``qkv_a_proj``: ``q_lora_rank`` with q-LoRA, else all the
        query heads (``num_attention_heads * qk_head_dim``)."""
        if self.q_lora_rank is None:
            return self.num_attention_heads * self.qk_head_dim
        return self.q_lora_rank

    @property
    def latent_dim(self) -> int:
        """Width of the cached MLA latent per token per layer (kv_lora_rank + rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` uses DeepSeekMoE (else the dense MLP)."""
        return self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale: qk_head_dim^-0.5, times mscale(mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (round-trips through :meth:`from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV2Config:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        return cls(**d)

    # -- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekV2Config:
        """Build and validate a config from a parsed HF ``config.json``."""
        _validate_hf(hf)
        q_lora_rank = hf.get("q_lora_rank")
        n_routed = int(hf.get("n_routed_experts") or 0)
        cfg = cls(
            vocab_size=_req_int(hf, "vocab_size"),
            hidden_size=_req_int(hf, "hidden_size"),
            intermediate_size=_req_int(hf, "intermediate_size"),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            num_hidden_layers=_req_int(hf, "num_hidden_layers"),
            num_attention_heads=_req_int(hf, "num_attention_heads"),
            q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
            kv_lora_rank=_req_int(hf, "kv_lora_rank"),
            qk_nope_head_dim=_req_int(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=_req_int(hf, "qk_rope_head_dim"),
            v_head_dim=_req_int(hf, "v_head_dim"),
            n_routed_experts=n_routed,
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            topk_method=str(hf.get("topk_method", "greedy")),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope=_parse_rope(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        _validate_sizes(cfg)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV2Config:
        """Read ``config.json`` (or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json found; point at a Hugging Face model folder")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from err
        return cls.from_hf(hf)


_SUPPORTED = {
    "model_type": {"deepseek_v2"},
    "hidden_act": {"silu"},
    "scoring_func": {"softmax"},
    "topk_method": {"greedy", "group_limited_greedy"},
    "moe_layer_freq": {1},
    "attention_bias": {False},
    "mlp_bias": {False},
    "pretraining_tp": {1},
}


def _validate_hf(hf: dict[str, Any]) -> None:
    for key, allowed in _SUPPORTED.items():
        if key in hf and hf[key] is not None and hf[key] not in allowed:
            raise ConfigError(
                f"config.json: unsupported {key}={hf[key]!r}; supported: "
                + ", ".join(repr(v) for v in sorted(allowed, key=str))
            )
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise ConfigError(
            f"config.json: unsupported num_key_value_heads={kv_heads} (MLA requires it to equal "
            f"num_attention_heads={heads})"
        )


def _req_int(hf: dict[str, Any], key: str) -> int:
    if hf.get(key) is None:
        raise ConfigError(f"config.json: missing required key {key!r}")
    try:
        return int(hf[key])
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config.json: {key}={hf[key]!r} is not an integer") from err


def _parse_rope(hf: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from ``rope_scaling`` + ``rope_theta`` or from ``rope_parameters``."""
    params = hf.get("rope_parameters")
    key = "rope_parameters"
    if not params:
        params, key = hf.get("rope_scaling"), "rope_scaling"
    theta = float((params or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    if not params:
        return RopeConfig(theta=theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ConfigError(
            f"config.json: unsupported {key}.type={kind!r}; supported: 'yarn' or none (plain RoPE)"
        )
    if params.get("factor") is None:
        raise ConfigError(f"config.json: {key} of type 'yarn' needs 'factor'")
    if params.get("truncate", True) is not True:
        raise ConfigError(f"config.json: unsupported {key}.truncate=False (DeepSeek truncates)")
    if params.get("attention_factor") is not None:
        raise ConfigError(f"config.json: unsupported {key}.attention_factor (DeepSeek uses mscale)")
    return RopeConfig(
        kind="yarn",
        theta=theta,
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale", 1.0) or 1.0),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0) or 0.0),
    )


def _validate_sizes(cfg: DeepseekV2Config) -> None:
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")
    if cfg.n_routed_experts > 0:
        if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise ConfigError(
                f"config.json: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                f"[1, n_routed_experts={cfg.n_routed_experts}]"
            )
        if cfg.moe_intermediate_size <= 0:
            raise ConfigError("config.json: moe_intermediate_size must be set for MoE layers")
    if cfg.topk_method == "group_limited_greedy":
        if cfg.n_routed_experts % cfg.n_group:
            raise ConfigError(
                f"config.json: n_routed_experts={cfg.n_routed_experts} is not divisible by "
                f"n_group={cfg.n_group}"
            )
        if not 0 < cfg.topk_group <= cfg.n_group:
            raise ConfigError(
                f"config.json: topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]"
            )
        per_group = cfg.n_routed_experts // cfg.n_group
        if cfg.num_experts_per_tok > cfg.topk_group * per_group:
            raise ConfigError(
                f"config.json: num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts "
                f"in topk_group={cfg.topk_group} groups"
            )
    if cfg.tie_word_embeddings:
        raise ConfigError("config.json: unsupported tie_word_embeddings=true (DeepSeek-V2 unties)")

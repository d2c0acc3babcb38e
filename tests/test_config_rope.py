"""Config parsing/validation and the YaRN RoPE tables against Hugging Face."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_reference import CONFIG_A, CONFIG_B

from dsv2_mlc.model.config import ConfigError, DeepseekV2Config
from dsv2_mlc.rope import rope_cos_sin_scale, rope_inv_freq


def test_published_and_transformers5_spellings_agree():
    published = DeepseekV2Config.from_hf(CONFIG_B)
    rope = dict(CONFIG_B["rope_scaling"])
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = CONFIG_B["rope_theta"]
    v5 = {k: v for k, v in CONFIG_B.items() if k not in ("rope_scaling", "rope_theta")}
    v5.update(rope_parameters=rope, head_dim=CONFIG_B["qk_rope_head_dim"])
    assert DeepseekV2Config.from_hf(v5) == published
    assert published.rope.kind == "yarn" and published.rope.factor == 40
    assert published.q_lora_rank == 24 and published.topk_method == "group_limited_greedy"


def test_reads_transformers_saved_config(tmp_path):
    from transformers import DeepseekV2Config as HFConfig

    HFConfig(**CONFIG_A).save_pretrained(tmp_path)  # writes rope_parameters, head_dim, ...
    ours = DeepseekV2Config.from_file(tmp_path)
    assert ours == DeepseekV2Config.from_hf(CONFIG_A)
    assert ours.qk_head_dim == 24  # not HF's forced head_dim (the rope dim)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("moe_layer_freq", 2),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("num_key_value_heads", 1),
    ],
)
def test_unsupported_value_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        DeepseekV2Config.from_hf({**CONFIG_A, key: value})


def test_unsupported_rope_and_bad_sizes():
    with pytest.raises(ConfigError, match="rope_scaling.type='linear'"):
        DeepseekV2Config.from_hf({**CONFIG_A, "rope_scaling": {"type": "linear", "factor": 2}})
    with pytest.raises(ConfigError, match="n_group"):
        DeepseekV2Config.from_hf({**CONFIG_B, "n_group": 3})
    with pytest.raises(ConfigError, match="vocab_size"):
        DeepseekV2Config.from_hf({k: v for k, v in CONFIG_A.items() if k != "vocab_size"})


def test_config_roundtrip(tmp_path):
    cfg = DeepseekV2Config.from_hf(CONFIG_B)
    assert DeepseekV2Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "rope_scaling",
    [
        CONFIG_A["rope_scaling"],
        {**CONFIG_A["rope_scaling"], "mscale": 1.0},  # cos/sin scaled by mscale ratio != 1
        {**CONFIG_A["rope_scaling"], "factor": 4, "original_max_position_embeddings": 512},
        None,
    ],
)
def test_rope_tables_and_softmax_scale_match_hf(rope_scaling):
    from transformers import DeepseekV2Config as HFConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2Attention,
        DeepseekV2RotaryEmbedding,
    )

    hf_dict = {**CONFIG_A, "rope_scaling": rope_scaling, "qk_rope_head_dim": 64}
    hf_cfg = HFConfig(**hf_dict)
    rot = DeepseekV2RotaryEmbedding(hf_cfg)
    ours = DeepseekV2Config.from_hf(hf_dict)
    # float32 pow may differ from torch's by an ulp
    np.testing.assert_allclose(rope_inv_freq(ours.rope, 64), rot.inv_freq.numpy(), rtol=1e-6)
    assert rope_cos_sin_scale(ours.rope) == pytest.approx(rot.attention_scaling, rel=1e-12)
    attn = DeepseekV2Attention(hf_cfg, 0)
    assert ours.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert torch.is_tensor(rot.inv_freq)

"""The weight map (dsv2_mlc/model/weights.py) on real HF checkpoints, and its inverse
(dsv2_mlc/hf_export.py): the fused ``qkv_a_proj`` holds the HF query (or q-LoRA ``q_a``) rows then
the ``kv_a_proj_with_mqa`` rows, and exporting our parameters gives back every HF tensor."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import CONFIGS
from safetensors.numpy import load_file

from dsv2_mlc.hf_export import _FloatParams, _hub_tensors, _Ops
from dsv2_mlc.model.checkpoint import SafetensorsCheckpoint
from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.model.weights import check_checkpoint, convert, weight_map


def _hf_tensors(path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _converted(path, cfg: DeepseekV2Config) -> dict[str, np.ndarray]:
    convs = weight_map(cfg)
    ckpt = SafetensorsCheckpoint(path)
    try:
        check_checkpoint(convs, ckpt)  # every checkpoint tensor consumed
        dtypes = {t: "float32" for conv in convs for t in conv.targets}
        return dict(convert(convs, ckpt, dtypes))
    finally:
        ckpt.close()


@pytest.mark.parametrize("name", ["A", "B"])
def test_qkv_a_proj_concatenates_the_hf_rows(name, checkpoints):
    cfg = DeepseekV2Config.from_hf(CONFIGS[name])
    hf = _hf_tensors(checkpoints[name])
    ours = _converted(checkpoints[name], cfg)
    q_name = "q_proj" if CONFIGS[name]["q_lora_rank"] is None else "q_a_proj"
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn"
        q, kv_a = hf[f"{p}.{q_name}.weight"], hf[f"{p}.kv_a_proj_with_mqa.weight"]
        fused = ours[f"{p}.qkv_a_proj.weight"]
        assert fused.shape == (q.shape[0] + kv_a.shape[0], cfg.hidden_size)
        np.testing.assert_array_equal(fused[: q.shape[0]], q)
        np.testing.assert_array_equal(fused[q.shape[0] :], kv_a)
        assert f"{p}.{q_name}.weight" not in ours and f"{p}.kv_a_proj_with_mqa.weight" not in ours


@pytest.mark.parametrize("name", ["A", "B"])
def test_export_inverts_the_weight_map(name, checkpoints):
    cfg = DeepseekV2Config.from_hf(CONFIGS[name])
    hf = _hf_tensors(checkpoints[name])
    ours = _converted(checkpoints[name], cfg)
    ops = _Ops(lambda n: ours[n], group=32, use_torch=False)
    back = dict(_hub_tensors(cfg, _FloatParams(list(ours), ops)))
    assert sorted(back) == sorted(hf)
    for key, tensor in hf.items():
        np.testing.assert_array_equal(back[key], tensor.astype(np.float32), err_msg=key)

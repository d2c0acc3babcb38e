"""QuantizeInt4 (nn-level rewrite): what it replaces, what it leaves alone, the plan it returns."""

from __future__ import annotations

import tvm
from hf_reference import CONFIG_B
from tvm.relax.frontend import nn

from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.model.deepseek_v2 import DeepseekV2ForCausalLM
from dsv2_mlc.quant import QuantizedParam, get_quantization
from dsv2_mlc.quant.mutator import quantize_model
from dsv2_mlc.schedules.dequantize_cuda import DEQUANTIZE_ATTR


class Proj(nn.Module):
    def __init__(self):
        self.proj = nn.Linear(64, 32, bias=False, dtype="float32")

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.proj(x)


def _export(model: nn.Module):
    spec = {"forward": {"x": nn.spec.Tensor([1, 64], "float32"), "$": {"param_mode": "plain"}}}
    return model.export_tvm(spec=spec)


def _dequantize_groups(mod: tvm.IRModule) -> list[int]:
    return [
        int(f.attrs[DEQUANTIZE_ATTR])
        for _, f in mod.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and DEQUANTIZE_ATTR in f.attrs
    ]


def test_linear_becomes_packed_weights_and_a_marked_dequantize():
    before, before_params = _export(Proj())
    assert [(n, tuple(p.shape), p.dtype) for n, p in before_params] == [
        ("proj.weight", (32, 64), "float32")
    ]
    assert _dequantize_groups(before) == []

    model = Proj()
    plan = quantize_model(model, get_quantization("q4f32_g32"))
    after, params = _export(model)
    assert plan == {"proj.weight": QuantizedParam("proj.q_weight", "proj.q_scale", 32, "float32")}
    assert [(n, tuple(p.shape), p.dtype) for n, p in params] == [
        ("proj.q_weight", (32, 8), "uint32"),
        ("proj.q_scale", (32, 2), "float32"),
    ]
    assert _dequantize_groups(after) == [32]
    assert "R.matmul" in after["forward"].script()


def test_does_not_fire_for_float_schemes():
    model = Proj()
    assert quantize_model(model, get_quantization("q0f16")) == {}
    assert isinstance(model.proj, nn.Linear)


def test_model_keeps_gate_norms_and_absorbed_mla_in_float():
    cfg = DeepseekV2Config.from_hf(CONFIG_B)
    model = DeepseekV2ForCausalLM(cfg, "float16", tvm.target.Target({"kind": "llvm"}))
    plan = quantize_model(
        model, get_quantization("q4f16_g128", quantize_embedding=False, quantize_lm_head=True)
    )
    with tvm.target.Target({"kind": "llvm"}):
        _, params = model.export_tvm(spec=model.get_default_spec())
    dtypes = {name: p.dtype for name, p in params}
    assert dtypes["model.embed_tokens.weight"] == "float16"  # --no-quantize-embedding
    assert dtypes["lm_head.q_weight"] == "uint32"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "float32"  # the router stays fp32
    assert dtypes["model.layers.1.self_attn.kv_b_proj.w_uk"] == "float16"
    assert dtypes["model.layers.1.input_layernorm.weight"] == "float16"
    assert dtypes["model.layers.1.mlp.experts.gate_up_q_weight"] == "uint32"
    assert "model.layers.1.mlp.experts.gate_up_proj" in plan
    assert all(not name.endswith(("norm.weight", "gate.weight", "w_uk", "w_uv")) for name in plan)


class _Packed(nn.Module):
    def __init__(self):
        self.w_q_weight = nn.Parameter((4, 1), "uint32")


class _OwnForm(nn.Module):
    """A module with its own INT4 form (the protocol of ``dsv2_mlc.quant.mutator``)."""

    def __init__(self):
        self.w = nn.Parameter((4, 8), "float32")

    def int4_form(self, q) -> tuple[nn.Module, dict[str, str]]:
        return _Packed(), {"w": "w_"}


class _Holder(nn.Module):
    def __init__(self):
        self.inner = _OwnForm()


def test_a_module_with_its_own_int4_form_is_swapped_and_recorded():
    model = _Holder()
    plan = quantize_model(model, get_quantization("q4f32_g32"))
    assert isinstance(model.inner, _Packed)
    assert plan == {"inner.w": QuantizedParam("inner.w_q_weight", "inner.w_q_scale", 32, "float32")}

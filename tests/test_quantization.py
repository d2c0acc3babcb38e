"""INT4 group quantization: the NumPy codec, and the compiled INT4 model against HF run on the
same INT4 weights dequantised back to float32 (so a kernel bug cannot hide behind quantization
noise), plus the fused kernels in the compiled module."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import CONFIGS, PROMPT, hf_greedy, hf_logits

from dsv2_mlc.quant import dequantize_int4, quantize_int4

KERNEL_TOL = 1e-3


def test_codec_roundtrip_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 96)).astype(np.float32)  # 96 = 3 groups of 32
    packed, scale = quantize_int4(w, 32, "float32")
    assert packed.shape == (16, 12) and packed.dtype == np.uint32 and scale.shape == (16, 3)
    back = dequantize_int4(packed, scale, 32)
    step = np.repeat(scale, 32, axis=-1)
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)
    assert np.allclose(np.abs(back).reshape(16, 3, 32).max(-1), 7 * scale)  # max maps to +-7


def test_codec_bit_layout_and_partial_last_group():
    # Nibble i of word j holds element 8j+i, offset by 8; a ragged last group (K=40, G=32).
    w = np.zeros((1, 40), np.float32)
    w[0, :8] = [0, 1, 2, 3, -1, -2, -3, -7]
    w[0, 32:40] = 0.5
    packed, scale = quantize_int4(w, 32, "float32")
    assert scale.shape == (1, 2) and scale[0, 0] == pytest.approx(1.0)
    nibbles = [(int(packed[0, 0]) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [8, 9, 10, 11, 7, 6, 5, 1]
    np.testing.assert_allclose(dequantize_int4(packed, scale, 32), w, atol=1e-7)


def read_tensor_cache(params_dir: Path) -> dict[str, np.ndarray]:
    """Read TVM's tensor-cache format (json + raw shards) with NumPy alone."""
    meta = json.loads((params_dir / "tensor-cache.json").read_text())
    out = {}
    for shard in meta["records"]:
        data = (params_dir / shard["dataPath"]).read_bytes()
        for rec in shard["records"]:
            arr = np.frombuffer(
                data,
                rec["dtype"],
                offset=rec["byteOffset"],
                count=rec["nbytes"] // np.dtype(rec["dtype"]).itemsize,
            )
            out[rec["name"]] = arr.reshape(rec["shape"])
    return out


def dequantized_hf_state(params: dict[str, np.ndarray], cfg: dict, group: int) -> dict:
    """Invert the weight map: our (INT4) parameters -> HF tensors, dequantised to float32.

    HF keeps routed experts stacked in memory (``experts.gate_up_proj`` [E, 2I, H], gate rows
    first, and ``experts.down_proj``), exactly our layout, so those map one to one."""

    def weight(prefix: str) -> np.ndarray:
        if f"{prefix}q_weight" in params:
            return dequantize_int4(params[f"{prefix}q_weight"], params[f"{prefix}q_scale"], group)
        return params[f"{prefix.rstrip('.')}.weight" if prefix.endswith(".") else prefix]

    state = {}
    for name in params:
        if name.endswith(".q_scale") or name.endswith("_q_scale"):
            continue
        if name.endswith(".q_weight"):
            base = name[: -len("q_weight")]
            full = weight(base)
            hf = base + "weight"
        elif name.endswith("_q_weight"):  # stacked experts: gate_up_q_weight / down_q_weight
            base = name[: -len("q_weight")]
            full = weight(base)
            hf = base.replace("gate_up_", "gate_up_proj").replace("down_", "down_proj")
        else:
            full, hf = params[name].astype(np.float32), name
        if hf.endswith("kv_b_proj.w_uk"):
            w_uv = params[hf[: -len("w_uk")] + "w_uv"].astype(np.float32)
            full = np.concatenate([full, w_uv], axis=1).reshape(-1, cfg["kv_lora_rank"])
            hf = hf[: -len("w_uk")] + "weight"
        elif hf.endswith("kv_b_proj.w_uv"):
            continue
        if hf.endswith("gate_up_proj.weight"):
            half = full.shape[0] // 2
            state[hf.replace("gate_up_proj", "gate_proj")] = full[:half]
            state[hf.replace("gate_up_proj", "up_proj")] = full[half:]
            continue
        if hf.endswith("qkv_a_proj.weight"):  # query (or q-LoRA q_a) rows, then kv_a rows
            lora = cfg.get("q_lora_rank")
            q_rows = lora or cfg["num_attention_heads"] * (
                cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            )
            state[hf.replace("qkv_a_proj", "q_a_proj" if lora else "q_proj")] = full[:q_rows]
            state[hf.replace("qkv_a_proj", "kv_a_proj_with_mqa")] = full[q_rows:]
            continue
        state[hf] = full
    return {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in state.items()}


@pytest.fixture(scope="module")
def int4_builds(checkpoints, tmp_path_factory):
    from dsv2_mlc.compiler.compile import compile_model

    root = tmp_path_factory.mktemp("int4")
    builds = {}
    for name, quant in (("A", "q4f32_g32"), ("B", "q4f32_g128")):
        builds[name] = compile_model(
            checkpoints[name], root / name, quantization=quant, dump_ir=root / f"ir{name}",
            progress=False,
        )  # fmt: skip
    return builds


@pytest.mark.parametrize(("name", "group"), [("A", 32), ("B", 128)])
def test_int4_kernels_match_hf_on_dequantized_weights(name, group, int4_builds, checkpoints):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from dsv2_mlc.runtime.engine import Engine

    build = int4_builds[name]
    params = read_tensor_cache(build.out_dir / "params")
    assert any(k.endswith("q_weight") for k in params)
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(**CONFIGS[name])).eval()
    missing, unexpected = hf.load_state_dict(dequantized_hf_state(params, CONFIGS[name], group))
    assert not missing and not unexpected
    eng = Engine(build.out_dir, context_window=128)
    ours, ref = eng.logits(PROMPT), hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() < KERNEL_TOL
    assert eng.generate(PROMPT, 16, stop_token_ids=[]).token_ids == hf_greedy(hf, PROMPT, 16)


def test_compiled_int4_module_has_fused_kernels_and_no_dequantized_weight(int4_builds):
    build = int4_builds["A"]
    irs = sorted((build.out_dir.parent / "irA").glob("*.py"))
    rewritten = next(p for p in irs if p.name.endswith("rewrite.py")).read_text()
    final = irs[-1].read_text()
    # The dequantize kernels that QuantizeInt4 emitted are all gone after the rewrite phase:
    # every INT4 weight is read inside a matmul's reduction, never written out in float.
    assert "R.call_tir(cls.dequantize" in irs[0].read_text()
    assert "cls.dequantize," not in rewritten and "cls.dequantize1," not in rewritten
    kernels = re.findall(r"def (\w+)\(", final)
    for kernel in (
        "fused_dequantize_matmul",
        "fused_add_rms_norm",
        "fused_silu_mul",
        "moe_route",
        "moe_gate_up_q4",
        "moe_down_q4",
        "embedding_dequantize",
        "latent_norm_rope",  # RMSNorm + RoPE of the latent appended to the cache: one kernel
    ):
        assert any(kernel in k for k in kernels), kernel  # FuseOps may prefix/suffix it
    assert "dsv2_mlc.dequantize_int4_group" not in final

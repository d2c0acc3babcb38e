"""Residual add + RMSNorm folded into the decode kernels that read the norm
(schedules/norm_gemv_cuda.py): which shapes they take, that they compile for sm_90, and where the
model uses them. Their numerics: tests/test_decode_emulation.py (TVM's CUDA source run on the CPU
against NumPy) and, on the H200, scripts/gpu_numerics.py (tiny models vs HF)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import tvm

from dsv2_mlc.compiler.compile import make_target
from dsv2_mlc.compiler.cuda import cuda_codegen
from dsv2_mlc.schedules.norm_gemv_cuda import (
    add_norm_gemv_kernel,
    add_norm_gemv_q4,
    add_norm_router,
    add_norm_router_kernel,
    add_norm_unsupported,
)
from dsv2_mlc.schedules.tiles import NormGemvTiles, NormRouterTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import entry_ir, needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A, CONFIG_B  # noqa: E402


def test_unsupported_shapes_say_why():
    assert add_norm_unsupported(2048, 128) is None and add_norm_unsupported(64) is None
    assert "hidden 2050" in add_norm_unsupported(2050)
    assert "group 48" in add_norm_unsupported(2048, 48)
    assert "group 128" in add_norm_unsupported(64, 128)
    with pytest.raises(ValueError, match="add_norm_gemv_q4"):
        add_norm_gemv_q4(2050, 3648, 128, 1e-6)
    with pytest.raises(ValueError, match="add_norm_router"):
        add_norm_router(100, 64, 1e-6)


@needs_nvcc
def test_kernels_compile_for_sm90():
    target = make_target("cuda", "sm_90")
    funcs = {
        "g_lite": add_norm_gemv_q4(2048, 3648, 128, 1e-6),
        "g_v2": add_norm_gemv_kernel(5120, 2112, 128, 1e-6, NormGemvTiles(4, 132, 8)),
        "g_tiny": add_norm_gemv_kernel(64, 152, 32, 1e-5, NormGemvTiles(2, 3)),
        "r_lite": add_norm_router(2048, 64, 1e-6),
        "r_v2": add_norm_router_kernel(5120, 160, 1e-6, NormRouterTiles(warps=8)),
        "r_tiny": add_norm_router(64, 8, 1e-5),
    }
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    with target, cuda_codegen():
        lib = tvm.compile(mod, target=target)
    src = next(m for m in lib.mod.imports_ if m.kind == "cuda").inspect_source()
    for name in funcs:
        assert f"{name}_kernel(" in src, name
    # the epsilon is baked into each kernel's source
    assert "1e-05f" in src and "1e-06f" in src


# the model's calls of the prefetch INT4 GEMV (dsv2_mlc/quant/decode_linear.py), by kernel name
PREFETCH_GEMVS = ("qkv_a_decode", "o_proj_decode", "mlp_down_decode")


@needs_nvcc
@pytest.mark.parametrize("cfg", [CONFIG_A, CONFIG_B], ids=["A", "B"])
def test_cuda_decode_folds_the_norms_and_prefetches_the_gemvs(tmp_path: Path, cfg: dict):
    (decode,) = entry_ir(tmp_path, cfg, "q4f16_g32", "cuda", ("batch_decode",))
    layers, dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    # every layer after the first: qkv_a with its input norm; every MoE layer: the router with
    # the post-attention norm; what is left: the dense layer's post-attention norm, the final one
    assert decode.count("cls.add_norm_qkv_a,") == layers - 1
    assert decode.count("cls.add_norm_router,") == layers - dense
    assert decode.count("cls.fused_add_rms_norm,") == dense + 1
    assert "moe_gate_logits" not in decode
    # the INT4 linears no fused kernel covers: GEMVs that load their weights before they wait
    # (identical PrimFuncs are shared, so a call may name another layer's; q_b_proj's 24-wide
    # rows are not whole 32-element chunks: it stays a TIR GEMV)
    calls = re.findall(r"R\.call_tir\(cls\.(\w+), \([^)]*?(model_layers_\w+?)_q_weight", decode)
    gemvs = sorted(w for f, w in calls if f in PREFETCH_GEMVS)
    expect = [f"model_layers_{i}_self_attn_o_proj" for i in range(layers)]
    expect += ["model_layers_0_self_attn_qkv_a_proj"]
    expect += [f"model_layers_{i}_mlp_down_proj" for i in range(dense)]
    assert gemvs == sorted(expect)


@pytest.mark.parametrize("quantization, device", [("q4f16_g32", "cpu"), ("q0f16", "cuda")])
def test_other_builds(tmp_path: Path, quantization: str, device: str):
    if device == "cuda" and (shutil.which("nvcc") is None or shutil.which("gcc") is None):
        pytest.skip("CUDA builds need nvcc")
    (decode,) = entry_ir(tmp_path, CONFIG_A, quantization, device, ("batch_decode",))
    # q0f16 on CUDA: the router keeps its norm folded in (fp32 gate), qkv_a is not INT4
    assert "add_norm_qkv_a" not in decode
    for name in PREFETCH_GEMVS:
        assert f"cls.{name}," not in decode  # no INT4 prefetch GEMV (CPU; float weights)
    assert ("cls.add_norm_router," in decode) == (device == "cuda")

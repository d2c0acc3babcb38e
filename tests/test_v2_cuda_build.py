"""The CUDA build of a DeepSeek-V2 (236B)-shaped model compiles, exports and takes the hand kernels.

The config is ``scripts/gpu_v2_numerics.py``'s ``V2_SHAPED``: V2's real widths (hidden 5120, 128
heads, q-LoRA of rank 1536, 160 routed experts of width 1536, top-6 of group-limited routing
over 8 groups keeping 3) in three layers, one dense and two MoE (the GPU script compares the
same model with HF on the H200). Built once for sm_90 in INT4 (q4f16_g128) with random weights:
the exported library embeds sm_90 machine code and no CUDA source, loads through the thin
runtime without the compiler, and its decode entry runs the kernels V2-Lite's decode runs
(the add + RMSNorm GEMV, the fused MLA prologue, the fused MoE pair with the group-limited
warp router) plus q-LoRA's ``q_b_proj``, with the tiles ``schedules/tiles.py`` has for hidden
5120. Kernel numerics at these widths: ``tests/test_moe_v2_emulation.py`` and the V2 cases of
the other ``*_emulation.py`` tests.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from cuda_builds import Build, needs_nvcc
from scripts_module import load_script

from dsv2_mlc.compiler.cuda import build_driver_stub, check_fatbin
from dsv2_mlc.layout import BUILD_CONFIG, LIBRARY
from dsv2_mlc.schedules.moe_decode_cuda import MoeDecodeShape, gate_up_source
from dsv2_mlc.schedules.tiles import tuned

V2_SHAPED = load_script("gpu_v2_numerics").V2_SHAPED
MOE_LAYERS = V2_SHAPED["num_hidden_layers"] - V2_SHAPED["first_k_dense_replace"]

pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def v2_build(model_builds) -> Build:
    return model_builds.get(V2_SHAPED, "q4f16_g128", "cuda")


def test_config_is_v2_cut_to_one_dense_and_two_moe_layers():
    assert V2_SHAPED["first_k_dense_replace"] == 1 and MOE_LAYERS == 2
    assert V2_SHAPED["q_lora_rank"] == 1536 and V2_SHAPED["n_routed_experts"] == 160
    assert (V2_SHAPED["n_group"], V2_SHAPED["topk_group"]) == (8, 3)
    assert V2_SHAPED["topk_method"] == "group_limited_greedy"


def test_v2_export_holds_sm90_fatbin_and_no_source(v2_build: Build):
    check_fatbin(v2_build.out_dir / LIBRARY, "sm_90")
    build = json.loads((v2_build.out_dir / BUILD_CONFIG).read_text())
    assert build["device"] == "cuda" and build["dtype"] == "float16"
    model = build["model"]
    assert (model["hidden_size"], model["q_lora_rank"], model["n_group"]) == (5120, 1536, 8)
    names = build["param_names"]
    for i in range(V2_SHAPED["num_hidden_layers"]):
        assert f"model.layers.{i}.self_attn.q_b_proj.q_weight" in names
        assert f"model.layers.{i}.self_attn.q_a_layernorm.weight" in names


def test_v2_export_loads_without_compiler_or_nvrtc(v2_build: Build):
    code = textwrap.dedent(
        f"""
        import ctypes, sys
        import tvm_ffi
        ctypes.CDLL({str(build_driver_stub())!r}, mode=ctypes.RTLD_GLOBAL)
        from dsv2_mlc.runtime.tvm_runtime import load_runtime
        load_runtime("cuda")
        vm = tvm_ffi.load_module({str(v2_build.out_dir / LIBRARY)!r})["vm_load_executable"]()
        assert "tvm" not in sys.modules
        print("LOADED", vm["get_function_arity"]("batch_decode"))
        print("EXPERT_MAJOR", vm["get_function_arity"]("batch_decode_expert_major"))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED 3" in proc.stdout and "EXPERT_MAJOR 3" in proc.stdout


def test_v2_decode_runs_the_hand_kernels_with_group_limited_routing(v2_build: Build):
    decode, prefill = v2_build.entries(("batch_decode", "batch_prefill"))
    layers = V2_SHAPED["num_hidden_layers"]
    assert decode.count("cls.mla_prologue,") == layers  # q from q_b_proj, latent from qkv_a
    assert decode.count("cls.add_norm_qkv_a,") == layers - 1  # layer 0 has no residual yet
    assert decode.count("cls.add_norm_router,") == MOE_LAYERS
    for fused in ("moe_decode_gate_up", "moe_decode_down"):
        assert decode.count(f"cls.{fused},") == MOE_LAYERS, fused
        assert fused not in prefill
    assert "moe_route" not in decode  # the router runs inside the gate/up kernel
    assert "cls.moe_route," in prefill  # prefill's router kernel (group-limited too)
    # the gate/up kernel routes with the group limit (8 groups, best 3, scaled by 16) and takes
    # the tiles for hidden 5120
    shape = MoeDecodeShape(5120, 1536, 3072, 160, 6, 128, 8, 3, False, 16.0)
    name, _ = gate_up_source(shape, tuned("moe_decode_gate_up", shape=(5120,)))
    cuda = "".join(v2_build.cuda_sources)
    assert re.search(rf"\b{name}\(", cuda), name
    assert "dsv2_route_e160_k6_g8_t3_s16p0" in name
    other, _ = gate_up_source(shape, tuned("moe_decode_gate_up"))  # the table's default tiles
    assert other != name and other not in cuda

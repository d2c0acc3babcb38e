"""The fused MoE decode kernels (schedules/moe_decode_cuda.py): which shapes they take, that
they compile for sm_90 over a sweep of shapes and tilings, and where the model uses them. Their
numerics: ``tests/test_moe_decode_emulation.py`` runs them on the CPU against NumPy; on the GPU,
``schedules/lab/kernel_lab_moe_decode.py`` checks them against a torch float32 reference,
``scripts/gpu_numerics.py`` the tiny models built with them against HF."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import tvm

from dsv2_mlc.compiler.compile import make_target
from dsv2_mlc.compiler.cuda import cuda_codegen
from dsv2_mlc.schedules.moe_decode_cuda import (
    MoeDecodeShape,
    down_decode_kernel,
    down_source,
    gate_up_decode_kernel,
    gate_up_source,
    moe_down_decode,
    moe_gate_up_decode,
)
from dsv2_mlc.schedules.tiles import DecodeTiles, GateUpTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import entry_ir, needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A, CONFIG_B  # noqa: E402

LITE = MoeDecodeShape(2048, 1408, 2816, 64, 6, 128)
V2 = MoeDecodeShape(5120, 1536, 3072, 160, 6, 128, 8, 3, False, 16.0)
TINY_B = MoeDecodeShape(64, 32, 64, 8, 2, 32, 4, 2, False, 16.0)
TINY_RENORM = MoeDecodeShape(64, 32, 64, 8, 2, 32, 1, 1, True, 1.0)


@pytest.mark.parametrize(
    "shape, why",
    [
        (MoeDecodeShape(2048, 1400, 2800, 64, 6, 128), "inter 1400"),
        (MoeDecodeShape(2048, 1408, 2816, 64, 6, 16), "group 16"),
        (MoeDecodeShape(2048, 1408, 0, 64, 6, 128), "shared intermediate 0"),
        (MoeDecodeShape(2048, 1408, 2816, 64, 6, 256), "inter 1408 is not a multiple of the group"),
        (MoeDecodeShape(2048, 1408, 2816 * 8, 64, 6, 128), "shared memory"),
    ],
)
def test_unsupported_shapes_say_why_and_do_not_build(shape: MoeDecodeShape, why: str):
    assert why in (shape.unsupported() or "")
    with pytest.raises(ValueError, match="moe_gate_up_decode"):
        moe_gate_up_decode(shape)
    with pytest.raises(ValueError, match="moe_down_decode"):
        moe_down_decode(shape)


def test_supported_shapes():
    for shape in (LITE, V2, TINY_B, TINY_RENORM):
        assert shape.unsupported() is None
        assert shape.total == shape.top_k * shape.inter + shape.shared_inter


def test_sources_carry_the_routing_and_the_tiling():
    # the routing parameters select the router (group limit, renormalise vs scale)
    names = {gate_up_source(s, GateUpTiles(8, 264))[0] for s in (LITE, V2, TINY_B, TINY_RENORM)}
    assert len(names) == 4
    _, src = gate_up_source(V2, GateUpTiles(8, 264))
    assert "w[j] * 16.0f" in src and "keep" in src
    _, src = gate_up_source(TINY_RENORM, GateUpTiles(8, 264))
    assert "w[j] / (total + 1e-20f)" in src
    # one source per tiling: the lab builds several into one process
    a, b = down_source(LITE, DecodeTiles(8, 32, 2)), down_source(LITE, DecodeTiles(4, 32, 4))
    assert a[0] != b[0]


@needs_nvcc
@pytest.mark.parametrize("shape", [LITE, V2, TINY_B, TINY_RENORM], ids=["lite", "v2", "B", "C"])
def test_kernels_compile_for_sm90(shape: MoeDecodeShape):
    target = make_target("cuda", "sm_90")
    gate_up = [GateUpTiles(8, 264), GateUpTiles(4, 132, 8), GateUpTiles(16, 7), GateUpTiles(8, 9)]
    down = [DecodeTiles(4, 16, 2), DecodeTiles(4, 32, 1), DecodeTiles(8, 32, 2, 8),
            DecodeTiles(8, 32, 1, 8, 2)]  # fmt: skip
    tilings = list(zip(gate_up, down, strict=True))
    funcs = {}
    for i, (gu, dn) in enumerate(tilings):
        funcs[f"gu{i}"] = gate_up_decode_kernel(shape, gu).with_attr("global_symbol", f"gu{i}")
        funcs[f"dn{i}"] = down_decode_kernel(shape, dn).with_attr("global_symbol", f"dn{i}")
    # the shipped tiles (schedules/tiles.py)
    funcs["gu"] = moe_gate_up_decode(shape).with_attr("global_symbol", "gu")
    funcs["dn"] = moe_down_decode(shape).with_attr("global_symbol", "dn")
    with target, cuda_codegen():
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
    cuda = [m for m in lib.mod.imports_ if m.kind == "cuda"]
    assert cuda
    src = cuda[0].inspect_source()
    for name in [f"{k}{i}" for i in range(len(tilings)) for k in ("gu", "dn")] + ["gu", "dn"]:
        assert re.search(rf"__global__ void __launch_bounds__\(\d+(, \d+)?\) {name}_kernel", src)


@needs_nvcc
def test_int4_cuda_decode_uses_the_fused_kernels_and_prefill_does_not(tmp_path: Path):
    decode, prefill = entry_ir(tmp_path, CONFIG_B, "q4f16_g32", "cuda")
    moe_layers = CONFIG_B["num_hidden_layers"] - CONFIG_B["first_k_dense_replace"]
    for fused in ("moe_decode_gate_up", "moe_decode_down"):
        assert decode.count(f"cls.{fused},") == moe_layers, fused
        assert fused not in prefill
    # the gathers, the router kernel and the shared experts' own GEMVs are gone from decode
    assert "moe_gate_up_q4" not in decode and "moe_route" not in decode
    # the router logits come with the post-attention norm (norm_gemv_cuda)
    assert decode.count("cls.add_norm_router,") == moe_layers


@pytest.mark.parametrize("quantization, device", [("q4f16_g32", "cpu"), ("q0f16", "cuda")])
def test_other_builds_keep_the_gather_kernels(tmp_path: Path, quantization: str, device: str):
    if device == "cuda" and (shutil.which("nvcc") is None or shutil.which("gcc") is None):
        pytest.skip("CUDA builds need nvcc")
    decode, _ = entry_ir(tmp_path, CONFIG_A, quantization, device)
    assert "moe_decode_gate_up" not in decode and "moe_decode_down" not in decode
    assert "cls.moe_route," in decode

"""The fused MLA prologue on CUDA (``dsv2_mlc.schedules.mla_prologue_cuda``), no GPU: the kernel
compiles to sm_90 machine code at the model's shapes, and a compiled tiny CUDA model runs one
``qkv_a_proj`` GEMV and this kernel per layer in decode (and extend) instead of two GEMVs, the
latent kernel and a separate query absorption. Its numerics against NumPy:
test_mla_prologue_emulation.py; the CPU path (the Relax / TE composition) is checked against
Hugging Face by test_e2e_hf.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tvm

from dsv2_mlc.schedules.mla_prologue_cuda import build_mla_prologue, mla_prologue_cuda
from dsv2_mlc.schedules.tiles import MLAPrologueTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import entry_ir, needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A, CONFIG_B  # noqa: E402


def _compiles(func, tmp_path: Path) -> None:
    from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"p": func.with_attr("global_symbol", "p")}), target)
    exe.export_library(str(tmp_path / "p.so"))
    check_fatbin(tmp_path / "p.so", "sm_90")


@needs_nvcc
@pytest.mark.parametrize(
    ("heads", "nope", "rope", "lora", "q_a", "dtype"),
    [
        (16, 128, 64, 512, None, "float16"),  # V2-Lite: q and the latent in one tensor
        (128, 128, 64, 512, 1536, "float16"),  # V2: q-LoRA, q from q_b_proj
        (4, 16, 8, 32, None, "float16"),  # the tiny test models
        (4, 16, 8, 32, 24, "float32"),
    ],
)
def test_kernel_compiles_to_sm90(tmp_path: Path, heads, nope, rope, lora, q_a, dtype) -> None:
    q_width = heads * (nope + rope)
    kv_offset = q_width if q_a is None else q_a
    func = mla_prologue_cuda(
        heads, nope, rope, lora, dtype, q_width=q_width + (0 if q_a else lora + rope),
        kv_width=kv_offset + lora + rope, kv_offset=kv_offset, eps=1e-6,
    )  # fmt: skip
    _compiles(func, tmp_path)


def test_blocks_per_token() -> None:
    """One latent block plus ``ceil(L / cols)`` column tiles per head: 129 blocks for V2-Lite at
    batch 1."""
    func = mla_prologue_cuda(
        16, 128, 64, 512, "float16", q_width=3648, kv_width=3648, kv_offset=3072, eps=1e-6
    )
    grid = re.findall(r"T.thread_binding\((.*), thread=\"blockIdx.x\"\)", func.script())
    assert grid == ["n * T.int64(129)"]


def test_rejects_unsupported_shapes() -> None:
    ok = {"q_width": 192, "kv_width": 192 + 40, "kv_offset": 192, "eps": 1e-6}
    mla_prologue_cuda(8, 16, 8, 32, "float16", **ok)
    with pytest.raises(ValueError, match="L=36"):
        mla_prologue_cuda(8, 16, 8, 36, "float16", **{**ok, "kv_width": 236})
    with pytest.raises(ValueError, match="rope=7"):
        mla_prologue_cuda(8, 16, 7, 32, "float16", **ok)
    with pytest.raises(ValueError, match="cols=12"):
        build_mla_prologue(8, 16, 8, 32, "float16", MLAPrologueTiles(cols=12, threads=128), **ok)
    with pytest.raises(ValueError, match="threads=80"):
        build_mla_prologue(8, 16, 8, 32, "float16", MLAPrologueTiles(cols=64, threads=80), **ok)
    with pytest.raises(ValueError, match="kv_offset"):
        mla_prologue_cuda(8, 16, 8, 32, "float16", **{**ok, "kv_width": 200})


def _kernels(body: str) -> list[str]:
    return re.findall(r"R\.call_tir\(cls\.(\w+),", body)


@needs_nvcc
@pytest.mark.parametrize("name", ["A", "B"])
def test_tiny_cuda_build_runs_one_projection_and_the_prologue(tmp_path: Path, name: str):
    cfg_dict = {"A": CONFIG_A, "B": CONFIG_B}[name]
    entries = tuple(f"batch_{f}" for f in ("decode", "extend", "prefill"))
    decode, extend, prefill = entry_ir(
        tmp_path, cfg_dict, "q4f16_g32", "cuda", entries, "04-schedule.py"
    )
    layers = cfg_dict["num_hidden_layers"]
    for body in (decode, extend):
        kernels = _kernels(body)
        assert kernels.count("mla_prologue") == layers
        assert not [k for k in kernels if "absorb_q" in k or "latent_norm_rope" in k]
    assert not [k for k in _kernels(decode) if "split" in k]  # q and the latent read in place
    for layer in range(layers):  # one GEMV reads the fused weight, none the HF ones
        calls = re.findall(rf"model_layers_{layer}_self_attn_(\w+)_q_weight\d*,", decode)
        assert calls.count("qkv_a_proj") == 1, calls
        assert not {"q_proj", "q_a_proj", "kv_a_proj_with_mqa"} & set(calls), calls
    kernels = _kernels(prefill)  # prefill: the latent kernel alone, no absorbed query
    assert "mla_prologue" not in kernels
    assert sum("latent_norm_rope" in k for k in kernels) == layers

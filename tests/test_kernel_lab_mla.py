"""The MLA kernel labs' builds (``schedules/lab/kernel_lab_mla.py``, ``kernel_lab_absorb.py``,
``kernel_lab_prefill_attn.py``), no GPU: every variant their ``prepare`` builds (the shipped
builders' inner, tile-taking functions with the table's tiles changed; the MLA lab's FP8 variants
too) compiles to sm_90 machine code at V2-Lite's shapes, and the FP8 lab's inputs pass its
self-check (the model's quantisation kernel, ml_dtypes, NumPy and the product's CPU attention,
with a control that must fail). Lab only (``-m lab``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import tvm
from cuda_builds import needs_nvcc
from scripts_module import load_script

from dsv2_mlc.schedules.mla_attention_cuda import build_mla_attention
from dsv2_mlc.schedules.mla_prologue_cuda import build_mla_prologue
from dsv2_mlc.schedules.prefill_attention_cuda import build_prefill_attention
from dsv2_mlc.schedules.tiles import tuned

pytestmark = [pytest.mark.lab, needs_nvcc]


def _compiles(func: tvm.tirx.PrimFunc, tmp_path: Path) -> None:
    from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"m": func.with_attr("global_symbol", "m")}), target)
    exe.export_library(str(tmp_path / "m.so"))
    check_fatbin(tmp_path / "m.so", "sm_90")


def _variants(script: str) -> dict:
    return load_script(script).VARIANTS


@pytest.mark.parametrize("variant", sorted(_variants("kernel_lab_mla")))
def test_attention_variants_compile(tmp_path: Path, variant: str) -> None:
    tiles = replace(tuned("mla_attention"), **_variants("kernel_lab_mla")[variant])
    _compiles(build_mla_attention(16, 512, 64, "float16", tiles), tmp_path)


_LAB = load_script("kernel_lab_mla")


@pytest.mark.parametrize("variant", sorted([*_LAB.FP8_VARIANTS, *_LAB.F16_VARIANTS]))
def test_attention_fp8_lab_variants_compile(tmp_path: Path, variant: str) -> None:
    """The FP8 lab's variants (and its float16 ones), the lab's streams block included."""
    lab = _LAB
    fp8 = variant in lab.FP8_VARIANTS
    base = tuned("mla_attention", shape=(16, 512, 64, "e4m3" if fp8 else "float16"))
    fields = (lab.FP8_VARIANTS if fp8 else lab.F16_VARIANTS)[variant]
    tiles, stream_warps = lab.variant(base, fields)
    func = lab.build_variant(tiles, stream_warps, lab.fp8.FP8_KV_SCALE if fp8 else None)
    _compiles(func, tmp_path)
    resources = lab.fp8.kernel_resources(tmp_path / "m.so")
    assert 0 < resources["m_kernel"]["regs"] <= 255, resources  # the split kernel's cubin read


@pytest.mark.parametrize("kv_scale", [0.5, 1.0])
def test_fp8_lab_selfcheck(kv_scale: float) -> None:
    assert load_script("kernel_lab_mla").selfcheck(kv_scale)


@pytest.mark.parametrize("variant", sorted(_variants("kernel_lab_absorb")))
def test_prologue_variants_compile(tmp_path: Path, variant: str) -> None:
    tiles = replace(tuned("mla_prologue"), **_variants("kernel_lab_absorb")[variant])
    func = build_mla_prologue(
        16, 128, 64, 512, "float16", tiles, q_width=3648, kv_width=3648, kv_offset=3072, eps=1e-6
    )
    _compiles(func, tmp_path)


@pytest.mark.parametrize("variant", sorted(_variants("kernel_lab_prefill_attn")))
def test_prefill_attention_variants_compile(tmp_path: Path, variant: str) -> None:
    """The flash kernel's tiles, and the lab's wgmma variant (``wgmma=True``)."""
    fields = dict(_variants("kernel_lab_prefill_attn")[variant])
    wgmma, pv, ws = fields.pop("wgmma", False), fields.pop("pv", False), fields.pop("ws", False)
    tiles = replace(tuned("prefill_attention"), **fields)
    lab = load_script("prefill_wgmma_cuda")
    if ws:
        func = lab.build_prefill_ws(16, 16, 192, 128, "float16", tiles)
    elif wgmma:
        func = lab.build_prefill_wgmma(16, 16, 192, 128, "float16", tiles, pv=pv)
    else:
        func = build_prefill_attention(16, 16, 192, 128, "float16", tiles)
    _compiles(func, tmp_path)

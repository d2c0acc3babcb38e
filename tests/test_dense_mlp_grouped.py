"""The dense layer's MLP in prefill and extend on CUDA: the INT4 weights read packed by the grouped
tensor-core GEMMs (one expert, every token routed to it), so no float copy of them is written per
chunk; decode keeps its GEMVs, the CPU its fused dequantise-matmuls, and shapes the tensor-core
kernel does not take keep the dequantise + GEMM path. Traced to the fuse phase (no CUDA compile);
the kernels' arithmetic, a last group shorter than the others included, is checked in
``test_moe_grouped_emulation.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tvm

from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.quant import get_quantization

sys.path.insert(0, str(Path(__file__).parent))
from hf_reference import CONFIG_A  # noqa: E402
from test_moe_grouped import _called  # noqa: E402

DENSE = {"mlp_grouped_q4_gate_up", "mlp_grouped_q4_down"}
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
# CONFIG_A with widths the tensor-core kernel tiles (hidden a multiple of 128, the dense
# intermediate of 64); 320 is 2.5 groups of 128: a last group of 64
WIDE = {**CONFIG_A, "hidden_size": 256, "moe_intermediate_size": 128}


def _entries(cfg: dict, target: tvm.target.Target, quant: str) -> dict[str, set]:
    from dsv2_mlc.compiler.compile import _export
    from dsv2_mlc.passes.pipeline import PHASES, PipelineOptions

    mod, _, _ = _export(DeepseekV2Config.from_hf(cfg), target, get_quantization(quant))
    with target:
        passes = [p for name, make in PHASES[:3] for p in make(target, PipelineOptions())]
        mod = tvm.transform.Sequential(passes)(mod)
    entries = ("batch_prefill", "batch_extend", "batch_decode")
    return {e: {gv.name_hint for gv in _called(mod[e])} for e in entries}


@pytest.mark.parametrize(
    ("inter", "quant"), [(256, "q4f16_g32"), (320, "q4f16_g128")], ids=["whole", "ragged"]
)
def test_dense_mlp_prefill_reads_int4_in_the_grouped_gemms(inter: int, quant: str) -> None:
    called = _entries({**WIDE, "intermediate_size": inter}, CUDA, quant)
    for entry in ("batch_prefill", "batch_extend"):
        assert DENSE <= called[entry], (entry, sorted(called[entry]))
    assert not called["batch_decode"] & DENSE


def test_dense_mlp_keeps_the_gemms_where_the_kernel_does_not_fit() -> None:
    # hidden 64 (CONFIG_A): not a multiple of the kernel's 128 output rows
    for target in (CUDA, tvm.target.Target({"kind": "llvm"})):
        called = _entries(CONFIG_A, target, "q4f16_g32")
        assert not any(called[e] & DENSE for e in called), target.kind.name
    # float weights: no INT4 to read packed
    called = _entries({**WIDE, "intermediate_size": 256}, CUDA, "q0f16")
    assert not any(called[e] & DENSE for e in called)

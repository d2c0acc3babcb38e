"""Which decode linear layers ``dsv2_mlc/quant/decode_linear.py`` puts on the prefetch INT4 GEMV:
CUDA, fp16, INT4 with fp16 scales, a shape the kernel takes and at most one pass of its grid
(taller weights measured slower than the TIR GEMV). The model's CUDA decode IR shows where it does
(tests/test_norm_gemv_cuda.py); the kernel's numerics: tests/test_prefetch_gemv_emulation.py."""

from __future__ import annotations

import pytest
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, spec
from tvm.target import Target

from dsv2_mlc.quant import QUANTIZATIONS
from dsv2_mlc.quant.decode_linear import int4_decode_gemv, int4_group
from dsv2_mlc.quant.modules import GroupQuantLinear
from dsv2_mlc.schedules.prefetch_gemv_cuda import gemv_q4_rows_per_pass


class _Linear(nn.Module):
    def __init__(self, rows: int, k: int, scheme: str):
        self.lin = GroupQuantLinear(k, rows, QUANTIZATIONS[scheme])

    def forward(self, x: Tensor) -> Tensor:
        y = int4_decode_gemv(self.lin, x, "prefetch_gemv")
        return self.lin(x) if y is None else y


def _traced(rows: int, k: int, scheme: str, target: Target | None, dtype: str) -> str:
    module, x = _Linear(rows, k, scheme), spec.Tensor((1, k), dtype)
    if target is None:
        mod, _ = module.export_tvm(spec={"forward": {"x": x}})
    else:
        with target:
            mod, _ = module.export_tvm(spec={"forward": {"x": x}})
    return mod["forward"].script()


CUDA = Target({"kind": "cuda", "arch": "sm_90"})
ONE_PASS = gemv_q4_rows_per_pass()


@pytest.mark.parametrize(
    ("scheme", "rows", "k", "target", "dtype", "picked"),
    [
        ("q4f16_g128", 2048, 10944, CUDA, "float16", True),  # V2-Lite's dense down_proj
        ("q4f16_g128", ONE_PASS, 256, CUDA, "float16", True),  # one pass of the grid
        ("q4f16_g128", ONE_PASS + 1, 256, CUDA, "float16", False),  # tall
        ("q4f16_g128", 2048, 2048, Target("llvm"), "float16", False),  # CPU
        ("q4f16_g128", 2048, 2048, None, "float16", False),  # no target
        ("q4f32_g128", 2048, 2048, CUDA, "float32", False),  # fp32 activations and scales
        ("q4f16_g32", 2048, 104, CUDA, "float16", False),  # rows not whole 32-value chunks
    ],
)
def test_which_linears_take_the_prefetch_gemv(scheme, rows, k, target, dtype, picked) -> None:
    ir = _traced(rows, k, scheme, target, dtype)
    assert ("call_tir(prefetch_gemv," in ir) == picked
    assert ("dequantize" in ir) != picked  # else: the plain linear layer


def test_int4_group_names_the_layout_of_the_hand_kernels() -> None:
    assert int4_group(GroupQuantLinear(256, 64, QUANTIZATIONS["q4f16_g32"])) == 32
    assert int4_group(GroupQuantLinear(256, 64, QUANTIZATIONS["q4f32_g32"])) is None
    assert int4_group(nn.Linear(256, 64, bias=False, dtype="float16")) is None

"""Router logits on a GPU from fp16 activations: ``split_weight_logits`` (the float32 weight as
two fp16 parts, one tensor-core GEMM) against the float64 product, compiled for the CPU here."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn

from dsv2_mlc.model.moe import split_weight_logits

H, E = 512, 16


class _Logits(nn.Module):
    def __init__(self) -> None:
        self.weight = nn.Parameter((E, H), "float32")

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return split_weight_logits(x, self.weight)


@pytest.fixture(scope="module")
def logits_vm() -> relax.VirtualMachine:
    mod, _ = _Logits().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", H], "float16")}})
    return relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())


@pytest.mark.parametrize("n, scale", [(1, 0.02), (7, 0.02), (33, 3.0)])
def test_split_weight_logits_are_float32_accurate(logits_vm, n: int, scale: float):
    rng = np.random.default_rng(n)
    w = (rng.standard_normal((E, H)) * scale).astype(np.float32)
    x = rng.standard_normal((n, H)).astype(np.float16)
    out = logits_vm["forward"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    assert out.dtype == np.float32 and out.shape == (n, E)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    err = np.abs(out - exact).max() / np.abs(exact).max()
    # the fp16 weight alone is ~1e-4 off; hi + lo is as close as a float32 sum (~1e-6)
    hi_only = x.astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
    assert err < 4e-6 < np.abs(hi_only - exact).max() / np.abs(exact).max() / 20

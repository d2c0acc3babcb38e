"""The SwiGLU kernel (``schedules/silu_mul_cuda.py``) run on the CPU through
``tests/cuda_emulation.py`` against the TE it replaces (``passes/fuse_gate_up_silu_mul.py``)
compiled for the CPU, and the rule that picks it, on tagged and untagged TEs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.passes.fuse_gate_up_silu_mul import silu_mul_te
from dsv2_mlc.schedules.silu_mul_cuda import (
    SILU_MUL_ATTR,
    THREADS,
    silu_mul_cuda,
    silu_mul_kernel,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402


def _te(inter: int, dtype: str = "float16", tagged: bool = True) -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    gu = te.placeholder((n, tirx.IntImm("int64", 2 * inter)), dtype, name="gu")
    func = te.create_prim_func([gu, silu_mul_te(gu)])
    return func.with_attr(SILU_MUL_ATTR, 1) if tagged else func


@needs_toolchain
@pytest.mark.parametrize(("inter", "n"), [(2816, 3), (40, 5), (264, 2)])
def test_silu_mul_kernel_matches_the_te(tmp_path: Path, inter: int, n: int):
    rng = np.random.default_rng(inter)
    gu = (rng.standard_normal((n, 2 * inter)) * 4).astype(np.float16)
    gu[0, :8] = [-20, -9, -0.0, 0.0, 9, 20, 60000, -60000]  # saturation, signed zeros
    lib = tvm.compile(tvm.IRModule({"main": _te(inter).with_attr("global_symbol", "main")}))
    ref = tvm.runtime.tensor(np.zeros((n, inter), np.float16))
    lib["main"](tvm.runtime.tensor(gu), ref)
    ref = ref.numpy()
    out = np.full((n, inter), np.nan, np.float16)
    run = emulate(silu_mul_cuda(inter), tmp_path)
    run(n * -(-inter // 8 // THREADS), {"gu": gu, "out": out}, n)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), finite)
    ulp = np.spacing(np.abs(ref[finite])).astype(np.float64)
    off = np.abs(out[finite].astype(np.float64) - ref[finite]) / ulp
    assert off.max() <= 1, f"off by {off.max()} ulp"  # expf vs LLVM's exp at most


def test_the_rule_takes_tagged_fp16_swiglu_only():
    assert silu_mul_kernel(_te(2816)) is not None
    assert silu_mul_kernel(_te(2816, tagged=False)) is None
    assert silu_mul_kernel(_te(2816, dtype="float32")) is None
    assert silu_mul_kernel(_te(20)) is None  # not a multiple of 8

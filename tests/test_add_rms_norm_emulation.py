"""The fused residual add + RMSNorm kernel (``schedules/rms_norm_cuda.add_rms_norm_cuda``) run on
the CPU through ``tests/cuda_emulation.py`` against the TE it replaces (``passes/
fuse_add_rms_norm.add_rms_norm_te``) compiled for the CPU, and the rule that picks it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.model.deepseek_v2 import RMS_NORM_ATTR
from dsv2_mlc.passes.fuse_add_rms_norm import add_rms_norm_te
from dsv2_mlc.schedules.rms_norm_cuda import add_rms_norm_cuda, schedule_add_rms_norm

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402


def _te(d: int, eps: float, lead: tuple = ()) -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    rows = (*[tirx.IntImm("int64", v) for v in lead], n, tirx.IntImm("int64", d))
    a = te.placeholder(rows, "float16", name="a")
    b = te.placeholder(rows, "float16", name="b")
    w = te.placeholder((tirx.IntImm("int64", d),), "float16", name="w")
    func = te.create_prim_func([a, b, w, *add_rms_norm_te(a, b, w, eps)])
    return func.with_attr(RMS_NORM_ATTR, eps)


@needs_toolchain
@pytest.mark.parametrize(("d", "eps", "n"), [(2048, 1e-6, 3), (256, 1e-5, 5), (5120, 1e-6, 2)])
def test_add_rms_norm_kernel_matches_the_te(tmp_path: Path, d: int, eps: float, n: int):
    rng = np.random.default_rng(d)
    a = (rng.standard_normal((n, d)) * rng.uniform(0.5, 8, (n, 1))).astype(np.float16)
    b = rng.standard_normal((n, d)).astype(np.float16)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(np.float16)
    lib = tvm.compile(tvm.IRModule({"main": _te(d, eps).with_attr("global_symbol", "main")}))
    ref_s, ref_y = (tvm.runtime.tensor(np.zeros((n, d), np.float16)) for _ in range(2))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), tvm.runtime.tensor(w), ref_s, ref_y)
    s, y = np.full((n, d), np.nan, np.float16), np.full((n, d), np.nan, np.float16)
    run = emulate(add_rms_norm_cuda(d, eps), tmp_path)
    run(n, {"a": a, "b": b, "w": w, "s": s, "y": y}, n)
    np.testing.assert_array_equal(s, ref_s.numpy())
    ref = ref_y.numpy().astype(np.float64)
    off = np.abs(y - ref) / np.spacing(np.abs(ref_y.numpy())).astype(np.float64)
    # the sum of squares in another order: fp16(s * inv) an ulp apart at most, times w
    assert off.max() <= 2, f"off by {off.max()} ulp"
    assert (off == 0).mean() > 0.99


def test_the_rule_takes_the_kernel_where_it_can():
    def hand(func: tirx.PrimFunc) -> bool:
        done = schedule_add_rms_norm(func)
        return done is not None and "dsv2_add_rms_norm" in done.script()

    assert hand(_te(2048, 1e-6))
    assert not hand(_te(200, 1e-6))  # width not a multiple of 256: the TIR schedule
    assert not hand(_te(2048, 1e-6, lead=(1,)))  # 3-D rows: the TIR schedule
    assert schedule_add_rms_norm(_te(2048, 1e-6).without_attr(RMS_NORM_ATTR)) is not None  # TIR
    assert not hand(_te(2048, 1e-6).without_attr(RMS_NORM_ATTR))

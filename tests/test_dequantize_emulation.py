"""Prefill's INT4 dequantization kernel (``schedules/dequantize_cuda.py``) run on the CPU through
``tests/cuda_emulation.py``, against the TE it replaces compiled for the CPU (bit for bit), and
the rule that picks it (``dequantize_int4_kernel``, one of ``ROW_SCHEDULES``) on that TE and on
ones it must leave to dlight."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.quant.modules import DEQUANTIZE_ATTR, dequantize_expr
from dsv2_mlc.schedules.dequantize_cuda import (
    THREADS,
    dequantize_int4_kernel,
    dequantize_int4_rows,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402


def _te(rows: int, k: int, group: int, dtype: str = "float16", lead: tuple = ()) -> tirx.PrimFunc:
    """The dequantize TE as ``GroupQuantLinear`` builds it (``lead``: extra leading dims)."""
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731 (Relax shapes are int64)
    dims = [i64(d) for d in (*lead, rows)]
    qw = te.placeholder((*dims, i64(k // 8)), "uint32", name="qw")
    qs = te.placeholder((*dims, i64(-(-k // group))), "float16", name="qs")
    out = te.compute(
        (*dims, i64(k)),
        lambda *i: dequantize_expr(qw, qs, i[:-1], i[-1], group).astype(dtype),
        name="dequantize",
    )
    return te.create_prim_func([qw, qs, out]).with_attr(DEQUANTIZE_ATTR, group)


@needs_toolchain
@pytest.mark.parametrize(
    ("rows", "k", "group"), [(3, 256, 128), (37, 96, 32), (5, 64, 64), (4, 96, 64)]
)  # the last: a partial last group, as V2-Lite's dense down_proj (10944 = 85.5 x 128)
def test_dequantize_kernel_is_bit_identical_to_the_te(tmp_path: Path, rows: int, k: int, group):
    rng = np.random.default_rng(rows)
    qw = rng.integers(0, 2**32, (rows, k // 8), dtype=np.uint32)
    # scales of any size: the products (q - 8) * scale round to fp16
    qs = (rng.uniform(1e-4, 300, (rows, -(-k // group))) * rng.choice([-1, 1])).astype(np.float16)
    run = emulate(dequantize_int4_rows(rows, k, group), tmp_path)
    out = np.full((rows, k), np.nan, np.float16)
    run(-(-rows * k // 8 // THREADS), {"qw": qw, "qs": qs, "out": out})
    te_func = _te(rows, k, group).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": te_func}))
    ref = tvm.runtime.tensor(np.zeros((rows, k), np.float16))
    lib["main"](tvm.runtime.tensor(qw), tvm.runtime.tensor(qs), ref)
    np.testing.assert_array_equal(out.view(np.uint16), ref.numpy().view(np.uint16))


def test_the_rule_takes_2d_fp16_dequantize_tes_only():
    assert dequantize_int4_kernel(_te(16, 256, 128)) is not None
    assert dequantize_int4_kernel(_te(16, 256, 128, dtype="float32")) is None
    assert dequantize_int4_kernel(_te(16, 256, 128, lead=(4,))) is None  # stacked experts
    untagged = _te(16, 256, 128).without_attr(DEQUANTIZE_ATTR)
    assert dequantize_int4_kernel(untagged) is None

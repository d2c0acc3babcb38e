"""Prefill's query and key rows (``schedules/prefill_qk_cuda.py``) run on the CPU through
``tests/cuda_emulation.py``, against the TEs they replace (``mla_ops.prefill_query_te`` /
``prefill_key_te``) compiled for the CPU, which ``test_e2e_hf.py`` checks against Hugging Face
as part of the model; and the rules that pick the kernels, on those TEs and on ones they must
leave to dlight."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.model.mla_ops import prefill_key_te, prefill_query_te
from dsv2_mlc.schedules.prefill_qk_cuda import (
    KEY_ATTR,
    QUERY_ATTR,
    prefill_key_cuda,
    prefill_key_kernel,
    prefill_query_cuda,
    prefill_query_kernel,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402

I64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731 (Relax shapes are int64)


def _query_te(heads: int, nope: int, rope: int, width: int, dtype: str = "float16"):
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, I64(width)), dtype, name="x")
    tab = te.placeholder((n, I64(rope)), "float32", name="tab")
    out = prefill_query_te(x, tab, heads, nope)
    return te.create_prim_func([x, tab, out]).with_attr(QUERY_ATTR, width)


def _key_te(heads: int, nope: int, rope: int, lora: int):
    n = tirx.Var("n", "int64")
    kn = te.placeholder((n, I64(heads * nope)), "float16", name="kn")
    lat = te.placeholder((n, I64(lora + rope)), "float16", name="lat")
    out = prefill_key_te(kn, lat, heads, rope)
    return te.create_prim_func([kn, lat, out]).with_attr(KEY_ATTR, 1)


def _cpu(func: tirx.PrimFunc, *arrays: np.ndarray) -> None:
    """Run ``func`` on the CPU; the last array is its output (written in place)."""
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*tensors)
    arrays[-1][...] = tensors[-1].numpy()


@needs_toolchain
@pytest.mark.parametrize(
    ("heads", "nope", "rope", "width", "n"),
    [(16, 128, 64, 3648, 3), (128, 128, 64, 24576, 2), (2, 16, 8, 56, 5), (3, 8, 16, 80, 2)],
)  # V2-Lite's fused qkv_a output; V2's q_b_proj output (q-LoRA, 128 heads); tiny heads; the
# query heads narrower than the source
def test_query_kernel_matches_the_te(tmp_path: Path, heads, nope, rope, width, n):
    rng = np.random.default_rng(heads)
    x = (rng.standard_normal((n, width)) * 3).astype(np.float16)
    ang = rng.uniform(0, 6.3, (n, rope // 2))
    tab = np.stack([np.cos(ang) * 1.3, np.sin(ang) * 1.3], -1).reshape(n, rope).astype(np.float32)
    qk = nope + rope
    ref = np.zeros((n, heads, qk), np.float16)
    _cpu(_query_te(heads, nope, rope, width), x, tab, ref)
    out = np.full((n, heads, qk), np.nan, np.float16)
    run = emulate(prefill_query_cuda(heads, nope, rope, width), tmp_path)
    bpt = -(-heads * qk // 8 // 64)
    run(n * bpt, {"x": x, "tab": tab, "out": out}, n)
    np.testing.assert_array_equal(out[..., :nope], ref[..., :nope])  # copied
    ulp = np.spacing(np.abs(ref[..., nope:]).astype(np.float16)).astype(np.float64)
    off = np.abs(out[..., nope:].astype(np.float64) - ref[..., nope:]) / ulp
    assert off.max() <= 1, f"roped values off by {off.max()} ulp"  # fma contraction at most


@needs_toolchain
@pytest.mark.parametrize(
    ("heads", "nope", "rope", "lora", "n"),
    [(16, 128, 64, 512, 3), (128, 128, 64, 512, 2), (2, 8, 16, 24, 4)],  # V2-Lite, V2, tiny
)
def test_key_kernel_matches_the_te(tmp_path: Path, heads, nope, rope, lora, n):
    rng = np.random.default_rng(lora)
    kn = rng.standard_normal((n, heads * nope)).astype(np.float16)
    lat = rng.standard_normal((n, lora + rope)).astype(np.float16)
    ref = np.zeros((n, heads, nope + rope), np.float16)
    _cpu(_key_te(heads, nope, rope, lora), kn, lat, ref)
    out = np.full_like(ref, np.nan)
    run = emulate(prefill_key_cuda(heads, nope, rope, lora), tmp_path)
    run(n * -(-heads * (nope + rope) // 8 // 64), {"kn": kn, "lat": lat, "out": out}, n)
    np.testing.assert_array_equal(out, ref)


def test_the_rules_take_tagged_fp16_tes_with_widths_of_8():
    assert prefill_query_kernel(_query_te(16, 128, 64, 3648)) is not None
    assert prefill_key_kernel(_key_te(16, 128, 64, 512)) is not None
    assert prefill_query_kernel(_query_te(16, 128, 64, 3648, "float32")) is None
    assert prefill_query_kernel(_query_te(2, 12, 4, 36)) is None  # not multiples of 8
    assert prefill_key_kernel(_key_te(2, 12, 4, 20)) is None
    assert prefill_query_kernel(_query_te(16, 128, 64, 3648).without_attr(QUERY_ATTR)) is None
    assert prefill_key_kernel(_query_te(16, 128, 64, 3648)) is None  # untagged for the key

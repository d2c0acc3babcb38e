"""The decode-kernel hook (passes/schedule_decode_kernels.py): where it fires, and that the
hand-scheduled kernels compile for sm_90. Needs nvcc for the CUDA builds (no GPU); the numerics
on a GPU are in schedules/results/decode_kernels.md."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.compiler.compile import compile_random_model, make_target
from dsv2_mlc.compiler.cuda import cuda_codegen
from dsv2_mlc.model.moe import gate_logits_te
from dsv2_mlc.passes.fuse_add_rms_norm import add_rms_norm_te
from dsv2_mlc.passes.fuse_dequantize_matmul import dequantize_matmul_te
from dsv2_mlc.passes.pipeline import _schedule
from dsv2_mlc.passes.schedule_decode_kernels import ScheduleDecodeKernels
from dsv2_mlc.schedules.decode_gemv_cuda import schedule_decode_gemv
from dsv2_mlc.schedules.rms_norm_cuda import schedule_add_rms_norm

sys.path.insert(0, str(Path(__file__).parent))
from hf_reference import CONFIG_A  # noqa: E402

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("gcc") is None,
    reason="CUDA builds need nvcc (and gcc for the driver stub)",
)

N = tirx.Var("n", "int64")


def _i64(*dims: int) -> tuple:
    return tuple(tirx.IntImm("int64", d) for d in dims)


def _kernels() -> dict[str, tirx.PrimFunc]:
    x = te.placeholder((N, *_i64(256)), "float16", name="x")
    qw = te.placeholder(_i64(96, 32), "uint32", name="qw")
    scale = te.placeholder(_i64(96, 8), "float16", name="scale")
    gate_w = te.placeholder(_i64(64, 256), "float32", name="gate_w")
    b = te.placeholder((N, *_i64(256)), "float16", name="b")
    norm_w = te.placeholder(_i64(256), "float16", name="norm_w")
    dq = dequantize_matmul_te(x, qw, scale, 256, 32)
    return {
        "dequantize_matmul": te.create_prim_func([x, qw, scale, dq]),
        "gate_logits": te.create_prim_func([x, gate_w, gate_logits_te(x, gate_w)]),
        "add_rms_norm": te.create_prim_func([x, b, norm_w, *add_rms_norm_te(x, b, norm_w, 1e-6)]),
    }


def test_schedules_take_only_their_tagged_kernels():
    k = _kernels()
    for name in ("dequantize_matmul", "gate_logits"):
        assert schedule_decode_gemv(k[name]) is not None, name
        assert schedule_add_rms_norm(k[name]) is None, name
    assert schedule_add_rms_norm(k["add_rms_norm"]) is not None
    assert schedule_decode_gemv(k["add_rms_norm"]) is None
    a = te.placeholder(_i64(4, 8), "float32", name="a")
    r = te.reduce_axis((0, 8), name="r")
    plain = te.compute(_i64(4), lambda i: te.sum(a[i, r], axis=r), name="plain")
    assert schedule_decode_gemv(te.create_prim_func([a, plain])) is None  # untagged


def test_cpu_pipeline_has_no_hook_and_the_pass_is_a_no_op_there():
    llvm = make_target("cpu")
    assert _schedule(llvm) == []
    mod = tvm.IRModule({"main": _kernels()["dequantize_matmul"]})
    with llvm:
        assert ScheduleDecodeKernels(mod).same_as(mod)


@needs_nvcc
def test_scheduled_kernels_compile_for_sm90():
    target = make_target("cuda", "sm_90")
    for name, func in _kernels().items():
        rule = schedule_add_rms_norm if name == "add_rms_norm" else schedule_decode_gemv
        done = rule(func)
        with target, cuda_codegen():
            lib = tvm.compile(tvm.IRModule({"main": done}), target=target)
        assert "cuda" in {m.kind for m in lib.mod.imports_}, name


@needs_nvcc
def test_tiny_cuda_build_gives_decode_its_own_scheduled_kernels(tmp_path: Path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG_A))
    dump = tmp_path / "ir"
    compile_random_model(
        cfg, tmp_path / "out", device="cuda", quantization="q4f16_g32", arch="sm_90",
        dump_ir=dump,
    )  # fmt: skip
    ir = (dump / "04-schedule.py").read_text()
    copies = set(re.findall(r"def (\w+_decode)\(", ir)) - {"batch_decode"}
    kinds = {
        "moe_gate_logits",
        "moe_gate_up_q4",
        "moe_down_q4",
        "dequantize_matmul",
        "add_rms_norm",
    }
    for kind in kinds:
        assert any(kind in c for c in copies), (kind, sorted(copies))
    decode = ir[ir.index("def batch_decode(") :]
    decode = decode[: decode.find("\n    @R.function")]
    prefill = ir[ir.index("def batch_prefill(") :]
    prefill = prefill[: prefill.find("\n    @R.function")]
    for c in copies:
        assert f"cls.{c}," in decode and f"cls.{c}," not in prefill, c


# -- NumPy references of the tagged kernels (checked here on their unscheduled TE, LLVM) ----------
def ref_dequantize_matmul(x, qw, scale, group):
    """``x @ dequantize(qw, scale)^T``: INT4 nibble ``i`` of word ``w`` is element ``8w + i``,
    value ``(q - 8) * scale[o, k // group]``; accumulated in float32."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    q = ((qw[:, :, None] >> shifts) & 15).reshape(qw.shape[0], -1).astype(np.float32) - 8
    w = q * np.repeat(scale.astype(np.float32), group, axis=1)
    return (x.astype(np.float32) @ w.T).astype(x.dtype)


def ref_gate_logits(x, w):
    return x.astype(np.float32) @ w.T


def ref_add_rms_norm(a, b, w, eps):
    s = a + b
    s32 = s.astype(np.float32)
    inv = 1 / np.sqrt((s32 * s32).mean(-1, keepdims=True) + eps)
    return s, w * (s32 * inv).astype(s.dtype)


def test_tagged_kernels_match_numpy_on_llvm():
    rng = np.random.default_rng(0)
    n = 3
    x = rng.standard_normal((n, 256)).astype("float16")
    b = rng.standard_normal((n, 256)).astype("float16")
    qw = rng.integers(0, 2**32, (96, 32), dtype=np.uint32)
    scale = (rng.random((96, 8)) * 0.1).astype("float16")
    gate_w = rng.standard_normal((64, 256)).astype("float32")
    norm_w = rng.standard_normal(256).astype("float16")
    k = _kernels()
    dev = tvm.cpu()

    def run(func, *args, outs):
        lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
        arrs = [tvm.runtime.tensor(a, dev) for a in args]
        res = [tvm.runtime.empty(s, d, dev) for s, d in outs]
        lib["main"](*arrs, *res)
        return [r.numpy() for r in res]

    (y,) = run(k["dequantize_matmul"], x, qw, scale, outs=[((n, 96), "float16")])
    np.testing.assert_allclose(y, ref_dequantize_matmul(x, qw, scale, 32), rtol=2e-2, atol=2e-2)
    (y,) = run(k["gate_logits"], x, gate_w, outs=[((n, 64), "float32")])
    np.testing.assert_allclose(y, ref_gate_logits(x, gate_w), rtol=1e-4, atol=1e-4)
    s, y = run(k["add_rms_norm"], x, b, norm_w, outs=[((n, 256), "float16"), ((n, 256), "float16")])
    s_ref, y_ref = ref_add_rms_norm(x, b, norm_w, 1e-6)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_allclose(y, y_ref, rtol=1e-2, atol=1e-2)

"""The decode-kernel hook (passes/schedule_decode_kernels.py): where it fires, and that the
hand-scheduled kernels compile for sm_90. Needs nvcc for the CUDA builds (no GPU). The scheduled
GEMVs the model uses run under the CPU emulation in tests/test_decode_gemv_emulation.py; the
shipped configs (``SHIPPED``) are only compiled here (lab marker)."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.compiler.compile import make_target
from dsv2_mlc.compiler.cuda import cuda_codegen
from dsv2_mlc.model.moe import gate_logits_te
from dsv2_mlc.passes.fuse_add_rms_norm import add_rms_norm_te
from dsv2_mlc.passes.fuse_dequantize_matmul import dequantize_matmul_te
from dsv2_mlc.passes.pipeline import PipelineOptions, _schedule
from dsv2_mlc.passes.schedule_decode_kernels import ScheduleDecodeKernels
from dsv2_mlc.schedules.decode_gemv_cuda import schedule_decode_gemv
from dsv2_mlc.schedules.rms_norm_cuda import schedule_add_rms_norm
from dsv2_mlc.schedules.tiles import TABLE, GemvConfig

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import model_build, needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A  # noqa: E402

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
    assert _schedule(llvm, PipelineOptions()) == []
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
def test_tiny_cuda_build_gives_decode_its_own_scheduled_kernels():
    # the session's INT4 CUDA build of CONFIG_A for sm_90 (its IR of every phase dumped)
    ir = model_build(CONFIG_A, "q4f16_g32", "cuda").ir("04-schedule.py")
    copies = set(re.findall(r"def (\w+_decode)\(", ir)) - {"batch_decode"}
    # (the INT4 routed and shared experts of decode run as moe_decode_cuda's fused kernels, the
    # router logits with the post-attention norm: norm_gemv_cuda)
    kinds = {"dequantize_matmul"}
    for kind in kinds:
        assert any(kind in c for c in copies), (kind, sorted(copies))
    decode = ir[ir.index("def batch_decode(") :]
    decode = decode[: decode.find("\n    @R.function")]
    for fused in ("moe_decode_gate_up", "moe_decode_down"):
        assert f"cls.{fused}," in decode, fused
    prefill = ir[ir.index("def batch_prefill(") :]
    prefill = prefill[: prefill.find("\n    @R.function")]
    for c in copies:  # batch-1 GEMV schedules: decode only
        assert f"cls.{c}," in decode and f"cls.{c}," not in prefill, c
    rows = set(re.findall(r"def (\w*add_rms_norm\w*_rows)\(", ir))
    assert rows, "the row-per-block add+RMSNorm schedule is missing"
    for c in rows:  # row-per-block schedules: every entry point
        assert f"cls.{c}," in decode and f"cls.{c}," in prefill, c


# -- NumPy references of the tagged kernels (checked here on their unscheduled TE, LLVM) ----------
def ref_dequantize_matmul(x, qw, scale, group):
    """``x @ dequantize(qw, scale)^T`` in float64: INT4 nibble ``i`` of word ``w`` is element
    ``8w + i``, value ``(q - 8) * scale[o, k // group]``."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    q = ((qw[:, :, None] >> shifts) & 15).reshape(qw.shape[0], -1).astype(np.float64) - 8
    w = q * np.repeat(scale.astype(np.float64), group, axis=1)
    return x.astype(np.float64) @ w.T


def ref_gate_logits(x, w):
    return x.astype(np.float64) @ w.T.astype(np.float64)


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
    # float32 sums of 256 products, then one fp16 rounding (unit roundoff 2^-11) of the output
    ref = ref_dequantize_matmul(x, qw, scale, 32)
    np.testing.assert_allclose(y, ref, rtol=2**-11, atol=1e-4 * np.abs(ref).max())
    (y,) = run(k["gate_logits"], x, gate_w, outs=[((n, 64), "float32")])
    ref = ref_gate_logits(x, gate_w)  # (float32 sums of 256 products)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    s, y = run(k["add_rms_norm"], x, b, norm_w, outs=[((n, 256), "float16"), ((n, 256), "float16")])
    s_ref, y_ref = ref_add_rms_norm(x, b, norm_w, 1e-6)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_allclose(y, y_ref, rtol=1e-2, atol=1e-2)


# -- the shipped configurations (schedules/tiles.py), each with its scalar fallback -------------
SHIPPED = list(dict.fromkeys(TABLE["decode_gemv"].values()))
SHIPPED += [replace(c, hfma2=0) for c in SHIPPED if c.hfma2]


def _lab_kernels() -> dict[str, tirx.PrimFunc]:
    """Small kernels of every tagged kind: dense (K=256, and K=1408 whose steps over 32 lanes do
    not divide), the routed-expert gather with its weight epilogue, the fp32 router gate."""
    from dsv2_mlc.model.moe import gather_matmul_te
    from dsv2_mlc.quant.modules import dequantize_expr

    k = _kernels()
    out = {"dense": k["dequantize_matmul"], "gate": k["gate_logits"]}
    x = te.placeholder((N, *_i64(1408)), "float16", name="x")
    qw = te.placeholder(_i64(64, 176), "uint32", name="qw")
    sc = te.placeholder(_i64(64, 11), "float16", name="scale")
    out["dense_tail"] = te.create_prim_func([x, qw, sc, dequantize_matmul_te(x, qw, sc, 1408, 128)])
    xs = te.placeholder((N, *_i64(2, 256)), "float16", name="xs")
    idx = te.placeholder((N, *_i64(2)), "int32", name="idx")
    eq = te.placeholder(_i64(4, 64, 32), "uint32", name="eq")
    es = te.placeholder(_i64(4, 64, 2), "float16", name="es")
    wt = te.placeholder((N, *_i64(2)), "float32", name="wt")

    def read(ws, e, o, r):
        return dequantize_expr(ws[0], ws[1], (e, o), r, 128)

    y = gather_matmul_te(xs, idx, [eq, es], _i64(64)[0], "moe_down_q4", read)
    w = te.compute(y.shape, lambda t, j, o: y[t, j, o].astype("float32") * wt[t, j], name="mul")
    out["gather"] = te.create_prim_func([xs, idx, eq, es, wt, w])
    return out


@pytest.mark.lab  # (the shipped choices run under the emulation: test_decode_gemv_emulation.py)
@needs_nvcc
@pytest.mark.parametrize("config", SHIPPED, ids=[v.name for v in SHIPPED])
def test_gemv_configs_compile_for_sm90(config: GemvConfig):
    """Every shipped config schedules and compiles the small kernels of every tagged kind."""
    target = make_target("cuda", "sm_90")
    funcs = {}
    for name, func in _lab_kernels().items():
        done = schedule_decode_gemv(func, config)
        assert done is not None, (config.name, name)
        funcs[name] = done.with_attr("global_symbol", name)
    with target, cuda_codegen():
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
    assert "cuda" in {m.kind for m in lib.mod.imports_}


def test_fast_dequant_rewrites_the_nibble_conversion_exactly():
    func = _kernels()["dequantize_matmul"]
    fast = schedule_decode_gemv(func, GemvConfig(rows=2, lanes=32, fast_dequant=True))
    text = fast.script()
    assert "T.reinterpret" in text and "1258291200" in text  # 0x4B000000
    # bits_as_float(q | 0x4B000000) - (2^23 + 8) == q - 8 for every nibble q
    q = np.arange(16, dtype=np.uint32)
    val = (q | np.uint32(0x4B000000)).view(np.float32) - np.float32(8388616.0)
    np.testing.assert_array_equal(val, q.astype(np.float32) - 8)


# -- the hand half2 dot product (``GemvConfig.hfma2``) --------------------------------------------
HFMA2 = [v for v in SHIPPED if v.hfma2]


@needs_nvcc
@pytest.mark.parametrize("config", HFMA2[:1], ids=[v.name for v in HFMA2[:1]])
def test_hfma2_takes_the_int4_kernels_and_compiles_for_sm90(config: GemvConfig):
    target = make_target("cuda", "sm_90")
    funcs = {}
    for name, func in _lab_kernels().items():
        done = schedule_decode_gemv(func, config)
        assert done is not None, (config.name, name)
        hand = f"dsv2_dot32_int4_h{config.hfma2}" in done.script()
        # the INT4 dot products take the hand function; the fp32 router does not
        assert hand == (name in ("dense", "dense_tail", "gather")), name
        funcs[name] = done.with_attr("global_symbol", name)
    with target, cuda_codegen():
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
    assert "cuda" in {m.kind for m in lib.mod.imports_}


def _h16(bits: np.ndarray) -> np.ndarray:
    """uint32 words -> [..., 2] float16 halves (low half first)."""
    return bits.astype(np.uint32).view(np.float16).reshape(*bits.shape, 2)


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """CUDA ``__byte_perm(a, b, sel)`` (selector nibbles < 8: bytes of b:a)."""
    both = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        byte = (both >> np.uint64(8 * ((sel >> (4 * i)) & 7))) & np.uint64(0xFF)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def _dot32_numpy(w: np.ndarray, x: np.ndarray, scale: np.float16, run: int) -> np.float32:
    """NumPy model of ``dot32_source(run)`` (fp16 rounding after every HFMA2, as the hardware)."""
    from dsv2_mlc.schedules.decode_gemv_cuda import dot32_source

    src = dot32_source(run)
    for const in ("0x64086408u", "0x2c002c00u", "0xd480d480u", "0x5410", "0x7632"):
        assert const in src
    h = lambda v: np.asarray(v, np.float64).astype(np.float16).astype(np.float64)  # noqa: E731
    xw = x.view(np.uint32)
    total, acc = np.float32(0), None
    for i in range(4):
        q, q8 = w[i : i + 1], w[i : i + 1] >> np.uint32(8)
        ws = [
            h(_h16((q & 0x000F000F) | 0x64006400) - 1032.0),
            h(_h16((q & 0x00F000F0) | 0x64006400) * (1 / 16) - 72.0),
            h(_h16((q8 & 0x000F000F) | 0x64006400) - 1032.0),
            h(_h16((q8 & 0x00F000F0) | 0x64006400) * (1 / 16) - 72.0),
        ]
        x01, x23, x45, x67 = (xw[4 * i + j : 4 * i + j + 1] for j in range(4))
        ps = [_prmt(x01, x45, 0x5410), _prmt(x01, x45, 0x7632)]
        ps += [_prmt(x23, x67, 0x5410), _prmt(x23, x67, 0x7632)]
        for j, (wj, pj) in enumerate(zip(ws, ps, strict=True)):
            prod = wj * _h16(pj).astype(np.float64)
            acc = h(prod) if (i % (run // 4) == 0 and j == 0) else h(acc + prod)
        if i % (run // 4) == run // 4 - 1:
            total = np.float32(total + np.float32(acc[0, 0] + acc[0, 1]))
    return np.float32(total * np.float32(scale))


def test_nibble_to_half_trick_is_exact():
    # (q & 0x000f000f) | 0x64006400 is half2 1024 + (n0, n4); the 0x00f000f0 nibbles read
    # 1024 + 16 (n1, n5): both give q - 8 exactly (-1032; * 1/16 - 72), for every nibble.
    q = np.arange(16, dtype=np.uint32)
    lo = _h16(q | (q << 16) | 0x64006400).astype(np.float32) - np.float32(1032)
    hi = _h16((q << 4) | (q << 20) | 0x64006400).astype(np.float32) / 16 - np.float32(72)
    want = q.astype(np.float32) - 8
    np.testing.assert_array_equal(lo, np.stack([want, want], -1))
    np.testing.assert_array_equal(hi, np.stack([want, want], -1))
    # the whole step (nibble pairing, PRMT pairing of x): the exact dot when no fp16 rounding
    # happens (small integer x), and within fp16 accumulation error for random x
    rng = np.random.default_rng(0)
    shifts = np.arange(8, dtype=np.uint32) * 4
    for run in (4, 8, 16):
        w = rng.integers(0, 2**32, 4, dtype=np.uint32)
        vals = ((w[:, None] >> shifts) & 15).reshape(-1).astype(np.float64) - 8
        xi = rng.integers(-2, 3, 32).astype(np.float16)
        got = _dot32_numpy(w, xi, np.float16(1), run)
        assert got == np.float32(vals @ xi.astype(np.float64)), run
        errs = []
        for _ in range(200):
            w = rng.integers(0, 2**32, 4, dtype=np.uint32)
            vals = ((w[:, None] >> shifts) & 15).reshape(-1).astype(np.float64) - 8
            x = rng.standard_normal(32).astype(np.float16)
            ref = vals @ x.astype(np.float64) * 0.01
            errs.append(_dot32_numpy(w, x, np.float16(0.01), run) - ref)
        scale = np.sqrt(32 * np.mean(vals**2)) * 0.01
        assert np.sqrt(np.mean(np.square(errs))) / scale < 1.5e-3, run

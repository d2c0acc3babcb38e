"""TIR kernels that fill device tensors with deterministic pseudo-random weights (config-only
builds, ``dsv2-mlc compile --random-weights``).

Each kernel writes a flat buffer ``out[n]`` in place from a counter-based hash: element ``i`` gets
``h = fmix32((i * 0x9E3779B1) ^ key)`` (MurmurHash3's 32-bit finaliser, a bijection of uint32),
where ``key`` is derived on the host from the seed and the parameter's index
(:func:`dsv2_mlc.runtime.random_params.param_key`). So a value depends only on (seed, parameter,
element): no state, any launch order, the same on every device.

* ``dsv2_fill_uniform_<dtype>(out, key, center, half)``: ``center + half * (2u - 1)`` with
  ``u = (h >> 8) / 2**24`` in [0, 1): uniform on [center - half, center + half)
  (``half = 0`` gives a constant, e.g. norms = 1).
* ``dsv2_fill_int4_uint32(out, key)``: eight 4-bit codes per word, code ``c`` of element
  ``8 * i + c`` in bits ``4c..4c+3`` (the layout of :mod:`dsv2_mlc.quant.packing`), each uniform on
  1..15, i.e. dequantised ``nibble - 8`` uniform on -7..7 (mean 0, variance 56/3).

The Python mirror :func:`dsv2_mlc.runtime.random_params.reference_fill` computes the same values
with NumPy (tests compare the two).
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.ir import IRModule

from ..layout import INT4_KERNEL, uniform_kernel

FILL_DTYPES = ("float16", "float32")
GOLDEN = 0x9E3779B1
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35


def _u32(v: int) -> tirx.PrimExpr:
    return tirx.const(v, "uint32")


def _fmix32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """MurmurHash3 fmix32 with let-bindings (each intermediate is used twice)."""
    for shift, mul in ((16, FMIX_C1), (13, FMIX_C2), (16, None)):
        v = tirx.Var("h", "uint32")
        step = v ^ (v >> _u32(shift))
        if mul is not None:
            step = step * _u32(mul)
        x = tirx.Let(v, x, step)
    return x


def _hash(index: tirx.PrimExpr, key: tirx.PrimExpr) -> tirx.PrimExpr:
    return _fmix32((index.astype("uint32") * _u32(GOLDEN)) ^ key)


def _uniform_func(dtype: str) -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    key = tirx.Var("key", "int64")
    center = tirx.Var("center", "float32")
    half = tirx.Var("half_width", "float32")  # not "half": a CUDA type name

    def f32(v: float) -> tirx.PrimExpr:
        return tirx.const(v, "float32")

    def value(i: tirx.PrimExpr) -> tirx.PrimExpr:
        u = (_hash(i, key.astype("uint32")) >> _u32(8)).astype("float32") * f32(1.0 / (1 << 24))
        return (center + half * (u * f32(2.0) - f32(1.0))).astype(dtype)

    out = te.compute((n,), value, name="fill")
    return te.create_prim_func([out, key, center, half])


def _int4_func() -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    key = tirx.Var("key", "int64")

    def word(i: tirx.PrimExpr) -> tirx.PrimExpr:
        k = key.astype("uint32")
        acc = _u32(0)
        for c in range(8):
            h = _hash(i * tirx.const(8, "int64") + tirx.const(c, "int64"), k)
            code = (((h >> _u32(16)) * _u32(15)) >> _u32(16)) + _u32(1)  # 1..15
            acc = acc | (code << _u32(4 * c))
        return acc

    out = te.compute((n,), word, name="fill_int4")
    return te.create_prim_func([out, key])


def add_fill_kernels(mod: IRModule, dtypes: tuple[str, ...] = FILL_DTYPES) -> IRModule:
    """``mod`` plus the public fill kernels (one per float dtype, one for packed INT4)."""
    funcs = {uniform_kernel(d): _uniform_func(d) for d in dtypes}
    funcs[INT4_KERNEL] = _int4_func()
    for name, func in funcs.items():
        mod[name] = func.with_attr("global_symbol", name)
    return mod

"""The FP8 latent KV cache: its storage format, the quantisation kernel, the decode helpers.

A cache built with ``--kv-dtype fp8`` stores a token's row ``[c_kv (L = kv_lora_rank) | k_pe
(R = rope width)]`` as the ``L`` latent values in ``float8_e4m3fn``, ``q = saturate_e4m3(x /
kv_scale)`` (clamped to +-448, rounded to nearest even), read back as ``q * kv_scale``, and the
``R`` rope values in the build's dtype, unchanged: ``L + R * itemsize`` bytes a row (V2-Lite in
float16: 640 B, 56 % of the float16 cache). The rope part stays wide because it carries almost
all of the rounding's cost (it enters the score through ``q_pe . k_pe`` alone): e4m3 everywhere
costs the default model +0.63 % held-out perplexity, this layout +0.03 %
(schedules/results/kv_fp8.md). DeepSeek's own FP8 MLA cache (FlashMLA) keeps its rope part in
bf16 for the same reason. One static ``kv_scale`` per cache (vLLM's scheme; default 1.0).

**Storage.** TVM's C++ ``PagedAttentionKVCache`` requires the query and output of
``cross_attention`` and the rows of ``append_mla_kv`` to have the pages' dtype, and sizes its
temporary attention outputs in that dtype, so the pages cannot be declared ``float8_e4m3fn``
while the activations stay float16/float32. The FP8 cache is declared to it in the build's
dtype: a row is ``L / k + R`` slots (``k`` = that dtype's size, :func:`slot_values`), slots
``0 .. L/k - 1`` holding ``k`` e4m3 bytes each (slot ``j`` the latent values ``kj .. kj + k -
1``, lowest byte first, i.e. the bytes in memory order), slots ``L/k ..`` the rope values.
To keep the C++ shape checks consistent (:func:`fp8_cache_dims`), the cache sees ``kH`` query
heads of ``L / k + R`` values and an output of ``kH`` heads of ``L / k`` values: the model's
``[n, H, L]`` output is a plain reshape (pseudo-head ``kh + i`` is part ``i`` of head ``h``),
its ``[n, H, L + R]`` query is padded to ``[n, H, k (L/k + R)]`` (:func:`fp8_query_width`; the
kernels read head ``h``'s ``L + R`` values at the start of its ``k`` pseudo-heads and never the
padding). The attention kernels write a head's ``lse`` to each of its pseudo-heads, so TVM's
merge of partial states (which runs per pseudo-head) stays exact. The copy, fork and compaction
kernels move slots unchanged (loads and stores only, no arithmetic on them).

**Encoding** (:func:`e4m3_encode`, :func:`quantize_latent`): arithmetic on the float32 bits, the
same on CPU and CUDA: for ``a = min(|x| / kv_scale, 448)`` below ``2^-6`` the subnormal code
``rint(a * 2^9)``; otherwise with ``e = floor(log2 a)`` (the float32 exponent)
``(e + 6) * 8 + rint(a * 2^(3 - e))`` (a mantissa that rounds up to 16 carries into the
exponent); the sign is bit 7. ``rint`` rounds half to even. The new tokens' rows are built by
:func:`quantize_latent` (latent encoded, rope copied) before ``append_mla_kv`` (the append then
copies slots).

**Decoding** (:func:`e4m3_byte_f16`): a byte ``b`` becomes the float16 with bits
``(b & 0x80) << 8 | (b & 0x7f) << 7``, which is exactly ``value(b) / 256`` for every finite
e4m3 value (subnormals included: the exponent biases differ by 8). So the kernels read the
latent with integer shifts and masks and fold ``256 * kv_scale`` (:func:`read_scale`) into the
latent part of the score and into the attention output: ``score = sm (s (q_L . c) + q_R .
k_pe)``, ``out = s * sum_t p_t c_t``.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

__all__ = [
    "E4M3_MAX",
    "FP8_KV_DTYPE",
    "e4m3_encode",
    "e4m3_byte_f16",
    "fp8_cache_dims",
    "fp8_query_width",
    "quantize_latent",
    "read_scale",
    "slot_values",
]

FP8_KV_DTYPE = "float8_e4m3fn"  # BuildConfig.kv_dtype of an FP8 cache
E4M3_MAX = 448.0
_DECODE_FACTOR = 256.0  # value(b) = decoded float16 * 256
_QUANT_THREADS = 128
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def read_scale(kv_scale: float) -> float:
    """The factor a kernel multiplies the decoded (float16) cache values by: ``256 * kv_scale``."""
    return _DECODE_FACTOR * float(kv_scale)


def slot_values(dtype: str) -> int:
    """e4m3 bytes one cache slot of ``dtype`` (the build's activation dtype) holds."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"an FP8 KV cache stores its bytes in {sorted(_ITEMSIZE)}, got {dtype}")
    return _ITEMSIZE[dtype]


def fp8_cache_dims(
    num_heads: int, latent_dim: int, rope_dim: int, dtype: str
) -> tuple[int, int, int]:
    """(query heads, row width, output width) the C++ cache is told for an FP8 cache of
    ``num_heads`` heads, ``latent_dim`` e4m3 latent values and ``rope_dim`` rope values a row, in
    slots of ``dtype`` holding ``k`` bytes each: ``(k H, L / k + R, L / k)`` (module
    docstring)."""
    k = slot_values(dtype)
    if latent_dim % k:
        raise ValueError(
            f"an FP8 KV cache in {dtype} slots needs kv_lora_rank divisible by {k}, "
            f"got {latent_dim}"
        )
    return k * num_heads, latent_dim // k + rope_dim, latent_dim // k


def fp8_query_width(latent_dim: int, rope_dim: int, dtype: str) -> int:
    """Width of a head's query as the FP8 cache takes it, ``k (L / k + R)`` (its ``k``
    pseudo-heads): the ``L + R`` values, then ``(k - 1) R`` of padding the kernels never read."""
    return slot_values(dtype) * fp8_cache_dims(1, latent_dim, rope_dim, dtype)[1]


def e4m3_encode(x: tirx.PrimExpr, inv_scale: float) -> tirx.PrimExpr:
    """The e4m3 code (``uint32`` in ``0..255``, never NaN) of the float32 ``x * inv_scale``,
    saturated to +-448 and rounded to nearest even (module docstring)."""
    xs = x * T.float32(inv_scale) if inv_scale != 1.0 else x
    bits = T.reinterpret("uint32", xs)
    sign = (bits >> T.uint32(31)) << T.uint32(7)
    a = T.min(T.fabs(xs), T.float32(E4M3_MAX))
    e = T.Cast("int32", (T.reinterpret("uint32", a) >> T.uint32(23)) & T.uint32(0xFF)) - 127
    # 2^(3 - e) for a normal a (e in -6..8), built from its exponent bits (exact)
    pow2 = T.reinterpret("float32", T.Cast("uint32", 130 - e) << T.uint32(23))
    sub = T.Cast("int32", T.nearbyint(a * T.float32(512.0)))
    nrm = (e + 6) * 8 + T.Cast("int32", T.nearbyint(a * pow2))
    code = T.if_then_else(a < T.float32(2.0**-6), sub, nrm)
    return sign | T.Cast("uint32", code)


def e4m3_byte_f16(slot: tirx.PrimExpr, i: tirx.PrimExpr | int, dtype: str) -> tirx.PrimExpr:
    """Byte ``i`` (0 = lowest) of a cache slot of ``dtype`` as float16: ``value / 256`` exactly
    (module docstring)."""
    bits = _ITEMSIZE[dtype] * 8
    u = T.Cast("uint32", T.reinterpret(f"uint{bits}", slot))
    b = (
        (u >> T.Cast("uint32", i * 8)) & T.uint32(0xFF)
        if not (isinstance(i, int) and i == 0)
        else u & T.uint32(0xFF)
    )
    f16 = ((b & T.uint32(0x80)) << T.uint32(8)) | ((b & T.uint32(0x7F)) << T.uint32(7))
    return T.reinterpret("float16", T.Cast("uint16", f16))


def quantize_latent(
    latent_dim: int, rope_dim: int, dtype: str, kv_scale: float, cuda: bool
) -> tirx.PrimFunc:
    """``f(latent [n, L + R] dtype, out [n, L / k + R] dtype)``: the FP8 cache rows of the new
    tokens (module docstring): the e4m3 codes of ``latent[:, :L] / kv_scale``
    (:func:`e4m3_encode`) packed ``k`` a slot of ``dtype`` (:func:`slot_values`), then the rope
    values ``latent[:, L:]`` copied. ``cuda``: a thread per slot (grid over the ``n (L / k +
    R)`` slots); else a ``T.parallel`` loop over the rows."""
    k = slot_values(dtype)
    width = latent_dim + rope_dim
    _, row, lat = fp8_cache_dims(1, latent_dim, rope_dim, dtype)
    inv = 1.0 / float(kv_scale)
    threads = _QUANT_THREADS
    bits = _ITEMSIZE[dtype] * 8

    def pack(x, t, j):  # the latent slot j of row t
        code = e4m3_encode(T.Cast("float32", x[t, j * k]), inv)
        for i in range(1, k):
            code = code | (e4m3_encode(T.Cast("float32", x[t, j * k + i]), inv) << T.uint32(8 * i))
        return T.reinterpret(dtype, T.Cast(f"uint{bits}", code))

    if cuda:

        @T.prim_func(private=True, s_tir=True)
        def quantize_latent_e4m3(var_x: T.handle, var_out: T.handle):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, width), dtype)
            out = T.match_buffer(var_out, (n, row), dtype)
            for bx in T.thread_binding((n * row + threads - 1) // threads, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("quantize"):
                        T.reads()
                        T.writes()
                        i: T.let[T.int64] = bx * threads + tx
                        t: T.let[T.int64] = i // row
                        j: T.let[T.int64] = i % row
                        if j < lat:  # packed latent bytes
                            if t < n:
                                out[t, j] = pack(x, t, j)
                        elif t < n:  # a rope value
                            out[t, j] = x[t, latent_dim + j - lat]

        return quantize_latent_e4m3

    @T.prim_func(private=True, s_tir=True)
    def quantize_latent_e4m3_cpu(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, width), dtype)
        out = T.match_buffer(var_out, (n, row), dtype)
        for t in T.parallel(n):
            for j in T.serial(lat):
                with T.sblock("quantize"):
                    T.reads()
                    T.writes()
                    out[t, j] = pack(x, t, j)
            for r in T.serial(rope_dim):
                with T.sblock("rope"):
                    T.reads()
                    T.writes()
                    out[t, lat + r] = x[t, latent_dim + r]

    return quantize_latent_e4m3_cpu

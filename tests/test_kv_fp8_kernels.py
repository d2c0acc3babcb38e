"""The FP8 (e4m3) latent KV cache's kernels (``schedules/kv_fp8.py``) against float64 NumPy.

The e4m3 reference is ``ml_dtypes.float8_e4m3fn`` (round to nearest even; the values are clipped
to +-448 first, which is what saturation means). Checked: the cache rows built from every finite
float16 latent value (e4m3 bytes; the rope part copied bit-exactly; CPU kernel, and the CUDA
kernel under ``tests/cuda_emulation.py``), the CPU attention over FP8 pages (float16 and float32
slots), and the CUDA split-KV kernel's FP8 variant (V2-Lite's shapes: its tensor-core block,
the PTX primitives by the emulator's stand-ins; several splits, a causal chunk) under
emulation, with controls that must fail: a kernel built with the wrong scale, and one that
scales the rope part's scores too.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv2_mlc.schedules.kv_fp8 import E4M3_MAX, quantize_latent
from dsv2_mlc.schedules.mla_attention_cuda import MLA_CUDA_PAGE_SIZE, mla_attention_cuda
from dsv2_mlc.schedules.mla_cpu import mla_paged_attention_fp8_cpu

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402

U16 = 2.0**-11  # fp16 unit roundoff


def e4m3_codes(x: np.ndarray, kv_scale: float) -> np.ndarray:
    """The e4m3 bytes of ``x / kv_scale`` (float32 division, as the kernels), saturated."""
    xs = x.astype(np.float32) / np.float32(kv_scale)
    return np.clip(xs, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_values(codes: np.ndarray, kv_scale: float) -> np.ndarray:
    """float64 values of e4m3 bytes times ``kv_scale``."""
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * kv_scale


def all_float16() -> np.ndarray:
    """Every finite float16 value, as rows of 64."""
    x = np.arange(65536, dtype=np.uint16).view(np.float16)
    return x[np.isfinite(x)].reshape(-1, 64)


def _run_llvm(func, *arrays):
    import tvm

    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*tensors)
    return [t.numpy() for t in tensors]


def _rows(latent: np.ndarray, dtype: str, seed: int = 0) -> np.ndarray:
    """Rows ``[latent | 16 rope values]`` in ``dtype`` (the rope part random)."""
    rope = np.random.default_rng(seed).standard_normal((latent.shape[0], 16)) * 8
    return np.ascontiguousarray(np.concatenate([latent, rope], axis=1).astype(dtype))


def _check_rows(got: np.ndarray, x: np.ndarray, kv_scale: float) -> None:
    """FP8 cache rows ``got`` of ``x``: the latent's e4m3 bytes, then the rope values bit-exact."""
    k = x.dtype.itemsize
    assert got.shape == (x.shape[0], 64 // k + 16)
    want = e4m3_codes(x[:, :64], kv_scale)
    np.testing.assert_array_equal(np.ascontiguousarray(got[:, : 64 // k]).view(np.uint8), want)
    np.testing.assert_array_equal(got[:, 64 // k :].view(np.uint8), x[:, 64:].view(np.uint8))


@pytest.mark.parametrize("kv_scale", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_quantize_cpu_matches_ml_dtypes(dtype: str, kv_scale: float) -> None:
    x = _rows(all_float16(), dtype)
    k = np.dtype(dtype).itemsize
    out = np.zeros((x.shape[0], 64 // k + 16), dtype)
    _, got = _run_llvm(quantize_latent(64, 16, dtype, kv_scale, cuda=False), x, out)
    _check_rows(got, x, kv_scale)
    want = e4m3_codes(x[:, :64], kv_scale)
    assert (want == 0x7E).any() and (want == 0xFE).any()  # saturated on both sides
    assert (want & 0x7F == 0x7F).sum() == 0  # never NaN


@needs_toolchain
def test_quantize_cuda_matches_ml_dtypes(tmp_path: Path) -> None:
    x = all_float16()[:256]  # every exponent, both signs, the subnormals, the saturating tail
    x = _rows(np.concatenate([x, all_float16()[-256:]]), "float16")
    out = np.zeros((x.shape[0], 32 + 16), np.float16)
    kernel = emulate(quantize_latent(64, 16, "float16", 1.0, cuda=True), tmp_path)
    grid = -(-out.size // 128)
    # scalars: the rows n, and the host's slot count n * 48 (a common subexpression)
    kernel(
        grid, {"x": x, "out": out}, *[x.shape[0] if s == "n" else out.size for s in kernel.scalars]
    )
    _check_rows(out, x, 1.0)


# (cached tokens after the step, new tokens of the step = query rows)
SEQS = [(5, 1), (40, 3), (700, 1)]


def _case(heads, latent, rope, page, dtype, kv_scale, seqs, seed=0):
    """Paged FP8 pages in ``dtype`` slots (kv_fp8's storage: the latent's e4m3 bytes, then the
    rope values in ``dtype``), the padded query (its padding NaN, which no kernel may read), and
    the float64 reference (out, lse) of the absorbed attention with causal chunks (base-2
    lse)."""
    rng = np.random.default_rng(seed)
    d = latent + rope
    k = np.dtype(dtype).itemsize
    row = latent // k + rope  # slots a cache row
    n_pages = [-(-kv // page) for kv, _ in seqs]
    pool = sum(n_pages) + 3
    perm = rng.permutation(pool).astype(np.int32)
    page_indptr = np.int32([0, *np.cumsum(n_pages)])
    page_values = np.ascontiguousarray(perm[: page_indptr[-1]])
    last_len = np.int32([kv - (n - 1) * page for (kv, _), n in zip(seqs, n_pages, strict=True)])
    q_indptr = np.int32([0, *np.cumsum([q for _, q in seqs])])
    total = int(q_indptr[-1])
    pages = np.full((pool, page, row), np.nan, dtype)  # unused slots: NaN
    keys_all = []
    for b, (kv, _) in enumerate(seqs):
        rows = (rng.standard_normal((kv, d)) * 2.0).astype(np.float32)
        rows[0, :3] = [1000.0, -1000.0, 1e-4]  # saturating and subnormal values
        rows[:, latent:] *= 4  # the rope part wider than the latent (as in the models)
        c = e4m3_codes(rows[:, :latent], kv_scale)
        rope_vals = rows[:, latent:].astype(dtype)
        keys_all.append(
            np.concatenate([e4m3_values(c, kv_scale), rope_vals.astype(np.float64)], axis=1)
        )
        ids = page_values[page_indptr[b] : page_indptr[b + 1]]
        padded = np.full((len(ids) * page, row), np.nan, dtype)
        padded[:kv, : latent // k] = c.view(dtype)
        padded[:kv, latent // k :] = rope_vals
        pages[ids] = padded.reshape(-1, page, row)
    q = (rng.standard_normal((total, heads, d)) * 0.3).astype(dtype)
    sm = 1 / math.sqrt(192)
    ref_out = np.zeros((total, heads, latent))
    ref_lse = np.zeros((total, heads))
    for b, (kv, q_len) in enumerate(seqs):
        for r in range(q_len):
            i = q_indptr[b] + r
            keys = keys_all[b][: kv - q_len + r + 1]
            s = q[i].astype(np.float64) @ keys.T * sm * math.log2(math.e)
            m = s.max(axis=1, keepdims=True)
            w = np.exp2(s - m)
            ref_lse[i] = m[:, 0] + np.log2(w.sum(axis=1))
            ref_out[i] = (w / w.sum(axis=1, keepdims=True)) @ keys[:, :latent]
    q_pad = np.full((total, heads, k * row), np.nan, dtype)
    q_pad[:, :, :d] = q
    arrays = {
        "q": q_pad.reshape(total, heads * k, row),
        "q_indptr": q_indptr,
        "pages": pages,
        "page_indptr": page_indptr,
        "page_values": page_values,
        "length_info": last_len,
        "output": np.full((total, heads * k, latent // k), np.nan, dtype),
        "lse": np.full((total, heads * k), np.nan, np.float32),
    }
    return arrays, ref_out, ref_lse, sm


def _check(arrays, ref_out, ref_lse, heads, latent, out_tol, lse_tol) -> None:
    total = ref_out.shape[0]
    k = arrays["lse"].shape[1] // heads
    out = arrays["output"].reshape(total, heads, latent).astype(np.float64)
    lse = arrays["lse"].reshape(total, heads, k)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    rel = np.linalg.norm(out - ref_out, axis=(1, 2)) / np.linalg.norm(ref_out, axis=(1, 2))
    assert rel.max() < out_tol, rel.max()
    for i in range(k):  # every pseudo-head of a head carries its lse
        assert np.abs(lse[:, :, i] - ref_lse).max() < lse_tol


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cpu_attention_over_fp8_pages(dtype: str) -> None:
    heads, latent, rope, page, kv_scale = 4, 32, 8, 7, 0.25
    arrays, ref_out, ref_lse, sm = _case(heads, latent, rope, page, dtype, kv_scale, SEQS[:2])
    func = mla_paged_attention_fp8_cpu(heads, latent, rope, dtype, kv_scale)
    names = list(arrays)
    args = [arrays[n] for n in names[:6]] + [arrays["output"], arrays["lse"]]
    import tvm

    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    tensors = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*tensors, 1, sm)
    arrays["output"], arrays["lse"] = tensors[6].numpy(), tensors[7].numpy()
    tol = 4 * U16 if dtype == "float16" else 1e-5
    _check(arrays, ref_out, ref_lse, heads, latent, tol, 1e-4)


_EMU_CALLS = {
    "mma": "const unsigned b[2] = {b0, b1}; dsv2_emu_mma16816(c, a, b);",
    "ldsm": "dsv2_emu_ldmatrix_x4(r, addr, false);",
    "ldsm_t": "dsv2_emu_ldmatrix_x4(r, addr, true);",
    "ldsm_t2": "unsigned x[4]; dsv2_emu_ldmatrix_x4(x, addr, true); r[0] = x[0]; r[1] = x[1];",
    "cp": "dsv2_emu_cp_async(dst, src, bytes);",
    "commit": "dsv2_emu_cp_commit();",
}


def _emulated_prim(m) -> str:
    """A PTX primitive of the split-KV kernel's tensor-core block (``mla_cuda_helpers``) as the
    emulator's stand-in (``cp.async`` copies land at their ``wait_group``)."""
    import re

    kind, tag, params, asm = m.groups()
    if kind == "wait":
        (pending,) = re.findall(r"wait_group (\d+)", asm)
        call = f"dsv2_emu_cp_wait({pending});"
    else:
        call = _EMU_CALLS[kind]
    return f"static inline void mlap_{kind}_{tag}({params}) {{ {call} }}\n"


def _rope_scaled_too(src: str) -> str:
    """The tensor-core block scales the rope k-step's score sums by 256 kv_scale too."""
    old = "      if (k == 4) {"
    assert old in src
    return src.replace(old, "      if (k == 5) {")


# The wgmma block's PTX (schedules/mla_wgmma_cuda.py, sm_90's FP8 entry) as the emulator's
# stand-ins: wgmma on shared addresses (computed at the wait that completes it), cvt of two
# e4m3 bytes to their float16 values, the named barriers (the emulator's bar.sync / bar.arrive)
_WG_PRIM = re.compile(
    r"__device__ __forceinline__ (\w+) mlaw_(wgmma|fence|commit|wait0|proxy|cvt|bar0|sync|arrive)"
    r"_(\w+)"
    r"\(([^)]*)\) \{\n.*?\n\}\n",
    re.S,
)
_WG_CALLS = {
    "wgmma": "dsv2_emu_wgmma(d, a, b, 16);",
    "fence": "",
    "commit": "dsv2_emu_wg_commit();",
    "wait0": "dsv2_emu_wg_wait(0);",
    "proxy": "",
    "bar0": "dsv2_emu_bar_sync(1, 128);",
    "sync": "dsv2_emu_bar_sync(id, n);",
    "arrive": "dsv2_emu_bar_arrive(id, n);",
    "cvt": "unsigned r = 0; for (int i = 0; i < 2; ++i) { const unsigned b = (w >> (8 * i)) & "
    "0xffu; const unsigned short u = (unsigned short)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)); "
    "half h; memcpy(&h, &u, 2); const half v = (half)((float)h * 256.f); unsigned short o; "
    "memcpy(&o, &v, 2); r |= (unsigned)o << (16 * i); } return r;",
}


def _wg_prim(m) -> str:
    ret, kind, tag, params = m.groups()
    return f"static inline {ret} mlaw_{kind}_{tag}({params}) {{ {_WG_CALLS[kind]} }}\n"


def _split_kv_fp8(
    tmp_path: Path, kv_scale_built: float, kv_scale: float = 0.5, controls=(), arch=None
):
    from test_mla_attention_emulation import _PRIM, _launch

    H, L, R = 16, 512, 64  # V2-Lite
    func = mla_attention_cuda(H, L, R, "float16", kv_scale=kv_scale_built, arch=arch)

    def patch(src: str) -> str:
        src, n = _PRIM.subn(_emulated_prim, src)  # the tensor-core block's PTX (7 primitives)
        assert n == 7, n
        if arch is not None:
            src, n = _WG_PRIM.subn(_wg_prim, src)
            assert n == 9, n
        for control in controls:
            src = control(src)
        return "#define CUDART_INF_F INFINITY  // (math_constants.h, in TVM's header)\n" + src

    split = emulate(func, tmp_path, "split", kernel=0, patch=patch)
    merge = emulate(func, tmp_path, "merge", kernel=1, patch=patch)
    arrays, ref_out, ref_lse, sm = _case(H, L, R, MLA_CUDA_PAGE_SIZE, "float16", kv_scale, SEQS)
    total = ref_out.shape[0]
    n = _launch(func, total)
    arrays["ws_o"] = np.full(n["ws_o"], np.nan, np.float32)
    arrays["ws_lse"] = np.full(n["ws_lse"], np.nan, np.float32)
    arrays["ws_n"] = np.full(n["ws_n"], -1, np.int32)
    scalars = {"batch_size": len(SEQS), "causal": 1, "total_len": total, "sm_scale": sm}
    # the host's common subexpressions, named as the split kernel takes them: the splits per row
    # and the split grid (the merge also gets its grid's, which its body does not read: 0)
    smax, blocks = (s for s in split.scalars if s.startswith("cse"))
    scalars.update({smax: n["smax"], blocks: n["split"]})

    def args(kernel):
        return [scalars.get(s, 0) for s in kernel.scalars]

    split((n["split"], 1), arrays, *args(split))
    merge(n["merge"], arrays, *args(merge))
    return arrays, ref_out, ref_lse, H, L


@needs_toolchain
def test_cuda_split_kv_over_fp8_pages(tmp_path: Path) -> None:
    arrays, ref_out, ref_lse, H, L = _split_kv_fp8(tmp_path, 0.5)
    _check(arrays, ref_out, ref_lse, H, L, 4 * U16, 1e-4)


@needs_toolchain
def test_cuda_split_kv_over_fp8_pages_wgmma_block(tmp_path: Path) -> None:
    """sm_90's split kernel (the wgmma block of mla_wgmma_cuda in the shipped planning and
    merge) over the same pages, and a control: its warpgroup 1 leaving out the rope scores."""
    arrays, ref_out, ref_lse, H, L = _split_kv_fp8(tmp_path, 0.5, arch="sm_90")
    _check(arrays, ref_out, ref_lse, H, L, 4 * U16, 1e-4)

    def no_rope(src: str) -> str:
        old = " + sr[e];"
        assert src.count(old) == 1, "the block's exchange of the rope scores"
        return src.replace(old, ";")

    (tmp := tmp_path / "control").mkdir()
    arrays, ref_out, ref_lse, H, L = _split_kv_fp8(tmp, 0.5, controls=(no_rope,), arch="sm_90")
    with pytest.raises(AssertionError):
        _check(arrays, ref_out, ref_lse, H, L, 4 * U16, 1e-4)


@needs_toolchain
def test_cuda_split_kv_rope_scaled_fails(tmp_path: Path) -> None:
    """Control: the rope part's scores scaled by 256 kv_scale as well."""
    arrays, ref_out, ref_lse, H, L = _split_kv_fp8(tmp_path, 0.5, controls=(_rope_scaled_too,))
    with pytest.raises(AssertionError):
        _check(arrays, ref_out, ref_lse, H, L, 4 * U16, 1e-4)


@needs_toolchain
def test_cuda_split_kv_wrong_scale_fails(tmp_path: Path) -> None:
    """Control: the kernel built for another scale than the pages were written with."""
    arrays, ref_out, ref_lse, H, L = _split_kv_fp8(tmp_path, 1.0)
    with pytest.raises(AssertionError):
        _check(arrays, ref_out, ref_lse, H, L, 4 * U16, 1e-4)

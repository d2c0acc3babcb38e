"""The row-tiled MLA extend kernel's FP8-cache variant (``schedules/mla_extend_cuda.py`` with
``kv_scale``) run on the CPU (no GPU), against float64 NumPy.

``mla_extend_cuda(16, 512, 64, kv_scale=...)`` (V2-Lite's heads, latent and rope widths) is built
by TVM for sm_90 and its CUDA runs under ``tests/cuda_emulation.py`` (``cp.async`` copies land at
their ``wait_group``, NaN until then). The pages hold ``schedules/kv_fp8.py``'s storage (a row:
the 512 latent values as e4m3 bytes in 256 float16 slots, then the 64 rope values in float16;
bytes from ``ml_dtypes``, as in ``tests/test_kv_fp8_kernels.py``), shuffled in a pool with unused
NaN pages and NaN rows past each sequence's length; the query is ``[n, 2H, 320]`` (head ``h``'s
576 values at the start of pseudo-heads ``2h, 2h + 1``, the 64 padding values NaN), the output
``[n, 2H, 256]`` (a reshape of ``[n, H, 512]``), the lse ``[n, 2H]`` (each head's on both of its
pseudo-heads). Reference: the absorbed attention over the e4m3 values times ``kv_scale`` and the
float16 rope values, in float64 (lse base 2). Shapes: query rows not multiples of the block's 4
tokens, prefixes of 1 row to a thousand with partial last pages, two sequences of different
lengths, a sequence without a page (out 0, lse -inf), causal chunks, two scales.

Controls (each must fail): the rope part's scores scaled by ``256 kv_scale`` too; the kernel
built with another scale than the pages were written with; a decode that drops the exponent
shift (the byte's bits as a float16 without ``>> 1``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.mla_extend_cuda import mla_extend_cuda

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402
from test_kv_fp8_kernels import e4m3_codes, e4m3_values  # noqa: E402

pytestmark = needs_toolchain
H, L, R = 16, 512, 64
D = L + R
K = 2  # e4m3 bytes a float16 slot
ROW = L // K + R  # slots a cache row
P = 16
U16 = 2.0**-11
SM_SCALE = 1 / math.sqrt(192)
OUT_TOL, LSE_TOL = 4 * U16, 1e-4


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """``build(kv_scale, *controls)``: the emulated kernel with the source rewrites
    ``controls``."""
    tmp = tmp_path_factory.mktemp("mla_extend_fp8")
    cache: dict = {}

    def build(kv_scale: float, *controls):
        key = (kv_scale, controls)
        if key not in cache:

            def patch(src: str) -> str:
                for control in controls:
                    src = control(src)
                return src

            func = mla_extend_cuda(H, L, R, "float16", kv_scale=kv_scale)
            cache[key] = emulate(func, tmp, f"k{len(cache)}", patch=patch)
        return cache[key]

    return build


def _attend(run, seqs, causal: int, kv_scale: float, seed: int = 0):
    """``seqs``: (cached rows kv_len, query rows q_len) per sequence; pages written with
    ``kv_scale``. Returns out [n, H, L], lse [n, H, K] and the float64 reference of both."""
    rng = np.random.default_rng(seed)
    n_pages = [-(-kv // P) for kv, _ in seqs]
    pool = sum(n_pages) + 3
    perm = rng.permutation(pool).astype(np.int32)
    page_indptr = np.int32([0, *np.cumsum(n_pages)])
    page_values = np.ascontiguousarray(perm[: page_indptr[-1]])
    lens = zip(seqs, n_pages, strict=True)
    last_len = np.int32([kv - (n - 1) * P if n else 0 for (kv, _), n in lens])
    q_indptr = np.int32([0, *np.cumsum([q for _, q in seqs])])
    total = int(q_indptr[-1])
    pages = np.full((pool, P, ROW), np.nan, np.float16)
    keys = []
    for b, (kv, _) in enumerate(seqs):
        rows = (rng.standard_normal((kv, D)) * 2.0).astype(np.float32)
        if kv:
            rows[0, :3] = [1000.0, -1000.0, 1e-4]  # saturating and subnormal values
        rows[:, L:] *= 4  # the rope part wider than the latent (as in the models)
        codes = e4m3_codes(rows[:, :L], kv_scale)
        rope = rows[:, L:].astype(np.float16)
        keys.append(np.concatenate([e4m3_values(codes, kv_scale), rope.astype(np.float64)], 1))
        ids = page_values[page_indptr[b] : page_indptr[b + 1]]
        padded = np.full((len(ids) * P, ROW), np.nan, np.float16)
        padded[:kv, : L // K] = np.ascontiguousarray(codes).view(np.float16)
        padded[:kv, L // K :] = rope
        pages[ids] = padded.reshape(-1, P, ROW)
    q = (rng.standard_normal((total, H, D)) * 0.3).astype(np.float16)
    q_pad = np.full((total, H, K * ROW), np.nan, np.float16)  # the padding: never read
    q_pad[:, :, :D] = q
    arrays = {
        "q": q_pad.reshape(total, H * K, ROW),
        "q_indptr": q_indptr,
        "pages": pages,
        "page_indptr": page_indptr,
        "page_values": page_values,
        "length_info": last_len,
        "output": np.full((total, H * K, L // K), np.nan, np.float16),
        "lse": np.full((total, H * K), np.nan, np.float32),
    }
    scalars = {"batch_size": len(seqs), "causal": causal, "sm_scale": float(np.float32(SM_SCALE))}
    run((total // 4 + len(seqs), H // 16), arrays, *(scalars.get(s, 0) for s in run.scalars))
    ref_out = np.zeros((total, H, L))
    ref_lse = np.full((total, H), -np.inf)
    for b, (kv, q_len) in enumerate(seqs):
        for r in range(q_len):
            row = q_indptr[b] + r
            n_vis = max(min(kv, kv - q_len + r + 1), 0) if causal else kv
            if n_vis == 0:
                continue
            kb = keys[b][:n_vis]
            s = q[row].astype(np.float64) @ kb.T * SM_SCALE * math.log2(math.e)
            m = s.max(axis=1, keepdims=True)
            w = np.exp2(s - m)
            ref_lse[row] = m[:, 0] + np.log2(w.sum(axis=1))
            ref_out[row] = (w / w.sum(axis=1, keepdims=True)) @ kb[:, :L]
    out = arrays["output"].reshape(total, H, L)
    return out, arrays["lse"].reshape(total, H, K), ref_out, ref_lse


def _errors(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    """(max over rows of the relative L2 error of out, max |lse - reference| over both
    pseudo-heads); rows that see no key must be exactly out = 0, lse = -inf."""
    o = out.astype(np.float64)
    if np.isnan(o).any() or np.isnan(lse).any():
        return math.inf, math.inf
    empty = np.isinf(ref_lse[:, 0])
    if empty.any() and (np.any(o[empty] != 0) or np.any(lse[empty] != -np.inf)):
        return math.inf, math.inf
    seen = ~empty
    rel = np.linalg.norm(o[seen] - ref_out[seen], axis=(1, 2)) / np.linalg.norm(
        ref_out[seen], axis=(1, 2)
    )
    return float(rel.max()), float(np.abs(lse[seen] - ref_lse[seen][:, :, None]).max())


CASES = [
    ([(1, 5)], 0, 0.5),  # a one-row prefix, 5 query rows (a block of 1 row)
    ([(1000, 7), (37, 66)], 0, 0.5),  # partial last pages, 32 key tiles; two sequences
    ([(0, 3), (50, 9)], 0, 0.5),  # a sequence without a cached page
    ([(70, 6), (16, 5)], 1, 0.5),  # causal: the rows see 65..70 and 12..16 keys
    ([(300, 13)], 0, 0.0371),  # another scale (256 kv_scale not a power of two)
]


@pytest.mark.parametrize(
    ("seqs", "causal", "kv_scale"), CASES, ids=[f"case{i}" for i in range(len(CASES))]
)
def test_extend_fp8_matches_numpy(kernel, seqs, causal, kv_scale):
    err_out, err_lse = _errors(*_attend(kernel(kv_scale), seqs, causal, kv_scale))
    assert err_out < OUT_TOL and err_lse < LSE_TOL, (err_out, err_lse)


def _rope_scaled_too(src: str) -> str:
    """Every k-step before the latent's scale: the rope part's scores scaled by 256 kv_scale."""
    old_lat, old_rope = "ks = hf; ks < 32; ks += 2", "ks = 32 + hf; ks < 36; ks += 2"
    assert old_lat in src and old_rope in src
    src = src.replace(old_lat, "ks = hf; ks < 36; ks += 2")
    return src.replace(old_rope, "ks = 36 + hf; ks < 36; ks += 2")


def _no_exponent_shift(src: str) -> str:
    """The byte's bits as a float16 without the shift that aligns e4m3's exponent."""
    old = "((u & 0x7f007f00u) >> 1)"
    assert old in src
    return src.replace(old, "(u & 0x7f007f00u)")


def _identity(src: str) -> str:
    return src


@pytest.mark.parametrize(
    ("control", "built_scale"),
    [(_rope_scaled_too, 0.5), (_identity, 1.0), (_no_exponent_shift, 0.5)],
    ids=["rope_scaled_too", "wrong_scale", "no_exponent_shift"],
)
def test_extend_fp8_broken_variants_fail(kernel, control, built_scale):
    out, lse, ref_out, ref_lse = _attend(kernel(built_scale, control), [(37, 9)], 0, 0.5)
    err_out, err_lse = _errors(out, lse, ref_out, ref_lse)
    assert err_out > 20 * OUT_TOL or err_lse > 20 * LSE_TOL, (err_out, err_lse)


def test_fp8_slot_function_adds_the_extend_kernel_only():
    """The FP8 cache's slot function: the FP8 split-KV kernels' source kept line for line, the
    FP8 row-tiled kernel added behind the ``min_rows`` host branch."""
    import re

    from cuda_emulation import cuda_source

    from dsv2_mlc.schedules.mla_attention_cuda import mla_attention_cuda
    from dsv2_mlc.schedules.mla_extend_cuda import with_extend_path
    from dsv2_mlc.schedules.tiles import tuned

    split_kv = mla_attention_cuda(H, L, R, "float16", kv_scale=0.5)
    slot = with_extend_path(split_kv, H, L, R, "float16", kv_scale=0.5)
    assert slot is not split_kv
    a, b = cuda_source(split_kv).splitlines(), cuda_source(slot).splitlines()
    i = 0
    added = []
    for line in b:
        if i < len(a) and line == a[i]:
            i += 1
        else:
            added.append(line)
    assert i == len(a), "a line of the split-KV source changed"
    added_src = "\n".join(added)
    assert "mla_extend_16_512_576_s3_fp8(" in added_src and "*= 128.0f" in added_src
    min_rows = tuned("mla_extend").min_rows
    assert re.search(
        rf"if total_len < (batch_size \* {min_rows}|{min_rows} \* batch_size):", slot.script()
    )

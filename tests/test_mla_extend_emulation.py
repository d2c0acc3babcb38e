"""The row-tiled MLA extend kernel (``schedules/mla_extend_cuda.py``) run on the CPU (no GPU).

``mla_extend_cuda(16, 512, 64)`` (V2-Lite's heads, latent and rope widths) is built by TVM for
sm_90 and its CUDA runs under ``tests/cuda_emulation.py`` (``mma.sync``, ``ldmatrix`` and
``cp.async`` by their stand-ins: a copy lands only at the ``wait_group`` that covers it, its
destination NaN until then), on batches of sequences whose pages lie shuffled in a pool with
unused NaN pages and NaN rows past each sequence's length. Out and lse are checked against a
float64 NumPy softmax of the absorbed attention over the cached latent rows (``causal=0``: the
cross-attention of an extend sees the whole prefix; ``causal=1``: row ``r`` of a ``q_len``-row
chunk sees ``kv_len - q_len + r + 1`` rows). Shapes: query rows that are not multiples of the
block's 4 tokens, prefixes of 1 row to past a thousand with partial last pages, two sequences of
different lengths in one batch, a sequence with no cached page (out 0, lse -inf).

Controls (each must fail): the softmax sees one key past the visible ones; the block's sequence
lookup drops the ``+ b`` of its tile offsets.

The slot function (``with_extend_path``): the split-KV kernels come first with the device code
of ``mla_attention_cuda`` alone, the row-tiled kernel is added after them, and the host launches
it only from ``min_rows`` query rows a sequence on.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.mla_extend_cuda import mla_extend_cuda, with_extend_path
from dsv2_mlc.schedules.tiles import tuned

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import cuda_source, emulate, needs_toolchain  # noqa: E402

pytestmark = needs_toolchain
H, L, R = 16, 512, 64
D = L + R
P = 16
U16 = 2.0**-11
SM_SCALE = 1 / math.sqrt(192)
OUT_TOL, LSE_TOL = 4 * U16, 1e-5


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """``build(*controls)``: the emulated kernel with the source rewrites ``controls``."""
    func = mla_extend_cuda(H, L, R, "float16")
    tmp = tmp_path_factory.mktemp("mla_extend")
    cache: dict = {}

    def build(*controls):
        if controls not in cache:

            def patch(src: str) -> str:
                for control in controls:
                    src = control(src)
                return src

            cache[controls] = emulate(func, tmp, f"k{len(cache)}", patch=patch)
        return cache[controls]

    return build


def _attend(run, seqs, causal: int, seed: int = 0):
    """``seqs``: (cached rows kv_len, query rows q_len) per sequence. Returns out, lse and the
    float64 reference of both."""
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
    pages = np.full((pool, P, D), np.nan, np.float16)
    latent = []
    for b, (kv, _) in enumerate(seqs):
        rows = rng.standard_normal((kv, D)).astype(np.float16)
        latent.append(rows.astype(np.float64))
        ids = page_values[page_indptr[b] : page_indptr[b + 1]]
        padded = np.full((len(ids) * P, D), np.nan, np.float16)
        padded[:kv] = rows
        pages[ids] = padded.reshape(-1, P, D)
    q = (rng.standard_normal((total, H, D)) * 0.5).astype(np.float16)
    out = np.full((total, H, L), np.nan, np.float16)
    lse = np.full((total, H), np.nan, np.float32)
    arrays = {"q": q, "q_indptr": q_indptr, "pages": pages, "page_indptr": page_indptr,
              "page_values": page_values, "length_info": last_len, "output": out,
              "lse": lse}  # fmt: skip
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
            keys = latent[b][:n_vis]
            s = q[row].astype(np.float64) @ keys.T * SM_SCALE * math.log2(math.e)
            m = s.max(axis=1, keepdims=True)
            w = np.exp2(s - m)
            ref_lse[row] = m[:, 0] + np.log2(w.sum(axis=1))
            ref_out[row] = (w / w.sum(axis=1, keepdims=True)) @ keys[:, :L]
    return out, lse, ref_out, ref_lse


def _errors(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    """(max over rows of the relative L2 error of out, max |lse - reference|); rows that see no
    key must be exactly out = 0, lse = -inf."""
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
    return float(rel.max()), float(np.abs(lse[seen] - ref_lse[seen]).max())


CASES = [
    ([(1, 5)], 0),  # a one-row prefix, 5 query rows (a block of 1 row)
    ([(1000, 7), (37, 66)], 0),  # partial last pages, 32 key tiles; two sequences
    ([(300, 10)], 0),  # one sequence: 10 key tiles, the last partial; 3 blocks, the last of 2 rows
    ([(0, 3), (50, 9)], 0),  # a sequence without a cached page
    ([(70, 6), (16, 5)], 1),  # causal: the rows see 65..70 and 12..16 keys
]


@pytest.mark.parametrize(("seqs", "causal"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_extend_matches_numpy(kernel, seqs, causal):
    err_out, err_lse = _errors(*_attend(kernel(), seqs, causal))
    assert err_out < OUT_TOL and err_lse < LSE_TOL, (err_out, err_lse)


def _one_key_more(src: str) -> str:
    """The softmax sees one key past the visible ones (a zero-filled or stale row)."""
    old = "k0 + e < vis_t ?"
    assert old in src
    return src.replace(old, "k0 + e <= vis_t ?")


def _no_batch_offset(src: str) -> str:
    """The sequence lookup forgets that every sequence may leave one block idle."""
    old = "q_indptr[b] / 4 + b)) * 4"
    assert old in src, src[src.index("const int pos0") :][:200]
    return src.replace(old, "q_indptr[b] / 4)) * 4")


@pytest.mark.parametrize(
    ("control", "seqs"),
    [(_one_key_more, [(37, 9)]), (_no_batch_offset, [(37, 9), (50, 6)])],
    ids=["softmax_one_key_more", "lookup_without_batch_offset"],
)
def test_extend_broken_variants_fail(kernel, control, seqs):
    err_out, err_lse = _errors(*_attend(kernel(control), seqs, 0))
    assert err_out > 20 * OUT_TOL or err_lse > 20 * LSE_TOL, (err_out, err_lse)


def test_slot_function_adds_the_extend_kernel_only():
    """The slot function's source: the split-KV kernels exactly as built alone, the row-tiled
    kernel added; the host branch compares total_len with min_rows * batch_size."""
    from dsv2_mlc.schedules.mla_attention_cuda import mla_attention_cuda

    split_kv = mla_attention_cuda(H, L, R, "float16")
    slot = with_extend_path(split_kv, H, L, R, "float16")
    alone, both = cuda_source(split_kv), cuda_source(slot)
    assert len(re.findall(r"__global__ void __launch_bounds__\(256\) p_kernel_2\(", both)) == 2
    # the split-KV source is a prefix-and-suffix-preserving part of the slot's: every line of
    # it appears, in order, and what the slot adds is the extend kernel
    a, b = alone.splitlines(), both.splitlines()
    added, i = [], 0
    for line in b:
        if i < len(a) and line == a[i]:
            i += 1
        else:
            added.append(line)
    assert i == len(a), "a line of the split-KV source changed"
    assert any("mla_extend_" in line for line in added)
    assert "p_kernel_2" in "\n".join(added)
    min_rows = tuned("mla_extend").min_rows
    assert re.search(
        rf"if total_len < (batch_size \* {min_rows}|{min_rows} \* batch_size):", slot.script()
    )


def test_slot_function_keeps_other_dtypes():
    from dsv2_mlc.schedules.mla_attention_cuda import mla_attention_cuda

    split_kv = mla_attention_cuda(16, 512, 64, "bfloat16")
    assert with_extend_path(split_kv, 16, 512, 64, "bfloat16") is split_kv
    split_kv = mla_attention_cuda(8, 64, 32, "float16")
    assert with_extend_path(split_kv, 8, 64, 32, "float16") is split_kv

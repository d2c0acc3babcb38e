"""The tensor-core ragged prefill attention (``schedules/prefill_attention_cuda.py``) runs on the
CPU through ``tests/cuda_emulation.py`` against a float64 NumPy reference, no GPU.

The kernel's ``mma.sync``, ``ldmatrix`` (``.x4`` for Q and K, ``.x4.trans`` for V), ``cp.async``
(a copy lands at its ``wait_group``, its destination NaN until then) and ``ex2.approx`` run as the
emulation's stand-ins, so a fragment read from the wrong row, a stage read before its wait or a
wrong causal limit shows as a wrong result. Every element of ``out`` and ``lse`` starts NaN: a row
no block wrote shows. Warp 1 lags behind the others in every block (``slow_warp``).

Tolerances, per element, from the kernel's roundings (``u16 = 2^-11``, ``u32 = 2^-24``, unit
roundoffs): the scores ``q . k`` are sums of ``Dqk`` exact fp16 products in fp32, so a score is
off by at most ``Dqk u32 sum_i |q_i k_i|`` and a weight ``p = exp(s - m)`` by that times
``sm_scale`` relatively; the row sum ``d`` and the output accumulators add ``n_keys`` fp32 terms
(plus a rescale per key tile). Together ``e32 = (Dqk S + n_keys + 8) u32`` bounds the relative
error of both the numerator and the denominator (``S`` the row's largest ``sm_scale sum_i
|q_i k_i|``), ``2 e32 A`` the output's (``A = sum_j p_j |v_j| / sum_j p_j``). P is rounded to
fp16 once for the PV product (``u16 A``) and the output once to fp16 (``u16 |out|``):
``|out - ref| <= u16 (A + |out|) + 2 e32 A``. ``lse = m + log2 d`` (base 2): ``2 e32 / ln 2``
from ``m`` and ``d``, ``2 u32 (|lse| + 1)`` from ``log2f`` and the final sum. ``ex2.approx``'s
own error (relative ``2^-22``) is inside ``e32``'s slack of 8 terms.

Each case has a negative control: the same check on a deliberately broken variant of the source
(a causal limit one key too far, the wait for V skipped, a ``.trans`` ldmatrix row address
shifted by 8 columns) must fail.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules import prefill_attention_cuda as pfa
from dsv2_mlc.schedules.tiles import PrefillAttentionTiles, tuned

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402

pytestmark = needs_toolchain

U16, U32 = 2.0**-11, 2.0**-24

# (replaced text, broken text): each must make the check fail
BROKEN = {
    # (the lab's wgmma variant) the Q and K tiles stored without the swizzle its MMAs read
    "unswizzled": ("(((c & 7) ^ (r & 7)) << 4)", "((c & 7) << 4)"),
    # (... with P V on wgmma) the k-steps of P V 8 keys apart instead of 16
    "pv-kstep": ("v_sa + kk * 2048", "v_sa + kk * 1024"),
    # (... warp-specialized) the producer fills stage 0 for every tile (V2-Lite's shapes)
    "ws-one-stage": ("      const unsigned kt = k_sa + st * 40960, vt = kt + 24576;\n      if",
                     "      const unsigned kt = k_sa + 0 * 40960, vt = kt + 24576;\n      if"),
    # query r sees one key past its causal limit
    "causal-limit": ("off + row_base + g + 8 * r + 1", "off + row_base + g + 8 * r + 2"),
    # the PV product reads the V tile before its cp.async group has landed
    "no-v-wait": ("pfa_wait1_{tag}();  // V(it) has landed", "// (wait skipped)"),
    # the V fragments' ldmatrix.trans rows of the second 8 columns read 8 columns too far left
    "ldsm-trans-shift": ("+ np * 16 + (lane >> 4) * 8) * 2", "+ np * 16 + (lane >> 4) * 0) * 2"),
}


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, q_ptr: list, kv_ptr: list, causal: bool, sm: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float64 attention of the ragged batch: (out, lse in base 2, the output bound, the lse
    bound) per (row, head) as the module docstring derives them."""
    n, heads, dqk = q.shape
    dv = v.shape[-1]
    out, lse = np.zeros((n, heads, dv)), np.zeros((n, heads))
    tol_out, tol_lse = np.zeros((n, heads, dv)), np.zeros((n, heads))
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    for b in range(len(q_ptr) - 1):
        q0, q_len = q_ptr[b], q_ptr[b + 1] - q_ptr[b]
        k0, kv_len = kv_ptr[b], kv_ptr[b + 1] - kv_ptr[b]
        for h in range(heads):
            qs, ks, vs = q64[q0 : q0 + q_len, h], k64[k0 : k0 + kv_len, h], v64[k0 : k0 + kv_len, h]
            s = qs @ ks.T * sm
            mag = np.abs(qs) @ np.abs(ks).T * sm
            seen = np.ones((q_len, kv_len), bool)
            if causal:  # bottom-right aligned: query r sees keys < kv_len - q_len + r + 1
                seen = np.arange(kv_len)[None, :] < (kv_len - q_len + np.arange(q_len) + 1)[:, None]
            s = np.where(seen, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            d = p.sum(axis=1, keepdims=True)
            o = p @ vs / d
            a = p @ np.abs(vs) / d
            e32 = (dqk * np.where(seen, mag, 0).max(axis=1) + seen.sum(axis=1) + 8) * U32
            out[q0 : q0 + q_len, h] = o
            lse[q0 : q0 + q_len, h] = (m[:, 0] + np.log(d[:, 0])) / math.log(2)
            tol_out[q0 : q0 + q_len, h] = U16 * (a + np.abs(o)) + 2 * e32[:, None] * a
            tol_lse[q0 : q0 + q_len, h] = 2 * e32 / math.log(2) + 2 * U32 * (
                np.abs(lse[q0 : q0 + q_len, h]) + 1
            )
    return out, lse, tol_out, tol_lse


def run_kernel(
    tmp_path: Path,
    heads: int,
    dqk: int,
    dv: int,
    q_lens: list,
    kv_lens: list,
    causal: bool,
    seed: int,
    broken: str | None = None,
    lab_wgmma: str | None = None,
    **tiles: int,
) -> tuple[bool, str]:
    """Emulate the kernel (``broken``: with that :data:`BROKEN` edit; ``lab_wgmma``: the lab's
    variant with the scores, ``"scores"``, or both products, ``"pv"``, on wgmma, or the
    warp-specialized one, ``"ws"``: schedules/lab/prefill_wgmma_cuda.py) on random fp16
    inputs; (whether every element is within its bound, a summary of the worst ones)."""
    rng = np.random.default_rng(seed)
    q_ptr, kv_ptr = [0, *np.cumsum(q_lens).tolist()], [0, *np.cumsum(kv_lens).tolist()]
    n, m = q_ptr[-1], kv_ptr[-1]
    q = rng.standard_normal((n, heads, dqk)).astype(np.float16)
    k = rng.standard_normal((m, heads, dqk)).astype(np.float16)
    v = rng.standard_normal((m, heads, dv)).astype(np.float16)
    sm = float(np.float32(1 / math.sqrt(dqk)))
    owner, name = pfa, "_cuda_source"
    if lab_wgmma:
        owner = _lab_wgmma()
        name = "ws_prefill_source" if lab_wgmma == "ws" else "wgmma_prefill_source"
    source = original = getattr(owner, name)
    if broken is not None:
        old, new = BROKEN[broken]

        def source(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            text = original(*args, **kwargs)
            old_text = old.replace("{tag}", args[0])
            assert old_text in text, broken
            return text.replace(old_text, new)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, name, source)
        if lab_wgmma == "ws":
            shape = PrefillAttentionTiles(**tiles)
            func = owner.build_prefill_ws(heads, heads, dqk, dv, "float16", shape)
        elif lab_wgmma:
            shape = PrefillAttentionTiles(**tiles)
            func = owner.build_prefill_wgmma(
                heads, heads, dqk, dv, "float16", shape, pv=lab_wgmma == "pv"
            )
        elif tiles:  # the builder with other tiles (as the lab sweeps them)
            shape = PrefillAttentionTiles(**tiles)
            func = pfa.build_prefill_attention(heads, heads, dqk, dv, "float16", shape)
        else:  # the shipped kernel, tiles from schedules/tiles.py
            func = pfa.prefill_attention_cuda(heads, heads, dqk, dv, "float16")
    run = emulate(func, tmp_path, broken or "kernel")
    out = np.full((n, heads, dv), np.nan, np.float16)
    lse = np.full((n, heads), np.nan, np.float32)
    arrays = {
        "q": q, "k": k, "v": v, "output": out, "lse": lse,
        "q_indptr": np.array(q_ptr, np.int32), "kv_indptr": np.array(kv_ptr, np.int32),
    }  # fmt: skip
    scalars = {
        "batch_size": len(q_lens), "causal": int(causal), "kv_indptr_elem_offset": 0,
        "q_indptr_elem_offset": 0, "qo_len": n, "sm_scale": sm,
    }  # fmt: skip
    block_m = tiles.get("block_m", tuned("prefill_attention").block_m)
    grid = heads * (-(-n // block_m) + len(q_lens))
    run(grid, arrays, *[scalars[s] for s in run.scalars], slow_warp=1)  # (warp 1 lags)
    want, want_lse, tol, tol_lse = reference(q, k, v, q_ptr, kv_ptr, causal, sm)
    err = np.abs(out.astype(np.float64) - want)
    err_lse = np.abs(lse.astype(np.float64) - want_lse)
    ok = bool((err <= tol).all() and (err_lse <= tol_lse).all())  # (NaN fails both)
    pairs = ((err, tol), (err_lse, tol_lse))
    worst = [float(np.nan_to_num(e / t, nan=np.inf).max()) for e, t in pairs]
    return ok, f"worst error / bound: out {worst[0]:.3g}, lse {worst[1]:.3g}"


def _lab_wgmma():
    """The lab's module of the wgmma variant (schedules/lab/prefill_wgmma_cuda.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "schedules" / "lab"))
    import prefill_wgmma_cuda

    return prefill_wgmma_cuda


# (heads, dqk, dv, q_lens, kv_lens, causal, tiles, broken variant for the negative control)
CASES = {
    # V2-Lite: 16 heads, 192 / 128, the default tiles (BM 64, BN 32, Q in registers); a
    # sequence of two query tiles and three key tiles, a single token, one of 33
    "v2lite": (16, 192, 128, [70, 1, 33], None, True, {}, "causal-limit"),
    # 3 heads, 64 / 32: 6 query tiles, 11 key tiles, extend-like rows (more keys than queries)
    "small-extend": (3, 64, 32, [5, 97, 130], [5, 110, 333], True, {}, "no-v-wait"),
    # V2-Lite, a prefill chunk after a cached prefix in one call (the non-absorbed long-prefix
    # path of schedules/results/long_prefill.md): 48 rows over a 300-key prefix + themselves
    "v2lite-chunk-after-prefix": (16, 192, 128, [48], [348], True, {}, "causal-limit"),
    # other tiles through the builder the lab sweeps (BM 32, BN 16); one non-causal batch
    "small-bm32": (2, 48, 32, [45, 19], None, True, dict(block_m=32, block_n=16),
                   "ldsm-trans-shift"),
    "small-bm32-full": (2, 48, 32, [45, 19], [50, 30], False, dict(block_m=32, block_n=16),
                        "no-v-wait"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_attention_matches_float64(case: str, tmp_path: Path) -> None:
    heads, dqk, dv, q_lens, kv_lens, causal, tiles, broken = CASES[case]
    args = (heads, dqk, dv, q_lens, kv_lens or q_lens, causal)
    ok, summary = run_kernel(tmp_path, *args, seed=len(case), **tiles)
    assert ok, summary
    # the negative control: the same check on a broken variant fails
    ok, summary = run_kernel(tmp_path, *args, seed=len(case), broken=broken, **tiles)
    assert not ok, f"{broken} passed: {summary}"


# the lab's wgmma variants: (heads, dqk, dv, q_lens, kv_lens, causal, block_n, variant, broken);
# variant "scores": S on wgmma; "pv": P V too; "ws": both, a producer warpgroup, 128-row blocks
LAB_WGMMA_CASES = {
    # V2-Lite, 64-key tiles: two query tiles, three key tiles, a single token, one of 33
    "v2lite-bn64": (16, 192, 128, [70, 1, 33], None, True, 64, "scores", "unswizzled"),
    # a chunk after a cached prefix, 128-key tiles (the prefix crosses tile edges)
    "v2lite-prefix-bn128": (4, 192, 128, [48, 100], [348, 230], True, 128, "scores",
                            "causal-limit"),
    # small heads, non-causal
    "small-full-bn64": (2, 64, 32, [45, 19], [50, 130], False, 64, "scores", "no-v-wait"),
    # P V on wgmma too (V MN-major): V2-Lite, both key tiles; small heads, non-causal
    "pv-v2lite-bn64": (16, 192, 128, [70, 1, 33], None, True, 64, "pv", "unswizzled"),
    "pv-v2lite-prefix-bn128": (4, 192, 128, [48, 100], [348, 230], True, 128, "pv",
                               "pv-kstep"),
    "pv-small-full-bn64": (2, 64, 64, [45, 19], [50, 130], False, 64, "pv", "no-v-wait"),
    # warp-specialized: blocks of 128 rows (a consumer warpgroup's 64 past the sequence end),
    # up to 6 key tiles through the two stages; a chunk after a prefix; non-causal small heads
    "ws-v2lite": (16, 192, 128, [70, 1, 200], None, True, 64, "ws", "ws-one-stage"),
    "ws-v2lite-prefix": (4, 192, 128, [48, 130], [348, 330], True, 64, "ws", "causal-limit"),
    "ws-small-full": (2, 64, 64, [45, 150], [50, 230], False, 64, "ws", "unswizzled"),
}  # fmt: skip


@pytest.mark.lab
@pytest.mark.parametrize("case", list(LAB_WGMMA_CASES))
def test_lab_wgmma_prefill_matches_float64(case: str, tmp_path: Path) -> None:
    heads, dqk, dv, q_lens, kv_lens, causal, block_n, lab, broken = LAB_WGMMA_CASES[case]
    args = (heads, dqk, dv, q_lens, kv_lens or q_lens, causal)
    tiles = dict(block_m=128 if lab == "ws" else 64, block_n=block_n)
    ok, summary = run_kernel(tmp_path, *args, seed=len(case), lab_wgmma=lab, **tiles)
    assert ok, summary
    ok, summary = run_kernel(tmp_path, *args, seed=len(case), broken=broken, lab_wgmma=lab,
                             **tiles)  # fmt: skip
    assert not ok, f"{broken} passed: {summary}"

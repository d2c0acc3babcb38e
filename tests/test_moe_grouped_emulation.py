"""The tensor-core grouped GEMMs of the routed experts (``schedules/moe_mma_cuda.py``, the
``mma.sync`` bodies that ``grouped_gemm_cuda`` runs for INT4 experts) run on the CPU through
``tests/cuda_emulation.py`` against a float64 NumPy reference, no GPU.

Both GEMMs (gate/up with the SwiGLU epilogue, gathering the token rows; down on padded rows) in
both block shapes (one tile a block with 2 or 4 warps along the columns; a pair of tiles a block,
two passes where the tiles belong to different experts), two column blocks each. The routing is
uneven on purpose: an expert of 80 pairs (two tiles), one of none, one of 5, tiles past the last
segment (``tile_expert = -1``), and for the pair kernel a pair of one expert, a pair of two
experts and a pair whose second tile is past the last segment. The mma, ldmatrix and cp.async
(a copy lands at its ``wait_group``, its destination NaN until then) run as the emulation's
stand-ins. Every output element starts NaN: a valid tile's row no warp wrote fails, and the
tiles past the last segment must stay unwritten. Warp 1 lags behind the others in every block
(``slow_warp``).

Tolerances, per element (``u16 = 2^-11``, ``u32 = 2^-24``): the kernel dequantises a weight to
fp16 (``(q - 8) * scale`` rounded once: relative ``u16``) and sums ``K`` exact fp16 x fp16
products in fp32 (``K u32`` relative to ``sum |w x|``), so a dot product is off by at most
``eps = (u16 + K u32) sum_k |w_k x_k|``. Down: ``(1 + u16) eps + u16 |y|`` with the final fp16
rounding. Gate/up ``h = silu(g) u``: silu's slope is at most 1.1, so ``|silu(g') u' - silu(g) u|
<= 1.1 eps_g (|u| + eps_u) + |silu(g)| eps_u``; the fp32 epilogue (exp, a division, three
products: ``8 u32 |h|``) and the fp16 rounding (``u16``) add to that.

Each case has a negative control: the same check on a deliberately broken variant (the
``cp.async`` wait skipped, a B fragment's ``ldmatrix`` row address in the wrong 8-column half,
the second pass of a pair run with the first tile's expert) must fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from tvm import te, tirx

from dsv2_mlc.schedules import moe_mma_cuda as mma
from dsv2_mlc.schedules.tiles import GroupedMmaTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, random_int4  # noqa: E402

pytestmark = needs_toolchain

U16, U32 = 2.0**-11, 2.0**-24
TM = 64
HIDDEN, INTER, EXPERTS, GROUP = 256, 128, 5, 64

# (module constant, replaced text, broken text): each must make the check fail
BROKEN = {
    # the MMAs read the activation stage before its cp.async group has landed
    "no-cp-wait": ("_MMA_TILES", "      moe_cp_wait_all();\n", ""),
    # the B fragments' rows of the second 8 columns read from the first 8
    "ldsm-b-half": (
        "_MMA_COMMON", "const int c = kk * 2 + ((lane >> 3) & 1);", "const int c = kk * 2;"
    ),
    # a pair of two experts runs its second pass with the first tile's expert
    "pass-expert": ("_MMA_TILES", "const int e = pass == 0 ? e0 : e1;", "const int e = e0;"),
}  # fmt: skip


def routing(rng: np.random.Generator) -> np.ndarray:
    """``idx [85, 2]``: expert 0 takes 80 pairs (two tiles), 1 takes 35, 2 takes 50, 3 none,
    4 takes 5; the tokens in a random order (the gathered rows are not contiguous)."""
    idx = np.zeros((85, 2), np.int32)
    idx[:80, 0] = 0
    idx[:30, 1] = 1
    idx[30:80, 1] = 2
    idx[80:, 0] = 4
    idx[80:, 1] = 1
    return idx[rng.permutation(85)]


def align(idx: np.ndarray, tm: int = TM) -> tuple[np.ndarray, np.ndarray]:
    """``moe_align``'s rows ``[nt, tm]`` (each expert's pairs in (token, slot) order, padded with
    token 0 to whole tiles) and ``tile_expert [nt]`` (-1 past the last segment)."""
    n, k = idx.shape
    nt = (n * k + EXPERTS * (tm - 1)) // tm
    rows, tile_expert = np.zeros(nt * tm, np.int32), np.full(nt, -1, np.int32)
    start = 0
    for e in range(EXPERTS):
        pairs = np.nonzero(idx.reshape(-1) == e)[0]
        rows[start : start + len(pairs)] = pairs // k
        tiles = -(-len(pairs) // tm)
        tile_expert[start // tm : start // tm + tiles] = e
        start += tiles * tm
    return rows.reshape(nt, tm), tile_expert


def reference_tiles(
    kind: str, x: np.ndarray, rows: np.ndarray, tile_expert: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """float64 outputs ``[nt, tm, out]`` of the valid tiles (NaN elsewhere) and their bounds
    (``rows [nt, tm]``: the tile height is the caller's)."""
    nt, TM = rows.shape
    inter = w.shape[1] // 2 if kind == "gate_up" else w.shape[2]
    out_dim = inter if kind == "gate_up" else w.shape[1]
    want, tol = np.full((nt, TM, out_dim), np.nan), np.full((nt, TM, out_dim), np.nan)
    for t in np.nonzero(tile_expert >= 0)[0]:
        e = tile_expert[t]
        a = (x[rows[t]] if kind == "gate_up" else x[t]).astype(np.float64)  # [TM, K]
        k = a.shape[1]
        y, mag = a @ w[e].T, np.abs(a) @ np.abs(w[e]).T
        eps = (U16 + k * U32) * mag
        if kind == "down":
            want[t], tol[t] = y, (1 + U16) * eps + U16 * np.abs(y)
            continue
        g, u, eg, eu = y[:, :inter], y[:, inter:], eps[:, :inter], eps[:, inter:]
        silu = g / (1 + np.exp(-g))
        h = silu * u
        bound = 1.1 * eg * (np.abs(u) + eu) + np.abs(silu) * eu
        want[t], tol[t] = h, (1 + U16) * bound + (U16 + 8 * U32) * np.abs(h)
    return want, tol


def check_tiles(out: np.ndarray, want: np.ndarray, tol: np.ndarray) -> tuple[bool, str]:
    """(whether every element of the valid tiles (``want`` not NaN) is within its bound and the
    others unwritten (NaN), the worst error / bound and the count written outside)."""
    valid = ~np.isnan(want)
    err = np.abs(out.astype(np.float64) - want)
    ratio = np.nan_to_num(err[valid] / tol[valid], nan=np.inf)
    ok = bool((ratio <= 1).all() and np.isnan(out[~valid]).all())
    outside = int((~np.isnan(out[~valid])).sum())
    return ok, f"worst error / bound {ratio.max():.3g}, {outside} elements written outside"


def run_kernel(
    tmp_path: Path,
    kind: str,
    warps_n: int,
    rows_per_block: int,
    broken: str | None = None,
    dims: tuple[int, int, int] = (HIDDEN, INTER, GROUP),
) -> tuple[bool, str]:
    """Emulate one GEMM (``broken``: with that :data:`BROKEN` edit; ``dims``: hidden, expert
    width, INT4 group); (whether every element of the valid tiles is within its bound and the
    others unwritten, the worst error / bound)."""
    rng = np.random.default_rng(len(kind) + warps_n + rows_per_block)
    idx = routing(rng)
    rows, tile_expert = align(idx)
    nt = len(tile_expert)
    gathered = kind == "gate_up"
    hidden, inter, group = dims
    k, out_dim, halves = (hidden, inter, 2) if gathered else (inter, hidden, 1)
    packed, scale, w = random_int4(rng, (EXPERTS, out_dim * halves), k, group)
    x_shape = (len(idx), k) if gathered else (nt, TM, k)
    x = rng.standard_normal(x_shape).astype(np.float16)

    n_var, nt_var = tirx.Var("n", "int64"), tirx.Var("nt", "int64")
    xt = te.placeholder((n_var, k) if gathered else (nt_var, TM, k), "float16", name="x")
    rt = te.placeholder((nt_var, TM), "int32", name="rows")
    tt = te.placeholder((nt_var,), "int32", name="tile_expert")
    qt = te.placeholder(packed.shape, "uint32", name="qw")
    st = te.placeholder(scale.shape, "float16", name="sc")
    with pytest.MonkeyPatch.context() as patch:
        if broken is not None:
            const, old, new = BROKEN[broken]
            text = getattr(mma, const)
            assert old in text, broken
            patch.setattr(mma, const, text.replace(old, new))
        # one-tile blocks (64 rows: pair_from None) or pair blocks (128 rows: pair_from 0), each
        # a kernel of its own (the shipped PrimFunc holds both; the host picks by tile count)
        tiles = GroupedMmaTiles(warps_n, None if rows_per_block == 64 else 0)
        func = mma.grouped_mma_kernel(xt, rt, tt, [qt, st], out_dim, halves, gathered, kind, tiles)
    run = emulate(func, tmp_path, broken or "kernel")
    out = np.full((nt, TM, out_dim), np.nan, np.float16)
    arrays = {"xb": x, "rb": rows, "teb": tile_expert, "qb": packed, "sb": scale, "ob": out}
    blocks = nt if rows_per_block == 64 else (nt + 1) // 2
    col_blocks = out_dim * halves // 128
    grid = (blocks, col_blocks) if gathered else (col_blocks, blocks)  # (down: columns first)
    run(grid, arrays, *[{"nt": nt, "n": len(idx)}[s] for s in run.scalars], slow_warp=1)

    return check_tiles(out, *reference_tiles(kind, x, rows, tile_expert, w))


# (kind, warps along the columns, rows per block, broken variant for the negative control[,
# (hidden, expert width, group)])
CASES: dict[str, tuple] = {
    "gate_up-tile-w2": ("gate_up", 2, 64, "no-cp-wait"),
    "gate_up-tile-w4": ("gate_up", 4, 64, "ldsm-b-half"),
    "gate_up-pair": ("gate_up", 2, 128, "pass-expert"),
    "down-tile-w2": ("down", 2, 64, "ldsm-b-half"),
    "down-tile-w4": ("down", 4, 64, "no-cp-wait"),
    "down-pair": ("down", 2, 128, "pass-expert"),
    # a reduction with a last, shorter group (V2-Lite's dense down_proj: 10,944 = 85.5 x 128)
    "down-ragged-group": ("down", 2, 64, "no-cp-wait", (256, 320, 128)),
    "gate_up-ragged-group": ("gate_up", 2, 64, "ldsm-b-half", (320, 128, 128)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_mma_matches_float64(case: str, tmp_path: Path) -> None:
    kind, warps_n, rows_per_block, broken, *dims = CASES[case]
    ok, summary = run_kernel(tmp_path, kind, warps_n, rows_per_block, None, *dims)
    assert ok, summary
    # the negative control: the same check on a broken variant fails
    ok, summary = run_kernel(tmp_path, kind, warps_n, rows_per_block, broken, *dims)
    assert not ok, f"{broken} passed: {summary}"

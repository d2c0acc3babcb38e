"""The grouped GEMMs of decode batches with the weights as ``wgmma``'s M
(``schedules/moe_swap_cuda.py``) run on the CPU through ``tests/cuda_emulation.py`` against a
float64 NumPy reference, no GPU.

Both GEMMs (gate/up with the SwiGLU epilogue, gathering the token rows; down on the padded rows)
at token tiles of 16, 32 and 64, rings of 3 to 6 stages and packed weights copied 1, 2 or 4
steps at a time, two column blocks or more each. The
routing is uneven on purpose: an expert of 80 pairs (several tiles, the last one partial), one of
none, one of 5, tiles past the last segment (``tile_expert = -1``, which must stay unwritten).
``wgmma`` runs as the emulation's stand-in, which reads its shared-memory operands (through the
128-byte swizzle) at the ``wait_group`` that completes it, and ``cp.async`` lands at its
``wait_group`` (its destination NaN until then), so a stage reused while an MMA or a copy may
still touch it shows. Every output element starts NaN. Warp 1 lags behind in every block.

Tolerances as in ``test_moe_grouped_emulation.py`` (the same dequantisation and fp32 sums):
``eps = (u16 + K u32) sum_k |w_k x_k|`` a dot product, then the epilogue's roundings.

Both ways of feeding the MMA's A: a shared stage the threads dequantise into, and the threads'
registers (``operand_a="regs"``: the activations staged in the permuted input order the
registers' fragments imply).

Each case has a negative control, the same check on a broken variant: the ``cp.async`` wait
skipped, the MMAs not waited for (their stage rewritten under them), the dequantised weights
stored without the swizzle the descriptor reads, the register fragments' pairs in an order the
staged activations do not follow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from tvm import te, tirx

from dsv2_mlc.schedules import moe_swap_cuda as swap
from dsv2_mlc.schedules.tiles import SwapTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain, random_int4  # noqa: E402
from test_moe_grouped_emulation import reference_tiles, routing  # noqa: E402

pytestmark = needs_toolchain

HIDDEN, INTER, EXPERTS, GROUP = 256, 128, 5, 64

# (kernel body, replaced text, broken text): each must make the check fail
BROKEN = {
    "no-cp-wait": ("_SWAP_BODY", "    swap_cp_wait<S - 3>();", "    (void)0;"),
    "no-wg-wait": ("_SWAP_BODY", "    swap_wg_wait<1>();", "    (void)0;"),
    "no-swizzle": ("_SWAP_BODY", "(ws + ((j ^ (tid & 7)) << 3))", "(ws + (j << 3))"),
    "ra-no-cp-wait": ("_SWAP_RA_BODY", "        swap_cp_wait<S - 2>();", "        (void)0;"),
    "ra-no-wg-wait": ("_SWAP_RA_BODY", "        swap_wg_wait<0>();", "        (void)0;"),
    # the hi word's pairs given as the lo word's: A and B disagree on the inputs' order
    "ra-pair-order": ("_SWAP_RA_BODY", "a[h][sl][2 + m] = hv[sl];", "a[h][sl][2 + m] = lv[sl];"),
}


def align(idx: np.ndarray, tm: int) -> tuple[np.ndarray, np.ndarray]:
    """``moe_align``'s rows ``[nt, tm]`` and ``tile_expert [nt]`` (-1 past the last segment)."""
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


def run_kernel(
    tmp_path: Path,
    kind: str,
    tiles: SwapTiles,
    broken: str | None = None,
    dims: tuple[int, int, int] = (HIDDEN, INTER, GROUP),
) -> tuple[bool, str]:
    """Emulate one GEMM; (whether every element of the valid tiles is within its bound and the
    others unwritten, the worst error / bound)."""
    rng = np.random.default_rng(len(kind) + tiles.tokens + tiles.stages)
    tm = tiles.tokens
    idx = routing(rng)
    rows, tile_expert = align(idx, tm)
    nt = len(tile_expert)
    gathered = kind == "gate_up"
    hidden, inter, group = dims
    k, out_dim, halves = (hidden, inter, 2) if gathered else (inter, hidden, 1)
    packed, scale, w = random_int4(rng, (EXPERTS, out_dim * halves), k, group)
    x = rng.standard_normal((len(idx), k) if gathered else (nt, tm, k)).astype(np.float16)

    n_var, nt_var = tirx.Var("n", "int64"), tirx.Var("nt", "int64")
    xt = te.placeholder((n_var, k) if gathered else (nt_var, tm, k), "float16", name="x")
    qt = te.placeholder(packed.shape, "uint32", name="qw")
    st = te.placeholder(scale.shape, "float16", name="sc")
    with pytest.MonkeyPatch.context() as patch:
        if broken is not None:
            body, old, new = BROKEN[broken]
            text = getattr(swap, body)
            assert old in text, broken
            patch.setattr(swap, body, text.replace(old, new))
        func = swap.swap_kernel(xt, [qt, st], out_dim, halves, gathered, kind, tiles, False)
    run = emulate(func, tmp_path, broken or "kernel")
    out = np.full((nt, tm, out_dim), np.nan, np.float16)
    arrays = {"xb": x, "rb": rows, "teb": tile_expert, "qb": packed, "sb": scale, "ob": out}
    grid = (nt, out_dim * halves // 128)
    run(grid, arrays, *[{"nt": nt, "n": len(idx)}[s] for s in run.scalars], slow_warp=1)

    want, tol = reference_tiles(kind, x, rows, tile_expert, w)
    valid = ~np.isnan(want)
    err = np.abs(out.astype(np.float64) - want)
    ratio = np.nan_to_num(err[valid] / tol[valid], nan=np.inf)
    ok = bool((ratio <= 1).all() and np.isnan(out[~valid]).all())
    outside = int((~np.isnan(out[~valid])).sum())
    return ok, f"worst error / bound {ratio.max():.3g}, {outside} elements written outside"


# (kind, tiles, broken variant for the negative control[, (hidden, expert width, group)]); a
# skipped MMA wait shows only where a stage comes round again (K of 4 steps or more)
CASES: dict[str, tuple] = {
    "gate_up-t32-s4": ("gate_up", SwapTiles(32, 4), "no-cp-wait"),
    "gate_up-t16-s3": ("gate_up", SwapTiles(16, 3), "no-swizzle"),
    "gate_up-t64-s5": ("gate_up", SwapTiles(64, 5), "no-wg-wait"),
    "down-t32-s4": ("down", SwapTiles(32, 4), "no-swizzle"),
    "down-t16-s5": ("down", SwapTiles(16, 5), "no-cp-wait"),
    # packed weights copied 2 or 4 steps at a time (whole lines); K of 2 steps with 4 a copy
    "gate_up-t32-s6-l4": ("gate_up", SwapTiles(32, 6, 4), "no-wg-wait"),
    "gate_up-t16-s4-l2": ("gate_up", SwapTiles(16, 4, 2), "no-cp-wait"),
    "down-t32-s4-l4": ("down", SwapTiles(32, 4, 4), "no-swizzle"),
    # a reduction with a last, shorter group (10,944 = 85.5 x 128 in V2-Lite's dense down_proj)
    "down-ragged-group": ("down", SwapTiles(32, 4), "no-wg-wait", (256, 320, 128)),
    # 5 steps in copies of 4: the second copy's last 3 steps lie past the reduction
    "down-ragged-l4": ("down", SwapTiles(32, 5, 4), "no-cp-wait", (256, 320, 128)),
    # A from registers (the weights loaded 1, 2 or 4 steps ahead)
    "gate_up-t32-s4-ra": ("gate_up", SwapTiles(32, 4, 4, "regs"), "ra-no-cp-wait"),
    "gate_up-t64-s3-ra": ("gate_up", SwapTiles(64, 3, 1, "regs"), "ra-pair-order"),
    "down-t16-s5-ra": ("down", SwapTiles(16, 5, 2, "regs"), "ra-no-wg-wait"),
    "down-ragged-ra": ("down", SwapTiles(32, 4, 4, "regs"), "ra-pair-order", (256, 320, 128)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_swap_matches_float64(case: str, tmp_path: Path) -> None:
    kind, tiles, broken, *dims = CASES[case]
    ok, summary = run_kernel(tmp_path, kind, tiles, None, *dims)
    assert ok, summary
    ok, summary = run_kernel(tmp_path, kind, tiles, broken, *dims)
    assert not ok, f"{broken} passed: {summary}"


def test_swap_refuses_what_it_cannot_take() -> None:
    """Shapes outside the kernel's (a reduction not a multiple of 64, float weights) and a
    build without an sm_90 target are refused."""
    x = te.placeholder((4, 96), "float16")
    packed, scale = (te.placeholder((2, 256, 12), "uint32"), te.placeholder((2, 256, 3), "float16"))
    assert not swap.swap_supported(x, [packed, scale], 128, 2, target=False)
    x = te.placeholder((4, 128), "float16")
    ok = [te.placeholder((2, 256, 16), "uint32"), te.placeholder((2, 256, 2), "float16")]
    assert swap.swap_supported(x, ok, 128, 2, target=False)
    assert not swap.swap_supported(x, ok, 128, 2)  # no target: no wgmma
    assert not swap.swap_supported(x, [te.placeholder((2, 256, 128), "float16")], 128, 2, False)
    with pytest.raises(ValueError, match="does not take"):
        swap.swap_kernel(x, ok, 128, 2, True, "t", SwapTiles(), target=True)

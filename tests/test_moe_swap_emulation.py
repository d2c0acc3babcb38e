"""The grouped GEMMs of decode batches with the weights as ``wgmma``'s M
(``schedules/moe_swap_cuda.py``) run on the CPU through ``tests/cuda_emulation.py`` against a
float64 NumPy reference, no GPU.

Both GEMMs (gate/up with the SwiGLU epilogue, gathering the token rows; down on the padded rows)
at token tiles of 16, 32 and 64, rings of 2 to 5 activation slots, weights loaded 1, 2 or 4 steps
ahead, one or two warpgroups a block, two column blocks or more each. The routing is uneven on
purpose: an expert of 80 pairs (several tiles, the last one partial), one of none, one of 5, tiles
past the last segment (``tile_expert = -1``, which must stay unwritten). ``wgmma`` runs as the
emulation's stand-in (A from the warp's registers, exchanged at issue; B read from shared memory
through the 128-byte swizzle at the ``wait_group`` that completes it) and ``cp.async`` lands at its
``wait_group`` (its destination NaN until then), so a slot reused while an MMA or a copy may still
touch it shows. Every output element starts NaN. Warp 1 lags behind in every block.

Tolerances as in ``test_moe_grouped_emulation.py`` (the same dequantisation and fp32 sums):
``eps = (u16 + K u32) sum_k |w_k x_k|`` a dot product, then the epilogue's roundings.

Each case has a negative control, the same check on a broken variant: the ``cp.async`` wait
skipped, the MMAs not waited for (their slot rewritten under them), the register fragments'
pairs in an order the staged activations do not follow, the activations staged without the
swizzle the descriptor reads. A skipped MMA wait shows only where a slot comes round again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx

from dsv2_mlc.schedules import moe_swap_cuda as swap
from dsv2_mlc.schedules.tiles import SwapTiles

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402
from cuda_emulation import emulate, needs_toolchain, random_int4  # noqa: E402
from test_moe_grouped_emulation import (  # noqa: E402
    EXPERTS,
    align,
    check_tiles,
    reference_tiles,
    routing,
)

pytestmark = needs_toolchain

HIDDEN, INTER, GROUP = 256, 128, 64

# (replaced text of _SWAP_BODY, broken text): each must make the check fail
BROKEN = {
    "no-cp-wait": ("        swap_cp_wait<S - 2>();", "        (void)0;"),
    "no-wg-wait": ("        swap_wg_wait0();", "        (void)0;"),
    # the hi word's pairs given as the lo word's: A and B disagree on the inputs' order
    "pair-order": ("[sl][2 + m] = hv[sl];", "[sl][2 + m] = lv[sl];"),
    # the activation pairs stored without the swizzle the descriptor reads
    "no-swizzle": ("(((2 * sl + hh) ^ (r & 7)) << 4)", "((2 * sl + hh) << 4)"),
}


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
            old, new = BROKEN[broken]
            assert old in swap._SWAP_BODY, broken
            patch.setattr(swap, "_SWAP_BODY", swap._SWAP_BODY.replace(old, new))
        func = swap.swap_kernel(xt, [qt, st], out_dim, halves, gathered, kind, tiles, False)
    run = emulate(func, tmp_path, broken or "kernel")
    out = np.full((nt, tm, out_dim), np.nan, np.float16)
    arrays = {"xb": x, "rb": rows, "teb": tile_expert, "qb": packed, "sb": scale, "ob": out}
    grid = (nt, out_dim * halves // 128)
    run(grid, arrays, *[{"nt": nt, "n": len(idx)}[s] for s in run.scalars], slow_warp=1)

    return check_tiles(out, *reference_tiles(kind, x, rows, tile_expert, w))


RAGGED = (256, 320, 128)  # hidden, expert width, group: 5 steps, the last group half as long
# (kind, tiles, broken variant for the negative control[, (hidden, expert width, group)])
CASES: dict[str, tuple] = {
    "gate_up-t32-s4-a2": ("gate_up", SwapTiles(32, 4, 2), "no-cp-wait"),
    "gate_up-t16-s3-a4": ("gate_up", SwapTiles(16, 3, 4), "pair-order"),
    "gate_up-t64-s2-a1": ("gate_up", SwapTiles(64, 2, 1), "no-swizzle"),
    "down-t32-s4-a2": ("down", SwapTiles(32, 4, 2), "pair-order"),
    "down-t16-s5-a2": ("down", SwapTiles(16, 5, 2), "no-cp-wait"),
    "down-ragged-a4": ("down", SwapTiles(32, 3, 4), "no-wg-wait", RAGGED),
    # two warpgroups, a 64-row half each (gate/up: the gate half's values through shared memory)
    "gate_up-t32-s3-wg2": ("gate_up", SwapTiles(32, 3, 2, 2), "no-wg-wait"),
    "gate_up-t16-s3-a4-wg2": ("gate_up", SwapTiles(16, 3, 4, 2), "no-swizzle"),
    "down-t32-s4-wg2": ("down", SwapTiles(32, 4, 2, 2), "no-cp-wait"),
    "down-ragged-wg2": ("down", SwapTiles(32, 3, 4, 2), "pair-order", RAGGED),
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


@needs_nvcc
def test_swap_kernels_compile_for_sm90_with_wgmma():
    """The table's kernels (and a two-warpgroup, 16-token variant) at V2-Lite's and V2's shapes:
    nvcc fatbin for sm_90, compiled as sm_90a, the wgmma with A from registers and the 4-byte
    cp.async in the source (what the emulation replaces with its stand-ins)."""
    from dsv2_mlc.compiler.compile import make_target
    from dsv2_mlc.compiler.cuda import cuda_codegen, cuda_sources

    kernels = {}
    n, nt = tirx.Var("n", "int64"), tirx.Var("nt", "int64")
    shapes = {"lite": (2048, 1408, 64), "v2": (5120, 1536, 160)}  # hidden, width, experts
    for shape, (hidden, inter, experts) in shapes.items():
        for tiles in (swap.swap_tiles(), SwapTiles(16, 3, 4, 2)):
            for kind, k, out_dim, halves in (("gu", hidden, inter, 2), ("dn", inter, hidden, 1)):
                x = te.placeholder((n, k) if halves == 2 else (nt, tiles.tokens, k), "float16")
                rows = out_dim * halves
                ws = [te.placeholder((experts, rows, k // 8), "uint32"),
                      te.placeholder((experts, rows, k // 128), "float16")]  # fmt: skip
                key = f"{shape}_{kind}_{tiles.name}"
                gathered = halves == 2
                kernels[key] = swap.swap_kernel(x, ws, out_dim, halves, gathered, key, tiles, False)
    target = make_target("cuda", "sm_90")
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in kernels.items()})
    with target, cuda_codegen(True):
        assert swap.swap_target()
        lib = tvm.compile(mod, target=target)
    (src,) = cuda_sources(lib.mod)
    wgmma = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.f16.f16"
    for needle in (wgmma.format(32), wgmma.format(16), "cp.async.ca.shared.global", "fence.proxy"):
        assert needle in src, needle

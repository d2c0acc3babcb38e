"""The lab's streams split block (``schedules/lab/mla_streams_cuda.py``) on the CPU, no GPU.

The harness of tests/test_mla_pipe_emulation.py (g++ under AddressSanitizer, one thread per
CUDA thread, the PTX primitives emulated, copies landing at issue or at their covering wait,
NaN shared memory and NaN rows past the visible length, the step's new rows NaN until the
block's PDL wait), with the streams' named barriers (``bar.sync id, 32 W``) emulated as
barriers of their ``32 W`` threads. Every block of rows of several lengths, split in ``pps``
pages, is checked against a float64 softmax over its keys: a stream with no page, streams with
different page counts, part-filled last pages, splits of many pages a stream, the FP8 cache.
Controls: a stream reading another stream's ring slot, a warp summing the partial scores in its
own order, a page copied before the wait too many.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from string import Template

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "schedules" / "lab"))
from cuda_emulation import TYPES, compile_cpp  # noqa: E402
from mla_streams_cuda import streams_shared_halves, streams_source  # noqa: E402
from test_mla_pipe_emulation import _PRIMS, _run, harness  # noqa: E402

pytestmark = [
    pytest.mark.lab,  # a lab block: pytest -m lab
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)"),
]

_BAR = r"""
static inline void mlap_bar_$tag(int id) { t_b->pbar[id - 1]->arrive_and_wait(); }
static inline bool __all_sync(unsigned, bool v) {
  const int w = t_tx >> 5, l = t_tx & 31;
  t_b->fst[w][l][1] = v ? 1.f : 0.f;
  wsync();
  bool all = true;
  for (int k = 0; k < 32; ++k) all = all && t_b->fst[w][k][1] != 0.f;
  wsync();
  return all;
}
"""


def _build(
    tmp: Path,
    d: int,
    dl: int,
    stages: int,
    warps: int,
    kv_scale: float | None = None,
    patch: Callable[[str], str] = lambda src: src,
) -> Path:
    tag = "emu"
    kscale = None if kv_scale is None else 256 * kv_scale
    smem = streams_shared_halves(d, dl, stages, warps, kscale is not None)
    prelude, main = harness(d, dl, kscale, smem, "mla_split_streams", (8, 32 * warps))
    src = (
        TYPES
        + prelude
        + Template(_PRIMS).substitute(tag=tag, wait=stages - 2)
        + Template(_BAR).substitute(tag=tag)
        + patch(streams_source(tag, d, dl, stages, warps, prims=False, kscale=kscale))
        + main
    )
    return compile_cpp(src, tmp / "emu", sanitize=True)


ROWS = [0, 1, 16, 17, 33, 100, 300, 130]
NEW = [0, 1, 1, 1, 1, 1, 1, 40]


@pytest.mark.parametrize(
    ("d", "dl", "stages", "warps", "pps", "kv_scale"),
    [
        (80, 64, 2, 2, 3, None),  # 4 streams, one or no page each
        (80, 64, 3, 2, 9, None),  # streams of 2-3 pages, 2 in flight
        (80, 64, 2, 4, 5, None),  # 2 streams of 4 warps
        (80, 64, 4, 4, 19, None),  # long splits, 3 pages in flight
        (144, 128, 2, 2, 7, 2.0**-7),  # FP8 cache: latent and rope k-steps in one warp
        (144, 128, 3, 4, 6, 2.0**-6),
    ],
)
def test_streams_split_block(
    tmp_path: Path, d: int, dl: int, stages: int, warps: int, pps: int, kv_scale: float | None
) -> None:
    """Every block's state against the reference, the copies landing at issue and at the
    covering wait, the old pages of each stream copied before the block's wait."""
    exe = _build(tmp_path, d, dl, stages, warps, kv_scale)
    for late in (0, 1):
        _run(tmp_path, exe, d, dl, ROWS, pps, late, new=NEW, kv_scale=kv_scale)


@pytest.mark.parametrize(("warps", "kv_scale"), [(2, None), (4, 2.0**-7)])
def test_streams_split_block_v2_lite(tmp_path: Path, warps: int, kv_scale) -> None:
    """V2-Lite rows (576 = 512 + 64): 36 k-steps split over the stream's warps."""
    exe = _build(tmp_path, 576, 512, 2, warps, kv_scale)
    _run(tmp_path, exe, 576, 512, [0, 33, 200, 75], 5, 1, new=[0, 1, 1, 20], kv_scale=kv_scale)


SLOT_STREAM = 2 * 16 * 88 * 2  # bytes of a stream's ring at d = 80, 2 stages (rows of 88)


def _other_stream_slot(src: str) -> str:
    """Every stream reads the ring of the stream after it."""
    old = "const unsigned kvb = ring0 +"
    assert old in src
    return src.replace(old, f"const unsigned kvb = ring0 + ((s + 1) % 4 - s) * {SLOT_STREAM} +")


def _partner_dropped(src: str) -> str:
    """The stream's second warp leaves its own partial scores out of the sum."""
    old = "for (int o = 0; o < 2; ++o) {  // one order in every warp: the same sums"
    assert old in src
    return src.replace(old, "for (int o = 0; o < 2 - hw; ++o) {")


@pytest.mark.parametrize(
    ("control", "late", "extra"),
    [(_other_stream_slot, 1, 0), (_partner_dropped, 0, 0), (None, 0, 1)],
    ids=["other_stream_slot", "partial_scores_dropped", "page_copied_before_wait"],
)
def test_streams_split_block_broken_variants_fail(tmp_path: Path, control, late, extra) -> None:
    """Controls: a stream reading another stream's pages, a warp dropping its own partial
    scores, one page more copied before the wait (the new token's page: NaN)."""
    exe = _build(tmp_path, 80, 64, 2, 2, patch=control or (lambda src: src))
    with pytest.raises(AssertionError, match="rel L2"):
        _run(tmp_path, exe, 80, 64, [100, 300], 9, late, new=[1, 1], extra_early=extra)

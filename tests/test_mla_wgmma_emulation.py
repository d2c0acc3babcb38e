"""The FP8 cache's wgmma split block (``dsv2_mlc.schedules.mla_wgmma_cuda``) and the lab's variants
(``schedules/lab/mla_wgmma_rs.py``, ``mla_wgmma_variants.py``, ``-m lab``) on the CPU, no GPU.

The harness of tests/test_mla_pipe_emulation.py (g++ under AddressSanitizer, one thread per
CUDA thread, the ``mma.sync`` / ``ldmatrix`` / ``cp.async`` stand-ins, copies landing at issue
or at their covering wait, NaN shared memory and NaN rows past the visible length, the step's
new rows NaN until the block's PDL wait), plus stand-ins for this block's primitives:
``wgmma.m64n16k16`` with both operands K-major in shared memory under the 128-byte swizzle (the
16-byte chunk bits 4-6 of an address XORed with its bits 7-9; a descriptor start off a 1024-byte
atom aborts), computed at the ``wait_group`` that completes it (the latest moment the hardware
may read its operands), ``cvt.rn.f16x2.e4m3x2`` (exact: the e4m3 values), and the named
barriers: ``bar.sync`` a barrier of its thread count (checked against the barrier's role),
``bar.arrive`` an arrival that does not wait. The shipped block runs its 512 threads (two
producer warpgroups, two consumers), the lab's register-staged blocks 256. Every block of rows of
several lengths, split in ``pps`` pages, is checked against a float64 softmax over its keys:
part-filled last groups and pages, one-split rows, splits of up to 6 steps, V2-Lite's rows.
Controls: the swizzle left out of the key tile's stores, a warpgroup's partial scores dropped, a
step's rows loaded before the wait though a page of it is the step's new one, one key tile for
every step, the producer storing a tile before the consumers have freed it.
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
import mla_wgmma_rs as lab_rs  # noqa: E402
import mla_wgmma_variants as lab  # noqa: E402
from cuda_emulation import TYPES, compile_cpp  # noqa: E402
from test_mla_pipe_emulation import _PRIMS, _run, harness  # noqa: E402

from dsv2_mlc.schedules import mla_wgmma_cuda as shipped  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")

_WG = r"""
struct WgOp { float* d; unsigned a, b; };
thread_local std::vector<WgOp> t_wg_open;
thread_local std::vector<std::vector<WgOp>> t_wg_groups;
static inline double wg_elem(unsigned base, unsigned row, unsigned k) {
  unsigned addr = base + (row >> 3) * 1024u + (row & 7u) * 128u + 2u * k;
  addr ^= ((addr >> 7) & 7u) << 4;
  half h;
  memcpy(&h, t_b->smem + addr, 2);
  return (double)h;
}
static inline void mlaw_wgmma_$tag(float* d, unsigned a, unsigned b) {
  if (a % 16 || b % 16 || (a >> 7) & 7u || (b >> 7) & 7u) fail("wgmma descriptor start");
  t_wg_open.push_back({d, a, b});
}
static inline void mlaw_fence_$tag() {}
static inline void mlaw_commit_$tag() { t_wg_groups.push_back(t_wg_open); t_wg_open.clear(); }
static inline void mlaw_wait0_$tag() {
  const unsigned w = (t_tx >> 5) & 3u, l = t_tx & 31u, g = l >> 2, tq = l & 3u;
  for (auto& grp : t_wg_groups)
    for (auto& op : grp)
      for (unsigned j = 0; j < 2; ++j)
        for (unsigned v = 0; v < 4; ++v) {
          const unsigned m = 16 * w + g + 8 * (v >> 1), c = 8 * j + 2 * tq + (v & 1);
          double acc = op.d[4 * j + v];
          for (unsigned k = 0; k < 16; ++k) acc += wg_elem(op.a, m, k) * wg_elem(op.b, c, k);
          op.d[4 * j + v] = (float)acc;
        }
  t_wg_groups.clear();
}
static inline void mlaw_proxy_$tag() {}
// cvt.rn.f16x2.e4m3x2: byte i of w -> half i, the e4m3 value itself
static inline unsigned mlaw_cvt_$tag(unsigned w) {
  unsigned r = 0;
  for (int i = 0; i < 2; ++i) {
    const unsigned b = (w >> (8 * i)) & 0xffu;
    const unsigned short u = (unsigned short)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    half h;
    memcpy(&h, &u, 2);  // value / 256
    const half v = (half)((float)h * 256.f);
    unsigned short o;
    memcpy(&o, &v, 2);
    r |= (unsigned)o << (16 * i);
  }
  return r;
}
static inline void mlaw_bar0_$tag() {
  if (t_tx >= 128) fail("warpgroup 1 at warpgroup 0's barrier");
  t_b->pbar[0]->arrive_and_wait();
}
static inline void mlaw_barw_$tag(int id) {  // (the lab's) named barrier of warpgroup id - 1
  if (t_tx / 128 != id - 1) fail("a warpgroup at the other's barrier");
  t_b->pbar[id - 1]->arrive_and_wait();
}
"""


# the warp-specialized block's named barriers: 1 warpgroup 0's, 2-3 a key tile stored (the
# producer arrives, the consumers wait), 4-5 a key tile free (the consumers arrive, the producer
# waits), 6 the consumers'
_WS_BARS = [0, 128, 384, 384, 384, 384, 256]
_WS = r"""
static const int ws_count[] = {0, 128, 384, 384, 384, 384, 256};
static inline void ws_check(int id, int n) {
  if (id < 1 || id > 6 || ws_count[id] != n) fail("named barrier id or thread count");
  if (id == 1 && t_tx >= 128) fail("another warpgroup at warpgroup 0's barrier");
  if (id == 6 && t_tx >= 256) fail("the producer at the consumers' barrier");
}
static inline void mlaw_sync_$tag(int id, int n) {
  ws_check(id, n);
  t_b->pbar[id]->arrive_and_wait();
}
static inline void mlaw_arrive_$tag(int id, int n) {
  ws_check(id, n);
  if (id == 6) fail("bar.arrive at the consumers' barrier");
  auto token = t_b->pbar[id]->arrive();
  (void)token;
}
"""


def _build_ws(
    tmp: Path,
    d: int,
    dl: int,
    kv_scale: float,
    patch=lambda src: src,
    overlap: bool = False,
    producers: int = shipped.PRODUCERS,
) -> Path:
    """The emulated shipped block, or the lab's variants of it: the steps overlapped
    (``overlap``), one producer warpgroup (``producers``); its source through ``patch``."""
    tag = "emu"
    kscale = 256 * kv_scale
    smem = shipped.shared_halves(d, dl)
    threads = 256 + 128 * producers
    prelude, main = harness(d, dl, kscale, smem, "mla_split_wg", _WS_BARS, threads=threads)
    wg = (
        Template(_WG)
        .substitute(tag=tag)
        .replace("t_b->pbar[0]->arrive_and_wait();", "t_b->pbar[1]->arrive_and_wait();")
    )
    block = (
        lab_rs.ws_variant_source(tag, d, dl, kscale, prims=False, producers=producers)
        if overlap
        else shipped.wgmma_source(tag, d, dl, kscale, prims=False, producers=producers)
    )
    src = (
        TYPES
        + prelude
        + Template(_PRIMS).substitute(tag=tag, wait=0)
        + wg
        + Template(_WS).substitute(tag=tag)
        + patch(block)
        + main
    )
    return compile_cpp(src, tmp / "emu", sanitize=True)


def _build(
    tmp: Path,
    d: int,
    dl: int,
    stages: int,
    kv_scale: float | None = None,
    patch: Callable[[str], str] = lambda src: src,
    variant: dict | None = None,
) -> Path:
    """The emulated lab block of 256 threads: ``variant`` (:func:`lab.wgmma_source`'s ``ring`` /
    ``cvt`` ...; None: the register-staged block that was shipped, ``cvt``), its source through
    ``patch``."""
    tag = "emu"
    kscale = None if kv_scale is None else 256 * kv_scale
    variant = variant or {"ring": False, "cvt": True}
    smem = lab.wgmma_shared_halves(
        d, dl, stages, kscale is not None, variant["ring"], variant.get("dbuf", False)
    )
    prelude, main = harness(d, dl, kscale, smem, "mla_split_wg", (2, 128))
    src = (
        TYPES
        + prelude
        + Template(_PRIMS).substitute(tag=tag, wait=stages // 4 - 2)
        + Template(_WG).substitute(tag=tag)
        + patch(lab.wgmma_source(tag, d, dl, stages, kscale, prims=False, **variant))
        + main
    )
    return compile_cpp(src, tmp / "emu", sanitize=True)


ROWS = [0, 1, 16, 17, 63, 64, 65, 300, 130]
NEW = [0, 1, 1, 1, 1, 1, 1, 1, 40]
FP8 = 2.0**-7


@pytest.mark.parametrize("pps", [4, 5, 13, 24])
def test_wgmma_split_block(tmp_path: Path, pps: int) -> None:
    """The shipped block (rows of 192 = 128 latent + 64 rope): every block's state against the
    reference, splits of 1 to 6 steps (the producer two tiles ahead at most), a split's last
    group part-filled (pps 5, 13), the old rows loaded before the block's wait."""
    exe = _build_ws(tmp_path, 192, 128, FP8)
    _run(tmp_path, exe, 192, 128, ROWS + [390], pps, 0, new=NEW + [1], kv_scale=FP8)


def test_wgmma_split_block_v2_lite(tmp_path: Path) -> None:
    """V2-Lite rows (576 = 512 + 64): 36 k-steps, 18 a consumer warpgroup, the producer's 32
    latent pieces a step."""
    exe = _build_ws(tmp_path, 576, 512, FP8)
    _run(tmp_path, exe, 576, 512, [0, 33, 200, 75, 330], 8, 0, new=[0, 1, 1, 20, 1],
         kv_scale=FP8)  # fmt: skip


def _unswizzled(src: str) -> str:
    """The key tile's rows stored without the swizzle (the MMAs still read it swizzled)."""
    old = "(((c & 7) ^ (r & 7)) << 4)"
    assert old in src
    return src.replace(old, "((c & 7) << 4)")


def _wg1_dropped(src: str) -> str:
    """Warpgroup 0 ignores warpgroup 1's partial scores."""
    old = "+ xs[(w4 * 32 + lane) * 8 + e];"
    assert old in src
    return src.replace(old, "+ 0.f;")


def _one_tile(src: str) -> str:
    """The producer stores every step into tile 0 (the consumers read tile i % 2)."""
    old = "mlaw_store_emu(x, gbase + (i & 1) * "
    assert old in src
    return src.replace(old, "mlaw_store_emu(x, gbase + 0 * ")


def _store_before_wait(src: str) -> str:
    """The producer stores a step's rows before it waits for the consumers to free the tile."""
    wait = "if (i >= 2) mlaw_sync_emu(4 + (i & 1), 384);\n"
    store = "mlaw_store_emu(x, gbase + (i & 1) * 24576, p);\n"
    assert src.count(wait) == 1 and src.count(store) == 1
    return src.replace(wait, "").replace(store, store + "      " + wait)


@pytest.mark.parametrize(
    ("control", "extra"),
    [(_unswizzled, 0), (_wg1_dropped, 0), (None, 1), (_one_tile, 0), (_store_before_wait, 0)],
    ids=["unswizzled_tile", "warpgroup_1_dropped", "rows_loaded_before_wait", "one_tile",
         "store_before_wait"],
)  # fmt: skip
def test_wgmma_split_block_broken_variants_fail(tmp_path: Path, control, extra) -> None:
    """Controls: tiles stored without the swizzle, consumer 1's scores left out, a step's rows
    loaded before the wait though one of its pages holds the step's new token (NaN then), one
    key tile for every step, the producer overwriting a tile before the consumers are done
    with it."""
    exe = _build_ws(tmp_path, 192, 128, FP8, patch=control or (lambda src: src))
    with pytest.raises(AssertionError, match="rel L2"):
        _run(tmp_path, exe, 192, 128, [100, 300, 390], 24, 0, new=[1, 1, 1], extra_early=extra,
             kv_scale=FP8)  # fmt: skip


@pytest.mark.lab
@pytest.mark.parametrize("pps", [4, 13])
def test_lab_register_staged_block(tmp_path: Path, pps: int) -> None:
    """The register-staged block (256 threads; shipped before the producer warpgroup)."""
    exe = _build(tmp_path, 192, 128, 8, FP8)
    _run(tmp_path, exe, 192, 128, ROWS, pps, 0, new=NEW, kv_scale=FP8)


@pytest.mark.lab
def test_lab_one_producer(tmp_path: Path) -> None:
    """The shipped block with one producer warpgroup for every step (384 threads)."""
    exe = _build_ws(tmp_path, 192, 128, FP8, producers=1)
    for pps in (4, 13, 24):
        _run(tmp_path, exe, 192, 128, ROWS + [390], pps, 0, new=NEW + [1], kv_scale=FP8)


@pytest.mark.lab
def test_lab_overlapped_steps(tmp_path: Path) -> None:
    """The lab's variant of the shipped block: step i's P V overlapping step i + 1's scores."""
    exe = _build_ws(tmp_path, 192, 128, FP8, overlap=True)
    for pps in (4, 13, 24):
        _run(tmp_path, exe, 192, 128, ROWS + [390], pps, 0, new=NEW + [1], kv_scale=FP8)
    (tmp := tmp_path / "v2lite").mkdir()
    exe = _build_ws(tmp, 576, 512, FP8, overlap=True)
    _run(tmp, exe, 576, 512, [0, 33, 200, 75, 330], 8, 0, new=[0, 1, 1, 20, 1], kv_scale=FP8)


@pytest.mark.lab
@pytest.mark.parametrize(
    ("stages", "pps", "kv_scale", "variant"),
    [
        (8, 4, None, {"ring": True}),  # float16 pages through a ring of 2 slots
        (8, 5, None, {"ring": True}),
        (12, 9, None, {"ring": True}),  # 3 slots, splits of 3 groups
        (8, 8, FP8, {"ring": True}),  # FP8: raw slots, a decode pass
        (12, 13, 2.0**-6, {"ring": True}),
        (8, 5, FP8, {"ring": False, "cvt": False}),  # register-staged, shifts and masks
        (8, 13, FP8, {"ring": False, "cvt": True, "dbuf": True}),  # two key tiles
        (8, 5, FP8, {"ring": False, "cvt": True, "chains": 2}),  # two accumulator chains
        (8, 13, FP8, {"ring": False, "cvt": True, "hsplit": True}),  # softmax by head blocks
    ],
)
def test_lab_wgmma_variants(tmp_path: Path, stages: int, pps: int, kv_scale, variant) -> None:
    """The lab's variants of the block, the copies landing at issue and at the covering wait."""
    exe = _build(tmp_path, 192, 128, stages, kv_scale, variant=variant)
    for late in (0, 1) if variant["ring"] else (0,):
        _run(tmp_path, exe, 192, 128, ROWS, pps, late, new=NEW, kv_scale=kv_scale)


@pytest.mark.lab
@pytest.mark.parametrize("pps", [5, 13])
def test_lab_wgmma_wide_pieces(tmp_path: Path, pps: int) -> None:
    """16-byte latent pieces (rows of 320 = 256 latent + 64 rope, V2-Lite's)."""
    wide = {"ring": False, "cvt": True, "wide": True}
    for d, dl, rows, new in ((320, 256, ROWS, NEW), (576, 512, [0, 33, 200, 75], [0, 1, 1, 20])):
        (tmp := tmp_path / str(d)).mkdir()
        exe = _build(tmp, d, dl, 8, FP8, variant=wide)
        _run(tmp, exe, d, dl, rows, pps, 0, new=new, kv_scale=FP8)


@pytest.mark.lab
def test_lab_wgmma_ring_v2_lite(tmp_path: Path) -> None:
    exe = _build(tmp_path, 576, 512, 8, None, variant={"ring": True})
    _run(tmp_path, exe, 576, 512, [0, 33, 200, 75], 6, 1, new=[0, 1, 1, 20])

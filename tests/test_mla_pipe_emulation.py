"""The pipelined MLA split block (``mla_cuda_helpers.pipe_source``) run on the CPU, no GPU.

The device function is compiled as C++20 with g++ under AddressSanitizer (``half`` =
``_Float16``, the types of ``tests/cuda_emulation.py``; a read past the page pool or the page
ids aborts), one ``std::thread`` per CUDA thread, with CPU emulations of its seven PTX
primitives swapped in: ``mma.sync.m16n8k16`` (the PTX fragment layouts), ``ldmatrix`` (x4,
x4.trans, x2.trans), ``cp.async`` (16-byte copies, zero-fill) with commit/wait groups, plus
``__syncthreads`` and ``__shfl_xor_sync`` as barriers. ``cp.async`` copies land either at issue
("early") or only at the ``wait_group`` that must cover them ("late"), the two ends of what the
hardware may do, so a wrong ring-buffer index or wait count shows up as a wrong result. Every
block of a few rows (empty, one key, page edges, several splits) is run and its state (the final
out/lse of a one-split row, else its partial out/lse in the workspace) is checked against a
float64 softmax over the keys of its pages. Shared memory starts as NaN and the page rows past
the visible length are NaN, so reads of unwritten data show.

The device function alone: the blocks to run are a minimal job list (every row's pages cut into
splits of a fixed ``pps`` pages), not the shipped planning, and no merge runs here; the shipped
kernel around the block (its TIR page planning, the merge kernel) runs in
tests/test_mla_attention_emulation.py.

Every block waits itself (the PDL ``griddepcontrol.wait``, emulated as a block barrier, once per
block) after copying the pages older than the row's new tokens: those new rows stay NaN until
the wait, as if the step's KV append were still running, so an early copy of a page it writes
shows as a NaN result (a control case copies one page too many and must fail).

The block of ``pages_per_step`` 2 and 4 (``G`` pages a ring slot and step) runs on splits whose
last group is part-filled, float16 and FP8 pages (e4m3 latent bytes, the reference's keys their
``ml_dtypes`` values times ``kv_scale``), with controls: a split's tail group not masked, a step
reading the other ring slot, one page more copied before the wait.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from string import Template

import ml_dtypes
import numpy as np
import pytest

from dsv2_mlc.schedules.mla_cuda_helpers import P, pipe_shared_halves, pipe_source

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import TYPES, compile_cpp  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")
H = 16  # heads per block (the pipelined path's only shape)

_PRELUDE = r"""
struct Block {
  std::barrier<>* bar;
  std::barrier<>* wbar[8];
  char* smem;
  int late;  // cp.async copies land at the covering wait_group, else at issue
  int waits;  // PDL waits of the block (emulated)
  half* pages;  // the new rows [first_new, n_vis) of the row are NaN until the wait
  const half* clean;
  const int* ids;
  int first_new, n_vis;
  float fst[8][32][16];
  unsigned ust[8][32][8];
};
struct Copy { unsigned dst; const char* src; int bytes; };
thread_local int t_tx;
thread_local Block* t_b;
thread_local std::vector<Copy> t_open;
thread_local std::vector<std::vector<Copy>> t_groups;
static void fail(const char* what) { fprintf(stderr, "emulation: %s\n", what); std::abort(); }
static inline void __syncthreads() { t_b->bar->arrive_and_wait(); }
static inline void wsync() { t_b->wbar[t_tx >> 5]->arrive_and_wait(); }
static inline size_t __cvta_generic_to_shared(const void* p) {
  return (size_t)((const char*)p - t_b->smem);
}
static inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int w = t_tx >> 5, l = t_tx & 31;
  t_b->fst[w][l][0] = v;
  wsync();
  const float r = t_b->fst[w][l ^ o][0];
  wsync();
  return r;
}
static inline float lo_h(unsigned u) {
  half h; unsigned short s = u & 0xffff; memcpy(&h, &s, 2); return (float)h;
}
static inline float hi_h(unsigned u) { return lo_h(u >> 16); }
static inline unsigned short smem_u16(unsigned addr) {
  unsigned short s; memcpy(&s, t_b->smem + addr, 2); return s;
}
// The PDL wait: the step's append lands the row's new tokens (as the predecessor's writes
// become visible); its release is a no-op here.
static inline void dsv2_griddepcontrol_wait() {
  __syncthreads();
  if (t_tx == 0) {
    ++t_b->waits;
    for (int r = t_b->first_new; r < t_b->n_vis; ++r) {
      const size_t off = ((size_t)t_b->ids[r / 16] * 16 + r % 16) * $prow;
      memcpy(t_b->pages + off, t_b->clean + off, $prow * 2);
    }
  }
  __syncthreads();
}
static inline void dsv2_griddepcontrol_launch_dependents() {}
static void land(const Copy& c) {
  if (c.dst % 16 || (uintptr_t)c.src % 16) fail("cp.async address not 16-byte aligned");
  char* d = t_b->smem + c.dst;
  if (c.bytes == 16) memcpy(d, c.src, 16);
  else if (c.bytes == 0) memset(d, 0, 16);
  else fail("cp.async src-size");
}
"""

_PRIMS = r"""
static inline void mlap_mma_$tag(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  const int w = t_tx >> 5, l = t_tx & 31;
  for (int i = 0; i < 4; ++i) t_b->ust[w][l][i] = a[i];
  t_b->ust[w][l][4] = b0; t_b->ust[w][l][5] = b1;
  wsync();
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    const unsigned* u = t_b->ust[w][L];
    A[g][2 * t] = lo_h(u[0]); A[g][2 * t + 1] = hi_h(u[0]);
    A[g + 8][2 * t] = lo_h(u[1]); A[g + 8][2 * t + 1] = hi_h(u[1]);
    A[g][2 * t + 8] = lo_h(u[2]); A[g][2 * t + 9] = hi_h(u[2]);
    A[g + 8][2 * t + 8] = lo_h(u[3]); A[g + 8][2 * t + 9] = hi_h(u[3]);
    B[2 * t][g] = lo_h(u[4]); B[2 * t + 1][g] = hi_h(u[4]);
    B[2 * t + 8][g] = lo_h(u[5]); B[2 * t + 9][g] = hi_h(u[5]);
  }
  wsync();
  const int g = l >> 2, t = l & 3;
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][n];
    c[e] += s;
  }
}
static void ldsm(unsigned* r, unsigned addr, int nmat, bool trans) {
  const int w = t_tx >> 5, l = t_tx & 31;
  if (addr % 16) fail("ldmatrix row address not 16-byte aligned");
  t_b->ust[w][l][0] = addr;
  wsync();
  const int g = l >> 2, t = l & 3;
  for (int i = 0; i < nmat; ++i) {
    unsigned lo, hi;
    if (!trans) {
      const unsigned row = t_b->ust[w][i * 8 + g][0];
      lo = smem_u16(row + 4 * t); hi = smem_u16(row + 4 * t + 2);
    } else {
      lo = smem_u16(t_b->ust[w][i * 8 + 2 * t][0] + 2 * g);
      hi = smem_u16(t_b->ust[w][i * 8 + 2 * t + 1][0] + 2 * g);
    }
    r[i] = lo | (hi << 16);
  }
  wsync();
}
static inline void mlap_ldsm_$tag(unsigned* r, unsigned a) { ldsm(r, a, 4, false); }
static inline void mlap_ldsm_t_$tag(unsigned* r, unsigned a) { ldsm(r, a, 4, true); }
static inline void mlap_ldsm_t2_$tag(unsigned* r, unsigned a) { ldsm(r, a, 2, true); }
static inline void mlap_cp_$tag(unsigned dst, const void* src, int bytes) {
  const Copy c{dst, (const char*)src, bytes};
  if (t_b->late) t_open.push_back(c); else land(c);
}
static inline void mlap_commit_$tag() { t_groups.push_back(t_open); t_open.clear(); }
static inline void mlap_wait_$tag() {
  while (t_groups.size() > $wait) {
    for (const Copy& c : t_groups.front()) land(c);
    t_groups.erase(t_groups.begin());
  }
}
"""

_MAIN = r"""
template <class T> static std::vector<T> load(const char* path, size_t n) {
  std::vector<T> v(n);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(T), n, f) != n) fail(path);
  fclose(f);
  return v;
}
template <class T> static void save(const char* path, const std::vector<T>& v) {
  FILE* f = fopen(path, "wb");
  fwrite(v.data(), sizeof(T), v.size(), f);
  fclose(f);
}
// argv: dir late n_rows n_pages n_ids n_jobs n_ws; jobs: row ids_off npg tok0 n_vis final
// ws_row row_ids_off first_new n_early
int main(int argc, char** argv) {
  const std::string dir = argv[1];
  const int late = atoi(argv[2]), n_rows = atoi(argv[3]), n_pages = atoi(argv[4]);
  const int n_ids = atoi(argv[5]), n_jobs = atoi(argv[6]), n_ws = atoi(argv[7]);
  auto q = load<half>((dir + "/q").c_str(), (size_t)n_rows * $qrow);
  std::vector<half> pages_v = load<half>((dir + "/pages").c_str(), (size_t)n_pages * 16 * $prow);
  half* pages = (half*)aligned_alloc(64, pages_v.size() * 2);
  memcpy(pages, pages_v.data(), pages_v.size() * 2);
  auto ids = load<int>((dir + "/ids").c_str(), n_ids);
  auto jobs = load<int>((dir + "/jobs").c_str(), (size_t)n_jobs * 10);
  std::vector<half> out((size_t)n_rows * 16 * $dl, (half)7.f);
  std::vector<float> lse((size_t)n_rows * $nlse, 7.f);
  std::vector<float> ws_o((size_t)n_ws * $dl, NAN);
  std::vector<float> ws_lse(n_ws, NAN);
  const size_t smem_bytes = $smem_halves * 2;
  char* smem = (char*)aligned_alloc(64, (smem_bytes + 63) / 64 * 64);
  for (int j = 0; j < n_jobs; ++j) {
    const int* jb = &jobs[(size_t)j * 10];
    memset(smem, 0xff, smem_bytes);  // NaN halves / floats
    Block blk;
    blk.waits = 0; blk.pages = pages; blk.clean = pages_v.data(); blk.ids = ids.data() + jb[7];
    blk.first_new = jb[8]; blk.n_vis = jb[4];
    for (int r = blk.first_new; r < blk.n_vis; ++r)  // the append has not run yet
      for (int c = 0; c < $prow; ++c)
        pages[((size_t)blk.ids[r / 16] * 16 + r % 16) * $prow + c] = (half)NAN;
    std::barrier<> bar(256);
    std::vector<std::barrier<>*> wb;
    for (int w = 0; w < 8; ++w) blk.wbar[w] = new std::barrier<>(32);
    blk.bar = &bar; blk.smem = smem; blk.late = late;
    std::vector<std::thread> th;
    for (int tx = 0; tx < 256; ++tx) {
      th.emplace_back([&, tx] {
        t_tx = tx; t_b = &blk; t_open.clear(); t_groups.clear();
        mla_split_pipe_$tag(q.data() + (size_t)jb[0] * $qrow, pages, ids.data() + jb[1], jb[2],
                            jb[3], jb[4], $scale, jb[5], out.data() + (size_t)jb[0] * 16 * $dl,
                            lse.data() + (size_t)jb[0] * $nlse, ws_o.data(), ws_lse.data(), jb[6],
                            (half*)smem, (const half*)smem + $smem_halves - 1, tx, jb[9]);
        if (!t_open.empty()) fail("uncommitted cp.async copies");
        for (auto& g : t_groups) if (!g.empty()) fail("copies never waited for");
      });
    }
    for (auto& t : th) t.join();
    for (int w = 0; w < 8; ++w) delete blk.wbar[w];
    if (blk.waits != 1) fail("the block's PDL waits");
  }
  save((dir + "/out").c_str(), out);
  save((dir + "/lse").c_str(), lse);
  save((dir + "/ws_o").c_str(), ws_o);
  save((dir + "/ws_lse").c_str(), ws_lse);
  free(smem);
  free(pages);
  return 0;
}
"""

SCALE = 0.25  # sm_scale * log2(e) of the test (any value)


def _build(
    tmp: Path,
    d: int,
    dl: int,
    stages: int,
    g: int = 1,
    kv_scale: float | None = None,
    patch: Callable[[str], str] = lambda src: src,
) -> Path:
    """The emulated block of ``pages_per_step = g`` (an FP8 cache of that scale if given), its
    source through ``patch`` (a control)."""
    tag = "emu"
    kscale = None if kv_scale is None else 256 * kv_scale
    prow = dl // 2 + d - dl if kscale else d  # halves a page row (FP8: raw latent bytes)
    src = (
        TYPES
        + Template(_PRELUDE).substitute(prow=prow)
        + Template(_PRIMS).substitute(tag=tag, wait=stages // g - 2)
        + patch(pipe_source(tag, d, dl, stages, prims=False, kscale=kscale, pages_per_step=g))
        + Template(_MAIN).substitute(
            tag=tag,
            prow=prow,
            qrow=16 * (2 * prow if kscale else d),
            nlse=32 if kscale else 16,
            dl=dl,
            smem_halves=pipe_shared_halves(d, stages, dl if kscale else 0, g),
            scale=f"{SCALE}f",
        )
    )
    return compile_cpp(src, tmp / "emu", sanitize=True)


def harness(
    d: int,
    dl: int,
    kscale: float | None,
    smem_halves: int,
    block: str,
    named: tuple[int, int] | list[int],
    threads: int = 256,
) -> tuple[str, str]:
    """(prelude, main) of this harness for another split block of ``threads`` threads: the
    device function ``<block>_emu`` in place of the pipelined one, and named barriers for its
    stand-ins (``t_b->pbar[i]``): ``named = (count, n)``, ``count`` barriers of ``n`` threads
    each, or a list of each barrier's threads."""
    prow = dl // 2 + d - dl if kscale else d
    sizes = [named[1]] * named[0] if isinstance(named, tuple) else list(named)
    count = len(sizes)
    prelude = Template(_PRELUDE).substitute(prow=prow)
    old = "std::barrier<>* wbar[8];"
    assert old in prelude
    prelude = prelude.replace(old, old + f"\n  std::barrier<>* pbar[{count}];")
    if threads != 256:
        nw = threads // 32
        for a in ("wbar[8]", "fst[8]", "ust[8]"):
            b = a.replace("[8]", f"[{nw}]")
            assert a in prelude
            prelude = prelude.replace(a, b)
    main = Template(_MAIN).substitute(
        tag="emu",
        prow=prow,
        qrow=16 * (2 * prow if kscale else d),
        nlse=32 if kscale else 16,
        dl=dl,
        smem_halves=smem_halves,
        scale=f"{SCALE}f",
    )
    main = main.replace("mla_split_pipe_", f"{block}_")
    make = "for (int w = 0; w < 8; ++w) blk.wbar[w] = new std::barrier<>(32);"
    done = "for (int w = 0; w < 8; ++w) delete blk.wbar[w];"
    assert make in main and done in main
    sizes_c = "{" + ", ".join(map(str, sizes)) + "}"
    main = main.replace(
        make,
        make + f"\n    {{ const int n_[] = {sizes_c}; for (int p = 0; p < {count}; ++p) "
        "blk.pbar[p] = new std::barrier<>(n_[p]); }",
    )
    main = main.replace(done, done + f"\n    for (int p = 0; p < {count}; ++p) "
                        "delete blk.pbar[p];")  # fmt: skip
    if threads != 256:
        for a, b in (
            ("std::barrier<> bar(256);", f"std::barrier<> bar({threads});"),
            ("for (int tx = 0; tx < 256; ++tx)", f"for (int tx = 0; tx < {threads}; ++tx)"),
            ("for (int w = 0; w < 8; ++w)", f"for (int w = 0; w < {threads // 32}; ++w)"),
        ):
            assert a in main
            main = main.replace(a, b)
    return prelude, main


def _blocks(n_vis: list[int], pps: int, new: list[int], extra_early: int = 0) -> list[list[int]]:
    """The blocks to run, a minimal job list (not the shipped planning, which runs in
    tests/test_mla_attention_emulation.py): every row's visible pages in splits of ``pps`` (one
    empty split for a row that sees no key; a row of one split writes out/lse itself, the others
    write their partial state to workspace row ``job * 16``), each told how many of its leading
    pages are older than the row's ``new`` tokens (``extra_early``: that many more)."""
    jobs, begin = [], 0
    for r, (n, k) in enumerate(zip(n_vis, new, strict=True)):
        vis = -(-n // P)
        nsplit = max(-(-vis // pps), 1)
        for s in range(nsplit):
            lo, hi = min(s * pps, vis), min(s * pps + pps, vis)
            n_early = max(min((n - k) // P - lo + extra_early, hi - lo), 0)
            jobs.append(
                [r, begin + lo, hi - lo, lo * P, n, int(nsplit == 1), len(jobs) * H, begin,
                 n - k, n_early]
            )  # fmt: skip
        begin += max(vis, 1)
    return jobs


def _run(tmp: Path, exe: Path, d: int, dl: int, n_vis: list[int], pps: int, late: int,
         new: list[int], extra_early: int = 0, kv_scale: float | None = None) -> None:  # fmt: skip
    """Run the blocks of rows of ``n_vis`` keys, the last ``new`` of each appended this step,
    and check every block's state (the final out/lse of a one-split row, a split's partial
    out/lse in the workspace) against a float64 softmax over the keys of its pages.
    ``kv_scale``: an FP8 cache (pages of e4m3 latent bytes, then the rope halves; the keys'
    latent values are ``ml_dtypes``' e4m3 values times ``kv_scale``)."""
    rng = np.random.default_rng(7 + late)
    jobs = _blocks(n_vis, pps, new, extra_early)
    n_ids = sum(max(-(-n // P), 1) for n in n_vis)
    n_pages = n_ids + 3
    perm = rng.permutation(n_pages)[:n_ids].astype(np.int32)
    pages = rng.standard_normal((n_pages, P, d)).astype(np.float16)
    q = (rng.standard_normal((len(n_vis), H, d)) * 0.5).astype(np.float16)
    if kv_scale is not None:  # raw rows: dl e4m3 bytes (no NaN codes), then the rope halves
        codes = rng.integers(0, 0x7F, (n_pages, P, dl), dtype=np.uint8)
        codes |= rng.integers(0, 2, codes.shape, dtype=np.uint8) << 7  # (the sign)
        values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * kv_scale
        keys_all = np.concatenate([values, pages[:, :, dl:].astype(np.float64)], axis=2)
        raw = np.concatenate([codes.view(np.float16), pages[:, :, dl:]], axis=2)
        # q: head h at a stride of two pseudo-heads of the raw row (the tail unused)
        q_in = np.zeros((len(n_vis), H, 2 * raw.shape[2]), np.float16)
        q_in[:, :, :d] = q
    else:
        keys_all, raw, q_in = pages.astype(np.float64), pages, q
    kv, begin = [], 0
    for n in n_vis:
        vis = -(-n // P)
        ids = perm[begin : begin + vis]
        kv.append(keys_all[ids].reshape(-1, d)[:n])
        if vis:  # rows past the visible length: NaN (they must never be read)
            raw[ids[-1], n - (vis - 1) * P :] = np.nan
        begin += max(vis, 1)
    for name, arr in (("q", q_in), ("pages", raw), ("ids", perm), ("jobs", np.int32(jobs))):
        np.ascontiguousarray(arr).tofile(tmp / name)
    n_ws = len(jobs) * H
    args = [str(exe), str(tmp), str(late), str(len(n_vis)), str(n_pages), str(n_ids)]
    subprocess.run(args + [str(len(jobs)), str(n_ws)], check=True, timeout=600)
    out = np.fromfile(tmp / "out", np.float16).reshape(len(n_vis), H, dl).astype(np.float64)
    lse = np.fromfile(tmp / "lse", np.float32).reshape(len(n_vis), H, -1).astype(np.float64)
    assert (lse == lse[:, :, :1]).all() or np.isnan(lse).any(), "the pseudo-heads' lse differ"
    lse = lse[:, :, 0]
    ws_o = np.fromfile(tmp / "ws_o", np.float32).reshape(len(jobs), H, dl).astype(np.float64)
    ws_lse = np.fromfile(tmp / "ws_lse", np.float32).reshape(len(jobs), H).astype(np.float64)
    for j, (r, _, npg, tok0, n, final, *_) in enumerate(jobs):
        got_o, got_lse = (out[r], lse[r]) if final else (ws_o[j], ws_lse[j])
        keys = kv[r][tok0 : min(tok0 + npg * P, n)]
        if len(keys) == 0:
            assert (got_o == 0).all() and (got_lse == -math.inf).all(), f"block {j}: no key"
            continue
        s = q[r].astype(np.float64) @ keys.T * SCALE  # base-2 scores
        ref_lse = s.max(axis=1) + np.log2(np.exp2(s - s.max(axis=1, keepdims=True)).sum(axis=1))
        ref = np.exp2(s - ref_lse[:, None]) @ keys[:, :dl]
        rel = np.linalg.norm(got_o - ref) / np.linalg.norm(ref)
        assert rel < 2e-3, f"block {j} (row {r}, keys {tok0}+{len(keys)}): rel L2 {rel:.2e}"
        assert np.abs(got_lse - ref_lse).max() < 1e-3, f"block {j}: lse"


@pytest.mark.parametrize(
    ("d", "dl", "stages", "pps"),
    [
        (80, 64, 2, 1),  # one n-tile per warp: the ldmatrix.x2 tail
        (80, 64, 3, 2),
        (80, 64, 4, 5),  # long splits, 3 pages in flight
        (576, 512, 3, 2),  # V2-Lite rows
    ],
)
def test_pipelined_split_block(tmp_path: Path, d: int, dl: int, stages: int, pps: int) -> None:
    """Decode rows (one new token; none for an empty row) over rings of 2 to 4 page buffers,
    with the copies landing at issue and at the covering wait."""
    exe = _build(tmp_path, d, dl, stages)
    n_vis = [0, 1, 16, 17, 100, 300] if d < 200 else [0, 33, 200]
    new = [min(n, 1) for n in n_vis]
    for late in (0, 1):
        _run(tmp_path, exe, d, dl, n_vis, pps, late, new=new)


@pytest.mark.parametrize(
    ("d", "dl", "stages", "pps"),
    [
        (80, 64, 3, 2),
        (80, 64, 4, 3),  # 3 pages before the wait
    ],
)
def test_pipelined_split_block_copies_old_pages_before_its_wait(
    tmp_path: Path, d: int, dl: int, stages: int, pps: int
) -> None:
    """Decode rows (one new token, at a page's start, middle and end), a chunk of 40 new tokens
    and a first chunk (every token new): the pages older than the new tokens are copied before
    the block's own PDL wait, and the result is the reference's. (The model's shape, V2-Lite
    with 3 stages and the shipped splits, runs in tests/test_mla_attention_emulation.py.)"""
    exe = _build(tmp_path, d, dl, stages)
    n_vis, new = [1, 16, 17, 100, 300, 130], [1, 1, 1, 1, 1, 40]
    for late in (0, 1):
        _run(tmp_path, exe, d, dl, n_vis, pps, late, new=new)


def test_pipelined_split_block_reading_a_new_page_early_fails(tmp_path: Path) -> None:
    """The control: blocks told that one page more is old copy the page the append is still
    writing before the wait, and the check fails (NaN rows)."""
    exe = _build(tmp_path, 80, 64, 3)
    with pytest.raises(AssertionError, match="rel L2 nan"):
        _run(tmp_path, exe, 80, 64, [100, 300], 2, 0, new=[1, 1], extra_early=1)


# pages_per_step > 1: splits of pps pages (odd ones end in a part-filled group), rings of 2 to 4
# slots, rows with a part-filled last page, a chunk of 40 new tokens (causal rows: each its
# own n_vis); the FP8 cache (V2-like 128 + 16 rows with whole latent / rope k-steps).
ROWS = [0, 1, 16, 17, 33, 100, 300, 130]
NEW = [0, 1, 1, 1, 1, 1, 1, 40]


@pytest.mark.parametrize(
    ("d", "dl", "stages", "g", "pps", "kv_scale"),
    [
        (80, 64, 4, 2, 3, None),  # one n-tile per warp (ldmatrix.x2 tail), tail groups
        (80, 64, 6, 2, 5, None),  # 2 groups in flight
        (80, 64, 8, 4, 6, None),  # 4 pages a step, 2 of a split's 6 in the tail group
        (144, 128, 4, 2, 1, None),  # one page a split: every group half empty
        (144, 128, 4, 2, 3, 2.0**-7),  # FP8 cache
        (144, 128, 8, 4, 5, 2.0**-6),
    ],
)
def test_pipelined_split_block_pages_per_step(
    tmp_path: Path, d: int, dl: int, stages: int, g: int, pps: int, kv_scale: float | None
) -> None:
    """``g`` pages a step: every block's state against the reference, with the copies landing
    at issue and at the covering wait, the old pages copied before the block's wait."""
    exe = _build(tmp_path, d, dl, stages, g, kv_scale)
    for late in (0, 1):
        _run(tmp_path, exe, d, dl, ROWS, pps, late, new=NEW, kv_scale=kv_scale)


def test_pipelined_split_block_pages_per_step_v2_lite(tmp_path: Path) -> None:
    """V2-Lite rows (576 = 512 + 64), 2 pages a step over 4 page buffers, splits of 3 pages."""
    exe = _build(tmp_path, 576, 512, 4, 2)
    _run(tmp_path, exe, 576, 512, [0, 33, 200, 75], 3, 1, new=[0, 1, 1, 20])


def _unmasked_tail(src: str) -> str:
    """The split's visible rows taken as the row's from tok0 on: a tail group's pages past the
    split's end are read (page id 0) and counted."""
    old = "min(n_vis - tok0, npg * 16)"
    assert old in src
    return src.replace(old, "(n_vis - tok0)")


def _other_ring_slot(src: str) -> str:
    """A step reads the ring slot of the group after its own (2 slots)."""
    old = "(i % 2) *"
    assert old in src
    return src.replace(old, "((i + 1) % 2) *")


@pytest.mark.parametrize(
    ("control", "pps", "late", "extra"),
    [(_unmasked_tail, 3, 0, 0), (_other_ring_slot, 4, 1, 0), (None, 3, 0, 1)],
    ids=["unmasked_tail", "wrong_ring_slot", "page_copied_before_wait"],
)
def test_pipelined_split_block_pages_per_step_broken_variants_fail(
    tmp_path: Path, control, pps: int, late: int, extra: int
) -> None:
    """Controls of the 2-page step: the tail of a split not masked, the step reading the other
    ring slot, one page more copied before the wait (the new token's page: NaN)."""
    exe = _build(tmp_path, 80, 64, 4, 2, patch=control or (lambda src: src))
    with pytest.raises(AssertionError, match="rel L2"):
        _run(tmp_path, exe, 80, 64, [100, 300], pps, late, new=[1, 1], extra_early=extra)

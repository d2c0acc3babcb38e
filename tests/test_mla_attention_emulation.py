"""The split-KV MLA decode attention, the whole shipped path, run on the CPU (no GPU).

``mla_attention_cuda(16, 512, 64, "float16")`` is the PrimFunc the paged KV cache builds for
V2-Lite (``dsv2_mlc/model/kv_cache.py``, no ``split_kv_options``): a split kernel, whose TIR
preamble finds each query row's sequence, its visible pages and its split of them (the shipped
planning: ``split_pages``, ``nsplit``, the page range, the pages older than the row's new tokens)
and whose block is the pipelined tensor-core function of ``mla_cuda_helpers.pipe_source``; then
the merge kernel. TVM's CUDA of both runs under ``tests/cuda_emulation.py``, launched as the
host code launches them (grids and workspace sizes evaluated from the PrimFunc's own
expressions), on sequences of different lengths (shorter than a page, a chunk of several query
rows, many pages split over many blocks, past the long-context threshold) whose pages lie
shuffled in a pool with unused pages; out and lse are checked against a float64 NumPy softmax of
the absorbed MLA attention over the latent rows.

Stand-ins (the kernel's PTX): ``mma.sync.m16n8k16`` and ``ldmatrix`` (x4, x4.trans, x2.trans)
by their PTX fragment layouts over a warp's lanes; ``cp.async`` 16-byte copies (zero-fill)
landing at issue or only at the ``wait_group`` that must cover them (both ends of what the
hardware may do). The PDL wait (``griddepcontrol.wait``) is modelled as what it waits for: at the
start of every split block the query (the MLA prologue writes it) and the rows the step's KV
append writes (the last ``q_len`` tokens of each sequence) are NaN, and they land when the block
calls its wait (all its threads: a barrier), so a read of them before the wait shows as NaN; and
whatever the block may write (out, lse, the workspace) must be unchanged at its wait. Every split
block must wait once. Unused pages, page rows past a sequence's length and the shared memory
start as NaN too. Not modelled: the release of the dependents (it only lets the next kernel start
early; passes/grid_dependency_control.py and tests/test_kernel_lab_mla.py check the source for
it), and the merge kernel's wait, which that pass puts first in it.

Controls (each must fail): the planning drops a sequence's last partial page; the merge weighs
the splits in base e instead of 2; a split copies one page more than the old ones before its
wait; a split waits only after it has read Q.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dsv2_mlc.schedules.mla_attention_cuda import MLA_CUDA_PAGE_SIZE, mla_attention_cuda

sys.path.insert(0, str(Path(__file__).parent))
from cuda_emulation import emulate, needs_toolchain  # noqa: E402

pytestmark = needs_toolchain
H, L, R = 16, 512, 64  # V2-Lite: heads, kv_lora_rank, rope width
D = L + R
P = MLA_CUDA_PAGE_SIZE
U16 = 2.0**-11  # fp16 unit roundoff
SM_SCALE = 1 / math.sqrt(192)  # (qk_nope + qk_rope) ** -0.5, as the model calls it

# The kernel's PTX, for the CPU (a warp's lanes exchange their operands through per-warp slots
# between two __syncwarp()s). Shared addresses are offsets into the block's shared array.
_MATH = "#define CUDART_INF_F INFINITY  // (math_constants.h, in TVM's header)\n"
_STANDINS = r"""
static char* g_emu_sbase;  // the block's shared memory
static int g_emu_late = $late;  // cp.async copies land at the covering wait_group (else at issue)
static unsigned g_emu_slot[32][32][8];
struct EmuCopy { unsigned dst; const char* src; int bytes; };
thread_local std::vector<EmuCopy> t_open;
thread_local std::vector<std::vector<EmuCopy>> t_groups;
// (shared addresses as offsets into this block's array: the emulator's own mapping is replaced)
static inline size_t emu_mla_cvta(const void* p) {
  return (size_t)((const char*)p - g_emu_sbase);
}
#define __cvta_generic_to_shared emu_mla_cvta
static inline float emu_lo(unsigned u) {
  unsigned short s = u & 0xffff; half h; memcpy(&h, &s, 2); return (float)h;
}
static inline unsigned short emu_smem16(unsigned addr) {
  unsigned short s; memcpy(&s, g_emu_sbase + addr, 2); return s;
}
static void emu_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  const int w = t_lin >> 5, l = t_lin & 31;
  for (int i = 0; i < 4; ++i) g_emu_slot[w][l][i] = a[i];
  g_emu_slot[w][l][4] = b0; g_emu_slot[w][l][5] = b1;
  __syncwarp();
  float A[16][16], B[16][8];
  for (int ln = 0; ln < 32; ++ln) {
    const int g = ln >> 2, t = ln & 3;
    const unsigned* u = g_emu_slot[w][ln];
    A[g][2 * t] = emu_lo(u[0]); A[g][2 * t + 1] = emu_lo(u[0] >> 16);
    A[g + 8][2 * t] = emu_lo(u[1]); A[g + 8][2 * t + 1] = emu_lo(u[1] >> 16);
    A[g][2 * t + 8] = emu_lo(u[2]); A[g][2 * t + 9] = emu_lo(u[2] >> 16);
    A[g + 8][2 * t + 8] = emu_lo(u[3]); A[g + 8][2 * t + 9] = emu_lo(u[3] >> 16);
    B[2 * t][g] = emu_lo(u[4]); B[2 * t + 1][g] = emu_lo(u[4] >> 16);
    B[2 * t + 8][g] = emu_lo(u[5]); B[2 * t + 9][g] = emu_lo(u[5] >> 16);
  }
  __syncwarp();
  const int g = l >> 2, t = l & 3;
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e >> 1), n = 2 * t + (e & 1);
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][n];
    c[e] += s;
  }
}
static void emu_ldsm(unsigned* r, unsigned addr, int nmat, bool trans) {
  const int w = t_lin >> 5, l = t_lin & 31;
  if (addr % 16) emu_fail("ldmatrix row address not 16-byte aligned");
  g_emu_slot[w][l][0] = addr;
  __syncwarp();
  const int g = l >> 2, t = l & 3;
  for (int i = 0; i < nmat; ++i) {
    unsigned lo, hi;
    if (!trans) {
      const unsigned row = g_emu_slot[w][i * 8 + g][0];
      lo = emu_smem16(row + 4 * t); hi = emu_smem16(row + 4 * t + 2);
    } else {
      lo = emu_smem16(g_emu_slot[w][i * 8 + 2 * t][0] + 2 * g);
      hi = emu_smem16(g_emu_slot[w][i * 8 + 2 * t + 1][0] + 2 * g);
    }
    r[i] = lo | (hi << 16);
  }
  __syncwarp();
}
static void emu_cp_land(const EmuCopy& c) {
  if (c.dst % 16 || (uintptr_t)c.src % 16) emu_fail("cp.async address not 16-byte aligned");
  if (c.bytes == 16) memcpy(g_emu_sbase + c.dst, c.src, 16);
  else if (c.bytes == 0) memset(g_emu_sbase + c.dst, 0, 16);
  else emu_fail("cp.async src-size");
}
static void emu_cp(unsigned dst, const void* src, int bytes) {
  const EmuCopy c{dst, (const char*)src, bytes};
  if (g_emu_late) t_open.push_back(c); else emu_cp_land(c);
}
static void emu_commit() { t_groups.push_back(t_open); t_open.clear(); }
static void emu_wait_group(size_t pending) {
  while (t_groups.size() > pending) {
    for (const EmuCopy& c : t_groups.front()) emu_cp_land(c);
    t_groups.erase(t_groups.begin());
  }
}
// PDL, modelled as what the split kernel's wait waits for: its predecessors write the query
// (q, the MLA prologue) and the step's new latent rows (the KV append), so from the start of
// every split block until its wait (all its threads call it: a barrier whose completion lands
// them) those are NaN; and a block must write nothing before its wait (what it may write
// - out, lse, ws_lse, ws_n, its ws_o slot - is compared with a copy taken at its start).
typedef std::vector<half> EmuRow;
static std::vector<std::pair<half*, EmuRow>> g_emu_new;
static std::atomic<long long> g_emu_blocks{0}, g_emu_waits{0};
static struct {
  half *pages, *q, *out;
  float *lse, *ws_lse, *ws_o;
  int* ws_n;
  const int *page_indptr, *ids, *last_len, *q_indptr;
  int batch, smax;
  long long bx, by;
} g_emu_k;
static std::vector<char> g_emu_snap;
template <class F> static void emu_outputs(F f) {
  const size_t total = g_emu_k.q_indptr[g_emu_k.batch];
  f(g_emu_k.out, total * $heads * $dl);
  f(g_emu_k.lse, total * $heads);
  f(g_emu_k.ws_lse, total * g_emu_k.smax * $heads);
  f(g_emu_k.ws_n, total);
  // (ws_o: the block's 16 heads of its row and split; of size 1 without splits)
  const long long ws_row = g_emu_k.bx * $heads + g_emu_k.by * 16;
  if (g_emu_k.smax > 1) f(g_emu_k.ws_o + ws_row * $dl, 16 * $dl);
}
static void emu_block_start() noexcept {
  if (g_emu_new.empty()) {  // (the first block: the query, the new rows by the page tables)
    const size_t total = g_emu_k.q_indptr[g_emu_k.batch];
    for (size_t r = 0; r < total * $heads; ++r) {
      half* row = g_emu_k.q + r * $d;
      g_emu_new.push_back({row, EmuRow(row, row + $d)});
    }
    for (int b = 0; b < g_emu_k.batch; ++b) {
      const int np = g_emu_k.page_indptr[b + 1] - g_emu_k.page_indptr[b];
      const int kv = np > 0 ? (np - 1) * $page + g_emu_k.last_len[b] : 0;
      const int q_len = g_emu_k.q_indptr[b + 1] - g_emu_k.q_indptr[b];
      for (int pos = kv - q_len; pos < kv; ++pos) {
        const int id = g_emu_k.ids[g_emu_k.page_indptr[b] + pos / $page];
        half* row = g_emu_k.pages + ((size_t)id * $page + pos % $page) * $d;
        g_emu_new.push_back({row, EmuRow(row, row + $d)});
      }
    }
  }
  for (auto& [row, clean] : g_emu_new) std::fill(row, row + $d, (half)NAN);
  g_emu_snap.clear();
  emu_outputs([](auto* p, size_t n) {
    const char* c = (const char*)p;
    g_emu_snap.insert(g_emu_snap.end(), c, c + n * sizeof(*p));
  });
  ++g_emu_blocks;
}
static void emu_wait_done() noexcept {
  size_t at = 0;
  emu_outputs([&](auto* p, size_t n) {
    if (memcmp(g_emu_snap.data() + at, p, n * sizeof(*p))) emu_fail("a write before the wait");
    at += n * sizeof(*p);
  });
  for (auto& [row, clean] : g_emu_new) std::copy(clean.begin(), clean.end(), row);
  ++g_emu_waits;
}
static std::barrier<decltype(&emu_block_start)> g_emu_begin_bar(256, &emu_block_start);
static std::barrier<decltype(&emu_wait_done)> g_emu_wait_bar(256, &emu_wait_done);
static void emu_block_begin(half* smem, half* pages, const int* page_indptr, const int* ids,
                            const int* last_len, const int* q_indptr, int batch, half* q,
                            half* out, float* lse, float* ws_o, float* ws_lse, int* ws_n,
                            int smax) {
  // (a block may leave empty commit groups behind, not copies it never waited for)
  if (!t_open.empty()) emu_fail("cp.async copies never committed");
  for (auto& g : t_groups) if (!g.empty()) emu_fail("cp.async copies never waited for");
  t_groups.clear();
  if (t_lin == 0) {
    g_emu_sbase = (char*)smem;
    g_emu_k = {pages, q, out, lse, ws_lse, ws_o, ws_n, page_indptr, ids, last_len, q_indptr,
               batch, smax, (long long)blockIdx.x, (long long)blockIdx.y};
  }
  g_emu_begin_bar.arrive_and_wait();
}
static void emu_pdl_wait() { g_emu_wait_bar.arrive_and_wait(); }
static struct EmuReport {
  ~EmuReport() {
    printf("emu: blocks %lld\nemu: pdl_waits %lld\n", g_emu_blocks.load(), g_emu_waits.load());
  }
} g_emu_report;
"""
_PRIM = re.compile(
    r"__device__ __forceinline__ void mlap_(mma|ldsm_t2|ldsm_t|ldsm|cp|commit|wait)_(\w+)"
    r"\(([^)]*)\) \{\n\s*asm volatile\((.*?)\);\n\}\n",
    re.S,
)
_CALLS = {
    "mma": "emu_mma(c, a, b0, b1);",
    "ldsm": "emu_ldsm(r, addr, 4, false);",
    "ldsm_t": "emu_ldsm(r, addr, 4, true);",
    "ldsm_t2": "emu_ldsm(r, addr, 2, true);",
    "cp": "emu_cp(dst, src, bytes);",
    "commit": "emu_commit();",
}


def _smax_param(src: str) -> str:
    """The split kernel's parameter for the splits per row: its first TVM-named scalar
    (``cse_vN``; the number depends on the shapes), the grid size its second."""
    sig = re.search(r"void __launch_bounds__\(\d+\) p_kernel\(([^)]*)\)", src)
    assert sig, "no split kernel"
    return re.findall(r"int (cse_v\d+)", sig.group(1))[0]


def _split_patch(
    late: bool, *controls: Callable[[str], str], heads: int = H
) -> Callable[[str], str]:
    """The kernels' source (of ``heads`` query heads) with the stand-ins (module docstring) and
    ``controls``."""

    def patch(src: str) -> str:
        def prim(m: re.Match) -> str:
            kind, tag, params, asm = m.groups()
            if kind == "wait":
                (pending,) = re.findall(r"wait_group (\d+)", asm)
                call = f"emu_wait_group({pending});"
            else:
                call = _CALLS[kind]
            return f"static inline void mlap_{kind}_{tag}({params}) {{ {call} }}\n"

        src, n = _PRIM.subn(prim, src)
        assert n == 7, f"{n} PTX primitives replaced"
        wait = '  asm volatile("griddepcontrol.wait;" ::: "memory");\n#endif'
        assert wait in src
        src = src.replace(wait, wait.replace("#endif", "#else\n  emu_pdl_wait();\n#endif"))
        entry = "extern __shared__ __align__(64) half smem_ptr[];\n"
        assert src.count(entry) == 1
        smax = _smax_param(src)
        src = src.replace(
            entry,
            entry + "  emu_block_begin(smem_ptr, pages_ptr, page_indptr_ptr, page_values_ptr, "
            "length_info_ptr, q_indptr_ptr, batch_size, q_ptr, output_ptr, lse_ptr, ws_o_ptr, "
            f"ws_lse_ptr, ws_n_ptr, {smax});\n",
        )
        for control in controls:
            src = control(src)
        stand = _STANDINS.replace("$late", str(int(late))).replace("$page", str(P))
        stand = stand.replace("$heads", str(heads))
        return _MATH + stand.replace("$dl", str(L)).replace("$d", str(D)) + src

    return patch


def _evaluate(expr: str, total_len: int) -> int:
    """A launch or workspace extent of the PrimFunc's script, for ``total_len`` query rows."""

    class TShim:
        max, min = max, min

        @staticmethod
        def if_then_else(c, a, b):
            return a if c else b

    return int(eval(expr, {"T": TShim, "total_len": total_len}))  # noqa: S307 (its own script)


def _launch(func, total_len: int) -> dict[str, int]:
    """The host code's numbers for ``total_len`` rows: the split grid (``split``), the merge
    grid (``merge``), the splits per row (``smax``) and the workspace sizes."""
    script = func.script()
    grids = re.findall(r'T\.thread_binding\((.+?), thread="blockIdx\.x"\)', script)
    assert len(grids) == 2, grids
    ws = dict(re.findall(r"(ws_\w+) = T\.alloc_buffer\(\((.+?),\)", script))
    out = {"split": _evaluate(grids[0], total_len), "merge": _evaluate(grids[1], total_len)}
    out.update({name: _evaluate(expr, total_len) for name, expr in ws.items()})
    out["smax"] = out["split"] // total_len
    assert out["smax"] * total_len == out["split"]
    return out


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> Callable:
    """``build(late, split_controls, merge_controls)`` -> (func, split, merge) launchers, each
    kernel compiled once per variant."""
    func = mla_attention_cuda(H, L, R, "float16")  # what the KV cache builds for V2-Lite
    return _builder(func, tmp_path_factory.mktemp("mla"))


def _builder(func, tmp: Path, heads: int = H) -> Callable:
    """The ``build`` of :func:`kernels` for ``func`` (of ``heads`` query heads)."""
    cache: dict = {}

    def one(kernel: int, late: bool, controls: tuple):
        key = (kernel, late, controls)
        if key not in cache:
            patch = _split_patch(late, *controls, heads=heads)
            cache[key] = emulate(func, tmp, f"k{len(cache)}", kernel=kernel, patch=patch)
        return cache[key]

    def build(late: bool, split_controls: tuple = (), merge_controls: tuple = ()):
        return func, one(0, late, split_controls), one(1, False, merge_controls)

    return build


# (cached tokens after the step, new tokens of the step = query rows)
SEQS = [
    (5, 1),  # shorter than a page: one split, written by the split kernel itself
    (40, 3),  # a chunk of 3 query rows (causal), 3 pages
    (700, 1),  # 44 pages: 22 splits of 2 pages
    (2100, 1),  # 132 pages: past the long threshold (128), splits of 4 pages
]


def _attend(
    kernels_, seqs, late: bool, split_controls=(), merge_controls=(), seed: int = 0, heads: int = H
):
    """Run the split and merge kernels (of ``heads`` query heads) on ``seqs``; (out, lse,
    reference out, reference lse, counters of the split kernel)."""
    func, split, merge = kernels_(late, split_controls, merge_controls)
    rng = np.random.default_rng(seed)
    n_pages = [-(-kv // P) for kv, _ in seqs]
    pool = sum(n_pages) + 5  # (unused pages: NaN)
    perm = rng.permutation(pool).astype(np.int32)
    page_indptr = np.int32([0, *np.cumsum(n_pages)])
    page_values = np.ascontiguousarray(perm[: page_indptr[-1]])
    last_len = np.int32([kv - (n - 1) * P for (kv, _), n in zip(seqs, n_pages, strict=True)])
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
    q = (rng.standard_normal((total, heads, D)) * 0.5).astype(np.float16)
    out = np.full((total, heads, L), np.nan, np.float16)
    lse = np.full((total, heads), np.nan, np.float32)
    n = _launch(func, total)
    ws_o = np.full(n["ws_o"], np.nan, np.float32)
    ws_lse = np.full(n["ws_lse"], np.nan, np.float32)
    ws_n = np.full(n["ws_n"], -1, np.int32)
    arrays = {"q": q, "q_indptr": q_indptr, "pages": pages, "page_indptr": page_indptr,
              "page_values": page_values, "length_info": last_len, "output": out, "lse": lse,
              "ws_o": ws_o, "ws_lse": ws_lse, "ws_n": ws_n}  # fmt: skip
    smax, blocks = (name for name in split.scalars if name.startswith("cse_v"))
    scalars = {"batch_size": len(seqs), "causal": 1, smax: n["smax"], blocks: n["split"],
               "total_len": total, "sm_scale": float(np.float32(SM_SCALE))}  # fmt: skip
    # (the merge also gets the host's subexpression of its grid, which its body does not read)
    assert smax in merge.scalars
    grid = (n["split"], heads // 16)  # (row and split, head group of 16)
    stats = split(grid, arrays, *(scalars.get(s, 0) for s in split.scalars))
    merge(n["merge"], arrays, *(scalars.get(s, 0) for s in merge.scalars))
    assert set(split.scalars) - set(scalars) <= {
        "length_info_elem_offset", "page_indptr_elem_offset", "page_values_elem_offset",
        "q_indptr_elem_offset",
    }, split.scalars  # fmt: skip
    # float64 reference: row r of a chunk of q_len sees kv - q_len + r + 1 latent rows
    ref_out = np.zeros((total, heads, L))
    ref_lse = np.zeros((total, heads))
    for b, (kv, q_len) in enumerate(seqs):
        for r in range(q_len):
            row = q_indptr[b] + r
            keys = latent[b][: kv - q_len + r + 1]
            s = q[row].astype(np.float64) @ keys.T * SM_SCALE * math.log2(math.e)  # base 2
            m = s.max(axis=1, keepdims=True)
            w = np.exp2(s - m)
            ref_lse[row] = m[:, 0] + np.log2(w.sum(axis=1))
            ref_out[row] = (w / w.sum(axis=1, keepdims=True)) @ keys[:, :L]
    return out, lse, ref_out, ref_lse, stats


def _errors(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    """(max over query rows of the relative L2 error of out, max |lse - reference|)."""
    o = out.astype(np.float64)
    if np.isnan(o).any() or np.isnan(lse).any():
        return math.inf, math.inf
    rel = np.linalg.norm(o - ref_out, axis=(1, 2)) / np.linalg.norm(ref_out, axis=(1, 2))
    return float(rel.max()), float(np.abs(lse - ref_lse).max())


# P goes to the tensor cores as fp16 (one rounding per weight) and out is stored as fp16: a few
# fp16 roundoffs; the scores, sums and lse (of order 1) are float32 throughout.
OUT_TOL, LSE_TOL = 4 * U16, 1e-5


@pytest.mark.parametrize("late", [False, True], ids=["copies_at_issue", "copies_at_wait"])
def test_split_kv_attention_matches_numpy(kernels, late: bool):
    out, lse, ref_out, ref_lse, stats = _attend(kernels, SEQS, late)
    err_out, err_lse = _errors(out, lse, ref_out, ref_lse)
    assert err_out < OUT_TOL and err_lse < LSE_TOL, (err_out, err_lse)
    assert stats["pdl_waits"] == stats["blocks"] > 0  # every split block waits, once
    assert stats["prefetches"] > 0  # (the split's later pages asked for in L2)


@pytest.mark.parametrize(("g", "stages"), [(2, 4)])
def test_split_kv_attention_pages_per_step(tmp_path_factory, g: int, stages: int):
    """The table's planning with ``pages_per_step = g``: splits rounded up to whole groups (a
    row's last split ends in a part-filled one), the old pages among the first ``stages - g``
    copied before the wait; copies landing at their wait."""
    from dataclasses import replace

    from dsv2_mlc.schedules.mla_attention_cuda import build_mla_attention
    from dsv2_mlc.schedules.tiles import tuned

    tiles = replace(tuned("mla_attention"), stages=stages, pages_per_step=g)
    build = _builder(build_mla_attention(H, L, R, "float16", tiles), tmp_path_factory.mktemp("g"))
    # (100: 7 pages, splits of 2; 6000: 375 pages, splits of 5 -> 6, the last of 3)
    seqs = [(5, 1), (40, 3), (700, 1), (100, 1), (6000, 1)]
    out, lse, ref_out, ref_lse, stats = _attend(build, seqs, True)
    err_out, err_lse = _errors(out, lse, ref_out, ref_lse)
    assert err_out < OUT_TOL and err_lse < LSE_TOL, (err_out, err_lse)
    assert stats["pdl_waits"] == stats["blocks"] > 0


def test_split_kv_attention_one_split_a_row(tmp_path_factory):
    """A grid of one split a row (``target_blocks`` <= the rows, as at large decode batches):
    every row's split block writes ``out`` and ``lse`` itself and the merge grid is one idle
    block."""
    from dataclasses import replace

    from dsv2_mlc.schedules.mla_attention_cuda import build_mla_attention
    from dsv2_mlc.schedules.tiles import tuned

    tiles = replace(tuned("mla_attention"), target_blocks=4)
    func = build_mla_attention(H, L, R, "float16", tiles)
    build = _builder(func, tmp_path_factory.mktemp("one"))
    total = sum(q for _, q in SEQS)
    assert _launch(func, total)["smax"] == 1 and _launch(func, total)["merge"] == 1
    assert _launch(func, 1)["smax"] == 4 and _launch(func, 1)["merge"] > 1
    out, lse, ref_out, ref_lse, stats = _attend(build, SEQS, True)
    err_out, err_lse = _errors(out, lse, ref_out, ref_lse)
    assert err_out < OUT_TOL and err_lse < LSE_TOL, (err_out, err_lse)


def _one_head_group(src: str) -> str:
    """Every split block takes the first 16 heads, whatever its ``blockIdx.y``."""
    first = "(((int)blockIdx.y) * 16)"  # (h0, and TVM's common subexpression of it)
    assert src.count(first) >= 1
    return src.replace(first, "0")


@pytest.mark.parametrize("controls", [(), (_one_head_group,)], ids=["kernel", "one_head_group"])
@pytest.mark.wide
def test_split_kv_attention_at_v2_heads(tmp_path_factory, controls):
    """DeepSeek-V2 (236B): 128 heads, 8 split blocks of 16 heads for each (row, split), where
    V2-Lite has one (``blockIdx.y``), with the tiles of its shape: every head group of every row
    against the reference; the control, blocks that ignore their head group, fails."""
    func = mla_attention_cuda(128, L, R, "float16")
    build = _builder(func, tmp_path_factory.mktemp("v2"), heads=128)
    # 3 rows of one split, one of 10 splits (the control: the first 3 alone)
    seqs = [(40, 3)] if controls else [(40, 3), (300, 1)]
    out, lse, ref_out, ref_lse, stats = _attend(build, seqs, False, controls, heads=128)
    err_out, err_lse = _errors(out, lse, ref_out, ref_lse)
    if controls:
        assert err_out > 20 * OUT_TOL or err_lse > 20 * LSE_TOL, (err_out, err_lse)
        return
    assert err_out < OUT_TOL and err_lse < LSE_TOL, (err_out, err_lse)
    assert stats["pdl_waits"] == stats["blocks"] == 8 * 4 * _launch(func, 4)["smax"]


def _drop_partial_page(src: str) -> str:
    """The planning sees ``floor(n_vis / 16)`` pages: a sequence's last partial page is lost."""
    out, n = re.subn(r"\(\(n_vis \+ 15\) >> 4\)", "(n_vis >> 4)", src)
    assert n
    return out


def _merge_base_e(src: str) -> str:
    """The merge weighs the splits by ``e^(lse_s - max)`` (the lse are base 2)."""
    head = re.search(r"p_kernel_1\([^)]*\) \{", src).start()  # the merge kernel's definition
    out, n = re.subn(r"\bexp2f\(", "expf(", src[head:])
    assert n
    return src[:head] + out


def _one_page_early(src: str) -> str:
    """A split copies one page past the old ones before its wait."""
    old = "s0 < n_early && s0 < npg"
    assert old in src
    return src.replace(old, "s0 <= n_early && s0 < npg")


def _wait_after_q(src: str) -> str:
    """A split block waits only after it has issued its first pages and read Q."""
    wait = "  dsv2_griddepcontrol_wait();\n  dsv2_griddepcontrol_launch_dependents();"
    pipe = src.index("void mla_split_pipe_")
    at = src.index(wait, pipe)
    src = src[:at] + src[at + len(wait) :]
    acc = src.index("  float acc[", pipe)
    return src[:acc] + wait + "\n" + src[acc:]


@pytest.mark.parametrize(
    ("seqs", "split_controls", "merge_controls"),
    [
        ([(5, 1), (40, 3)], (_drop_partial_page,), ()),
        ([(700, 1)], (), (_merge_base_e,)),
        ([(700, 1)], (_one_page_early,), ()),  # (the new token's page is its split's second)
        ([(40, 3)], (_wait_after_q,), ()),
    ],
    ids=["planning_drops_partial_page", "merge_base_e", "page_copied_before_wait", "late_wait"],
)
def test_split_kv_attention_broken_variants_fail(kernels, seqs, split_controls, merge_controls):
    """The controls (module docstring), on the sequences that show them: each misses the
    tolerance by far."""
    out, lse, ref_out, ref_lse, _ = _attend(kernels, seqs, False, split_controls, merge_controls)
    err_out, err_lse = _errors(out, lse, ref_out, ref_lse)
    assert err_out > 20 * OUT_TOL or err_lse > 20 * LSE_TOL, (err_out, err_lse)

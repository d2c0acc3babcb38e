"""The split-KV CUDA MLA attention kernel (``dsv2_mlc.schedules.mla_attention_cuda``), no GPU.

Checks that the kernel compiles to sm_90 machine code alone (V2-Lite and tiny shapes), the order
of its PDL wait in a ``--pdl`` build, that its launch configuration reads the row count only,
that ``MLAPagedKVCache`` puts it into the MLA attention slot of TVM's ``TIRPagedKVCache`` for
CUDA where it supports the shapes (TVM's kernel stays where not), and that a compiled tiny CUDA
model carries it. The pipelined block's numerics: test_mla_pipe_emulation.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import tvm
from cuda_builds import needs_nvcc  # noqa: E402
from cuda_source import function_body, statements
from mla_cache_module import create_script

from dsv2_mlc.errors import UsageError
from dsv2_mlc.schedules.mla_attention_cuda import (
    build_mla_attention,
    mla_attention_cuda,
    mla_attention_cuda_supports,
    split_pages,
)
from dsv2_mlc.schedules.tiles import TABLE, tuned

SPLIT_KV = "batch_mla_paged_attention_split_kv"  # its global symbol
TVM_MLA = "batch_prefill_paged_kv_mla"


@needs_nvcc
@pytest.mark.parametrize(
    ("heads", "latent", "rope", "dtype"),
    [
        (16, 512, 64, "float16"),
        (4, 32, 8, "float16"),
        (32, 512, 64, "float16"),
        (4, 32, 8, "float32"),
    ],
)
def test_kernel_compiles_to_sm90(tmp_path: Path, heads, latent, rope, dtype) -> None:
    from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    func = mla_attention_cuda(heads, latent, rope, dtype).with_attr("global_symbol", "mla")
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"mla": func}), target=target)
    lib = tmp_path / "mla.so"
    exe.export_library(str(lib))
    check_fatbin(lib, "sm_90")


def _pdl_source() -> str:
    """The CUDA source of the V2-Lite kernel, compiled as a ``--pdl`` build."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, cuda_sources, make_cuda_target
    from dsv2_mlc.passes.pipeline import tir_pipeline

    target = make_cuda_target("sm_90")
    func = mla_attention_cuda(16, 512, 64).with_attr("global_symbol", "m")
    with cuda_codegen(), target:
        lib = tvm.compile(tvm.IRModule({"m": func}), target=target, tir_pipeline=tir_pipeline(True))
    (src,) = cuda_sources(lib.mod)
    return src


_PIPE = "mla_split_pipe_16_512_576_s3_e"  # the V2-Lite block (3 stages, early copies)
_PREFETCH = "mla_prefetch_16_512_576"


@pytest.fixture(scope="module")
def pdl_source() -> str:
    return _pdl_source()


def _pdl_problems(src: str) -> list[str]:
    """What the CPU emulation cannot see of the PDL wait (it does not time copies or L2
    prefetches, nor model the merge kernel's wait), read from the statements of a ``--pdl``
    build: the names of the properties ``src`` breaks."""
    from dsv2_mlc.passes.grid_dependency_control import (
        WAIT,
        _waiting_device_functions,
        kernels_without_wait,
    )

    kernels, missing = kernels_without_wait(src)
    waiting = re.compile(
        r"\b(" + "|".join([WAIT, *sorted(_waiting_device_functions(src))]) + r")\("
    )
    problems = [] if len(kernels) == 2 and missing == [] else ["a kernel without its wait"]
    pipe = statements(function_body(src, _PIPE))
    waits = [i for i, stmt in enumerate(pipe) if waiting.search(stmt)]
    early = [s for s in pipe[: waits[0] if waits else 0] if "mlap_page_" in s]
    if len(waits) != 1 or pipe[waits[0]] != f"{WAIT}();":
        problems.append("the block does not wait once, as a statement of its own")
    elif not (len(early) == 1 and re.match(r"for \([^)]*\bn_early\b", early[0])):
        problems.append("the block's old pages are not issued before its wait")
    if any(waiting.search(stmt) for stmt in statements(function_body(src, _PREFETCH))):
        problems.append("the L2 prefetch waits")
    split_name, merge_name = sorted(kernels)  # (the merge kernel's name has a suffix)
    split = statements(function_body(src, split_name))
    if any(f"{WAIT}(" in stmt for stmt in split):
        problems.append("the pass added a wait to the split kernel")
    asks = [i for i, stmt in enumerate(split) if stmt.startswith(f"{_PREFETCH}(")]
    waits = [i for i, stmt in enumerate(split) if waiting.search(stmt)]
    if len(asks) != 1 or not waits or asks[0] > waits[0]:
        problems.append("the split kernel does not ask L2 for its pages before it waits")
    merge = statements(function_body(src, merge_name))
    if merge[0] != f"{WAIT}();" or any(waiting.search(stmt) for stmt in merge[1:]):
        problems.append("the merge kernel does not wait first, once")
    return problems


@needs_nvcc
def test_split_kernel_copies_old_pages_then_waits_in_its_block(pdl_source: str) -> None:
    """The pipelined block issues the copies of its old pages, then waits (one statement, once);
    the split kernel asks L2 for its pages before any of its statements waits, and the prefetch
    helper does not wait; the pass adds no wait of its own to the split kernel (it waits in its
    device functions only) and puts its wait first in the merge kernel. (That Q and the step's
    new rows are read, and out, lse and the workspace written, only after the wait, and that
    every split block waits once, idle ones too: tests/test_mla_attention_emulation.py.)"""
    assert _pdl_problems(pdl_source) == []
    assert "cp.async.bulk.prefetch" in pdl_source


def _edit_body(src: str, name: str, edit: Callable[[str], str]) -> str:
    """``src`` with the body of function ``name`` replaced by ``edit`` of it."""
    body = function_body(src, name)
    at = re.search(rf"\b{name}\([^;{{]*\)\s*\{{", src).end()
    return src[:at] + edit(body) + src[at + len(body) :]


_WAIT_RELEASE = "  dsv2_griddepcontrol_wait();\n  dsv2_griddepcontrol_launch_dependents();"


@needs_nvcc
@pytest.mark.parametrize(
    ("name", "edit", "problem"),
    [
        (
            _PIPE,
            lambda b: b.replace(_WAIT_RELEASE, "", 1).replace(
                "  int s0 = 0;\n", f"  int s0 = 0;\n{_WAIT_RELEASE}\n", 1
            ),
            "the block's old pages are not issued before its wait",
        ),
        (
            "m_kernel",
            lambda b: b.replace(f"  {_PREFETCH}((", f"  mla_wait_release();\n  {_PREFETCH}((", 1),
            "the split kernel does not ask L2 for its pages before it waits",
        ),
        (
            "m_kernel",
            lambda b: "\n  dsv2_griddepcontrol_wait();" + b,
            "the pass added a wait to the split kernel",
        ),
        (
            "m_kernel_1",
            lambda b: (
                b.replace("\n  dsv2_griddepcontrol_wait();", "", 1)
                + "  dsv2_griddepcontrol_wait();\n"
            ),
            "the merge kernel does not wait first, once",
        ),
    ],
    ids=["block_waits_first", "wait_before_prefetch", "pass_wait_in_split", "merge_waits_last"],
)
def test_split_kernel_wait_order_controls(pdl_source: str, name: str, edit, problem: str) -> None:
    """The controls: each broken source shows its problem."""
    broken = _edit_body(pdl_source, name, edit)
    assert broken != pdl_source
    assert problem in _pdl_problems(broken)


# Names of the PrimFunc's shape variables and buffers besides ``total_len`` (the query rows).
_CONTEXT_NAMES = (
    "nnz_pages",
    "max_num_pages",
    "batch_size",
    "q_indptr",
    "page_indptr",
    "page_values",
    "length_info",
    "pages",
    "causal",
)


@pytest.mark.parametrize(
    ("heads", "latent", "rope", "dtype"),
    [(16, 512, 64, "float16"), (4, 32, 8, "float16"), (16, 512, 64, "bfloat16")],
    ids=["pipelined", "simt", "simt_bf16"],
)
def test_launch_config_depends_on_rows_only(heads, latent, rope, dtype) -> None:
    """Grid extents and workspace sizes read ``total_len`` only, never the page table: a captured
    CUDA graph replays the same launch while the context grows."""
    script = mla_attention_cuda(heads, latent, rope, dtype).script()
    launch = [
        line
        for line in script.splitlines()
        if "T.thread_binding(" in line or re.match(r"\s*ws_\w+ = T.alloc_buffer\(", line)
    ]
    assert sum("blockIdx.x" in line for line in launch) == 2  # split and merge kernels
    assert sum("alloc_buffer(" in line for line in launch) == 3  # ws_o, ws_lse, ws_n
    for line in launch:
        words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", line))
        assert not words & set(_CONTEXT_NAMES), line


@needs_nvcc
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_path_source(stages: int) -> None:
    """The split block is the cp.async / ldmatrix device function; a ring of 2 stages fits
    static shared memory (46.5 KB), 3 (the table's) take dynamic shared memory (64 KB, opted in
    at launch)."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    tiles = replace(tuned("mla_attention"), stages=stages)
    func = build_mla_attention(16, 512, 64, "float16", tiles)
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"m": func.with_attr("global_symbol", "m")}), target)
    src = exe.mod.imports_[0].inspect_source("cuda")
    for needle in (f"mla_split_pipe_16_512_576_s{stages}_e(", "cp.async.wait_group", "ldmatrix"):
        assert needle in src
    assert ("extern __shared__" in src) == (stages > 2)


@needs_nvcc
@pytest.mark.parametrize("kv_scale", [None, 0.5], ids=["float16", "fp8"])
def test_pipelined_path_source_pages_per_step(kv_scale: float | None) -> None:
    """2 pages a step over 4 page buffers: the block of that tag (a 32-token step: 4 n-tiles of
    scores a warp), compiled by nvcc."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    tiles = replace(tuned("mla_attention"), stages=4, pages_per_step=2)
    func = build_mla_attention(16, 512, 64, "float16", tiles, kv_scale=kv_scale)
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"m": func.with_attr("global_symbol", "m")}), target)
    src = exe.mod.imports_[0].inspect_source("cuda")
    name = "mla_split_pipe_16_512_576_s4_e" + ("_fp8" if kv_scale else "") + "_g2("
    for needle in (name, "float c[4 * 4];", "cp.async.wait_group 0;", "extern __shared__"):
        assert needle in src, needle


@needs_nvcc
def test_fp8_split_kernel_on_sm90_carries_the_wgmma_block() -> None:
    """sm_90's FP8 entry (schedules/tiles.py) builds the split kernel with the wgmma block
    (mla_wgmma_cuda), compiled by nvcc for sm_90a; other architectures keep the pipelined
    block."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target

    assert tuned("mla_attention", "sm_90", (16, 512, 64, "e4m3")).block == "wgmma"
    assert tuned("mla_attention", "sm_89", (16, 512, 64, "e4m3")).block == "pipe"
    assert tuned("mla_attention", "sm_90", (16, 512, 64, "float16")).block == "pipe"
    target = make_cuda_target("sm_90")
    func = mla_attention_cuda(16, 512, 64, "float16", kv_scale=0.5, arch="sm_90")
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"m": func.with_attr("global_symbol", "m")}), target)
    src = exe.mod.imports_[0].inspect_source("cuda")
    for needle in ("wgmma.mma_async.sync.aligned.m64n16k16", "cvt.rn.f16x2.e4m3x2",
                   "mla_split_pipe_16_512_576_s8_e_fp8_g4(", "extern __shared__"):  # fmt: skip
        assert needle in src, needle
    assert "mlaw_wgmma" not in mla_attention_cuda(16, 512, 64, "float16", 0.5).script()


def test_build_rejects_bad_tiles() -> None:
    tiles = tuned("mla_attention")
    with pytest.raises(ValueError, match=">= 1"):
        build_mla_attention(16, 512, 64, "float16", replace(tiles, min_pages_per_split=0))
    with pytest.raises(ValueError, match="stages"):
        build_mla_attention(16, 512, 64, "float16", replace(tiles, stages=1))
    # pages_per_step: a ring of at least 2 slots of that many pages, in 227 KB
    for g, stages in ((2, 3), (2, 2), (5, 10), (0, 3)):
        with pytest.raises(UsageError, match="pages_per_step must be 1 to 4 and stages a"):
            build_mla_attention(16, 512, 64, "float16", replace(tiles, stages=stages,
                                                                 pages_per_step=g))  # fmt: skip
    big = replace(tiles, stages=12, pages_per_step=4)  # 253 KB
    with pytest.raises(UsageError, match="shared memory a block, more than 232448"):
        build_mla_attention(16, 512, 64, "float16", big)
    build_mla_attention(16, 512, 64, "float16", replace(big, stages=8))  # 180 KB
    # the wgmma block: the FP8 cache's, 4 pages a step
    wg = replace(tiles, block="wgmma", stages=8, pages_per_step=4)
    with pytest.raises(UsageError, match="block='wgmma' is the FP8 cache's block"):
        build_mla_attention(16, 512, 64, "float16", wg)  # a float16 cache
    with pytest.raises(UsageError, match="block='wgmma' is the FP8 cache's block"):
        build_mla_attention(16, 512, 64, "float16", replace(wg, stages=4, pages_per_step=2), 0.5)
    build_mla_attention(16, 512, 64, "float16", wg, kv_scale=0.5)


def test_kernel_raises_for_a_bad_table_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile table entry no shape can use is an error, not a shape the cache leaves to TVM's
    kernel."""
    entries = {k: replace(v, pages_per_step=2) for k, v in TABLE["mla_attention"].items()}
    monkeypatch.setitem(TABLE, "mla_attention", entries)  # (stages 3: not a multiple of 2)
    with pytest.raises(UsageError, match="pages_per_step=2 with stages=3"):
        mla_attention_cuda_supports(16, 512, 64, "float16")


def test_kernel_rejects_unsupported_shapes() -> None:
    with pytest.raises(ValueError, match="heads"):
        mla_attention_cuda(3, 32, 8)
    with pytest.raises(ValueError, match="heads"):
        mla_attention_cuda(6, 32, 8)
    with pytest.raises(ValueError, match="latent"):
        mla_attention_cuda(4, 30, 8)
    with pytest.raises(ValueError, match="shared memory"):
        mla_attention_cuda(16, 512, 64, "float32")  # TVM's kernel fails there too (ptxas)
    assert not mla_attention_cuda_supports(16, 512, 64, "float32")
    assert mla_attention_cuda_supports(16, 512, 64, "float16")
    # sm_90's FP8 entry (the wgmma block) at V2-Lite's shapes; 3 heads with sm_90's tiles: no
    assert mla_attention_cuda_supports(16, 512, 64, "float16", kv_scale=2.0**-7, arch="sm_90")
    assert not mla_attention_cuda_supports(3, 32, 8, "float16", arch="sm_90")


@pytest.mark.parametrize(("heads", "ours"), [(16, True), (3, False)])
def test_cuda_cache_mla_slot(heads: int, ours: bool) -> None:
    """The cache's MLA slot holds the split-KV kernel where it supports the shapes (16 heads) and
    TVM's kernel where it does not (3 heads)."""
    names, script = create_script({"kind": "cuda", "arch": "sm_90"}, heads=heads)
    slot, other = (SPLIT_KV, TVM_MLA) if ours else (TVM_MLA, SPLIT_KV)
    assert slot in names
    assert f'(R.str("tirx"), {slot})' in script
    assert f'(R.str("tirx"), {other})' not in script
    assert (SPLIT_KV in names) == ours


@needs_nvcc
def test_tiny_cuda_model_carries_split_kv_kernel(checkpoints, tmp_path: Path) -> None:
    """A tiny model compiled for CUDA through our pipeline holds the kernel in its fatbin."""
    from dsv2_mlc.compiler.compile import compile_model
    from dsv2_mlc.compiler.cuda import check_fatbin
    from dsv2_mlc.layout import LIBRARY

    out = compile_model(
        checkpoints["A"], tmp_path / "A", device="cuda", dtype="float16", progress=False
    ).out_dir
    lib = out / LIBRARY
    check_fatbin(lib, "sm_90")
    data = lib.read_bytes()
    assert SPLIT_KV.encode() in data  # host wrapper and kernel names


@pytest.mark.parametrize("smax", [1, 3, 64, 256])
def test_split_pages_takes_the_fewest_pages_the_rule_allows(smax: int) -> None:
    """The pages a split takes (the split kernel evaluates the same expression per row on the
    device): at least 2 up to 128 visible pages and 4 past them, at most ``smax`` splits, and
    the fewest pages per split with both."""
    from tvm import tirx
    from tvm.sym import Analyzer

    analyzer = Analyzer()
    for pages in [*range(1, 300), 511, 512, 513, 1024, 2048, 4097]:
        expr = split_pages(tirx.IntImm("int32", pages), tirx.IntImm("int32", smax), 2, 4, 128)
        pps = analyzer.simplify(expr)
        assert isinstance(pps, tirx.IntImm), pps
        pps = int(pps)
        least = 4 if pages > 128 else 2
        splits = -(-pages // pps)
        assert splits <= smax, (pages, pps)
        assert pps >= min(least, pages), (pages, pps)
        # one page fewer would break a bound (or leave a split empty)
        fewer = pps - 1
        assert fewer < min(least, pages) or -(-pages // fewer) > smax or pps == 1, (pages, pps)

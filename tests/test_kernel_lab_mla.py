"""The split-KV CUDA MLA attention kernel (``dsv2_mlc.schedules.mla_attention_cuda``), no GPU.

Checks that the kernel compiles to sm_90 machine code alone (V2-Lite and tiny shapes, the way
``schedules/lab/kernel_lab_mla.py prepare`` builds it), that ``MLAPagedKVCache`` puts it into the
MLA
attention slot of TVM's ``TIRPagedKVCache`` for CUDA (and keeps TVM's kernel with
``mla_kernel="tvm"``), and that a compiled tiny CUDA model carries it. Its numerics are measured
on an H200 by ``schedules/lab/kernel_lab_mla.py run`` (schedules/results/mla_attention.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tvm
from cuda_builds import needs_nvcc  # noqa: E402
from mla_cache_module import create_script
from scripts_module import load_script

from dsv2_mlc.schedules.mla_attention_cuda import (
    mla_attention_cuda,
    mla_attention_cuda_supports,
    split_pages,
)

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


def _lab_variants() -> dict:
    return load_script("kernel_lab_mla").VARIANTS


@needs_nvcc
@pytest.mark.parametrize("variant", sorted(_lab_variants()))
def test_lab_variants_compile(tmp_path: Path, variant: str) -> None:
    """Every variant ``kernel_lab_mla.py prepare`` builds compiles to sm_90 (V2-Lite shapes)."""
    from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    kwargs = _lab_variants()[variant]
    func = mla_attention_cuda(16, 512, 64, "float16", **kwargs).with_attr("global_symbol", "m")
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"m": func}), target=target)
    exe.export_library(str(tmp_path / "m.so"))
    check_fatbin(tmp_path / "m.so", "sm_90")


def _pdl_source(**kwargs) -> str:
    """The CUDA source of the V2-Lite kernel with ``kwargs``, compiled as a ``--pdl`` build."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, cuda_sources, make_cuda_target
    from dsv2_mlc.passes.pipeline import tir_pipeline

    target = make_cuda_target("sm_90")
    func = mla_attention_cuda(16, 512, 64, **kwargs).with_attr("global_symbol", "m")
    with cuda_codegen(), target:
        lib = tvm.compile(tvm.IRModule({"m": func}), target=target, tir_pipeline=tir_pipeline(True))
    (src,) = cuda_sources(lib.mod)
    return src


@needs_nvcc
def test_l2_prefetch_variant_waits_after_its_prefetches() -> None:
    """In a PDL build the split kernel of ``l2_prefetch=True`` asks L2 for its pages and then
    waits itself (so the pass adds no wait in front), the merge kernel starts with the wait."""
    from dsv2_mlc.passes.grid_dependency_control import WAIT, kernels_without_wait

    src = _pdl_source(l2_prefetch=True, early_pages=False)
    kernels, missing = kernels_without_wait(src)
    assert len(kernels) == 2 and missing == []
    assert "cp.async.bulk.prefetch.L2.global" in src
    bodies = {k: src.split(f" {k}(")[-1].split("{", 1)[1].lstrip() for k in kernels}
    starts = sorted(body.startswith(f"{WAIT}();") for body in bodies.values())
    assert starts == [False, True]  # the split kernel waits inside mla_prefetch_wait_*


@needs_nvcc
@pytest.mark.parametrize(("l2", "merge_release"), [(False, True), (True, True), (True, False)])
def test_release_variant_waits_then_releases_in_both_kernels(l2: bool, merge_release: bool):
    """``release=True`` (``early_pages=False``): the split kernel reads its page tables, (asks
    L2 for its pages,) then waits and releases before anything else (its first write,
    ``ws_n``, comes after);
    ``merge_release=True``: the merge kernel waits and releases before it reads anything; the
    pass adds no wait of its own to them (without ``merge_release`` it puts its wait first in
    the merge kernel)."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, cuda_sources, make_cuda_target
    from dsv2_mlc.passes.grid_dependency_control import WAIT, kernels_without_wait
    from dsv2_mlc.passes.pipeline import tir_pipeline
    from dsv2_mlc.schedules.cuda_call import LAUNCH_DEPENDENTS

    target = make_cuda_target("sm_90")
    func = mla_attention_cuda(
        16, 512, 64, release=True, merge_release=merge_release, l2_prefetch=l2, early_pages=False
    )
    with cuda_codegen(), target:
        lib = tvm.compile(
            tvm.IRModule({"m": func.with_attr("global_symbol", "m")}),
            target=target,
            tir_pipeline=tir_pipeline(True),
        )
    (src,) = cuda_sources(lib.mod)
    kernels, missing = kernels_without_wait(src)
    assert len(kernels) == 2 and missing == []
    # one helper for both kernels (and the prefetching one of the split)
    assert src.count(f"{WAIT}();\n  {LAUNCH_DEPENDENTS}();") == int(merge_release or not l2) + l2
    split, merge = (src.split(f" {k}(")[-1].split("{", 1)[1] for k in sorted(kernels))
    call = "mla_prefetch_wait_r_" if l2 else "mla_wait_release("
    assert call in split and split.index(call) < split.index("ws_n_ptr[")
    assert split.index("page_indptr_ptr[") < split.index(call)  # the preamble comes first
    if merge_release:
        assert merge.index("mla_wait_release();") < merge.index("ws_n_ptr[")  # its first read
    else:
        assert "mla_wait_release" not in merge and merge.lstrip().startswith(f"{WAIT}();")


@needs_nvcc
def test_early_pages_variant_copies_old_pages_then_waits_in_its_block() -> None:
    """``early_pages=True``: the split kernel's prefetch helper does not wait; the pipelined
    block issues the copies of its old pages, then waits and releases, then issues the rest and
    reads Q; ``ws_n`` is written after the block (its wait); idle blocks wait too; the pass adds
    no wait of its own to the split kernel."""
    from dsv2_mlc.passes.grid_dependency_control import WAIT, kernels_without_wait

    src = _pdl_source(early_pages=True)
    kernels, missing = kernels_without_wait(src)
    assert len(kernels) == 2 and missing == []
    pipe = src.split("void mla_split_pipe_16_512_576_s3_e(")[1].split("\n}\n")[0]
    early, rest = pipe.split(f"{WAIT}();", 1)
    assert "s0 < n_early" in early and "mlap_page_" in early  # old pages before the wait
    assert "q + g * 576" in rest  # Q after it
    prefetch = src.split("void mla_prefetch_16_512_576(")[1].split("\n}\n")[0]
    assert "cp.async.bulk.prefetch" in src and WAIT not in prefetch
    split = src.split(f" {sorted(kernels)[0]}(")[-1].split("{", 1)[1]
    assert split.index("mla_split_pipe_16_512_576_s3_e(") < split.index("ws_n_ptr[")
    assert "mla_wait_release();" in split  # the idle blocks'


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
    "kwargs",
    [
        {},
        {"mma": False, "heads_per_block": 8},
        {"merge": "serial", "max_split": 64},
        {"stages": 3, "min_pages_per_split": 2, "merge_prefetch": True},
    ],
)
def test_launch_config_depends_on_rows_only(kwargs: dict) -> None:
    """Grid extents and workspace sizes read ``total_len`` only, never the page table: a captured
    CUDA graph replays the same launch while the context grows."""
    script = mla_attention_cuda(16, 512, 64, "float16", **kwargs).script()
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
    """``stages >= 2``: the split block is the cp.async / ldmatrix device function; 2 stages fit
    static shared memory (46.5 KB), 3 take dynamic shared memory (64 KB, opted in at launch)."""
    from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target

    target = make_cuda_target("sm_90")
    func = mla_attention_cuda(16, 512, 64, "float16", stages=stages, min_pages_per_split=2)
    with cuda_codegen(), target:
        exe = tvm.compile(tvm.IRModule({"m": func.with_attr("global_symbol", "m")}), target)
    src = exe.mod.imports_[0].inspect_source("cuda")
    for needle in (f"mla_split_pipe_16_512_576_s{stages}_e(", "cp.async.wait_group", "ldmatrix"):
        assert needle in src
    assert ("extern __shared__" in src) == (stages > 2)
    assert "mla_qk_" not in src  # the TIR page loop is gone


def test_kernel_rejects_bad_variant_arguments() -> None:
    with pytest.raises(ValueError, match="merge"):
        mla_attention_cuda(16, 512, 64, merge="tree")
    with pytest.raises(ValueError, match="threads"):
        mla_attention_cuda(16, 512, 64, threads=384)
    with pytest.raises(ValueError, match=">= 1"):
        mla_attention_cuda(16, 512, 64, min_pages_per_split=0)
    with pytest.raises(ValueError, match="stages"):
        mla_attention_cuda(16, 512, 64, stages=0)
    with pytest.raises(ValueError, match="partials"):
        mla_attention_cuda(16, 512, 64, partials="bfloat16")
    with pytest.raises(ValueError, match="float16 partials"):  # only the pipelined path has them
        mla_attention_cuda(16, 512, 64, stages=1, partials="float16")
    with pytest.raises(ValueError, match="float16 partials"):
        mla_attention_cuda(16, 512, 64, merge="serial", partials="float16")
    # the TIR page loop, the SIMT path and a split kernel that does not wait itself copy no
    # page early: the option changes nothing there
    for kwargs in ({"stages": 1}, {"mma": False}, {"release": False}):
        plain = mla_attention_cuda(16, 512, 64, early_pages=False, **kwargs).script()
        assert mla_attention_cuda(16, 512, 64, early_pages=True, **kwargs).script() == plain


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


def _create_script(mla_kernel: str) -> tuple[set[str], str]:
    """Export ``create_paged_kv_cache`` alone for sm_90: (function names, its script)."""
    return create_script({"kind": "cuda", "arch": "sm_90"}, mla_kernel=mla_kernel)


@pytest.mark.parametrize("mla_kernel", ["split_kv", "tvm"])
def test_cuda_cache_mla_slot(mla_kernel: str) -> None:
    names, script = _create_script(mla_kernel)
    slot = SPLIT_KV if mla_kernel == "split_kv" else TVM_MLA
    assert slot in names
    assert f'(R.str("tirx"), {slot})' in script
    other = TVM_MLA if mla_kernel == "split_kv" else SPLIT_KV
    assert f'(R.str("tirx"), {other})' not in script
    assert (SPLIT_KV in names) == (mla_kernel == "split_kv")


def test_cuda_cache_rejects_unknown_kernel() -> None:
    with pytest.raises(ValueError, match="mla_kernel"):
        _create_script("flash")


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

"""PDL builds (``--pdl``): every CUDA kernel starts with ``griddepcontrol.wait`` and compiles for
sm_90, and the build records the option for the runtime. Needs nvcc for the CUDA builds (no
GPU); the decode graphs with programmatic edges run in scripts/gpu_pdl_check.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import tvm
from tvm import te, tirx
from tvm.script import ir as I
from tvm.script import tirx as T

from dsv2_mlc.compiler.compile import CompileError, compile_random_model, make_target
from dsv2_mlc.compiler.cuda import check_fatbin, cuda_codegen, cuda_sources
from dsv2_mlc.layout import BUILD_CONFIG, BuildConfig
from dsv2_mlc.passes.grid_dependency_control import (
    WAIT,
    InsertGridDependencyControl,
    _waiting_device_functions,
    is_cuda_kernel,
    kernels_without_wait,
)
from dsv2_mlc.passes.pipeline import tir_pipeline
from dsv2_mlc.schedules.cuda_call import LAUNCH_DEPENDENTS

sys.path.insert(0, str(Path(__file__).parent))
from cuda_builds import needs_nvcc  # noqa: E402
from cuda_source import function_body  # noqa: E402
from hf_reference import CONFIG_A  # noqa: E402


def _module() -> tvm.IRModule:
    """Three kernels: elementwise, a shared-memory reduction, and a two-kernel function."""
    import tvm.s_tir.dlight as dl

    n = te.var("n")
    a = te.placeholder((n, 128), "float32", name="a")
    scaled = te.compute((n, 128), lambda i, j: a[i, j] * 2, name="scaled")
    k = te.reduce_axis((0, 128), "k")
    total = te.compute((n,), lambda i: te.sum(a[i, k], axis=k), name="total")
    mod = tvm.IRModule(
        {
            "scale": te.create_prim_func([a, scaled]).with_attr("global_symbol", "scale"),
            "row_sum": te.create_prim_func([a, total]).with_attr("global_symbol", "row_sum"),
        }
    )
    with make_target("cuda", "sm_90"):
        return dl.ApplyDefaultSchedule(dl.gpu.Reduction(), dl.gpu.Fallback())(mod)


def _build(pipeline: str) -> tvm.runtime.Module:
    target = make_target("cuda", "sm_90")
    with target, cuda_codegen():
        return tvm.compile(_module(), target=target, tir_pipeline=pipeline)


def _body_starts(source: str, kernel: str) -> list[str]:
    head = source.split(f" {kernel}(")[2]  # [0] before, [1] the declaration, [2] the definition
    lines = head.split("{", 1)[1].strip().splitlines()
    return [line.strip() for line in lines[:2]]


@needs_nvcc
def test_every_kernel_starts_with_the_wait_and_compiles_for_sm90(tmp_path: Path):
    lib = _build(tir_pipeline(pdl=True))
    (source,) = cuda_sources(lib.mod)
    kernels, missing = kernels_without_wait(source)
    assert sorted(kernels) == ["row_sum_kernel", "scale_kernel"] and missing == []
    assert 'asm volatile("griddepcontrol.wait;" ::: "memory");' in source
    assert source.count(f"void {WAIT}()") == 1  # one helper, called by every kernel
    for kernel in kernels:
        first = _body_starts(source, kernel)
        assert first[0] == f"{WAIT}();"
    # TVM's kernels release their dependents at their exit (the helper is defined, not called)
    assert f"{LAUNCH_DEPENDENTS}();" not in source
    lib.export_library(str(tmp_path / "lib.so"))
    check_fatbin(tmp_path / "lib.so", "sm_90")  # nvcc compiled the PTX for sm_90


@needs_nvcc
def test_default_pipeline_adds_nothing():
    assert tir_pipeline() == "default"
    (source,) = cuda_sources(_build("default").mod)
    kernels, missing = kernels_without_wait(source)
    assert len(kernels) == 2 and sorted(missing) == sorted(kernels)
    assert "griddepcontrol" not in source


def test_pass_touches_cuda_kernels_only():
    cuda, llvm = tvm.target.Target({"kind": "cuda"}), tvm.target.Target({"kind": "llvm"})

    @I.ir_module
    class Mod:
        @T.prim_func
        def kernel(a: T.handle):
            T.func_attr({"calling_conv": 2, "target": cuda})
            T.evaluate(0)

        @T.prim_func
        def helper(a: T.handle):
            T.func_attr({"target": cuda})
            T.evaluate(0)

        @T.prim_func
        def host(a: T.handle):
            T.func_attr({"calling_conv": 2, "target": llvm})
            T.evaluate(0)

    assert [is_cuda_kernel(Mod[n]) for n in ("kernel", "helper", "host")] == [True, False, False]
    out = InsertGridDependencyControl()(Mod)
    assert isinstance(out["kernel"].body, tirx.SeqStmt) and WAIT in out["kernel"].script()
    assert out["helper"].same_as(Mod["helper"]) and out["host"].same_as(Mod["host"])


def test_kernels_without_wait_reads_cuda_source():
    src = (
        'extern "C" __global__ void __launch_bounds__(64) a_kernel(float* x);\n'
        'extern "C" __global__ void __launch_bounds__(64) a_kernel(float* x) {\n'
        f"  {WAIT}();\n  x[0] = 1;\n}}\n"
        'extern "C" __global__ void b_kernel(float* __restrict__ x, int n) {\n  x[0] = 1;\n}\n'
    )
    assert kernels_without_wait(src) == (["a_kernel", "b_kernel"], ["b_kernel"])


def test_hand_kernels_that_wait_themselves_are_left_alone():
    """A hand kernel that loads its weights and then calls the wait (``schedules/cuda_call.py:
    grid_wait_source``) gets no second wait in front; the source check accepts it, but not a
    kernel that calls a device function without the wait."""
    from dsv2_mlc.schedules.cuda_call import grid_wait_source, token_grid_call

    body = "  float w = wt[tid];\n  {wait}\n  y[t] = w * x[t];\n"
    fn = "__device__ __forceinline__ void {name}(const float* wt, const float* x, float* y, "
    fn += "long long t, int blk, int tid) {{\n{body}}}\n"
    params = [("wt", (32,), "float32"), ("x", (None,), "float32"), ("y", (None,), "float32")]
    cuda = tvm.target.Target({"kind": "cuda"})

    def kernel(name: str, wait: str) -> tirx.PrimFunc:
        src = grid_wait_source() + fn.format(name=name, body=body.format(wait=wait))
        shell = token_grid_call("k", name, src, params, 1, 32)
        return shell.with_attr({"calling_conv": 2, "target": cuda})

    mod = tvm.IRModule({"hand": kernel("hand_fn", f"{WAIT}();"), "plain": kernel("plain_fn", "")})
    out = InsertGridDependencyControl()(mod)
    assert out["hand"].same_as(mod["hand"])  # its own wait, after the weight load
    assert not out["plain"].same_as(mod["plain"])
    assert f'"{WAIT}"' in out["plain"].script()  # a call of it
    assert f'"{LAUNCH_DEPENDENTS}"' not in out["plain"].script()  # released at its exit
    src = (
        grid_wait_source()
        + fn.format(name="hand_fn", body=body.format(wait=f"{WAIT}();"))
        + fn.format(name="plain_fn", body=body.format(wait=""))
        + 'extern "C" __global__ void hand_kernel(float* a) {\n  hand_fn(a, a, a, 0, 0, 0);\n}\n'
        + 'extern "C" __global__ void plain_kernel(float* a) {\n  plain_fn(a, a, a, 0, 0, 0);\n}\n'
    )
    assert kernels_without_wait(src) == (["hand_kernel", "plain_kernel"], ["plain_kernel"])


@needs_nvcc
def test_pdl_build_waits_in_tvm_kernels_too_and_records_the_option(model_builds):
    """A whole model: our kernels and TVM's (KV cache append, attention merge, page copies) all
    wait; the hand kernels release their dependents once, right after their own wait, TVM's at
    their exit; the build config says ``pdl`` so the runtime may use programmatic graph edges.
    (The build itself runs ``check_pdl_kernels``: it fails if any kernel lacks the wait.)"""
    build = model_builds.get(CONFIG_A, "q4f16_g32", "cuda", pdl=True)
    sources = list(build.cuda_sources)
    assert sources
    seen = [kernels_without_wait(s)[0] for s in sources]
    kernels = {k for names in seen for k in names}
    tvm_kernels = {
        "mla_append_release_first_kernel",  # ours: the KV append
        "tir_attention_merge_state_mla_kernel",
        "copy_single_page_mla_kernel",
        "compact_kv_copy_kernel",
    }
    assert tvm_kernels <= kernels and len(kernels) > 40
    # the hand kernels release their dependents right after their own wait, once; the wait the
    # pass puts first in TVM's kernels is not followed by a release
    hand = sorted({f for src in sources for f in _waiting_device_functions(src)})
    kinds = ("dsv2_moe_gu_", "dsv2_moe_dn_", "dsv2_norm_gemv_", "dsv2_norm_router_",
             "dsv2_pf_gemv_", "dsv2_pf_absorb_v_", "mla_prologue_", "dsv2_mla_append_")  # fmt: skip
    assert sorted(k for k in kinds if any(f.startswith(k) for f in hand)) == sorted(kinds), hand
    released = re.compile(rf"{WAIT}\(\);\s*{LAUNCH_DEPENDENTS}\(\);")
    # the KV append has nothing to load before its wait: it releases the split kernel first
    released_first = re.compile(rf"{LAUNCH_DEPENDENTS}\(\);\s*{WAIT}\(\);")
    for src in sources:
        for name in _waiting_device_functions(src):
            body = function_body(src, name)
            pattern = released_first if name.startswith("dsv2_mla_append_") else released
            assert len(pattern.findall(body)) == body.count(f"{WAIT}();") == 1, name
        for kernel in kernels_without_wait(src)[0]:
            first = _body_starts(src, kernel)
            if first[0] == f"{WAIT}();":
                assert first[1] != f"{LAUNCH_DEPENDENTS}();", kernel
    raw = json.loads((build.out_dir / BUILD_CONFIG).read_text())
    assert raw["pdl"] is True
    assert BuildConfig.read(build.out_dir).pdl
    check_fatbin(build.out_dir / "model.so", "sm_90")


def test_old_build_configs_read_as_no_pdl(tmp_path: Path):
    raw = dict(format_version=1, model={}, dtype="float16", device="cuda", target="{}")
    (tmp_path / BUILD_CONFIG).write_text(json.dumps(raw))
    build = BuildConfig.read(tmp_path)
    assert build.pdl is False and build.pdl_launch_dependents is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(device="cpu", pdl=True), "cuda only"),
        (dict(device="cuda", arch="sm_80", pdl=True), "sm_90 or newer"),
    ],
)
def test_pdl_options_are_checked_before_building(tmp_path: Path, kwargs, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG_A))
    with pytest.raises(CompileError, match=message):
        compile_random_model(cfg, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_cli_passes_pdl_flags(tmp_path: Path, monkeypatch):
    import dsv2_mlc.compiler.compile as compile_mod
    from dsv2_mlc.cli import main

    calls = []

    def fake(config, out, **options):
        calls.append(options)
        raise CompileError("stop")

    monkeypatch.setattr(compile_mod, "compile_random_model", fake)
    base = ["compile", str(tmp_path), "-o", str(tmp_path / "o"), "--random-weights"]
    for extra in ([], ["--pdl"], ["--no-pdl"]):
        main([*base, "--device", "cuda", *extra])
    assert [c["pdl"] for c in calls] == [None, True, False]


@pytest.mark.parametrize(
    ("device", "arch", "pdl", "expected"),
    [
        ("cuda", "sm_90", None, True),  # the default on Hopper
        ("cuda", "sm_100", None, True),
        ("cuda", "sm_90", False, False),  # --no-pdl
        ("cuda", "sm_80", None, False),  # no griddepcontrol before sm_90
        ("cpu", "sm_90", None, False),
    ],
)
def test_pdl_is_on_by_default_where_the_gpu_has_it(device, arch, pdl, expected):
    from dsv2_mlc.compiler.compile import _build_options

    assert _build_options(device, arch, pdl).pdl is expected

"""``--gemm cublas``: the option, the shim build, finding libcublas, and the library's
registrations (loaded with the driver stub, no GPU). The GEMMs themselves run on the H200:
``scripts/gpu_cublas_check.py`` (the shim against torch over a shape sweep) and the GPU numerics
of the CUDA builds, which use it for every prefill (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cuda_builds import needs_nvcc
from hf_reference import CONFIG_A

from dsv2_mlc.compiler.compile import CompileError, _build_options, compile_random_model
from dsv2_mlc.layout import BUILD_CONFIG, LIBRARY, BuildConfig
from dsv2_mlc.runtime.tvm_runtime import RuntimeLibraryError


@pytest.mark.parametrize(
    ("device", "gemm", "expected"),
    [("cuda", None, "cublas"), ("cpu", None, "tir"), ("cuda", "tir", "tir")],
)
def test_gemm_defaults_to_cublas_on_cuda(device, gemm, expected):
    assert _build_options(device, "sm_90", None, gemm).gemm == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(device="cpu", gemm="cublas"), "cuda only"),
        (dict(gemm="cutlass"), "unsupported --gemm"),
    ],
)
def test_gemm_option_is_checked_before_building(tmp_path: Path, kwargs, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG_A))
    with pytest.raises(CompileError, match=message):
        compile_random_model(cfg, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_cli_passes_gemm(tmp_path: Path, monkeypatch):
    import dsv2_mlc.compiler.compile as compile_mod
    from dsv2_mlc.cli import main

    calls = []

    def fake(config, out, **options):
        calls.append(options["gemm"])
        raise CompileError("stop")

    monkeypatch.setattr(compile_mod, "compile_random_model", fake)
    base = ["compile", str(tmp_path), "-o", str(tmp_path / "o"), "--random-weights"]
    for extra in ([], ["--gemm", "tir"], ["--gemm", "cublas"]):
        main([*base, "--device", "cuda", *extra])
    assert calls == [None, "tir", "cublas"]


def test_old_build_configs_read_as_tir_gemm(tmp_path: Path):
    raw = dict(format_version=1, model={}, dtype="float16", device="cuda", target="{}")
    (tmp_path / BUILD_CONFIG).write_text(json.dumps(raw))
    assert BuildConfig.read(tmp_path).gemm == "tir"


def test_shim_needs_a_cpp_compiler(tmp_path: Path, monkeypatch):
    from dsv2_mlc.compiler import extern_gemm

    monkeypatch.setattr(extern_gemm.shutil, "which", lambda _name: None)
    with pytest.raises(extern_gemm.ShimBuildError, match="--gemm tir"):
        extern_gemm.build_cublas_shim(tmp_path)


def test_find_cublas_looks_in_the_nvidia_packages_and_explains_a_miss(tmp_path, monkeypatch):
    from dsv2_mlc.runtime import cublas

    for var in (cublas.CUBLAS_ENV, "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libcublas.so.13"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert cublas.find_cublas() == str(lib)

    monkeypatch.setenv(cublas.CUBLAS_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeLibraryError, match="no such file.*--gemm tir"):
        cublas.find_cublas()


@needs_nvcc
def test_cublas_build_registers_the_shim(model_builds):
    """A ``--gemm cublas`` build (the CUDA default) records the choice, and loading its library
    (thin runtime, driver stub) registers ``dsv2.cublas.*``, whose errors name the problem:
    a library path that does not open, a GEMM before cuBLAS is opened, a host tensor, a
    workspace that is not a device byte array."""
    from dsv2_mlc.compiler.cuda import build_driver_stub

    out = model_builds.get(CONFIG_A, "q0f16", "cuda").out_dir  # the session's shared build
    assert BuildConfig.read(out).gemm == "cublas"
    assert not list(out.glob("*.o"))  # the shim object is linked in, not left behind
    code = textwrap.dedent(
        f"""
        import ctypes
        import numpy as np
        import tvm_ffi
        ctypes.CDLL({str(build_driver_stub())!r}, mode=ctypes.RTLD_GLOBAL)
        from dsv2_mlc.runtime.tvm_runtime import load_runtime
        load_runtime("cuda")
        tvm_ffi.load_module({str(out / LIBRARY)!r})
        for name in ("init", "gemm_nt", "version", "set_workspace"):
            print("REGISTERED", name, tvm_ffi.get_global_func("dsv2.cublas." + name) is not None)
        x = tvm_ffi.from_dlpack(np.zeros((4, 8), np.float16))
        try:
            tvm_ffi.get_global_func("dsv2.cublas.gemm_nt")(x, x, x)
        except Exception as err:
            print("GEMM", err)
        try:
            ws = tvm_ffi.from_dlpack(np.zeros(64, np.uint8))
            tvm_ffi.get_global_func("dsv2.cublas.set_workspace")(ws)
        except Exception as err:
            print("WORKSPACE", err)
        try:
            tvm_ffi.get_global_func("dsv2.cublas.init")("/nonexistent/libcublas.so.13")
        except Exception as err:
            print("INIT", err)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("init", "gemm_nt", "version", "set_workspace"):
        assert f"REGISTERED {name} True" in proc.stdout
    assert "WORKSPACE set_workspace: a contiguous 1-D uint8 CUDA tensor" in proc.stdout
    assert "x: not on CUDA device 0" in proc.stdout
    assert "cannot open cuBLAS /nonexistent/libcublas.so.13" in proc.stdout

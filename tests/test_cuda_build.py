"""CUDA builds on a machine without a GPU: precompiled sm_90 kernels, loadable without nvcc/NVRTC.

Needs nvcc and gcc (the driver stub), not a GPU; skipped where nvcc is missing. The numerics on a
real GPU are checked by scripts/gpu_numerics.py (docs/gpu-numerics.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cuda_builds import needs_nvcc  # noqa: E402
from hf_reference import CONFIG_A

from dsv2_mlc.compiler.cuda import CudaBuildError, build_driver_stub, check_fatbin, make_cuda_target
from dsv2_mlc.layout import BUILD_CONFIG, LIBRARY


@pytest.fixture(scope="module")
def cuda_build(model_builds) -> Path:
    """Config A in float16 for sm_90 (the session's build, shared with the other CUDA tests)."""
    return model_builds.get(CONFIG_A, "q0f16", "cuda").out_dir


@needs_nvcc
def test_cuda_export_holds_sm90_fatbin_and_no_source(cuda_build):
    lib = cuda_build / LIBRARY
    check_fatbin(lib, "sm_90")  # fatbin magic, sm_90 cubin inside, no `__global__` source
    build = json.loads((cuda_build / BUILD_CONFIG).read_text())
    assert build["device"] == "cuda" and build["dtype"] == "float16"
    assert '"sm_90"' in build["target"]


@needs_nvcc
def test_cuda_export_loads_without_compiler_or_nvrtc(cuda_build):
    """The thin runtime's way in (ctypes + tvm_ffi, no `import tvm`) with the driver stub: a
    source artifact would fail here (`fmt=='cuda' requires tvm_callback_cuda_compile`)."""
    code = textwrap.dedent(
        f"""
        import ctypes, sys
        import tvm_ffi
        ctypes.CDLL({str(build_driver_stub())!r}, mode=ctypes.RTLD_GLOBAL)
        from dsv2_mlc.runtime.tvm_runtime import load_runtime
        load_runtime("cuda")
        vm = tvm_ffi.load_module({str(cuda_build / LIBRARY)!r})["vm_load_executable"]()
        assert "tvm" not in sys.modules
        assert tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True) is None
        print("LOADED", vm["get_function_arity"]("batch_decode"))
        print("GREEDY", vm["get_function_arity"]("greedy_tokens"))  # the device arg-max
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED 3" in proc.stdout
    assert "GREEDY 1" in proc.stdout


_FEATURE_PROBE = r"""
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "compiled without the sm_90a features"
#endif
__device__ __forceinline__ void feature_probe(float* b, int i) { b[i] = 1.0f; }
"""


@needs_nvcc
def test_sm90_compiles_with_arch_specific_features_unless_asked_not_to():
    """``cuda_codegen`` compiles an ``sm_90`` target as ``sm_90a`` (what the wgmma kernels test),
    and as plain ``sm_90`` with ``arch_specific=False``; TVM's own callback is back afterwards."""
    import tvm
    import tvm_ffi
    from tvm.script import tirx as T

    from dsv2_mlc.compiler.cuda import cuda_codegen

    @T.prim_func
    def probe(b: T.Buffer((32,), "float32")):
        for i in T.thread_binding(32, thread="threadIdx.x"):
            T.cuda.func_call("feature_probe", b.data, i, source_code=_FEATURE_PROBE)

    target = make_cuda_target("sm_90")
    before = tvm_ffi.get_global_func("tvm_callback_cuda_compile")
    with cuda_codegen(), target:
        lib = tvm.compile(tvm.IRModule({"probe": probe}), target=target)
    assert [m for m in lib.mod.imports_ if m.kind == "cuda"]
    with pytest.raises(Exception, match="without the sm_90a features"):
        with cuda_codegen(arch_specific=False), target:
            tvm.compile(tvm.IRModule({"probe": probe}), target=target)
    assert tvm_ffi.get_global_func("tvm_callback_cuda_compile").same_as(before)


def test_cuda_arch_must_be_plain_sm():
    with pytest.raises(CudaBuildError, match="sm_90a"):
        make_cuda_target("sm_90a")
    with pytest.raises(CudaBuildError, match="unsupported CUDA arch"):
        make_cuda_target("hopper")


def test_device_copy_round_trip():
    """The copy path the engine uses for CUDA tensors (alloc + copy in/out), run on the CPU."""
    from dsv2_mlc.runtime.device import to_device, to_numpy
    from dsv2_mlc.runtime.tvm_runtime import load_runtime

    load_runtime("cpu")
    for arr in (np.arange(12, dtype=np.int32).reshape(3, 4), np.linspace(0, 1, 7, dtype="f4")):
        original = arr.copy()
        tensor = to_device(arr, "cpu", copy=True)
        arr[...] = 0  # a copy, not a view: the tensor keeps the values
        back = to_numpy(tensor)
        assert back.dtype == arr.dtype and back.shape == arr.shape
        np.testing.assert_array_equal(back, original)
    view = to_device(np.ones(3, np.float32), "cpu")
    assert to_numpy(view).tolist() == [1.0, 1.0, 1.0]

"""The GPU router kernel (one warp per token) builds for sm_90, greedy and group-limited.

Its numerics are checked on the H200 end to end (scripts/gpu_numerics.py: config A is greedy,
config B group-limited, 32 greedy tokens against HF float32; docs/gpu-numerics.md); the CPU
router, the same steps serially, is checked against HF and NumPy in the CPU tests, and this
kernel's CUDA source on the CPU against NumPy in ``tests/test_moe_decode_emulation.py``.
"""

from __future__ import annotations

import pytest
import tvm
from cuda_builds import needs_nvcc

from dsv2_mlc.compiler.cuda import cuda_codegen, make_cuda_target
from dsv2_mlc.schedules.moe_routing import GPU_WARPS_PER_BLOCK, moe_route, moe_route_gpu


@needs_nvcc
@pytest.mark.parametrize(
    "args",
    [
        (64, 6, 1, 1, False, 1.0),  # V2-Lite: greedy over 64
        (160, 6, 8, 3, False, 16.0),  # V2: group-limited, scaled
        (8, 2, 4, 2, True, 1.0),  # tiny config B-like, renormalised
    ],
)
def test_gpu_router_builds_for_sm90_with_warp_reductions(args):
    func = moe_route_gpu(*args)
    source = str(func.script())
    assert "__shfl_xor_sync" in source and "expf" in source
    target = make_cuda_target("sm_90")
    mod = tvm.IRModule({"route": func.with_attr("global_symbol", "route")})
    with cuda_codegen(), target:
        lib = tvm.compile(mod, target=target)
    # every warp of a block has its own scratch of all E scores (the ranks read all of them):
    # declared in CUDA at full size, not a TIR buffer TVM would shrink to the indices it sees
    cuda = lib.mod.imports[0].inspect_source()
    assert f"__shared__ float scratch[{GPU_WARPS_PER_BLOCK * args[0]}];" in cuda


@needs_nvcc  # make_cuda_target looks for nvcc
def test_router_choice_follows_the_target():
    gpu = moe_route(make_cuda_target("sm_90"), 64, 6, 1, 1, False, 1.0)
    cpu = moe_route(None, 64, 6, 1, 1, False, 1.0)
    assert "__shfl_xor_sync" in str(gpu.script())
    assert "__shfl_xor_sync" not in str(cpu.script())

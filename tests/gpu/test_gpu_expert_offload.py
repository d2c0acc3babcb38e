"""``Engine(experts="host")`` on the GPU: the routed experts in pinned, mapped host memory.

scripts/gpu_expert_offload.py runs each placement in a process of its own (random weights,
a prompt, greedy tokens after a warm-up run that captures the decode graphs): ``host`` must give
exactly the tokens of ``gpu`` (the same kernels read the same bits, over PCIe), and on V2-Lite
the device memory in use after the runs must be lower by about the routed experts' bytes
(7.4 GB), which the placement arithmetic (dsv2_mlc/runtime/placement.py) predicts from the
build's parameter list.
"""

from __future__ import annotations

import pytest
from lane_helpers import lane_build, script

from dsv2_mlc.runtime.placement import build_params, weight_bytes

pytestmark = pytest.mark.gpu


def test_tiny_int4_experts_in_host_memory_give_the_same_tokens(manifest, lib_dir):
    build = lane_build(manifest, "A-q4f16_g32")
    report = script("gpu_expert_offload").run_offload(
        str(build.path), lib_dir, prompt_len=64, gen_len=32
    )
    assert report["of"] == 32
    assert report["same_tokens"], report
    host = weight_bytes(build_params(build.path), "host")[1]
    assert report["host_expert_bytes"] == host > 0


def test_v2_lite_experts_in_host_memory_same_tokens_less_device_memory(v2_lite, lib_dir):
    report = script("gpu_expert_offload").run_offload(
        str(v2_lite.path), lib_dir, prompt_len=512, gen_len=32
    )
    assert report["same_tokens"], {k: v for k, v in report.items() if k != "placements"}
    gpu, host = weight_bytes(build_params(v2_lite.path), "host")
    assert report["host_expert_bytes"] == host > 7e9
    assert report["placements"]["host"]["weight_bytes"] == {"gpu": gpu, "host": host}
    saved = report["gpu_bytes_saved"]
    assert saved is not None and 0.9 * host <= saved <= 1.1 * host, (saved, host)

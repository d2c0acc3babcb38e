"""``Engine(experts="host")``: the routed experts in separately allocated host memory.

On a CPU build both placements are host memory, but ``"host"`` still allocates every routed
expert tensor apart (runtime/host_memory.py: a DLPack header and ``aligned_alloc``, the path the
CUDA build takes with pinned mapped memory) and fills or reads it there. Checked: the routed
expert names and their bytes against the config's arithmetic, the same logits and greedy tokens
as the all-resident engine (random INT4 weights and converted float weights), and a negative
control: zeroing one host expert tensor changes the logits, so the model reads those buffers.
"""

from __future__ import annotations

import gc
import json
import math

import numpy as np
import pytest
import tvm_ffi
from cuda_builds import model_build
from hf_reference import CONFIG_A, PROMPT

from dsv2_mlc.runtime.api_checks import EngineOptionError
from dsv2_mlc.runtime.placement import (
    build_params,
    is_routed_expert,
    param_bytes,
    weight_bytes,
)

QUANT = "q4f32_g32"
SEED = 7


@pytest.fixture(scope="module")
def int4_build():
    return model_build(CONFIG_A, QUANT, "cpu").out_dir


def _engine(path, experts: str, seed: int | None = SEED):
    from dsv2_mlc.runtime.engine import Engine

    return Engine(path, context_window=64, random_weights=seed, experts=experts)


def _moe_layers(cfg: dict) -> list[int]:
    first, freq = cfg["first_k_dense_replace"], cfg["moe_layer_freq"]
    return [i for i in range(cfg["num_hidden_layers"]) if i >= first and i % freq == 0]


def _expert_bytes_int4(cfg: dict, group: int, scale_bytes: int) -> int:
    """Bytes of one MoE layer's routed experts in INT4 (packed codes + one scale a group)."""
    e, i, h = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    gate_up = e * 2 * i * (h // 2 + (h // group) * scale_bytes)
    down = e * h * (i // 2 + (i // group) * scale_bytes)
    return gate_up + down


def test_routed_expert_names():
    assert is_routed_expert("model.layers.1.mlp.experts.gate_up_q_weight")
    assert is_routed_expert("model.layers.12.mlp.experts.down_proj")
    for name in (
        "model.layers.1.mlp.shared_experts.gate_up_proj",
        "model.layers.1.mlp.shared_experts.down_q_weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.mlp.gate_up_proj",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        assert not is_routed_expert(name), name


def test_expert_params_and_bytes_match_the_config(int4_build):
    params = build_params(int4_build)
    experts = [n for n, _, _ in params if is_routed_expert(n)]
    layers = _moe_layers(CONFIG_A)
    want = {
        f"model.layers.{i}.mlp.experts.{t}"
        for i in layers
        for t in ("gate_up_q_weight", "gate_up_q_scale", "down_q_weight", "down_q_scale")
    }
    assert set(experts) == want
    total = sum(param_bytes(s, d) for _, s, d in params)
    host = len(layers) * _expert_bytes_int4(CONFIG_A, group=32, scale_bytes=4)
    assert weight_bytes(params, "host") == (total - host, host)
    assert weight_bytes(params, "gpu") == (total, 0)
    with pytest.raises(ValueError, match="experts='disk'"):
        weight_bytes(params, "disk")


def test_engine_rejects_an_unknown_placement(int4_build):
    with pytest.raises(EngineOptionError, match="experts='cpu'.*gpu, host"):
        _engine(int4_build, "cpu")


def test_random_weights_in_host_memory_give_the_same_tokens(int4_build):
    gpu, host = _engine(int4_build, "gpu"), _engine(int4_build, "host")
    params = build_params(int4_build)
    want_gpu, want_host = weight_bytes(params, "host")
    assert host.weight_bytes() == {"gpu": want_gpu, "host": want_host}
    assert gpu.weight_bytes() == {"gpu": want_gpu + want_host, "host": 0}
    # the same bits in every parameter (the fill kernels wrote the host buffers in place)
    from dsv2_mlc.runtime.device import to_numpy

    host_params = dict(host.named_params())
    for name, t in gpu.named_params():
        np.testing.assert_array_equal(to_numpy(host_params[name]), to_numpy(t), err_msg=name)
    np.testing.assert_array_equal(host.logits(PROMPT), gpu.logits(PROMPT))
    ref = gpu.generate(PROMPT, max_new_tokens=24).token_ids
    assert host.generate(PROMPT, max_new_tokens=24).token_ids == ref
    # negative control: the model reads the host buffers (zero one layer's down weights)
    name = f"model.layers.{_moe_layers(CONFIG_A)[0]}.mlp.experts.down_q_weight"
    view = np.from_dlpack(host_params[name])
    view[...] = 0
    assert not np.array_equal(host.logits(PROMPT), gpu.logits(PROMPT))


def test_converted_weights_read_into_host_memory_give_the_same_tokens(compiled):
    from dsv2_mlc.runtime.engine import Engine

    path = compiled["A"]
    gpu = Engine(path, context_window=64)
    host = Engine(path, context_window=64, experts="host")
    total = sum(math.prod(t.shape) * np.dtype(str(t.dtype)).itemsize for _, t in gpu.named_params())
    moved = host.weight_bytes()["host"]
    assert moved == weight_bytes(build_params(path), "host")[1] > 0
    assert host.weight_bytes()["gpu"] == total - moved
    np.testing.assert_array_equal(host.logits(PROMPT), gpu.logits(PROMPT))
    ref = gpu.generate(PROMPT, max_new_tokens=24).token_ids
    assert host.generate(PROMPT, max_new_tokens=24).token_ids == ref


def test_host_buffers_outlive_the_engine_only_through_their_tensors(int4_build):
    """A tensor taken from the engine keeps its host buffer; dropping all frees it (no crash,
    the memory returned: the next engine's buffers may reuse it)."""
    from dsv2_mlc.runtime.device import to_numpy

    eng = _engine(int4_build, "host")
    name, tensor = next((n, t) for n, t in eng.named_params() if is_routed_expert(n))
    before = to_numpy(tensor)
    del eng
    gc.collect()
    np.testing.assert_array_equal(to_numpy(tensor), before)
    del tensor
    gc.collect()
    again = dict(_engine(int4_build, "host").named_params())[name]
    np.testing.assert_array_equal(to_numpy(again), before)


def test_host_tensor_header_device_and_deleter():
    """The DLPack header of a host tensor (runtime/host_memory.py) as the CUDA path builds it:
    device cuda:0, the data after the header at the device address, and the allocation freed
    (the deleter called with its start) exactly when the last reference goes."""
    import ctypes

    from dsv2_mlc.runtime import host_memory

    freed: list[int] = []
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def record_free(ptr):
        freed.append(int(ptr))
        libc.free(ptr)

    class FakeCuda(host_memory._CpuAllocator):
        """Host memory labelled as the device's, at a device address 1 MiB past the host one."""

        def __init__(self) -> None:
            super().__init__()
            self.device_type = 2  # kDLCUDA
            self.free_fn = int(ctypes.cast(record_free, ctypes.c_void_p).value)

        def alloc(self, nbytes: int) -> tuple[int, int]:
            host, _ = super().alloc(nbytes)
            return host, host + (1 << 20)

    weights = host_memory.HostWeights("cpu")
    weights._alloc = FakeCuda()
    tensor, data = weights.tensor("model.layers.1.mlp.experts.down_q_weight", (3, 5, 7), "uint32")
    base = data - host_memory.HEADER_BYTES
    assert (tensor.device.dlpack_device_type(), tensor.device.index) == (2, 0)
    assert tuple(tensor.shape) == (3, 5, 7) and str(tensor.dtype) == "uint32"
    assert tensor.data_ptr() == base + (1 << 20) + host_memory.HEADER_BYTES
    assert data % 256 == 0 and weights.bytes == 3 * 5 * 7 * 4
    assert weights.names == ["model.layers.1.mlp.experts.down_q_weight"]
    arr = tvm_ffi.Array([tensor])
    del tensor
    gc.collect()
    assert freed == []  # the array still holds it
    del arr
    gc.collect()
    assert freed == [base]


def test_bench_reports_the_placement(int4_build, tmp_path, capsys):
    from dsv2_mlc.cli import build_parser, main

    report = tmp_path / "bench.json"
    argv = ["bench", str(int4_build), "--prompt-len", "8", "--gen-len", "3", "--warmup", "0"]
    argv += ["--repeat", "1", "--seed", str(SEED), "--experts", "host", "--json", str(report)]
    rc = main(argv)
    assert rc == 0
    assert "of routed experts in pinned host memory (experts=host)" in capsys.readouterr().out
    r = json.loads(report.read_text())
    gpu, host = weight_bytes(build_params(int4_build), "host")
    assert r["options"]["experts"] == "host"
    assert r["model"]["placement"] == {
        "experts": "host",
        "weight_bytes": {"gpu": gpu, "host": host},
    }
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", str(int4_build), "--experts", "disk"])
    assert build_parser().parse_args(["chat", "--experts", "host"]).experts == "host"
    # None: the engine's gpu, or where a --gpu-memory plan puts them
    assert build_parser().parse_args(["chat"]).experts is None

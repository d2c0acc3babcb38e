"""Weight conversion streams: its peak memory is bounded by one expert / one checkpoint tensor.

DeepSeek-V2 (236B) stacks 160 routed experts per MoE layer; converting such a stack whole in
float32 (10 GB for one layer's ``gate_up_proj``, several times that in the INT4 quantizer's
temporaries) cannot run on a build machine with less memory than that. Here a bfloat16
checkpoint whose stacked experts dominate (64 experts; every other tensor at most one expert's
size) is converted and INT4-quantized the way ``dsv2-mlc compile`` does it, consuming each
parameter and letting go of it, as ``tvmjs.dump_tensor_cache`` does; NumPy's allocations are
traced (tracemalloc) and the peak must stay within a small multiple of one expert's float32
block plus the largest output array, far below the float32 stack. The converted values are
checked against the stack built from the checkpoint read by ``safetensors`` (torch) and quantized
in one :func:`quantize_int4` call.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from hf_reference import BASE
from scripts_module import load_script

from dsv2_mlc.compiler.compile import _export, converted_params, make_target
from dsv2_mlc.model.checkpoint import SafetensorsCheckpoint
from dsv2_mlc.model.config import DeepseekV2Config
from dsv2_mlc.model.weights import check_checkpoint, weight_map
from dsv2_mlc.quant import get_quantization, quantize_blockwise, quantize_int4

EXPERTS, HIDDEN, MOE_INTER = 64, 256, 256
CONFIG = {
    **BASE,
    "vocab_size": 256,
    "hidden_size": HIDDEN,
    "intermediate_size": 256,
    "moe_intermediate_size": MOE_INTER,
    "num_hidden_layers": 1,
    "first_k_dense_replace": 0,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": EXPERTS,
    "n_shared_experts": 1,
    "q_lora_rank": None,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
}
EXPERT_BLOCK = 2 * MOE_INTER * HIDDEN * 4  # one expert's gate_up block in float32 (512 KiB)
STACK = EXPERTS * EXPERT_BLOCK  # the float32 gate_up stack of the layer (32 MiB)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("experts_ckpt")
    (path / "config.json").write_text(json.dumps(CONFIG))
    load_script("make_synthetic_checkpoint").write_checkpoint(path, shard_gb=0.01, seed=3)
    return path


def _stream(path, quantization: str):
    cfg = DeepseekV2Config.from_file(path)
    _, named, plan = _export(cfg, make_target("cpu"), get_quantization(quantization))
    convs = weight_map(cfg)
    ckpt = SafetensorsCheckpoint(path)
    check_checkpoint(convs, ckpt)
    return cfg, convs, ckpt, plan, {name: str(p.dtype) for name, p in named}


def _traced_peak(path, quantization: str) -> tuple[int, int, int]:
    """(peak traced bytes, largest output array, largest non-expert source in float32)."""
    cfg, convs, ckpt, plan, dtypes = _stream(path, quantization)
    largest_source = max(
        4 * int(np.prod(shape)) for c in convs if not c.experts for _, shape in c.sources
    )
    largest_out = 0
    try:
        tracemalloc.start()
        for _, arr in converted_params(convs, ckpt, dtypes, plan):
            largest_out = max(largest_out, arr.nbytes)
            del arr
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        ckpt.close()
    return peak, largest_out, largest_source


@pytest.mark.parametrize("quantization", ["q4f16_g128", "q0f16"])
def test_peak_is_bounded_by_one_expert_not_the_stack(checkpoint, quantization):
    peak, largest_out, largest_source = _traced_peak(checkpoint, quantization)
    assert largest_source <= EXPERT_BLOCK  # the experts dominate this checkpoint
    bound = largest_out + 8 * EXPERT_BLOCK
    assert bound < STACK  # the bound excludes holding the float32 stack
    assert peak <= bound, (
        f"converting held {peak / 2**20:.1f} MiB at peak; one expert's float32 block is "
        f"{EXPERT_BLOCK / 2**20:.2f} MiB, the largest output {largest_out / 2**20:.2f} MiB, "
        f"the float32 stack {STACK / 2**20:.0f} MiB"
    )


def test_converted_experts_match_the_checkpoint(checkpoint):
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        hf.update(load_file(str(f)))

    def f32(name):
        return hf[name].float().numpy()

    cfg, convs, ckpt, plan, dtypes = _stream(checkpoint, "q4f16_g128")
    try:
        ours = dict(converted_params(convs, ckpt, dtypes, plan))
    finally:
        ckpt.close()
    p = "model.layers.0.mlp.experts"
    gate_up = np.stack(
        [
            np.concatenate([f32(f"{p}.{e}.gate_proj.weight"), f32(f"{p}.{e}.up_proj.weight")])
            for e in range(EXPERTS)
        ]
    )
    down = np.stack([f32(f"{p}.{e}.down_proj.weight") for e in range(EXPERTS)])
    for name, ref in ((f"{p}.gate_up_proj", gate_up), (f"{p}.down_proj", down)):
        q = plan[name]
        packed, scale = quantize_int4(ref, q.group_size, q.scale_dtype)
        np.testing.assert_array_equal(ours[q.q_weight], packed)
        np.testing.assert_array_equal(ours[q.q_scale], scale)
    emb = plan["model.embed_tokens.weight"]
    packed, scale = quantize_int4(f32("model.embed_tokens.weight"), emb.group_size, "float16")
    np.testing.assert_array_equal(ours[emb.q_weight], packed)
    np.testing.assert_array_equal(ours[emb.q_scale], scale)


class _Stack:
    """A [n, rows, k] stack read entry by entry (as the converter's ExpertStack is)."""

    def __init__(self, arr):
        self.arr, self.shape, self.reads = arr, arr.shape, []

    def __getitem__(self, i):
        self.reads.append(i)
        return self.arr[i]


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("block_values", [1, 300, 1 << 22])
def test_blockwise_quantization_is_bytewise_one_call(group, block_values):
    rng = np.random.default_rng(group + block_values)
    w = rng.standard_normal((5, 7, 96)).astype(np.float32)
    w[1, 2, :40] = 0  # an all-zero group
    packed, scale = quantize_int4(w, group, "float16")
    for source in (w, _Stack(w)):
        p, s = quantize_blockwise(source, group, "float16", block_values)
        assert p.dtype == np.uint32 and s.dtype == np.float16
        np.testing.assert_array_equal(p, packed)
        np.testing.assert_array_equal(s, scale)
    stack = _Stack(w)
    quantize_blockwise(stack, group, "float16", block_values)
    assert stack.reads == list(range(5))  # each entry read once, in order


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_checkpoint_reads_into_out(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(300, 40, generator=gen).to(getattr(torch, dtype))
    pad = torch.ones(3, dtype=torch.float16)  # a second tensor: "w" need not start the data
    save_file({"w": t, "pad": pad}, str(tmp_path / "m.safetensors"))
    ref = t.float().numpy()
    ckpt = SafetensorsCheckpoint(tmp_path)
    try:
        np.testing.assert_array_equal(ckpt.get("w"), ref)
        block = np.full((700, 40), np.nan, np.float32)
        rows = block[200:500]
        assert ckpt.get("w", out=rows) is rows
        np.testing.assert_array_equal(block[200:500], ref)
        assert np.isnan(block[:200]).all() and np.isnan(block[500:]).all()
        with pytest.raises(ValueError, match="shape"):
            ckpt.get("w", out=block[:10])
    finally:
        ckpt.close()

"""The memory budget planner (dsv2_mlc/runtime/memory_plan.py): its arithmetic for DeepSeek-V2-Lite
against figures computed by hand from the config, its refusals, size parsing, and
``Engine(gpu_memory=...)`` on a tiny CPU build."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hf_reference import CONFIG_A

from dsv2_mlc.layout import BuildConfig
from dsv2_mlc.runtime.memory_plan import (
    DeviceMemory,
    GiB,
    MemoryBudgetError,
    MiB,
    ModelMemory,
    budget_needed,
    is_out_of_memory,
    longest_context,
    parse_size,
    plan_memory,
)

# DeepSeek-V2-Lite's config.json (the published one, as the fields the planner reads)
V2_LITE = {
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 163840,
}
GROUP = 128  # q4f16_g128


def _int4(name: str, out: int, fan_in: int, experts: int = 0) -> list[tuple]:
    """The compiled layout of an INT4 linear: 8 codes per uint32 word, a float16 scale per
    group of 128 input features (optionally stacked for ``experts``)."""
    lead = (experts,) if experts else ()
    sep = "_" if experts else "."
    return [
        (f"{name}{sep}q_weight", (*lead, out, fan_in // 8), "uint32"),
        (f"{name}{sep}q_scale", (*lead, out, -(-fan_in // GROUP)), "float16"),
    ]


def v2_lite_params() -> list[tuple]:
    """V2-Lite's parameters as the compiler lays them out for q4f16_g128 (names, shapes, dtypes):
    the embedding and every linear in INT4, the absorbed MLA matrices, norms in float16, the
    router in float32, each MoE layer's routed experts stacked."""
    c = V2_LITE
    h, heads, inter, moe = 2048, 16, 10944, 1408
    params = _int4("model.embed_tokens", c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        params += _int4(f"{p}.self_attn.qkv_a_proj", heads * 192 + 576, h)
        params += [(f"{p}.self_attn.kv_a_layernorm.weight", (512,), "float16")]
        params += [
            (f"{p}.self_attn.kv_b_proj.{x}", (heads, 128, 512), "float16") for x in ("w_uk", "w_uv")
        ]
        params += _int4(f"{p}.self_attn.o_proj", h, heads * 128)
        if i == 0:
            params += _int4(f"{p}.mlp.gate_up_proj", 2 * inter, h)
            params += _int4(f"{p}.mlp.down_proj", h, inter)
        else:
            params += [(f"{p}.mlp.gate.weight", (64, h), "float32")]
            params += _int4(f"{p}.mlp.experts.gate_up", 2 * moe, h, experts=64)
            params += _int4(f"{p}.mlp.experts.down", h, moe, experts=64)
            params += _int4(f"{p}.mlp.shared_experts.gate_up_proj", 2 * 2 * moe, h)
            params += _int4(f"{p}.mlp.shared_experts.down_proj", h, 2 * moe)
        params += [
            (f"{p}.{n}.weight", (h,), "float16")
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
    params += [("model.norm.weight", (h,), "float16")]
    return params + _int4("lm_head", c["vocab_size"], h)


def v2_lite(kv_dtype: str = "float8_e4m3fn", device: str = "cuda") -> ModelMemory:
    build = BuildConfig(1, V2_LITE, "float16", device, "", kv_dtype=kv_dtype)
    return ModelMemory.from_params(build, v2_lite_params())


# explicit constants, so the figures below do not follow the table's
CONSTANTS = DeviceMemory(
    runtime_overhead=500 * MiB,
    workspace_fixed=64 * MiB,
    workspace_scale=1.5,
    cuda_graphs=32 * MiB,
    source="test",
)
# hand: one routed expert = gate+up [2816, 2048] and down [2048, 1408] in INT4 (half a byte a
# weight) plus a 2-byte scale per 128 weights; 26 MoE layers x 64 experts
EXPERT = (2816 * 2048 + 2048 * 1408) // 2 + (2816 * 16 + 2048 * 11) * 2
ROUTED = 26 * 64 * EXPERT
# hand: per prefill token, fp16 activations: 4 x hidden, attention (qkv_a 16 x 192 + 576, the
# normed latent 576, 16 heads x (q and k 192, v and out 128)), the widest MLP (6 experts x
# (gate, up, act 1408 + out 2048) > dense 3 x 10944)
WORKSPACE_PER_TOKEN = (4 * 2048 + 3648 + 576 + 16 * 640 + 6 * (3 * 1408 + 2048)) * 2


def _int4_bytes(out: int, fan_in: int) -> int:
    return out * fan_in // 2 + out * -(-fan_in // 128) * 2


def test_v2_lite_weights_match_the_hand_figures():
    m = v2_lite()
    assert EXPERT == 4_460_544  # "4.46 MB" an expert (notes)
    assert m.routed_expert_bytes == ROUTED
    assert m.routed_expert_bytes / GiB == pytest.approx(6.913, abs=5e-4)  # notes: 6.91 GiB
    # resident, by hand: the notes' 0.534 GiB of non-expert weights count kv_b_proj in INT4,
    # the router gates in 16 bits, and leave the embedding out; this build keeps w_uk / w_uv in
    # float16, the gates in float32 and the embedding in INT4
    embedding = _int4_bytes(102400, 2048)
    absorbed = 27 * 2 * 16 * 128 * 512 * 2
    kv_b_int4 = 27 * _int4_bytes(16 * 256, 512)
    gates_fp32_over_16 = 26 * 64 * 2048 * 2
    notes_non_expert = m.resident_bytes - embedding - absorbed + kv_b_int4 - gates_fp32_over_16
    assert notes_non_expert / GiB == pytest.approx(0.534, abs=2e-3)
    assert m.workspace_per_token == WORKSPACE_PER_TOKEN == 120_576


@pytest.mark.parametrize("kv_dtype, per_token", [("float8_e4m3fn", 17_280), ("", 31_104)])
def test_kv_bytes_per_token_and_the_page_pool(kv_dtype, per_token):
    m = v2_lite(kv_dtype)
    # notes: 27 layers x 576 values (FP8: 512 one-byte latent values + 64 float16 rope values)
    assert m.kv_bytes_per_token == per_token
    plan = plan_memory(m, "64GiB", 131072, 1, constants=CONSTANTS)
    # 131,072 tokens plus one page for the batch's one sequence
    assert plan.kv_cache == (131072 + 16) * per_token
    plan = plan_memory(m, "64GiB", 1000, 3, constants=CONSTANTS)
    assert plan.kv_capacity == 3000
    assert plan.kv_cache == math.ceil((3000 + 3 * 16) / 16) * 16 * per_token


def test_128k_fp8_in_4_gib_puts_the_experts_in_host_memory():
    m = v2_lite()
    plan = plan_memory(m, "4GiB", 131072, 1, constants=CONSTANTS)
    assert plan.experts == "host" and plan.host_experts == ROUTED
    assert plan.weights == m.resident_bytes
    assert plan.kv_cache == 131088 * 17_280  # 27 layers x (512 + 64 * 2) bytes
    # the largest chunk of 8192, 4096, 2048, 1024, 512 that fits, by hand
    fixed = m.resident_bytes + plan.kv_cache + 500 * MiB + 32 * MiB + 64 * MiB + 102400 * 4
    room = 4 * GiB - fixed
    chunk = next(c for c in (8192, 4096, 2048, 1024, 512) if 1.5 * WORKSPACE_PER_TOKEN * c <= room)
    assert plan.prefill_chunk_size == chunk
    assert plan.workspace == int(64 * MiB + 1.5 * WORKSPACE_PER_TOKEN * chunk + 102400 * 4)
    assert plan.total == fixed - 64 * MiB - 102400 * 4 + plan.workspace <= 4 * GiB
    text = plan.table()
    for part in ("weights (without the routed experts)", "KV cache (131,072 tokens)", "total"):
        assert part in text
    assert "routed experts in pinned host memory" in text


def test_a_roomy_budget_keeps_the_experts_on_the_gpu_with_full_chunks():
    plan = plan_memory(v2_lite(), "16GiB", 8192, 1, constants=CONSTANTS)
    assert plan.experts == "gpu" and plan.prefill_chunk_size == 8192
    assert plan.weights == v2_lite().resident_bytes + ROUTED and plan.host_experts == 0


def test_fp16_cache_at_128k_in_4_gib_is_refused_with_the_breakdown():
    m = v2_lite("")
    with pytest.raises(MemoryBudgetError) as info:
        plan_memory(m, "4GiB", 131072, 1, constants=CONSTANTS)
    msg = str(info.value)
    kv = 131088 * 31_104
    assert f"KV {kv / GiB:.2f} GiB at context 131,072" in msg
    assert f"weights {m.resident_bytes / MiB:.2f} MiB" in msg
    assert "runtime overhead 500.00 MiB" in msg and "vs budget 4.00 GiB" in msg
    assert "prefill chunks of 512" in msg  # the smallest layout is the one shown
    # what would fit, by hand: whole pages after the smallest layout's other parts
    others = (
        m.resident_bytes + 500 * MiB + 32 * MiB + int(64 * MiB + 1.5 * WORKSPACE_PER_TOKEN * 512)
    )
    others += 102400 * 4
    longest = (4 * GiB - others) // (16 * 31_104) * 16 - 16
    assert f"holds at most {longest:,} tokens" in msg
    needed = others + kv
    assert f"at least {needed / GiB:.2f} GiB ({needed:,} B)" in msg
    # and those figures are the boundaries
    assert longest_context(m, "4GiB", 1, constants=CONSTANTS) == longest
    plan_memory(m, 4 * GiB, longest, 1, constants=CONSTANTS)
    with pytest.raises(MemoryBudgetError):
        plan_memory(m, 4 * GiB, longest + 1, 1, constants=CONSTANTS)
    assert budget_needed(m, 131072, 1, constants=CONSTANTS) == needed
    assert plan_memory(m, needed, 131072, 1, constants=CONSTANTS).total == needed
    with pytest.raises(MemoryBudgetError):
        plan_memory(m, needed - 1, 131072, 1, constants=CONSTANTS)


def test_the_notes_fp16_limit_at_4_gib():
    """The notes' layout (0.534 GiB of non-expert weights, 0.25 GiB workspace, one layer's 6
    experts double-buffered, nothing else) holds 109,297 tokens of fp16 cache in 4 GiB."""
    notes = ModelMemory("cuda", int(0.534 * GiB), ROUTED, 31_104, 0, 0, 163840)
    constants = DeviceMemory(0, int(0.25 * GiB) + 2 * 6 * EXPERT, 0.0, 0, "notes")
    longest = longest_context(notes, "4GiB", 1, constants=constants)
    assert abs(longest - 109_297) <= 32  # whole pages, one page per sequence


def test_batch_and_explicit_options_are_honoured():
    m = v2_lite()
    plan = plan_memory(m, "40GiB", 4096, 8, prefill_chunk_size=1024, constants=CONSTANTS)
    assert (plan.kv_capacity, plan.prefill_chunk_size, plan.experts) == (32768, 1024, "gpu")
    plan = plan_memory(m, "40GiB", 4096, 8, experts="host", constants=CONSTANTS)
    assert plan.experts == "host"
    with pytest.raises(MemoryBudgetError, match="experts='elsewhere'"):
        plan_memory(m, "40GiB", 4096, 8, experts="elsewhere", constants=CONSTANTS)
    # a context below the smallest chunk: the chunk is the KV capacity, as the engine caps it
    assert plan_memory(m, "40GiB", 300, 1, constants=CONSTANTS).prefill_chunk_size == 300


def test_a_budget_below_the_fixed_parts_holds_no_context():
    with pytest.raises(MemoryBudgetError, match="holds no context at all"):
        plan_memory(v2_lite(), "512MiB", 4096, 1, constants=CONSTANTS)


@pytest.mark.parametrize(
    "text, size",
    [
        ("4GiB", 4 * 2**30),
        ("4.5G", int(4.5 * 2**30)),
        ("3500MiB", 3500 * 2**20),
        (" 2 gib ", 2 * 2**30),
        ("4GB", 4 * 10**9),
        ("512k", 512 * 1024),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("junk", ["four", "4XB", "", "-1G", "0", 0, -5, True, 4.5, None, "4 G B"])
def test_junk_sizes_are_refused(junk):
    with pytest.raises(MemoryBudgetError, match="memory size"):
        parse_size(junk)


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(RuntimeError("InternalError: CUDA: out of memory"))
    assert is_out_of_memory(RuntimeError("cudaErrorMemoryAllocation (2)"))
    assert is_out_of_memory(RuntimeError("std::bad_alloc"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("The KV cache is full. No page can be allocated."))


# -- the engine, on a tiny CPU build ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(model_builds) -> Path:
    """Config A, INT4, compiled for the CPU with random weights (the session's shared build)."""
    return model_builds.get(CONFIG_A, "q4f32_g32", "cpu").out_dir


def _tiny_expert_bytes() -> int:
    """Config A's routed experts, by hand: 2 MoE layers x 8 experts x (gate+up [64, 64] and
    down [64, 32]) in INT4 with a float32 scale per 32 weights."""
    weights = 2 * 32 * 64 + 64 * 32
    return 2 * 8 * (weights // 2 + weights // 32 * 4)


def test_engine_plans_inside_its_budget(tiny):
    from dsv2_mlc.runtime.engine import Engine

    model = ModelMemory.from_build(tiny)
    assert model.routed_expert_bytes == _tiny_expert_bytes()
    params = json.loads((tiny / "random-params.json").read_text())["params"]
    total = sum(math.prod(p["shape"]) * 4 for p in params)  # every tensor 4-byte here
    assert model.resident_bytes + model.routed_expert_bytes == total

    from dsv2_mlc.runtime import engine as engine_module
    from dsv2_mlc.runtime import memory_plan

    assert engine_module.PAGE_SIZE == memory_plan.PAGE_SIZE  # the pool the plan counts
    engine = Engine(tiny, context_window=1024, max_batch_size=2, random_weights=0,
                    gpu_memory="64MiB")  # fmt: skip
    plan = engine.memory_plan
    assert plan.device == "cpu" and plan.experts == "gpu" and plan.runtime_overhead == 0
    assert plan.weights == total and plan.kv_capacity == engine.kv_capacity == 2048
    assert engine.prefill_chunk_size == plan.prefill_chunk_size == 512  # the CPU default
    assert plan.kv_cache == (2048 + 32) * BuildConfig.read(tiny).kv_bytes_per_token()
    seq = engine.add_sequence()
    assert engine.prefill([seq], [[t % 512 for t in range(600)]])[0].shape == (512,)  # two chunks
    assert Engine(tiny, context_window=64, random_weights=0).memory_plan is None


def test_engine_refuses_a_budget_before_loading(tiny):
    from dsv2_mlc.runtime.engine import Engine

    with pytest.raises(MemoryBudgetError) as info:
        Engine(tiny, context_window=100_000, max_batch_size=4, random_weights=0,
               gpu_memory="20MiB")  # fmt: skip
    msg = str(info.value)
    assert "cannot hold a context of 100,000 tokens x batch 4" in msg
    assert "need a budget of at least" in msg and "holds at most" in msg
    with pytest.raises(MemoryBudgetError, match="cannot read 'lots'"):
        Engine(tiny, random_weights=0, gpu_memory="lots")


def test_engine_reports_out_of_memory_with_the_plan(tiny):
    from dsv2_mlc.runtime.engine import Engine

    engine = Engine(tiny, context_window=256, random_weights=0, gpu_memory="64MiB")

    def fails(*args):
        raise RuntimeError("InternalError: Check failed: CUDA: out of memory")

    engine._fn["batch_prefill"] = fails
    seq = engine.add_sequence()
    with pytest.raises(MemoryBudgetError) as info:
        engine.prefill([seq], [[1, 2, 3]])
    msg = str(info.value)
    assert "out of memory inside the memory plan" in msg and "KV" in msg and "64.00 MiB" in msg
    engine._fn["batch_prefill"] = lambda *a: (_ for _ in ()).throw(RuntimeError("other"))
    with pytest.raises(RuntimeError, match="other"):  # anything else passes unchanged
        engine.prefill([seq], [[1, 2, 3]])


def test_bench_plans_and_reports_the_plan(tiny, tmp_path, capsys):
    from dsv2_mlc.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", str(tiny), "--prompt-len", "600", "--gen-len", "3", "--warmup", "0",
            "--repeat", "1", "--gpu-memory", "64MiB", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "memory plan: budget 64.00 MiB" in capsys.readouterr().out
    plan = json.loads(out.read_text())["memory_plan"]
    assert plan["kv_capacity"] == 603 and plan["prefill_chunk_size"] == 512  # planned chunks
    assert plan["total"] == sum(
        plan[k] for k in ("weights", "kv_cache", "workspace", "cuda_graphs", "runtime_overhead")
    )
    assert main([*argv[:-4], "--gpu-memory", "100KiB"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold a context of 603 tokens" in err and "need a budget of at least" in err


def test_gpu_memory_flag_rejects_junk(capsys):
    from dsv2_mlc.cli import main

    for command in (["chat"], ["bench", "somewhere"]):
        with pytest.raises(SystemExit):
            main([*command, "--gpu-memory", "4 gigs"])
        assert "cannot read '4 gigs' as a memory size" in capsys.readouterr().err


def test_large_batch_workspace_holds_the_lm_head_copy():
    """From GEMM_DECODE_FROM sequences a decode step runs batch_decode_gemm, whose workspace
    holds the float16 copy of the INT4 lm_head: 102,400 x 2,048 x 2 B for V2-Lite."""
    from dsv2_mlc.runtime.memory_plan import GEMM_DECODE_FROM

    m = v2_lite()
    assert m.lm_head_copy_bytes == 102400 * 2048 * 2
    below, at = (
        plan_memory(m, "80GiB", 1024, b, prefill_chunk_size=2048, constants=CONSTANTS)
        for b in (GEMM_DECODE_FROM - 1, GEMM_DECODE_FROM)
    )
    logits = 102400 * 4  # one more sequence's float32 logits
    assert at.workspace - below.workspace == m.lm_head_copy_bytes + logits

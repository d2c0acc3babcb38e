"""Config-only builds with random weights made by the runtime, their export as an HF checkpoint,
and ``dsv2-mlc bench`` (CPU, tiny config A)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import CONFIGS, PROMPT, hf_logits

from dsv2_mlc.cli import main
from dsv2_mlc.layout import BuildError
from dsv2_mlc.quant import dequantize_int4
from dsv2_mlc.runtime.device import to_numpy


@pytest.fixture(scope="module")
def random_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Config A compiled from its config.json alone, through the CLI, in fp32 and INT4."""
    root = tmp_path_factory.mktemp("random")
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(CONFIGS["A"]))
    builds = {}
    for quant in ("q0f32", "q4f32_g32"):
        out = root / quant
        rc = main(["compile", str(root / "cfg"), "--random-weights", "-o", str(out),
                   "--quantization", quant])  # fmt: skip
        assert rc == 0
        builds[quant] = out
    return builds


def _engine(path: Path, seed: int):
    from dsv2_mlc.runtime.engine import Engine

    return Engine(path, context_window=128, random_weights=seed)


def _host_params(engine) -> dict[str, np.ndarray]:
    return {name: to_numpy(t) for name, t in engine.named_params()}


def test_config_only_build_has_no_weights_and_needs_a_seed(random_builds):
    from dsv2_mlc.runtime.engine import Engine

    path = random_builds["q4f32_g32"]
    assert not (path / "params").exists() and (path / "random-params.json").is_file()
    with pytest.raises(BuildError, match="random weights"):
        Engine(path)


@pytest.mark.parametrize("quant", ["q0f32", "q4f32_g32"])
def test_random_params_are_deterministic_per_seed(quant, random_builds):
    from dsv2_mlc.layout import read_spec
    from dsv2_mlc.runtime.random_params import reference_fill

    path = random_builds[quant]
    a, b, c = (_host_params(_engine(path, s)) for s in (7, 7, 8))
    assert list(a) == json.loads((path / "dsv2-mlc.json").read_text())["param_names"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        if not name.endswith(("norm.weight", "q_scale")):  # constants do not depend on the seed
            assert (a[name] != c[name]).mean() > 0.9, name
    # The device kernels and their NumPy mirror agree (up to float rounding of the affine map).
    for index, p in enumerate(read_spec(path)):
        ref = reference_fill(p, 7, index)
        if p.dtype == "uint32":
            np.testing.assert_array_equal(a[p.name], ref)
        else:
            np.testing.assert_allclose(a[p.name], ref, rtol=0, atol=1e-6 * (1 + abs(p.center)))


def test_random_weights_have_the_intended_statistics(random_builds):
    q0 = _host_params(_engine(random_builds["q0f32"], 3))
    q4 = _host_params(_engine(random_builds["q4f32_g32"], 3))
    for name, w in q0.items():
        if name.endswith("norm.weight"):
            assert np.all(w == 1.0), name
        elif name.startswith("model.embed_tokens."):
            assert w.std() == pytest.approx(1.0, rel=0.05)
        else:
            assert w.dtype == np.float32
            assert w.std() * math.sqrt(w.shape[-1]) == pytest.approx(1.0, rel=0.1), name
            assert abs(w.mean()) < 0.1 * w.std(), name
    for name, packed in q4.items():
        if not name.endswith("q_weight"):
            continue
        codes = (packed[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
        assert codes.min() == 1 and codes.max() == 15, name  # symmetric: -7..7 after the offset
        w = dequantize_int4(packed, q4[name[: -len("weight")] + "scale"], 32)
        std = 1.0 if name.startswith("model.embed_tokens.") else 1 / math.sqrt(w.shape[-1])
        assert w.std() == pytest.approx(std, rel=0.1), name
        assert abs(w.mean()) < 0.1 * std, name


@pytest.mark.parametrize(("quant", "tol"), [("q0f32", 1e-4), ("q4f32_g32", 1e-3)])
def test_exported_hf_checkpoint_reproduces_our_logits(quant, tol, random_builds, tmp_path):
    from transformers import DeepseekV2ForCausalLM

    from dsv2_mlc.hf_export import INDEX_FILE, save_hf_checkpoint

    engine = _engine(random_builds[quant], 5)
    out = save_hf_checkpoint(engine, tmp_path / "hf", dtype="float32", shard_bytes=200_000)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in config
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]  # hub layout
    assert "model.layers.0.self_attn.kv_b_proj.weight" in index["weight_map"]
    hf = DeepseekV2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, ref = engine.logits(PROMPT), hf_logits(hf, PROMPT)
    assert np.abs(ours - ref).max() < tol
    assert engine.generate(PROMPT, 8, stop_token_ids=[]).token_ids == [
        int(t) for t in _greedy_hf(hf, PROMPT, 8)
    ]


def _greedy_hf(model, ids: list[int], n: int) -> list[int]:
    from hf_reference import hf_greedy

    return hf_greedy(model, ids, n)


def test_load_into_hf_without_disk_equals_the_export(random_builds, tmp_path):
    from transformers import DeepseekV2ForCausalLM

    from dsv2_mlc.hf_export import load_into_hf, save_hf_checkpoint

    engine = _engine(random_builds["q4f32_g32"], 9)
    direct = load_into_hf(engine, device="cpu", dtype="float32")
    saved = save_hf_checkpoint(engine, tmp_path / "hf", dtype="float32")
    disk = DeepseekV2ForCausalLM.from_pretrained(saved, dtype=torch.float32)
    for (name, a), (name_b, b) in zip(
        direct.state_dict().items(), disk.state_dict().items(), strict=True
    ):
        assert name == name_b
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_bfloat16_export_rounds_to_nearest_even_like_torch():
    from dsv2_mlc.hf_export import to_bfloat16_bits

    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    x[:4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, 65504.0]  # ties: to even, both directions
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bfloat16_bits(x), ref)


def test_expected_distinct_experts():
    from dsv2_mlc.bench import expected_experts

    assert expected_experts(64, 6, 1) == pytest.approx(6.0)
    assert expected_experts(64, 6, 2) == pytest.approx(64 * (1 - (58 / 64) ** 2))
    assert expected_experts(64, 6, 10_000) == pytest.approx(64.0)


def test_bench_cli_reports_every_field(random_builds, tmp_path, capsys):
    path = random_builds["q4f32_g32"]
    report_file = tmp_path / "bench.json"
    prompt, gen, repeat = 12, 5, 2
    rc = main(
        ["bench", str(path), "--prompt-len", str(prompt), "--gen-len", str(gen), "--warmup", "0",
         "--repeat", str(repeat), "--profile", "--profile-steps", "2", "--compare-hf",
         "--hf-dtype", "float32", "--hf-decode-tokens", "3", "--hbm-bandwidth", "1e11",
         "--json", str(report_file)]
    )  # fmt: skip
    assert rc == 0
    assert "decode:" in capsys.readouterr().out
    r = json.loads(report_file.read_text())
    cfg = CONFIGS["A"]

    p, d, f = r["prefill"], r["decode"], r["roofline"]
    assert len(p["prefill_s"]) == repeat and all(t > 0 for t in p["prefill_s"])
    assert p["ttft_ms_median"] >= p["prefill_s_median"] * 1e3 > 0
    assert p["prefill_tok_s"] == pytest.approx(prompt / p["prefill_s_median"])
    assert len(d["step_s"]) == repeat * (gen - 1)
    assert d["decode_tok_s"] == pytest.approx(len(d["step_s"]) / sum(d["step_s"]))
    assert 0 < d["tpot_ms_p50"] <= d["tpot_ms_p99"]
    assert d["argmax_on_device"] and d["host_argmax_us_in_loop"] is None  # tokens from the device
    assert d["host_argmax_us"] > 0
    assert d["first_run"] is None  # no warm-up run

    # Bytes per decoded token, recomputed here from the config (INT4 g32, float32 scales).
    h, lora, rope = cfg["hidden_size"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    mi, n_exp, k = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]

    def q4(out_f: int, in_f: int) -> float:  # packed words + one fp32 scale per 32 weights
        return out_f * in_f / 2 + out_f * (in_f / 32) * 4

    attn = q4(heads * (nope + rope), h) + q4(lora + rope, h) + q4(h, heads * v)
    attn += (heads * (nope + v) * lora + lora) * 4  # w_uk, w_uv and kv_a_layernorm in fp32
    dense_mlp = q4(2 * cfg["intermediate_size"], h) + q4(h, cfg["intermediate_size"])
    shared = q4(2 * 2 * mi, h) + q4(h, 2 * mi)
    moe_layers = cfg["num_hidden_layers"] - 1
    layers = 3 * attn + dense_mlp + moe_layers * (shared + n_exp * h * 4) + 3 * 2 * h * 4
    expert = q4(2 * mi, h) + q4(h, mi)
    weights = layers + h * 4 + q4(cfg["vocab_size"], h) + q4(cfg["vocab_size"], h) / 512
    weights += moe_layers * k * expert
    mean_ctx = prompt + gen / 2
    kv = mean_ctx * 3 * (lora + rope) * 4
    assert f["weight_bytes"] == pytest.approx(weights)
    assert f["kv_bytes"] == pytest.approx(kv)
    assert f["bytes_per_token"] == pytest.approx(weights + kv)
    assert f["roofline_tok_s"] == pytest.approx(1e11 / (weights + kv))
    assert f["achieved_bytes_s"] == pytest.approx((weights + kv) / np.mean(d["step_s"]))
    assert f["fraction_of_hbm"] == pytest.approx(f["achieved_bytes_s"] / 1e11)

    assert r["memory"]["peak_bytes"] > 0
    s = r["sync_check"]
    assert 0 < s["call_returns_ms"] <= s["device_idle_ms"] <= s["logits_on_host_ms"]
    names = {row["name"] for row in r["profile"]["decode"]}
    assert any("moe_gate_up_q4" in n for n in names)
    assert any("cross_attention" in n for n in names)  # absorbed decode attention
    assert sum(row["share"] for row in r["profile"]["prefill"]) == pytest.approx(1.0)

    hf = r["hf"]
    assert hf["first_token_agrees"] and hf["first_logits_max_abs_diff"] < 1e-3
    assert hf["decode_steps"] == 3 and hf["prefill_tok_s"] > 0 and hf["decode_tok_s"] > 0
    assert hf["ratio_decode_tok_s"] == pytest.approx(d["decode_tok_s"] / hf["decode_tok_s"])
    assert r["model"]["weights"] == "random (seed 0)"


def test_bench_reports_the_first_warm_up_run(random_builds):
    from dsv2_mlc.bench import BenchOptions, format_report, run_bench

    opts = BenchOptions(model=str(random_builds["q4f32_g32"]), prompt_len=8, gen_len=4, warmup=2)
    r = run_bench(opts, log=lambda _: None)
    # no --prefill-chunk: the engine's default chunk (CPU 512, at most the KV capacity 12)
    assert r["prefill"]["chunk_size"] == 12 and "prefill chunks" not in format_report(r)
    first = r["decode"]["first_run"]
    assert first["decode_tok_s"] > 0 and first["tpot_ms_max"] > 0
    assert first["decode_tok_s"] >= 3 / (3 * first["tpot_ms_max"] / 1e3)  # 3 steps, each <= max
    assert first["cuda_graph"] is None  # CPU: no graphs
    assert "decode, first run:" in format_report(r)


def test_bench_prefill_in_chunks(random_builds):
    """``prefill_chunk`` below the prompt: the engine prefills in chunks (one prefill call, then
    extends), the report says so, and the decode steps still run."""
    from dsv2_mlc.bench import BenchOptions, format_report, run_bench

    model = str(random_builds["q4f32_g32"])
    opts = BenchOptions(model=model, prompt_len=12, gen_len=3, warmup=0, repeat=1, prefill_chunk=5)
    r = run_bench(opts, log=lambda _: None)
    assert r["options"]["prefill_chunk"] == 5 and r["prefill"]["chunk_size"] == 5
    assert "prefill chunks of 5" in format_report(r)
    assert r["prefill"]["prefill_tok_s"] > 0 and r["decode"]["decode_tok_s"] > 0


def test_bench_mixed_prompt_lengths(random_builds):
    """``mixed_lengths``: each sequence's prompt length in [prompt_len / 8, prompt_len], the same
    for a seed; prefill tokens and the roofline's contexts follow the lengths; the first logits
    are those of the first prompt alone."""
    from dsv2_mlc.bench import BenchError, BenchOptions, _one_run, bench_prompts, run_bench

    model = str(random_builds["q4f32_g32"])
    opts = BenchOptions(model=model, batch=6, prompt_len=40, gen_len=3, warmup=0, repeat=1,
                        mixed_lengths=True)  # fmt: skip
    prompts = bench_prompts(opts, CONFIGS["A"]["vocab_size"])
    lengths = [len(p) for p in prompts]
    assert all(5 <= n <= 40 for n in lengths) and len(set(lengths)) > 1
    assert prompts == bench_prompts(opts, CONFIGS["A"]["vocab_size"])
    r = run_bench(opts, log=lambda _: None)
    assert r["prefill"]["prompt_lengths"] == lengths and r["prefill"]["tokens"] == sum(lengths)
    assert r["roofline"]["mean_context"] == pytest.approx(np.mean(lengths) + 1.5)
    from dsv2_mlc.runtime.engine import Engine

    engine = Engine(model, context_window=64, max_batch_size=6, random_weights=opts.seed)
    first = _one_run(engine, prompts, 2)["first_logits"]  # the batch of mixed lengths
    np.testing.assert_allclose(first, engine.logits(prompts[0])[-1], atol=1e-4)
    with pytest.raises(BenchError, match="--mixed-lengths"):
        BenchOptions(model=model, mixed_lengths=True, compare_hf=True).check()


def test_bench_decode_loop_falls_back_to_the_host_argmax(random_builds, monkeypatch):
    from dsv2_mlc.bench import _one_run

    engine = _engine(random_builds["q0f32"], 2)
    prompts = np.random.default_rng(0).integers(0, CONFIGS["A"]["vocab_size"], (2, 6)).tolist()
    device = _one_run(engine, prompts, 4)
    monkeypatch.setattr(engine, "_greedy", None)  # a build compiled before greedy_tokens
    host = _one_run(engine, prompts, 4)
    assert len(device["step_s"]) == len(host["step_s"]) == 3
    assert device["argmax_s"] == [] and len(host["argmax_s"]) == 3


def test_bench_rejects_impossible_options(random_builds, capsys):
    rc = main(["bench", str(random_builds["q0f32"]), "--gen-len", "0"])
    assert rc == 2 and "--gen-len must be at least 1" in capsys.readouterr().err
    rc = main(["bench", str(random_builds["q0f32"]), "--prompt-len", "200000"])
    assert rc == 2 and "exceeds the model's" in capsys.readouterr().err
    rc = main(["bench", str(random_builds["q0f32"]), "--prefill-chunk", "0"])
    assert rc == 2 and "--prefill-chunk must be at least 1" in capsys.readouterr().err


def test_long_prefill_script_times_every_chunk(random_builds):
    """``scripts/gpu_long_prefill.py``'s case on the CPU: one call per chunk, each timed at its
    prefix, and the chunked prompt's first token is the one-call prompt's."""
    from scripts_module import load_script

    script = load_script("gpu_long_prefill")
    build = str(random_builds["q0f32"])
    chunked = script.run_case(build, None, 40, 16, seed=3)
    whole = script.run_case(build, None, 40, 40, seed=3)
    assert [(c["prefix"], c["tokens"]) for c in chunked["chunks"]] == [(0, 16), (16, 16), (32, 8)]
    assert whole["calls"] == 1 and whole["later_chunks_s_mean"] is None
    assert chunked["first_token"] == whole["first_token"]
    assert chunked["ttft_s"] >= sum(c["seconds"] for c in chunked["chunks"])
    assert chunked["memory"]["weight_bytes"] > 0


def test_bench_refuses_a_small_budget_before_loading(random_builds, capsys, monkeypatch):
    """--gpu-memory too small for the prompt: the planner's refusal (breakdown, what would fit)
    comes before the TVM runtime is even loaded, so it needs no device."""
    import dsv2_mlc.runtime.tvm_runtime as tvm_runtime

    def no_runtime(*_args, **_kwargs):
        raise AssertionError("the runtime was loaded before the budget was checked")

    monkeypatch.setattr(tvm_runtime, "load_runtime", no_runtime)
    argv = ["bench", str(random_builds["q4f32_g32"]), "--prompt-len", "64", "--gen-len", "8"]
    rc = main([*argv, "--gpu-memory", "64KiB"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "cannot hold a context of 72 tokens" in err and "need a budget of at least" in err

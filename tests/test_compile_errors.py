"""Bad checkpoints fail before anything is written, with errors that name the problem."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_reference import CONFIG_A, PROMPT, hf_greedy, hf_logits, load_hf, make_checkpoint
from safetensors.numpy import load_file, save_file

from dsv2_mlc.compiler.compile import CompileError, compile_model
from dsv2_mlc.model.checkpoint import CheckpointError
from dsv2_mlc.model.config import ConfigError
from dsv2_mlc.model.weights import WeightMapError


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture()
def previous_build(compiled, tmp_path) -> Path:
    """An OUT_DIR that already holds a good build (it must survive a failed compile)."""
    out = tmp_path / "out"
    shutil.copytree(compiled["A"], out)
    return out


@pytest.fixture()
def broken(checkpoints, tmp_path) -> Path:
    ckpt = tmp_path / "broken"
    shutil.copytree(checkpoints["A"], ckpt)
    return ckpt


def _edit_tensors(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def _expect_failure(ckpt: Path, out: Path, error: type, *patterns: str) -> None:
    before = _snapshot(out)
    with pytest.raises(error) as info:
        compile_model(ckpt, out, progress=False)
    for pattern in patterns:
        assert pattern in str(info.value)
    assert _snapshot(out) == before
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_missing_tensor(broken, previous_build):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _edit_tensors(broken, lambda t: t.pop(name))
    _expect_failure(broken, previous_build, WeightMapError, "missing tensors (1)", name)


def test_extra_tensor(broken, previous_build):
    name = "model.layers.0.mlp.bogus.weight"
    _edit_tensors(broken, lambda t: t.__setitem__(name, np.zeros((2, 2), np.float32)))
    _expect_failure(broken, previous_build, WeightMapError, "unexpected tensors", name)


def test_wrong_shape(broken, previous_build):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    _edit_tensors(broken, lambda t: t.__setitem__(name, t[name][:-1]))
    _expect_failure(
        broken, previous_build, WeightMapError, name, "expected [128, 32], found [127, 32]"
    )


def test_unsupported_config_value(broken, previous_build):
    (broken / "config.json").write_text(json.dumps({**CONFIG_A, "scoring_func": "sigmoid"}))
    _expect_failure(broken, previous_build, ConfigError, "scoring_func")


def test_missing_shard(tmp_path, previous_build):
    ckpt = tmp_path / "sharded"
    make_checkpoint(ckpt, CONFIG_A)
    model = load_hf(ckpt)
    shutil.rmtree(ckpt)
    model.save_pretrained(ckpt, max_shard_size="200KB")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").is_file()
    shards[1].unlink()
    _expect_failure(ckpt, previous_build, CheckpointError, shards[1].name, "missing shard")


def test_output_folder_that_is_not_a_build(checkpoints, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    _expect_failure(checkpoints["A"], out, CompileError, "not a dsv2-mlc build")


def test_sharded_bf16_checkpoint_compiles_and_matches_hf(tmp_path):
    """Index + several shards, bfloat16 weights (as DeepSeek publishes), fp32 compute."""
    import torch

    src = make_checkpoint(tmp_path / "src", CONFIG_A, seed=7)
    model = load_hf(src).to(torch.bfloat16)
    ckpt = tmp_path / "bf16"
    model.save_pretrained(ckpt, max_shard_size="300KB")
    (ckpt / "config.json").write_text((src / "config.json").read_text())
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1
    out = compile_model(ckpt, tmp_path / "out", progress=False).out_dir

    from dsv2_mlc.runtime.engine import Engine

    ref = hf_logits(load_hf(ckpt), PROMPT)  # bf16 weights upcast to fp32 by HF
    assert np.abs(Engine(out, context_window=64).logits(PROMPT) - ref).max() < 1e-4


def test_cli_reports_one_line_error(broken, tmp_path):
    (broken / "config.json").write_text(json.dumps({**CONFIG_A, "topk_method": "noaux_tc"}))
    proc = subprocess.run(
        [sys.executable, "-m", "dsv2_mlc.cli", "compile", str(broken), "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "topk_method" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()


def test_runtime_runs_without_importing_tvm(compiled, hf_models):
    """The runtime alone (no ``import tvm``) generates HF's greedy tokens for model "A"."""
    code = (
        "import sys, dsv2_mlc\n"
        f"e = dsv2_mlc.Engine({str(compiled['A'])!r}, context_window=64)\n"
        f"print(e.generate({PROMPT!r}, 4, stop_token_ids=[]).token_ids)\n"
        "assert 'tvm' not in sys.modules, 'the runtime imported the TVM compiler package'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens == hf_greedy(hf_models["A"], PROMPT, 4)

"""The artifacts this repo publishes (dist/index.json) verify, install and generate what HF does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_reference import hf_greedy, hf_logits
from test_quantization import KERNEL_TOL, dequantized_hf_state, read_tensor_cache

from dsv2_mlc.artifacts.pull import pull
from dsv2_mlc.model.config import DeepseekV2Config as OurConfig
from dsv2_mlc.resolve import default_model_dir

INDEX = Path(__file__).resolve().parent.parent / "dist" / "index.json"
MODEL = default_model_dir()
NEW_TOKENS = 24
CPU_ARTIFACTS = [
    a["name"] for a in json.loads(INDEX.read_text())["artifacts"] if a["target"]["device"] == "cpu"
]


@pytest.mark.parametrize("name", CPU_ARTIFACTS)
def test_published_cpu_artifact_pulls_and_matches_hf_on_its_weights(name, tmp_path):
    """The installed artifact's greedy tokens (and logits) on a prompt equal HF float32 run on
    the artifact's own weights (INT4 dequantised back to float32, tests/test_quantization.py)
    with the default model's config, so the shipped library, not only its packaging, is
    checked. Logits agree to float32 accumulation noise (~2e-5) against HF's top-2 margins of
    >= 2e-2 over these steps, so the tokens must be the same."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    import dsv2_mlc
    from dsv2_mlc.layout import BuildConfig

    result = pull(name, cache_dir=tmp_path, index=str(INDEX), progress=False)
    assert result.name == name
    eng = dsv2_mlc.load(name, cache_dir=tmp_path, context_window=256)
    build = BuildConfig.read(result.path)
    ids = eng.encode_prompt("def main(")
    ours = eng.generate(ids, NEW_TOKENS, stop_token_ids=[]).token_ids

    # the published model is the embedded default model: HF's config is its config.json
    assert OurConfig.from_file(MODEL).to_dict() == build.model
    config = json.loads((MODEL / "config.json").read_text())
    params = read_tensor_cache(result.path / "params")
    group = int(build.quantization.rsplit("_g", 1)[1]) if "_g" in build.quantization else 0
    state = dequantized_hf_state(params, config, group)  # (float weights: as they are)
    hf = DeepseekV2ForCausalLM(DeepseekV2Config(**config)).eval()
    missing, unexpected = hf.load_state_dict(state)
    assert not missing and not unexpected
    ref = hf_greedy(hf, ids, NEW_TOKENS)
    assert ours == ref
    logits = eng.logits(ids + ref)
    assert np.abs(logits - hf_logits(hf, ids + ref)).max() < KERNEL_TOL


def test_index_publishes_the_default_model_for_cpu_and_cuda():
    entries = json.loads(INDEX.read_text())["artifacts"]
    devices = {a["target"]["device"] for a in entries if a["model"] == "dsv2-coder-tiny"}
    assert devices == {"cpu", "cuda"}
    for a in entries:
        assert a["url"] and a["sha256"] and a["manifest_sha256"], a["name"]
        assert (INDEX.parent / a["url"]).is_file(), a["url"]

"""The prebuilt CUDA artifact of dist/index.json pulls, loads and decodes as the CPU artifact does.

Both artifacts of the default model (``dsv2-coder-tiny``, INT4 of the same trained checkpoint:
``q4f16_g32`` for CUDA, ``q4f32_g32`` for the CPU) are pulled from this checkout's index into an
empty cache and opened by name, each with the TVM runtime it bundles. The prompt's greedy
continuation is the same on both: along it the CPU artifact's top two logits are never closer than
0.26 (48 tokens checked), well above the fp16-versus-fp32 differences of the two builds (the
teacher-forced logits below stay within a tenth of the largest logit).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

INDEX = Path(__file__).resolve().parents[2] / "dist" / "index.json"
PROMPT = "import numpy as np\n\ndef "
NEW_TOKENS = 32


def _names() -> dict[str, str]:
    entries = json.loads(INDEX.read_text())["artifacts"]
    return {a["target"]["device"]: a["name"] for a in entries if a["model"] == "dsv2-coder-tiny"}


def test_cuda_artifact_decodes_the_cpu_artifacts_tokens(tmp_path):
    import dsv2_mlc
    from dsv2_mlc.artifacts.pull import pull

    names = _names()
    engines = {}
    for device in ("cuda", "cpu"):
        result = pull(names[device], cache_dir=tmp_path, index=str(INDEX), progress=False)
        assert result.name == names[device]
        engines[device] = dsv2_mlc.load(names[device], cache_dir=tmp_path, context_window=256)
        assert engines[device].device == device
    out = {d: e.generate(PROMPT, NEW_TOKENS, stop_token_ids=[]) for d, e in engines.items()}
    cuda, cpu = out["cuda"].token_ids, out["cpu"].token_ids
    assert len(cuda) == NEW_TOKENS
    assert cuda == cpu, f"CUDA {cuda} vs CPU {cpu}: {out['cuda'].text!r} vs {out['cpu'].text!r}"
    assert out["cuda"].text == out["cpu"].text
    ids = engines["cpu"].encode_prompt(PROMPT) + cpu[:-1]
    logits = {d: e.logits(ids) for d, e in engines.items()}
    assert np.isfinite(logits["cuda"]).all()
    diff = float(np.abs(logits["cuda"] - logits["cpu"]).max())
    assert diff <= 0.1 * float(np.abs(logits["cpu"]).max()), diff

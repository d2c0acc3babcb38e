"""The artifacts this repo publishes (dist/index.json) verify, install and run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv2_mlc.artifacts.pull import pull

INDEX = Path(__file__).resolve().parent.parent / "dist" / "index.json"
CPU_ARTIFACTS = [
    a["name"] for a in json.loads(INDEX.read_text())["artifacts"] if a["target"]["device"] == "cpu"
]


@pytest.mark.parametrize("name", CPU_ARTIFACTS)
def test_published_cpu_artifact_pulls_and_runs(name, tmp_path):
    import dsv2_mlc

    result = pull(name, cache_dir=tmp_path, index=str(INDEX), progress=False)
    assert result.name == name
    eng = dsv2_mlc.load(name, cache_dir=tmp_path, context_window=256)
    text = eng.generate("def main(", 24).text
    assert text.strip() and "\ufffd" not in text


def test_index_publishes_the_default_model_for_cpu_and_cuda():
    entries = json.loads(INDEX.read_text())["artifacts"]
    devices = {a["target"]["device"] for a in entries if a["model"] == "dsv2-coder-tiny"}
    assert devices == {"cpu", "cuda"}
    for a in entries:
        assert a["url"] and a["sha256"] and a["manifest_sha256"], a["name"]
        assert (INDEX.parent / a["url"]).is_file(), a["url"]

"""The embedded default model: our compiled module against HF on held-out perplexity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv2_mlc import resolve
from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = resolve.default_model_dir()


@pytest.fixture(scope="module")
def default_build(tmp_path_factory):
    from dsv2_mlc.compiler.compile import compile_model

    return compile_model(MODEL, tmp_path_factory.mktemp("default") / "q0f32", progress=False)


@pytest.fixture(scope="module")
def windows():
    tok = Tokenizer.from_dir(MODEL)
    files = heldout_files(MODEL)
    assert files and all(f.is_file() for f in files)
    docs = [tok.encode(f.read_text(encoding="utf-8"), add_special_tokens=False) for f in files]
    return token_windows(docs, 256, 8, tok.bos_token_id)


def test_heldout_perplexity_matches_hf(default_build, windows):
    from transformers import AutoModelForCausalLM

    from dsv2_mlc.runtime.engine import Engine

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

    def hf_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0].numpy()

    ours = perplexity(Engine(default_build.out_dir, context_window=512).logits, windows)
    ref = perplexity(hf_logits, windows)
    assert ours.tokens == ref.tokens == 8 * 255
    assert abs(ours.ppl / ref.ppl - 1) < 1e-3
    assert ref.ppl < 50  # a trained model, not noise (a uniform guess is the vocabulary size)


def test_default_model_writes_python(default_build):
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(default_build.out_dir, context_window=512)
    text = eng.generate("import os\n\n\ndef ", 48).text
    assert text.strip() and "\ufffd" not in text
    assert np.mean([c.isprintable() or c in "\n\t" for c in text]) == 1.0

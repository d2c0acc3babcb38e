"""The embedded default model: our compiled module against HF on held-out perplexity and on
greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy

from dsv2_mlc import resolve
from dsv2_mlc.evaluate import heldout_files, perplexity, token_windows
from dsv2_mlc.runtime.tokenizer import Tokenizer

MODEL = resolve.default_model_dir()
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def default_build(default_model_cache) -> Path:
    """The default model compiled (q0f32, CPU) once in the session, by the JIT cache's first use
    (tests/conftest.py; tests/test_chat.py checks that use)."""
    cache, first_run = default_model_cache
    assert first_run.returncode == 0, first_run.stderr
    compiling: list[str] = []
    path = resolve.resolve_model(None, cache_dir=cache, log=compiling.append)
    assert not compiling  # the CLI's build, found in the cache
    return path


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def windows():
    tok = Tokenizer.from_dir(MODEL)
    files = heldout_files(MODEL)
    assert files and all(f.is_file() for f in files)
    docs = [tok.encode(f.read_text(encoding="utf-8"), add_special_tokens=False) for f in files]
    return token_windows(docs, 256, 8, tok.bos_token_id)


def test_heldout_perplexity_matches_hf(default_build, windows, hf_model):
    from dsv2_mlc.runtime.engine import Engine

    def hf_logits(ids):
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)))
            return out.logits[0].numpy()

    ours = perplexity(Engine(default_build, context_window=512).logits, windows)
    ref = perplexity(hf_logits, windows)
    assert ours.tokens == ref.tokens == 8 * 255
    assert abs(ours.ppl / ref.ppl - 1) < 1e-3
    assert ref.ppl < 50  # a trained model, not noise (a uniform guess is the vocabulary size)


def test_default_model_greedy_tokens_match_hf(default_build, hf_model):
    """48 greedy tokens after a code prompt equal HF float32's on the same weights (our logits
    agree to float32 noise, ~1e-5, far under the trained model's top-2 margins here), and they
    decode to printable text."""
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(default_build, context_window=512)
    ids = eng.encode_prompt("import os\n\n\ndef ")
    result = eng.generate(ids, NEW_TOKENS, stop_token_ids=[])
    ref = hf_greedy(hf_model, ids, NEW_TOKENS)
    assert result.token_ids == ref
    text = eng.tokenizer.decode(ref)
    assert "\ufffd" not in text and all(c.isprintable() or c in "\n\t" for c in text)

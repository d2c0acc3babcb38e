"""The host sampler against Hugging Face's logits processors (the reference), its seeding, its
frequencies, and the validation of sampling values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dsv2_mlc.runtime.sampling import Sampler, SamplingError, SamplingParams

VOCAB = 300


def _case(seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
    history = rng.integers(0, VOCAB, size=40).tolist()
    return logits, history


def _hf_probs(logits: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    ids = torch.tensor([history])
    scores = torch.from_numpy(logits.copy())[None]
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.temperature == 0:
        out = np.zeros(VOCAB)
        out[int(scores.argmax())] = 1.0
        return out
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores.double())
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, repetition_penalty=0.8),
    SamplingParams(temperature=0.5, top_p=0.05),  # keeps only the most likely token or so
    SamplingParams(temperature=2.0, top_p=0.999),  # a nucleus of nearly the whole vocabulary
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: repr(p)[15:80])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distribution_equals_hf_logits_processors(params, seed):
    logits, history = _case(seed)
    ours = Sampler(params, VOCAB, history).probabilities(logits)
    ref = _hf_probs(logits, history, params)
    assert set(np.flatnonzero(ours)) == set(np.flatnonzero(ref > 0))
    assert np.abs(ours - ref).max() < 1e-6


def test_greedy_is_exactly_argmax():
    sampler = Sampler(SamplingParams(temperature=0), VOCAB)
    for seed in range(20):
        logits, _ = _case(seed)
        assert sampler.sample(logits) == int(np.argmax(logits))


def test_sampled_frequencies_follow_the_distribution():
    logits, history = _case(5)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95, repetition_penalty=1.2, seed=7)
    probs = Sampler(params, VOCAB, history).probabilities(logits)
    n = 20000
    counts = np.zeros(VOCAB)
    sampler = Sampler(params, VOCAB, history)
    for _ in range(n):
        counts[sampler.sample(logits)] += 1
        sampler._seen[:] = False  # keep the penalty set fixed: the same distribution each draw
        sampler.observe(history)
    freq = counts / n
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(probs))
    # Binomial standard deviation of a frequency is <= 0.0036 at n = 20000: allow 5 of them.
    assert np.abs(freq - probs).max() < 0.018


def test_seed_makes_sampling_reproducible():
    def draw(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), VOCAB)
        return [sampler.sample(_case(i)[0]) for i in range(30)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_repetition_penalty_counts_generated_tokens():
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[7], logits[9] = 2.0, 1.9
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), VOCAB)
    assert sampler.sample(logits) == 7  # then 7 is penalised: 2.0 / 2 < 1.9
    assert sampler.sample(logits) == 9


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("seed", -3),
        ("stop", ("",)),
    ],
)
def test_invalid_values_are_rejected_with_one_line(field, value):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert "\n" not in msg
    assert field.split("_")[0] in msg.replace(" ", "_")


def test_defaults_from_generation_config_follow_hf(tmp_path):
    from transformers import GenerationConfig

    cases = [
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
        {"do_sample": True, "top_k": 7, "repetition_penalty": 1.1},
        {"do_sample": False, "temperature": 0.6},
        {"bos_token_id": 0, "eos_token_id": 1},
    ]
    for cfg in cases:
        (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
        ours = SamplingParams.from_generation_config(tmp_path)
        hf = GenerationConfig.from_pretrained(tmp_path)
        if hf.do_sample:
            assert ours.temperature == pytest.approx(hf.temperature if hf.temperature else 1.0)
            assert ours.top_p == pytest.approx(hf.top_p if hf.top_p is not None else 1.0)
            assert ours.top_k == (hf.top_k if hf.top_k is not None else 50)
        else:
            assert ours.greedy
        assert ours.repetition_penalty == pytest.approx(hf.repetition_penalty or 1.0)
    assert SamplingParams.from_generation_config(tmp_path / "none") == SamplingParams()

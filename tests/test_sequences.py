"""Paged-KV sequence operations through the compiled model: batching, fork, pop, chunking."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import PROMPT

TOL = 1e-4


def _alone(eng, prompt, steps):
    """Greedy tokens and per-step logits of one sequence run on its own."""
    seq = eng.add_sequence()
    try:
        logits = [eng.prefill([seq], [prompt])[0]]
        tokens = []
        for _ in range(steps):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(eng.decode([seq], [tokens[-1]])[0])
    finally:
        eng.remove_sequence(seq)
    return tokens, np.stack(logits)


@pytest.mark.parametrize("name", ["A", "B"])
def test_batched_prefill_and_decode_equal_each_alone(name, engines):
    eng = engines[name]
    prompts = [PROMPT, PROMPT[:5] + [3, 99], [400, 2, 77] * 7]
    steps = 6
    alone = [_alone(eng, p, steps) for p in prompts]
    seqs = [eng.add_sequence() for _ in prompts]
    try:
        logits = eng.prefill(seqs, prompts)
        got = [[] for _ in prompts]
        for _ in range(steps):
            toks = [int(np.argmax(row)) for row in logits]
            for g, t in zip(got, toks, strict=True):
                g.append(t)
            logits = eng.decode(seqs, toks)
            for i, (_, ref) in enumerate(alone):
                assert np.abs(logits[i] - ref[len(got[i])]).max() < TOL
    finally:
        for s in seqs:
            eng.remove_sequence(s)
    assert got == [a[0] for a in alone]
    assert len({len(p) for p in prompts}) == 3


@pytest.mark.parametrize("fork_pos", [-1, 7])
def test_fork_continues_as_parent(engines, fork_pos):
    eng = engines["A"]
    parent = eng.add_sequence()
    try:
        eng.prefill([parent], [PROMPT])
        child = eng.fork_sequence(parent, fork_pos)
        assert eng.sequence_length(child) == (len(PROMPT) if fork_pos < 0 else fork_pos)
        cont = PROMPT[len(PROMPT) if fork_pos < 0 else fork_pos :] + [42, 43]
        # The child continues from the fork point exactly as a fresh sequence with that prefix.
        ours = eng.prefill([child], [cont], all_logits=True)[0]
        ref = eng.logits(PROMPT[: eng.sequence_length(child) - len(cont)] + cont)[-len(cont) :]
        assert np.abs(ours - ref).max() < TOL
        # And the parent is untouched by its child.
        assert np.abs(eng.decode([parent], [42])[0] - eng.logits(PROMPT + [42])[-1]).max() < TOL
        eng.remove_sequence(child)
    finally:
        eng.remove_sequence(parent)


def test_popn_then_redecode_reproduces_logits(engines):
    eng = engines["B"]
    seq = eng.add_sequence()
    try:
        eng.prefill([seq], [PROMPT])
        first = [eng.decode([seq], [t])[0] for t in (5, 6, 7)]
        eng.popn(seq, 3)
        assert eng.sequence_length(seq) == len(PROMPT)
        again = [eng.decode([seq], [t])[0] for t in (5, 6, 7)]
        eng.popn(seq, 5)  # into the prompt, across a page boundary
        redo = eng.prefill([seq], [PROMPT[-2:] + [5, 6, 7]], all_logits=True)[0][-3:]
    finally:
        eng.remove_sequence(seq)
    for a, b, c in zip(first, again, redo, strict=True):
        assert np.abs(a - b).max() < TOL
        assert np.abs(a - c).max() < TOL


@pytest.mark.parametrize("name", ["A", "B"])
def test_chunked_prefill_equals_one_prefill(name, engines):
    eng = engines[name]
    prompt = (PROMPT * 4)[:41]  # spans three pages
    whole = eng.logits(prompt)
    seq = eng.add_sequence()
    try:
        parts = [prompt[:13], prompt[13:30], prompt[30:]]
        chunks = [eng.prefill([seq], [p], all_logits=True)[0] for p in parts]
    finally:
        eng.remove_sequence(seq)
    assert np.abs(np.concatenate(chunks) - whole).max() < TOL


def test_prefill_chunk_size_splits_long_prompts(compiled):
    from dsv2_mlc.runtime.engine import Engine

    small = Engine(compiled["A"], context_window=128, prefill_chunk_size=16)
    big = Engine(compiled["A"], context_window=128)
    prompt = (PROMPT * 5)[:50]
    assert np.abs(small.logits(prompt) - big.logits(prompt)).max() < TOL


def test_default_prefill_chunk_is_the_device_default_capped_by_the_kv_capacity(compiled):
    from dsv2_mlc.runtime.engine import DEFAULT_PREFILL_CHUNK, Engine

    assert DEFAULT_PREFILL_CHUNK["cpu"] == 512 and DEFAULT_PREFILL_CHUNK["cuda"] >= 4096
    assert Engine(compiled["A"], context_window=128, max_batch_size=1).prefill_chunk_size == 128
    assert Engine(compiled["A"], context_window=256, max_batch_size=4).prefill_chunk_size == 512
    with pytest.raises(ValueError, match="prefill_chunk_size=0 must be an integer"):
        Engine(compiled["A"], context_window=128, prefill_chunk_size=0)


def test_mixed_batch_extend(engines):
    """One batch holding a fresh sequence and one with a cached prefix."""
    eng = engines["A"]
    a, b = eng.add_sequence(), eng.add_sequence()
    try:
        eng.prefill([a], [PROMPT[:9]])
        out = eng.prefill([a, b], [PROMPT[9:], PROMPT], all_logits=True)
    finally:
        eng.remove_sequence(a)
        eng.remove_sequence(b)
    whole = eng.logits(PROMPT)
    assert np.abs(out[0] - whole[9:]).max() < TOL
    assert np.abs(out[1] - whole).max() < TOL


def test_decode_of_many_forks_sharing_a_block(compiled):
    """33 forks decoded in one batch equal each decoded alone.

    With 32+ sequences of a decode batch sharing their last-depth block, TVM's cache appends the
    new token *after* attention, so absorbed-only decode would miss it; the engine splits such
    batches (MAX_DECODE_GROUP). Layout as in test_mla_kv_cache: a 32-token parent split by a
    fork at 16 into [root, 16-token block], then children [root, shared block, own block]."""
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["A"], context_window=64, max_batch_size=40)
    prompt = (PROMPT * 3)[:32]
    parent = eng.add_sequence()
    eng.prefill([parent], [prompt])
    eng.fork_sequence(parent, 16)
    children = [eng.fork_sequence(parent) for _ in range(33)]
    tokens = [(7 * i) % 500 for i in range(33)]
    together = eng.decode(children, tokens)
    for i in (0, 31, 32):
        alone = eng.logits(prompt + [tokens[i]])[-1]
        assert np.abs(together[i] - alone).max() < TOL


def test_more_sequences_than_pages_is_a_clear_error(compiled, engines):
    """Each sequence fills whole pages of 16 tokens: past the pool's pages a step is refused
    with a ContextLengthError that says what to do (not TVM's "KV cache is full" from inside the
    cache), nothing is appended, and the sequences already cached decode on as before."""
    from dsv2_mlc.runtime.engine import ContextLengthError, Engine

    long = (PROMPT * 2)[:16]  # a whole page
    token = int(np.argmax(engines["A"].logits(long)[-1]))
    alone = engines["A"].logits(long + [token])[-1]
    # pool: 64 tokens + a page for each of 2 sequences = 6 pages of 16 tokens
    eng = Engine(compiled["A"], context_window=64, max_batch_size=2, kv_capacity=64)
    seqs = [eng.add_sequence() for _ in range(7)]
    eng.prefill(seqs[:2], [long, [6]])
    eng.prefill(seqs[2:4], [[7], [8]])
    eng.prefill(seqs[4:6], [[9], [10]])  # 21 tokens, 6 pages
    full = "7 sequences would fill 7 pages of 16 tokens, more than the KV cache's 6.*kv_capacity"
    with pytest.raises(ContextLengthError, match=full):
        eng.prefill([seqs[6]], [[11]])  # 22 tokens in all: the token budget alone allows it
    with pytest.raises(ContextLengthError, match="would fill 7 pages"):
        eng.decode(seqs[:1], [token])  # the first sequence's 17th token opens a 7th page
    assert eng.sequence_length(seqs[0]) == 16
    eng.remove_sequence(seqs[5])  # a page free again
    again = eng.decode(seqs[:1], [token])
    assert np.abs(again[0] - alone).max() < TOL


def test_a_step_past_max_batch_size_is_refused(compiled, engines):
    """The KV cache's auxiliary arrays hold ``max_batch_size`` sequences: a decode step of more
    (by any entry point) is refused with a ValueError naming the fix, before anything is
    appended; more sequences may be live, and smaller steps decode them as alone."""
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["A"], context_window=64, max_batch_size=2)
    prompts = [PROMPT[:5], PROMPT[3:9], PROMPT[1:4]]
    seqs = [eng.add_sequence() for _ in prompts]
    for seq, prompt in zip(seqs, prompts, strict=True):
        eng.prefill([seq], [prompt])
    refused = "a step of 3 sequences exceeds max_batch_size=2.*larger max_batch_size"
    for step in (eng.decode, eng.decode_greedy, eng.launch_greedy):
        with pytest.raises(ValueError, match=refused):
            step(seqs, [5, 6, 7])
    with pytest.raises(ValueError, match=refused):
        eng.prefill(seqs, [[5], [6], [7]])
    assert [eng.sequence_length(s) for s in seqs] == [len(p) for p in prompts]
    pair = eng.decode(seqs[1:], [6, 7])
    for row, prompt, token in zip(pair, prompts[1:], [6, 7], strict=True):
        alone = engines["A"].logits(prompt + [token])[-1]
        assert np.abs(row - alone).max() < TOL


@pytest.mark.parametrize("gemm_from", [None, 2], ids=["decode", "decode_gemm"])
def test_large_decode_step_against_hf(compiled, hf_models, gemm_from):
    """40 independent sequences (more than MAX_DECODE_GROUP) decode in one step, through
    ``batch_decode`` or ``batch_decode_gemm`` (absorbed attention, the prefill path's
    projections and experts); each row's logits against HF over its prompt and token."""
    import torch
    from hf_reference import hf_logits

    from dsv2_mlc.runtime.engine import MAX_DECODE_GROUP, Engine

    n = MAX_DECODE_GROUP + 9
    eng = Engine(compiled["B"], context_window=32, max_batch_size=n, gemm_decode_from=gemm_from)
    assert eng.gemm_decode_from == gemm_from
    calls: list[str] = []
    for name, fn in list(eng._fn.items()):  # which entry points one step calls
        eng._fn[name] = lambda *a, _fn=fn, _name=name: (calls.append(_name), _fn(*a))[1]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 500, 1 + i % 11).tolist() for i in range(n)]
    seqs = [eng.add_sequence() for _ in range(n)]
    eng.prefill(seqs, prompts)
    tokens = rng.integers(0, 500, n).tolist()
    calls.clear()
    got = eng.decode(seqs, tokens)
    assert calls == ["batch_decode" if gemm_from is None else "batch_decode_gemm"]
    model = hf_models["B"]
    with torch.no_grad():
        for i in (0, 1, 17, 31, 32, n - 1):
            ref = hf_logits(model, prompts[i] + [tokens[i]])[-1]
            assert np.abs(got[i] - ref).max() < 2e-3, i

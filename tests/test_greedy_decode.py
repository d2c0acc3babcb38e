"""Greedy decoding on the device: ``Engine.decode_greedy`` and its callers (CPU, tiny models).

The device arg-max (the model's ``greedy_tokens``) must pick exactly ``decode(...).argmax(-1)``
for one and several sequences, leave the KV cache as ``decode`` does, ride in the decode step's
CUDA graph (here a recording stand-in for :class:`DecodeGraphs`), and fall back to the host for
builds without it. Greedy generation goes through it (and through logits when a repetition
penalty needs them); generation against HF is ``test_e2e_hf.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import PROMPT

from dsv2_mlc.runtime.device import to_numpy
from dsv2_mlc.runtime.sampling import SamplingParams


def _prefilled(eng, prompts: list[list[int]]) -> tuple[list[int], np.ndarray]:
    seqs = [eng.add_sequence() for _ in prompts]
    logits = np.stack(eng.prefill(seqs, prompts))
    return seqs, logits.argmax(-1)


def _prompts(n: int) -> list[list[int]]:
    return [PROMPT[i:] + PROMPT[:i] for i in range(n)]


@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_greedy_equals_host_argmax_of_decode(name, batch, engines):
    eng = engines[name]
    assert eng.has_device_greedy
    a, tok_a = _prefilled(eng, _prompts(batch))
    b, tok_b = _prefilled(eng, _prompts(batch))
    try:
        for _ in range(6):
            logits = eng.decode(a, tok_a.tolist())
            tokens = eng.decode_greedy(b, tok_b.tolist())
            assert tokens.dtype == np.int64 and tokens.shape == (batch,)
            np.testing.assert_array_equal(tokens, logits.argmax(-1))
            tok_a, tok_b = logits.argmax(-1), tokens
        # both paths appended the same tokens: the caches agree
        assert [eng.sequence_length(s) for s in a] == [eng.sequence_length(s) for s in b]
        np.testing.assert_array_equal(eng.decode(a, tok_a.tolist()), eng.decode(b, tok_b.tolist()))
    finally:
        for s in a + b:
            eng.remove_sequence(s)


def test_decode_greedy_of_a_large_batch_like_decode(compiled):
    from dsv2_mlc.runtime.engine import MAX_DECODE_GROUP, Engine

    n = MAX_DECODE_GROUP + 2
    eng = Engine(compiled["A"], context_window=32, max_batch_size=n)
    seqs, tokens = _prefilled(eng, [PROMPT[: 1 + i % 5] for i in range(n)])
    ref = eng.decode(seqs, tokens.tolist()).argmax(-1)
    for s in seqs:
        eng.popn(s, 1)
    np.testing.assert_array_equal(eng.decode_greedy(seqs, tokens.tolist()), ref)


@pytest.mark.parametrize("follow", [False, True], ids=["begun_ahead", "followed"])
@pytest.mark.parametrize("batch", [1, 2])
def test_launched_steps_match_decode_greedy(batch, follow, engines):
    """Steps with the next one begun ahead (some without), or with ``follow`` already running on
    the picked tokens (one in the middle without): the tokens and caches of plain steps."""
    eng = engines["B"]
    a, tok_a = _prefilled(eng, _prompts(batch))
    b, tok_b = _prefilled(eng, _prompts(batch))
    refs = []  # a's steps first: a call on a would undo a step of b run ahead
    for _ in range(7):
        refs.append(tok_a := eng.decode_greedy(a, tok_a.tolist()))
    start = [eng.sequence_length(s) for s in b]
    try:
        for i, ref in enumerate(refs):
            ahead = i % 3 != 2 or follow
            run_on = follow and i != 4
            pending = eng.launch_greedy(b, tok_b.tolist(), next_step=ahead, follow=run_on)
            got = pending.result()
            assert pending.done and got.dtype == np.int64 and got is pending.result()
            np.testing.assert_array_equal(got, ref)
            # a followed step runs already on ``got``; it is not counted until asked for
            assert (eng._followed is not None) == run_on
            assert [eng.sequence_length(s) for s in b] == [n + i + 1 for n in start]
            tok_b = got
        # the next step is begun ahead (or running) for b; decoding a undoes it, the caches agree
        assert eng._ahead == b
        assert [eng.sequence_length(s) for s in a] == [eng.sequence_length(s) for s in b]
        np.testing.assert_array_equal(eng.decode(a, tok_a.tolist()), eng.decode(b, tok_b.tolist()))
        assert eng._ahead is None and eng._followed is None
    finally:
        for s in a + b:
            eng.remove_sequence(s)


@pytest.mark.parametrize("follow", [False, True], ids=["begun_ahead", "followed"])
@pytest.mark.parametrize(
    "then", ["decode", "other_tokens", "popn", "prefill_other", "fork", "generate"]
)
def test_a_step_begun_or_run_ahead_is_taken_or_undone_by_the_next_call(then, follow, engines):
    """After a greedy step, the next one is begun ahead (host bookkeeping) or, with ``follow``,
    already running on the picked token: the next call takes it or undoes it first."""
    eng = engines["A"]
    (a,), tok_a = _prefilled(eng, [PROMPT])
    (b,), tok_b = _prefilled(eng, [PROMPT])
    extra = []
    try:
        ref_tok = eng.decode_greedy([a], tok_a.tolist())
        got_tok = eng.launch_greedy([b], tok_b.tolist(), follow=follow).result()
        np.testing.assert_array_equal(got_tok, ref_tok)
        assert eng._ahead == [b] and (eng._followed is not None) == follow
        if then == "other_tokens":  # a step on other tokens than the device picked
            other = (got_tok + 1) % eng.config.vocab_size
            got = eng.launch_greedy([b], other.tolist(), follow=follow).result()
            ref = eng.decode_greedy([a], other.tolist())  # (undoes b's next step)
            np.testing.assert_array_equal(got, ref)
            ref_tok, got_tok = ref, got
        elif then == "popn":
            for s in (a, b):
                eng.popn(s, 2)
            ref_tok = got_tok = np.array([PROMPT[-2]])
        elif then == "prefill_other":
            extra = [eng.add_sequence()]
            eng.prefill(extra, [PROMPT[:5]])
        elif then == "fork":
            extra = [eng.fork_sequence(b)]
        elif then == "generate":
            eng.generate(PROMPT[:4], 3, stop_token_ids=[])
        if then not in ("decode", "other_tokens"):  # those leave it for the decode below
            assert eng._ahead is None and eng._followed is None
        assert eng.sequence_length(a) == eng.sequence_length(b)
        got = eng.decode([b], got_tok.tolist())  # takes a step begun ahead, undoes a run one
        np.testing.assert_array_equal(got, eng.decode([a], ref_tok.tolist()))
        assert eng._followed is None
    finally:
        for s in [a, b, *extra]:
            eng.remove_sequence(s)


def test_follow_needs_next_step(engines):
    eng = engines["A"]
    (seq,), tokens = _prefilled(eng, [PROMPT])
    try:
        with pytest.raises(ValueError, match="next_step"):
            eng.launch_greedy([seq], tokens.tolist(), next_step=False, follow=True)
        assert eng.sequence_length(seq) == len(PROMPT)
    finally:
        eng.remove_sequence(seq)


def test_no_step_is_begun_ahead_past_the_context_window(compiled):
    from dsv2_mlc.runtime.engine import ContextLengthError, Engine

    eng = Engine(compiled["A"], context_window=len(PROMPT) + 2)
    (seq,), tokens = _prefilled(eng, [PROMPT])
    for _ in range(2):
        tokens = eng.launch_greedy([seq], tokens.tolist(), follow=True).result()
    assert eng._ahead is None and eng._followed is None
    assert eng.sequence_length(seq) == len(PROMPT) + 2
    with pytest.raises(ContextLengthError, match="context window"):
        eng.launch_greedy([seq], tokens.tolist())
    eng.popn(seq, 1)  # the cache is as the two steps left it
    assert eng.sequence_length(seq) == len(PROMPT) + 1


def test_greedy_generation_that_stops_undoes_the_step_begun_ahead(compiled):
    from dsv2_mlc.runtime.engine import Engine
    from dsv2_mlc.runtime.generation import run_generation

    eng = Engine(compiled["A"], context_window=64)
    ref = eng.generate(PROMPT, 8, stop_token_ids=[]).token_ids
    stop = ref[4]
    seq = eng.add_sequence()
    params = SamplingParams(max_tokens=8)
    result = run_generation(eng, seq, PROMPT, 0, params, None, [stop], 8).collect()
    assert result.token_ids == ref[: ref.index(stop) + 1] and result.finish_reason == "stop"
    # the prompt and every token but the stop token went through the model, nothing more (the
    # step that followed the stop token is undone)
    assert eng._ahead is None and eng._followed is None
    assert eng.sequence_length(seq) == len(PROMPT) + ref.index(stop)
    other = eng.add_sequence()  # the same tokens through plain steps
    eng.prefill([other], [PROMPT])
    for token in ref[: ref.index(stop)]:
        eng.decode([other], [token])
    np.testing.assert_array_equal(eng.decode([seq], [stop]), eng.decode([other], [stop]))


def test_greedy_tokens_is_np_argmax_on_given_logits(engines):
    from dsv2_mlc.runtime.device import to_device

    eng = engines["A"]
    vocab = eng.config.vocab_size
    x = np.random.default_rng(0).standard_normal((4, 1, vocab)).astype(np.float32)
    x[1, 0, [3, 9, 400]] = 50.0  # a tie: the lowest id
    x[2, 0, [7, 11]] = np.nan  # a NaN wins, the first one
    out = to_numpy(eng._greedy(to_device(x, "cpu")))
    np.testing.assert_array_equal(out, x[:, 0].argmax(-1))


class _RecordingGraphs:
    """Stands in for :class:`DecodeGraphs` (which needs a GPU): runs ``call`` eagerly, records
    the keys and the outputs, and checks them with ``same`` as a first replay would."""

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.outs: list = []
        self.stats: dict[str, float] = {}

    def run(self, key, ids, call, to_device, write, same=None):
        ids_t = to_device(ids)
        write(ids_t, ids)
        out = call(ids_t)
        assert same is not None and same(out, out)
        self.keys.append(key)
        self.outs.append(out)
        return out

    def launch_greedy(self, key, ids):
        return None  # no verified graph: every step through run_greedy, recorded

    def run_greedy(self, key, ids, call, to_device, same=None):
        out = self.run(key, ids, call, to_device, lambda t, a: None, same)
        return to_numpy(out[1]).astype(np.int64)  # the real one reads them from pinned memory


def test_greedy_step_runs_in_one_graph_call_with_its_own_key(compiled):
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["B"], context_window=64, max_batch_size=2)
    graphs = eng._graphs = _RecordingGraphs()
    seqs, tokens = _prefilled(eng, _prompts(2))
    logits = eng.decode(seqs, tokens.tolist())
    for s in seqs:
        eng.popn(s, 1)
    picked = eng.decode_greedy(seqs, tokens.tolist())
    plain, greedy = graphs.keys
    assert greedy == (*plain, "greedy")  # a greedy graph never replays a logits-only one
    out = graphs.outs[1]
    assert len(out) == 2  # logits first (the replay check), then the tokens
    np.testing.assert_array_equal(to_numpy(out[0]).reshape(2, -1), logits)
    np.testing.assert_array_equal(to_numpy(out[1]), picked)
    np.testing.assert_array_equal(picked, logits.argmax(-1))


def test_builds_without_the_kernel_fall_back_to_the_host(compiled, monkeypatch):
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["A"], context_window=64)
    ref = eng.generate(PROMPT, 6, stop_token_ids=[]).token_ids
    monkeypatch.setattr(eng, "_greedy", None)  # as a build compiled before greedy_tokens
    assert not eng.has_device_greedy
    seqs, tokens = _prefilled(eng, _prompts(2))
    logits = eng.decode(seqs, tokens.tolist())
    for s in seqs:
        eng.popn(s, 1)
    np.testing.assert_array_equal(eng.decode_greedy(seqs, tokens.tolist()), logits.argmax(-1))
    assert eng.generate(PROMPT, 6, stop_token_ids=[]).token_ids == ref


def _spy(eng, monkeypatch) -> dict[str, int]:
    calls = {"decode": 0, "decode_greedy": 0, "launch_greedy": 0}
    for name in calls:
        real = getattr(eng, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(eng, name, counted)
    return calls


def test_greedy_generation_picks_on_the_device_with_the_same_tokens(compiled, monkeypatch):
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["A"], context_window=64)
    seq, tokens = _prefilled(eng, [PROMPT])
    host = [int(tokens[0])]
    for _ in range(7):
        host.append(int(eng.decode(seq, [host[-1]])[0].argmax()))
    eng.remove_sequence(seq[0])
    calls = _spy(eng, monkeypatch)
    assert eng.generate(PROMPT, 8, stop_token_ids=[]).token_ids == host
    assert calls == {"decode": 0, "decode_greedy": 0, "launch_greedy": 7}


def test_generation_overlaps_its_steps_unless_told_not_to(compiled, monkeypatch):
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["A"], context_window=64)
    assert eng.overlap_steps
    ref = eng.generate(PROMPT, 8, stop_token_ids=[]).token_ids
    follows: list[bool] = []
    real = eng.launch_greedy

    def spy(*args, **kwargs):
        follows.append(kwargs.get("follow", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(eng, "launch_greedy", spy)
    assert eng.generate(PROMPT, 8, stop_token_ids=[]).token_ids == ref
    assert follows == [True] * 6 + [False]  # no step is launched past max_new_tokens
    eng.overlap_steps = False
    follows.clear()
    assert eng.generate(PROMPT, 8, stop_token_ids=[]).token_ids == ref
    assert follows == [False] * 7 and eng._followed is None


@pytest.mark.parametrize(
    "params",
    [SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.7, seed=1)],
    ids=["penalty", "sampled"],
)
def test_generation_that_needs_logits_keeps_the_logits_path(params, compiled, monkeypatch):
    from dsv2_mlc.runtime.engine import Engine

    eng = Engine(compiled["A"], context_window=64)
    calls = _spy(eng, monkeypatch)
    eng.generate(PROMPT, 5, stop_token_ids=[], sampling=params)
    assert calls == {"decode": 4, "decode_greedy": 0, "launch_greedy": 0}


def test_only_plain_greedy_goes_without_logits():
    from dsv2_mlc.runtime.sampling import Sampler

    def needs(**kw) -> bool:
        return Sampler(SamplingParams(**kw), 16).needs_logits

    assert not needs() and not needs(top_k=5, top_p=0.5)  # temperature 0: top-k/p change nothing
    assert needs(repetition_penalty=1.1) and needs(temperature=0.5)
    sampler = Sampler(SamplingParams(repetition_penalty=2.0), 16)
    assert sampler.accept(np.int64(3)) == 3 and sampler._seen[3]  # the penalty will see it

"""Random sequences of Engine API calls (hypothesis) on the tiny CPU model, against a model of the
expected state (each live sequence's tokens): every call either succeeds with the state and
logits the model predicts, or raises one of the project's own errors and leaves the state as it
was - never a crash, a traceback from inside TVM, or a silently wrong result.

``EXAMPLES`` programs of up to ``STEPS`` calls each run per test session (derandomized, so CI sees
the same programs). A call's logits are compared with a fresh prefill of the sequence's whole
history (float32 on the CPU: the same kernels in another order, within ``ATOL``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv2_mlc.errors import Dsv2Error
from dsv2_mlc.runtime.engine import Engine

EXAMPLES = 60
STEPS = 8
ATOL = 2e-4
VOCAB = 512  # the tiny configs' vocabulary (tests/hf_reference.py)
WINDOW = 48

good_token = st.integers(0, VOCAB - 1)
bad_token = st.sampled_from([-1, VOCAB, 10**9, 1.5, 2.0, True, "7", None, b"\x01"])
# mostly valid calls (so the state grows and the logits are checked), some misuse mixed in
any_token = st.one_of(good_token, good_token, good_token, bad_token)
good_list = st.lists(good_token, min_size=1, max_size=20)
token_list = st.one_of(
    good_list,
    good_list,
    good_list,
    st.lists(any_token, max_size=6),
    st.sampled_from(["abc", b"abc", 5]),
)
live_ref = st.integers(0, 3)
seq_ref = st.one_of(live_ref, live_ref, live_ref, st.sampled_from([-1, 99, 1.0, "0", None]))
prefill_args = st.lists(st.tuples(seq_ref, token_list), min_size=1, max_size=2)
decode_args = st.one_of(
    st.lists(st.tuples(live_ref, good_token), min_size=1, max_size=1),
    st.lists(st.tuples(live_ref, good_token), min_size=1, max_size=1),
    st.lists(st.tuples(seq_ref, any_token), min_size=1, max_size=2),
)
op = st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("prefill"), prefill_args),
    st.tuples(st.just("prefill"), prefill_args),
    st.tuples(st.just("decode"), decode_args),
    st.tuples(st.just("decode"), decode_args),
    st.tuples(st.just("decode"), decode_args),
    st.tuples(st.just("fork"), seq_ref, st.one_of(st.just(-1), st.integers(-2, 25), st.just(1.5))),
    st.tuples(st.just("popn"), seq_ref, st.integers(-2, 6)),
    st.tuples(st.just("remove"), seq_ref),
)
# every program starts from one or two sequences holding a prompt each, then random calls
start = st.lists(good_list, min_size=1, max_size=2).map(
    lambda prompts: (
        [("add",)] * len(prompts) + [("prefill", [(i, p) for i, p in enumerate(prompts)])]
    )
)
program = st.tuples(start, st.lists(op, min_size=1, max_size=STEPS)).map(lambda p: p[0] + p[1])


@pytest.fixture(scope="module")
def engine(compiled) -> Engine:
    return Engine(compiled["A"], context_window=WINDOW, max_batch_size=3, kv_capacity=WINDOW * 3)


def _resolve(ref, handles: list[int]):
    """Small integers name the program's own sequences (by creation order, removed ones too);
    others pass as they are."""
    if type(ref) is int and 0 <= ref <= 3 and handles:
        return handles[ref % len(handles)]
    return ref


def _check_logits(engine: Engine, history: list[int], got: np.ndarray) -> None:
    want = engine.logits(history)[-1]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def _project_error(err: BaseException) -> bool:
    return isinstance(err, Dsv2Error)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(program=program)
def test_random_api_programs_match_the_model(engine: Engine, program: list) -> None:
    engine.reset()
    handles: list[int] = []  # every sequence the program made, in order (removed ones too)
    state: dict[int, list[int]] = {}  # live sequence -> its tokens
    for name, *args in program:
        before = {s: list(t) for s, t in state.items()}
        try:
            if name == "add":
                seq = engine.add_sequence()
                handles.append(seq)
                state[seq] = []
            elif name == "prefill":
                seqs = [_resolve(r, handles) for r, _ in args[0]]
                lists = [t for _, t in args[0]]
                out = engine.prefill(seqs, lists)
                for seq, tokens, row in zip(seqs, lists, out, strict=True):
                    state[seq] += list(tokens)
                    _check_logits(engine, state[seq], row)
            elif name == "decode":
                seqs = [_resolve(r, handles) for r, _ in args[0]]
                tokens = [t for _, t in args[0]]
                out = engine.decode(seqs, tokens)
                for seq, token, row in zip(seqs, tokens, out, strict=True):
                    state[seq].append(token)
                    _check_logits(engine, state[seq], row)
            elif name == "fork":
                parent = _resolve(args[0], handles)
                child = engine.fork_sequence(parent, args[1])
                handles.append(child)
                keep = len(state[parent]) if args[1] == -1 else args[1]
                state[child] = state[parent][:keep]
            elif name == "popn":
                seq = _resolve(args[0], handles)
                engine.popn(seq, args[1])
                state[seq] = state[seq][: len(state[seq]) - args[1]]
            elif name == "remove":
                seq = _resolve(args[0], handles)
                engine.remove_sequence(seq)
                del state[seq]
        except Exception as err:  # noqa: BLE001 - the property: only the project's own errors
            assert _project_error(err), f"{name}{tuple(args)} raised {type(err).__name__}: {err}"
            assert state == before, f"{name} failed but changed the model state"
        for seq, tokens in state.items():
            assert engine.sequence_length(seq) == len(tokens), (name, args)
    for seq, tokens in state.items():  # the cache still holds each history exactly
        if tokens and len(tokens) < WINDOW:
            _check_logits(engine, tokens + [0], engine.decode([seq], [0])[0])
            engine.popn(seq, 1)

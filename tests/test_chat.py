"""Generation, streaming, multi-turn chat, the JIT cache and ``dsv2-mlc chat`` on a tiny random
checkpoint with a BPE tokenizer and DeepSeek-V2's chat template (compiled once, via the cache)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from chat_fixtures import copy_model, deepseek_chat_template, write_tokenizer

import dsv2_mlc
from dsv2_mlc import resolve
from dsv2_mlc.cli import main
from dsv2_mlc.layout import BUILD_CONFIG
from dsv2_mlc.runtime.chat import ChatSession
from dsv2_mlc.runtime.engine import ContextLengthError, Engine
from dsv2_mlc.runtime.sampling import SamplingParams

WINDOW = 256
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11, "max_tokens": 12}
STATS = re.compile(
    r"prefill: [\d.]+ tok/s \((\d+) tokens\), decode: [\d.]+ tok/s \((\d+) tokens\), "
    rf"context: (\d+)/{WINDOW} tokens"
)


@pytest.fixture(scope="module")
def chat_ckpt(checkpoints, tmp_path_factory) -> Path:
    ckpt = copy_model(checkpoints["A"], tmp_path_factory.mktemp("chat") / "tiny-chat")
    write_tokenizer(ckpt, chat_template=deepseek_chat_template())
    return ckpt


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jit-cache")


@pytest.fixture(scope="module")
def chat_dir(chat_ckpt, cache_dir) -> Path:
    return resolve.resolve_model(chat_ckpt, cache_dir=cache_dir)  # compiles: first use


@pytest.fixture(scope="module")
def engine(chat_dir) -> Engine:
    return Engine(chat_dir, context_window=WINDOW, max_batch_size=2)


@pytest.fixture(scope="module")
def base_dir(chat_dir, tmp_path_factory) -> Path:
    """The same compiled model with a base (template-less) tokenizer config."""
    out = copy_model(chat_dir, tmp_path_factory.mktemp("base") / "tiny-base")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def base_engine(base_dir) -> Engine:
    return Engine(base_dir, context_window=WINDOW, max_batch_size=2)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{**SAMPLED, **kw})


def _hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_chat_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _cli(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsv2_mlc.cli", "chat", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- JIT cache ------------------------------------------------------------------------------------
def test_second_open_uses_the_cache(chat_ckpt, cache_dir, chat_dir, monkeypatch):
    from dsv2_mlc.compiler import compile as compiler

    calls = []
    monkeypatch.setattr(compiler, "compile_model", lambda *a, **k: calls.append(a))
    stamp = (chat_dir / BUILD_CONFIG).stat().st_mtime_ns
    assert resolve.resolve_model(chat_ckpt, cache_dir=cache_dir) == chat_dir
    assert dsv2_mlc.load(chat_ckpt, cache_dir=cache_dir, context_window=32).path == chat_dir
    # The embedded default model goes through the same cache.
    monkeypatch.setattr(resolve, "default_model_dir", lambda: chat_ckpt)
    assert resolve.resolve_model(None, cache_dir=cache_dir) == chat_dir
    assert dsv2_mlc.load(cache_dir=cache_dir, context_window=32).path == chat_dir
    assert calls == []
    assert (chat_dir / BUILD_CONFIG).stat().st_mtime_ns == stamp
    assert chat_dir.parent == cache_dir / resolve.BUILDS_DIR
    assert chat_dir.name.startswith("tiny-chat-q0f32-cpu-")

    # A changed checkpoint file is a new entry, compiled on its first use.
    changed = copy_model(chat_ckpt, cache_dir.parent / "changed")
    cfg = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    resolve.resolve_model(changed, cache_dir=cache_dir)
    assert len(calls) == 1 and Path(calls[0][1]) != chat_dir


def test_cache_key_covers_everything_that_changes_the_build(chat_ckpt, tmp_path, monkeypatch):
    def key(ckpt=chat_ckpt, **kw):
        return resolve.cache_key(ckpt, **{"dtype": None, "device": "cpu", **kw})

    base = key()
    assert key() == base and key(dtype="float32") != base  # explicit inputs are part of it
    assert key(dtype="float16") != base and key(quantization="q4f32_g32") != base
    assert key(device="cuda") != base
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        other = copy_model(chat_ckpt, tmp_path / name)
        with open(other / name, "ab") as f:
            f.write(b" ")
        assert key(other) != base, name
    monkeypatch.setattr(resolve, "tvm_version", lambda: "0.0.0")
    assert key() != base
    monkeypatch.undo()
    sources = resolve.compiler_sources()
    assert any(p.match("passes/*.py") for p in sources)
    assert any(p.match("schedules/*.py") for p in sources)
    assert any(p.match("dsv2_mlc/model/*.py") for p in sources)
    assert any(p.match("dsv2_mlc/compiler/compile.py") for p in sources)
    src = tmp_path / "extra_pass.py"
    src.write_text("x = 1\n")
    monkeypatch.setattr(resolve, "compiler_sources", lambda: [*sources, src])
    one = key()
    src.write_text("x = 2\n")
    assert key() != one != base


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv(resolve.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve.default_cache_dir() == tmp_path / "xdg" / "dsv2-mlc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve.default_cache_dir() == tmp_path / "home" / ".cache" / "dsv2-mlc"
    monkeypatch.setenv(resolve.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert resolve.default_cache_dir() == tmp_path / "mine"


# -- generate and stream -------------------------------------------------------------------------
def test_greedy_text_generation_is_argmax(engine):
    prompt = "Hello there"
    ids = engine.tokenizer.encode(prompt)
    seq = engine.add_sequence()
    try:
        logits, ref = engine.prefill([seq], [ids])[0], []
        for _ in range(10):
            ref.append(int(np.argmax(logits)))
            logits = engine.decode([seq], [ref[-1]])[0]
    finally:
        engine.remove_sequence(seq)
    out = engine.generate(prompt, sampling=SamplingParams(max_tokens=10, stop_token_ids=()))
    assert out.token_ids == ref
    assert out.text == engine.tokenizer.decode(ref)
    assert engine.generate(ids, 10, stop_token_ids=[]).token_ids == ref  # the low-level form


def test_stream_equals_generate_and_seed_reproduces(engine):
    live = dict(engine._seq_len)
    prompt = "Hello there"
    params = _params(max_tokens=24, stop_token_ids=())
    stream = engine.stream(prompt, sampling=params)
    deltas = list(stream)
    assert all(len(d.token_ids) == 1 for d in deltas) and deltas[-1].finish_reason == "length"
    streamed = "".join(d.text for d in deltas)
    tokens = [d.token_ids[0] for d in deltas]
    again = engine.generate(prompt, sampling=params)
    assert again.token_ids == tokens == stream.result.token_ids
    assert again.text == streamed == engine.tokenizer.decode(tokens)
    other = engine.generate(prompt, sampling=params.updated(seed=12))
    assert other.token_ids != tokens
    assert engine._seq_len == live  # every sequence was released


def test_stop_strings_are_trimmed_and_never_streamed(engine):
    prompt = "Hello there"
    params = SamplingParams(max_tokens=30, stop_token_ids=())
    deltas = list(engine.stream(prompt, sampling=params))
    full = "".join(d.text for d in deltas)
    # A stop string across a token boundary: its first part must be held back.
    ends = np.cumsum([len(d.text) for d in deltas])
    cut = next(int(e) for e in ends if 8 < e < len(full) - 2 and full[e - 1 : e + 1].strip())
    stop = full[cut - 1 : cut + 1]
    want = full[: full.index(stop)]
    for stops in ([stop], ["never-there", stop]):
        stream = engine.stream(prompt, sampling=params.updated(stop=tuple(stops)))
        got = list(stream)
        assert "".join(d.text for d in got) == want == stream.result.text
        assert stream.result.finish_reason == "stop"
        assert len(got) < len(deltas)


def test_prompt_longer_than_the_window_is_an_error(engine):
    live = dict(engine._seq_len)
    long = "hello " * 400
    with pytest.raises(ContextLengthError, match="context window"):
        engine.generate(long)
    with pytest.raises(ContextLengthError, match="context window"):
        ChatSession(engine).send(long)
    assert engine._seq_len == live


# -- multi-turn -----------------------------------------------------------------------------------
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_multi_turn_equals_one_prefill_of_the_conversation(engine, chat_dir, system):
    hf = _hf_tokenizer(chat_dir)
    params = SamplingParams(max_tokens=8)
    session = ChatSession(engine, system=system, sampling=params)
    first = session.send("Hello there")
    second = session.send("How are you?")
    convo = session.messages[:-1]
    assert [m["role"] for m in convo][-3:] == ["user", "assistant", "user"]
    full = _hf_chat_ids(hf, convo)  # the reference rendering of the whole conversation
    fresh = engine.generate(full, sampling=params)
    assert second.token_ids == fresh.token_ids
    assert second.prompt_tokens == len(full)
    # Turn 2 prefilled only what turn 1 had not: at least its whole prompt came from the cache,
    # and exactly the tokens turn 1 left in it that agree with the rendering.
    assert second.cached_tokens >= first.prompt_tokens
    turn1 = _hf_chat_ids(hf, convo[:-2]) + first.token_ids[:-1]
    assert second.cached_tokens == _common_prefix(turn1, full)
    assert session.context_used == len(full) + len(second.token_ids)
    # Sampled turns too: the same seed gives the same reply as a fresh prefill.
    sampled = session.send("And then?", _params())
    ref = engine.generate(_hf_chat_ids(hf, session.messages[:-1]), sampling=_params())
    assert sampled.token_ids == ref.token_ids and sampled.text == ref.text
    session.close()


def test_base_model_chat_is_plain_completion(base_engine, base_dir):
    from tokenizers import Tokenizer as HFTokenizer

    session = ChatSession(base_engine, sampling=SamplingParams(max_tokens=6))
    assert not session.use_template
    p1, p2 = "def add(a, b):", "\nprint("
    first = session.send(p1)
    second = session.send(p2)
    text = p1 + first.text + p2
    ids = [0, *HFTokenizer.from_file(str(base_dir / "tokenizer.json")).encode(text).ids]
    assert second.token_ids == base_engine.generate(ids, sampling=session.sampling).token_ids
    turn1 = [0, *HFTokenizer.from_file(str(base_dir / "tokenizer.json")).encode(p1).ids]
    assert first.prompt_tokens == len(turn1)
    # Only the tokens that disagree with the new rendering (a re-merged boundary) are redone.
    assert second.cached_tokens == _common_prefix(turn1 + first.token_ids[:-1], ids)
    assert second.cached_tokens >= len(turn1) - 2
    assert session.stats.turns == 2
    session.reset()
    assert session.context_used == 0 and session.messages == []
    session.close()


def test_openai_style_api(engine, chat_dir):
    messages = [{"role": "user", "content": "Hello there"}]
    kw = {"temperature": 0.8, "top_k": 40, "seed": 5, "max_tokens": 10}
    answer = engine.chat.completions.create(messages=messages, **kw)
    chunks = list(engine.chat.completions.create(messages=messages, stream=True, **kw))
    ref = engine.generate(
        _hf_chat_ids(_hf_tokenizer(chat_dir), messages),
        sampling=SamplingParams(**kw),
    )
    assert answer.choices[0].message.content == ref.text
    assert "".join(c.choices[0].delta.content for c in chunks) == ref.text
    assert [t for c in chunks for t in c.token_ids] == answer.token_ids == ref.token_ids
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason
    assert answer.usage.prompt_tokens == ref.prompt_tokens
    assert answer.usage.completion_tokens == len(ref.token_ids)
    follow = [*messages, {"role": "assistant", "content": answer.choices[0].message.content}]
    follow.append({"role": "user", "content": "More."})
    again = engine.chat.completions.create(messages=follow, **kw)
    assert again.usage.cached_tokens >= answer.usage.prompt_tokens  # the prefix was reused


# -- the CLI --------------------------------------------------------------------------------------
def _cli_sampling_args() -> list[str]:
    return [
        "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "11",
        "--max-tokens", "12", "--context-window", str(WINDOW),
    ]  # fmt: skip


def test_cli_two_turns_and_stats_over_stdin(engine, chat_dir):
    proc = _cli(str(chat_dir), *_cli_sampling_args(), stdin="Hello there\nHow are you?\n/stats\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    defaults = SamplingParams.from_generation_config(chat_dir)
    session = ChatSession(engine, sampling=defaults.updated(**SAMPLED))
    one, two = session.send("Hello there"), session.send("How are you?")
    head = one.text + "\n" + two.text + "\n"
    assert proc.stdout.startswith(head)
    stats = STATS.fullmatch(proc.stdout[len(head) :].rstrip("\n"))
    assert stats is not None, proc.stdout
    assert int(stats[1]) == two.prompt_tokens - two.cached_tokens
    assert int(stats[2]) == len(two.token_ids)
    assert int(stats[3]) == session.context_used
    session.close()


def test_cli_prompt_streams_what_generate_returns(engine, chat_dir, base_engine, base_dir):
    proc = _cli(str(chat_dir), "--prompt", "Hello there", *_cli_sampling_args())
    assert proc.returncode == 0, proc.stderr
    ids = _hf_chat_ids(_hf_tokenizer(chat_dir), [{"role": "user", "content": "Hello there"}])
    assert proc.stdout == engine.generate(ids, sampling=_params()).text + "\n"
    proc = _cli(str(base_dir), "--prompt", "def f(", *_cli_sampling_args(), "--stop", "\n")
    assert proc.returncode == 0, proc.stderr
    ref = base_engine.generate("def f(", sampling=_params(stop=("\n",)))
    assert proc.stdout == ref.text + "\n"


def test_cli_commands_reset_and_exit(engine, chat_dir):
    from dsv2_mlc.chat_repl import HELP

    script = "/help\nHello\n/reset\n/stats\n/nope\n//exit is text\n/exit\nnever answered\n"
    proc = _cli(str(chat_dir), "--max-tokens", "4", "--context-window", str(WINDOW), stdin=script)
    assert proc.returncode == 0, proc.stderr
    assert "unknown command '/nope'" in proc.stderr
    session = ChatSession(engine, sampling=SamplingParams(max_tokens=4))
    first = session.send("Hello").text
    session.reset()
    stats = session.stats.summary()
    assert STATS.fullmatch(stats)[3] == "0"  # nothing in context after /reset
    second = session.send("/exit is text").text  # "//" escapes a leading slash
    session.close()
    # /exit ends the session: "never answered" gets no reply.
    assert proc.stdout == f"{HELP}\n{first}\n{stats}\n{second}\n"


def test_cli_pseudo_terminal_session(chat_dir):
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv2_mlc.cli", "chat", str(chat_dir), "--max-tokens", "4"],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    out = b""

    def read_until(prompts: int, deadline: float) -> None:
        """Read until the REPL has shown its input prompt ``prompts`` times."""
        nonlocal out
        while out.count(b">>> ") < prompts and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                out += os.read(leader, 4096)

    try:
        read_until(1, time.monotonic() + 90)
        os.write(leader, b"Hello\n")
        read_until(2, time.monotonic() + 60)
        os.write(leader, b"/stats\n")
        read_until(3, time.monotonic() + 60)
        os.write(leader, b"\x04")  # Ctrl-D at the prompt: a clean exit
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = out.decode(errors="replace")
    assert "dsv2-mlc chat:" in text and ">>> " in text and "context:" in text
    assert "Traceback" not in text


# -- one-line errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--max-tokens", "0"], "max tokens"),
        (["--seed", "-1"], "seed"),
        (["--context-window", "1"], "context window"),
    ],
)
def test_cli_invalid_values_one_line(chat_dir, capsys, flags, words):
    assert main(["chat", str(chat_dir), "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and err.startswith("dsv2-mlc chat: error:")


def test_cli_unknown_model_unreadable_tokenizer_long_prompt(chat_dir, tmp_path, capsys):
    proc = _cli(str(tmp_path / "no-such-model"), "--prompt", "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "unknown model" in proc.stderr

    assert main(["chat", str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a checkpoint folder" in capsys.readouterr().err

    broken = copy_model(chat_dir, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{ not a tokenizer")
    assert main(["chat", str(broken), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tokenizer.json: unreadable" in err

    long = "hello " * 100
    assert main(["chat", str(chat_dir), "--prompt", long, "--context-window", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "context window holds 32" in err


def test_cli_default_model_compiles_once(default_model_cache):
    cache, first = default_model_cache  # `chat --prompt "def " --max-tokens 8 --cache-dir CACHE`
    assert first.returncode == 0, first.stderr
    assert "compiling" in first.stderr
    env = {**os.environ, resolve.CACHE_DIR_ENV: str(cache)}
    second = subprocess.run(
        [sys.executable, "-m", "dsv2_mlc.cli", "chat", "--prompt", "def ", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr  # the cached build was used
    eng = dsv2_mlc.load(cache_dir=cache)
    params = SamplingParams.from_generation_config(eng.path).updated(max_tokens=8)
    assert first.stdout == second.stdout == eng.generate("def ", sampling=params).text + "\n"

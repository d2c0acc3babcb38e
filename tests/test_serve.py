"""``dsv2-mlc serve``: the OpenAI-compatible server on the embedded default model (CPU).

Each server listens on a free loopback port, started and stopped by its fixture (uvicorn in a
thread of this process; one test runs the real ``dsv2-mlc serve`` command). Replies are checked
against the engine itself (``Engine.generate`` one request at a time, ``Engine.logits``); every
request loop is bounded in count and in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from dsv2_mlc import resolve
from dsv2_mlc.runtime.engine import Engine
from dsv2_mlc.serve.app import create_app
from dsv2_mlc.serve.metrics import FAMILIES
from dsv2_mlc.serve.scheduler import Scheduler

WINDOW = 256
TIMEOUT = 60.0  # seconds any one request may take
N_REQUESTS = 1000  # of the stress test, the count


@pytest.fixture(scope="module")
def model_path(default_model_cache) -> Path:
    cache, first_run = default_model_cache
    assert first_run.returncode == 0, first_run.stderr
    return resolve.resolve_model(None, cache_dir=cache)


@pytest.fixture(scope="module")
def reference(model_path) -> Engine:
    """A second engine on the same build: the answers one request at a time."""
    return Engine(model_path, context_window=WINDOW, max_batch_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    scheduler: Scheduler

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="none", timeout=TIMEOUT, **kw)

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """Every sample of ``/metrics`` as {family: {labels: value}}, via the text parser."""
        text = httpx.get(self.url + "/metrics", timeout=TIMEOUT).text
        out: dict[str, dict[tuple, float]] = {}
        for fam in text_string_to_metric_families(text):
            samples = out.setdefault(fam.name, {})
            for s in fam.samples:
                samples[(s.name, *sorted(s.labels.items()))] = s.value
        return out

    def gauge(self, name: str) -> float:
        return self.metrics()[name][(name,)]

    def counter(self, name: str) -> float:
        return self.metrics()[name][(name + "_total",)]

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _serve(factory: Callable[[], Engine], **kw) -> Iterator[Server]:
    app = create_app(factory, model_name="default", **kw)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    server = Server(f"http://127.0.0.1:{port}", app.state.scheduler)
    try:
        yield server
    finally:
        srv.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def _ready(server: Server, timeout: float = 120.0) -> None:
    def up() -> bool:
        try:
            return httpx.get(server.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    server.wait_for(up, "the server to load its model", timeout)


@pytest.fixture(scope="module")
def server(model_path) -> Iterator[Server]:
    """max_batch 8 (16 concurrent requests queue), a KV cache of 2048 tokens."""

    def factory() -> Engine:
        return Engine(model_path, context_window=WINDOW, max_batch_size=8, kv_capacity=2048)

    with _serve(factory, step_tokens=64) as s:
        _ready(s)
        yield s


@pytest.fixture(scope="module")
def small_server(model_path) -> Iterator[Server]:
    """A KV cache of 512 tokens (32 pages) for 6 sequences: admission waits, prefixes are
    evicted and sequences preempted."""

    def factory() -> Engine:
        return Engine(model_path, context_window=WINDOW, max_batch_size=6, kv_capacity=512)

    with _serve(factory, step_tokens=48) as s:
        _ready(s)
        yield s


PROMPTS = [
    "def ",
    "import numpy as np\n",
    "class Stack:\n    def __init__(self):",
    "# sort a list\n",
    "def fib(n):\n    ",
    "for i in range(10):",
    "x = [1, 2, 3]\nprint(",
    "def add(a, b):\n    return",
    "with open(path) as f:\n",
    "try:\n    import torch\nexcept",
    "async def main():\n",
    "def is_prime(n):\n    if n < 2:",
    "from collections import",
    "while True:\n    line = input()",
    "def read_json(path):\n    ",
    "if __name__ == '__main__':\n",
]


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["default"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_concurrent_greedy_matches_sequential_generate(server, reference):
    """16 requests at once (8 run, the rest queue and join as others leave) answer exactly what
    Engine.generate answers for each alone."""
    want = [reference.generate(p, max_new_tokens=24).text for p in PROMPTS]

    async def run() -> list[str]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT)
        try:
            replies = await asyncio.gather(
                *(
                    client.completions.create(model="default", prompt=p, max_tokens=24)
                    for p in PROMPTS
                )
            )
        finally:
            await client.close()
        return [r.choices[0].text for r in replies]

    assert asyncio.run(asyncio.wait_for(run(), 120)) == want


def test_chat_streaming_and_not(server, reference):
    """A chat answer (a model without a chat template: its messages' text continued), streamed
    and whole; the stream's deltas join to the whole answer, usage comes last on request."""
    messages = [{"role": "user", "content": "def fib(n):\n    "}]
    want = reference.generate("def fib(n):\n    ", max_new_tokens=20)
    client = server.client()
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=20)
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.completion_tokens == len(want.token_ids)
    assert whole.usage.prompt_tokens == want.prompt_tokens
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_completion_logprobs_match_engine_logits(server, reference):
    prompt = "def add(a, b):\n"
    r = server.client().completions.create(model="default", prompt=prompt, max_tokens=6, logprobs=3)
    ids = reference.encode_prompt(prompt)
    gen = reference.generate(prompt, max_new_tokens=6).token_ids
    logits = reference.logits(ids + gen[:-1])[len(ids) - 1 :].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    lp = r.choices[0].logprobs
    expect = [float(logp[i, t]) for i, t in enumerate(gen)]
    np.testing.assert_allclose(lp.token_logprobs, expect, atol=1e-4)
    for i, top in enumerate(lp.top_logprobs):
        best = np.sort(logp[i])[::-1][:3]
        np.testing.assert_allclose(sorted(top.values(), reverse=True), best, atol=1e-4)
    assert "".join(lp.tokens) == r.choices[0].text


def test_sampling_n_seed_and_stop(server, reference):
    client = server.client()
    kw = {"model": "default", "prompt": "def ", "max_tokens": 12, "temperature": 1.0}
    a = client.completions.create(n=3, seed=7, **kw)
    b = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the seed reproduces
    assert len({c.text for c in a.choices}) > 1  # each choice draws its own tokens
    greedy = reference.generate("def ", max_new_tokens=24).text
    stop = greedy[6:9]
    r = client.completions.create(model="default", prompt="def ", max_tokens=24, stop=[stop])
    assert r.choices[0].text == greedy[: greedy.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_prefix_cache_hit_prefills_only_the_rest(server, reference):
    """A prompt sharing 4 whole pages with an earlier one forks them: cached_tokens is 64 and
    only the rest goes through prefill; the answer is still Engine.generate's."""
    rng = random.Random(1)
    shared = [0] + [rng.randrange(100, 4000) for _ in range(79)]  # BOS, then 79 tokens
    first = shared
    second = shared[:64] + [rng.randrange(100, 4000) for _ in range(30)]
    client = server.client()
    r1 = client.completions.create(model="default", prompt=first, max_tokens=8)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    before = server.counter("dsv2_prefill_tokens")
    hits = server.counter("dsv2_prefix_cache_hit_tokens")
    r2 = client.completions.create(model="default", prompt=second, max_tokens=8)
    assert r2.usage.prompt_tokens == 94
    assert r2.usage.prompt_tokens_details.cached_tokens == 64
    assert server.counter("dsv2_prefill_tokens") - before == 94 - 64
    assert server.counter("dsv2_prefix_cache_hit_tokens") - hits == 64
    assert r2.choices[0].text == reference.generate(second, max_new_tokens=8).text
    # the same prompt again: all its whole pages but the one holding its last token are cached
    r3 = client.completions.create(model="default", prompt=second, max_tokens=8)
    assert r3.usage.prompt_tokens_details.cached_tokens == 80
    assert r3.choices[0].text == r2.choices[0].text
    assert 0 < server.gauge("dsv2_prefix_cache_hit_rate") < 1


def test_cancel_mid_stream_frees_pages(server):
    server.wait_for(lambda: server.gauge("dsv2_num_requests_running") == 0, "an idle server")
    server.scheduler.clear_prefix_cache()  # no eviction during the test changes the baseline
    server.wait_for(lambda: server.gauge("dsv2_kv_pages_used") == 0, "an empty KV cache")
    baseline = 0.0
    aborted = server.metrics()["dsv2_request_success"][
        ("dsv2_request_success_total", ("finish_reason", "abort"))
    ]
    prompt = [0] + [random.Random(2).randrange(100, 4000) for _ in range(70)]
    stream = server.client().completions.create(
        model="default", prompt=prompt, max_tokens=150, stream=True, extra_body={"ignore_eos": True}
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got >= 3:
            break
    assert server.gauge("dsv2_kv_pages_used") > baseline  # its pages are held while it runs
    stream.close()  # the client goes away mid-stream
    server.wait_for(
        lambda: (
            server.gauge("dsv2_kv_pages_used") == baseline
            and server.gauge("dsv2_num_requests_running") == 0
        ),
        "the cancelled sequence's pages to be freed",
    )
    m = server.metrics()["dsv2_request_success"]
    assert m[("dsv2_request_success_total", ("finish_reason", "abort"))] == aborted + 1


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors(server):
    url = server.url + "/v1"
    post = httpx.post
    e = _error(post(url + "/completions", json={"model": "default"}), 400)
    assert e["param"] == "prompt"
    e = _error(post(url + "/completions", json={"prompt": "x", "temperature": -1}), 400)
    assert e["param"] == "temperature"
    e = _error(post(url + "/completions", json={"prompt": "x", "max_tokens": 0}), 400)
    assert e["param"] == "max_tokens"
    _error(post(url + "/chat/completions", json={"messages": []}), 400)
    _error(post(url + "/chat/completions", content=b"{not json"), 400)
    e = _error(post(url + "/completions", json={"prompt": [0] * (WINDOW + 1)}), 400)
    assert e["code"] == "context_length_exceeded"
    e = _error(post(url + "/completions", json={"prompt": "def ", "max_tokens": WINDOW}), 400)
    assert e["code"] == "context_length_exceeded"
    e = _error(post(url + "/completions", json={"prompt": [10**6]}), 400)
    e = _error(post(url + "/completions", json={"prompt": "x", "frequency_penalty": 1}), 400)
    assert e["param"] == "frequency_penalty"
    e = _error(post(url + "/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found"
    _error(httpx.get(server.url + "/v1/nothing"), 404)
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=[], max_tokens=4)
    assert err.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="def ", max_tokens=4)


def test_many_requests_random_cancels_no_leaks(small_server, reference):
    """N_REQUESTS requests, 16 at a time, random prompt lengths (1-127 tokens, half sharing
    prefixes) and lengths (1-23 tokens), a third streamed and cancelled at a random point; on a
    KV cache this small, admission waits and cached prefixes are evicted and sequences
    preempted. Every answer completes or is cancelled by us, nothing else fails (within a time
    bound), and once idle with the prefix cache cleared no page is held."""
    rng = random.Random(3)
    base = [0] + [rng.randrange(100, 4000) for _ in range(127)]
    jobs = []
    for _ in range(N_REQUESTS):
        n = rng.randrange(1, 128)
        prompt = base[:n] if rng.random() < 0.5 else [rng.randrange(100, 4000) for _ in range(n)]
        cancel_after = rng.randrange(0, 10) if rng.random() < 0.33 else None
        jobs.append((prompt, rng.randrange(1, 24), cancel_after))
    outcomes: list[str] = []
    answers: list[tuple[list[int], int, str]] = []

    async def one(client, prompt, max_tokens, cancel_after) -> None:
        if cancel_after is None:
            r = await client.completions.create(
                model="default", prompt=prompt, max_tokens=max_tokens
            )
            assert r.choices[0].finish_reason in ("stop", "length")
            assert r.usage.completion_tokens <= max_tokens
            outcomes.append("done")
            answers.append((prompt, max_tokens, r.choices[0].text))
            return
        stream = await client.completions.create(
            model="default", prompt=prompt, max_tokens=24, stream=True
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen > cancel_after:
                break
        await stream.close()
        outcomes.append("cancelled")

    async def run() -> None:
        client = AsyncOpenAI(base_url=small_server.url + "/v1", api_key="none", timeout=TIMEOUT)
        gate = asyncio.Semaphore(16)

        async def gated(job):
            async with gate:
                await one(client, *job)

        try:
            await asyncio.gather(*(gated(j) for j in jobs))
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(run(), 240))
    assert len(outcomes) == len(jobs)
    s = small_server
    s.wait_for(
        lambda: (
            s.gauge("dsv2_num_requests_running") == 0 and s.gauge("dsv2_num_requests_waiting") == 0
        ),
        "the server to go idle",
    )
    m = s.metrics()
    assert m["dsv2_preemptions"][("dsv2_preemptions_total",)] > 0  # memory did run short
    s.scheduler.clear_prefix_cache()
    s.wait_for(lambda: s.gauge("dsv2_kv_pages_used") == 0, "every page to be free")
    assert s.gauge("dsv2_kv_pages_free") == s.scheduler.total_pages
    engine = s.scheduler.engine
    assert engine is not None and not engine._seq_len  # no sequence left behind
    # answers computed in batches, from forked prefixes and after preemptions (recomputed) are
    # the ones each prompt gets alone
    for prompt, max_tokens, text in random.Random(4).sample(answers, 40):
        assert text == reference.generate(prompt, max_new_tokens=max_tokens).text
    # and the server still answers
    r = s.client().completions.create(model="default", prompt="def ", max_tokens=4)
    assert r.usage.completion_tokens >= 1


def test_metrics_families(server):
    server.client().completions.create(model="default", prompt="def ", max_tokens=4)
    m = server.metrics()
    for name in FAMILIES:
        assert name in m, name
    assert m["dsv2_time_to_first_token_seconds"][("dsv2_time_to_first_token_seconds_count",)] > 0
    assert m["dsv2_e2e_request_latency_seconds"][("dsv2_e2e_request_latency_seconds_count",)] > 0
    assert m["dsv2_generation_tokens"][("dsv2_generation_tokens_total",)] > 0
    # the CPU build's memory gauges: the process's resident set, within its peak
    used_mem, peak_mem = (
        server.gauge("dsv2_memory_used_bytes"),
        server.gauge("dsv2_memory_peak_bytes"),
    )
    assert 0 < used_mem <= peak_mem
    used, free = server.gauge("dsv2_kv_pages_used"), server.gauge("dsv2_kv_pages_free")
    assert used + free == server.scheduler.total_pages
    assert 0 <= server.gauge("dsv2_kv_page_fragmentation") <= 1


def test_loading_503_then_queue_full_429(model_path):
    """While the model loads every request gets a 503; a server whose queue holds nothing
    answers 429."""
    release = threading.Event()

    def factory() -> Engine:
        assert release.wait(60)
        return Engine(model_path, context_window=WINDOW, max_batch_size=2)

    with _serve(factory, max_queue=0) as s:
        s.wait_for(lambda: _reachable(s.url), "the server to listen")
        _error(httpx.get(s.url + "/health"), 503)
        e = _error(httpx.post(s.url + "/v1/completions", json={"prompt": "def "}), 503)
        assert e["type"] == "service_unavailable"
        release.set()
        _ready(s)
        e = _error(httpx.post(s.url + "/v1/completions", json={"prompt": "def "}), 429)
        assert e["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            s.client(max_retries=0).completions.create(model="default", prompt="x", max_tokens=2)


def _reachable(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
        return True
    except httpx.HTTPError:
        return False


def test_bench_serve_cli(server, tmp_path):
    from dsv2_mlc.cli import main

    out = tmp_path / "report.json"
    argv = ["bench-serve", server.url, "--concurrency", "4", "--requests", "8"]
    argv += ["--prompt-len", "24", "--gen-len", "6", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 8 and report["errors"] == 0
    assert report["output_tokens"] == 8 * 6  # ignore_eos: every request generates gen_len
    assert report["prompt_tokens"] == 8 * 24
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        assert report[key] is not None and report[key] > 0
    assert report["ttft_p50_s"] <= report["ttft_p99_s"]
    assert math.isclose(report["request_throughput"], 8 / report["duration_s"])
    # the server's memory, read from its /metrics after the run
    assert 0 < report["server_memory_used_bytes"] <= report["server_memory_peak_bytes"]


def test_serve_command(default_model_cache, reference):
    """The real ``dsv2-mlc serve`` process, called with the openai client, then stopped."""
    cache, _ = default_model_cache
    port = _free_port()
    cmd = [sys.executable, "-m", "dsv2_mlc.cli", "serve", "--port", str(port)]
    cmd += ["--cache-dir", str(cache), "--max-batch", "2", "--context-window", str(WINDOW)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        s = Server(f"http://127.0.0.1:{port}", None)  # type: ignore[arg-type]
        _ready(s)
        r = s.client().chat.completions.create(
            model="default", messages=[{"role": "user", "content": "def "}], max_tokens=10
        )
        assert r.choices[0].message.content == reference.generate("def ", 10).text
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    # uvicorn shuts down cleanly on SIGTERM, then re-raises the signal
    assert proc.returncode in (0, -15), out
    assert "Application shutdown complete" in out


def _steps_streamed_during_prefill(model_path: Path, step_tokens: int) -> int:
    """Tokens a running stream gets from a long prompt's arrival to that prompt's first token,
    on a scheduler with ``step_tokens`` (events recorded in the engine thread's order)."""
    from dsv2_mlc.runtime.sampling import SamplingParams
    from dsv2_mlc.serve.scheduler import Delta, Done, Request

    events: list[tuple[str, object]] = []
    sched = Scheduler(
        lambda: Engine(model_path, context_window=WINDOW, max_batch_size=2),
        step_tokens=step_tokens,
        prefix_cache=False,
    )
    sched.start()
    try:
        assert sched.ready.wait(60)

        def request(name: str, prompt: list[int], max_tokens: int) -> Request:
            return Request(
                id=name,
                prompt=prompt,
                params=SamplingParams(),
                max_tokens=max_tokens,
                stop_token_ids=frozenset(),
                emit=lambda e: events.append((name, e)),
            )

        def wait(cond: Callable[[], bool]) -> None:
            end = time.monotonic() + 30
            while not cond():
                assert time.monotonic() < end, "timed out"
                time.sleep(0.01)

        sched.submit(request("a", [0, 5, 6], 80))
        wait(lambda: len(events) >= 3)
        mark = len(events)
        sched.submit(request("b", [0] + list(range(100, 250)), 2))
        wait(lambda: any(n == "b" and isinstance(e, Done) for n, e in events))
        first_b = next(i for i, (n, e) in enumerate(events) if n == "b" and isinstance(e, Delta))
        return sum(1 for n, e in events[mark:first_b] if n == "a" and isinstance(e, Delta))
    finally:
        sched.stop()


def test_long_prompt_prefilled_in_chunks_while_streams_run(model_path):
    """A 151-token prompt under a 16-token step budget is prefilled over 11 steps, each of which
    also advances the running stream (a step or two more may pass before it is admitted); a
    budget that takes it whole (the control) gives the stream one step in the meantime."""
    assert _steps_streamed_during_prefill(model_path, 16) >= 10
    assert _steps_streamed_during_prefill(model_path, 1024) <= 3


def test_gpu_memory_sizes_the_kv_cache(model_path):
    """--gpu-memory BUDGET: the KV cache takes what the memory plan leaves (whole pages): an
    engine of that capacity fits the budget, one of a page more a sequence does not; a budget
    too small is refused with the planner's breakdown."""
    from dsv2_mlc.runtime.memory_plan import MemoryBudgetError, ModelMemory, budget_needed
    from dsv2_mlc.serve.app import kv_tokens_for_memory

    model = ModelMemory.from_build(model_path)
    budget = budget_needed(model, 1000, 4, None, None, None, 512, True) + 5000  # not a page
    tokens = kv_tokens_for_memory(model_path, budget, max_batch=4)
    assert tokens % 16 == 0 and 4 * 992 <= tokens <= 4 * 1000
    per_seq = tokens // 4
    assert budget_needed(model, per_seq, 4, None, None, None, 512, True) <= budget
    assert budget_needed(model, per_seq + 16, 4, None, None, None, 512, True) > budget
    engine = Engine(model_path, max_batch_size=4, kv_capacity=tokens, gpu_memory=budget,
                    context_window=min(WINDOW, tokens))  # fmt: skip
    assert engine.memory_plan is not None and engine.memory_plan.total <= budget
    with pytest.raises(MemoryBudgetError, match="holds no context at all"):
        kv_tokens_for_memory(model_path, model.resident_bytes // 2, max_batch=4)


def test_prefix_cache_radix_tree():
    """Matches whole 16-token blocks only; a path already held is not parked twice; eviction
    takes the least recently used entry that no running sequence was forked from first."""
    from dsv2_mlc.serve.prefix_cache import PrefixCache

    cache = PrefixCache()
    a = list(range(48))
    b = list(range(32)) + [1000 + i for i in range(16)]
    ea = cache.insert(1, a)
    eb = cache.insert(2, b)
    assert ea is not None and eb is not None
    assert cache.insert(3, a[:32]) is None  # held by both already
    assert cache.match(a + [7]) == (ea, 48)
    assert cache.match(a[:47]) in ((ea, 32), (eb, 32))  # the partial third block never matches
    assert cache.match(a, limit=47)[1] == 32
    assert cache.match(b[:40])[1] == 32
    assert cache.match([5] + a) == (None, 0)
    cache.touch(ea)  # b is now the least recently used
    eb.refs = 1  # ... but a sequence runs on it
    assert cache.evict_one() is ea
    assert cache.match(a) == (eb, 32)  # a's own third block is gone, the shared two stay
    assert cache.evict_one() is eb
    assert cache.match(b) == (None, 0) and len(cache) == 0 and cache.evict_one() is None


def test_default_max_tokens(server, reference):
    """Without max_tokens a completion stops after 16 tokens (OpenAI's default); a chat reply
    may use what the context window leaves."""
    r = server.client().completions.create(
        model="default", prompt="def ", extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    text = ""
    while len(reference.encode_prompt(text or "x")) < 220:  # a few tokens left in the window
        text += "x = 1\n"
    c = server.client().chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": text}],
        extra_body={"ignore_eos": True},
    )
    assert 220 <= c.usage.prompt_tokens < WINDOW
    assert c.usage.completion_tokens == WINDOW - c.usage.prompt_tokens


def test_model_without_tokenizer_answers_token_pieces(model_path, reference, tmp_path):
    """A build without tokenizer files (as random-weights benchmark builds are) serves token-id
    prompts; each generated token streams as the piece ``<id>``, the greedy tokens of
    ``Engine.generate``."""
    bare = tmp_path / "bare"
    shutil.copytree(model_path, bare, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))

    def factory() -> Engine:
        return Engine(bare, context_window=WINDOW, max_batch_size=2)

    prompt = [0, 500, 901, 1200, 77]
    want = reference.generate(prompt, max_new_tokens=6).token_ids
    with _serve(factory) as s:
        _ready(s)
        assert not s.scheduler.engine.has_tokenizer()
        r = s.client().completions.create(
            model="default", prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == "".join(f"<{t}>" for t in want)
        stream = s.client().completions.create(
            model="default",
            prompt=prompt,
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
        assert pieces == [f"<{t}>" for t in want]
        with pytest.raises(openai.BadRequestError, match="tokenizer"):
            s.client().completions.create(model="default", prompt=prompt, stop=["x"])

"""``dsv2-mlc bench-serve URL``: a load generator for an OpenAI-compatible server.

``requests`` streamed completions, ``concurrency`` at a time, each a prompt of ``prompt_len``
random token ids asking for ``gen_len`` tokens (``ignore_eos``, so every request generates them
all on servers that honour it), sent with the official ``openai`` client. Reported: request and
output-token throughput, time to first token and time per output token (p50, p99), errors, and
the server's memory in use and its peak when its ``/metrics`` has them (``dsv2-mlc serve``:
device memory on CUDA, the CUDA context included).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Dsv2Error
from .metrics import PREFIX


class BenchServeError(Dsv2Error, ValueError):
    """A load-generator option that cannot work."""


@dataclass
class BenchServeReport:
    """What one run measured (seconds; throughputs per second)."""

    url: str
    requests: int
    concurrency: int
    prompt_len: int
    gen_len: int
    completed: int = 0
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    request_throughput: float = 0.0
    output_token_throughput: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    server_memory_used_bytes: float | None = None
    server_memory_peak_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def print(self, json_path: str | Path | None = None) -> None:
        """The summary on stderr, the JSON report on stdout (and into ``json_path``)."""
        text = json.dumps(self.to_dict(), indent=2)
        if json_path:
            Path(json_path).write_text(text + "\n")
        print(self.summary(), file=sys.stderr)
        print(text)

    def summary(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.1f} ms"

        peak = self.server_memory_peak_bytes
        memory = "" if peak is None else f"; server memory peak {peak / 2**30:.2f} GiB"
        return (
            f"{self.completed}/{self.requests} requests in {self.duration_s:.2f} s "
            f"({self.request_throughput:.2f} req/s, {self.output_token_throughput:.1f} tok/s), "
            f"errors {self.errors}\n"
            f"TTFT p50 {ms(self.ttft_p50_s)}  p99 {ms(self.ttft_p99_s)}; "
            f"TPOT p50 {ms(self.tpot_p50_s)}  p99 {ms(self.tpot_p99_s)}{memory}"
        )


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _one(client: Any, model: str, prompt: list[int], gen_len: int) -> dict[str, Any]:
    start = time.perf_counter()
    first = last = None
    usage = None
    chunks = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=gen_len,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
    out = usage.completion_tokens if usage is not None else chunks
    ttft = None if first is None else first - start
    tpot = None
    if first is not None and last is not None and out > 1:
        tpot = (last - first) / (out - 1)
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    prompt_tokens = usage.prompt_tokens if usage is not None else len(prompt)
    return {"ttft": ttft, "tpot": tpot, "out": out, "prompt": prompt_tokens, "cached": cached}


async def _run(
    url: str,
    *,
    concurrency: int,
    requests: int,
    prompt_len: int,
    gen_len: int,
    model: str | None,
    seed: int,
    timeout: float,
) -> BenchServeReport:
    from openai import AsyncOpenAI

    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    client = AsyncOpenAI(base_url=base, api_key="none", timeout=timeout, max_retries=0)
    if model is None:
        model = (await client.models.list()).data[0].id
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 1000) for _ in range(prompt_len)] for _ in range(requests)]
    report = BenchServeReport(url, requests, concurrency, prompt_len, gen_len)
    gate = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []

    async def task(prompt: list[int]) -> None:
        async with gate:
            try:
                results.append(await _one(client, model, prompt, gen_len))
            except Exception as err:  # counted and reported, the run goes on
                report.errors += 1
                if len(report.error_messages) < 10:
                    report.error_messages.append(f"{type(err).__name__}: {err}")

    start = time.perf_counter()
    await asyncio.gather(*(task(p) for p in prompts))
    report.duration_s = time.perf_counter() - start
    await client.close()
    report.completed = len(results)
    report.output_tokens = sum(r["out"] for r in results)
    report.prompt_tokens = sum(r["prompt"] for r in results)
    report.cached_tokens = sum(r["cached"] for r in results)
    if report.duration_s > 0:
        report.request_throughput = report.completed / report.duration_s
        report.output_token_throughput = report.output_tokens / report.duration_s
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    report.ttft_p50_s, report.ttft_p99_s = _percentile(ttft, 50), _percentile(ttft, 99)
    report.tpot_p50_s, report.tpot_p99_s = _percentile(tpot, 50), _percentile(tpot, 99)
    memory = _server_gauges(base.removesuffix("/v1"), timeout)
    report.server_memory_used_bytes = memory.get(f"{PREFIX}_memory_used_bytes")
    report.server_memory_peak_bytes = memory.get(f"{PREFIX}_memory_peak_bytes")
    return report


def _server_gauges(root: str, timeout: float) -> dict[str, float]:
    """The server's gauges from ``root/metrics`` by name (empty when it has no such page)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(root + "/metrics", timeout=timeout)
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return {}
    return {s.name: float(s.value) for f in families if f.type == "gauge" for s in f.samples}


def bench_serve(
    url: str,
    *,
    concurrency: int = 8,
    requests: int = 64,
    prompt_len: int = 128,
    gen_len: int = 64,
    model: str | None = None,
    seed: int = 0,
    timeout: float = 600.0,
) -> BenchServeReport:
    """Run the load against ``url`` (the server's root or its ``/v1``) and report."""
    for name, value in (
        ("concurrency", concurrency),
        ("requests", requests),
        ("prompt_len", prompt_len),
        ("gen_len", gen_len),
    ):
        if value < 1:
            raise BenchServeError(f"{name} must be at least 1 (got {value})")
    return asyncio.run(
        _run(
            url,
            concurrency=concurrency,
            requests=requests,
            prompt_len=prompt_len,
            gen_len=gen_len,
            model=model,
            seed=seed,
            timeout=timeout,
        )
    )

"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own.

Latencies are histograms (seconds): time to first token, time per output token after the
first, end-to-end latency and time spent waiting for admission. Counters: prompt and generated
tokens, prompt tokens served from the prefix cache, tokens prefilled, finished requests by
finish reason, preemptions. Gauges, refreshed by the engine thread after every step: running and
waiting requests, KV pages used and free, page fragmentation (unused token slots in partly
filled pages over all allocated slots), the prefix cache's hit rate (cached over all prompt
tokens), and memory: the device's used bytes and their peak since the server started
(``cudaMemGetInfo``, the CUDA context included) on CUDA, the process's resident set on the CPU.

The expert-cache hit rate of the issue applies only where experts are offloaded to the host,
which this runtime does not do; there is no such metric.
"""

from __future__ import annotations

import resource
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "dsv2"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# every family /metrics exposes (the names the text parser reports: counters without _total)
FAMILIES = (
    f"{PREFIX}_time_to_first_token_seconds",
    f"{PREFIX}_time_per_output_token_seconds",
    f"{PREFIX}_e2e_request_latency_seconds",
    f"{PREFIX}_request_queue_time_seconds",
    f"{PREFIX}_prompt_tokens",
    f"{PREFIX}_generation_tokens",
    f"{PREFIX}_prefix_cache_hit_tokens",
    f"{PREFIX}_prefill_tokens",
    f"{PREFIX}_request_success",
    f"{PREFIX}_preemptions",
    f"{PREFIX}_num_requests_running",
    f"{PREFIX}_num_requests_waiting",
    f"{PREFIX}_kv_pages_used",
    f"{PREFIX}_kv_pages_free",
    f"{PREFIX}_kv_page_fragmentation",
    f"{PREFIX}_prefix_cache_hit_rate",
    f"{PREFIX}_memory_used_bytes",
    f"{PREFIX}_memory_peak_bytes",
)


class ServerMetrics:
    """The metric objects, registered in :attr:`registry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._prompt_total = self._cached_total = 0  # the hit rate's terms
        self._peak = 0  # bytes, the memory_peak gauge
        p = PREFIX
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            f"{p}_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds", "End-to-end latency", buckets=_LATENCY, registry=r
        )
        self.queue = Histogram(
            f"{p}_request_queue_time_seconds",
            "Time from arrival to admission",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            f"{p}_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache", registry=r
        )
        self.prefill_tokens = Counter(
            f"{p}_prefill_tokens",
            "Tokens run through the model before a sequence's next token: prompt tokens the "
            "prefix cache did not hold, and those of preempted sequences recomputed",
            registry=r,
        )
        self.finished = Counter(
            f"{p}_request_success", "Finished requests", ["finish_reason"], registry=r
        )
        for reason in ("stop", "length", "abort"):
            self.finished.labels(finish_reason=reason)
        self.preemptions = Counter(f"{p}_preemptions", "Sequences preempted", registry=r)
        self.running = Gauge(f"{p}_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge(f"{p}_num_requests_waiting", "Sequences waiting", registry=r)
        self.pages_used = Gauge(f"{p}_kv_pages_used", "KV pages in use", registry=r)
        self.pages_free = Gauge(f"{p}_kv_pages_free", "KV pages free", registry=r)
        self.fragmentation = Gauge(
            f"{p}_kv_page_fragmentation",
            "Unused token slots in partly filled pages over allocated slots",
            registry=r,
        )
        self.hit_rate = Gauge(
            f"{p}_prefix_cache_hit_rate", "Cached prompt tokens over all prompt tokens", registry=r
        )
        where = "device memory (CUDA) or the process's resident memory (CPU)"
        self.memory_used = Gauge(f"{p}_memory_used_bytes", f"Bytes of {where} in use", registry=r)
        self.memory_peak = Gauge(
            f"{p}_memory_peak_bytes", f"Peak bytes of {where} since start", registry=r
        )

    def record_memory(self, device_used: int | None) -> None:
        """Refresh the memory gauges: ``device_used`` bytes (CUDA), or with None the process's
        resident set (the CPU: the model lives in host memory)."""
        if device_used is None:
            used = _resident_bytes()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        else:
            used = peak = device_used
        self._peak = max(self._peak, peak, used)
        self.memory_used.set(used)
        self.memory_peak.set(self._peak)

    def record_prompt(self, prompt: int, cached: int) -> None:
        """Count one admitted sequence's prompt and its cached part; refresh the hit rate."""
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self._prompt_total += prompt
        self._cached_total += cached
        total = self._prompt_total
        self.hit_rate.set(self._cached_total / total if total else 0.0)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


def _resident_bytes() -> int:
    """The process's resident set size (Linux ``/proc/self/statm``; 0 where it is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * resource.getpagesize()

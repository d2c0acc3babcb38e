"""Continuous batching: one engine thread owns the :class:`Engine` and steps every live request.

The HTTP side (asyncio) hands requests in through a thread-safe inbox and receives events
(:class:`Delta`, :class:`Done`, :class:`Failed`) through a callback of each request; it never
touches the engine, which is not thread-safe.

Each step, at its boundary: cancellations are applied (the sequence and its pages freed at
once), waiting sequences are admitted first-come first-served while the KV pages allow (a prompt
sharing page-aligned blocks with a cached one forks that entry: :mod:`.prefix_cache`), then one
decode call advances every sequence that is generating by a token and one prefill call feeds
the others' prompts in chunks, all of them within ``step_tokens`` tokens, so a long prompt never
stalls the running streams for long. When the next step will be the same decode (nothing to
prefill or admit), the engine launches it as soon as this step's greedy tokens are known
(:meth:`Engine.launch_greedy` with ``follow``), so the host's streaming overlaps the device.
When the pages run short, cached prefixes are evicted (least recently used) and then the most
recently admitted sequence is preempted: its pages are freed and it waits again at its place in
line, to be recomputed (prompt plus the tokens it had generated) when readmitted.

Pages are counted as the engine counts them (every live sequence's length in whole pages, a
fork's shared prefix included), so no step can overflow the engine's KV capacity.
"""

from __future__ import annotations

import bisect
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import Dsv2Error
from ..runtime.engine import Engine
from ..runtime.generation import _StopStrings
from ..runtime.sampling import Sampler, SamplingParams
from ..runtime.tokenizer import StreamDecoder, Tokenizer
from .metrics import ServerMetrics
from .prefix_cache import PAGE, Entry, PrefixCache


class QueueFullError(Dsv2Error, RuntimeError):
    """The waiting queue is full; try again later (HTTP 429)."""


class NotReadyError(Dsv2Error, RuntimeError):
    """The model is still loading, or failed to load (HTTP 503)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Delta:
    """New output of one choice: the text it settled (possibly empty) and its tokens."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass(frozen=True)
class Done:
    """Every choice finished; the request's token counts."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request failed in the engine (HTTP ``status``)."""

    status: int
    message: str


Event = Delta | Done | Failed


@dataclass(eq=False)
class Request:
    """One API call: ``n`` choices over one prompt."""

    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    emit: Callable[[Event], None]
    n: int = 1
    top_logprobs: int | None = None  # None: no logprobs
    arrival: float = field(default_factory=time.perf_counter)
    choices: list[_Choice] = field(default_factory=list)
    cancelled: bool = False


class _Text:
    """A choice's detokenized text, stop strings and what was emitted of it (the rules of
    :func:`dsv2_mlc.runtime.generation.run_generation`). A model without a tokenizer (random
    weights) answers each token as the piece ``<id>``, as its logprobs name them."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...]):
        self.detok = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.stops = _StopStrings(stops)
        self.text, self.emitted = "", 0

    def _extend(self, delta: str) -> bool:
        found = delta and self.stops.stops
        at = self.stops.find(self.text + delta, len(self.text)) if found else -1
        self.text = self.text + delta if at < 0 else (self.text + delta)[:at]
        return at >= 0

    def push(self, token: int, stop_id: bool, at_limit: bool) -> tuple[str, str | None]:
        """Take one token; returns (text to emit now, finish reason or None)."""
        finished = None
        if self.detok is None and not stop_id:  # no tokenizer: each token is the piece <id>
            self.text += f"<{token}>"
        if stop_id:
            finished = "stop"
            if self.detok is not None:
                self._extend(self.detok.flush())
        elif self.detok is not None and self._extend(self.detok.push(token)):
            finished = "stop"
        elif at_limit:
            finished = "length"
            if self.detok is not None and self._extend(self.detok.flush()):
                finished = "stop"
        if finished is not None:
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out, finished
        safe = len(self.text) - self.stops.held(self.text, self.emitted)
        out, self.emitted = self.text[self.emitted : safe], max(self.emitted, safe)
        return out, None


@dataclass(eq=False)
class _Choice:
    """One sequence of a request. The KV sequence holds ``context[:kv_len]``."""

    req: Request
    index: int
    sampler: Sampler
    text: _Text
    order: int  # arrival order, the key of the waiting line
    tokens: list[int] = field(default_factory=list)
    seq_id: int | None = None
    kv_len: int = 0
    entry: Entry | None = None  # the cache entry it was forked from
    admitted_once: bool = False
    cached_tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None
    finish_reason: str | None = None

    @property
    def context(self) -> list[int]:
        return self.req.prompt + self.tokens

    @property
    def pending(self) -> int:
        return len(self.req.prompt) + len(self.tokens) - self.kv_len


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


class Scheduler:
    """The engine thread and its queues. ``factory`` opens the engine (in the thread, so the
    server answers 503 while it loads)."""

    def __init__(
        self,
        factory: Callable[[], Engine],
        *,
        metrics: ServerMetrics | None = None,
        max_queue: int = 256,
        step_tokens: int = 256,
        prefix_cache: bool = True,
    ):
        self._factory = factory
        self.metrics = metrics or ServerMetrics()
        self.max_queue = max_queue
        self.step_tokens = step_tokens
        self.use_prefix_cache = prefix_cache
        self.cache = PrefixCache()
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._queued = 0  # requests submitted and not yet admitted (any thread reads it)
        self._lock = threading.Lock()
        self._waiting: list[_Choice] = []
        self._running: list[_Choice] = []
        self._order = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="dsv2-engine", daemon=True)
        self.total_pages = 0
        self.page_budget = 0
        self._available_pages: Callable[[], int] | None = None

    # -- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def check_ready(self) -> Engine:
        """The engine, or :class:`NotReadyError` while it loads (or when it failed to)."""
        if self.load_error is not None:
            raise NotReadyError(f"the model failed to load: {self.load_error}")
        if not self.ready.is_set() or self.engine is None:
            raise NotReadyError("the model is loading; try again shortly")
        return self.engine

    def submit(self, req: Request) -> None:
        """Queue ``req`` (:class:`QueueFullError` when the waiting line is full)."""
        engine = self.check_ready()
        with self._lock:
            if self._queued + req.n > self.max_queue:
                raise QueueFullError(
                    f"the server's queue is full ({self.max_queue} waiting sequences); retry later"
                )
            self._queued += req.n
        for i in range(req.n):
            params = req.params
            if i and params.seed is not None:
                params = params.updated(seed=params.seed + i)  # n choices differ under a seed
            tokenizer = engine.tokenizer if engine.has_tokenizer() else None
            req.choices.append(
                _Choice(
                    req,
                    i,
                    Sampler(params, engine.config.vocab_size, req.prompt),
                    _Text(tokenizer, params.stop),
                    next(self._order),
                )
            )
        self._inbox.put(("submit", req))

    def cancel(self, req: Request) -> None:
        """Drop ``req`` (a client that went away): its sequences and pages are freed at the next
        step boundary."""
        self._inbox.put(("cancel", req))

    def clear_prefix_cache(self) -> None:
        """Evict every cached prefix (at the next step boundary)."""
        self._inbox.put(("clear", None))

    def pages_needed(self, tokens: int) -> int:
        """Pages a sequence of ``tokens`` takes (one more for its next token)."""
        return _pages(tokens + 1)

    # -- the engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._factory()
            if engine.has_tokenizer():
                engine.tokenizer  # noqa: B018 - read it now, not in the first request
            self._available_pages = engine.free_pages
            self.total_pages = engine.free_pages()
            # the engine's own room check: every sequence's whole pages within kv_capacity
            self.page_budget = engine.kv_capacity // PAGE
            self.engine = engine
        except Exception as err:  # reported by /health and every request
            self.load_error = f"{type(err).__name__}: {err}"
            return
        self.ready.set()
        self._refresh_gauges()
        while not self._stop:
            self._drain(block=not (self._running or self._waiting))
            if self._stop:
                break
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as err:  # a failed step fails its requests, not the server
                self._fail_running(f"{type(err).__name__}: {err}")
            self._refresh_gauges()
        for c in self._running + self._waiting:
            c.req.emit(Failed(503, "the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, obj = item
            if kind == "submit":
                assert isinstance(obj, Request)
                for c in obj.choices:
                    bisect.insort(self._waiting, c, key=lambda x: x.order)
            elif kind == "cancel":
                assert isinstance(obj, Request)
                self._cancel(obj)
            elif kind == "clear":
                while self._evict():
                    pass
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, req: Request) -> None:
        req.cancelled = True
        for c in req.choices:
            if c in self._waiting:
                self._waiting.remove(c)
                self._dequeued(1)
                self.metrics.finished.labels(finish_reason="abort").inc()
            elif c in self._running:
                self._running.remove(c)
                self._release(c, park=False)
                self.metrics.finished.labels(finish_reason="abort").inc()

    def _dequeued(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def _logical_pages(self) -> int:
        """Pages as the engine counts them: every live sequence's length in whole pages."""
        running = sum(_pages(c.kv_len) for c in self._running)
        return running + sum(e.pages for e in self.cache.entries)

    def _evict(self) -> bool:
        entry = self.cache.evict_one()
        if entry is None:
            return False
        assert self.engine is not None
        self.engine.remove_sequence(entry.seq_id)
        return True

    def _admit(self) -> None:
        engine = self.engine
        assert engine is not None
        while self._waiting and len(self._running) < engine.max_batch_size:
            c = self._waiting[0]
            ctx = c.context
            need = self.pages_needed(len(ctx))
            while self._logical_pages() + need > self.page_budget and self._evict():
                pass
            if self._logical_pages() + need > self.page_budget:
                return  # it waits for running sequences to finish
            self._waiting.pop(0)
            entry, hit = (None, 0)
            if self.use_prefix_cache:
                entry, hit = self.cache.match(ctx, limit=len(ctx) - 1)
            if entry is not None:
                c.seq_id = engine.fork_sequence(entry.seq_id, hit)
                entry.refs += 1
                self.cache.touch(entry)
            else:
                c.seq_id, hit = engine.add_sequence(), 0
            c.entry, c.kv_len = entry, hit
            self._running.append(c)
            if not c.admitted_once:
                c.admitted_once, c.cached_tokens = True, hit
                self._dequeued(1)
                self.metrics.queue.observe(time.perf_counter() - c.req.arrival)
                self.metrics.record_prompt(len(c.req.prompt), hit)

    def _plan(self) -> tuple[list[_Choice], list[tuple[_Choice, int]]]:
        """This step's decode sequences and (sequence, tokens) prefill chunks, FCFS."""
        decode = [c for c in self._running if c.pending == 1]
        budget = max(self.step_tokens - len(decode), 1)
        chunks = []
        for c in self._running:
            if c.pending > 1 and budget > 0:
                take = min(c.pending, budget)
                chunks.append((c, take))
                budget -= take
        return decode, chunks

    def _step(self) -> None:
        engine = self.engine
        assert engine is not None
        while True:
            decode, chunks = self._plan()
            grow = {c: 1 for c in decode} | dict(chunks)
            after = self._logical_pages() + sum(
                _pages(c.kv_len + n) - _pages(c.kv_len) for c, n in grow.items()
            )
            if after <= self.page_budget or self._evict():
                if after <= self.page_budget:
                    break
                continue
            if len(self._running) <= 1:
                break  # cannot happen: a request that could never fit is refused at submit
            self._preempt(self._running[-1])
        self.metrics.prefill_tokens.inc(
            sum(n for _, n in chunks) + sum(1 for c in decode if not c.tokens)
        )
        if decode:
            ids = [c.seq_id for c in decode]
            last = [c.context[c.kv_len] for c in decode]
            host = any(c.sampler.needs_logits or c.req.top_logprobs is not None for c in decode)
            if host or not engine.has_device_greedy:
                rows = engine.decode(ids, last)
                for c, row in zip(decode, rows, strict=True):
                    c.kv_len += 1
                    self._accept(c, row, None)
            else:
                # the same sequences will step again (nothing to prefill or admit, nobody at
                # their length limit): the engine launches that step as soon as these tokens
                # are known, so streaming them overlaps the device (undone if a token stops)
                more = (
                    engine.overlap_steps
                    and not chunks
                    and not self._waiting
                    and all(len(c.tokens) + 1 < c.req.max_tokens for c in decode)
                )
                picked = engine.launch_greedy(ids, last, next_step=more, follow=more).result()
                for c, tok in zip(decode, picked, strict=True):
                    c.kv_len += 1
                    self._accept(c, None, int(tok))
        if chunks:
            ids = [c.seq_id for c, _ in chunks]
            lists = [c.context[c.kv_len : c.kv_len + n] for c, n in chunks]
            rows = engine.prefill(ids, lists)
            for (c, n), row in zip(chunks, rows, strict=True):
                c.kv_len += n
                if c.pending == 0:
                    self._accept(c, row, None)

    def _accept(self, c: _Choice, row: np.ndarray | None, picked: int | None) -> None:
        """Sample (or take the device's) next token of ``c``; stream it; finish ``c`` when it
        stops."""
        if c.req.cancelled:
            return
        token = c.sampler.sample(row) if picked is None else c.sampler.accept(picked)
        c.tokens.append(token)
        logprobs = []
        if c.req.top_logprobs is not None and row is not None:
            logprobs.append(_logprob(row, token, c.req.top_logprobs))
        now = time.perf_counter()
        if c.first_at is None:
            c.first_at = now
            self.metrics.ttft.observe(now - c.req.arrival)
        elif c.last_at is not None:
            self.metrics.tpot.observe(now - c.last_at)
        c.last_at = now
        stop_id = token in c.req.stop_token_ids
        text, reason = c.text.push(token, stop_id, len(c.tokens) >= c.req.max_tokens)
        c.req.emit(Delta(c.index, text, [token], logprobs, reason))
        if reason is not None:
            self._finish(c, reason)

    def _finish(self, c: _Choice, reason: str) -> None:
        self._running.remove(c)
        self._release(c, park=self.use_prefix_cache)
        m = self.metrics
        m.finished.labels(finish_reason=reason).inc()
        m.generation_tokens.inc(len(c.tokens))
        m.e2e.observe(time.perf_counter() - c.req.arrival)
        c.finish_reason = reason
        req = c.req
        if all(x.finish_reason is not None for x in req.choices):
            req.emit(
                Done(
                    len(req.prompt),
                    sum(len(x.tokens) for x in req.choices),
                    sum(x.cached_tokens for x in req.choices),
                )
            )

    def _release(self, c: _Choice, park: bool) -> None:
        """Free ``c``'s sequence; with ``park`` keep its whole pages as a prefix-cache entry."""
        engine = self.engine
        assert engine is not None and c.seq_id is not None
        if c.entry is not None:
            c.entry.refs -= 1
        seq, c.seq_id, c.entry = c.seq_id, None, None
        keep = (c.kv_len // PAGE) * PAGE
        if park and keep:
            engine.popn(seq, c.kv_len - keep)
            if self.cache.insert(seq, c.context[:keep]) is not None:
                return
        engine.remove_sequence(seq)

    def _preempt(self, c: _Choice) -> None:
        """Free ``c``'s pages; it waits again at its place in line (recomputed on admission)."""
        self._running.remove(c)
        self._release(c, park=False)
        c.kv_len = 0
        bisect.insort(self._waiting, c, key=lambda x: x.order)
        self.metrics.preemptions.inc()

    def _fail_running(self, message: str) -> None:
        engine = self.engine
        assert engine is not None
        failed, self._running = self._running, []
        broken = False
        for c in failed:
            c.req.cancelled = True
            c.req.emit(Failed(500, message))
            if not broken:
                try:
                    self._release(c, park=False)
                    continue
                except Exception:  # the engine is in a bad state: start its cache afresh
                    broken = True
            c.seq_id = c.entry = None
        if broken:
            self.cache.clear()
            engine.reset()

    def _refresh_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self._running))
        m.waiting.set(len(self._waiting))
        if self._available_pages is None:
            return
        free = self._available_pages()
        used = self.total_pages - free
        m.pages_free.set(free)
        m.pages_used.set(used)
        unused = sum(_pages(c.kv_len) * PAGE - c.kv_len for c in self._running)
        m.fragmentation.set(unused / (used * PAGE) if used else 0.0)
        if self.engine is not None:
            m.record_memory(self.engine.device_memory_used())


def _logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The log-softmax of the model's logits at ``token`` and its ``top`` most likely tokens."""
    z = row.astype(np.float64)
    z = z - z.max()
    lse = math.log(float(np.exp(z).sum()))
    best = np.argsort(-z, kind="stable")[:top] if top else []
    return TokenLogprob(
        int(token), float(z[token] - lse), [(int(i), float(z[i] - lse)) for i in best]
    )

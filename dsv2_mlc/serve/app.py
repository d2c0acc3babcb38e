"""The OpenAI-compatible HTTP server: FastAPI routes over the engine thread (:mod:`.scheduler`).

``POST /v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events with
``stream: true``), ``GET /v1/models``, ``/health`` (503 while the model loads) and ``/metrics``
(Prometheus). Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad request (a prompt longer than the context window too, code
``context_length_exceeded``), 404 for an unknown model or route, 429 when the waiting line is
full, 503 while the model loads. A client that disconnects has its sequences freed at the next
step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import Dsv2Error
from ..layout import BuildConfig
from ..runtime.engine import DEFAULT_PREFILL_CHUNK, Engine
from ..runtime.memory_plan import ModelMemory, longest_context, plan_memory
from ..runtime.sampling import SamplingParams
from .metrics import ServerMetrics
from .prefix_cache import PAGE
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    now,
    usage,
)
from .scheduler import Delta, Done, Event, Failed, NotReadyError, QueueFullError, Scheduler
from .scheduler import Request as EngineRequest

# how often a non-streamed request checks that its client is still there (seconds)
DISCONNECT_POLL = 0.25


def create_app(
    factory: Callable[[], Engine],
    *,
    model_name: str = "default",
    max_queue: int = 256,
    step_tokens: int = 256,
    prefix_cache: bool = True,
) -> FastAPI:
    """The server's app; ``factory`` opens the engine in the engine thread at startup."""
    scheduler = Scheduler(
        factory,
        metrics=ServerMetrics(),
        max_queue=max_queue,
        step_tokens=step_tokens,
        prefix_cache=prefix_cache,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="dsv2-mlc", lifespan=lifespan)
    app.state.scheduler = scheduler
    handlers = _Handlers(scheduler, model_name)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(err.detail), kind), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            scheduler.check_ready()
        except NotReadyError as e:
            return JSONResponse(error_body(str(e), "service_unavailable"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scheduler.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        engine = handlers.engine()
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dsv2-mlc",
            "max_model_len": engine.context_window,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await handlers.serve(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handlers.serve(body, request, chat=False)

    return app


class _Handlers:
    """The two generation endpoints: prompt, limits, submission, streamed or whole answers."""

    def __init__(self, scheduler: Scheduler, model_name: str):
        self.scheduler = scheduler
        self.model_name = model_name
        self._defaults: SamplingParams | None = None

    def engine(self) -> Engine:
        try:
            return self.scheduler.check_ready()
        except NotReadyError as err:
            raise ApiError(503, str(err), type="service_unavailable") from err

    def _prompt(self, engine: Engine, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
        try:
            if isinstance(body, ChatCompletionRequest):
                tok = engine.tokenizer
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                if tok.chat_template is not None:
                    ids = tok.apply_chat_template(
                        messages, add_generation_prompt=True, tokenize=True
                    )
                    assert isinstance(ids, list)
                    return engine.encode_prompt(ids)
                return engine.encode_prompt("".join(m["content"] for m in messages))
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ApiError(400, "send one prompt per request", param="prompt")
                prompt = prompt[0]
            return engine.encode_prompt(prompt)  # type: ignore[arg-type]
        except ApiError:
            raise
        except Dsv2Error as err:
            raise ApiError(400, str(err), param="prompt") from err

    def _request(
        self, engine: Engine, body: ChatCompletionRequest | CompletionRequest, emit: Any
    ) -> EngineRequest:
        body.check_supported()
        if body.model not in (None, self.model_name):
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server has {self.model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        prompt = self._prompt(engine, body)
        if self._defaults is None:
            self._defaults = SamplingParams.from_generation_config(engine.path)
        try:
            params = self._defaults.updated(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed,
                stop=body.stops,
            )
        except Dsv2Error as err:
            raise ApiError(400, str(err)) from err
        if params.stop and not engine.has_tokenizer():
            raise ApiError(400, "stop strings need the model's tokenizer", param="stop")
        window = engine.context_window
        limit = body.limit
        room = window - len(prompt)
        if room < 1 or (limit is not None and limit > room):
            asked = "" if limit is None else f" plus max_tokens {limit}"
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens{asked}; this model's context window holds "
                f"{window}: shorten the prompt or max_tokens",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        default = body.default_max_tokens
        max_tokens = limit or (room if default is None else min(default, room))
        sched = self.scheduler
        if sched.pages_needed(len(prompt) + max_tokens) > sched.page_budget:
            raise ApiError(
                400,
                f"a prompt of {len(prompt)} tokens plus {max_tokens} new ones exceeds the KV "
                f"cache of {sched.page_budget * 16} tokens; ask for fewer max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = engine.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        if body.ignore_eos:
            stop_ids = []
        return EngineRequest(
            id=uuid.uuid4().hex[:24],
            prompt=prompt,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_ids),
            emit=emit,
            n=body.n,
            top_logprobs=body.wanted_logprobs,
        )

    async def serve(
        self, body: ChatCompletionRequest | CompletionRequest, http: Request, chat: bool
    ) -> Response:
        engine = self.engine()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
                loop.call_soon_threadsafe(events.put_nowait, event)

        req = self._request(engine, body, emit)
        try:
            self.scheduler.submit(req)
        except QueueFullError as err:
            raise ApiError(
                429, str(err), type="rate_limit_error", code="rate_limit_exceeded"
            ) from err
        except NotReadyError as err:
            raise ApiError(503, str(err), type="service_unavailable") from err
        answer = _Answer(engine, self.model_name, req, chat)
        if body.stream:
            stream = self._stream(events, answer, req, body.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        done = False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return Response(status_code=499)
                    continue
                if isinstance(event, Failed):
                    done = True
                    raise ApiError(event.status, event.message, type="server_error")
                if isinstance(event, Delta):
                    answer.add(event)
                else:
                    done = True
                    return JSONResponse(answer.whole(event))
        finally:
            if not done:
                self.scheduler.cancel(req)

    async def _stream(
        self, events: asyncio.Queue[Event], answer: _Answer, req: EngineRequest, with_usage: bool
    ) -> AsyncIterator[str]:
        done = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, Failed):
                    done = True
                    yield _sse(error_body(event.message, "server_error"))
                    return
                if isinstance(event, Done):
                    done = True
                    if with_usage:
                        yield _sse(answer.usage_chunk(event))
                    yield "data: [DONE]\n\n"
                    return
                chunk = answer.chunk(event)
                if chunk is not None:
                    yield _sse(chunk)
        finally:
            if not done:  # the client went away (or the server stops): free the sequences
                self.scheduler.cancel(req)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Answer:
    """Builds the response objects of one request from its events."""

    def __init__(self, engine: Engine, model: str, req: EngineRequest, chat: bool):
        self.engine, self.model, self.chat = engine, model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + req.id
        self.created = now()
        self.want_logprobs = req.top_logprobs is not None
        self.texts = [""] * req.n
        self.logprobs: list[list[Any]] = [[] for _ in range(req.n)]
        self.reasons: list[str | None] = [None] * req.n
        self.held: list[list[Any]] = [[] for _ in range(req.n)]  # logprobs of held-back text
        self.sent_role = [False] * req.n
        self.sent_text = [0] * req.n

    def _piece(self, token_id: int) -> str:
        if not self.engine.has_tokenizer():
            return f"<{token_id}>"
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, items: list[Any], offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(items, self._piece)
        return completion_logprobs(items, self._piece, offset)

    def add(self, d: Delta) -> None:
        self.texts[d.index] += d.text
        self.logprobs[d.index].extend(d.logprobs)
        if d.finish_reason is not None:
            self.reasons[d.index] = d.finish_reason

    def whole(self, done: Done) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(self.texts):
            lp = self._logprobs(self.logprobs[i], 0)
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": self.reasons[i],
                    }
                )
            else:
                choices.append(
                    {"index": i, "text": text, "logprobs": lp, "finish_reason": self.reasons[i]}
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
        }

    def chunk(self, d: Delta) -> dict[str, Any] | None:
        """A streamed chunk for ``d``; None while its text is held back (its logprobs go with the
        next chunk)."""
        i = d.index
        self.held[i].extend(d.logprobs)
        if not d.text and d.finish_reason is None:
            return None
        items, self.held[i] = self.held[i], []
        lp = self._logprobs(items, self.sent_text[i])
        self.sent_text[i] += len(d.text)
        if self.chat:
            delta: dict[str, Any] = {"content": d.text}
            if not self.sent_role[i]:
                delta["role"] = "assistant"
                self.sent_role[i] = True
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            choice = {"index": i, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        return self._envelope([choice])

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        out = self._envelope([])
        out["usage"] = usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
        return out

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


STEP_TOKENS = {"cpu": 256, "cuda": 2048}
"""Default tokens of one batching step by device: on CUDA a 1K-2K prompt is prefilled in one
step (a step of 2,048 tokens takes ~30 ms on the H200 with V2-Lite), on the CPU a step stays
short so running streams keep their pace."""


def kv_tokens_for_memory(path: str | Path, budget: int | str, max_batch: int) -> int:
    """KV-cache tokens (whole pages, shared by all sequences and cached prefixes) that an engine
    of ``max_batch`` sequences gets inside the memory ``budget`` (bytes or text such as
    ``"4GiB"``) once the weights, workspace, CUDA graphs and runtime overhead are placed
    (:mod:`dsv2_mlc.runtime.memory_plan`). A budget that holds no page raises the planner's
    :class:`~dsv2_mlc.runtime.memory_plan.MemoryBudgetError` with the breakdown."""
    model = ModelMemory.from_build(path)
    chunk = DEFAULT_PREFILL_CHUNK[model.device]
    per_sequence = longest_context(model, budget, max_batch, default_chunk=chunk)
    tokens = per_sequence * max_batch // PAGE * PAGE
    if tokens < PAGE:  # the planner's refusal, with the breakdown and what would fit
        plan_memory(model, budget, PAGE, max_batch, default_chunk=chunk)
        raise ApiConfigError(f"--gpu-memory {budget} holds no page of the KV cache")
    return tokens


class ApiConfigError(Dsv2Error, ValueError):
    """A server option that cannot work."""


def run_server(
    model: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    context_window: int | None = None,
    kv_capacity: int | None = None,
    gpu_memory: int | str | None = None,
    max_queue: int = 256,
    step_tokens: int | None = None,
    prefix_cache: bool = True,
    cache_dir: str | None = None,
    device: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    random_weights: int | None = None,
    lib_dir: str | None = None,
) -> None:
    """Serve MODEL (see :func:`dsv2_mlc.load`) until interrupted. The model is resolved (and
        compiled on first use) before the server starts; its weights load in the engine thread.
        ``step_tokens``: tokens one batching step takes (default :data:`STEP_TOKENS` of the
        build's device). ``gpu_memory`` (bytes or text such as ``"4GiB"``): the whole memory budget,
    the KV cache sized to what the weights and workspace leave (instead of ``kv_capacity``).
        ``random_weights=SEED`` serves a build compiled with ``--random-weights`` (benchmarks: the
        prompts are token ids, the replies' text is ``<id>`` pieces without a tokenizer);
        ``lib_dir`` is the TVM runtime library folder, as for :class:`Engine`."""
    import uvicorn

    from ..resolve import resolve_model

    path = resolve_model(model, cache_dir=cache_dir, device=device, progress=True)
    if step_tokens is None:
        step_tokens = STEP_TOKENS[BuildConfig.read(path).device]
    if gpu_memory is not None:
        if kv_capacity is not None:
            raise ApiConfigError("give --kv-capacity or --gpu-memory, not both")
        kv_capacity = kv_tokens_for_memory(path, gpu_memory, max_batch)
        context_window = min(context_window or kv_capacity, kv_capacity)

    def factory() -> Engine:
        return Engine(
            path,
            context_window=context_window,
            max_batch_size=max_batch,
            kv_capacity=kv_capacity,
            gpu_memory=gpu_memory,
            random_weights=random_weights,
            lib_dir=lib_dir,
        )

    name = served_model_name or ("default" if model is None else path.name)
    app = create_app(
        factory,
        model_name=name,
        max_queue=max_queue,
        step_tokens=step_tokens,
        prefix_cache=prefix_cache,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)

"""Routes and SSE: GET /v1/models, POST /v1/completions and /v1/chat/completions (JSON or an event stream), GET
/health, the routes routers call (fleet.py), GET /metrics (all of it for the metrics key, its own series for an API
key). Routes stay thin: checks and engine glue live in service.py, planning.py and generation.py, wire shapes in
protocol.py (requests) and responses.py, keys / Host / body limits in security.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dgemma import __version__
from dgemma.api import Model
from dgemma.server import errors, fleet, planning, playground, security
from dgemma.server.config import ServerConfig
from dgemma.server.generation import Generation
from dgemma.server.protocol import ChatCompletionRequest, CompletionRequest
from dgemma.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Shapes,
    knob_cards,
    message,
)
from dgemma.server.service import Service

DONE = b"data: [DONE]\n\n"
LARGE_BODY = 64 << 10  # bytes from which a body is parsed off the event loop
_ERRORS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
           408: "the request's deadline passed (dgemma_timeout / --request-timeout)",
           413: "request body too large", 429: "at capacity: retry later", 503: "loading or shutting down"}


def _responses(ok: type | None, *statuses: int, stream: bool = False) -> dict[int | str, Any]:
    out: dict[int | str, Any] = {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}
    if ok is not None:
        out[200] = {"model": ok, "description": "the result"}
        if stream:
            out[200]["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    return out


def create_app(config: ServerConfig, loader: Callable[[], Model],
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The ASGI app. The model loads in a background thread at start-up; /health answers 503 until it is ready."""
    service = Service(config, loader, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(service.close)

    app = FastAPI(title="dgemma", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # served below, behind the key like /v1/*
    app.state.service = service
    errors.install(app)
    security.install(app, config)
    keys = security.ApiKeys(config.api_keys)
    api = APIRouter(route_class=_guarded(keys))
    _routes(api, service)
    fleet.install(api, app, service, _responses)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(_openapi(app))

    app.include_router(api)
    _metrics_route(app, service, keys)
    playground.install(app)

    @app.get("/health", response_model=None, responses=_responses(Health, 503))
    async def health() -> Any:
        """200 when the model is loaded and the engine runs; 503 with an error object otherwise."""
        if error := service.unavailable():
            return error.response()
        return {"status": "ok"}

    return app


class GuardedRoute(APIRoute):
    """Checks the API key first (before the body is even read: `keys`, set on the subclass `_guarded` makes, and
    it records which key in `request.state.key` for the prefix cache's partitions), then parses the JSON body
    with a nesting cap (security.parse_json), in a worker thread when it is large (FastAPI would parse it on the
    event loop, where a 4 MB body costs tens of milliseconds of every other client's time); FastAPI then finds
    the parsed body cached."""

    keys: security.ApiKeys

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            request.state.key = self.keys.check(request) if self.keys else None
            if request.method == "POST":
                body = await request.body()
                parsed = await asyncio.to_thread(security.parse_json, body) if len(body) > LARGE_BODY else \
                    security.parse_json(body)
                if parsed is not None:
                    request._json = parsed  # else FastAPI parses it again and reports the error
            return await handler(request)

        return route


def _guarded(keys: security.ApiKeys) -> type[GuardedRoute]:
    return type("KeyedRoute", (GuardedRoute,), {"keys": keys})


def _routes(api: APIRouter, service: Service) -> None:
    name = service.config.model_name

    def card() -> dict[str, Any]:
        context = service.model.max_context if service.model is not None else None
        return {"id": name, "object": "model", "created": service.created, "owned_by": "dgemma",
                "max_model_len": context, "dgemma_defaults": service.defaults(), "dgemma_knobs": knob_cards()}

    @api.get("/v1/models", response_model=None, responses=_responses(ModelList, 401))
    async def list_models() -> Any:
        return {"object": "list", "data": [card()]}

    @api.get("/v1/models/{model_id:path}", response_model=None, responses=_responses(ModelCard, 401, 404))
    async def get_model(model_id: str) -> Any:
        service.check_model(model_id)
        return card()

    @api.post("/v1/completions", response_model=None,
              responses=_responses(CompletionResponse, 400, 401, 404, 408, 413, 429, 503, stream=True))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _respond(service, body, planning.prompts(body), "prompt", request, chat=False)

    @api.post("/v1/chat/completions", response_model=None,
              responses=_responses(ChatCompletionResponse, 400, 401, 404, 408, 413, 429, 503, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _respond(service, body, [service.chat_prompt(body)], "messages", request, chat=True)


def _metrics_route(app: FastAPI, service: Service, keys: security.ApiKeys) -> None:
    config = service.config
    operator = security.ApiKeys((config.metrics_key,) if config.metrics_key else ())

    @app.get("/metrics", response_class=PlainTextResponse, responses=_responses(None, 401))
    async def metrics(request: Request) -> PlainTextResponse:
        """Prometheus text format: everything for --metrics-key (or anyone, on a server without keys), only its
        own series for an API key."""
        key = _metrics_viewer(request, keys, operator)
        if key is None:
            gauges, counters = _server_figures(service)
            text = service.metrics.render(_static_gauges(service) | gauges, counters)
        else:
            text = service.metrics.render_key(key, _static_gauges(service))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _metrics_viewer(request: Request, keys: security.ApiKeys, operator: security.ApiKeys) -> int | None:
    """None: the caller sees everything; else the position of the API key whose own series it sees (401 for
    anyone else, once a key of either kind is configured)."""
    if (not keys and not operator) or operator.find(request) is not None:
        return None
    return keys.check(request)


def _static_gauges(service: Service) -> dict[str, tuple[str, float]]:
    """Gauges that say nothing about anyone's traffic."""
    return {"dgemma_admission_capacity": ("Sequences admitted at once (running + queued).", service.config.capacity),
            "dgemma_ready": ("1 when the model is loaded and requests are served.", service.unavailable() is None)}


def _server_figures(service: Service) -> tuple[dict[str, tuple[str, float]], dict[str, tuple[str, float]]]:
    """(gauges, counters) of everyone's traffic: the batch, the queue, the prefix cache."""
    running = service.worker.running if service.worker is not None else 0
    gauges = {"dgemma_requests_running": ("Sequences in the engine's batch.", running),
              "dgemma_requests_waiting": ("Admitted sequences not yet in a batch.", max(0, service.in_use - running))}
    if (prefix := service.prefix_cache) is None:
        return gauges, {}
    gauges["dgemma_prefix_cache_bytes"] = ("KV-cache bytes the prefix cache holds.", prefix.bytes)
    counters = {
        "dgemma_prefix_cache_lookups_total": ("Prompts looked up in the prefix cache.", prefix.lookups),
        "dgemma_prefix_cache_hits_total": ("Prompts that continued from a cached prefix.", prefix.hits),
        "dgemma_prefix_cache_tokens_reused_total": ("Prompt tokens taken from the prefix cache instead of encoded.",
                                                    prefix.tokens_reused),
        "dgemma_prefix_cache_evictions_total": ("Entries evicted to stay within the budget.", prefix.evictions)}
    return gauges, counters


async def _respond(service: Service, body: Any, prompts: list[Any], param: str, request: Request,
                   chat: bool) -> Response:
    """Prepare the request (given up as soon as the client disconnects), then answer it."""
    prefix = "chatcmpl" if chat else "cmpl"
    gen = await _unless_disconnected(request, service.generate(body, prompts, param, prefix, request.state.key))
    if gen is None:
        return Response(status_code=499)  # the client is gone; its lease went back with the cancelled work
    return await _answer(gen, body, request, chat)


async def _answer(gen: Generation, body: Any, request: Request, chat: bool) -> Response:
    ignored = {"X-Dgemma-Ignored-Fields": ", ".join(body.ignored_fields())} if body.ignored_fields() else {}
    if body.stream:
        return await _stream(gen, body, request, chat, ignored)
    try:
        results = await _unless_disconnected(request, gen.collect())
    finally:
        gen.close()
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    shapes, choices = Shapes(chat, gen.id, gen.created, gen.service.config.model_name), []
    for i, r in enumerate(results):
        logprobs = None if r.logprobs is None else body.format_logprobs(r.logprobs, gen.service.model.token_bytes, 0)
        reasoning = r.reasoning if getattr(body, "include_reasoning", False) else None
        choices.append(shapes.answer(i, r.text, logprobs, r.finish_reason, message(r.text, r.tool_calls, reasoning)))
    return JSONResponse(shapes.response(choices, gen.usage()), headers=ignored)


async def _stream(gen: Generation, body: Any, request: Request, chat: bool, headers: dict[str, str]) -> Response:
    """The response starts when a choice enters the batch (or the first output, whatever it is), so that a
    request refused while queued (--max-queue-seconds) still gets a plain 503 status."""
    events = gen.events()
    try:
        first = await _unless_disconnected(request, anext(events, None))
        if first is None:
            gen.close()
            return Response(status_code=499)  # the client is gone (or nothing came: it was closed)
        if first[1].kind == "done" and first[1].result is None and gen.n == 1:
            raise gen.errors[first[0]]
    except BaseException:
        gen.close()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = Shapes(chat, gen.id, gen.created, gen.service.config.model_name, include_usage)
    return EventStream(_events(gen, chunks, _chain(first, events), body), on_close=gen.close, headers=headers)


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _events(gen: Generation, chunks: Shapes, events: AsyncIterator[Any], body: Any) -> AsyncIterator[bytes]:
    """Role chunks, then committed text per canvas (and drafts when asked), a finish chunk per choice (after the
    reply's tool calls, each whole as its own delta), the usage chunk when asked, then [DONE]. An error mid-stream
    sends an error object, then [DONE]."""
    if chunks.chat:
        for i in range(gen.n):
            yield _data(chunks.choice(i, role=True))
    shown = [0] * gen.n  # characters sent per choice (completions' text_offset)
    keep_thought = getattr(body, "include_reasoning", False)
    async for index, ev in events:
        reasoning = ev.reasoning if keep_thought else ""
        if ev.kind == "start" or (ev.kind == "text" and not (ev.text or ev.logprobs or reasoning)):
            continue
        if ev.kind == "text" and ev.logprobs is not None:
            logprobs = body.format_logprobs(ev.logprobs, gen.service.model.token_bytes, shown[index])
            shown[index] += len(ev.text)
            yield _data(chunks.choice(index, ev.text, logprobs=logprobs, reasoning=reasoning))
        elif ev.kind == "text":
            yield _data(chunks.choice(index, ev.text, reasoning=reasoning))
        elif ev.kind == "draft":
            draft = {"canvas": ev.canvas, "step": ev.step, "text": ev.text, "token_ids": ev.token_ids,
                     "tokens": ev.pieces, "accepted": ev.accepted} | ({"reasoning": reasoning} if reasoning else {})
            yield _data(chunks.choice(index, dgemma_draft=draft))
        elif ev.result is not None:
            for i, call in enumerate(ev.result.tool_calls or ()):
                yield _data(chunks.choice(index, call=(i, call)))
            yield _data(chunks.choice(index, finish_reason=ev.finish_reason))
        else:
            yield _data(gen.errors[index].body())
            yield DONE
            return
    if chunks.include_usage:
        yield _data(chunks.usage(gen.usage()))
    yield DONE


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """A server-sent-event response that runs `on_close` however it ends (done, error, client gone)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, or give up (None) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 responses: validation errors are 400 OpenAI error objects here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema

"""OpenAI-compatible HTTP API over any `TextGenerator` (FastAPI + uvicorn).

Endpoints, each a FastAPI route: `GET /health`, `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (both with `stream`: server-sent events ending in `data: [DONE]`),
`GET /metrics` (Prometheus text, `prom`: the server's request, token and latency metrics and the
engine's counters).

Invariants:
- The guards run in front of the routes, as ASGI middleware (`http_guard`): the API key, the
  body read whole under its size limit and deadline, admission (at most `max_queue` generation
  requests at once, 503 beyond). A request is then parsed and checked completely (`api_request`
  with the `api_models` rules; a large body on a worker thread) before any generation starts; a
  malformed one gets a 4xx with OpenAI's error object.
- A failure that is not the request's fault is a 500 whose body carries a request id and never
  the exception's text (that goes to the server's log under the same id); once a stream has
  started it is a final `data: {"error": ...}` event. Nothing stops the server.
- Generation runs on an engine face (`channels.LocalEngine`: the scheduler on its own thread;
  or `engine_process.EngineProcess`): up to `max_num_seqs` requests run at once, each advancing
  one step per iteration with one batched target forward for all of them, the rest wait in FIFO
  order; the event loop only moves text deltas to the client, so /health and /metrics answer
  while long generations run, and /metrics never waits for the engine. A client that goes away
  — mid-stream, or while waiting for a non-streamed answer — stops its generation at the next
  token (or before it starts, if it was still waiting), freeing its place in the running set.
- Streamed text deltas concatenate to exactly the non-streamed text: both come from the same
  worker, through `IncrementalDecoder` (no split UTF-8 characters) and the stop-string scanner
  (text that might begin a stop string is held back until it cannot).
- finish_reason is "stop" when the model emitted an EOS id or a stop string matched (the stop
  string and everything after it are cut), "length" when max_tokens ran out.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.runtime.serving.api_answers import (ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion,
                                                 ChatMessage, Completion, CompletionChoice, Delta,
                                                 ModelCard, ModelList, Usage)
from metrale.runtime.serving.api_models import APIError, GenerationRequest
from metrale.runtime.serving.api_request import (TextGenerator, check_request_schema, decode_body,
                                                  parse_request)
from metrale.runtime.serving.channels import LocalEngine, Wakes, events
from metrale.runtime.serving.engine_process import freeze_heap
from metrale.runtime.serving.http_guard import (Admission, Admitted, Guard, ServerLimits,
                                                protocol_class)
from metrale.runtime.serving.prom import CONTENT_TYPE, ServingMetrics
from metrale.runtime.serving.stats import Finished

log = logging.getLogger(__name__)

# A body this small is parsed and tokenized on the event loop (well under a millisecond); a
# larger one in a worker thread, whose hand-offs cost a short request more than its parsing.
INLINE_PARSE_BYTES = 16 << 10
SWITCH_INTERVAL_S = 0.0005  # the GIL's hand-off interval while serving (Python's default: 5 ms)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# /metrics is the server's telemetry; FastAPI's own OpenTelemetry hooks would otherwise ask for
# configured providers at every request.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}
JSON = "application/json"


def server_error(e: BaseException, rid: str, what: str = "generation", logged: bool = False) -> APIError:
    """A 500 that names the request id only; the exception is logged under that id."""
    if not logged:
        log.error("request %s: %s failed", rid, what, exc_info=e)
    return APIError(500, f"internal error during {what}; the server log has the details under "
                    f"request id {rid}", kind="server_error", code="internal_error")


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


class _Service:
    """One app's state: the generator, the engine face it runs on, the admission count and the
    metrics; `handle` answers a generation request."""

    def __init__(self, generator: TextGenerator, limits: ServerLimits, engine) -> None:
        self.generator, self.limits = generator, limits
        self.wakes = Wakes()
        if engine is None:
            engine = LocalEngine(generator, limits.max_num_seqs,
                                 limits.speculative_disable_by_batch_size, self.wakes)
        else:  # its messages are read on the loop: the channels it fills are woken there
            engine.flush = self.wakes.flush_here
        self.engine = engine
        self.admitted = Admitted(limits.max_queue)
        self.metrics = ServingMetrics(engine.stats, lambda: self.admitted.n)
        self.started = int(time.time())

    def refused(self, path: str) -> None:
        self.metrics.request(ENDPOINTS[path], "server_error")

    async def handle(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        arrived = time.perf_counter()
        raw = await request.body()
        try:
            response = await self._generate(request, raw, chat, rid, arrived)
        except APIError as e:
            self.metrics.request(endpoint, "client_error" if e.status < 500 else "server_error")
            e.headers = {**(e.headers or {}), "X-Request-Id": rid}
            raise
        except Exception as e:  # a bug, not the request's fault: still a JSON 500
            self.metrics.request(endpoint, "server_error")
            raise server_error(e, rid, f"{endpoint} request") from e
        self.metrics.request(endpoint, "ok")
        response.headers["X-Request-Id"] = rid
        return response

    async def _generate(self, request: Request, raw: bytes, chat: bool, rid: str,
                        arrived: float) -> Response:
        gen = self.generator

        def parse() -> GenerationRequest:
            return parse_request(gen, decode_body(raw), chat)

        # a long prompt's tokenizing must not hold up the other requests' responses
        req = parse() if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(parse)
        if req.params.json_schema is not None:
            await asyncio.to_thread(check_request_schema, req.params.json_schema)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        cancel = self.engine.new_cancel(rid)
        watcher = asyncio.create_task(_watch_disconnect(request, cancel))
        answer = _Answer(self, req, rid, chat, arrived)
        stream = events(self.engine, req, cancel, rid, self.wakes)
        try:
            first = await anext(stream)  # waiting for it turns a failing prefill into a 500
            if first[0] == "error":
                await stream.aclose()
                raise server_error(first[1], rid, logged=True)
            if not req.stream:
                return await answer.whole(stream, first)
        finally:  # a streaming response watches the client itself from its first byte on
            watcher.cancel()
        return StreamingResponse(answer.sse(stream, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(cancel.set))


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client goes away (the body was read: what comes is the end)."""
    while not cancel.is_set():
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()


class _Answer:
    """One request's answer, whole or as server-sent events, in the endpoint's objects."""

    def __init__(self, service: _Service, req: GenerationRequest, rid: str, chat: bool,
                 arrived: float) -> None:
        self.service, self.req, self.rid, self.chat, self.arrived = service, req, rid, chat, arrived
        self.created, self.model = int(time.time()), service.generator.model_id

    def _finished(self, done: Finished) -> Usage:
        self.service.metrics.finished(done, time.perf_counter() - self.arrived)
        return Usage.of(len(self.req.prompt_ids), done.tokens, done.drafts)

    async def whole(self, stream: AsyncIterator[tuple[str, Any]], first: tuple[str, Any]) -> Response:
        """A non-streamed answer: every text event joined."""
        parts: list[str] = []
        event = first
        try:
            while event[0] == "text":
                parts.append(event[1])
                event = await anext(stream)
        finally:
            await stream.aclose()
        if event[0] == "error":
            raise server_error(event[1], self.rid, logged=True)
        done: Finished = event[1]
        usage, text = self._finished(done), "".join(parts)
        if self.chat:
            body = ChatCompletion(id=self.rid, created=self.created, model=self.model, usage=usage,
                                  choices=[ChatChoice(message=ChatMessage(content=text),
                                                      finish_reason=done.finish)])
        else:
            body = Completion(id=self.rid, created=self.created, model=self.model, usage=usage,
                              choices=[CompletionChoice(text=text, finish_reason=done.finish)])
        return Response(body.model_dump_json(), media_type=JSON)

    def _chunk(self, text: str | None, finish: str | None = None, role: bool = False):
        if self.chat:
            delta = Delta(role="assistant", content="") if role else Delta(content=text)
            return ChatChunk(id=self.rid, created=self.created, model=self.model,
                             choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])
        return Completion(id=self.rid, created=self.created, model=self.model,
                          choices=[CompletionChoice(text=text or "", finish_reason=finish)])

    async def sse(self, stream: AsyncIterator[tuple[str, Any]],
                  first: tuple[str, Any]) -> AsyncIterator[str]:
        try:
            async for line in self._lines(stream, first):
                yield line
        finally:  # also when the client went away: stop the worker at its next token
            await stream.aclose()

    async def _lines(self, stream: AsyncIterator[tuple[str, Any]],
                     first: tuple[str, Any]) -> AsyncIterator[str]:
        metrics = self.service.metrics
        if self.chat:
            yield _sse(self._chunk(None, role=True))
        event, timed = first, False
        while True:
            kind, payload = event
            if kind == "text":
                if not timed:
                    metrics.ttft.observe(time.perf_counter() - self.arrived)
                    timed = True
                yield _sse(self._chunk(payload))
            elif kind == "error":
                yield _sse(server_error(payload, self.rid, logged=True).body())
                break
            else:
                usage = self._finished(payload)
                yield _sse(self._chunk(None, payload.finish))
                if self.req.include_usage:
                    last = self._chunk(None)
                    last.choices, last.usage = [], usage
                    yield _sse(last)
                break
            event = await anext(stream)
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- routes

async def _service(request: Request) -> _Service:
    return request.app.state.service


Service = Annotated[_Service, Depends(_service)]
router = APIRouter()


# The generation endpoints are plain routes of the router (`add_route`): every short completion
# goes through them, and FastAPI's per-endpoint handler (dependency resolution, its exit stack)
# costs the event loop more per request than everything else FastAPI does for it; they read
# the request body themselves anyway, to check it with the `api_models` rules off the loop.
async def completions(request: Request) -> Response:
    return await request.app.state.service.handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await request.app.state.service.handle(request, chat=True)


router.add_route("/v1/completions", completions, methods=["POST"])
router.add_route("/v1/chat/completions", chat_completions, methods=["POST"])


@router.get("/health")
async def health() -> Response:
    return Response(b'{"status":"ok"}', media_type=JSON)


@router.get("/v1/models")
async def models(service: Service) -> Response:
    card = ModelCard(id=service.generator.model_id, created=service.started)
    return Response(ModelList(data=[card]).model_dump_json(), media_type=JSON)


@router.get("/metrics")
async def metrics(service: Service) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)


def _error_response(e: APIError) -> Response:
    return Response(e.body().model_dump_json(), status_code=e.status, headers=e.headers,
                    media_type=JSON)


async def _api_error(request: Request, e: APIError) -> Response:
    return _error_response(e)


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    code = "not_found" if e.status_code == 404 else None
    return _error_response(APIError(e.status_code, str(e.detail), code=code, headers=e.headers))


async def _bug(request: Request, e: Exception) -> Response:
    rid = f"req-{uuid.uuid4().hex}"
    error = server_error(e, rid, f"{request.method} {request.url.path}")
    error.headers = {"X-Request-Id": rid}
    return _error_response(error)


class _AttachEngine:
    """ASGI middleware: the engine process's pipe read and written on the loop serving the app
    (`EngineProcess.attach`, a no-op once attached)."""

    def __init__(self, app: Callable, engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        await self.engine.attach()
        await self.app(scope, receive, send)


def create_app(generator: TextGenerator, limits: ServerLimits | None = None, engine=None) -> FastAPI:
    """The ASGI app serving `generator`. `engine`: an `engine_process.EngineProcess` running the
    model (then `generator` is its `EngineProxy`), else a scheduler here runs it."""
    limits = limits or ServerLimits()
    app = FastAPI(title="metrale", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=NO_TELEMETRY,
                  exception_handlers={APIError: _api_error, StarletteHTTPException: _http_error,
                                      Exception: _bug})
    app.state.service = service = _Service(generator, limits, engine)
    app.include_router(router)
    # added innermost first: the engine attached, then the API key and body, then admission
    app.add_middleware(Admission, admitted=service.admitted, paths=frozenset(ENDPOINTS),
                       on_refused=service.refused)
    app.add_middleware(Guard, limits=limits, max_bytes=limits.request_bytes(generator.max_context))
    if engine is not None:
        app.add_middleware(_AttachEngine, engine=engine)
    return app


def uvicorn_config(app: Callable, host: str, port: int, limits: ServerLimits, **kw: Any):
    """uvicorn's config with the limits applied: connection cap, keep-alive, header deadline."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits),
                          limit_concurrency=limits.max_connections,
                          timeout_keep_alive=limits.keep_alive_s, **kw)


def serve(generator: TextGenerator, host: str = "127.0.0.1", port: int = 8000,
          limits: ServerLimits | None = None, engine=None) -> None:
    """Serve `generator` (with `engine`, the engine process's proxy) until interrupted."""
    import uvicorn

    limits = limits or ServerLimits()
    log.info("serving %s on http://%s:%d", generator.model_id, host, port)
    app = create_app(generator, limits, engine)
    # The scheduler's thread runs Python between its package calls; a request's handling on
    # the event loop waits for the GIL at each hand-off, by default up to 5 ms each time.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    freeze_heap()
    uvicorn.Server(uvicorn_config(app, host, port, limits, log_level="info")).run()

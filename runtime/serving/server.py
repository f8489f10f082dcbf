"""OpenAI-compatible HTTP API over any `TextGenerator` (FastAPI + uvicorn; a POST to a
generation endpoint goes to its handler directly, past FastAPI's routing: `_Endpoints`).

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(both with `stream`: server-sent events ending in `data: [DONE]`), `GET /metrics` (Prometheus
text: the generator's own metrics followed by the server's request and token counters).

Invariants:
- A request is parsed and checked completely (`api_request`, on a worker thread) before any
  generation starts; a malformed one gets a 4xx with OpenAI's error object. Limits, timeouts and
  the API key are enforced in front of the app (`http_guard`).
- A failure that is not the request's fault is a 500 whose body carries a request id and never
  the exception's text (that goes to the server's log under the same id); once a stream has
  started it is a final `data: {"error": ...}` event. Nothing stops the server.
- Generation runs on the scheduler's thread (`scheduler`): up to `max_num_seqs` requests run
  at once, each advancing one step per iteration with one batched target forward for all of
  them, the rest wait in FIFO order; the event loop
  only moves text deltas from a queue to the client, so /health and /metrics answer while long
  generations run. At most `max_queue` generation requests are admitted at once (running or
  waiting); beyond that a request gets 503 with `Retry-After`. A client that goes away —
  mid-stream, or while waiting for a non-streamed answer — stops its generation at the next
  token (or before it starts, if it was still waiting), freeing its place in the running set.
- Streamed text deltas concatenate to exactly the non-streamed text: both come from the same
  worker, through `IncrementalDecoder` (no split UTF-8 characters) and the stop-string scanner
  (text that might begin a stop string is held back until it cannot).
- finish_reason is "stop" when the model emitted an EOS id or a stop string matched (the stop
  string and everything after it are cut), "length" when max_tokens ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.runtime.serving.api_request import (  # noqa: F401  (re-exported: the server's contract)
    APIError, GenerationRequest, TextGenerator, decode_body, parse_request,
)
from metrale.runtime.serving.engine_process import freeze_heap
from metrale.runtime.serving.http_guard import Guard, ServerLimits, protocol_class, release_memory
from metrale.runtime.serving.scheduler import Scheduler

log = logging.getLogger(__name__)

LARGE_REQUEST_BYTES = 256 << 10  # after a body this large, freed heap goes back to the OS
RETRY_AFTER_S = 1
# A body this small is parsed and tokenized on the event loop (well under a millisecond); a
# larger one in a worker thread, whose hand-offs cost a short request more than its parsing.
INLINE_PARSE_BYTES = 16 << 10
SWITCH_INTERVAL_S = 0.0005  # the GIL's hand-off interval while serving (Python's default: 5 ms)


def _server_error(e: BaseException, rid: str, what: str = "generation",
                  logged: bool = False) -> APIError:
    """A 500 that names the request id only; the exception is logged under that id."""
    if not logged:
        log.error("request %s: %s failed", rid, what, exc_info=e)
    return APIError(500, f"internal error during {what}; the server log has the details under "
                    f"request id {rid}", kind="server_error", code="internal_error")


# ---------------------------------------------------------------- generation worker

class _Channel:
    """A request's events from the scheduler's thread to the event loop, text coalesced: the
    worker appends under a lock and wakes the loop only when no wake-up is pending, and the
    loop takes everything that arrived by then as one text event. A fast stream therefore
    costs the loop one callback per turn, not one per token, and cannot queue a backlog of
    callbacks in front of other requests' work."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wakes: "_Wakes | None" = None,
                 on_closed: Callable[[], None] = lambda: None, quiet: bool = False):
        self.loop, self.lock = loop, threading.Lock()
        self.wakes, self.on_closed = wakes, on_closed
        self.quiet = quiet  # a non-streamed answer: text waits for the final event's wake-up
        self.ready = asyncio.Event()
        self.text: list[str] = []
        self.final: tuple[str, Any] | None = None  # ("done", ...) or ("error", exc)
        self.pending = False  # a wake-up is scheduled and not yet taken

    def emit(self, kind: str, payload: Any) -> None:  # the scheduler's thread
        with self.lock:
            if kind == "text":
                self.text.append(payload)
                if self.quiet:
                    return
            else:
                self.final = (kind, payload)
            wake, self.pending = not self.pending, True
        if not wake:
            return
        if self.wakes is not None:  # woken with the others at the end of the scheduler's phase
            self.wakes.add(self)
            return
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the loop closed (server shutting down): nobody is listening
            self.on_closed()

    async def take(self) -> list[tuple[str, Any]]:  # the event loop
        await self.ready.wait()
        self.ready.clear()
        with self.lock:
            text, final = "".join(self.text), self.final
            self.text, self.pending = [], False
        return ([("text", text)] if text else []) + ([final] if final is not None else [])


class _Wakes:
    """The event-loop wake-ups the scheduler's thread owes its channels, sent together after
    each phase of an iteration (`Scheduler` calls `flush`): one callback for every channel that
    got events, where one per channel cost a write to the loop's self-pipe each and woke the
    loop once per request and token."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.due: list[_Channel] = []

    def add(self, channel: _Channel) -> None:
        with self.lock:
            self.due.append(channel)

    def flush_here(self) -> None:
        """The same on the event loop's own thread (the engine process's messages are read
        there): every channel woken at once, no callback queued."""
        with self.lock:
            due, self.due = self.due, []
        _set_ready(due)

    def flush(self) -> None:
        with self.lock:
            due, self.due = self.due, []
        by_loop: dict[int, list[_Channel]] = {}
        for channel in due:
            by_loop.setdefault(id(channel.loop), []).append(channel)
        for channels in by_loop.values():
            try:
                channels[0].loop.call_soon_threadsafe(_set_ready, channels)
            except RuntimeError:  # the loop closed (server shutting down): nobody is listening
                for channel in channels:
                    channel.on_closed()


def _set_ready(channels: list[_Channel]) -> None:
    for channel in channels:
        channel.ready.set()


async def _events(scheduler: Scheduler, gen: TextGenerator, req: GenerationRequest,
                  cancel: threading.Event, rid: str, wakes: _Wakes | None = None) -> AsyncIterator[tuple[str, Any]]:
    """Run one generation on the scheduler's thread and yield its events on the event loop
    (text deltas as they arrive, joined when several did at once; for a non-streamed request
    all its text at once with its final event, so the loop wakes once per request, not once
    per token); setting `cancel` ends the generation at its next step."""
    channel = _Channel(asyncio.get_running_loop(), wakes, cancel.set, quiet=not req.stream)
    scheduler.start(gen, req, channel.emit, cancel, rid)
    try:
        while True:
            for kind, payload in await channel.take():
                yield kind, payload
                if kind != "text":
                    return
    finally:
        cancel.set()  # a client gone mid-stream ends the generation at its next token


# ---------------------------------------------------------------- the app

def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _Endpoints:
    """The ASGI app `serve` runs: a POST to a generation endpoint goes straight to its handler
    (behind its own `Guard`), everything else to the FastAPI app (routing, the other endpoints,
    405 and 404). FastAPI's middleware, routing and dependency resolution cost a short
    completion about a quarter of the event loop's time per request (measured with an instant
    generator), which under load is CPU the model's process and the clients do not get."""

    def __init__(self, app: FastAPI, posts: dict[str, Callable], engine=None) -> None:
        self.app, self.posts, self.engine = app, posts, engine

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if self.engine is not None:  # its pipe is read and written on the loop serving the app
            await self.engine.attach()
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.posts.get(scope["path"])
            if endpoint is not None:
                return await endpoint(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(generator: TextGenerator, limits: ServerLimits | None = None,
               engine=None) -> _Endpoints:
    """The ASGI app serving `generator`, behind `http_guard.Guard` (limits, API key); all
    state lives in this closure. `engine`: an `engine_process.EngineProcess` running the model
    (then `generator` is its `EngineProxy`), else a `Scheduler` here runs it."""
    limits = limits or ServerLimits()
    app = FastAPI(title="metrale", docs_url=None, redoc_url=None, openapi_url=None)
    max_bytes = limits.request_bytes(generator.max_context)
    app.add_middleware(Guard, limits=limits, max_bytes=max_bytes)
    wakes = _Wakes()
    if engine is not None:
        scheduler, engine.flush = engine, wakes.flush_here
    else:
        scheduler = Scheduler.for_generator(generator, limits.max_num_seqs,
                                            limits.speculative_disable_by_batch_size, wakes.flush)
    # Mutated on the event loop thread only. requests: (endpoint, outcome); tokens: kind;
    # admitted: generation requests between parsing and their last byte (running or queued).
    requests: Counter[tuple[str, str]] = Counter()
    tokens: Counter[str] = Counter()
    admitted = [0]
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        rid = f"req-{uuid.uuid4().hex}"
        return JSONResponse(_server_error(e, rid, f"{request.method} {request.url.path}").body(),
                            status_code=500, headers={"X-Request-Id": rid})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": generator.model_id, "object": "model",
                                            "created": started, "owned_by": "metrale"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:  # off the loop: the engine process's answer is read on it
            text = await asyncio.to_thread(generator.metrics_text)
        except Exception as e:
            raise _server_error(e, f"req-{uuid.uuid4().hex}", "metrics_text") from e
        lines = [text.rstrip("\n")] if text.strip() else []
        lines += ["# HELP metrale_server_requests_total Generation requests by endpoint, outcome.",
                  "# TYPE metrale_server_requests_total counter"]
        for (endpoint, status), v in sorted(requests.items()):
            lines.append(f'metrale_server_requests_total{{endpoint="{endpoint}",'
                         f'status="{status}"}} {v}')
        for name in ("prompt", "completion"):
            lines += [f"# HELP metrale_server_{name}_tokens_total {name.title()} tokens processed.",
                      f"# TYPE metrale_server_{name}_tokens_total counter",
                      f"metrale_server_{name}_tokens_total {tokens[name]}"]
        lines += ["# HELP metrale_server_requests_admitted Generation requests running or queued.",
                  "# TYPE metrale_server_requests_admitted gauge",
                  f"metrale_server_requests_admitted {admitted[0]}", *scheduler.metrics_lines()]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def handle(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        raw = await request.body()
        try:
            if admitted[0] >= limits.max_queue:
                raise APIError(503, f"the server is busy ({limits.max_queue} requests running or "
                               "queued); retry shortly", code="server_busy", kind="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            admitted[0] += 1
            held = True  # until the last byte: a stream releases its place when it ends

            def release() -> None:
                nonlocal held
                if held:
                    held = False
                    admitted[0] -= 1

            response = None
            try:
                response = await generate(request, raw, chat, rid, release)
            finally:
                if not isinstance(response, StreamingResponse):
                    release()
        except APIError as e:
            requests[endpoint, "client_error" if e.status < 500 else "server_error"] += 1
            e.headers = {**(e.headers or {}), "X-Request-Id": rid}
            raise
        except Exception as e:  # a bug, not the request's fault: still a JSON 500
            requests[endpoint, "server_error"] += 1
            raise _server_error(e, rid, f"{endpoint} request") from e
        finally:
            if len(raw) >= LARGE_REQUEST_BYTES:
                await asyncio.to_thread(release_memory)
        requests[endpoint, "ok"] += 1
        response.headers["X-Request-Id"] = rid
        return response

    async def watch_disconnect(request: Request, cancel: threading.Event) -> None:
        """Set `cancel` when the client goes away (the body was read: what comes is the end)."""
        while not cancel.is_set():
            message = await request.receive()
            if message["type"] == "http.disconnect":
                cancel.set()

    async def generate(request: Request, raw: bytes, chat: bool, rid: str,
                       release: Callable[[], None]) -> Response:
        def parse() -> GenerationRequest:
            return parse_request(generator, decode_body(raw), chat)

        # a long prompt's tokenizing must not hold up the other requests' responses
        req = parse() if len(raw) <= INLINE_PARSE_BYTES else await asyncio.to_thread(parse)
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        n_prompt = len(req.prompt_ids)
        tokens["prompt"] += n_prompt
        cancel = scheduler.new_cancel(rid)
        watcher = asyncio.create_task(watch_disconnect(request, cancel))
        events = _events(scheduler, generator, req, cancel, rid, wakes)
        try:
            first = await anext(events)  # waiting for it turns a failing prefill into a 500
            if first[0] == "error":
                await events.aclose()
                raise _server_error(first[1], rid, logged=True)
            if not req.stream:
                return await complete(events, first, req, rid, obj, created, chat)
        finally:  # a streaming response watches the client itself from its first byte on
            watcher.cancel()

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role
                         else {} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": generator.model_id, "choices": [choice]}

        async def sse() -> AsyncIterator[str]:
            try:
                async for line in sse_lines():
                    yield line
            finally:  # also when the client went away: stop the worker at its next token
                await events.aclose()

        async def sse_lines() -> AsyncIterator[str]:
            if chat:
                yield _sse(chunk(None, None, role=True))
            event = first
            while True:
                kind, payload = event
                if kind == "text":
                    yield _sse(chunk(payload, None))
                elif kind == "error":
                    yield _sse(_server_error(payload, rid, logged=True).body())
                    break
                else:
                    finish, n_done = payload
                    tokens["completion"] += n_done
                    yield _sse(chunk(None, finish))
                    if req.include_usage:
                        yield _sse({"id": rid, "object": obj + ".chunk" if chat else obj,
                                    "created": created, "model": generator.model_id,
                                    "choices": [], "usage": _usage(n_prompt, n_done)})
                    break
                event = await anext(events)
            yield "data: [DONE]\n\n"

        def finished() -> None:  # runs after the stream, also when the client left first
            cancel.set()
            release()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(finished))

    async def complete(events, first, req: GenerationRequest, rid: str, obj: str, created: int,
                       chat: bool) -> Response:
        """A non-streamed answer: every text event joined."""
        parts: list[str] = []
        event = first
        try:
            while event[0] == "text":
                parts.append(event[1])
                event = await anext(events)
        finally:
            await events.aclose()
        if event[0] == "error":
            raise _server_error(event[1], rid, logged=True)
        finish, n_done = event[1]
        tokens["completion"] += n_done
        text = "".join(parts)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text},
             "logprobs": None, "finish_reason": finish} if chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": obj, "created": created,
                             "model": generator.model_id, "choices": [choice],
                             "usage": _usage(len(req.prompt_ids), n_done)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    def direct(chat: bool) -> Callable:
        """A generation endpoint as a bare ASGI app: the route's handler, its refusals as the
        FastAPI app's `APIError` handler answers them (every other failure `handle` already
        turned into an `APIError` 500 that names the request id)."""
        async def endpoint(scope: dict[str, Any], receive: Callable, send: Callable) -> None:
            try:
                response = await handle(Request(scope, receive), chat)
            except APIError as e:
                response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            await response(scope, receive, send)
        return Guard(endpoint, limits=limits, max_bytes=max_bytes)

    return _Endpoints(app, {"/v1/completions": direct(False), "/v1/chat/completions": direct(True)},
                      engine)


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

    import sys

    limits = limits or ServerLimits()
    log.info("serving %s on http://%s:%d", generator.model_id, host, port)
    app = create_app(generator, limits, engine)
    # The scheduler's thread runs Python between its package calls; a request's handling on
    # the event loop waits for the GIL at each hand-off, by default up to 5 ms each time.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    freeze_heap()
    uvicorn.Server(uvicorn_config(app, host, port, limits, log_level="info")).run()

"""OpenAI-compatible HTTP API over any `TextGenerator` (FastAPI + uvicorn).

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(both with `stream`: server-sent events ending in `data: [DONE]`), `GET /metrics` (Prometheus
text: the generator's own metrics followed by the server's request and token counters).

Invariants:
- A request is parsed and checked completely before any generation starts. A malformed one
  (bad JSON, missing or mistyped field, n>1, temperature<0, top_p outside (0, 1], prompt +
  max_tokens over the context, an unknown model) gets a 4xx with OpenAI's error object
  `{"error": {"message", "type", "param", "code"}}`; a generator exception gets a 500 with the
  same shape (or, once a stream has started, a final `data: {"error": ...}` event). Neither
  stops the server.
- Generation runs on a worker thread, one request at a time behind a lock (the model is
  single-stream); the event loop only moves text deltas from a queue to the client, so /health
  and /metrics answer while a long generation runs. A client that disconnects mid-stream stops
  its generation at the next token.
- Streamed text deltas concatenate to exactly the non-streamed text: both come from the same
  worker, through `IncrementalDecoder` (no split UTF-8 characters) and the stop-string scanner
  (text that might begin a stop string is held back until it cannot).
- finish_reason is "stop" when the model emitted an EOS id or a stop string matched (the stop
  string and everything after it are cut), "length" when max_tokens ran out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metrale.runtime.errors import MetraleError
from metrale.runtime.sampling import SamplingParams
from metrale.runtime.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger(__name__)


class TextGenerator(Protocol):
    """What the server serves: a single-stream generator plus its tokenizer."""

    model_id: str  # shown by /v1/models; requests naming another model get a 404
    tokenizer: Tokenizer
    max_context: int  # prompt + max_tokens must fit

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids; stop at EOS or after params.max_tokens ids."""
        ...

    def metrics_text(self) -> str:
        """Prometheus exposition text for /metrics."""
        ...


class APIError(Exception):
    """A request the server refuses; becomes OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind,
                          "param": self.param, "code": self.code}}


def _server_error(e: BaseException, what: str = "generation") -> APIError:
    return APIError(500, f"{what} failed: {type(e).__name__}: {e}", kind="server_error",
                    code="internal_error")


# ---------------------------------------------------------------- request parsing

_NUMBER = (int, float)
# OpenAI fields this server does not implement: refused unless they hold their no-op value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
    "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},),
}


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str,
           required: bool = False) -> Any:
    """body[name] checked against `kinds` (bool is never a number); None when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"`{name}` is required", name, "missing_required_parameter")
        return None
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise APIError(400, f"`{name}` must be {what}, got {value!r}", name, "invalid_type")
    return value


def _strings(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise APIError(400, f"`{name}` must be a string or a list of strings, got {value!r}", name,
                   "invalid_type")


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: what the worker needs, nothing from the HTTP layer."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _message_text(m: Any, i: int) -> Any:
    """OpenAI lets content be a list of parts; the text parts join into the template's string."""
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        parts = m["content"]
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in parts):
            raise APIError(400, f"messages[{i}].content: only text parts are supported",
                           "messages", "invalid_type")
        return {**m, "content": "".join(p["text"] for p in parts)}
    return m


def parse_request(gen: TextGenerator, body: Any, chat: bool) -> GenerationRequest:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body; raise APIError."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    model = _field(body, "model", str, "a string")
    if model is not None and model != gen.model_id:
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                       f"{gen.model_id!r}", "model", "model_not_found")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise APIError(400, f"`{name}` is not supported by this server, got {body[name]!r}",
                           name, "unsupported_parameter")
    n = _field(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise APIError(400, f"`n` must be 1 (one choice per request), got {n}", "n",
                       "unsupported_parameter")
    tok = gen.tokenizer
    if chat:
        prompt_param = "messages"
        messages = _field(body, "messages", list, "a list of messages", required=True)
        try:
            text = tok.apply_chat_template([_message_text(m, i) for i, m in enumerate(messages)])
        except MetraleError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from e
        prompt_ids = tok.encode(text)
    else:
        prompt_param = "prompt"
        prompt = _field(body, "prompt", (str, list), "a string, a list of one string, or a list "
                        "of token ids", required=True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < tok.vocab_size for t in prompt):
                raise APIError(400, f"`prompt` token ids must lie in [0, {tok.vocab_size})",
                               "prompt", "invalid_value")
            prompt_ids = list(prompt)  # already token ids
        else:
            prompts = _strings(prompt, "prompt")
            if len(prompts) != 1:
                raise APIError(400, f"`prompt` must hold exactly one string (batches are not "
                               f"supported), got {len(prompts)}", "prompt", "unsupported_parameter")
            prompt_ids = tok.encode(prompts[0], add_special=True)
    if not prompt_ids:
        raise APIError(400, f"`{prompt_param}` encodes to no tokens", prompt_param, "invalid_value")

    max_tokens = _field(body, "max_tokens", int, "an integer")
    if chat and max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", int, "an integer")
    temperature = _field(body, "temperature", _NUMBER, "a number")
    top_p = _field(body, "top_p", _NUMBER, "a number")
    seed = _field(body, "seed", int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"`max_tokens` must be at least 1, got {max_tokens}", "max_tokens",
                       "invalid_value")
    if temperature is not None and not temperature >= 0:  # NaN included
        raise APIError(400, f"`temperature` must be >= 0 (0 = greedy), got {temperature}",
                       "temperature", "invalid_value")
    if top_p is not None and not 0 < top_p <= 1:
        raise APIError(400, f"`top_p` must lie in (0, 1], got {top_p}", "top_p", "invalid_value")
    room = gen.max_context - len(prompt_ids)
    if max_tokens is None:
        max_tokens = min(SamplingParams().max_tokens, room)  # the sampler's default, if it fits
    if room < 1 or max_tokens > room:
        raise APIError(400, f"the context holds {gen.max_context} tokens; the {prompt_param} "
                       f"takes {len(prompt_ids)}, leaving {max(room, 0)} for completion, but "
                       f"max_tokens is {max_tokens}", prompt_param, "context_length_exceeded")
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "seed": seed}
    if temperature is not None:
        sampling["temperature"] = float(temperature)
    if top_p is not None:
        sampling["top_p"] = float(top_p)
    try:
        params = SamplingParams(**sampling)
    except MetraleError as e:  # its message starts with the field's name
        field = str(e).split(":", 1)[0]
        raise APIError(400, str(e), field if field in sampling else None, "invalid_value") from e

    stop = body.get("stop")
    stops = tuple(s for s in _strings(stop, "stop") if s) if stop is not None else ()
    stream = _field(body, "stream", bool, "a boolean")
    options = _field(body, "stream_options", dict, "an object") or {}
    include_usage = options.get("include_usage") is True
    return GenerationRequest(prompt_ids, params, stops, bool(stream), include_usage)


# ---------------------------------------------------------------- generation worker

class StopScanner:
    """Cuts text at the first stop string; holds back a tail that may still begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string matched)."""
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)], True
        hold = 0  # longest suffix of text that is a proper prefix of some stop string
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


def _run_generation(gen: TextGenerator, lock: threading.Lock, req: GenerationRequest,
                    emit: Callable[[str, Any], None], cancel: threading.Event) -> None:
    """Worker thread body: emit ("text", str)*, then ("done", (finish_reason, n_tokens)) or
    ("error", exception)."""
    try:
        decoder, scanner = IncrementalDecoder(gen.tokenizer), StopScanner(req.stop)
        eos, limit = gen.tokenizer.eos_token_ids, req.params.max_tokens
        n, saw_eos, stopped = 0, False, False
        with lock:
            if cancel.is_set():  # the client left while this request waited for the model
                return
            tokens = gen.stream(req.prompt_ids, req.params)
            try:
                for token in tokens:
                    n += 1
                    if token in eos:
                        saw_eos = True
                        break
                    text, stopped = scanner.push(decoder.feed(token))
                    if text:
                        emit("text", text)
                    if stopped or cancel.is_set() or n >= limit:
                        break
            finally:
                close = getattr(tokens, "close", None)
                if close is not None:  # a generator: run its cleanup now, under the lock
                    close()
        if not stopped:
            text, stopped = scanner.push(decoder.flush())
            text += "" if stopped else scanner.flush()
            if text:
                emit("text", text)
        finish = "stop" if stopped or saw_eos or n < limit else "length"
        emit("done", (finish, n))
    except Exception as e:  # reported to the client as a 500; the server keeps serving
        log.exception("generation failed")
        emit("error", e)


async def _events(gen: TextGenerator, lock: threading.Lock,
                  req: GenerationRequest) -> AsyncIterator[tuple[str, Any]]:
    """Run one generation on a worker thread and yield its events on the event loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancel = threading.Event()

    def emit(kind: str, payload: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop closed (server shutting down): nobody is listening
            cancel.set()

    threading.Thread(target=_run_generation, args=(gen, lock, req, emit, cancel),
                     name="metrale-generate", daemon=True).start()
    try:
        while True:
            kind, payload = await queue.get()
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


def create_app(generator: TextGenerator) -> FastAPI:
    """The FastAPI app serving `generator`; all state lives in this closure."""
    app = FastAPI(title="metrale", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()
    # Mutated on the event loop thread only. requests: (endpoint, outcome); tokens: kind.
    requests: Counter[tuple[str, str]] = Counter()
    tokens: Counter[str] = Counter()
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=e)
        return JSONResponse(_server_error(e, "request").body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": generator.model_id, "object": "model",
                                            "created": started, "owned_by": "metrale"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = generator.metrics_text()
        except Exception as e:
            log.exception("metrics_text failed")
            raise _server_error(e, "metrics_text") from e
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
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def handle(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            response = await generate(request, chat)
        except APIError as e:
            requests[endpoint, "client_error" if e.status < 500 else "server_error"] += 1
            raise
        except Exception as e:  # a bug, not the request's fault: still a JSON 500
            log.exception("%s request failed", endpoint)
            requests[endpoint, "server_error"] += 1
            raise _server_error(e) from e
        requests[endpoint, "ok"] += 1
        return response

    async def generate(request: Request, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
        req = parse_request(generator, body, chat)
        prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        n_prompt = len(req.prompt_ids)
        tokens["prompt"] += n_prompt
        events = _events(generator, lock, req)
        first = await anext(events)  # waiting for it turns a failing prefill into a 500
        if first[0] == "error":
            await events.aclose()
            raise _server_error(first[1])

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role
                         else {} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": generator.model_id, "choices": [choice]}

        if not req.stream:
            parts: list[str] = []
            event = first
            try:
                while event[0] == "text":
                    parts.append(event[1])
                    event = await anext(events)
            finally:
                await events.aclose()
            if event[0] == "error":
                raise _server_error(event[1])
            finish, n_done = event[1]
            tokens["completion"] += n_done
            text = "".join(parts)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text},
                 "logprobs": None, "finish_reason": finish} if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
            return JSONResponse({"id": rid, "object": obj, "created": created,
                                 "model": generator.model_id, "choices": [choice],
                                 "usage": _usage(n_prompt, n_done)})

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
                    yield _sse(_server_error(payload).body())
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

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


def serve(generator: TextGenerator, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `generator` until interrupted."""
    import uvicorn

    log.info("serving %s on http://%s:%d", generator.model_id, host, port)
    uvicorn.run(create_app(generator), host=host, port=port, log_level="info")

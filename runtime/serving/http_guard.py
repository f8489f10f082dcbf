"""What stands between the network and the API: limits, timeouts and the API key.

Contract:
- `ServerLimits` holds every knob, validated when built; `request_bytes(context)` sizes the
  body limit to the context window unless one is given.
- `Guard` is an ASGI middleware. For `/v1/*` it checks `Authorization: Bearer <key>` when a
  key is set (401 otherwise, compared in constant time). For every request with a body it reads
  the whole body before the app runs: a `Content-Length` over the limit is refused at once
  (413), a body that grows past it while streaming in is cut off (413), one that does not
  arrive within `body_timeout_s` gets 408. The app then sees the body replayed, and after it
  the connection's own messages (so a disconnect still reaches the app). After a body of
  `LARGE_REQUEST_BYTES` or more, freed heap goes back to the OS (`release_memory`, glibc's
  `malloc_trim`) before the response starts, so the resident size falls back.
- `Admission` is an ASGI middleware admitting at most `max_queue` generation requests at once
  (`Admitted`), from their body's arrival to their response's last byte (a stream holds its
  place until it ends); beyond it a request gets 503 with `Retry-After`.
- `protocol_class(limits)` is uvicorn's httptools protocol with a header deadline: a connection that
  has not sent a complete request head `header_timeout_s` after it opened (or after its last
  response) is closed, however slowly it trickles bytes in.
Every refusal is OpenAI's error object; none of them stops the server.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import hmac
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from metrale.runtime.errors import ConfigError
from metrale.runtime.serving.api_models import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

BASE_REQUEST_BYTES = 1 << 20  # JSON framing, chat messages, stop strings
BYTES_PER_CONTEXT_TOKEN = 64  # generous: a token id list or escaped text of a full context
LARGE_REQUEST_BYTES = 256 << 10  # after a body this large, freed heap goes back to the OS
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """How much the server accepts, and how long it waits. `max_request_bytes` None: sized to
    the context window (`request_bytes`)."""

    max_request_bytes: int | None = None
    max_queue: int = 64  # generation requests admitted at once (running or waiting): 503 beyond
    max_num_seqs: int = 64  # requests running at once (the scheduler's running set)
    # steps are plain while this many sequences or more run (None: they always may draft)
    speculative_disable_by_batch_size: int | None = 2
    max_connections: int = 256  # open connections and tasks (uvicorn's limit_concurrency): 503 beyond
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        for v, flag in ((self.max_queue, "--max-queue"), (self.max_connections, "--max-connections"),
                        (self.max_num_seqs, "--max-num-seqs")):
            if type(v) is not int or v < 1:
                raise ConfigError(f"{flag} {v!r}: expected an integer of at least 1")
        d = self.speculative_disable_by_batch_size
        if d is not None and (type(d) is not int or d < 1):
            raise ConfigError(f"--speculative-disable-by-batch-size {d!r}: expected an integer of "
                              "at least 1 (1: never draft; 0 or absent is not allowed)")
        m = self.max_request_bytes
        if m is not None and (type(m) is not int or m < 1024):
            raise ConfigError(f"--max-request-bytes {m!r}: expected an integer of at least 1024")
        for v, name in ((self.header_timeout_s, "header_timeout_s"), (self.body_timeout_s, "body_timeout_s"),
                        (self.keep_alive_s, "keep_alive_s")):
            if not isinstance(v, (int, float)) or not 0 < v < 3600:
                raise ConfigError(f"{name} {v!r}: expected seconds in (0, 3600)")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or any(c.isspace() for c in self.api_key)):
            raise ConfigError("--api-key (or METRALE_API_KEY): expected a non-empty key of printable "
                              "characters without spaces")

    def request_bytes(self, context: int) -> int:
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return BASE_REQUEST_BYTES + BYTES_PER_CONTEXT_TOKEN * context


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    return ErrorBody(error=ErrorDetail(message=message, type=kind, code=code)).model_dump_json().encode()


async def send_error(send: Send, status: int, message: str, code: str,
                     headers: tuple[tuple[bytes, bytes], ...] = (),
                     kind: str = "invalid_request_error") -> None:
    body = error_body(message, code, kind)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Guard:
    """ASGI middleware: API key on /v1/*, then the body read whole under limit and deadline."""

    def __init__(self, app: Callable, limits: ServerLimits, max_bytes: int) -> None:
        self.app, self.limits, self.max_bytes = app, limits, max_bytes
        key = limits.api_key
        self._key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self._key is not None and scope["path"].startswith("/v1/"):
            # the scheme's name in any case (RFC 9110 section 11.1), then the key
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if not (hmac.compare_digest(given.strip(b" "), self._key) and scheme.lower() == b"bearer"):
                return await send_error(send, 401, "invalid or missing API key: send the header "
                                        "`Authorization: Bearer <key>`", "invalid_api_key",
                                        ((b"www-authenticate", b"Bearer"),))
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        try:
            body = await self._read_body(headers, receive)
        except _Refused as e:
            return await send_error(send, e.status, e.message, e.code,
                                    ((b"connection", b"close"),))
        if len(body) >= LARGE_REQUEST_BYTES:
            send = _trimming(send)
        return await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise _Refused(400, "Content-Length is not a byte count", "invalid_request")
            if int(declared) > self.max_bytes:
                raise _Refused(413, f"request body of {int(declared)} bytes exceeds this server's "
                               f"limit of {self.max_bytes} bytes", "request_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Refused(400, "client disconnected", "client_disconnected")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise _Refused(413, f"request body exceeds this server's limit of "
                                       f"{self.max_bytes} bytes", "request_too_large")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise _Refused(408, f"request body did not arrive within "
                           f"{self.limits.body_timeout_s:g} s", "request_timeout") from None


def _trimming(send: Send) -> Send:
    """`send`, handing freed heap back to the OS before the response starts (off the loop)."""
    async def send_trimmed(message: Message) -> None:
        if message["type"] == "http.response.start":
            await asyncio.to_thread(release_memory)
        await send(message)

    return send_trimmed


class Admitted:
    """Generation requests admitted now (running or waiting for the model), at most `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit, self.n = limit, 0


class Admission:
    """ASGI middleware: a POST to one of `paths` is admitted while `admitted` has room, and
    holds its place until the app returns (its response's last byte sent); beyond the limit it
    gets 503 with `Retry-After` and `on_refused(path)` is told."""

    def __init__(self, app: Callable, admitted: Admitted, paths: frozenset[str],
                 on_refused: Callable[[str], None] = lambda path: None) -> None:
        self.app, self.admitted, self.paths, self.on_refused = app, admitted, paths, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        admitted = self.admitted
        if admitted.n >= admitted.limit:
            self.on_refused(scope["path"])
            return await send_error(send, 503, f"the server is busy ({admitted.limit} requests "
                                    "running or queued); retry shortly", "server_busy",
                                    ((b"retry-after", str(RETRY_AFTER_S).encode()),), "server_error")
        admitted.n += 1
        try:
            await self.app(scope, receive, send)
        finally:
            admitted.n -= 1


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def protocol_class(limits: ServerLimits) -> type:
    """uvicorn's httptools protocol (its C parser costs a short request less of the server's
    time than h11's), closing connections that do not send a request head in time. A
    connection is overdue when every request head it sent has had its response: none is
    outstanding, not even a pipelined one."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _heads = _answered = 0  # request heads parsed, responses completed

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._head_overdue)

        def _head_overdue(self) -> None:
            if self._heads == self._answered and not self.transport.is_closing():
                self.transport.close()  # no complete request head in time

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._heads += 1
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._answered += 1
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return HeaderDeadlineProtocol


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no C library, or one without malloc_trim (not glibc)
        return None


def release_memory() -> None:
    """Return freed heap memory to the OS where the C library can (glibc); else nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)

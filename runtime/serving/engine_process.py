"""The model in a process of its own: `serve` answers HTTP in one process and runs the scheduler
and the models in another, as vLLM splits its API server from its engine core.

In one process the event loop's Python (parsing, tokenizing, responses) and the scheduler's
(the decode loops, between the package calls) take turns on one interpreter lock, and every
hand-off waits for the other to let go of it: at C = 32 on two cores the server used 1.1 cores
of its two. Split, each has its own.

The engine process (`engine_main`) loads the generator with the caller's `load` (a picklable
callable: the CLI's loader), splits its batched steps over one thread fewer than torch's (at least
one: `HTTP_CORES` stay with the HTTP process), and runs a `scheduler.Scheduler` over it on its one
Python thread, which between iterations reads the pipe: ("submit", rid, request), ("cancel",
rid), ("metrics", n), ("stop",). What the jobs emit is sent back once per scheduler phase, every
request's events of the phase in one message (a fast stream's later deltas at most once per
`STREAM_FLUSH_S`). The server's side (`EngineProcess`) is the `Scheduler` its app submits to,
reading and writing the pipe on the app's event loop (`attach`: an asyncio transport, so a send
never blocks the loop and the engine, which reads only between iterations, never waits on a
server that is itself waiting to send): `start` sends a request and routes its events to the
request's channel, `new_cancel` gives an event whose `set` cancels the
request there too, `metrics_lines` and `metrics_text` ask the engine for its counters.

Neither side has a reader thread: a hand-off through one cost a wake-up of that thread, which
then waited for a core and for the interpreter lock its process's busy thread held (traced on 2
cores behind a 1,000-token stream: the engine's reader took a submitted request up to 3-6 ms
after the pipe write, read between iterations up to 0.65 ms). Measured over HTTP on the tiny
default, 40 interleaved runs each: a 4-token request behind a 1,000-token stream p90 8.59 ->
6.93 ms, worst 11.87 -> 10.13 ms; tokens/s alone and at C = 32 within noise (1.01x, 1.02x).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable

from metrale.runtime.serving.scheduler import Job, Scheduler

log = logging.getLogger(__name__)

# Cores the batched steps leave to the HTTP process (parsing, tokenizing, responses), as vLLM's CPU
# backend reserves one for its API server. Measured on 2 cores, 32 clients over HTTP: the steps on
# both (two half-batch calls, each streaming every weight) against one, plain decoding, 16
# requests a client, median of 9 rounds 4,143 -> 5,296 tok/s; 8 requests a client, all modes up
# together over 6 rounds, plain inside its noise and MTP and DFlash 4,335 -> 5,392 and
# 4,389 -> 5,248.
HTTP_CORES = 1
# A stream's later text deltas leave the engine at most this often; its first delta, and every
# request's end, leave at the end of the scheduler phase that made them. A phase (an iteration's
# steps) shorter than this is a stream faster than a token a millisecond: the tiny default
# decodes one alone every ~0.25 ms, and each message costs the HTTP process and the client a
# wake-up, an SSE event and a parse, on the cores the engine and every other request share.
STREAM_FLUSH_S = 0.001
READY_TIMEOUT_S = 600.0  # loading (and building nothing): the engine says ready or why not
METRICS_TIMEOUT_S = 10.0


def _send(conn, msg: tuple) -> None:
    """One message over the pipe, pickled with the standard pickler: a Connection's own `send`
    builds a ForkingPickler, copying its table of reducers, for every message (on the server's
    side about a tenth of a short request's time)."""
    conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))


def _recv(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


class _Outbox:
    """The engine side: events of the scheduler's jobs, sent together at each flush. A flush
    holding only later text deltas of streams waits until `STREAM_FLUSH_S` passed since the last
    message (the next phase's flush sends them, joined by the HTTP side); one holding a
    request's first delta or its end sends at once. The scheduler's thread, the process's one,
    is the only caller."""

    def __init__(self, conn, cancels: dict):
        self.conn, self.cancels = conn, cancels
        self.items: list[tuple[str, str, Any]] = []
        self.urgent = False  # an item that does not wait: a first delta, an end
        self.sent_at, self.clock = float("-inf"), time.monotonic

    def emitter(self, rid: str, stream: bool) -> Callable[[str, Any], None]:
        """The events of request `rid`; a non-streamed one's text is held and sent joined with
        its final event (the server wakes once per answer)."""
        held: list[str] = []
        first = True

        def emit(kind: str, payload: Any) -> None:
            nonlocal first
            if kind == "text" and not stream:
                held.append(payload)
                return
            if kind == "error":  # logged here with its traceback (`Job.fail`); its words travel
                payload = f"{type(payload).__name__}: {payload}"
            if kind != "text":
                self.cancels.pop(rid, None)
                if held:
                    self.items.append((rid, "text", "".join(held)))
                self.urgent = True
            elif first:  # its time to first token waits for nothing
                self.urgent, first = True, False
            self.items.append((rid, kind, payload))
        return emit

    def flush(self) -> None:
        if not self.items:
            return
        now = self.clock()
        if not self.urgent and now - self.sent_at < STREAM_FLUSH_S:
            return  # later deltas of fast streams: the next phase's flush sends them
        items, self.items, self.urgent, self.sent_at = self.items, [], False, now
        _send(self.conn, ("events", items))


class _Inbox:
    """The engine side's pipe, read by its scheduler's loop before each iteration
    (`Scheduler.run`): every waiting message handled, blocking for the first only while nothing
    runs; False once the server said stop or went away.

    With nothing waiting mid-generation it yields the core (`os.sched_yield`): on a machine
    with more runnable threads than cores (the HTTP process, its clients, a stream's reader)
    the kernel otherwise lets this busy thread run out its time slice, a few milliseconds,
    before a thread woken on its core runs. Measured on 2 cores over HTTP, 40 interleaved runs
    each: a 4-token request behind a 1,000-token stream p90 7.32 -> 5.14 ms, worst 11.73 ->
    6.39 ms (alone: 4.1-4.2 ms); tokens/s alone 0.98x and at C = 32 1.01x, inside noise (8
    rounds)."""

    def __init__(self, conn, gen):
        self.conn, self.gen = conn, gen
        self.cancels: dict[str, threading.Event] = {}  # of the requests running or waiting
        self.outbox = _Outbox(conn, self.cancels)  # what the jobs emit goes back on the pipe
        self.scheduler = None  # set once the scheduler reading it exists

    def __call__(self, wait: bool) -> bool:
        conn = self.conn
        if not wait and not conn.poll():
            os.sched_yield()
            return True
        while True:
            try:
                msg = _recv(conn)
            except (EOFError, OSError):
                return False
            if msg[0] == "submit":
                _, rid, req = msg
                self.cancels[rid] = cancel = threading.Event()
                self.scheduler.submit(Job(self.gen, req, self.outbox.emitter(rid, req.stream), cancel, rid))
            elif msg[0] == "cancel":
                cancel = self.cancels.pop(msg[1], None)
                if cancel is not None:
                    cancel.set()
            elif msg[0] == "metrics":
                _send(conn, ("metrics", msg[1], self.gen.metrics_text(),
                             self.scheduler.metrics_lines()))
            elif msg[0] == "stop":
                return False
            if not conn.poll():
                return True


def freeze_heap() -> None:
    """Everything alive once loading is done (imported modules, the models, the packages'
    wrappers) out of the garbage collector's generations: a full collection otherwise walks
    those millions of objects again each time serving's allocations trigger one (measured: 6%
    of a batched step's time in `gc_collect_main`)."""
    gc.collect()
    gc.freeze()


def engine_main(conn, load: Callable, max_num_seqs: int, disable_at: int | None,
                prefix_cache_tokens: int) -> None:
    """The engine process: load, say ready (or why not), then serve the pipe until it closes."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it stops the engine

    try:
        gen = load()
        cache = gen.cache_prefixes(prefix_cache_tokens) if prefix_cache_tokens else None
        lanes = gen.leave_cores(HTTP_CORES)
    except BaseException as e:  # noqa: BLE001 - the server reports it as the CLI would
        from metrale.runtime.errors import MetraleError

        _send(conn, ("failed", isinstance(e, MetraleError), f"{type(e).__name__}: {e}", str(e)))
        return
    engine = gen.engine
    inbox = _Inbox(conn, gen)
    inbox.scheduler = Scheduler.for_generator(gen, max_num_seqs, disable_at, inbox.outbox.flush,
                                              yield_gil=False, inbox=inbox)  # no event loop here
    freeze_heap()
    _send(conn, ("ready", {"model_id": gen.model_id, "max_context": gen.max_context,
                           "engine_dir": str(engine.path), "backend": getattr(engine, "backend", ""),
                           "backend_note": getattr(engine, "backend_note", ""),
                           "requantized": dict(getattr(engine, "requantized", {})),
                           "prefix_cache": cache is not None, "lanes": lanes,
                           "threads": torch.get_num_threads()}))
    inbox.scheduler.run()


def _frame(data: bytes) -> bytes:
    """`data` framed as `multiprocessing.connection.Connection.send_bytes` frames it (a 4-byte
    big-endian length, or -1 and an 8-byte length), so the engine's `recv_bytes` reads it."""
    n = len(data)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + data


class _FromEngine(asyncio.Protocol):
    """The HTTP side's end of the pipe on the event loop: whole messages out of the bytes as
    they arrive (framed as `_frame` frames them), handed to the `EngineProcess` together; the
    engine's exit (end of file) fails what waits for it."""

    def __init__(self, engine: "EngineProcess"):
        self.engine, self.buf = engine, bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        msgs, at, buf = [], 0, self.buf
        while len(buf) - at >= 4:
            (n,), head = struct.unpack_from("!i", buf, at), 4
            if n == -1:
                if len(buf) - at < 12:
                    break
                (n,), head = struct.unpack_from("!Q", buf, at + 4), 12
            if len(buf) - at < head + n:
                break
            msgs.append(pickle.loads(buf[at + head:at + head + n]))
            at += head + n
        del buf[:at]
        if msgs:
            self.engine._handle(msgs)

    def eof_received(self) -> bool:
        self.engine.detach()
        self.engine._gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.engine.dead is None:  # a failed pipe, not our own close
            self.engine._gone()


class _RemoteCancel(threading.Event):
    """A request's cancel event on the server's side: setting it cancels it in the engine, while
    it runs there. The app sets it once every request is over (`server._events`); a request
    whose final event came back has nothing to cancel, and a message for it would cost a pipe
    write here and a read between the engine's iterations there."""

    def __init__(self, engine: "EngineProcess", rid: str):
        super().__init__()
        self.engine, self.rid = engine, rid

    def set(self) -> None:
        if not self.is_set():
            super().set()
            if self.rid in self.engine.channels:  # its final event has not come back
                self.engine.send(("cancel", self.rid))


class EngineProcess:
    """The server's side of the engine process (see the module docstring). `info`: what the
    engine said once loaded (model id, context, engine directory, backend)."""

    def __init__(self, load: Callable, max_num_seqs: int, disable_at: int | None,
                 prefix_cache_tokens: int):
        from metrale.runtime.errors import MetraleError

        self.dead: str | None = None
        self.closing = False
        self.send_lock = threading.Lock()  # sends down the pipe itself (not attached)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport: asyncio.Transport | None = None  # the pipe on `loop`, once attached
        self._attached: asyncio.Future | None = None
        self._loop_thread = 0
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, name="metrale-engine", daemon=True,
                                args=(child, load, max_num_seqs, disable_at, prefix_cache_tokens))
        self.proc.start()
        child.close()
        if not self.conn.poll(READY_TIMEOUT_S):
            self.close()
            raise MetraleError(f"the engine process did not load within {READY_TIMEOUT_S:.0f} s")
        try:
            msg = _recv(self.conn)
        except EOFError:
            self.proc.join(5)
            raise MetraleError(f"the engine process exited while loading (exit code "
                               f"{self.proc.exitcode})") from None
        if msg[0] == "failed":
            self.close()
            _, user_error, described, words = msg  # a user's error is told as the CLI tells it
            raise MetraleError(words) if user_error else RuntimeError(described)
        self.info: dict = msg[1]
        self.flush: Callable[[], None] = lambda: None  # the app's wake-ups, after each message
        self.channels: dict[str, Callable[[str, Any], None]] = {}
        self._metrics: dict[int, tuple] = {}
        self._metrics_ready = threading.Condition()
        self._asked = 0
        self._lines: list[str] = []

    async def attach(self) -> None:
        """Read and write the engine's pipe on the running loop (the app's: it attaches at each
        call, which costs nothing but on a loop's first): messages are handled as they arrive,
        and sends never block the loop (the transport buffers what the pipe does not take, as
        the engine reads only between iterations), so neither side can wait on the other."""
        loop = asyncio.get_running_loop()
        if loop is self.loop:
            await self._attached
            return
        if self.dead is not None or self.conn.closed:
            return
        self.detach()
        self.loop, self._loop_thread, self._attached = loop, threading.get_ident(), loop.create_future()
        try:
            sock = socket.socket(fileno=os.dup(self.conn.fileno()))
            self.transport, _ = await loop.connect_accepted_socket(lambda: _FromEngine(self), sock)
        finally:
            self._attached.set_result(None)

    def detach(self) -> None:
        if self.transport is not None and self.loop is not None and not self.loop.is_closed():
            self.transport.close()
        self.loop = self.transport = None

    def send(self, msg: tuple) -> None:
        """From the loop's thread: into the transport's buffer. From another thread: handed to
        the loop. Before attaching or once its loop is closed: down the pipe itself."""
        if self.dead is not None:
            return
        data = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
        loop, transport = self.loop, self.transport
        if transport is not None and not loop.is_closed():
            frame = _frame(data)
            if threading.get_ident() == self._loop_thread:
                transport.write(frame)
            else:
                loop.call_soon_threadsafe(transport.write, frame)
            return
        try:
            with self.send_lock:
                os.set_blocking(self.conn.fileno(), True)  # (the transport made it non-blocking)
                self.conn.send_bytes(data)
        except (OSError, ValueError):  # the engine is gone
            pass

    # the app's scheduler face
    def start(self, gen, req, emit: Callable[[str, Any], None], cancel, rid: str) -> None:
        """(On the event loop, where the engine's messages are handled.)"""
        if self.dead is not None:
            emit("error", RuntimeError(self.dead))
            self.flush()
            return
        self.channels[rid] = emit
        self.send(("submit", rid, req))

    def new_cancel(self, rid: str) -> threading.Event:
        return _RemoteCancel(self, rid)

    def metrics_lines(self) -> list[str]:
        return list(self._lines)

    def metrics_text(self) -> str:
        """The engine's spec-decode text (its scheduler's lines kept for `metrics_lines`)."""
        with self._metrics_ready:
            self._asked += 1
            n = self._asked
        self.send(("metrics", n))
        with self._metrics_ready:
            if not self._metrics_ready.wait_for(lambda: n in self._metrics or self.dead is not None,
                                                METRICS_TIMEOUT_S):
                raise RuntimeError("the engine process did not answer for its metrics")
            if self.dead is not None and n not in self._metrics:
                raise RuntimeError(self.dead)
            text, self._lines = self._metrics.pop(n)
        return text

    def _handle(self, msgs: list[tuple]) -> None:
        """The engine's messages that arrived together (on the loop), then the app's wake-ups
        once."""
        for msg in msgs:
            if msg[0] == "events":
                for rid, kind, payload in msg[1]:
                    emit = self.channels.get(rid) if kind == "text" else self.channels.pop(rid, None)
                    if emit is not None:
                        emit(kind, RuntimeError(payload) if kind == "error" else payload)
            elif msg[0] == "metrics":
                with self._metrics_ready:
                    self._metrics[msg[1]] = (msg[2], msg[3])
                    self._metrics_ready.notify_all()
        self.flush()

    def _gone(self) -> None:
        """The engine exited: every request still waiting for it fails, and so does a wait for
        its metrics."""
        self.dead = "the engine process exited"  # (its exit code: `close` reaps it)
        orphans, self.channels = list(self.channels.values()), {}
        if not self.closing:
            log.error("%s", self.dead)
        for emit in orphans:
            emit("error", RuntimeError(self.dead))
        with self._metrics_ready:
            self._metrics_ready.notify_all()
        self.flush()

    def close(self) -> None:
        self.closing = True
        self.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


class EngineProxy:
    """What the server's app reads of its generator when the model runs in the engine process:
    the model id, context and tokenizer (loaded here from the engine directory) and the
    engine's metrics."""

    batched = False  # the app submits to the engine process, which batches

    def __init__(self, engine: EngineProcess):
        from pathlib import Path

        from metrale.runtime.artifact.tokenizer import Tokenizer

        self.engine = engine
        self.model_id, self.max_context = engine.info["model_id"], engine.info["max_context"]
        self.tokenizer = Tokenizer.from_dir(Path(engine.info["engine_dir"]) / "tokenizer")

    def metrics_text(self) -> str:
        return self.engine.metrics_text()

"""The model in a process of its own: `serve` answers HTTP in one process and runs the scheduler
and the models in another, as vLLM splits its API server from its engine core.

In one process the event loop's Python (parsing, tokenizing, responses) and the scheduler's
(the decode loops, between the package calls) take turns on one interpreter lock, and every
hand-off waits for the other to let go of it. Split, each has its own.

The engine process (`engine_main`) loads the generator with the caller's `load` (a picklable
callable: the CLI's loader), sets it up as `engine_setup` does (the prefix cache, its batched
steps over one thread fewer than torch's: `HTTP_CORES` stay with the HTTP process, the scheduler)
and runs the scheduler on its one Python thread, which between iterations reads the pipe
(`messages.ToEngine`: `Submit`, `Cancel`, `Stop`). What the jobs emit goes back once per
scheduler phase, every request's events of the phase in one `Outputs` (a fast stream's later
deltas at most once per `STREAM_FLUSH_S`), with a snapshot of the engine's counters where they
changed: whenever a request ended, at least every `STATS_INTERVAL_S` while messages flow, and
once more when the engine has been idle for `IDLE_STATS_S`. `/metrics` reads the latest
snapshot; it never asks.

The server's side (`EngineProcess`) is the engine face its app submits to, reading and writing
the pipe on the app's event loop (`attach`: an asyncio transport, so a send never blocks the loop
and the engine, which reads only between iterations, never waits on a server that is itself
waiting to send): `start` sends a request and routes its events to the request's channel,
`new_cancel` gives an event whose `set` cancels the request there too, `stats` is the latest
snapshot. The pipe is a socket pair framed by `pipe` (a 4-byte length, then MessagePack).

Neither side has a reader thread: a hand-off through one costs a wake-up of that thread, which
then waits for a core and for the interpreter lock its process's busy thread holds, where the
engine reading between iterations takes a request at the next one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Any, Callable

from metrale.runtime.serving.api_models import GenerationRequest
from metrale.runtime.serving.messages import (Cancel, Done, EngineInfo, Failure, FromEngine,
                                              LoadFailed, Outputs, Ready, Stop, Submit, Text,
                                              ToEngine)
from metrale.runtime.serving.pipe import Encoder, Frames, Pipe
from metrale.runtime.serving.scheduler import Job, Scheduler
from metrale.runtime.serving.stats import EngineStats, GeneratorStats, timed

log = logging.getLogger(__name__)

# Cores the batched steps leave to the HTTP process (parsing, tokenizing, responses), as vLLM's CPU
# backend reserves one for its API server: on a small machine the HTTP side is a large share of
# each short request's work, and two half-batch calls each stream every weight.
HTTP_CORES = 1
# A stream's later text deltas leave the engine at most this often; its first delta, and every
# request's end, leave at the end of the scheduler phase that made them. A phase (an iteration's
# steps) shorter than this is a stream faster than a token a millisecond: the tiny default
# decodes one alone every ~0.25 ms, and each message costs the HTTP process and the client a
# wake-up, an SSE event and a parse, on the cores the engine and every other request share.
STREAM_FLUSH_S = 0.001
# While requests run and none ends, the counters ride along at most this often; once the engine
# has had nothing to do for IDLE_STATS_S, they go once more (the last iteration's included), where
# sending them at once would cost the HTTP side a message while it answers the request that ended.
STATS_INTERVAL_S = 0.25
IDLE_STATS_S = 0.05
READY_TIMEOUT_S = 600.0  # loading (and building nothing): the engine says ready or why not


def freeze_heap() -> None:
    """Everything alive once loading is done (imported modules, the models, the packages'
    wrappers) out of the garbage collector's generations: a full collection otherwise walks
    those millions of objects again each time serving's allocations trigger one."""
    gc.collect()
    gc.freeze()


def engine_setup(gen, max_num_seqs: int, disable_at: int | None, prefix_cache_tokens: int,
                 flush: Callable[[], None] = lambda: None,
                 inbox: Callable[[bool], bool] | None = None,
                 http_cores: int = HTTP_CORES) -> tuple[Scheduler, EngineInfo]:
    """A loaded generator made ready to serve as the engine process runs it: its prefix cache
    (`prefix_cache_tokens` positions, 0: none), its batched steps on `http_cores` fewer threads
    (0: all), a scheduler over it that yields to no event loop (`flush`, `inbox`: see
    `Scheduler`), and the heap frozen. -> the scheduler and what was set up."""
    import torch

    cache = gen.cache_prefixes(prefix_cache_tokens) if prefix_cache_tokens else None
    lanes = gen.leave_cores(http_cores) if http_cores else None
    scheduler = Scheduler.for_generator(gen, max_num_seqs, disable_at, flush, yield_gil=False,
                                        inbox=inbox)
    engine = gen.engine
    info = EngineInfo(gen.model_id, gen.max_context, str(engine.path), engine.backend.name,
                      engine.backend_note, dict(engine.requantized), cache is not None, lanes,
                      torch.get_num_threads())
    freeze_heap()
    return scheduler, info


class _Outbox:
    """The engine side: events of the scheduler's jobs, sent together at each flush. A flush
    holding only later text deltas of streams waits until `STREAM_FLUSH_S` passed since the last
    message (the next phase's flush sends them, joined by the HTTP side); one holding a
    request's first delta or its end sends at once. The scheduler's thread, the process's one,
    is the only caller."""

    def __init__(self, pipe: Pipe, cancels: dict, stats: Callable[[], EngineStats]):
        self.pipe, self.cancels, self.stats = pipe, cancels, stats
        self.items: list[Text | Done | Failure] = []
        self.urgent = False  # an item that does not wait: a first delta, an end
        self.ended = False  # an item that ends a request: the counters go with it
        self.sent_at, self.clock = float("-inf"), time.monotonic
        self.stats_at = float("-inf")
        self.stats_sent: EngineStats | None = None

    def emitter(self, rid: str, stream: bool) -> Callable[[str, Any], None]:
        """The events of request `rid` (timed: `stats.timed`); a non-streamed one's text is held
        and sent joined with its final event (the server wakes once per answer)."""
        held: list[str] = []
        first = True

        def emit(kind: str, payload: Any) -> None:
            nonlocal first
            if kind == "text":
                if not stream:
                    held.append(payload)
                    return
                if first:  # its time to first token waits for nothing
                    self.urgent, first = True, False
                self.items.append(Text(rid, payload))
                return
            self.cancels.pop(rid, None)
            if held:
                self.items.append(Text(rid, "".join(held)))
            self.urgent = self.ended = True
            if kind == "done":
                self.items.append(Done(rid, payload))
            else:  # logged with its traceback by the job; its words travel
                self.items.append(Failure(rid, f"{type(payload).__name__}: {payload}"))

        return timed(emit, stream)

    def flush(self) -> None:
        if not self.items:
            return
        now = self.clock()
        if not self.urgent and now - self.sent_at < STREAM_FLUSH_S:
            return  # later deltas of fast streams: the next phase's flush sends them
        stats = None
        if self.ended or now - self.stats_at >= STATS_INTERVAL_S:
            stats = self._snapshot(now)
        items, self.items, self.urgent, self.ended, self.sent_at = self.items, [], False, False, now
        self.pipe.send(Outputs(items, stats))

    def idle(self) -> None:
        """The engine has nothing to run: its counters once more, if they moved since sent."""
        stats = self.stats()
        if stats != self.stats_sent:
            self.stats_sent, self.stats_at = stats, self.clock()
            self.pipe.send(Outputs([], stats))

    def _snapshot(self, now: float) -> EngineStats:
        self.stats_sent, self.stats_at = self.stats(), now
        return self.stats_sent


class _Inbox:
    """The engine side's pipe, read by its scheduler's loop before each iteration
    (`Scheduler.run`): every waiting message handled, blocking for the first only while nothing
    runs; False once the server said stop or went away.

    With nothing waiting mid-generation it yields the core (`os.sched_yield`): on a machine
    with more runnable threads than cores (the HTTP process, its clients, a stream's reader)
    the kernel otherwise lets this busy thread run out its time slice, a few milliseconds,
    before a thread woken on its core runs."""

    def __init__(self, pipe: Pipe, gen):
        self.pipe, self.gen = pipe, gen
        self.cancels: dict[str, threading.Event] = {}  # of the requests running or waiting
        self.outbox = _Outbox(pipe, self.cancels, self.stats)  # what the jobs emit goes back
        self.scheduler: Scheduler | None = None  # set once the scheduler reading it exists

    def stats(self) -> EngineStats:
        return EngineStats(self.gen.stats(), self.scheduler.stats())

    def __call__(self, wait: bool) -> bool:
        pipe = self.pipe
        if not wait and not pipe.ready():
            os.sched_yield()
            return True
        if wait and not pipe.ready(IDLE_STATS_S):
            self.outbox.idle()
        while True:
            msgs = pipe.receive()
            if msgs is None:
                return False
            for msg in msgs:
                if type(msg) is Submit:
                    self.cancels[msg.rid] = cancel = threading.Event()
                    emit = self.outbox.emitter(msg.rid, msg.request.stream)
                    self.scheduler.submit(Job(self.gen, msg.request, emit, cancel, msg.rid))
                elif type(msg) is Cancel:
                    cancel = self.cancels.pop(msg.rid, None)
                    if cancel is not None:
                        cancel.set()
                else:
                    return False  # Stop
            if not pipe.ready():
                return True


def engine_main(sock: socket.socket, load: Callable, max_num_seqs: int, disable_at: int | None,
                prefix_cache_tokens: int) -> None:
    """The engine process: load, say ready (or why not), then serve the pipe until it closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it stops the engine

    pipe = Pipe(sock, ToEngine)
    try:
        gen = load()
        inbox = _Inbox(pipe, gen)
        inbox.scheduler, info = engine_setup(gen, max_num_seqs, disable_at, prefix_cache_tokens,
                                             inbox.outbox.flush, inbox)
    except BaseException as e:  # noqa: BLE001 - the server reports it as the CLI would
        from metrale.runtime.errors import MetraleError

        pipe.send(LoadFailed(isinstance(e, MetraleError), f"{type(e).__name__}: {e}", str(e)))
        return
    pipe.send(Ready(info, inbox.stats()))
    inbox.scheduler.run()


class _FromEngine(asyncio.Protocol):
    """The HTTP side's end of the pipe on the event loop: whole messages out of the bytes as
    they arrive, handed to the `EngineProcess` together; the engine's exit (end of file) fails
    what waits for it."""

    def __init__(self, engine: EngineProcess):
        self.engine = engine

    def data_received(self, data: bytes) -> None:
        msgs = self.engine.frames.feed(data)
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
    it runs there. The app sets it once every request is over (`channels.events`); a request
    whose final event came back has nothing to cancel, and a message for it would cost a pipe
    write here and a read between the engine's iterations there."""

    def __init__(self, engine: EngineProcess, rid: str):
        super().__init__()
        self.engine, self.rid = engine, rid

    def set(self) -> None:
        if not self.is_set():
            super().set()
            if self.rid in self.engine.channels:  # its final event has not come back
                self.engine.send(Cancel(self.rid))


class EngineProcess:
    """The server's side of the engine process (see the module docstring). `info`: what the
    engine said once loaded (`messages.EngineInfo`)."""

    def __init__(self, load: Callable, max_num_seqs: int, disable_at: int | None,
                 prefix_cache_tokens: int):
        from metrale.runtime.errors import MetraleError

        self.dead: str | None = None
        self.closing = False
        self.send_lock = threading.Lock()  # sends down the socket itself (not attached)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport: asyncio.Transport | None = None  # the pipe on `loop`, once attached
        self._attached: asyncio.Future | None = None
        self._loop_thread = 0
        self.encoder, self.frames = Encoder(), Frames(FromEngine)
        ctx = multiprocessing.get_context("spawn")
        self.sock, child = socket.socketpair()
        self.proc = ctx.Process(target=engine_main, name="metrale-engine", daemon=True,
                                args=(child, load, max_num_seqs, disable_at, prefix_cache_tokens))
        self.proc.start()
        child.close()
        msg = self._first_message()
        if type(msg) is LoadFailed:
            self.close()  # a user's error is told as the CLI tells it
            raise MetraleError(msg.words) if msg.user_error else RuntimeError(msg.described)
        self.info: EngineInfo = msg.info
        self._stats: EngineStats = msg.stats
        self.flush: Callable[[], None] = lambda: None  # the app's wake-ups, after each message
        self.channels: dict[str, Callable[[str, Any], None]] = {}

    def _first_message(self) -> Ready | LoadFailed:
        from metrale.runtime.errors import MetraleError

        self.sock.settimeout(READY_TIMEOUT_S)
        msgs: list = []
        try:
            while not msgs:
                data = self.sock.recv(1 << 16)
                if not data:
                    self.proc.join(5)
                    raise MetraleError(f"the engine process exited while loading (exit code "
                                       f"{self.proc.exitcode})")
                msgs = self.frames.feed(data)
        except TimeoutError:
            self.close()
            raise MetraleError(f"the engine process did not load within {READY_TIMEOUT_S:.0f} s") from None
        finally:
            self.sock.settimeout(None)
        return msgs[0]

    async def attach(self) -> None:
        """Read and write the engine's pipe on the running loop (the app's: it attaches at each
        request, which costs nothing but on a loop's first): messages are handled as they
        arrive, and sends never block the loop (the transport buffers what the socket does not
        take, as the engine reads only between iterations), so neither side waits on the
        other."""
        loop = asyncio.get_running_loop()
        if loop is self.loop:
            await self._attached
            return
        if self.dead is not None or self.sock.fileno() < 0:
            return
        self.detach()
        self.loop, self._loop_thread, self._attached = loop, threading.get_ident(), loop.create_future()
        try:
            sock = socket.socket(fileno=os.dup(self.sock.fileno()))
            self.transport, _ = await loop.connect_accepted_socket(lambda: _FromEngine(self), sock)
        finally:
            self._attached.set_result(None)

    def detach(self) -> None:
        if self.transport is not None and self.loop is not None and not self.loop.is_closed():
            self.transport.close()
        self.loop = self.transport = None

    def send(self, msg: Submit | Cancel | Stop) -> None:
        """From the loop's thread: into the transport's buffer. From another thread: handed to
        the loop. Before attaching or once its loop is closed: down the socket itself."""
        if self.dead is not None:
            return
        frame = self.encoder.encode(msg)
        loop, transport = self.loop, self.transport
        if transport is not None and not loop.is_closed():
            if threading.get_ident() == self._loop_thread:
                transport.write(frame)
            else:
                loop.call_soon_threadsafe(transport.write, frame)
            return
        try:
            with self.send_lock:
                self.sock.setblocking(True)  # (the transport made the shared socket non-blocking)
                self.sock.sendall(frame)
        except OSError:  # the engine is gone
            pass

    # the app's engine face
    def start(self, req: GenerationRequest, emit: Callable[[str, Any], None], cancel, rid: str) -> None:
        """(On the event loop, where the engine's messages are handled.)"""
        if self.dead is not None:
            emit("error", RuntimeError(self.dead))
            self.flush()
            return
        self.channels[rid] = emit
        self.send(Submit(rid, req))

    def new_cancel(self, rid: str) -> threading.Event:
        return _RemoteCancel(self, rid)

    def stats(self) -> EngineStats:
        """The engine's counters as its last message carried them."""
        return self._stats

    def _handle(self, msgs: list) -> None:
        """The engine's messages that arrived together (on the loop), then the app's wake-ups
        once."""
        channels = self.channels
        for msg in msgs:
            if type(msg) is not Outputs:
                continue
            for event in msg.events:
                kind = type(event)
                if kind is Text:
                    emit = channels.get(event.rid)
                    if emit is not None:
                        emit("text", event.text)
                else:
                    emit = channels.pop(event.rid, None)
                    if emit is not None:
                        emit(*(("done", event.finished) if kind is Done
                               else ("error", RuntimeError(event.described))))
            if msg.stats is not None:
                self._stats = msg.stats
        self.flush()

    def _gone(self) -> None:
        """The engine exited: every request still waiting for it fails."""
        self.dead = "the engine process exited"  # (its exit code: `close` reaps it)
        orphans, self.channels = list(self.channels.values()), {}
        if not self.closing:
            log.error("%s", self.dead)
        for emit in orphans:
            emit("error", RuntimeError(self.dead))
        self.flush()

    def close(self) -> None:
        self.closing = True
        self.send(Stop())
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


class EngineProxy:
    """What the server's app reads of its generator when the model runs in the engine process:
    the model id, context and tokenizer (loaded here from the engine directory) and the
    engine's counters as its last message carried them."""

    def __init__(self, engine: EngineProcess):
        from pathlib import Path

        from metrale.runtime.artifact.tokenizer import Tokenizer

        self.engine = engine
        self.model_id, self.max_context = engine.info.model_id, engine.info.max_context
        self.tokenizer = Tokenizer.from_dir(Path(engine.info.engine_dir) / "tokenizer")

    def stats(self) -> GeneratorStats:
        return self.engine.stats().generator

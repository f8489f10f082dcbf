"""A request's events from where its generation runs to its handler on the event loop.

Contract: an engine face (`LocalEngine` here: a `Scheduler` on a thread of this process; or
`engine_process.EngineProcess`) `start`s a request with an `emit` callable: ("text", str)*, then
("done", `stats.Finished`) or ("error", exception). `events` gives them to the handler on the
event loop through a `Channel`, text coalesced, and ends the generation (its cancel event) when
the handler stops listening. `Wakes` batches the loop's wake-ups of many channels: one callback
per scheduler phase, not one per request and token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from metrale.runtime.serving.api_models import GenerationRequest
from metrale.runtime.serving.scheduler import Scheduler
from metrale.runtime.serving.stats import EngineStats, timed


class Channel:
    """A request's events from the scheduler's thread to the event loop, text coalesced: the
    worker appends under a lock and wakes the loop only when no wake-up is pending, and the
    loop takes everything that arrived by then as one text event. A fast stream therefore
    costs the loop one callback per turn, not one per token, and cannot queue a backlog of
    callbacks in front of other requests' work."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wakes: Wakes | None = None,
                 on_closed: Callable[[], None] = lambda: None, quiet: bool = False):
        self.loop, self.lock = loop, threading.Lock()
        self.wakes, self.on_closed = wakes, on_closed
        self.quiet = quiet  # a non-streamed answer: text waits for the final event's wake-up
        self.ready = asyncio.Event()
        self.text: list[str] = []
        self.final: tuple[str, Any] | None = None  # ("done", Finished) or ("error", exc)
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


class Wakes:
    """The event-loop wake-ups the scheduler's thread owes its channels, sent together after
    each phase of an iteration (`Scheduler` calls `flush`): one callback for every channel that
    got events, where one per channel costs a write to the loop's self-pipe each and wakes the
    loop once per request and token."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.due: list[Channel] = []

    def add(self, channel: Channel) -> None:
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
        by_loop: dict[int, list[Channel]] = {}
        for channel in due:
            by_loop.setdefault(id(channel.loop), []).append(channel)
        for channels in by_loop.values():
            try:
                channels[0].loop.call_soon_threadsafe(_set_ready, channels)
            except RuntimeError:  # the loop closed (server shutting down): nobody is listening
                for channel in channels:
                    channel.on_closed()


def _set_ready(channels: list[Channel]) -> None:
    for channel in channels:
        channel.ready.set()


class LocalEngine:
    """The engine face of a generator run here: a `Scheduler` on its own thread, its wake-ups
    through `wakes`; each request's emit timed as the engine process times it (`stats.timed`)."""

    def __init__(self, gen, max_num_seqs: int, disable_at: int | None, wakes: Wakes):
        self.gen = gen
        self.scheduler = Scheduler.for_generator(gen, max_num_seqs, disable_at, wakes.flush)

    def start(self, req: GenerationRequest, emit: Callable[[str, Any], None],
              cancel: threading.Event, rid: str) -> None:
        self.scheduler.start(self.gen, req, timed(emit, req.stream), cancel, rid)

    @staticmethod
    def new_cancel(rid: str) -> threading.Event:
        return threading.Event()

    def stats(self) -> EngineStats:
        return EngineStats(self.gen.stats(), self.scheduler.stats())


async def events(engine, req: GenerationRequest, cancel: threading.Event, rid: str,
                 wakes: Wakes | None = None) -> AsyncIterator[tuple[str, Any]]:
    """Run one generation on `engine` and yield its events on the event loop (text deltas as
    they arrive, joined when several did at once; for a non-streamed request all its text at
    once with its final event, so the loop wakes once per request, not once per token);
    setting `cancel` ends the generation at its next step."""
    channel = Channel(asyncio.get_running_loop(), wakes, cancel.set, quiet=not req.stream)
    engine.start(req, channel.emit, cancel, rid)
    try:
        while True:
            for kind, payload in await channel.take():
                yield kind, payload
                if kind != "text":
                    return
    finally:
        cancel.set()  # a client gone mid-stream ends the generation at its next token

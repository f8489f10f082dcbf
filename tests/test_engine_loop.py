"""The engine process's loop and pipe, run in this process: the scheduler yields the interpreter
only beside an event loop; the outbox holds a fast stream's later deltas to the flush interval;
a scheduler with an inbox reads it between iterations on the caller's thread, and the engine's
inbox yields its core when nothing waits; the pipe's frames are read whole however they arrive,
and every seed and draft cap the API takes crosses it."""

from __future__ import annotations

import pytest

from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig


@pytest.mark.parametrize("yield_gil", [True, False])
def test_the_scheduler_yields_between_iterations_only_beside_an_event_loop(tiny_engine, monkeypatch,
                                                                           yield_gil):
    """In-process (an event loop shares the interpreter) the scheduler's thread lets it in
    after every iteration; in the engine process it does not (each yield is a system call)."""
    import threading
    import time

    from metrale.runtime.serving import scheduler as sched
    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.spec.sampling import SamplingParams

    class Counting:  # the module's `time`, with its sleeps counted
        perf_counter = staticmethod(time.perf_counter)
        sleeps = 0

        @classmethod
        def sleep(cls, s):
            cls.sleeps += 1
            time.sleep(s)

    class Tokens:  # a generator of five tokens, one per iteration
        tokenizer = tiny_engine.tokenizer
        max_context = 64

        def stream(self, ids, params, counted=None):
            yield from [5, 6, 7, 8, 9]

    monkeypatch.setattr(sched, "time", Counting)
    done = threading.Event()
    s = sched.Scheduler(4, yield_gil=yield_gil)
    req = GenerationRequest([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), (), False, False)
    s.submit(sched.Job(Tokens(), req, lambda kind, _: kind == "done" and done.set(), threading.Event(), "r"))
    assert done.wait(30)
    assert (Counting.sleeps >= 5) if yield_gil else (Counting.sleeps == 0)


def _pipes():
    """Both ends of an engine pipe as blocking `Pipe`s: (the engine's, the server's)."""
    import socket

    from metrale.runtime.serving.messages import FromEngine, ToEngine
    from metrale.runtime.serving.pipe import Pipe

    a, b = socket.socketpair()
    return Pipe(a, ToEngine), Pipe(b, FromEngine)


def test_a_fast_streams_later_deltas_wait_for_the_flush_interval():
    """The engine's outbox sends a stream's first delta and every request's end at the flush
    that finds them; later deltas wait until `STREAM_FLUSH_S` passed since the last message, and
    then go in one message, in order, with whatever else was held. A message that ends a
    request carries the engine's counters; the others do not (within `STATS_INTERVAL_S`)."""
    import threading

    from metrale.runtime.serving import engine_process as ep
    from metrale.runtime.serving.messages import Done, Text
    from metrale.runtime.serving.stats import EngineStats, Finished

    clock = [100.0]
    here, there = _pipes()
    cancels = {"a": threading.Event(), "b": threading.Event()}
    snapshots = [0]

    def stats():
        snapshots[0] += 1
        return EngineStats()

    box = ep._Outbox(here, cancels, stats)
    box.clock = lambda: clock[0]
    a, b = box.emitter("a", stream=True), box.emitter("b", stream=False)
    got = []

    def sent():
        if not there.ready():
            return None
        msg = there.receive()[0]
        got.append(msg)
        return msg.events

    a("text", "x")
    box.flush()
    assert sent() == [Text("a", "x")]  # its first token waits for nothing
    assert got[-1].stats is not None  # the first message: the counters' first ride
    for later in ("y", "z"):
        clock[0] += ep.STREAM_FLUSH_S / 4
        a("text", later)
        box.flush()
        assert sent() is None  # held: the last message left under the interval ago
    b("text", "held ")
    b("text", "whole")
    box.flush()
    assert sent() is None  # a non-streamed answer's text waits for its end anyway
    clock[0] += ep.STREAM_FLUSH_S
    box.flush()
    assert sent() == [Text("a", "y"), Text("a", "z")] and got[-1].stats is None
    a("text", "w")
    box.flush()
    assert sent() is None
    b("done", ("stop", 2))  # an end goes at once, and takes the held deltas with it
    box.flush()
    assert sent() == [Text("a", "w"), Text("b", "held whole"), Done("b", Finished("stop", 2, []))]
    assert got[-1].stats is not None
    assert "b" not in cancels and "a" in cancels
    a("done", ("length", 4))
    box.flush()
    (done,) = sent()
    # a streamed request's end carries the gaps between its deltas: x, y, z, w made 3
    assert done.rid == "a" and done.finished.tokens == 4 and len(done.finished.gaps) == 3
    box.flush()
    assert sent() is None  # nothing left
    box.idle()
    assert sent() is None  # the counters did not move since the last message carried them


def test_a_scheduler_with_an_inbox_reads_it_between_iterations_on_the_callers_thread(tiny_engine):
    """The engine process has one thread: its scheduler's loop reads the pipe before each
    iteration, without blocking while something runs, blocking while nothing does, and returns
    once the inbox says stop."""
    import threading

    from metrale.runtime.serving import scheduler as sched
    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.spec.sampling import SamplingParams

    class Tokens:  # a generator of five tokens, one per iteration
        tokenizer = tiny_engine.tokenizer
        max_context = 64

        def stream(self, ids, params, counted=None):
            yield from [5, 6, 7, 8, 9]

    events, calls = [], []
    req = GenerationRequest([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), (), False, False)

    def inbox(wait: bool) -> bool:
        calls.append((wait, threading.get_ident(), len(events)))
        if len(calls) == 1:  # idle: the first message submits a request
            s.submit(sched.Job(Tokens(), req, lambda kind, payload: events.append(kind),
                               threading.Event(), "r"))
        return not (wait and "done" in events)  # idle again once it is over: stop

    threads = threading.active_count()
    s = sched.Scheduler(4, inbox=inbox, yield_gil=False)
    assert threading.active_count() == threads  # no thread of its own
    s.run()
    assert events == ["text", "done"] and {c[1] for c in calls} == {threading.get_ident()}
    waits = [c[0] for c in calls]
    # once before each of the five iterations (a token each), blocking only for the first (then
    # nothing ran) and once the request is over
    assert waits == [True] + [False] * 4 + [True]


def test_the_engines_inbox_handles_what_waits_and_yields_its_core_when_nothing_does(tiny_engine,
                                                                                     monkeypatch):
    import threading

    from metrale.runtime.serving import engine_process as ep
    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.serving.messages import Cancel, Stop, Submit
    from metrale.runtime.serving.stats import GeneratorStats, SchedulerStats
    from metrale.runtime.spec.sampling import SamplingParams

    class Gen:
        tokenizer = tiny_engine.tokenizer
        max_context = 64

        def stats(self):
            return GeneratorStats()

    class Sched:
        jobs: list = []
        iterations = 0

        def submit(self, job):
            self.jobs.append(job)

        def stats(self):
            return SchedulerStats(iterations=self.iterations)

    yields = []
    monkeypatch.setattr(ep.os, "sched_yield", lambda: yields.append(1))
    engine, server = _pipes()
    inbox = ep._Inbox(engine, Gen())
    inbox.scheduler = sched = Sched()
    assert inbox(False) and len(yields) == 1  # mid-generation, nothing waiting: the core yielded
    req = GenerationRequest([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), (), False, False)
    server.send(Submit("a", req))
    server.send(Submit("b", req))
    assert inbox(False) and len(yields) == 1  # both handled in one call
    assert [j.rid for j in sched.jobs] == ["a", "b"] and sched.jobs[0].req == req
    server.send(Cancel("a"))
    assert inbox(False) and sched.jobs[0].cancel.is_set() and "a" not in inbox.cancels
    sched.iterations = 7  # the engine ran: idle a moment, it sends its counters once
    stop = threading.Timer(5 * ep.IDLE_STATS_S, lambda: server.send(Stop()))
    stop.start()
    assert inbox(True) is False
    stop.join()
    (idle,) = server.receive()
    assert idle.events == [] and idle.stats.scheduler.iterations == 7
    server.sock.close()
    assert inbox(True) is False  # the server went away


def test_the_pipes_frames_are_read_whole_however_they_arrive():
    """The HTTP side reads the engine's frames (a 4-byte length, then MessagePack) whatever the
    split: a message cut anywhere waits for its rest, and messages that arrive together are
    handled together."""
    import random

    from metrale.runtime.serving.messages import FromEngine, Outputs, Text
    from metrale.runtime.serving.pipe import Encoder, Frames
    from metrale.runtime.serving.stats import EngineStats

    msgs = [Outputs([Text("a", "x" * n)]) for n in (0, 5, 20_000, 70_000)] + [Outputs([], EngineStats())]
    encoder = Encoder()
    stream = b"".join(encoder.encode(m) for m in msgs)
    assert stream[:4] == len(encoder.encode(msgs[0])[4:]).to_bytes(4, "big")  # the documented header
    rng = random.Random(0)
    for _ in range(20):
        frames, cut = Frames(FromEngine), sorted(rng.sample(range(1, len(stream)), 6))
        got = [frames.feed(stream[a:b]) for a, b in zip([0, *cut], [*cut, len(stream)])]
        assert [m for batch in got for m in batch] == msgs and frames.pending == 0


def test_any_seed_and_draft_cap_the_api_takes_crosses_the_pipe(tiny_engine):
    """The API takes any integer as a seed (modulo 2**64) or a draft cap; the request the
    engine process receives carries them within MessagePack's 64 bits, with the same meaning:
    the seed's generator and the cap's drafts are the ones the integer gives."""
    from metrale.runtime.serving.api_request import parse_request
    from metrale.runtime.serving.messages import Submit, ToEngine
    from metrale.runtime.serving.pipe import Encoder, Frames
    from metrale.runtime.spec.sampling import NO_CAP, generator_for

    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True))
    for seed, cap in ((2 ** 70 + 5, 10 ** 30), (-2 ** 80, 3), (7, None)):
        body = {"prompt": "x", "max_tokens": 2, "temperature": 0.5, "seed": seed,
                "speculative": {"max_drafts": cap}}
        req = parse_request(gen, body, chat=False)
        (got,) = Frames(ToEngine).feed(Encoder().encode(Submit("r", req)))
        params = got.request.params
        assert params.seed == seed % 2 ** 64
        assert generator_for(params).initial_seed() == seed % 2 ** 64  # the sampler's own seed
        assert params.draft_cap(9) == (8 if cap is None else min(8, cap))  # 9 tokens left: 8 drafts at most
        assert params.max_drafts == (None if cap is None else min(cap, NO_CAP))

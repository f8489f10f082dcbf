"""A request's events on their way to its handler (`serving.channels`): text coalesced, one
wake-up per scheduler phase, a non-streamed answer woken once; each request's emit timed
(`stats.timed`); and the text a job emits, decoded once at the end where nobody reads it sooner."""

import threading

from metrale.runtime.spec.sampling import SamplingParams


def test_text_events_are_coalesced_in_order():
    """Deltas that arrive while the event loop is busy come out as one text event, in order,
    then the final event; one wake-up per batch of deltas."""
    import asyncio

    from metrale.runtime.serving.channels import Channel

    async def main():
        loop = asyncio.get_running_loop()
        channel = Channel(loop)
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(1), real(*a))[1]
        worker = threading.Thread(target=lambda: [channel.emit("text", t) for t in ("a", "b", "c")])
        worker.start()
        worker.join()
        first = await channel.take()
        channel.emit("text", "d")
        channel.emit("done", ("stop", 4))
        second = await channel.take()
        return first, second, len(calls)

    first, second, wakes = asyncio.run(main())
    assert first == [("text", "abc")] and second == [("text", "d"), ("done", ("stop", 4))]
    assert wakes == 2


def test_wake_ups_are_sent_once_per_phase_for_every_channel():
    """Channels with a `Wakes` leave their wake-up to its `flush` (the scheduler's, after each
    phase): one callback wakes every channel that got events, each then takes its own text."""
    import asyncio

    from metrale.runtime.serving.channels import Channel, Wakes

    async def main():
        loop = asyncio.get_running_loop()
        wakes, calls = Wakes(), []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(1), real(*a))[1]
        a, b = Channel(loop, wakes), Channel(loop, wakes)
        worker = threading.Thread(target=lambda: [a.emit("text", "x"), b.emit("text", "y"),
                                                  a.emit("text", "z"), wakes.flush()])
        worker.start()
        worker.join()
        got = await asyncio.wait_for(asyncio.gather(a.take(), b.take()), 5)
        return got, len(calls)

    (first, second), wakes = asyncio.run(main())
    assert first == [("text", "xz")] and second == [("text", "y")]
    assert wakes == 1


def test_a_quiet_channel_wakes_once_with_all_its_text():
    """A non-streamed answer's channel keeps its text until the final event: one wake-up for
    the whole answer, whose text comes joined, in order, before the final event."""
    import asyncio

    from metrale.runtime.serving.channels import Channel

    async def main():
        loop = asyncio.get_running_loop()
        channel, calls = Channel(loop, quiet=True), []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(1), real(*a))[1]
        worker = threading.Thread(target=lambda: [channel.emit("text", t) for t in ("a", "b", "c")])
        worker.start()
        worker.join()
        assert calls == [] and not channel.ready.is_set()  # no wake-up for text alone
        channel.emit("done", ("length", 3))
        return await asyncio.wait_for(channel.take(), 5), len(calls)

    events, wakes = asyncio.run(main())
    assert events == [("text", "abc"), ("done", ("length", 3))] and wakes == 1


def test_a_timed_emit_ends_with_the_gaps_between_a_streamed_requests_texts():
    from metrale.runtime.serving.stats import Finished, timed

    clock = iter([1.0, 1.5, 1.75]).__next__
    got = []
    emit = timed(lambda kind, payload: got.append((kind, payload)), stream=True, clock=clock)
    for t in ("a", "b", "c"):
        emit("text", t)
    emit("done", ("stop", 3))
    assert got == [("text", "a"), ("text", "b"), ("text", "c"), ("done", Finished("stop", 3, [0.5, 0.25]))]
    quiet = []
    emit = timed(lambda kind, payload: quiet.append(payload), stream=False)
    emit("text", "a")
    emit("done", ("length", 2))
    assert quiet[-1] == Finished("length", 2, [])  # not streamed: no gaps


def test_a_request_neither_streamed_nor_stopped_is_decoded_once_at_its_end(tiny_engine):
    """Its ids are decoded when it ends, in one call, to the text the streamed deltas join to;
    a streamed request (or one with stop strings) is decoded as it goes (`decode_stream`)."""
    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.serving.scheduler import Job

    tok = tiny_engine.tokenizer
    ids = tok.encode("h\u00e9llo w\u00f6rld \U0001F600 and some more text")
    calls = [0]

    class Counting:
        eos_token_ids = frozenset()

        def decode(self, ids, skip_special=True):
            calls[0] += 1
            return tok.decode(ids, skip_special)

        def decode_stream(self, skip_special=True):
            return tok.decode_stream(skip_special)

    class Gen:
        tokenizer = Counting()
        max_context = 1 << 20

        def stream(self, prompt_ids, params, counted=None):
            yield from ids

    def run(stream: bool, stop: tuple[str, ...] = ()):
        events, calls[0] = [], 0
        req = GenerationRequest([1], SamplingParams(temperature=0, max_tokens=len(ids)), stop, stream, False)
        job = Job(Gen(), req, lambda kind, payload: events.append((kind, payload)), threading.Event(), "r")
        while job.advance():
            pass
        return events, calls[0]

    held, held_calls = run(stream=False)
    streamed, streamed_calls = run(stream=True)
    stopped, stopped_calls = run(stream=False, stop=("zzz",))
    assert [kind for kind, _ in held] == ["text", "done"] and held_calls == 1
    assert held[0][1] == tok.decode(ids) == "".join(p for k, p in streamed if k == "text")
    assert "".join(p for k, p in stopped if k == "text") == held[0][1]
    assert streamed_calls == stopped_calls == 0  # decoded as they go, by the decode stream
    assert held[-1] == streamed[-1] == stopped[-1] == ("done", ("length", len(ids), None))

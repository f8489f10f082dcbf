"""The model in its own process (`serving.engine_process`): the HTTP app submits to it over a
pipe and gets the answers the in-process decode loop gives, streamed or not; its metrics come
back; a request cancelled mid-stream frees its place; a load that fails says why; a dead engine
fails its requests instead of hanging them."""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from conftest import serve_in_thread, solo_answers
from metrale.runtime.errors import MetraleError
from metrale.runtime.serving.engine_process import EngineProcess, EngineProxy
from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.messages import Cancel
from metrale.runtime.serving.scheduler import SPECULATE_AFTER_S
from metrale.runtime.serving.server import create_app
from metrale.runtime.serving.service import EngineGenerator, load_generator
from metrale.runtime.spec.config import SpeculativeConfig

MTP = dict(speculative=True, num_drafts=3)


@pytest.fixture(scope="module")
def engine(aoti_engine_dir):
    spec = SpeculativeConfig.from_flags(**MTP)
    proc = EngineProcess(functools.partial(load_generator, aoti_engine_dir, spec, backend="aoti"),
                         max_num_seqs=16, disable_at=2, prefix_cache_tokens=4096)
    yield proc
    proc.close()
    assert not proc.proc.is_alive()


def test_answers_through_the_engine_process_equal_the_decode_loops(engine, aoti_engine_dir, tiny_prompts):
    from metrale.runtime.backends import load_engine

    assert engine.info.backend == "aoti" and engine.info.prefix_cache
    # its batched steps leave a core to the HTTP process
    assert engine.info.lanes == max(1, engine.info.threads - 1)
    local = EngineGenerator(load_engine(aoti_engine_dir, backend="aoti"), SpeculativeConfig.from_flags(**MTP))
    tok = local.tokenizer
    texts = [tok.decode(p[:12]) for p in tiny_prompts]
    solo = dict(enumerate(solo_answers(local, texts, 20)))
    proxy = EngineProxy(engine)
    assert proxy.model_id == local.model_id and proxy.max_context == local.max_context
    with serve_in_thread(create_app(proxy, ServerLimits(max_num_seqs=16), engine)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int, stream: bool = False) -> tuple[int, str]:
            r = client.completions.create(model=proxy.model_id, prompt=texts[i % len(texts)],
                                          max_tokens=20, temperature=0, stream=stream)
            return i % len(texts), "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(16))) + list(pool.map(lambda i: ask(i, True), range(8)))
        time.sleep(2 * SPECULATE_AFTER_S)  # alone again: the next request drafts
        answers.append(ask(0, stream=True))
        metrics = requests.get(base + "/metrics", timeout=10).text
    assert all(text == solo[i] for i, text in answers)
    assert "metrale_spec_decode" in metrics and "metrale_scheduler_peak_running" in metrics
    assert "metrale_prefix_cache_hits_total" in metrics and "metrale_scheduler_running 0" in metrics
    # /metrics is Prometheus text its own parser reads, with the histograms, their counts
    # plausible: every answer timed end to end, the 9 streamed ones to their first token and
    # between their tokens, and the steps of the request that drafted alone
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if not s.labels or s.labels == {"le": "+Inf"}}
    assert samples["metrale_server_e2e_request_latency_seconds_count"] == 25
    assert samples["metrale_server_time_to_first_token_seconds_count"] == 9
    assert 9 * 5 <= samples["metrale_server_inter_token_latency_seconds_count"] <= 9 * 19
    steps = samples["metrale_spec_decode_steps_total"]
    assert samples["metrale_spec_decode_drafts_per_step_count"] == steps > 0
    verifies = samples["metrale_spec_decode_acceptance_length_count"]
    assert 0 < verifies <= steps
    # each verify step emits 1 to 4 tokens (3 drafts + 1)
    assert verifies <= samples["metrale_spec_decode_acceptance_length_sum"] <= 4 * verifies
    assert samples["metrale_spec_decode_drafts_per_step_sum"] == samples["metrale_spec_decode_draft_tokens_verified_total"]


def test_schemas_compile_in_the_engine_while_its_loop_reads_the_pipe(engine, aoti_engine_dir, tiny_prompts):
    """Requests under a patterned schema, beside free ones, through the engine process: each
    waits on its grammar (`steps.Wait`) while the loop that reads the pipe runs the others, and
    every answer is the decode loop's alone."""
    import json

    import jsonschema

    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec.sampling import SamplingParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^(\\w{1,6} ?){1,3}$"}},
              "required": ["name"], "additionalProperties": False}
    local = EngineGenerator(load_engine(aoti_engine_dir, backend="aoti"), SpeculativeConfig.from_flags(**MTP))
    tok = local.tokenizer
    texts = [tok.decode(p[:12]) for p in tiny_prompts[:4]]
    want = {}
    for i, text in enumerate(texts):
        for constrained in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=24, json_schema=json.dumps(schema) if constrained else None)
            want[i, constrained] = tok.decode([t for t in local.generate(tok.encode(text), params).token_ids
                                               if t not in tok.eos_token_ids])
    proxy = EngineProxy(engine)
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    with serve_in_thread(create_app(proxy, ServerLimits(max_num_seqs=16), engine)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(job):
            i, constrained = job
            return job, client.completions.create(model=proxy.model_id, prompt=texts[i], max_tokens=24,
                                                  temperature=0, extra_body={"response_format": fmt} if constrained
                                                  else None).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, list(want)))
    for (i, constrained), text in answers:
        assert text == want[i, constrained], (i, constrained)
        if constrained:
            jsonschema.validate(json.loads(text), schema)


def test_a_cancelled_stream_frees_its_place_in_the_engine(engine):
    proxy = EngineProxy(engine)
    with serve_in_thread(create_app(proxy, ServerLimits(max_num_seqs=16), engine)) as base:
        with requests.post(base + "/v1/completions", stream=True, timeout=60,
                           json={"prompt": "def main(", "max_tokens": 900, "stream": True}) as r:
            assert next(r.iter_lines(), b"").startswith(b"data:")  # it runs; then the client goes
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model=proxy.model_id, prompt="import os", max_tokens=4,
                                         temperature=0).choices[0].text is not None
        import time

        for _ in range(100):  # the engine sees the cancel at its next step
            if "metrale_scheduler_running 0" in requests.get(base + "/metrics", timeout=10).text:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the cancelled stream still runs in the engine")


def test_a_finished_request_sends_no_cancel_and_a_running_one_does(engine, monkeypatch):
    """The app sets every request's cancel once it is over; only a request still running in the
    engine is worth a message (each costs a pipe write and a wake-up of the engine's reader)."""
    sent: list[tuple] = []
    real_send = engine.send
    monkeypatch.setattr(engine, "send", lambda msg: (sent.append(msg), real_send(msg))[1])
    proxy = EngineProxy(engine)
    with serve_in_thread(create_app(proxy, ServerLimits(max_num_seqs=16), engine)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            r = client.completions.create(model=proxy.model_id, prompt="import os", max_tokens=4,
                                          temperature=0, stream=stream)
            list(r) if stream else r.choices[0].text
        assert [type(m).__name__ for m in sent] == ["Submit", "Submit"]
        cancel = engine.new_cancel("still-running")
        engine.channels["still-running"] = lambda kind, payload: None  # as `start` registers it
        try:
            cancel.set()
            cancel.set()  # once
        finally:
            engine.channels.pop("still-running", None)
    assert sent[2:] == [Cancel("still-running")]


def test_a_load_that_fails_says_why(tmp_path):
    with pytest.raises(MetraleError, match=str(tmp_path)):
        EngineProcess(functools.partial(load_generator, tmp_path, SpeculativeConfig.from_flags()),
                      max_num_seqs=4, disable_at=2, prefix_cache_tokens=0)


def test_requests_fail_once_the_engine_is_gone(aoti_engine_dir):
    proc = EngineProcess(functools.partial(load_generator, aoti_engine_dir, SpeculativeConfig.from_flags(),
                                           backend="aoti"), max_num_seqs=4, disable_at=2, prefix_cache_tokens=0)
    proxy = EngineProxy(proc)
    proc.proc.kill()
    proc.proc.join(10)
    with serve_in_thread(create_app(proxy, ServerLimits(), proc)) as base:
        r = requests.post(base + "/v1/completions", timeout=30, json={"prompt": "import os", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert requests.get(base + "/health", timeout=5).ok
    proc.close()


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error(aoti_engine_dir):
    """The engine's exit, read on the event loop mid-stream: the running stream ends with an
    error event, the next request gets a 500 at once, and the server stays up."""
    import json
    import os
    import signal
    import time

    proc = EngineProcess(functools.partial(load_generator, aoti_engine_dir, SpeculativeConfig.from_flags(),
                                           backend="aoti"), max_num_seqs=4, disable_at=2, prefix_cache_tokens=0)
    proxy = EngineProxy(proc)
    try:
        with serve_in_thread(create_app(proxy, ServerLimits(), proc)) as base:
            for _ in range(10):
                with requests.post(base + "/v1/completions", stream=True, timeout=60,
                                   json={"prompt": "def main(", "max_tokens": 1000, "stream": True}) as r:
                    lines = r.iter_lines()
                    assert next(lines).startswith(b"data:")  # it runs: the engine stops there
                    os.kill(proc.proc.pid, signal.SIGSTOP)
                    time.sleep(0.3)  # what it sent before stopping reaches the server
                    if not proc.channels:  # it had finished already: again
                        os.kill(proc.proc.pid, signal.SIGCONT)
                        continue
                    proc.proc.kill()  # mid-stream
                    events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
                    break
            assert events and events[-1]["error"]["type"] == "server_error"
            r = requests.post(base + "/v1/completions", timeout=30, json={"prompt": "import os", "max_tokens": 4})
            assert r.status_code == 500 and "request id" in r.json()["error"]["message"]
            assert requests.get(base + "/health", timeout=5).ok
    finally:
        proc.close()


def test_freeze_heap_moves_what_is_alive_out_of_the_collectors_generations():
    import gc

    from metrale.runtime.serving.engine_process import freeze_heap

    kept = [object() for _ in range(1000)]
    try:
        freeze_heap()
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
        assert all(gc.get_count()[g] < 100 for g in (1, 2))
    finally:
        gc.unfreeze()


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


def test_a_send_on_the_loop_never_waits_for_the_engine(engine):
    """A message far larger than the pipe holds, sent from the event loop, returns with the rest
    in the transport's buffer (the engine reads only between iterations); the engine then reads
    it whole, and the pipe stays in step: a request after it is answered."""
    import asyncio

    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.serving.messages import Cancel
    from metrale.runtime.spec.sampling import SamplingParams

    async def main():
        await engine.attach()
        engine.send(Cancel("no-such-request-" + "x" * (8 << 20)))
        assert engine.transport.get_write_buffer_size() > 0  # not written through: held
        for _ in range(600):
            if engine.transport.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.05)
        done = asyncio.get_running_loop().create_future()
        req = GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_tokens=3), (), False, False)
        engine.start(req, lambda kind, payload: kind != "text" and done.set_result((kind, payload)),
                     engine.new_cancel("after"), "after")
        return await asyncio.wait_for(done, 60)

    try:
        kind, finished = asyncio.run(main())
        assert kind == "done" and finished.tokens >= 1
    finally:
        engine.detach()

"""The model in its own process (`serving.engine_process`): the HTTP app submits to it over a
pipe and gets the answers the in-process decode loop gives, streamed or not, under a schema or
not; its metrics come back; a request cancelled mid-stream frees its place; a load that fails says why; a dead engine
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


"""Per-request speculation control and per-request drafts in `usage`, through HTTP with the
official openai client: a request's `speculative` object is checked like every field, requests
carrying different settings run batched together, and each answer (greedy, and sampled with a
seed) equals what a server started with the equivalent flags gives; `usage` counts the
request's own drafts, as the decode loop recorded them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI

from metrale.runtime.serving.api_answers import Usage
from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.server import create_app
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.serving.stats import Drafts
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.sampling import SamplingError, SamplingParams

from conftest import serve_in_thread

# per server mode: the request's `speculative` object -> the flags of a server that answers the same
EQUIVALENT = {
    "mtp": (dict(speculative=True, num_drafts=3), [
        ({"enabled": False}, {}),
        ({"max_drafts": 0}, {}),
        ({"max_drafts": 1}, dict(speculative=True, num_drafts=1)),
        ({"max_drafts": 9}, dict(speculative=True, num_drafts=3)),
        ({"enabled": True}, dict(speculative=True, num_drafts=3)),
    ]),
    "dflash": (dict(dflash=True), [
        ({"enabled": False}, {}),
        ({"max_drafts": 2}, dict(dflash=True, dflash_draft_ladder="2")),
        ({"max_drafts": 5}, dict(dflash=True, dflash_draft_ladder="5")),
        ({}, dict(dflash=True)),
    ]),
}


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_sampling_params_check_the_controls():
    assert SamplingParams(max_drafts=0).drafts is False and SamplingParams(speculate=False).drafts is False
    assert SamplingParams(max_drafts=2).draft_cap(10) == 2 and SamplingParams(max_drafts=9).draft_cap(4) == 3
    assert SamplingParams().draft_cap(4) == 3
    for field, value in (("max_drafts", -1), ("max_drafts", 1.0), ("max_drafts", True), ("speculate", 1)):
        with pytest.raises(SamplingError, match=field):
            SamplingParams(**{field: value})


def test_the_speculative_object_is_checked_like_every_field(tiny_engine):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True))
    with serve_in_thread(create_app(gen, ServerLimits())) as base:
        def refused(speculative) -> dict:
            r = requests.post(base + "/v1/completions", timeout=30, json={
                "prompt": "def main(", "max_tokens": 4, "speculative": speculative})
            assert r.status_code == 400, r.text
            return r.json()["error"]

        e = refused({"enabled": "no"})
        assert e["param"] == "speculative" and "`speculative.enabled` must be a boolean, got 'no'" in e["message"]
        e = refused({"max_drafts": -1})
        assert "`speculative.max_drafts` must be an integer of at least 0" in e["message"] and "got -1" in e["message"]
        e = refused({"max_drafts": 2.5})
        assert "`speculative.max_drafts`" in e["message"] and "got 2.5" in e["message"]
        e = refused({"draft_count": 3})
        assert "`speculative.draft_count` is not a field of `speculative`" in e["message"]
        assert "`enabled`" in e["message"] and "`max_drafts`" in e["message"]
        e = refused(True)
        assert "`speculative` must be an object with `enabled`" in e["message"] and "got True" in e["message"]
        ok = requests.post(base + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "speculative": {"enabled": True, "max_drafts": 3}})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("mode", list(EQUIVALENT))
def test_each_request_gets_the_answer_of_a_server_with_its_flags(tiny_engine, tiny_prompts, mode):
    flags, cases = EQUIVALENT[mode]
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**flags))
    tok = tiny_engine.tokenizer
    texts = [tok.decode(p[:12]) for p in tiny_prompts[:3]]
    sampled = dict(temperature=0.8, top_p=0.95, seed=7)
    jobs = [(c, t, s) for c in range(len(cases)) for t in range(len(texts)) for s in (False, True)]
    want = {}
    for c, (_, equivalent) in enumerate(cases):  # each alone, on a generator with the flags
        alone = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**equivalent))
        for t, text in enumerate(texts):
            for s in (False, True):
                params = SamplingParams(max_tokens=20, **(sampled if s else dict(temperature=0.0)))
                res = alone.generate(tok.encode(text), params)
                ids = [i for i in res.token_ids if i not in tok.eos_token_ids]
                want[c, t, s] = (tok.decode(ids), Drafts.of(res.metrics))
    # speculation stays on however many run, so each request drafts as it would alone
    limits = ServerLimits(max_num_seqs=8, speculative_disable_by_batch_size=None)
    with serve_in_thread(create_app(gen, limits)) as base:
        client = _client(base)

        def ask(job):
            c, t, s = job
            extra = {"speculative": cases[c][0]} if cases[c][0] else None
            r = client.completions.create(model=gen.model_id, prompt=texts[t], max_tokens=20,
                                          extra_body=extra, **(sampled if s else dict(temperature=0)))
            return job, r

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, jobs))
    for job, r in answers:
        text, drafts = want[job]
        assert r.choices[0].text == text, (mode, cases[job[0]][0], job)
        # the drafts it reports are the ones its decode loop made, verified and accepted
        spec, details = r.usage.model_extra["speculative"], r.usage.completion_tokens_details
        assert spec == {"drafts_proposed": drafts.proposed, "drafts_verified": drafts.verified,
                        "drafts_accepted": drafts.accepted}, (mode, cases[job[0]][0], job)
        assert details.accepted_prediction_tokens == drafts.accepted
        assert details.rejected_prediction_tokens == drafts.verified - drafts.accepted
    capped = [r for (c, _, _), r in answers if cases[c][0].get("max_drafts", 1) == 0
              or cases[c][0].get("enabled") is False]
    assert capped and all(r.usage.model_extra["speculative"]["drafts_verified"] == 0 for r in capped)
    drafting = [r.usage.model_extra["speculative"]["drafts_accepted"] for (c, _, _), r in answers
                if not cases[c][0] or cases[c][0].get("max_drafts", 0) > 1]
    assert sum(drafting) > 0


def test_usage_counts_drafts_only_where_the_server_speculates(tiny_engine):
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    with serve_in_thread(create_app(plain, ServerLimits())) as base:
        r = requests.post(base + "/v1/completions", timeout=30,
                          json={"prompt": "def main(", "max_tokens": 8, "temperature": 0}).json()
        streamed = requests.post(base + "/v1/completions", timeout=30, stream=True, json={
            "prompt": "def main(", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}).text
    assert set(r["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert '"speculative"' not in streamed and '"completion_tokens":8' in streamed
    mtp = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(speculative=True, num_drafts=3))
    with serve_in_thread(create_app(mtp, ServerLimits())) as base:
        events = requests.post(base + "/v1/chat/completions", timeout=30, stream=True, json={
            "messages": [{"role": "user", "content": "import os"}], "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}).text
    last = [line for line in events.splitlines() if '"usage"' in line][-1]
    got = json.loads(last.removeprefix("data: "))["usage"]
    assert Usage.model_validate(got).speculative is not None
    assert got["speculative"]["drafts_verified"] >= got["speculative"]["drafts_accepted"] >= 0
    assert got["completion_tokens_details"]["accepted_prediction_tokens"] == got["speculative"]["drafts_accepted"]
    # a request that ends at the prefill's token made no drafts, and says so in the same shape
    with serve_in_thread(create_app(mtp, ServerLimits())) as base:
        one = requests.post(base + "/v1/completions", timeout=30,
                            json={"prompt": "def main(", "max_tokens": 1, "temperature": 0}).json()["usage"]
    assert one["completion_tokens"] == 1
    assert one["speculative"] == {"drafts_proposed": 0, "drafts_verified": 0, "drafts_accepted": 0}
    assert one["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}


def test_graph_lanes_serve_requests_that_control_speculation(tiny_engine_dir, tiny_engine, tiny_prompts):
    """On a target whose iterations run as graphs in lanes (the capture stand-in), a request that
    turns speculation off or caps it below the lanes' count accepts no drafts, or at most its
    cap, in its own lane, batched with the others: every greedy answer is plain decoding's."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True))
    assert gen.capabilities.max_running is not None  # lanes
    tok = tiny_engine.tokenizer
    bodies = [{}, {"speculative": {"enabled": False}}, {"speculative": {"max_drafts": 2}}]
    texts = [tok.decode(p[:12]) for p in tiny_prompts[:2]]
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    want = {}
    for t, text in enumerate(texts):
        ids = plain.generate(tok.encode(text), SamplingParams(temperature=0.0, max_tokens=16)).token_ids
        want[t] = tok.decode([i for i in ids if i not in tok.eos_token_ids])
    # batches keep drafting (None), so the requests' caps are what limits their drafts
    limits = ServerLimits(max_num_seqs=8, speculative_disable_by_batch_size=None)
    with serve_in_thread(create_app(gen, limits)) as base:
        client = _client(base)

        def ask(job):
            t, b = job
            r = client.completions.create(model=gen.model_id, prompt=texts[t], max_tokens=16, temperature=0,
                                          extra_body=bodies[b] or None)
            return job, r

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, [(t, b) for t in range(len(texts)) for b in range(len(bodies))] * 2))
    for (t, b), r in answers:
        assert r.choices[0].text == want[t], (t, bodies[b])
        spec = r.usage.model_extra["speculative"]
        if b == 1:  # speculation off: no draft verified for it
            assert spec["drafts_verified"] == 0
        else:  # its drafts, at most 2 an iteration where capped
            assert spec["drafts_verified"] >= spec["drafts_accepted"] > 0, (t, b, spec)
            if b == 2:
                assert spec["drafts_verified"] <= 2 * r.usage.completion_tokens


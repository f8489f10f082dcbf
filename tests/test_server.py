"""Tests for metrale.runtime.serving.server over real HTTP: uvicorn on a free port, the official openai
client, raw `requests` for malformed input.

The served model is a real 3-gram model over the trained test tokenizer: the next token is the
one that followed the last three tokens in a fixed corpus (EOS when that context never occurred),
so every expected output below follows from the corpus.
"""

import json
import threading
import time

import pytest
import requests
from conftest import serve_in_thread
from openai import OpenAI
from pydoc_data.topics import topics

from metrale.runtime.serving.scheduler import STREAM_ONLY, StopScanner
from metrale.runtime.serving.stats import GeneratorStats
from metrale.runtime.serving.server import create_app
from metrale.runtime.artifact.tokenizer import train_bpe_tokenizer

CORPUS = (
    "Once upon a time, the quick brown fox jumps over the lazy dog.<|im_end|>"
    "<|im_start|>assistant\nHello there, café 日本 🎉 friend!<|im_end|>"
)
MODEL = "tiny-trigram"
CONTEXT = 256
ONCE = "Once upon a time,"
ONCE_REPLY = " the quick brown fox jumps over the lazy dog."
CHAT = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
CHAT_REPLY = "Hello there, café 日本 🎉 friend!"


class TrigramGenerator:
    """A TextGenerator: next token = the corpus's successor of the last 3 tokens, else EOS.
    Prompts containing `explode` fail at once, `explode later` after two tokens; `slow` sleeps
    between tokens and never ends (to test disconnects); `gated` waits for `gate` first."""

    model_id = MODEL
    max_context = CONTEXT
    capabilities = STREAM_ONLY

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        ids = tokenizer.encode(CORPUS)
        self.table = {tuple(ids[i - 3 : i]): ids[i] for i in range(3, len(ids))}
        self.eos = tokenizer.token_id("<|endoftext|>")
        self.calls = 0
        self.closed = threading.Event()
        self.gate = threading.Event()

    def next_token(self, context):
        return self.table.get(tuple(context[-3:]), self.eos)

    def stream(self, prompt_ids, params, counted=None):
        self.calls += 1
        text = self.tokenizer.decode(prompt_ids)
        if "explode" in text and "later" not in text:
            raise RuntimeError("kaboom")
        if "gated" in text:
            self.gate.wait(5)
        context = list(prompt_ids)
        try:
            for i in range(params.max_tokens):
                if "explode later" in text and i == 2:
                    raise RuntimeError("kaboom later")
                if "slow" in text:
                    time.sleep(0.01)
                if "slow" in text or "explode later" in text:
                    token = context[-1]  # repeat: never reaches EOS
                else:
                    token = self.next_token(context)
                context.append(token)
                yield token
                if token in self.tokenizer.eos_token_ids:
                    return
        finally:
            self.closed.set()

    def stats(self):
        return GeneratorStats(requests=self.calls)


def reference(gen, prompt_ids, max_tokens):
    """The generator's output, computed without the server: (text, n_tokens, finish)."""
    context, out = list(prompt_ids), []
    while len(out) < max_tokens:
        out.append(gen.next_token(context))
        context.append(out[-1])
        if out[-1] in gen.tokenizer.eos_token_ids:
            return gen.tokenizer.decode(out), len(out), "stop"
    return gen.tokenizer.decode(out), len(out), "length"


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    tok = train_bpe_tokenizer(
        [topics[k] for k in sorted(topics)[:10]], 512, tmp_path_factory.mktemp("tok")
    )
    return TrigramGenerator(tok)


@pytest.fixture(scope="module")
def base(gen):
    with serve_in_thread(create_app(gen)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=10)


def test_reference_model_is_what_the_tests_assume(gen):
    tok = gen.tokenizer
    assert reference(gen, tok.encode(ONCE), 64) == (ONCE_REPLY, 32, "stop")
    prompt = tok.encode(tok.apply_chat_template(CHAT))
    assert reference(gen, prompt, 64)[0] == CHAT_REPLY


def test_health_and_models(base, client):
    assert requests.get(base + "/health", timeout=5).json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "metrale"


def test_completion(gen, client):
    r = client.completions.create(model=MODEL, prompt=ONCE, max_tokens=64)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == ONCE_REPLY
    assert r.choices[0].finish_reason == "stop"  # the model emitted <|im_end|>
    n_prompt = len(gen.tokenizer.encode(ONCE))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 32)
    assert r.usage.total_tokens == n_prompt + 32


def test_completion_list_of_one_prompt_and_token_ids(gen, client):
    by_list = client.completions.create(model=MODEL, prompt=[ONCE], max_tokens=64)
    by_ids = client.completions.create(model=MODEL, prompt=gen.tokenizer.encode(ONCE))
    assert by_list.choices[0].text == by_ids.choices[0].text == ONCE_REPLY


def test_max_tokens_gives_length(gen, client):
    r = client.completions.create(model=MODEL, prompt=ONCE, max_tokens=5)
    text, n, finish = reference(gen, gen.tokenizer.encode(ONCE), 5)
    assert (n, finish) == (5, "length")
    assert r.choices[0].text == text and ONCE_REPLY.startswith(text) and len(text) > 0
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_chat_completion(gen, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == CHAT_REPLY
    assert r.choices[0].finish_reason == "stop"
    prompt = gen.tokenizer.encode(gen.tokenizer.apply_chat_template(CHAT))
    assert r.usage.prompt_tokens == len(prompt)


def test_streaming_completion_matches_non_streaming(client):
    plain = client.completions.create(model=MODEL, prompt=ONCE, max_tokens=64)
    chunks = list(client.completions.create(model=MODEL, prompt=ONCE, max_tokens=64, stream=True))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert len(chunks) > 3  # really streamed, not one blob
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streaming_chat_matches_non_streaming_with_usage(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    # Multi-byte characters arrive whole: no delta holds a replacement character.
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == plain.choices[0].message.content == CHAT_REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens


@pytest.mark.parametrize(
    "stop, expected",
    [
        (" fox", " the quick brown"),
        (["zzz", "ick bro"], " the qu"),  # spans several tokens
        ([" lazy", " the"], ""),  # the earliest match wins, even at the very start
        ("lazy dog.!", ONCE_REPLY),  # never matches: full text, EOS ends it
    ],
)
def test_stop_strings(client, stop, expected):
    r = client.completions.create(model=MODEL, prompt=ONCE, stop=stop, max_tokens=64)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=ONCE, stop=stop, max_tokens=64, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_stop_string_ends_generation_early(gen, client):
    r = client.completions.create(model=MODEL, prompt=ONCE, stop=" fox", max_tokens=64)
    # " the quick brown fox" is 12 tokens (" the", " ", "q", "u", "i", "c", "k", " b", "ro", "w",
    # "n", " f", ...): generation stops at the token completing " fox", far before 32.
    assert r.usage.completion_tokens < 32


def test_stop_scanner_holds_back_possible_prefixes():
    s = StopScanner(["abc", "bd"])
    assert s.push("xa") == ("x", False)  # "a" may begin "abc"
    assert s.push("b") == ("", False)  # "ab" may begin "abc", "b" may begin "bd"
    assert s.push("x") == ("abx", False)
    assert s.push("ab") == ("", False)
    assert s.push("d") == ("a", True)  # "bd" matched: cut before it
    assert StopScanner([]).push("abc") == ("abc", False)


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1, "max_tokens": 3}', 400, "max_tokens",
         "repeats the key 'max_tokens'"),
        ("/v1/completions", b'{"prompt": "x", "speculative": {"enabled": true, "enabled": false}}', 400,
         "speculative", "repeats the key 'enabled'"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a", "role": "system"}]}', 400,
         "messages", "repeats the key 'role'"),
        ("/v1/completions", b'{"x": {"y": {"z": 1, "z": 2}}, "w": {"q": 1, "q": 2}, "prompt": "a"}', 400,
         "x", "repeats the key 'z'"),  # the first repeat in the document's order
        ("/v1/completions", {"model": MODEL}, 400, "prompt", "`prompt` is required"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "`n` must be 1"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", ">= 0"),
        ("/v1/completions", {"prompt": "x", "temperature": 5e-324}, 400, "temperature", "at least"),
        ("/v1/completions", {"prompt": "x", "temperature": 10 ** 400}, 400, "temperature", "finite"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
         "holds a number of more than 4300 digits"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None, "too deeply"),
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, None, "lone surrogate"),
        ("/v1/completions", b'{"prompt": "\xff"}', 400, None, "not UTF-8"),
        ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop", "at most 16"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "an integer"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", "an integer"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed", "seed"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "exactly one string"),
        ("/v1/completions", {"prompt": [1, 999]}, 400, "prompt", "[0, 512)"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "encodes to no tokens"),
        ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop", "list of strings"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "a boolean"),
        ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "not supported"),
        ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens", "leaving 255"),
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": CONTEXT}, 400, "max_completion_tokens",
         "but max_completion_tokens is"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 7, "max_completion_tokens": 2}, 400,
         "max_completion_tokens", "`max_tokens` 7 and `max_completion_tokens` 2 disagree"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages",
         "must be one of system, developer, user, assistant, got 'wizard'"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages",
         "tool calls are not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
         400, "functions", "not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prediction": {
            "type": "content", "content": "x"}}, 400, "prediction", "not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]},
         400, "modalities", "not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"},
         400, "reasoning_effort", "not supported"),
        ("/v1/completions", b'{"prompt": "x", "seed": -' + b"9" * 5000 + b"}", 400, None,
         "holds a number of more than 4300 digits"),
        ("/v1/completions", {"prompt": "x " * CONTEXT}, 400, "prompt", "leaving none for completion"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5 * CONTEXT},
         400, "max_completion_tokens", f"but max_completion_tokens is {5 * CONTEXT}"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model", "'gpt-9' does not"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
         "only allowed when `stream` is true"),
        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
         "stream_options", "`include_usage` must be a boolean, got 'yes'"),
        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, 400,
         "stream_options", "has no key 'bogus'"),
        ("/v1/completions", {"prompt": "x", "top_k": 5}, 400, "top_k", "not supported by this server, got 5"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [1]}, 400, "stop_token_ids", "not supported"),
        ("/v1/completions", {"prompt": "x", "best_of": True}, 400, "best_of", "not supported"),
        ("/v1/completions", {"prompt": "x", "echo": 0}, 400, "echo", "not supported"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json",
         "structured output is asked with `response_format`"),
        ("/v1/completions", {"prompt": "x", "bad_words": ["a"]}, 400, "bad_words", "not supported"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list of messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages", "`role`"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ],
)
def test_malformed_requests_get_openai_errors(base, path, body, status, param, words):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = requests.post(base + path, data=data, timeout=5,
                         headers={"Content-Type": "application/json"})
    err = error_of(resp, status)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]
    assert requests.get(base + "/health", timeout=5).json() == {"status": "ok"}


def test_unsupported_fields_pass_when_neutral(base):
    """OpenAI's fields and vLLM's extensions this server does not implement pass at the value
    that changes nothing (a number as an int or a float, a boolean only as a boolean), and the
    answer is the one without them."""
    plain = requests.post(base + "/v1/completions", timeout=30,
                          json={"prompt": "the", "max_tokens": 3, "temperature": 0}).json()
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0, "best_of": 1, "echo": False, "top_k": -1,
               "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False,
               "stop_token_ids": [], "logprobs": None, "functions": [], "function_call": "none",
               "parallel_tool_calls": True, "modalities": ["text"], "prediction": None}
    got = requests.post(base + "/v1/completions", timeout=30,
                        json={"prompt": "the", "max_tokens": 3, "temperature": 0, **neutral})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    streamed = requests.post(base + "/v1/completions", timeout=30, json={
        "prompt": "the", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"usage"' in streamed.text


def test_unknown_route_gets_error_shape(base):
    err = error_of(requests.get(base + "/v1/nope", timeout=5), 404)
    assert err["code"] == "not_found"


def test_generation_paths_answer_other_methods_with_405(base):
    """Another method on a generation path: 405 in OpenAI's error shape, naming POST; the POST
    answer's request id is its id."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = requests.get(base + path, timeout=5)
        err = error_of(resp, 405)
        assert "not allowed" in err["message"].lower() and "POST" in resp.headers["allow"]
    answer = requests.post(base + "/v1/completions", json={"prompt": "the", "max_tokens": 2},
                           timeout=5)
    assert answer.status_code == 200 and answer.headers["X-Request-Id"] == answer.json()["id"]


def test_generator_exception_is_a_500_not_a_crash(base, caplog):
    for stream in (False, True):
        resp = requests.post(base + "/v1/completions", timeout=5,
                             json={"prompt": "please explode", "stream": stream})
        err = error_of(resp, 500)
        rid = resp.headers["X-Request-Id"]
        # the body names the request id, never the exception; the log has both
        assert err["type"] == "server_error" and rid in err["message"]
        assert "kaboom" not in resp.text and "RuntimeError" not in resp.text
        assert any(rid in r.getMessage() and r.exc_info and "kaboom" in str(r.exc_info[1])
                   for r in caplog.records)
    resp = requests.post(base + "/v1/completions", timeout=5,
                         json={"prompt": "explode later"})
    assert "request id" in error_of(resp, 500)["message"] and "kaboom" not in resp.text
    # Once a stream has started, the failure arrives as a final error event.
    resp = requests.post(base + "/v1/completions", timeout=5,
                         json={"prompt": "explode later", "stream": True})
    assert resp.status_code == 200
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    message = json.loads(events[-2])["error"]["message"]
    assert resp.headers["X-Request-Id"] in message and "kaboom" not in resp.text
    assert requests.get(base + "/health", timeout=5).json() == {"status": "ok"}


def test_event_loop_stays_free_during_generation(gen, base, client):
    gen.gate.clear()
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        r=client.completions.create(model=MODEL, prompt="gated " + ONCE, max_tokens=3)))
    worker.start()
    try:
        time.sleep(0.1)
        assert worker.is_alive()  # the generation is blocked inside the generator...
        t0 = time.monotonic()  # ...and the server still answers
        assert requests.get(base + "/health", timeout=2).status_code == 200
        assert requests.get(base + "/metrics", timeout=2).status_code == 200
        assert time.monotonic() - t0 < 1.0
    finally:
        gen.gate.set()
    worker.join(5)
    expected = reference(gen, gen.tokenizer.encode("gated " + ONCE), 3)[0]
    assert result["r"].choices[0].text == expected


def test_client_disconnect_stops_generation(gen, base):
    gen.closed.clear()
    with requests.post(base + "/v1/completions", stream=True, timeout=5,
                       json={"prompt": "slow", "max_tokens": 200, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith(b"data: ")
    # 200 tokens at 10 ms would take 2 s; the disconnect ends it at the next token.
    assert gen.closed.wait(1.5)
    r = requests.post(base + "/v1/completions", json={"prompt": ONCE}, timeout=5)
    assert r.json()["choices"][0]["text"] == ONCE_REPLY  # the lock was released


def scrape(base) -> dict:
    """/metrics as Prometheus' own parser reads it: sample name and labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(base + "/metrics", timeout=5)
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(resp.text) for s in f.samples}


def test_metrics(gen, base, client):
    before = scrape(base)
    client.completions.create(model=MODEL, prompt=ONCE, max_tokens=64)
    requests.post(base + "/v1/completions", json={"prompt": "x", "n": 3}, timeout=5)
    after = scrape(base)

    def grew(name, labels=()):
        return after[name, labels] - before.get((name, labels), 0)

    assert grew("metrale_server_requests_total", (("endpoint", "completions"), ("status", "ok"))) == 1
    assert grew("metrale_server_requests_total", (("endpoint", "completions"), ("status", "client_error"))) == 1
    assert grew("metrale_server_completion_tokens_total") == 32
    assert grew("metrale_spec_decode_requests_total") == 1  # the generator's own counters
    assert grew("metrale_server_e2e_request_latency_seconds_count") == 1
    assert after["metrale_scheduler_running", ()] == 0


def test_metrics_histograms_time_streamed_requests(base, client):
    before = scrape(base)
    for _ in range(3):
        list(client.completions.create(model=MODEL, prompt=ONCE, max_tokens=64, stream=True))
    after = scrape(base)

    def grew(name):
        return after[name, ()] - before.get((name, ()), 0)

    assert grew("metrale_server_time_to_first_token_seconds_count") == 3
    assert grew("metrale_server_e2e_request_latency_seconds_count") == 3
    # a delta a token but for those held back (split characters): fewer gaps than 3 x 31
    assert 3 * 10 <= grew("metrale_server_inter_token_latency_seconds_count") <= 3 * 31
    assert 0 < grew("metrale_server_inter_token_latency_seconds_sum") < grew(
        "metrale_server_e2e_request_latency_seconds_sum")
    le = ("le", "+Inf")
    assert after["metrale_server_time_to_first_token_seconds_bucket", (le,)] == after[
        "metrale_server_time_to_first_token_seconds_count", ()]


def test_a_developer_message_is_rendered_as_a_system_one(tiny_engine):
    """OpenAI's `developer` role is the chat template's `system` (a template that does not know
    the role would otherwise drop the instruction or render an unknown one)."""
    from metrale.runtime.serving.api_models import ChatRequest

    class Served:
        tokenizer = tiny_engine.tokenizer

    def ids(role: str) -> list[int]:
        body = {"messages": [{"role": role, "content": "Be kind."}, {"role": "user", "content": "hi"}]}
        return ChatRequest.model_validate(body).prompt_ids(Served)

    assert ids("developer") == ids("system") != ids("user")

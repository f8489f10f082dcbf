"""The server under abuse: fuzzed bodies never give a 5xx, limits and deadlines hold, the API
key is required on /v1/*, a full queue answers 503 with Retry-After, an abandoned non-streamed
request stops generating, and memory goes back after large requests.

The served model is test_server's 3-gram generator (fast, deterministic)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests
from conftest import serve_in_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydoc_data.topics import topics
from test_server import ONCE, ONCE_REPLY, TrigramGenerator

from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.server import create_app
from metrale.runtime.artifact.tokenizer import train_bpe_tokenizer

KEY = "s3cret-key"
LIMITS = ServerLimits(max_request_bytes=4096, max_queue=2, header_timeout_s=0.5,
                      body_timeout_s=0.5, api_key=KEY)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    tok = train_bpe_tokenizer([topics[k] for k in sorted(topics)[:10]], 512,
                              tmp_path_factory.mktemp("tok"))
    return TrigramGenerator(tok)


@pytest.fixture(scope="module")
def open_base(gen):
    with serve_in_thread(create_app(gen)) as url:
        yield url


@pytest.fixture(scope="module")
def guarded(gen):
    with serve_in_thread(create_app(gen, LIMITS), LIMITS) as url:
        yield url


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- fuzzing: no input gives a 5xx ---------------------------------------------------------------

NUMBERS = st.one_of(st.integers(-(10**30), 10**30), st.floats(allow_nan=True), st.booleans(),
                    st.sampled_from([0, 1, 5e-324, 1e-300, 10**400, -0.0]))
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
LEAF = st.one_of(st.none(), NUMBERS, TEXT)
VALUE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(TEXT, inner, max_size=4), max_leaves=10)
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "n", "stop", "stream", "seed", "model", "echo", "logprobs", "stream_options")
BODY = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=6),
    st.fixed_dictionaries({"prompt": TEXT, "max_tokens": st.integers(-3, 300),
                           "temperature": NUMBERS, "top_p": NUMBERS, "stream": st.booleans()}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", 3]), "content": VALUE}),
        max_size=3), "max_tokens": st.integers(1, 8)}),
    VALUE)


def check_answer(resp: requests.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif resp.headers["content-type"].startswith("application/json"):
        assert resp.json()["choices"]
    else:
        assert resp.text.endswith("data: [DONE]\n\n")


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, chat=st.booleans())
def test_fuzzed_bodies_never_give_a_5xx(open_base, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = json.dumps(body, ensure_ascii=True).encode()  # NaN/Infinity and \ud800 escapes too
    check_answer(requests.post(open_base + path, data=data, timeout=10,
                               headers={"Content-Type": "application/json"}))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200))
def test_fuzzed_bytes_never_give_a_5xx(open_base, raw):
    check_answer(requests.post(open_base + "/v1/completions", data=raw, timeout=10))


# -- limits and deadlines ------------------------------------------------------------------------

def test_body_over_the_limit_is_refused(guarded):
    resp = requests.post(guarded + "/v1/completions", data=b"x" * 5000, headers=AUTH, timeout=5)
    assert resp.status_code == 413 and "4096" in resp.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(10):
            yield b"y" * 1000

    resp = requests.post(guarded + "/v1/completions", data=chunks(), headers=AUTH, timeout=5)
    assert resp.status_code == 413
    assert requests.get(guarded + "/health", timeout=5).status_code == 200


def raw_exchange(url: str, data: bytes, wait: float = 3.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; (what came back before close, seconds it took)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=wait) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except TimeoutError:
            pass
    return got, time.monotonic() - t0


def test_short_body_behind_a_longer_content_length_times_out(guarded):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    got, took = raw_exchange(guarded, head)
    assert got.startswith(b"HTTP/1.1 408") and took < 2.5


def test_connection_without_a_request_head_is_closed(guarded):
    got, took = raw_exchange(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert got == b"" and took < 2.5  # closed by the 0.5 s header deadline, not the 3 s wait


def test_api_key_is_required_on_v1_only(guarded, gen):
    assert requests.get(guarded + "/health", timeout=5).status_code == 200
    assert requests.get(guarded + "/metrics", timeout=5).status_code == 200
    for auth in (None, "Bearer wrong", KEY, f"Basic {KEY}", f"Bearer{KEY}", "Bearer", f"Bearer {KEY}x"):
        resp = requests.get(guarded + "/v1/models", headers={"Authorization": auth} if auth else {}, timeout=5)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", auth
    for auth in (AUTH["Authorization"], f"bearer {KEY}", f"BEARER {KEY}"):  # the scheme in any case
        assert requests.get(guarded + "/v1/models", headers={"Authorization": auth}, timeout=5).status_code == 200
    resp = requests.post(guarded + "/v1/completions", json={"prompt": ONCE}, headers=AUTH, timeout=5)
    assert resp.json()["choices"][0]["text"] == ONCE_REPLY


def test_full_queue_answers_503_with_retry_after(guarded, gen):
    gen.gate.clear()
    results = []

    def gated():
        results.append(requests.post(guarded + "/v1/completions", headers=AUTH, timeout=10,
                                     json={"prompt": "gated " + ONCE, "max_tokens": 2}))

    threads = [threading.Thread(target=gated) for _ in range(LIMITS.max_queue)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 5
        while "metrale_server_requests_admitted 2" not in requests.get(guarded + "/metrics",
                                                                       timeout=5).text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        resp = requests.post(guarded + "/v1/completions", headers=AUTH, timeout=5,
                             json={"prompt": ONCE})
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["code"] == "server_busy"
    finally:
        gen.gate.set()
    for t in threads:
        t.join(10)
    assert [r.status_code for r in results] == [200, 200]


def test_abandoned_non_streamed_request_stops_generating(open_base, gen):
    gen.closed.clear()
    body = json.dumps({"prompt": "slow", "max_tokens": 250}).encode()
    with socket.create_connection(("127.0.0.1", port_of(open_base)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.1)
    # 250 tokens at 10 ms would take 2.5 s; the disconnect ends the generation at the next token
    assert gen.closed.wait(1.5)
    resp = requests.post(open_base + "/v1/completions", json={"prompt": ONCE}, timeout=5)
    assert resp.json()["choices"][0]["text"] == ONCE_REPLY


def test_long_prompt_is_tokenized_off_the_event_loop(open_base, gen):
    prompt = "the quick brown fox " * 40_000  # 800 KB of text: ~1 s to tokenize here
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=requests.post(
        open_base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)))
    worker.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert requests.get(open_base + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 0.5
    worker.join(30)
    assert result["r"].status_code == 400  # longer than the 256-token context


def admitted(url: str) -> int:
    lines = requests.get(url + "/metrics", timeout=5).text.splitlines()
    return int(float(next(x for x in lines if x.startswith("metrale_server_requests_admitted ")).split()[1]))


def test_a_stream_holds_its_queue_place_until_it_ends(open_base, gen):
    """A stream is counted from admission until its last byte, then its place is given back."""
    gen.gate.clear()
    got = {}

    def stream():
        got["r"] = requests.post(open_base + "/v1/completions", timeout=10,
                                 json={"prompt": "gated " + ONCE, "max_tokens": 2, "stream": True})

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while admitted(open_base) != 1:  # admitted, held at the gate before its first token
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        gen.gate.set()
    worker.join(10)
    assert got["r"].text.endswith("data: [DONE]\n\n")
    deadline = time.monotonic() + 3
    while admitted(open_base):  # the place is given back once the stream has ended
        assert time.monotonic() < deadline
        time.sleep(0.02)

@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_speculative_disable_by_batch_size_is_checked(value):
    from metrale.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--speculative-disable-by-batch-size .*at least 1"):
        ServerLimits(speculative_disable_by_batch_size=value)

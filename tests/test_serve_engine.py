"""`metrale serve` as a real process on the tiny engine, spoken to by the official openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
from openai import OpenAI


@pytest.fixture(scope="module")
def server(server_proc):
    return server_proc[0]


@pytest.fixture(scope="module")
def server_proc(tiny_engine_dir):
    """`metrale serve` on the tiny engine: (base URL, pid)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "metrale", "serve", "--engine-dir", str(tiny_engine_dir),
           "--port", str(port), "--dflash", "--dflash-draft-ladder", "1,3,7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "metrale serve did not come up"
        try:
            if requests.get(base + "/health", timeout=1).ok:
                break
        except requests.ConnectionError:
            time.sleep(0.2)
    yield base, proc.pid
    proc.terminate()
    proc.wait(10)


def test_openai_client_against_metrale_serve(server, tiny_engine, tiny_prompts):
    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_engine.model_id]
    prompt = tiny_engine.tokenizer.decode(tiny_prompts[0])
    done = client.completions.create(model=tiny_engine.model_id, prompt=prompt, max_tokens=16, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=tiny_engine.model_id, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert done.choices[0].text and streamed == done.choices[0].text
    chat = client.chat.completions.create(model=tiny_engine.model_id, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "import os"}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens >= 1
    # a malformed request is a 4xx JSON error and the server stays up
    bad = requests.post(server + "/v1/completions", data="{not json", timeout=10,
                        headers={"Content-Type": "application/json"})
    assert 400 <= bad.status_code < 500 and "error" in bad.json()
    assert requests.get(server + "/health", timeout=5).ok
    metrics = requests.get(server + "/metrics", timeout=5).text
    assert "metrale_spec_decode" in metrics and "position=" in metrics


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_32_concurrent_clients_get_their_solo_answers(server, tiny_engine, tiny_prompts):
    from concurrent.futures import ThreadPoolExecutor

    tok = tiny_engine.tokenizer
    prompts = [tok.decode(p[: 3 + i]) for p in tiny_prompts for i in range(8)]  # 32 prompts

    def ask(prompt: str) -> str:
        resp = requests.post(server + "/v1/completions", timeout=120,
                             json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    solo = [ask(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, prompts))
    assert together == solo and len(set(solo)) > 1


def test_memory_goes_back_after_large_requests(server_proc):
    base, pid = server_proc
    requests.post(base + "/v1/completions", json={"prompt": "def main(", "max_tokens": 2})
    line = "def main(): return x + y  # ünïcödé 日本\n"
    prompt = line * (600_000 // len(line))  # ~0.7 MB of JSON: near the 1 MiB + 64 KiB limit
    # one large request first: what it sets up once (worker threads and their allocator arenas)
    # is the baseline; what must not happen is growth with every further request
    requests.post(base + "/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 2})
    before = rss_mb(pid)
    for i in range(1, 7):
        resp = requests.post(base + "/v1/completions", timeout=60,
                             json={"prompt": prompt[i:], "max_tokens": 2})
        assert resp.status_code == 400  # far longer than the 1024-token context
    assert rss_mb(pid) - before < 50
    assert requests.post(base + "/v1/completions", data=b"x" * (2 << 20), timeout=10).status_code == 413


def _load_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "load.py"
    spec = importlib.util.spec_from_file_location("load_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_load_script_counts_what_its_clients_got(server_proc, tiny_engine, tiny_prompts):
    """scripts/load.py's figures come from real answers: each client thread its own openai
    client, every request counted, its answer the one it gets alone; where the time went comes
    from the processes' CPU counters and the server's scheduler counters."""
    load = _load_script()
    server, pid = server_proc
    prompts = [tiny_engine.tokenizer.decode(p[:6]) for p in tiny_prompts[:4]]
    alone, solo = load.run_load(server, prompts, 1, 4, 6, server_pid=pid)
    busy, together = load.run_load(server, prompts, 4, 2, 6, server_pid=pid)
    # alone, a forward runs one sequence's rows: its prompt (6 tokens at most) or a verify (the
    # pending token and at most 7 drafts of the ladder 1,3,7); together, up to 4 such sets
    assert 1.0 <= alone["rows_per_forward"] <= 8.0 and 1.0 <= busy["rows_per_forward"] <= 32.0
    assert busy["cores_busy"] > 0
    # the engine process (the server's child) computes every token; each process did some work
    assert set(busy["cpu_ms_per_request"]) == {"client", "http", "engine"}
    assert all(v > 0 for v in alone["cpu_ms_per_request"].values())
    assert alone["requests"] == 4 and busy["requests"] == 8 and alone["lost"] == busy["lost"] == 0
    assert busy["tokens_per_s"] > 0 and busy["p99_latency_s"] >= busy["median_latency_s"] > 0
    assert dict(solo) == dict(together) and len(solo) == 4
    rounds = [dict(busy, equal_to_solo=True, tokens_per_s=t, lost=n, rows_per_forward=t,
                   cpu_ms_per_request={"client": t, "http": 1.0, "engine": 2 * t})
              for t, n in ((3.0, 0), (1.0, 1), (2.0, 0))]
    row = load._median_row(rounds)
    assert (row["tokens_per_s"], row["lost"], row["rounds"], row["requests"]) == (2.0, 1, 3, 24)
    assert row["rows_per_forward"] == 2.0
    assert row["cpu_ms_per_request"] == {"client": 2.0, "http": 1.0, "engine": 4.0}
    # CPU seconds and counters before and after a level -> per request, per second, per forward
    went = load._where_time_went(({"client": 1.0, "http": 2.0, "engine": 3.0}, (100.0, 10.0)),
                                 ({"client": 1.5, "http": 2.1, "engine": 3.4}, (420.0, 30.0)), 100, 0.5)
    assert went == {"cpu_ms_per_request": {"client": 5.0, "http": 1.0, "engine": 4.0}, "cores_busy": 2.0,
                    "rows_per_forward": 16.0}
    assert load._where_time_went((None, (0.0, 0.0)), (None, (0.0, 0.0)), 1, 1.0) == {}
    assert row["equal_to_solo"] and not load._median_row([dict(busy, equal_to_solo=False)])["equal_to_solo"]
    # paired by round: the median of each round's ratio, not the ratio of the two medians (1.0)
    plain = [dict(busy, tokens_per_s=t) for t in (1.5, 2.0, 4.0)]
    assert load._paired(rounds, plain) == {"vs_plain_rounds": [2.0, 0.5, 0.5], "vs_plain": 0.5}
    assert load._paired(rounds, plain, "vs_serial")["vs_serial_rounds"] == [2.0, 0.5, 0.5]
    # every level sends the largest level's requests in all: C = 1 sends all 256 one by one
    levels = [1, 4, 8, 32]
    assert [c * load.per_level_requests(levels, 8, c) for c in levels] == [256] * 4
    assert load.per_level_requests([1, 3], 2, 3) == 2 and load.per_level_requests([2, 3], 1, 2) == 2


def test_load_scripts_http_clients_get_the_openai_clients_answers(server, tiny_engine, tiny_prompts):
    """`scripts/load.py --client http`: plain keep-alive connections count every request's
    tokens and get the answers the openai client gets; a refused request raises (lost)."""
    load = _load_script()
    prompts = [tiny_engine.tokenizer.decode(p[:6]) for p in tiny_prompts[:4]]
    _, by_openai = load.run_load(server, prompts, 1, 4, 6)
    row, by_http = load.run_load(server, prompts, 4, 2, 6, client_kind="http")
    assert row["requests"] == 8 and row["lost"] == 0 and row["tokens_per_s"] > 0
    assert dict(by_http) == dict(by_openai) and all(dict(by_http).values())
    with pytest.raises(RuntimeError, match="HTTP 400"):
        load.HttpClient(server).complete(model=tiny_engine.model_id, prompt="a", max_tokens=-1)


def test_load_scripts_engine_only_rows_are_the_schedulers_real_answers(tiny_engine_dir, tiny_engine,
                                                                       tiny_prompts):
    """`scripts/load.py --engine-only`: the scheduler fed without HTTP counts every request's
    tokens, and each greedy answer under 4 clients is the one it gets alone."""
    load = _load_script()
    prompts = [tiny_engine.tokenizer.decode(p[:6]) for p in tiny_prompts[:4]]
    alone, solo = load.run_engine_only(str(tiny_engine_dir), prompts, 1, 4, 6, 8)
    busy, together = load.run_engine_only(str(tiny_engine_dir), prompts, 4, 2, 6, 8)
    assert alone["requests"] == 4 and busy["requests"] == 8 and alone["lost"] == busy["lost"] == 0
    assert busy["tokens_per_s"] > 0 and busy["p99_latency_s"] >= busy["median_latency_s"] > 0
    assert dict(solo) == dict(together) and len(solo) == 4 and all(dict(solo).values())

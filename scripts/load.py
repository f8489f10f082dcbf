"""Load `metrale serve` over loopback with the official openai client and report what users see.

    python scripts/load.py --engine-dir engines/tiny [--concurrency 1,4,8,32] [--requests 8]
                           [--max-tokens 32] [--modes plain,mtp,dflash,dflash2-tree] [--rounds 5]
                           [--max-num-seqs 64] [--server-threads N] [--serve-flags '...']
                           [--temperature T] [--client openai|http] [--engine-only]
                           [--serial] [--json FILE]

It starts one `metrale serve` process per mode, all up together (`--max-num-seqs`;
`--server-threads` torch threads, by default the server's own: one per core; an idle server
takes no CPU). Then for `--rounds` rounds, for each concurrency C and each mode in turn (the
order rotating between rounds, so a machine's slow spells fall on every mode alike), it runs C
client threads, each with its own openai client, that together send the same number of
completions of `--max-tokens` tokens at every level: `--requests` per client at the largest C,
split evenly over the C clients (C = 1 sends them one by one: the one-request-at-a-time figure
is measured over the same requests as the others, not over a sample a fraction of a second
long) (prompts from the tiny recipe's held-out set; greedy, or with
`--temperature` above 0 sampled, each prompt with its own seed, so its answer is still the same
under any load). Per mode and C it reports aggregate completion tokens/s, median and p99
latency (medians over the rounds) and lost requests (summed), and whether every answer equals
the same request's answer at the first level (C = 1 by default: the request alone); for each
mode but plain, also its tokens/s over plain decoding's in each round and their median (the
two measured minutes apart at most, where medians taken over separate rounds are not; two
servers of the same code may still differ by several per cent from one start to the next, so a
ratio a few per cent from 1 is noise). Last, per mode, the latency of a 4-token request sent just after another client's 1,000-token stream
started (from its own process), the slowest of 5 such runs, against the same request alone (the
median of two runs just before each of those: a machine's slow spell moves both).

Each level over HTTP also says where the time went: CPU ms per request of the clients (this
process), the server's HTTP process and its engine process, the cores the three kept busy
together, and the mean target rows per batched forward (`/metrics`; a batch of 32 full would run
32), each over the timed requests only.

With `--serial`, every mode also runs as `serial-MODE` on a server of its own with
`--max-num-seqs 1`: one request at a time, the rest queued, as `serve` ran before it batched.
Each mode's row then carries its tokens/s over its serial server's, round by round
(`vs_serial`): what batching gives, before and after in one run.

`--client http` sends the same requests as plain HTTP/1.1 from each thread's own keep-alive
connection (the standard library's `http.client`, JSON in and out), as vLLM's serving benchmark
posts its requests itself rather than through the openai client: the openai client spends
several times this one's CPU a request, which on a machine whose
clients share the server's cores is CPU the server does not get.

With `--engine-only`, each level also runs plain decoding with no HTTP and no openai client: C
threads of this process hand tokenized requests to the serving scheduler itself, as the engine
process's pipe reader does (vLLM's offline throughput benchmark, beside its serving one). On a
machine whose clients share the server's cores, that row is the engine's batched ceiling: what
the tokens/s over HTTP would be if serving and clients cost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"plain": [], "mtp": ["--speculative", "--num-drafts", "3", "--draft-confidence-stop", "cum:0.5"],
         "dflash": ["--dflash"],
         "dflash2-tree": ["--dflash", "--dflash-drafter", "dflash2", "--dflash-tree-budget", "16"]}


def start_server(engine_dir: str, flags: list[str], max_num_seqs: int,
                 threads: int = 0) -> tuple[subprocess.Popen, str]:
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "metrale", "serve", "--engine-dir", engine_dir, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--max-queue", "256", *flags]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"metrale serve {' '.join(flags)} did not come up")
        try:
            if requests.get(base + "/health", timeout=1).ok:
                return proc, base
        except requests.ConnectionError:
            time.sleep(0.2)


class HttpClient:
    """A completion over one keep-alive HTTP/1.1 connection (`--client http`): the request's
    JSON posted, the answer's (text, completion tokens) read back; a non-2xx status raises."""

    def __init__(self, base: str):
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)

    def complete(self, **body) -> tuple[str, int]:
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        answer = json.loads(data)
        return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def run_load(base: str, prompts: list[str], concurrency: int, per_client: int, max_tokens: int,
             temperature: float = 0.0, client_kind: str = "openai", server_pid: int | None = None):
    from openai import OpenAI

    def new_openai() -> OpenAI:
        return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)

    def new_client():
        """A client's completion call: (text, completion tokens) of the request's body."""
        if client_kind == "http":
            return HttpClient(base).complete
        client = new_openai()

        def complete(**body) -> tuple[str, int]:
            r = client.completions.create(**body)
            return r.choices[0].text, r.usage.completion_tokens
        return complete

    openai_client = new_openai()
    model = openai_client.models.list().data[0].id
    mine = threading.local()  # each client thread its own client, as C separate users have
    # (one client shared by many threads serializes them on its connection pool's lock: fewer
    # tokens/s and more client CPU per request)

    def one(i: int):
        t0 = time.perf_counter()
        seed = {"seed": i % len(prompts)} if temperature > 0 else {}
        text, n = mine.complete(model=model, prompt=prompts[i % len(prompts)],
                                max_tokens=max_tokens, temperature=temperature, **seed)
        return i % len(prompts), text, n, time.perf_counter() - t0

    def warm(i: int) -> None:  # each thread's client made and connected
        mine.complete = new_client()
        mine.complete(model=model, prompt=prompts[i % len(prompts)], max_tokens=4, temperature=0)

    for p in prompts:  # warm: the first calls of a fresh server allocate and load
        openai_client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0)
    with ThreadPoolExecutor(concurrency) as pool:
        barrier = threading.Barrier(concurrency)  # every thread warms once, none twice
        list(pool.map(lambda i: (warm(i), barrier.wait()), range(concurrency)))
        before = (server_pid and _cpu_seconds(server_pid), _batch_counters(base))
        t0 = time.perf_counter()
        futures = [pool.submit(one, i) for i in range(concurrency * per_client)]
        done, lost = [], 0
        for f in futures:
            try:
                done.append(f.result())
            except Exception:  # noqa: BLE001 - counted as lost
                lost += 1
        wall = time.perf_counter() - t0
        after = (server_pid and _cpu_seconds(server_pid), _batch_counters(base))
    row, answers = _figures(concurrency, len(futures), lost, done, wall)
    row.update(_where_time_went(before, after, len(futures), wall))
    return row, answers


def _figures(concurrency: int, requests: int, lost: int, done: list[tuple], wall: float):
    """One level's figures from its answered requests `done` ((prompt, text, tokens, seconds)
    each) over `wall` seconds, and the set of (prompt, text) answers."""
    lat = sorted(d[3] for d in done)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))] if lat else float("nan")
    return {"concurrency": concurrency, "requests": requests, "lost": lost,
            "tokens_per_s": round(sum(d[2] for d in done) / wall, 1),
            "median_latency_s": round(statistics.median(lat), 3) if lat else None,
            "p99_latency_s": round(p99, 3)}, {(i, t) for i, t, _, _ in done}


def _cpu_seconds(server_pid: int) -> dict[str, float] | None:
    """CPU seconds so far of this process (the clients: `getrusage`), the server's process (HTTP)
    and its children (the engine process), the last two summed over their threads' scheduler
    statistics (`/proc/PID/task/TID/schedstat`, in nanoseconds: /proc's per-process figures
    count 10 ms ticks, too coarse for a level of a few short requests); None where there is no
    /proc. A thread that ended between two readings takes its time with it."""
    import resource

    def threads(pid) -> float:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except OSError:  # ended since the listing
                pass
        return total / 1e9

    try:
        children = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:  # gone since the listing
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid:  # its parent
                    children.append(entry)
        http = threads(server_pid)
        engine = sum(threads(c) for c in children)
    except OSError:
        return None
    mine = resource.getrusage(resource.RUSAGE_SELF)
    return {"client": mine.ru_utime + mine.ru_stime, "http": http, "engine": engine}


def _batch_counters(base: str) -> tuple[float, float]:
    """The server's scheduler counters (target rows run in batched forwards, those forwards)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(base + "/metrics", timeout=30).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return (values.get("metrale_scheduler_batched_rows_total", 0.0),
            values.get("metrale_scheduler_batched_forwards_total", 0.0))


def _where_time_went(before: tuple, after: tuple, requests: int, wall: float) -> dict:
    """What a level cost, from `_cpu_seconds` and `_batch_counters` taken just before and just
    after it: CPU ms per request of the clients, the HTTP process and the engine process, the
    cores they kept busy together, and the mean target rows per batched forward (at C = 32 a
    full batch runs 32: fewer means requests spent that share of their time outside the engine,
    in the clients, the HTTP process or the pipes between)."""
    out = {}
    (cpu0, (rows0, fwd0)), (cpu1, (rows1, fwd1)) = before, after
    if cpu0 is not None and cpu1 is not None:
        spent = {k: cpu1[k] - cpu0[k] for k in cpu0}
        out["cpu_ms_per_request"] = {k: round(1e3 * v / requests, 2) for k, v in spent.items()}
        out["cores_busy"] = round(sum(spent.values()) / wall, 2)
    if fwd1 > fwd0:
        out["rows_per_forward"] = round((rows1 - rows0) / (fwd1 - fwd0), 1)
    return out


_ENGINES: dict = {}
SERVE_PREFIX_CACHE_TOKENS = 8192  # `metrale serve --prefix-cache-tokens`' default


def run_engine_only(engine_dir: str, prompts: list[str], concurrency: int, per_client: int,
                    max_tokens: int, max_num_seqs: int):
    """`run_load`'s figures for plain decoding without HTTP: the engine and scheduler set up by
    `serve`'s engine process's own `engine_setup` (its default prefix cache, no yield to an
    event loop, the heap frozen; its steps on every thread, where serve leaves one to its HTTP
    process), loaded once per engine directory, each client thread submitting its requests one
    after another."""
    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.serving.engine_process import engine_setup
    from metrale.runtime.serving.scheduler import Job
    from metrale.runtime.serving.service import load_generator
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.sampling import SamplingParams

    if (engine_dir, max_num_seqs) not in _ENGINES:
        gen = load_generator(engine_dir, SpeculativeConfig())
        scheduler, _ = engine_setup(gen, max_num_seqs, None, SERVE_PREFIX_CACHE_TOKENS, http_cores=0)
        _ENGINES[engine_dir, max_num_seqs] = gen, scheduler
    gen, scheduler = _ENGINES[engine_dir, max_num_seqs]
    ids = [gen.tokenizer.encode(p) for p in prompts]

    def one(i: int):
        t0, done, parts, n = time.perf_counter(), threading.Event(), [], [0]

        def emit(kind, payload):
            if kind == "text":
                parts.append(payload)
            elif kind == "done":
                n[0] = payload[1]
            if kind in ("done", "error"):
                done.set()

        req = GenerationRequest(ids[i % len(ids)], SamplingParams(temperature=0, max_tokens=max_tokens),
                                (), False, False)
        scheduler.submit(Job(gen, req, emit, threading.Event(), f"engine-only-{i}"))
        done.wait()
        return i % len(prompts), "".join(parts), n[0], time.perf_counter() - t0

    for i in range(len(prompts)):  # warm, as run_load does
        one(i)
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        done = list(pool.map(one, range(concurrency * per_client)))
    answered = [d for d in done if d[2]]  # a failed request emits no tokens: lost
    return _figures(concurrency, len(done), len(done) - len(answered), answered,
                    time.perf_counter() - t0)


def _long_stream(base: str, model: str, started) -> None:
    """Another client's 1,000-token stream (its own process: a client's parsing must not
    compete with the measured client's for one interpreter)."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    for _ in client.completions.create(model=model, prompt="def main(", stream=True,
                                       max_tokens=1000, temperature=0):
        started.set()


def short_behind_long(base: str, repeats: int = 5) -> dict:
    import multiprocessing

    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def short() -> float:
        t0 = time.perf_counter()
        client.completions.create(model=model, prompt="import os", max_tokens=4, temperature=0)
        return time.perf_counter() - t0

    alone, behind = [], []
    ctx = multiprocessing.get_context("spawn")
    for _ in range(repeats):  # the request alone measured beside each of its runs behind a stream
        alone += [short(), short()]
        started = ctx.Event()
        other = ctx.Process(target=_long_stream, args=(base, model, started))
        other.start()
        started.wait(120)
        behind.append(short())
        other.join()
    solo = statistics.median(alone)
    return {"short_alone_s": round(solo, 4), "short_behind_long_p99_s": round(max(behind), 4),
            "ratio": round(max(behind) / solo, 2)}


def per_level_requests(levels: list[int], requests: int, concurrency: int) -> int:
    """Each client's requests at `concurrency`: the largest level's `requests` per client, in
    all, split over this level's clients (rounded up where they do not divide)."""
    return -(-max(levels) * requests // concurrency)


def _paired(mine: list[dict], other: list[dict], key: str = "vs_plain") -> dict:
    """A mode's tokens/s over another's (plain decoding's; with `--serial`, its serial server's),
    round by round (the two ran one after the other in each round, so a slow spell of the
    machine moves both), and their median."""
    ratios = [round(m["tokens_per_s"] / o["tokens_per_s"], 3) for m, o in zip(mine, other)]
    return {f"{key}_rounds": ratios, key: round(statistics.median(ratios), 3)}


def _median_row(rows: list[dict]) -> dict:
    """One concurrency level's rounds: the median of each figure, losses summed, every answer
    checked."""
    def med(key):
        return round(statistics.median(r[key] for r in rows), 3)

    return {"concurrency": rows[0]["concurrency"], "rounds": len(rows),
            "requests": sum(r["requests"] for r in rows), "lost": sum(r["lost"] for r in rows),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
            "tokens_per_s_rounds": [r["tokens_per_s"] for r in rows],
            "median_latency_s": med("median_latency_s"), "p99_latency_s": med("p99_latency_s"),
            "equal_to_solo": all(r["equal_to_solo"] for r in rows), **_median_costs(rows)}


def _median_costs(rows: list[dict]) -> dict:
    """`_where_time_went`'s figures of a level's rounds, each the median over the rounds."""
    out = {}
    for key in ("cores_busy", "rows_per_forward"):
        if all(key in r for r in rows):
            out[key] = round(statistics.median(r[key] for r in rows), 2)
    if all("cpu_ms_per_request" in r for r in rows):
        out["cpu_ms_per_request"] = {k: round(statistics.median(r["cpu_ms_per_request"][k] for r in rows), 2)
                                     for k in rows[0]["cpu_ms_per_request"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", default=str(ROOT / "engines" / "tiny"))
    ap.add_argument("--concurrency", default="1,4,8,32")
    ap.add_argument("--requests", type=int, default=8,
                    help="requests per client at the largest concurrency; every level sends as "
                    "many in all, split over its clients")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="plain,mtp,dflash")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of every level and mode, interleaved; medians are reported, and "
                    "each mode's tokens/s over plain decoding's of the same round")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--serve-flags", default="", help="more flags for every server, e.g. "
                    "'--speculative-disable-by-batch-size 65' (draft at any batch size)")
    ap.add_argument("--server-threads", type=int, default=0,
                    help="torch threads of the server (0: its default, one per core)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above 0: sampled, a seed per prompt")
    ap.add_argument("--client", choices=("openai", "http"), default="openai",
                    help="the clients: the official openai client, or plain HTTP/1.1 keep-alive "
                    "connections (cheaper: more of a shared machine left to the server)")
    ap.add_argument("--engine-only", action="store_true",
                    help="also run plain decoding without HTTP at each level (the engine's ceiling)")
    ap.add_argument("--serial", action="store_true", help="each mode also on a server with "
                    "--max-num-seqs 1, as serial-MODE (see above)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-tail", dest="tail", action="store_false",
                    help="skip the short-request-behind-long-streams latency of each mode")
    args = ap.parse_args()
    prompts = json.loads((ROOT / "recipes" / "tiny" / "prompts.json").read_text())[:8]
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    if args.temperature < 0:
        ap.error(f"--temperature {args.temperature}: expected 0 (greedy) or more")
    if args.engine_only and args.temperature:
        ap.error(f"--engine-only runs greedy requests; --temperature {args.temperature} is for the servers")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: expected 1 or more")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: expected 1 or more")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes {args.modes}: unknown {', '.join(unknown)}; expected some of {', '.join(MODES)}")
    out = {"max_num_seqs": args.max_num_seqs, "max_tokens": args.max_tokens,
           "temperature": args.temperature, "rounds": args.rounds, "client": args.client, "modes": {}}
    servers = {}
    served = modes + [f"serial-{m}" for m in modes] * args.serial
    modes_run = served + ["engine-only"] * args.engine_only
    try:
        for mode in served:  # all up at once, idle while another is loaded: rounds interleave
            serial = mode.startswith("serial-")
            servers[mode] = start_server(args.engine_dir, MODES[mode.removeprefix("serial-")]
                                         + shlex.split(args.serve_flags),
                                         1 if serial else args.max_num_seqs, args.server_threads)
        rows = {m: {c: [] for c in levels} for m in modes_run}
        per_client = {c: per_level_requests(levels, args.requests, c) for c in levels}
        solo: dict[str, dict] = {}
        for r in range(args.rounds):
            for c in levels:
                for mode in modes_run[r % len(modes_run):] + modes_run[:r % len(modes_run)]:
                    if mode == "engine-only":  # the order above rotates between rounds
                        row, answers = run_engine_only(args.engine_dir, prompts, c, per_client[c],
                                                       args.max_tokens, args.max_num_seqs)
                    else:
                        proc, base = servers[mode]
                        row, answers = run_load(base, prompts, c, per_client[c], args.max_tokens,
                                                args.temperature, args.client, proc.pid)
                    solo.setdefault(mode, dict(answers))  # its first level's answers (C = 1)
                    row["equal_to_solo"] = all(solo[mode].get(i) == t for i, t in answers)
                    rows[mode][c].append(row)
                    print(f"round {r + 1}", mode, row, flush=True)
        for mode in modes_run:
            out["modes"][mode] = {"levels": [_median_row(rows[mode][c]) for c in levels]}
            plain = "serial-plain" if mode.startswith("serial-") else "plain"  # its own kind's
            if mode != plain and plain in rows:
                for c, row in zip(levels, out["modes"][mode]["levels"]):
                    row.update(_paired(rows[mode][c], rows[plain][c]))
            if f"serial-{mode}" in rows:
                for c, row in zip(levels, out["modes"][mode]["levels"]):
                    row.update(_paired(rows[mode][c], rows[f"serial-{mode}"][c], "vs_serial"))
            for row in out["modes"][mode]["levels"]:
                print(mode, row, flush=True)
        save(args.json, out)  # the levels first: a run cut short during the tails keeps them
        for mode in modes_run if args.tail else ():
            if mode in servers:
                out["modes"][mode]["short_behind_long"] = tail = short_behind_long(servers[mode][1])
                print(mode, tail, flush=True)
                save(args.json, out)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # (its results are in; it must not outlive them)
                proc.kill()
                proc.wait()
    save(args.json, out)
    return 0


def save(path: Path | None, out: dict) -> None:
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())

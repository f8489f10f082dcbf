"""Iteration-level scheduling in `serve` (`serving.scheduler`), on the tiny engine through HTTP
with the official openai client: answers under concurrency equal the same requests served alone,
a short request runs alongside a long one instead of behind it, cancellation frees its place,
and /metrics shows the running set and the queue."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI

from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.server import create_app
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.sampling import SamplingParams

from conftest import serve_in_thread, solo_answers

MODES = {"plain": {}, "mtp": dict(speculative=True, num_drafts=3),
         "dflash": dict(dflash=True, dflash_draft_ladder="1,3,7"),
         "dflash2 tree": dict(dflash=True, dflash_drafter="dflash2", dflash_tree_budget=16)}


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("mode", list(MODES))
def test_answers_under_concurrency_equal_their_solo_answers(tiny_engine, tiny_prompts, mode):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    texts = [tiny_engine.tokenizer.decode(p[:12]) for p in tiny_prompts]
    solo = {}
    for i, text in enumerate(texts):  # alone, not through the server: the decode loop itself
        ids = tiny_engine.tokenizer.encode(text)
        res = gen.generate(ids, SamplingParams(temperature=0.0, max_tokens=24))
        solo[i] = tiny_engine.tokenizer.decode(
            [t for t in res.token_ids if t not in tiny_engine.tokenizer.eos_token_ids])
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=8))) as base:
        client = _client(base)

        def ask(job):
            i, _ = job
            return i, client.completions.create(model=gen.model_id, prompt=texts[i], max_tokens=24,
                                                temperature=0).choices[0].text

        jobs = [(i % len(texts), r) for r in range(4) for i in range(len(texts))] * 2  # 32 requests
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, jobs))
        metrics = requests.get(base + "/metrics", timeout=5).text
    assert len(answers) == 32 and all(text == solo[i] for i, text in answers)
    peak = int(float(next(x for x in metrics.splitlines() if x.startswith("metrale_scheduler_peak_running ")).split()[1]))
    assert 2 <= peak <= 8  # several ran at once, never more than --max-num-seqs
    assert "metrale_scheduler_waiting 0" in metrics and "metrale_scheduler_running 0" in metrics


def _streaming(client: OpenAI, model: str, max_tokens: int):
    """A greedy stream of up to `max_tokens` on a thread of its own -> (the thread, an event set
    at its first text, one set at its end)."""
    first_token, done = threading.Event(), threading.Event()

    def run():
        stream = client.completions.create(model=model, prompt="def main(", stream=True,
                                           max_tokens=max_tokens, temperature=0)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first_token.set()
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    return worker, first_token, done


def _short_behind_long(tiny_engine, max_num_seqs: int) -> tuple[bool, str]:
    """A 1,000-token-budget stream starts, then a 4-token request: did the short one finish
    while the long one was still streaming? And the short one's text."""
    gen = EngineGenerator(tiny_engine, SpeculativeConfig())
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=max_num_seqs))) as base:
        client = _client(base)
        worker, first_token, long_done = _streaming(client, gen.model_id, 200)
        assert first_token.wait(60)
        short = client.completions.create(model=gen.model_id, prompt="import os", max_tokens=4,
                                          temperature=0).choices[0].text
        alongside = not long_done.is_set()
        worker.join(120)
        return alongside, short


def test_a_short_request_runs_alongside_a_long_one(tiny_engine):
    alongside, short = _short_behind_long(tiny_engine, max_num_seqs=4)
    assert alongside  # it finished while the long stream was still running
    serial, short_serial = _short_behind_long(tiny_engine, max_num_seqs=1)
    assert not serial  # one at a time: it waited for the long one to end
    assert short == short_serial


def test_a_cancelled_stream_frees_its_place(tiny_engine):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig())
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=1))) as base:
        with requests.post(base + "/v1/completions", stream=True, timeout=60,
                           json={"prompt": "def main(", "max_tokens": 200, "stream": True}) as r:
            next(r.iter_lines())  # one event, then the client goes away
        # the only place in the running set is free again: the next request is answered
        text = _client(base).completions.create(model=gen.model_id, prompt="import os", max_tokens=4,
                                                temperature=0).choices[0].text
        assert isinstance(text, str)


@pytest.mark.parametrize("mode,disable_at", [("plain", None), ("mtp", None), ("mtp", 2),
                                             ("dflash", None), ("dflash", 2), ("dflash2 tree", None)])
def test_batched_answers_equal_their_solo_answers(aoti_engine, tiny_prompts, mode, disable_at,
                                                 monkeypatch):
    """On the aoti backend the running requests' rows go through one batched forward per
    iteration (the metrics show more rows than forwards); 32 requests from 32 threads get the
    answers they get alone, drafting or backing off to plain steps under load (those run as
    `PlainRun`s: the decode loop is not resumed at each)."""
    from metrale.runtime.spec.decode import PlainRun

    taken = []
    take = PlainRun.take
    monkeypatch.setattr(PlainRun, "take", lambda self, out: taken.append(1) or take(self, out))
    gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    assert gen.capabilities.batched
    trees = []  # DFlash2's tree package's calls, and the blocks in each
    face = aoti_engine.drafters["dflash2"]
    tree_package = face.tree_package
    monkeypatch.setattr(face, "tree_package",
                        lambda *inputs: trees.append(inputs[3].shape[0]) or tree_package(*inputs))
    tok = aoti_engine.tokenizer
    texts = [tok.decode(p[:12]) for p in tiny_prompts]
    solo = dict(enumerate(solo_answers(gen, texts, 24)))
    limits = ServerLimits(max_num_seqs=32, speculative_disable_by_batch_size=disable_at)
    with serve_in_thread(create_app(gen, limits)) as base:
        client = _client(base)

        def ask(i):
            return i, client.completions.create(model=gen.model_id, prompt=texts[i], max_tokens=24,
                                                temperature=0).choices[0].text

        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, [i % len(texts) for i in range(32)]))
        metrics = requests.get(base + "/metrics", timeout=5).text
    assert all(text == solo[i] for i, text in answers)
    assert bool(taken) == (mode == "plain" or disable_at is not None)  # plain steps, and busy ones
    value = lambda name: float(next(x for x in metrics.splitlines()  # noqa: E731
                                    if x.startswith(f"metrale_scheduler_{name} ")).split()[1])
    assert value("batched_rows_total") > 1.5 * value("batched_forwards_total")  # rows of many sequences
    assert value("peak_running") >= 4
    assert 0 < value("forward_seconds_total") < value("iteration_seconds_total")
    if mode == "mtp" and disable_at is None:  # every drafting sequence's chain link in one head forward
        assert value("head_forwards_total") > 0
        assert value("head_rows_total") > 1.5 * value("head_forwards_total")
    assert bool(trees) == (mode == "dflash2 tree") and (not trees or max(trees) > 1)  # trees' blocks together
    if mode.startswith("dflash") and disable_at is None:  # every drafting sequence's block in one drafter call
        assert value("draft_forwards_total") > 0
        assert value("draft_blocks_total") > 1.5 * value("draft_forwards_total")


def _busy_then_free(gen, prompts: list[list[int]], plain_tokens: int, runs: bool = False,
                    decoders: list | None = None, max_tokens: int = 24) -> list[list[int]]:
    """The sequences' decode loops in one busy batch (plain steps, the target rows of all in one
    batched forward) until each emitted `plain_tokens`, then drafting; -> their tokens. With
    `runs`, greedy plain steps come as `PlainRun`s, driven as the scheduler's `Job` drives them;
    `decoders` gets each sequence's decoder."""
    import torch

    from metrale.runtime.spec.decode import Batch, PlainRun

    batch = Batch(size=len(prompts), speculate=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    emitted = [[] for _ in prompts]
    with torch.inference_mode():
        mine = [gen.decoder() for _ in prompts]
        if decoders is not None:
            decoders.extend(mine)
        loops = [d.steps(p, params, batch, runs=runs) for d, p in zip(mine, prompts)]
        replies, live = [None] * len(prompts), list(range(len(prompts)))
        taking: list = [None] * len(prompts)  # each sequence's run, while it runs
        while live:
            needs = {}
            for i in live:
                while True:
                    run = taking[i]
                    if run is not None:
                        emitted[i].append(run.take(replies[i]))
                        replies[i] = None
                        if run.forward is not None:
                            needs[i] = run.forward
                            break
                        taking[i], replies[i] = None, run
                    try:
                        item = loops[i].send(replies[i])
                    except StopIteration:
                        break
                    replies[i] = None
                    if isinstance(item, PlainRun):
                        taking[i] = item
                        needs[i] = item.forward
                        break
                    if not isinstance(item, list):
                        needs[i] = item
                        break
                    emitted[i] += item
            if min(map(len, emitted)) >= plain_tokens:  # the batch empties: drafting resumes
                batch.size, batch.speculate = 1, True
            for i, out in zip(needs, gen.run_forwards(list(needs.values())) if needs else []):
                replies[i] = out
            live = list(needs)
    return emitted


def _spy_fed(gen, mode: str, monkeypatch, record) -> None:
    """Call `record(cache, rows)` with a copy of every batch of rows fed to an MTP head (its
    hidden states) or a DFlash drafter (its context taps), and the head's or drafter's cache."""
    from metrale.runtime.spec.mtp_proposer import MTPProposer

    if mode == "mtp":
        entries = MTPProposer._entries

        def spy_entries(self, tokens, hidden):
            record(self.cache, hidden.clone())
            return (yield from entries(self, tokens, hidden))

        monkeypatch.setattr(MTPProposer, "_entries", spy_entries)
        return
    drafter = gen.decoder().proposer.drafter
    add_context = drafter.add_context

    def spy_context(rows, cache):
        record(cache, rows.clone())
        return add_context(rows, cache)

    monkeypatch.setattr(drafter, "add_context", spy_context)


@pytest.mark.parametrize("mode", ["mtp", "dflash"])
def test_followed_rows_reach_the_drafter_as_the_target_computed_them(aoti_engine, tiny_prompts, mode,
                                                                    monkeypatch):
    """Two sequences take plain steps in shared batched forwards while their proposers follow
    (on the batched target: catch up on the missed rows when drafting resumes). Then what each
    feeds its MTP head or DFlash drafter is its own sequence's hidden states or taps, position
    for position: those one forward over the whole sequence alone computes."""
    import torch

    gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    fed: dict[int, list[torch.Tensor]] = {}  # per head or drafter cache: the rows fed, in order
    _spy_fed(gen, mode, monkeypatch, lambda cache, rows: fed.setdefault(id(cache), []).append(rows))
    prompts = [tiny_prompts[0][:10], tiny_prompts[1][:14]]
    emitted = _busy_then_free(gen, prompts, plain_tokens=10)
    assert len(fed) == 2
    taps = gen.decoder().proposer.taps
    target = aoti_engine.target
    for rows, prompt, out in zip(fed.values(), prompts, emitted):
        # a chain's or a block's first feed holds the prompt and every followed row
        got = rows[0]
        n = got.shape[1]
        assert n >= len(prompt) + 9  # the followed steps' rows are there
        whole = torch.tensor([(prompt + out)[:n]])
        with torch.inference_mode():
            ref = target(whole, target.new_cache(1, n + 8), taps=taps)
        want = ref.last_hidden if mode == "mtp" else ref.taps
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("runs,chunk", [(False, 64), (True, 64), (True, 4)], ids=["steps", "runs", "chunked"])
@pytest.mark.parametrize("mode", ["mtp", "dflash"])
def test_catching_up_feeds_the_drafter_what_following_each_step_fed(aoti_engine, tiny_prompts, mode,
                                                                    runs, chunk, monkeypatch):
    """On the batched target a busy batch's plain steps keep nothing and the rows run again when
    drafting resumes (`Decoder._catch_up`), in forwards of at most `CATCH_UP_ROWS` (an MTP head
    fed in as many): the head or drafter gets the bits that following every step (whole) fed it,
    the target's cache ends as it did, and every draft, acceptance and token is the same. The
    plain steps carry no taps and the proposer keeps no row meanwhile; so too when the scheduler
    runs them as a `PlainRun` (`runs`), which ends as the batch lets steps draft."""
    import torch

    from metrale.runtime.backends.aoti_batched import BatchedTarget
    from metrale.runtime.spec import decode

    monkeypatch.setattr(decode, "CATCH_UP_ROWS", chunk)

    gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    fed: list[tuple[int, torch.Tensor]] = []
    _spy_fed(gen, mode, monkeypatch, lambda cache, rows: fed.append((id(cache), rows)))
    forwards: list[tuple] = []  # (cache, start, rows, last_logits, taps) of each target forward
    many = BatchedTarget.forward_many

    def spy_many(self, batch):
        forwards.extend((id(f.cache), f.cache.length, f.rows, f.last_logits, f.taps) for f in batch)
        return many(self, batch)

    monkeypatch.setattr(BatchedTarget, "forward_many", spy_many)
    prompts = [tiny_prompts[0][:10], tiny_prompts[1][:14]]
    caught = _busy_then_free(gen, prompts, plain_tokens=10, runs=runs, decoders=(mine := []))
    caught_fed, caught_forwards = fed[:], forwards[:]
    fed.clear()
    forwards.clear()
    monkeypatch.setattr(type(aoti_engine), "rows_invariant", False)  # each plain step followed
    monkeypatch.setattr(decode, "CATCH_UP_ROWS", 64)  # and an MTP head fed them whole
    followed = _busy_then_free(gen, prompts, plain_tokens=10, decoders=(theirs := []))
    assert caught == followed
    for a, b in zip((d.last_result for d in mine), (d.last_result for d in theirs)):  # what each recorded
        assert (a.token_ids, a.steps) == (b.token_ids, b.steps)
        assert (a.metrics.steps, a.metrics.tokens_emitted, a.metrics.drafts_proposed, a.metrics.accepted_at) == \
            (b.metrics.steps, b.metrics.tokens_emitted, b.metrics.drafts_proposed, b.metrics.accepted_at)
    def joined(fed):  # each cache's rows in the order fed, the caches in the order first fed
        return [torch.cat([r for c, r in fed if c == k], dim=1) for k in dict.fromkeys(c for c, _ in fed)]
    assert len(joined(caught_fed)) == len(joined(fed)) == 2 and all(map(torch.equal, joined(caught_fed), joined(fed)))
    for cache in {c for c, *_ in caught_forwards}:
        mine = [f for f in caught_forwards if f[0] == cache]
        again = [i for i, (_, start, _, last, _) in enumerate(mine) if last and start > 0]
        plain = mine[1:again[0]]  # after the prompt: the busy steps, one row each, without taps
        assert len(plain) >= 9 and all(f[2] == 1 and not f[4] for f in plain)
        # the catch-up, when drafting resumed: its forwards in a row, at most `chunk` rows each,
        # with DFlash's tap layers (MTP reads the last hidden), at the busy steps' positions
        assert again == list(range(again[0], again[0] + -(-len(plain) // chunk)))
        assert all(mine[i][4] == gen.decoder().proposer.taps and mine[i][2] <= chunk for i in again)
        assert [mine[i][1] for i in again + [again[-1] + 1]] == \
            [plain[0][1] + sum(mine[j][2] for j in again[:k]) for k in range(len(again) + 1)]


@pytest.mark.parametrize("ending", ["budget", "eos"])
def test_plain_runs_decode_and_record_what_plain_steps_do(aoti_engine, tiny_prompts, ending, monkeypatch):
    """Greedy plain steps run as `PlainRun`s (the scheduler's, the decode loop not resumed at
    each) emit the tokens per-step decoding emits, end where it ends (the budget, or EOS) and
    leave the same result: tokens, finish reason, steps and metrics."""
    gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**MODES["plain"]))
    prompts = [tiny_prompts[0][:10], tiny_prompts[1][:14], tiny_prompts[2][:6]]
    stepped, ran = [], []
    want = _busy_then_free(gen, prompts, 0, decoders=stepped, max_tokens=20)
    if ending == "eos":  # a token each sequence emits midway ends it there, as EOS would
        eos, decoder = frozenset({want[0][7], want[1][5], want[2][9]}), EngineGenerator.decoder

        def with_eos(self, params=None):
            made = decoder(self, params)
            made.eos_ids = eos
            return made
        monkeypatch.setattr(EngineGenerator, "decoder", with_eos)
        stepped.clear()
        want = _busy_then_free(gen, prompts, 0, decoders=stepped, max_tokens=20)
        assert all(len(w) < 20 for w in want)  # EOS ended each
    assert _busy_then_free(gen, prompts, 0, runs=True, decoders=ran, max_tokens=20) == want
    for a, b in zip((d.last_result for d in ran), (d.last_result for d in stepped)):
        assert (a.token_ids, a.finish_reason, len(a.steps)) == (b.token_ids, b.finish_reason, len(b.steps))
        assert (a.metrics.steps, a.metrics.tokens_emitted, a.metrics.verify_rows) == \
            (b.metrics.steps, b.metrics.tokens_emitted, b.metrics.verify_rows) and a.seconds > 0


@pytest.mark.parametrize("mode", ["mtp", "dflash"])
def test_seeded_sampled_answers_do_not_depend_on_the_load(aoti_engine, tiny_prompts, mode):
    """A seeded sampled request drafts as if alone whatever the batch, and its rows are its
    own: under 16 concurrent requests it gets the text it gets alone."""
    gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    texts = [aoti_engine.tokenizer.decode(p[:12]) for p in tiny_prompts]
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=16))) as base:
        client = _client(base)

        def ask(i):
            return client.completions.create(model=gen.model_id, prompt=texts[i % len(texts)], max_tokens=24,
                                             temperature=0.9, seed=i).choices[0].text

        alone = [ask(i) for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(ask, range(16)))
    assert together == alone
    assert len(set(alone)) > 1  # sampled: the seeds matter


def test_speculation_resumes_only_once_the_batch_stayed_small(monkeypatch):
    """With `speculative_disable_by_batch_size` 2: a lone request drafts; once two ran, steps stay
    plain until fewer than two have run for `SPECULATE_AFTER_S` (a closed loop's brief dips do
    not start drafting); without the setting every step may draft."""
    from metrale.runtime.serving import scheduler as S
    from metrale.runtime.spec.decode import Batch

    clock = [100.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: clock[0])
    # its admission alone: with an inbox (here, saying go on) it has no thread running its loop
    sched = S.Scheduler(8, speculative_disable_by_batch_size=2, inbox=lambda wait: True)

    class Running:
        def __init__(self, waiting: bool = False):
            self.waiting = waiting

    def speculates(running: int, at: float) -> bool:
        clock[0], sched.running = at, [Running() for _ in range(running)] + [Running(waiting=True)]
        sched._admit()
        assert sched.batch.size == running  # (a job waiting on its grammar: not counted)
        return sched.batch.speculate

    wait = S.SPECULATE_AFTER_S
    assert speculates(1, 100.0)
    assert not speculates(3, 100.0)
    assert not speculates(1, 100.0 + wait / 2)  # a dip
    assert speculates(1, 100.0 + wait * 1.01)
    assert not speculates(2, 101.0) and not speculates(1, 101.0 + wait * 0.99)
    sched.disable_at, sched.batch = None, Batch()
    assert speculates(30, 102.0)


def test_a_schema_compiles_while_the_other_requests_run(tiny_engine, monkeypatch):
    """A request's schema compiles on the grammar thread (`steps.Wait`): while its compile is
    held, a stream already running goes on to its end; released, the request's answer follows
    the schema. (The server's own check of the schema, which admits it, compiles over the bytes,
    not through `Grammars`.)"""
    from metrale.runtime.spec import grammar

    held, release, calls = threading.Event(), threading.Event(), []
    compile_schema = grammar.Grammars.compile

    def compile_held(self, schema):
        calls.append(threading.current_thread().name)
        held.set()
        release.wait(120)
        return compile_schema(self, schema)

    monkeypatch.setattr(grammar.Grammars, "compile", compile_held)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    gen = EngineGenerator(tiny_engine, SpeculativeConfig())
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=4))) as base:
        client = _client(base)
        answers = {}

        def constrained():
            fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
            answers["text"] = client.completions.create(model=gen.model_id, prompt="x = ", max_tokens=16,
                                                        temperature=0, extra_body={"response_format": fmt}
                                                        ).choices[0].text

        streaming, first_token, long_done = _streaming(client, gen.model_id, 120)
        assert first_token.wait(60)
        workers = [streaming, threading.Thread(target=constrained)]
        workers[1].start()
        try:
            assert held.wait(60)
            assert long_done.wait(60)  # the stream ended while the schema's compile was held
            assert "text" not in answers
        finally:
            release.set()
            for w in workers:
                w.join(120)
    assert json.loads(answers["text"])["n"] is not None and calls == ["metrale-grammar_0"]

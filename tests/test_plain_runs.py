"""A busy batch's plain steps: the batched target's one-row steps (`BatchedTarget._step_plans`, the
forward almost every iteration of a busy server runs) and a `PlainRun` that its request drops
before the run ends (a stop string, a cancel)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from metrale.runtime.steps import Forward
from metrale.runtime.serving.api_request import GenerationRequest
from metrale.runtime.serving.scheduler import Job
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.sampling import SamplingParams


@pytest.mark.parametrize("max_rows", [None, 3], ids=["one-call", "chunked"])
def test_one_row_steps_of_many_sequences_equal_each_alone(aoti_engine, lanes, max_rows, monkeypatch):
    """Decode steps of one row each (tokens given as lists: the quick plan, not `_plan`), of
    ten sequences in two pools at different lengths, their calls on one thread or two and in
    one call or chunks of three rows, give every sequence the bits it gets alone, in the order
    given, and move each cache on by one; a step past its cache is refused before anything
    runs."""
    from metrale.runtime.backends.aoti_batched import BatchedTarget

    target = aoti_engine.target
    if max_rows is not None:
        monkeypatch.setattr(target, "max_rows", max_rows)
    planned, plan = [], BatchedTarget._plan
    monkeypatch.setattr(BatchedTarget, "_plan", lambda self, fs: planned.append(fs) or plan(self, fs))
    gen = torch.Generator().manual_seed(3)
    lengths = (40, 40, 90, 40, 40, 90, 40, 40, 40, 40)  # eight in one pool, two in another
    starts = tuple(int(s) for s in torch.randint(1, 25, (len(lengths),), generator=gen))
    ids = torch.randint(0, target.config.vocab_size, (len(lengths), 30), generator=gen)
    with torch.inference_mode():
        caches = [target.new_cache(1, n) for n in lengths]
        for b, c in enumerate(caches):  # each its own prompt first
            target(ids[b:b + 1, :starts[b]], c)
        planned.clear()
        steps = [Forward([int(ids[b, starts[b]])], c, (0, 1, 3)) for b, c in enumerate(caches)]
        order = [2, 0, 9, 3, 5, 1, 8, 4, 7, 6]
        outs = target.forward_many([steps[b] for b in order])
        assert not planned  # the quick plan
        assert [c.length for c in caches] == [s + 1 for s in starts]
        for b, out in zip(order, outs):
            want = target(ids[b:b + 1, :starts[b] + 1], target.new_cache(1, lengths[b]), taps=(0, 1, 3))
            for field in ("logits", "last_hidden", "taps"):
                assert torch.equal(getattr(out, field)[0, -1], getattr(want, field)[0, -1]), (b, field)
            assert out.argmax == [int(want.logits[0, -1].argmax())]
        full = caches[0]
        full.length = full.max_len
        with pytest.raises(ValueError, match="exceed the cache's"):
            target.forward_many([Forward([1], caches[1]), Forward([1], full)])
        assert caches[1].length == starts[1] + 1 and full.length == full.max_len


def test_steps_beside_a_prompt_the_prefix_cache_holds_whole_take_the_quick_plan(aoti_engine, monkeypatch):
    """A prompt the prefix cache holds whole runs no row, so the steps beside it still take the
    quick plan (no `_plan`, which plans rows one by one); each gets its bits alone."""
    from metrale.runtime.backends.aoti_batched import BatchedTarget
    from metrale.runtime.backends.prefix_cache import PrefixCache

    target = aoti_engine.target
    ids = torch.randint(0, target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(5))
    prompt = ids[0, :20].tolist()
    before, target.prefix_cache = target.prefix_cache, PrefixCache(4096)
    try:
        with torch.inference_mode():
            (kept,) = target.forward_many([Forward(prompt, target.new_cache(1, 40), (), last_logits=True)])
            mid = target.new_cache(1, 40)
            target(ids[:, 20:27], mid)
            planned, plan = [], BatchedTarget._plan
            monkeypatch.setattr(BatchedTarget, "_plan", lambda self, fs: planned.append(fs) or plan(self, fs))
            again = target.new_cache(1, 40)
            step, hit = target.forward_many([Forward([int(ids[0, 27])], mid), Forward(prompt, again, (), last_logits=True)])
            assert not planned and mid.length == 8 and again.length == 20
            want = target(ids[:, 20:28], target.new_cache(1, 40))
            assert torch.equal(step.logits[0, -1], want.logits[0, -1]) and step.argmax == want.argmax[-1:]
            assert torch.equal(hit.logits[0, -1], kept.logits[0, -1]) and hit.argmax == kept.argmax
    finally:
        target.prefix_cache = before


def _drive(gen, job: Job) -> None:
    """`job` to its end, its forwards run one at a time, as the scheduler runs them."""
    with torch.inference_mode():
        while job.advance():
            if job.need is not None:
                job.reply = gen.run_forwards([job.need])[0]
                job.need = None


@pytest.mark.parametrize("ending", ["stop string", "cancel"])
def test_a_run_its_request_drops_midway_records_the_steps_it_took(aoti_engine, tiny_prompts, ending, monkeypatch):
    """A request that ends while its plain steps run as a `PlainRun` (its stop string, or its
    client's cancel, midway) leaves in its result and the server's metrics every step that
    emitted a token, timed up to the last one's output, as when the run ends by itself."""
    gen = EngineGenerator(aoti_engine, SpeculativeConfig())
    prompt = tiny_prompts[0][:12]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    decoders, decoder = [], EngineGenerator.decoder
    monkeypatch.setattr(EngineGenerator, "decoder",
                        lambda self, params=None: decoders.append(decoder(self, params)) or decoders[-1])
    pause = 0.25  # between the cancelling token and the cancel: not a step's time

    def run(stop: tuple[str, ...] = (), cancel_after: int | None = None) -> tuple[list, int, int]:
        events, cancel = [], threading.Event()

        def emit(kind, payload):
            events.append((kind, payload))
            if cancel_after is not None and kind == "text" and len(events) >= cancel_after:
                time.sleep(pause)
                cancel.set()
        _, before = gen.metrics.snapshot()
        job = Job(gen, GenerationRequest(prompt, params, stop, cancel_after is not None, False), emit, cancel, "r",
                  coroutine=True)
        _drive(gen, job)
        assert job.driver is None and job.tokens is None  # dropped with the request
        _, after = gen.metrics.snapshot()
        return events, after.tokens_emitted - before.tokens_emitted, after.steps - before.steps

    whole, emitted, steps = run()
    # the first token comes from the prompt's forward; each later one from a plain step
    assert events_end(whole) == ("length", 24) and emitted == steps == 23
    want = decoders[-1].last_result.token_ids
    text = "".join(p for k, p in whole if k == "text")
    if ending == "stop string":
        cut = aoti_engine.tokenizer.decode(aoti_engine.tokenizer.encode(text)[:10])
        events, emitted, steps = run(stop=(text[len(cut):len(cut) + 3],))
    else:
        events, emitted, steps = run(cancel_after=10)
    kind, taken = events_end(events)
    assert kind == "stop" and 1 < taken < 24
    assert emitted == steps == taken - 1  # each later token a plain step, none lost with the run
    result = decoders[-1].last_result
    assert result.token_ids == want[:taken] and len(result.steps) == taken - 1
    assert 0 < result.metrics.verify_s < pause


def events_end(events: list) -> tuple[str, int]:
    """(finish, tokens) of the last event, a "done" (its drafts, None on a plain server, aside)."""
    assert events[-1][0] == "done" and events[-1][1][2] is None
    return events[-1][1][:2]


@pytest.mark.parametrize("engine", ["tiny_engine", "aoti_engine"])
def test_a_streams_plain_steps_run_as_runs_and_record_what_steps_do(engine, tiny_prompts, request):
    """`Decoder.stream` (generate, bench) runs its greedy plain steps as `PlainRun`s: the tokens
    and the result (token ids, traces, metric counts) are those of per-step decoding, and a
    stream its consumer leaves midway records the steps it yielded."""
    from metrale.runtime.backends import run_forwards
    from metrale.runtime.spec.decode import ALONE

    gen = EngineGenerator(request.getfixturevalue(engine), SpeculativeConfig())
    params = SamplingParams(temperature=0.0, max_tokens=20)
    for prompt in tiny_prompts[:3]:
        stepped, reply, tokens = gen.decoder(), None, []
        loop = stepped.steps(prompt, params, ALONE, runs=False)
        with torch.inference_mode():
            for need in iter(lambda: loop.send(reply), None):  # per step, the loop resumed at each
                if isinstance(need, list):
                    tokens += need
                    reply = None
                else:
                    reply = run_forwards(gen.engine.target, [need])[0]
        ran = gen.decoder()
        assert list(ran.stream(prompt, params)) == tokens == stepped.last_result.token_ids
        a, b = ran.last_result, stepped.last_result
        assert (a.token_ids, a.steps, a.finish_reason) == (b.token_ids, b.steps, b.finish_reason)
        assert (a.metrics.steps, a.metrics.tokens_emitted, a.metrics.verify_rows) == \
            (b.metrics.steps, b.metrics.tokens_emitted, b.metrics.verify_rows)
        left = gen.decoder()
        stream = left.stream(prompt, params)
        taken = [next(stream) for _ in range(7)]
        stream.close()
        assert left.last_result.token_ids == taken == tokens[:7] and len(left.last_result.steps) == 6
        _, before = gen.metrics.snapshot()
        served = gen.stream(prompt, params)  # the server's face of a stream: its metrics too
        assert [next(served) for _ in range(7)] == taken
        served.close()
        _, after = gen.metrics.snapshot()
        assert after.steps - before.steps == after.tokens_emitted - before.tokens_emitted == 6

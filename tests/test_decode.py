"""The speculative loop on the tiny models: exact verify reproduces plain greedy decoding in every
mode; the confidence stop changes which drafts are verified, never the emitted tokens."""

from __future__ import annotations

import pytest
import torch

from metrale.runtime.backends import run_forwards

from metrale.runtime.spec.adaptive_k import AdaptiveKController
from metrale.runtime.spec.decode import PlainRun
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)

MODES = {
    "mtp k=1": dict(speculative=True, num_drafts=1),
    "mtp k=2": dict(speculative=True, num_drafts=2),
    "mtp k=3": dict(speculative=True, num_drafts=3),
    "mtp k=3 stop 0.7": dict(speculative=True, num_drafts=3, draft_confidence_stop="0.7"),
    "mtp k=3 stop cum:0.5": dict(speculative=True, num_drafts=3, draft_confidence_stop="cum:0.5"),
    "dflash full γ": dict(dflash=True),
    "dflash γ=3": dict(dflash=True, dflash_gamma=3),
    "dflash ladder": dict(dflash=True, dflash_draft_ladder="1,3,7"),
    "dflash adaptive-k": dict(dflash=True, dflash_adaptive_k="0:32,1:44,2:50,3:56", dflash_reprobe_interval=2),
    "dflash2 full γ": dict(dflash=True, dflash_drafter="dflash2"),
    "dflash2 ladder": dict(dflash=True, dflash_drafter="dflash2", dflash_draft_ladder="1,3"),
}


def run(engine, prompts, params=GREEDY, **flags):
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))
    return [gen.decoder().generate(p, params) for p in prompts]


@pytest.fixture(scope="module")
def plain(tiny_engine, tiny_prompts):
    return [r.token_ids for r in run(tiny_engine, tiny_prompts)]


@pytest.mark.parametrize("mode", list(MODES))
def test_exact_verify_equals_plain_greedy(tiny_engine, tiny_prompts, plain, mode):
    results = run(tiny_engine, tiny_prompts, exact_verify=True, **MODES[mode])
    assert [r.token_ids for r in results] == plain
    steps = sum(r.metrics.steps for r in results)
    emitted = sum(r.metrics.tokens_emitted for r in results)
    # every step emits at least its own token; drafts were actually accepted somewhere
    assert emitted == sum(len(p) for p in plain) - len(plain)  # the first token comes from prefill
    if "adaptive" not in mode:
        assert emitted > steps, f"{mode}: no draft was ever accepted"


@pytest.mark.parametrize("mode", ["mtp k=3", "dflash full γ", "dflash2 full γ"])
def test_chunkwise_verify_accepts_drafts(tiny_engine, tiny_prompts, plain, mode):
    results = run(tiny_engine, tiny_prompts, **MODES[mode])
    m = results[0].metrics
    for r in results[1:]:
        m.merge(r.metrics)
    assert m.tau > 1.2  # drafters trained on the target's greedy text are accepted
    assert m.verify_rows == m.steps + m.drafts_verified  # one forward of k+1 rows per step
    # a one-forward verify may flip a near-tie, but on this model it agrees nearly everywhere
    same = sum(a == b.token_ids for a, b in zip(plain, results))
    assert same >= len(plain) - 1


def test_confidence_stop_verifies_fewer_drafts_same_tokens(tiny_engine, tiny_prompts):
    full = run(tiny_engine, tiny_prompts, speculative=True, num_drafts=3, exact_verify=True)
    for stop in ("0.9", "cum:0.9"):
        stopped = run(tiny_engine, tiny_prompts, speculative=True, num_drafts=3, exact_verify=True,
                      draft_confidence_stop=stop)
        assert [r.token_ids for r in stopped] == [r.token_ids for r in full]
        verified = sum(r.metrics.drafts_verified for r in stopped)
        assert verified < sum(r.metrics.drafts_verified for r in full)
        # the draft that trips the stop is still verified: every step verifies at least one
        # (but the last, when only one token of the budget is left)
        assert all(s.drafted >= 1 for r in stopped for s in r.steps[:-1])


def test_adaptive_k_suspends_when_plain_is_cheaper(tiny_engine, tiny_prompts, monkeypatch):
    """A cost model where drafts pay only if all are accepted: k = 0 except for the re-probes,
    whose intervals double while they leave the stream suspended (as often as the interval
    allows: the probes' cost budget out of the way); one where even that cannot pay: no probe
    at all."""
    monkeypatch.setattr(AdaptiveKController, "PROBE_BUDGET", float("inf"))
    results = run(tiny_engine, tiny_prompts[:1], dflash=True, dflash_adaptive_k="0:1,1:1.99,2:2.99",
                  dflash_reprobe_interval=4, exact_verify=True)
    drafted = [s.drafted for s in results[0].steps]
    assert drafted.count(0) > len(drafted) // 2
    probes = [i for i, d in enumerate(drafted) if d > 0]
    assert probes, "the re-probe never ran"
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(g >= 4 for g in gaps) and gaps == sorted(gaps)
    hopeless = run(tiny_engine, tiny_prompts[:1], dflash=True, dflash_adaptive_k="0:1,1:1000,2:2000",
                   dflash_reprobe_interval=4, exact_verify=True)[0]
    assert all(s.drafted == 0 for s in hopeless.steps)


def test_sampling_with_seed_is_reproducible(tiny_engine, tiny_prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24)
    a = run(tiny_engine, tiny_prompts[:2], params, dflash=True)
    b = run(tiny_engine, tiny_prompts[:2], params, dflash=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(0 <= t < tiny_engine.target.config.vocab_size for r in a for t in r.token_ids)


@pytest.mark.parametrize("flags", [{}, dict(speculative=True, num_drafts=3)], ids=["plain", "mtp"])
def test_prompts_outside_the_vocabulary_are_refused(tiny_engine, flags):
    """The compiled steps index without checks: the decode loop refuses an empty prompt and
    any id below 0 or past the vocabulary before a forward runs."""
    vocab = tiny_engine.target.config.vocab_size
    decoder = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**flags)).decoder()
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([], GREEDY)
    for ids in ([5, -1, 7], [5, vocab, 7], [vocab + 100]):
        with pytest.raises(ValueError, match=rf"prompt token ids must lie in \[0, {vocab}\)"):
            decoder.generate(ids, GREEDY)
    assert len(decoder.generate([0, vocab - 1], SamplingParams(temperature=0.0, max_tokens=3)).token_ids) >= 1


def test_eos_and_max_tokens_stop(tiny_engine, tiny_prompts):
    r = run(tiny_engine, tiny_prompts[:1], SamplingParams(temperature=0.0, max_tokens=5), speculative=True)[0]
    assert len(r.token_ids) <= 5
    assert r.finish_reason in ("length", "stop")
    assert torch.tensor(r.token_ids).numel() == len(r.token_ids)


@pytest.mark.parametrize("flags", [dict(speculative=True, num_drafts=3), dict(dflash=True)])
def test_a_busy_batch_makes_steps_plain_and_the_drafter_waits(tiny_engine, tiny_prompts, plain, flags, monkeypatch):
    """`Batch.speculate` False (a scheduler's batch at its back-off size): every step is plain,
    the MTP head never runs (its entries wait for a chain that never comes), greedy text is
    plain decoding's; drafting resumes with complete context once the batch allows it."""
    from metrale.runtime.backends import run_forwards
    from metrale.runtime.spec.decode import Batch

    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**flags))
    head_calls = []
    if tiny_engine.mtp is not None:
        real = type(tiny_engine.mtp).__call__
        monkeypatch.setattr(type(tiny_engine.mtp), "__call__",
                            lambda self, *a, **k: (head_calls.append(1), real(self, *a, **k))[1])
    for ids, want in zip(tiny_prompts, plain):
        decoder = gen.decoder()
        batch = Batch(size=3, speculate=False)
        steps, reply, got = decoder.steps(ids, GREEDY, batch), None, []
        with torch.inference_mode():  # as a scheduler's model thread runs the coroutine
            while True:
                try:
                    need = steps.send(reply)
                except StopIteration:
                    break
                if isinstance(need, list):
                    got += need
                    reply = None
                    if len(got) >= 12:  # the batch empties: drafting resumes
                        batch.size, batch.speculate = 1, True
                else:
                    reply = run_forwards(tiny_engine.target, [need])[0]
        assert got == want
        drafted = [s.drafted for s in decoder.last_result.steps]
        assert not any(drafted[:10]) and any(drafted[12:])
    if flags.get("speculative"):
        assert head_calls  # it ran once drafting resumed


def test_argmax_rows_is_torch_argmax():
    """The greedy token of each row, numpy's way on float32 CPU rows and torch's otherwise:
    the same ids, ties going to the first maximum, strided views included."""
    from metrale.runtime.backends import argmax_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 2048, generator=gen)
    logits[3, 7] = logits[3, 900] = logits[3].max() + 1  # a tie: the lower id wins
    logits[5, :] = 0.5  # a constant row: id 0
    for x in (logits, logits[::3], logits[:, :1000], logits.to(torch.bfloat16)):
        assert argmax_rows(x) == x.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[3] == 7 and argmax_rows(logits)[5] == 0


def test_a_suspended_adaptive_stream_runs_plain_decodings_steps(tiny_engine, tiny_prompts, monkeypatch):
    """Between its probes a suspended adaptive-k stream takes plain decoding's path: the loop
    yields one `PlainRun` for the plain steps up to the next probe (not a propose and a
    one-row verify per step), the proposer is asked for a count once per run and once per
    probe, every step's row is followed (the drafter's context complete at each probe), and
    the tokens, step traces and metrics are those of the per-step path."""
    monkeypatch.setattr(AdaptiveKController, "PROBE_BUDGET", float("inf"))  # probes every 4
    flags = dict(dflash=True, dflash_drafter="dflash2", dflash_adaptive_k="0:1,1:1.7,2:2.4,3:3.1",
                 dflash_reprobe_interval=4)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**flags))
    plain = EngineGenerator(tiny_engine).generate(tiny_prompts[0], params)
    add = tiny_engine.drafters["dflash2"].add_context

    def drive(runs: bool):
        decoder = gen.decoder()
        counts, fed, followed = [], [], []
        proposer = decoder.proposer
        count = proposer.draft_count
        monkeypatch.setattr(proposer, "draft_count", lambda: (counts.append(1), count())[1])
        follow = proposer.follow
        monkeypatch.setattr(proposer, "follow", lambda out, ids: (followed.append(len(ids)), follow(out, ids))[1])
        monkeypatch.setattr(proposer.drafter, "add_context", lambda f, c: (fed.append(f.shape[1]), add(f, c))[1])
        items, reply = [], None
        steps = decoder.steps(tiny_prompts[0], params, runs=runs)
        with torch.inference_mode():
            for item in iter(lambda: steps.send(reply), None):
                items.append(type(item).__name__)
                if type(item) is PlainRun:
                    while item.forward is not None:
                        item.take(run_forwards(decoder.target, [item.forward])[0])
                    reply = item
                elif isinstance(item, list):
                    reply = None
                else:
                    reply = run_forwards(decoder.target, [item])[0]
        return decoder.last_result, items, counts, fed, followed

    per_step, step_items, step_counts, step_fed, _ = drive(runs=False)
    res, items, counts, fed, followed = drive(runs=True)
    assert res.token_ids == per_step.token_ids == plain.token_ids
    assert res.steps == per_step.steps and res.metrics.steps == per_step.metrics.steps
    assert res.metrics.drafts_verified == per_step.metrics.drafts_verified
    assert fed == step_fed  # the drafter saw the same context at every probe
    probes = sum(1 for s in res.steps if s.drafted)
    assert probes >= 2 and len(fed) == probes  # suspended, with probes (each feeding the drafter)
    plain_steps = len(res.steps) - probes
    assert sum(followed) == plain_steps  # every plain step's row followed, one at a time
    runs = items.count("PlainRun")
    assert 0 < runs <= probes + 1 and len(counts) == runs + probes  # a count per run, not per step
    # per step: a count at every step but a last one with room for no draft
    assert len(step_counts) >= len(res.steps) - 1 > 3 * len(counts) and "PlainRun" not in step_items
    assert items.count("Forward") == probes + 1  # the prompt, then a verify per probe


def test_busy_batch_steps_of_a_suspended_stream_still_catch_up(tiny_engine, tiny_prompts):
    """A suspended adaptive stream whose batch stops letting it draft, then lets it again,
    emits plain decoding's tokens (runs of both kinds in one stream)."""
    from metrale.runtime.spec.decode import Batch

    flags = dict(dflash=True, dflash_adaptive_k="0:1,1:1.2,2:1.3,3:1.4,4:1.5,5:1.6,6:1.7,7:1.8",
                 dflash_reprobe_interval=2)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    decoder = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**flags)).decoder()
    plain = EngineGenerator(tiny_engine).generate(tiny_prompts[1], params)
    batch, reply, n = Batch(), None, 0
    steps = decoder.steps(tiny_prompts[1], params, batch=batch, runs=True)
    with torch.inference_mode():
        for item in iter(lambda: steps.send(reply), None):
            n += 1
            batch.size, batch.speculate = (3, False) if (n // 7) % 2 else (1, True)
            if type(item) is PlainRun:
                while item.forward is not None:
                    item.take(run_forwards(decoder.target, [item.forward])[0])
                    batch.size, batch.speculate = (1, True) if batch.size == 3 else (3, False)
                reply = item
            elif isinstance(item, list):
                reply = None
            else:
                reply = run_forwards(decoder.target, [item])[0]
    assert decoder.last_result.token_ids == plain.token_ids

"""The DFlash proposer feeds the drafter's context lazily: the prompt's and kept rows' taps wait
until the next propose and then enter in one `add_context` (the drafter's cache made then), so a
request that never drafts pays nothing for the drafter and a suspended stream nothing per plain
step, while every draft still sees the whole context."""

import torch

from metrale.runtime.models.qwen3 import TargetOutput
from metrale.runtime.spec.dflash_proposer import DFlashProposer
from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash


def _proposer(engine, adaptive_k=None):
    drafter = engine.drafters["dflash"]
    spec = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k=adaptive_k)
    return DFlashProposer(drafter, engine.target.model.embed_tokens,
                          resolve_dflash(spec, drafter.config.block_size), 128)


def _out(taps: torch.Tensor) -> TargetOutput:
    return TargetOutput(logits=torch.zeros(1, taps.shape[1], 4), last_hidden=taps[..., :4], taps=taps)


def test_context_waits_for_the_next_propose_and_matches_eager_feeding(tiny_engine):
    gen = torch.Generator().manual_seed(0)
    width = tiny_engine.drafters["dflash"].config.num_context_features * 128
    feats = torch.randn(1, 12, width, generator=gen)
    lazy, eager = _proposer(tiny_engine), _proposer(tiny_engine)
    with torch.inference_mode():
        for p in (lazy, eager):
            p.prefill([], _out(feats[:, :6]), pending=5)
        eager._feed()  # the prompt's context in the drafter's cache at once
        assert eager.cache.length == 6
        for a, b in ((6, 7), (7, 9), (9, 12)):  # three steps keep 1, 2 and 3 rows
            lazy.accept(_out(feats[:, a:b + 2]), b - a, torch.zeros(b - a, dtype=torch.long))
            eager.drafter.add_context(feats[:, a:b], eager.cache)  # what feeding at once does
        assert lazy.cache is None and len(lazy.unfed) == 4  # nothing fed yet, not even made
        drafts, _ = lazy.propose(pending=5, max_drafts=7)
        assert lazy.cache.length == 12 == eager.cache.length and lazy.unfed == []
        n = lazy.cache.length
        assert torch.allclose(lazy.cache.k[:, :, :, :n], eager.cache.k[:, :, :, :n], atol=1e-5)
        assert torch.equal(drafts, eager.propose(pending=5, max_drafts=7)[0])


def test_a_suspended_stream_feeds_nothing_per_plain_step(tiny_engine, tiny_prompts, monkeypatch):
    """Adaptive k with a table that makes plain steps pay: between re-probes the drafter's
    cache stands still, and the output is plain decoding's."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator

    # plain steps pay at any acceptance below 1, yet full acceptance would pay: it probes (as
    # often as the interval allows: the probes' cost budget out of the way)
    from metrale.runtime.spec.adaptive_k import AdaptiveKController

    monkeypatch.setattr(AdaptiveKController, "PROBE_BUDGET", float("inf"))
    costly = "0:1,1:1.95,2:2.95,3:3.95,4:4.95,5:5.95,6:6.95,7:7.95"
    spec = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k=costly, dflash_reprobe_interval=8,
                                        exact_verify=True)
    gen = EngineGenerator(tiny_engine, spec)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    decoder = gen.decoder()
    fed = []
    proposer = decoder.proposer
    real = proposer.drafter.add_context
    monkeypatch.setattr(proposer.drafter, "add_context",
                        lambda f, c: (fed.append(f.shape[1]), real(f, c))[1])
    res = decoder.generate(tiny_prompts[0], params)
    assert res.token_ids == EngineGenerator(tiny_engine).generate(tiny_prompts[0], params).token_ids
    plain_steps = sum(1 for s in res.steps if s.drafted == 0)
    assert plain_steps > 10 and res.metrics.drafts_verified > 0  # suspended, with probes
    assert len(fed) <= 1 + (len(res.steps) - plain_steps)  # prefill + one feed per propose


def test_a_settled_stream_retires_its_drafter(tiny_engine, tiny_prompts, monkeypatch):
    """A table where no count could pay even with every draft accepted: the controller settles
    on plain decoding at the first step, and the loop then neither proposes nor asks the target
    for taps; the text is plain decoding's."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator

    spec = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="0:1,1:50,2:50,3:50,4:50,5:50,6:50,7:50")
    decoder = EngineGenerator(tiny_engine, spec).decoder()
    asked = []
    real = decoder.target.__class__.__call__
    monkeypatch.setattr(decoder.target.__class__, "__call__",
                        lambda self, *a, **k: (asked.append(k.get("taps", ())), real(self, *a, **k))[1])
    params = SamplingParams(temperature=0.0, max_tokens=24)
    res = decoder.generate(tiny_prompts[0], params)
    assert decoder.proposer.controller.settled and decoder.proposer.off
    assert all(s.drafted == 0 for s in res.steps)
    assert asked[0] and not any(asked[2:])  # the prompt's taps, then none once settled
    assert res.token_ids == EngineGenerator(tiny_engine).generate(tiny_prompts[0], params).token_ids


def test_adaptive_k_sets_the_count_only_for_a_stream_that_runs_alone(tiny_engine):
    """With other sequences in the batch the count is γ−1 (no ladder here), not the cost
    model's; a plain step of a busy batch (max_drafts 0) runs nothing of the drafter."""
    costly = "0:1,1:1.95,2:2.95,3:3.95,4:4.95,5:5.95,6:6.95,7:7.95"  # plain steps pay
    p = _proposer(tiny_engine, adaptive_k=costly)
    width = tiny_engine.drafters["dflash"].config.num_context_features * 128
    with torch.inference_mode():
        p.prefill([], _out(torch.randn(1, 6, width)), pending=5)
        p.batch_size = 4
        assert p.draft_count() == p.settings.max_drafts
        drafts, proposed = p.propose(pending=5, max_drafts=0)
        assert drafts.numel() == 0 and proposed == 0 and p.cache is None  # no cache even made
        p.batch_size = 1
        assert p.draft_count() == p.controller.next_k()

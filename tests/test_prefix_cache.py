"""Prefix caching (`backends.prefix_cache`): which kept prompt a prompt reuses, and on the aoti
backend's batched target that a prompt reusing kept positions gets the bits of its full prefill,
its cache the same K/V, so every later step and answer is unchanged."""

from __future__ import annotations

import pytest
import requests
import torch

from metrale.runtime.backends.prefix_cache import BLOCK, PrefixCache


def _keep(cache: PrefixCache, tokens):
    n = len(tokens)
    cache.keep(tuple(tokens), torch.zeros(1, 2, 4, n), torch.zeros(1, n, 2, 4), torch.zeros(n, 3), None,
               torch.zeros(1, 5), [0])


def test_lookup_finds_the_longest_kept_prefix_in_whole_blocks():
    cache = PrefixCache(1000)
    a = list(range(40))
    _keep(cache, a)
    hit = cache.lookup(tuple(a))
    assert hit.whole and hit.reused == 40  # the same prompt: all of it
    hit = cache.lookup(tuple(a[:35] + [99] * 10))
    assert not hit.whole and hit.reused == 2 * BLOCK  # whole blocks only
    assert cache.lookup(tuple(a[:32])).reused == BLOCK  # its last row must run: at most n - 1
    assert cache.lookup(tuple([7] + a[1:])) is None  # differs in the first block
    assert cache.lookup(tuple(a[:10])) is None  # shorter than a block
    assert cache.queried == 40 + 45 + 32 + 40 + 10 and cache.reused == 40 + 32 + 16


def test_kept_prompts_are_evicted_least_recently_used_first():
    cache = PrefixCache(100)
    first, second, third = list(range(40)), list(range(100, 140)), list(range(200, 240))
    _keep(cache, first)
    _keep(cache, second)
    assert cache.lookup(tuple(first)).whole  # first is now the most recently used
    _keep(cache, third)  # 120 > 100 positions: second goes
    assert cache.tokens == 80 and cache.lookup(tuple(second)) is None
    assert cache.lookup(tuple(first)).whole and cache.lookup(tuple(third)).whole
    assert cache.lookup(tuple(second[:33])) is None  # its blocks went with it
    _keep(cache, list(range(500, 700)))  # longer than the whole cache: not kept
    assert cache.tokens == 80
    with pytest.raises(ValueError, match="at least one token"):
        PrefixCache(0)


@pytest.fixture()
def target(aoti_engine_dir):
    from metrale.runtime.backends import load_engine

    return load_engine(aoti_engine_dir, backend="aoti").target


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, vocab, (1, 45), generator=g)
    return [a, torch.cat([a[:, :37], torch.randint(0, vocab, (1, 6), generator=g)], 1), a.clone(),
            torch.randint(0, vocab, (1, 20), generator=g), a[:, :33].clone()]


def _run(target, prompts, together: bool):
    """Each prompt's forward (all in one batched forward, or one by one) then two decode steps;
    -> per prompt its outputs and its cache's K/V."""
    from metrale.runtime.steps import Forward

    caches = [target.new_cache(1, 80) for _ in prompts]
    firsts = [Forward(p, c, (0, 1, 3), last_logits=True) for p, c in zip(prompts, caches)]
    outs = target.forward_many(firsts) if together else [target.forward_many([f])[0] for f in firsts]
    seen = [[o] for o in outs]
    for _ in range(2):
        steps = [Forward(torch.tensor([[s[-1].argmax[-1]]]), c, (0, 1, 3)) for s, c in zip(seen, caches)]
        for s, o in zip(seen, target.forward_many(steps)):
            s.append(o)
    kv = [[t[c.index][..., :c.length] if j % 2 == 0 else t[c.index][:c.length]
           for j, t in enumerate(c.pool.kv)] for c in caches]
    return seen, kv


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "in-one-forward"])
def test_reused_prefixes_give_the_bits_of_a_full_prefill(target, together):
    prompts = _prompts(target.config.vocab_size)
    with torch.inference_mode():
        want, want_kv = _run(target, prompts, together)
        target.prefix_cache = PrefixCache(4096)
        _run(target, prompts[:1], together)  # the first prompt kept; then every prompt again
        got, got_kv = _run(target, prompts, together)
    cache = target.prefix_cache
    assert cache.reused >= 45 + 32 + 45 + 32  # whole and partial hits both happened
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            for field in ("logits", "last_hidden", "taps"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field
            assert a.argmax == b.argmax
    assert all(torch.equal(x, y) for w, g in zip(want_kv, got_kv) for x, y in zip(w, g))


def test_a_forward_counts_the_rows_the_prefix_cache_served(target):
    """`Forward.served`: a prompt's positions that came from the cache (none when nothing was
    kept, all of a prompt kept whole, whole blocks of one sharing a prefix)."""
    from metrale.runtime.steps import Forward

    a, shares, same = _prompts(target.config.vocab_size)[:3]
    target.prefix_cache = PrefixCache(4096)
    with torch.inference_mode():
        forwards = [Forward(p, target.new_cache(1, 80), (), last_logits=True) for p in (a, same, shares)]
        target.forward_many(forwards[:1])
        target.forward_many(forwards[1:])
    assert [f.served for f in forwards] == [0, 45, 2 * BLOCK]


def test_a_failed_forward_leaves_a_hit_prompts_cache_empty(target, monkeypatch):
    from metrale.runtime.steps import Forward

    prompt = _prompts(target.config.vocab_size)[0]
    target.prefix_cache = PrefixCache(4096)
    with torch.inference_mode():
        target.forward_many([Forward(prompt, target.new_cache(1, 80), (), last_logits=True)])
        partial = torch.cat([prompt[:, :40], prompt[:, :3]], 1)
        cache = target.new_cache(1, 80)

        def boom(*inputs):
            raise RuntimeError("the package failed")

        monkeypatch.setattr(target, "package", boom)
        with pytest.raises(RuntimeError, match="the package failed"):
            target.forward_many([Forward(partial, cache, (), last_logits=True)])
    assert cache.length == 0  # a retry starts the prompt from its first position again


def test_serve_reports_prefix_cache_hits(aoti_engine_dir, tiny_prompts):
    """Through HTTP: the same prompt twice and one sharing its first block answer as without
    the cache, and /metrics counts the reused positions."""
    from openai import OpenAI

    from conftest import serve_in_thread
    from metrale.runtime.backends import load_engine
    from metrale.runtime.serving.http_guard import ServerLimits
    from metrale.runtime.serving.server import create_app
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.sampling import SamplingParams

    engine = load_engine(aoti_engine_dir, backend="aoti")
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(speculative=True, num_drafts=3))
    tok = engine.tokenizer
    base_ids = [t for p in tiny_prompts for t in p][:40]
    texts = [tok.decode(base_ids), tok.decode(base_ids), tok.decode(base_ids[:20] + base_ids[:12])]
    solo = []
    for text in texts:
        res = gen.generate(tok.encode(text), SamplingParams(temperature=0.0, max_tokens=16))
        solo.append(tok.decode([t for t in res.token_ids if t not in tok.eos_token_ids]))
    assert gen.cache_prefixes(4096) is not None
    with serve_in_thread(create_app(gen, ServerLimits())) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = [client.completions.create(model=gen.model_id, prompt=t, max_tokens=16,
                                         temperature=0).choices[0].text for t in texts]
        metrics = requests.get(base + "/metrics", timeout=5).text
    assert got == solo
    value = lambda name: float(next(x for x in metrics.splitlines()  # noqa: E731
                                    if x.startswith(f"metrale_prefix_cache_{name} ")).split()[1])
    assert value("hits_total") >= BLOCK + len(tok.encode(texts[1])) and value("queries_total") > value("hits_total")
    assert value("tokens") > 0
    metric = lambda name: float(next(x for x in metrics.splitlines()  # noqa: E731
                                     if x.startswith(f"metrale_{name} ")).split()[1])
    # the rows run: the prompts' positions the cache did not hold, then every step's verify rows
    assert metric("scheduler_batched_rows_total") == (
        value("queries_total") - value("hits_total") + metric("spec_decode_verify_rows_total"))

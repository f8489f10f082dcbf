"""Draft trees in the decode loop (`--dflash-tree-budget`, `Decoder._tree_step`): greedy tree
verification emits plain decoding's tokens (exact verify: the path's rows are plain decoding's
rows; chunkwise: one forward with tree attention over the cache, the path's K/V moved into
place), sampled tree verification is reproducible per seed, trees run batched in the server,
and backends without tree attention refuse the flag by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from metrale.runtime.errors import ConfigError
from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.server import create_app
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.sampling import SamplingParams

from conftest import serve_in_thread

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "chunkwise"])
def test_greedy_trees_emit_plain_decoding(tiny_engine, tiny_prompts, drafter, exact):
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    chain = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter=drafter,
                                                                      exact_verify=exact))
    tree = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(
        dflash=True, dflash_drafter=drafter, exact_verify=exact, dflash_tree_budget=16))
    tree_tau = chain_tau = 0.0
    for p in tiny_prompts:
        want = plain.generate(p, GREEDY).token_ids
        got = tree.generate(p, GREEDY)
        assert got.token_ids == want
        assert max(s.drafted for s in got.steps) == 16 and all(s.accepted <= s.drafted for s in got.steps)
        tree_tau += got.metrics.tau or 0.0
        chain_tau += chain.generate(p, GREEDY).metrics.tau or 0.0
    assert tree_tau > chain_tau  # the tree accepts more per verify than the chain on these prompts


def test_a_requests_draft_cap_caps_its_tree(tiny_engine, tiny_prompts):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16))
    r = gen.generate(tiny_prompts[0], SamplingParams(temperature=0.0, max_tokens=40, max_drafts=5))
    assert max(s.drafted for s in r.steps) == 5
    assert r.token_ids == EngineGenerator(tiny_engine, SpeculativeConfig()).generate(tiny_prompts[0], GREEDY).token_ids


def test_sampled_trees_are_reproducible_per_seed(tiny_engine, tiny_prompts):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2",
                                                                    dflash_tree_budget=16))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40)
    a, b = gen.generate(tiny_prompts[1], params), gen.generate(tiny_prompts[1], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 40
    assert any(s.accepted for s in a.steps)
    other = gen.generate(tiny_prompts[1], SamplingParams(temperature=0.8, top_p=0.95, seed=12, max_tokens=40))
    assert other.token_ids != a.token_ids


def test_trees_serve_batched_with_their_solo_answers(tiny_engine, tiny_prompts):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16))
    tok = tiny_engine.tokenizer
    texts = [tok.decode(p[:12]) for p in tiny_prompts]
    solo = []
    for text in texts:
        ids = gen.generate(tok.encode(text), SamplingParams(temperature=0.0, max_tokens=24)).token_ids
        solo.append(tok.decode([i for i in ids if i not in tok.eos_token_ids]))
    limits = ServerLimits(max_num_seqs=8, speculative_disable_by_batch_size=None)
    with serve_in_thread(create_app(gen, limits)) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int):
            r = client.completions.create(model=gen.model_id, prompt=texts[i % len(texts)], max_tokens=24,
                                          temperature=0)
            return i % len(texts), r

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(16)))
    for i, r in answers:
        assert r.choices[0].text == solo[i]
        spec = r.usage.model_extra["speculative"]
        assert spec["drafts_verified"] >= 16 and spec["drafts_accepted"] > 0


def test_trees_on_the_cpu_packages_emit_plain_decoding(aoti_engine, tiny_prompts):
    """On the aoti backend a tree's rows and its block's distributions come from the eager
    modules over the packages' own caches (pooled): greedy trees under exact verify emit plain
    decoding's tokens, and chunkwise ones too on these prompts; batched in the scheduler's
    forwards beside other sequences' package rows."""
    plain = EngineGenerator(aoti_engine, SpeculativeConfig())
    for drafter in ("dflash", "dflash2"):
        for exact in (True, False):
            gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(
                dflash=True, dflash_drafter=drafter, exact_verify=exact, dflash_tree_budget=16))
            for p in tiny_prompts[:2]:
                got = gen.generate(p, GREEDY)
                assert got.token_ids == plain.generate(p, GREEDY).token_ids, (drafter, exact)
                assert max(s.drafted for s in got.steps) == 16 and any(s.accepted for s in got.steps)


def test_backends_without_tree_attention_refuse_the_flag(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    onnx = load_engine(tiny_engine_dir, backend="torch")
    onnx.backend = __import__("metrale.runtime.backend_registry", fromlist=["BACKENDS"]).BACKENDS["onnxruntime"]
    with pytest.raises(ConfigError, match="--dflash-tree-budget 16: the onnxruntime backend verifies no draft tree"):
        EngineGenerator(onnx, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16))


def test_trees_on_the_cuda_graph_target_emit_plain_decoding(tiny_engine_dir, tiny_prompts):
    """On a target whose steps are CUDA graphs (the capture stand-in here) a tree's rows run
    the eager model over the graphs' static caches (`step_caches.TreeSlotKV`); its chains and
    plain steps replay the graphs."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    assert engine.backend.draft_trees
    plain = EngineGenerator(engine, SpeculativeConfig())
    for drafter in ("dflash", "dflash2"):
        gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter=drafter,
                                                                   exact_verify=True, dflash_tree_budget=16))
        for p in tiny_prompts[:2]:
            got = gen.generate(p, GREEDY)
            assert got.token_ids == plain.generate(p, GREEDY).token_ids, drafter
            assert max(s.drafted for s in got.steps) == 16


@pytest.mark.parametrize("layout", ["slots", "pooled"])
def test_tree_rows_over_the_compiled_caches_are_the_eager_caches_rows(tiny_engine, tiny_prompts, layout):
    """`TreeSlotKV` (one sequence, slot-major) and `TreePooledKV` (a place in a pool) give a
    tree's rows the values `TreeKV` gives them over the eager cache, and `keep_path` leaves
    each cache holding the same K/V at the path's positions."""
    import torch

    from metrale.runtime.backends.aoti import StaticKVCache
    from metrale.runtime.backends.kv_pool import KVPool, PooledCache
    from metrale.runtime.models.step_caches import TreeKV, TreePooledKV, TreeSlotKV
    from metrale.runtime.spec.ddtree import build_tree

    target, c = tiny_engine.target, tiny_engine.target.config
    context = tiny_prompts[1][:11]
    g = torch.Generator().manual_seed(4)
    tree = build_tree(3, torch.log_softmax(torch.randn(5, c.vocab_size, generator=g) * 3, -1), 12)
    ids = torch.tensor([list(tree.tokens)])
    with torch.inference_mode():
        ref = target.new_cache(1, 64)
        target(torch.tensor([context]), ref)
        want = target(ids, TreeKV(ref, tree))
        if layout == "slots":
            cache = StaticKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64, target.dtype)
            for i in range(c.num_hidden_layers):  # the context's K/V, slot-major
                cache.kv[2 * i].copy_(ref.k[i, 0].transpose(0, 1))
                cache.kv[2 * i + 1].copy_(ref.v[i, 0].transpose(0, 1))
            rows = TreeSlotKV(cache.kv, len(context), tree)
        else:
            pool = KVPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64, target.dtype, "cpu")
            PooledCache(pool)  # another sequence holds place 0
            cache = PooledCache(pool)
            for i in range(c.num_hidden_layers):  # the context's K/V, keys slot-minor
                pool.keys[i, cache.index].copy_(ref.k[i, 0].transpose(1, 2))
                pool.values[i, cache.index].copy_(ref.v[i, 0].transpose(0, 1))
            rows = TreePooledKV(pool.kv, cache.index, len(context), tree)
        cache.length = len(context)
        got = target(ids, rows)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        node, path = max(range(len(tree.tokens)), key=lambda i: (tree.depths[i], i)), []
        while node > 0:  # the deepest node's path, root excluded (a path off the node order)
            path.insert(0, node)
            node = tree.parents[node]
        ref.keep_path(len(context), path)
        cache.keep_path(len(context), path)
        n = ref.length
        assert cache.length == n == len(context) + 1 + len(path)
        for i in range(c.num_hidden_layers):
            if layout == "slots":
                k, v = cache.kv[2 * i][:n], cache.kv[2 * i + 1][:n]
            else:
                k, v = pool.keys[i, cache.index, :, :, :n].permute(2, 0, 1), pool.values[i, cache.index, :n]
            torch.testing.assert_close(k, ref.k[i, 0, :, :n].transpose(0, 1), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, ref.v[i, 0, :, :n].transpose(0, 1), rtol=1e-4, atol=1e-4)

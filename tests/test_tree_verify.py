"""Draft trees in the decode loop (`--dflash-tree-budget`, `Decoder._tree_step`): greedy tree
verification emits plain decoding's tokens (exact verify: the path's rows are plain decoding's
rows; chunkwise: one forward with tree attention over the cache, the path's K/V moved into
place, or, on the compiled backends, the tree's paths as chains), sampled tree verification is
reproducible per seed, and trees run batched in the server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
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


def test_trees_on_the_cpu_packages_walk_paths_and_emit_plain_decoding(aoti_engine, tiny_engine, tiny_prompts,
                                                                       monkeypatch):
    """The CPU packages have no tree mask: a tree is verified along its paths, each a chain of
    the packages' rows (bit-identical to one-row steps), so chunkwise greedy trees emit plain
    decoding's tokens exactly; the block's distributions come from the drafter's package (one
    built without them is refused by name). Each step runs one chain from the root along the best children, and one more each time
    the walk leaves it; the τ is the eager backend's one-forward tree's."""
    from metrale.runtime.steps import Forward

    plain = EngineGenerator(aoti_engine, SpeculativeConfig())
    chains: list[int] = []
    orig = Forward.__init__

    def counting(self, ids, cache, *a, **k):
        orig(self, ids, cache, *a, **k)
        assert self.tree is None  # never a tree's rows in one forward here
        chains.append(self.rows)

    assert all(aoti_engine.drafters[n].distributions for n in ("dflash", "dflash2"))
    with monkeypatch.context() as m:  # a package built before draft trees gives drafts only
        m.setattr(aoti_engine.drafters["dflash2"], "distributions", False)
        with pytest.raises(ConfigError, match=r"--dflash-tree-budget 16: drafter 'dflash2''s CPU package "
                                              r"gives drafts only \(built before draft trees\), engine "
                                              r"directory .*build the engine again"):
            EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(
                dflash=True, dflash_drafter="dflash2", dflash_tree_budget=16))
        EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2"))
        from metrale.bench import mode_table  # bench measures its chains, and the other drafter's trees

        names = [n for n, _ in mode_table(aoti_engine, None)]
        assert "dflash2 γ=8" in names and "dflash tree 16" in names
        assert not [n for n in names if n.startswith("dflash2 tree")]
    for drafter in ("dflash", "dflash2"):
        eager = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(
            dflash=True, dflash_drafter=drafter, exact_verify=True, dflash_tree_budget=16))
        gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(
            dflash=True, dflash_drafter=drafter, dflash_tree_budget=16))
        for p in tiny_prompts[:2]:
            chains.clear()
            with monkeypatch.context() as m:
                m.setattr(Forward, "__init__", counting)
                got = gen.generate(p, GREEDY)
            assert got.token_ids == plain.generate(p, GREEDY).token_ids, drafter
            steps = [s for s in got.steps if s.drafted]
            assert max(s.drafted for s in steps) == 16 and any(s.accepted for s in steps)
            # a tree step's chains (the root and at least one node each; a plain step's forward
            # has one row): one, plus one per time its walk left the chain, so at most its
            # accepted drafts + 1; each at most the root and γ − 1 nodes
            tree_chains = [n for n in chains[1:] if n > 1]
            assert len(steps) <= len(tree_chains) <= sum(s.accepted + 1 for s in steps)
            assert all(n <= 8 for n in tree_chains)
            assert [s.accepted for s in got.steps] == [s.accepted for s in eager.generate(p, GREEDY).steps]


def test_trees_on_the_cpu_packages_run_in_one_forward_with_their_chains_bits(aoti_engine, tiny_engine, tiny_prompts,
                                                                            monkeypatch):
    """The target package takes each row's hidden drafts: a tree's rows run in one call, each
    with the bits of its path's chain row (the build's check), so one forward per tree step
    emits plain decoding's tokens and accepts what the eager one-forward tree accepts. It runs
    with `--dflash-tree-verify forward`, or by its cost under auto: always under a table where
    rows cost nothing, never on a CPU without a table (the walk, above)."""
    from metrale.runtime.steps import Forward

    assert aoti_engine.tree_attention and aoti_engine.manifest.components["target"].cpu.check[
        "tree_rows_bit_identical"] is True
    plain = EngineGenerator(aoti_engine, SpeculativeConfig())
    trees: list[tuple[int, int]] = []
    orig = Forward.__init__

    def counting(self, ids, cache, *a, **k):
        orig(self, ids, cache, *a, **k)
        if self.tree is not None:
            trees.append((self.rows, self.tree.size))

    monkeypatch.setattr(Forward, "__init__", counting)
    for drafter in ("dflash", "dflash2"):
        eager = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(
            dflash=True, dflash_drafter=drafter, exact_verify=True, dflash_tree_budget=16))
        forced = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(
            dflash=True, dflash_drafter=drafter, dflash_tree_budget=16, dflash_tree_verify="forward"))
        free_rows = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(
            dflash=True, dflash_drafter=drafter, dflash_tree_budget=16,
            dflash_adaptive_k=",".join(f"{k}:1" for k in range(17))))
        for p in tiny_prompts[:2]:
            want = plain.generate(p, GREEDY).token_ids
            trees.clear()
            got = forced.generate(p, GREEDY)
            assert got.token_ids == want, drafter
            steps = [s for s in got.steps if s.drafted]
            assert [s.drafted for s in steps] == [n for _, n in trees]  # one forward a tree step
            assert all(rows == n + 1 for rows, n in trees) and max(n for _, n in trees) == 16
            assert [s.accepted for s in got.steps] == [s.accepted for s in eager.generate(p, GREEDY).steps]
            trees.clear()
            got = free_rows.generate(p, GREEDY)
            assert got.token_ids == want, drafter
            assert len(trees) == len([s for s in got.steps if s.drafted]) > 0


def test_the_builds_tree_check_fails_on_rows_that_see_off_path_drafts(aoti_engine, monkeypatch):
    """The build's check of tree rows (`cpu_check`) against a package whose rows hide nothing
    (every draft before a node visible to it): not the chains' bits."""
    from metrale.builder.cpu_check import _check_tree
    from metrale.runtime.spec.ddtree import Tree

    assert _check_tree(aoti_engine.target, torch.Generator().manual_seed(1))
    monkeypatch.setattr(Tree, "hidden_bits", lambda self: [0] * len(self.tokens))
    assert not _check_tree(aoti_engine.target, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("route", ["forward", "paths"])
def test_trees_on_the_onnx_graphs_emit_plain_decoding(engine_factory, tiny_prompts, route, monkeypatch):
    """The exported target graph verifies a tree in one call (its `tree_mask`) or along its
    paths, and the drafter graph gives the block's logits (DFlash2: its selector query, scored
    with the codebooks)."""
    from metrale.runtime.backends import load_engine

    engine = load_engine(engine_factory(onnx=True), backend="onnxruntime")
    assert engine.tree_attention
    trees, forward_tree = [], engine.target.forward_tree

    def one_call(f):
        runs = engine.target.runner.stats.runs
        out = forward_tree(f)
        trees.append(engine.target.runner.stats.runs - runs)
        return out

    monkeypatch.setattr(engine.target, "forward_tree", one_call)
    plain = EngineGenerator(engine, SpeculativeConfig())
    for drafter in ("dflash", "dflash2"):
        for exact in (True, False):
            gen = EngineGenerator(engine, SpeculativeConfig.from_flags(
                dflash=True, dflash_drafter=drafter, exact_verify=exact, dflash_tree_budget=16,
                dflash_tree_verify=None if exact else route))
            trees.clear()
            got = gen.generate(tiny_prompts[0], GREEDY)
            assert got.token_ids == plain.generate(tiny_prompts[0], GREEDY).token_ids, (drafter, exact)
            assert max(s.drafted for s in got.steps) == 16 and any(s.accepted for s in got.steps)
            # the forward route: every tree (a step that drafted) in one graph call; else none
            drafted = sum(1 for s in got.steps if s.drafted)
            assert trees == ([1] * drafted if route == "forward" and not exact else [])


def test_a_graph_without_a_tree_mask_walks_paths(engine_factory, tiny_prompts):
    """A target graph exported before trees (its runner lists no `tree_mask` input) loads, is fed
    no mask and decodes; its trees go along their paths, and the forward route is refused by
    name."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.graph_steps import GraphTarget

    class OldGraph:  # this build's graph behind the interface of one without the input
        def __init__(self, inner):
            self.inner, self.device, self.past_sizes = inner, inner.device, inner.past_sizes
            self.dtypes = {n: t for n, t in inner.dtypes.items() if n != "tree_mask"}
            self.fed: list[bool] = []

        def run(self, feeds, graph_key=None, persistent=()):
            self.fed.append("tree_mask" in feeds)
            t = feeds["input_ids"].shape[1]  # (the causal mask the graph takes)
            return self.inner.run({**feeds, "tree_mask": torch.ones(t, t, dtype=torch.bool).tril()})

    engine = load_engine(engine_factory(onnx=True), backend="onnxruntime")
    new = engine.target
    runner = OldGraph(new.runner)
    engine.target = GraphTarget(runner, new.profile, new.config, new.model.embed_tokens, new.engine_taps)
    assert not engine.target.masked and not engine.target.tree_rows and not engine.tree_attention
    with pytest.raises(ConfigError, match="--dflash-tree-verify forward: the onnxruntime target runs no draft tree"):
        EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16,
                                                             dflash_tree_verify="forward"))
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16))
    plain = EngineGenerator(load_engine(engine_factory(onnx=True), backend="onnxruntime"), SpeculativeConfig())
    got = gen.generate(tiny_prompts[0], GREEDY)
    assert got.token_ids == plain.generate(tiny_prompts[0], GREEDY).token_ids
    assert max(s.drafted for s in got.steps) == 16
    assert runner.fed and not any(runner.fed)  # no call fed a mask the graph would not have had


def test_trees_on_the_cuda_graph_target_emit_plain_decoding(tiny_engine_dir, tiny_prompts, monkeypatch):
    """On a target whose steps are CUDA graphs (the capture stand-in here) the decode loop
    verifies a tree in one forward, its rows replaying the same graphs with their hidden drafts
    (chunked by the graphs' rows), or along its paths, each chain replaying the graphs
    (`--dflash-tree-verify`; under auto its cost decides, on a GPU without a table the forward).
    Both emit plain decoding's tokens. (A chunkwise tree of one budget verified in one forward
    runs as whole iterations, `tree_iteration`, unless they are switched off as here.)"""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs
    from metrale.runtime.serving import service
    from metrale.runtime.spec.iteration_loop import IterationDecoder
    from metrale.runtime.steps import Forward

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    assert engine.tree_attention and not engine.backend.tree_attention  # the face's, not the backend's
    plain = EngineGenerator(engine, SpeculativeConfig())
    trees: list[int] = []
    orig = Forward.__init__

    def counting(self, ids, cache, *a, **k):
        orig(self, ids, cache, *a, **k)
        if self.tree is not None:
            trees.append(self.rows)

    monkeypatch.setattr(Forward, "__init__", counting)
    spec = SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16)
    assert isinstance(EngineGenerator(engine, spec).decoder(), IterationDecoder)
    monkeypatch.setattr(service, "tree_graphs", lambda *a: False)
    for drafter in ("dflash", "dflash2"):
        for exact in (True, False):
            for route in ("paths", "forward"):
                gen = EngineGenerator(engine, SpeculativeConfig.from_flags(
                    dflash=True, dflash_drafter=drafter, exact_verify=exact, dflash_tree_budget=16,
                    dflash_tree_verify=route))
                for p in tiny_prompts[:2]:
                    trees.clear()
                    got = gen.generate(p, GREEDY)
                    assert got.token_ids == plain.generate(p, GREEDY).token_ids, (drafter, exact, route)
                    assert max(s.drafted for s in got.steps) == 16
                    forwards = [s.drafted + 1 for s in got.steps if s.drafted] if route == "forward" and not exact else []
                    assert trees == forwards, (drafter, exact, route)


def test_a_tree_server_on_the_cuda_graph_target_runs_one_request_at_a_time(tiny_engine_dir, tiny_engine):
    """Draft trees the iterations do not run (here: verified along their paths) run the decode
    loop on the target's graphs (no iteration lanes), whose one decode cache serves one
    sequence: concurrent requests over HTTP queue for it, each with its solo greedy answer
    (several at once used to retire each other's cache)."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16,
                                                               dflash_tree_verify="paths"))
    assert gen.capabilities.max_running == 1
    tok = tiny_engine.tokenizer
    texts = [f"def f{i}(" for i in range(4)]
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    want = [tok.decode([t for t in plain.generate(tok.encode(x), SamplingParams(temperature=0.0, max_tokens=16)).token_ids
                        if t not in tok.eos_token_ids]) for x in texts]
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=8))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda x: client.completions.create(model=gen.model_id, prompt=x, max_tokens=16,
                                                                    temperature=0).choices[0].text, texts))
    assert got == want


@pytest.mark.parametrize("backend", ["cuda-graphs", "onnxruntime"])
def test_a_graph_targets_tree_rows_are_the_eager_trees(engine_factory, tiny_prompts, backend):
    """A graph target's rows of a tree (17 rows; on the CUDA graphs a 16-row graph and a 1-row
    one, on the ONNX graph one call with the tree's mask) against the eager model's one tree
    forward over its cache (`TreeKV`), and the kept path's K/V: a chain verify's."""
    from metrale.runtime.backends import load_engine, run_forwards
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs
    from metrale.runtime.spec.ddtree import Tree
    from metrale.runtime.steps import Forward

    if backend == "onnxruntime":
        eager = load_engine(engine_factory(onnx=True), backend="torch")
        graphs = load_engine(engine_factory(onnx=True), backend="onnxruntime")

        def slots(cache, n):  # [L, 1, nkv, S, hd] K and V
            return [t[:, :, :, :n].clone() for t in (cache.k, cache.v)]
    else:
        eager = load_engine(engine_factory("fp8"), backend="torch")
        graphs = load_engine(engine_factory("fp8"), backend="torch")
        use_cuda_graphs(graphs, graphs=EagerGraphs())

        def slots(cache, n):  # per layer [S, nkv, hd] K, V
            return [t[:n].clone() for t in cache.kv]
    g = torch.Generator().manual_seed(3)
    parents, depths = [-1], [0]
    for i in range(1, 17):
        parents.append(int(torch.randint(0, i, (1,), generator=g)))
        depths.append(depths[parents[-1]] + 1)
    tree = Tree(tuple(torch.randint(0, 256, (17,), generator=g).tolist()), tuple(parents), tuple(depths))
    prompt = torch.tensor([tiny_prompts[0]])
    taps = (0, 1)
    outs = []
    for engine in (eager, graphs):
        cache = engine.target.new_cache(1, 128)
        engine.target(prompt, cache)
        out = run_forwards(engine.target, [Forward(list(tree.tokens), cache, taps, tree=tree)])[0]
        assert cache.length == prompt.shape[1]  # a tree's rows wait for keep_path
        outs.append((out, cache))
    (a, _), (b, cache) = outs
    # onnxruntime's kernels sum in other orders than torch's (`test_graphs_match_the_torch_target`)
    tol = 3e-3 if backend == "onnxruntime" else 1e-4
    torch.testing.assert_close(b.logits, a.logits, rtol=tol, atol=tol)
    torch.testing.assert_close(b.taps, a.taps, rtol=tol, atol=tol)
    leaf = max(range(17), key=lambda i: depths[i])
    path = [leaf]
    while parents[path[-1]] > 0:
        path.append(parents[path[-1]])
    path = path[::-1]
    base = prompt.shape[1]
    cache.keep_path(base, path)
    assert cache.length == base + 1 + len(path)
    kept = slots(cache, base + 1 + len(path))
    chain = graphs.target.new_cache(1, 128)  # (may retire `cache`: its K/V are read first)
    graphs.target(prompt, chain)
    rows = graphs.target(torch.tensor([[tree.tokens[0], *(tree.tokens[n] for n in path)]]), chain)
    for k, c in zip(kept, slots(chain, base + 1 + len(path))):
        torch.testing.assert_close(k, c, rtol=1e-5, atol=1e-5)
    # the path's rows of the tree are the chain verify's on the same backend
    torch.testing.assert_close(b.logits[:, [0, *path]], rows.logits, rtol=1e-4, atol=1e-4)


def test_adaptive_k_chooses_each_trees_budget_from_the_cost_table(aoti_engine, tiny_prompts):
    """With `--dflash-adaptive-k`, a stream alone verifies the first b nodes of each block's
    tree, b priced by the table: where nodes cost nothing the trees stay near their budget;
    where each costs half a step they shrink to a node or two, or the stream decodes plainly;
    where no draft could pay (a step of k drafts costing 1 + 5k plain steps) it never drafts.
    Either way greedy output is plain decoding's."""
    tables = {"flat": ",".join(f"{k}:1" for k in range(17)),
              "steep": ",".join(f"{k}:{1 + 0.5 * k}" for k in range(17)),
              "never": ",".join(f"{k}:{1 + 5 * k}" for k in range(17))}
    plain = EngineGenerator(aoti_engine, SpeculativeConfig())
    sizes = {}
    for name, table in tables.items():
        gen = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=16,
                                                                        dflash_adaptive_k=table))
        sizes[name] = []
        for p in tiny_prompts[:2]:
            got = gen.generate(p, GREEDY)
            assert got.token_ids == plain.generate(p, GREEDY).token_ids, name
            sizes[name] += [s.drafted for s in got.steps if s.drafted]
    assert sum(sizes["flat"]) / len(sizes["flat"]) > 10, sizes
    assert not sizes["steep"] or sum(sizes["steep"]) / len(sizes["steep"]) < 3, sizes
    assert sizes["never"] == [], sizes

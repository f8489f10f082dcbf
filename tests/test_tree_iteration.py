"""Draft trees inside the whole-iteration graph (`runtime/spec/tree_iteration.py`): the device's
tree is `ddtree.build_tree`'s, its walk `ddtree.accepted_path`, its sampled walk plain
sampling (χ²), its K/V compaction moves the path into place; and on the capture stand-in a
tree iteration (one forward, or exact: a row a forward) emits plain decoding's tokens, accepts
what the decode loop's trees accept, beats its chain, and reads nothing from the host."""

from __future__ import annotations

import pytest
import torch
from conftest import PLAIN_TOKENS, replay_reading_nothing
from test_ddtree import CRITICAL_DF4_P001, ROWS, SAMPLED, _chi_square, _paths

from metrale.runtime.backends.cuda_graphs import EagerGraphs
from metrale.runtime.spec.ddtree import SelectorChildren, Tree, accepted_path, build_tree, marginal_tree
from metrale.runtime.spec.iteration import DFlashIteration
from metrale.runtime.spec.iteration_loop import IterationLoop
from metrale.runtime.spec.sampling import SamplingParams, sample_from_probs
from metrale.runtime.spec.tree_iteration import (DFlashTreeIteration, ancestors, compact, device_tree, hidden_slots,
                                                 marginal_children, selector_children, walk)

SLOTS = 256


def _tree(tokens, parents, depths, valid, b: int) -> Tree:
    """Lane b's valid nodes as a `Tree` (the device's root has itself as parent)."""
    keep = [i for i in range(tokens.shape[1]) if valid[b, i]]
    assert keep == list(range(len(keep)))  # the invalid nodes come last
    par = parents[b].tolist()
    return Tree(tuple(tokens[b, :len(keep)].tolist()), (-1, *par[1:len(keep)]), tuple(depths[b, :len(keep)].tolist()))


def _selector_tables(g, lanes: int, depth: int, k: int, vocab: int):
    """Random DFlash2 children: each slot's K candidates [B, D, K], and row r of slot d the
    children of slot d−1's candidate r, as `selector_children` gives them (candidate order) and
    as `CandidateSelector.tables` does (best first)."""
    cand = torch.stack([torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(depth)])
                        for _ in range(lanes)])  # [B, D, K]
    lp = torch.log_softmax(torch.randn(lanes, depth, k, k, generator=g) * 2, -1)
    ids = cand[:, :, None, :].expand(lanes, depth, k, k)
    vals, order = lp.sort(dim=-1, descending=True, stable=True)
    return cand, (lp, ids, torch.arange(k).expand(lanes, depth, k, k)), (vals, ids.gather(-1, order))


@pytest.mark.parametrize("budget", [1, 5, 16, 40])
def test_the_device_tree_is_the_best_first_tree_of_dflash(budget):
    g = torch.Generator().manual_seed(budget)
    logits = torch.randn(3, 7, 60, generator=g) * 2
    anchor = torch.tensor([4, 5, 6])
    tokens, parents, depths, valid, _ = device_tree(anchor, *marginal_children(logits, budget), budget)
    assert tokens.shape == (3, budget + 1) and bool(valid.all())
    for b in range(3):
        tree = _tree(tokens, parents, depths, valid, b)
        assert tree.tokens[0] == int(anchor[b]) and all(tree.parents[i] < i for i in range(1, budget + 1))
        assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, budget + 1))
        assert _paths(tree) == _paths(marginal_tree(int(anchor[b]), logits[b], budget))


def test_a_block_with_fewer_paths_than_the_budget_leaves_the_rest_invalid():
    logits = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(0))  # 3 + 9 paths
    tokens, parents, depths, valid, _ = device_tree(torch.tensor([0, 1]), *marginal_children(logits, 16), 16)
    assert valid.sum(1).tolist() == [13, 13]
    for b in range(2):
        assert _paths(_tree(tokens, parents, depths, valid, b)) == _paths(marginal_tree(b, logits[b], 16))


@pytest.mark.parametrize("seed", range(4))
def test_the_device_tree_is_the_best_first_tree_of_dflash2(seed):
    g = torch.Generator().manual_seed(seed)
    cand, children, (vals, ids) = _selector_tables(g, 2, 6, 8, 40)
    budget = 16
    tokens, parents, depths, valid, _ = device_tree(torch.tensor([1, 2]), *children, budget)
    for b in range(2):
        children = SelectorChildren.from_tables(None, torch.zeros(6, 1), b + 1, torch.zeros(6, 8), cand[b],
                                                vals[b], ids[b])
        host = build_tree(b + 1, children, budget)
        assert _paths(_tree(tokens, parents, depths, valid, b)) == _paths(host)


def test_selector_children_are_the_selectors_tables_unsorted(engine):
    selector = engine.drafters["dflash2"].candidate_selector
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, selector.hidden_projection.in_features, generator=g)
    logits = torch.randn(2, 7, 300, generator=g) * 3
    anchor = torch.tensor([5, 9])
    vals, ids, rows = selector_children(selector, hidden, logits, anchor)
    cand_logits, cand_ids = logits.topk(selector.num_candidates, dim=-1)
    want_vals, want_ids = selector.tables(hidden, cand_logits, cand_ids, anchor)
    got_vals, order = vals.sort(dim=-1, descending=True, stable=True)
    torch.testing.assert_close(got_vals, want_vals)
    assert torch.equal(ids.gather(-1, order), want_ids)
    assert torch.equal(ids, cand_ids[:, :, None, :].expand_as(rows).gather(-1, rows))  # a child's row: its place among its slot's candidates


def test_the_walk_is_greedy_acceptance_and_the_mask_a_trees():
    g = torch.Generator().manual_seed(7)
    _, children, _ = _selector_tables(g, 64, 5, 6, 30)
    tokens, parents, depths, valid, _ = device_tree(torch.zeros(64, dtype=torch.long), *children, 12)
    # each lane's target tokens follow one of its nodes' paths, then leave the tree
    target = torch.randint(30, (64, 13), generator=g)
    for b in range(64):
        node = int(torch.randint(13, (), generator=g))
        while node > 0:
            target[b, int(parents[b, node])] = tokens[b, node]
            node = int(parents[b, node])
    anc = ancestors(parents, 5)
    path, n = walk(target, tokens, parents, depths, valid, anc, 5)
    pos = torch.arange(64) % 5 + 3
    hidden = hidden_slots(anc, pos, 24)[:, 0]  # [B, 13, 24]
    for b in range(64):
        tree = _tree(tokens, parents, depths, valid, b)
        want = accepted_path(tree, target[b].tolist())
        assert int(n[b]) == len(want) and path[b, 1:1 + len(want)].tolist() == want
        assert path[b, 0] == 0 and (path[b, 1 + len(want):] == 0).all()
        assert torch.equal(anc[b], tree.mask())
        p = int(pos[b])
        seen = ~hidden[b]
        assert seen[:, :p].all() and not seen[:, p + 13:].any() and torch.equal(seen[:, p:p + 13], tree.mask())


def test_the_walk_never_takes_an_invalid_node():
    """Node 3 (invalid: its path could not be had) holds the token node 1's target row picks;
    the walk stops at node 1, and an invalid child of the root is no match either."""
    tokens = torch.tensor([[9, 4, 5, 7, 2]])
    parents = torch.tensor([[0, 0, 0, 1, 0]])
    depths = torch.tensor([[0, 1, 1, 2, 1]])
    valid = torch.tensor([[True, True, True, False, False]])
    anc = ancestors(parents, 2)
    path, n = walk(torch.tensor([[4, 7, 0, 0, 0]]), tokens, parents, depths, valid, anc, 2)
    assert path.tolist() == [[0, 1, 0]] and n.tolist() == [1]
    path, n = walk(torch.tensor([[2, 0, 0, 0, 0]]), tokens, parents, depths, valid, anc, 2)
    assert path.tolist() == [[0, 0, 0]] and n.tolist() == [0]


def test_a_trees_room_holds_the_iteration_discarded_after_the_last():
    from metrale.runtime.spec.tree_iteration import tree_room

    assert tree_room(16, 8) == 64 and tree_room(64, 16) == 2 * 16 + 65


def test_a_sampled_walk_emits_what_plain_sampling_would():
    """Every node draws from its own row, the walk follows the draws: the first token follows
    the root's row, the second the accepted child's (`test_ddtree`'s tree and rows)."""
    lanes = 20000
    tokens = torch.tensor(SAMPLED.tokens).expand(lanes, -1)
    parents = torch.tensor((0, *SAMPLED.parents[1:])).expand(lanes, -1)
    draws = sample_from_probs(ROWS.expand(lanes, -1, -1), torch.Generator().manual_seed(5))  # [B, 5]
    depths = torch.tensor(SAMPLED.depths).expand(lanes, -1)
    path, n = walk(draws, tokens, parents, depths, torch.ones(lanes, 5, dtype=torch.bool), ancestors(parents, 2), 2)
    emitted = draws.gather(1, path)[:, :2]
    first = torch.bincount(emitted[:, 0], minlength=5).float()
    assert _chi_square(first, ROWS[0]) < CRITICAL_DF4_P001, first.tolist()
    assert torch.equal(n >= 1, (emitted[:, 0] == 2) | (emitted[:, 0] == 0))
    for token, row in ((2, ROWS[1]), (0, ROWS[2])):
        second = torch.bincount(emitted[emitted[:, 0] == token, 1], minlength=5).float()
        assert _chi_square(second, row) < CRITICAL_DF4_P001, second.tolist()


def test_compaction_moves_the_accepted_path_into_place():
    b, slots = 3, 20
    pool = [torch.arange(slots).float().expand(b, 2, 4, slots).clone(),  # K: slot-minor
            torch.arange(slots).float()[:, None].expand(b, 2, slots, 4).clone()]
    pos = torch.tensor([2, 5, 9])
    path = torch.tensor([[0, 3, 7, 8], [0, 1, 2, 2], [0, 4, 4, 4]])
    n = torch.tensor([3, 2, 1])
    compact(pool, pos, path, n)
    for lane, (p, want) in enumerate(zip(pos.tolist(), ([3, 7, 8], [1, 2, 3], [4, 2, 3]))):
        got = pool[0][lane, 0, 0].tolist()
        assert got[p + 1:p + 4] == [p + w for w in want] and got[:p + 1] == list(range(p + 1))
        assert pool[1][lane, 0, :, 0].tolist() == got


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    return load_engine(tiny_engine_dir).pack()


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_a_tree_iteration_decodes_plain_decodings_tokens_and_beats_its_chain(engine, tiny_engine_dir, tiny_prompts,
                                                                           plain_tokens, drafter):
    """On the stand-in: plain decoding's tokens; each iteration accepts what the eager decode
    loop's tree of the same budget accepts (the loop's request runs longer: near its end a
    step's tree holds only as many nodes as tokens remain); more tokens an iteration than the
    chain's; no host read in any variant."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    it = DFlashTreeIteration(engine.target, engine.drafters[drafter], 16, plain=True, slots=SLOTS, linear="rowwise")
    loop = IterationLoop(it, EagerGraphs())
    chain = IterationLoop(DFlashIteration(engine.target, engine.drafters[drafter], 7, slots=SLOTS, linear="rowwise"),
                          EagerGraphs())
    eager = EngineGenerator(load_engine(tiny_engine_dir, backend="torch"), SpeculativeConfig.from_flags(
        dflash=True, dflash_drafter=drafter, dflash_tree_budget=16, exact_verify=True))
    tree_tokens = chain_tokens = 0
    for ids, want in zip(tiny_prompts, plain_tokens):
        res = loop.generate(ids, PLAIN_TOKENS, engine.tokenizer.eos_token_ids)
        assert res.token_ids == want
        ref = eager.generate(ids, SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS + 32))
        assert res.emitted[:-1] == [s.emitted for s in ref.steps[:len(res.emitted) - 1]]
        assert max(res.emitted) <= it.gamma and set(res.verified) == {16}
        tree_tokens += len(res.token_ids) / len(res.emitted)
        chain_tokens += len(want) / len(chain.generate(ids, PLAIN_TOKENS, engine.tokenizer.eos_token_ids).emitted)
    assert tree_tokens > 1.1 * chain_tokens
    replay_reading_nothing(it, tiny_prompts[0], drafter)


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_an_exact_tree_iteration_walks_its_path_a_row_a_forward(engine, tiny_engine_dir, tiny_prompts, plain_tokens,
                                                               drafter):
    """Exact verify: the tree's path one row per forward, as plain decoding's steps (so its
    bits, whatever the rows' GEMMs); each iteration accepts what the eager decode loop's exact
    tree accepts and runs γ rows; several lanes at once each walk their own path; no host
    read."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.iteration_loop import IterationLanes, LaneStep

    it = DFlashTreeIteration(engine.target, engine.drafters[drafter], 16, exact=True, slots=SLOTS)
    loop = IterationLoop(it, EagerGraphs())
    eager = EngineGenerator(load_engine(tiny_engine_dir, backend="torch"), SpeculativeConfig.from_flags(
        dflash=True, dflash_drafter=drafter, dflash_tree_budget=16, exact_verify=True))
    for ids, want in zip(tiny_prompts, plain_tokens):
        res = loop.generate(ids, PLAIN_TOKENS, engine.tokenizer.eos_token_ids)
        assert res.token_ids == want
        ref = eager.generate(ids, SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS + 32))
        assert res.emitted[:-1] == [s.emitted for s in ref.steps[:len(res.emitted) - 1]]
        assert set(res.rows) == {it.gamma} and max(res.emitted) > 2
    lanes = IterationLanes(DFlashTreeIteration(engine.target, engine.drafters[drafter], 16, exact=True, slots=SLOTS,
                                               lanes=4), EagerGraphs())
    got = {}
    for ids in tiny_prompts[:3]:
        lane = lanes.acquire()
        got[lane] = [lanes.prefill(lane, ids, SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS), PLAIN_TOKENS)]
    while any(len(t) < PLAIN_TOKENS for t in got.values()):
        steps = [LaneStep(lanes, lane) for lane, t in got.items() if len(t) < PLAIN_TOKENS]
        for step, toks in zip(steps, lanes.run(steps)):
            got[step.lane] += toks
    assert [t[:PLAIN_TOKENS] for t in got.values()] == [w[:PLAIN_TOKENS] for w in plain_tokens[:3]]
    assert steps[0].ran == it.gamma
    # a tree of 2 nodes is at most 2 deep: 3 rows
    small = IterationLoop(DFlashTreeIteration(engine.target, engine.drafters[drafter], 2, exact=True, slots=SLOTS),
                          EagerGraphs())
    res = small.generate(tiny_prompts[0], PLAIN_TOKENS, engine.tokenizer.eos_token_ids)
    assert res.token_ids == plain_tokens[0] and set(res.rows) == {3} and max(res.emitted) == 3
    replay_reading_nothing(it, tiny_prompts[0], drafter)


@pytest.mark.parametrize("drafter, budget, gamma", [("dflash", 16, 4), ("dflash2", 64, None), ("dflash2", 1, None)])
def test_trees_of_every_size_decode_plain_decodings_tokens(engine, tiny_prompts, plain_tokens, drafter, budget, gamma):
    """A shorter block (γ = 4: 16 nodes over 3 depths), the largest tree, a one-node tree."""
    it = DFlashTreeIteration(engine.target, engine.drafters[drafter], budget, gamma=gamma, slots=SLOTS,
                             linear="rowwise")
    res = IterationLoop(it, EagerGraphs()).generate(tiny_prompts[0], PLAIN_TOKENS, engine.tokenizer.eos_token_ids)
    assert res.token_ids == plain_tokens[0] and max(res.emitted) <= it.gamma
    assert sum(res.emitted) / len(res.emitted) > 1.2


@pytest.mark.parametrize("exact", [False, True], ids=["one forward", "exact"])
def test_a_sampled_tree_iteration_draws_reproducibly(engine, tiny_prompts, exact):
    loop = IterationLoop(DFlashTreeIteration(engine.target, engine.drafters["dflash2"], 8, exact=exact, slots=SLOTS,
                                             linear="rowwise"), EagerGraphs())
    greedy = loop.generate(tiny_prompts[1], PLAIN_TOKENS).token_ids
    cold = SamplingParams(temperature=0.001, max_tokens=PLAIN_TOKENS, seed=5)
    assert loop.generate(tiny_prompts[1], PLAIN_TOKENS, params=cold).token_ids == greedy
    warm = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24)
    a = loop.generate(tiny_prompts[0], 24, params=warm)
    assert loop.generate(tiny_prompts[0], 24, params=warm).token_ids == a.token_ids
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=12, max_tokens=24)
    assert loop.generate(tiny_prompts[0], 24, params=other).token_ids != a.token_ids
    assert max(a.emitted) > 1  # draws that land on the tree's nodes are accepted


def test_a_tree_needs_a_budget_the_steps_allow(engine):
    with pytest.raises(ValueError, match="1 to 64"):
        DFlashTreeIteration(engine.target, engine.drafters["dflash"], 65, slots=SLOTS)


@pytest.mark.parametrize("seed", range(4))
def test_a_trees_first_nodes_are_the_smaller_budgets_tree_and_its_stats_their_path_probabilities(seed):
    """The first b+1 rows of the N-node tree are the tree `device_tree` builds for b (the same
    paths: what adaptive k's smaller budgets verify), and the path log-probabilities come best
    first, a node's below its parent's."""
    g = torch.Generator().manual_seed(seed)
    _, children, _ = _selector_tables(g, 2, 7, 16, 300)
    full = device_tree(torch.tensor([1, 2]), *children, 32)
    for b in (1, 2, 4, 8, 16):
        small = device_tree(torch.tensor([1, 2]), *children, b)
        for lane in range(2):
            first = _tree(*(t[:, :b + 1] for t in full[:4]), lane)
            assert _paths(first) == _paths(_tree(*small[:4], lane))
    scores, parents = full[4], full[1]
    assert (scores[:, 1:].diff(dim=1) <= 0).all() and (scores[:, 1:] <= scores.gather(1, parents)[:, 1:]).all()


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_adaptive_k_over_tree_budgets_picks_a_captured_graph_each_iteration(engine, tiny_prompts, plain_tokens,
                                                                           drafter):
    """`--dflash-adaptive-k` with trees on whole iterations: a graph per budget (the table's
    powers of two and its largest) plus plain; where rows cost little the largest tree is
    chosen, where each row costs much the chooser moves to smaller ones, where drafting
    cannot pay every iteration settles on plain. Plain decoding's tokens throughout; the
    policy learns from the trees the iterations leave (`stats`: their nodes' probabilities)."""
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.count_policy import TreeCountPolicy

    def run(slope: float, plain_cost: float = 1.0):
        table = ",".join(f"{k}:{plain_cost if k == 0 else 1 + slope * k:.3f}" for k in range(17))
        spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter=drafter, dflash_tree_budget=16,
                                            dflash_adaptive_k=table)
        policy = TreeCountPolicy(resolve_dflash(spec, engine.drafters[drafter].config.block_size))
        it = DFlashTreeIteration(engine.target, engine.drafters[drafter], policy.counts, plain=True, settled=True,
                                 stats=True, slots=SLOTS, linear="rowwise")
        loop = IterationLoop(it, EagerGraphs(), policy)
        assert {key[1] for key in loop.captured} == {0, 1, 2, 4, 8, 16, "settled"}
        res = [loop.generate(ids, PLAIN_TOKENS, engine.tokenizer.eos_token_ids) for ids in tiny_prompts[:3]]
        assert [r.token_ids for r in res] == plain_tokens[:3]
        return [k for r in res for k in r.verified[2:]], policy  # (the first two: before any tree was read)

    cheap, policy = run(0.002)
    assert set(cheap) == {16}
    assert policy.probs is not None and len(policy.probs) == 16 and policy.probs == sorted(policy.probs, reverse=True)
    costly, policy = run(0.15)
    assert 0 < sum(k > 0 for k in costly) and max(k for k in costly) < 16 and len(set(costly) - {0}) > 1
    never, policy = run(50.0)
    assert policy.controller.settled and not any(never)
    # a request capped below what a tree may accept teaches nothing; one capped at γ − 1 does
    for cap, teaches in ((2, False), (7, True)):
        spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter=drafter, dflash_tree_budget=16,
                                            dflash_adaptive_k=",".join(f"{k}:{1 + 0.002 * k:.3f}" for k in range(17)))
        policy = TreeCountPolicy(resolve_dflash(spec, engine.drafters[drafter].config.block_size))
        it = DFlashTreeIteration(engine.target, engine.drafters[drafter], policy.counts, plain=True, settled=True,
                                 stats=True, slots=SLOTS, linear="rowwise")
        loop = IterationLoop(it, EagerGraphs(), policy)
        loop.generate(tiny_prompts[0], 12, params=SamplingParams(temperature=0.0, max_drafts=cap))
        assert (policy.probs is not None) is teaches and (policy.chooser.predicted > 0) is teaches
    with pytest.raises(ValueError, match="stats=True"):
        IterationLoop(DFlashTreeIteration(engine.target, engine.drafters[drafter], policy.counts, plain=True,
                                          slots=SLOTS), EagerGraphs(), policy)


def test_a_batch_teaches_the_tree_policy_whatever_the_order_of_its_lanes():
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.count_policy import TreeCountPolicy

    spec = SpeculativeConfig.from_flags(dflash=True, dflash_tree_budget=4,
                                        dflash_adaptive_k="0:1,1:1.1,2:1.2,3:1.3,4:1.4")
    g = torch.Generator().manual_seed(0)
    lanes = []
    for _ in range(7):  # random trees: sums in another order would round otherwise
        probs = torch.rand(4, generator=g, dtype=torch.float64).sort(descending=True).values.tolist()
        lanes.append((int(torch.randint(1, 4, (), generator=g)), (probs, [1, 2, 2, 3])))
    seen = []
    for order in (lanes, lanes[::-1], lanes[3:] + lanes[:3]):
        policy = TreeCountPolicy(resolve_dflash(spec, 8))
        policy.observe_batch(2, [n for n, _ in order], [s for _, s in order])
        policy.observe_batch(4, [n for n, _ in order], [s for _, s in order])
        seen.append((policy.probs, policy.chooser.ratio, policy.controller.estimator.tested, policy.next()))
    assert seen[0] == seen[1] == seen[2]
    mean = [sum(p[i] for _, (p, _) in lanes) / 7 for i in range(4)]
    assert seen[0][0] == pytest.approx(mean)  # the batches' mean tree, twice

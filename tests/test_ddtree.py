"""Draft trees from a DFlash block (`spec.ddtree`): best first by path probability under a
budget, the tree attention mask, greedy acceptance along the target's continuation, and the τ
measurement whose chain reproduces the decode loop's acceptance exactly."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from metrale.runtime.models.step_caches import TreeKV
from metrale.runtime.spec.ddtree import (SelectorChildren, Tree, accepted_along, accepted_path, build_tree,
                                         chain, choose_child, walk)


def _all_prefixes(log_probs: torch.Tensor, k: int) -> dict[tuple[int, ...], float]:
    """Every path of up to D tokens over each position's k best, with its log-probability."""
    top = log_probs.topk(min(k, log_probs.shape[1]), dim=-1).indices.tolist()
    out = {}
    for depth in range(1, log_probs.shape[0] + 1):
        for path in itertools.product(*top[:depth]):
            out[path] = sum(float(log_probs[d, t]) for d, t in enumerate(path))
    return out


def _paths(tree: Tree) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, len(tree.tokens)):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_is_the_budget_most_probable_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    depth, vocab, budget = 4, 7, 11
    log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)
    tree = build_tree(5, log_probs, budget)
    assert tree.size == budget and tree.tokens[0] == 5 and tree.parents[0] == -1
    assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
               for i in range(1, budget + 1))
    ranked = sorted(_all_prefixes(log_probs, budget).items(), key=lambda kv: -kv[1])
    assert _paths(tree) == {p for p, _ in ranked[:budget]}
    # a budget of D holds at least the argmax chain's first token; a chain is a one-path tree
    argmax = log_probs.argmax(-1).tolist()
    assert (argmax[0],) in _paths(build_tree(5, log_probs, depth))
    forced = build_tree(5, log_probs, budget, path=(3, 3, 3, 3))
    assert {(3,), (3, 3), (3, 3, 3), (3, 3, 3, 3)} <= _paths(forced) and forced.size == budget
    assert _paths(chain(5, [1, 2])) == {(1,), (1, 2)}


def test_the_mask_lets_a_node_see_itself_and_its_ancestors_only():
    tree = Tree((9, 1, 2, 3, 4), (-1, 0, 0, 1, 3), (0, 1, 1, 2, 3))
    mask = tree.mask()
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                             [1, 1, 0, 1, 1]]


def test_greedy_acceptance_follows_the_matching_children():
    tree = Tree((9, 1, 2, 3, 4, 5), (-1, 0, 0, 1, 3, 2), (0, 1, 1, 2, 3, 2))
    assert accepted_along(tree, [1, 3, 4, 7]) == 3 and accepted_along(tree, [2, 5, 1]) == 2
    assert accepted_along(tree, [7, 1]) == 0 and accepted_along(tree, [1, 4]) == 1
    # the target's argmax per node: at the root 2, at node 2 (token 2) 5, at node 5 anything
    assert accepted_path(tree, [2, 0, 5, 0, 0, 8]) == [2, 5]


def test_the_chain_policy_measures_the_decode_loops_acceptance(tiny_engine, tiny_prompts):
    """Greedy exact verify emits plain decoding's tokens, so the τ the measurement gives the
    chain is the decode loop's own, step for step, for both drafters; trees accept more."""
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.tree_acceptance import block_acceptance
    from metrale.runtime.spec.sampling import SamplingParams

    prompts = tiny_prompts[:2]
    for name in ("dflash", "dflash2"):
        got = block_acceptance(tiny_engine, name, prompts, 48, (16,))
        gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter=name,
                                                                        exact_verify=True))
        emitted = steps = 0
        for p in prompts:
            decoder = gen._decode_loop()
            decoder.eos_ids = frozenset()  # as the measurement: every prompt its whole budget
            r = decoder.generate(p, SamplingParams(temperature=0.0, max_tokens=48))
            emitted, steps = emitted + sum(t.emitted for t in r.steps), steps + len(r.steps)
        assert got["chain"] == round(emitted / steps, 3), name
        assert got["tree 16"] > got["chain"], name
        # and the tree τ is the decode loop's own under --dflash-tree-budget 16 (exact verify)
        gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(
            dflash=True, dflash_drafter=name, exact_verify=True, dflash_tree_budget=16))
        emitted = steps = 0
        for p in prompts:
            decoder = gen._decode_loop()
            decoder.eos_ids = frozenset()
            r = decoder.generate(p, SamplingParams(temperature=0.0, max_tokens=48))
            emitted, steps = emitted + sum(t.emitted for t in r.steps), steps + len(r.steps)
        assert got["tree 16"] == round(emitted / steps, 3), name


def test_the_marginal_reading_is_dflashs_own_and_drops_dflash2s_selector(tiny_engine, tiny_prompts):
    """`block_steps(marginal=True)` reads a block as DFlash's: for DFlash, whose blocks are read
    that way already, every step is the same; for DFlash2 the chain is each slot's argmax, not
    the selector's pick. Each policy's histogram counts its steps and gives its τ."""
    from metrale.runtime.spec.tree_acceptance import block_steps

    prompts = tiny_prompts[:2]
    own = block_steps(tiny_engine, "dflash", prompts, 48, (16,))
    read = block_steps(tiny_engine, "dflash", prompts, 48, (16,), marginal=True)
    assert {p: (a.steps, a.emitted, a.accepted) for p, a in own.items()} == \
        {p: (a.steps, a.emitted, a.accepted) for p, a in read.items()}
    for a in own.values():
        assert sum(a.accepted.values()) == a.steps
        # each step emits its accepted drafts and one token more, but a prompt's last step,
        # whose bonus would fall past the 48 tokens
        assert 0 <= sum((n + 1) * c for n, c in a.accepted.items()) - a.emitted <= len(prompts)

    face = tiny_engine.drafters["dflash2"]
    selected, argmax = [], []
    propose = face.propose

    def spy(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        selected.append(proposal.tokens[0].tolist())
        argmax.append(proposal.logits[0].argmax(-1).tolist())
        return proposal

    face.propose = spy
    try:
        got = block_steps(tiny_engine, "dflash2", prompts, 48, (), marginal=True)
    finally:
        del face.propose
    assert got["chain"].steps == len(argmax) > 0
    assert selected != argmax  # the selector picks other tokens than the argmax somewhere ...
    assert got["chain"].tau != block_steps(tiny_engine, "dflash2", prompts, 48, ())["chain"].tau  # ... and accepts differently


def test_the_tree_tau_script_reports_each_policy(tiny_engine_dir, tmp_path):
    """scripts/tree_tau.py: a row per drafter reading and policy, the chain's ratio 1, its JSON
    the printed figures; `--unseen` measures prompts of the standard library's packages; a bad
    flag or prompts file is refused by name, with no traceback."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "tree_tau.py"
    out = tmp_path / "tau.json"
    run = subprocess.run([sys.executable, script, "--engine-dir", tiny_engine_dir, "--prompts", "1",
                          "--max-tokens", "24", "--budgets", "4", "--marginal", "--json", out],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["drafter"], r["marginal"], r["policy"]) for r in rows] == [
        ("dflash", False, "chain"), ("dflash", False, "tree 4"), ("dflash2", False, "chain"),
        ("dflash2", False, "tree 4"), ("dflash2", True, "chain"), ("dflash2", True, "tree 4")]
    assert all(r["ratio"] == 1.0 for r in rows if r["policy"] == "chain")
    assert all(0.0 <= r["whole_block_share"] <= 1.0 and r["tau"] >= 1.0 for r in rows)
    for r in rows:
        assert f"{r['tau']:.3f}" in run.stdout
    unseen = subprocess.run([sys.executable, script, "--engine-dir", tiny_engine_dir, "--unseen", "--prompts", "2",
                             "--max-tokens", "16", "--drafters", "dflash", "--budgets", "4", "--json", out],
                            capture_output=True, text=True, timeout=300)
    assert unseen.returncode == 0, unseen.stderr
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and [r["policy"] for r in report["rows"]] == ["chain", "tree 4"]
    notes = tmp_path / "notes.json"
    notes.write_text('{"a": 1}')
    for flags, named in ((["--budgets", "0"], "--budgets '0'"), (["--drafters", "eagle"], "--drafters 'eagle'"),
                         (["--max-tokens", "1"], "--max-tokens 1"),
                         (["--prompts-file", str(notes)], "a JSON list of strings"),
                         (["--prompts-file", str(tmp_path / "none.json")], "cannot be read")):
        bad = subprocess.run([sys.executable, script, "--engine-dir", tiny_engine_dir, *flags],
                             capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and named in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def _random_tree(seed: int, budget: int = 12) -> Tree:
    g = torch.Generator().manual_seed(seed)
    return build_tree(7, torch.log_softmax(torch.randn(5, 40, generator=g) * 3, -1), budget)


@pytest.mark.parametrize("seed", range(3))
def test_one_tree_forward_gives_each_nodes_row_of_its_own_path(tiny_engine, tiny_prompts, seed):
    """Each node's row in the tree forward (`TreeKV`) is the row the target computes for the
    node's path run as a chain after the same context, and after `keep_path` the cache holds an
    accepted path's K/V where a chain verify of that path would have written them."""
    target = tiny_engine.target
    context = tiny_prompts[0][:9]
    tree = _random_tree(seed)
    tree = Tree(tuple(t % target.config.vocab_size for t in tree.tokens), tree.parents, tree.depths)
    with torch.inference_mode():
        cache = target.new_cache(1, 64)
        target(torch.tensor([context]), cache)
        out = target(torch.tensor([list(tree.tokens)]), TreeKV(cache, tree))
        deepest = max(range(len(tree.tokens)), key=lambda i: (tree.depths[i], -i))
        path = []
        node = deepest
        while node > 0:
            path.append(node)
            node = tree.parents[node]
        path.reverse()
        for i in range(len(tree.tokens)):
            chain_nodes, node = [], i
            while node >= 0:
                chain_nodes.append(node)
                node = tree.parents[node]
            chain_nodes.reverse()
            ref_cache = target.new_cache(1, 64)
            target(torch.tensor([context]), ref_cache)
            ref = target(torch.tensor([[tree.tokens[n] for n in chain_nodes]]), ref_cache)
            torch.testing.assert_close(out.logits[0, i], ref.logits[0, -1], rtol=1e-4, atol=1e-4)
            if i == deepest:
                cache.keep_path(len(context), path)
                assert cache.length == ref_cache.length == len(context) + 1 + len(path)
                n = cache.length
                torch.testing.assert_close(cache.k[:, :, :, :n], ref_cache.k[:, :, :, :n], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(cache.v[:, :, :, :n], ref_cache.v[:, :, :, :n], rtol=1e-4, atol=1e-4)


# Tree sampling against plain sampling: a root with children tokens 2 and 0 (nodes 1, 2), node 1
# with children 1 and 3 (nodes 3, 4); V = 5, each node's target row below.
SAMPLED = Tree((9, 2, 0, 1, 3), (-1, 0, 0, 1, 1), (0, 1, 1, 2, 2))
ROWS = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15],   # root
                     [0.05, 0.5, 0.1, 0.3, 0.05],   # after 2
                     [0.3, 0.1, 0.2, 0.2, 0.2],     # after 0
                     [0.2, 0.2, 0.2, 0.2, 0.2],
                     [0.2, 0.2, 0.2, 0.2, 0.2]])
CRITICAL_DF4_P001 = 18.467  # chi-square, 4 degrees of freedom, the 0.999 quantile


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _sampled_steps(choose, n: int = 6000):
    """n tree verifies of `SAMPLED` (as the decode loop runs them: `walk` with `choose`) ->
    the first emitted tokens' counts and, per first token that was a node, the second's."""
    g = torch.Generator().manual_seed(2026)
    first, second = [], {2: [], 0: []}
    for _ in range(n):
        path, token = walk(SAMPLED, lambda node, kids: _pick(choose, node, kids, g))
        emitted = [SAMPLED.tokens[i] for i in path] + [token]
        first.append(emitted[0])
        if path:
            second[emitted[0]].append(emitted[1])
    count = lambda xs: torch.bincount(torch.tensor(xs), minlength=5).float()  # noqa: E731
    return count(first), {t: count(xs) for t, xs in second.items()}


def _pick(choose, node, kids, g):
    j, token = choose(ROWS[node], list(kids), g)
    return (kids[token] if j >= 0 else None), token


def test_tree_sampling_emits_what_plain_sampling_would():
    first, second = _sampled_steps(choose_child)
    assert _chi_square(first, ROWS[0]) < CRITICAL_DF4_P001, first.tolist()
    # after an accepted child, the next token follows that child's own row
    assert second[2].sum() == first[2] and second[0].sum() == first[0]
    assert _chi_square(second[2], ROWS[1]) < CRITICAL_DF4_P001, second[2].tolist()
    assert _chi_square(second[0], ROWS[2]) < CRITICAL_DF4_P001, second[0].tolist()


def test_the_chi_square_check_catches_tree_sampling_that_keeps_rejected_mass():
    """Negative control: judging each child against the whole row (not what is left once the
    children before it are out) over-weights the later children."""
    def keeps_mass(probs, children, g):
        for i, c in enumerate(children):
            if float(torch.rand((), generator=g, dtype=torch.float64)) < float(probs[c]):
                return i, c
        return -1, int(torch.multinomial(probs, 1, generator=g))

    first, _ = _sampled_steps(keeps_mass)
    assert _chi_square(first, ROWS[0]) > 10 * CRITICAL_DF4_P001


def test_a_child_holding_all_that_is_left_is_taken():
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # once 1 is refused, 3 holds everything left
        assert choose_child(probs, [1, 3], g)[1] in (1, 3)
    assert choose_child(torch.tensor([0.0, 0.0, 1.0]), [1], g) == (-1, 2)


def test_selector_children_follow_the_parent_token(tiny_engine, tiny_prompts):
    """DFlash2's tree: a node's children are its position's candidates rescored given the
    node's own token, so the path of best children is the selector's chain."""
    face = tiny_engine.drafters["dflash2"]
    target, embed = tiny_engine.target, tiny_engine.target.model.embed_tokens
    taps = tuple(face.config.target_layer_ids)
    with torch.inference_mode():
        ids = torch.tensor([tiny_prompts[0][:16]])
        feats = target(ids, target.new_cache(1, 32), taps=taps).taps
        cache = face.new_cache(1, 64, embed.weight.dtype, "cpu")
        face.add_context(feats[:, :15], cache)
        proposal = face.propose(ids[0, 15:16], embed, cache, face.config.block_size)
        children = SelectorChildren(face.candidate_selector, proposal.hidden[0], proposal.logits[0],
                                    int(ids[0, 15]))
        node_token, chain_tokens = int(ids[0, 15]), []
        for depth in range(1, children.depth + 1):
            vals, toks = children(depth, node_token)
            assert vals == sorted(vals, reverse=True) and abs(sum(map(math.exp, vals)) - 1) < 1e-4
            node_token = toks[0]
            chain_tokens.append(node_token)
        assert chain_tokens == proposal.tokens[0].tolist()
        a, b = children(2, chain_tokens[0]), children(2, (chain_tokens[0] + 1) % 2048)
        assert a != b  # the parent's token moves its children's scores


@pytest.mark.parametrize("ties", [False, True])
def test_selector_tables_are_each_parents_distribution_best_first(ties):
    """`CandidateSelector.tables`: row r of slot j is the selector's distribution over j's
    candidates given the anchor (j = 0) or slot j−1's candidate r, sorted best first with ties
    in candidate order (as a stable sort), for every block of a batch; and `SelectorChildren`
    built from the tables gives the children it gives scoring on the host."""
    from metrale.runtime.models.dflash import CandidateSelector

    g = torch.Generator().manual_seed(1)
    sel = CandidateSelector(24, 300, 8, 6).eval()
    if not ties:  # (zero codebooks and equal logits: every row all ties)
        for p in sel.parameters():
            p.data.normal_(generator=g)
    hidden, logits = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 300, generator=g)
    if ties:
        logits[:, :, :40] = 2.0
    cand_logits, cand_ids = logits.topk(6, dim=-1)
    anchor = torch.tensor([4, 9, 250])
    with torch.no_grad():
        vals, ids = sel.tables(hidden, cand_logits, cand_ids, anchor)
        for b, j, r in itertools.product(range(3), range(5), range(6)):
            parent = anchor[b] if j == 0 else cand_ids[b, j - 1, r]
            want = torch.log_softmax(sel.scores(hidden[b, j], cand_ids[b, j], cand_logits[b, j], parent), -1)
            want_vals, order = want.sort(descending=True, stable=True)
            assert torch.allclose(vals[b, j, r], want_vals, atol=1e-5)
            assert ids[b, j, r].tolist() == cand_ids[b, j, order].tolist()
        # a NaN (a broken drafter's) leaves each row's ids its candidates, each once
        nan_logits = cand_logits.clone()
        nan_logits[0, 1, 2] = float("nan")
        _, nan_ids = sel.tables(hidden, nan_logits, cand_ids, anchor)
        assert (nan_ids.sort(-1).values == cand_ids.sort(-1).values[:, :, None, :]).all()
        host = SelectorChildren(sel, hidden[1], logits[1], 9)
        packed = SelectorChildren.from_tables(sel, hidden[1], 9, cand_logits[1], cand_ids[1], vals[1], ids[1])
        for depth in range(1, 6):
            for parent in [9] if depth == 1 else [*cand_ids[1, depth - 2].tolist(), 299]:  # 299: off the table
                (hv, ht), (pv, pt) = host(depth, parent), packed(depth, parent)
                assert ht == pt and max(abs(x - y) for x, y in zip(hv, pv)) < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_a_nodes_hidden_bits_are_the_drafts_before_it_off_its_path(seed):
    """Node i hides the drafts 1..i−1 that are not its ancestors (bit i−1−j for node j): the
    complement of its mask's row among them, i − depth_i of them."""
    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for i in range(1, 40):
        parents.append(int(torch.randint(0, i, (1,), generator=g)))
        depths.append(depths[parents[-1]] + 1)
    tree = Tree(tuple(range(40)), tuple(parents), tuple(depths))
    mask = tree.mask()
    for i, bits in enumerate(tree.hidden_bits()):
        hidden = {j for j in range(1, i) if (bits >> (i - 1 - j)) & 1}
        assert hidden == {j for j in range(1, i) if not mask[i, j]}
        assert len(hidden) == i - depths[i]


def test_each_tree_is_verified_the_cheaper_way():
    """One forward of every node's row, or the walk along the best chain and a chain more per
    switch: the forward's rows off the chain against the walk's extra chains, priced by the
    cost table, the walk's switches measured on the stream's trees; without a table, one
    forward where rows run in parallel only."""
    from metrale.runtime.spec.cost_model import CostModel
    from metrale.runtime.spec.tree_verify import TreeVerifyChoice, best_chain, switches

    # root 0; chain 0-1-3-5; 2 a second child of the root, 4 of node 1
    tree = Tree((9, 1, 2, 3, 4, 5), (-1, 0, 0, 1, 1, 3), (0, 1, 1, 2, 2, 3))
    assert best_chain(tree) == [0, 1, 3, 5]
    assert switches(tree, [1, 3, 5]) == 0 and switches(tree, [1, 4]) == 1 and switches(tree, [2]) == 1
    assert TreeVerifyChoice(None, rows_in_parallel=True).one_forward(tree)
    assert not TreeVerifyChoice(None, rows_in_parallel=False).one_forward(tree)
    flat = TreeVerifyChoice(CostModel.parse("0:1,1:1,2:1"), rows_in_parallel=False)
    assert flat.one_forward(tree)  # rows cost nothing: 5 drafts cost what 3 do
    rows = TreeVerifyChoice(CostModel.parse("0:1,1:1.5,2:2"), rows_in_parallel=True)
    assert (rows.row_ms, rows.step_ms) == (0.5, 1.0) and not rows.one_forward(tree)  # 1 ms more, no switch
    for _ in range(30):  # every path switches once: a chain more, 1 + 3 · 0.5 ms, against 1 ms
        rows.observe(tree, [1, 4])
    assert rows.switches > 0.9 and rows.one_forward(tree)
    assert not TreeVerifyChoice(CostModel.parse("1:1.5,2:2"), rows_in_parallel=True).one_forward(tree)

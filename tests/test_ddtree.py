"""Draft trees from a DFlash block (`spec.ddtree`): best first by path probability under a
budget, the tree attention mask, greedy acceptance along the target's continuation, and the τ
measurement whose chain reproduces the decode loop's acceptance exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from metrale.runtime.spec.ddtree import Tree, accepted_along, accepted_path, build_tree, chain


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
    from metrale.runtime.spec.ddtree import block_acceptance
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

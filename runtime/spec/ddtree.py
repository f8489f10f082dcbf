"""Draft trees from one DFlash block (DDTree): the tree, its attention, and its greedy acceptance.

A DFlash block gives a distribution for each of its γ−1 positions at once, each given the
anchor and the context only (not the tokens drafted before it). A chain verifies one token per
position (the argmax, or DFlash2's selected candidate); a tree verifies, under a budget of
nodes, the prefixes of highest probability: a node at depth d is a token for position d, its
path probability the product of its path's tokens' probabilities, and the tree takes nodes
best first by that probability (every prefix of a taken path is taken before it, since each
factor is at most 1). One target forward verifies the whole tree when each node's row attends
to the context and to its own ancestors only (`Tree.mask`), at the position its depth gives;
the target's argmax at each node then says which child, if any, continues the accepted path.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    """Nodes in the order they were taken (a parent always before its children); node 0 is the
    root (the anchor, depth 0, parent -1)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]

    @property
    def size(self) -> int:
        """Nodes besides the root: the drafts it verifies."""
        return len(self.tokens) - 1

    def mask(self) -> torch.Tensor:
        """[N+1, N+1] bool: row i may attend to column j when j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask

    def children(self) -> list[dict[int, int]]:
        """Per node, its children by token."""
        out: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            out[self.parents[i]][self.tokens[i]] = i
        return out


def chain(anchor: int, drafts: list[int]) -> Tree:
    """The chain of `drafts` as a tree (one node per depth)."""
    n = len(drafts)
    return Tree((anchor, *drafts), (-1, *range(n)), tuple(range(n + 1)))


def build_tree(anchor: int, log_probs: torch.Tensor, budget: int, path: tuple[int, ...] = ()) -> Tree:
    """The `budget` nodes of highest path probability over the block's per-position
    log-probabilities `log_probs` [D, V] (position d+1 of the block in row d), best first, after
    the nodes of `path` (the block's chain, which a drafter may pick otherwise than by the
    argmax: DFlash2's selector), which the tree always holds; ties go to the earlier candidate."""
    depth_max = log_probs.shape[0]
    k = min(budget, log_probs.shape[1])
    top_vals, top_ids = log_probs.float().topk(k, dim=-1)  # per position, its k best tokens
    vals, ids = top_vals.tolist(), top_ids.tolist()
    tokens, parents, depths, scores = [anchor], [-1], [0], [0.0]
    children: list[dict[int, int]] = [{}]
    # candidates: (-(path log-prob), order, parent node, depth of the child, rank of its token)
    heap: list[tuple[float, int, int, int, int]] = []
    order = 0

    def push(parent: int, depth: int, rank: int) -> None:
        nonlocal order
        if depth <= depth_max and rank < k:
            heapq.heappush(heap, (-(scores[parent] + vals[depth - 1][rank]), order, parent, depth, rank))
            order += 1

    def add(parent: int, depth: int, token: int, score: float) -> int:
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        children.append({})
        children[parent][token] = node
        push(node, depth + 1, 0)  # its best child
        return node

    push(0, 1, 0)
    node = 0
    for depth, token in enumerate(path[:min(budget, depth_max)], 1):
        node = add(node, depth, token, scores[node] + float(log_probs[depth - 1, token]))
    while heap and len(tokens) <= budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        push(parent, depth, rank + 1)  # its next sibling
        token = ids[depth - 1][rank]
        if token not in children[parent]:  # not a node of `path` already
            add(parent, depth, token, -neg)
    return Tree(tuple(tokens), tuple(parents), tuple(depths))


def accepted_path(tree: Tree, target_ids: list[int]) -> list[int]:
    """The nodes of the longest accepted path under greedy verify (the root excluded):
    `target_ids[i]` is the target's argmax at node i; a child is accepted while its token is
    its parent's argmax."""
    children = tree.children()
    path, node = [], 0
    while True:
        nxt = children[node].get(target_ids[node])
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def accepted_along(tree: Tree, continuation: list[int]) -> int:
    """Drafts a greedy verify accepts when the target's greedy continuation of the anchor is
    `continuation` (each node's argmax is the continuation's next token where the node lies on
    it: the target's rows are those of plain decoding)."""
    children = tree.children()
    node, n = 0, 0
    for token in continuation:
        node = children[node].get(token)
        if node is None:
            break
        n += 1
    return n


def block_acceptance(engine, drafter: str, prompts: list[list[int]], max_tokens: int,
                     budgets: tuple[int, ...]) -> dict[str, float]:
    """τ (tokens per verify: accepted drafts + 1) of greedy speculative decoding with drafter
    `drafter`'s blocks verified as its chain and as trees of each budget, on `prompts` of plain
    decoding's first `max_tokens` tokens each. Greedy verify of a target whose rows are plain
    decoding's accepts exactly the drafts on the target's greedy continuation, so each policy
    is run over that continuation: at each step the drafter proposes from the context the
    policy has accepted so far (the target's taps at those positions, as the decode loop feeds
    them), and the step advances by what the policy accepts. -> {"chain": τ, "tree N": τ}."""
    from metrale.runtime.spec.decode import Decoder
    from metrale.runtime.spec.sampling import SamplingParams

    target, face = engine.target, engine.drafters[drafter]
    taps = tuple(face.config.target_layer_ids)
    gamma = face.config.block_size
    embed = target.model.embed_tokens
    dtype, device = embed.weight.dtype, embed.weight.device
    policies = ["chain", *(f"tree {b}" for b in budgets)]
    steps = {p: 0 for p in policies}
    emitted = {p: 0 for p in policies}
    plain = Decoder(target, frozenset())  # no EOS: every prompt runs its whole budget
    with torch.inference_mode():
        for prompt in prompts:
            ys = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)).token_ids
            ids = torch.tensor([prompt + ys], device=device)
            cache = target.new_cache(1, ids.shape[1] + gamma)
            feats = target(ids, cache, taps=taps).taps  # [1, T, n·H]: every position's taps
            for policy in policies:
                budget = None if policy == "chain" else int(policy.split()[1])
                cache = face.new_cache(1, ids.shape[1] + 2 * gamma, dtype, device)
                fed, i = 0, 0  # positions fed to the drafter; the anchor's index in `ys`
                while i < len(ys) - 1:
                    at = len(prompt) + i  # the anchor's position
                    face.add_context(feats[:, fed:at], cache)
                    fed = at
                    anchor = torch.tensor([ys[i]], device=device)
                    proposal = face.propose(anchor, embed, cache, gamma)
                    if budget is None:
                        tree = chain(ys[i], proposal.tokens[0].tolist())
                    else:
                        # a chain picked otherwise than by the argmax (DFlash2's selector) is
                        # kept whole in the tree
                        path = tuple(proposal.tokens[0].tolist()) if face.config.version == 2 else ()
                        tree = build_tree(ys[i], torch.log_softmax(proposal.logits[0].float(), -1), budget, path)
                    n = accepted_along(tree, ys[i + 1:])
                    steps[policy] += 1
                    emitted[policy] += min(n + 1, len(ys) - 1 - i)
                    i += n + 1
    return {p: round(emitted[p] / steps[p], 3) if steps[p] else 0.0 for p in policies}

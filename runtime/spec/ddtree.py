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
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from metrale.runtime.spec.sampling import sample_from_probs


@dataclass(frozen=True)
class Tree:
    """Nodes in the order they were taken (a parent always before its children); node 0 is the
    root (the anchor, depth 0, parent -1)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    # each node's path log-probability under the drafter's distributions (empty: not known)
    log_probs: tuple[float, ...] = ()

    @property
    def size(self) -> int:
        """Nodes besides the root: the drafts it verifies."""
        return len(self.tokens) - 1

    def first(self, n: int) -> Tree:
        """Its first `n` nodes besides the root: a tree (a parent comes before its children),
        and, for a tree built best first, the tree of budget `n` over the same block."""
        m = min(n, self.size) + 1
        return Tree(self.tokens[:m], self.parents[:m], self.depths[:m], self.log_probs[:m])

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

    def hidden_bits(self) -> list[int]:
        """Per node i, the drafts before it that are not its ancestors, as bits counted back from
        it (bit i−1−j for node j): node i at slot base+i hides them from its row
        (`plugins.cpu_attention`'s `hide`; their count is i − depth_i)."""
        out = [0] * len(self.tokens)
        for i in range(2, len(self.tokens)):
            seen, j = 0, self.parents[i]
            while j > 0:
                seen |= 1 << (i - 1 - j)
                j = self.parents[j]
            out[i] = ((1 << (i - 1)) - 1) & ~seen
        return out

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


class MarginalChildren:
    """A DFlash block's children: at depth d, position d's k most probable tokens, whatever the
    parent (each position's distribution is given the anchor and the context only). `log_probs`
    [D, V], or with `ids` each position's best candidates' already, [D, k'] with their ids (a
    tensor-parallel drafter's gathered top candidates)."""

    def __init__(self, log_probs: torch.Tensor, k: int, ids: torch.Tensor | None = None):
        if ids is None:
            vals, ids = log_probs.float().topk(min(k, log_probs.shape[-1]), dim=-1)
        else:
            vals, ids = log_probs[:, :k].float(), ids[:, :k]
        self.depth = log_probs.shape[0]
        self._vals, self._ids = vals.tolist(), ids.tolist()

    def __call__(self, depth: int, parent_token: int) -> tuple[list[float], list[int]]:
        return self._vals[depth - 1], self._ids[depth - 1]


class SelectorChildren:
    """DFlash2's children: its candidate selector rescores position d's candidates given the
    token before them (`dflash.CandidateSelector`: a first-order model over the block), so a
    node's children are its position's candidates under the selector's distribution given the
    node's own token; the selector's chain is the path that takes each node's best child. The
    root's token is the anchor and every other node's a candidate of the position before its
    own, so each position's distributions given each of those tokens are scored at once, one
    table [parents, K] per position (`CandidateSelector.tables`' math); a token off them (a
    forced path's) is scored on its own. `candidates` ([D, K] values, ids), when given, are
    each position's top K already (a tensor-parallel drafter's, as log-probabilities: the
    selector's softmax over the K is the same for logits or log-probabilities), and `logits` is
    not read. `from_tables` takes the tables a drafter's package computed."""

    def __init__(self, selector, hidden: torch.Tensor, logits: torch.Tensor | None, anchor: int,
                 candidates: tuple[torch.Tensor, torch.Tensor] | None = None):
        # the candidates and their codebook rows gathered where the model is, then a few small
        # tables on the host in numpy, whose per-op cost is a fraction of torch's (a step's tree
        # is built between the drafter's call and the verify's)
        with torch.no_grad():
            if candidates is None:
                top_vals, top = logits.float().topk(selector.num_candidates, dim=-1)  # [D, K]
            else:
                top_vals, top = candidates[0].float(), candidates[1]
            parents = torch.cat([torch.full_like(top[:1], anchor), top[:-1]])  # [D, K]
            host = [t.float().cpu().numpy() for t in (selector.hidden_projection(hidden), top_vals,
                                                      F.embedding(parents, selector.predecessor_codebook),
                                                      F.embedding(top, selector.successor_codebook))]
        projected, cand_logits, pred, succ = host  # [D, dim], [D, K], [D, K parents, dim], [D, K, dim]
        cand_ids = top.cpu().numpy()
        z = projected[:, None, :] + pred  # [D, K parents, dim]
        scores = cand_logits[:, None, :] + np.matmul(z, succ.transpose(0, 2, 1))  # [D, K parents, K]
        scores = scores - scores.max(-1, keepdims=True)
        log_probs = scores - np.log(np.exp(scores).sum(-1, keepdims=True))
        order = np.argsort(-log_probs, axis=-1, kind="stable")
        self._fill(selector, hidden, anchor, cand_ids, cand_logits, np.take_along_axis(log_probs, order, -1),
                   np.take_along_axis(np.broadcast_to(cand_ids[:, None, :], order.shape), order, -1))

    @classmethod
    def from_tables(cls, selector, hidden: torch.Tensor, anchor: int, cand_logits: torch.Tensor,
                    cand_ids: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor) -> SelectorChildren:
        """The children of one block from `CandidateSelector.tables` as a drafter's package gives
        them (its candidates' logits and ids [D, K], the tables [D, K, K], on the host)."""
        self = cls.__new__(cls)
        self._fill(selector, hidden, anchor, cand_ids.numpy(), cand_logits.numpy(), vals.numpy(), ids.numpy())
        return self

    def _fill(self, selector, hidden, anchor: int, cand_ids, cand_logits, vals, ids) -> None:
        """Each position's rows by parent token, the sorted tables ([D, K parents, K] values,
        ids) read a row at a time when a node first asks for it."""
        self.selector, self.depth, self._hidden = selector, hidden.shape[0], hidden
        self._cand_ids, self._cand_logits, self._vals, self._ids = cand_ids, cand_logits, vals, ids
        self._rows = [{anchor: 0}] + [{t: r for r, t in enumerate(row)} for row in cand_ids[:-1].tolist()]
        self._seen: dict[tuple[int, int], tuple[list[float], list[int]]] = {}

    def __call__(self, depth: int, parent_token: int) -> tuple[list[float], list[int]]:
        d = depth - 1
        key = (depth, parent_token)
        if key in self._seen:
            return self._seen[key]
        row = self._rows[d].get(parent_token)
        if row is not None:
            self._seen[key] = (self._vals[d, row].tolist(), self._ids[d, row].tolist())
        else:
            with torch.no_grad():
                hidden = self._hidden[d]
                scores = self.selector.scores(hidden, *(torch.from_numpy(a).to(hidden.device) for a in (
                    self._cand_ids[d], self._cand_logits[d])), torch.tensor(parent_token, device=hidden.device))
            vals, order = torch.log_softmax(scores, -1).sort(descending=True, stable=True)
            self._seen[key] = (vals.tolist(), self._cand_ids[d][order.cpu().numpy()].tolist())
        return self._seen[key]


def build_tree(anchor: int, children, budget: int, path: tuple[int, ...] = ()) -> Tree:
    """The `budget` nodes of highest path probability, best first, after the nodes of `path`
    (a chain the tree must hold), which the tree always holds; ties go to the earlier
    candidate. `children(depth, parent_token)` -> (log-probabilities, tokens), best first: the
    candidates for a node's children at `depth` (`MarginalChildren`, `SelectorChildren`); its
    `depth` is the deepest a node may sit. A [D, V] tensor of per-position log-probabilities
    stands for `MarginalChildren` of it."""
    if isinstance(children, torch.Tensor):
        children = MarginalChildren(children, budget)
    depth_max = children.depth
    tokens, parents, depths, scores = [anchor], [-1], [0], [0.0]
    kids: list[dict[int, int]] = [{}]
    # candidates: (-(path log-prob), order, parent node, depth of the child, rank of its token,
    # the parent's children (log-probabilities, tokens)); a node asks for its children once
    heap: list[tuple] = []
    order = itertools.count()

    def push_first(parent: int, depth: int) -> None:  # a node's best child
        if depth <= depth_max:
            vals, ids = children(depth, tokens[parent])
            if vals:
                heapq.heappush(heap, (-(scores[parent] + vals[0]), next(order), parent, depth, 0, vals, ids))

    def add(parent: int, depth: int, token: int, score: float) -> int:
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        kids.append({})
        kids[parent][token] = node
        push_first(node, depth + 1)
        return node

    node = 0
    for depth, token in enumerate(path[:min(budget, depth_max)], 1):
        vals, ids = children(depth, tokens[node])
        logp = vals[ids.index(token)] if token in ids else min(vals)
        node = add(node, depth, token, scores[node] + logp)
    push_first(0, 1)
    while heap and len(tokens) <= budget:
        neg, _, parent, depth, rank, vals, ids = heapq.heappop(heap)
        if rank + 1 < len(vals):  # its next sibling
            heapq.heappush(heap, (-(scores[parent] + vals[rank + 1]), next(order), parent, depth, rank + 1,
                                  vals, ids))
        if ids[rank] not in kids[parent]:  # not a node of `path` already
            add(parent, depth, ids[rank], -neg)
    return Tree(tuple(tokens), tuple(parents), tuple(depths), tuple(scores))


def block_tree(drafter, anchor: int, proposal, budget: int) -> Tree:
    """Drafter `drafter`'s block `proposal` (one sequence's) as a draft tree of `budget` nodes
    rooted at `anchor`: DFlash2's children under its candidate selector given their parent's
    token (where the proposal carries the slots' hidden states), DFlash's under each
    position's own distribution."""
    if proposal.top is not None:  # a tensor-parallel drafter's gathered top candidates
        log_probs, ids = proposal.top[0][0], proposal.top[1][0]
        if drafter.config.version == 2:
            k = drafter.candidate_selector.num_candidates
            children = SelectorChildren(drafter.candidate_selector, proposal.hidden[0], None, anchor,
                                        (log_probs[:, :k], ids[:, :k]))
        else:
            children = MarginalChildren(log_probs, budget, ids)
    elif proposal.tables is not None:  # a DFlash2 package's selector tables
        children = SelectorChildren.from_tables(drafter.candidate_selector, proposal.hidden[0], anchor,
                                                *(t[0] for t in proposal.tables))
    elif drafter.config.version == 2 and proposal.hidden is not None:
        children = SelectorChildren(drafter.candidate_selector, proposal.hidden[0], proposal.logits[0], anchor)
    else:
        return marginal_tree(anchor, proposal.logits[0], budget)
    return build_tree(anchor, children, budget)


def marginal_tree(anchor: int, logits: torch.Tensor, budget: int) -> Tree:
    """A block's tree of `budget` nodes from its positions' own distributions (`logits` [D,
    V]): DFlash's, and any drafter's block read as DFlash's."""
    return build_tree(anchor, MarginalChildren(torch.log_softmax(logits.float(), dim=-1), budget), budget)


def choose_child(probs: torch.Tensor, children: list[int], generator=None) -> tuple[int, int]:
    """Lossless multi-candidate verification at one node (`probs` [V], the target's
    distribution there; `children`, its children's tokens, best first): each child in turn is
    accepted with its probability under what is left of `probs` once the children before it
    are taken out; if none is, the token is drawn from what is left. -> (index of the
    accepted child or -1, the token). Each token is emitted with exactly its probability under
    `probs` (SpecInfer's multi-step speculative sampling with one-hot drafts, drawn without
    replacement); one uniform per child tried, then one for the draw."""
    residual = probs.double().clone()
    for i, c in enumerate(children):
        total, mass = residual.sum(), residual[c]
        u = torch.rand((), generator=generator, device=probs.device, dtype=torch.float64)
        # a child holding all that is left is taken outright (rounding may leave its share a
        # hair under 1, and nothing to draw from if it were refused)
        if mass > 0 and (u * total < mass or total - mass <= 0):
            return i, c
        residual[c] = 0.0
    return -1, int(sample_from_probs(residual, generator))


def walk(tree: Tree, choose, kids: list[dict[int, int]] | None = None) -> tuple[list[int], int]:
    """A verify's outcome over the tree's rows: from the root, `choose(node, children)` (its
    children by token) -> (the child that continues the path, or None; the row's token).
    -> (the accepted path's nodes, the token of the row that ended it: recovered or bonus).
    `kids`: the tree's `children()`, where the caller has them."""
    kids = tree.children() if kids is None else kids
    path, node = [], 0
    while True:
        child, token = choose(node, kids[node])
        if child is None:
            return path, token
        path.append(child)
        node = child


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

"""Draft trees (DDTree) inside the whole-iteration graph: the tree is built, verified and
accepted on the device, so a tree mode's iteration, like a chain's, is one replay with no read
from the host (`iteration.DFlashIteration` is the chain's; this module holds what differs).

Per lane, one iteration:

- propose: the drafter's block as `DFlashIteration` runs it, with each draft slot's
  distribution (DFlash: its own top N tokens; DFlash2: its top K candidates under the candidate
  selector given each possible parent, `CandidateSelector.parent_log_probs`);
- build (`device_tree`): the N nodes of highest path probability, as `ddtree.build_tree` takes
  them best first, found with fixed shapes: every depth keeps the N best of its nodes' children
  (a node among the N best overall is among the N best of its depth, and its parent among the N
  best of the one above), then one stable sort of those D·N candidates by path probability
  takes the N best, a tie going to the shallower node, so a parent always comes before its
  children and the nodes form a tree;
- verify: the root (the pending token) and the N nodes as one forward of N+1 rows, node i
  written at slot pos+i, at position pos+depth_i, seeing the context and its own ancestors
  (`LaneKV`'s `slots` and `hidden`); with exact verify, the path row by row instead, one
  forward per depth as plain decoding's steps (`_walk_rows`: the walk below, a depth at a time);
- accept (`walk`): from the root, the child whose token is the row's target token (the argmax,
  or a sampled lane's draw from the row's distribution) while there is one, found for all
  depths at once; the emitted tokens are the target tokens of the path's rows, at most the
  lane's cap of drafts accepted. A sampled lane's walk is lossless: every emitted token is a
  draw from the target's distribution given the tokens before it, and a child is accepted
  exactly when the draw is its token, with the probability the multi-candidate rejection scheme
  accepts it (`ddtree.choose_child`: its drafts are one-hot);
- keep: the path's K/V moved from slots pos+p_i to pos+i (`compact`), its rows' taps fed to the
  drafter at the next iteration, as a chain's kept rows are.

Greedy lanes emit plain decoding's tokens wherever the verify's rows are plain decoding's
(the target's argmax at a node is its continuation of the node's path).
"""

from __future__ import annotations

import torch

from metrale.runtime.spec.iteration import ROOM, DFlashIteration, lanes_of
from metrale.runtime.spec.sampling import probs_on_device, sample_from_probs
from metrale.runtime.steps import MAX_TREE_NODES


def tree_room(budget: int, gamma: int) -> int:
    """The slots a request needs past its last position in iterations of trees of `budget`
    nodes over blocks of `gamma`, at least `ROOM`: the last iteration's advance (γ at most),
    then the rows of the one discarded after it (N+1 and its block of γ)."""
    return max(ROOM, 2 * gamma + budget + 1)


def marginal_children(logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash's children: logits [B, D, V] of the draft slots -> (log-probabilities, tokens,
    rows) [B, D, 1, C]: at depth d every parent's children are position d's top C = min(budget,
    V) tokens (one row: whatever the parent), best first, as `ddtree.MarginalChildren` takes
    them."""
    vals, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(budget, logits.shape[-1]), dim=-1)
    return vals[:, :, None], ids[:, :, None], torch.zeros_like(ids)[:, :, None]


def selector_children(selector, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor):
    """DFlash2's children: the draft slots' final hidden states [B, D, H] and logits [B, D, V]
    -> (log-probabilities, tokens, rows) [B, D, K, K]: row r of depth d the slot's K candidates
    under the candidate selector given slot d−1's candidate r (depth 0's every row: given the
    anchor [B]), in candidate order (`CandidateSelector.parent_log_probs`), a child's row being
    its own place among its slot's candidates."""
    cand_logits, cand_ids = logits.topk(selector.num_candidates, dim=-1)  # [B, D, K]
    vals = selector.parent_log_probs(selector.hidden_projection(hidden), cand_logits, cand_ids, anchor)
    b, d, k = cand_ids.shape
    rows = torch.arange(k, device=cand_ids.device).expand(b, d, k, k)
    return vals, cand_ids[:, :, None, :].expand(b, d, k, k), rows


def device_tree(anchor: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best-first tree of `budget` nodes per sequence (see the module docstring): anchor
    [B]; a node at depth d+1 whose parent reads row r has the children vals/ids [:, d, r]
    (log-probabilities and tokens, in any order) whose own rows are rows [:, d, r]
    (`marginal_children`, `selector_children`) -> tokens, parents, depths, valid, path
    log-probabilities [B, N+1]: node 0 the root (the anchor, its parent itself, log-probability
    0), a parent before its children, the nodes best first; a node of path log-probability −inf
    (fewer than N nodes can be had) is not valid."""
    b, depth, _, c = vals.shape
    n = budget
    device = vals.device
    lanes = torch.arange(b, device=device)[:, None]
    score = torch.zeros(b, 1, device=device)  # the beam above: the root alone
    row = torch.zeros(b, 1, dtype=torch.long, device=device)
    index = torch.full((b, 1), -1, dtype=torch.long, device=device)  # its candidates' numbers (root: −1)
    scores, tokens, parents = [], [], []
    for d in range(depth):
        w = score.shape[1]
        total = (score[:, :, None] + vals[:, d][lanes, row]).reshape(b, w * c)  # [B, w·C]
        if total.shape[1] < n:  # fewer children than the budget: the rest cannot be had
            total = torch.cat([total, total.new_full((b, n - total.shape[1]), float("-inf"))], dim=1)
        score, pick = total.topk(n, dim=1)  # the depth's N best, by path log-probability
        src, child = (pick // c).clamp(max=w - 1), pick % c
        parent_row = row.gather(1, src)
        scores.append(score)
        tokens.append(ids[:, d][lanes, parent_row, child])
        parents.append(index.gather(1, src))
        row = rows[:, d][lanes, parent_row, child]
        index = d * n + torch.arange(n, device=device).expand(b, n)
    scores, tokens, parents = (torch.cat(t, dim=1) for t in (scores, tokens, parents))  # [B, D·N]
    depths = torch.arange(1, depth + 1, device=device)[:, None].expand(depth, n).reshape(1, -1).expand(b, -1)
    # the N best of all depths; the candidates lie shallowest first, so a stable sort gives a
    # tie to the shallower (a child's log-probability is at most its parent's)
    order = scores.sort(dim=1, descending=True, stable=True).indices[:, :n]
    node = torch.zeros_like(scores, dtype=torch.long).scatter_(
        1, order, torch.arange(1, n + 1, device=device).expand(b, n))  # candidate -> node (0: not taken)
    parent = parents.gather(1, order)
    parent = torch.where(parent < 0, 0, node.gather(1, parent.clamp(min=0)))
    zero = torch.zeros(b, 1, dtype=torch.long, device=device)
    scores = torch.cat([zero.float(), scores.gather(1, order)], dim=1)
    return (torch.cat([anchor[:, None], tokens.gather(1, order)], dim=1),
            torch.cat([zero, parent], dim=1),
            torch.cat([zero, depths.gather(1, order)], dim=1),
            scores > float("-inf"), scores)


def ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """parents [B, N+1] (the root its own) -> [B, N+1, N+1] bool: row i holds i and its
    ancestors."""
    b, r = parents.shape
    anc = torch.eye(r, dtype=torch.bool, device=parents.device).expand(b, r, r).clone()
    up = torch.arange(r, device=parents.device).expand(b, r)
    for _ in range(depth):
        up = parents.gather(1, up)
        anc.scatter_(2, up[:, :, None], True)
    return anc


def hidden_slots(anc: torch.Tensor, pos: torch.Tensor, slots: int) -> torch.Tensor:
    """The slots each tree row may not see: node i of the lane at `pos` [B] is written at slot
    pos+i and sees the slots before pos and its ancestors' -> [B, 1, N+1, slots] bool."""
    b, r, _ = anc.shape
    offset = torch.arange(slots, device=pos.device)[None, :] - pos[:, None]  # [B, S]
    seen = anc.gather(2, offset.clamp(0, r - 1)[:, None, :].expand(b, r, slots))  # [B, N+1, S]
    seen = (offset < 0)[:, None, :] | (seen & (offset < r)[:, None, :])
    return ~seen[:, None]


def walk(target_ids: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
         valid: torch.Tensor, anc: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path: from the root, the child whose token is the node's target token
    (`target_ids` [B, N+1]) while there is one. A node continues the path when its token is its
    parent's target token and so does every node above it (`anc`, `ancestors`); siblings'
    tokens differ, so at most one node of each depth does -> (path [B, D+1]: the root, then the
    path's node at each depth up to `depth`, the root past its end; n [B] its accepted
    drafts)."""
    match = valid & (tokens == target_ids.gather(1, parents))
    match[:, 0] = True  # the root
    on_path = ~(anc & ~match[:, None, :]).any(2)  # [B, N+1]
    levels = torch.arange(depth + 1, device=tokens.device)
    at = on_path[:, None, :] & (depths[:, None, :] == levels[None, :, None])  # [B, D+1, N+1]
    return at.long().argmax(2), on_path.sum(1) - 1


def compact(kv: list[torch.Tensor], pos: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> None:
    """Move each lane's accepted path's K/V into place: node path[i] was written at slot
    pos+path[i] and belongs at pos+i (i = 1..n); `kv` per layer K [B, nkv, hd, S] then V
    [B, nkv, S, hd] (a pool's lanes, in place)."""
    depth = path.shape[1] - 1
    i = torch.arange(1, depth + 1, device=pos.device)
    src = pos[:, None] + torch.where(i <= n[:, None], path[:, 1:], i)  # [B, D]: past the path, in place
    dst = pos[:, None] + i
    # the slots as each kind of pool indexes them (every layer's K alike, every V alike)
    k_shape, v_shape = list(kv[0].shape), list(kv[1].shape)
    k_shape[3] = v_shape[2] = depth
    k_at, k_to = (x[:, None, None, :].expand(k_shape) for x in (src, dst))
    v_at, v_to = (x[:, None, :, None].expand(v_shape) for x in (src, dst))
    for j, t in enumerate(kv):
        if j % 2 == 0:
            t.scatter_(3, k_to, t.gather(3, k_at))
        else:
            t.scatter_(2, v_to, t.gather(2, v_at))


class DFlashTreeIteration(DFlashIteration):
    """A DFlash / DFlash2 drafter's block as a draft tree, built, verified and accepted on the
    device (see the module docstring), for each node budget of `budgets` (a variant each; the
    largest, N, the tree every variant builds, a smaller b verifying its first b nodes, which
    are the best-first tree of b); with `plain`, also a plain variant (count 0) that keeps its
    row for the drafter, and with `settled` one that keeps nothing (`SETTLED`). Its count is the
    tree's nodes: what it verifies. With `stats`, each tree iteration leaves every stepped
    lane's tree in `stats` (its N nodes' path probabilities, best first, and their depths; 0
    where a node is not valid): what adaptive k over budgets prices the next trees by."""

    def __init__(self, model, drafter, budgets: int | tuple[int, ...], *, gamma: int | None = None,
                 exact: bool = False, plain: bool = False, settled: bool = False, stats: bool = False,
                 slots: int, lanes: int = 1, ring: int = 64, linear: str = "gemm"):
        budgets = (budgets,) if isinstance(budgets, int) else tuple(sorted(set(budgets)))
        if not budgets or not all(1 <= b <= MAX_TREE_NODES for b in budgets):
            raise ValueError(f"trees of {budgets} nodes: 1 to {MAX_TREE_NODES}")
        self.budgets, self.budget = budgets, max(budgets)
        super().__init__(model, drafter, ((0,) if plain else ()) + budgets, gamma=gamma, exact=exact,
                         settled=settled, slots=slots, lanes=lanes, ring=ring, linear=linear, distributions=True)
        self.selector = drafter.candidate_selector if drafter.config.version == 2 else None
        self._tree_rows = torch.arange(self.budget + 1, device=self.device)
        if stats:
            self.stats = (torch.zeros(lanes, self.budget, device=self.device),
                          torch.zeros(lanes, self.budget, dtype=torch.long, device=self.device))

    def most_drafts(self, gamma: int) -> int:
        return MAX_TREE_NODES

    def rows(self, k) -> int:  # exact: a row a depth, as deep as a tree of k goes
        return min(self.gamma, k + 1) if self.exact and k in self.budgets else super().rows(k)

    def accepts(self, k) -> int:
        return min(self.gamma - 1, k) if k in self.budgets else super().accepts(k)  # a path's depth

    def emitted_rows(self) -> int:
        return self.gamma  # the path's drafts and its bonus: the block's γ at most

    def room(self) -> int:
        return tree_room(self.budget, self.gamma)

    @property
    def proposed(self) -> int:
        return self.budget

    def targets(self, logits: torch.Tensor, sampled: bool) -> torch.Tensor:
        """The target's token at each row, logits [B, R, V] -> [B, R]: its argmax or, where
        `sampled` and the lane samples, a draw from the row's distribution."""
        ids = logits.argmax(-1)
        if not sampled:
            return ids
        b, r, _ = logits.shape
        s = self.state
        per_row = lambda t: t[:b, None].expand(b, r).reshape(-1, 1)  # noqa: E731 - [B] -> [B·R, 1]
        probs = probs_on_device(logits.reshape(b * r, -1), per_row(s.temperature), per_row(s.top_p))
        drawn = sample_from_probs(probs, self.generator).view(b, r)
        return torch.where(s.sampled[:b, None], drawn, ids)

    def step(self, b: int, k, sampled: bool, slots: int) -> tuple:
        if k not in self.budgets:
            return super().step(b, k, sampled, slots)
        s = self.state
        pending, pos = s.pending[:b], s.pos[:b]
        block_logits, block_hidden = self._propose(b, slots)
        if self.selector is not None:
            children = selector_children(self.selector, block_hidden, block_logits, pending)
        else:
            children = marginal_children(block_logits, self.budget)
        tree = device_tree(pending, *children, self.budget)
        if self.stats:
            active = s.active[:b].bool()[:, None]
            for t, new in zip(self.stats, (tree[4][:, 1:].exp(), torch.where(tree[3], tree[2], 0)[:, 1:])):
                t[:b].copy_(torch.where(active, new, t[:b]))
        tokens, parents, depths, valid = (t[:, :k + 1] if k < self.budget else t for t in tree[:4])  # the tree of k
        if self.exact:
            return self._walk_rows(b, k, tokens, parents, valid, sampled, slots)
        depth = self.gamma - 1
        anc = ancestors(parents, depth)
        rows = k + 1
        lane_seq, _ = self.index(b, rows)
        kv = lanes_of(self.kv, 0, b, slots)
        unseen = hidden_slots(anc, pos, slots)
        logits, _, taps = (o.view(b, rows, -1) for o in self.target.forward_tree(
            tokens.reshape(-1), (pos[:, None] + depths).reshape(-1), lane_seq, self.index(1, b * rows)[1],
            (pos[:, None] + self._tree_rows[:rows]).reshape(-1), unseen, *kv))
        # a sampled lane draws at every node; the walk keeps what the path needs
        target_ids = self.targets(logits, sampled)  # [B, N+1]
        path, n = walk(target_ids, tokens, parents, depths, valid, anc, depth)
        n = torch.minimum(n, s.cap[:b])
        compact(kv, pos, path, n)
        self._keep(b, taps.gather(1, path[:, :, None].expand(b, self.gamma, taps.shape[-1])), n)  # the path's
        s.emit(target_ids.gather(1, path), n)
        return ()

    def _walk_rows(self, b: int, k: int, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                   sampled: bool, slots: int) -> tuple:
        """Exact verify of the tree of k nodes [B, k+1] (`device_tree`): the path walked one row
        per forward, as plain decoding runs its steps (so greedy lanes emit its bits), as many
        rows as the tree can be deep (`rows`). Row j is the path's node at depth j at slot and
        position pos+j; its target token picks the child that holds it, and the path ends where
        none does (the later rows run on and count for nothing). The rows lie in the path's
        order, so nothing moves."""
        s = self.state
        pos = s.pos[:b]
        seq = self.index(b, 1)[0]
        kv = lanes_of(self.kv, 0, b, slots)
        node = torch.zeros(b, dtype=torch.long, device=self.device)  # each lane's node on its path
        on = torch.ones(b, dtype=torch.bool, device=self.device)  # its path goes on
        n = torch.zeros(b, dtype=torch.long, device=self.device)
        kids = valid & (torch.arange(tokens.shape[1], device=self.device) > 0)  # the root is no child
        ids, taps, rows = [], [], self.rows(k)
        for j in range(rows):
            logits, _, tap = self.forward(tokens.gather(1, node[:, None])[:, 0], pos + j, seq, kv)
            t = self.targets(logits[:, None], sampled)[:, 0]
            ids.append(t)
            taps.append(tap)
            if j == rows - 1:
                break
            child = kids & (parents == node[:, None]) & (tokens == t[:, None])  # [B, N+1]: one at most
            on = on & child.any(1)
            n = n + on.long()
            node = torch.where(on, child.long().argmax(1), node)
        n = torch.minimum(n, s.cap[:b])
        self._keep(b, torch.stack(taps, dim=1), n)
        s.emit(torch.stack(ids, dim=1), n)
        return ()

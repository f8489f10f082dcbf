"""Drafts made on rank 0 only, relayed to the other ranks (`--draft-tp-size 1` on a world).

Every rank of a world runs the same decode loop over its replicated target, so each needs the
step's drafts; with `--draft-tp-size 1` only the leader holds the drafter ("1 runs the whole
drafter on rank 0"). `LeaderDrafts` wraps the leader's proposer and broadcasts what it proposes;
`RelayedDrafts` is the other ranks' proposer, which receives it. Per step they exchange, in the
same order on every rank: the drafts (when the step proposes: a chain's tokens, or a draft
tree's tokens, parents and depths) and, after the step's `accept`,
whether the drafter has retired (`off`: adaptive k settled on plain decoding), so every rank
takes the same branch of the next step.
"""

from __future__ import annotations

import torch

from metrale.runtime.models.tp import World
from metrale.runtime.spec.ddtree import Tree
from metrale.runtime.spec.proposer import NO_DRAFTS, Proposer


class LeaderDrafts(Proposer):
    """The leader's proposer, unchanged, plus the broadcasts the other ranks wait for. Neither
    side `follows`: every rank must reach the same broadcasts, so each step proposes."""

    def __init__(self, inner: Proposer, world: World):
        self.inner, self.world = inner, world
        self.taps = inner.taps
        # every rank verifies a tree the same way: by the flag, never by a table one rank holds
        self.tree_verify = inner.tree_verify

    @property
    def max_len(self) -> int:
        return self.inner.max_len

    @max_len.setter
    def max_len(self, value: int) -> None:
        self.inner.max_len = value

    @property
    def off(self) -> bool:
        return self.inner.off

    def prefill(self, prompt_ids: list[int], out, pending: int) -> None:
        self.inner.prefill(prompt_ids, out, pending)

    def propose_steps(self, pending: int, max_drafts: int):
        drafts, proposed = yield from self.inner.propose_steps(pending, max_drafts)
        if type(drafts) is Tree:
            self.world.broadcast(((drafts.tokens, drafts.parents, drafts.depths), proposed))
        else:
            self.world.broadcast((drafts.tolist(), proposed))
        return drafts, proposed

    def accept(self, out, rows: int, emitted: torch.Tensor) -> None:
        self.inner.accept(out, rows, emitted)
        self.world.broadcast(self.off)


class RelayedDrafts(Proposer):
    """A non-leader rank's proposer: the leader's drafts, received; no drafter, no taps."""

    def __init__(self, world: World, device: torch.device | str = "cpu", tree_verify: str = "auto"):
        self.world, self.device = world, device
        self.tree_verify = tree_verify  # the leader's (`LeaderDrafts`)
        self._off = False

    @property
    def off(self) -> bool:
        return self._off

    def prefill(self, prompt_ids: list[int], out, pending: int) -> None:
        self._off = False

    def propose_steps(self, pending: int, max_drafts: int):
        ids, proposed = self.world.broadcast()
        if type(ids) is tuple:  # a draft tree (the decode loop verifies it as the leader's)
            return Tree(*ids), proposed
        drafts = torch.tensor(ids, dtype=torch.long, device=self.device) if ids else NO_DRAFTS
        return drafts, proposed
        yield  # a coroutine that needs no model step

    def accept(self, out, rows: int, emitted: torch.Tensor) -> None:
        self._off = bool(self.world.broadcast())

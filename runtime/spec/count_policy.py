"""Which of an iteration's counts the next iteration verifies, where a mode has several
(`iteration_loop`: a graph captured per count, one picked by the host before each replay): a
DFlash draft ladder's rung, adaptive k's count, or with draft trees adaptive k's node budget."""

from __future__ import annotations

import math

from metrale.runtime.spec.adaptive_k import AdaptiveKController, DraftLadder, TreeBudgetChooser
from metrale.runtime.spec.config import ResolvedDFlash, SpecMode, SpeculativeConfig
from metrale.runtime.spec.iteration import SETTLED


def drafts_of(count) -> int:
    """The drafts an iteration of policy count `count` verifies (SETTLED's variant: none)."""
    return 0 if count is SETTLED else count


class CountPolicy:
    """Which of a `DFlashIteration`'s counts the next iteration verifies: adaptive k's choice
    (`--dflash-adaptive-k`; `SETTLED` once it settled on plain decoding), else the draft
    ladder's rung (`--dflash-draft-ladder`). The loop runs one stream, so adaptive k decides
    every iteration; it learns each iteration's outcome when the host reads it, one iteration
    after the next count was chosen."""

    stats = False  # whether it reads what the iteration leaves (`iteration.stats`)

    def __init__(self, settings: ResolvedDFlash):
        self.settings = settings
        self.ladder = DraftLadder(settings.ladder) if settings.ladder else None
        self.controller = None
        if settings.adaptive_k is not None:
            self.controller = AdaptiveKController(settings.adaptive_k, settings.max_drafts,
                                                  settings.reprobe_interval or 16, self.ladder)
        cost = settings.adaptive_k
        self.counts = (tuple(k for k in cost.counts if k <= settings.max_drafts) if cost is not None
                       else self.ladder.rungs)

    def next(self):
        if self.controller is None:
            return self.ladder.current
        k = self.controller.next_k()
        return SETTLED if self.controller.settled else k

    def observe(self, key, emitted: int, stats=None) -> None:
        """An iteration at count `key` emitted that many tokens (`stats`: what it left for the
        policy, its iteration's `stats` read for the lane)."""
        if key is SETTLED:
            return
        (self.controller or self.ladder).observe(key, emitted - 1)

    def reset(self) -> None:
        """Start as constructed: from adaptive k's prior, on the ladder's lowest rung. A request
        run alone starts so (as the decode loop's do), so the counts it runs, and with them a
        seeded request's draws, do not depend on the requests before it."""
        self.__init__(self.settings)

    def reopen(self) -> None:
        """A sequence joins the batch: adaptive k settled by what the others accepted measures
        afresh (`AdaptiveKController.reopen`)."""
        if self.controller is not None:
            self.controller.reopen()

    def observe_batch(self, k: int, emitted: list[int], stats=None) -> None:
        """An iteration of many lanes at count k (each lane's tokens emitted): every lane
        teaches adaptive k's estimates, and the ladder moves once, by the batch's outcome."""
        (self.controller or self.ladder).observe_batch(k, [n - 1 for n in emitted])


class TreeCountPolicy(CountPolicy):
    """Adaptive k over draft trees' budgets (`--dflash-adaptive-k` with `--dflash-tree-budget`)
    as the decode loop's proposer decides it: adaptive k's controller whether an iteration
    drafts (over the chain counts, with its probes and its settling), `TreeBudgetChooser` how
    many nodes its tree verifies. The host picks an iteration's graph before its tree exists,
    so the chooser prices the budgets with the path probabilities of the trees the last
    iterations built (their nodes', best first: a decayed mean over iterations and lanes, which
    `DFlashTreeIteration.stats` leaves); each verified tree teaches it what the target accepted
    of its first b nodes, and the controller the path's depth it could reach. Its budgets are
    the table's powers of two and its largest (a graph each, per batch and slot bucket)."""

    stats = True
    DECAY = 0.9  # the mean tree's, per iteration

    def __init__(self, settings: ResolvedDFlash):
        cost = settings.adaptive_k
        self.settings = settings
        self.controller = AdaptiveKController(cost.up_to(settings.max_drafts), settings.max_drafts,
                                              settings.reprobe_interval or 16)
        self.chooser = TreeBudgetChooser(cost, settings.tree_budget, sparse=True)
        self.counts = tuple(self.chooser.counts)
        self.probs: list[float] | None = None  # the recent trees' nodes' path probabilities

    def next(self):
        k = self.controller.next_k()
        if self.controller.settled:
            return SETTLED
        if not k:
            return 0
        return self.counts[-1] if self.probs is None else self.chooser.choose(self.probs)

    def observe(self, key, emitted: int, stats=None) -> None:
        self.observe_batch(key, [emitted], [stats])

    def observe_batch(self, k, emitted: list[int], stats=None) -> None:
        """Every lane's tree and outcome; the means move once an iteration, by the batch's
        (whatever the order of its lanes)."""
        if k is SETTLED or not k or not emitted:
            return
        trees = [probs for probs, _ in stats]
        batch = [math.fsum(col) / len(trees) for col in zip(*trees)]  # the batch's mean tree (exact sums)
        self.probs = batch if self.probs is None else [
            self.DECAY * m + (1.0 - self.DECAY) * p for m, p in zip(self.probs, batch)]
        self.chooser.observe([math.fsum(p for probs in trees for p in probs[:k])], sum(emitted) - len(emitted))
        for n, (_, depths) in zip(emitted, stats):
            self.controller.observe(max(depths[:k]), n - 1)


def count_policy(spec: SpeculativeConfig, dflash: ResolvedDFlash | None) -> CountPolicy | None:
    """What picks each iteration's count: a DFlash draft ladder's or adaptive k's (over tree
    budgets, with trees); None for a mode of one count."""
    if spec.mode is not SpecMode.DFLASH or (dflash.ladder is None and dflash.adaptive_k is None):
        return None
    return TreeCountPolicy(dflash) if dflash.tree_budget else CountPolicy(dflash)

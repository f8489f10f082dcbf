"""Choosing how many drafts to verify per step: the DFlash ladder and the adaptive draft count.

Contract:
- `expected_tokens(acc, k)` is E(k) = 1 + Σ_{i=1..k} Π_{j=1..i} a_j: the expected tokens a step
  emits when it verifies k drafts, with a_j the conditional probability that draft j is
  accepted given drafts 1..j−1 were (the 1 is the bonus / recovered token every step emits).
- `choose_k(cost, acc, max_k)` picks the count with the most expected tokens per ms.
- `AcceptanceEstimator` measures a_j from verify outcomes without censoring bias.
- `DraftLadder` is the `--dflash-draft-ladder` state machine; `AdaptiveKController` combines
  the ladder cap, the estimator and `--dflash-adaptive-k`'s cost model into a per-step k.

Invariants: pure Python, no tensors and no model code; every object holds the state of one
sequence. The adaptive controller is for a single stream: with concurrent sequences a step's
cost no longer depends on one sequence's draft count alone, so the serve leaves k to the
ladder or to γ there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from metrale.runtime.spec.cost_model import CostModel


def expected_tokens(acc: Sequence[float], k: int) -> float:
    """E(k) = 1 + Σ_{i=1..k} Π_{j=1..i} a_j, with `acc[j-1]` = a_j; needs len(acc) >= k."""
    if k < 0 or k > len(acc):
        raise ValueError(f"k = {k} needs 0 <= k <= len(acc) = {len(acc)}")
    total, chain = 1.0, 1.0
    for a in acc[:k]:
        chain *= a  # probability that drafts 1..i are all accepted
        total += chain
    return total


def choose_k(cost: CostModel, acc: Sequence[float], max_k: int) -> int:
    """The count k <= max_k of `cost` maximizing E(k) / cost(k); ties go to the smaller k.

    `acc` must hold at least min(max_k, cost.max_count) rates. The smaller k wins a tie because
    it spends fewer drafter and verify rows for the same expected throughput.
    """
    best_k, best_rate = None, -1.0
    for k in cost.counts:
        if k > max_k:
            break
        rate = expected_tokens(acc, k) / cost.cost(k)
        if rate > best_rate:  # strict: an equal rate keeps the smaller k
            best_k, best_rate = k, rate
    if best_k is None:
        raise ValueError(f"no count of the cost model {cost} is <= max_k = {max_k}")
    return best_k


class AcceptanceEstimator:
    """Per-position conditional acceptance a_j, counting only the positions actually tested.

    One verify step that drafted n and accepted m tested positions 1..m (all accepted) and, if
    m < n, position m+1 (rejected); positions after m+1 were never compared with the target, so
    they count neither way. The naive ratio accepted / drafted counts them as rejections and
    underestimates acceptance whenever chains are longer than their accepted prefix.

    `rates` shrinks each position towards the pooled rate of all positions with a pseudo-count
    (`strength`), and the pooled rate towards `prior`: a position never tested inherits the
    sequence's overall acceptance, and a sequence with no data at all starts at `prior`.
    `decay` < 1 multiplies the counts by `decay` before every update, so old steps fade and a
    re-probe after a long suspension can move the estimate.
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay = {decay}; expected 0 < decay <= 1")
        self.decay = decay
        self.tested: list[float] = []  # tested[j-1]: times position j was verified
        self.accepted: list[float] = []  # accepted[j-1]: times position j was accepted

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafts")
        if num_drafted == 0:
            return  # a plain step measures nothing
        if self.decay < 1.0:
            self.tested = [t * self.decay for t in self.tested]
            self.accepted = [a * self.decay for a in self.accepted]
        last_tested = min(num_accepted + 1, num_drafted)
        while len(self.tested) < last_tested:
            self.tested.append(0.0)
            self.accepted.append(0.0)
        for j in range(last_tested):
            self.tested[j] += 1.0
        for j in range(num_accepted):
            self.accepted[j] += 1.0

    def pooled(self, prior: float = 0.5, strength: float = 1.0) -> float:
        """All tested positions together, shrunk towards `prior` by `strength` pseudo-tests."""
        return (sum(self.accepted) + strength * prior) / (sum(self.tested) + strength)

    def rates(self, max_k: int, prior: float = 0.5, strength: float = 1.0) -> list[float]:
        """[a_1, ..., a_max_k]; each (accepted_j + s·pooled) / (tested_j + s), s = strength."""
        if not (0.0 <= prior <= 1.0 and strength > 0.0):
            raise ValueError(f"prior = {prior}, strength = {strength}; expected 0..1 and > 0")
        pooled = self.pooled(prior, strength)
        out = []
        for j in range(max_k):
            t = self.tested[j] if j < len(self.tested) else 0.0
            a = self.accepted[j] if j < len(self.accepted) else 0.0
            out.append((a + strength * pooled) / (t + strength))
        return out


class DraftLadder:
    """`--dflash-draft-ladder`: the draft count a sequence sits on, moved by its verify outcomes.

    A sequence starts on the lowest rung: its acceptance is unknown, a low rung wastes the
    fewest drafter and verify rows if it turns out poor, and a sequence that accepts well
    climbs one rung per fully accepted step, so starting low costs only a few steps.
    A step that accepts all its drafts moves up one rung; a step that accepts fewer drafts than
    the rung below moves down one; anything else stays.
    """

    def __init__(self, rungs: Sequence[int]) -> None:
        rungs = tuple(rungs)
        if not rungs or rungs[0] < 1 or any(b <= a for a, b in zip(rungs, rungs[1:])):
            raise ValueError(f"rungs {rungs}: expected strictly ascending counts of at least 1")
        self.rungs = rungs
        self.index = 0

    @property
    def current(self) -> int:
        return self.rungs[self.index]

    def observe(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafts")
        if drafted == 0:
            return  # a plain step says nothing about the rung
        if accepted == drafted:
            self.index = min(self.index + 1, len(self.rungs) - 1)
        elif self.index > 0 and accepted < self.rungs[self.index - 1]:
            self.index -= 1

    def observe_batch(self, drafted: int, accepted: Sequence[int]) -> None:
        """One step of many sequences at one count: the ladder moves once, by the lower median
        of their accepted drafts (a rung for the batch, not one sequence's, whatever their
        order)."""
        if accepted:
            self.observe(drafted, sorted(accepted)[(len(accepted) - 1) // 2])


class TreeBudgetChooser:
    """`--dflash-adaptive-k` with `--dflash-tree-budget N`: each step verifies the first b nodes
    of its block's best-first tree, b the count of the cost model (1 <= b <= N) with the most
    expected tokens per ms. A tree built best first holds, for every b, the tree of budget b
    as its first b nodes, and its expected tokens are 1 + Σ P(node's path accepted) over them;
    the drafter's path probabilities stand for those, scaled by how the target has accepted its
    trees so far (`ratio`: accepted nodes over the path probability the verified trees summed,
    counts decayed as `AcceptanceEstimator`'s, shrunk towards 1 by `strength` pseudo-trees). A
    single-stream policy, as `AdaptiveKController`. `sparse`: only the budgets that are powers
    of two, and the largest (what whole iterations capture a graph for, `count_policy`)."""

    def __init__(self, cost: CostModel, budget: int, decay: float = 0.9, strength: float = 2.0,
                 sparse: bool = False) -> None:
        self.cost, self.decay, self.strength = cost, decay, strength
        self.counts = [b for b in cost.counts if 1 <= b <= budget]
        if sparse:
            self.counts = [b for b in self.counts if b & (b - 1) == 0 or b == self.counts[-1]]
        if not self.counts:
            raise ValueError(f"the cost model {cost} prices no tree of 1..{budget} nodes")
        self.accepted = 0.0  # accepted nodes of the verified trees (decayed)
        self.predicted = 0.0  # the path probabilities they summed (decayed)

    @property
    def ratio(self) -> float:
        return (self.accepted + self.strength) / (self.predicted + self.strength)

    def choose(self, path_probs: Sequence[float]) -> int:
        """The budget for a tree whose nodes (root excluded, best first) have these path
        probabilities; ties go to the smaller budget."""
        best, best_rate, total, r = self.counts[0], -1.0, 0.0, self.ratio
        sums = [0.0]
        for p in path_probs:
            total += p
            sums.append(total)
        for b in self.counts:
            rate = (1.0 + r * sums[min(b, len(sums) - 1)]) / self.cost.cost(b)
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def observe(self, path_probs: Sequence[float], accepted: int) -> None:
        """A verified tree (its nodes' path probabilities) and the nodes the target accepted."""
        self.accepted = self.accepted * self.decay + accepted
        self.predicted = self.predicted * self.decay + sum(path_probs)


class AdaptiveKController:
    """`--dflash-adaptive-k` for one stream: each step verifies the k with most tokens per ms.

    Call `next_k()` once per decode step and `observe(drafted, accepted)` after it. k is capped
    by the ladder's rung (when a ladder is given) and by `max_k` (γ − 1). When the chosen k is
    0 the step decodes plainly; after `reprobe_interval` plain steps in a row `next_k` returns
    the best k > 0 once, so the estimator gets a fresh measurement (a suspended sequence would
    otherwise never learn that its acceptance rose). A probe that leaves the stream suspended
    doubles the interval (up to `MAX_BACKOFF` times the base; a resumed stream starts again
    from the base), so a stream whose acceptance stays low pays for ever fewer probes. Where
    the cost model says no k > 0 could beat a plain step even with every draft accepted
    ((k+1)/cost(k) <= 1/cost(0) for every allowed k), a probe could not change the decision
    and none is run: the stream decodes plainly throughout (`settled`: the decode loop then
    retires the proposer, see `dflash_proposer`). More generally a probe runs only
    while an optimistic acceptance — the pooled rate's upper confidence bound, `Z` standard
    errors above it — could make some count pay; a stream whose measured acceptance (or, before
    it has any, the calibrated acceptance the cost model carries) is far below what the table
    needs is not probed.

    A probe is an investment a suspended stream pays for in plain decoding's time: its expected
    loss (the probe's step cost less the plain steps its expected tokens replace, at the
    current estimate) is spread over enough plain steps to stay under `PROBE_BUDGET` of their
    time, so where drafting costs many plain steps (a CPU) probes are rare and a stream close
    to paying is probed as often as the interval allows. The wait before a probe is the larger
    of the (backed-off) interval and that budget's. Where the drafter's context is kept by
    running the plain steps' rows again before the probe (`rerun_rows`: a target whose rows do
    not depend on the forward's others), each waited step also costs a target row
    (`CostModel.row_ms`) against the budget; where that alone exceeds it no probe can be
    afforded and the stream settles.

    A cost model with `acceptance` (measured by `metrale calibrate` or `bench`) starts the
    stream at that rate, weighted as `CALIBRATED_STRENGTH` tested positions; otherwise at `prior`
    with the weight of one.

    While suspended the choice cannot change before the probe (plain steps measure nothing), so
    a caller may run the plain steps `plain_ahead()` counts without asking `next_k` at each and
    record them with `skip(n)`.
    """

    MAX_BACKOFF = 64
    Z = 2.0
    CALIBRATED_STRENGTH = 16.0
    HOST_DECAY = 0.9  # `observe_host`: the weight of the past steps
    PROBE_BUDGET = 0.01

    def __init__(
        self,
        cost: CostModel,
        max_k: int,
        reprobe_interval: int,
        ladder: DraftLadder | None = None,
        estimator: AcceptanceEstimator | None = None,
        prior: float = 0.5,
    ) -> None:
        if max_k < 1 or reprobe_interval < 1:
            raise ValueError(f"max_k = {max_k}, reprobe_interval = {reprobe_interval}; need >= 1")
        self.cost = self.table = cost
        self.host_row_ms: float | None = None  # host work per verified row the table lacks (`observe_host`)
        self.max_k = max_k
        self.reprobe_interval = reprobe_interval
        self.ladder = ladder
        self.estimator = estimator if estimator is not None else AcceptanceEstimator()
        self.prior, self.strength = prior, 1.0
        if cost.acceptance is not None:
            self.prior, self.strength = cost.acceptance, self.CALIBRATED_STRENGTH
        self._start()
        self.probed = False  # the last k came from a probe
        self.row_ms = 0.0  # what keeping a plain step's row for the probe costs (`rerun_rows`)

    def _start(self) -> None:
        """The choice's state before any step (at construction, and when `reopen`ed)."""
        self.plain_steps = 0  # consecutive steps that chose k = 0
        self.interval = self.reprobe_interval  # the current re-probe interval (see backoff above)
        self._choice = None  # (what it depends on, rates, k, a probe could pay) of the last choice
        self.settled = False  # suspended with no probe that could pay: plain from here on

    def observe_host(self, ms_per_row: float) -> None:
        """A step's host work per row it verified that the measured table does not hold (a
        request's grammar: its mask at every row and its walk over the drafts), averaged over
        the steps (weight HOST_DECAY on the past) and added to the table's every count."""
        past = self.host_row_ms
        self.host_row_ms = ms_per_row if past is None else self.HOST_DECAY * past + (1 - self.HOST_DECAY) * ms_per_row
        self.cost, self._choice = self.table.plus_rows(self.host_row_ms), None

    def rerun_rows(self) -> None:
        """The plain steps' rows run again before a probe (rather than being kept as they
        come): each costs a target row, `cost.row_ms`, counted against the probe budget."""
        self.row_ms, self._choice = self.cost.row_ms, None

    def cap(self) -> int:
        return min(self.max_k, self.ladder.current) if self.ladder else self.max_k

    def reopen(self) -> None:
        """Where the measurements settled the stream on plain decoding (not the cost table, under
        which no count could pay at any acceptance), forget them: the next step chooses from the
        prior again. For a pool of sequences that changes (serving's lanes), whose newly
        admitted sequence may accept what those measured did not."""
        if self.settled and self.can_pay(self.cap()):
            self.estimator = AcceptanceEstimator(self.estimator.decay)
            self._start()

    def optimistic_acceptance(self) -> float:
        """The pooled acceptance's upper confidence bound (1 for a stream with no data and no
        calibrated prior)."""
        est = self.estimator
        p = est.pooled(self.prior, self.strength)
        n = sum(est.tested) + self.strength
        return min(1.0, p + self.Z * (p * (1.0 - p) / n) ** 0.5)

    def can_pay(self, cap: int, acceptance: float = 1.0) -> bool:
        """Could some 0 < k <= cap beat a plain step if every draft were accepted with
        probability `acceptance`? A step verifying more drafts costs at least what one verifying
        fewer does, so each count is judged at the largest cost up to it (a measured table's
        noise cannot make k look cheap)."""
        if self.cost.first != 0:
            return True
        plain, worst = 1.0 / self.cost.cost(0), self.cost.cost(0)
        for k in self.cost.counts:
            worst = max(worst, self.cost.cost(k))
            if 0 < k <= cap and expected_tokens([acceptance] * k, k) / worst > plain:
                return True
        return False

    def next_k(self) -> int:
        cap = self.cap()
        # the choice depends on the cap and the measurements only: a suspended stream's plain
        # steps measure nothing, so it is made again only when either changed
        key = (cap, len(self.estimator.tested), sum(self.estimator.tested))
        if self._choice is None or self._choice[0] != key:
            acc = self.estimator.rates(cap, prior=self.prior, strength=self.strength)
            k = choose_k(self.cost, acc, cap)
            pays = k > 0 or self.can_pay(cap, self.optimistic_acceptance())
            probe, budget_wait = 0, 0
            if k == 0 and pays:
                positive = CostModel(first=1, ms=self.cost.ms[1:])  # the same costs without 0
                probe = choose_k(positive, acc, cap)
                budget_wait = self.budget_wait(probe, acc)
                pays = budget_wait is not None  # else no probe can be afforded
            self._choice = (key, k, pays, probe, budget_wait)
        _, k, pays, probe, budget_wait = self._choice
        probed, self.probed = self.probed, False
        if k > 0:
            self.plain_steps, self.interval = 0, self.reprobe_interval
            return k
        if probed:  # the probe left the stream suspended: wait longer for the next one
            self.interval = min(2 * self.interval, self.MAX_BACKOFF * self.reprobe_interval)
        if not pays:
            # no probe will run, so no measurement will change this: plain for good
            self.settled = True
            return 0
        if self.plain_steps >= max(self.interval, budget_wait):
            self.plain_steps, self.probed = 0, True
            return probe
        self.plain_steps += 1
        return 0

    def budget_wait(self, probe: int, acc: Sequence[float]) -> int | None:
        """The plain steps before a probe of `probe` drafts that keep its expected loss (its
        cost less E(probe) plain steps' at the rates `acc`), with the rows kept for it
        (`row_ms` each), within `PROBE_BUDGET` of their time: 0 where the probe is expected to
        lose nothing, None where no wait is long enough."""
        plain = self.cost.cost(0)
        loss = self.cost.cost(probe) - expected_tokens(acc, probe) * plain
        spare = self.PROBE_BUDGET * plain - self.row_ms  # each waited step's share, its row paid
        if spare <= 0:
            return None if self.row_ms > 0 else 0
        return math.ceil(loss / spare - 1e-9) if loss > 0 else 0

    def plain_ahead(self) -> int:
        """After `next_k` returned 0: how many more steps will be plain before a probe is due
        (0 once settled: the decode loop then stops asking)."""
        if self.settled or self._choice is None:
            return 0
        return max(0, max(self.interval, self._choice[4]) - self.plain_steps)

    def skip(self, n: int) -> None:
        """`n` plain steps run without `next_k` (at most `plain_ahead()` of them)."""
        self.plain_steps += n

    def observe(self, drafted: int, accepted: int) -> None:
        self.estimator.update(drafted, accepted)
        if self.ladder is not None:
            self.ladder.observe(drafted, accepted)

    def observe_batch(self, drafted: int, accepted: Sequence[int]) -> None:
        """One step of many sequences verifying `drafted` each (serving's lanes): each one's
        outcome teaches the estimates; the ladder moves once (`DraftLadder.observe_batch`)."""
        for a in accepted:
            self.estimator.update(drafted, a)
        if self.ladder is not None:
            self.ladder.observe_batch(drafted, accepted)

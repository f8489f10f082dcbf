"""The draft count: E(k), the cost-model chooser, the estimator, the ladder, the controller."""

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.runtime.spec.adaptive_k import (
    AcceptanceEstimator,
    AdaptiveKController,
    DraftLadder,
    choose_k,
    expected_tokens,
)
from metrale.runtime.spec.cost_model import CostModel

SEED_COST = CostModel.parse("0:32,1:44,2:50,3:56")


@pytest.fixture
def interval_only(monkeypatch):
    """Probes as often as the re-probe interval allows: their cost budget out of the way, for
    the tests of the interval's own rules."""
    monkeypatch.setattr(AdaptiveKController, "PROBE_BUDGET", float("inf"))


def test_expected_tokens_by_hand():
    acc = [0.8, 0.5, 0.25]
    assert expected_tokens(acc, 0) == 1.0
    assert expected_tokens(acc, 1) == pytest.approx(1.8)  # 1 + 0.8
    assert expected_tokens(acc, 2) == pytest.approx(2.2)  # + 0.8·0.5
    assert expected_tokens(acc, 3) == pytest.approx(2.3)  # + 0.8·0.5·0.25
    with pytest.raises(ValueError):
        expected_tokens(acc, 4)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=10))
def test_expected_tokens_monotone_and_bounded(acc):
    values = [expected_tokens(acc, k) for k in range(len(acc) + 1)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert all(1.0 <= v <= k + 1 + 1e-12 for k, v in enumerate(values))


def test_choose_k_thresholds_of_the_seed_cost_model():
    # Cost 0:32,1:44,2:50,3:56 with i.i.d. acceptance α; rate r(k) = E(k)/cost(k):
    #   r0 = 1/32, r1 = (1+α)/44, r2 = (1+α+α²)/50, r3 = (1+α+α²+α³)/56.
    # Lower threshold: r1 > r0 ⇔ 1+α > 44/32 = 1.375 ⇔ α > 0.375. The others beat r0 later
    #   (r2 > r0 ⇔ α²+α > 0.5625 ⇔ α > (−1+√3.25)/2 ≈ 0.4014; r3 > r0 ⇔ α³+α²+α > 0.75 ⇔
    #   α > ≈ 0.4526), so k = 0 below 0.375 and k = 1 just above it.
    # Upper threshold: r3 > r2 ⇔ 50α³ > 6(1+α+α²) ⇔ f(α) = 50α³ − 6α² − 6α − 6 > 0, whose one
    #   positive root is α ≈ 0.6226 (f(0.622) ≈ −0.021, f(0.623) ≈ +0.023). Past it r3 also
    #   beats r1 (⇔ 1+α² > 56/44 ⇔ α > ≈ 0.5222) and r0, so k = 3 above ≈ 0.6226; just below
    #   it k = 2 (r2 > r1 ⇔ 44α² > 6(1+α) ⇔ α > ≈ 0.4437).
    f = lambda a: 50 * a**3 - 6 * a**2 - 6 * a - 6  # noqa: E731
    assert f(0.622) < 0 < f(0.623)

    def k_at(alpha):
        return choose_k(SEED_COST, [alpha] * 3, max_k=3)

    assert k_at(0.2) == 0 and k_at(0.374) == 0
    assert k_at(0.375) == 0  # exact tie r1 = 1.375/44 = 1/32 = r0: the smaller k wins
    assert k_at(0.376) == 1
    assert k_at(0.44) == 1 and k_at(0.45) == 2
    assert k_at(0.622) == 2 and k_at(0.624) == 3 and k_at(0.95) == 3


def test_choose_k_respects_max_k_and_a_model_without_zero():
    assert choose_k(SEED_COST, [0.9] * 3, max_k=2) == 2
    no_plain = CostModel.parse("1:44,2:50")
    assert choose_k(no_plain, [0.0, 0.0], max_k=2) == 1  # cannot suspend: the cheapest count
    with pytest.raises(ValueError):
        choose_k(no_plain, [0.5], max_k=0)


def simulate(alpha, k, steps, seed):
    """Verify outcomes of chains of k drafts, each accepted i.i.d. with probability alpha."""
    rng = random.Random(seed)
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        yield k, accepted


def test_estimator_recovers_alpha_where_the_naive_ratio_is_biased():
    alpha, k = 0.7, 4
    est = AcceptanceEstimator()
    drafted = accepted = 0
    for n, m in simulate(alpha, k, steps=4000, seed=1234):
        est.update(n, m)
        drafted, accepted = drafted + n, accepted + m
    # Naive accepted / drafted = E[m]/k = (α+α²+α³+α⁴)/4 = (0.7+0.49+0.343+0.2401)/4 ≈ 0.443:
    # drafts after the first rejection are counted as rejected though they were never tested.
    naive = accepted / drafted
    assert naive == pytest.approx(0.443, abs=0.02)
    assert abs(naive - alpha) > 0.2
    # Position j is tested ≈ 4000·α^(j−1) times (≥ 1372 at j = 4): standard error ≤ 0.013.
    rates = est.rates(k)
    assert all(abs(a - alpha) < 0.04 for a in rates), rates
    assert est.tested[0] == 4000 and est.tested[3] == pytest.approx(4000 * alpha**3, rel=0.1)


def test_estimator_counts_only_tested_positions():
    est = AcceptanceEstimator()
    est.update(4, 1)  # position 1 accepted, position 2 rejected, 3 and 4 untested
    est.update(2, 2)  # positions 1 and 2 accepted
    est.update(0, 0)  # plain step: nothing
    assert est.tested == [2, 2] and est.accepted == [2, 1]
    # prior 0.5, strength 1: pooled = (3 + 0.5)/(4 + 1) = 0.7;
    # a_1 = (2 + 0.7)/(2 + 1) = 0.9, a_2 = (1 + 0.7)/3 ≈ 0.5667, a_3 untested = 0.7/1 = 0.7.
    assert est.rates(3) == pytest.approx([0.9, 1.7 / 3, 0.7])
    assert AcceptanceEstimator().rates(2, prior=0.3) == pytest.approx([0.3, 0.3])
    with pytest.raises(ValueError):
        est.update(2, 3)


def test_estimator_decay_forgets_old_steps():
    est = AcceptanceEstimator(decay=0.5)
    est.update(1, 0)
    est.update(1, 0)
    est.update(1, 1)
    # Counts halve before each update: tested 1 → 0.5+1 = 1.5 → 0.75+1 = 1.75;
    # accepted 0 → 0 → 0+1 = 1. Without decay a_1 would be 1/3; here it leans to the last step.
    assert est.tested == [1.75] and est.accepted == [1.0]


def test_ladder_moves():
    ladder = DraftLadder([1, 3, 7])
    assert ladder.current == 1  # starts low
    ladder.observe(1, 1)  # all accepted: up
    assert ladder.current == 3
    ladder.observe(3, 1)  # 1 is not fewer than the rung below (1): stay
    assert ladder.current == 3
    ladder.observe(3, 3)
    assert ladder.current == 7
    ladder.observe(7, 7)  # top rung: stays
    assert ladder.current == 7
    ladder.observe(7, 2)  # 2 < 3: down
    assert ladder.current == 3
    ladder.observe(3, 0)  # 0 < 1: down
    assert ladder.current == 1
    ladder.observe(1, 0)  # bottom rung: stays
    assert ladder.current == 1
    ladder.observe(0, 0)  # a plain step: no move
    assert ladder.current == 1
    with pytest.raises(ValueError):
        DraftLadder([3, 1])


@given(st.lists(st.integers(1, 20), min_size=1, max_size=5, unique=True).map(sorted),
       st.lists(st.floats(0.0, 1.0), max_size=30))
def test_ladder_stays_on_its_rungs(rungs, fractions):
    ladder = DraftLadder(rungs)
    for f in fractions:
        before = ladder.index
        k = ladder.current
        ladder.observe(k, round(f * k))
        assert ladder.current in rungs and abs(ladder.index - before) <= 1


def test_controller_suspends_and_reprobes(interval_only):
    ctl = AdaptiveKController(SEED_COST, max_k=3, reprobe_interval=3)
    # No data: every a_j = prior 0.5; r2 = 1.75/50 = 0.035 is best (r1 ≈ 0.0341, r3 ≈ 0.0335).
    assert ctl.next_k() == 2
    for _ in range(3):
        ctl.observe(2, 0)  # three first drafts rejected: a_1 ≈ 0.03, optimistically still 0.46
    ks = [ctl.next_k() for _ in range(8)]
    # Three plain steps, then one probe at the best k > 0 (k = 1 when a_1 ≈ 0).
    assert ks == [0, 0, 0, 1, 0, 0, 0, 0]
    # (twenty rejections would leave no optimism: a_1 needs 0.375 to pay here; no probe then)
    # The probe (not observed as accepted) left it suspended: the interval doubled to 6, then 12.
    ks = [ctl.next_k() for _ in range(3 + 13)]
    assert ks == [0, 0, 1] + [0] * 12 + [1]
    for _ in range(200):
        ctl.observe(1, 1)  # acceptance recovers: the probe's measurements lift a_1
    assert ctl.next_k() > 0


def test_controller_is_capped_by_ladder_and_max_k():
    ladder = DraftLadder([1, 2, 3])
    ctl = AdaptiveKController(SEED_COST, max_k=3, reprobe_interval=16, ladder=ladder)
    for _ in range(50):
        ctl.estimator.update(3, 3)  # near-perfect acceptance: the cost model alone wants 3
    assert ctl.next_k() == 1  # the lowest rung caps it
    ctl.observe(1, 1)
    assert ladder.current == 2 and ctl.next_k() == 2
    ctl.observe(2, 2)
    assert ctl.next_k() == 3
    assert AdaptiveKController(SEED_COST, max_k=2, reprobe_interval=16).next_k() <= 2


def test_controller_never_probes_where_no_count_can_pay(interval_only):
    """A table where even fully accepted drafts lose to a plain step ((k+1)/c(k) <= 1/c(0)):
    no probe could change the decision, so the stream decodes plainly throughout."""
    hopeless = CostModel(first=0, ms=(1.0, 2.5, 3.5, 4.5))
    ctl = AdaptiveKController(hopeless, max_k=3, reprobe_interval=2)
    assert not ctl.can_pay(3)
    assert [ctl.next_k() for _ in range(50)] == [0] * 50
    assert ctl.settled  # nothing will be measured again: plain for the rest of the stream
    # one count that pays at full acceptance ((2+1)/2.9 > 1/1) keeps the probes
    ctl = AdaptiveKController(CostModel(first=0, ms=(1.0, 2.5, 2.9, 4.5)), max_k=3, reprobe_interval=2)
    assert ctl.can_pay(3) and not ctl.can_pay(1)
    assert 2 in [ctl.next_k() for _ in range(10)]
    # a noisy table whose last count measured cheaper than the one before it: judged at the
    # larger cost ((3+1)/4.5 < 1/1), so no probe
    assert not AdaptiveKController(CostModel(first=0, ms=(1.0, 2.5, 4.5, 3.5)), max_k=3, reprobe_interval=2).can_pay(3)
    # a table without 0: (the model has no plain-step cost) never suspends on its own
    assert AdaptiveKController(CostModel(first=1, ms=(2.0, 3.0)), max_k=2, reprobe_interval=2).can_pay(2)


def test_host_work_per_row_adds_to_the_table_and_turns_the_choice():
    """A request's grammar costs host work at every row a step verifies, which the measured
    table lacks: `observe_host` adds its average per row to every count, and the choice follows."""
    table = CostModel(first=0, ms=(1.0, 1.9, 2.6), acceptance=0.9)
    assert table.plus_rows(0.5).ms == (1.5, 2.9, 4.1) and table.plus_rows(0.5).acceptance == 0.9
    ctl = AdaptiveKController(table, max_k=2, reprobe_interval=4)
    for _ in range(20):
        ctl.observe(2, 2)
    assert ctl.next_k() == 2  # about 2.9 tokens for 2.6 ms against 1 for 1.0
    for _ in range(30):
        ctl.observe_host(20.0)  # each row costs 20 ms more: 2.9 / 62.6 against 1 / 21
    assert ctl.host_row_ms == pytest.approx(20.0) and ctl.table is table
    assert ctl.next_k() == 0


def test_a_resumed_stream_restarts_the_backoff(interval_only):
    ctl = AdaptiveKController(SEED_COST, max_k=3, reprobe_interval=2)
    for _ in range(3):
        ctl.observe(2, 0)
    ks = [ctl.next_k() for _ in range(3)] + [ctl.next_k() for _ in range(5)]
    assert ks == [0, 0, 1, 0, 0, 0, 0, 1]  # interval 2, then 4
    for _ in range(300):
        ctl.observe(3, 3)  # the probe found the acceptance high: speculation resumes
    assert ctl.next_k() > 0 and ctl.interval == 2


def test_a_calibrated_acceptance_starts_the_estimate_and_gates_the_probes():
    """With the drafter's measured acceptance in the cost model, a stream starts from it (as if
    16 positions had been tested) and is probed only while an optimistic acceptance (two
    standard errors up) could make a count pay."""
    ms = (1.0, 1.8, 2.2, 2.6)  # pays at full acceptance, not at 0.52: E(k)/c(k) <= 0.84
    low = AdaptiveKController(CostModel(0, ms, acceptance=0.3), max_k=3, reprobe_interval=2)
    assert low.prior == 0.3 and low.strength == 16.0
    assert low.optimistic_acceptance() < 0.6 and not low.can_pay(3, low.optimistic_acceptance())
    assert [low.next_k() for _ in range(40)] == [0] * 40  # never probed
    high = AdaptiveKController(CostModel(0, ms, acceptance=0.97), max_k=3, reprobe_interval=2)
    assert high.can_pay(3, high.optimistic_acceptance())
    assert high.next_k() == 3  # at 0.97: E(3) = 3.82 tokens in 2.6 ms beats 1 in 1 ms
    # without a calibrated acceptance: prior 0.5 weighing one position, optimism up to 1
    plain = AdaptiveKController(CostModel(0, ms), max_k=3, reprobe_interval=2)
    assert plain.strength == 1.0 and plain.optimistic_acceptance() == 1.0


def test_probes_keep_their_expected_loss_within_the_budget():
    """A suspended stream's probe costs c(k) and is expected to emit E(k) tokens, which plain
    steps would have cost E(k)·c(0): its expected loss is spread over enough plain steps to stay
    under PROBE_BUDGET (1%) of their time, however short the interval."""
    ms = (1.0, 1.8, 2.2, 2.6)  # pays at full acceptance (4 / 2.6 > 1), not at 0.5
    ctl = AdaptiveKController(CostModel(0, ms), max_k=3, reprobe_interval=2)
    assert ctl.next_k() == 0
    # no data: a_j = 0.5 everywhere; the probe's best count is 1 (1.5 tokens in 1.8 ms), whose
    # loss is 1.8 - 1.5 = 0.3 ms: 30 plain steps of 1 ms keep it within 1%
    acc = ctl.estimator.rates(3, prior=0.5, strength=1.0)
    assert ctl.budget_wait(1, acc) == 30
    assert ctl.plain_ahead() == 29  # after the step that just chose 0
    assert [ctl.next_k() for _ in range(30)] == [0] * 29 + [1]
    # a probe expected to pay for itself waits only for the interval
    assert ctl.budget_wait(1, [0.9]) == 0  # 1.8 - 1.9 < 0


def test_plain_ahead_and_skip_stand_for_the_plain_steps_between_probes():
    """Running `plain_ahead()` plain steps at once and recording them with `skip` leaves the
    controller where as many `next_k` calls returning 0 would: the probe comes next."""
    ms = (1.0, 1.8, 2.2, 2.6)
    one, many = (AdaptiveKController(CostModel(0, ms), max_k=3, reprobe_interval=4) for _ in range(2))
    for _ in range(2):  # a probe each, observed as rejected: backoff and a moved estimate
        for ctl in (one, many):
            assert ctl.next_k() == 0
        ahead = many.plain_ahead()
        assert ahead > 0
        many.skip(ahead)
        ks = [one.next_k() for _ in range(ahead)]
        assert ks == [0] * ahead
        k = one.next_k()
        assert k > 0 and many.next_k() == k
        one.observe(k, 0)
        many.observe(k, 0)
    assert one.plain_steps == many.plain_steps and one.interval == many.interval
    assert one.next_k() == many.next_k() == 0 and one.settled and many.settled  # no optimism left
    assert many.plain_ahead() == 0


def test_rows_run_again_before_a_probe_count_against_its_budget():
    """Where the plain steps' rows run again before a probe (`rerun_rows`), each waited step
    costs a target row (`CostModel.row_ms`, the table's cost per extra verify row): where that
    alone exceeds the budget's share of a plain step the stream settles at once; where it
    leaves some, the probe waits longer."""
    # a table like the CPU packages': a row costs 8% of a plain step, the budget 1%
    cpu = CostModel(0, (0.187, 0.777, 0.793, 0.815, 0.84, 0.843, 0.857, 0.868), acceptance=0.69)
    assert cpu.row_ms == pytest.approx((0.868 - 0.777) / 6)
    kept = AdaptiveKController(cpu, max_k=7, reprobe_interval=16)
    assert kept.next_k() == 0 and not kept.settled and kept.plain_ahead() > 16
    rerun = AdaptiveKController(cpu, max_k=7, reprobe_interval=16)
    rerun.rerun_rows()
    assert rerun.next_k() == 0 and rerun.settled and rerun.plain_ahead() == 0
    # a table whose rows are cheap: one costs 0.2% of a plain step, so probes still pay off
    cheap = CostModel.parse("0:1,1:1.5,2:1.502,3:1.504")
    assert cheap.row_ms == pytest.approx(0.002)
    kept, rerun = (AdaptiveKController(cheap, max_k=3, reprobe_interval=4) for _ in range(2))
    rerun.rerun_rows()
    for ctl in (kept, rerun):
        for _ in range(3):
            ctl.observe(3, 0)  # a_1 low: suspended, but optimism remains
        assert ctl.next_k() == 0 and not ctl.settled
    # the probe's loss (1.5 - E(1)) over 0.01 per step, or over 0.01 - 0.002 with its rows
    acc = kept.estimator.rates(3, prior=kept.prior, strength=kept.strength)
    loss = 1.5 - expected_tokens(acc, 1)
    assert kept.plain_ahead() + 1 == math.ceil(loss / 0.01 - 1e-9)
    assert rerun.plain_ahead() + 1 == math.ceil(loss / 0.008 - 1e-9)


def test_the_tree_budget_chooser_takes_the_most_tokens_per_ms():
    from metrale.runtime.spec.adaptive_k import TreeBudgetChooser
    from metrale.runtime.spec.cost_model import CostModel

    probs = [0.9, 0.5, 0.4, 0.1, 0.05, 0.01]  # a best-first tree's path probabilities
    flat = TreeBudgetChooser(CostModel.parse("0:1,1:1,2:1,3:1,4:1,5:1,6:1"), budget=6)
    assert flat.ratio == 1.0 and flat.choose(probs) == 6  # free nodes: all of them
    steep = TreeBudgetChooser(CostModel.parse("1:1,2:2,3:3,4:4,5:5,6:6"), budget=4)
    assert steep.counts == [1, 2, 3, 4]
    # (1 + Σ p) / cost: b=1 1.9, b=2 1.2, ...: one node
    assert steep.choose(probs) == 1
    mid = TreeBudgetChooser(CostModel.parse("1:1,2:1.2,3:1.4,4:3"), budget=4)
    rates = [(1 + sum(probs[:b])) / c for b, c in zip((1, 2, 3, 4), (1, 1.2, 1.4, 3))]
    assert mid.choose(probs) == 1 + rates.index(max(rates))
    # the target accepts far less than the drafter's probabilities say: smaller trees pay
    for _ in range(30):
        mid.observe(probs[:3], 0)
    assert mid.ratio < 0.2 and mid.choose(probs) == 1
    for _ in range(60):  # and more: larger ones do again
        mid.observe(probs[:3], 3)
    assert mid.ratio > 1.5 and mid.choose(probs) == 3
    with pytest.raises(ValueError, match="prices no tree"):
        TreeBudgetChooser(CostModel.parse("0:1,1:2"), budget=0)

"""Verification: greedy cases worked by hand; sampled verification matches plain sampling."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from metrale.runtime.spec.sampling import SamplingParams, probs_from_logits
from metrale.runtime.spec.verify import verify_greedy, verify_sampling

V = 5


def rows(*argmaxes):
    """Target logits [len, V] whose row i has its argmax at argmaxes[i]."""
    out = torch.zeros(len(argmaxes), V)
    for i, t in enumerate(argmaxes):
        out[i, t] = 1.0
    return out


@pytest.mark.parametrize(
    "drafts, argmaxes, accepted, emitted",
    [
        # all three drafts match rows 0..2; the bonus is row 3's argmax (4)
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),
        # the second draft (0) differs from row 1's argmax (2): recovered token 2
        ([1, 0, 3], [1, 2, 3, 4], 1, [1, 2]),
        # the first draft already differs: only the recovered token
        ([4, 2, 3], [1, 2, 3, 4], 0, [1]),
        # a later match after a mismatch does not count (draft 3 == row 2's argmax)
        ([1, 0, 3], [1, 2, 3, 0], 1, [1, 2]),
        # no drafts: a plain step emitting row 0's argmax
        ([], [3], 0, [3]),
    ],
)
def test_verify_greedy_by_hand(drafts, argmaxes, accepted, emitted):
    m, out = verify_greedy(torch.tensor(drafts, dtype=torch.long), rows(*argmaxes))
    assert m == accepted and out.tolist() == emitted and out.dtype == torch.long


def test_verify_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        verify_greedy(torch.tensor([1, 2]), rows(1, 2))


@given(st.lists(st.integers(0, V - 1), max_size=6), st.data())
def test_verify_greedy_invariants(drafts, data):
    n = len(drafts) + 1
    argmaxes = data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
    m, out = verify_greedy(torch.tensor(drafts, dtype=torch.long), rows(*argmaxes))
    assert len(out) == m + 1  # accepted drafts plus one bonus or recovered token
    assert out[:m].tolist() == drafts[:m] and out.tolist() == argmaxes[: m + 1]
    assert m == len(drafts) or drafts[m] != argmaxes[m]


@given(st.lists(st.integers(0, V - 1), max_size=5), st.data())
def test_verify_sampling_with_greedy_probs_is_verify_greedy(drafts, data):
    # Temperature 0 turns each row into a one-hot at its argmax: rejection sampling then accepts
    # exactly the matching drafts and recovers the argmax, whatever the random stream.
    n = len(drafts) + 1
    row = st.lists(st.floats(-5, 5), min_size=V, max_size=V)
    logits = torch.tensor(data.draw(st.lists(row, min_size=n, max_size=n)))  # [k+1, V]
    d = torch.tensor(drafts, dtype=torch.long)
    probs = probs_from_logits(logits, SamplingParams(temperature=0))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    m_s, out_s = verify_sampling(d, probs, g)
    m_g, out_g = verify_greedy(d, logits)
    assert m_s == m_g and out_s.tolist() == out_g.tolist()


def test_sole_mass_draft_is_never_rejected():
    # Row 0 puts all its mass on token 2, slightly under 1 as float32 rows can: nothing would be
    # left to recover from, so the draft must be accepted whatever u is.
    probs = torch.zeros(2, V)
    probs[0, 2] = 0.99999994
    probs[1, 4] = 1.0
    for seed in range(50):
        m, out = verify_sampling(torch.tensor([2]), probs, torch.Generator().manual_seed(seed))
        assert m == 1 and out.tolist() == [2, 4]


# --- sampled verification against plain sampling ---------------------------------------------

# Target rows for a fixed chain d = (1, 3): row 0 judges d_1 = 1, row 1 (the target's
# distribution given the first token is d_1) judges d_2 = 3, row 2 follows the chain.
P0 = torch.tensor([0.10, 0.40, 0.20, 0.25, 0.05])
P1 = torch.tensor([0.30, 0.05, 0.15, 0.35, 0.15])
P2 = torch.tensor([0.20, 0.20, 0.20, 0.20, 0.20])
DRAFTS = torch.tensor([1, 3])
N = 5000

# Chi-square with V − 1 = 4 degrees of freedom: the 0.999 quantile is 18.467 (standard table).
# With a fixed generator seed the test is deterministic; a correct sampler lands below it.
CRITICAL_DF4_P001 = 18.467


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run_chains(sampler):
    g = torch.Generator().manual_seed(2024)
    target = torch.stack([P0, P1, P2])  # [3, V]
    first, second = [], []
    for _ in range(N):
        _, out = sampler(DRAFTS, target, g)
        first.append(int(out[0]))
        # The second token, conditional on the first being d_1 (a faulty sampler may emit d_1
        # as a recovered token with nothing after it).
        if int(out[0]) == int(DRAFTS[0]) and len(out) > 1:
            second.append(int(out[1]))
    return torch.bincount(torch.tensor(first), minlength=V).float(), torch.bincount(
        torch.tensor(second), minlength=V
    ).float()


def test_speculative_sampling_matches_plain_sampling():
    first, second = run_chains(verify_sampling)
    # Emitting d_1 first always means it was accepted, so a second token follows every time;
    # ≈ N·P0[1] = 2000 conditional draws.
    assert first.sum() == N and second.sum() == first[1] and second.sum() > 1600
    for counts, probs in [(first, P0), (second, P1)]:
        stat = chi_square(counts, probs)
        assert stat < CRITICAL_DF4_P001, (stat, counts.tolist())
        try:
            from scipy.stats import chisquare
        except ImportError:
            continue
        p64 = probs.double() / probs.double().sum()  # scipy wants the sums equal to ~1e-8
        expected = (p64 * float(counts.sum())).tolist()
        assert chisquare(counts.tolist(), expected).pvalue > 0.001


def test_the_chi_square_check_catches_a_wrong_sampler():
    # Negative control: "resample from p on rejection" (forgetting to remove the rejected draft's
    # mass) over-weights the draft: P(first = 1) = 0.4 + 0.6·0.4 = 0.64 instead of 0.4, which at
    # N = 5000 puts ≈ (3200 − 2000)²/2000 = 720 into the statistic from that cell alone.
    def naive(drafts, target, g):
        u = torch.rand(1, generator=g).item()
        if u < float(target[0, drafts[0]]):
            second = int(torch.multinomial(target[1], 1, generator=g))
            return 1, torch.tensor([int(drafts[0]), second])
        return 0, torch.multinomial(target[0], 1, generator=g)

    first, _ = run_chains(naive)
    assert chi_square(first, P0) > 10 * CRITICAL_DF4_P001


def test_accepted_prefix_stops_at_the_rows_given():
    from metrale.runtime.spec.verify import accepted_prefix

    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3  # every draft matched: bonus row 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5, 6, 7], [5, 6]) == 1  # exact verify stopped at row 1, which rejected
    assert accepted_prefix([], [4]) == 0


def test_a_plain_step_draws_its_token_from_row_0():
    """k = 0 (a plain step, e.g. under back-off): nothing accepted, one token distributed as
    row 0, the same stream again for the same seed."""
    g = torch.Generator().manual_seed(11)
    draws = [verify_sampling(torch.empty(0, dtype=torch.long), P0[None], g) for _ in range(N)]
    assert all(m == 0 and out.shape == (1,) for m, out in draws)
    counts = torch.bincount(torch.tensor([int(out[0]) for _, out in draws]), minlength=V).float()
    assert chi_square(counts, P0) < CRITICAL_DF4_P001, counts.tolist()
    again = torch.Generator().manual_seed(11)
    assert [int(verify_sampling(torch.empty(0, dtype=torch.long), P0[None], again)[1][0])
            for _ in range(50)] == [int(out[0]) for _, out in draws[:50]]


def _on_device(drafts, target, g):
    """`verify_sampling_on_device` as `verify_sampling` answers (for the chain harness), run
    under the host-read guard."""
    from metrale.runtime.backends.host_reads import forbid_host_reads
    from metrale.runtime.spec.verify import verify_sampling_on_device

    with forbid_host_reads("the device verify"):
        m, ids = verify_sampling_on_device(drafts, target, g)
    return int(m), ids[:int(m) + 1]


def test_sampling_on_the_device_matches_plain_sampling():
    first, second = run_chains(_on_device)
    assert first.sum() == N and second.sum() == first[1] and second.sum() > 1600
    for counts, probs in [(first, P0), (second, P1)]:
        assert chi_square(counts, probs) < CRITICAL_DF4_P001, counts.tolist()


def test_sampling_on_the_device_draws_what_the_reference_draws():
    """The same uniforms in the same order: with one seed, the reference's tokens, chain after
    chain (a plain step's too), and a sole-mass draft is never rejected."""
    target = torch.stack([P0, P1, P2])
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(300):
        assert _on_device(DRAFTS, target, a)[1].tolist() == verify_sampling(DRAFTS, target, b)[1].tolist()
    assert _on_device(DRAFTS[:0], target[:1], a)[1].tolist() == verify_sampling(DRAFTS[:0], target[:1], b)[1].tolist()
    sole = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    for _ in range(50):
        assert _on_device(torch.tensor([1]), sole, a)[0] == 1


def test_a_draft_stop_on_the_device_draws_the_bonus_after_the_counted_drafts():
    """With only d_1 counted, accepting it ends the judging: the next token is drawn from row 1
    whole (d_2 = 3 keeps its mass there), as a chain of one draft would draw it."""
    from metrale.runtime.spec.verify import verify_sampling_on_device

    target = torch.stack([torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]), P1, P2])  # d_1 always accepted
    g = torch.Generator().manual_seed(3)
    seconds = []
    for _ in range(N):
        m, ids = verify_sampling_on_device(DRAFTS, target, g, counted=torch.tensor(1))
        assert int(m) == 1 and int(ids[0]) == 1
        seconds.append(int(ids[1]))
    counts = torch.bincount(torch.tensor(seconds), minlength=V).float()
    assert chi_square(counts, P1) < CRITICAL_DF4_P001, counts.tolist()

"""Sampling parameters, temperature and nucleus, worked by hand on tiny vocabularies."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.sampling import (
    SamplingParams,
    generator_for,
    probs_from_logits,
    sample,
    sample_from_probs,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed=1.5), "seed"),
        (dict(seed=True), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
    ],
)
def test_params_refused_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}: got .*expected"):
        SamplingParams(**kwargs)


def test_params_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.seed, p.max_tokens) == (1.0, 1.0, None, 256)
    assert SamplingParams(temperature=0).greedy and not p.greedy


def test_temperature_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    # T = 1 gives the probabilities back; T = 0.5 squares them: [0.25, 1/16, 1/16] / 0.375.
    plain = probs_from_logits(logits, SamplingParams())
    assert torch.allclose(plain, torch.tensor([0.5, 0.25, 0.25]))
    hot = probs_from_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, torch.tensor([2 / 3, 1 / 6, 1 / 6]))


def test_top_p_by_hand():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.1]))
    # Sorted: 0.5, 0.3, 0.1, 0.1. top_p 0.7: mass before 0.3 is 0.5 < 0.7, kept; before the
    # next it is 0.8: dropped. Nucleus {1, 2} renormalized: [0, 0.625, 0.375, 0].
    p = probs_from_logits(logits, SamplingParams(top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.0, 0.625, 0.375, 0.0]))
    # top_p 0.5: the top token alone reaches it.
    p = probs_from_logits(logits, SamplingParams(top_p=0.5))
    assert torch.allclose(p, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # Batched rows keep their own nucleus.
    batch = torch.stack([logits, logits.flip(0)])  # [2, 4]
    p = probs_from_logits(batch, SamplingParams(top_p=0.7))
    assert torch.allclose(p[1], torch.tensor([0.0, 0.375, 0.625, 0.0]))


def test_greedy_is_one_hot_argmax_and_bf16_gives_float32():
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0)
    probs = probs_from_logits(logits, greedy)
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]  # first max on ties
    assert sample(logits, greedy).tolist() == [1, 0]


@given(st.lists(st.floats(-20, 20), min_size=2, max_size=8),
       st.floats(0.05, 5.0), st.floats(0.01, 1.0))
def test_probs_are_a_distribution_containing_the_top_token(values, temperature, top_p):
    logits = torch.tensor(values)
    p = probs_from_logits(logits, SamplingParams(temperature=temperature, top_p=top_p))
    full = probs_from_logits(logits, SamplingParams(temperature=temperature))
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    # The most likely token (the first on ties, like argmax) is always in the nucleus.
    assert float(p.min()) >= 0.0 and float(p[full.argmax()]) > 0.0


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(6000, 3)  # [6000, 3]
    a = sample(logits, params, generator_for(params))
    b = sample(logits, params, generator_for(params))
    assert a.shape == (6000,) and torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / 6000
    # Binomial standard error at 6000 draws is <= 0.0065; 0.03 is beyond 4.5 of them.
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    assert generator_for(SamplingParams()) is None
    # Negative and huge seeds are accepted, reduced modulo 2**64: -1 and 2**64 − 1 agree.
    g1, g2 = generator_for(SamplingParams(seed=-1)), generator_for(SamplingParams(seed=2**64 - 1))
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_sample_from_probs_never_draws_a_zero():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    ids = sample_from_probs(probs.repeat(50, 1), torch.Generator().manual_seed(0))  # [100]
    assert ids[0::2].eq(1).all() and ids[1::2].ne(1).all()


def test_sample_from_probs_follows_each_row_of_a_batch():
    """Rows of one call are drawn independently, each from its own (unnormalized) row."""
    rows = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 0.0, 3.0, 1.0]])  # sums 4, 4
    ids = sample_from_probs(rows.repeat(4000, 1), torch.Generator().manual_seed(3)).view(4000, 2)
    for col, want in ((0, [0.5, 0.25, 0.25, 0.0]), (1, [0.0, 0.0, 0.75, 0.25])):
        freq = torch.bincount(ids[:, col], minlength=4).float() / 4000
        assert torch.allclose(freq, torch.tensor(want), atol=0.03), freq.tolist()  # > 4 s.e.


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.8, 0.9), (1.3, 0.5), (0.05, 0.95)])
def test_probs_on_the_device_are_probs_from_logits(temperature, top_p):
    """The captured form of a sampled request's distribution (temperature and top_p as
    tensors, no branch on their values): the reference's bits, and no host read."""
    from metrale.runtime.backends.host_reads import forbid_host_reads
    from metrale.runtime.spec.sampling import probs_on_device

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    want = probs_from_logits(logits, SamplingParams(temperature=temperature, top_p=top_p))
    with forbid_host_reads("sampling"):
        got = probs_on_device(logits, torch.tensor([temperature]), torch.tensor([top_p]))
    assert torch.equal(got, want)

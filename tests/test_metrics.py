"""Metrics: counters from hand-built steps, derived ratios and histograms, JSON and Prometheus text."""

import json
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.runtime.spec.metrics import SpecMetrics, SpecMetricsAggregate


def two_steps() -> SpecMetrics:
    m = SpecMetrics()
    # Step 1: 4 drafts verified, 1 accepted: positions 1 (accepted) and 2 (rejected) tested.
    m.record_step(proposed=7, verified=4, accepted=1, emitted=2, verify_rows=5,
                  draft_s=0.01, verify_s=0.03)
    # Step 2: 3 of 3 accepted plus the bonus: positions 1..3 tested and accepted.
    m.record_step(proposed=7, verified=3, accepted=3, emitted=4, verify_rows=4,
                  draft_s=0.01, verify_s=0.02)
    return m


def test_counters_and_derived_ratios_by_hand():
    m = two_steps()
    assert (m.steps, m.tokens_emitted, m.drafts_proposed, m.drafts_verified) == (2, 6, 14, 7)
    assert m.accepted_at == [2, 1, 1] and m.tested_at == [2, 2, 1] and m.verify_rows == 9
    assert m.tau == 3.0  # (1 + 1) and (3 + 1) tokens over 2 steps
    assert m.acceptance_per_position() == [1.0, 0.5, 1.0]
    assert m.draft_s == pytest.approx(0.02) and m.verify_s == pytest.approx(0.05)


def test_plain_step_and_truncated_last_step():
    m = SpecMetrics()
    m.record_step(0, 0, 0, 1, 1, 0.0, 0.01)  # plain decode: one token, nothing tested
    m.record_step(3, 3, 3, 2, 4, 0.0, 0.01)  # all accepted but the request ended after 2 tokens
    assert m.tau == 1.5 and m.tested_at == [1, 1, 1] and m.accepted_at == [1, 1, 1]


@pytest.mark.parametrize(
    "args",
    [
        (2, 3, 0, 1, 4, 0.0, 0.0),  # verified > proposed
        (3, 3, 4, 1, 4, 0.0, 0.0),  # accepted > verified
        (3, 3, 1, 3, 4, 0.0, 0.0),  # emitted > accepted + 1
        (3, 3, 1, 0, 4, 0.0, 0.0),  # nothing emitted
        (3, 3, 1, 1, -1, 0.0, 0.0),  # negative rows
        (3, 3, 1, 1, 4, -0.1, 0.0),  # negative time
    ],
)
def test_record_step_refuses_impossible_steps(args):
    m = SpecMetrics()
    with pytest.raises(ValueError):
        m.record_step(*args)
    assert m.steps == 0 and m.tested_at == []


def test_to_dict_is_json_and_has_no_nan_before_any_step():
    empty = SpecMetrics().to_dict()
    assert empty["tau"] is None and empty["draft_acceptance_rate"] is None
    d = json.loads(json.dumps(two_steps().to_dict(), allow_nan=False))
    assert d["tau"] == 3.0 and d["acceptance_per_position"] == [1.0, 0.5, 1.0]
    assert d["drafts_accepted"] == 4 and d["draft_acceptance_rate"] == pytest.approx(4 / 7)


def exposition(families) -> str:
    """The families as prometheus_client writes them for /metrics."""
    from prometheus_client import CollectorRegistry, generate_latest

    class Fixed:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    return generate_latest(registry).decode()


def parse_exposition(text: str) -> dict[str, tuple[str, list[tuple[dict, float]]]]:
    """name -> (type, [(labels, value)]) as Prometheus' own parser reads the text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: (f.type, [(s.labels, s.value) for s in f.samples if not s.name.endswith("_created")])
            for f in text_string_to_metric_families(text)}


def test_prometheus_families_are_valid_exposition():
    label = 'tiny "q"\\x'
    fams = parse_exposition(exposition(two_steps().families(labels={"model": label})))
    counters = {n: v for n, v in fams.items() if v[0] == "counter"}
    assert all(name.startswith("metrale_spec_decode_") for name in counters)
    model = {"model": label}  # quote and backslash escaped in the text, whole again once parsed
    assert fams["metrale_spec_decode_steps"][1] == [(model, 2.0)]
    assert fams["metrale_spec_decode_emitted_tokens"][1] == [(model, 6.0)]
    assert fams["metrale_spec_decode_accepted_tokens"][1] == [(model, 4.0)]
    assert fams["metrale_spec_decode_accepted_per_position"][1] == [
        ({**model, "position": "1"}, 2.0), ({**model, "position": "2"}, 1.0), ({**model, "position": "3"}, 1.0)]
    tested = fams["metrale_spec_decode_tested_per_position"][1]
    assert tested[1] == ({**model, "position": "2"}, 2.0)
    assert fams["metrale_spec_decode_verify_seconds"][1][0][1] == pytest.approx(0.05)


def test_histograms_derived_from_the_counters_by_hand():
    """two_steps: step 1 verified 4 drafts and accepted 1 (length 2), step 2 verified 3 and
    accepted 3 (length 4); a plain step after them verifies none (and is no verify step)."""
    m = two_steps()
    m.record_plain_step(draft_s=0.0, verify_s=0.01)
    fams = parse_exposition(exposition(m.families()))

    def buckets(name):
        kind, samples = fams[name]
        assert kind == "histogram"
        got = {s["le"]: v for s, v in samples if "le" in s}
        rest = {tuple(s): v for s, v in samples if "le" not in s}
        return got, rest

    length, _ = buckets("metrale_spec_decode_acceptance_length")
    assert (length["1.0"], length["2.0"], length["3.0"], length["4.0"], length["+Inf"]) == (0, 1, 1, 2, 2)
    drafts, _ = buckets("metrale_spec_decode_drafts_per_step")
    assert (drafts["0.0"], drafts["2.0"], drafts["3.0"], drafts["4.0"], drafts["+Inf"]) == (1, 1, 2, 3, 3)
    sums = {s.name: s.value for f in text_string_to_metric_families(exposition(m.families()))
            for s in f.samples if s.name.endswith("_sum")}
    assert sums["metrale_spec_decode_acceptance_length_sum"] == 6  # 2 + 4
    assert sums["metrale_spec_decode_drafts_per_step_sum"] == 7  # 4 + 3 + 0


def test_prometheus_families_refuse_bad_names_and_handle_no_steps():
    fams = parse_exposition(exposition(SpecMetrics().families(prefix="x_")))
    assert fams["x_spec_decode_steps"][1] == [({}, 0.0)]
    assert fams["x_spec_decode_accepted_per_position"][1] == []  # a family with no series
    with pytest.raises(ValueError):
        SpecMetrics().families(prefix="9bad")
    with pytest.raises(ValueError):
        SpecMetrics().families(labels={"position": "1"})  # would collide
    with pytest.raises(ValueError):
        SpecMetrics().families(labels={"bad-name": "1"})


def test_aggregate_merges_requests_from_many_threads():
    agg = SpecMetricsAggregate()
    per_thread = 50

    def worker():
        for _ in range(per_thread):
            agg.add(two_steps())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    requests, totals = agg.snapshot()
    assert requests == 200
    assert totals.steps == 400 and totals.tokens_emitted == 1200
    assert totals.accepted_at == [400, 200, 200] and totals.tested_at == [400, 400, 200]
    assert totals.tau == 3.0 and agg.to_dict()["requests"] == 200
    fams = parse_exposition(exposition(agg.families()))
    assert fams["metrale_spec_decode_requests"][1] == [({}, 200.0)]
    # The snapshot is a copy: later requests do not change it.
    agg.add(two_steps())
    assert totals.steps == 400 and agg.snapshot()[1].steps == 402


def test_merge_of_different_depths():
    a, b = SpecMetrics(), SpecMetrics()
    a.record_step(1, 1, 1, 2, 2, 0.0, 0.0)
    b.record_step(4, 4, 3, 4, 5, 0.0, 0.0)
    a.merge(b)
    assert a.accepted_at == [2, 1, 1, 0] and a.tested_at == [2, 1, 1, 1]
    assert a.acceptance_per_position() == [1.0, 1.0, 1.0, 0.0]


def test_a_plain_steps_record_is_a_general_steps_without_drafts():
    fast, general = SpecMetrics(), SpecMetrics()
    general.record_step(proposed=2, verified=2, accepted=1, emitted=2, verify_rows=3, draft_s=0.1, verify_s=0.2)
    fast.record_step(proposed=2, verified=2, accepted=1, emitted=2, verify_rows=3, draft_s=0.1, verify_s=0.2)
    for _ in range(3):
        fast.record_plain_step(draft_s=0.01, verify_s=0.02)
        general.record_step(proposed=0, verified=0, accepted=0, emitted=1, verify_rows=1, draft_s=0.01, verify_s=0.02)
    assert fast == general
    fast.record_plain_step(draft_s=0.0, verify_s=0.06, n=3)  # three at once: their times summed
    for _ in range(3):
        general.record_step(proposed=0, verified=0, accepted=0, emitted=1, verify_rows=1, draft_s=0.0, verify_s=0.02)
    assert fast.steps == general.steps and fast.tokens_emitted == general.tokens_emitted
    assert fast.verify_rows == general.verify_rows and fast.verify_s == pytest.approx(general.verify_s)
    with pytest.raises(ValueError, match="negative"):
        fast.record_plain_step(draft_s=-1.0, verify_s=0.0)

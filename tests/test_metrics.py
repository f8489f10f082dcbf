"""Metrics: counters from hand-built steps, derived ratios, JSON and Prometheus text."""

import json
import re
import threading

import pytest

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


# One sample line of the exposition format: name, optional {label="value",...}, a number.
SAMPLE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*)\})?'
    r' (?P<value>[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|Inf|NaN))'
)


def parse_exposition(text: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """name -> (type, [(labels, value)]), checking HELP/TYPE precede each family's samples."""
    assert text.endswith("\n")
    families: dict[str, tuple[str, list]] = {}
    current = None
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# HELP "):
            current = line.split(" ")[2]
            assert current not in families, f"family {current} appears twice"
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == current and kind in ("counter", "gauge")
            families[name] = (kind, [])
        else:
            match = SAMPLE.fullmatch(line)
            assert match, f"not a sample line: {line!r}"
            assert match["name"] == current, line
            families[current][1].append((match["labels"] or "", match["value"]))
    return families


def test_prometheus_text_is_valid_exposition():
    text = two_steps().prometheus_text(labels={"model": 'tiny "q"\\x'})
    fams = parse_exposition(text)
    assert all(name.startswith("metrale_") and name.endswith("_total") for name in fams)
    assert all(kind == "counter" for kind, _ in fams.values())
    label = 'model="tiny \\"q\\"\\\\x"'  # quote and backslash escaped
    assert fams["metrale_spec_decode_steps_total"][1] == [(label, "2")]
    assert fams["metrale_spec_decode_emitted_tokens_total"][1] == [(label, "6")]
    assert fams["metrale_spec_decode_accepted_tokens_total"][1] == [(label, "4")]
    assert fams["metrale_spec_decode_accepted_per_position_total"][1] == [
        (f'{label},position="1"', "2"),
        (f'{label},position="2"', "1"),
        (f'{label},position="3"', "1"),
    ]
    tested = fams["metrale_spec_decode_tested_per_position_total"][1]
    assert tested[1] == (f'{label},position="2"', "2")
    assert float(fams["metrale_spec_decode_verify_seconds_total"][1][0][1]) == pytest.approx(0.05)


def test_prometheus_text_refuses_bad_names_and_handles_no_steps():
    fams = parse_exposition(SpecMetrics().prometheus_text(prefix="x_"))
    assert fams["x_spec_decode_steps_total"][1] == [("", "0")]
    assert fams["x_spec_decode_accepted_per_position_total"][1] == []  # a family with no series
    with pytest.raises(ValueError):
        SpecMetrics().prometheus_text(prefix="9bad")
    with pytest.raises(ValueError):
        SpecMetrics().prometheus_text(labels={"position": "1"})  # would collide
    with pytest.raises(ValueError):
        SpecMetrics().prometheus_text(labels={"bad-name": "1"})


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
    fams = parse_exposition(agg.prometheus_text())
    assert fams["metrale_spec_decode_requests_total"][1] == [("", "200")]
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

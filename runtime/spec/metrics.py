"""The one vocabulary of speculative decoding metrics: raw counters, and ratios derived from them.

Raw counters (per request in `SpecMetrics`, summed over requests in `SpecMetricsAggregate`):
steps, tokens emitted, drafts proposed (by the drafter), drafts verified (sent to the target),
accepted and tested drafts per position, verify rows, drafter and verify seconds.
Derived, never stored: tau (acceptance length: accepted drafts + the bonus or recovered token,
per step = emitted / steps) and per-position acceptance accepted_at[j] / tested_at[j], where a
position counts as tested only when the target actually judged it (positions after a step's
first rejection are not), so the ratio is the conditional acceptance a_j of `adaptive_k`.

Prometheus (`families`: prometheus_client's metric families) exports only the raw counters,
so rates over any window are computed server side, and two histograms derived from them exactly:
acceptance length per verify step (accepted drafts + 1, over the steps that verified drafts) and
drafts verified per step (every step, plain ones at 0):

    tau (over 5 minutes):
        rate(metrale_spec_decode_emitted_tokens_total[5m])
          / rate(metrale_spec_decode_steps_total[5m])
    acceptance at position j:
        rate(metrale_spec_decode_accepted_per_position_total{position="j"}[5m])
          / rate(metrale_spec_decode_tested_per_position_total{position="j"}[5m])
    draft acceptance rate:
        rate(metrale_spec_decode_accepted_tokens_total[5m])
          / rate(metrale_spec_decode_draft_tokens_verified_total[5m])
    median acceptance length:
        histogram_quantile(0.5, rate(metrale_spec_decode_acceptance_length_bucket[5m]))

Invariants: every counter only grows; a step's numbers satisfy
0 <= accepted <= verified <= proposed and 1 <= emitted <= accepted + 1 (fewer than accepted + 1
only when the request ends inside the step). A plain decode step is a step with no drafts.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


@dataclass
class SpecMetrics:
    """Raw counters of one request (or of many, after `merge`)."""

    steps: int = 0
    tokens_emitted: int = 0
    drafts_proposed: int = 0
    drafts_verified: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [j-1]: drafts accepted at position j
    tested_at: list[int] = field(default_factory=list)  # [j-1]: drafts judged at position j
    verify_rows: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    # [k-1]: steps that verified k drafts (plain steps: `steps` less their sum)
    steps_with_drafts: list[int] = field(default_factory=list)

    def record_step(
        self,
        proposed: int,
        verified: int,
        accepted: int,
        emitted: int,
        verify_rows: int,
        draft_s: float,
        verify_s: float,
    ) -> None:
        if not 0 <= accepted <= verified <= proposed:
            raise ValueError(
                f"need 0 <= accepted {accepted} <= verified {verified} <= proposed {proposed}"
            )
        if not 1 <= emitted <= accepted + 1:
            raise ValueError(f"need 1 <= emitted {emitted} <= accepted {accepted} + 1")
        if verify_rows < 0 or not (draft_s >= 0.0 and verify_s >= 0.0):
            raise ValueError(
                f"negative verify_rows {verify_rows}, draft_s {draft_s} or verify_s {verify_s}"
            )
        tested = min(accepted + 1, verified)  # positions 1..accepted, plus the rejected one
        if verified:
            while len(self.steps_with_drafts) < verified:
                self.steps_with_drafts.append(0)
            self.steps_with_drafts[verified - 1] += 1
        self._grow(tested)
        for j in range(tested):
            self.tested_at[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1
        self.steps += 1
        self.tokens_emitted += emitted
        self.drafts_proposed += proposed
        self.drafts_verified += verified
        self.verify_rows += verify_rows
        self.draft_s += draft_s
        self.verify_s += verify_s

    def record_plain_step(self, draft_s: float, verify_s: float, n: int = 1) -> None:
        """`record_step` of `n` steps without drafts (one row verified and its token emitted
        each), taking `draft_s` and `verify_s` together: the step every sequence of a busy
        batch takes, so it skips the general bookkeeping."""
        if not (draft_s >= 0.0 and verify_s >= 0.0):
            raise ValueError(f"negative draft_s {draft_s} or verify_s {verify_s}")
        self.steps += n
        self.tokens_emitted += n
        self.verify_rows += n
        self.draft_s += draft_s
        self.verify_s += verify_s

    def _grow(self, positions: int) -> None:
        while len(self.tested_at) < positions:
            self.tested_at.append(0)
            self.accepted_at.append(0)

    def merge(self, other: SpecMetrics) -> None:
        """Add `other`'s counters into these."""
        self._grow(len(other.tested_at))
        for j, (a, t) in enumerate(zip(other.accepted_at, other.tested_at)):
            self.accepted_at[j] += a
            self.tested_at[j] += t
        while len(self.steps_with_drafts) < len(other.steps_with_drafts):
            self.steps_with_drafts.append(0)
        for k, n in enumerate(other.steps_with_drafts):
            self.steps_with_drafts[k] += n
        self.steps += other.steps
        self.tokens_emitted += other.tokens_emitted
        self.drafts_proposed += other.drafts_proposed
        self.drafts_verified += other.drafts_verified
        self.verify_rows += other.verify_rows
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s

    def copy(self) -> SpecMetrics:
        out = SpecMetrics()
        out.merge(self)
        return out

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)

    @property
    def tau(self) -> float | None:
        """Acceptance length: emitted tokens per step (accepted + bonus); None before a step."""
        return self.tokens_emitted / self.steps if self.steps else None

    def acceptance_per_position(self) -> list[float]:
        """[a_1, a_2, ...]: accepted_at[j] / tested_at[j] over the positions ever tested."""
        return [a / t for a, t in zip(self.accepted_at, self.tested_at)]

    def to_dict(self) -> dict:
        """Raw counters and derived ratios; JSON-able (no NaN: an undefined ratio is None)."""
        verified = self.drafts_verified
        return {
            "steps": self.steps,
            "tokens_emitted": self.tokens_emitted,
            "drafts_proposed": self.drafts_proposed,
            "drafts_verified": self.drafts_verified,
            "drafts_accepted": self.accepted,
            "accepted_at": list(self.accepted_at),
            "tested_at": list(self.tested_at),
            "verify_rows": self.verify_rows,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "tau": self.tau,
            "acceptance_per_position": self.acceptance_per_position(),
            "draft_acceptance_rate": self.accepted / verified if verified else None,
        }

    def families(self, prefix: str = "metrale_", labels: dict[str, str] | None = None) -> list[Metric]:
        """Prometheus metric families of the raw counters and the histograms derived from them
        (see the module docstring)."""
        return families(self, prefix, labels or {}, requests=None)


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*|")

_COUNTERS: tuple[tuple[str, Callable[[SpecMetrics], float], str], ...] = (
    # (name without prefix and "_total", its value, help)
    ("spec_decode_steps", lambda m: m.steps, "Decode steps, plain and speculative."),
    (
        "spec_decode_emitted_tokens",
        lambda m: m.tokens_emitted,
        "Tokens emitted: accepted drafts plus one bonus or recovered token per step.",
    ),
    ("spec_decode_draft_tokens_proposed", lambda m: m.drafts_proposed, "Draft tokens the drafter proposed."),
    ("spec_decode_draft_tokens_verified", lambda m: m.drafts_verified, "Draft tokens the target verified."),
    ("spec_decode_accepted_tokens", lambda m: m.accepted, "Draft tokens accepted."),
    ("spec_decode_verify_rows", lambda m: m.verify_rows, "Rows the target model computed to verify drafts."),
    ("spec_decode_draft_seconds", lambda m: m.draft_s, "Seconds spent in the drafter."),
    ("spec_decode_verify_seconds", lambda m: m.verify_s, "Seconds spent verifying in the target model."),
)
# Bucket bounds: an acceptance length is 1 to drafts + 1, a step's drafts 0 to 32 (the most
# `--num-drafts` allows).
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 33)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)


def families(m: SpecMetrics, prefix: str, labels: dict[str, str], requests: int | None) -> list[Metric]:
    """`m`'s metric families (with `requests`, also the count of requests merged into it)."""
    if not _METRIC_PREFIX.fullmatch(prefix):
        raise ValueError(f"metric prefix {prefix!r} is not a valid Prometheus name start")
    for name in labels:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__") or name in ("position", "le"):
            raise ValueError(f"label name {name!r} is not allowed")
    keys, values = list(labels), list(labels.values())
    out: list[Metric] = []

    def counter(name: str, help_text: str, samples: list[tuple[tuple[str, ...], float]],
                extra: tuple[str, ...] = ()) -> None:
        family = CounterMetricFamily(f"{prefix}{name}", help_text, labels=keys + list(extra))
        for more, value in samples:
            family.add_metric(values + list(more), value)
        out.append(family)

    if requests is not None:
        counter("spec_decode_requests", "Requests whose metrics were merged.", [((), requests)])
    for name, value, help_text in _COUNTERS:
        counter(name, help_text, [((), value(m))])
    counter("spec_decode_accepted_per_position", "Drafts accepted at each draft position (1 = first draft).",
            [((str(j + 1),), a) for j, a in enumerate(m.accepted_at)], ("position",))
    counter("spec_decode_tested_per_position",
            "Drafts the target judged at each draft position (those after a rejection are not).",
            [((str(j + 1),), t) for j, t in enumerate(m.tested_at)], ("position",))
    # accepted_at[j] counts the steps that accepted more than j drafts, all of them steps that
    # verified some: so the verify steps of length (accepted + 1) <= b are those less it
    verifies = sum(m.steps_with_drafts)
    out.append(_histogram(
        f"{prefix}spec_decode_acceptance_length",
        "Acceptance length (accepted drafts + 1) of each step that verified drafts.", keys, values,
        [(b, verifies - (m.accepted_at[b - 1] if b - 1 < len(m.accepted_at) else 0))
         for b in ACCEPTANCE_BUCKETS], verifies, m.accepted + verifies))
    plain = m.steps - verifies
    out.append(_histogram(
        f"{prefix}spec_decode_drafts_per_step", "Drafts each decode step verified (a plain step: 0).",
        keys, values, [(b, plain + sum(m.steps_with_drafts[:b])) for b in DRAFT_BUCKETS],
        m.steps, m.drafts_verified))
    return out


def _histogram(name: str, help_text: str, keys: list[str], values: list[str],
               cumulative: list[tuple[int, int]], count: int, total: float) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=keys)
    family.add_metric(values, [(floatToGoString(b), n) for b, n in cumulative] + [("+Inf", count)], total)
    return family


class SpecMetricsAggregate:
    """The server's totals over finished requests; safe to use from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = SpecMetrics()
        self._requests = 0

    def add(self, request_metrics: SpecMetrics) -> None:
        with self._lock:
            self._totals.merge(request_metrics)
            self._requests += 1

    def snapshot(self) -> tuple[int, SpecMetrics]:
        """(requests merged, a copy of the totals), taken atomically."""
        with self._lock:
            return self._requests, self._totals.copy()

    def to_dict(self) -> dict:
        requests, totals = self.snapshot()
        return {"requests": requests, **totals.to_dict()}

    def families(self, prefix: str = "metrale_", labels: dict[str, str] | None = None) -> list[Metric]:
        requests, totals = self.snapshot()
        return families(totals, prefix, labels or {}, requests=requests)

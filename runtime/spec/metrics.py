"""The one vocabulary of speculative decoding metrics: raw counters, and ratios derived from them.

Raw counters (per request in `SpecMetrics`, summed over requests in `SpecMetricsAggregate`):
steps, tokens emitted, drafts proposed (by the drafter), drafts verified (sent to the target),
accepted and tested drafts per position, verify rows, drafter and verify seconds.
Derived, never stored: tau (acceptance length: accepted drafts + the bonus or recovered token,
per step = emitted / steps) and per-position acceptance accepted_at[j] / tested_at[j], where a
position counts as tested only when the target actually judged it (positions after a step's
first rejection are not), so the ratio is the conditional acceptance a_j of `adaptive_k`.

Prometheus exports only the raw counters, so rates over any window are computed server side:

    tau (over 5 minutes):
        rate(metrale_spec_decode_emitted_tokens_total[5m])
          / rate(metrale_spec_decode_steps_total[5m])
    acceptance at position j:
        rate(metrale_spec_decode_accepted_per_position_total{position="j"}[5m])
          / rate(metrale_spec_decode_tested_per_position_total{position="j"}[5m])
    draft acceptance rate:
        rate(metrale_spec_decode_accepted_tokens_total[5m])
          / rate(metrale_spec_decode_draft_tokens_verified_total[5m])

Invariants: every counter only grows; a step's numbers satisfy
0 <= accepted <= verified <= proposed and 1 <= emitted <= accepted + 1 (fewer than accepted + 1
only when the request ends inside the step). A plain decode step is a step with no drafts.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field


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

    def prometheus_text(
        self, prefix: str = "metrale_", labels: dict[str, str] | None = None
    ) -> str:
        """Prometheus exposition text of the raw counters (see the module docstring)."""
        return _exposition(self, prefix, labels or {}, requests=None)


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*|")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    return repr(float(v)) if math.isfinite(v) else ("+Inf" if v > 0 else "-Inf")


_COUNTERS = (
    # (name without prefix and "_total", attribute, help)
    ("spec_decode_steps", "steps", "Decode steps, plain and speculative."),
    (
        "spec_decode_emitted_tokens",
        "tokens_emitted",
        "Tokens emitted: accepted drafts plus one bonus or recovered token per step.",
    ),
    ("spec_decode_draft_tokens_proposed", "drafts_proposed", "Draft tokens the drafter proposed."),
    ("spec_decode_draft_tokens_verified", "drafts_verified", "Draft tokens the target verified."),
    ("spec_decode_accepted_tokens", "accepted", "Draft tokens accepted."),
    ("spec_decode_verify_rows", "verify_rows", "Rows the target model computed to verify drafts."),
    ("spec_decode_draft_seconds", "draft_s", "Seconds spent in the drafter."),
    ("spec_decode_verify_seconds", "verify_s", "Seconds spent verifying in the target model."),
)


def _exposition(m: SpecMetrics, prefix: str, labels: dict[str, str], requests: int | None) -> str:
    if not _METRIC_PREFIX.fullmatch(prefix):
        raise ValueError(f"metric prefix {prefix!r} is not a valid Prometheus name start")
    for name in labels:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__") or name == "position":
            raise ValueError(f"label name {name!r} is not allowed")
    lines: list[str] = []

    def counter(name: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        full = f"{prefix}{name}_total"
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} counter")
        for extra, value in samples:
            lines.append(f"{full}{_labels({**labels, **extra})} {_number(value)}")

    if requests is not None:
        counter("spec_decode_requests", "Requests whose metrics were merged.", [({}, requests)])
    for name, attr, help_text in _COUNTERS:
        counter(name, help_text, [({}, getattr(m, attr))])
    counter(
        "spec_decode_accepted_per_position",
        "Drafts accepted at each draft position (1 = first draft).",
        [({"position": str(j + 1)}, a) for j, a in enumerate(m.accepted_at)],
    )
    counter(
        "spec_decode_tested_per_position",
        "Drafts the target judged at each draft position (those after a rejection are not).",
        [({"position": str(j + 1)}, t) for j, t in enumerate(m.tested_at)],
    )
    return "\n".join(lines) + "\n"


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

    def prometheus_text(
        self, prefix: str = "metrale_", labels: dict[str, str] | None = None
    ) -> str:
        requests, totals = self.snapshot()
        return _exposition(totals, prefix, labels or {}, requests=requests)

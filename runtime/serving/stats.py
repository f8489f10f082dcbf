"""What the engine counts, as data: the scheduler's, the generator's and each request's figures,
carried from where they are made to `/metrics` (`prom`).

Contract: these are msgspec Structs, so the engine process sends them down its pipe with the
outputs it sends anyway (`messages.Outputs.stats`, a request's `Finished`); the HTTP side keeps
the latest and `/metrics` renders them, never asking the engine. In one process `/metrics` reads
them from the scheduler and generator directly. All counters only grow; gauges say the moment
the snapshot was taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from metrale.runtime.spec.metrics import SpecMetrics


class SchedulerStats(msgspec.Struct, frozen=True):
    """`scheduler.Scheduler`'s counters (see its docstring)."""

    running: int = 0
    waiting: int = 0
    peak_running: int = 0
    iterations: int = 0
    iteration_seconds: float = 0.0
    forward_seconds: float = 0.0
    batched_forwards: int = 0
    batched_rows: int = 0
    head_forwards: int = 0
    head_rows: int = 0
    draft_forwards: int = 0
    draft_blocks: int = 0


class PrefixCacheStats(msgspec.Struct, frozen=True):
    queries: int  # prompt positions looked up
    hits: int  # of those, positions reused
    tokens: int  # positions held now


class GeneratorStats(msgspec.Struct, frozen=True):
    """A generator's counters: speculative decoding's over `requests` finished requests, and its
    prefix cache's where it has one."""

    requests: int = 0
    spec: SpecMetrics = msgspec.field(default_factory=SpecMetrics)
    prefix_cache: PrefixCacheStats | None = None


class EngineStats(msgspec.Struct, frozen=True):
    generator: GeneratorStats = msgspec.field(default_factory=GeneratorStats)
    scheduler: SchedulerStats = msgspec.field(default_factory=SchedulerStats)


class Drafts(msgspec.Struct, frozen=True, array_like=True):
    """One request's drafts: made by its drafter, verified by the target (a step may verify
    fewer than its drafter made: DFlash's count, a confidence stop, the request's cap) and
    accepted."""

    proposed: int
    verified: int
    accepted: int

    @classmethod
    def of(cls, metrics: SpecMetrics) -> Drafts:
        return cls(metrics.drafts_proposed, metrics.drafts_verified, sum(metrics.accepted_at))


class Finished(msgspec.Struct, frozen=True, array_like=True):
    """A request's end: why (`stop` or `length`), its completion tokens, for a streamed request
    the seconds between its successive text deltas as they were made (one a token, but a token
    whose text is held back, a split character or a possible stop string, goes out with the
    next): its inter-token latencies, and its drafts where its generator speculates."""

    finish: str
    tokens: int
    gaps: list[float] = []
    drafts: Drafts | None = None


def timed(emit: Callable[[str, Any], None], stream: bool,
          clock: Callable[[], float] = time.perf_counter) -> Callable[[str, Any], None]:
    """`emit` of one request's events (`scheduler.Job`'s: ("text", str), ("done", (finish,
    tokens[, drafts])), ("error", exc)), with its end turned into a `Finished` that carries, for a
    streamed request, the gaps between its texts."""
    gaps: list[float] = []
    last: float | None = None

    def emit_timed(kind: str, payload: Any) -> None:
        nonlocal last
        if kind == "text":
            if stream:
                now = clock()
                if last is not None:
                    gaps.append(now - last)
                last = now
        elif kind == "done":
            payload = Finished(payload[0], payload[1], gaps, *payload[2:])
        emit(kind, payload)

    return emit_timed

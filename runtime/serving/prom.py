"""`/metrics`: every metric of one app in its own prometheus_client registry.

Contract: `ServingMetrics(stats)` holds the HTTP side's own metrics — generation requests by
endpoint and outcome, prompt and completion tokens, requests admitted, and the histograms of
time to first token, inter-token latency and end-to-end latency — and renders, at each scrape,
the engine's counters as `stats()` gives them (`stats.EngineStats`: the scheduler's, speculative
decoding's with its acceptance-length and drafts-per-step histograms, the prefix cache's).
`stats` never waits: in the engine process's case it is the snapshot its last message carried.
A registry per app, so tests may build many apps in one process.

The HTTP side's histograms (names as vLLM's, under `metrale_server_`):
- time to first token: a streamed request's arrival to its first text handed to the client;
- inter-token latency: the gaps between a streamed request's text deltas as the engine made them
  (`stats.Finished.gaps`), observed when it ends;
- end-to-end latency: arrival to the final event, every request that got an answer.
A non-streamed answer is timed whole (end-to-end only): its text is made in one piece at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from metrale.runtime.serving.stats import EngineStats, Finished, SchedulerStats
from metrale.runtime.spec.metrics import families as spec_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# (field of SchedulerStats, which names its metric; kind; help)
_SCHEDULER = (
    ("running", "gauge", "Requests in the running set (the batch)."),
    ("waiting", "gauge", "Admitted requests waiting to run."),
    ("peak_running", "gauge", "Largest running set so far."),
    ("iterations", "counter", "Scheduler iterations."),
    ("iteration_seconds", "counter",
     "Time spent in iterations (each advances every running request)."),
    ("forward_seconds", "counter",
     "Of that, time in the batched forwards (the models; the rest is the host's)."),
    ("batched_forwards", "counter", "Target forwards run for the whole batch at once."),
    ("batched_rows", "counter",
     "Target rows those forwards ran (rows / forwards: the mean batch in rows; a prompt's "
     "positions the prefix cache held are not run)."),
    ("head_forwards", "counter",
     "MTP head forwards run for every drafting sequence's chain at once."),
    ("head_rows", "counter",
     "Head entries those forwards ran (rows / forwards: the mean batch in rows)."),
    ("draft_forwards", "counter",
     "Drafter calls proposing every drafting sequence's DFlash block at once."),
    ("draft_blocks", "counter",
     "Blocks those calls proposed (blocks / calls: the mean batch)."),
)


def _scheduler_families(s: SchedulerStats) -> Iterable[Metric]:
    values = msgspec.structs.asdict(s)
    for name, kind, help_text in _SCHEDULER:
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        yield family(f"metrale_scheduler_{name}", help_text, value=values[name])


class _Engine:
    """A collector of the engine's counters, read from `stats` at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self.stats()
        gen = stats.generator
        yield from spec_families(gen.spec, "metrale_", {}, requests=gen.requests)
        cache = gen.prefix_cache
        if cache is not None:
            yield CounterMetricFamily("metrale_prefix_cache_queries", "Prompt positions looked up in "
                                      "the prefix cache.", value=cache.queries)
            yield CounterMetricFamily("metrale_prefix_cache_hits", "Of those, positions reused (their "
                                      "rows not run).", value=cache.hits)
            yield GaugeMetricFamily("metrale_prefix_cache_tokens", "Prompt positions the prefix cache "
                                    "holds.", value=cache.tokens)
        yield from _scheduler_families(stats.scheduler)


class ServingMetrics:
    """One app's metrics (see the module docstring); its methods run on the event loop."""

    def __init__(self, stats: Callable[[], EngineStats], admitted: Callable[[], int]):
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter("metrale_server_requests", "Generation requests by endpoint, outcome.",
                                 ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("metrale_server_prompt_tokens", "Prompt tokens processed.",
                                     registry=registry)
        self.completion_tokens = Counter("metrale_server_completion_tokens",
                                         "Completion tokens processed.", registry=registry)
        Gauge("metrale_server_requests_admitted", "Generation requests running or queued.",
              registry=registry).set_function(admitted)
        self.ttft = Histogram("metrale_server_time_to_first_token_seconds", "A streamed request's "
                              "arrival to its first text.", buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("metrale_server_inter_token_latency_seconds", "Gaps between a streamed "
                             "request's text deltas as the engine made them (one a token).",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("metrale_server_e2e_request_latency_seconds", "A request's arrival to "
                             "its final event.", buckets=E2E_BUCKETS, registry=registry)
        registry.register(_Engine(stats))
        self._outcomes: dict[tuple[str, str], Counter] = {}

    def request(self, endpoint: str, status: str) -> None:
        """One generation request's outcome: ok, client_error or server_error."""
        child = self._outcomes.get((endpoint, status))
        if child is None:
            child = self._outcomes[endpoint, status] = self._requests.labels(endpoint, status)
        child.inc()

    def finished(self, done: Finished, seconds: float) -> None:
        """A request answered in `seconds`: its tokens, its latency and its inter-token gaps."""
        self.completion_tokens.inc(done.tokens)
        self.e2e.observe(seconds)
        observe = self.itl.observe
        for gap in done.gaps:
            observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)

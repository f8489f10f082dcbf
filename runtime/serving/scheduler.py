"""Iteration-level scheduling: every running request advances at every iteration.

One scheduler thread owns the model. Admitted requests wait in a FIFO queue; at the start of
each iteration the scheduler moves waiting requests into the running set while it holds fewer
than `max_num_seqs`, then advances every running request by one emitted token — a decode step
(speculative or plain) when the request has no token left from its last step — and retires at
once a request that finished, hit a stop string or its token limit, failed, or whose client went
away (its caches are freed with it). A short request arriving behind a long one therefore runs
alongside it instead of waiting for it to end.

Each request keeps its own decoder, caches and sampling state (`EngineGenerator.stream`), so its
answer is the one it gets alone: requests share the thread, not state. Steps are not batched
into one forward: the model runs one sequence's step at a time. A tensor-parallel world decodes
requests in lockstep across ranks, one at a time, so there `max_num_seqs` is 1.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from metrale.runtime.artifact.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)


class StopScanner:
    """Cuts text at the first stop string; holds back a tail that may still begin one."""

    def __init__(self, stops) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string matched)."""
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)], True
        hold = 0  # longest suffix of text that is a proper prefix of some stop string
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text


class Job:
    """One admitted request: emits ("text", str)*, then ("done", (finish_reason, n_tokens)) or
    ("error", exception); `cancel` set ends it at its next token (or before it starts)."""

    def __init__(self, gen, req, emit: Callable[[str, Any], None], cancel: threading.Event, rid: str):
        self.gen, self.req, self.emit, self.cancel, self.rid = gen, req, emit, cancel, rid
        self.decoder, self.scanner = IncrementalDecoder(gen.tokenizer), StopScanner(req.stop)
        self.eos, self.limit = gen.tokenizer.eos_token_ids, req.params.max_tokens
        self.n, self.tokens = 0, None

    def advance(self) -> bool:
        """Emit the next token's text; False once the job is over (its stream closed)."""
        try:
            if self.cancel.is_set():  # the client left (while waiting, or mid-generation)
                return self._finish(stopped=True)
            if self.tokens is None:
                self.tokens = self.gen.stream(self.req.prompt_ids, self.req.params)
            token = next(self.tokens, None)
            if token is None:
                return self._finish(stopped=False)
            self.n += 1
            if token in self.eos:
                return self._finish(stopped=False, eos=True)
            text, stopped = self.scanner.push(self.decoder.feed(token))
            if text:
                self.emit("text", text)
            if stopped or self.n >= self.limit:
                return self._finish(stopped)
            return True
        except Exception as e:  # reported to the client as a 500; the server keeps serving
            log.exception("request %s: generation failed", self.rid)
            self._close()
            self.emit("error", e)
            return False

    def _finish(self, stopped: bool, eos: bool = False) -> bool:
        self._close()
        if not stopped:
            text, stopped = self.scanner.push(self.decoder.flush())
            text += "" if stopped else self.scanner.flush()
            if text:
                self.emit("text", text)
        self.emit("done", ("stop" if stopped or eos or self.n < self.limit else "length", self.n))
        return False

    def _close(self) -> None:
        close = getattr(self.tokens, "close", None)
        self.tokens = None
        if close is not None:  # a generator: its cleanup (metrics, a world's lockstep) runs now
            close()


class Scheduler:
    """The model's one thread: admits waiting jobs up to `max_num_seqs` running and advances
    every running one each iteration. Counters for /metrics: `running`, `waiting`, `steps`
    (iterations), `step_seconds` (their total time), `peak_running`."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.steps, self.step_seconds, self.peak_running = 0, 0.0, 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="metrale-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self.waiting.append(job)
            self._cv.notify()

    def _admit(self) -> None:
        with self._cv:
            while not self.waiting and not self.running:
                self._cv.wait()
            while self.waiting and len(self.running) < self.max_num_seqs:
                self.running.append(self.waiting.popleft())
            self.peak_running = max(self.peak_running, len(self.running))

    def _loop(self) -> None:
        while True:
            self._admit()
            t0 = time.perf_counter()
            self.running = [job for job in self.running if job.advance()]
            self.steps += 1
            self.step_seconds += time.perf_counter() - t0
            # Let the event loop in between iterations: a busy thread otherwise holds the GIL
            # for the interpreter's switch interval (5 ms), which every hand-off of a request
            # arriving mid-generation (parse, admission, each delta) would wait for.
            time.sleep(0)

    def metrics_lines(self) -> list[str]:
        out = []
        for name, kind, value, text in (
                ("running", "gauge", len(self.running), "Requests in the running set (the batch)."),
                ("waiting", "gauge", len(self.waiting), "Admitted requests waiting to run."),
                ("peak_running", "gauge", self.peak_running, "Largest running set so far."),
                ("iterations_total", "counter", self.steps, "Scheduler iterations."),
                ("iteration_seconds_total", "counter", round(self.step_seconds, 6),
                 "Time spent in iterations (each advances every running request).")):
            out += [f"# HELP metrale_scheduler_{name} {text}", f"# TYPE metrale_scheduler_{name} {kind}",
                    f"metrale_scheduler_{name} {value}"]
        return out

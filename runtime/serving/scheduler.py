"""Iteration-level scheduling: every running request advances at every iteration.

One scheduler thread owns the model. Admitted requests wait in a FIFO queue; at the start of
each iteration the scheduler moves waiting requests into the running set while it holds fewer
than `max_num_seqs`, then advances every running request by one emitted token — a decode step
(speculative or plain) when the request has no token left from its last step — and retires at
once a request that finished, hit a stop string or its token limit, failed, or whose client went
away (its caches are freed with it). A short request arriving behind a long one therefore runs
alongside it instead of waiting for it to end.

Each request keeps its own decode loop, caches and sampling state (`EngineGenerator.steps`); the
target rows every running request needs next (a prompt, a plain step's token, a verify's token
and drafts) run in one batched forward per iteration (`EngineGenerator.run_forwards`), in which
each row reads its own sequence's cache only, so every answer is the one the request gets
alone; so do the MTP head's entries of every drafting request's chain (one head forward per
link of the chains) and every drafting request's DFlash block (one drafter call). A request's
greedy plain steps (plain decoding's, or those of a speculative request in a busy batch) come as
one `decode.PlainRun`: the scheduler runs them, its token out after each, without resuming the
request's decode loop until the run ends. Drafting backs off under load: with
`speculative_disable_by_batch_size` or more sequences running, steps are plain (the drafters
still follow, see `decode.Decoder.steps`), and drafting resumes once fewer have run for
`SPECULATE_AFTER_S`; greedy answers do not change, since a speculative step emits plain
decoding's tokens. A tensor-parallel world decodes requests in lockstep across ranks, one at a
time, so there `max_num_seqs` is 1.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from metrale.runtime.artifact.tokenizer import IncrementalDecoder
from metrale.runtime.serving.stats import Drafts, SchedulerStats
from metrale.runtime.spec.decode import Batch
from metrale.runtime.spec.metrics import SpecMetrics
from metrale.runtime.steps import Driver, ModelStep, StepKind

log = logging.getLogger(__name__)

# Speculation resumes only once fewer than `speculative_disable_by_batch_size` sequences have run
# for this long. Clients in a closed loop leave the batch between their requests, so under
# steady load the running set dips for moments; a sequence drafting in such a dip runs its chain
# (a head forward per link) and its backlog of followed rows through the drafter, and its verify
# rows, while the batch refills around it: drafting in the dips costs the batch more than it
# gains.
SPECULATE_AFTER_S = 0.1
WAIT_POLL_S = 0.005  # how long a loop whose every job waits on host work waits before it looks again


class StopScanner:
    """Cuts text at the first stop string; holds back a tail that may still begin one."""

    def __init__(self, stops) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string matched)."""
        if not self._stops:  # nothing to hold back
            return delta, False
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


def _closing(tokens):
    """A generator over `tokens` whose `close` closes them too where they can be closed (a
    generator's cleanup: its metrics, a world's lockstep)."""
    yield from tokens


@dataclass(frozen=True)
class Capabilities:
    """What a generator offers its scheduler (`TextGenerator.capabilities`)."""

    # its sequences' model steps can run together: each request's `steps(prompt_ids, params,
    # batch, counted)` coroutine (`steps` contract), their steps through its `run_forwards`
    batched: bool = False
    sequential: bool = False  # it decodes one request at a time (a tensor-parallel world)
    max_running: int | None = None  # the most requests it runs at once (a graph target's lanes)
    speculates: bool = False  # every answer's usage counts its drafts (zeros where it made none)
    # what the scheduler's model thread runs in (entered once: the coroutines resume there)
    thread_mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


STREAM_ONLY = Capabilities()  # a generator that only streams each request on its own


class Job:
    """One admitted request: emits ("text", str)*, then ("done", (finish_reason, n_tokens,
    drafts)) or ("error", exception); `cancel` set ends it at its next step (or before it
    starts). `drafts` (`stats.Drafts`) counts its drafts where its generator speculates (the
    generator merges the request's counters into `counted` as it ends; zeros for a request that
    ended before its first step), else None.

    On a batched scheduler (`coroutine`, set at `Scheduler.submit`) the request runs as its
    decode loop's coroutine (`gen.steps`) through a `steps.Driver`: `advance` runs it up to the
    next model step it needs and leaves that in `need` (None while it waits on host work, a
    `steps.Wait`); the scheduler runs every job's `need` together and hands each its output
    (`reply`). Otherwise (a tensor-parallel world, a stream-only generator) `advance` takes the
    next token of `gen.stream`."""

    def __init__(self, gen, req, emit: Callable[[str, Any], None], cancel: threading.Event, rid: str,
                 batch: Batch | None = None, coroutine: bool = False):
        self.gen, self.req, self.emit, self.cancel, self.rid = gen, req, emit, cancel, rid
        self.speculates = False  # its generator's `Capabilities.speculates` (set at `Scheduler.submit`)
        # a request neither streamed nor cut at stop strings needs its text only once it ends:
        # its ids are decoded then, at once, not one decode per token in the busy loop
        self.decoder = IncrementalDecoder(gen.tokenizer, deferred=not (req.stream or req.stop))
        self.scanner = StopScanner(req.stop)
        # the tokens it may emit: its max_tokens, within the context (where the decode loop ends
        # it too), so a request the context cut ends with "length"
        self.eos = gen.tokenizer.eos_token_ids
        self.limit = min(req.params.max_tokens, gen.max_context - len(req.prompt_ids))
        self.n, self.tokens = 0, None
        self.counted = SpecMetrics()
        self.batch = batch or Batch()
        self.coroutine = coroutine
        self.need: ModelStep | None = None
        self.reply = None
        self.driver: Driver | None = None

    def advance(self) -> bool:
        """Run the request to its next forward (or its next token); False once it is over (its
        stream closed)."""
        try:
            if self.cancel.is_set():  # the client left (while waiting, or mid-generation)
                return self._finish(stopped=True)
            if self.coroutine:
                return self._advance_steps()
            if self.tokens is None:
                self.tokens = _closing(self.gen.stream(self.req.prompt_ids, self.req.params, self.counted))
            token = next(self.tokens, None)
            if token is None:
                return self._finish(stopped=False)
            return self._take(token)
        except Exception as e:  # reported to the client as a 500; the server keeps serving
            return self.fail(e)

    def _advance_steps(self) -> bool:
        driver = self.driver
        if driver is None:
            self.tokens = self.gen.steps(self.req.prompt_ids, self.req.params, self.batch, self.counted)
            driver = self.driver = Driver(self.tokens, self._take)
        reply, self.reply = self.reply, None
        if driver.advance(reply):
            self.need = driver.need
            return True
        if driver.finished:
            return self._finish(stopped=False)
        return False  # `_take` ended it

    @property
    def waiting(self) -> bool:
        """Whether it waits on host work (`steps.Wait`), needing no forward meanwhile."""
        return self.driver is not None and self.driver.wait is not None

    def _take(self, token: int) -> bool:
        """One emitted token: its text (minus any stop string) out; False when the job ended."""
        self.n += 1
        if token in self.eos:
            return self._finish(stopped=False, eos=True)
        text, stopped = self.scanner.push(self.decoder.feed(token))
        if text:
            self.emit("text", text)
        if stopped or self.n >= self.limit:
            return self._finish(stopped)
        return True

    def fail(self, e: Exception) -> bool:
        log.error("request %s: generation failed", self.rid, exc_info=e)
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
        counted = self.counted
        drafts = Drafts.of(counted) if counted.steps or self.speculates else None
        self.emit("done", ("stop" if stopped or eos or self.n < self.limit else "length", self.n, drafts))
        return False

    def _close(self) -> None:
        """Its steps so far into the result the decode loop's cleanup reads, then that cleanup
        (metrics, a world's lockstep) at once."""
        driver, tokens = self.driver, self.tokens
        self.tokens, self.need, self.driver = None, None, None
        if driver is not None:
            driver.close()
        elif tokens is not None:
            tokens.close()


class Scheduler:
    """The model's one thread: admits waiting jobs up to `max_num_seqs` running and advances
    every running one each iteration, the forwards of the batched ones in one call
    (`run_forwards`). Steps draft only while fewer than `speculative_disable_by_batch_size`
    sequences run (None: always). Counters for /metrics: `running`, `waiting`, `steps`
    (iterations), `step_seconds` (their total time), `forward_seconds` (of it, in the batched
    forwards), `peak_running`, `batched_rows` (target
    rows run in batched forwards), `forwards` (those forwards), `head_rows` and `head_forwards`
    (the same for the MTP head's draft-chain entries), `draft_blocks` and `draft_forwards`
    (DFlash blocks proposed in batched drafter calls, and those calls)."""

    def __init__(self, max_num_seqs: int, run_forwards: Callable | None = None,
                 speculative_disable_by_batch_size: int | None = None,
                 thread_mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 flush: Callable[[], None] = lambda: None, yield_gil: bool = True,
                 inbox: Callable[[bool], bool] | None = None, speculates: bool = False):
        self.max_num_seqs = max_num_seqs
        self.speculates = speculates  # its generator's `Capabilities.speculates`, for its jobs
        # between iterations, let another thread of this interpreter in (an event loop's)
        self.yield_gil = yield_gil
        self.thread_mode = thread_mode  # the model thread runs in it (the generator's torch mode)
        self.deliver = flush  # after each phase of an iteration: what the jobs emitted goes out
        self.run_forwards = run_forwards
        self.disable_at = speculative_disable_by_batch_size
        self._busy_until = 0.0  # speculation waits for this time (`SPECULATE_AFTER_S`)
        self.batch = Batch()  # shared by every job: read by each step
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.steps, self.step_seconds, self.peak_running = 0, 0.0, 0
        self.forward_seconds = 0.0  # of step_seconds, inside the batched forwards (the models)
        self.batched_rows, self.forwards = 0, 0
        self.head_rows, self.head_forwards = 0, 0
        self.draft_blocks, self.draft_forwards = 0, 0
        self._cv = threading.Condition()
        # Where requests come from: `submit` from other threads (then this thread of its own
        # runs the loop), or `inbox` read by the loop itself between iterations (`run`).
        self.inbox = inbox
        if inbox is None:
            threading.Thread(target=self._loop, name="metrale-scheduler", daemon=True).start()

    @classmethod
    def for_generator(cls, gen, max_num_seqs: int, disable_at: int | None,
                      flush: Callable[[], None] = lambda: None, yield_gil: bool = True,
                      inbox: Callable[[bool], bool] | None = None) -> "Scheduler":
        """The scheduler of `gen`, as its `capabilities` allow: batched where it can batch, one
        request at a time where it decodes so, and never more at once than it runs.
        `yield_gil`: whether an event loop shares its interpreter (see `_iterate`); `inbox`:
        see `run`."""
        caps: Capabilities = gen.capabilities
        most = 1 if caps.sequential else min(max_num_seqs, caps.max_running or max_num_seqs)
        return cls(most, gen.run_forwards if caps.batched else None, disable_at, caps.thread_mode,
                   flush, yield_gil, inbox, caps.speculates)

    def run(self) -> None:
        """The loop on the caller's thread, for a scheduler given an `inbox`: a callable that
        handles the messages waiting for the scheduler (submitting jobs, setting cancels) and
        says whether to go on. It is called before every iteration, with `wait` True when
        nothing runs or waits (then it blocks for the next message). Returns once it says
        stop. The engine process reads its pipe so: a request arriving mid-generation is
        admitted at the next iteration, without waking a reader thread that then waits for a
        core and for the interpreter lock the busy loop holds."""
        self._loop()

    def start(self, gen, req, emit: Callable[[str, Any], None], cancel: threading.Event, rid: str) -> None:
        """Admit request `req` of `gen`: its events go to `emit`; `cancel` set ends it."""
        self.submit(Job(gen, req, emit, cancel, rid))

    @staticmethod
    def new_cancel(rid: str) -> threading.Event:
        """The event that cancels request `rid` when set."""
        return threading.Event()

    def submit(self, job: Job) -> None:
        job.batch = self.batch
        job.coroutine = self.run_forwards is not None
        job.speculates = self.speculates
        with self._cv:
            self.waiting.append(job)
            self._cv.notify()

    def _admit(self) -> bool:
        """Waiting jobs into the running set; False once the inbox said stop."""
        if self.inbox is not None:
            while True:
                if not self.inbox(not (self.waiting or self.running)):
                    return False
                if self.waiting or self.running:
                    break
        with self._cv:
            while not self.waiting and not self.running:
                self._cv.wait()
            while self.waiting and len(self.running) < self.max_num_seqs:
                self.running.append(self.waiting.popleft())
            self.peak_running = max(self.peak_running, len(self.running))
        n = self.batch.size = sum(not job.waiting for job in self.running)  # (a waiting job runs no forward)
        if self.disable_at is not None:
            now = time.monotonic()
            if n >= self.disable_at:
                self._busy_until = now + SPECULATE_AFTER_S
            self.batch.speculate = now >= self._busy_until
        return True

    def _forward(self, jobs: list[Job]) -> None:
        """Every job's `need` in one batched forward; a failure there is retried one job at a
        time, so only the request at fault fails."""
        forwards = [job.need for job in jobs]
        t0 = time.perf_counter()
        try:
            outs = self.run_forwards(forwards)
        except Exception:  # noqa: BLE001 - find the request at fault below
            outs = None
        self.forward_seconds += time.perf_counter() - t0
        if outs is not None:
            self._count(forwards)
        for i, job in enumerate(jobs):
            job.need = None
            if outs is not None:
                job.reply = outs[i]
                continue
            try:
                job.reply = self.run_forwards([forwards[i]])[0]
            except Exception as e:  # noqa: BLE001 - this request's own failure
                job.fail(e)

    def _count(self, forwards: list[ModelStep]) -> None:
        """/metrics' counters of one batched call's model steps, in one pass over them."""
        steps, rows = [0, 0, 0], [0, 0, 0]  # per `StepKind`
        for f in forwards:
            kind = f.kind
            steps[kind] += 1
            rows[kind] += f.ran
        self.forwards += steps[StepKind.TARGET] > 0
        self.batched_rows += rows[StepKind.TARGET]
        self.head_forwards += steps[StepKind.HEAD] > 0
        self.head_rows += rows[StepKind.HEAD]
        self.draft_forwards += steps[StepKind.DRAFT] > 0
        self.draft_blocks += steps[StepKind.DRAFT]

    def _loop(self) -> None:
        with self.thread_mode():
            self._iterate()

    def _iterate(self) -> None:
        while self._admit():
            t0 = time.perf_counter()
            self.running = [job for job in self.running if job.advance()]
            self.deliver()  # the text of every job's step out before the next forward
            needing = [job for job in self.running if job.need is not None]
            if needing:
                self._forward(needing)
                self.deliver()  # the failures of jobs whose forward failed
                self.running = [job for job in self.running if job.tokens is not None]
            elif self.running and all(job.waiting for job in self.running):
                # every job waits on host work (`steps.Wait`): until one's is done (or a while,
                # for a request arriving meanwhile), not an iteration
                futures.wait([job.driver.wait.future for job in self.running], WAIT_POLL_S,
                             futures.FIRST_COMPLETED)
                continue
            self.steps += 1
            self.step_seconds += time.perf_counter() - t0
            # Let the event loop in between iterations: a busy thread otherwise holds the GIL
            # for the interpreter's switch interval (5 ms), which every hand-off of a request
            # arriving mid-generation (parse, admission, each delta) would wait for. In the
            # engine process no other thread needs it (this loop reads the pipe), and the sleep
            # is a clock_nanosleep that Linux's timer slack (50 us by default) stretches, a cost
            # every iteration would pay: there it is skipped.
            if self.yield_gil:
                time.sleep(0)

    def stats(self):
        """Its counters for /metrics (`serving.stats.SchedulerStats`), as they stand now."""
        return SchedulerStats(len(self.running), len(self.waiting), self.peak_running, self.steps,
                              self.step_seconds, self.forward_seconds, self.forwards, self.batched_rows,
                              self.head_forwards, self.head_rows, self.draft_forwards, self.draft_blocks)

"""The step contract (`runtime.steps`): the one driver of a decode loop's coroutine hands out its
model steps, runs its runs of plain steps without resuming it, emits its tokens in order, stops
where its consumer says, and closes what it drove."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from metrale.runtime.steps import Driver, Forward, HeadForward, Run, StepKind, Wait, drive, run_alone


class _Doubling(Run):
    """A run of `n` steps whose token is its step's output doubled."""

    def __init__(self, n: int):
        self.forward, self.left, self.tokens, self.closed = Forward([0], None), n, [], 0

    def take(self, out) -> int:
        token = 2 * out
        self.tokens.append(token)
        self.left -= 1
        if self.left == 0:
            self.forward = None
        return token

    def close(self) -> None:
        self.closed += 1


def _loop(log: list, run: _Doubling):
    """A decode loop: a model step, its output emitted; a run; one more step; it returns 'done'."""
    try:
        out = yield Forward([1, 2], None)
        yield [out, out + 1]
        ended = yield run
        log.append(("run back", ended is run, list(run.tokens)))
        out = yield Forward([3], None)
        yield [out]
        return "done"
    finally:
        log.append("closed")


def test_the_driver_stops_at_model_steps_steps_runs_and_emits_in_order():
    log, emitted, run = [], [], _Doubling(3)
    driver = Driver(_loop(log, run), lambda t: emitted.append(t) or True)
    needs = []
    reply = None
    outputs = iter([10, 5, 6, 7, 40])
    while driver.advance(reply):
        needs.append(driver.need)
        reply = next(outputs)
    assert driver.finished and driver.value == "done" and driver.need is None
    assert emitted == [10, 11, 10, 12, 14, 40]
    assert [type(n).__name__ for n in needs] == ["Forward"] * 5  # a run's steps are its forward
    assert needs[1] is needs[2] is needs[3] and needs[0] is not needs[1] is not needs[4]
    assert log == [("run back", True, [10, 12, 14]), "closed"]


def test_an_emit_that_says_stop_ends_the_sequence_and_close_records_the_run():
    log, run = [], _Doubling(5)
    seen = []

    def emit(token):
        seen.append(token)
        return len(seen) < 3  # the third token ends it (a stop string, the token limit)

    driver = Driver(_loop(log, run), emit)
    reply, outputs = None, iter([10, 5, 6, 7])
    while driver.advance(reply):
        reply = next(outputs)
    assert not driver.finished and seen == [10, 11, 10]
    assert log == []  # the coroutine is left where it was until the driver is closed
    driver.close()
    assert run.closed == 1 and log == ["closed"]


def test_drive_runs_each_step_at_once_and_yields_tokens_as_they_come():
    log, run = [], _Doubling(2)
    calls = []

    def run_steps(steps):
        calls.append(len(steps))
        return [len(calls) * 10]

    tokens = drive(_loop(log, run), run_steps)
    assert list(tokens) == [10, 11, 40, 60, 40]
    assert calls == [1, 1, 1, 1] and log[-1] == "closed"

    stopped = drive(_loop(log := [], _Doubling(9)), run_steps)
    next(stopped)
    stopped.close()  # a consumer that stops midway closes the coroutine
    assert log == ["closed"]


def test_a_proposer_coroutine_alone_returns_its_drafts():
    class Head:
        def __init__(self):
            self.calls = 0

        def __call__(self, embeds, hidden, cache, start=None):
            self.calls += 1
            return embeds + 1, hidden

    head = Head()

    def chain():
        x = torch.zeros(1, 1, 2)
        for _ in range(3):
            x, _ = yield HeadForward(head, x, x, None)
        return x[0, 0, 0].item()

    assert run_alone(chain()) == 3.0 and head.calls == 3
    assert HeadForward(head, torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), None).kind is StepKind.HEAD


def _waiting(future, log: list):
    """A decode loop that waits on host work first (a request's grammar compiling), then steps."""
    compiled = yield Wait(future)
    log.append(compiled)
    out = yield Forward([1], None)
    yield [out]
    return "done"


def test_a_wait_needs_nothing_until_its_work_is_done_and_its_result_is_sent():
    future, log, emitted = Future(), [], []
    driver = Driver(_waiting(future, log), lambda t: emitted.append(t) or True)
    assert driver.advance() and driver.need is None and driver.wait is not None
    assert driver.advance() and driver.need is None and log == []  # not done: not resumed
    future.set_result("grammar")
    assert driver.advance() and isinstance(driver.need, Forward) and log == ["grammar"]
    assert not driver.advance(7) and driver.finished and emitted == [7]


def test_closing_a_waiting_driver_drops_work_not_started():
    future, log = Future(), []
    driver = Driver(_waiting(future, log))
    assert driver.advance() and driver.wait is not None
    driver.close()  # (a request cancelled while its grammar waited to compile)
    assert future.cancelled() and driver.wait is None and log == []


def test_a_failed_wait_raises_where_the_driver_resumes():
    future = Future()
    driver = Driver(_waiting(future, []))
    assert driver.advance()
    future.set_exception(ValueError("no grammar"))
    with pytest.raises(ValueError, match="no grammar"):
        driver.advance()


def test_drive_and_run_alone_block_on_a_wait():
    with ThreadPoolExecutor(1) as pool:
        release = threading.Event()
        log = []
        tokens = drive(_waiting(pool.submit(lambda: release.wait(30) and "late"), log), lambda steps: [3])
        release.set()
        assert list(tokens) == [3] and log == ["late"]

        def proposer():
            drafts = yield Wait(pool.submit(lambda: [4, 5]))
            return drafts

        assert run_alone(proposer()) == [4, 5]

"""The step contract: what a decode loop asks of whoever runs it, and the one driver that answers.

A sequence's decode loop (`spec.decode.Decoder.steps`, or a request's lane of whole iterations,
`serving.service.EngineGenerator.steps`) is a coroutine. It yields, and is sent back:

    it yields                          it is sent
    a `ModelStep` (model work):
      `Forward`      target rows        their `TargetOutput`
      `HeadForward`  MTP-head entries   (logits, hidden)
      `DraftForward` a DFlash block     its `Proposal`
      `LaneStep`     a whole iteration  the tokens it emitted for the lane (`spec.iteration_loop`)
    a `Run` (`spec.decode.PlainRun`)    the run itself, once it has ended
    a `Wait` (host work off the loop)   its result, once it is done
    a list of token ids (emitted)       None

A proposer's draft coroutine (`spec.proposer.Proposer.propose_steps`) yields model steps the same
way and returns its drafts.

`Driver` is the only code that tells these apart: it resumes the coroutine, hands emitted tokens
to its `emit`, steps a `Run` one forward at a time without resuming the loop, holds a `Wait`
until its work is done (meanwhile it needs nothing), and stops at the next model step, which it
leaves in `need`. Who runs the model steps differs: `drive` runs each at once (one sequence:
`Decoder.stream`, a proposer alone), a scheduler gathers every running sequence's `need` and runs
them together (`serving.scheduler`), one call per face (`backends.run_forwards`). A face that
runs many sequences' steps in one call is a `BatchedFace`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import torch


# The most drafts a draft tree holds (`--dflash-tree-budget`'s range): its verify's rows are
# these and the root's.
MAX_TREE_NODES = 64


class StepKind(enum.IntEnum):
    """Which model a step runs: what the scheduler counts it as."""

    TARGET = 0
    HEAD = 1
    DRAFT = 2


class ModelStep:
    """Model work a sequence waits for. `face` runs it (None: the target the driver was given),
    `ran` is the rows it runs (what the scheduler counts)."""

    __slots__ = ()
    kind: StepKind = StepKind.TARGET
    face = None

    @property
    def ran(self) -> int:
        return 1

    def run(self):
        """This step alone, on its own face."""
        raise NotImplementedError(f"{type(self).__name__} runs on the target: use run_forwards")


class Forward(ModelStep):
    """Target rows a sequence needs next: `ids` [1, T] at positions `cache.length`.., with the
    outputs of target layers `taps`. `last_logits`: only the last row's logits are needed (a
    prompt): a batched forward then computes no others and gives logits [1, 1, V].

    `ids` may be given as a list of token ids (the decode loop's steps: a batched forward
    builds one tensor for all its rows); `ids` is then made, on `device`, when first read.
    `served`: of its rows, those a backend answered without running them (a prompt's positions
    its prefix cache held), set by the backend.

    `tree` (a `spec.ddtree.Tree` whose nodes the rows are, in order): the rows are a draft tree's,
    node i at position cache.length + its depth, seeing the cache's positions before the root
    and its own ancestors only; they are written at slots cache.length + i, and the cache's
    length stays where it was until the decode loop keeps the accepted path (`keep_path`)."""

    __slots__ = ("_ids", "tokens", "cache", "taps", "last_logits", "device", "rows", "served", "tree")

    def __init__(self, ids: torch.Tensor | list[int], cache, taps: tuple[int, ...] = (),
                 last_logits: bool = False, device: torch.device | str = "cpu", tree=None):
        self._ids, self.tokens = (None, list(ids)) if isinstance(ids, list) else (ids, None)
        self.cache, self.taps, self.last_logits, self.device = cache, taps, last_logits, device
        self.tree = tree
        # read several times per forward by a batched step's planning: counted once
        self.rows = len(self.tokens) if self.tokens is not None else ids.shape[1]
        self.served = 0

    @property
    def ran(self) -> int:
        return self.rows - self.served

    @property
    def ids(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = torch.tensor([self.tokens], dtype=torch.long, device=self.device)
        return self._ids

    def token_ids(self) -> list[int]:
        return self.tokens if self.tokens is not None else self._ids[0].tolist()

    def feed(self, token: int) -> None:
        """A one-row step's forward made the next step's: its row is now `token`, at the
        position after the last (the cache's length, which the forward moved on)."""
        self.tokens[0], self._ids = token, None

    def __repr__(self) -> str:
        return f"Forward(rows={self.rows}, taps={self.taps}, last_logits={self.last_logits})"


@dataclass
class HeadForward(ModelStep):
    """MTP-head entries a sequence's draft chain needs next: `embeds`, `hidden` [1, T, H] at
    positions `start`.. (default `cache.length`) of `head`'s cache -> (logits [1, T, V], h
    [1, T, H]), the cache's length then start + T (`backends.MTPSteps.__call__`)."""

    head: object
    embeds: torch.Tensor
    hidden: torch.Tensor
    cache: object
    start: int | None = None
    kind = StepKind.HEAD

    @property
    def rows(self) -> int:
        return self.embeds.shape[1]

    ran = rows

    @property
    def face(self):
        return self.head

    def run(self):
        return self.head(self.embeds, self.hidden, self.cache, start=self.start)


@dataclass
class DraftForward(ModelStep):
    """A block propose a sequence needs next: `drafter.propose(anchor [1], embed, cache, gamma,
    tree_nodes)` (`backends.DrafterSteps.propose`, the context added since the last propose fed first)
    -> its `dflash.Proposal`."""

    drafter: object
    anchor: torch.Tensor
    embed: object
    cache: object
    gamma: int
    # the nodes of a draft tree built from the block (0: none): the `Proposal` then carries the
    # slots' distributions, whatever the face
    tree_nodes: int = 0
    kind = StepKind.DRAFT
    rows = 1  # one block

    @property
    def face(self):
        return self.drafter

    @property
    def distributions(self) -> bool:
        """Whether the block's distributions are needed (a draft tree is built from them)."""
        return self.tree_nodes > 0

    def run(self):
        return self.drafter.propose(self.anchor, self.embed, self.cache, self.gamma, self.tree_nodes)


class BatchedFace(ABC):
    """A face that runs many sequences' model steps of its kind in one call."""

    @abstractmethod
    def forward_many(self, steps: list) -> list:
        """Each step's output, in order."""


class Run(ABC):
    """Steps of one sequence that its driver runs without resuming the decode loop: `forward`
    is the current step's target rows (None once the run has ended), `take` its output -> the
    token it emits (and `forward` becomes the next step's), `close` records the steps taken so
    far (the sequence was dropped midway)."""

    forward: Forward | None

    @abstractmethod
    def take(self, out) -> int: ...

    @abstractmethod
    def close(self) -> None: ...


class Wait:
    """Host work a sequence waits for before it goes on (a request's grammar compiling on a
    worker thread): `future` (a `concurrent.futures.Future`), whose result the coroutine is sent.
    A scheduler runs the other sequences meanwhile."""

    __slots__ = ("future",)

    def __init__(self, future):
        self.future = future


Step = ModelStep | Run | Wait | list  # what a decode loop yields (a list: the token ids it emitted)


def _keep(token: int) -> bool:
    return True


class Driver:
    """Drives one sequence's coroutine: `advance(reply)` resumes it with the output of the last
    `need` and runs it to its next model step, which it leaves in `need`; each emitted token goes
    to `emit` (which returns False to end the sequence there). `advance` returns False once the
    sequence is over: `finished` (the coroutine returned, `value` what it returned) or ended by
    `emit`."""

    __slots__ = ("steps", "emit", "need", "run", "wait", "finished", "value")

    def __init__(self, steps: Generator, emit: Callable[[int], bool] = _keep):
        self.steps, self.emit = steps, emit
        self.need: ModelStep | None = None
        self.run: Run | None = None  # a run in progress: its steps taken here, the loop untouched
        self.wait: Wait | None = None  # host work the sequence waits for: `need` is None meanwhile
        self.finished, self.value = False, None

    def advance(self, reply=None) -> bool:
        """(While a `Wait` is not done: True, `need` None, the coroutine not resumed.)"""
        if self.wait is not None:
            if not self.wait.future.done():
                return True
            reply, self.wait = self.wait.future.result(), None  # (its exception: raised here)
            return self._resume(reply)
        run = self.run
        if run is not None:  # a step of the run: its token out, the next step's row
            if not self.emit(run.take(reply)):
                return False
            if run.forward is not None:
                self.need = run.forward
                return True
            self.run, reply = None, run  # the run ended: the loop goes on from it
        return self._resume(reply)

    def _resume(self, reply) -> bool:
        steps, emit = self.steps, self.emit
        while True:
            try:
                item = steps.send(reply)
            except StopIteration as done:
                self.need, self.finished, self.value = None, True, done.value
                return False
            if isinstance(item, ModelStep):
                self.need = item
                return True
            if isinstance(item, Run):
                self.run, self.need = item, item.forward
                return True
            if isinstance(item, Wait):
                self.wait, self.need = item, None
                return self.advance()
            for token in item:
                if not emit(token):
                    return False
            reply = None

    def block(self) -> None:
        """Until a `Wait` is done (a driver with no other sequence to run meanwhile)."""
        if self.wait is not None:
            self.wait.future.exception()  # (waits; the result or error is taken by `advance`)

    def close(self) -> None:
        """End the sequence here: a run's steps so far into its result, then the coroutine's
        cleanup (its metrics, a world's lockstep)."""
        if self.run is not None:
            self.run.close()
        if self.wait is not None:
            self.wait.future.cancel()  # (work not started yet is dropped)
        self.need = self.run = self.wait = None
        self.steps.close()


def drive(steps: Generator, run: Callable[[list], list]) -> Iterator[int]:
    """One sequence's coroutine with each model step run at once by `run` (a list of steps ->
    their outputs); yields its tokens as they are emitted and returns what it returns."""
    tokens: list[int] = []
    driver = Driver(steps, lambda token: tokens.append(token) or True)
    try:
        reply = None
        while driver.advance(reply):
            if tokens:
                yield from tokens
                tokens.clear()
            if driver.need is None:  # a Wait
                driver.block()
                reply = None
                continue
            reply = run([driver.need])[0]
        yield from tokens
        return driver.value
    finally:
        driver.close()


def run_each(steps: list) -> list:
    """Each model step alone on its own face."""
    return [step.run() for step in steps]


def run_alone(steps: Generator):
    """A proposer's draft coroutine with each model step run at once -> what it returns."""
    driver = Driver(steps)
    reply = None
    while driver.advance(reply):
        driver.block()
        reply = driver.need.run() if driver.need is not None else None
    return driver.value

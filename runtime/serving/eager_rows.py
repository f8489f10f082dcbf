"""A request's decode loop on the eager target, beside the lanes of whole-iteration graphs.

Where a graph target serves requests in the lanes of its iteration graphs, a request the graphs
cannot serve (one with a `response_format` schema: the graphs emit their rows' argmax unmasked)
runs the decode loop instead, on the eager model behind the graphs with a cache of its own, so
several of them run beside the lanes (within the server's running limit, which they share
with the lanes' requests). The scheduler runs a step on its face, and a decode loop's target
rows (`Forward`) have none (they run on the scheduler's target, the graph target, whose one
decode cache serves one sequence at a time): `on_eager_target` re-yields the loop's steps with
its target rows as `EagerRows`, whose face is the eager model. The loop must take no plain runs
(`Decoder.steps(runs=False)`, as the scheduler's lanes run every loop): a run's rows would go to
the scheduler's target.
"""

from __future__ import annotations

from collections.abc import Generator

from metrale.runtime.backends import tree_forward
from metrale.runtime.steps import Forward, ModelStep, Run, StepKind


class EagerRows(ModelStep):
    """A decode loop's target rows (`forward`) run on `model`, the eager target."""

    __slots__ = ("forward", "model")
    kind = StepKind.TARGET

    def __init__(self, forward: Forward, model):
        self.forward, self.model = forward, model

    @property
    def face(self):
        return self.model

    @property
    def ran(self) -> int:
        return self.forward.ran

    def run(self):
        f = self.forward
        if f.tree is not None:
            return tree_forward(self.model, f)
        return self.model(f.ids, f.cache, taps=f.taps)


def on_eager_target(steps: Generator, model) -> Generator:
    """`steps` (a decode loop's coroutine, taking no plain runs) with its target rows run on
    `model`; the rest as it yields them, and what it returns."""
    reply = None
    try:
        while True:
            try:
                item = steps.send(reply)
            except StopIteration as done:
                return done.value
            if isinstance(item, Run):
                raise TypeError("a decode loop on the eager target takes no plain runs (runs=False)")
            if isinstance(item, Forward):
                item = EagerRows(item, model)
            reply = yield item
    finally:
        steps.close()

"""A run of greedy plain steps that a scheduler drives without resuming the decode loop
(`decode.Decoder.steps` with `runs`): the steps of plain decoding, and of a speculative stream
while it drafts nothing."""

from __future__ import annotations

import time

from metrale.runtime.backends import argmax_rows
from metrale.runtime.models.qwen3 import TargetOutput
from metrale.runtime.spec.proposer import Proposer
from metrale.runtime.steps import Forward, Run


def greedy_ids(out: TargetOutput) -> list[int]:
    """Each row's argmax token (taken once for a whole batch where the backend did)."""
    return out.argmax if out.argmax is not None else argmax_rows(out.logits[0])


def greedy_token(out: TargetOutput, grammar=None) -> int:
    """The last row's argmax token; under a request's `grammar` (`spec.grammar.GrammarState`)
    its argmax among the tokens the grammar allows, taken into the grammar's state (`pick`)."""
    return greedy_ids(out)[-1] if grammar is None else grammar.pick(out.logits[0, -1])



class PlainRun(Run):
    """Greedy plain steps of one sequence that a scheduler runs without resuming its decode loop
    at each (`Decoder.steps` with `runs`): the loop yields one `PlainRun`; the scheduler runs
    `forward` in its batched forward, hands the output to `take` (which gives the token, to
    emit at once, and sets `forward` to the next step's) until `forward` is None, then sends
    the run back. Each step is `Decoder._plain_step`'s without following: the same row, the
    argmax emitted, the same metrics. A run ends at EOS, at the sequence's budget (`room`
    tokens), or, for a sequence whose proposer drafts again once its batch lets it (`batch`
    given), as soon as the batch lets steps draft; meanwhile each step's token is noted for
    the catch-up (`missed`, as `_step` notes a busy step's). A run of a suspended stream (adaptive
    k's plain steps until its probe, `Proposer.plain_ahead`) is given the proposer (`follower`):
    each step's row carries its taps and the proposer follows it, as it keeps a verify's kept
    row; the run ends after `limit` steps, or as soon as the sequence no longer runs alone
    (adaptive k sets the count only then). A request's `grammar` (`spec.grammar.GrammarState`)
    picks each step's token among those it allows, as the decode loop's steps do. Its steps go
    into the sequence's result together when it ends, or when the scheduler drops it (`close`:
    the request ended first, at a stop string or its client's cancel): the same tokens, traces
    and metric counts as step by step, and the same total time (each step's time runs from the
    one before it)."""

    __slots__ = ("forward", "tokens", "finished", "_room", "_eos", "_result", "_missed", "_batch",
                 "_t0", "_at", "_taken_at", "_recorded", "_follow", "_limit", "_alone", "_grammar")

    def __init__(self, pending: int, cache, room: int, eos: frozenset[int], result,
                 missed: list[int] | None, batch, t0: float, device,
                 follower: Proposer | None = None, limit: int | None = None, alone=None, grammar=None):
        # (`result`: the sequence's `decode.DecodeResult`; `batch`, `alone`: `decode.Batch`es)
        taps = follower.taps if follower is not None else ()
        self.forward: Forward | None = Forward([pending], cache, taps, device=device)
        self.tokens: list[int] = []
        self.finished = False  # it ended the sequence (EOS, or the budget)
        self._room, self._eos, self._result, self._missed, self._batch = room, eos, result, missed, batch
        self._follow = follower.follow if follower is not None else None
        self._limit = room if limit is None else min(limit, room)  # steps before the run ends
        self._alone = alone  # the batch the run ends in once it no longer holds this sequence alone
        self._grammar = grammar
        self._t0, self._recorded = t0, 0
        self._at = self._taken_at = time.perf_counter()  # the last recorded step's end; the last step's

    def take(self, out: TargetOutput) -> int:
        """The current step's output -> its token."""
        token = greedy_token(out, self._grammar)
        if self._follow is not None:
            self._follow(out, (token,))  # the row stays in the cache: the proposer keeps it
        self._taken_at = time.perf_counter()
        tokens = self.tokens
        tokens.append(token)
        if token in self._eos or len(tokens) >= self._room:
            self.close()
            result = self._result
            if token in self._eos:
                result.finish_reason = "stop"
            result.seconds = self._at - self._t0
            self.forward, self.finished = None, True
        elif ((self._batch is not None and self._batch.speculate) or len(tokens) >= self._limit
              or (self._alone is not None and self._alone.size != 1)):
            self.close()
            self.forward = None
        else:
            if self._missed is not None:
                self._missed.append(token)  # the next step's pending token, noted as `_step` notes it
            self.forward.feed(token)  # the next step's row
        return token

    def close(self) -> None:
        """The steps taken since the last call into the sequence's result, timed to the last
        one's output (a step whose output never came is not a step)."""
        n = len(self.tokens) - self._recorded
        if n:
            result = self._result
            result.record_plain_step(draft_s=0.0, verify_s=self._taken_at - self._at, n=n)
            result.token_ids.extend(self.tokens[self._recorded:])
            self._at, self._recorded = self._taken_at, len(self.tokens)

"""The proposer contract: what makes drafts for the decode loop (`decode.Decoder`).

One proposer serves one sequence. The decode loop calls, in order: `prefill` once with the
prompt's target outputs; then per step `propose_steps` (the drafts, as a coroutine of model
steps, `steps`), and `accept` with the verify's kept rows, or, for a step it took no part in
(a busy batch's plain step), `follow` where the proposer `follows`. Everything the loop may
ask is declared here; a proposer states its capabilities as class attributes rather than by
which methods it happens to define.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator

import torch

from metrale.runtime.steps import ModelStep, run_alone

NO_DRAFTS = torch.empty(0, dtype=torch.long)  # a plain step's drafts (never written to)

DraftSteps = Generator[ModelStep, object, tuple[torch.Tensor, int]]


class Proposer(ABC):
    # target layer ids whose outputs (taps) the proposer needs on the rows it keeps
    taps: tuple[int, ...] = ()
    # the most positions its caches may hold; the decode loop narrows it to each request's
    max_len: int = 0
    # the sequences running with this one, set by the decode loop before each propose (adaptive
    # k is a policy for a stream that runs alone)
    batch_size: int = 1
    # it keeps the rows of plain steps it took no part in (`follow`), so drafting can resume
    # from complete context after a busy spell; without it such steps are not run plain
    follows: bool = False
    # after a propose without drafts: how many of the following steps it keeps plain too
    # (adaptive k's suspension until its probe), which the decode loop runs as one plain run
    plain_ahead: int = 0
    # the request's grammar state (`spec.grammar.GrammarState`), set by the decode loop: a
    # proposer that can draft within it does (the loop drops whatever drafts the grammar
    # refuses in any case); it must leave the state as it found it
    grammar = None
    # ms per verify of k drafts (`cost_model.CostModel`) where the proposer has a cost table:
    # what prices a draft tree's verify in one forward against its path walk, and how its trees
    # are verified (`--dflash-tree-verify`; `tree_verify.TreeVerifyChoice`)
    tree_cost = None
    tree_verify = "auto"

    @classmethod
    def for_spec(cls, face, embed, spec, settings, max_len: int) -> "Proposer":
        """The proposer the speculative flags run (`spec`, a `SpeculativeConfig`; `settings`,
        what the engine resolved of them) over component `face`, embedding with `embed`, its
        caches holding `max_len` positions (`spec.shapes` names the class per step shape)."""
        raise NotImplementedError(f"{cls.__name__} is not made from the speculative flags")

    @abstractmethod
    def prefill(self, prompt_ids: list[int], out, pending: int) -> None:
        """The prompt's target output `out` (every row, with `taps`) and the first pending token."""

    @abstractmethod
    def propose_steps(self, pending: int, max_drafts: int) -> DraftSteps:
        """The step's drafts as a coroutine: yields the model steps it needs (send back their
        outputs), so a scheduler can run many sequences' together; returns (drafts [k] int64 to
        verify, drafts proposed by the drafter). `max_drafts` 0 is a plain step: no drafts, and
        nothing of the drafter runs."""

    def propose(self, pending: int, max_drafts: int) -> tuple[torch.Tensor, int]:
        """`propose_steps` with each model step run at once (one sequence)."""
        return run_alone(self.propose_steps(pending, max_drafts))

    @abstractmethod
    def accept(self, out, rows: int, emitted: torch.Tensor) -> None:
        """The first `rows` rows of `out` (pending + accepted drafts) were kept; `emitted`
        [rows] are the tokens that followed them (accepted drafts, then the new pending)."""

    def host_work(self, seconds: float, rows: int) -> None:
        """A step's host work that the proposer's cost table does not hold (a request's grammar,
        its walk over the drafts and its masks), over the `rows` the step verified: what a
        proposer that counts its drafts by the table adds to it."""

    def follow(self, out, emitted_ids: list[int]) -> None:
        """Rows of plain steps it took no part in (one per token of `emitted_ids`, the token
        that followed each): kept for when drafting resumes. Called only where `follows`."""
        raise NotImplementedError(f"{type(self).__name__} does not follow plain steps")

    @property
    def off(self) -> bool:
        """It has retired for the rest of the stream (adaptive k settled on plain decoding):
        the loop asks it for nothing more, and its rows need no taps."""
        return False

    def skip(self, n: int) -> None:
        """`n` of the `plain_ahead` steps ran (each followed, or noted to run again)."""
        raise AssertionError(f"{type(self).__name__} keeps no step plain in advance (plain_ahead 0)")

    def rerun_rows(self) -> None:
        """The decode loop keeps a busy batch's rows by running them again when drafting resumes
        (`Decoder._catch_up`), not by having the proposer follow each step; said once, before
        the first step, for a proposer whose policy weighs what keeping rows costs."""

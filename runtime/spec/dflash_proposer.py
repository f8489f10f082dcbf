"""DFlash / DFlash2 block drafts as a `decode.Proposer`: γ, the draft ladder and adaptive k.

Each step runs one block propose `[pending, MASK×(γ−1)]` and verifies its first k drafts, where
k comes from, in order of precedence: `--dflash-adaptive-k` (the cost model, capped by the
ladder's rung when there is one), `--dflash-draft-ladder` (the sequence's rung), or γ−1.
k = 0 (adaptive k only) is a plain step: no propose, but the drafter's context is still fed
with the target's taps of the kept row, so a later re-probe drafts from complete context; the
suspension's plain steps up to the probe (`plain_ahead`) run as one plain run of the decode
loop, followed one row at a time, or, on a row-invariant target, run again before the probe. The
feeding is deferred: kept rows' taps wait in `unfed` and enter the drafter's cache in one
`add_context` just before the next propose, so every draft sees the whole context while a
suspended stream pays nothing per plain step (as the tensorrt backend's pending features do).
Adaptive k is a single-stream policy: it sets k only while the stream runs alone
(`batch_size` 1, set by the decode loop); with other sequences in the batch k comes from the
ladder's rung or γ−1, as the flag's help says, and the controller keeps learning from the steps.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import torch

from metrale.runtime.errors import ConfigError
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.spec.adaptive_k import AdaptiveKController, DraftLadder, TreeBudgetChooser
from metrale.runtime.spec.config import ResolvedDFlash
from metrale.runtime.spec.ddtree import block_tree
from metrale.runtime.spec.proposer import NO_DRAFTS, Proposer
from metrale.runtime.steps import DraftForward


class DFlashProposer(Proposer):
    follows = True

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Embedding, settings: ResolvedDFlash,
                 max_len: int):
        self.drafter, self.embed, self.settings, self.max_len = drafter, embed, settings, max_len
        self.taps = tuple(drafter.config.target_layer_ids)
        ladder = DraftLadder(settings.ladder) if settings.ladder else None
        self.ladder = ladder
        self.controller = self.chooser = None
        cost = settings.adaptive_k
        # its chain counts (up to γ − 1): what a chain step costs, and a tree's verify routes
        self.tree_cost = cost if cost is None else cost.up_to(settings.max_drafts)
        self.tree_verify = settings.tree_verify
        if cost is not None:
            # with trees the controller decides whether a step drafts at all (plain steps, with
            # its probes, where no count pays at the trees' measured acceptance), the chooser
            # how many nodes a drafted tree verifies
            self.controller = AdaptiveKController(self.tree_cost, settings.max_drafts,
                                                  settings.reprobe_interval or 16, ladder)
            if settings.tree_budget:
                self.chooser = TreeBudgetChooser(cost, settings.tree_budget)
        self.last_k = 0
        self._chosen = None  # the path probabilities of the tree the step verifies, for the chooser
        self._grammar_s = 0.0  # the step's walk of its block through the request's grammar

    @classmethod
    def for_spec(cls, drafter, embed, spec, settings: ResolvedDFlash, max_len: int) -> "DFlashProposer":
        """The proposer `--dflash` runs (`components`' factory) with its resolved settings."""
        return cls(drafter, embed, settings, max_len)

    def prefill(self, prompt_ids: list[int], out, pending: int) -> None:
        # (the target output, its rows kept: None for all), oldest first, the prompt's first;
        # the taps are read when fed, so a plain step of a busy batch costs no tensor op (`kept`
        # holds the taps only), and the drafter's cache is made at the first feed: a request
        # that never drafts (a busy batch's) costs the drafter nothing
        self.cache = None
        # (its own rows copied: a batched forward's output holds every sequence's, and this
        # one may wait for a request's whole life)
        self.unfed: list[tuple[object, int | None]] = [(SimpleNamespace(taps=out.taps.clone()), None)]

    def _feed(self) -> None:
        if self.cache is None:
            w = self.embed.weight
            self.cache = self.drafter.new_cache(1, self.max_len, w.dtype, w.device)
        if self.unfed:
            kept = [out.taps[:, :rows] for out, rows in self.unfed]
            self.drafter.add_context(kept[0] if len(kept) == 1 else torch.cat(kept, dim=1), self.cache)
            self.unfed = []

    @property
    def off(self) -> bool:
        """Adaptive k settled on plain decoding for the rest of the stream: the decode loop
        stops asking for drafts and taps, and the unfed context is dropped."""
        if self.controller is not None and self.controller.settled:
            self.unfed = []
            return True
        return False

    def draft_count(self) -> int:
        self.plain_ahead = 0
        if self.controller is not None and self.batch_size == 1:
            k = self.controller.next_k()
            if k == 0:
                self.plain_ahead = self.controller.plain_ahead()
            return k
        if self.ladder is not None:
            return self.ladder.current
        return self.settings.max_drafts

    def propose_steps(self, pending: int, max_drafts: int):
        """The propose as a coroutine: it yields its `DraftForward` (send back the `Proposal`),
        so a scheduler can propose every drafting sequence's block in one drafter call;
        returns (drafts [k], drafts proposed)."""
        k = min(self.draft_count(), max_drafts) if max_drafts > 0 else 0
        if max_drafts <= 0:
            self.plain_ahead = 0
        self.last_k, self._grammar_s = k, 0.0
        if k == 0:
            return NO_DRAFTS, 0
        self._feed()  # the drafter's cache now ends at the anchor's position
        anchor = torch.tensor([pending], device=self.embed.weight.device)
        budget = min(self.settings.tree_budget, max_drafts)
        tree = budget > 0 and self.grammar is None  # (under a grammar: the chain, each draft within it)
        proposal = yield DraftForward(self.drafter, anchor, self.embed, self.cache, self.settings.gamma,
                                      budget if tree else 0)
        if tree:
            if proposal.top is None and (proposal.vocab_start
                                         or proposal.logits.shape[-1] != self.embed.weight.shape[0]):
                # a vocabulary slice without the global candidates a sharded drafter gathers with
                # its propose (the serve refuses faces without them: `block_distributions`)
                raise ConfigError(f"--dflash-tree-budget {budget}: a draft tree over a sharded "
                                  f"{type(self.drafter).__name__} needs its gathered candidates' "
                                  "log-probabilities, which it did not give; rebuild the engine, or "
                                  "run --backend torch or --draft-tp-size 1")
            drafts = block_tree(self.drafter, pending, proposal, budget)
            if self.chooser is not None and self.batch_size == 1:  # adaptive k: a stream alone
                probs = [math.exp(p) for p in drafts.log_probs[1:]]
                b = self.chooser.choose(probs)
                drafts, self._chosen = drafts.first(b), probs[:b]
            self.last_k = max(drafts.depths)  # the positions its paths reach (what it may accept)
            return drafts, self.settings.max_drafts
        logits = proposal.logits
        drafts = proposal.tokens[0, :k]
        if self.grammar is not None and logits is not None and proposal.vocab_start == 0 \
                and logits.shape[-1] == self.embed.weight.shape[0]:  # the whole vocabulary's logits
            t0 = time.perf_counter()
            drafts = self.grammar.redraft(logits[0, :k], drafts.tolist())
            self._grammar_s = time.perf_counter() - t0  # (its step's host work: `host_work`)
            return drafts, self.settings.max_drafts
        return drafts.cpu(), self.settings.max_drafts

    def host_work(self, seconds: float, rows: int) -> None:
        if self.controller is not None and rows:
            self.controller.observe_host(1e3 * (seconds + self._grammar_s) / rows)
        self._grammar_s = 0.0

    def rerun_rows(self) -> None:
        """The decode loop keeps the rows of plain steps by running them again when drafting
        resumes (`Decoder._catch_up`), not by having this proposer follow each: adaptive k
        counts what that costs against its probes."""
        if self.controller is not None:
            self.controller.rerun_rows()

    def skip(self, n: int) -> None:
        """`n` of the `plain_ahead` steps ran (each followed, or noted to run again)."""
        self.controller.skip(n)

    def follow(self, out, emitted_ids: list[int]) -> None:
        """Plain steps of a busy batch (one, or the rows `Decoder._catch_up` ran again, each
        followed by its token in `emitted_ids`): their taps wait in `unfed`; the ladder and the
        acceptance estimates see nothing (a plain step measures nothing)."""
        self.unfed.append((out.kept("taps"), len(emitted_ids)))

    def accept(self, out, rows: int, emitted: torch.Tensor) -> None:
        self.unfed.append((out.kept("taps"), rows))  # read when fed: a suspended step pays nothing
        if self._chosen is not None:  # the chosen tree's outcome
            self.chooser.observe(self._chosen, rows - 1)
            self._chosen = None
        if self.controller is not None:
            self.controller.observe(self.last_k, rows - 1)
        elif self.ladder is not None:
            self.ladder.observe(self.last_k, rows - 1)

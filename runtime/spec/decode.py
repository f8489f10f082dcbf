"""The decode loop: plain decoding and speculative steps on the torch backend (one sequence).

Vocabulary (one per concept, shared with `metrics`):
- *pending* token: the last emitted token, not yet fed to the target. The target cache holds
  every position before it, so the pending token's position is `target_cache.length`.
- a *step* feeds `[pending, d_1..d_k]` (k drafts; k = 0 is a plain step) and emits the
  accepted drafts plus one token from the target (recovered or bonus), so 1..k+1 tokens.
- *chunkwise* verify computes the k+1 target rows in one forward; *exact* verify computes them
  one row per forward, exactly as plain decoding does, so greedy output is byte-identical to
  plain decoding (a one-forward verify sums in another order and may flip a near-tie argmax).

Drafters plug in through `proposer.Proposer` (`mtp_proposer`, `dflash_proposer`): `prefill`
sees the prompt's target outputs, `propose_steps(pending, k_max)` returns drafts, `accept` sees
the target outputs of the accepted rows so the drafter's own state follows the target's.

The loop itself is a coroutine (`Decoder.steps`) that yields the model steps it needs
(`steps`: target rows as a `Forward`, an MTP chain's head entries as a `HeadForward`, a DFlash
block as a `DraftForward`) and is sent their outputs: `Decoder.stream` drives it with each step
run at once (`steps.drive`); the server's scheduler drives one per running sequence and runs
their steps in one batched forward per model (`run_forwards`). A sequence's own arithmetic is
the same either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import torch

from metrale.runtime.backends import TargetSteps, run_forwards
from metrale.runtime.models.qwen3 import TargetOutput
from metrale.runtime.spec.ddtree import Tree, choose_child, walk
from metrale.runtime.spec.metrics import SpecMetrics
from metrale.runtime.spec.plain_run import PlainRun, greedy_ids, greedy_token
from metrale.runtime.spec.proposer import NO_DRAFTS, Proposer
from metrale.runtime.spec.sampling import SamplingParams, generator_for, probs_from_logits, sample
from metrale.runtime.spec.tree_verify import TreeVerifyChoice, best_chain
from metrale.runtime.spec.verify import accepted_prefix, verify_sampling
from metrale.runtime.steps import Forward, Step, drive

if TYPE_CHECKING:
    from metrale.runtime.spec.grammar import GrammarState


def joined_outputs(outs: list) -> TargetOutput:
    """The outputs of forwards run one after another, as one forward's (rows in order)."""
    if len(outs) == 1:
        return outs[0]
    cat = lambda xs: None if xs[0] is None else torch.cat(xs, dim=1)  # noqa: E731
    return TargetOutput(logits=cat([o.logits for o in outs]), last_hidden=cat([o.last_hidden for o in outs]),
                        taps=cat([o.taps for o in outs]))


def output_rows(out, rows: torch.Tensor) -> TargetOutput:
    """Rows `rows` [n] of a forward's output (a verify's kept rows)."""
    pick = lambda x: None if x is None else x.index_select(1, rows)  # noqa: E731
    return TargetOutput(logits=pick(out.logits), last_hidden=pick(out.last_hidden), taps=pick(out.taps))


@dataclass
class Batch:
    """What a scheduler tells each of its sequences before a step: how many run (`size`) and
    whether steps may draft (`speculate`; False makes them plain, see `Decoder.steps`)."""

    size: int = 1
    speculate: bool = True


ALONE = Batch()


@dataclass(frozen=True)
class StepTrace:
    drafted: int
    accepted: int
    emitted: int


# The most missed rows one catch-up forward runs again (`Decoder._catch_up`), and the most rows
# an MTP head takes in one feed: a sequence that resumes drafting after a busy spell may have
# missed hundreds, and each forward is an iteration of the whole batch; forwards of 64 rows keep
# one sequence's catch-up from holding the batch long, at no cost in total time.
CATCH_UP_ROWS = 64

PLAIN_STEP = StepTrace(drafted=0, accepted=0, emitted=1)  # every step without drafts: one shared record


@dataclass
class DecodeResult:
    token_ids: list[int]
    seconds: float
    prefill_s: float
    finish_reason: str  # "stop" (EOS) or "length"
    steps: list[StepTrace] = field(default_factory=list)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    def record_plain_step(self, draft_s: float, verify_s: float, n: int = 1) -> None:
        """`n` steps without drafts (one row each, its token emitted), taking `draft_s` and
        `verify_s` together: their metrics and their traces."""
        self.metrics.record_plain_step(draft_s=draft_s, verify_s=verify_s, n=n)
        self.steps.extend((PLAIN_STEP,) * n)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.seconds - self.prefill_s
        return len(self.token_ids) / decode_s if decode_s > 0 else float("inf")


class Decoder:
    """Decodes one sequence at a time with a target and an optional proposer."""

    def __init__(self, target: TargetSteps, eos_ids: frozenset[int], proposer: Proposer | None = None,
                 exact_verify: bool = False, max_context: int | None = None, rows_invariant: bool = False,
                 grammar: "GrammarState | None" = None, tree_attention: bool = True):
        self.target, self.eos_ids, self.proposer = target, eos_ids, proposer
        # the request's structured output (`spec.grammar`): every row it emits from is masked
        # at its grammar state, drafts the grammar refuses are dropped before the verify, and
        # its steps are never plain runs (a run takes each row's unmasked argmax)
        self.grammar = grammar
        if proposer is not None:
            proposer.grammar = grammar
        self.exact_verify = exact_verify
        self._proposer_len = proposer.max_len if proposer is not None else 0
        self._follows = proposer is not None and proposer.follows  # looked up once: steps are hot
        # A target whose rows' bits do not depend on how many rows a forward runs
        # (`LoadedEngine.rows_invariant`) lets a busy batch's plain steps keep nothing: their
        # tokens are noted (`_missed`) and, when drafting resumes, one forward runs those rows
        # again at their positions for the proposer (the same K/V written over the same K/V).
        # Elsewhere the proposer follows each step (keeps its row's outputs).
        self._catches_up = self._follows and rows_invariant
        if self._catches_up:
            proposer.rerun_rows()
        self.max_context = max_context or target.config.max_position_embeddings
        self.device = target.model.embed_tokens.weight.device  # looked up once: steps are hot
        # where the target can run a draft tree's rows in one forward (`LoadedEngine.tree_attention`)
        # each tree goes so or along its paths (`tree_verify`); elsewhere along its paths (an exact
        # verify runs a tree's path row by row: no route to choose)
        self._tree_verify = None
        if tree_attention and proposer is not None and not exact_verify:
            self._tree_verify = TreeVerifyChoice(proposer.tree_cost, self.device.type == "cuda",
                                                 proposer.tree_verify)
        self._runs, self._started = False, 0.0  # a scheduler takes `PlainRun`s; the sequence's start
        self._grammar_s = 0.0  # a step's host work in the request's grammar
        self.last_result: DecodeResult | None = None

    def _taps(self) -> tuple[int, ...]:
        return self.proposer.taps if self._drafting() else ()

    def _drafting(self) -> bool:
        """A proposer that has not retired (`off`: adaptive k settled on plain decoding for the
        rest of the stream, see `AdaptiveKController.settled`)."""
        return self.proposer is not None and not self.proposer.off

    def _verify_rows(self, tokens: list[int], cache, greedy: bool, draft_ids: list[int]):
        """Target outputs for rows [pending, d_1..d_k] (`tokens`) and, when greedy, each row's
        argmax token (a generator: yields the `Forward`s it needs, returns the pair); under a
        grammar, each row's within its state's tokens up to the first that rejects the next
        draft (`GrammarState.greedy`), the state then holding them.

        Exact verify runs one row per forward and, when greedy, stops after the first row whose
        argmax rejects the next draft (rows past it are never used)."""
        taps, device, grammar = self._taps(), self.device, self.grammar
        if not self.exact_verify:
            out = yield Forward(tokens, cache, taps, device=device)
            if not greedy or grammar is None:
                return out, (greedy_ids(out) if greedy else None)
            t0 = time.perf_counter()
            ids = grammar.greedy(out.logits[0], draft_ids)
            self._grammar_s += time.perf_counter() - t0
            return out, ids
        outs, ids = [], []
        for i in range(len(tokens)):
            o = yield Forward(tokens[i:i + 1], cache, taps, device=device)
            outs.append(o)
            if greedy:  # (under a grammar, as `GrammarState.greedy` picks them)
                t0 = time.perf_counter()
                ids.append(greedy_token(o, grammar))
                self._grammar_s += time.perf_counter() - t0
                if i < len(draft_ids) and ids[-1] != draft_ids[i] or grammar is not None and grammar.done:
                    break
        return joined_outputs(outs), (ids if greedy else None)

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids; stops at EOS (yielded) or after params.max_tokens. Runs
        `steps` with each forward on the target at once (one sequence), its greedy plain steps
        as `PlainRun`s, as a scheduler runs them (the loop not resumed at each)."""
        target = self.target
        yield from drive(self.steps(prompt_ids, params, runs=True), lambda need: run_forwards(target, need))

    def steps(self, prompt_ids: list[int], params: SamplingParams, batch: Batch = ALONE,
              runs: bool = False) -> Generator[Step, object, None]:
        """The decode loop of one sequence as a coroutine, so a scheduler can run the target
        rows of many sequences in one forward: it yields a `Forward` whenever it needs target
        rows (send back their `TargetOutput`), a `HeadForward` for each link of an MTP draft
        chain and a `DraftForward` for a DFlash block (send back the head's output or the
        `Proposal`: the chains or blocks of many sequences then run in one call per link or
        block) and, after each step, the token ids the step emitted (send back None); it
        returns after EOS (emitted) or params.max_tokens.

        `batch` is read before each step: with `speculate` False the step is plain (the
        proposer still follows the kept rows, each step's or, on a target whose rows do not
        depend on the forward's other rows, all of them at once when drafting resumes
        (`_catch_up`), so drafting resumes from complete context), and
        its `size` reaches the proposer (`batch_size`): adaptive k is a policy for a stream
        that runs alone. A seeded sampled request ignores `batch` (it drafts as if alone), so
        its samples are the same under any load. With `runs` (a scheduler that takes them), a
        greedy plain step that does not follow yields a `PlainRun` instead of its `Forward`:
        the steps after it run without resuming this loop until the run ends (send the run
        back). Resume it under `torch.inference_mode` (as `stream` and the server's scheduler
        thread do: entered once, not at every resume)."""
        t0 = time.perf_counter()
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # compiled steps index without checks
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        device = self.device
        budget = min(params.max_tokens, self.max_context - len(prompt_ids))
        if budget < 1:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in the "
                             f"context of {self.max_context} tokens")
        cache = self.target.new_cache(1, len(prompt_ids) + budget)  # its last step ends before that
        gen = generator_for(params, device)
        result = DecodeResult([], 0.0, 0.0, "length")
        self.last_result = result
        # the prompt's ids as a list: a prompt the prefix cache holds whole never becomes a tensor
        prompt = Forward(list(prompt_ids), cache, self._taps(), last_logits=True, device=device)
        out = yield prompt
        grammar = self.grammar
        if params.greedy:
            pending = greedy_token(out, grammar)
        elif grammar is None:
            pending = int(sample(out.logits[0, -1], params, gen))
        else:  # drawn again without it where the matcher refuses it
            row = grammar.masked(out.logits[0, -1])
            pending = grammar.take_drawn([int(sample(row, params, gen))], row, lambda r: sample(r, params, gen))[0]
        if self.proposer is not None:
            # the drafter's caches hold this request's positions and a chain or block past them
            self.proposer.max_len = min(self._proposer_len, cache.max_len + 64)
            self.proposer.prefill(prompt.tokens, out, pending)
            self._missed: list[int] = []  # this sequence's busy steps' tokens, not yet followed
        result.prefill_s = time.perf_counter() - t0
        self._runs, self._started = runs, t0
        emitted_total = 0
        next_tokens = [pending]
        while True:
            emitted = []
            for tok in next_tokens:
                result.token_ids.append(tok)
                emitted.append(tok)
                emitted_total += 1
                if tok in self.eos_ids or emitted_total >= budget:
                    if tok in self.eos_ids:
                        result.finish_reason = "stop"
                    result.seconds = time.perf_counter() - t0
                    yield emitted
                    return
            yield emitted
            step = yield from self._step(next_tokens[-1], cache, params, gen, budget - emitted_total,
                                         result, batch)
            while type(step) is PlainRun:  # its tokens went out as they came, and are in `result`
                if step.finished:
                    return
                emitted_total += len(step.tokens)
                step = yield from self._step(step.tokens[-1], cache, params, gen, budget - emitted_total,
                                             result, batch)
            next_tokens = step

    def _step(self, pending: int, cache, params, gen, room: int, result: DecodeResult, batch: Batch):
        t0 = time.perf_counter()
        drafts, proposed = NO_DRAFTS, 0
        drafting = resumes = self._drafting()
        if params.seed is not None and not params.greedy:
            batch = ALONE  # its draws must not depend on the load: it drafts as if alone
        following = drafting and not batch.speculate and self._follows
        if following:  # a busy batch: a plain step; the proposer only keeps the kept row
            drafting = False
            if self._catches_up:  # or keeps nothing: the row runs again when drafting resumes
                self._missed.append(pending)
                following = False
        elif drafting and self._missed:  # drafting resumes: the proposer first sees what it missed
            yield from self._catch_up(pending, cache)
        if drafting and room > 1:
            proposer = self.proposer
            proposer.batch_size = batch.size
            max_drafts = params.draft_cap(room) if batch.speculate else 0
            drafts, proposed = yield from proposer.propose_steps(pending, max_drafts)
            if type(drafts) is Tree:  # a draft tree (`--dflash-tree-budget`), of at most room − 1 nodes
                return (yield from self._tree_step(pending, drafts, cache, params, gen, result, t0))
            if drafts.numel() > room - 1:
                drafts = drafts[: room - 1]
            if not drafts.numel() and params.greedy and self._runs and self._follows:
                # a suspended stream: this step and the plain ones after it as one run, each
                # row followed (as a verify's kept row is) or noted for the catch-up, the next
                # choice made after it
                if proposer.off:  # settled: plain for good, nothing kept
                    run = self._run(pending, cache, room, result, None, None)
                    yield run
                    return run
                ahead = proposer.plain_ahead
                if self._catches_up:  # its rows run again before the probe
                    self._missed.append(pending)
                run = self._run(pending, cache, room, result, self._missed if self._catches_up else None,
                                None, follower=None if self._catches_up else proposer,
                                limit=1 + ahead, alone=batch if batch.size == 1 else None)
                yield run
                if len(run.tokens) > 1:  # its first step was this one, counted by the propose
                    proposer.skip(len(run.tokens) - 1)
                return run
        elif params.greedy and not drafting:  # the pending token's row, its argmax emitted
            if self._runs and not following:  # the scheduler runs these steps until drafting resumes
                run = self._run(pending, cache, room, result, self._missed if resumes else None,
                                batch if resumes else None)
                yield run
                return run
            return (yield from self._plain_step(pending, cache, t0, result, following))
        t1 = time.perf_counter()
        device = self.device
        k = drafts.numel()
        draft_ids = drafts.tolist() if k else []
        grammar = self.grammar
        self._grammar_s = 0.0  # the step's host work in the grammar (`Proposer.host_work`)
        if grammar is not None and k:  # drafts from the first one the grammar refuses: dropped
            k = grammar.valid_drafts(draft_ids)
            draft_ids, drafts = draft_ids[:k], drafts[:k]
            self._grammar_s = time.perf_counter() - t1
        base = cache.length
        out, target_ids = yield from self._verify_rows([pending, *draft_ids], cache, params.greedy, draft_ids)
        if params.greedy:  # the target's argmax per row (within the grammar's tokens); drafts kept while they match it
            accepted = accepted_prefix(draft_ids, target_ids)
            emitted_ids = target_ids[: accepted + 1]
            emitted = torch.tensor(emitted_ids, device=device) if drafting else None
            verify_rows = len(target_ids) if self.exact_verify else k + 1  # (exact greedy verify: those it ran)
        else:
            rows = out.logits[0]  # [k+1, V]
            g0 = time.perf_counter()
            if grammar is not None:
                rows = grammar.masked_rows(rows, draft_ids)
            g1 = time.perf_counter()
            accepted, emitted = verify_sampling(drafts.to(device), probs_from_logits(rows, params), gen)
            emitted_ids = emitted.tolist()
            if grammar is not None:  # a last token the matcher refuses: drawn again from its row
                g2 = time.perf_counter()
                drawn = grammar.take_drawn(emitted_ids, rows[accepted], lambda r: sample(r, params, gen),
                                           draft_ids[accepted] if accepted < k else None)
                if drawn != emitted_ids:
                    emitted_ids, emitted = drawn, torch.tensor(drawn, device=device)
                self._grammar_s += (g1 - g0) + (time.perf_counter() - g2)
            verify_rows = rows.shape[0]
        cache.length = base + accepted + 1  # pending + accepted drafts stay; the rest is stale
        t2 = time.perf_counter()
        if drafting:  # the drafter's own bookkeeping is drafter time
            self.proposer.accept(out, accepted + 1, emitted)
            if grammar is not None:
                self.proposer.host_work(self._grammar_s, verify_rows)
        elif following:
            self.proposer.follow(out, emitted_ids)
        t3 = time.perf_counter()
        result.metrics.record_step(proposed=max(proposed, k), verified=k, accepted=accepted,
                                   emitted=accepted + 1, verify_rows=verify_rows,
                                   draft_s=(t1 - t0) + (t3 - t2), verify_s=t2 - t1)
        result.steps.append(StepTrace(drafted=k, accepted=accepted, emitted=accepted + 1))
        return emitted_ids

    def _tree_step(self, pending: int, tree: Tree, cache, params, gen, result: DecodeResult, t0: float):
        """A step that verifies a draft tree (`spec.ddtree`; its root is `pending`): from the
        root, each node's row decides which child, if any, continues the path (greedy: the
        child whose token is the row's argmax; sampled: `ddtree.choose_child`, lossless), and
        the first row that continues none gives the recovered or bonus token. Chunkwise verify
        runs every node's row in one forward (a `Forward` with its `tree`) and moves the
        accepted path's K/V into place (the cache's `keep_path`), or, on a target without tree
        attention, runs one path of the tree as a chain: from the root along each node's best
        child, and again, through the child the walk took, whenever the walk leaves the path
        (the last chain's rows then hold the accepted path, its K/V in place). Exact verify
        runs the path's rows one per forward, as plain decoding does. The proposer keeps the
        root's and the path's rows."""
        t1 = time.perf_counter()
        taps, device = self._taps(), self.device
        greedy = params.greedy
        kids = tree.children()
        argmax = (None, [])  # the last forward's output and its rows' argmax, taken once for all

        def choose(out, row: int, children: dict[int, int]) -> tuple[int | None, int]:
            """Row `row` of `out` at a node with `children` (by token) -> (the child that
            continues the path or None, the row's token)."""
            nonlocal argmax
            if greedy:
                if argmax[0] is not out:
                    argmax = (out, greedy_ids(out))
                token = argmax[1][row]
                return children.get(token), token
            j, token = choose_child(probs_from_logits(out.logits[0, row], params), list(children), gen)
            return (children[token] if j >= 0 else None), token

        path, node, base = [], 0, cache.length
        if self.exact_verify:
            outs = []
            while True:
                out = yield Forward([tree.tokens[node]], cache, taps, device=device)
                outs.append(out)
                child, token = choose(out, 0, kids[node])
                if child is None:
                    break
                path.append(child)
                node = child
            kept, verify_rows = joined_outputs(outs), len(outs)
        elif self._tree_verify is None or not self._tree_verify.one_forward(tree, kids):
            verify_rows, nodes = 0, []
            while True:
                if node not in nodes:  # the walk left the chain run last: the chain through `node`
                    nodes = best_chain(tree, kids, (0, *path))
                    cache.length = base
                    out = yield Forward([tree.tokens[n] for n in nodes], cache, taps, device=device)
                    verify_rows += len(nodes)
                child, token = choose(out, len(path), kids[node])
                if child is None:
                    break
                path.append(child)
                node = child
            cache.length = base + 1 + len(path)
            kept = out  # (its first rows are the root's and the path's)
        else:
            out = yield Forward(list(tree.tokens), cache, taps, device=device, tree=tree)
            path, token = walk(tree, lambda node, children: choose(out, node, children), kids)
            cache.keep_path(base, path)
            kept, verify_rows = output_rows(out, torch.tensor([0, *path], device=device)), len(tree.tokens)
        if self._tree_verify is not None:
            self._tree_verify.observe(tree, path, kids)
        accepted = len(path)
        emitted_ids = [tree.tokens[n] for n in path] + [token]
        t2 = time.perf_counter()
        self.proposer.accept(kept, accepted + 1, torch.tensor(emitted_ids, device=device))
        t3 = time.perf_counter()
        result.metrics.record_step(proposed=tree.size, verified=tree.size, accepted=accepted,
                                   emitted=accepted + 1, verify_rows=verify_rows,
                                   draft_s=(t1 - t0) + (t3 - t2), verify_s=t2 - t1)
        result.steps.append(StepTrace(drafted=tree.size, accepted=accepted, emitted=accepted + 1))
        return emitted_ids

    def _catch_up(self, pending: int, cache):
        """The missed rows (`_missed`: the tokens of the plain steps since the proposer last
        saw a row, at the positions just before `pending`'s) run again, with the proposer's
        taps, in forwards of at most `CATCH_UP_ROWS` rows, and the proposer follows them as if
        it had followed each step: the target's rows have the bits they had then, so the drafts
        are the ones following gives."""
        rows, self._missed = self._missed, []
        cache.length -= len(rows)  # the forwards leave it where it was
        following = rows[1:] + [pending]
        for i in range(0, len(rows), CATCH_UP_ROWS):
            out = yield Forward(rows[i:i + CATCH_UP_ROWS], cache, self.proposer.taps, last_logits=True,
                                device=self.device)
            self.proposer.follow(out, following[i:i + CATCH_UP_ROWS])

    def _run(self, pending: int, cache, room: int, result: DecodeResult, missed, batch, **kw) -> PlainRun:
        """The sequence's next plain steps as one `PlainRun` (its arguments)."""
        return PlainRun(pending, cache, room, self.eos_ids, result, missed, batch, self._started,
                        self.device, grammar=self.grammar, **kw)

    def _plain_step(self, pending: int, cache, t0: float, result: DecodeResult, following: bool):
        """A greedy step without drafts: `_step`'s outcome with k = 0 (one row, the argmax
        emitted, the same metrics), without a verify's bookkeeping (the step a busy batch's
        sequences all take). Its row carries the proposer's taps only when the proposer follows
        (`_taps`: a proposer that drafts or follows is one that has not retired)."""
        t1 = time.perf_counter()
        base = cache.length
        out = yield Forward([pending], cache, self.proposer.taps if following else (), device=self.device)
        emitted_ids = [greedy_token(out, self.grammar)]
        cache.length = base + 1
        t2 = t3 = time.perf_counter()
        if following:
            self.proposer.follow(out, emitted_ids)
            t3 = time.perf_counter()
        result.record_plain_step(draft_s=(t1 - t0) + (t3 - t2), verify_s=t2 - t1)
        return emitted_ids

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> DecodeResult:
        for _ in self.stream(prompt_ids, params):
            pass
        assert self.last_result is not None
        return self.last_result

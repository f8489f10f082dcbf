"""Decoding by whole-iteration graphs: `IterationLoop` replays one `iteration` per step and
reads its tokens one step late; `IterationDecoder` gives it the decode loop's face, so
`generate`, `bench` and the CLI run it where the engine's target runs as graphs.

The loop: the prompt runs eagerly (`prefill`), then each iteration is one replay followed by a
copy of the device ring and count (and what a count policy reads: a tree's node probabilities)
into a host buffer (pinned on a GPU, two alternating) and an event. Iteration i's copy is
waited on only after i+1 is enqueued, so the host's reading and its checks (EOS, the budget)
overlap the device's next iteration; the iteration enqueued past the end is discarded (its rows
lie past the request's positions). One host wait per iteration, and no read inside one.

Which requests (`loop_for`): plain decoding, MTP chains (with the confidence stop),
DFlash / DFlash2, chunkwise or exact, greedy or sampled (temperature, top-p and the rejection
sampling of `verify`, on the device: each variant is captured greedy and sampled), and DFlash
draft trees, chunkwise or exact (`tree_iteration`, `tree_graphs`). A DFlash draft ladder or
adaptive k (over chain counts, or trees' node budgets) picks, before each iteration, one of the
graphs captured per count (`count_policy`).

Serving (`IterationLanes`): many requests in the lanes of one iteration, a graph per batch
bucket, the scheduler gathering each running request's `LaneStep` into one replay.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from metrale.runtime.spec.config import ResolvedDFlash, SpecMode, SpeculativeConfig
from metrale.runtime.spec.count_policy import CountPolicy, count_policy, drafts_of
from metrale.runtime.spec.decode import DecodeResult, Decoder, StepTrace
from metrale.runtime.spec.iteration import DFlashIteration, MTPIteration, PlainIteration, room
from metrale.runtime.spec.sampling import NO_CAP, SamplingParams
from metrale.runtime.spec.tree_iteration import DFlashTreeIteration, tree_room
from metrale.runtime.steps import BatchedFace, ModelStep

log = logging.getLogger(__name__)


@dataclass
class IterationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    emitted: list[int] = field(default_factory=list)  # tokens each iteration emitted
    verified: list[int] = field(default_factory=list)  # drafts each iteration verified (counted, capped)
    rows: list[int] = field(default_factory=list)  # target rows each iteration ran
    seconds: float = 0.0
    prefill_s: float = 0.0


def _checked(policy: CountPolicy | None, iteration) -> CountPolicy | None:
    """`policy`, refused where it reads what `iteration` does not leave (`stats`)."""
    if policy is not None and policy.stats and not iteration.stats:
        raise ValueError(f"{type(policy).__name__} reads each tree's node statistics: the iteration "
                         "must be made with stats=True")
    return policy


class IterationLoop:
    """Runs an iteration (`iteration.PlainIteration`, `DFlashIteration`, `MTPIteration`) captured
    once by `graphs` (`cuda_graphs.CudaGraphs` on a GPU; `cuda_graphs.EagerGraphs` stands in on
    a CPU); with a `policy` (`CountPolicy`), each of the iteration's variants is captured and
    the policy picks one per iteration, from its start at each request (`CountPolicy.reset`).
    `last_result` is the last request's `IterationResult`."""

    def __init__(self, iteration, graphs, policy: CountPolicy | None = None):
        self.iteration, self.graphs, self.policy = iteration, graphs, _checked(policy, iteration)
        state = iteration.state
        self.captured = {}
        self.unsampled = None  # why the sampled variants could not be captured, if they could not
        with torch.inference_mode():
            for key, fn in iteration.variants().items():
                sampled = key[2]  # (B, count, sampled, slot bucket)
                if sampled and self.unsampled is not None:
                    continue
                try:
                    graphs.warmup(fn)
                    self.captured[key] = graphs.capture(fn, generators=(iteration.generator,))[0]
                except Exception as exc:  # noqa: BLE001 - greedy ones raise; sampled ones are left out
                    if not sampled:
                        raise
                    self.unsampled = f"{type(exc).__name__}: {exc}"
                    log.warning("the sampled iterations could not be captured (%s): sampled "
                                "requests run the decode loop", self.unsampled)
        self.captured = {k: g for k, g in self.captured.items() if not (k[2] and self.unsampled)}
        cuda = state.tokens.device.type == "cuda"
        # per host buffer: the ring, the count, and what the iteration leaves for the policy
        read = (state.tokens, state.count) + (iteration.stats if policy is not None else ())
        self._host = [tuple(torch.empty_like(t, device="cpu", pin_memory=cuda) for t in read) for _ in range(2)]
        self._cuda = cuda
        self.replays = 0
        self.last_result: IterationResult | None = None

    def _enqueue(self, slot: int, key):
        """One replay of variant `key` (a count, sampled or not, a slot bucket) and its copy into
        host buffer `slot` -> an event to wait on (None on a CPU, where the copy is done)."""
        self.graphs.replay(self.captured[(1, *key)])
        self.replays += 1
        state, it = self.iteration.state, self.iteration
        for host, t in zip(self._host[slot], (state.tokens, state.count) + it.stats):
            host.copy_(t, non_blocking=self._cuda)
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def stream(self, prompt_ids: list[int], max_tokens: int, eos: frozenset[int] = frozenset(),
               params: SamplingParams | None = None) -> Iterator[int]:
        """Yield the request's tokens as their iterations are read; stops at EOS (yielded) or
        after `max_tokens`. Greedy unless `params` samples (its temperature, top_p and seed; the
        first token from the prompt is the prompt's argmax or draw). Resume it under
        `torch.inference_mode`."""
        t0 = time.perf_counter()
        it = self.iteration
        sampled = params is not None and not params.greedy
        # a request that caps its drafts: each iteration accepts at most that many (the state's
        # `cap`), and an iteration that could accept more than the cap does not teach the policy
        cap = NO_CAP if params is None else params.lane_cap
        slots = it.check_room(len(prompt_ids), max_tokens)  # the request's slot bucket
        if sampled:
            it.seed(params)
        if self.policy is not None:  # each request from the policy's start
            self.policy.reset()
        it.prefill(0, prompt_ids, params, slots)  # the loop's one lane
        first = int(it.state.pending[0])
        result = self.last_result = IterationResult([first], "length")
        result.prefill_s = time.perf_counter() - t0
        yield first
        if first in eos or max_tokens <= 1:
            result.finish_reason = "stop" if first in eos else "length"
            result.seconds = time.perf_counter() - t0
            return
        ring = it.state.tokens.shape[1]
        choose = self.policy.next if self.policy is not None else (lambda: it.k)
        read, slot = 0, 0  # tokens of the ring read so far; the host buffer of the oldest iteration
        key = choose()
        waiting = self._enqueue(slot, (key, sampled, slots))
        try:
            while True:
                next_key = choose()
                following = self._enqueue(1 - slot, (next_key, sampled, slots))  # i+1 enqueued before i is read
                if waiting is not None:
                    waiting.synchronize()
                tokens, count, *stats = self._host[slot]
                tokens, n = tokens[0].tolist(), int(count[0])
                result.emitted.append(n - read)
                result.verified.append(min(drafts_of(key), cap))
                result.rows.append(it.rows(key))
                if self.policy is not None and it.accepts(key) <= cap:  # (else it measured its cap)
                    self.policy.observe(key, n - read, [t[0].tolist() for t in stats])
                for j in range(read, n):
                    tok = tokens[j % ring]
                    result.token_ids.append(tok)
                    yield tok
                    if tok in eos or len(result.token_ids) >= max_tokens:
                        result.finish_reason = "stop" if tok in eos else "length"
                        result.seconds = time.perf_counter() - t0
                        return
                read, waiting, slot, key = n, following, 1 - slot, next_key
        finally:
            if self._cuda:  # the discarded iteration's writes finish before anything reuses them
                torch.cuda.current_stream().synchronize()

    def generate(self, prompt_ids: list[int], max_tokens: int, eos: frozenset[int] = frozenset(),
                 params: SamplingParams | None = None) -> IterationResult:
        with torch.inference_mode():
            for _ in self.stream(prompt_ids, max_tokens, eos, params):
                pass
        assert self.last_result is not None
        return self.last_result


def iteration_for(engine, spec: SpeculativeConfig, dflash: ResolvedDFlash | None, lanes: int = 1,
                  counts: tuple[int, ...] | None = None, settled: bool = False, plain: bool = False):
    """`spec`'s mode on `engine`'s models as an iteration of `lanes` lanes, its caches holding
    the target's context and the mode's `room` past it; a DFlash iteration of `counts`
    (default: the mode's fixed count); `plain`: with a plain variant (k = 0) that keeps its
    row for the drafter."""
    model = engine.target.model_ref  # the eager model behind the target's graph face
    context, exact = model.config.max_position_embeddings, spec.exact_verify
    if spec.mode is SpecMode.OFF:
        return PlainIteration(model, slots=context + room(0), lanes=lanes)
    if spec.mode is SpecMode.MTP:
        k = spec.num_drafts
        return MTPIteration(model, engine.mtp, k, stop=spec.draft_stop, exact=exact, plain=plain,
                            slots=context + room(k), lanes=lanes)
    gamma = dflash.gamma
    if dflash.tree_budget:  # (`tree_graphs`)
        budget = dflash.tree_budget
        return DFlashTreeIteration(model, engine.drafters[dflash.drafter], counts or budget, gamma=gamma,
                                   exact=exact, plain=plain or counts is not None, settled=settled,
                                   stats=counts is not None,
                                   slots=context + tree_room(budget, gamma), lanes=lanes)
    counts = (counts or (dflash.max_drafts,)) + ((0,) if plain else ())
    return DFlashIteration(model, engine.drafters[dflash.drafter], counts, gamma=gamma,
                           exact=exact, settled=settled, slots=context + room(gamma - 1, gamma), lanes=lanes)


def tree_graphs(spec: SpeculativeConfig, dflash: ResolvedDFlash | None) -> bool:
    """Whether `spec`'s draft trees (where it has them) run as whole iterations: verified in one
    forward or, with exact verify, one row per forward (`tree_iteration`), of a fixed budget or
    of adaptive k's; `--dflash-tree-verify paths` (chunkwise) runs the decode loop."""
    return dflash is None or not dflash.tree_budget or spec.exact_verify or dflash.tree_verify != "paths"


def loop_for(engine, spec: SpeculativeConfig, dflash: ResolvedDFlash | None, graphs) -> IterationLoop:
    """`spec`'s mode on `engine`'s models as whole iterations of one sequence captured by
    `graphs`; a DFlash draft ladder or adaptive k with a graph per count."""
    policy = count_policy(spec, dflash)
    if policy is not None:
        return IterationLoop(iteration_for(engine, spec, dflash, counts=policy.counts,
                                           settled=policy.controller is not None), graphs, policy)
    return IterationLoop(iteration_for(engine, spec, dflash), graphs)


def lanes_for(engine, spec: SpeculativeConfig, dflash: ResolvedDFlash | None, graphs, lanes: int) -> "IterationLanes":
    """`spec`'s mode as an iteration of `lanes` lanes, captured per bucket (serving), with a
    plain variant for iterations whose batch may not draft; a DFlash ladder or adaptive k
    with a graph per count, the count of each iteration chosen for the batch."""
    policy = count_policy(spec, dflash)
    counts = policy.counts if policy is not None else None
    plain = spec.mode is not SpecMode.OFF
    return IterationLanes(iteration_for(engine, spec, dflash, lanes=lanes, counts=counts, plain=plain), graphs, policy)


@dataclass(frozen=True)
class LaneStep(ModelStep):
    """A request's next iteration in its lane of `IterationLanes` (its face): what a scheduler
    gathers from every running request and runs in one replay (`IterationLanes.run`); answered
    with the tokens the iteration emitted for the lane. The scheduler counts its target rows."""

    lanes: "IterationLanes"
    lane: int
    speculate: bool = True  # the batch lets steps draft (`decode.Batch.speculate`)

    @property
    def rows(self) -> int:
        it = self.lanes.iteration
        return it.rows(it.k)  # at most: the count is chosen when the lanes run

    @property
    def ran(self) -> int:
        return self.lanes.iteration.rows(self.lanes.last_k)

    @property
    def face(self) -> "IterationLanes":
        return self.lanes


class IterationLanes(BatchedFace):
    """Many requests at once through one iteration of `lanes` lanes (serving on a graph target):
    a request takes the lowest free lane (`acquire`), its prompt runs eagerly (`prefill`), and
    each `run` replays the graph of the smallest bucket (`BUCKETS`, then every lane) holding the
    lanes asked for, with only those lanes active, over the slot bucket of the longest request
    in those lanes (a released lane goes back to position 0, which the smallest bucket holds),
    then reads their tokens (one wait per iteration). Each lane accepts its own count; a greedy
    batch runs the greedy graph, one with a sampled lane the graph that also draws (the lanes'
    one generator, seeded by a sampled request admitted alone: a seed makes a request's draws
    reproducible only while it runs alone).
    Before a replay the host checks that every lane's next rows lie in the bucket (a write past
    a graph's caches would be a device fault). An iteration whose batch may not draft
    (`--speculative-disable-by-batch-size`) runs the plain variant, which still keeps every
    row for the drafter; `last_k` is the count the last iteration verified.

    With a `policy` (a DFlash ladder or adaptive k, `CountPolicy`) every count's variant is
    captured and the policy picks each iteration's count for the whole batch, from the batch's
    outcomes: every lane's accepted drafts teach it (not a lane whose request's `max_drafts`
    capped it below the count) and the ladder moves once an iteration, so adaptive k maximises
    the batch's tokens per iteration cost under the stream's cost table (the iteration's cost
    at a count, relative to plain, taken as the same for any number of lanes) and may settle
    every lane on the plain variant until a request is admitted (`CountPolicy.reopen`); a
    request admitted alone starts the policy afresh (`CountPolicy.reset`)."""

    BUCKETS = (1, 2, 4, 8, 16, 32)

    def __init__(self, iteration, graphs, policy: CountPolicy | None = None):
        self.iteration, self.graphs, self.policy = iteration, graphs, _checked(policy, iteration)
        n = iteration.lanes
        self.buckets = tuple(b for b in self.BUCKETS if b < n) + (n,)
        state = iteration.state
        iteration.generator.manual_seed(int(torch.randint(2**62, ())))
        self.captured = {}
        with torch.inference_mode():
            for key, fn in iteration.variants(self.buckets).items():
                graphs.warmup(fn)
                self.captured[key] = graphs.capture(fn, generators=(iteration.generator,))[0]
            state.active.zero_()
        self._cuda = state.tokens.device.type == "cuda"
        pin = self._cuda
        self._tokens = torch.empty_like(state.tokens, device="cpu", pin_memory=pin)
        self._count = torch.empty_like(state.count, device="cpu", pin_memory=pin)
        self._stats = tuple(torch.empty_like(t, device="cpu", pin_memory=pin)
                            for t in (iteration.stats if policy is not None else ()))
        self._active = torch.zeros_like(state.active, device="cpu", pin_memory=pin)
        self._free = list(range(n))  # a heap: the lowest lane first keeps the buckets small
        self._read = [0] * n  # per lane, the tokens of its ring read so far
        self._slots = [0] * n  # per lane, its request's slot bucket (0: free)
        self._prompt = [0] * n  # per lane, its request's prompt length
        self._room = iteration.room()
        self._sampled: set[int] = set()
        self._cap = [NO_CAP] * n  # per lane, its request's cap on its drafts
        self._plain = 0 in iteration.keys() and iteration.k > 0
        self.last_k = iteration.k

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.iteration.lanes} lanes are taken")
        return heapq.heappop(self._free)

    def release(self, lane: int) -> None:
        self.iteration.vacate(lane)
        self._slots[lane] = 0
        self._sampled.discard(lane)
        self._cap[lane] = NO_CAP
        heapq.heappush(self._free, lane)

    def prefill(self, lane: int, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> int:
        """The request's prompt in `lane` -> its first token."""
        it = self.iteration
        self._slots[lane] = it.check_room(len(prompt_ids), max_tokens)
        self._prompt[lane] = len(prompt_ids)
        # a request alone starts the lanes' generator from its seed and the policy from its
        # start, as a request of its own does (so a seeded one repeats); one beside others
        # joins theirs
        alone = len(self._free) == it.lanes - 1
        if alone and not params.greedy:
            it.seed(params)
        with torch.inference_mode():
            it.prefill(lane, prompt_ids, params, self._slots[lane])
        if not params.greedy:
            self._sampled.add(lane)
        self._cap[lane] = params.lane_cap
        if self.policy is not None and alone:
            self.policy.reset()
        elif self.policy is not None:
            self.policy.reopen()
        self._read[lane] = 0
        return int(it.state.pending[lane])

    def forward_many(self, steps: list[LaneStep]) -> list[list[int]]:
        return self.run(steps)

    def run(self, steps: list[LaneStep]) -> list[list[int]]:
        """One iteration of the lanes of `steps` -> each one's emitted tokens."""
        lanes = [s.lane for s in steps]
        top = max(lanes) + 1
        b = next(x for x in self.buckets if x >= top)
        # the slot bucket of every request in the first b lanes, those not stepping included:
        # each lane's rows are written at its position, so it must lie in the bucket
        slots = max(self._slots[:b])
        for lane in range(b):  # position: its prompt and the tokens emitted since (a free lane's: 0)
            pos = self._prompt[lane] + self._read[lane] if self._slots[lane] else 0
            if pos + self._room > slots:
                raise RuntimeError(f"lane {lane} at position {pos} would write past the {slots} slots "
                                   f"its iteration attends over: its request ran past its budget")
        state = self.iteration.state
        self._active.zero_()
        self._active[lanes] = 1
        speculate = not self._plain or all(s.speculate for s in steps)
        k = (0 if not speculate else
             drafts_of(self.policy.next()) if self.policy is not None else self.iteration.k)
        self.last_k = k
        with torch.inference_mode():
            state.active.copy_(self._active, non_blocking=self._cuda)
            self.graphs.replay(self.captured[(b, k, not self._sampled.isdisjoint(lanes), slots)])
            self._tokens[:b].copy_(state.tokens[:b], non_blocking=self._cuda)
            self._count[:b].copy_(state.count[:b], non_blocking=self._cuda)
            for host, t in zip(self._stats, self.iteration.stats):
                host[:b].copy_(t[:b], non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.current_stream().synchronize()
        ring = self._tokens.shape[1]
        counts, tokens = self._count[:b].tolist(), self._tokens[:b].tolist()  # one conversion each
        out = []
        for lane in lanes:
            n, read = counts[lane], self._read[lane]
            row = tokens[lane]
            out.append([row[j % ring] for j in range(read, n)])
            self._read[lane] = n
        if self.policy is not None and k > 0:  # (a lane whose request capped it below k measured its cap)
            most = self.iteration.accepts(k)
            taught = sorted((lane, len(o)) for lane, o in zip(lanes, out) if most <= self._cap[lane])  # lane order
            stats = [[t[lane].tolist() for t in self._stats] for lane, _ in taught]
            self.policy.observe_batch(k, [n for _, n in taught], stats)
        return out


def request_budget(prompt_ids: list[int], params: SamplingParams, vocab: int, max_context: int) -> int:
    """The tokens a request may emit (its max_tokens, within the context), its prompt checked
    as the decode loop checks it (the graphs index without checks)."""
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    budget = min(params.max_tokens, max_context - len(prompt_ids))
    if budget < 1:
        raise ValueError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in the "
                         f"context of {max_context} tokens")
    return budget


class IterationDecoder:
    """The decode loop's face (`generate`, `stream`, `last_result`) over an `IterationLoop` (a
    sampled request whose graphs could not be captured runs the decode loop, `fallback()`).
    Each iteration is recorded as a step: the drafts it verified (of a block's or a chain's),
    its tokens less one accepted; the graph fuses drafting and verifying, so a step's time is
    all verify."""

    def __init__(self, loop: IterationLoop, eos_ids: frozenset[int], max_context: int,
                 fallback: Callable[[], Decoder]):
        self.loop, self.eos_ids, self.max_context, self.fallback = loop, eos_ids, max_context, fallback
        self.proposed = loop.iteration.proposed
        self.last_result: DecodeResult | None = None

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        if not params.greedy and self.loop.unsampled is not None:  # the decode loop draws it
            decoder = self.fallback()
            yield from decoder.stream(prompt_ids, params)
            self.last_result = decoder.last_result
            return
        budget = request_budget(prompt_ids, params, self.loop.iteration.vocab_size, self.max_context)
        with torch.inference_mode():
            yield from self.loop.stream(list(prompt_ids), budget, self.eos_ids, params)
        self.last_result = self._result(self.loop.last_result)

    def _result(self, res: IterationResult) -> DecodeResult:
        out = DecodeResult(list(res.token_ids), res.seconds, res.prefill_s, res.finish_reason)
        per = (res.seconds - res.prefill_s) / max(1, len(res.emitted))
        for n, k, rows in zip(res.emitted, res.verified, res.rows):
            out.metrics.record_step(proposed=self.proposed if k else 0, verified=k, accepted=n - 1, emitted=n,
                                    verify_rows=rows, draft_s=0.0, verify_s=per)
            out.steps.append(StepTrace(drafted=k, accepted=n - 1, emitted=n))
        return out

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> DecodeResult:
        for _ in self.stream(prompt_ids, params):
            pass
        assert self.last_result is not None
        return self.last_result

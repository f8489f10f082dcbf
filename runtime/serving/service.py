"""What `generate`, `serve` and `bench` run: an engine directory plus speculative settings.

`EngineGenerator` implements the server's `TextGenerator` protocol. Each request gets a fresh
`Decoder` (and proposer) so no state leaks between sequences; metrics of finished requests are
merged into one aggregate for `/metrics`. The speculative config was validated when parsed; the
parts that need the engine (the drafter exists, γ against its block size, the MTP head exists)
are resolved here once, at start-up, before the first request.

Under `torchrun` (`load_generator` joins the world) every rank loads the whole target and runs
the same decode: the target is replicated, which is deterministic and lets every rank know the
accepted tokens without a broadcast per step; only the drafter is tensor-parallel, or, with
`--draft-tp-size 1`, held by the leader alone, which broadcasts each step's drafts. The leader
(rank 0) broadcasts each request (prompt ids and sampling parameters, with a seed it draws for
an unseeded sampled request) before decoding it; the other ranks `follow`, decoding the same
requests until the leader's `shutdown`. A stream the client abandons is still decoded to its
end on the leader, so every rank runs the same collectives. Only the leader prints or serves.
"""

from __future__ import annotations

import json
import logging
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.artifact.engine_dir import load_manifest
from metrale.runtime.backend_registry import BACKENDS
from metrale.runtime.backends import Backend, load_engine, run_forwards
from metrale.runtime.components import KINDS, Role, names_with_role
from metrale.runtime.errors import ConfigError, MetraleError
from metrale.runtime.models.configs import DFlashConfig
from metrale.runtime.models.tp import TensorParallel, World, env_count
from metrale.runtime.serving.eager_rows import on_eager_target
from metrale.runtime.serving.scheduler import Capabilities
from metrale.runtime.serving.stats import GeneratorStats, PrefixCacheStats
from metrale.runtime.spec.config import AUTO, SpecMode, SpeculativeConfig, resolve_dflash, resolve_draft_tp_size
from metrale.runtime.spec.decode import Batch, DecodeResult, Decoder
from metrale.runtime.spec.grammar import Grammars, GrammarState
from metrale.runtime.spec.iteration_loop import (IterationDecoder, IterationLanes, IterationLoop, LaneStep,
                                                 lanes_for, loop_for, request_budget, tree_graphs)
from metrale.runtime.spec.metrics import SpecMetrics, SpecMetricsAggregate
from metrale.runtime.spec.relay import LeaderDrafts, RelayedDrafts
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.spec.shapes import SHAPES
from metrale.runtime.steps import Wait

log = logging.getLogger(__name__)

LANES = 32  # the requests a graph target runs at once (its iterations' lanes)
GRAMMAR_THREADS = 4  # schemas compiling at once for the requests waiting on them


def check_engine_supports(engine: LoadedEngine, spec: SpeculativeConfig):
    """Resolve the engine-dependent settings; refuse what the engine directory cannot run."""
    if spec.mode is SpecMode.MTP and engine.mtp is None:
        raise ConfigError(f"--speculative needs an MTP head; engine directory {engine.path} has none")
    if spec.mode is SpecMode.DFLASH:
        name = spec.dflash_drafter
        if name not in engine.drafters:
            have = ", ".join(sorted(engine.drafters)) or "none"
            raise ConfigError(f"--dflash-drafter {name!r}: engine directory {engine.path} has no such "
                              f"drafter (it has: {have})")
        if spec.dflash_tree_budget and not engine.block_distributions(name):
            raise ConfigError(f"--dflash-tree-budget {spec.dflash_tree_budget}: "
                              f"{engine.no_distributions(name)}: expected 0 (the chain), or build "
                              "the engine again, or run --backend torch")
        calibrated, of = None, ""
        if spec.dflash_adaptive_k == AUTO:
            from metrale.runtime.spec import calibration

            wanted = calibration.setting(name, engine.backend.name, str(engine.dtype).removeprefix("torch."),
                                         torch.get_num_threads())
            calibrated = calibration.lookup(engine.path, wanted)
            of = f"{calibration.describe(wanted)} in engine directory {engine.path}"
        return resolve_dflash(spec, engine.drafters[name].config.block_size, calibrated, of)
    return None


class EngineGenerator:
    """`relay`: the DFlash drafter runs whole on the leader and its drafts reach the other
    ranks by broadcast (`--draft-tp-size 1` on a world; the other ranks load no drafter)."""

    def __init__(self, engine: LoadedEngine, spec: SpeculativeConfig | None = None,
                 world: World | None = None, relay: bool = False):
        self.engine = engine.pack()
        self.spec = spec or SpeculativeConfig()
        self.world = world or World()
        self.relay = relay and self.world.size > 1 and self.spec.mode is SpecMode.DFLASH
        # a world's ranks decode in lockstep, so they take the same steps only where they hold
        # the same row claim: where one rank's probe withdrew it, every rank withdraws it
        verdicts = self.world.gather(engine.eager_invariant)
        if engine.eager_invariant and not all(verdicts):
            others = [str(r) for r, v in enumerate(verdicts) if not v]
            engine.withdraw_rows_invariance(f"rank{'s' * (len(others) > 1)} {', '.join(others)} of "
                                            f"{self.world.size} measured rows that differ")
        follower_relay = self.relay and not self.world.leader
        self.dflash = None if follower_relay else check_engine_supports(engine, self.spec)
        if self.spec.dflash_tree_verify == "forward" and not engine.tree_attention:
            raise ConfigError(f"--dflash-tree-verify forward: the {engine.backend} target runs no draft "
                              "tree's rows in one forward (no tree attention mask: CPU packages or "
                              "target graphs built before tree rows, or a graph profile of fewer "
                              "rows than a 64-node tree's: build the engine again); use auto or paths")
        self.tokenizer = engine.tokenizer
        self.model_id = engine.model_id
        self.max_context = engine.target.config.max_position_embeddings
        self.metrics = SpecMetricsAggregate()
        # what each request's proposer is made from: the proposer of the proposing component's
        # step shape
        self._proposing = None
        if self.spec.mode is not SpecMode.OFF and not follower_relay:
            comps = engine.manifest.components
            name = (self.spec.dflash_drafter if self.spec.mode is SpecMode.DFLASH
                    else names_with_role(comps, Role.HEAD)[0])
            self._proposing = (SHAPES[KINDS[comps[name].kind].shape].proposer, name)
        # a backend whose whole iterations run as graphs (one process holding the whole model):
        # requests run them one at a time (`decoder`), or many in lanes (`steps`, a
        # scheduler's); each kind captured at its first use
        self._graphs = None
        if engine.backend.iteration_graphs and self.world.size == 1 and tree_graphs(self.spec, self.dflash):
            self._graphs = engine.target.runner.graphs
        self._iterations: IterationLoop | bool | None = None  # False: its capture failed
        self._lanes: IterationLanes | bool | None = None
        self._grammars: Grammars | None = None  # made at the first request with a schema
        self._grammar_threads: ThreadPoolExecutor | None = None  # where a served request's schema compiles

    def decoder(self, params: SamplingParams | None = None) -> Decoder | IterationDecoder:
        """A request's decoder: the iterations' (`IterationDecoder`) where they were captured
        and the request drafts (`_as_served`), else the decode loop."""
        if self._graphs is not None and self._iterations is None:
            self._iterations = self._captured(loop_for, "whole-iteration graphs")
        if self._iterations and (params is None or _as_served(params)):
            return IterationDecoder(self._iterations, self.tokenizer.eos_token_ids, self.max_context,
                                    self._decode_loop)
        return self._decode_loop(params)

    def _decode_loop(self, params: SamplingParams | None = None, eager: bool = False,
                     grammar: GrammarState | None = None) -> Decoder:
        """The decode loop of a request: plain where the request turned speculation off
        (`SamplingParams.drafts`), as on a server without speculative flags; with `eager`, on
        the eager model behind a graph target (a cache of its own). Under the request's schema,
        its matcher `grammar` (made here where None)."""
        e, spec = self.engine, self.spec
        embed = e.target.model.embed_tokens
        max_len = self.max_context + 64
        proposer = None
        if grammar is None and params is not None and params.json_schema is not None:
            grammar = self._compiler().state(params.json_schema)
        if params is not None and not params.drafts:
            pass  # (every rank of a world decides so: the leader announced the request)
        elif spec.mode is SpecMode.DFLASH and self.relay and not self.world.leader:
            proposer = RelayedDrafts(self.world, embed.weight.device, spec.dflash_tree_verify or "auto")
        elif self._proposing is not None:
            factory, name = self._proposing
            proposer = factory.for_spec(e.component(name), embed, spec, self.dflash, max_len)
            if self.relay:
                proposer = LeaderDrafts(proposer, self.world)
        target, invariant, trees = ((e.target.model_ref, e.eager_rows_invariant, BACKENDS["torch"].tree_attention)
                                    if eager else (e.target, e.rows_invariant, e.tree_attention))
        return Decoder(target, self.tokenizer.eos_token_ids, proposer, spec.exact_verify, self.max_context,
                       invariant, grammar, trees)

    def _announce(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Leader: send the request to the other ranks (a sampled request gets a seed)."""
        if self.world.size == 1:
            return params
        if not params.greedy and params.seed is None:
            params = replace(params, seed=random.getrandbits(63))
        self.world.broadcast((list(prompt_ids), params))
        return params

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> DecodeResult:
        """One whole request (on every rank of a world: the leader announces it)."""
        params = self._announce(prompt_ids, params)
        return self.decoder(params).generate(prompt_ids, params)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               counted: SpecMetrics | None = None) -> Iterator[int]:
        params = self._announce(prompt_ids, params)
        decoder = self.decoder(params)
        tokens = decoder.stream(prompt_ids, params)
        try:
            for tok in tokens:  # not `yield from`: closing this generator must not close `tokens`
                yield tok
        finally:
            if self.world.size > 1:
                for _ in tokens:  # the other ranks decode the whole request: keep in step
                    pass
            else:  # left midway: the steps it yielded go into its result first
                tokens.close()
            if decoder.last_result is not None:
                self._finished(decoder.last_result.metrics, counted)

    def _finished(self, metrics: SpecMetrics, counted: SpecMetrics | None) -> None:
        """A request's counters into the aggregate, and, where it speculates, into the
        request's own (`counted`)."""
        self.metrics.add(metrics)
        if counted is not None and self.spec.mode is not SpecMode.OFF:
            counted.merge(metrics)

    @property
    def capabilities(self) -> Capabilities:
        """What a scheduler may do with it. In one process its sequences' model steps run
        together (`steps`, `run_forwards`); a tensor-parallel world decodes one request at a
        time (its ranks decode in lockstep). On a graph backend it runs at most its lanes at
        once (captured here, at the scheduler's construction), or 1 where there are none (a
        draft tree's mode the iterations do not run, `iteration_loop.tree_graphs`) or they could
        not be captured: the decode loop then runs one request at a time on the target's
        graphs, whose one decode cache serves one sequence."""
        most = None
        if self.engine.backend.iteration_graphs:
            most = LANES if self._graphs is not None and self._serving_lanes() else 1
        one = self.world.size == 1
        return Capabilities(batched=one, sequential=not one, max_running=most,
                            speculates=self.spec.mode is not SpecMode.OFF, thread_mode=torch.inference_mode)

    def _serving_lanes(self) -> "IterationLanes | None":
        if self._lanes is None:
            self._lanes = self._captured(lambda *a: lanes_for(*a, LANES), "iteration lanes")
        return self._lanes or None

    def _captured(self, make, what: str):
        """`make(engine, spec, dflash, graphs)`, or False where capturing failed: the decode
        loop runs instead, and the engine's `backend_note` says why."""
        try:
            return make(self.engine, self.spec, self.dflash, self._graphs)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the decode loop
            why = f"{what} failed, the decode loop runs: {type(exc).__name__}: {exc}"
            log.warning("engine directory %s: %s", self.engine.path, why)
            self.engine.backend_note = "; ".join(n for n in (self.engine.backend_note, why) if n)
            return False

    def steps(self, prompt_ids: list[int], params: SamplingParams, batch: Batch,
              counted: SpecMetrics | None = None):
        """One request's decode loop as a coroutine (`decode.Decoder.steps`) for a scheduler,
        resumed under its capabilities' `thread_mode`; on a graph target its iterations in a lane
        (`_lane_steps`), or, for a request with a grammar (which the graphs do not mask), the
        decode loop: beside lanes on the eager model behind the graphs (`eager_rows`), several
        at once within the server's running limit, else on the target's graphs (one request at
        a time)."""
        lanes = self._graphs is not None and self._serving_lanes() is not None
        if lanes and params.json_schema is None:
            yield from self._lane_steps(prompt_ids, params, batch, counted)
            return
        grammar = None
        if params.json_schema is not None:  # compiled off the scheduler's thread, the others running
            grammar = yield Wait(self._compiling(params.json_schema))
        if self._graphs is not None or grammar is not None:  # (a schema's request: the decode loop, as `decoder`'s)
            decoder = self._decode_loop(params, eager=lanes, grammar=grammar)
        else:
            decoder = self.decoder(params)
        # (beside lanes no plain runs: a run's rows would go to the graphs, not the eager model)
        steps = decoder.steps(prompt_ids, params, batch, runs=not lanes)
        if lanes:
            steps = on_eager_target(steps, decoder.target)
        try:
            yield from steps
        finally:
            if decoder.last_result is not None:
                self._finished(decoder.last_result.metrics, counted)

    def _compiler(self) -> Grammars:
        """The target's grammar compiler, made at the first request with a schema."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.engine.target.config.vocab_size)
        return self._grammars

    def _compiling(self, schema: str) -> Future:
        """The request's matcher for `schema` (`GrammarState`), its grammar compiling on a
        grammar thread while the scheduler runs the other requests (xgrammar's compile leaves
        the interpreter free; a pattern's automaton, built in Python, shares it). Several
        threads, so a slow schema does not hold up the next."""
        if self._grammar_threads is None:
            self._grammar_threads = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="metrale-grammar")
        return self._grammar_threads.submit(self._compiler().state, schema)

    def _lane_steps(self, prompt_ids: list[int], params: SamplingParams, batch: Batch,
                    counted: SpecMetrics | None):
        """A request in a lane of the iterations (`iteration_loop.IterationLanes`): its prompt
        at once, then a `LaneStep` per iteration (send back its tokens); each batch of tokens
        yielded as the decode loop yields a step's. It ends at its budget; the scheduler ends it
        at EOS or its limit (closing it frees the lane). Its iterations draft while `batch`
        lets them."""
        lanes = self._serving_lanes()
        budget = request_budget(prompt_ids, params, lanes.iteration.vocab_size, self.max_context)
        proposed = lanes.iteration.proposed
        # the lanes verify one count together; a request that caps its drafts (or turns them
        # off) accepts at most its cap in its own lane (`IterationState.cap`), the others theirs
        cap = params.lane_cap
        result = DecodeResult([], 0.0, 0.0, "length")
        lane = lanes.acquire()
        t0 = time.perf_counter()
        try:
            tokens = [lanes.prefill(lane, list(prompt_ids), params, budget)]
            result.prefill_s = time.perf_counter() - t0
            while True:
                tokens = tokens[: budget - len(result.token_ids)]  # an iteration past the budget: cut
                result.token_ids.extend(tokens)
                yield tokens
                if len(result.token_ids) >= budget:
                    return
                t1 = time.perf_counter()
                tokens = yield LaneStep(lanes, lane, batch.speculate)
                # the drafts its lane verified for it; the rows are the whole iteration's
                n, k = len(tokens), min(lanes.last_k, cap)
                result.metrics.record_step(proposed=proposed if k else 0, verified=k, accepted=n - 1, emitted=n,
                                           verify_rows=lanes.iteration.rows(lanes.last_k), draft_s=0.0,
                                           verify_s=time.perf_counter() - t1)
        finally:
            lanes.release(lane)
            result.seconds = time.perf_counter() - t0
            self._finished(result.metrics, counted)

    def run_forwards(self, forwards: list) -> list:
        """The outputs of many sequences' model steps (`steps`), in one batched call per face
        where the face has one (a graph target's `LaneStep`s: one replay of their lanes)."""
        with torch.inference_mode():
            return run_forwards(self.engine.target, forwards)

    def follow(self) -> None:
        """A non-leader rank: decode the leader's requests until its `shutdown`."""
        while True:
            request = self.world.broadcast()
            if request is None:
                return
            prompt_ids, params = request
            try:
                self.decoder(params).generate(prompt_ids, params)
            except (MetraleError, ValueError) as exc:  # the leader raises the same, to its caller
                log.debug("rank %d: request refused: %s", self.world.rank, exc)

    def shutdown(self) -> None:
        """Leader: release the other ranks' `follow`."""
        if self.world.size > 1 and self.world.leader:
            self.world.broadcast(None)

    def cache_prefixes(self, tokens: int):
        """Keep prompts' K/V and rows for reuse by the prompts that start the same way, up to
        `tokens` positions (`backends.prefix_cache`) -> the cache, or None where the backend
        has none to offer (`BackendEntry.prefix_cache`) or `tokens` is 0."""
        from metrale.runtime.backends.prefix_cache import PrefixCache

        target = self.engine.target
        if tokens <= 0 or not self.engine.backend.prefix_cache:
            return None
        target.prefix_cache = PrefixCache(tokens)
        return target.prefix_cache

    def leave_cores(self, cores: int) -> int | None:
        """Split the batched target's steps over `cores` fewer threads than torch's (at least
        one), leaving those cores to another process: `serve`'s HTTP process. -> the lanes,
        or None where the backend does not split its steps (`BackendEntry.split_steps`)."""
        from metrale.runtime.backends.aoti_native import Lanes

        target = self.engine.target
        if not self.engine.backend.split_steps:
            return None
        target.lanes = Lanes(max(1, torch.get_num_threads() - cores))
        return target.lanes.n

    def stats(self):
        """Its counters for /metrics (`serving.stats.GeneratorStats`): speculative decoding's
        over the finished requests, and the prefix cache's where it keeps one."""
        requests, spec = self.metrics.snapshot()
        cache = self.engine.target.prefix_cache if self.engine.backend.prefix_cache else None
        held = None if cache is None else PrefixCacheStats(cache.queried, cache.reused, cache.tokens)
        return GeneratorStats(requests, spec, held)


def _as_served(params: SamplingParams) -> bool:
    """A request whose speculation the whole-iteration graphs run: drafting, as the flags say or
    capped (each iteration accepts at most its cap, `IterationState.cap`), with no grammar."""
    return params.drafts and params.json_schema is None


def drafter_kv_heads(engine_dir: Path, name: str) -> int | None:
    """The KV heads of drafter `name` from its config, or None when there is no such drafter."""
    path = Path(engine_dir) / name / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = DFlashConfig.from_hf(json.loads(path.read_text()), f"{name}/config.json")
    except MetraleError as exc:  # (another component's config: the MTP head's, the target's)
        raise ConfigError(f"--dflash-drafter {name!r}: not a DFlash drafter of engine directory "
                          f"{engine_dir} ({exc})") from None
    return cfg.decoder.num_key_value_heads


def load_generator(engine_dir: str | Path, spec: SpeculativeConfig, *,
                   dtype: torch.dtype = torch.float32, device: str = "cpu",
                   backend: str = "auto", states: dict | None = None) -> EngineGenerator:
    """Load an engine for this process: a plain process, or one rank of a `torchrun` world.

    In a world, `--draft-tp-size` must be the same on every rank (checked with an all-gather)
    and resolve to 1 or the world size; above 1 every drafter is loaded as this rank's shard,
    at 1 only the leader loads drafters and relays its drafts (`spec.relay`).
    """
    kind = Backend.parse(backend)
    if kind is Backend.ONNXRUNTIME:  # one process, one rank: the graphs are the one-rank build's
        world_size = env_count("WORLD_SIZE", 1, default=1)
        if world_size > 1:
            raise ConfigError(f"--backend {kind.value} runs in one process, not {world_size} torchrun ranks")
        tp_ranks = spec.draft_tp_size.ranks if spec.mode is SpecMode.DFLASH else None
        if tp_ranks is not None and tp_ranks > 1:
            raise ConfigError(f"--draft-tp-size {tp_ranks}: the {kind.value} backend runs one-rank "
                              "graphs; use --backend torch for tensor-parallel drafters")
        return EngineGenerator(load_engine(engine_dir, backend=kind, device=device), spec)
    world = World.from_env(device)
    tp, relay, components = None, False, None
    if spec.mode is SpecMode.DFLASH:
        world.agree(str(spec.draft_tp_size), "--draft-tp-size")
        kv_heads = drafter_kv_heads(Path(engine_dir), spec.dflash_drafter)
        if kv_heads is not None and resolve_draft_tp_size(spec, world.size, kv_heads) > 1:
            tp = TensorParallel(world.rank, world.size)
        relay = tp is None and world.size > 1
    if kind is Backend.TENSORRT and world.size > 1 and tp is None:
        raise ConfigError(f"--backend tensorrt on {world.size} ranks runs a --draft-tp-size "
                          f"{world.size} build's DFlash drafter engines, one per rank: use --dflash "
                          f"with --draft-tp-size auto or {world.size}, or one process")
    if relay and not world.leader:  # the drafter lives on rank 0 only
        manifest = load_manifest(engine_dir, verify=False)
        drafters = names_with_role(manifest.components, Role.DRAFTER)
        components = tuple(n for n in manifest.components if n not in drafters)
    engine = load_engine(engine_dir, dtype=dtype, device=world.device(device), tp=tp,
                         backend=backend, states=states, components=components)
    return EngineGenerator(engine, spec, world, relay=relay)

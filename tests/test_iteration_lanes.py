"""Serving on a graph target (the capture stand-in): requests in the lanes of one iteration
(`iteration_loop.IterationLanes`), over HTTP with the official client and lane by lane; lanes
that step plainly while their batch may not draft, and lanes capped by their requests."""

from __future__ import annotations

import pytest
from conftest import COUNT_POLICIES, PLAIN_TOKENS

from metrale.runtime.backends.cuda_graphs import EagerGraphs
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.sampling import NO_CAP, SamplingParams

MAX_TOKENS = PLAIN_TOKENS


@pytest.mark.parametrize("flags", [{}, dict(dflash=True), dict(speculative=True, num_drafts=3),
                                   dict(dflash=True, dflash_drafter="dflash2", dflash_draft_ladder="1,3,7"),
                                   dict(dflash=True, dflash_drafter="dflash2", dflash_tree_budget=16),
                                   dict(dflash=True, dflash_tree_budget=16, exact_verify=True)],
                         ids=["plain", "dflash", "mtp", "dflash2 ladder", "dflash2 tree", "dflash exact tree"])
def test_serving_on_a_graph_target_runs_requests_in_lanes(tiny_engine_dir, tiny_prompts, flags):
    """`serve` on a target run as graphs: concurrent requests over HTTP (the official client)
    run in the lanes of one iteration graph per bucket, drafting whatever the batch, each
    accepting its own drafts, each with its solo answer (greedy); several ran at once."""
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from conftest import serve_in_thread
    from openai import OpenAI

    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.serving.http_guard import ServerLimits
    from metrale.runtime.serving.server import create_app
    from metrale.runtime.spec.config import SpeculativeConfig

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))
    caps = gen.capabilities
    assert caps.batched and not caps.sequential and caps.max_running == 32
    texts = [engine.tokenizer.decode(p[:12]) for p in tiny_prompts]
    solo = []
    for text in texts:
        res = EngineGenerator(engine).generate(engine.tokenizer.encode(text), SamplingParams(temperature=0.0, max_tokens=16))
        solo.append(engine.tokenizer.decode([t for t in res.token_ids if t not in engine.tokenizer.eos_token_ids]))
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=8, speculative_disable_by_batch_size=None))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i):
            return client.completions.create(model=gen.model_id, prompt=texts[i], max_tokens=16,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, [i % len(texts) for i in range(12)]))
        metrics = requests.get(base + "/metrics", timeout=5).text
    assert answers == [solo[i % len(texts)] for i in range(12)]
    peak = int(float(next(x for x in metrics.splitlines() if x.startswith("metrale_scheduler_peak_running ")).split()[1]))
    assert 2 <= peak <= 8
    totals = gen.metrics.snapshot()[1]
    if flags:  # every iteration drafted (the batch always may), its lanes each accepting their own
        assert totals.steps > 0 and totals.drafts_verified > 0 and totals.tokens_emitted > 1.2 * totals.steps
    if flags.get("dflash_tree_budget"):  # the rows each iteration ran: the tree's 17, or exact's γ = 8
        assert totals.verify_rows == (8 if flags.get("exact_verify") else 17) * totals.steps


@pytest.mark.parametrize("flags", [dict(dflash=True), dict(speculative=True, num_drafts=3),
                                   dict(dflash=True, dflash_tree_budget=16)], ids=["dflash", "mtp", "dflash tree"])
def test_lanes_step_plainly_while_the_batch_may_not_draft(tiny_engine_dir, tiny_prompts, plain_tokens, flags):
    """Three requests in lanes, their iterations alternating between drafting and the plain
    variant (`--speculative-disable-by-batch-size` under load): each lane's tokens are plain
    decoding's, a plain iteration emits one token a lane, and drafting after plain steps still
    accepts (the drafter kept every row)."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.iteration_loop import LaneStep, lanes_for

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    spec = SpeculativeConfig.from_flags(**flags)
    dflash = resolve_dflash(spec, engine.drafters["dflash"].config.block_size) if "dflash" in flags else None
    lanes = lanes_for(engine, spec, dflash, engine.target.runner.graphs, 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    got = {lane: [lanes.prefill(lane, tiny_prompts[lane], greedy, MAX_TOKENS)] for lane in (lanes.acquire() for _ in range(3))}
    drafted = []
    for i in range(30):
        speculate = i % 3 != 1
        steps = [LaneStep(lanes, lane, speculate) for lane, toks in got.items() if len(toks) < MAX_TOKENS]
        if not steps:
            break
        for step, toks in zip(steps, lanes.run(steps)):
            got[step.lane] += toks
            assert lanes.last_k == (lanes.iteration.k if speculate else 0)
            if speculate:
                drafted.append(len(toks))
            else:
                assert len(toks) == 1
    for lane, toks in got.items():
        assert toks[:MAX_TOKENS] == plain_tokens[lane]
    assert sum(drafted) / len(drafted) > 1.3


@pytest.mark.parametrize("flags", [dict(dflash=True), dict(speculative=True, num_drafts=3),
                                   dict(dflash=True, dflash_tree_budget=16)], ids=["dflash", "mtp", "dflash tree"])
def test_each_lane_accepts_at_most_its_requests_cap(tiny_engine_dir, tiny_prompts, plain_tokens, flags):
    """Three requests in the lanes of one iteration: one uncapped, one capped at 2 drafts, one
    with speculation off. Each lane's tokens are plain decoding's; the capped lane emits at
    most 3 tokens an iteration and the one without speculation 1, while the uncapped lane,
    verified in the same iterations, still accepts more than 2."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.iteration_loop import LaneStep, lanes_for

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    spec = SpeculativeConfig.from_flags(**flags)
    dflash = resolve_dflash(spec, engine.drafters["dflash"].config.block_size) if "dflash" in flags else None
    lanes = lanes_for(engine, spec, dflash, engine.target.runner.graphs, 4)
    caps = [None, 2, 0]
    state = lanes.iteration.state
    state.sampling(3, SamplingParams(max_drafts=10 ** 20))  # any count the API lets through
    assert int(state.cap[3]) == NO_CAP
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_drafts=c, speculate=c != 0) for c in caps]
    got = {lanes.acquire(): [] for _ in caps}
    for lane, p in zip(got, params):
        got[lane].append(lanes.prefill(lane, tiny_prompts[lane], p, MAX_TOKENS))
    emitted = {lane: [] for lane in got}
    for _ in range(MAX_TOKENS):
        steps = [LaneStep(lanes, lane) for lane, toks in got.items() if len(toks) < MAX_TOKENS]
        if not steps:
            break
        for step, toks in zip(steps, lanes.run(steps)):
            got[step.lane] += toks
            emitted[step.lane].append(len(toks))
    for lane, toks in got.items():
        assert toks[:MAX_TOKENS] == plain_tokens[lane]
    uncapped, capped, off = emitted.values()
    assert max(capped) <= 3 and max(capped) > 1 and set(off) == {1}
    assert max(uncapped) > 3


def test_a_failing_step_beside_the_lanes_leaves_them_unreplayed(tiny_engine_dir, tiny_prompts):
    """The lanes' replay goes last in a batched call: where a step beside them fails, the lanes
    have not moved, so the scheduler's retry of each step alone replays them once."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.iteration_loop import LaneStep
    from metrale.runtime.steps import ModelStep

    class Failing(ModelStep):
        face = object()

        def run(self):
            raise RuntimeError("out of memory")

    engine = load_engine(tiny_engine_dir, backend="torch")
    graphs = EagerGraphs()
    use_cuda_graphs(engine, graphs=graphs)
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True))
    lanes = gen._serving_lanes()
    lane = lanes.acquire()
    lanes.prefill(lane, tiny_prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), MAX_TOKENS)
    before = graphs.replays
    with pytest.raises(RuntimeError, match="out of memory"):
        gen.run_forwards([LaneStep(lanes, lane), Failing()])
    assert graphs.replays == before
    assert len(gen.run_forwards([LaneStep(lanes, lane)])[0]) >= 1 and graphs.replays == before + 1


def _policy_lanes(engine_dir, **flags):
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.iteration_loop import lanes_for

    engine = load_engine(engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    spec = SpeculativeConfig.from_flags(dflash=True, **flags)
    dflash = resolve_dflash(spec, engine.drafters["dflash"].config.block_size)
    return lanes_for(engine, spec, dflash, engine.target.runner.graphs, 4)


def _run_lanes(lanes, prompts, params, budget=MAX_TOKENS):
    """Each prompt in a lane, every lane stepped together until each has `budget` tokens ->
    (tokens per lane, the count of each iteration); `lanes.stepped`: per iteration, the
    indices (in `prompts`) of the requests it stepped."""
    from metrale.runtime.spec.iteration_loop import LaneStep

    got = {}
    for prompt, p in zip(prompts, params):
        lane = lanes.acquire()
        got[lane] = [lanes.prefill(lane, prompt, p, budget)]
    index = {lane: i for i, lane in enumerate(got)}
    counts, lanes.stepped = [], []
    while True:
        steps = [LaneStep(lanes, lane) for lane, toks in got.items() if len(toks) < budget]
        if not steps:
            break
        for step, toks in zip(steps, lanes.run(steps)):
            got[step.lane] += toks
        counts.append(lanes.last_k)
        lanes.stepped.append([index[s.lane] for s in steps])
    for lane in got:
        lanes.release(lane)
    return [toks[:budget] for toks in got.values()], counts


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("table, pays", [("0:1,1:1.01,2:1.02,3:1.03,4:1.04,5:1.05,6:1.06,7:1.07", True),
                                         ("0:1,1:9,2:9.5,3:10,4:10.5,5:11,6:11.5,7:12", False)],
                         ids=["drafting pays", "drafting cannot pay"])
def test_adaptive_k_in_lanes_chooses_each_iterations_count_for_the_batch(tiny_engine_dir, tiny_prompts,
                                                                          plain_tokens, table, pays):
    """Adaptive k serving in lanes: a graph per count, the batch's count chosen each iteration
    from every lane's outcomes under the cost table: where drafting is nearly free and the
    drafter accepts, the iterations draft (more than one count as the estimates move); where
    no count could beat a plain step even fully accepted, every iteration is plain. Each
    lane's tokens are plain decoding's either way."""
    lanes = _policy_lanes(tiny_engine_dir, dflash_adaptive_k=table)
    assert {key[1] for key in lanes.captured} == set(range(8))  # every count, and plain
    got, counts = _run_lanes(lanes, tiny_prompts[:3], [GREEDY] * 3)
    assert got == plain_tokens[:3]
    if pays:
        assert sum(k > 0 for k in counts) > len(counts) // 2 and len(set(counts)) > 1
        assert len(lanes.policy.controller.estimator.tested) > 0
    else:
        assert set(counts) == {0} and lanes.policy.controller.settled


def test_a_draft_ladder_in_lanes_climbs_its_rungs_for_the_batch(tiny_engine_dir, tiny_prompts, plain_tokens):
    lanes = _policy_lanes(tiny_engine_dir, dflash_draft_ladder="1,3,7")
    assert {key[1] for key in lanes.captured} == {0, 1, 3, 7}
    got, counts = _run_lanes(lanes, tiny_prompts[:3], [GREEDY] * 3)
    assert got == plain_tokens[:3]
    assert counts[0] == 1 and set(counts) <= {1, 3, 7} and max(counts) > 1


def test_a_lane_capped_below_the_count_does_not_teach_adaptive_k(tiny_engine_dir, tiny_prompts, plain_tokens):
    """A request capped at 2 drafts accepts at most 2 whatever the batch verifies: its outcomes
    would read as a low acceptance, so they are observed only where the count is within its
    cap; one capped at 7 (no count exceeds it) teaches as an uncapped one."""
    table = "0:1,1:1.01,2:1.02,3:1.03,4:1.04,5:1.05,6:1.06,7:1.07"
    capped = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_drafts=2)
    lanes = _policy_lanes(tiny_engine_dir, dflash_adaptive_k=table)
    got, counts = _run_lanes(lanes, tiny_prompts[:1], [capped])
    assert got == plain_tokens[:1] and max(counts) > 2
    assert lanes.policy.controller.estimator.tested == []
    # beside lanes that teach: the position-1 tests count the taught lanes' outcomes only
    lanes = _policy_lanes(tiny_engine_dir, dflash_adaptive_k=table)
    seven = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_drafts=7)
    got, counts = _run_lanes(lanes, tiny_prompts[:3], [GREEDY, capped, seven], budget=12)
    assert got == [p[:12] for p in plain_tokens[:3]]
    taught = sum(len([i for i in stepped if i != 1 or k <= 2]) for k, stepped in zip(counts, lanes.stepped) if k > 0)
    assert 1 in lanes.stepped[0] and max(counts) > 2
    assert lanes.policy.controller.estimator.tested[0] == taught


def test_adaptive_k_over_tree_budgets_in_lanes(tiny_engine_dir, tiny_prompts, plain_tokens):
    """Draft trees under adaptive k in lanes: a graph per budget, each iteration's budget chosen
    for the batch from the trees its lanes built and what they accepted; plain decoding's
    tokens. A lane whose request caps its drafts below what a tree may accept teaches nothing."""
    lanes = _policy_lanes(tiny_engine_dir, dflash_tree_budget=16,
                          dflash_adaptive_k=",".join(f"{k}:{1 + 0.15 * k:.2f}" for k in range(17)))
    assert {key[1] for key in lanes.captured} == {0, 1, 2, 4, 8, 16}
    got, counts = _run_lanes(lanes, tiny_prompts[:3], [GREEDY] * 3)
    assert got == plain_tokens[:3]
    assert counts[0] == 16 and len(set(counts) - {0}) > 1
    assert lanes.policy.chooser.predicted > 0 and len(lanes.policy.probs) == 16
    lanes = _policy_lanes(tiny_engine_dir, dflash_tree_budget=16,
                          dflash_adaptive_k=",".join(f"{k}:{1 + 0.001 * k:.3f}" for k in range(17)))
    capped = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_drafts=2)
    got, counts = _run_lanes(lanes, tiny_prompts[:1], [capped])
    assert got == plain_tokens[:1] and set(counts) == {16}
    assert lanes.policy.probs is None and lanes.policy.chooser.predicted == 0


def test_the_ladder_moves_once_an_iteration_by_the_batch_and_not_by_the_order_of_its_lanes():
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.count_policy import CountPolicy

    def rung_after(emitted):
        policy = CountPolicy(resolve_dflash(SpeculativeConfig.from_flags(dflash=True, dflash_draft_ladder="1,3,7"), 8))
        policy.observe_batch(1, emitted)
        return policy.next()

    assert rung_after([2, 2, 1]) == rung_after([1, 2, 2]) == 3  # most lanes accepted their draft: one rung up
    assert rung_after([1, 1, 2]) == rung_after([2, 1, 1]) == 1
    policy = CountPolicy(resolve_dflash(SpeculativeConfig.from_flags(dflash=True, dflash_draft_ladder="1,3,7"), 8))
    policy.observe_batch(1, [2] * 8)
    assert policy.next() == 3  # one rung, however many lanes climbed
    policy.observe_batch(3, [2, 4, 4])
    policy.observe_batch(7, [2, 3, 2])  # fewer than the rung below (3): down one
    assert policy.next() == 3


def test_a_lane_step_counts_the_rows_its_iteration_ran(tiny_engine_dir, tiny_prompts):
    from metrale.runtime.spec.iteration_loop import LaneStep

    lanes = _policy_lanes(tiny_engine_dir, dflash_adaptive_k="0:1,1:9,2:9.5,3:10,4:10.5,5:11,6:11.5,7:12")
    lane = lanes.acquire()
    lanes.prefill(lane, tiny_prompts[0], GREEDY, MAX_TOKENS)
    step = LaneStep(lanes, lane)
    assert step.rows == 8  # before it runs: at most the largest count's
    lanes.run([step])
    assert lanes.last_k == 0 and step.ran == 1


def test_lanes_settled_by_what_they_accepted_measure_again_when_a_request_joins(tiny_engine_dir, tiny_prompts):
    """Adaptive k settled by measurements (lanes that accepted nothing) opens again for a new
    request, from the prior; settled by its cost table (no count could ever pay), it stays."""
    lanes = _policy_lanes(tiny_engine_dir, dflash_adaptive_k="0:1,1:1.1,2:1.2,3:1.3,4:1.4,5:1.5,6:1.6,7:1.7")
    lanes.prefill(lanes.acquire(), tiny_prompts[1], GREEDY, MAX_TOKENS)  # a request running
    controller = lanes.policy.controller
    assert lanes.policy.next() > 0  # the prior: drafting pays
    for _ in range(40):
        lanes.policy.observe_batch(3, [1] * 8)  # every lane rejected every draft
        lanes.policy.next()
        if controller.settled:
            break
    assert controller.settled
    lane = lanes.acquire()
    lanes.prefill(lane, tiny_prompts[0], GREEDY, MAX_TOKENS)
    assert lanes.policy.controller is controller  # joined: reopened, not started afresh
    assert not controller.settled and controller.estimator.tested == [] and lanes.policy.next() > 0
    lanes = _policy_lanes(tiny_engine_dir, dflash_adaptive_k="0:1,1:9,2:9.5,3:10,4:10.5,5:11,6:11.5,7:12")
    lanes.prefill(lanes.acquire(), tiny_prompts[1], GREEDY, MAX_TOKENS)
    lanes.policy.next()
    assert lanes.policy.controller.settled
    lanes.prefill(lanes.acquire(), tiny_prompts[0], GREEDY, MAX_TOKENS)
    assert lanes.policy.controller.settled


@pytest.mark.parametrize("flags", list(COUNT_POLICIES.values()), ids=list(COUNT_POLICIES))
def test_a_request_alone_in_its_lanes_starts_as_a_request_of_its_own(tiny_engine_dir, tiny_prompts, flags):
    """A request admitted alone starts the policy afresh (the ladder's lowest rung, adaptive
    k's prior) and the lanes' generator from its seed: a seeded sampled request gives the same
    tokens and counts each time it runs alone, whatever ran before it."""
    lanes = _policy_lanes(tiny_engine_dir, **flags)
    warm = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24)
    runs = [_run_lanes(lanes, tiny_prompts[:1], [warm], budget=24) for _ in range(2)]
    _run_lanes(lanes, tiny_prompts[1:3], [GREEDY] * 2)  # others, which teach the policy
    runs.append(_run_lanes(lanes, tiny_prompts[:1], [warm], budget=24))
    assert runs[1] == runs[0] and runs[2] == runs[0]
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=8, max_tokens=24)
    assert _run_lanes(lanes, tiny_prompts[:1], [other], budget=24)[0] != runs[0][0]


@pytest.mark.parametrize("graphs", [False, True], ids=["decode loop", "lanes"])
def test_a_request_the_context_cuts_ends_with_length(tiny_engine_dir, tiny_prompts, graphs, monkeypatch):
    """A request asking for more tokens than its context has room for, run by the scheduler:
    it ends where the context does, with finish "length" (the scheduler counted its max_tokens),
    as `generate` says, on the decode loop and in a graph target's lanes."""
    import threading

    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.serving import scheduler as sched
    from metrale.runtime.serving import service
    from metrale.runtime.serving.api_models import GenerationRequest
    from metrale.runtime.spec.config import SpeculativeConfig

    monkeypatch.setattr(service, "LANES", 2)  # (fewer lanes to capture)
    engine = load_engine(tiny_engine_dir, backend="torch")
    if graphs:
        use_cuda_graphs(engine, graphs=EagerGraphs())
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True))
    room = 5
    ids = (sum(tiny_prompts, []) * gen.max_context)[:gen.max_context - room]
    params = SamplingParams(temperature=0.0, max_tokens=4 * room)
    want = gen.generate(ids, params)
    assert want.finish_reason == "length" and len(want.token_ids) == room  # (no end token came first)
    events = []
    req = GenerationRequest(ids, params, (), False, False)

    def inbox(wait: bool) -> bool:
        if not events:
            events.append(None)
            s.submit(sched.Job(gen, req, lambda kind, payload: events.append((kind, payload)),
                               threading.Event(), "r"))
        return not (wait and any(e and e[0] == "done" for e in events))

    s = sched.Scheduler.for_generator(gen, 4, None, yield_gil=False, inbox=inbox)
    s.run()
    reason, n, _ = next(payload for e in events if e and e[0] == "done" for payload in [e[1]])
    assert (reason, n) == ("length", room)

"""Whole speculative iterations (`runtime/spec/iteration.py`) on the capture stand-in: every mode
decodes plain decoding's tokens, plain and exact; acceptance, the ring and the stop are worked on
the device; and no op inside an iteration reads the device from the host
(`host_reads.forbid_host_reads`, which these tests also show failing where a read happens)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import COUNT_POLICIES, PLAIN_TOKENS, replay_reading_nothing

from metrale.runtime.backends.cuda_graphs import EagerGraphs
from metrale.runtime.spec.config import DraftStop
from metrale.runtime.backends.host_reads import HostRead, forbid_host_reads
from metrale.runtime.spec.iteration import (DFlashIteration, IterationState, MTPIteration, PlainIteration,
                                            accepted_count)
from metrale.runtime.spec.iteration_loop import IterationLoop
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.serving.service import EngineGenerator

MAX_TOKENS = PLAIN_TOKENS
SLOTS = 256

# name -> (iteration class, its arguments besides the model and slots): chunkwise modes verify
# over row-invariant projections ("rowwise"), so their rows are the one-row steps' bits
MODES = {
    "plain": ("plain", {}),
    "dflash k=7": ("dflash", dict(k=7, linear="rowwise")),
    "dflash k=3 γ=4": ("dflash", dict(k=3, gamma=4, linear="rowwise")),
    "dflash k=7 exact": ("dflash", dict(k=7, exact=True)),
    "dflash2 k=7": ("dflash2", dict(k=7, linear="rowwise")),
    "dflash2 k=7 exact": ("dflash2", dict(k=7, exact=True)),
    "mtp k=3": ("mtp", dict(k=3, linear="rowwise")),
    "mtp k=3 exact": ("mtp", dict(k=3, exact=True)),
    "mtp k=3 stop cum:0.5 exact": ("mtp", dict(k=3, exact=True, stop=DraftStop.parse("cum:0.5"))),
    "mtp k=2 stop 0.7": ("mtp", dict(k=2, linear="rowwise", stop=DraftStop.parse("0.7"))),
}


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    """An engine of its own: the iterations' steps ready the models in place."""
    from metrale.runtime.backends import load_engine

    return load_engine(tiny_engine_dir).pack()


def make(engine, mode: str):
    kind, args = MODES[mode]
    model = engine.target
    if kind == "plain":
        return PlainIteration(model, slots=SLOTS, **args)
    if kind == "mtp":
        return MTPIteration(model, engine.mtp, slots=SLOTS, **args)
    args = dict(args)
    return DFlashIteration(model, engine.drafters[kind], args.pop("k"), slots=SLOTS, **args)


def test_accepted_count_by_hand():
    t = torch.tensor([5, 6, 9, 1])
    assert int(accepted_count(torch.tensor([5, 6, 7]), t)) == 2  # d_3 = 7 is not t_2 = 9
    assert int(accepted_count(torch.tensor([4, 6, 9]), t)) == 0  # a later match does not count
    assert int(accepted_count(torch.tensor([5, 6, 9]), t)) == 3  # all: t_3 is the bonus
    assert int(accepted_count(torch.tensor([5, 6, 9]), t, torch.tensor(1))) == 1  # the stop's cap
    assert int(accepted_count(torch.empty(0, dtype=torch.long), t[:1])) == 0  # a plain step


def test_the_ring_keeps_what_each_iteration_emitted():
    """Two lanes, ragged: each emits its own count into its own ring; an inactive lane moves
    nothing."""
    s = IterationState(torch.device("cpu"), lanes=3, ring=8)
    s.start(0, torch.tensor(3), pos=10)
    s.start(1, torch.tensor(4), pos=20)
    s.emit(torch.tensor([[11, 12, 13, 14], [51, 52, 53, 54]]), torch.tensor([2, 0]))  # t_3 of lane 0: stale
    assert s.count.tolist() == [3, 1, 0] and s.pending.tolist()[:2] == [13, 51] and s.pos.tolist()[:2] == [13, 21]
    s.emit(torch.tensor([[21, 22, 23, 24], [61, 62, 63, 64]]), torch.tensor([3, 1]))
    s.active[1] = 0
    s.emit(torch.tensor([[31, 32, 33, 34], [71, 72, 73, 74]]), torch.tensor([0, 3]))  # lane 0 wraps
    assert s.count.tolist() == [8, 3, 0] and s.pending.tolist()[:2] == [31, 62] and s.pos.tolist()[:2] == [18, 23]
    assert s.tokens[0].tolist() == [32, 33, 34, 21, 22, 23, 24, 31]  # the count's 8, read in ring order
    assert s.tokens[1, :3].tolist() == [51, 61, 62]
    assert int(accepted_count(torch.tensor([[5, 6, 7], [5, 0, 9]]), torch.tensor([[5, 6, 9, 1], [5, 6, 9, 1]]))[1]) == 1


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_decodes_plain_decodings_tokens(engine, tiny_prompts, plain_tokens, mode):
    """Each iteration replayed from one capture (the stand-in), its tokens read one iteration
    late: plain decoding's tokens, every prompt; the speculative modes accept drafts."""
    graphs = EagerGraphs()
    loop = IterationLoop(make(engine, mode), graphs)
    assert graphs.captured == 2  # greedy and sampled
    emitted = []
    for ids, want in zip(tiny_prompts, plain_tokens):
        res = loop.generate(ids, MAX_TOKENS, engine.tokenizer.eos_token_ids)
        assert res.token_ids == want, mode
        emitted += res.emitted
    assert graphs.captured == 2 and loop.replays == graphs.replays
    if mode == "plain":
        assert set(emitted) == {1}
    else:
        assert sum(emitted) / len(emitted) > 1.3, f"{mode}: τ {sum(emitted) / len(emitted):.2f}"
        assert max(emitted) <= MODES[mode][1]["k"] + 1


def test_exact_dflash_iterations_accept_what_the_decode_loop_accepts(engine, tiny_engine, tiny_prompts):
    """The device's acceptance is the decode loop's: the same tokens per iteration as the eager
    loop's steps with the same drafter, k and exact verify."""
    from metrale.runtime.spec.config import SpeculativeConfig

    loop = IterationLoop(make(engine, "dflash k=7 exact"), EagerGraphs())
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, exact_verify=True))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for ids in tiny_prompts:
        eager = gen.generate(ids, params)
        res = loop.generate(ids, MAX_TOKENS)
        assert res.token_ids == eager.token_ids
        assert res.emitted[:len(eager.steps) - 1] == [s.emitted for s in eager.steps[:-1]]


def test_the_stop_counts_fewer_drafts_and_leaves_the_tokens(engine, tiny_prompts):
    full = IterationLoop(make(engine, "mtp k=3 exact"), EagerGraphs())
    stopped = IterationLoop(make(engine, "mtp k=3 stop cum:0.5 exact"), EagerGraphs())
    fewer = 0
    for ids in tiny_prompts:
        a, b = full.generate(ids, MAX_TOKENS), stopped.generate(ids, MAX_TOKENS)
        assert a.token_ids == b.token_ids
        fewer += sum(a.emitted) / len(a.emitted) > sum(b.emitted) / len(b.emitted)
    assert fewer  # a chain cut short accepts no more than it verified


def test_a_budget_and_eos_end_the_request_one_iteration_late(engine, tiny_prompts, plain_tokens):
    loop = IterationLoop(make(engine, "dflash k=7"), EagerGraphs())
    res = loop.generate(tiny_prompts[0], 9)
    assert res.token_ids == plain_tokens[0][:9] and res.finish_reason == "length"
    eos = plain_tokens[0][5]
    res = loop.generate(tiny_prompts[0], MAX_TOKENS, frozenset({eos}))
    assert res.token_ids == plain_tokens[0][:plain_tokens[0].index(eos) + 1] and res.finish_reason == "stop"
    with pytest.raises(ValueError, match="need .* cache slots"):
        loop.generate(tiny_prompts[0], SLOTS)


@pytest.mark.parametrize("mode", list(MODES))
def test_no_host_read_inside_an_iteration(engine, tiny_prompts, mode):
    """Every variant, greedy and sampled, every count."""
    it = make(engine, mode)
    replay_reading_nothing(it, tiny_prompts[0], mode)


def test_the_guard_catches_host_reads():
    x = torch.arange(6)
    for read in (lambda: x.sum().item(), lambda: int(x[2]), lambda: x.nonzero(), lambda: x[x > 2],
                 lambda: bool(x.any()), lambda: x.repeat_interleave(x)):
        with pytest.raises(HostRead), forbid_host_reads("a test"):
            read()
    with forbid_host_reads("a test"):  # what an iteration does instead
        n = (x[:3] == torch.tensor([0, 1, 7])).long().cumprod(0).sum()
        x.index_select(0, n.view(1))


def test_the_decode_loop_reads_the_host_where_an_iteration_does_not(engine, tiny_engine, tiny_prompts):
    """The guard's positive control on real code: a step of the eager decode loop (DFlash,
    greedy) reads the device several times; the DFlash iteration none, in fewer ops."""
    from metrale.runtime.backends import run_forwards
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.backends.host_reads import OpCount

    decoder = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True)).decoder()
    steps = decoder.steps(tiny_prompts[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))

    def one_step():
        """Run the loop to the tokens of its next step."""
        reply = None
        while not isinstance(need := steps.send(reply), list):
            reply = run_forwards(decoder.target, [need])[0]
        return need

    with torch.inference_mode():
        assert one_step()  # the prompt's token
        count = OpCount()
        with count:  # one speculative step: propose, verify, accept, to its tokens
            assert one_step()
        with pytest.raises(HostRead), forbid_host_reads("the decode loop"):
            one_step()
        it = make(engine, "dflash k=7")
        it.prefill(0, tiny_prompts[0])
        iteration = OpCount()
        with iteration:
            it()
    assert count.host_reads >= 3 and iteration.host_reads == 0
    assert iteration.ops > 0


def test_a_graph_target_runs_greedy_requests_as_iterations(tiny_engine_dir, tiny_prompts, plain_tokens):
    """Through the engine as `--device cuda` loads it (the stand-in's graphs here): greedy
    requests of plain decoding, MTP and DFlash (fixed, laddered, adaptive, a draft tree verified
    in one forward or exact, adaptive k over tree budgets) run whole iterations (a tree verified along its paths runs the decode
    loop), with plain decoding's tokens and no host read inside a step (bench's counts); so
    does a sampled request, reproducible under its seed."""
    from metrale.bench_costs import step_counts
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.iteration_loop import IterationDecoder

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for flags, iterates in (({}, True), (dict(speculative=True, num_drafts=3), True),
                            (dict(dflash=True, exact_verify=True), True),
                            (dict(dflash=True, dflash_drafter="dflash2", dflash_gamma=4), True),
                            (dict(dflash=True, dflash_draft_ladder="1,3,7"), True),
                            (dict(dflash=True, dflash_adaptive_k="0:1,1:1.2,2:1.3,3:1.4,4:1.5,5:1.6,6:1.7,7:1.8"),
                             True),
                            (dict(dflash=True, dflash_drafter="dflash2", dflash_tree_budget=16), True),
                            (dict(dflash=True, dflash_tree_budget=16, exact_verify=True), True),
                            (dict(dflash=True, dflash_tree_budget=16,
                                  dflash_adaptive_k=",".join(f"{k}:{1 + 0.01 * k:.2f}" for k in range(17))), True),
                            (dict(dflash=True, dflash_tree_budget=16, dflash_tree_verify="paths"), False)):
        gen = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))
        assert isinstance(gen.decoder(), IterationDecoder) is iterates, flags
        res = gen.generate(tiny_prompts[1], greedy)
        assert res.token_ids == plain_tokens[1], flags
        assert len(res.steps) == res.metrics.steps and sum(t.emitted for t in res.steps) >= len(res.token_ids) - 1
        if flags:
            assert res.metrics.tau > 1.2 and res.metrics.drafts_verified > 0, flags
        counts = step_counts(gen, tiny_prompts[0])
        if iterates:
            assert counts["steps_run_as"] == "iteration graph" and counts["host_reads_per_step"] == 0, flags
    sampled = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True))
    res = sampled.generate(tiny_prompts[0], SamplingParams(temperature=0.8, seed=3, max_tokens=12))
    again = sampled.generate(tiny_prompts[0], SamplingParams(temperature=0.8, seed=3, max_tokens=12))
    assert len(res.token_ids) == 12 and res.token_ids == again.token_ids
    assert isinstance(sampled.decoder(), IterationDecoder)
    # a request that caps its drafts runs the iterations too, each accepting at most its cap;
    # one that turns speculation off runs the decode loop's plain steps on the target's graphs
    capped = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_drafts=2)
    assert isinstance(sampled.decoder(capped), IterationDecoder)
    res = sampled.generate(tiny_prompts[1], capped)
    assert res.token_ids == plain_tokens[1]
    assert max(t.drafted for t in res.steps) == 2 and max(t.emitted for t in res.steps) == 3
    assert res.metrics.verify_rows == 8 * res.metrics.steps  # each ran the block's 7 drafts' rows
    off = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, speculate=False)
    assert not isinstance(sampled.decoder(off), IterationDecoder)
    assert sampled.generate(tiny_prompts[1], off).token_ids == plain_tokens[1]
    ladder = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_draft_ladder="1,3,7"))
    seen = []  # a capped request's outcomes move the ladder (or teach adaptive k) only within its cap
    with pytest.MonkeyPatch.context() as m:
        policy = ladder.decoder().loop.policy
        m.setattr(policy, "observe", lambda *a, observe=policy.observe: (seen.append(a), observe(*a)))
        assert ladder.generate(tiny_prompts[1], capped).token_ids == plain_tokens[1]
        assert seen and {key for key, *_ in seen} == {1}  # rung 1 (it climbs): 3 and 7 exceed the cap
        seen.clear()
        assert ladder.generate(tiny_prompts[1], greedy).token_ids == plain_tokens[1]
        assert {key for key, *_ in seen} > {1}


class Scripted:
    """A count policy that plays a fixed sequence of variants, round and round."""

    stats = False

    def __init__(self, keys):
        self.keys, self.i, self.seen = list(keys), 0, []

    def next(self):
        key = self.keys[self.i % len(self.keys)]
        self.i += 1
        return key

    def observe(self, key, emitted, stats=None):
        self.seen.append((key, emitted))

    def reset(self):
        self.i = 0


def test_dflash_variants_share_their_state(engine, tiny_prompts, plain_tokens):
    """One DFlash iteration's variants (counts 0, 1, 3, 7, each its own graph) picked in any
    order decode plain decoding's tokens: a plain variant keeps its row for the drafter, so the
    drafting variants after it still accept; each iteration's outcome reaches the policy."""
    it = DFlashIteration(engine.target, engine.drafters["dflash"], (0, 1, 3, 7), linear="rowwise", slots=SLOTS)
    policy = Scripted([7, 0, 0, 3, 1, 0, 7, 7])
    graphs = EagerGraphs()
    loop = IterationLoop(it, graphs, policy)
    assert graphs.captured == 8  # four counts, greedy and sampled
    for ids, want in zip(tiny_prompts, plain_tokens):
        res = loop.generate(ids, MAX_TOKENS)
        assert res.token_ids == want
        assert all(n <= k + 1 for n, k in zip(res.emitted, res.verified))
    drafting = [(k, n) for k, n in policy.seen if k]
    assert all(n == 1 for k, n in policy.seen if k == 0)
    assert sum(n for _, n in drafting) / len(drafting) > 1.5  # the drafter's context stayed whole


def test_adaptive_k_over_captured_counts(engine, tiny_prompts, plain_tokens):
    """`--dflash-adaptive-k` on whole iterations: a table where drafting pays drafts; one where
    plain steps pay suspends (k = 0, with probes); one where nothing can pay settles on the
    variant that keeps nothing. Plain decoding's tokens throughout."""
    from metrale.runtime.spec.config import SpeculativeConfig, resolve_dflash
    from metrale.runtime.spec.count_policy import CountPolicy

    def run(table: str, tokens: int = MAX_TOKENS):
        spec = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k=table, dflash_reprobe_interval=2)
        settings = resolve_dflash(spec, engine.drafters["dflash"].config.block_size)
        policy = CountPolicy(settings)
        it = DFlashIteration(engine.target, engine.drafters["dflash"], policy.counts, linear="rowwise",
                             settled=True, slots=SLOTS)
        loop = IterationLoop(it, EagerGraphs(), policy)
        prompts = tiny_prompts if tokens == MAX_TOKENS else tiny_prompts[:1]
        res = [loop.generate(ids, tokens) for ids in prompts]
        return [r.token_ids for r in res], [k for r in res for k in r.verified], policy

    got, drafts, _ = run("0:1,1:1.05,2:1.1,3:1.15,4:1.2,5:1.25,6:1.3,7:1.35")
    assert got == plain_tokens and sum(k > 0 for k in drafts) > len(drafts) // 2
    # one long request (each request starts from the prior): suspended, with probes
    got, suspended, policy = run("0:1,1:1.9,2:2.7,3:3.5", 150)
    assert suspended.count(0) > len(suspended) // 2 and any(suspended)
    settled_tokens, settled, policy = run("0:1,1:50,2:50,3:50", 150)  # plain steps throughout
    assert policy.controller.settled and not any(settled) and got == settled_tokens
    assert settled_tokens[0][:MAX_TOKENS] == plain_tokens[0]


@pytest.mark.parametrize("flags", list(COUNT_POLICIES.values()), ids=list(COUNT_POLICIES))
def test_each_request_starts_the_count_policy_afresh(tiny_engine_dir, tiny_prompts, flags):
    """As the decode loop's requests do: a seeded sampled request gives the same tokens, and
    runs the same counts, however many requests ran before it."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, **flags))
    warm = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=32)
    first = gen.generate(tiny_prompts[0], warm)
    gen.generate(tiny_prompts[1], SamplingParams(temperature=0.0, max_tokens=32))
    again = gen.generate(tiny_prompts[0], warm)
    assert again.token_ids == first.token_ids
    assert [s.drafted for s in again.steps] == [s.drafted for s in first.steps]


SAMPLED = ["plain", "dflash k=7 exact", "dflash2 k=7 exact", "mtp k=3 exact", "mtp k=3 stop cum:0.5 exact"]


@pytest.mark.parametrize("mode", SAMPLED)
def test_sampled_iterations_draw_what_plain_sampling_draws(engine, tiny_engine, tiny_prompts, mode):
    """A sampled request on the device: near temperature 0 its draws are greedy decoding's
    tokens (each iteration's rejection sampling accepts exactly the matching drafts); at
    temperature 0.8 a seed gives the same tokens every time, another seed others; plain
    decoding's iteration draws the decode loop's tokens under the same seed (the same
    uniforms in the same order)."""
    loop = IterationLoop(make(engine, mode), EagerGraphs())
    cold = SamplingParams(temperature=0.001, max_tokens=MAX_TOKENS)
    greedy = IterationLoop(make(engine, mode), EagerGraphs())
    for ids in tiny_prompts[:2]:
        assert loop.generate(ids, MAX_TOKENS, params=cold).token_ids == greedy.generate(ids, MAX_TOKENS).token_ids
    warm = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24)
    a = loop.generate(tiny_prompts[0], 24, params=warm).token_ids
    assert loop.generate(tiny_prompts[0], 24, params=warm).token_ids == a
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=12, max_tokens=24)
    assert loop.generate(tiny_prompts[0], 24, params=other).token_ids != a
    if mode == "plain":
        assert EngineGenerator(tiny_engine).generate(tiny_prompts[0], warm).token_ids == a


class _Refusing(EagerGraphs):
    """The stand-in, refusing the captures `refuse(fn)` picks (as a GPU refuses a capture)."""

    def __init__(self, refuse):
        super().__init__()
        self.refuse = refuse

    def capture(self, fn, generators=()):
        if self.refuse(fn):
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(fn, generators)


def test_a_failed_capture_leaves_the_decode_loop(tiny_engine_dir, tiny_prompts, plain_tokens):
    """Iterations that cannot be captured: the decode loop runs instead, and the engine says
    why; sampled variants alone refused: greedy requests iterate, sampled ones run the decode
    loop; lanes refused: serving runs one request at a time."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.decode import Decoder
    from metrale.runtime.spec.iteration_loop import IterationDecoder

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    spec = SpeculativeConfig.from_flags(dflash=True)
    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    iteration = lambda fn: isinstance(fn, functools.partial)  # noqa: E731 - the iterations' captures
    engine.target.runner.graphs = _Refusing(iteration)  # the target's own graphs are captured already
    gen = EngineGenerator(engine, spec)
    assert isinstance(gen.decoder(), Decoder)
    assert gen.generate(tiny_prompts[1], greedy).token_ids == plain_tokens[1]
    assert "whole-iteration graphs failed, the decode loop runs: RuntimeError" in engine.backend_note
    assert gen.capabilities.max_running == 1  # the lanes too: one request at a time on the target's graphs

    engine.target.runner.graphs = _Refusing(lambda fn: iteration(fn) and fn.args[2])  # sampled ones
    gen = EngineGenerator(engine, spec)
    decoder = gen.decoder()
    assert isinstance(decoder, IterationDecoder) and decoder.loop.unsampled.startswith("RuntimeError")
    assert gen.generate(tiny_prompts[1], greedy).token_ids == plain_tokens[1]
    sampled = gen.generate(tiny_prompts[1], SamplingParams(temperature=0.8, seed=2, max_tokens=12))
    assert len(sampled.token_ids) == 12 and sampled.steps  # the decode loop's result

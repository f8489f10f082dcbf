"""The whole-iteration graphs' caches: `step_caches.LaneKV` (each lane's rows attend as matrix
products with its own cache, read once) against `PooledKV`'s row-by-row reductions, and the slot
buckets the iterations are captured for (a request's iterations attend over the first S slots
of its lane's cache, the smallest bucket its positions fit)."""

from __future__ import annotations

import pytest
import torch
from conftest import PLAIN_TOKENS

from metrale.runtime.backends.cuda_graphs import EagerGraphs
from metrale.runtime.models.step_caches import LaneKV, PooledKV, buckets_to
from metrale.runtime.spec.iteration import DFlashIteration, PlainIteration, lanes_of, room
from metrale.runtime.spec.iteration_loop import IterationLanes, IterationLoop, LaneStep
from metrale.runtime.spec.sampling import SamplingParams

NKV, G, HD = 2, 3, 8  # KV heads, query heads per KV head, head size


def _pools(lanes: int, slots: int, seed: int = 0):
    """The same random caches as `PooledKV`'s layout (V [B, S, nkv, hd]) and `LaneKV`'s (V
    [B, nkv, S, hd])."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(lanes, NKV, HD, slots, generator=g, dtype=torch.float64)
    v = torch.randn(lanes, slots, NKV, HD, generator=g, dtype=torch.float64)
    return [k, v], [k.clone(), v.transpose(1, 2).contiguous()]


@pytest.mark.parametrize("lanes,rows,bucket,first", [(1, 1, 40, 0), (3, 4, 24, 0), (4, 1, 40, 0), (2, 6, 16, 0),
                                                     (2, 3, 24, 1)])
def test_lane_attention_is_pooled_attention(lanes, rows, bucket, first):
    """B lanes of R rows each over the first `bucket` slots of a 40-slot pool (lanes from
    `first` on, as `iteration.lanes_of` views them): the rows' K/V land in the pool's own
    memory and every row's attention equals `PooledKV`'s (which reads every slot, the unwritten
    ones past a row masked), with rows that see their own position and rows that see further
    (a drafter's block)."""
    pooled, whole = _pools(first + lanes, 40)
    pooled = [pooled[0][first:], pooled[1][first:]]
    own = [whole[0][first:first + lanes], whole[1][first:first + lanes]]
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, bucket - rows, (lanes, 1), generator=g) + torch.arange(rows)  # [B, R]
    seq = torch.arange(lanes).repeat_interleave(rows)
    k_new = torch.randn(1, NKV, lanes * rows, HD, generator=g, dtype=torch.float64)
    v_new = torch.randn(1, NKV, lanes * rows, HD, generator=g, dtype=torch.float64)
    q = torch.randn(1, NKV * G, lanes * rows, HD, generator=g, dtype=torch.float64)
    for last in (None, (pos[:, -1:] + torch.zeros_like(pos)).reshape(-1)):
        ref = PooledKV(pooled, seq, pos.reshape(-1), last)
        got = LaneKV([own[0][:, :, :, :bucket], own[1][:, :, :bucket]], seq, pos.reshape(-1), last)
        ref.write(0, None, k_new, v_new)
        got.write(0, None, k_new, v_new)
        torch.testing.assert_close(own[0], pooled[0], rtol=0, atol=0)  # written through the views
        torch.testing.assert_close(own[1], pooled[1].transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(got.attend(0, q), ref.attend(0, q), rtol=1e-12, atol=1e-12)


def test_lane_attention_in_bfloat16():
    """In the engines' dtype on a GPU, bfloat16, the two forms differ by its rounding only."""
    from importlib.util import module_from_spec, spec_from_file_location
    from pathlib import Path

    spec = spec_from_file_location("lane_costs", Path(__file__).resolve().parent.parent / "scripts" / "lane_costs.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    assert 0 < module.lane_attention_error("cpu") < 2e-2


def test_lane_attention_refuses_what_it_cannot_run():
    _, own = _pools(2, 8)
    with pytest.raises(ValueError, match="not R rows of each of 2 sequences"):
        LaneKV(own, torch.zeros(3, dtype=torch.long), torch.arange(3))
    with pytest.raises(ValueError, match="no hidden-draft bits"):
        LaneKV(own, torch.zeros(2, dtype=torch.long), torch.arange(2), hide=torch.zeros(2, dtype=torch.long))


def test_slot_buckets():
    assert buckets_to(256) == (256,) and buckets_to(1088) == (256, 1088)
    assert buckets_to(32832) == (256, 1088, 4352, 32832)
    assert room(0) == room(7, 8) == 64  # plain and a block of 8: one bucket for either
    assert room(15, 32) == 2 * 16 + 32


class _Recording(EagerGraphs):
    """The stand-in, noting each replayed iteration's (B, count, sampled, S)."""

    def __init__(self):
        super().__init__()
        self.keys = []

    def replay(self, graph):
        self.keys.append(graph.fn.args)
        super().replay(graph)


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    return load_engine(tiny_engine_dir).pack()


def test_a_request_iterates_in_the_smallest_slot_bucket_it_fits(engine, tiny_prompts, plain_tokens):
    """Caches of 1,088 slots, captured for buckets of 256 and 1,088: a short request replays
    the 256-slot graphs, a long one the whole caches', both with plain decoding's tokens; a
    request past the caches is refused. Exact verify and plain decoding pick the same bucket."""
    context = engine.target.config.max_position_embeddings
    ids = tiny_prompts[0]
    for it in (PlainIteration(engine.target, slots=context + room(0)),
               DFlashIteration(engine.target, engine.drafters["dflash"], 7, exact=True, slots=context + room(7, 8))):
        graphs = _Recording()
        loop = IterationLoop(it, graphs)
        assert it.slot_buckets == (256, 1088) and graphs.captured == 4  # greedy and sampled, each bucket
        short = loop.generate(ids, PLAIN_TOKENS)
        assert short.token_ids == plain_tokens[0] and {k[3] for k in graphs.keys} == {256}
        assert it.check_room(len(ids), 256 - 64 - len(ids)) == 256
        assert it.check_room(len(ids), 256 - 64 - len(ids) + 1) == 1088
        graphs.keys.clear()
        long = loop.generate(ids, 256)  # its positions pass 256
        assert long.token_ids[:PLAIN_TOKENS] == plain_tokens[0] and {k[3] for k in graphs.keys} == {1088}
        with pytest.raises(ValueError, match="need .* cache slots; the iteration's caches hold 1088"):
            loop.generate(ids, context)


def test_lanes_attend_over_the_bucket_of_their_longest_request(engine, tiny_prompts, plain_tokens):
    """Two requests in lanes, a short one (bucket 256) and a long one (1,088): iterations that
    hold the long one's lane attend over 1,088 slots, those of the short one's lane alone over
    256, also while the long one waits; a released lane goes back to position 0, so the small
    bucket holds its rows again. Each request's tokens are plain decoding's."""
    context = engine.target.config.max_position_embeddings
    it = DFlashIteration(engine.target, engine.drafters["dflash"], 7, slots=context + room(7, 8), lanes=2)
    graphs = _Recording()
    lanes = IterationLanes(it, graphs)
    greedy = SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS)
    short, long = lanes.acquire(), lanes.acquire()
    got = {short: [lanes.prefill(short, tiny_prompts[0], greedy, PLAIN_TOKENS)],
           long: [lanes.prefill(long, tiny_prompts[1], greedy, 600)]}
    got[short] += lanes.run([LaneStep(lanes, short)])[0]
    assert graphs.keys[-1][0] == 1 and graphs.keys[-1][3] == 256  # lane 0 alone
    while min(len(t) for t in got.values()) < PLAIN_TOKENS:  # each stepped until its budget
        steps = [LaneStep(lanes, lane) for lane, toks in got.items() if len(toks) < PLAIN_TOKENS]
        for step, toks in zip(steps, lanes.run(steps)):
            got[step.lane] += toks
        assert graphs.keys[-1][0] == 2 and graphs.keys[-1][3] == 1088
    assert got[short][:PLAIN_TOKENS] == plain_tokens[0] and got[long][:PLAIN_TOKENS] == plain_tokens[1]
    lanes.release(long)
    assert int(it.state.pos[long]) == 0 and int(it.kept[long]) == 0
    lanes.run([LaneStep(lanes, short)])
    assert graphs.keys[-1][3] == 256
    lanes.release(short)
    again = lanes.acquire()
    toks = [lanes.prefill(again, tiny_prompts[2], greedy, PLAIN_TOKENS)]
    other = lanes.acquire()  # a lane 1 whose request runs short too: both lanes in bucket 256
    lanes.prefill(other, tiny_prompts[3], greedy, PLAIN_TOKENS)
    while len(toks) < PLAIN_TOKENS:
        toks += lanes.run([LaneStep(lanes, again), LaneStep(lanes, other)])[0]
        assert graphs.keys[-1][3] == 256
    assert toks[:PLAIN_TOKENS] == plain_tokens[2]


def test_a_lane_past_its_bucket_is_refused_before_the_replay(engine, tiny_prompts):
    """A request stepped past its budget would write past the bucket its iterations attend
    over (on a GPU, a device fault inside a graph): the host refuses the iteration first."""
    it = DFlashIteration(engine.target, engine.drafters["dflash"], 7, slots=1088, lanes=1)
    lanes = IterationLanes(it, EagerGraphs())
    ids = tiny_prompts[0]
    budget = 256 - room(7, 8) - len(ids)  # the most the 256-slot bucket holds
    lane = lanes.acquire()
    lanes.prefill(lane, ids, SamplingParams(temperature=0.0, max_tokens=budget), budget)
    emitted = 0
    with pytest.raises(RuntimeError, match="lane 0 at position .* would write past the 256 slots"):
        while True:
            emitted += len(lanes.run([LaneStep(lanes, lane)])[0])
    assert emitted > budget  # refused only past its budget


def test_iteration_pools_are_lane_views(engine):
    """`lanes_of` gives views of the pool (writes through them land in it), K slot-minor and V
    heads-first."""
    it = PlainIteration(engine.target, slots=300, lanes=3)
    views = lanes_of(it.kv, 1, 2, 256)
    c = engine.target.config
    assert views[0].shape == (2, c.num_key_value_heads, c.head_dim, 256)
    assert views[1].shape == (2, c.num_key_value_heads, 256, c.head_dim)
    views[1][1, 0, 5].fill_(7.0)
    assert bool((it.kv[1][2, 0, 5] == 7.0).all())


def test_the_lane_costs_script_measures_a_case(tiny_engine_dir, tmp_path):
    """scripts/lane_costs.py on this CPU (the capture stand-in): a DFlash case of 2 lanes per
    slot bucket, its ops and allocated bytes counted, more bytes in the bigger bucket."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "lane_costs.py"
    out = tmp_path / "costs.json"
    subprocess.run([sys.executable, script, tiny_engine_dir, out, "--lanes", "2", "--modes", "dflash",
                    "--replays", "1"], check=True, capture_output=True, timeout=300)
    cases = json.loads(out.read_text())["cases"]
    assert [(c["lanes"], c["slots"], c["rows"]) for c in cases] == [(2, 256, 8), (2, 1088, 8)]
    assert cases[0]["ops"] == cases[1]["ops"] > 100
    assert 0 < cases[0]["allocated_mb"] < cases[1]["allocated_mb"]

"""CPU engines: the static-cache step modules, the AOTInductor packages `metrale build` compiles,
and the `aoti` backend's promise — every row of a multi-row step is bit-identical to the one-row
step at its position, so chunkwise speculation emits exactly plain greedy decoding's tokens."""

import json
import shutil

import pytest
import torch
from conftest import CHUNKWISE_MODES, assert_verify_rows_are_one_row_steps

from metrale.runtime.artifact.engine_dir import load_manifest
from metrale.runtime.backends.aoti_steps import TargetStep
from metrale.runtime.errors import EngineDirError
from metrale.runtime.models.layers import pack_for_inference


def _kv(target, slots):
    c = target.config
    return [torch.zeros(slots, c.num_key_value_heads, c.head_dim) for _ in range(2 * c.num_hidden_layers)]


def test_target_step_matches_the_model(tiny_recipe):
    """The step module (eager) against the packed model: prefill, then one- and multi-row steps
    at later positions; logits, last hidden and taps (the last layer's after the final norm)."""
    from metrale.runtime.models.loader import load_target

    target = pack_for_inference(load_target(tiny_recipe.target.checkpoint))
    taps = (3, 0, 1)
    step = TargetStep(target, taps).eval()
    ids = torch.randint(0, target.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    kv = _kv(target, 64)
    cache = target.new_cache(1, 64)
    with torch.inference_mode():
        for a, b in ((0, 12), (12, 13), (13, 20)):
            got = step(ids[:, a:b], torch.tensor([a]), *kv)
            want = target(ids[:, a:b], cache, taps=taps)
            assert (got[0] - want.logits).abs().max().item() <= 1e-4
            assert (got[1] - want.last_hidden).abs().max().item() <= 1e-4
            assert (got[2] - want.taps).abs().max().item() <= 1e-4
    assert cache.length == 20


def test_manifest_records_packages_and_what_they_were_built_for(aoti_engine_dir):
    m = json.loads((aoti_engine_dir / "config.json").read_text())
    comps = m["components"]
    cpu = comps["target"]["cpu"]
    # one package per step, its row count dynamic; the target's and the head's over many sequences' rows
    assert [(p["file"], p["rows"], p["dynamic_rows"], p["batched"]) for p in cpu["packages"]] == [
        ("target/cpu/steps.pt2", 64, True, True)]
    assert [(p["file"], p["rows"], p["dynamic_rows"], p["batched"]) for p in comps["mtp"]["cpu"]["packages"]] == [
        ("mtp/cpu/steps.pt2", 64, True, True)]
    # a drafter's propose; DFlash2's also as a tree's, with its selector's tables
    for name, files in (("dflash", ["propose.pt2"]), ("dflash2", ["propose.pt2", "propose_tree.pt2"])):
        packages = comps[name]["cpu"]["packages"]
        assert [p["file"] for p in packages] == [f"{name}/cpu/{f}" for f in files]
        assert [p.get("selector_tables", False) for p in packages] == [f == "propose_tree.pt2" for f in files]
        for pkg in packages:
            assert pkg["feed"] == 8 and pkg["block"] == 8 and pkg["batched"] and pkg["fed_rows"] == 8 * 64
        assert comps[name]["cpu"]["check"]["drafts_equal"] >= 0.9
        assert comps[name]["cpu"]["check"]["batched_equal_alone"] >= 0.9
    assert comps["dflash2"]["cpu"]["check"]["tables_trees_equal"] >= 0.9
    assert "tables_trees_equal" not in comps["dflash"]["cpu"]["check"]
    assert comps["mtp"]["cpu"]["check"]["max_abs_diff_vs_eager"] <= 1e-4
    for info in comps.values():
        for p in info["cpu"]["packages"]:
            assert p["file"] in m["files"] and p["file"] in info["files"] and m["files"][p["file"]]["size"] > 0
        assert info["cpu"]["max_slots"] >= 1024 + 64
    assert cpu["dtype"] == "float32" and cpu["torch"] == torch.__version__.split("+")[0]
    assert cpu["isa"] == torch.backends.cpu.get_cpu_capability() and cpu["taps"] == [0, 1, 3]
    assert cpu["check"]["rows_bit_identical"] is True
    assert cpu["check"]["max_abs_diff_vs_eager"] <= 1e-4


def test_the_drafters_run_on_their_packages(aoti_engine, tiny_engine, tiny_prompts):
    """The aoti backend swaps the MTP head and both drafters for their packages; their drafts
    are the eager drafters' (same verify outcome, step for step, on greedy decoding)."""
    from metrale.runtime.backends.aoti_batched import BatchedMTP
    from metrale.runtime.backends.aoti_dflash import BatchedDFlash
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    assert isinstance(aoti_engine.mtp, BatchedMTP)
    assert all(isinstance(d, BatchedDFlash) for d in aoti_engine.drafters.values())
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for flags in ({"speculative": True, "num_drafts": 3}, {"dflash": True},
                  {"dflash": True, "dflash_drafter": "dflash2", "dflash_gamma": 4}):
        spec = SpeculativeConfig.from_flags(**flags, exact_verify=True)
        same = total = 0
        for ids in tiny_prompts[:4]:
            got = EngineGenerator(aoti_engine, spec).generate(ids, params)
            want = EngineGenerator(tiny_engine, spec).generate(ids, params)
            assert got.token_ids == want.token_ids  # exact verify: plain greedy text on both
            same += sum(a == b for a, b in zip(got.steps, want.steps))
            total += len(want.steps)
        assert same >= 0.9 * total, flags  # the drafts, as seen through each step's acceptance


def test_request_caches_are_sized_to_the_request(aoti_engine):
    target = aoti_engine.target
    assert target.new_cache(1, 40).max_len == 64  # its positions, rounded up to 64 slots
    assert target.new_cache(1, 64).max_len == 64 and target.new_cache(1, 65).max_len == 128
    with pytest.raises(ValueError, match="needs .* cache slots; the CPU packages hold at most"):
        target.new_cache(1, target.max_slots + 1)


@pytest.mark.parametrize("k", range(8))
def test_verify_rows_bit_identical_to_one_row_steps(aoti_engine, k):
    assert_verify_rows_are_one_row_steps(aoti_engine.target, k, seed=100 + k)


def test_aoti_decodes_like_the_eager_target(aoti_engine, tiny_engine, tiny_prompts):
    """Greedy plain decoding on the packages gives the eager backend's tokens."""
    from metrale.runtime.spec.decode import Decoder
    from metrale.runtime.spec.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32)
    eos = tiny_engine.tokenizer.eos_token_ids
    for ids in tiny_prompts:
        want = Decoder(tiny_engine.target, eos).generate(ids, params).token_ids
        got = Decoder(aoti_engine.target, eos).generate(ids, params).token_ids
        assert got == want


SPEC_MODES = CHUNKWISE_MODES + [
    {"dflash": True, "dflash_drafter": "dflash2", "dflash_adaptive_k": "0:1,1:1.2,2:1.3,3:1.4,4:1.5,5:1.6,6:1.7,7:1.8"},
]


@pytest.mark.parametrize("flags", SPEC_MODES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_chunkwise_speculation_emits_plain_greedy_text(aoti_engine, tiny_prompts, flags):
    """Without --exact-verify: the verify rows are the plain steps' rows, so every mode's greedy
    tokens are plain decoding's, token for token."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = EngineGenerator(aoti_engine)
    spec = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**flags))
    for ids in tiny_prompts:
        res = spec.generate(ids, params)
        assert res.token_ids == plain.generate(ids, params).token_ids
        assert res.metrics.drafts_verified > 0


def test_backend_choice(tiny_engine_dir, aoti_engine_dir, tmp_path):
    from metrale.runtime.backends.aoti import check_fingerprint
    from metrale.runtime.backends import load_engine

    assert load_engine(tiny_engine_dir, backend="auto").backend.name == "torch"  # no packages: eager
    assert load_engine(aoti_engine_dir, backend="auto").backend.name == "aoti"
    assert load_engine(aoti_engine_dir, backend="torch").backend.name == "torch"
    with pytest.raises(EngineDirError, match="--backend aoti: .*no CPU packages"):
        load_engine(tiny_engine_dir, backend="aoti")
    # bf16 activations: the packages are float32, so auto runs eager and aoti is refused by name
    assert load_engine(aoti_engine_dir, backend="auto", dtype=torch.bfloat16).backend.name == "torch"
    with pytest.raises(EngineDirError, match="built for dtype 'float32'.*'bfloat16'"):
        load_engine(aoti_engine_dir, backend="aoti", dtype=torch.bfloat16)
    cpu = load_manifest(aoti_engine_dir).components["target"].cpu
    with pytest.raises(EngineDirError, match="built for isa 'AVX512_NOT_HERE'"):
        check_fingerprint(cpu.model_copy(update={"isa": "AVX512_NOT_HERE"}), torch.float32, "x")
    # a package altered on disk is refused by the manifest's checksum, naming it
    copy = tmp_path / "copy"
    shutil.copytree(aoti_engine_dir, copy)
    pkg = copy / "target" / "cpu" / "steps.pt2"
    pkg.write_bytes(pkg.read_bytes()[:-10])
    with pytest.raises(EngineDirError, match="steps.pt2"):
        load_engine(copy, backend="aoti")


def test_packages_of_an_older_layout_are_refused_by_name(aoti_engine_dir, tmp_path):
    """An engine whose CPU packages an older metrale built (slot buckets, no `max_slots`): its
    manifest entry does not parse, so every backend refuses it, naming the field and the rebuild."""
    from metrale.runtime.backends import load_engine

    copy = tmp_path / "old"
    shutil.copytree(aoti_engine_dir, copy)
    manifest = json.loads((copy / "config.json").read_text())
    del manifest["components"]["target"]["cpu"]["max_slots"]
    (copy / "config.json").write_text(json.dumps(manifest))
    for backend in ("auto", "aoti", "torch"):
        with pytest.raises(EngineDirError, match=r"components\['target'\]: its CPU packages are of "
                           r"another layout \(max_slots: Field required.*rebuild it with metrale build"):
            load_engine(copy, backend=backend)


def test_a_drafter_package_feeds_what_its_entry_records(aoti_engine_dir, tmp_path):
    """A drafter package's `fed_rows` is what its face feeds a call: an entry without it (an
    engine built before it) feeds `feed` rows a sequence, and one below `feed` is refused."""
    from metrale.runtime.backends import load_engine

    copy = tmp_path / "engine"
    shutil.copytree(aoti_engine_dir, copy)
    manifest = json.loads((copy / "config.json").read_text())
    (pkg,) = manifest["components"]["dflash"]["cpu"]["packages"]
    del pkg["fed_rows"]
    (copy / "config.json").write_text(json.dumps(manifest))
    engine = load_engine(copy, backend="aoti")
    assert engine.drafters["dflash"].fed_rows == 8 and engine.drafters["dflash2"].fed_rows == 512
    pkg["fed_rows"] = 4
    (copy / "config.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineDirError, match="feeds 4 context rows a call, fewer than its 8 a sequence"):
        load_engine(copy, backend="aoti")


def test_batched_head_entries_equal_each_chain_alone(aoti_engine, tiny_engine):
    """The MTP head's entries for several sequences' chains in one call (a prompt's rows, chain
    links, two pools) equal each sequence's entries run alone, and the eager head's."""
    from metrale.runtime.steps import HeadForward
    from metrale.runtime.backends.aoti_batched import BatchedMTP

    head = aoti_engine.mtp
    assert isinstance(head, BatchedMTP)
    eager = tiny_engine.mtp  # the same weights, eager
    gen = torch.Generator().manual_seed(3)
    h = head.config.decoder.hidden_size
    embeds, hidden = torch.randn(4, 1, 20, h, generator=gen), torch.randn(4, 1, 20, h, generator=gen)
    lengths = (40, 40, 40, 90)
    splits = [[12, 1, 1, 1], [1] * 6, [3, 3], [20]]
    together = [head.new_cache(1, n, embeds.dtype) for n in lengths]
    got = [[] for _ in lengths]
    done = [0] * len(lengths)
    for step in range(max(map(len, splits))):
        who = [b for b in range(len(lengths)) if step < len(splits[b])]
        needs = [HeadForward(head, embeds[b][:, done[b]:done[b] + splits[b][step]],
                             hidden[b][:, done[b]:done[b] + splits[b][step]], together[b]) for b in who]
        for b, out in zip(who, head.forward_many(needs)):
            got[b].append(out)
            done[b] += splits[b][step]
    for b, n in enumerate(lengths):
        assert together[b].length == done[b]
        alone = head.new_cache(1, n, embeds.dtype)
        want = head(embeds[b][:, :done[b]], hidden[b][:, :done[b]], alone)
        for i in range(2):  # logits, h
            mine = torch.cat([o[i] for o in got[b]], dim=1)
            assert torch.allclose(mine, want[i], atol=1e-5, rtol=0), (b, i, (mine - want[i]).abs().max())
        ref = eager(embeds[b][:, :done[b]], hidden[b][:, :done[b]], eager.new_cache(1, n, embeds.dtype))
        assert (want[0] - ref[0]).abs().max() < 1e-4


@pytest.mark.parametrize("fed_rows, eager_rows", [(512, []), (32, [11, 11]), (8, None)],
                         ids=["backlogs through the package", "shared when they do not fit", "older rows eagerly"])
@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_batched_proposes_equal_each_sequence_alone(aoti_engine, tiny_engine, name, fed_rows, eager_rows, monkeypatch):
    """Five sequences' blocks proposed in one drafter call (contexts fed in steps of different
    sizes, backlogs longer than a package's feed, caches in two pools, γ 8 and 4) are the
    drafts each sequence gets alone, and the eager drafter's; a call that fails moves no cache.
    The package feeds the backlogs whole, as its manifest entry's `fed_rows` lets it, where
    they fit in it together; where they do not, each sequence gets an equal share of it (at
    least `feed`), and its older rows go through the eager context projection first, with the
    same drafts: of the five sequences' last feeds, 33 rows, 19 are one sequence's, of which 11
    past the share of 32 / 5 -> 8."""
    from metrale.runtime.steps import DraftForward
    from metrale.runtime.backends.aoti_dflash import BatchedDFlash

    drafter, eager = aoti_engine.drafters[name], tiny_engine.drafters[name]
    assert isinstance(drafter, BatchedDFlash) and drafter.fed_rows == 512
    monkeypatch.setattr(drafter, "fed_rows", fed_rows)
    projected = []
    context_kv = drafter.eager.context_kv
    monkeypatch.setattr(drafter.eager, "context_kv", lambda rows, *a: projected.append(rows.shape[1]) or
                        context_kv(rows, *a))
    target, embed = tiny_engine.target, tiny_engine.target.model.embed_tokens
    ids = torch.randint(0, target.config.vocab_size, (5, 24), generator=torch.Generator().manual_seed(5))
    equal = total = 0
    with torch.inference_mode():
        taps = [target(ids[b:b + 1], target.new_cache(1, 32), taps=eager.config.target_layer_ids).taps
                for b in range(5)]
        dtype = taps[0].dtype
        for gamma in (8, 4):
            sizes = (40, 40, 100, 40, 40)
            caches = [drafter.new_cache(1, n, dtype) for n in sizes]
            solo = [drafter.new_cache(1, n, dtype) for n in sizes]
            ref = [eager.new_cache(1, 40, dtype) for _ in sizes]
            schedule = [(12, 13, 20, 24), (3, 4, 5, 24), (1, 9, 17, 24), (2, 4, 6, 8), (9, 18, 20, 21)]
            done = [0] * 5
            for step in range(4):
                needs = []
                for b in range(5):
                    rows = taps[b][:, done[b]:schedule[b][step]]
                    done[b] = schedule[b][step]
                    for face, cache in ((drafter, caches[b]), (drafter, solo[b]), (eager, ref[b])):
                        face.add_context(rows, cache)
                    needs.append(DraftForward(drafter, ids[b, done[b] - 1:done[b]], embed, caches[b], gamma))
                if step == 1:  # a batch with a bad γ fails as a whole: nothing moved, retried fine
                    before = [(c.length, len(c.pending)) for c in caches]
                    bad = DraftForward(drafter, needs[0].anchor, embed, caches[0], 1)
                    with pytest.raises(ValueError, match="γ = 1"):
                        drafter.forward_many([*needs[1:], bad])
                    assert [(c.length, len(c.pending)) for c in caches] == before
                for b, got in enumerate(drafter.forward_many(needs)):
                    alone = drafter.propose(needs[b].anchor, embed, solo[b], gamma).tokens
                    want = eager.propose(needs[b].anchor, embed, ref[b], gamma).tokens
                    assert torch.equal(got.tokens, alone) and got.tokens.shape == (1, gamma - 1)
                    equal, total = equal + int((got.tokens == want).sum()), total + want.numel()
                assert [c.length for c in caches] == done and all(not c.pending for c in caches)
    assert equal >= 0.9 * total  # the eager drafter's drafts, but for a rare near-tie
    if eager_rows is None:  # 8 a call: the first feeds of 12 and 9 rows, also alone, past the 8
        assert 4 in projected and 1 in projected
    else:
        assert projected == eager_rows


def test_leaving_cores_to_another_process_splits_steps_over_fewer_lanes(aoti_engine, tiny_engine,
                                                                       monkeypatch):
    from metrale.runtime.serving.service import EngineGenerator

    target = aoti_engine.target
    before = target.lanes
    try:
        for threads, lanes in ((4, 3), (2, 1), (1, 1)):
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            assert EngineGenerator(aoti_engine).leave_cores(1) == lanes == target.lanes.n
    finally:
        target.lanes = before
    assert EngineGenerator(tiny_engine).leave_cores(1) is None  # eager steps: nothing to split


def test_batched_forward_rows_equal_each_sequence_alone(aoti_engine, lanes):
    """One forward over several sequences (prefills, verifies and plain steps of different
    lengths, in two pools, while a pool grows; its calls on one thread or split over two) gives
    every sequence the bits it gets alone, and freed places are reused."""
    from metrale.runtime.backends.aoti_batched import BatchedTarget
    from metrale.runtime.steps import Forward

    target = aoti_engine.target
    assert isinstance(target, BatchedTarget) and target.lanes.n == lanes
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, target.config.vocab_size, (6, 30), generator=gen)
    lengths = (40, 40, 40, 40, 40, 90)  # five in one pool (it grows past 4), one in another
    splits = [[9, 1, 4, 1], [1] * 15, [15], [3, 3, 3, 3, 3], [8, 7], [2, 13]]
    caches = [target.new_cache(1, n) for n in lengths]
    got, done = [[] for _ in ids], [0] * len(ids)
    with torch.inference_mode():
        for step in range(max(map(len, splits))):
            who = [b for b, s in enumerate(splits) if step < len(s)]
            forwards = [Forward(ids[b:b + 1, done[b]:done[b] + splits[b][step]], caches[b], (0, 1, 3)) for b in who]
            for b, out in zip(who, target.forward_many(forwards)):
                got[b].append(out)
                done[b] += splits[b][step]
        pools = {id(c.pool) for c in caches}
        assert len(pools) == 2 and max(c.pool.capacity for c in caches) == 8
        for b in range(len(ids)):
            alone = target.new_cache(1, lengths[b])
            ones = [target(ids[b:b + 1, i:i + 1], alone, taps=(0, 1, 3)) for i in range(15)]
            for field in ("logits", "last_hidden", "taps"):
                assert torch.equal(torch.cat([getattr(o, field) for o in got[b]], 1),
                                   torch.cat([getattr(o, field) for o in ones], 1)), (b, field)
    # a prompt's forward with only its last row's logits (split across two package calls)
    cache, alone = target.new_cache(1, 100), target.new_cache(1, 100)
    long = torch.randint(0, target.config.vocab_size, (1, target.max_rows + 9), generator=gen)
    with torch.inference_mode():
        (last,) = target.forward_many([Forward(long, cache, (0, 1, 3), last_logits=True)])
        whole = target(long, alone, taps=(0, 1, 3))
    assert last.logits.shape[1] == 1 and torch.equal(last.logits[0, -1], whole.logits[0, -1])
    assert torch.equal(last.taps, whole.taps) and last.argmax == whole.argmax[-1:]
    pool = caches[0].pool
    before = pool.in_use
    del caches, alone
    import gc

    gc.collect()
    assert pool.in_use < before  # freed caches gave their places back


def test_a_batched_forward_refuses_rows_past_a_cache(aoti_engine):
    from metrale.runtime.steps import Forward

    target = aoti_engine.target
    cache = target.new_cache(1, 10)
    cache.length = cache.max_len - 1
    with pytest.raises(ValueError, match="exceed the cache's"):
        target.forward_many([Forward(torch.zeros(1, 2, dtype=torch.long), cache)])
    assert cache.length == cache.max_len - 1  # refused before anything ran


def test_a_suspended_adaptive_stream_keeps_nothing_and_reruns_its_rows(aoti_engine, tiny_prompts, monkeypatch):
    """On the row-invariant packages a suspended adaptive-k stream's plain steps are plain
    decoding's (one row, no taps, nothing kept); before each probe its rows run again (the
    catch-up), so the drafter gets the context that following each step gives: the same steps,
    drafts and acceptances as a stream whose proposer follows, and plain decoding's tokens."""
    from metrale.runtime.steps import Forward
    from metrale.runtime.spec import decode
    from metrale.runtime.spec.adaptive_k import AdaptiveKController
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator

    monkeypatch.setattr(AdaptiveKController, "PROBE_BUDGET", float("inf"))  # probes every 4 or so
    spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2", dflash_reprobe_interval=4,
                                        dflash_adaptive_k="0:1,1:1.7,2:2.4,3:3.1")
    params = SamplingParams(temperature=0.0, max_tokens=48)
    forwards, real = [], decode.run_forwards
    monkeypatch.setattr(decode, "run_forwards",
                        lambda t, needs: (forwards.extend((n.rows, bool(n.taps)) for n in needs if type(n) is Forward),
                                          real(t, needs))[1])
    plain = EngineGenerator(aoti_engine).generate(tiny_prompts[0], params)
    forwards.clear()
    rerun = EngineGenerator(aoti_engine, spec).generate(tiny_prompts[0], params)
    rerun_forwards = list(forwards)
    forwards.clear()
    monkeypatch.setattr(type(aoti_engine), "rows_invariant", property(lambda self: False))
    followed = EngineGenerator(aoti_engine, spec).generate(tiny_prompts[0], params)
    assert rerun.token_ids == followed.token_ids == plain.token_ids
    assert rerun.steps == followed.steps
    probes = sum(1 for s in rerun.steps if s.drafted)
    assert probes >= 2
    # following: every decode step's row carries taps; rerunning: only the catch-ups and the
    # probes' verifies do, and the plain steps' one-row forwards carry none
    assert all(taps for _, taps in forwards[1:])
    plain_rows = [rows for rows, taps in rerun_forwards[1:] if not taps]
    assert plain_rows and set(plain_rows) == {1}
    tapped = [rows for rows, taps in rerun_forwards[1:] if taps]
    assert len(tapped) >= 2 * probes - 1  # a catch-up and a verify per probe (none before the first)
    assert sum(plain_rows) == len(rerun.steps) - probes

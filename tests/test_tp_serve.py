"""`--draft-tp-size` resolved at startup, as the seed defines it, over gloo in separate processes:

- a rank's shard is cut at load from a one-rank engine directory (`auto` on any world size),
  also from weights requantized at load to another tier;
- `--draft-tp-size 1` on a world runs the whole drafter on rank 0 only and relays its drafts
  (the other ranks load no drafter), adaptive k's retirement included;
- KV heads split unevenly (4 over 3 ranks: 2, 1, 1), drafts equal to one rank's;
- draft trees over the sharded drafter, with the eager target or the captured one (the capture
  stand-in, as auto loads a target on CUDA), the one rank's trees node for node;
- a bfloat16 world's row claim (`LoadedEngine.pack`'s probe) withdrawn on every rank where one
  rank's probe withdrew it.

Run as a script (`python tests/test_tp_serve.py SCENARIO RANK WORLD PORT ARGS_JSON OUT`) this
file is one rank of a scenario; the fixtures below start every rank and compare with one rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metrale.runtime.models.configs import DecoderConfig, DFlashConfig
from metrale.runtime.models.tp import TensorParallel, World, cut_tensor, drafter_cut, merge_drafter_state

GREEDY_TOKENS = 20
UNEVEN = dict(heads=8, kv_heads=4, head_dim=16, hidden=64, inter=96, vocab=512)


def uneven_config(version: int) -> DFlashConfig:
    d = UNEVEN
    decoder = DecoderConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=2,
                            num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
                            head_dim=d["head_dim"], intermediate_size=d["inter"], rms_norm_eps=1e-6,
                            rope_theta=10000.0, max_position_embeddings=64)
    return DFlashConfig(decoder=decoder, block_size=8, target_layer_ids=(0, 1), mask_token_id=3,
                        target_hidden_size=d["hidden"], version=version,
                        conv_groups=8 if version == 2 else 0, selector_dim=16 if version == 2 else 0)


def uneven_job(version: int):
    """A seeded random drafter at fp8 (ModelOpt), its embedding and a context: the same on every
    process. -> (config, one-rank engine state, embedding, context features, anchor)."""
    from metrale.builder.quantize import quantize_drafter
    from metrale.runtime.models.dflash import DFlashDrafter

    cfg = uneven_config(version)
    torch.manual_seed(1234 + version)
    whole = DFlashDrafter(cfg)
    for p in whole.parameters():  # matrices random, norms left at one
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.08)
    state, _ = quantize_drafter(whole.engine_state(), "fp8")
    embed = torch.nn.Embedding(cfg.decoder.vocab_size, cfg.decoder.hidden_size)
    torch.nn.init.normal_(embed.weight, std=0.5)
    features = torch.randn(1, 12, 2 * cfg.target_hidden_size)
    return cfg, state, embed, features, torch.tensor([7])


def propose_with(cfg, state, embed, features, anchor, tp: TensorParallel | None):
    from metrale.runtime.models.dflash import DFlashDrafter
    from metrale.runtime.artifact.engine import fill_engine_state

    if tp is not None:
        state = {n: cut_tensor(n, t, drafter_cut(n, cfg), tp.rank, tp.size) for n, t in state.items()}
    drafter = fill_engine_state(DFlashDrafter(cfg, tp), state, "test").eval()
    with torch.no_grad():
        cache = drafter.new_cache(1, 32, torch.float32)
        drafter.add_context(features, cache)
        return drafter.propose(anchor, embed, cache, cfg.block_size)


def _decode_all(gen, prompts, world) -> list | None:
    from metrale.runtime.spec.sampling import SamplingParams

    if not world.leader:  # record what this rank decoded while following
        seen, make = [], gen.decoder

        def recording(params=None):
            decoder = make(params)
            run = decoder.generate
            decoder.generate = lambda *a, **k: seen.append(run(*a, **k)) or seen[-1]
            return decoder

        gen.decoder = recording
        gen.follow()
        return seen
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    out = [gen.generate(ids, greedy) for ids in prompts]
    out.append(gen.generate(prompts[0], SamplingParams(temperature=0.8, seed=5, max_tokens=12)))
    gen.shutdown()
    return out


def _worker(scenario: str, rank: int, world_size: int, port: int, args: dict, out_file: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from metrale.runtime.serving.service import load_generator
    from metrale.runtime.spec.config import SpeculativeConfig

    world = World.from_env("cpu")
    res: dict = {}
    if scenario == "uneven":
        tp = TensorParallel(world.rank, world.size)
        res["proposals"] = {v: propose_with(*uneven_job(v), tp) for v in (1, 2)}
    elif scenario == "claims":  # each rank's probe says what `claims` gives it
        from metrale.runtime.artifact import engine as engine_mod
        from metrale.runtime.models.layers import Attention

        for label, claims in args["claims"].items():
            engine_mod.probe_invariant = lambda *a, claim=claims[rank]: claim
            gen = load_generator(args["engine_dir"], SpeculativeConfig.from_flags(dflash=True),
                                 dtype=torch.bfloat16, backend="torch")
            modules = {m.row_invariant for m in gen.engine.target.modules() if isinstance(m, Attention)}
            res[label] = (gen.engine.eager_invariant, gen.engine.rows_invariant, modules)
    else:  # decode through load_generator: the startup path of generate and serve
        for label, run in args["runs"].items():
            flags, backend = spec_flags(run)
            spec = SpeculativeConfig.from_flags(dflash=True, **flags)
            states = None
            if spec.draft_weight_quantization is not None:
                from metrale.builder.requantize import states_for
                from metrale.runtime.artifact.engine_dir import load_manifest

                states = states_for(args["engine_dir"], load_manifest(args["engine_dir"]), spec)
            with captured_target(backend == "eager-graphs"):
                gen = load_generator(args["engine_dir"], spec, states=states, backend="torch")
            res[label] = {"relay": gen.relay, "drafters": sorted(gen.engine.drafters),
                          "backend": gen.engine.backend.name,
                          "tp": [getattr(d, "tp", None) is not None for d in gen.engine.drafters.values()],
                          "decodes": _decode_all(gen, args["prompts"], world)}
            # the all-gathers of the sharded drafters (one per propose, a tree's candidates in it;
            # the drafters share the world's one `TensorParallel`)
            tps = {id(d.tp): d.tp for d in gen.engine.drafters.values() if getattr(d, "tp", None)}
            res[label]["gathers"] = sum(tp.stats.calls.get("all_gather", 0) for tp in tps.values())
    torch.save(res, out_file)
    world.close()


@contextlib.contextmanager
def captured_target(on: bool):
    """With `on`, the serve's engine loads as auto loads it on CUDA: the target's steps captured,
    here on the capture stand-in (`cuda_graphs.EagerGraphs`), the drafter eager and sharded."""
    from metrale.runtime.serving import service

    if not on:
        yield
        return
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs

    load = service.load_engine

    def loading(*args, **kw):
        engine = load(*args, **kw)
        use_cuda_graphs(engine, graphs=EagerGraphs())
        return engine

    service.load_engine = loading
    try:
        yield
    finally:
        service.load_engine = load


def run_ranks(scenario: str, size: int, args: dict, tmp: Path) -> list[dict]:
    """Start `size` processes of `_worker` (gloo) and return each rank's results."""
    (tmp / "args.json").write_text(json.dumps(args))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, scenario, str(r), str(size), str(port),
                               str(tmp / "args.json"), str(tmp / f"rank{r}.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
             for r in range(size)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} failed:\n{text[-4000:]}"
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(size)]


# -- uneven KV heads ---------------------------------------------------------------------------

def test_uneven_shards_put_back_are_the_one_rank_bytes():
    from metrale.runtime.models.tp import local_decoder

    cfg, state, *_ = uneven_job(2)
    shards = [{n: cut_tensor(n, t, drafter_cut(n, cfg), r, 3) for n, t in state.items()} for r in range(3)]
    assert [local_decoder(cfg.decoder, r, 3).num_key_value_heads for r in range(3)] == [2, 1, 1]
    assert [local_decoder(cfg.decoder, r, 3).num_attention_heads for r in range(3)] == [4, 2, 2]
    q = "layers.0.self_attn.q_proj.weight"
    assert [s[q].shape[0] for s in shards] == [64, 32, 32]  # query heads follow their KV heads
    merged = merge_drafter_state(shards, cfg)
    for n, t in state.items():
        assert torch.equal(merged[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n


def test_three_ranks_with_uneven_kv_heads_draft_the_one_rank_tokens(tmp_path):
    ranks = run_ranks("uneven", 3, {}, tmp_path)
    for version in (1, 2):
        want = propose_with(*uneven_job(version), None)
        for rank, res in enumerate(ranks):
            got = res["proposals"][version]
            assert torch.equal(got.tokens, want.tokens), (version, rank)
            start = got.vocab_start
            diff = (got.logits - want.logits[..., start:start + got.logits.shape[-1]]).abs().max().item()
            assert diff < 1e-4, (version, rank, diff)  # only the all-reduce's order differs


# -- startup on a world: cut at load, or the drafter on rank 0 --------------------------------------

RUNS = {
    "auto": {"draft_tp_size": "auto", "dflash_drafter": "dflash2"},
    "auto-nvfp4": {"draft_tp_size": "auto", "draft_weight_quantization": "nvfp4"},
    "rank0": {"draft_tp_size": "1", "dflash_drafter": "dflash2"},
    "rank0-adaptive": {"draft_tp_size": "1", "dflash_adaptive_k": "0:1,1:40,2:41,3:42,4:43,5:44,6:45,7:46"},
    # draft trees: every rank builds the tree from the candidates gathered over the ranks' vocab
    # slices, or the leader's tree relayed
    "auto-tree": {"draft_tp_size": "auto", "dflash_tree_budget": 16},
    "auto-tree-dflash2": {"draft_tp_size": "auto", "dflash_drafter": "dflash2", "dflash_tree_budget": 16},
    "rank0-tree": {"draft_tp_size": "1", "dflash_drafter": "dflash2", "dflash_tree_budget": 16},
    # a captured target (the capture stand-in) with the sharded eager drafter's trees
    "auto-tree-graphs": {"draft_tp_size": "auto", "dflash_tree_budget": 16, "backend": "eager-graphs"},
}


def spec_flags(run: dict) -> tuple[dict, str]:
    """A run's speculative flags and its backend (the torch backend unless it names one)."""
    flags = dict(run)
    return flags, flags.pop("backend", "torch")


# -- the row claim, the same on every rank -------------------------------------------------------

def test_a_row_claim_one_rank_withdrew_is_withdrawn_on_every_rank(tiny_engine_dir, tmp_path):
    """Ranks decode in lockstep, so a bfloat16 world holds `pack`'s row claim only where every
    rank's probe made it (here each rank's verdict is given, as CPUs that differ would give)."""
    claims = {"all": [True, True], "one": [True, False], "none": [False, False]}
    ranks = run_ranks("claims", 2, {"engine_dir": str(tiny_engine_dir), "claims": claims}, tmp_path)
    for rank, res in enumerate(ranks):
        assert res["all"] == (True, True, {True}), rank
        assert res["one"] == (False, False, {False}), rank
        assert res["none"] == (False, False, {False}), rank


@pytest.fixture(scope="module")
def two_rank_serves(tiny_engine_dir, tiny_prompts, tmp_path_factory):
    args = {"engine_dir": str(tiny_engine_dir), "prompts": tiny_prompts[:3], "runs": RUNS}
    return run_ranks("serve", 2, args, tmp_path_factory.mktemp("tp_serve"))


def one_rank_decodes(engine_dir, prompts, flags):
    from metrale.builder.requantize import states_for
    from metrale.runtime.artifact.engine_dir import load_manifest
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import load_generator
    from metrale.runtime.spec.config import SpeculativeConfig

    spec = SpeculativeConfig.from_flags(dflash=True, **{**spec_flags(flags)[0], "draft_tp_size": None})
    gen = load_generator(engine_dir, spec, backend="torch",
                         states=states_for(engine_dir, load_manifest(engine_dir), spec))
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    return [gen.generate(ids, greedy) for ids in prompts] + [
        gen.generate(prompts[0], SamplingParams(temperature=0.8, seed=5, max_tokens=12))]


@pytest.mark.parametrize("label", list(RUNS))
def test_a_two_rank_serve_decodes_as_one_rank(two_rank_serves, tiny_engine_dir, tiny_prompts, label):
    leader, follower = (r[label] for r in two_rank_serves)
    want = one_rank_decodes(tiny_engine_dir, tiny_prompts[:3], RUNS[label])
    for got, ref in zip(leader["decodes"], want, strict=True):
        assert got.token_ids == ref.token_ids, label
        assert [s.accepted for s in got.steps] == [s.accepted for s in ref.steps], label
    for got, mine in zip(leader["decodes"], follower["decodes"], strict=True):  # in step
        assert mine.token_ids == got.token_ids, label
        assert [s.drafted for s in mine.steps] == [s.drafted for s in got.steps], label
    if "tree" in label:  # the trees verified: the one rank's, node for node
        assert max(s.drafted for d in leader["decodes"] for s in d.steps) == 16
        for got, ref in zip(leader["decodes"], want):
            assert [s.drafted for s in got.steps] == [s.drafted for s in ref.steps], label
    assert leader["backend"] == spec_flags(RUNS[label])[1]
    if label.startswith("auto"):  # the one-rank engine cut at load: every rank holds a shard
        assert not leader["relay"] and all(leader["tp"]) and all(follower["tp"])
        proposes = sum(1 for d in leader["decodes"] for s in d.steps if s.drafted)
        assert leader["gathers"] == follower["gathers"] == proposes, label
    else:  # the drafter lives on rank 0 only; the other rank received its drafts
        assert leader["relay"] and follower["relay"] and follower["drafters"] == []
        assert leader["drafters"] == ["dflash", "dflash2"] and not any(leader["tp"])


def test_the_adaptive_rank0_serve_settled_and_still_matched(two_rank_serves):
    steps = two_rank_serves[0]["rank0-adaptive"]["decodes"][0].steps
    assert steps[-1].drafted == 0  # the table makes no draft count pay: speculation retired


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
            json.loads(Path(sys.argv[5]).read_text()), sys.argv[6])
    # the results are on disk: leave without running the process group's destructors, whose
    # threads can abort the process at interpreter exit on a loaded machine
    sys.stdout.flush()
    os._exit(0)

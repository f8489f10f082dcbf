"""Drafter tensor parallelism (runtime.models.tp, builder.shard): the cut layout worked out by hand,
shards that put back together are the one-rank bytes for every tier, the refusals, and two
ranks over gloo (separate processes) drafting exactly what one rank drafts.

Run as a script (`python tests/test_tp.py RANK PORT ENGINE_DIR PROMPTS OUT`) this file is one
rank of the two-rank check; the test below starts both ranks and compares their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from metrale.runtime.models.configs import DecoderConfig, DFlashConfig
from metrale.runtime.errors import ConfigError, EngineDirError, MetraleError
from metrale.runtime.models.tp import (
    Cut, TensorParallel, World, cut_tensor, drafter_cut, local_decoder, merge_drafter_state,
    merge_tensor, shard_range, torchrun_argv,
)

GREEDY_TOKENS = 24
DRAFTERS = ("dflash", "dflash2")


def make_config(*, heads=4, kv_heads=2, head_dim=32, hidden=128, inter=256, layers=2,
                vocab=2048, version=2) -> DFlashConfig:
    """The tiny drafters' shapes unless told otherwise."""
    decoder = DecoderConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, intermediate_size=inter, rms_norm_eps=1e-6,
                            rope_theta=10000.0, max_position_embeddings=64)
    return DFlashConfig(decoder=decoder, block_size=8, target_layer_ids=(0, 1, 3),
                        mask_token_id=3, target_hidden_size=hidden, version=version,
                        conv_groups=8 if version == 2 else 0, selector_dim=32 if version == 2 else 0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# -- the layout ------------------------------------------------------------------------------

def test_shard_range_covers_in_order_with_sizes_differing_by_at_most_one():
    assert [shard_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [shard_range(2048, r, 2) for r in range(2)] == [(0, 1024), (1024, 2048)]
    for total in range(0, 13):
        for size in range(1, 6):
            ranges = [shard_range(total, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            lengths = [e - s for s, e in ranges]
            assert max(lengths) - min(lengths) <= 1


def test_drafter_cut_table():
    cfg = make_config()  # heads 4, kv 2, hd 32, intermediate 256, vocab 2048, 2 layers
    want = {
        "layers.0.self_attn.q_proj.weight": Cut(0, 1, 2, 64),  # per KV head: its 2 query heads
        "layers.1.self_attn.k_proj.weight_scale": Cut(0, 1, 2, 32),
        "layers.1.self_attn.v_proj.weight": Cut(0, 1, 2, 32),
        "layers.0.self_attn.o_proj.weight": Cut(1, 1, 2, 64),
        "layers.0.mlp.gate_proj.weight": Cut(0, 1, 256, 1),
        "layers.0.mlp.up_proj.weight": Cut(0, 1, 256, 1),
        "layers.1.mlp.down_proj.weight_scale": Cut(1, 1, 256, 1),
        "lm_head.weight": Cut(0, 1, 2048, 1),
        "context_kv_proj.weight": Cut(0, 4, 2, 32),  # 2 layers × (k, v), 2 heads of 32 rows
    }
    for name, cut in want.items():
        assert drafter_cut(name, cfg) == cut, name
    replicated = ["fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight",
                  "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.o_proj.weight_scale_2",
                  "layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
                  "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight"]
    assert all(drafter_cut(n, cfg) is None for n in replicated)


def test_context_kv_rows_go_to_their_heads_per_layer():
    # 2 layers, 2 KV heads of 1 row: rows are [k0h0, k0h1, v0h0, v0h1, k1h0, k1h1, v1h0, v1h1]
    cfg = make_config(heads=2, kv_heads=2, head_dim=1, hidden=4, inter=4, vocab=32)
    w = torch.arange(8.0)[:, None].expand(8, 4).contiguous()
    cut = drafter_cut("context_kv_proj.weight", cfg)
    shards = [cut_tensor("context_kv_proj.weight", w, cut, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 4, 6] and shards[1][:, 0].tolist() == [1, 3, 5, 7]
    assert torch.equal(merge_tensor("context_kv_proj.weight", shards, cut), w)


def test_fp8_column_cut_keeps_the_row_scale_and_the_partial_products_sum():
    from metrale.builder.quantize import quantize_fp8
    from metrale.plugins.formats import dequantize_fp8

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(6, 64, generator=g), torch.randn(5, 64, generator=g)
    q = quantize_fp8(w)
    cut = Cut(1, 1, 4, 16)  # 4 heads of 16 columns
    parts = [{k: cut_tensor(k, v, cut, r, 2) for k, v in q.items()} for r in range(2)]
    assert all(torch.equal(p["weight_scale"], q["weight_scale"]) for p in parts)  # [out]: whole rows
    whole = x @ dequantize_fp8(q["weight"], q["weight_scale"]).T  # [5, 6]
    summed = sum(x[:, 32 * r:32 * (r + 1)] @ dequantize_fp8(p["weight"], p["weight_scale"]).T
                 for r, p in enumerate(parts))
    assert torch.allclose(summed, whole, atol=1e-5)
    assert torch.equal(as_bytes(merge_tensor("w", [p["weight"] for p in parts], cut)), as_bytes(q["weight"]))


def test_nvfp4_column_cut_equals_quantizing_each_slice_with_the_whole_global_scale():
    from metrale.builder.quantize import nvfp4_global_scale, quantize_nvfp4

    g = torch.Generator().manual_seed(4)
    w = torch.randn(4, 64, generator=g)
    w[:, 32:] *= 0.1  # the right half alone would have another global scale
    q = quantize_nvfp4(w)
    cut = Cut(1, 1, 4, 16)
    for r in range(2):
        part = {k: cut_tensor(k, v, cut, r, 2) for k, v in q.items()}
        assert part["weight"].shape == (4, 16) and part["weight_scale"].shape == (4, 2)
        own = quantize_nvfp4(w[:, 32 * r:32 * (r + 1)], global_scale=nvfp4_global_scale(w))
        for key in ("weight", "weight_scale", "weight_scale_2"):
            assert torch.equal(as_bytes(part[key]), as_bytes(own[key])), (r, key)
    # 3 heads of 16 over 2 ranks: 32 | 16 columns fall on blocks; heads of 8 would not
    with pytest.raises(ConfigError, match=r"at weight 8\.\.16 of each 16, off its 16-weight"):
        cut_tensor("o.weight_scale", q["weight_scale"][:, :1], Cut(1, 1, 2, 8), 1, 2)


def test_local_shapes_of_a_rank():
    cfg = make_config()
    local = local_decoder(cfg.decoder, 1, 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.intermediate_size, local.vocab_size, local.hidden_size) == (128, 1024, 128)
    from metrale.runtime.models.dflash import DFlashDrafter

    drafter = DFlashDrafter(cfg, TensorParallel(1, 2))  # built without joining any group
    a, mlp = drafter.layers[0].self_attn, drafter.layers[0].mlp
    assert (a.q_proj.weight.shape, a.k_proj.weight.shape, a.o_proj.weight.shape) == (
        (64, 128), (32, 128), (128, 64))
    assert (mlp.gate_proj.weight.shape, mlp.down_proj.weight.shape) == ((128, 128), (128, 128))
    assert drafter.lm_head.weight.shape == (1024, 128) and drafter.vocab_start == 1024
    assert drafter.candidate_selector.successor_codebook.shape == (2048, 32)  # replicated
    assert drafter.new_cache(1, 8, torch.float32).k.shape == (2, 1, 1, 8, 32)


# -- refusals ------------------------------------------------------------------------------------

def test_check_drafter_tp_refusals_name_the_numbers():
    from metrale.builder.shard import check_drafter_tp

    cfg = make_config()
    check_drafter_tp(cfg, 2, "nvfp4")  # o_proj 64 | 64 and down_proj 128 | 128 columns
    with pytest.raises(ConfigError, match="at least 1, got 0"):
        check_drafter_tp(cfg, 0, "fp8")
    with pytest.raises(ConfigError, match="drafter's 2 KV heads do not cover 3 ranks; expected "
                                          "at most 2 ranks"):
        check_drafter_tp(cfg, 3, None)
    # 4 heads of 8: one head per rank is 8 columns of o_proj, half an NVFP4 block
    small = make_config(heads=4, kv_heads=4, head_dim=8, hidden=32, inter=64)
    check_drafter_tp(small, 4, "fp8")  # FP8 scales are per row: any column cut is fine
    with pytest.raises(ConfigError,
                       match=r"NVFP4 self_attn.o_proj would be cut at column 0\.\.8 of 32 on rank 0"):
        check_drafter_tp(small, 4, "nvfp4")
    odd = make_config(inter=48)  # 24 intermediate columns per rank
    with pytest.raises(ConfigError, match=r"NVFP4 mlp.down_proj would be cut at column 0\.\.24 of 48"):
        check_drafter_tp(odd, 2, "nvfp4")


def test_build_refuses_kv_heads_that_do_not_split_before_writing(tiny_recipe, tmp_path):
    from metrale.builder.build import build_engine

    with pytest.raises(ConfigError, match=r"--draft-tp-size \(drafter dflash\) 3: the drafter's 2 KV "
                                          r"heads do not cover 3 ranks"):
        build_engine(tiny_recipe.with_build(draft_tp_size=3), tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_a_one_rank_build_is_cut_at_load_to_a_two_rank_builds_bytes(tiny_engine_dir, engine_factory):
    from metrale.runtime.backends import load_engine
    from metrale.runtime.artifact.engine import _drafter_tensors
    from metrale.runtime.artifact.engine_dir import load_manifest

    two = engine_factory("fp8", draft_tp_size=2)
    infos = load_manifest(tiny_engine_dir).components
    for name in DRAFTERS:
        cfg = DFlashConfig.from_hf(json.loads((two / name / "config.json").read_text()), name)
        for rank in range(2):
            got, source = _drafter_tensors(tiny_engine_dir, name, infos[name], cfg, TensorParallel(rank, 2))
            assert source.endswith(f"rank0.safetensors, rank {rank} of 2 cut at load")
            want = load_file(str(two / name / f"rank{rank}.safetensors"))
            assert got.keys() == want.keys()
            assert all(torch.equal(as_bytes(got[k]), as_bytes(want[k])) for k in want), (name, rank)
    with pytest.raises(EngineDirError, match="built with --draft-tp-size 2, so it runs on 1 or 2 "
                                             "ranks, not 3; rebuild with --draft-tp-size 1 "
                                             r"\(any rank count, cut at load\) or 3"):
        load_engine(two, tp=TensorParallel(0, 3))


def test_nproc_refusals(monkeypatch):
    from typer.testing import CliRunner

    from metrale.cli import app

    r = CliRunner().invoke(app, ["generate", "--engine-dir", "missing", "--prompt", "x", "--nproc", "0"])
    assert r.exit_code == 2 and "--nproc: expected a process count of at least 1, got 0" in r.output
    r = CliRunner().invoke(app, ["generate", "--engine-dir", "missing", "--prompt", "x", "--nproc", "3"],
                           env={"WORLD_SIZE": "2"})
    assert r.exit_code == 2 and "one of 2 launched by torchrun" in r.output
    argv = torchrun_argv(2, ["generate", "--dflash"])
    assert argv[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "metrale", "generate", "--dflash"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert World.from_env() == World(0, 1, 0)  # a plain process joins no group
    # each rank of a world on its own GPU: `cuda` is the rank's; an index would stack every rank
    assert World(1, 2, 1).device("cuda") == "cuda:1" and World(0, 1, 0).device("cuda:3") == "cuda:3"
    assert World(1, 2, 1).device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="--device cuda:0: each of the 2 ranks runs on its own GPU"):
        World(1, 2, 1).device("cuda:0")


# -- builds ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["declared", "fp8", "fp8-aux", "nvfp4"])
def test_two_rank_shards_put_back_are_the_one_rank_bytes(engine_factory, tier):
    from metrale.runtime.artifact.engine_dir import load_manifest

    one, two = engine_factory(tier), engine_factory(tier, draft_tp_size=2)
    m = load_manifest(two)
    assert m.tp_size == 2
    assert m.components["target"].files == ["target/rank0.safetensors"]
    assert m.components["mtp"].files == ["mtp/rank0.safetensors"]  # BF16: its own declared
    for name in DRAFTERS:
        info = m.components[name]
        assert info.tp_size == 2
        assert info.files == [f"{name}/rank0.safetensors", f"{name}/rank1.safetensors",
                                 f"{name}/declared.safetensors"]
        cfg = DFlashConfig.from_hf(json.loads((two / name / "config.json").read_text()), name)
        whole = load_file(str(one / name / "rank0.safetensors"))
        shards = [load_file(str(two / name / f"rank{r}.safetensors")) for r in range(2)]
        assert info.rank_weight_bytes == [sum(t.nbytes for t in s.values()) for s in shards]
        for key, t in whole.items():
            cut = drafter_cut(key, cfg)
            if cut is not None and cut.dim < t.dim():  # cut: each rank holds half
                assert shards[0][key].shape[cut.dim] * 2 == t.shape[cut.dim], key
        merged = merge_drafter_state(shards, cfg)
        assert merged.keys() == whole.keys()
        for key, t in whole.items():
            assert merged[key].dtype == t.dtype and merged[key].shape == t.shape, key
            assert torch.equal(as_bytes(merged[key]), as_bytes(t)), key


def test_a_sharded_build_loads_whole_on_one_rank(engine_factory, tiny_engine):
    from metrale.runtime.backends import load_engine

    merged = load_engine(engine_factory("fp8", draft_tp_size=2))
    for name in DRAFTERS:
        a, b = merged.drafters[name].state_dict(), tiny_engine.drafters[name].state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(as_bytes(a[k]), as_bytes(b[k])) for k in a)


# -- two ranks over gloo ---------------------------------------------------------------------------

def propose_after_prompt(engine, name: str, ids: list[int]):
    """The drafter's block propose right after prefilling `ids`, anchored on the target's argmax."""
    drafter = engine.drafters[name]
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = engine.target(prompt, engine.target.new_cache(1, len(ids) + 16),
                            taps=tuple(drafter.config.target_layer_ids))
        cache = drafter.new_cache(1, len(ids) + 16, torch.float32)
        drafter.add_context(out.taps, cache)
        anchor = out.logits[0, -1].argmax().reshape(1)
        return drafter.propose(anchor, engine.target.model.embed_tokens, cache,
                               drafter.config.block_size)


def _worker(rank: int, port: int, engine_dir: str, prompts_file: str, out_file: str) -> None:
    """One rank of the two-rank check; writes what it saw to `out_file`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    world = World.from_env("cpu")
    res: dict = {"world": (world.rank, world.size)}
    try:  # a flag that differs between ranks is refused on every rank
        world.agree(str(rank + 1), "--draft-tp-size")
    except ConfigError as exc:
        res["agree"] = str(exc)
    tp = TensorParallel(world.rank, world.size)
    engine = load_engine(engine_dir, tp=tp)
    prompts = json.loads(Path(prompts_file).read_text())
    res["proposals"] = {name: [propose_after_prompt(engine, name, ids) for ids in prompts]
                        for name in DRAFTERS}
    res["decodes"] = {}
    for name in DRAFTERS:
        spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter=name, draft_tp_size="auto")
        gen = EngineGenerator(engine, spec, world)
        if world.leader:
            greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
            res["decodes"][name] = [gen.generate(ids, greedy) for ids in prompts]
            # a sampled request without a seed: the leader draws one for every rank
            res["sampled"] = gen.generate(prompts[0], SamplingParams(temperature=1.0, max_tokens=8))
            gen.shutdown()
        else:
            gen.follow()
    try:  # ranks anchored on different tokens are refused, on every rank at once
        drafter = engine.drafters["dflash"]
        cache = drafter.new_cache(1, 16, torch.float32)
        drafter.propose(torch.tensor([5 + rank]), engine.target.model.embed_tokens, cache, 4)
    except MetraleError as exc:
        res["diverged"] = str(exc)
    res["stats"] = (tp.stats.calls, tp.stats.seconds)
    torch.save(res, out_file)
    world.close()


@pytest.fixture(scope="module")
def two_ranks(engine_factory, tiny_prompts, tmp_path_factory):
    """Run `_worker` as ranks 0 and 1 (two processes, gloo) on the fp8 two-rank build."""
    engine_dir = engine_factory("fp8", draft_tp_size=2)
    tmp = tmp_path_factory.mktemp("tp")
    (tmp / "prompts.json").write_text(json.dumps(tiny_prompts))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(engine_dir),
                               str(tmp / "prompts.json"), str(tmp / f"rank{r}.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} failed:\n{text[-4000:]}"
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_ranks_draft_the_one_rank_tokens(two_ranks, tiny_engine, tiny_prompts):
    assert [r["world"] for r in two_ranks] == [(0, 2), (1, 2)]
    vocab = tiny_engine.target.config.vocab_size
    for name in DRAFTERS:
        for i, ids in enumerate(tiny_prompts):
            want = propose_after_prompt(tiny_engine, name, ids)
            for rank, res in enumerate(two_ranks):
                got = res["proposals"][name][i]
                assert torch.equal(got.tokens, want.tokens), (name, i, rank)
                start, end = shard_range(vocab, rank, 2)
                assert got.vocab_start == start and got.logits.shape[-1] == end - start
                # only the all-reduce's summation order differs
                diff = (got.logits - want.logits[..., start:end]).abs().max().item()
                assert diff < 1e-4, (name, i, rank, diff)


def test_two_rank_decodes_equal_one_rank_decodes(two_ranks, tiny_engine, tiny_prompts):
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    for name in DRAFTERS:
        gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter=name))
        for ids, got in zip(tiny_prompts, two_ranks[0]["decodes"][name]):
            want = gen.generate(ids, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS))
            assert got.token_ids == want.token_ids
            assert [s.accepted for s in got.steps] == [s.accepted for s in want.steps]
    assert len(two_ranks[0]["sampled"].token_ids) == 8


def test_two_rank_collectives_and_refusals(two_ranks):
    for res in two_ranks:
        assert "--draft-tp-size: the ranks disagree (rank 0: 1, rank 1: 2)" in res["agree"]
        assert "drafter ranks diverged" in res["diverged"]
    calls = two_ranks[0]["stats"][0]
    # per propose: 2 layers × (o_proj, down_proj) all-reduces, one all-gather
    assert calls["all_reduce"] == 4 * calls["all_gather"]  # the refused propose's included
    assert two_ranks[0]["stats"][0] == two_ranks[1]["stats"][0]


def test_torchrun_generate_prints_the_one_rank_text(engine_factory, tiny_engine):
    """`metrale generate --nproc 2` re-launches itself under torchrun; rank 0 prints."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2")
    ids = tiny_engine.tokenizer.encode("def main(")
    want = EngineGenerator(tiny_engine, spec).generate(ids, SamplingParams(temperature=0.0, max_tokens=16))
    two = subprocess.run([sys.executable, "-m", "metrale", "generate", "--nproc", "2", "--engine-dir",
                          str(engine_factory("fp8", draft_tp_size=2)), "--draft-tp-size", "auto",
                          "--prompt", "def main(", "--max-tokens", "16", "--dflash",
                          "--dflash-drafter", "dflash2"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=120)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == tiny_engine.tokenizer.decode(want.token_ids) + "\n"  # rank 0 only


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6])

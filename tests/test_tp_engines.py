"""Engines per component, rank and SM for tensor-parallel drafters (builder.tp_export, the
collective plugins, the per-rank build).

- The per-rank ONNX graphs of a `--draft-tp-size 2` build, run by two processes joined over gloo
  (`onnx.reference` with AllReduce/AllGather calling torch.distributed), compute the one-rank
  drafter's outputs and draft its tokens; their gathered candidates with the normalizer give the
  one-rank drafter's draft tree, and rank graphs without the normalizer refuse trees by name.
- A `--draft-tp-size 2 --trt-flavor rtx` build writes rank0/rank1 engines for SM89 and SM120 in
  the fp8 and nvfp4 tiers, listed in the manifest with checksums; the parsed networks hold the
  collective plugin layers (2 AllReduce per drafter layer + 1 AllGather per propose graph).

Run as a script (`python tests/test_tp_engines.py RANK PORT INPUTS OUT`) this file is one rank of
the two-rank ONNX check; the fixture below starts both ranks.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metrale.runtime.errors import ConfigError, MetraleError
from metrale.runtime.spec.ddtree import block_tree

DRAFTERS = ("dflash", "dflash2")
TIERS = ("fp8", "nvfp4")
SMS = (89, 120)
PAST, STALE, NEW = 5, 2, 3  # valid past entries, stale slots after them, new context positions
ANCHOR = 7
TREE = 16  # a draft tree's nodes: at most the candidates a rank graph gathers per slot


def tp_build(engine_factory, tier: str) -> Path:
    """Graphs in float32, so the reference evaluator runs them against the one-rank drafter."""
    return engine_factory(tier, draft_tp_size=2, trt_flavor="rtx", trt_dtype="float32")


# -- two ranks run their ONNX graphs over gloo -------------------------------------------------


def _worker(rank: int, port: int, inputs_file: str, out_file: str) -> None:
    import numpy as np
    import onnx
    import torch.distributed as dist
    from onnx.reference import ReferenceEvaluator

    from metrale.plugins.onnx_ops import REFERENCE_OPS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    jobs = torch.load(inputs_file, weights_only=False)
    res = {}
    for (tier, name), job in jobs.items():
        model = onnx.load(str(Path(job["engine_dir"]) / name / f"rank{rank}.onnx"))
        nkv = job["past_key"].shape[2] // 2  # this rank's KV heads: a contiguous half
        feeds = {"context_features": job["context_features"],
                 "past_key": job["past_key"][:, :, rank * nkv:(rank + 1) * nkv],
                 "past_value": job["past_value"][:, :, rank * nkv:(rank + 1) * nkv],
                 "position": job["position"], "block_embeds": job["block_embeds"]}
        feeds = {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()}
        outs = ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, feeds)
        res[(tier, name)] = dict(zip([o.name for o in model.graph.output],
                                     [torch.from_numpy(np.array(o)) for o in outs]))
    torch.save(res, out_file)
    dist.barrier()
    dist.destroy_process_group()


def _one_rank_job(engine, name: str, engine_dir: Path, gen: torch.Generator) -> tuple[dict, dict]:
    """Inputs for one propose after PAST context positions, and what the one-rank torch drafter
    computes for them (the merged shards: the one-rank bytes)."""
    d = engine.drafters[name]
    cfg = d.config
    embed = engine.target.model.embed_tokens
    feats = torch.randn(1, PAST + NEW, cfg.num_context_features * cfg.target_hidden_size, generator=gen)
    g = cfg.block_size
    block = torch.tensor([[ANCHOR] + [cfg.mask_token_id] * (g - 1)])
    with torch.no_grad():
        cache = d.new_cache(1, PAST + NEW + g, torch.float32)
        d.add_context(feats[:, :PAST], cache)
        stale = torch.randn(cache.k[:, :, :, :STALE].shape, generator=gen)  # masked out
        past_k = torch.cat([cache.k[:, :, :, :PAST], stale], dim=3)
        past_v = torch.cat([cache.v[:, :, :, :PAST], stale], dim=3)
        d.add_context(feats[:, PAST:], cache)
        hidden, logits = d.forward_block(embed(block), cache)
        proposal = d.propose(torch.tensor([ANCHOR]), embed, cache, g)
        want = {"new_key": cache.k[:, :, :, PAST:PAST + NEW].clone(),
                "new_value": cache.v[:, :, :, PAST:PAST + NEW].clone(),
                "hidden": hidden, "logits": logits, "tokens": proposal.tokens,
                "tree": block_tree(d, ANCHOR, proposal, TREE)}
        if cfg.version == 2:
            want["selector_query"] = d.candidate_selector.hidden_projection(hidden)
    job = {"engine_dir": str(engine_dir), "context_features": feats[:, PAST:], "past_key": past_k,
           "past_value": past_v, "position": torch.tensor([PAST]), "block_embeds": embed(block).detach()}
    return job, want


@pytest.fixture(scope="module")
def two_rank_graphs(engine_factory, tmp_path_factory):
    """(ranks' outputs, the one-rank drafters' outputs, the one-rank engines) per (tier, drafter)."""
    from metrale.runtime.backends import load_engine

    tmp = tmp_path_factory.mktemp("tp_onnx")
    gen = torch.Generator().manual_seed(11)
    jobs, wants, engines = {}, {}, {}
    for tier in TIERS:
        engine_dir = tp_build(engine_factory, tier)
        engines[tier] = load_engine(engine_dir, components=DRAFTERS)  # no tp: merged, one rank
        for name in DRAFTERS:
            jobs[(tier, name)], wants[(tier, name)] = _one_rank_job(engines[tier], name, engine_dir, gen)
    torch.save(jobs, tmp / "inputs.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp / "inputs.pt"),
                               str(tmp / f"rank{r}.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} failed:\n{text[-4000:]}"
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, wants, engines


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", DRAFTERS)
def test_two_rank_graphs_compute_the_one_rank_drafter(two_rank_graphs, tier, name):
    ranks, wants, engines = two_rank_graphs
    got = [r[(tier, name)] for r in ranks]
    want = wants[(tier, name)]
    close = dict(atol=1e-4, rtol=1e-4)  # the all-reduce sums the heads' shares in another order
    # rank r holds KV heads [r·nkv/2, (r+1)·nkv/2) and vocab ids [r·V/2, (r+1)·V/2)
    for key in ("new_key", "new_value"):
        torch.testing.assert_close(torch.cat([g[key] for g in got], dim=2), want[key], **close)
    torch.testing.assert_close(torch.cat([g["logits"] for g in got], dim=-1), want["logits"], **close)
    for g in got:  # replicated after the all-reduces: whole on every rank
        torch.testing.assert_close(g["hidden"], want["hidden"], **close)
        if "selector_query" in want:
            torch.testing.assert_close(g["selector_query"], want["selector_query"], **close)
        assert g["rank_positions"].tolist() == [PAST, PAST]
    # the gathered candidates: the one-rank top 16 of every slot, ids exactly, on both ranks
    top_vals, top_ids = want["logits"].topk(16, dim=-1)
    for g in got:
        assert g["top_ids"].dtype == torch.int64 and g["top_ids"].shape == (1, want["logits"].shape[1], 16)
        assert torch.equal(g["top_ids"], top_ids)
        torch.testing.assert_close(g["top_values"], top_vals, **close)
    assert torch.equal(got[0]["top_values"], got[1]["top_values"])
    for g in got:  # the whole vocabulary's normalizer, every slot's, on both ranks
        torch.testing.assert_close(g["log_normalizer"], want["logits"].logsumexp(-1), **close)
    # the drafts the tensorrt backend's drafter face forms from each rank's outputs (its rank's
    # cache, the global candidates, DFlash2's selector) are the one-rank drafts, on both ranks
    engine_dir = Path(engines[tier].path)
    for r, g in enumerate(got):
        face = _rank_face(engine_dir, name, r, g)
        assert face.vocab_start == r * want["logits"].shape[-1] // 2
        cache = face.new_cache(1, PAST + NEW + 8)
        assert cache.k.shape[2] * 2 == want["new_key"].shape[2]  # the rank's KV heads
        face.add_context(torch.zeros(1, NEW, 1), cache)
        embed = engines[tier].target.model.embed_tokens
        proposal = face.propose(torch.tensor([ANCHOR]), embed, cache, want["logits"].shape[1])
        assert torch.equal(proposal.tokens, want["tokens"]) and proposal.vocab_start == face.vocab_start
        assert proposal.top is None  # a chain's proposal
        # a tree's proposal: the candidates as log-probabilities, and the one-rank drafter's tree
        face.add_context(torch.zeros(1, NEW, 1), cache)
        proposal = face.propose(torch.tensor([ANCHOR]), embed, cache, want["logits"].shape[1], TREE)
        log_probs = want["logits"][:, 1:].float().log_softmax(-1).topk(16, dim=-1).values
        torch.testing.assert_close(proposal.top[0], log_probs, **close)
        tree = block_tree(face, ANCHOR, proposal, TREE)
        assert (tree.tokens, tree.parents) == (want["tree"].tokens, want["tree"].parents)
    _trees_refused_without_the_normalizer(engines[tier], name, _rank_face(engine_dir, name, 0, got[0]),
                                          {k: v for k, v in got[0].items() if k != "log_normalizer"})
    diverged = {**got[0], "rank_positions": torch.tensor([PAST, PAST + 1])}
    face = _rank_face(engine_dir, name, 0, diverged)
    cache = face.new_cache(1, 16)
    face.add_context(torch.zeros(1, NEW, 1), cache)
    with pytest.raises(MetraleError, match=r"drafter ranks diverged: .*\[5, 6\]"):
        face.propose(torch.tensor([ANCHOR]), engines[tier].target.model.embed_tokens, cache,
                     want["logits"].shape[1])


def _trees_refused_without_the_normalizer(engine, name: str, face, old_outputs: dict) -> None:
    """Rank graphs exported before draft trees (no `log_normalizer`) still draft chains; a tree
    over them is refused at startup by name, and by the face itself."""
    from metrale.runtime.serving.service import check_engine_supports
    from metrale.runtime.spec.config import SpeculativeConfig

    tree = SpeculativeConfig.from_flags(dflash=True, dflash_drafter=name, dflash_tree_budget=TREE)
    old = _rank_face(engine.path, name, 0, old_outputs)
    assert face.distributions and not old.distributions
    with pytest.MonkeyPatch.context() as m:
        m.setitem(engine.drafters, name, face)
        check_engine_supports(engine, tree)
        m.setitem(engine.drafters, name, old)
        with pytest.raises(ConfigError, match=rf"--dflash-tree-budget {TREE}: drafter '{name}''s rank "
                                              r"graphs gather no normalizer \(built before draft trees\), "
                                              r"engine directory .*build the engine again"):
            check_engine_supports(engine, tree)
        check_engine_supports(engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter=name))
    embed = engine.target.model.embed_tokens
    cache = old.new_cache(1, 16)
    old.add_context(torch.zeros(1, NEW, 1), cache)
    with pytest.raises(ValueError, match="rank graphs gather no normalizer"):
        old.propose(torch.tensor([ANCHOR]), embed, cache, 8, TREE)


class _RecordedRank:
    """A `GraphRunner` that answers every propose with one rank graph's recorded outputs."""

    def __init__(self, outputs: dict):
        self.outputs, self.device = outputs, torch.device("cpu")
        self.dtypes = {**{k: v.dtype for k, v in outputs.items()}, "past_key": torch.float32,
                       "block_embeds": torch.float32}

    def run(self, feeds, graph_key=None, persistent=()):
        return dict(self.outputs)


def _rank_face(engine_dir: Path, name: str, rank: int, outputs: dict):
    """The tensorrt backend's drafter face for `rank` of the directory's tensor-parallel
    drafter, over recorded outputs of that rank's graph."""
    from types import SimpleNamespace

    from metrale.runtime.artifact.engine_check import component_config
    from metrale.runtime.artifact.engine_dir import load_manifest
    from metrale.runtime.backends.graph_steps import GraphDrafter

    info = load_manifest(engine_dir, verify=False).components[name]
    assert info.tp_size == 2
    cfg = component_config(engine_dir, str(engine_dir), name, info)
    ctx = SimpleNamespace(path=engine_dir, where=str(engine_dir), engine_taps=tuple(cfg.target_layer_ids),
                          rank=rank)
    return GraphDrafter.from_graph(_RecordedRank(outputs), name, info, cfg, ctx)


# -- the rank graphs -----------------------------------------------------------------------------


def test_rank_graphs_hold_the_collectives_with_their_rank(engine_factory):
    import onnx

    from metrale.builder import tp_export

    engine_dir = tp_build(engine_factory, "fp8")
    ranks = tp_export.load_rank_drafters(engine_dir, "dflash2", 2)
    for r, drafter in enumerate(ranks):
        model = onnx.load(str(engine_dir / "dflash2" / f"rank{r}.onnx"))
        layers = drafter.config.decoder.num_hidden_layers
        assert tp_export.collective_ops(model) == {"AllReduce": 2 * layers, "AllGather": 1}
        for node in model.graph.node:
            if node.op_type in tp_export.COLLECTIVE_OPS:
                attrs = {a.name: a.i for a in node.attribute}
                assert node.domain == "metrale" and attrs == {"group_size": 2, "rank": r}
        # the gathered message [1, G, 2·16+2] gains a leading rank axis of 2
        shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                  for v in list(model.graph.value_info) + list(model.graph.output)}
        gather = next(n for n in model.graph.node if n.op_type == "AllGather")
        assert len(shapes[gather.output[0]]) == 4 and shapes[gather.output[0]][0] == 2
        shapes.update({v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                       for v in model.graph.input})
        assert shapes["logits"][-1] == 1024 and shapes["past_key"][2] == 1  # half vocab, one KV head
        # the runtime module is left as it was: its tp is the real TensorParallel again
        tp_export.export_rank(drafter)
        assert all(isinstance(m.tp, tp_export.TensorParallel) for m in drafter.layers)
        assert drafter.tp.rank == r


def test_a_one_rank_drafter_has_no_collectives_to_export(tiny_engine):
    from metrale.builder import tp_export

    with pytest.raises(ValueError, match="no TensorParallel"):
        tp_export.export_rank(tiny_engine.drafters["dflash"])


# -- the TensorRT-RTX build, every rank and SM ---------------------------------------------------


@pytest.fixture(scope="module")
def rtx():
    pytest.importorskip("tensorrt_rtx")
    from metrale.builder.trt_env import load_trt

    return load_trt("rtx")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("tier", TIERS)
def test_tp_build_writes_every_rank_engine_per_sm(rtx, engine_factory, tier):
    from metrale.builder import tp_export
    from metrale.runtime.artifact.engine_dir import load_manifest

    engine_dir = tp_build(engine_factory, tier)
    m = load_manifest(engine_dir)  # verifies every checksum
    assert m.tp_size == 2 and m.build["engine_sm"] == list(SMS) and m.build["trt_flavor"] == "rtx"
    # the target and the head stay one-rank engines
    assert m.components["target"].engines["89"].file == "target/rank0.sm89.engine"
    for name in DRAFTERS:
        info = m.components[name]
        quantized = tp_export.load_rank_drafters(engine_dir, name, 2)[0]
        layers = quantized.config.decoder.num_hidden_layers
        gemms = sum(type(mod).__name__ == "Nvfp4Linear" for mod in quantized.modules())
        assert info.onnx_ranks == [f"{name}/rank0.onnx", f"{name}/rank1.onnx"]
        assert info.io.outputs[-4:] == ["top_values", "top_ids", "log_normalizer", "rank_positions"]
        for sm in SMS:
            entry = info.engines[str(sm)]
            collectives = {"AllReduce": 2 * layers, "AllGather": 1}
            # NVFP4 reaches the GEMM plugin below SM100; FP8 and SM120 FP4 are native
            plugin = {"NvFp4W4A16Gemm": gemms} if (tier == "nvfp4" and sm == 89) else {}
            convs = {"DFlash2DynamicConv": 2 * layers} if name == "dflash2" else {}  # every SM
            assert entry.plugins == {**collectives, **plugin, **convs}
            assert entry.plan_files() == [f"{name}/rank{r}.sm{sm}.engine" for r in range(2)]
            for e in entry.ranks:
                path = engine_dir / e.file
                assert path.stat().st_size == e.bytes > 100_000
                assert m.files[e.file] == {"sha256": _sha256(path), "size": e.bytes}
                assert e.file in info.files
        for r in range(2):
            assert m.files[f"{name}/rank{r}.onnx"]["sha256"] == _sha256(engine_dir / name / f"rank{r}.onnx")
    # the collectives need no cubin: fp8's ship DFlash2's conv kernel alone
    kernels = {p["kernel"] for p in m.plugins}
    assert kernels == ({"nvfp4_w4a16_gemm"} if tier == "nvfp4" else set()) | {"dflash2_dynamic_conv"}


@pytest.mark.parametrize("r", [0, 1])
def test_parsed_rank_network_holds_the_collective_plugin_layers(rtx, engine_factory, r):
    import onnx

    from metrale.plugins import onnx_lowering as lw
    from metrale.plugins.trt_plugin import register_plugins

    trt = rtx.trt
    engine_dir = tp_build(engine_factory, "nvfp4")
    lowered = lw.lower_for_sm(onnx.load(str(engine_dir / "dflash" / f"rank{r}.onnx")), 89)
    plugins = register_plugins(trt, 89)
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(
        1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(lowered.SerializeToString())
    made = []  # the plugin objects behind the network's plugin layers
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer  # get_layer returns the base class
            made.append((layer.plugin, tuple(layer.get_output(0).shape)))
    ops = [p.plugin_name for p, _ in made]
    assert ops.count("AllReduce") == 4 and ops.count("AllGather") == 1
    assert ops.count("NvFp4W4A16Gemm") == lw.metrale_ops(lowered)["NvFp4W4A16Gemm"] == len(ops) - 5
    collectives = [(p, shape) for p, shape in made if p.plugin_name in ("AllReduce", "AllGather")]
    assert {(p.group_size, p.rank) for p, _ in collectives} == {(2, r)}
    # the sums keep the hidden shape; the gather adds the rank axis: [2, 1, G (dynamic), 2·16 + 2]
    assert {shape for p, shape in collectives if p.op == "AllReduce"} == {(1, -1, 128)}
    assert [shape for p, shape in collectives if p.op == "AllGather"] == [(2, 1, -1, 34)]
    assert plugins.collectives.keep_alive  # held while TensorRT may call them


def test_collective_plugins_refuse_to_run_without_a_matching_communicator():
    from metrale.plugins.trt_collectives import Collectives

    with pytest.raises(RuntimeError, match="AllReduce: no NCCL communicator"):
        Collectives().communicator("AllReduce", 2, 0)

    class Comm:  # a communicator's identity: what the check reads
        rank, size = 1, 2

    with pytest.raises(RuntimeError, match="engine is rank 0 of 2, the communicator rank 1 of 2"):
        Collectives(Comm()).communicator("AllGather", 2, 0)
    assert Collectives(Comm()).communicator("AllGather", 2, 1).rank == 1


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

"""DFlash2's draft trees on the CPU packages: the tree's propose package
(`<drafter>/cpu/propose_tree.pt2`, manifest `selector_tables`) gives the candidate selector's
tables a tree's children come from; a call runs it where one of its sequences builds a tree."""

import json
import shutil

import pytest
import torch

from metrale.runtime.errors import EngineDirError


def test_dflash2_trees_take_their_childrens_tables_from_the_tree_package(aoti_engine_dir, tiny_prompts, tmp_path,
                                                                           monkeypatch):
    """DFlash2's propose for a draft tree runs its tree package, whose selector tables build the
    trees the host builds from the same call's logits and hidden states; a chain's propose runs
    the package without them. An engine without the tree package (built before it) scores the
    children on the host, to the same trees and tokens; manifests listing more than one tree
    package, or one for a drafter without a selector, are refused by name."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec import dflash_proposer
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.ddtree import SelectorChildren, build_tree
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.steps import DraftForward

    def decode(engine, **flags):
        face, calls, trees = engine.drafters["dflash2"], [], []
        for name in ("package", "tree_package"):
            run = getattr(face, name)
            if run is not None:
                monkeypatch.setattr(face, name, lambda *inputs, run=run, name=name: calls.append(name) or run(*inputs))

        def tree(drafter, anchor, proposal, budget):
            got = block_tree(drafter, anchor, proposal, budget)
            host = SelectorChildren(drafter.candidate_selector, proposal.hidden[0], proposal.logits[0], anchor)
            trees.append(((got.tokens, got.parents), proposal.tables is not None,
                          build_tree(anchor, host, budget).tokens == got.tokens))
            return got

        block_tree = dflash_proposer.block_tree
        monkeypatch.setattr(dflash_proposer, "block_tree", tree)
        gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2", **flags))
        out = [gen.decoder().generate(p, SamplingParams(temperature=0.0, max_tokens=24)).token_ids
               for p in tiny_prompts[:3]]
        monkeypatch.undo()
        return out, calls, trees

    engine = load_engine(aoti_engine_dir, backend="aoti")
    assert engine.drafters["dflash2"].tree_package is not None and engine.drafters["dflash"].tree_package is None
    chain_tokens, calls, _ = decode(engine)
    assert calls and set(calls) == {"package"}
    tree_tokens, calls, trees = decode(engine, dflash_tree_budget=16)
    assert calls and set(calls) == {"tree_package"} and trees
    assert all(tables and same for _, tables, same in trees)
    assert tree_tokens == chain_tokens  # greedy: plain decoding's tokens either way
    # a call of a sequence's tree beside another's chain: the tree package for both, the same
    # drafts as each alone on its own package, tables for the tree's only
    face, embed = engine.drafters["dflash2"], engine.target.model.embed_tokens
    width = face.config.num_context_features * face.config.target_hidden_size
    context = torch.randn(2, 5, width, generator=torch.Generator().manual_seed(0))
    proposals = []
    with torch.inference_mode():
        for together in (True, False):
            caches = [face.new_cache(1, 64, torch.float32) for _ in range(2)]
            for b, cache in enumerate(caches):
                face.add_context(context[b:b + 1], cache)
            needs = [DraftForward(face, torch.tensor([7 + b]), embed, cache, 8, 16 * (1 - b))
                     for b, cache in enumerate(caches)]
            proposals.append(face.forward_many(needs) if together else [face.forward_many([n])[0] for n in needs])
    (tree, chain), (tree_alone, chain_alone) = proposals
    assert tree.tables is not None and chain.tables is None and chain.logits is not None  # (a grammar redrafts a chain)
    assert torch.equal(tree.tokens, tree_alone.tokens) and torch.equal(chain.tokens, chain_alone.tokens)

    copy = tmp_path / "engine"
    shutil.copytree(aoti_engine_dir, copy)
    manifest = json.loads((copy / "config.json").read_text())
    packages = manifest["components"]["dflash2"]["cpu"]["packages"]
    assert [p.get("selector_tables", False) for p in packages] == [False, True]
    manifest["components"]["dflash2"]["cpu"]["packages"] = packages[:1]
    (copy / "config.json").write_text(json.dumps(manifest))
    older = load_engine(copy, backend="aoti")
    assert older.drafters["dflash2"].tree_package is None
    tokens, calls, host_trees = decode(older, dflash_tree_budget=16)
    assert set(calls) == {"package"} and not any(tables for _, tables, _ in host_trees)
    assert tokens == tree_tokens and [t for t, _, _ in host_trees] == [t for t, _, _ in trees]
    # DFlash (version 1) listing a tree package of its own (DFlash2's copied into its folder)
    shutil.copy(copy / packages[1]["file"], copy / "dflash" / "cpu" / "propose_tree.pt2")
    manifest["files"]["dflash/cpu/propose_tree.pt2"] = manifest["files"][packages[1]["file"]]
    manifest["components"]["dflash"]["files"].append("dflash/cpu/propose_tree.pt2")
    own_tree = {**packages[1], "file": "dflash/cpu/propose_tree.pt2"}
    for name, listed, match in (("dflash2", packages + packages[1:], "at most one tree's propose.*1 and 2"),
                                ("dflash", [*manifest["components"]["dflash"]["cpu"]["packages"], own_tree],
                                 "selector tables from a DFlash drafter of version 1"),
                                ("dflash", [*manifest["components"]["dflash"]["cpu"]["packages"], packages[1]],
                                 "'dflash2/cpu/propose_tree.pt2' is not in the component's folder dflash/"),
                                ("dflash2", [packages[0], {**packages[1], "block": 4}],
                                 r"tree's propose package \(dflash2/cpu/propose_tree.pt2\) was built for other")):
        manifest["components"]["dflash2"]["cpu"]["packages"] = packages
        manifest["components"][name]["cpu"]["packages"] = listed
        (copy / "config.json").write_text(json.dumps(manifest))
        with pytest.raises(EngineDirError, match=match):
            load_engine(copy, backend="aoti")
        manifest["components"]["dflash"]["cpu"]["packages"] = manifest["components"]["dflash"]["cpu"]["packages"][:1]

"""`metrale calibrate` and `--dflash-adaptive-k auto`: the measured table lands in the engine
directory under the manifest's checksums, and auto resolves to it for the same setting only."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from metrale.cli import app
from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.config import AUTO, SpeculativeConfig, resolve_dflash
from metrale.runtime.spec.cost_model import CostModel


def test_auto_parses_and_resolves_only_with_a_table():
    cfg = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto")
    assert cfg.dflash_adaptive_k == AUTO and cfg.dflash_reprobe_interval == 16
    with pytest.raises(ConfigError, match="auto: there is no calibration for drafter 'x'.*metrale calibrate"):
        resolve_dflash(cfg, 8, None, "drafter 'x'")
    table = CostModel.parse("0:1,1:2,2:3,3:4,4:5,5:6,6:7,7:8")
    assert str(resolve_dflash(cfg, 8, table).adaptive_k) == str(table)
    cut = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto", dflash_gamma=4)
    assert resolve_dflash(cut, 8, table).adaptive_k.max_count == 3  # γ = 4: at most 3 drafts
    with pytest.raises(ConfigError, match="--dflash-adaptive-k"):
        SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="automatic")


def test_calibrate_writes_a_checksummed_table_that_auto_uses(tiny_engine_dir, tmp_path):
    from metrale.runtime.backends import load_engine
    from metrale.runtime.artifact.engine_dir import load_manifest
    from metrale.runtime.serving.service import EngineGenerator

    eng = tmp_path / "eng"
    shutil.copytree(tiny_engine_dir, eng)
    created = load_manifest(eng).created
    no_table = load_engine(eng, backend="torch")
    with pytest.raises(ConfigError, match="no calibration for drafter 'dflash' on backend torch"):
        EngineGenerator(no_table, SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto"))
    res = CliRunner().invoke(app, ["calibrate", "--engine-dir", str(eng), "--backend", "torch",
                                   "--num-prompts", "1", "--max-tokens", "6", "--repeats", "1"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    m = load_manifest(eng, verify=True)  # every checksum, the new file's included
    assert "calibration.json" in m.files and m.created == created
    entries = json.loads((eng / "calibration.json").read_text())["entries"]
    assert {e["drafter"] for e in entries} == {"dflash", "dflash2"}
    e = entries[0]
    assert e["backend"] == "torch" and e["dtype"] == "float32" and e["threads"] == 1
    table = CostModel.parse(e["table"])
    assert table.first == 0 and table.max_count == 7 and all(ms > 0 for ms in table.ms)
    torch.set_num_threads(1)
    gen = EngineGenerator(load_engine(eng, backend="torch"),
                          SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto"))
    assert str(gen.dflash.adaptive_k) == e["table"] or gen.dflash.adaptive_k.ms == table.ms
    # the drafter's acceptance measured with the table comes with it, as the streams' prior
    assert 0.0 < e["acceptance"] < 1.0 and gen.dflash.adaptive_k.acceptance == e["acceptance"]
    assert gen.decoder().proposer.controller.prior == e["acceptance"]
    # another setting (2 threads) has no entry: refused, naming it
    torch.set_num_threads(2)
    try:
        with pytest.raises(ConfigError, match="2 thread"):
            EngineGenerator(load_engine(eng, backend="torch"),
                            SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto"))
    finally:
        torch.set_num_threads(1)


def test_auto_with_trees_takes_the_tree_budgets_the_table_prices(caplog):
    """A table measured with `--tree-budget` prices trees past γ − 1: auto with
    `--dflash-tree-budget N` keeps its counts up to N; a chain serve keeps those up to γ − 1. A
    table of chains only caps the trees at γ − 1 nodes, and says so."""
    table = CostModel.parse(",".join(f"{k}:{1 + 0.1 * k}" for k in range(17)))
    trees = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto", dflash_tree_budget=12)
    assert resolve_dflash(trees, 8, table).adaptive_k.max_count == 12
    chains = SpeculativeConfig.from_flags(dflash=True, dflash_adaptive_k="auto")
    assert resolve_dflash(chains, 8, table).adaptive_k.max_count == 7
    assert not caplog.records
    chain_table = CostModel.parse(",".join(f"{k}:{1 + 0.1 * k}" for k in range(8)))
    assert resolve_dflash(trees, 8, chain_table).adaptive_k.max_count == 7
    assert "calibrate --tree-budget 12" in caplog.text and "up to 7 nodes" in caplog.text


def test_calibrate_measures_trees_up_to_its_tree_budget(tiny_engine_dir, tmp_path):
    """`metrale calibrate --tree-budget 10` stores counts 0..10 (8..10 draft trees of that many
    nodes), and a serve with auto and `--dflash-tree-budget 10` chooses each tree's budget among
    1..10 from it; a budget past the most a tree holds, or below γ (no tree to measure), is
    refused, naming the flag."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.sampling import SamplingParams

    eng = tmp_path / "eng"
    shutil.copytree(tiny_engine_dir, eng)
    args = ["calibrate", "--engine-dir", str(eng), "--backend", "torch", "--num-prompts", "1",
            "--max-tokens", "6", "--repeats", "1"]
    bad = CliRunner().invoke(app, [*args, "--tree-budget", "65"])
    assert bad.exit_code != 0 and "--tree-budget" in bad.output and "65" in bad.output
    short = CliRunner().invoke(app, [*args, "--tree-budget", "3"])  # below γ: no tree to measure
    assert short.exit_code != 0 and "--tree-budget 3" in short.output and "at least 8" in short.output
    from metrale.runtime.artifact.engine import LoadedEngine

    with pytest.MonkeyPatch.context() as m:  # as a CPU package built before draft trees loads
        m.setattr(LoadedEngine, "block_distributions", lambda self, name: False)
        old = CliRunner().invoke(app, [*args, "--tree-budget", "10"])
    assert old.exit_code != 0 and "--tree-budget 10" in old.output and "gives drafts only" in old.output
    res = CliRunner().invoke(app, [*args, "--tree-budget", "10"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    entries = json.loads((eng / "calibration.json").read_text())["entries"]
    table = CostModel.parse(next(e for e in entries if e["drafter"] == "dflash")["table"])
    assert table.first == 0 and table.max_count == 10 and all(ms > 0 for ms in table.ms)
    torch.set_num_threads(1)
    gen = EngineGenerator(load_engine(eng, backend="torch"), SpeculativeConfig.from_flags(
        dflash=True, dflash_adaptive_k="auto", dflash_tree_budget=10))
    assert gen.dflash.adaptive_k.max_count == 10
    proposer = gen.decoder().proposer
    assert proposer.chooser.counts == list(range(1, 11))
    assert proposer.tree_cost.max_count == 7  # the verify routes are priced by its chains
    # (on this machine's table plain steps may be what pays: then none drafts)
    got = gen.generate(gen.tokenizer.encode("The cat"), SamplingParams(max_tokens=16, temperature=0.0))
    assert len(got.token_ids) == 16 and all(s.drafted <= 10 for s in got.steps)

"""`metrale calibrate` and `--dflash-adaptive-k auto`: the measured table lands in the engine
directory under the manifest's checksums, and auto resolves to it for the same setting only."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from metrale.cli import app
from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.config import AUTO, CostModel, SpeculativeConfig, resolve_dflash


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

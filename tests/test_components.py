"""The component registry (`runtime.components`): every entry's references resolve to classes with
the faces the layers call, and a kind registered there alone is loaded, proposes, and is
benchmarked: no other module tests kind names."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from metrale.runtime import components
from metrale.runtime.backends import load_engine
from metrale.runtime.components import KINDS, Role, resolve
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.serving.service import EngineGenerator

FACES = {"adapter": "example_inputs", "graph_face": "from_graph", "aoti_face": "from_packages",
         "proposer": "for_spec"}


def test_every_reference_resolves_to_a_class_with_its_face():
    assert set(KINDS) == {"target", "mtp", "dflash"}
    assert [k.role for k in KINDS.values()] == [Role.TARGET, Role.HEAD, Role.DRAFTER]
    for kind in KINDS.values():
        assert isinstance(resolve(kind.module), type)
        for field, method in FACES.items():
            ref = getattr(kind, field)
            if ref is None:
                assert kind.role is Role.TARGET and field == "proposer"  # the target proposes nothing
                continue
            assert callable(getattr(resolve(ref), method)), (kind.name, field)
        assert callable(resolve(kind.checkpoint))  # its checkpoint loader
        for set_name, _ in kind.tensor_sets:
            kind.tensor_set(set_name)
    assert KINDS["dflash"].tensor_set("core").fullmatch("layers.1.mlp.down_proj")
    assert not KINDS["dflash"].tensor_set("core").fullmatch("fc")
    assert KINDS["dflash"].tensor_set("aux").fullmatch("fc")
    assert KINDS["mtp"].tensor_set("experts").fullmatch("layer.mlp.experts.3.up_proj")
    with pytest.raises(ValueError, match="unknown component kind 'medusa'"):
        components.kind_named("medusa")


def test_a_kind_registered_in_the_table_alone_loads_proposes_and_benches(tiny_engine_dir, tmp_path,
                                                                         monkeypatch, tiny_prompts):
    """A drafter kind under another name, entered in `KINDS` only (reusing DFlash's classes): the
    engine directory that names it loads, decodes with it exactly as with `dflash`, and bench
    lists its modes."""
    from metrale.bench import _mode_names, mode_table

    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, copy)
    manifest = json.loads((copy / "config.json").read_text())
    manifest["components"]["dflash"]["kind"] = "dflash_copy"
    (copy / "config.json").write_text(json.dumps(manifest))
    monkeypatch.setitem(KINDS, "dflash_copy", dataclasses.replace(KINDS["dflash"], name="dflash_copy"))

    engine = load_engine(copy)
    assert set(engine.drafters) == {"dflash", "dflash2"}
    params = SamplingParams(temperature=0.0, max_tokens=24)
    spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash")
    got = EngineGenerator(engine, spec).decoder().generate(tiny_prompts[0], params)
    ref = EngineGenerator(load_engine(tiny_engine_dir), spec).decoder().generate(tiny_prompts[0], params)
    assert got.token_ids == ref.token_ids and got.steps == ref.steps
    names = [n for n, _ in mode_table(engine, None)]
    assert "dflash γ=8" in names and set(names) < set(_mode_names(copy))  # + adaptive-k modes
    monkeypatch.delitem(KINDS, "dflash_copy")  # unregistered: refused by name
    from metrale.runtime.errors import EngineDirError

    with pytest.raises(EngineDirError, match="component dflash has kind 'dflash_copy'"):
        load_engine(copy)


def test_a_recipe_names_its_drafters_kind(tmp_path, monkeypatch):
    """[drafters.<name>] kind = "<kind>" (default dflash) is what the build writes into the
    manifest entry; a kind the registry lacks is refused by name before anything loads."""
    from metrale.builder.build import build_engine
    from metrale.builder.recipe import load_recipe
    from metrale.runtime.errors import ConfigError

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    text = (recipes / "tiny.toml").read_text().replace('checkpoint = "tiny/', f'checkpoint = "{recipes}/tiny/')
    text = text.replace(f'checkpoint = "{recipes}/tiny/dflash"',
                        f'checkpoint = "{recipes}/tiny/dflash"\nkind = "dflash_copy"')
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    monkeypatch.setitem(KINDS, "dflash_copy", dataclasses.replace(KINDS["dflash"], name="dflash_copy"))
    recipe = load_recipe(path)
    recipe = dataclasses.replace(recipe, build=dataclasses.replace(recipe.build, cpu_engines="none", onnx=False))
    build_engine(recipe, tmp_path / "engine")
    components = json.loads((tmp_path / "engine" / "config.json").read_text())["components"]
    assert components["dflash"]["kind"] == "dflash_copy" and components["dflash2"]["kind"] == "dflash"
    monkeypatch.delitem(KINDS, "dflash_copy")
    with pytest.raises(ConfigError, match=r"\[drafters.dflash\] kind = 'dflash_copy': expected one of dflash"):
        load_recipe(path)

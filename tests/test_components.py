"""The component registry (`runtime.components`): every kind is its model's facts and a step
shape, and every layer keys its part by the shape, so a kind registered there alone is built,
loaded, proposes and is benchmarked: no other module tests kind names."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from metrale.runtime import components
from metrale.runtime.backends import load_engine
from metrale.runtime.components import KINDS, ComponentKind, Role, StepShape
from metrale.runtime.models.configs import DFlashConfig
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.serving.service import EngineGenerator

def test_every_kind_is_model_facts_and_a_shape_that_every_layer_keys_its_part_by():
    from metrale.builder.onnx_export import ADAPTERS
    from metrale.runtime.backend_registry import BACKENDS
    from metrale.runtime.components import StepShape
    from metrale.runtime.spec.proposer import Proposer
    from metrale.runtime.spec.shapes import SHAPES

    assert set(KINDS) == {"target", "mtp", "dflash"}
    assert [k.role for k in KINDS.values()] == [Role.TARGET, Role.HEAD, Role.DRAFTER]
    assert [k.shape for k in KINDS.values()] == [StepShape.TARGET, StepShape.CHAIN, StepShape.BLOCK]
    for kind in KINDS.values():
        assert isinstance(kind.module, type) and callable(kind.checkpoint)
        assert all(isinstance(v, (str, tuple)) is False or not str(v).startswith("metrale.")
                   for v in vars(kind).values())  # no "module:Class" references left
        for set_name, _ in kind.tensor_sets:
            kind.tensor_set(set_name)
    # each layer's table covers every shape it serves
    assert set(ADAPTERS) == set(StepShape)
    assert set(SHAPES) == {StepShape.CHAIN, StepShape.BLOCK}
    for shape in SHAPES.values():
        assert issubclass(shape.proposer, Proposer) and "for_spec" in vars(shape.proposer)
    for entry in BACKENDS.values():
        for shape, _ in entry.faces:
            face = entry.face(shape)
            assert isinstance(face, type), (entry.name, shape)
    assert {e.name for e in BACKENDS.values() if e.faces and all(
        callable(getattr(e.face(s), "from_graph", None)) for s, _ in e.faces)} == {"onnxruntime", "tensorrt"}
    assert all(callable(BACKENDS["aoti"].face(s).from_packages) for s in StepShape)
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


# -- a new drafter kind, end to end ---------------------------------------------------------


class HubDrafter(DFlashDrafter):
    """A drafter kind's own module (the DFlash block's arithmetic, under another class)."""


def load_hub(folder, target_lm_head, dtype=torch.float32):
    """Its weights mapping: a checkpoint whose tensors sit under `draft_model.` (as training
    frameworks that wrap the drafter save it), mapped onto the module's names."""
    from metrale.runtime.models.loader import read_config, read_safetensors, strict_fill

    cfg = DFlashConfig.from_hf(read_config(folder), f"{folder}/config.json")
    tensors = {k.removeprefix("draft_model."): v for k, v in read_safetensors(folder).items()}
    tensors["lm_head.weight"] = target_lm_head
    drafter = HubDrafter(cfg).to(dtype)
    strict_fill(drafter, tensors, f"checkpoint {folder}")
    return drafter.eval()


HUB = ComponentKind("dflash_hub", StepShape.BLOCK, KINDS["dflash"].parse, HubDrafter,
                    lambda cfg: cfg.decoder, load_hub, KINDS["dflash"].tensor_sets)


@pytest.mark.slow
def test_a_new_drafter_kind_is_its_entry_its_module_and_its_weights_mapping(tmp_path, monkeypatch,
                                                                            tiny_prompts):
    """A kind added as its table entry, its module and its checkpoint mapping, nothing else: a
    recipe naming it builds (quantized, its step exported to ONNX), and the engine runs it on
    the eager backend (its module) and on the ONNX graphs (the block shape's graph face),
    drafting exactly what the `dflash` kind does with the same weights in its own layout."""
    from safetensors.torch import load_file, save_file

    from metrale.builder.build import build_engine
    from metrale.builder.recipe import load_recipe

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(recipes / "tiny" / "dflash" / "config.json", hub / "config.json")
    state = load_file(str(recipes / "tiny" / "dflash" / "model.safetensors"))
    save_file({f"draft_model.{k}": v.contiguous() for k, v in state.items()}, str(hub / "model.safetensors"))
    (tmp_path / "recipe.toml").write_text(f"""
[recipe]
name = "hub"
engine_dir = "{tmp_path / 'engine'}"

[target]
checkpoint = "{recipes / 'tiny' / 'target'}"

[drafters.dflash]
checkpoint = "{recipes / 'tiny' / 'dflash'}"

[drafters.hub]
checkpoint = "{hub}"
kind = "dflash_hub"

[build]
draft_weight_quantization = "fp8"
trt_flavor = "none"
cpu_engines = "none"
onnx = true
""")
    monkeypatch.setitem(KINDS, "dflash_hub", HUB)
    out = build_engine(load_recipe(tmp_path / "recipe.toml"), tmp_path / "engine").engine_dir
    entries = json.loads((out / "config.json").read_text())["components"]
    assert entries["hub"]["kind"] == "dflash_hub" and entries["hub"]["quantization"] == entries["dflash"]["quantization"]

    params = SamplingParams(temperature=0.0, max_tokens=24)
    for backend, face in (("torch", HubDrafter), ("onnxruntime", None)):
        engine = load_engine(out, backend=backend)
        if face is not None:
            assert type(engine.drafters["hub"]) is face
        else:  # the block shape's graph face, as for every DFlash drafter
            assert type(engine.drafters["hub"]) is type(engine.drafters["dflash"])
        runs = {}
        for name in ("dflash", "hub"):
            spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter=name)
            runs[name] = EngineGenerator(engine, spec).decoder().generate(tiny_prompts[0], params)
        assert runs["hub"].token_ids == runs["dflash"].token_ids, backend
        assert runs["hub"].steps == runs["dflash"].steps and runs["hub"].metrics.tau > 1.0, backend

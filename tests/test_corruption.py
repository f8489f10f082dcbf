"""Corrupted checkpoints and engine directories are refused with a metrale error naming the
file — at build for checkpoints, identically by `inspect` and loading for engine directories —
never a traceback from a library, never a silent acceptance."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from metrale.builder.build import check_tokenizer
from metrale.runtime.models.configs import target_config
from metrale.runtime.backends import load_engine
from metrale.runtime.artifact.engine import check_engine_dir
from metrale.runtime.errors import CheckpointError, EngineDirError, MetraleError
from metrale.runtime.models.loader import load_dflash, load_mtp, load_target

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny"
FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def copy_checkpoint(tmp: Path, name: str = "target") -> Path:
    out = tmp / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(TINY / name, out)
    return out


def build_stage(target: Path) -> None:
    """What `metrale build` does with a target checkpoint before writing anything."""
    model = load_target(target)
    check_tokenizer(target, model.config.vocab_size)


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


def edit_tensor(folder: Path, name: str, fn) -> None:
    f = folder / "model.safetensors"
    tensors = {k: t.clone() for k, t in load_file(str(f)).items()}  # off the file's memory map
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(folder / "edited.tmp"))
    (folder / "edited.tmp").replace(f)


@pytest.mark.parametrize("corrupt, words", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors cannot be read"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 16 + (d / "model.safetensors").read_bytes()[16:]),
     "model.safetensors cannot be read"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json must hold a JSON object"),
    (lambda d: (d / "config.json").write_text("7"), "config.json must hold a JSON object"),
    (lambda d: (d / "config.json").write_bytes(b"\xff\xfe"), "config.json is not valid JSON"),
    (lambda d: edit_config(d, architectures=["LlamaForCausalLM"]), "name no qwen3_moe target"),
    (lambda d: edit_config(d, eos_token_id=999_999), "eos_token_id 999999 is not a token id"),
    (lambda d: edit_config(d, bos_token_id=[1, -1]), "bos_token_id"),
    (lambda d: edit_config(d, num_attention_heads=0), "num_attention_heads` must be at least 1"),
    (lambda d: edit_config(d, rope_theta="big"), "rope_theta` must be a positive number"),
    (lambda d: edit_config(d, num_experts_per_tok=99), "exceeds num_experts"),
    (lambda d: edit_tensor(d, "lm_head.weight", lambda t: t.to(torch.int8)), "lm_head.weight is torch.int8"),
    (lambda d: edit_tensor(d, "model.embed_tokens.weight", lambda t: t.to(torch.int64)),
     "embed_tokens.weight is torch.int64"),
    (lambda d: edit_tensor(d, "model.norm.weight", lambda t: t.to(torch.float8_e4m3fn)),
     "model.norm.weight is torch.float8_e4m3fn; this role needs"),
    (lambda d: edit_tensor(d, "lm_head.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
     "model.safetensors: tensor lm_head.weight holds NaN"),
    (lambda d: (d / "tokenizer.json").write_text(""), "tokenizer.json: not a valid tokenizers file"),
    (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'), "not a valid tokenizers file"),
    (lambda d: (d / "tokenizer_config.json").write_text("[]"), "must hold a JSON object"),
    (lambda d: edit_config(d, vocab_size=100), "has shape"),
])
def test_corrupted_target_is_refused_naming_the_file(tmp_path, corrupt, words):
    target = copy_checkpoint(tmp_path)
    corrupt(target)
    with pytest.raises(CheckpointError, match=None) as info:
        build_stage(target)
    assert words in str(info.value) and str(target) in str(info.value)


def test_corrupted_heads_and_drafters_are_refused_naming_the_file(tmp_path):
    lm_head = torch.zeros(2048, 128)
    mtp = copy_checkpoint(tmp_path, "mtp")
    edit_config(mtp, num_attention_heads=3, num_key_value_heads=2)
    with pytest.raises(CheckpointError, match=r"mtp/config\.json: num_attention_heads \(3\)"):
        load_mtp(mtp, lm_head)
    mtp = copy_checkpoint(tmp_path, "mtp")
    edit_config(mtp, architectures=["DFlashDraftModel"])
    with pytest.raises(CheckpointError, match="name a DFlash drafter"):
        load_mtp(mtp, lm_head)
    drafter = copy_checkpoint(tmp_path, "dflash")
    cfg = json.loads((drafter / "config.json").read_text())
    edit_config(drafter, dflash_config=cfg["dflash_config"] | {"mask_token_id": 5000})
    with pytest.raises(CheckpointError, match=r"dflash/config\.json dflash_config: mask_token_id 5000"):
        load_dflash(drafter, lm_head)


@pytest.mark.parametrize("key", ["num_experts", "num_hidden_layers"])
def test_counts_past_the_tensors_are_refused_before_the_model_is_built(tmp_path, key):
    """A million experts or layers would take hundreds of GB to build before the shapes are
    compared: the counts are checked against the tensor names first."""
    target = copy_checkpoint(tmp_path)
    edit_config(target, **{key: 10 ** 6})
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(target))}: missing tensors of .*{key} is 1000000"):
        build_stage(target)


@FUZZ
@given(cut=st.integers(0, 4_613_735))
def test_truncated_weights_are_refused(tmp_path_factory, cut):
    target = copy_checkpoint(tmp_path_factory.getbasetemp())
    f = target / "model.safetensors"
    f.write_bytes(f.read_bytes()[:cut])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        build_stage(target)


@FUZZ
@given(key=st.sampled_from(["vocab_size", "hidden_size", "num_hidden_layers", "head_dim",
                            "num_key_value_heads", "rms_norm_eps", "rope_theta", "mlp_only_layers",
                            "max_position_embeddings", "num_experts", "tie_word_embeddings",
                            "architectures", "eos_token_id", "model_type", "decoder_sparse_step"]),
       value=JSON)
def test_fuzzed_target_config_values(tmp_path_factory, key, value):
    target = copy_checkpoint(tmp_path_factory.getbasetemp())
    original = json.loads((target / "config.json").read_text())
    edit_config(target, **{key: value})
    try:
        build_stage(target)
    except MetraleError as exc:
        assert str(target) in str(exc)
    else:  # accepted only when the value is allowed and means what the original meant
        if value is None:  # null is an absent key: its default
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        valid = {
            "architectures": lambda: "Qwen3MoeForCausalLM" in value,
            "eos_token_id": lambda: all(type(i) is int and 0 <= i < 2048 for i in
                                        (value if isinstance(value, list) else [value])),
            "rms_norm_eps": lambda: number and 0 < value < 1,
            "rope_theta": lambda: number and 0 < value < float("inf"),
            "mlp_only_layers": lambda: all(type(i) is int and i >= 0 for i in value),
            "max_position_embeddings": lambda: type(value) is int and value >= 2,
            "tie_word_embeddings": lambda: isinstance(value, bool),
        }
        if key in valid:
            assert valid[key](), (key, value)
        else:  # these change tensor shapes: only the original value can load
            assert target_config(target) == target_config(TINY / "target"), (key, value)


# -- engine directories -----------------------------------------------------------------------

def rehash(root: Path) -> None:
    """Make the manifest match the files again, as a careless hand edit would."""
    manifest = json.loads((root / "config.json").read_text())
    files = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if f.is_file() and rel != "config.json":
            files[rel] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": f.stat().st_size}
    manifest["files"] = files
    (root / "config.json").write_text(json.dumps(manifest))


def edit_manifest(root: Path, fn) -> None:
    manifest = json.loads((root / "config.json").read_text())
    fn(manifest)
    (root / "config.json").write_text(json.dumps(manifest))


def edit_component_config(root: Path, component: str, **fields) -> None:
    path = root / component / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def _section(manifest: dict, component: str) -> dict:
    return manifest["components"][component]["quantization"]["quantization"]


def both_refuse(root: Path) -> str:
    """`inspect`'s check and loading give the same refusal."""
    with pytest.raises(EngineDirError) as checked:
        check_engine_dir(root)
    with pytest.raises(EngineDirError) as loaded:
        load_engine(root)
    assert str(checked.value) == str(loaded.value)
    return str(checked.value)


@pytest.fixture
def engine_copy(tiny_engine_dir, tmp_path):
    out = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, out)
    return out


@pytest.mark.parametrize("corrupt, words", [
    (lambda d: edit_manifest(d, lambda m: m["components"]["mtp"].update(kind="medusa")),
     "component mtp has kind 'medusa'"),
    (lambda d: edit_manifest(d, lambda m: m["components"]["dflash"].update(tp_size=0)),
     "component dflash has tp_size 0"),
    (lambda d: edit_manifest(d, lambda m: m["components"].pop("dflash2")),
     "folder dflash2/ belongs to no component"),
    (lambda d: edit_manifest(d, lambda m: m["components"].pop("target")), "no target component"),
    (lambda d: (d / "mtp" / "config.json").write_text('{"hidden_size": "x"}'), "mtp/config.json"),
    (lambda d: (d / "dflash" / "config.json").write_text("[]"), "dflash/config.json must hold"),
    (lambda d: (d / "target" / "rank0.safetensors").write_bytes(
        (d / "target" / "rank0.safetensors").read_bytes()[:100_000]), "target/rank0.safetensors"),
    (lambda d: (d / "tokenizer" / "tokenizer.json").write_text("{}"), "tokenizer.json"),
    # counts past what the files hold, refused before a model of that many modules is built
    (lambda d: edit_component_config(d, "mtp", num_experts=10**6),
     "mtp/rank0.safetensors: missing tensors of expert 8: config num_experts is 1000000"),
    (lambda d: edit_component_config(d, "target", num_experts=10**6), "config num_experts is 1000000"),
    (lambda d: edit_component_config(d, "target", num_hidden_layers=10**6),
     "missing tensors of layer 4: config num_hidden_layers is 1000000"),
    (lambda d: edit_component_config(d, "dflash2", num_hidden_layers=10**6),
     "missing tensors of layer 2: config num_hidden_layers is 1000000"),
    # the stored formats against the manifest's quantization sections
    (lambda d: edit_manifest(d, lambda m: _section(m, "dflash").update(quant_algo="NVFP4")),
     "layers.0.mlp.down_proj is stored as fp8, but the manifest's quant_algo is NVFP4"),
    (lambda d: edit_manifest(d, lambda m: _section(m, "dflash").update(per_channel=False)),
     "quantization section records {'per_channel': False} besides the algorithm; FP8 records "
     "{'per_channel': True}"),
    # the typed entries: a mistyped or unknown field, named
    (lambda d: edit_manifest(d, lambda m: m["components"]["dflash"].update(tp_size="1")),
     "components['dflash']: field 'tp_size' is '1': Input should be a valid integer"),
    (lambda d: edit_manifest(d, lambda m: m["components"]["mtp"].update(nameing="deepseek")),
     "components['mtp'] has an unknown field 'nameing'"),
    (lambda d: edit_manifest(d, lambda m: _section(m, "dflash2").update(quant_algo="MXFP8")),
     "quant_algo 'MXFP8' is not one metrale runs"),
    (lambda d: edit_manifest(d, lambda m: _section(m, "dflash")["quantized_modules"].remove("lm_head")),
     "stored but not listed: ['lm_head']"),
    (lambda d: edit_manifest(d, lambda m: _section(m, "mtp")["quantized_modules"].append("fc")),
     "listed but not stored: ['fc']"),
])
def test_corrupted_engine_dir_refused_alike_by_inspect_and_load(engine_copy, corrupt, words):
    corrupt(engine_copy)
    rehash(engine_copy)
    assert words in both_refuse(engine_copy)


@FUZZ
@given(component=st.sampled_from(["target", "mtp", "dflash", "dflash2"]),
       key=st.sampled_from(["hidden_size", "vocab_size", "num_attention_heads", "block_size",
                            "dflash_config", "architectures", "rope_theta", "num_experts"]),
       value=JSON)
def test_fuzzed_component_configs(tiny_engine_dir, tmp_path_factory, component, key, value):
    root = tmp_path_factory.getbasetemp() / "fuzzed-engine"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(tiny_engine_dir, root)
    cfg_file = root / component / "config.json"
    original = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps(original | {key: value}))
    rehash(root)
    try:
        check_engine_dir(root)
    except EngineDirError as exc:
        assert f"{component}/" in str(exc)
        both_refuse(root)
        return
    load_engine(root)  # what the check passes, loading loads

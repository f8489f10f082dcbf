"""Tests for metrale.runtime.artifact.engine_dir: the manifest, the atomic writer and the verifier."""

import hashlib
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.runtime.artifact.engine_dir import (
    FORMAT_VERSION,
    EngineDirWriter,
    Manifest,
    human_size,
    load_manifest,
    verify_files,
)
from metrale.runtime.artifact.digests import checkpoint_digest
from metrale.runtime.artifact.entries import ComponentEntry
from metrale.runtime.artifact.manifest_view import component_rows, manifest_rows
from metrale.runtime.errors import CheckpointError, EngineDirError

SHA_A = "a" * 64
FP8_SECTION = {"producer": {"name": "modelopt", "version": "0.47.0"},
               "quantization": {"quant_algo": "FP8", "per_channel": True,
                                "quantized_modules": ["fc", "lm_head"], "exclude_modules": []}}


def _write_tiny(final: Path, **kw) -> Manifest:
    """A small engine dir: two components, a tokenizer file, a plugin cubin."""
    with EngineDirWriter(final, **kw) as w:
        w.write_json("target/config.json", {"hidden_size": 8})
        w.save_safetensors("target/rank0.safetensors", {"w": torch.arange(6.0).reshape(2, 3)})
        w.write_bytes("dflash/rank0.safetensors", b"0123456789")
        w.write_bytes("tokenizer/tokenizer.json", b'{"model": {}}')
        w.write_bytes("plugins/nvfp4_gemm.sm120.cubin", b"\x7fELF")
        w.component("target", {"kind": "target", "config": "target/config.json",
                               "files": ["target/rank0.safetensors"]})
        w.component("dflash", {"kind": "dflash", "files": ["dflash/rank0.safetensors"],
                               "weight_bytes": 10, "quantization": FP8_SECTION})
        w.set(tp_size=1, build={"target_sm": [89, 120], "trt_flavor": "none"},
              plugins=[{"name": "nvfp4_gemm"}], memory_estimate={"dflash": {"fp8": 10}},
              sources={"target": {"path": "tiny/target", "sha256": SHA_A}})
    return w.manifest


def _siblings(final: Path) -> list[str]:
    return sorted(p.name for p in final.parent.iterdir())


def test_round_trip_lists_every_file_with_its_digest(tmp_path):
    final = tmp_path / "engines" / "tiny"
    written = _write_tiny(final)
    loaded = load_manifest(final)
    assert loaded == written
    assert set(loaded.files) == {
        "target/config.json", "target/rank0.safetensors", "dflash/rank0.safetensors",
        "tokenizer/tokenizer.json", "plugins/nvfp4_gemm.sm120.cubin",
    }
    # 10 bytes "0123456789": size and sha256 worked out independently of the module.
    assert loaded.files["dflash/rank0.safetensors"] == {
        "sha256": hashlib.sha256(b"0123456789").hexdigest(), "size": 10}
    assert loaded.format_version == FORMAT_VERSION == 1
    assert loaded.components["dflash"] == ComponentEntry(
        kind="dflash", files=["dflash/rank0.safetensors"], weight_bytes=10, quantization=FP8_SECTION)
    assert json.loads((final / "config.json").read_text())["components"]["dflash"] == {
        "kind": "dflash", "files": ["dflash/rank0.safetensors"], "weight_bytes": 10,
        "quantization": FP8_SECTION}  # fields at their defaults (tp_size 1, no plans) left out
    assert loaded.build == {"target_sm": [89, 120], "trt_flavor": "none"}
    # No staging folder left beside the final directory.
    assert _siblings(final) == ["tiny"]


def test_manifest_is_written_with_sorted_keys_and_indent_2(tmp_path):
    final = tmp_path / "e"
    m = _write_tiny(final)
    text = (final / "config.json").read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"
    assert text == m.to_json()
    assert "config.json" not in m.files


def test_safetensors_written_by_the_writer_load_back(tmp_path):
    from safetensors.torch import load_file

    final = tmp_path / "e"
    _write_tiny(final)
    tensors = load_file(final / "target" / "rank0.safetensors")
    assert torch.equal(tensors["w"], torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]))


@settings(max_examples=25, deadline=None)
@given(files=st.dictionaries(
    st.lists(st.sampled_from(["a", "b", "rank0.bin", "x.onnx"]), min_size=1, max_size=3)
    .map(lambda parts: "c/" + "/".join(parts)),
    st.binary(max_size=300), min_size=1, max_size=5))
def test_arbitrary_contents_round_trip(files):
    # A path may not be both a file and a folder: keep only paths that are no other's prefix.
    files = {p: d for p, d in files.items() if not any(q.startswith(p + "/") for q in files)}
    with tempfile.TemporaryDirectory() as tmp:
        final = Path(tmp) / "e"
        with EngineDirWriter(final) as w:
            for rel, data in files.items():
                w.write_bytes(rel, data)
        m = load_manifest(final)
        assert {rel: e["size"] for rel, e in m.files.items()} == {
            rel: len(d) for rel, d in files.items()}
        for rel, data in files.items():
            assert (final / rel).read_bytes() == data
            assert m.files[rel]["sha256"] == hashlib.sha256(data).hexdigest()


def test_flipped_byte_is_refused_naming_the_file(tmp_path):
    final = tmp_path / "tiny"
    _write_tiny(final)
    path = final / "dflash" / "rank0.safetensors"
    path.write_bytes(b"0123X56789")  # same size, one byte changed
    with pytest.raises(EngineDirError) as e:
        load_manifest(final)
    msg = str(e.value)
    assert "file dflash/rank0.safetensors fails its checksum" in msg
    assert hashlib.sha256(b"0123456789").hexdigest()[:12] + "… expected" in msg
    assert hashlib.sha256(b"0123X56789").hexdigest()[:12] + "… found" in msg
    assert "rebuild it with metrale build" in msg
    # verify=False reads the manifest without touching the files.
    assert load_manifest(final, verify=False).files["dflash/rank0.safetensors"]["size"] == 10


def test_deleted_file_is_refused(tmp_path):
    final = tmp_path / "tiny"
    _write_tiny(final)
    (final / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(EngineDirError, match="file tokenizer/tokenizer.json is missing"):
        load_manifest(final)


def test_extra_file_is_refused(tmp_path):
    final = tmp_path / "tiny"
    _write_tiny(final)
    (final / "mtp").mkdir()
    (final / "mtp" / "rank0.onnx").write_bytes(b"x")
    with pytest.raises(EngineDirError, match="file mtp/rank0.onnx is not listed in the manifest"):
        load_manifest(final)


def test_truncated_file_is_refused_with_both_sizes(tmp_path):
    final = tmp_path / "tiny"
    _write_tiny(final)
    (final / "dflash" / "rank0.safetensors").write_bytes(b"01234")
    with pytest.raises(EngineDirError, match=r"dflash/rank0.safetensors has 5 bytes, 10 expected"):
        load_manifest(final)


def test_verify_files_is_callable_on_its_own(tmp_path):
    final = tmp_path / "tiny"
    m = _write_tiny(final)
    verify_files(final, m)  # intact: no error
    (final / "plugins" / "nvfp4_gemm.sm120.cubin").write_bytes(b"\x7fELG")
    with pytest.raises(EngineDirError, match="plugins/nvfp4_gemm.sm120.cubin fails its checksum"):
        verify_files(final, m)


def test_missing_directory_and_missing_or_bad_manifest(tmp_path):
    with pytest.raises(EngineDirError, match="does not exist"):
        load_manifest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineDirError, match=r"config.json \(the manifest\) is missing"):
        load_manifest(tmp_path / "empty")
    final = tmp_path / "tiny"
    _write_tiny(final)
    (final / "config.json").write_text("{not json")
    with pytest.raises(EngineDirError, match="config.json is not valid JSON"):
        load_manifest(final)


def test_exception_inside_writer_leaves_nothing(tmp_path):
    final = tmp_path / "tiny"
    with pytest.raises(ValueError, match="boom"):
        with EngineDirWriter(final) as w:
            w.write_bytes("target/rank0.safetensors", b"half")
            assert w.path.name.startswith(".staging-")
            assert w.path.parent == tmp_path
            raise ValueError("boom")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_failure_while_finishing_leaves_nothing(tmp_path):
    final = tmp_path / "tiny"
    with pytest.raises(EngineDirError, match="manifest tp_size must be an integer >= 1, got 0"):
        with EngineDirWriter(final) as w:
            w.write_bytes("a.bin", b"x")
            w.set(tp_size=0)
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_refused_without_overwrite(tmp_path):
    final = tmp_path / "tiny"
    _write_tiny(final)
    before = (final / "config.json").read_text()
    with pytest.raises(EngineDirError, match=f"engine directory {final} already exists"):
        with EngineDirWriter(final) as w:
            w.write_bytes("a.bin", b"x")
    assert (final / "config.json").read_text() == before
    assert _siblings(final) == ["tiny"]


def test_overwrite_replaces_the_old_directory_completely(tmp_path):
    final = tmp_path / "tiny"
    _write_tiny(final)
    with EngineDirWriter(final, overwrite=True) as w:
        w.write_bytes("target/rank0.safetensors", b"new")
    m = load_manifest(final)
    assert set(m.files) == {"target/rank0.safetensors"}  # nothing of the old dir survives
    assert (final / "target" / "rank0.safetensors").read_bytes() == b"new"
    assert _siblings(final) == ["tiny"]  # old copy moved aside was deleted


def test_overwrite_refuses_a_folder_that_is_not_an_engine_dir(tmp_path):
    final = tmp_path / "precious"
    final.mkdir()
    (final / "thesis.tex").write_text("years of work")
    with pytest.raises(EngineDirError, match="is not an engine directory"):
        with EngineDirWriter(final, overwrite=True) as w:
            w.write_bytes("a.bin", b"x")
    assert (final / "thesis.tex").read_text() == "years of work"
    # An empty folder is fine to replace.
    empty = tmp_path / "empty"
    empty.mkdir()
    with EngineDirWriter(empty, overwrite=True) as w:
        w.write_bytes("a.bin", b"x")
    assert set(load_manifest(empty).files) == {"a.bin"}


@pytest.mark.parametrize("rel", ["../escape.bin", "/abs.bin", "a/../../b", "", "config.json",
                                 "a//b", "./a"])
def test_writing_outside_or_onto_the_manifest_is_refused(tmp_path, rel):
    with pytest.raises(EngineDirError):
        with EngineDirWriter(tmp_path / "e") as w:
            w.write_bytes(rel, b"x")
    assert list(tmp_path.iterdir()) == []


def test_set_refuses_writer_owned_fields(tmp_path):
    with pytest.raises(TypeError, match="'files'"):
        with EngineDirWriter(tmp_path / "e") as w:
            w.set(files={})
    with pytest.raises(EngineDirError, match="component name 'plugins'"):
        with EngineDirWriter(tmp_path / "e") as w:
            w.component("plugins", {})
    assert list(tmp_path.iterdir()) == []


def _manifest_dict(**changes) -> dict:
    data = json.loads(Manifest(metrale_version="0.1.0", created="2026-11-29T00:00:00+00:00",
                               files={"a.bin": {"sha256": SHA_A, "size": 3}}).to_json())
    data.update(changes)
    return data


def test_manifest_json_round_trip():
    entry = {"kind": "target", "files": ["target/rank0.safetensors"], "taps": [1, 3],
             "cpu": {"packages": [{"file": "target/cpu/steps.pt2", "compile_s": 1, "rows": 64,
                                   "dynamic_rows": True, "batched": True}],
                     "torch": "2.13.0", "isa": "AVX512", "machine": "x86_64", "dtype": "float32",
                     "threads": 1, "max_slots": 4096, "linear": "gemm"}}
    listed = {f: {"sha256": SHA_A, "size": 3} for f in ("target/rank0.safetensors", "target/cpu/steps.pt2")}
    entry["files"].append("target/cpu/steps.pt2")
    m = Manifest.from_json(json.dumps(_manifest_dict(components={"target": entry}, files=listed)))
    target = m.components["target"]
    assert target.taps == [1, 3] and target.cpu.packages[0].batched and target.cpu.max_slots == 4096
    assert target.cpu.packages[0].compile_s == 1.0 and target.tp_size == 1 and target.cpu.check == {}
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("field, value, match", [
    ("cpu", "../outside/evil.pt2", r"\.cpu\.packages '\.\./outside/evil\.pt2' is not a normalised path"),
    ("cpu", "/tmp/evil.pt2", "is not a normalised path"),
    ("cpu", "dflash2/cpu/propose.pt2", r"\.cpu\.packages 'dflash2/cpu/propose\.pt2' is not in the component's folder dflash/"),
    ("cpu", "dflash/cpu/other.pt2", "is not a checksummed file of the directory"),
    ("cpu", "dflash/rank0.onnx", None),  # the component's own, but not a package: its load says so
    ("onnx", "dflash/cpu/propose.pt2", None),
    ("onnx", "target/rank0.onnx", r"\.onnx 'target/rank0\.onnx' is not in the component's folder"),
    ("declared", "dflash/spare.safetensors", r"\.declared 'dflash/spare\.safetensors' is not one of the component's files"),
    ("engines", "dflash/../target/rank0.sm89.engine", "is not a normalised path"),
    ("files", "target/rank0.safetensors", r"\.files 'target/rank0\.safetensors' is not in the component's folder"),
])
def test_every_file_a_component_names_is_its_own_checksummed_file(field, value, match):
    """A component's packages, graphs, plans and weights are files of its own folder that the
    manifest checksums; one that points out of the directory, at another component's file or
    at a file nobody checksums is refused when the manifest is read (`inspect` and every load)."""
    own = ["dflash/rank0.safetensors", "dflash/rank0.onnx", "dflash/cpu/propose.pt2"]
    listed = {f: {"sha256": SHA_A, "size": 3} for f in [*own, "dflash/config.json", "dflash/spare.safetensors",
                                                        "dflash2/cpu/propose.pt2", "target/rank0.onnx",
                                                        "target/rank0.safetensors"]}
    entry = {"kind": "dflash", "files": list(own), "config": "dflash/config.json", "onnx": "dflash/rank0.onnx",
             "cpu": {"packages": [{"file": "dflash/cpu/propose.pt2", "compile_s": 1}], "torch": "2.13.0",
                     "isa": "AVX512", "machine": "x86_64", "dtype": "float32", "threads": 1,
                     "max_slots": 64, "linear": "gemm"}}
    Manifest.from_json(json.dumps(_manifest_dict(components={"dflash": entry}, files=listed)))  # as built
    if field == "cpu":
        entry["cpu"]["packages"][0]["file"] = value
    elif field == "engines":
        entry["engines"] = {"89": {"file": value}}
    elif field == "files":
        entry["files"].append(value)
    else:
        entry[field] = value
    text = json.dumps(_manifest_dict(components={"dflash": entry}, files=listed))
    if match is None:
        Manifest.from_json(text)
        return
    with pytest.raises(EngineDirError, match=r"config\.json: components\['dflash'\].*" + match):
        Manifest.from_json(text)


def test_a_manifest_nested_too_deeply_is_refused_in_words():
    with pytest.raises(EngineDirError, match="nests JSON too deeply for a manifest"):
        Manifest.from_json("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("entry, match", [
    ({"files": []}, r"components\['target'\] lacks its field 'kind'"),
    ({"kind": "target", "files": [], "tp_sise": 2}, r"components\['target'\] has an unknown field 'tp_sise'"),
    ({"kind": "target", "files": [], "tp_size": "2"}, r"field 'tp_size' is '2': Input should be a valid integer"),
    ({"kind": "target", "files": "target/rank0.safetensors"}, r"field 'files' is 'target/rank0.safetensors'"),
    ({"kind": "dflash", "files": [], "engines": {"89": {"file": "a", "plugins": {"Op": "1"}}}},
     r"field 'engines.89.plugins.Op' is '1'"),
    ({"kind": "dflash", "files": [], "quantization": {"quantization": {"quant_algo": "FP8"}}},
     r"lacks its field 'quantization.producer'"),
    ("fp8", r"components\['target'\] must be an object"),
])
def test_manifest_component_entries_are_typed(entry, match):
    """A component entry of a missing, unknown or mistyped field is refused when the manifest is
    read, naming the component and the field."""
    with pytest.raises(EngineDirError, match=match):
        Manifest.from_json(json.dumps(_manifest_dict(components={"target": entry})))


def test_manifest_unknown_key_refused():
    with pytest.raises(EngineDirError, match="config.json: unknown key 'extra'"):
        Manifest.from_json(json.dumps(_manifest_dict(extra=1)))


def test_manifest_future_version_refused_before_its_new_keys():
    text = json.dumps(_manifest_dict(format_version=FORMAT_VERSION + 1, new_field=True))
    with pytest.raises(EngineDirError, match=r"format_version 2 was written by a newer metrale.*"
                                             r"upgrade metrale"):
        Manifest.from_json(text)


@pytest.mark.parametrize("changes, match", [
    ({"tp_size": 0}, "tp_size must be an integer >= 1"),
    ({"format_version": True}, "format_version must be an integer"),
    ({"files": {"../x": {"sha256": SHA_A, "size": 1}}}, "'../x' is not a normalised path"),
    ({"files": {"x": {"sha256": "abc", "size": 1}}}, r"files\['x'\] must be"),
    ({"files": {"config.json": {"sha256": SHA_A, "size": 1}}}, "the manifest itself"),
    ({"sources": {"target": {"path": "p"}}}, r"sources\['target'\] must be"),
    ({"created": "yesterday"}, "created must be an ISO 8601 timestamp"),
    ({"plugins": {}}, "plugins must be a JSON array"),
])
def test_manifest_bad_values_refused(changes, match):
    with pytest.raises(EngineDirError, match=match):
        Manifest.from_json(json.dumps(_manifest_dict(**changes)))


def test_manifest_missing_key_refused():
    data = _manifest_dict()
    del data["tp_size"]
    with pytest.raises(EngineDirError, match="missing key 'tp_size'"):
        Manifest.from_json(json.dumps(data))


def test_checkpoint_digest_covers_names_and_contents(tmp_path):
    cp = tmp_path / "cp"
    (cp / "sub").mkdir(parents=True)
    (cp / "config.json").write_bytes(b"{}")
    (cp / "sub" / "w.bin").write_bytes(b"abc")
    # Worked out by hand: sorted paths, each "path NUL size(8 bytes LE)" then its bytes.
    expected = hashlib.sha256(
        b"config.json\0" + (2).to_bytes(8, "little") + b"{}"
        + b"sub/w.bin\0" + (3).to_bytes(8, "little") + b"abc").hexdigest()
    assert checkpoint_digest(cp) == expected
    (cp / "sub" / "w.bin").rename(cp / "sub" / "v.bin")  # same bytes, other name
    assert checkpoint_digest(cp) != expected
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint_digest(tmp_path / "missing")


def test_human_size():
    assert human_size(0) == "0 B"
    assert human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB"
    assert human_size(3 * 1024**2) == "3.0 MiB"
    assert human_size(5 * 1024**4) == "5.0 TiB"


def test_inspect_rows(tmp_path):
    m = _write_tiny(tmp_path / "tiny")
    rows = dict(manifest_rows(m))
    assert rows["tensor parallel"] == "1"
    assert rows["build target_sm"] == "89, 120"
    assert rows["build trt_flavor"] == "none"
    assert rows["plugins"] == "nvfp4_gemm"
    assert rows["source target"] == "tiny/target (sha256 aaaaaaaaaaaa…)"
    assert rows["memory dflash fp8"] == "10 B"
    root = tmp_path / "tiny"
    total = sum(p.stat().st_size for p in root.rglob("*")
                if p.is_file() and p != root / "config.json")
    assert rows["files"] == f"5 files, {human_size(total)}"
    comps = component_rows(m)
    assert [r[0] for r in comps] == ["dflash", "target"]
    assert comps[0] == ("dflash", "dflash", "FP8, 2 modules", "1 file, 10 B")
    assert comps[1][1:3] == ("target", "-")  # the target is not quantized
    assert comps[1][3].startswith("2 files, ")


def test_a_full_disk_while_saving_weights_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """safetensors reports a failed write as its own error with the OS error's number: it
    becomes that OSError, naming the file (the CLI's one line, exit 1), not an internal error."""
    import errno

    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as e:
        with EngineDirWriter(tmp_path / "e") as w:
            w.save_safetensors("target/rank0.safetensors", {"w": torch.zeros(2)})
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("target/rank0.safetensors")
    assert e.value.strerror == "No space left on device" and list(tmp_path.iterdir()) == []

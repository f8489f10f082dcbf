"""Refusals of values that were once accepted silently or ended in an internal error: each is one
line naming the flag (or file, or environment variable), the value and what is allowed, exit 2,
and comes before any model loads or anything is measured."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import typer

from conftest import cli_refused as refused, cli_run as run
from metrale.cli import app


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model or measuring fails the test: every refusal here comes first."""
    import metrale.bench
    import metrale.runtime.backends

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(metrale.runtime.backends, "load_engine", loaded)
    monkeypatch.setattr(metrale.bench, "_load_engine", loaded)
    monkeypatch.setattr(metrale.bench, "measure_costs", loaded)


def prompts_file(tmp_path: Path, content: str | bytes) -> Path:
    f = tmp_path / "prompts.json"
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content, encoding="utf-8")
    return f


# --- --mtp-experts-nvfp4 is read by the MTP mode only -----------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("mode", [[], ["--dflash"]])
@pytest.mark.parametrize("flag", ["--mtp-experts-nvfp4", "--no-mtp-experts-nvfp4"])
def test_mtp_experts_nvfp4_without_speculative_is_refused(tmp_path, command, mode, flag):
    extra = ["--prompt", "x"] if command == "generate" else []
    line = refused(run(command, "--engine-dir", str(tmp_path / "missing"), *extra, *mode, flag),
                   f"{flag} requires --speculative")
    assert ("not with --dflash" in line) == bool(mode)


def configs_without(engine_dir: Path, dest: Path, *components: str) -> Path:
    """The manifest and component configs of `engine_dir` (what bench reads before loading)
    with `components` left out of the manifest."""
    for f in engine_dir.glob("**/config.json"):
        to = dest / f.relative_to(engine_dir)
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, to)
    manifest = json.loads((dest / "config.json").read_text())
    for name in components:
        del manifest["components"][name]
    (dest / "config.json").write_text(json.dumps(manifest))
    return dest


def test_bench_tier_flags_need_a_mode_that_reads_them(tiny_engine_dir, tmp_path, no_loading):
    # --modes selecting no MTP mode: nothing would read it
    refused(run("bench", "--engine-dir", str(tiny_engine_dir), "--modes", "dflash",
                "--mtp-experts-nvfp4"),
            "--mtp-experts-nvfp4 with --modes 'dflash'", "mtp k=1")
    no_head = configs_without(tiny_engine_dir, tmp_path / "no-head", "mtp")
    refused(run("bench", "--engine-dir", str(no_head), "--no-mtp-experts-nvfp4"),
            "--no-mtp-experts-nvfp4", "has no MTP head")
    no_drafter = configs_without(tiny_engine_dir, tmp_path / "no-drafter", "dflash", "dflash2")
    refused(run("bench", "--engine-dir", str(no_drafter), "--draft-weight-quantization", "nvfp4"),
            "--draft-weight-quantization nvfp4", "has no DFlash drafter")


def test_bench_tier_flags_have_bench_help():
    command = typer.main.get_command(app).commands["bench"]
    helps = {p.opts[0]: p.help for p in command.params if p.opts}
    tier, head = helps["--draft-weight-quantization"], helps["--mtp-experts-nvfp4"]
    assert "Requires --dflash" not in tier and "metrale bench: every DFlash mode" in tier
    assert "Requires --speculative" not in head and "metrale bench: every MTP mode" in head


# --- calibrate: --prompts, --num-prompts, --max-tokens, --engine-dir --------------------------


@pytest.mark.parametrize("content, words", [
    ('{"a": 1}', "got a dict"), ("[1, 2]", "item 0 is 1"), (b"\xff\xfe[]", "not a readable"),
    ('[""]', 'item 0 is ""'), ('"abcdef"', "got a str"), ("[]", "got an empty list"),
])
def test_calibrate_prompts_file_must_hold_strings(tmp_path, content, words, no_loading):
    f = prompts_file(tmp_path, content)
    refused(run("calibrate", "--engine-dir", str(tmp_path / "missing"), "--prompts", str(f)),
            "--prompts", str(f), "JSON list of", words)


@pytest.mark.parametrize("command", ["calibrate", "bench"])
def test_num_prompts_above_the_prompts_is_refused(tmp_path, command, no_loading):
    f = prompts_file(tmp_path, '["one", "two"]')
    refused(run(command, "--engine-dir", str(tmp_path / "missing"), "--prompts", str(f),
                "--num-prompts", "3"),
            "--num-prompts 3", "holds 2 prompts", "1 to 2")


@pytest.mark.parametrize("command", ["calibrate", "bench"])
def test_a_short_prompts_file_without_num_prompts_runs_all_of_it(tiny_engine_dir, tmp_path, command,
                                                                  monkeypatch):
    """Without --num-prompts, a --prompts file shorter than the default count is read whole."""
    from metrale import checks
    from metrale.runtime.errors import ConfigError

    def stop(prompts, max_tokens, context):  # the prompts as tokenized, after loading
        raise ConfigError(f"stop: {len(prompts)} prompts")

    monkeypatch.setattr(checks, "prompts_fit", stop)
    f = prompts_file(tmp_path, '["one", "two"]')
    refused(run(command, "--engine-dir", str(tiny_engine_dir), "--prompts", str(f), "--max-tokens", "4"),
            "stop: 2 prompts")


def test_calibrate_max_tokens_beyond_the_context_is_refused(tiny_engine_dir, no_loading):
    refused(run("calibrate", "--engine-dir", str(tiny_engine_dir), "--max-tokens", "5000"),
            "--max-tokens 5000", "1024 tokens")


def test_calibrate_refuses_an_engine_dir_it_cannot_write(tiny_engine_dir, tmp_path, monkeypatch,
                                                         no_loading):
    parent = tmp_path / "ro"
    eng = parent / "eng"
    shutil.copytree(tiny_engine_dir, eng)
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: answer as any other user would
        real = os.access

        def access(path, mode, **kwargs):
            return real(path, mode, **kwargs) and not (
                mode & os.W_OK and not os.stat(path).st_mode & 0o222)

        monkeypatch.setattr(os, "access", access)
    try:
        refused(run("calibrate", "--engine-dir", str(eng), "--max-tokens", "4"),
                f"--engine-dir '{eng}'", "calibration.json", f"{parent} is not writable")
    finally:
        parent.chmod(0o755)


# --- the torchrun environment -------------------------------------------------------------------


TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc': expected an integer of at least 1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected an integer of at least 1"),
    ({"WORLD_SIZE": "1_0"}, "WORLD_SIZE='1_0'"),
    ({"WORLD_SIZE": "2"}, "RANK is not set: expected an integer from 0 to 1 in the environment"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK='2': expected an integer from 0 to 1"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 without MASTER_ADDR"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "port"},
     "MASTER_PORT='port': expected an integer from 1 to 65535"),
])
def test_world_from_a_bad_environment_is_refused(tmp_path, monkeypatch, env, words):
    from metrale.runtime.errors import ConfigError
    from metrale.runtime.models.tp import World

    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        World.from_env("cpu")
    # and so on the command line, before the engine directory is even looked at
    refused(run("generate", "--engine-dir", str(tmp_path / "missing"), "--prompt", "x"), words)


def test_nproc_beside_a_bad_world_size_is_refused_naming_it(tmp_path, monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    refused(run("generate", "--engine-dir", str(tmp_path / "missing"), "--prompt", "x", "--nproc", "2"),
            "WORLD_SIZE='abc': expected an integer of at least 1")


def test_a_drafter_name_that_is_another_component_is_refused_naming_the_flag(tiny_engine_dir):
    refused(run("generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "x", "--dflash",
                "--dflash-drafter", "mtp"), "--dflash-drafter 'mtp': not a DFlash drafter of engine directory")


def test_tensorrt_without_cuda_points_to_the_real_default():
    from metrale.runtime.backends import resolve_backend
    from metrale.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"use --backend auto \(the default\) or torch"):
        resolve_backend("tensorrt", None, "auto", cuda_available=False)

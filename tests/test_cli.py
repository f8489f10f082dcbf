"""The command line: help texts carry the seeds' semantics; bad values are refused with the flag,
the value and what is allowed (exit code 2, no traceback); generate --json; inspect."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from metrale.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def plain_text(s: str) -> str:
    s = re.sub(r"\x1b\[[0-9;]*m", "", s)
    return re.sub(r"[\s│╭╮╰╯─]+", " ", s)


def test_help_texts_say_what_the_seeds_say():
    text = plain_text(invoke("generate", "--help").output)
    for phrase in ("top-1 probability", "still verified", "never the emitted tokens", "0 < TAU < 1",
                   "cum:TAU", "drafts:ms", "re-probe", "ladder"):
        assert phrase.lower() in text.lower(), phrase
    build = plain_text(invoke("build", "--help").output)
    for phrase in ("fp8-aux", "one scale per row", "whole unsharded tensor", "Refused on any other head"):
        assert phrase.lower() in build.lower(), phrase
    # the defaults a help text states in brackets, which rich would read as markup and drop
    for default in ("fp8", "off", "bf16", "bfloat16", "--onnx", "aoti"):
        assert f"[default: {default}]" in build, default


@pytest.mark.parametrize("args, needle", [
    (["--speculative", "--draft-confidence-stop", "1.5"], "--draft-confidence-stop"),
    (["--speculative", "--draft-confidence-stop", "cum:"], "--draft-confidence-stop"),
    (["--dflash", "--draft-confidence-stop", "0.5"], "requires --speculative"),
    (["--draft-confidence-stop", "0.5"], "requires --speculative"),
    (["--dflash", "--dflash-adaptive-k", "0:32,2:50"], "--dflash-adaptive-k"),
    (["--dflash", "--dflash-adaptive-k", "2:32,3:50"], "--dflash-adaptive-k"),
    (["--dflash", "--dflash-adaptive-k", "0:32,1:-4"], "--dflash-adaptive-k"),
    (["--dflash", "--dflash-draft-ladder", "3,1"], "--dflash-draft-ladder"),
    (["--dflash", "--dflash-gamma", "1"], "--dflash-gamma"),
    (["--dflash", "--draft-tp-size", "0"], "rank count of at least 1"),
    (["--speculative", "--dflash"], "--dflash"),
])
def test_refusals_before_any_model_loads(tmp_path, args, needle):
    # the engine directory does not exist: a refusal naming the flag proves nothing was loaded
    r = invoke("generate", "--engine-dir", str(tmp_path / "missing"), "--prompt", "x", *args)
    assert r.exit_code == 2
    assert needle in plain_text(r.output)
    assert "Traceback" not in r.output


def test_gamma_above_block_size_refused(tiny_engine_dir):
    r = invoke("generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "x", "--dflash",
               "--dflash-gamma", "99")
    assert r.exit_code == 2
    assert "--dflash-gamma" in plain_text(r.output) and "block size" in plain_text(r.output)


def test_missing_engine_dir_is_named(tmp_path):
    r = invoke("inspect", "--engine-dir", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "nope" in plain_text(r.output)


def test_generate_json_and_inspect(tiny_engine_dir):
    r = invoke("generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "def main(",
               "--max-tokens", "12", "--json", "--dflash")
    assert r.exit_code == 0, r.output
    row = json.loads(r.output.strip().splitlines()[-1])
    assert len(row["token_ids"]) == 12 or row["finish_reason"] == "stop"
    assert sum(row["accepted_per_step"]) + len(row["accepted_per_step"]) + 1 == len(row["token_ids"])
    assert row["tau"] >= 1.0 and row["tokens_per_s"] > 0
    assert row["backend"] == "torch" and row["backend_note"] == ""  # auto, no CPU packages
    r = invoke("inspect", "--engine-dir", str(tiny_engine_dir), "--json")
    assert json.loads(r.output)["components"]["dflash"]["kind"] == "dflash"
    assert "dflash2" in plain_text(invoke("inspect", "--engine-dir", str(tiny_engine_dir)).output)


def test_build_refuses_bad_tier(tmp_path):
    r = invoke("build", "--engine-dir", str(tmp_path / "e"), "--draft-weight-quantization", "int3")
    assert r.exit_code == 2 and "int3" in plain_text(r.output)
    assert not (tmp_path / "e").exists()

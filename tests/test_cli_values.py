"""Every CLI value is checked before any model loads: a bad one is refused in one line that
names the flag and the value (exit 2), user text is printed literally, and no input gives a
traceback. Fuzzed with hypothesis through typer's runner."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cli_refused as refused, cli_run as run

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("args, needles", [
    (["generate", "--prompt", "x", "--device", "tpu"], ["--device", "'tpu'", "cpu, cuda"]),
    (["generate", "--prompt", "x", "--device", "cuda:x"], ["--device", "cuda:N"]),
    (["generate", "--prompt", ""], ["--prompt", "non-empty"]),
    (["generate", "--prompt", "x", "--temperature", "5e-324"], ["--temperature", "5e-324"]),
    (["generate", "--prompt", "x", "--temperature", "nan"], ["--temperature", "nan"]),
    (["generate", "--prompt", "x", "--top-p", "0"], ["--top-p", "0"]),
    (["generate", "--prompt", "x", "--max-tokens", "0"], ["--max-tokens 0", "at least 1"]),
    (["generate", "--prompt", "x", "--nproc", "0"], ["--nproc", "at least 1"]),
    (["generate", "--prompt", "x", "--dtype", "int8"], ["--dtype", "int8"]),
    (["generate", "--prompt", "x", "--speculative", "--num-drafts", "100000"],
     ["--num-drafts", "100000", "at most 32"]),
    (["serve", "--port", "-1"], ["--port -1", "1 to 65535"]),
    (["serve", "--port", "70000"], ["--port 70000"]),
    (["serve", "--host", ""], ["--host"]),
    (["serve", "--max-queue", "0"], ["--max-queue 0"]),
    (["serve", "--max-request-bytes", "10"], ["--max-request-bytes 10"]),
    (["serve", "--api-key", "a b"], ["--api-key"]),
    (["bench", "--num-prompts", "0"], ["--num-prompts 0"]),
    (["bench", "--num-prompts", "-1"], ["--num-prompts -1"]),
    (["bench", "--repeats", "0"], ["--repeats 0"]),
    (["bench", "--threads", "0"], ["--threads 0"]),
    (["bench", "--modes", ","], ["--modes"]),
    (["bench", "--json", "/nonexistent-folder/out.json"], ["--json", "does not exist"]),
])
def test_bad_values_refused_before_anything_loads(tmp_path, args, needles):
    # the engine directory does not exist: a refusal naming the flag proves nothing loaded
    r = run(*args[:1], "--engine-dir", str(tmp_path / "missing"), *args[1:])
    refused(r, *needles)


@pytest.mark.parametrize("content, kind", [("5", "int"), ('{"a": 1}', "dict"), ("[]", "list"),
                                           ('["ok", 3]', "list"), ("not json", "JSON")])
def test_bench_prompts_file_must_hold_strings(tmp_path, content, kind):
    f = tmp_path / "p.json"
    f.write_text(content)
    refused(run("bench", "--engine-dir", str(tmp_path), "--prompts", str(f)), "--prompts", kind)


def test_bench_modes_matching_nothing_are_refused(tiny_engine_dir):
    refused(run("bench", "--engine-dir", str(tiny_engine_dir), "--modes", "nonsense"),
            "--modes 'nonsense'", "mtp k=1")


def test_generate_max_tokens_beyond_the_context_is_refused(tiny_engine_dir):
    refused(run("generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "x",
                "--max-tokens", "5000"), "--max-tokens 5000", "1024 tokens")


def test_sampling_at_the_edges_gives_text(tiny_engine_dir):
    r = run("generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "def main(",
            "--temperature", "1", "--top-p", "1e-300", "--max-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output.splitlines()[-1])["token_ids"]) == 4


@pytest.mark.parametrize("engine_dir, needle", [
    ("", "expected a directory path"), (".", "current directory"), ("/", "root"),
    ("/proc/x/engine", "cannot create"), ("README.md/x", "not a folder"),
])
def test_build_output_dir_checked_first(engine_dir, needle):
    refused(run("build", "--engine-dir", engine_dir), "--engine-dir", needle)


@pytest.mark.parametrize("args, words", [
    (["--mtp-experts-nvfp4", "--mtp-quantization", "fp8"],
     "--mtp-experts-nvfp4 needs --mtp-quantization bf16"),
    (["--draft-tp-size", "0"], "--draft-tp-size: expected `auto` or a rank count"),
    (["--draft-tp-size", "1_0"], "--draft-tp-size: expected `auto` or a rank count of at least 1, got '1_0'"),
    (["--target-sm", "50"], "--target-sm 50"),
    (["--target-sm", "89,x"], "--target-sm: expected comma-separated"),
    (["--trt-flavor", "vulkan"], "--trt-flavor 'vulkan'"),
])
def test_build_refusals_speak_the_flags(tmp_path, args, words):
    line = refused(run("build", "--engine-dir", str(tmp_path / "e"), *args), words)
    assert "mtp_quantization" not in line and "draft_tp_size" not in line
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("text", ["out[/]", "[bold]x[/bold]", "[red]", "a[/b]c"])
def test_user_text_is_printed_literally(tmp_path, text):
    line = refused(run("inspect", "--engine-dir", str(tmp_path / text)))
    assert text in line


INT_FLAGS = [("generate", "--max-tokens"), ("generate", "--nproc"), ("serve", "--port"),
             ("serve", "--max-queue"), ("serve", "--max-connections"), ("bench", "--repeats"),
             ("bench", "--num-prompts"), ("bench", "--threads"), ("generate", "--num-drafts"),
             ("generate", "--dflash-gamma"), ("generate", "--dflash-reprobe-interval")]
TEXT_FLAGS = [("generate", "--device"), ("generate", "--dtype"), ("generate", "--backend"),
              ("generate", "--draft-confidence-stop"), ("generate", "--dflash-draft-ladder"),
              ("generate", "--dflash-adaptive-k"), ("generate", "--draft-tp-size"),
              ("generate", "--dflash-drafter"), ("serve", "--host"), ("bench", "--modes")]
MODE = {"--num-drafts": ["--speculative"], "--draft-confidence-stop": ["--speculative"],
        "--dflash-gamma": ["--dflash"], "--dflash-draft-ladder": ["--dflash"],
        "--dflash-adaptive-k": ["--dflash"], "--draft-tp-size": ["--dflash"],
        "--dflash-drafter": ["--dflash"], "--dflash-reprobe-interval": ["--dflash"]}


def fuzz_one(tmp_path, command: str, flag: str, value: str):
    extra = ["--prompt", "x"] if command == "generate" else []
    r = run(command, "--engine-dir", str(tmp_path / "missing"), *extra, *MODE.get(flag, []),
            flag, value)
    # every value ends in a refusal: click's usage error for text that is not a number, else
    # one line about the value or (for a valid one) the missing engine directory — never a
    # traceback, never a model load
    if "Invalid value for" in r.output:
        assert r.exit_code == 2 and flag in r.output
    else:
        refused(r)


@FUZZ
@given(flag=st.sampled_from(INT_FLAGS), value=st.one_of(
    st.integers(-(10**20), 10**20), st.sampled_from(["x", "1.5", "", "0x10", "1e3"])))
def test_fuzzed_integer_flags(tmp_path_factory, flag, value):
    fuzz_one(tmp_path_factory.getbasetemp(), *flag, str(value))


@FUZZ
@given(flag=st.sampled_from(TEXT_FLAGS),
       value=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                     max_size=20))
def test_fuzzed_text_flags(tmp_path_factory, flag, value):
    fuzz_one(tmp_path_factory.getbasetemp(), *flag, value)


def test_non_loopback_bind_without_a_key_warns(tmp_path, monkeypatch):
    monkeypatch.delenv("METRALE_API_KEY", raising=False)
    args = ["serve", "--engine-dir", str(tmp_path / "missing"), "--host", "0.0.0.0"]
    r = run(*args)
    assert r.exit_code == 2 and "warning: --host 0.0.0.0 accepts connections" in r.output
    assert "warning" not in run(*args, "--api-key", "k").output
    monkeypatch.setenv("METRALE_API_KEY", "k")
    assert "warning" not in run(*args).output
    assert "warning" not in run("serve", "--engine-dir", str(tmp_path / "missing")).output

"""scripts/offline_wheels.py: what an offline machine with its own PyTorch needs to run metrale's
runtime, server and load test, resolved from this environment's installed metadata (no
download here)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import offline_wheels  # noqa: E402

SCRIPT = Path(offline_wheels.__file__)


def test_the_plan_holds_the_server_stack_at_the_installed_versions_and_not_the_gpu_stack():
    need = offline_wheels.plan("3.12", {})
    for name in ("pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "msgspec",
                 "xgrammar", "openai", "safetensors", "tokenizers", "typer"):
        assert need[name] == f"=={metadata.version(name)}", name
    assert not [n for n in need if n in ("torch", "triton", "metrale") or n.startswith("nvidia-")]


def test_what_the_machine_has_is_left_out_with_what_only_it_requires():
    need = offline_wheels.plan("3.12", {"fastapi": None, "openai": None})
    assert "fastapi" not in need and "openai" not in need
    assert "starlette" not in need  # only fastapi requires it
    assert "pydantic" in need  # the manifest's entries require it too


def test_a_version_there_that_misses_a_requirement_is_replaced():
    # (pydantic asks for a newer one)
    assert offline_wheels.plan("3.12", {"typing-extensions": "4.0.0"})["typing-extensions"] == \
        f"=={metadata.version('typing-extensions')}"
    assert "typing-extensions" not in offline_wheels.plan("3.12", {"typing-extensions": None})


def test_markers_are_read_for_that_python():
    older = offline_wheels.plan("3.10", {})
    assert offline_wheels.canonical("exceptiongroup") in older  # anyio's, below 3.11 only
    assert "exceptiongroup" not in offline_wheels.plan("3.12", {})


def test_have_reads_pip_freeze_and_names_a_bad_line(tmp_path):
    f = tmp_path / "freeze.txt"
    f.write_text("# the image\nTyping_Extensions==4.16.0\nfastapi\ntorch @ file:///wheels/torch.whl\n"
                 "-e git+https://example/x#egg=x\n--index-url https://example\n\n")
    assert offline_wheels.read_have(f) == {"Typing_Extensions": "4.16.0", "fastapi": None, "torch": None}
    f.write_text("pydantic 2.0\n")
    with pytest.raises(SystemExit, match=r"freeze\.txt: 'pydantic 2\.0' is not a line of pip freeze"):
        offline_wheels.read_have(f)


def test_extras_asked_for_bring_their_requirements():
    plain = offline_wheels.plan("3.12", {}, roots=("uvicorn",))
    assert "uvicorn" in plain and "websockets" not in plain
    standard = offline_wheels.plan("3.12", {}, roots=("uvicorn[standard]",))
    assert {"websockets", "httptools", "uvloop"} <= set(standard)


def test_a_root_is_followed_whatever_the_machine_has():
    assert "pydantic" in offline_wheels.plan("3.12", {"metrale": "0.1.0"})


def test_the_command_refuses_a_bad_python_version_and_plans_without_downloading(tmp_path):
    bad = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "w"), "--python-version", "3.x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--python-version '3.x'" in bad.stderr
    ok = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "w"), "--plan"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and f"fastapi=={metadata.version('fastapi')}" in ok.stdout
    assert not (tmp_path / "w").exists()

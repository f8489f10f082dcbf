"""`metrale serve` refuses what it cannot serve before any model loads: an address it cannot
listen on, and an API key in the environment that is empty or malformed (named as the
environment variable, not read as no key)."""

from __future__ import annotations

import socket

from typer.testing import CliRunner

from metrale.cli import app


def _serve(engine_dir, port: int, env: dict | None = None):
    return CliRunner().invoke(app, ["serve", "--engine-dir", str(engine_dir), "--port", str(port),
                                    "--no-engine-process"], env=env or {})


def test_a_port_in_use_is_refused_before_the_models_load(tiny_engine_dir, monkeypatch):
    from metrale.runtime.serving import service

    loads = []
    monkeypatch.setattr(service, "load_engine", lambda *a, **k: loads.append(1))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        got = _serve(tiny_engine_dir, port)
    assert got.exit_code == 2, got.output
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in got.output
    assert "serving" not in got.output and loads == []


def test_an_empty_or_malformed_api_key_in_the_environment_is_refused(tiny_engine_dir):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    got = _serve(tiny_engine_dir, port, {"METRALE_API_KEY": ""})
    assert got.exit_code == 2 and "METRALE_API_KEY is set but empty" in got.output, got.output
    got = _serve(tiny_engine_dir, port, {"METRALE_API_KEY": "a b"})
    assert got.exit_code == 2 and "--api-key (or METRALE_API_KEY): expected" in got.output, got.output

"""Checks of the CLI's own values, run before any model loads.

Contract: each function takes the flag as the user typed it and the value, and either returns
the checked value or raises a `ConfigError` whose one-line message names the flag, the value and
what is allowed. Nothing here imports torch at module level (the checks must be cheap), and
nothing here writes anything that outlives the call: an output location is probed with a
temporary folder that is removed again.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from metrale.runtime.errors import ConfigError


def int_range(flag: str, value: int, lowest: int, highest: int | None = None) -> int:
    """`value` if lowest <= value <= highest, else a refusal naming the flag."""
    if value < lowest or (highest is not None and value > highest):
        allowed = f"of at least {lowest}" if highest is None else f"from {lowest} to {highest}"
        raise ConfigError(f"{flag} {value}: expected an integer {allowed}")
    return value


def finite(flag: str, value: float) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"{flag} {value}: expected a finite number")
    return value


def text(flag: str, value: str) -> str:
    """Non-empty text that encodes as UTF-8 (a shell can pass undecodable bytes)."""
    if not value:
        raise ConfigError(f"{flag} '': expected non-empty text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{flag} {value!r}: not valid UTF-8 text") from None
    return value


def device(value: str | None) -> str | None:
    """`--device`: cpu, cuda or cuda:N, where CUDA (and GPU N) exists."""
    if value is None:
        return None
    kind, _, index = value.partition(":")
    if kind == "cpu" and not index:
        return value
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"--device {value!r}: expected cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device {value!r}: CUDA is not available here (torch "
                          f"{torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ConfigError(f"--device {value!r}: this machine has {count} GPU(s), "
                          f"cuda:0 to cuda:{count - 1}")
    return value


def port(value: int) -> int:
    return int_range("--port", value, 1, 65535)


def host(value: str) -> str:
    """`--host`: an address or name this machine can resolve (not yet whether it can bind)."""
    if not value:
        raise ConfigError("--host '': expected an address such as 127.0.0.1 or 0.0.0.0")
    try:
        socket.getaddrinfo(value, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"--host {value!r}: not an address this machine can resolve "
                          f"({exc})") from None
    return value


def bindable(host: str, port: int) -> None:
    """Refuse (ConfigError naming --host/--port) an address this process cannot listen on: one
    in use, not this machine's, or a privileged port; checked before the models load, so a
    server that cannot serve says so at once rather than after loading them."""
    import contextlib

    try:
        infos = set(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
        with contextlib.ExitStack() as held:  # every address at once, as asyncio's server binds them
            for family, kind, proto, _, address in sorted(infos, key=str):
                sock = held.enter_context(socket.socket(family, kind, proto))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as exc:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def is_loopback(address: str) -> bool:
    """Whether every address `address` resolves to is a loopback address."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


def _existing_ancestor(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def writable_dir(flag: str, folder: Path, shown: str) -> None:
    """A folder can be created under `folder`'s nearest existing ancestor (probed and removed)."""
    base = _existing_ancestor(folder)
    if not base.is_dir():
        raise ConfigError(f"{flag} {shown!r}: {base} is not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".metrale-probe-", dir=base)
    except OSError as exc:
        raise ConfigError(f"{flag} {shown!r}: cannot create anything under {base} "
                          f"({exc.strerror or exc})") from None
    os.rmdir(probe)


def output_dir(flag: str, value: str | Path) -> Path:
    """An output directory: not empty text, not a filesystem root nor the current directory,
    creatable where it goes."""
    shown = os.fspath(value)
    if not shown.strip():
        raise ConfigError(f"{flag} {shown!r}: expected a directory path")
    final = Path(os.path.abspath(shown))
    if final == final.parent:
        raise ConfigError(f"{flag} {shown!r}: a filesystem root cannot be an engine directory")
    cwd = Path.cwd()
    if final == cwd or final in cwd.parents:
        raise ConfigError(f"{flag} {shown!r}: is the current directory or holds it; a build "
                          "replaces its output directory, so name a folder inside it")
    if final.exists() and not final.is_dir():
        raise ConfigError(f"{flag} {shown!r}: exists and is not a directory")
    writable_dir(flag, final.parent, shown)
    return Path(value)


def output_file(flag: str, value: Path) -> Path:
    """A file that will be written at the end of a run: checked before the run starts."""
    shown = os.fspath(value)
    if not shown.strip():
        raise ConfigError(f"{flag} {shown!r}: expected a file path")
    path = Path(os.path.abspath(shown))
    if path.is_dir():
        raise ConfigError(f"{flag} {shown!r}: is a directory; expected a file path")
    if not path.parent.is_dir():
        raise ConfigError(f"{flag} {shown!r}: folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {shown!r}: not writable")
    return value


def _json_file(flag: str, path: Path, what: str) -> Any:
    """The JSON `path` holds; ConfigError naming the flag, the file, `what` it should be and why
    it could not be read."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"{flag} {os.fspath(path)!r}: not a readable {what} ({reason})") from None


def prompt_texts(flag: str, path: Path) -> list[str]:
    """A JSON file holding a non-empty list of non-empty strings."""
    data = _json_file(flag, path, "JSON list of strings")
    expected = f"{flag} {os.fspath(path)!r}: expected a non-empty JSON list of non-empty strings"
    if not isinstance(data, list):
        raise ConfigError(f"{expected}, got a {type(data).__name__}")
    if not data:
        raise ConfigError(f"{expected}, got an empty list")
    for i, t in enumerate(data):
        if not (isinstance(t, str) and t):
            shown = json.dumps(t)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise ConfigError(f"{expected}, got a list whose item {i} is {shown}")
    for t in data:
        text(flag, t)
    return data


def json_schema(flag: str, path: Path) -> str:
    """A JSON file holding a JSON schema a request's `response_format` could carry (its shape
    checked as the server checks it) -> the schema as text."""
    from metrale.runtime.spec.schema_check import check_shape

    data = _json_file(flag, path, "JSON file")
    try:
        check_shape(data)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {os.fspath(path)!r}: {exc}") from None
    return json.dumps(data)


def first_prompts(flag: str, count: int | None, texts: list[str], path: Path, default: int) -> list[str]:
    """The first `count` of the prompts read from `path`; a count given above how many it holds
    is refused rather than cut to what there is (the run would not measure what was asked).
    Not given (None): the first `default`, or all of them where there are fewer."""
    if count is None:
        return texts[:default]
    int_range(flag, count, 1)
    if count > len(texts):
        raise ConfigError(f"{flag} {count}: {os.fspath(path)!r} holds {len(texts)} prompts; "
                          f"expected 1 to {len(texts)}")
    return texts[:count]


def prompts_fit(prompts: list[list[int]], max_tokens: int, context: int) -> None:
    """Each tokenized prompt of `--prompts` with `--max-tokens` after it in the context window."""
    for i, ids in enumerate(prompts):
        if not ids or len(ids) + max_tokens > context:
            raise ConfigError(f"--prompts: prompt {i} takes {len(ids)} tokens; with --max-tokens "
                              f"{max_tokens} it must take 1 to {context - max_tokens} (the "
                              f"context holds {context})")


def updatable_dir(flag: str, folder: Path, why: str) -> None:
    """An existing directory that a command rewrites in place: the new copy, its lock and the
    swap go beside it, so its parent must be writable, and it must be writable itself (a
    read-only one is not replaced behind the user's back). `why` says what is written. A
    directory that does not exist is left to the loader, which names it."""
    shown = os.fspath(folder)
    final = Path(os.path.abspath(shown))
    if not final.is_dir():
        return
    for where in (final.parent, final):
        if not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {shown!r}: {why}, and {where} is not writable; make it "
                              "writable or copy the engine directory somewhere that is")


def context_length(engine_dir: Path) -> int | None:
    """The target's context window from the engine directory's target/config.json, when it can
    be read cheaply (loading reports any problem with the file itself)."""
    try:
        cfg = json.loads((Path(engine_dir) / "target" / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    n = cfg.get("max_position_embeddings", 32768) if isinstance(cfg, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def max_tokens_fit(max_tokens: int, context: int | None, prompt_tokens: int = 1) -> None:
    """`--max-tokens` against the context window, worded as the server words it; before the
    prompt is tokenized `prompt_tokens` is its least possible length, 1."""
    if context is None:
        return
    room = context - prompt_tokens
    if room < 1 or max_tokens > room:
        raise ConfigError(f"--max-tokens {max_tokens}: the context holds {context} tokens; the "
                          f"prompt takes {prompt_tokens}, leaving {max(room, 0)} for completion")

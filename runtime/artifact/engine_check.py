"""Everything about an engine directory that can be checked without building a model.

Contract: `check_files(path)` verifies the manifest and every checksum (`load_manifest`),
then what loading relies on: a `target` component, every component's kind known
(`components.KINDS`), a drafter's `tp_size` a count with that many rank files, every rank file
listed by its component and readable as safetensors, every component config parsing as its
kind's config, every folder on disk claimed by a component (or reserved).
`engine.check_engine_dir` adds loading itself as a dry run on the meta device; `metrale
inspect` and `load_engine` both call that, so inspect passes exactly the directories that load.
Every refusal is an `EngineDirError` naming the directory and the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from metrale.runtime.artifact.engine_dir import RESERVED_NAMES, Manifest, load_manifest
from metrale.runtime.components import KINDS, Role
from metrale.runtime.errors import CheckpointError, EngineDirError

REBUILD = "rebuild it with metrale build"


def _fail(shown: str, what: str) -> EngineDirError:
    return EngineDirError(f"engine directory {shown}: {what}; {REBUILD}")


def read_json(path: Path, shown: str, rel: str) -> dict[str, Any]:
    """A JSON object from `rel`, or an error naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(shown, f"{rel} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _fail(shown, f"{rel} must hold a JSON object, got {type(data).__name__}")
    return data


def check_safetensors(path: Path, shown: str, rel: str) -> None:
    """The file's header parses and its tensors lie inside the file (contents not read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                handle.get_slice(name).get_shape()
    except Exception as exc:  # SafetensorError and OSError: the file is not usable
        raise _fail(shown, f"{rel} cannot be read as safetensors ({exc})") from None


def component_config(root: Path, shown: str, name: str, info):
    """The component's config as its kind parses it (`components.KINDS`), refusals naming it."""
    rel = f"{name}/config.json"
    cfg = read_json(root / rel, shown, rel)
    try:
        return KINDS[info.kind].parse(cfg, f"engine directory {shown}: {rel}", info)
    except CheckpointError as exc:
        raise EngineDirError(f"{exc}; {REBUILD}") from None


def check_files(engine_dir: str | os.PathLike[str], verify: bool = True) -> Manifest:
    root, shown = Path(engine_dir), os.fspath(engine_dir)
    manifest = load_manifest(root, verify=verify)
    comps = manifest.components
    if "target" not in comps:
        raise _fail(shown, "the manifest has no target component")
    for name, info in comps.items():
        kind = KINDS.get(info.kind)
        if kind is None or (kind.role is Role.TARGET) != (name == "target"):
            allowed = [k for k, v in KINDS.items() if (v.role is Role.TARGET) == (name == "target")]
            raise _fail(shown, f"component {name} has kind {info.kind!r}; expected "
                        f"{' or '.join(allowed)}")
        tp = info.tp_size
        if tp < 1 or (tp > 1 and kind.role is not Role.DRAFTER):
            raise _fail(shown, f"component {name} has tp_size {tp!r}; expected an integer >= 1 "
                        "(above 1 for drafters only)")
        files = info.files
        wanted = [f"{name}/rank{r}.safetensors" for r in range(tp)]
        if not all(f in files for f in wanted):
            raise _fail(shown, f"component {name} must list its files {wanted}, got {files!r}")
        for rel in files:
            if rel not in manifest.files:
                raise _fail(shown, f"component {name} lists {rel!r}, which the manifest's files "
                            "do not hold")
        if f"{name}/config.json" not in manifest.files:
            raise _fail(shown, f"component {name} has no {name}/config.json")
        component_config(root, shown, name, info)
        declared = info.declared
        if declared is not None and not (kind.role is not Role.TARGET and declared in files
                                         and declared.endswith(".safetensors")):
            raise _fail(shown, f"component {name} keeps its declared weights in {declared!r}; "
                        "expected one of its own .safetensors files")
        for rel in wanted + ([declared] if declared not in (None, *wanted) else []):
            check_safetensors(root / rel, shown, rel)
    folders = {rel.split("/", 1)[0] for rel in manifest.files if "/" in rel}
    for folder in sorted(folders - set(comps) - RESERVED_NAMES):
        raise _fail(shown, f"folder {folder}/ belongs to no component of the manifest")
    return manifest

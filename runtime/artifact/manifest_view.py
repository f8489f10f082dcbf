"""Human-readable views of an engine directory's manifest, for `metrale inspect`."""

from __future__ import annotations

from typing import Any

from metrale.runtime.artifact.engine_dir import Manifest, human_size
from metrale.runtime.artifact.entries import ComponentEntry

COMPONENT_COLUMNS = ("component", "kind", "quantization", "files")


def quant_cell(entry: ComponentEntry) -> str:
    """A component's quantization section as `ALGO (group 16), N modules` ("-": none)."""
    q = entry.quant_algo
    if q is None:
        return "-"
    if not q.quant_algo:
        return "declared"
    group = (q.model_extra or {}).get("group_size")
    return f"{q.quant_algo}{f' (group {group})' if group else ''}, {len(q.quantized_modules)} modules"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value) or "-"
    return str(value)


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if not isinstance(value, dict):
        return [(prefix, value)]
    return [row for k, v in sorted(value.items()) for row in _flatten(f"{prefix} {k}", v)]


def _files_cell(sizes: list[int]) -> str:
    return f"{len(sizes)} file{'' if len(sizes) == 1 else 's'}, {human_size(sum(sizes))}"


def manifest_rows(manifest: Manifest) -> list[tuple[str, str]]:
    """(field, value) rows describing the whole directory, for `metrale inspect`."""
    rows = [("format version", str(manifest.format_version)),
            ("metrale version", manifest.metrale_version), ("created", manifest.created),
            ("tensor parallel", str(manifest.tp_size))]
    rows += [(key, _cell(v)) for key, v in _flatten("build", manifest.build)]
    names = sorted({p.get("kernel", p.get("name", "?")) if isinstance(p, dict) else p
                    for p in manifest.plugins})
    rows.append(("plugins", _cell(names) if names else "none"))
    for name, src in sorted(manifest.sources.items()):
        rows.append((f"source {name}", f"{src['path']} (sha256 {src['sha256'][:12]}…)"))
    for key, v in _flatten("memory", manifest.memory_estimate):
        is_bytes = isinstance(v, (int, float)) and not isinstance(v, bool)
        rows.append((key, human_size(v) if is_bytes else _cell(v)))
    rows.append(("files", _files_cell([e["size"] for e in manifest.files.values()])))
    return rows


def component_rows(manifest: Manifest) -> list[tuple[str, str, str, str]]:
    """One row per component, columns `COMPONENT_COLUMNS`: name, kind, quantization, files."""
    rows = []
    for name, info in sorted(manifest.components.items()):
        mine = [e["size"] for rel, e in manifest.files.items() if rel.startswith(f"{name}/")]
        rows.append((name, info.kind, quant_cell(info),
                     _files_cell(mine)))
    return rows

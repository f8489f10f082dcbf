"""The engine directory: the contract between `metrale build` and `metrale serve`.

Layout::

    config.json                 the manifest (this module's `Manifest`)
    <component>/                one folder per component (target, mtp, dflash, ...):
        config.json             the component's model config
        rank{r}.safetensors     the weights the torch backend runs
        rank{r}.onnx            the exported graph
        rank{r}.sm{NN}.engine   a TensorRT engine per target SM
    plugins/                    ahead-of-time compiled kernels (cubins)
    tokenizer/                  the tokenizer files

Invariants:
- The manifest lists every file of the directory except itself, with its sha256 and size; a
  directory whose files differ from the list in any way (missing, extra, other size, other
  digest) is refused by `load_manifest`, naming the file.
- A directory is only ever written by `EngineDirWriter`: everything goes into a hidden staging
  folder beside the final one, and that folder is renamed into place only once complete and
  hashed. An exception (Ctrl-C, SIGTERM and SIGHUP included) leaves neither a final directory
  nor a staging folder behind; one writer at a time per directory (`build_lock`), and what a
  killed writer left is removed by the next writer in the same parent.
- A manifest with a newer `format_version` than `FORMAT_VERSION` is refused, never guessed at.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, Mapping

from metrale.runtime import __version__
from metrale.runtime.artifact.build_lock import DirLock, remove_stale, signals_as_interrupts, signals_deferred
from metrale.runtime.artifact.digests import files_under, sha256_file
from metrale.runtime.artifact.entries import ComponentEntry, EntryInvalid, parse_entry
from metrale.runtime.errors import EngineDirError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "config.json"
# Top-level folders that hold no component.
RESERVED_NAMES = frozenset({"plugins", "tokenizer"})
COMPONENT_NAME_RULE = ("allowed (letters, digits, '_', '-', '.', starting with a letter or "
                       f"digit, and not one of {sorted(RESERVED_NAMES)})")

_COMPONENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REBUILD = "rebuild it with metrale build"


def is_component_name(name: object) -> bool:
    """Whether `name` can name a component (and so its folder)."""
    return isinstance(name, str) and bool(_COMPONENT_NAME.fullmatch(name)) \
        and name not in RESERVED_NAMES


def human_size(n: int | float) -> str:
    """Byte count as text with binary units: 512 -> '512 B', 1536 -> '1.5 KiB'."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


class _ManifestInvalid(EngineDirError):
    """A manifest field holds a value the format does not allow (message without location)."""


def _newer_version(version: int) -> str:
    return (f"format_version {version} was written by a newer metrale; this metrale {__version__} "
            f"reads format_version up to {FORMAT_VERSION}: upgrade metrale or rebuild the "
            "directory with this one")


def _json_copy(value: Any, what: str) -> Any:
    # Copy through JSON: the manifest in memory then equals the one read back (tuples -> lists).
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise _ManifestInvalid(f"{what} is not JSON-serialisable ({e})") from None


def _check_rel(rel: str, what: str) -> None:
    p = PurePosixPath(rel)
    if not rel or "\\" in rel or p.is_absolute() or ".." in p.parts or p.as_posix() != rel \
            or rel == ".":
        raise _ManifestInvalid(f"{what} {rel!r} is not a normalised path inside the directory")


def _is_int(value: object, lowest: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lowest


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


@dataclass(frozen=True)
class Manifest:
    """The root config.json of an engine directory.

    `files` maps a relative posix path to {"sha256": hex, "size": bytes} for every file but the
    manifest itself. `sources` maps a component to {"path", "sha256"} of the checkpoint it was
    built from (`digests.checkpoint_digest`). `components` maps a component name to its typed entry
    (`entries.ComponentEntry`: kind, config file, rank files, quantization, graphs, plans,
    packages). `memory_estimate` values are bytes.
    """

    metrale_version: str
    created: str
    files: dict[str, dict[str, Any]]
    sources: dict[str, dict[str, str]] = field(default_factory=dict)
    components: dict[str, ComponentEntry] = field(default_factory=dict)
    tp_size: int = 1
    build: dict[str, Any] = field(default_factory=dict)
    plugins: list[Any] = field(default_factory=list)
    memory_estimate: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        v = self.format_version
        if not _is_int(v, 1):
            raise _ManifestInvalid(f"format_version must be an integer >= 1, got {v!r}")
        if v > FORMAT_VERSION:
            raise _ManifestInvalid(_newer_version(v))
        for name in ("metrale_version", "created"):
            if not isinstance(getattr(self, name), str):
                raise _ManifestInvalid(f"{name} must be a string, got {getattr(self, name)!r}")
        try:
            datetime.fromisoformat(self.created)
        except ValueError:
            raise _ManifestInvalid(f"created must be an ISO 8601 timestamp, got {self.created!r}") \
                from None
        if not _is_int(self.tp_size, 1):
            raise _ManifestInvalid(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        for name, kind in (("files", dict), ("sources", dict), ("components", dict),
                           ("build", dict), ("plugins", list), ("memory_estimate", dict)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                json_kind = "object" if kind is dict else "array"
                raise _ManifestInvalid(f"{name} must be a JSON {json_kind}, got {value!r}")
            if name == "components":
                value = {n: e.to_json() if isinstance(e, ComponentEntry) else e
                         for n, e in value.items()}
            object.__setattr__(self, name, _json_copy(value, name))
        self._check_files()
        for name, src in self.sources.items():
            if not (isinstance(src, dict) and set(src) == {"path", "sha256"}
                    and isinstance(src["path"], str) and _is_sha256(src["sha256"])):
                raise _ManifestInvalid(f'sources[{name!r}] must be {{"path": str, "sha256": 64 '
                                       f'hex digits}}, got {src!r}')
        entries = {}
        for name, info in self.components.items():
            if not is_component_name(name):
                raise _ManifestInvalid(f"component name {name!r} is not {COMPONENT_NAME_RULE}")
            try:
                entries[name] = parse_entry(info, f"components[{name!r}]")
            except EntryInvalid as e:
                raise _ManifestInvalid(str(e)) from None
            self._check_component_paths(name, entries[name])
        object.__setattr__(self, "components", entries)

    def _check_component_paths(self, name: str, entry: ComponentEntry) -> None:
        """Every file a component names (weights, graphs, plans, CPU packages) is one of its own
        `files`, in its own folder, and every one of those is checksummed in `files`: a path
        that left the directory or named another component's file would load unchecked or
        the wrong model."""
        for field_name, rel in [*(("files", f) for f in entry.files), *entry.named_files()]:
            where = f"components[{name!r}].{field_name}"
            _check_rel(rel, where)
            if not rel.startswith(f"{name}/"):
                raise _ManifestInvalid(f"{where} {rel!r} is not in the component's folder {name}/")
            if rel not in self.files:
                raise _ManifestInvalid(f"{where} {rel!r} is not a checksummed file of the directory")
            if field_name not in ("files", "config") and rel not in entry.files:
                raise _ManifestInvalid(f"{where} {rel!r} is not one of the component's files")

    def _check_files(self) -> None:
        for rel, entry in self.files.items():
            _check_rel(rel, "files entry")
            if rel == MANIFEST_NAME:
                raise _ManifestInvalid(f"files lists {MANIFEST_NAME}, the manifest itself")
            if not (isinstance(entry, dict) and set(entry) == {"sha256", "size"}
                    and _is_sha256(entry["sha256"]) and _is_int(entry["size"], 0)):
                raise _ManifestInvalid(f'files[{rel!r}] must be {{"sha256": 64 hex digits, '
                                       f'"size": int >= 0}}, got {entry!r}')

    def to_json(self) -> str:
        """The manifest as written to config.json: sorted keys, indent 2, trailing newline."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["components"] = {n: e.to_json() for n, e in self.components.items()}
        return json.dumps(data, sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate a manifest; `where` names the file in error messages."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise EngineDirError(f"{where} is not valid JSON ({e}); {_REBUILD}") from None
        except RecursionError:
            raise EngineDirError(f"{where} nests JSON too deeply for a manifest; {_REBUILD}") from None
        if not isinstance(data, dict):
            raise EngineDirError(f"{where} must hold a JSON object; {_REBUILD}")
        known = [f.name for f in fields(cls)]
        # Version first: a newer format may well have keys this one does not know.
        if "format_version" not in data:
            raise EngineDirError(f"{where}: missing key 'format_version'; {_REBUILD}")
        version = data["format_version"]
        if _is_int(version, FORMAT_VERSION + 1):
            raise EngineDirError(f"{where}: {_newer_version(version)}")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise EngineDirError(f"{where}: unknown key {unknown[0]!r} (format_version "
                                 f"{FORMAT_VERSION} allows {', '.join(sorted(known))}); {_REBUILD}")
        missing = sorted(set(known) - set(data))
        if missing:
            raise EngineDirError(f"{where}: missing key {missing[0]!r}; {_REBUILD}")
        try:
            return cls(**data)
        except _ManifestInvalid as e:
            raise EngineDirError(f"{where}: {e}; {_REBUILD}") from None


def _dir_error(shown: str, what: str) -> EngineDirError:
    return EngineDirError(f"engine directory {shown}: {what}; {_REBUILD}")


def load_manifest(engine_dir: str | os.PathLike[str], verify: bool = True) -> Manifest:
    """Read an engine directory's manifest and (by default) check every file against it."""
    root, shown = Path(engine_dir), os.fspath(engine_dir)
    if not root.is_dir():
        state = "is not a directory" if root.exists() else "does not exist"
        raise EngineDirError(f"engine directory {shown} {state}; build it with metrale build")
    try:
        text = (root / MANIFEST_NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _dir_error(shown, f"{MANIFEST_NAME} (the manifest) is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _dir_error(shown, f"{MANIFEST_NAME} cannot be read ({e})") from None
    manifest = Manifest.from_json(text, where=f"engine directory {shown}: {MANIFEST_NAME}")
    if verify:
        verify_files(root, manifest)
    return manifest


def verify_files(engine_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Refuse a directory whose files differ from `manifest.files`, naming the first bad file.

    Cheap checks (missing, extra, size) run over the whole directory before any hashing.
    """
    root, shown = Path(engine_dir), os.fspath(engine_dir)
    for rel, entry in sorted(manifest.files.items()):
        path = root / rel
        if not path.is_file():
            raise _dir_error(shown, f"file {rel} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise _dir_error(shown, f"file {rel} has {size} bytes, {entry['size']} expected")
    for rel in files_under(root):
        if rel != MANIFEST_NAME and rel not in manifest.files:
            raise _dir_error(shown, f"file {rel} is not listed in the manifest ({MANIFEST_NAME})")
    for rel, entry in sorted(manifest.files.items()):
        found = sha256_file(root / rel)
        if found != entry["sha256"]:
            raise _dir_error(shown, f"file {rel} fails its checksum (sha256 "
                             f"{entry['sha256'][:12]}… expected, {found[:12]}… found)")


def _is_engine_dir(path: Path) -> bool:
    try:
        data = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and "format_version" in data


class EngineDirWriter:
    """Write an engine directory atomically::

        with EngineDirWriter("engines/tiny", overwrite=True) as w:
            w.save_safetensors("target/rank0.safetensors", tensors)
            w.component("target", {"kind": "qwen3", "config": "target/config.json"})
            w.set(tp_size=1, build={"target_sm": [89, 120], "trt_flavor": "rtx"})
        w.manifest  # the Manifest written

    Files may also be written straight under `w.path`; on clean exit every file there is hashed.
    `overwrite=True` replaces an existing directory only if it is empty or holds a manifest,
    so a mistyped path never deletes unrelated files.
    """

    _SETTABLE = frozenset(f.name for f in fields(Manifest)) - {"files", "format_version"}

    def __init__(self, final_dir: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        self.shown = os.fspath(final_dir)
        self._final = Path(os.path.abspath(final_dir))
        if self._final == self._final.parent:
            raise EngineDirError(f"engine directory {self.shown} cannot be a filesystem root")
        self.overwrite = overwrite
        self._staging: Path | None = None
        self._fields: dict[str, Any] = {}
        self._components: dict[str, ComponentEntry] = {}
        self.manifest: Manifest | None = None

    @property
    def path(self) -> Path:
        """The staging directory; valid only inside the `with` block."""
        if self._staging is None:
            raise RuntimeError("EngineDirWriter.path is only valid inside its with-block")
        return self._staging

    def _check_replaceable(self) -> None:
        final = self._final
        if not (final.exists() or final.is_symlink()):
            return
        if not self.overwrite:
            raise EngineDirError(f"engine directory {self.shown} already exists and overwriting "
                                 "is off; remove it or allow overwriting")
        if final.is_symlink() or not final.is_dir():
            raise EngineDirError(f"engine directory {self.shown} exists and is not a directory; "
                                 "refusing to replace it")
        if any(final.iterdir()) and not _is_engine_dir(final):
            raise EngineDirError(f"{self.shown} is not an engine directory (no {MANIFEST_NAME} "
                                 "with a format_version); refusing to delete it to make room")

    def __enter__(self) -> EngineDirWriter:
        self._check_replaceable()
        parent = self._final.parent
        parent.mkdir(parents=True, exist_ok=True)
        self._lock = DirLock(self._final, self.shown)
        self._lock.acquire()  # one writer per directory; refused while another lives
        self._signals = signals_as_interrupts()
        try:
            remove_stale(parent, own=self._final.name)  # what killed builds left behind
            self._check_replaceable()
            prefix = f".staging-{self._final.name}-"
            self._staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            self._signals.__enter__()  # SIGTERM/SIGHUP unwind through __exit__ like Ctrl-C
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        staging, self._staging = self._staging, None
        assert staging is not None, "__exit__ without __enter__"
        try:
            if exc_type is None:
                self.manifest = self._finish(staging)
        finally:
            # Whatever happened, the staging folder goes; on success it was renamed away.
            shutil.rmtree(staging, ignore_errors=True)
            self._lock.release()
            self._signals.__exit__(None, None, None)
        return False

    def _target(self, rel: str | PurePath) -> Path:
        text = rel.as_posix() if isinstance(rel, PurePath) else str(rel)
        try:
            _check_rel(text, "path")
        except _ManifestInvalid as e:
            raise EngineDirError(f"engine directory {self.shown}: {e}") from None
        if text == MANIFEST_NAME:
            raise EngineDirError(f"engine directory {self.shown}: {MANIFEST_NAME} at the root is "
                                 "the manifest, written by the writer itself")
        out = self.path / text
        out.parent.mkdir(parents=True, exist_ok=True)
        return out

    def write_bytes(self, rel: str | PurePath, data: bytes) -> Path:
        """Write `data` at `rel` (a relative posix path) in the staging dir; returns its path."""
        out = self._target(rel)
        out.write_bytes(data)
        return out

    def write_json(self, rel: str | PurePath, obj: Any) -> Path:
        """Write `obj` as JSON with sorted keys, indent 2 and a trailing newline."""
        return self.write_bytes(rel, (json.dumps(obj, sort_keys=True, indent=2) + "\n").encode())

    def save_safetensors(self, rel: str | PurePath, tensors: Mapping[str, Any],
                         metadata: dict[str, str] | None = None) -> Path:
        """Save torch tensors (any shape/dtype, made contiguous) as one safetensors file."""
        from safetensors.torch import save_file  # lazy: keeps torch out of manifest-only use

        out = self._target(rel)
        try:
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(out), metadata=metadata)
        except Exception as e:  # safetensors' own error type: an OS error (a full disk) named as one
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1])), str(out)) from None
        return out

    def copy_file(self, src: str | os.PathLike[str], rel: str | PurePath) -> Path:
        """Copy the file `src` (contents only, not links or modes) to `rel`."""
        out = self._target(rel)
        shutil.copyfile(src, out)
        return out

    def set(self, **manifest_fields: Any) -> None:
        """Set manifest fields (all but `files` and `format_version`, which the writer owns)."""
        unknown = sorted(set(manifest_fields) - self._SETTABLE)
        if unknown:
            raise TypeError(f"EngineDirWriter.set: unknown or writer-owned field {unknown[0]!r} "
                            f"(settable: {', '.join(sorted(self._SETTABLE))})")
        self._fields.update(manifest_fields)

    @property
    def components(self) -> dict[str, ComponentEntry]:
        """The component entries recorded so far."""
        return dict(self._components)

    def component(self, name: str, info: ComponentEntry | Mapping[str, Any]) -> ComponentEntry:
        """Record (or replace) one component's manifest entry, parsed now (an entry the manifest
        could not hold is refused here, not when the directory is finished)."""
        if not is_component_name(name):
            raise EngineDirError(f"component name {name!r} is not {COMPONENT_NAME_RULE}")
        try:
            entry = parse_entry(_json_copy(dict(info), name) if not isinstance(info, ComponentEntry)
                                else info, f"component {name}'s manifest entry")
        except EntryInvalid as e:
            raise EngineDirError(f"engine directory {self.shown}: {e}") from None
        self._components[name] = entry
        return entry

    def _finish(self, staging: Path) -> Manifest:
        files = {}
        for rel in files_under(staging):
            path = staging / rel
            if rel == MANIFEST_NAME:
                raise EngineDirError(f"engine directory {self.shown}: {MANIFEST_NAME} was written "
                                     "at the root, where the manifest goes")
            if path.is_symlink() or not path.is_file():
                raise EngineDirError(f"engine directory {self.shown}: {rel} is not a regular "
                                     "file; copy the file in instead of linking it")
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        values = dict(self._fields)
        components = dict(values.pop("components", {}))
        components.update(self._components)
        values.setdefault("metrale_version", __version__)
        values.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        try:
            manifest = Manifest(files=files, components=components, **values)
        except _ManifestInvalid as e:
            raise EngineDirError(f"engine directory {self.shown}: manifest {e}") from None
        (staging / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        self._install(staging)
        log.info("wrote engine directory %s (%d files)", self.shown, len(files))
        return manifest

    def _install(self, staging: Path) -> None:
        final = self._final
        if not (final.exists() or final.is_symlink()):
            os.rename(staging, final)
            return
        self._check_replaceable()  # again: the directory may have appeared while building
        aside = Path(tempfile.mkdtemp(prefix=f".replaced-{final.name}-", dir=final.parent))
        aside.rmdir()
        with signals_deferred():  # (a signal between the renames would leave no directory)
            os.rename(final, aside)
            try:
                os.rename(staging, final)
            except BaseException:
                os.rename(aside, final)
                raise
        shutil.rmtree(aside, ignore_errors=True)


def add_files(engine_dir: str | os.PathLike[str], new_files: Mapping[str, bytes]) -> Manifest:
    """Write `new_files` (relative path -> bytes) into an existing, verified engine directory:
    a new directory is staged with every current file plus these, hashed, and swapped in as a
    build's is, so a reader never sees a file its manifest does not vouch for."""
    root = Path(engine_dir)
    old = load_manifest(root, verify=True)
    with EngineDirWriter(root, overwrite=True) as w:
        for rel in old.files:
            if rel not in new_files:
                w.copy_file(root / rel, rel)
        for rel, data in new_files.items():
            w.write_bytes(rel, data)
        w.set(**{f.name: getattr(old, f.name) for f in fields(Manifest)
                 if f.name not in ("files", "format_version")})
    assert w.manifest is not None
    return w.manifest

"""Digests of files and folders: what an engine directory's manifest records of its files and
of the checkpoints it was built from."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from metrale.runtime.errors import CheckpointError

_CHUNK = 1 << 20  # 1 MiB reads: engine files run to hundreds of MB


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_under(root: Path) -> list[str]:
    """Relative posix paths of every file below `root`, sorted; symlinked folders not entered."""
    return sorted((Path(d) / name).relative_to(root).as_posix()
                  for d, _subdirs, names in os.walk(root) for name in names)


def checkpoint_digest(path: str | os.PathLike[str]) -> str:
    """One sha256 over a checkpoint folder: every file's relative path, size and contents.

    Files are taken in sorted relative-path order; each contributes `path NUL size(8 bytes LE)`
    and then its bytes, so renaming, moving or editing any file changes the digest.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root} is not a directory; cannot digest it")
    rels = files_under(root)
    if not rels:
        raise CheckpointError(f"checkpoint {root} holds no files; cannot digest it")
    h = hashlib.sha256()
    for rel in rels:
        file = root / rel
        h.update(rel.encode("utf-8") + b"\0" + file.stat().st_size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()

"""Exclusive writers and leftovers of dead ones, for directories written through a staging folder.

Contract:
- `DirLock(final)` is held by the one process writing `final`: an advisory `flock` on
  `.<name>.metrale-lock` beside it, taken without waiting; a second writer is refused with an
  `EngineDirError` naming the directory and the holder's pid. The kernel drops the lock when its
  holder dies however it dies (kill -9 included), so a lock never outlives its writer; the file
  is unlinked on release (re-checked by inode, so a writer never holds a lock on an unlinked
  file while another holds the live one).
- `remove_stale(parent)` deletes the `.staging-<name>-*` and `.replaced-<name>-*` folders and
  the lock files in `parent` whose directory `<name>` has no live writer: what a killed build
  left behind.
- `signals_as_interrupts()` turns SIGTERM and SIGHUP into `KeyboardInterrupt` for the block it
  guards (main thread only), so they unwind and clean up exactly as Ctrl-C does;
  `signals_deferred()` holds them, and Ctrl-C, back for a block that must not be cut in two.
- A `.replaced-<name>-*` folder whose `<name>` is gone, beside a `.staging-<name>-*` one, is
  what a writer killed mid-swap left: `remove_stale` puts it back instead of deleting it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator

from metrale.runtime.errors import EngineDirError

log = logging.getLogger(__name__)

# tempfile.mkdtemp's suffix: 8 characters of [a-z0-9_]
_LEFTOVER = re.compile(r"\.(?:staging|replaced)-(?P<name>.+)-[a-z0-9_]{8}")
LOCK_SUFFIX = ".metrale-lock"
_LOCK = re.compile(r"\.(?P<name>.+)" + re.escape(LOCK_SUFFIX))


def lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}{LOCK_SUFFIX}"


class DirLock:
    """The exclusive right to write `final` (see the module's contract)."""

    def __init__(self, final: Path, shown: str) -> None:
        self.final, self.shown, self.path = final, shown, lock_path(final)
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if no live writer holds it; True when taken."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the holder released and unlinked it in between: take the new one
                self._fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return True
            os.close(fd)

    def acquire(self) -> None:
        if not self.try_acquire():
            raise EngineDirError(f"engine directory {self.shown} is being written by another build "
                                 f"(pid {self._holder()}); wait for it to finish or choose "
                                 "another --engine-dir")

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(fd)


def remove_stale(parent: Path, own: str | None = None) -> list[Path]:
    """Delete the staging and set-aside folders in `parent` that no live writer owns; `own`
    names a directory whose lock the caller holds (so every leftover of it is stale)."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    # a writer killed between its two renames leaves its staging folder beside the set-aside one
    staged = {m["name"] for e in entries if (m := _LEFTOVER.fullmatch(e.name)) and e.name.startswith(".staging-")}
    for entry in entries:
        m = _LOCK.fullmatch(entry.name)
        if m and m["name"] != own and entry.is_file():  # a dead writer's lock file
            lock = DirLock(parent / m["name"], m["name"])
            if lock.try_acquire():
                lock.release()  # unlinks it
                removed.append(entry)
            continue
        m = _LEFTOVER.fullmatch(entry.name)
        if not m or not entry.is_dir() or entry.is_symlink():
            continue
        lock = None if m["name"] == own else DirLock(parent / m["name"], m["name"])
        if lock is not None and not lock.try_acquire():
            continue  # its writer is alive
        try:
            final = parent / m["name"]
            if (entry.name.startswith(".replaced-") and m["name"] in staged
                    and not (final.exists() or final.is_symlink())):
                # a writer killed between setting the old directory aside and putting the new
                # one in its place: the old one goes back (without a staging folder beside it,
                # the swap was done and the old one is what was being deleted)
                os.rename(entry, final)
                log.warning("restored %s from %s, left by a build killed while replacing it", final, entry)
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed %s, left by a build that did not finish", entry)
        finally:
            if lock is not None:
                lock.release()
    return removed


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block ends (main thread only), then act as they
    would have: for steps that must happen together, as the renames that replace a directory."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # (None: set outside Python)
        if got:
            signal.raise_signal(got[0])


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

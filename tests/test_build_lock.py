"""Builds are atomic under concurrency and signals: one writer per engine directory, a real
`kill -9` during a build leaves nothing the next build in that parent does not remove, and
SIGTERM/SIGHUP clean up like Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from metrale.cli import app
from metrale.runtime.artifact.build_lock import remove_stale
from metrale.runtime.artifact.engine_dir import EngineDirWriter, load_manifest
from metrale.runtime.errors import EngineDirError

ROOT = Path(__file__).resolve().parent.parent


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def small_build(out: Path, text: str = "x") -> None:
    with EngineDirWriter(out, overwrite=True) as w:
        w.write_bytes("target/a.bin", text.encode())


def test_second_writer_of_a_directory_is_refused(tmp_path):
    out = tmp_path / "engine"
    with EngineDirWriter(out) as w:
        w.write_bytes("target/a.bin", b"first")
        with pytest.raises(EngineDirError, match=rf"being written by another build \(pid {os.getpid()}\)"):
            small_build(out, "second")
        # the CLI says the same in one line, before touching the directory
        r = CliRunner().invoke(app, ["build", "--engine-dir", str(out)])
        assert r.exit_code == 2 and "being written by another build" in r.output
    assert (out / "target" / "a.bin").read_bytes() == b"first"
    assert leftovers(tmp_path) == []


WRITER = textwrap.dedent("""
    import os, sys, time
    from metrale.runtime.artifact.engine_dir import EngineDirWriter
    from metrale.runtime.errors import EngineDirError
    try:
        with EngineDirWriter(sys.argv[1], overwrite=True) as w:
            w.write_bytes("target/a.bin", sys.argv[2].encode())
            deadline = time.monotonic() + 30
            while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
                time.sleep(0.01)  # hold the directory until the test has seen the other end
    except EngineDirError as e:
        print(e)
        sys.exit(2)
""")


def test_two_concurrent_builds_one_wins_cleanly(tmp_path):
    out, release = tmp_path / "engine", tmp_path / "release"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(out), tag, str(release)],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for tag in ("one", "two")]
    deadline = time.monotonic() + 30
    while all(p.poll() is None for p in procs):  # the refused one ends while the other holds
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.touch()
    results = [(p.wait(30), p.stdout.read()) for p in procs]
    release.unlink()
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(text for code, text in results if code == 2)
    assert "is being written by another build" in loser
    winner = "one" if results[0][0] == 0 else "two"
    load_manifest(out)  # whole and verified
    assert (out / "target" / "a.bin").read_text() == winner
    assert leftovers(tmp_path) == []


def test_sigterm_and_sighup_clean_up_like_ctrl_c(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGHUP):
        out = tmp_path / f"engine-{sig.name}"
        with pytest.raises(KeyboardInterrupt, match=sig.name):
            with EngineDirWriter(out) as w:
                w.write_bytes("target/a.bin", b"x")
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the signal arrives first
        assert not out.exists() and leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_kill_9_during_a_real_build_leaves_nothing_the_next_build_keeps(tmp_path):
    out = tmp_path / "tiny"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "metrale", "build", "--engine-dir", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not any(n.startswith(".staging-tiny-") for n in leftovers(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, "the build never staged"
        time.sleep(0.02)
    time.sleep(0.2)  # mid-write
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    left = leftovers(tmp_path)
    assert any(n.startswith(".staging-tiny-") for n in left) and not out.exists()
    # the next build in that parent (of another directory) removes what the dead one left
    small_build(tmp_path / "other")
    assert leftovers(tmp_path) == []


def test_stale_leftovers_of_live_writers_are_kept(tmp_path):
    with EngineDirWriter(tmp_path / "busy") as w:
        w.write_bytes("target/a.bin", b"x")
        assert remove_stale(tmp_path) == []
        assert any(n.startswith(".staging-busy-") for n in leftovers(tmp_path))
    assert leftovers(tmp_path) == []


def test_a_signal_between_the_swaps_renames_waits_for_both(tmp_path, monkeypatch):
    """SIGTERM right after the old directory is set aside (before the new one is in its place)
    is held until both renames are done: the directory is never missing, and the build still
    ends as interrupted."""
    from metrale.runtime.artifact import engine_dir

    out = tmp_path / "engine"
    small_build(out, "old")
    rename = os.rename

    def renaming(src, dst):
        rename(src, dst)
        if Path(dst).name.startswith(".replaced-"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the signal arrives here, between the two renames

    monkeypatch.setattr(engine_dir.os, "rename", renaming)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        small_build(out, "new")
    assert (out / "target" / "a.bin").read_text() == "new"
    monkeypatch.setattr(engine_dir.os, "rename", rename)
    small_build(tmp_path / "other")  # the next build clears what was set aside
    assert leftovers(tmp_path) == [] and load_manifest(out).files


def test_a_directory_set_aside_by_a_killed_swap_is_put_back(tmp_path):
    """A writer killed (SIGKILL) between its two renames left the old directory only as
    `.replaced-<name>-*`: the next build in that parent restores it instead of deleting it."""
    out = tmp_path / "engine"
    small_build(out, "old")
    os.rename(out, tmp_path / ".replaced-engine-abcd1234")
    (tmp_path / ".staging-engine-efgh5678" / "target").mkdir(parents=True)  # the new, not yet in place
    small_build(tmp_path / "other")
    assert (out / "target" / "a.bin").read_text() == "old" and load_manifest(out).files
    assert leftovers(tmp_path) == []
    # without a staging folder the swap was done: a set-aside folder left by a cleanup cut short
    # is deleted, even where the directory was removed since
    small_build(out, "new")
    os.rename(out, tmp_path / ".replaced-engine-ijkl9012")
    small_build(tmp_path / "other")
    assert not out.exists() and leftovers(tmp_path) == []

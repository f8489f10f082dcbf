"""The wheels an offline machine needs to run metrale beside its own PyTorch:

    python scripts/offline_wheels.py DIR [--python-version 3.12] [--have FILE] [--plan]

An accelerator machine often has an image of its own (PyTorch, Triton, NumPy, transformers, …)
and no package index. This resolves, from the packages installed here (the versions the tests ran
with), what metrale's runtime, its server and `scripts/load.py`'s client need: metrale's own
dependencies and `openai`, each with what it requires under that machine's Python, leaving out
PyTorch and the GPU stack (the image's), ModelOpt (engines are built elsewhere,
`$METRALE_GPU_ENGINES`) and every distribution named in `--have` (a file with one name per line,
as `pip freeze --all` writes it: what that machine already has; what they require is
left out with them, unless the version there does not meet a requirement). It then downloads
each one's wheel at the version installed here for that Python on manylinux x86-64 into DIR,
with no dependency resolution (`pip download --no-deps`).
`scripts/gpu_checks.sh` installs them offline when `$METRALE_WHEELS=DIR`. `--plan` prints the
list without downloading.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# the GPU machine's own: PyTorch and what its CUDA builds bring, and the engine builder's
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|nvidia-modelopt.*|tensorrt.*)$")
ROOTS = ("metrale", "openai")  # the runtime and server; the load test's client
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def plan(python_version: str, have: dict[str, str | None], roots=ROOTS) -> dict[str, str]:
    """{distribution: `==` the installed version} that `roots` (metrale and the load test's
    client) need under `python_version` on Linux x86-64, from the installed distributions'
    metadata: their requirements whose markers hold there (with the extras asked for),
    transitively, less NEVER, `have` ({name: version, or None when unknown}: what that machine
    has, taken as it is unless its known version misses a requirement's) and what only those
    require; metrale's own are followed whatever `have` says of it. A requirement not installed
    here (its marker holds only on that Python) gets its specifier instead, and pip's choice of
    version; what it requires is not followed. metrale itself is left out (the machine runs it
    from the source tree)."""
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython", "extra": ""}
    have = {canonical(n): v for n, v in have.items()}
    roots = [Requirement(r) for r in roots]
    root_names = {canonical(r.name) for r in roots}
    need: dict[str, str] = {}
    read: dict[str, set[str]] = {}  # a distribution's extras whose requirements were followed
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if NEVER.match(name) or name != "metrale" and name in have and (
                have[name] is None or req.specifier.contains(have[name], prereleases=True)):
            continue
        extras = {""} | set(req.extras)
        if name in read and extras <= read[name]:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # (another Python's marker): pip picks its version
            if name in root_names:
                raise SystemExit(f"{name}: not installed here; install metrale with its test "
                                 "extra (`make .venv/.installed-extras`) first") from None
            need.setdefault(name, str(req.specifier))
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"{name} {dist.version} is installed here, but {req} is required: "
                             "this environment is not the one the tests ran in")
        need[name] = f"=={dist.version}"
        for extra in extras - read.setdefault(name, set()):
            for text in dist.requires or ():
                sub = Requirement(text)
                if (sub.marker.evaluate(env | {"extra": extra}) if sub.marker is not None else extra == ""):
                    todo.append(sub)
        read[name] |= extras
    need.pop("metrale", None)
    return dict(sorted(need.items()))


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def read_have(path: Path | None) -> dict[str, str | None]:
    """--have's file, as `pip freeze --all` writes it: `name==version`, `name @ url` (version
    unknown) or `name`, a line each; options (`-e ...`, `--...`) and comments are skipped."""
    if path is None:
        return {}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"--have {path}: cannot be read ({e.strerror})") from None
    have = {}
    for line in (s.strip() for s in lines):
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise SystemExit(f"--have {path}: {line!r} is not a line of pip freeze (name==version, "
                             "name @ url or a name)") from None
        pinned = [s.version for s in req.specifier if s.operator in ("==", "===")]
        have[req.name] = pinned[0] if pinned and req.url is None else None
    return have


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--have", type=Path)
    ap.add_argument("--plan", action="store_true")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d{1,2}", args.python_version):
        ap.error(f"--python-version {args.python_version!r}: a CPython version as 3.12")
    need = plan(args.python_version, read_have(args.have))
    installed = {n for n in need if need[n] == f"=={_version(n)}"}
    for name, spec in need.items():
        print(f"{name}{spec}" + ("" if name in installed else "  (not installed here: pip picks "
                                                               "it, without what it needs)"))
    if args.plan:
        return 0
    if not need:
        print("nothing to download: that machine has everything")
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", args.python_version, "--implementation", "cp",
           *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(args.dir),
           *(f"{n}{v}" for n, v in need.items())]
    done = subprocess.run(cmd)
    if done.returncode:
        print(f"pip download failed ({done.returncode}); the list above is what was asked for",
              file=sys.stderr)
        return done.returncode
    size = sum(f.stat().st_size for f in args.dir.glob("*.whl"))
    print(f"{len(need)} wheels, {size / 2**20:.1f} MiB in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

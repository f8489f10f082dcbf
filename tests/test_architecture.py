"""The architecture's import contracts (pyproject.toml's [tool.importlinter]): the direction
plugins <- runtime <- builder <- CLI, and no import cycle among the modules of any package, checked
by import-linter. grimp reads a package from one folder, so the check runs over the package
assembled from links as pyproject's package-dir maps the source folders (`gpu_checks.link_package`)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_checks import link_package  # noqa: E402


def _lint(tree: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    return subprocess.run([lint, str(ROOT / "pyproject.toml")], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, timeout=120)


def test_the_import_contracts_hold(tmp_path):
    res = _lint(link_package(ROOT, tmp_path))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "4 kept, 0 broken" in res.stdout


def test_a_runtime_module_importing_the_builder_breaks_the_layers(tmp_path):
    tree = link_package(ROOT, tmp_path)
    runtime = tree / "metrale" / "runtime"
    runtime.unlink()  # a copy of the runtime, with one module that reaches up into the builder
    shutil.copytree(ROOT / "runtime", runtime, ignore=shutil.ignore_patterns("__pycache__"))
    (runtime / "reaches_up.py").write_text("from metrale.builder import build  # noqa: F401\n")
    res = _lint(tree)
    assert res.returncode != 0
    assert "plugins <- runtime <- builder <- CLI BROKEN" in res.stdout
    assert "metrale.runtime.reaches_up -> metrale.builder.build" in res.stdout


def _sources(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_runtime_module_names_the_builder_even_as_a_string():
    """The "module:Class" references the registries resolve are strings import-linter cannot
    see: none of them (nor any other runtime text) names a builder module."""
    named = [rel for rel, text in _sources("runtime") if "metrale.builder" in text.replace(
        "`metrale.builder", "")]  # a docstring may point at one in backquotes
    assert named == []


# The getattr calls of the decode loop and serving that look at something other than a
# proposer, a face or a generator (which declare what they offer: `spec.proposer.Proposer`,
# `backend_registry`, `serving.scheduler.Capabilities`).
_NOT_PROBING = {
    "runtime/serving/http_guard.py": ["getattr(self, name)", 'getattr(ctypes.CDLL(name), "malloc_trim", None)'],
}


def test_the_decode_loop_and_serving_do_not_probe_what_they_are_given():
    import re

    found: dict[str, list[str]] = {}
    for rel, text in _sources("runtime/spec", "runtime/serving"):
        for m in re.finditer(r"\b(hasattr|getattr)\((?:[^()]|\([^()]*\))*\)", text):
            found.setdefault(rel, []).append(m.group(0))
    assert {rel: calls for rel, calls in found.items() if calls != _NOT_PROBING.get(rel)} == {}

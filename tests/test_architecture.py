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
    assert "3 kept, 0 broken" in res.stdout


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

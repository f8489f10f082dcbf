"""The training script of the embedded tiny models runs, is seeded, and writes loadable checkpoints."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from metrale.runtime.models.loader import load_dflash, load_mtp, load_target

SCRIPT = Path(__file__).resolve().parent.parent / "recipes" / "train_tiny.py"


def digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "TRAINING.json"}


@pytest.mark.slow
def test_quick_training_is_reproducible_and_loadable(tmp_path):
    runs = []
    for i, soft in enumerate(("1", "1", "0")):
        out = tmp_path / f"run{i}"
        subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--soft-labels", soft,
                        "--out", str(out)], check=True,
                       capture_output=True, timeout=600)
        runs.append(digest(out))
    assert runs[0] == runs[1]
    # the soft labels train the DFlash drafters only
    changed = {k for k in runs[0] if runs[0][k] != runs[2].get(k)}
    assert changed == {"dflash/model.safetensors", "dflash2/model.safetensors"}, changed
    out = tmp_path / "run0"
    assert {"target/model.safetensors", "mtp/model.safetensors", "dflash/model.safetensors",
            "dflash2/model.safetensors", "target/tokenizer.json", "prompts.json"} <= set(runs[0])
    target = load_target(out / "target")
    head = load_mtp(out / "mtp", target.lm_head.weight)
    assert head.config.naming == "qwen3_next" and head.config.decoder.is_moe
    assert load_dflash(out / "dflash", target.lm_head.weight).config.version == 1
    assert load_dflash(out / "dflash2", target.lm_head.weight).config.version == 2


def test_a_negative_soft_label_weight_is_refused_by_name(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--soft-labels", "-0.5", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--soft-labels -0.5" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()

"""Calibrated step costs: what `metrale calibrate` measured, stored in the engine directory.

`calibration.json` (listed and checksummed in the manifest like every other file) holds one
entry per drafter and setting the costs were measured under::

    {"entries": [{"drafter": "dflash", "backend": "aoti", "dtype": "float32", "threads": 1,
                  "isa": "AVX2", "machine": "x86_64", "torch": "2.13.0",
                  "table": "0:0.41,1:0.93,...", "acceptance": 0.62, "repeats": 5,
                  "measured": "2026-12-01T..."}]}

`table` is a `--dflash-adaptive-k` cost model: the median ms of a decode step verifying k drafts,
k = 0..γ−1 (measured with `--tree-budget N`, then draft trees of k = γ..N nodes); `acceptance` the drafter's per-position acceptance over those steps, which starts
each stream's estimate (see `adaptive_k.AdaptiveKController`). `--dflash-adaptive-k auto` uses the entry whose drafter, backend, dtype, threads and
machine match the serving process; none matching is refused with a message naming what to run.
"""

from __future__ import annotations

import json
from pathlib import Path

from metrale.runtime.errors import EngineDirError
from metrale.runtime.spec.cost_model import CostModel

FILE = "calibration.json"
MATCH = ("drafter", "backend", "dtype", "threads", "isa", "machine", "torch")


def read_entries(engine_dir: Path) -> list[dict]:
    path = Path(engine_dir) / FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise TypeError("entries must be a list of objects")
        return entries
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineDirError(f"engine directory {engine_dir}: {FILE} is not a calibration "
                             f"({exc}); run metrale calibrate again") from None


def setting(drafter: str, backend: str, dtype: str, threads: int) -> dict:
    """The keys an entry is looked up by, for this process."""
    import torch

    from metrale.runtime.backends.aoti import build_fingerprint

    fp = build_fingerprint({"float32": torch.float32, "bfloat16": torch.bfloat16,
                            "float16": torch.float16}[dtype], threads)
    return {"drafter": drafter, "backend": backend, "dtype": dtype, "threads": threads,
            "isa": fp["isa"], "machine": fp["machine"], "torch": fp["torch"]}


def lookup(engine_dir: Path, wanted: dict) -> CostModel | None:
    for entry in read_entries(engine_dir):
        if all(entry.get(k) == wanted[k] for k in MATCH):
            table = CostModel.parse(entry["table"])
            acc = entry.get("acceptance")
            ok = isinstance(acc, (int, float)) and not isinstance(acc, bool) and 0.0 <= acc <= 1.0
            return CostModel(table.first, table.ms, float(acc) if ok else None)
    return None


def describe(wanted: dict) -> str:
    return (f"drafter {wanted['drafter']!r} on backend {wanted['backend']}, {wanted['dtype']}, "
            f"{wanted['threads']} thread(s), {wanted['isa']}")


def merged(engine_dir: Path, new: list[dict]) -> bytes:
    """calibration.json with the `new` entries replacing any entry of the same setting."""
    def same(a, b):
        return all(a.get(k) == b.get(k) for k in MATCH)

    keep = [e for e in read_entries(engine_dir) if not any(same(e, n) for n in new)] + list(new)
    keep.sort(key=lambda e: tuple(str(e.get(k)) for k in MATCH))
    return (json.dumps({"entries": keep}, indent=2, sort_keys=True) + "\n").encode()

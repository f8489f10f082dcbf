"""The step bookkeeping of scripts/gpu_checks.py's run: each step a subprocess under its own time
cap and the run's budget (`Recorder`), recorded in summary.json the moment it ends; and why a
step cannot run on this machine (`gpu_skip_reason`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_STEP_S = 20  # a step that would start with less time left is skipped


@dataclass
class Recorder:
    """The steps so far, in summary.json at once after each (with the result files' heads)."""

    out: Path
    budget_s: float
    min_step_s: float = MIN_STEP_S
    t0: float = field(default_factory=time.monotonic)
    steps: list[dict] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def record(self, name: str, status: str, seconds: float = 0.0, note: str = "") -> dict:
        row = {"step": name, "status": status, "seconds": round(seconds, 1), "note": note}
        self.steps.append(row)
        self.write()
        print(f"=== {name}: {status}" + (f" ({note})" if note else "") +
              (f" in {seconds:.0f}s" if status != "skipped" else ""), flush=True)
        return row

    def status(self, name: str) -> str | None:
        return next((r["status"] for r in reversed(self.steps) if r["step"] == name), None)

    def write(self) -> None:
        summary: dict = {"all_ok": all(r["status"] in ("ok", "skipped") for r in self.steps),
                         "seconds": round(time.monotonic() - self.t0, 1), "steps": self.steps,
                         "skipped": {r["step"]: r["note"] for r in self.steps
                                     if r["status"] == "skipped"}}
        for name in ("env", "kernels", "cubins", "torch-cuda", "bench-torch-cuda", "bench-tensorrt"):
            path = self.out / f"{name}.json"
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if name in ("kernels", "cubins"):
                data = {k: data.get(k) for k in ("sm", "passed", "failed")}
            elif name == "torch-cuda":
                data = {"backend": data.get("backend"),
                        **{m["mode"]: m.get("error", m.get("identical_to_plain",
                                                          m.get("identical_to_plain_info")))
                           for m in data["modes"]}}
            elif name.startswith("bench"):
                data = {"backend": data.get("backend"), "backend_note": data.get("backend_note"),
                        **{m["mode"]: {k: m.get(k) for k in ("tokens_per_s", "tau", "speedup")}
                           for m in data.get("modes", [])}}
            summary[name] = data
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")

    def run(self, name: str, cap_s: float, cmd: list[str], env: dict, cwd: Path = ROOT) -> bool:
        """Run `cmd` under the smaller of its cap and the time left; record the outcome."""
        limit = min(cap_s, self.left())
        if limit < self.min_step_s:  # (not a pass: what it checks went unchecked)
            self.record(name, "not run", note=f"out of time ({self.left():.0f} s of the "
                                              f"{self.budget_s:.0f} s budget left)")
            return False
        print(f"=== {name} (limit {limit:.0f}s): {' '.join(map(str, cmd))}", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, start_new_session=True)
        except OSError as exc:
            self.record(name, "failed", note=f"could not start: {exc}")
            return False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            self.record(name, "failed", time.monotonic() - t0, f"timed out after {limit:.0f} s")
            return False
        self.record(name, "ok" if rc == 0 else "failed", time.monotonic() - t0,
                    "" if rc == 0 else f"exit status {rc}")
        return rc == 0


def gpu_skip_reason(env: dict, needs: tuple[str, ...]) -> str | None:
    """Why a step needing `needs` (cuda, metrale, triton, cuda.bindings, flavor) cannot run here,
    or None. The first missing need is named, with the environment's own reason."""
    what = {"metrale": "metrale", "cli": "metrale's CLI", "builder": "metrale's builder"}
    for need in needs:
        if need in what and not env.get(f"{need}_ok"):
            return f"{what[need]} does not import: {env.get(f'{need}_error') or 'unknown error'}"
        if need == "cuda" and not env.get("cuda"):
            return env.get("cuda_reason") or "no CUDA device"
        if need in ("triton", "cuda.bindings"):
            got = env.get(need)
            if got is None or got.startswith("does not import"):
                pkg = "triton" if need == "triton" else "cuda-python (cuda.bindings)"
                return f"{pkg} {'is not installed' if got is None else got}"
        if need == "flavor" and not env.get("build_flavor"):
            return env.get("build_flavor_reason") or "no TensorRT flavour builds this SM"
    return None

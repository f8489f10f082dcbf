#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one command (within 9 minutes: METRALE_GPU_BUDGET_S):
#   scripts/gpu_checks.sh OUT_DIR
# The steps, their time caps and what each writes are in scripts/gpu_checks.py (its `run`).
# OUT_DIR/summary.json is rewritten as each step ends (ok, failed, or skipped and why), each
# result file as its cases finish, and the whole output goes to OUT_DIR/gpu_checks.log.
# Without a GPU every GPU step is recorded as skipped within seconds and the exit status is 0;
# with one, it is 1 when any step failed.
# Python: $PYTHON, else the first of .venv/bin/python and python3 whose torch sees a GPU, else
# the first whose torch imports. $METRALE_WHEELS=DIR installs the wheels in DIR first, offline
# (what that Python lacks: scripts/offline_wheels.py); $METRALE_GPU_ENGINES=DIR uses a tiny engine
# directory built elsewhere instead of building one (a GPU machine may lack ModelOpt);
# $METRALE_GPU_BUDGET_S (default 540) caps the run (a step it leaves no time for is "not run",
# which fails it); $METRALE_GPU_WORK holds the scratch.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_checks.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

probe() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  fallback=""
  for cand in .venv/bin/python python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    probe "$cand"
    rc=$?
    if [ "$rc" -eq 0 ]; then PY=$cand; break; fi
    if [ "$rc" -eq 3 ] && [ -z "$fallback" ]; then fallback=$cand; fi
  done
  PY=${PY:-${fallback:-python3}}
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi 2>&1 | tee -a "$OUT/gpu_checks.log"
# A pipeline, not a process substitution: the shell waits for tee, so the log keeps its tail.
"$PY" scripts/gpu_checks.py run "$OUT" 2>&1 | tee -a "$OUT/gpu_checks.log"
exit "${PIPESTATUS[0]}"

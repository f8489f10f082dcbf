#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one go (under 8 minutes on an H200):
#   scripts/gpu_checks.sh OUT_DIR
# 1. env: the GPU, its SM, package versions, the TensorRT flavour that builds for the SM
#    (full TensorRT where it imports, else TensorRT-RTX where it lists the SM)        env.json
# 2. kernels: every Triton kernel compiled for this GPU against its PyTorch reference, and
#    the GEMM cubins launched the way the TensorRT plugin launches them            kernels.json
# 3. build: the tiny engine directory, fp8 and nvfp4 drafter tiers, engines for the local SM
# 4. pytest: the gpu-marked tests (tensorrt backend against torch on CUDA)          pytest.log
# 5. bench: the torch backend on CUDA and the tensorrt backend        bench-torch-cuda.json,
#                                                                     bench-tensorrt.json
# Everything is logged to OUT_DIR/gpu_checks.log; OUT_DIR/summary.json says what ran, passed,
# failed or was skipped (and why). Engines and other scratch go to $METRALE_GPU_WORK (default
# a fresh folder under /tmp), not OUT_DIR.
# Assumes `make install` (or a python whose torch sees the GPU: $PYTHON, .venv/bin/python or
# python3); metrale itself is installed editable (no dependencies) when it does not import.
# $METRALE_WHEELS=DIR installs the wheels in DIR first, offline (e.g. tensorrt-rtx, modelopt).
# $METRALE_GPU_BUDGET_S (default 450) caps the whole run; a step that would not fit is skipped.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_checks.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
WORK=${METRALE_GPU_WORK:-$(mktemp -d /tmp/metrale-gpu.XXXXXX)}
mkdir -p "$WORK"
STEPS=$WORK/steps.tsv
: > "$STEPS"
DEADLINE=$((SECONDS + ${METRALE_GPU_BUDGET_S:-450}))
exec > >(tee -a "$OUT/gpu_checks.log") 2>&1
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

note() { printf '%s\t%s\t0\t%s\n' "$1" "$2" "$3" >> "$STEPS"; echo "=== $1: $2 ($3)"; }

# step NAME CAP_SECONDS CMD...: run CMD under the smaller of CAP and the time left; record it
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    note "$name" skipped "out of time"
    return 1
  fi
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@"
  local rc=$?
  local status=ok
  [ "$rc" -eq 0 ] || status=failed
  [ "$rc" -eq 124 ] && status="failed (timed out)"
  printf '%s\t%s\t%s\trc=%s\n' "$name" "$status" "$((SECONDS - t0))" "$rc" >> "$STEPS"
  echo "=== $name: $status in $((SECONDS - t0))s"
  return "$rc"
}

finish() {
  "$PY" scripts/gpu_checks.py summary "$OUT" "$STEPS"
  exit $?
}

cuda_python() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && cuda_python .venv/bin/python; then
  PY=.venv/bin/python
else
  PY=python3
fi
echo "python: $PY"
nvidia-smi || true

if [ -n "${METRALE_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$METRALE_WHEELS"/*.whl \
    && export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c 'import metrale.runtime' 2>/dev/null; then
  step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . || true
fi

if ! step env 60 "$PY" scripts/gpu_checks.py env "$OUT/env.json"; then
  note all failed "no CUDA device visible to $PY: nothing else can run"
  finish
fi
read -r SM FLAVOR < <("$PY" -c "import json; e = json.load(open('$OUT/env.json')); print(e['sm'], e['build_flavor'] or '-')")
echo "SM$SM, engines built with: $FLAVOR"

step kernels 120 "$PY" scripts/gpu_checks.py kernels "$OUT/kernels.json"

ENGINES=""
if [ "$FLAVOR" = "-" ]; then
  note tensorrt skipped "$("$PY" -c "import json; print(json.load(open('$OUT/env.json'))['build_flavor_reason'])")"
  step build-fp8 120 "$PY" -m metrale build --engine-dir "$WORK/tiny-fp8" --trt-flavor none \
    --draft-weight-quantization fp8
else
  for tier in fp8 nvfp4; do
    if step "build-$tier" 150 "$PY" -m metrale build --engine-dir "$WORK/tiny-$tier" \
        --draft-weight-quantization "$tier" --trt-flavor "$FLAVOR" --target-sm "$SM"; then
      ENGINES=${ENGINES:+$ENGINES,}$tier=$WORK/tiny-$tier
    fi
  done
  # the gpu-marked tests; the kernel tests stay out (they put triton in interpreter mode)
  export METRALE_TRT_ENGINES=$ENGINES
  step pytest 200 "$PY" -m pytest tests/test_trt_backend.py -m gpu \
    -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
fi

BENCH=(--num-prompts 4 --max-tokens 32 --repeats 1)
if [ -f "$WORK/tiny-fp8/config.json" ]; then
  step bench-torch-cuda 120 "$PY" -m metrale bench --engine-dir "$WORK/tiny-fp8" --backend torch \
    --device cuda --json "$OUT/bench-torch-cuda.json" "${BENCH[@]}"
  if [ "$FLAVOR" != "-" ]; then
    step bench-tensorrt 120 "$PY" -m metrale bench --engine-dir "$WORK/tiny-fp8" --backend tensorrt \
      --json "$OUT/bench-tensorrt.json" "${BENCH[@]}"
  fi
fi
finish

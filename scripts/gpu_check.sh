#!/usr/bin/env bash
# The GPU check: run on a machine with a CUDA GPU (and its torch), from the
# repository root. Logs and results go to $OUT (the device tool's folder) or
# /tmp/zero_ext_gpu_check.
#   1. The build with the environment's own compiler ($CXX, as a user would
#      get it), and what the self-check said of it.
#   2. scripts/setup.sh: build, self-check, and the rebuild with /usr/bin/g++
#      if the first build crashes on C++ errors.
#   3. tests/cuda and the compatibility subset's CPU-device-independent parts.
#   4. benchmarks/gpu.py at world size 1 (GPT-2 124M and 1.3B, short), into
#      benchmarks/results/gpu-<date>.json and .md (copied to $OUT).
# Prints a summary table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/zero_ext_gpu_check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
ROWS=()

env_cxx=${CXX:-c++}
echo "== environment compiler: CXX=${CXX:-unset} -> $(command -v "$env_cxx") ($("$env_cxx" --version 2>/dev/null | head -1))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== 1. build with the environment's compiler"
rm -rf build zero_ext/_C*.so
start=$(date +%s)
if "$PY" setup.py -q build_ext --inplace >"$OUT_DIR/build_env_cxx.log" 2>&1; then
  status=0
  "$PY" zero_ext/selfcheck.py >"$OUT_DIR/selfcheck_env_cxx.log" 2>&1 || status=$?
  ROWS+=("| build with \$CXX=$env_cxx | $(( $(date +%s) - start ))s | self-check exit $status: $(tail -c 300 "$OUT_DIR/selfcheck_env_cxx.log" | tr '\n' ' ' | cut -c1-200) |")
else
  ROWS+=("| build with \$CXX=$env_cxx | failed | see build_env_cxx.log |")
fi

echo "== 2. scripts/setup.sh (self-check, fallback to the system compiler)"
start=$(date +%s)
if bash scripts/setup.sh >"$OUT_DIR/setup.log" 2>&1; then
  ROWS+=("| scripts/setup.sh | $(( $(date +%s) - start ))s | ok: $("$PY" -c "import json; i=json.load(open('zero_ext/_build_info.json')); print(i['cxx'], '-', i['cxx_version'])") |")
else
  ROWS+=("| scripts/setup.sh | $(( $(date +%s) - start ))s | FAILED (setup.log) |")
  printf '%s\n' "${ROWS[@]}"; exit 1
fi
grep -E "build check|rebuilding" "$OUT_DIR/setup.log"

echo "== 3. tests on CUDA"
start=$(date +%s)
"$PY" -m pytest -q -p no:cacheprovider tests/cuda tests/test_selfcheck.py tests/test_cpu_adam.py \
    2>&1 | tee "$OUT_DIR/pytest_cuda.log" | tail -n 15
ROWS+=("| tests/cuda, self-check, CPU Adam | $(( $(date +%s) - start ))s | $(grep -E '(passed|failed)' "$OUT_DIR/pytest_cuda.log" | tail -1) |")

echo "== 4. benchmarks/gpu.py (world 1, GPT-2 124M and 1.3B)"
start=$(date +%s)
RESULT="benchmarks/results/gpu-$(date +%Y-%m-%d-%H%M).json"
"$PY" benchmarks/gpu.py --world 1 --models gpt2-124m gpt2-1b --steps 10 --warmup 3 \
    --systems plain ddp fsdp2 zero_ext-1 zero_ext-2 zero_ext-3 zero_ext-2-offload \
    --out "$RESULT" 2>&1 | tee "$OUT_DIR/gpu_bench.log" | tail -n 25
cp "$RESULT" "${RESULT%.json}.md" "$OUT_DIR/" 2>/dev/null
ROWS+=("| benchmarks/gpu.py | $(( $(date +%s) - start ))s | $RESULT and ${RESULT%.json}.md |")

echo
echo "| step | time | result |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"

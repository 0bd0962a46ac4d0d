#!/usr/bin/env bash
# The GPU check: run on a machine with a CUDA GPU (and its torch), from the
# repository root. Logs and results go to $OUT (the device tool's folder) or
# /tmp/zero_ext_gpu_check.
#   1. scripts/setup.sh: the build with the environment's own compiler ($CXX,
#      as a user would get it), its self-check, and the rebuild with
#      /usr/bin/g++ if that build crashes on C++ errors; the table says which.
#   2. tests/cuda, the self-check and CPU Adam tests.
#   3. benchmarks/gpu.py at world size 1: GPT-2 124M with every system, GPT-2
#      1.3B with plain, FSDP2 and stages 2, 3 and 3 + offload (short runs), into
#      benchmarks/results/gpu-<date>-<model>.json and .md (copied to $OUT), each
#      with one profiled step per system (zero_ext's ranges, GPU kernel time by kind).
# Sized to run in about 8 minutes on one H100/H200 (16 cores).
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

echo "== 1. scripts/setup.sh: build with the environment's compiler, self-check, rebuild with /usr/bin/g++ if it crashes"
rm -rf build zero_ext/_C*.so
start=$(date +%s)
if bash scripts/setup.sh >"$OUT_DIR/setup.log" 2>&1; then
  used=$("$PY" -c "import json; i=json.load(open('zero_ext/_build_info.json')); print(i['cxx'], '-', i['cxx_version'])")
  if grep -q "rebuilding" "$OUT_DIR/setup.log"; then
    verdict="\$CXX=$env_cxx crashed on C++ errors; rebuilt with $used"
  else
    verdict="\$CXX=$env_cxx passed the self-check: $used"
  fi
  ROWS+=("| scripts/setup.sh | $(( $(date +%s) - start ))s | $verdict |")
else
  ROWS+=("| scripts/setup.sh | $(( $(date +%s) - start ))s | FAILED (setup.log) |")
  printf '%s\n' "${ROWS[@]}"; exit 1
fi
grep -E "build check|rebuilding|self-check" "$OUT_DIR/setup.log"

echo "== 2. tests on CUDA"
start=$(date +%s)
"$PY" -m pytest -q -p no:cacheprovider tests/cuda tests/test_selfcheck.py tests/test_cpu_adam.py \
    2>&1 | tee "$OUT_DIR/pytest_cuda.log" | tail -n 15
ROWS+=("| tests/cuda, self-check, CPU Adam | $(( $(date +%s) - start ))s | $(grep -E '(passed|failed)' "$OUT_DIR/pytest_cuda.log" | tail -1) |")

echo "== 3. benchmarks/gpu.py (world 1): GPT-2 124M, every system; GPT-2 1.3B, the systems the open goals compare"
stamp=$(date +%Y-%m-%d-%H%M)
bench() {  # bench NAME MODEL SYSTEMS...
  local name=$1 model=$2; shift 2
  local result="benchmarks/results/gpu-$stamp-$name.json" start=$(date +%s)
  "$PY" benchmarks/gpu.py --world 1 --models "$model" --steps "${GPU_CHECK_STEPS:-10}" --warmup 3 \
      --systems "$@" --system-timeout 240 --profile --out "$result" 2>&1 | tee "$OUT_DIR/gpu_bench_$name.log" | tail -n 15
  cp "$result" "${result%.json}.md" "$OUT_DIR/" 2>/dev/null
  ROWS+=("| benchmarks/gpu.py $model | $(( $(date +%s) - start ))s | $result |")
}
bench 124m gpt2-124m plain ddp fsdp2 zero_ext-1 zero_ext-2 zero_ext-3 zero_ext-2-offload
bench 1b gpt2-1b plain fsdp2 zero_ext-2 zero_ext-3 zero_ext-3-offload

echo
echo "| step | time | result |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"

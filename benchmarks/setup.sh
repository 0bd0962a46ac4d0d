#!/usr/bin/env bash
# Sets up the comparison benchmarks on top of scripts/setup.sh: transformers
# (model configs), matplotlib (PNGs) and DeepSpeed. DeepSpeed is installed
# with --no-deps and its dependencies named one by one, because its own
# requirement on torch would let pip replace the installed torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -m pip install --quiet transformers matplotlib
"$PY" -m pip install --quiet hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic tqdm einops
"$PY" -m pip install --quiet --no-deps deepspeed
"$PY" -c "import torch, transformers, deepspeed; print(f'torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}')"

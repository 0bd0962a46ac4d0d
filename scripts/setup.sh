#!/usr/bin/env bash
# Sets up a fresh machine: torch (CPU build 2.13.0 only if no torch is present,
# so pip never resolves a multi-GB CUDA torch), test tools, and zero_ext built
# against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet pytest ninja setuptools wheel
"$PY" -m pip install --quiet --no-build-isolation -e .
"$PY" -c "import torch, zero_ext; print(f'zero_ext {zero_ext.__version__} built against torch {torch.__version__}')"

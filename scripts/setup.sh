#!/usr/bin/env bash
# Sets up a fresh machine: torch (CPU build 2.13.0 only if no torch is present,
# so pip never resolves a multi-GB CUDA torch), test tools (pytest; safetensors to
# check zero_ext's own reader against; transformers, accelerate and lightning for the
# Hugging Face flow and the integration tests),
# and zero_ext built
# against that torch. Then the build checks itself (zero_ext/selfcheck.py): a
# C++ error must reach Python as RuntimeError. If the check's child crashes
# and the compiler was not the system one (a wrapper, a conda toolchain), it
# rebuilds once with /usr/bin/g++; otherwise it stops with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet xxhash pytest pytest-xdist ninja setuptools wheel safetensors transformers accelerate lightning peft

build() {
  # Installed (editable) from this checkout already: rebuild in place, which
  # setuptools skips when no source or header is newer than the built .so and
  # ninja limits to the changed files otherwise (setup.py: build/incremental/).
  # Else the editable install, which builds through the same directory.
  local package=$PWD/zero_ext  # outside the checkout, `import zero_ext` finds what is installed
  if (cd / && "$PY" -c "import os, sys, zero_ext; sys.exit(os.path.dirname(zero_ext.__file__) != sys.argv[1])" \
        "$package") 2>/dev/null; then
    PYTHONWARNINGS=ignore "$PY" setup.py -q build_ext --inplace
  else
    "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
  fi
}

build
status=0
"$PY" zero_ext/selfcheck.py || status=$?
if [ "$status" -eq 2 ]; then
  echo "setup.sh: rebuilding zero_ext with the system compiler (/usr/bin/g++)" >&2
  rm -rf build zero_ext/_C*.so
  CXX=/usr/bin/g++ CC=/usr/bin/gcc build
  status=0
  "$PY" zero_ext/selfcheck.py || status=$?
fi
if [ "$status" -ne 0 ]; then
  echo "setup.sh: zero_ext's build check failed (see above); not going on with a build that crashes" >&2
  exit 1
fi
"$PY" -c "import torch, zero_ext; print(f'zero_ext {zero_ext.__version__} built against torch {torch.__version__}')"

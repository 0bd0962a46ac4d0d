#!/usr/bin/env bash
# Builds zero_ext against each torch of the supported matrix and runs the
# compatibility subset of the test suite on it.
#
#   bash scripts/test_torch_versions.sh                # the whole matrix
#   bash scripts/test_torch_versions.sh 2.11.0         # one version
#   ZERO_EXT_TORCH_ENVS=/big/disk bash scripts/test_torch_versions.sh 2.14.1
#   ZERO_EXT_VERSION_TESTS="tests/test_compile.py" bash scripts/test_torch_versions.sh 2.11.0
#
# Each version gets a virtual environment under $ZERO_EXT_TORCH_ENVS
# (default ~/.cache/zero_ext/torch-envs/torch-VERSION), reused while its torch
# is the right one. torch is always installed pinned (torch==VERSION): pip
# never resolves it on its own. zero_ext is built as a wheel in that
# environment's src/ (incrementally, with ninja) and installed non-editable
# into it, so the checkout's own build (against the default torch) is left
# alone, the tests import the installed copy, and the install is tested.
#
# The subset: parity at world sizes 1 and 2, errors, checkpoints, CPU Adam,
# mixed precision, the build self-check, the benchmarks' smoke test, the
# registered ops (dispatcher and opcheck APIs move between releases), no Python
# in backward, and the components alone. Prints
# one table row per version: build time, tests passed/failed, wall time.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# The matrix: the declared lower bound (zero_ext/tools/torch_compat.py), the GPU
# machine's torch, the default one and the newest the registry serves.
MATRIX=(2.11.0 2.12.1 2.13.0 2.14.1 2.15.0)
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=("${MATRIX[@]}")
ENVS=${ZERO_EXT_TORCH_ENVS:-$HOME/.cache/zero_ext/torch-envs}
BASE_PY=${PYTHON:-python3}
SUBSET=(tests/test_parity.py tests/test_errors.py tests/test_errors_loose_inputs.py tests/test_checkpoint.py tests/test_checkpoint_trust.py
        tests/test_checkpoint_integrity.py
        tests/test_trust.py tests/test_cpu_adam.py tests/test_mixed_precision.py tests/test_selfcheck.py
        tests/test_default_settings.py tests/test_benchmarks.py tests/test_core_ops.py tests/test_core_views.py tests/test_python_calls.py
        tests/test_components.py tests/test_safetensors.py tests/test_weights.py tests/test_deferred_init.py
        tests/test_hf_flow.py tests/test_compile.py tests/test_env.py tests/test_profiler.py
        tests/test_whole_param_optimizers.py tests/test_package_layout.py tests/test_nvme_offload.py)
# ZERO_EXT_VERSION_TESTS="tests/test_compile.py ..." runs those instead.
[ -n "${ZERO_EXT_VERSION_TESTS:-}" ] && read -r -a SUBSET <<< "$ZERO_EXT_VERSION_TESTS"
mkdir -p "$ENVS"

env_torch_version() {  # the torch version a venv has, or nothing
  "$1/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null
}

TEST_DEPS=(xxhash pytest pytest-xdist ninja setuptools wheel numpy safetensors transformers)

prepare_env() {  # $1 version, $2 env dir: a venv whose torch is $1
  local version=$1 env=$2
  # Reused only if its set-up finished (the marker is written last); test
  # tools added since are installed into it (a no-op when present).
  if [ -f "$env/.complete" ] && [ "$(env_torch_version "$env")" = "$version" ]; then
    echo "[torch $version] reusing $env"
    "$env/bin/python" -m pip install --quiet "${TEST_DEPS[@]}" >>"$env.pip.log" 2>&1 || { tail "$env.pip.log"; return 1; }
    return 0
  fi
  echo "[torch $version] creating $env"
  rm -rf "$env"
  "$BASE_PY" -m venv "$env" || return 1
  "$env/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1
  # Pinned: the CPU build where the registry has one (2.13.0 here), else the
  # standard wheel, which imports and runs on CPU. A machine-wide constraint
  # file may cap torch below the version asked for (these machines cap at
  # 2.14.1): then this one install runs with pip's configuration minus it.
  without_constraint "$env/bin/python" -m pip install --quiet "torch==$version" >"$env.pip.log" 2>&1 \
    || { tail "$env.pip.log"; return 1; }
  "$env/bin/python" -m pip install --quiet "${TEST_DEPS[@]}" >>"$env.pip.log" 2>&1 \
    || { tail "$env.pip.log"; return 1; }
  [ "$(env_torch_version "$env")" = "$version" ] && touch "$env/.complete"
}

without_constraint() {  # runs "$@" with pip's configuration, less any global constraint file
  # With PIP_CONFIG_FILE=/dev/null pip reads no configuration file at all, so
  # every global setting but the constraint comes back as its PIP_* variable
  # (pip config list prints them as global.key='value').
  local vars=()
  while IFS= read -r line; do
    vars+=("$line")
  done < <("$BASE_PY" -m pip config list 2>/dev/null | sed -nE "s/^global\.([a-z-]+)='(.*)'$/\1=\2/p" \
             | grep -v '^constraint=' | awk -F= '{k=toupper($1); gsub("-", "_", k); sub("^[^=]*=", ""); print "PIP_" k "=" $0}')
  env PIP_CONFIG_FILE=/dev/null "${vars[@]}" "$@"
}

sources_hash() {
  # Everything the wheel holds: a change to the Python package alone must
  # build a new wheel too, or the tests would run the previous code.
  (cd "$REPO" && cat setup.py pyproject.toml csrc/* $(find zero_ext -name '*.py' | LC_ALL=C sort) | sha256sum | cut -c1-16)
}

build_in_env() {  # $1 env dir: builds a wheel of the checkout's sources against its torch and installs it
  local env=$1 src=$1/src
  mkdir -p "$src"
  # Copy only what the build and the package need; keep src/build for ninja.
  rm -rf "$src/zero_ext" "$src/csrc"
  # -p keeps the sources' times, so setuptools and ninja rebuild only what changed.
  cp -rp "$REPO/zero_ext" "$REPO/csrc" "$REPO/setup.py" "$REPO/pyproject.toml" "$src/"
  # A source whose content changed since the last build but whose time is
  # older than its object (edited while that build ran) is touched, so
  # ninja rebuilds it (before: an undefined symbol at import).
  (cd "$src" && sha256sum csrc/* > .hashes.now && if [ -f .hashes.built ]; then
     diff .hashes.built .hashes.now | sed -n 's/^> [0-9a-f]*  //p' | while read -r f; do touch "$f"; done
   fi)
  find "$src/zero_ext" -name '*.so' -delete
  rm -f "$src/zero_ext/_build_info.json"
  # A non-editable install, as users get it: `pip wheel` builds the wheel
  # (in the source tree, so ninja rebuilds only what changed) and pip installs
  # it into the environment's site-packages; the tests import that copy.
  if [ "$(cat "$env/built/hash" 2>/dev/null)" = "$(sources_hash)" ] && ls "$env"/built/zero_ext-*.whl >/dev/null 2>&1; then
    echo "[reusing the wheel of these sources]"
  else
    rm -rf "$env/wheel"
    if ! (cd "$src" && MAX_JOBS=${MAX_JOBS:-2} "$env/bin/python" -m pip wheel --no-build-isolation --no-deps \
          -w "$env/wheel" .) >"$env/build.log" 2>&1; then
      grep -E "error|Error" "$env/build.log" | head -n 30
      echo "[build failed: $env/build.log]"
      return 1
    fi
    rm -rf "$env/built" && mkdir -p "$env/built"
    cp "$env"/wheel/zero_ext-*.whl "$env/built/" && sources_hash > "$env/built/hash"
    mv "$src/.hashes.now" "$src/.hashes.built"
  fi
  "$env/bin/python" -m pip install --quiet --no-deps --force-reinstall "$env"/built/zero_ext-*.whl \
    >>"$env/build.log" 2>&1 || { tail "$env/build.log"; return 1; }
  # Run from the env, never the checkout: the installed package must be whole
  # (every subpackage in the wheel) and check itself: a C++ error must reach
  # Python as RuntimeError.
  (cd "$env" && "$env/bin/python" -c "import zero_ext, zero_ext.integrations.accelerate, zero_ext.integrations.transformers; \
print('installed:', zero_ext.__file__)") || return 1
  (cd "$env" && "$env/bin/python" -W "ignore::RuntimeWarning" -m zero_ext.selfcheck)
}

ROWS=()
STATUS=0
for version in "${VERSIONS[@]}"; do
  env=$ENVS/torch-$version
  started=$(date +%s)
  if ! prepare_env "$version" "$env"; then
    ROWS+=("| $version | - | setup failed | - |"); STATUS=1; continue
  fi
  built_at=$(date +%s)
  if ! build_in_env "$env"; then
    ROWS+=("| $version | failed | - | - |"); STATUS=1; continue
  fi
  build_s=$(( $(date +%s) - built_at ))
  log=$env/pytest.log
  # Run from the env, not the checkout: `import zero_ext` must find the wheel
  # installed for this torch, never the checkout's own build.
  # ZERO_EXT_TIER=all: the subset names its files, the jobs tier's among them.
  (cd "$env" && ZERO_EXT_PARITY_WORLDS=1,2 ZERO_EXT_TIER=all "$env/bin/python" -m pytest -q -n 2 \
      -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
      "${SUBSET[@]/#/$REPO/}" 2>&1 | tee "$log" | tail -n 40)
  [ "${PIPESTATUS[0]}" -eq 0 ] || STATUS=1
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?)\b.* in [0-9.]+s' "$log" | tail -1 \
    | sed -E 's/^=+ //; s/ =+$//')
  ROWS+=("| $version | ${build_s}s | ${summary:-no summary (see $log)} | $(( $(date +%s) - started ))s |")
done

echo
echo "| torch | build | tests | wall |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
exit $STATUS

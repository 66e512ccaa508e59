#!/usr/bin/env bash
# Installs what is missing (apt), builds shardps (Release, with CUDA when nvcc
# exists; deploy/local/build.sh) and runs the whole test suite: format and
# thread-safety checks, unit, end-to-end and (skipping without a GPU) GPU
# tests. Idempotent; fast when all is there.
#   tests/run.sh                      # build into build/, run every test
#   SHARDPS_SANITIZE=thread tests/run.sh   # ThreadSanitizer build in build-thread/
#   SHARDPS_SANITIZE=address tests/run.sh  # AddressSanitizer build in build-address/
#   SHARDPS_CHECKS=0 tests/run.sh     # skip the format and thread-safety checks
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

log() { printf '\n== %s\n' "$*"; }

# --- packages and build ----------------------------------------------------
sanitize=${SHARDPS_SANITIZE:-}
# The Python tests' packages (Debian's torch is for /usr/bin/python3).
test_packages=(python3-pytest python3-torch python3-matplotlib bible-kjv
  bible-kjv-text)
deploy/local/apt_install.sh "${test_packages[@]}"
build_dir=$(deploy/local/build.sh)
jobs=${SHARDPS_JOBS:-2}

# --- static checks ---------------------------------------------------------
if [ "${SHARDPS_CHECKS:-1}" = 1 ] && [ -z "$sanitize" ]; then
  log "clang-format --dry-run --Werror"
  git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
  log "clang -Wthread-safety"
  "$root/tests/thread_safety_check.sh" "$build_dir"
fi

# --- tests -----------------------------------------------------------------
log "ctest"
export TSAN_OPTIONS=${TSAN_OPTIONS:-"halt_on_error=1 second_deadlock_stack=1"}
export ASAN_OPTIONS=${ASAN_OPTIONS:-"detect_leaks=1"}
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" ${SHARDPS_CTEST_ARGS:-}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "NOTE: no GPU on this machine: the GPU tests (ctest -L gpu) were skipped;"
  echo "      run tests/gpu/check.sh on a machine with a GPU."
fi

# --- Python (the shardps package and its PyTorch layer) --------------------
# Real daemons and worker processes; not in sanitizer builds (the package
# is not built there).
if [ -z "$sanitize" ]; then
  log "pytest tests/python"
  # tests/gpu/test_torch_cuda.py too: it skips, saying why (-rs), where
  # torch has no CUDA.
  SHARDPS_BUILD_DIR="$(cd "$build_dir" && pwd)" /usr/bin/python3 -m pytest -q -rs -p no:cacheprovider \
    tests/python tests/gpu/test_torch_cuda.py ${SHARDPS_PYTEST_ARGS:-}
fi

# --- deploy/ (Docker, Compose, Kubernetes) ------------------------------------
# tests/deploy/validate.sh: offline checks of deploy/ and the real daemons run
# with the flags of the Compose file and the ConfigMap (about 1.5 min).
# tests/deploy/compose_up.sh: the image built and the Compose stack trained in
# containers (root, 2-4 min); runs in CI (CI=true) or with
# SHARDPS_DEPLOY_CONTAINERS=1. Missing tools are installed by
# tests/deploy/setup.sh, or the step says SKIP. SHARDPS_DEPLOY=0 skips both.
if [ "${SHARDPS_DEPLOY:-1}" = 1 ] && [ -z "$sanitize" ]; then
  log "deploy checks (tests/deploy)"
  if tests/deploy/setup.sh; then
    tests/deploy/validate.sh "$build_dir"
  else
    echo "SKIP: tests/deploy/setup.sh could not install the tools; deploy checks not run"
  fi
  if [ "${SHARDPS_DEPLOY_CONTAINERS:-${CI:-0}}" = 1 ] ||
     [ "${SHARDPS_DEPLOY_CONTAINERS:-${CI:-0}}" = true ]; then
    log "container run (tests/deploy/compose_up.sh)"
    tests/deploy/compose_up.sh
  else
    echo "NOTE: the container run (tests/deploy/compose_up.sh) was skipped;"
    echo "      SHARDPS_DEPLOY_CONTAINERS=1 tests/run.sh runs it (root, 2-4 min)."
  fi
fi

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

#!/usr/bin/env bash
# Installs what is missing (apt), builds shardps (Release, with CUDA when nvcc
# exists) and runs the whole test suite. Idempotent; fast when all is there.
#   tests/run.sh                      # build into build/, run every test
#   SHARDPS_SANITIZE=thread tests/run.sh   # ThreadSanitizer build in build-thread/
#   SHARDPS_SANITIZE=address tests/run.sh  # AddressSanitizer build in build-address/
#   SHARDPS_CHECKS=0 tests/run.sh     # skip the format and thread-safety checks
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

log() { printf '\n== %s\n' "$*"; }

# --- packages -------------------------------------------------------------
packages=(cmake g++ make pkg-config clang clang-format libclang-rt-14-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  zlib1g-dev dataset-fashion-mnist)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  $sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# --- build ----------------------------------------------------------------
sanitize=${SHARDPS_SANITIZE:-}
build_dir=${SHARDPS_BUILD_DIR:-build${sanitize:+-$sanitize}}
jobs=${SHARDPS_JOBS:-2}
log "configure ($build_dir${sanitize:+, sanitizer $sanitize})"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
  -DSHARDPS_SANITIZE="$sanitize" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
log "build"
cmake --build "$build_dir" -j "$jobs"

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

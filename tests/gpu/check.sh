#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and the CUDA toolkit: shows
# the device, builds a Release tree with CUDA into build-gpu, runs the tests
# labelled gpu (a skipped GPU test fails the check: here it means the GPU was
# not usable), then `shardps-bench gpu` when the bench is built.
#   tests/gpu/check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf '\n== %s\n' "$*"; }

log "nvidia-smi"
nvidia-smi

log "configure build-gpu (Release, CUDA)"
mkdir -p build-gpu
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSHARDPS_ENABLE_CUDA=ON |
  tee build-gpu/configure.log
if ! grep -q "shardps: CUDA backend ON" build-gpu/configure.log; then
  echo "check.sh: CMake did not enable CUDA (is nvcc installed?)" >&2
  exit 1
fi

log "build"
cmake --build build-gpu -j "$(nproc)"

log "ctest -L gpu"
ctest --test-dir build-gpu -L gpu --output-on-failure | tee build-gpu/ctest-gpu.log
if grep -q "(Skipped)" build-gpu/ctest-gpu.log; then
  echo "check.sh: GPU tests were skipped on a GPU machine (see above)" >&2
  exit 1
fi

bench=build-gpu/tests/shardps-bench
if [ -x "$bench" ]; then
  log "shardps-bench gpu"
  "$bench" gpu
else
  log "no $bench; benchmark skipped"
fi

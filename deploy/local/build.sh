#!/usr/bin/env bash
# Installs what is missing (Debian packages, via apt) and builds shardps:
# every target, or only the targets given as arguments (and what they need).
# Idempotent and quick when everything is present. Used by the training
# command (deploy/local/train.sh: only the daemons and the launcher) and the
# tests (tests/run.sh: everything).
#   deploy/local/build.sh [TARGET...]   e.g. deploy/local/build.sh shardps-local
#   SHARDPS_BUILD_DIR  build directory (default: build, or build-<sanitizer>)
#   SHARDPS_SANITIZE   address or thread: a sanitizer build
#   SHARDPS_JOBS       parallel compile jobs (default: 2)
#   SHARDPS_CMAKE_ARGS extra CMake arguments (e.g. -DSHARDPS_ENABLE_CUDA=OFF)
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf '\n== %s\n' "$*" >&2; }

packages=(cmake g++ make pkg-config clang clang-format libclang-rt-14-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  zlib1g-dev prometheus-cpp-dev dataset-fashion-mnist python3
  python3-dev python3-numpy pybind11-dev  # the shardps Python package
  prometheus)  # prometheus: promtool, which the metrics tests run
deploy/local/apt_install.sh "${packages[@]}"

sanitize=${SHARDPS_SANITIZE:-}
build_dir=${SHARDPS_BUILD_DIR:-build${sanitize:+-$sanitize}}
log "configure $build_dir${sanitize:+ (sanitizer: $sanitize)}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
  -DSHARDPS_SANITIZE="$sanitize" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  ${SHARDPS_CMAKE_ARGS:-} >&2
targets=()
if [ $# -gt 0 ]; then targets=(--target "$@"); fi
log "build${*:+: $*}"
cmake --build "$build_dir" -j "${SHARDPS_JOBS:-2}" "${targets[@]}" >&2
echo "$build_dir"

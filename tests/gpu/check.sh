#!/usr/bin/env bash
# The GPU check: shows the device, runs the GPU tests (a skipped GPU test
# fails the check: on a GPU machine it means the GPU was not usable), the
# torch layer's CUDA path (tests/gpu/test_torch_cuda.py, when the machine's
# torch has CUDA: Debian's has not, which the check says) and the GPU
# benchmark (`shardps-bench gpu`).
#   tests/gpu/check.sh                    # build here with CUDA into build-gpu
#   tests/gpu/check.sh --bundle DIR       # use binaries packed by
#                                         # tests/gpu/prepare.sh (for GPU
#                                         # machines without the -dev packages)
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf '\n== %s\n' "$*"; }

log "nvidia-smi"
nvidia-smi || { echo "check.sh: no usable GPU (nvidia-smi failed)" >&2; exit 1; }

if [ "${1:-}" = "--bundle" ]; then
  packed=$(realpath "${2:?--bundle needs a directory}")/gpu-bundle.tar.xz
  unpack=$(mktemp -d)
  tar xJf "$packed" -C "$unpack"
  bundle=$unpack/gpu-bundle
  export LD_LIBRARY_PATH="$bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
  tests=("$bundle/bin/cuda_kernels_test" "$bundle/bin/cuda_backend_test")
  bench="$bundle/bin/shardps-bench"
else
  log "configure build-gpu (Release, CUDA)"
  mkdir -p build-gpu
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSHARDPS_ENABLE_CUDA=ON |
    tee build-gpu/configure.log
  if ! grep -q "shardps: CUDA backend ON" build-gpu/configure.log; then
    echo "check.sh: CMake did not enable CUDA (is nvcc installed?)" >&2
    exit 1
  fi
  log "build"
  cmake --build build-gpu -j "$(nproc)" --target cuda_kernels_test \
    cuda_backend_test shardps-bench shardps-server shardps-coordinator \
    _shardps
  tests=(build-gpu/worker/cuda_kernels_test build-gpu/worker/cuda_backend_test)
  bench=build-gpu/tests/shardps-bench
fi

status=0
for t in "${tests[@]}"; do
  log "$(basename "$t")"
  out=$("$t" 2>&1) || status=1
  echo "$out"
  if grep -q "SKIPPED \]" <<<"$out"; then
    echo "check.sh: $(basename "$t") skipped tests on a GPU machine" >&2
    status=1
  fi
done

log "the torch layer on CUDA (tests/gpu/test_torch_cuda.py)"
if [ -n "${bundle:-}" ]; then
  echo "check.sh: not run from a bundle (it needs the Python module built here)"
elif ! /usr/bin/python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "check.sh: this machine's torch has no CUDA (Debian's is CPU-only):" \
    "the torch layer's CUDA path was NOT run; its staging thread runs on" \
    "the CPU in tests/python/test_torch_staging.py"
else
  SHARDPS_BUILD_DIR=$PWD/build-gpu /usr/bin/python3 -m pytest -q -rs \
    -p no:cacheprovider tests/gpu/test_torch_cuda.py || status=1
fi

log "shardps-bench gpu"
"$bench" gpu || status=1
exit $status

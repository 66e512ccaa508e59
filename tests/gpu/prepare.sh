#!/usr/bin/env bash
# Prepares the GPU check for a GPU machine that cannot install packages: builds
# with CUDA here (deploy/local/build.sh), then packs the GPU test binaries,
# shardps-bench and the shared libraries they need (except the C library and
# CUDA's own, which the GPU machine has) into .gpu-bundle/gpu-bundle.tar.xz
# (git-ignored; about 12 MiB, so it fits what a device run may carry).
# Then, on the GPU machine: tests/gpu/check.sh --bundle .gpu-bundle
set -euo pipefail
cd "$(dirname "$0")/../.."
build_dir=$(SHARDPS_BUILD_DIR=${SHARDPS_BUILD_DIR:-build} deploy/local/build.sh)
bundle=.gpu-bundle
stage=$(mktemp -d)/gpu-bundle
mkdir -p "$stage/bin" "$stage/lib"
# libshardps_cuda.so goes beside the binaries: they load it from there.
binaries=("$build_dir/worker/cuda_backend_test" "$build_dir/worker/cuda_kernels_test"
  "$build_dir/tests/shardps-bench" "$build_dir/worker/libshardps_cuda.so")
for b in "${binaries[@]}"; do
  [ -x "$b" ] || {
    echo "prepare.sh: missing $b (built without CUDA: is nvcc installed?)" >&2
    exit 1
  }
  cp "$b" "$stage/bin/"
  ldd "$b" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|\
      libcuda.so*|libcublas*|libcudart*|libnvidia*) ;;
      *) cp -Ln "$lib" "$stage/lib/" ;;
    esac
  done
done
grep -qx "/$bundle/" .git/info/exclude 2>/dev/null || echo "/$bundle/" >>.git/info/exclude
strip --strip-unneeded "$stage"/bin/* "$stage"/lib/* 2>/dev/null || true
rm -rf "$bundle"
mkdir -p "$bundle"
tar cJf "$bundle/gpu-bundle.tar.xz" -C "$(dirname "$stage")" gpu-bundle
rm -rf "$(dirname "$stage")"
du -sh "$bundle"
echo "ready: carry $bundle and run: bash tests/gpu/check.sh --bundle $bundle"

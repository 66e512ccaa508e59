#!/usr/bin/env bash
# A PyTorch example in one command: installs what is missing (Debian's
# python3-torch, python3-matplotlib for the loss plot; bible-kjv for the
# GPT), builds what it runs (shardps-local, its daemons and the Python
# package), then runs the example as the workers of a local job (2
# parameter servers, 2 workers); the example writes metrics.csv and
# loss.png into <run dir>/<example> (run/gpt_kjv/ by default):
#   deploy/local/train_torch.sh cnn [ARGS]   # CNN on Fashion-MNIST
#   deploy/local/train_torch.sh gpt [ARGS]   # LLaMA-style GPT on the KJV Bible
# ARGS go to the example (--epochs=3, --plain, --help). shardps-local flags
# go in SHARDPS_LOCAL_ARGS (e.g. "--workers=4 --run_dir=/tmp/run").
set -euo pipefail
cd "$(dirname "$0")/../.."
example=${1:-}
case "$example" in
  cnn) script=worker/python/examples/cnn_fashion_mnist.py ;;
  gpt) script=worker/python/examples/gpt_kjv.py ;;
  *) echo "usage: $0 cnn|gpt [example args]" >&2; exit 2 ;;
esac
shift
packages=(python3-torch python3-numpy python3-matplotlib)
[ "$example" = gpt ] && packages+=(bible-kjv bible-kjv-text)
deploy/local/apt_install.sh "${packages[@]}"
build_dir=$(deploy/local/build.sh shardps-local shardps-coordinator \
  shardps-server _shardps)
# Debian's torch is for the system interpreter, whatever python3 PATH finds.
# shellcheck disable=SC2086
exec "$build_dir/deploy/local/shardps-local" ${SHARDPS_LOCAL_ARGS:-} \
  -- /usr/bin/python3 "$script" "$@"

#!/usr/bin/env bash
# The main job in one command: installs what is missing, builds what it runs
# (shardps-local and the daemons it starts), then trains
# an MLP on Fashion-MNIST with 2 parameter servers and 2 workers on this
# machine (shardps-local's defaults). Extra flags go to shardps-local, e.g.
#   deploy/local/train.sh --epochs=3 --run_dir=/tmp/run
set -euo pipefail
cd "$(dirname "$0")/../.."
build_dir=$(deploy/local/build.sh shardps-local shardps-coordinator \
  shardps-server shardps-worker)
exec "$build_dir/deploy/local/shardps-local" "$@"

#!/usr/bin/env bash
# A real container run of the main job: builds the image from
# deploy/docker/Dockerfile, brings deploy/compose/docker-compose.yml up with
# docker-compose.host.yml (every service on the host network: no network is
# created), waits until the job has trained to the end, and checks that every
# container exited 0, that the coordinator's and the servers' health checks
# reported SERVING, and that rank 0 left a complete model and metrics.csv.
# Then it restores: `down` (keeping the checkpoints volume) and `up` again;
# the servers must load the newest committed checkpoint and the workers
# resume at its step and train to the end.
# With SHARDPS_DEPLOY_TORCH=1 it then builds deploy/docker/Dockerfile.torch
# and runs the job again with docker-compose.torch.yml (the workers run the
# PyTorch CNN example): every container must exit 0 (off by default: the
# image pulls in Debian's torch, about 1 GB, and the job takes minutes).
#   tests/deploy/compose_up.sh
# Needs root (it starts its own Docker engine, tests/deploy/docker_engine.sh,
# and stops it again when it started it) and the ports 7000, 5000 and 5001
# free on this machine. No image registry is needed: the base image debian:12
# is made with mmdebstrap and imported. Where a tool is missing it says so
# and exits 0 (SKIP), unless SHARDPS_REQUIRE_ENGINE=1.
# Ends with 'compose_up: N passed, M failed'.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root" || exit 1

project=shardpsup
compose=(docker-compose -p "$project" -f deploy/compose/docker-compose.yml
  -f deploy/compose/docker-compose.host.yml)
ports=(7000 5000 5001)
deadline_s=${SHARDPS_COMPOSE_TIMEOUT_S:-600}

log() { printf '\n== compose_up: %s\n' "$*"; }
passed=0 failed=0
check() {  # check DESCRIPTION COMMAND...
  local what=$1
  shift
  if "$@"; then
    passed=$((passed + 1)); echo "ok   $what"
  else
    failed=$((failed + 1)); echo "FAIL $what"
    return 1
  fi
}
finish() {
  echo "compose_up: $passed passed, $failed failed"
  [ $failed = 0 ]
  exit $?
}
skip_or_fail() {
  echo "SKIP compose_up: $*"
  if [ "${SHARDPS_REQUIRE_ENGINE:-0}" = 1 ]; then exit 1; fi
  exit 0
}

[ "$(id -u)" -eq 0 ] || skip_or_fail "needs root to start a Docker engine"
"$here/setup.sh" --engine || skip_or_fail "tests/deploy/setup.sh --engine failed"
for tool in dockerd docker-compose mmdebstrap python3; do
  command -v "$tool" >/dev/null 2>&1 || skip_or_fail "$tool is not installed"
done
for p in "${ports[@]}"; do
  if ! python3 -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', $p))" 2>/dev/null; then
    echo "FAIL port $p is in use on this machine; the host-network stack needs 7000, 5000, 5001"
    failed=$((failed + 1))
    finish
  fi
done

# shellcheck source=tests/deploy/docker_engine.sh
. "$here/docker_engine.sh"
t0=$SECONDS
cleanup() {
  if [ -n "${DOCKER_HOST:-}" ] && "$DOCKER" version >/dev/null 2>&1; then
    "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  engine_stop
}
trap cleanup EXIT

log "engine"
engine_start || { failed=$((failed + 1)); echo "FAIL dockerd did not start"; finish; }
engine_base_image debian:12 || { failed=$((failed + 1)); echo "FAIL base image"; finish; }
t_engine=$((SECONDS - t0))

log "docker build -f deploy/docker/Dockerfile -t shardps:latest ."
t1=$SECONDS
build_log="$engine_dir/build.log"
if DOCKER_BUILDKIT=0 "$DOCKER" build --network=host -f deploy/docker/Dockerfile \
    -t shardps:latest . >"$build_log" 2>&1; then
  check "image shardps:latest built ($(( SECONDS - t1 ))s)" true
else
  tail -n 40 "$build_log"
  check "image shardps:latest built (log: $build_log)" false
  finish
fi
t_build=$((SECONDS - t1))
"$DOCKER" image prune -f >/dev/null 2>&1 || true
echo "image: $("$DOCKER" image inspect -f '{{.Size}}' shardps:latest | awk '{printf "%.0f MB", $1/1e6}'), user $("$DOCKER" image inspect -f '{{.Config.User}}' shardps:latest)"

log "compose up (host network)"
# Never create a network: every service must be on the host's network.
merged=$("${compose[@]}" config)
check "every service has network_mode: host" python3 -c '
import sys, yaml
c = yaml.safe_load(sys.stdin)
bad = [n for n, s in c["services"].items() if s.get("network_mode") != "host"]
print("not on the host network:", bad) if bad else None
sys.exit(1 if bad or c.get("networks") else 0)' <<<"$merged" || finish
networks_before=$("$DOCKER" network ls -q | sort)
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
t2=$SECONDS
"${compose[@]}" up -d --no-build 2>&1 | grep -v '^$'
ids=$("${compose[@]}" ps -q)
[ -n "$ids" ] || { check "containers created" false; finish; }
# $ids: one container id a word.
# shellcheck disable=SC2086
while :; do
  running=$("$DOCKER" inspect -f '{{.State.Running}}' $ids | grep -c true)
  [ "$running" = 0 ] && break
  if [ $((SECONDS - t2)) -ge "$deadline_s" ]; then
    check "the job ended within ${deadline_s}s" false
    break
  fi
  sleep 2
done
t_run=$((SECONDS - t2))
"${compose[@]}" logs --no-color > "$engine_dir/compose.log" 2>&1
grep -E 'listening|joined|epoch 10/|done:|finished|exiting|stopped' "$engine_dir/compose.log" | head -n 40
check "the job trained and every container ended (${t_run}s)" [ "$running" = 0 ]
check "no network was created" [ "$("$DOCKER" network ls -q | sort)" = "$networks_before" ]

for id in $ids; do
  read -r name code restarts < <("$DOCKER" inspect -f '{{.Name}} {{.State.ExitCode}} {{.RestartCount}}' "$id")
  check "$name exited 0 (exit code $code, $restarts restarts)" [ "$code" = 0 ]
  if [ "$("$DOCKER" inspect -f '{{if .State.Health}}yes{{end}}' "$id")" = yes ]; then
    # Docker marks a stopped container unhealthy: look at the probes' log.
    check "$name health check reported SERVING while it ran" \
      sh -c "'$DOCKER' inspect -f '{{range .State.Health.Log}}{{.ExitCode}} {{.Output}}{{end}}' '$id' | grep -q '^0 .*SERVING'"
  fi
done

log "outputs of rank 0"
out="$engine_dir/out"
rm -rf "$out" && mkdir -p "$out"
worker0=$("${compose[@]}" ps -q worker-0)
"$DOCKER" cp "$worker0:/var/lib/shardps/model.safetensors" "$out/" &&
  "$DOCKER" cp "$worker0:/var/lib/shardps/metrics.csv" "$out/"
check "model and metrics in the checkpoints volume" python3 - "$out" <<'EOF'
import json, struct, sys
d = sys.argv[1]
with open(f"{d}/model.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
print("model.safetensors:", shapes)
want = {"fc1.weight": [512, 784], "fc1.bias": [512], "fc2.weight": [256, 512],
        "fc2.bias": [256], "fc3.weight": [10, 256], "fc3.bias": [10]}
rows = [l.split(",") for l in open(f"{d}/metrics.csv").read().splitlines()[1:] if l]
print("metrics.csv: %d epochs, last: epoch=%s step=%s test_accuracy=%s"
      % (len(rows), rows[-1][0], rows[-1][1], rows[-1][4]))
sys.exit(0 if shapes == want and len(rows) == 10 and float(rows[-1][4]) >= 0.85
         else 1)
EOF

log "restore: down (the volume stays), up again"
steps=$("$DOCKER" run --rm --network=none -v "${project}_checkpoints:/var/lib/shardps" \
  shardps:latest sh -c 'ls -d /var/lib/shardps/checkpoints/step-*/COMMITTED' 2>/dev/null |
  sed 's|.*/step-\([0-9]*\)/COMMITTED|\1|' | awk '{print $1 + 0}' | sort -n |
  tr '\n' ' ')
last=$(echo "$steps" | awk '{print $NF}')
check "committed checkpoints in the volume: steps ${steps:-none}" [ -n "$last" ]
t3=$SECONDS
"${compose[@]}" down >/dev/null 2>&1
"${compose[@]}" up -d --no-build 2>&1 | grep -v '^$' | grep -v '\.\.\. $'
ids=$("${compose[@]}" ps -q)
# shellcheck disable=SC2086
while [ "$("$DOCKER" inspect -f '{{.State.Running}}' $ids | grep -c true)" != 0 ]; do
  if [ $((SECONDS - t3)) -ge "$deadline_s" ]; then
    check "the restored job ended within ${deadline_s}s" false
    break
  fi
  sleep 2
done
"${compose[@]}" logs --no-color > "$engine_dir/compose-restore.log" 2>&1
grep -E 'restored from|resuming at|done:' "$engine_dir/compose-restore.log"
for s in server-0 server-1; do
  check "$s restored the checkpoint of step $last" \
    grep -q "^$s.*restored from the checkpoint of step $last" "$engine_dir/compose-restore.log"
done
check "worker-0 resumed at step $last and trained to the end ($((SECONDS - t3))s)" \
  sh -c "grep -q '^worker-0.*resuming at step $last' '$engine_dir/compose-restore.log' &&
         grep -q '^worker-0.*done: epoch 10 step 2340' '$engine_dir/compose-restore.log'"
for id in $ids; do
  read -r name code < <("$DOCKER" inspect -f '{{.Name}} {{.State.ExitCode}}' "$id")
  check "$name exited 0 after the restore" [ "$code" = 0 ]
done
t_restore=$((SECONDS - t3))

"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
echo "times: engine+base image ${t_engine}s, build ${t_build}s, job ${t_run}s, restored job ${t_restore}s, total $((SECONDS - t0))s"

if [ "${SHARDPS_DEPLOY_TORCH:-0}" = 1 ]; then
  log "docker build -f deploy/docker/Dockerfile.torch -t shardps:torch ."
  t4=$SECONDS
  if DOCKER_BUILDKIT=0 "$DOCKER" build --network=host \
      -f deploy/docker/Dockerfile.torch -t shardps:torch . \
      >"$engine_dir/build-torch.log" 2>&1; then
    check "image shardps:torch built ($(( SECONDS - t4 ))s)" true
  else
    tail -n 40 "$engine_dir/build-torch.log"
    check "image shardps:torch built (log: $engine_dir/build-torch.log)" false
    finish
  fi
  log "compose up with docker-compose.torch.yml (host network)"
  compose+=(-f deploy/compose/docker-compose.torch.yml)
  t5=$SECONDS
  "${compose[@]}" up -d --no-build 2>&1 | grep -v '^$'
  ids=$("${compose[@]}" ps -q)
  # shellcheck disable=SC2086
  while [ -n "$ids" ] &&
      [ "$("$DOCKER" inspect -f '{{.State.Running}}' $ids | grep -c true)" != 0 ]; do
    if [ $((SECONDS - t5)) -ge "$deadline_s" ]; then
      check "the torch job ended within ${deadline_s}s" false
      break
    fi
    sleep 2
  done
  "${compose[@]}" logs --no-color > "$engine_dir/compose-torch.log" 2>&1
  grep '^worker-0' "$engine_dir/compose-torch.log" | tail -n 15
  check "torch containers created" [ -n "$ids" ]
  for id in $ids; do
    read -r name code < <("$DOCKER" inspect -f '{{.Name}} {{.State.ExitCode}}' "$id")
    check "$name exited 0 in the torch job ($((SECONDS - t5))s)" [ "$code" = 0 ]
  done
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
fi
finish

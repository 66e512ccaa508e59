# shellcheck shell=bash
# Sourced by the deploy tests: a private Docker engine (Debian's docker.io)
# for machines where none runs. No bridge network and no iptables rules;
# data, exec state, socket and pid file under $SHARDPS_DOCKER_DIR. Only an
# engine this shell started is stopped again, by its pid file.
#   . tests/deploy/docker_engine.sh
#   engine_start; engine_base_image; ...; engine_stop
# Exports DOCKER_HOST and DOCKER_CONFIG (so no global docker config is read).

engine_dir=${SHARDPS_DOCKER_DIR:-/tmp/shardps-docker}
engine_started=0
DOCKER=${DOCKER:-/usr/bin/docker}

engine_log() { printf '[engine] %s\n' "$*" >&2; }

engine_alive() {
  [ -f "$engine_dir/docker.pid" ] &&
    kill -0 "$(cat "$engine_dir/docker.pid")" 2>/dev/null &&
    "$DOCKER" version >/dev/null 2>&1
}

# Starts dockerd unless the one from an earlier run still answers.
engine_start() {
  mkdir -p "$engine_dir/config"
  export DOCKER_HOST="unix://$engine_dir/docker.sock"
  export DOCKER_CONFIG="$engine_dir/config"
  if engine_alive; then
    engine_log "reusing the engine already running (pid $(cat "$engine_dir/docker.pid"))"
    return 0
  fi
  rm -f "$engine_dir/docker.pid" "$engine_dir/docker.sock"
  engine_log "starting dockerd (log: $engine_dir/dockerd.log)"
  dockerd --bridge=none --iptables=false --ip-masq=false \
    --data-root="$engine_dir/data" --exec-root="$engine_dir/exec" \
    --pidfile="$engine_dir/docker.pid" --host="$DOCKER_HOST" \
    >"$engine_dir/dockerd.log" 2>&1 </dev/null &
  engine_started=1
  local deadline=$((SECONDS + 60))
  until engine_alive; do
    if [ $SECONDS -ge $deadline ]; then
      tail -n 20 "$engine_dir/dockerd.log" >&2
      engine_log "dockerd did not answer within 60 s"
      return 1
    fi
    sleep 0.5
  done
  engine_log "dockerd up (pid $(cat "$engine_dir/docker.pid"), $("$DOCKER" version -f '{{.Server.Version}}'))"
}

# Stops the engine if this shell started it: SIGTERM, then SIGKILL after 30 s.
engine_stop() {
  [ "$engine_started" = 1 ] || return 0
  [ -f "$engine_dir/docker.pid" ] || return 0
  local pid
  pid=$(cat "$engine_dir/docker.pid")
  engine_log "stopping dockerd (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || return 0
  local deadline=$((SECONDS + 30))
  while kill -0 "$pid" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      engine_log "dockerd still up after 30 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.5
  done
  # dockerd leaves its namespace mount behind; nothing else uses it.
  if grep -q " $engine_dir/exec/netns/default " /proc/self/mountinfo; then
    umount "$engine_dir/exec/netns/default" || true
  fi
  engine_started=0
}

# Makes the image debian:12 from Debian's packages when the engine lacks it
# (no image registry is reachable): mmdebstrap's minbase bookworm, imported.
engine_base_image() {
  local image=${1:-debian:12}
  if "$DOCKER" image inspect "$image" >/dev/null 2>&1; then
    engine_log "base image $image present"
    return 0
  fi
  local tar="$engine_dir/bookworm-minbase.tar"
  if [ ! -s "$tar" ]; then
    engine_log "mmdebstrap --variant=minbase bookworm (a few minutes)"
    # mmdebstrap picks the output format from the name: keep ".tar".
    rm -rf "$engine_dir/partial.tar"
    mmdebstrap --variant=minbase bookworm "$engine_dir/partial.tar" \
      >"$engine_dir/mmdebstrap.log" 2>&1 || {
      tail -n 20 "$engine_dir/mmdebstrap.log" >&2
      return 1
    }
    mv "$engine_dir/partial.tar" "$tar"
  fi
  "$DOCKER" import --change 'CMD ["bash"]' "$tar" "$image" >/dev/null || return 1
  engine_log "imported $image from $tar"
}

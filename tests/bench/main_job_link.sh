#!/usr/bin/env bash
# The main job across a rate-limited link: the coordinator and 2 servers in
# one network namespace, 2 workers in another, joined by a veth pair with a
# tc tbf on each end (root; needs ip and tc). Prints each worker-0 epoch
# line (samples/s and the compute / push / wait shares of a step).
#   tests/bench/main_job_link.sh BUILD_DIR RATE [shardps-worker flags...]
#   tests/bench/main_job_link.sh build 1gbit --epochs=2 --compression=bf16
set -euo pipefail
build=$(realpath "${1:?usage: main_job_link.sh BUILD_DIR RATE [worker flags]}")
rate=${2:?usage: main_job_link.sh BUILD_DIR RATE [worker flags]}
shift 2
srv=shardps-jobsrv-$$
wrk=shardps-jobwrk-$$
dir=$(mktemp -d /tmp/shardps-main-job-link.XXXXXX)
cleanup() {
  # The daemons exit by themselves once the workers are done.
  for _ in $(seq 50); do
    [ -z "$(ip netns pids "$srv" 2>/dev/null)" ] && break
    sleep 0.2
  done
  for ns in "$srv" "$wrk"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}
trap cleanup EXIT
ip netns add "$srv"
ip netns add "$wrk"
ip link add "vs$$" type veth peer name "vw$$"
ip link set "vs$$" netns "$srv"
ip link set "vw$$" netns "$wrk"
ip -n "$srv" addr add 10.214.0.1/30 dev "vs$$"
ip -n "$wrk" addr add 10.214.0.2/30 dev "vw$$"
for end in "$srv vs$$" "$wrk vw$$"; do
  set -- $end "$@"
  ip -n "$1" link set "$2" up
  ip -n "$1" link set lo up
  # As shardps-bench transport --link: a bucket of rate/250 (HZ=250), at
  # least 128 KiB, and 5 ms of queue.
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" \
    burst "$(python3 -c "import sys; r=sys.argv[1].lower(); m={'kbit':1e3,'mbit':1e6,'gbit':1e9}; b=next(float(r[:-len(k)])*v for k,v in m.items() if r.endswith(k)); print(max(131072, int(b/8/250)))" "$rate")" \
    latency 5ms
  shift 2
done
ip netns exec "$srv" "$build/server/shardps-coordinator" \
  --host=10.214.0.1 --port=0 --port_file="$dir/coordinator.port" \
  --num_servers=2 --num_workers=2 >"$dir/coordinator.log" 2>&1 &
disown
for _ in $(seq 100); do [ -s "$dir/coordinator.port" ] && break; sleep 0.1; done
coordinator=10.214.0.1:$(cat "$dir/coordinator.port")
for s in 0 1; do
  ip netns exec "$srv" "$build/server/shardps-server" --host=10.214.0.1 \
    --port=0 --port_file="$dir/server-$s.port" --coordinator="$coordinator" \
    >"$dir/server-$s.log" 2>&1 &
  disown
done
pids=()
for r in 0 1; do
  # The namespaces share /proc: shared memory would bypass the link.
  ip netns exec "$wrk" "$build/worker/shardps-worker" \
    --coordinator="$coordinator" --shared_memory=false "$@" \
    >"$dir/worker-$r.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
grep -h " epoch " "$dir"/worker-*.log | grep "worker\[0\]" || true
[ "$status" = 0 ] || { echo "a worker failed; logs in $dir" >&2; exit 1; }
echo "logs in $dir"

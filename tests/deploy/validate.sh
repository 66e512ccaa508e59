#!/usr/bin/env bash
# Validates deploy/ offline, then runs the real daemons with its flags:
#   1. docker-compose config -q: the Compose file alone and with each override
#   2. kubectl kustomize: deploy/k8s/base, overlays/gpu, overlays/tls,
#      overlays/torch and overlays/compression render
#   3. the rendered manifests against the Kubernetes schemas of the npm
#      package kubernetes-models (validate_k8s.mjs)
#   4. npx dockerfile-utils lint: every Dockerfile
#   5. check_fields.py: ranks, probes, ports, volumes, images, flags (every
#      flag against the binaries' --helpfull when a build is given), the
#      torch workers' environment (docker-compose.torch.yml, overlays/torch)
#      and the compression settings (docker-compose.compression.yml,
#      overlays/compression)
#   6. run_local.py: the daemons started with the flags of the Compose file
#      and of the ConfigMap train the main job to the end (build needed);
#      then with overlays/tls: mutual TLS, the token and exec probes; then
#      with docker-compose.compression.yml: compressed gradients
#   tests/deploy/validate.sh [BUILD_DIR]
# A step whose tool is missing is skipped with a SKIP line (install them with
# tests/deploy/setup.sh). SHARDPS_DEPLOY_RUN=0 skips step 6.
# Ends with 'deploy: N passed, M failed, K skipped'.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build_dir=${1:-}
[ -n "$build_dir" ] && build_dir=$(cd "$build_dir" && pwd)
cd "$root" || exit 1

passed=0 failed=0 skipped=0
step() {  # step NAME COMMAND...
  local name=$1
  shift
  printf '\n== deploy: %s\n' "$name"
  if "$@"; then
    passed=$((passed + 1))
    echo "PASS $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name"
  fi
}
skip() {
  skipped=$((skipped + 1))
  printf '\n== deploy: %s\nSKIP %s\n' "$1" "$2"
}

tmp=$(mktemp -d /tmp/shardps-validate.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# 1. Compose.
compose_config() {
  local c=deploy/compose rc=0
  for extra in "" "$c/docker-compose.host.yml" "$c/docker-compose.gpu.yml" \
      "$c/docker-compose.host.yml $c/docker-compose.gpu.yml" \
      "$c/docker-compose.tls.yml" \
      "$c/docker-compose.host.yml $c/docker-compose.tls.yml" \
      "$c/docker-compose.torch.yml" \
      "$c/docker-compose.host.yml $c/docker-compose.torch.yml" \
      "$c/docker-compose.compression.yml" \
      "$c/docker-compose.host.yml $c/docker-compose.compression.yml" \
      "$c/docker-compose.tls.yml $c/docker-compose.compression.yml"; do
    local args=(-f "$c/docker-compose.yml")
    for f in $extra; do args+=(-f "$f"); done
    echo "docker-compose ${args[*]} config -q"
    docker-compose "${args[@]}" config -q || rc=1
  done
  return $rc
}
if command -v docker-compose >/dev/null 2>&1; then
  step "docker-compose config -q ($(docker-compose version --short 2>/dev/null))" compose_config
else
  skip "docker-compose config -q" "docker-compose is not installed"
fi

# 2. kustomize.
have_k8s=0
render() {
  kubectl kustomize deploy/k8s/base > "$tmp/base.yaml" &&
    kubectl kustomize deploy/k8s/overlays/gpu > "$tmp/gpu.yaml" &&
    kubectl kustomize deploy/k8s/overlays/tls > "$tmp/tls.yaml" &&
    kubectl kustomize deploy/k8s/overlays/torch > "$tmp/torch.yaml" &&
    kubectl kustomize deploy/k8s/overlays/compression > "$tmp/compression.yaml" &&
    echo "rendered: base $(grep -c '^kind:' "$tmp/base.yaml") objects, gpu $(grep -c '^kind:' "$tmp/gpu.yaml") objects, tls $(grep -c '^kind:' "$tmp/tls.yaml") objects, torch $(grep -c '^kind:' "$tmp/torch.yaml") objects, compression $(grep -c '^kind:' "$tmp/compression.yaml") objects"
}
if command -v kubectl >/dev/null 2>&1; then
  kver=$(kubectl version --client 2>/dev/null | tr '\n' ' ')
  step "kubectl kustomize ($kver)" render && have_k8s=1
  [ -s "$tmp/gpu.yaml" ] && have_k8s=1
else
  skip "kubectl kustomize" "kubectl is not installed"
fi

# 3, 4. npm tools.
have_npm=0
[ -f "$here/node_modules/.package-lock.json" ] && command -v node >/dev/null 2>&1 &&
  have_npm=1
if [ $have_npm = 1 ] && [ $have_k8s = 1 ]; then
  step "kubernetes-models schemas" node "$here/validate_k8s.mjs" "$tmp/base.yaml" "$tmp/gpu.yaml" "$tmp/tls.yaml" "$tmp/torch.yaml" "$tmp/compression.yaml"
else
  skip "kubernetes-models schemas" "needs kubectl and tests/deploy/node_modules (setup.sh)"
fi
lint() {
  local rc=0
  for f in deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda \
      deploy/docker/Dockerfile.torch; do
    echo "dockerfile-utils lint $f"
    (cd "$here" && npx --no-install dockerfile-utils lint "$root/$f") || rc=1
  done
  return $rc
}
if [ $have_npm = 1 ]; then
  step "dockerfile-utils lint" lint
else
  skip "dockerfile-utils lint" "tests/deploy/node_modules missing (setup.sh)"
fi

# 5, 6. Our own checks.
if python3 -c 'import yaml' 2>/dev/null; then
  fields_args=()
  [ $have_k8s = 1 ] && fields_args+=(--base="$tmp/base.yaml" --gpu="$tmp/gpu.yaml" --torch="$tmp/torch.yaml" --compression="$tmp/compression.yaml")
  [ -n "$build_dir" ] && fields_args+=(--bin_dir="$build_dir")
  step "check_fields.py" python3 "$here/check_fields.py" "${fields_args[@]}"
  if [ -z "$build_dir" ]; then
    skip "run_local.py" "no build directory given"
  elif [ "${SHARDPS_DEPLOY_RUN:-1}" = 0 ]; then
    skip "run_local.py" "SHARDPS_DEPLOY_RUN=0"
  else
    step "run_local.py (real daemons, flags from Compose and the ConfigMap)" \
      python3 "$here/run_local.py" --bin_dir="$build_dir"
  fi
else
  skip "check_fields.py, run_local.py" "PyYAML (python3-yaml) is not installed"
fi

echo
echo "deploy: $passed passed, $failed failed, $skipped skipped"
[ $failed = 0 ]

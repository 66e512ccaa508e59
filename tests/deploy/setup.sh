#!/usr/bin/env bash
# Installs what the deploy checks need and is missing; idempotent and quick
# when everything is there.
#   tests/deploy/setup.sh            # validation: docker-compose (1.29),
#                                    # PyYAML, promtool, node + npm packages,
#                                    # kubectl
#   tests/deploy/setup.sh --engine   # also a Docker engine (docker.io) and
#                                    # mmdebstrap, for tests/deploy/compose_up.sh
# Debian packages come through apt; the npm tools are pinned in
# tests/deploy/package.json and package-lock.json (npm ci).
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '== setup: %s\n' "$*" >&2; }

engine=0
[ "${1:-}" = "--engine" ] && engine=1

# prometheus: promtool checks the daemons' /metrics in run_local.py.
packages=(docker-compose python3-yaml prometheus)
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)
[ $engine = 1 ] && packages+=(docker.io mmdebstrap)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
apt_updated=0
apt_install() {
  if [ $apt_updated = 0 ]; then
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get update -q >&2
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q \
    --no-install-recommends "$@" >&2
}
if [ ${#missing[@]} -gt 0 ]; then
  log "installing: ${missing[*]}"
  apt_install "${missing[@]}"
fi

# kubectl renders the kustomize layout (kubectl kustomize). Machines of this
# project's image have it as the package kubectl; elsewhere try that package
# (when an apt source offers it), then Debian's kubernetes-client (kubectl
# 1.20, whose bundled kustomize is older than the one the layout is tested
# with).
if ! command -v kubectl >/dev/null 2>&1; then
  log "kubectl missing: trying the apt packages kubectl, then kubernetes-client"
  apt_install kubectl 2>/dev/null || apt_install kubernetes-client ||
    log "WARNING: no kubectl package: the Kubernetes checks will be skipped"
fi

# npm tools, exactly as locked.
if [ ! -f node_modules/.package-lock.json ] ||
   [ package-lock.json -nt node_modules/.package-lock.json ]; then
  log "npm ci (kubernetes-models, dockerfile-utils, yaml)"
  npm ci --no-audit --no-fund --loglevel=error >&2
fi
log "ready"

#!/usr/bin/env bash
# Installs the Debian packages given as arguments that are not installed yet
# (apt-get, with sudo when not root); quick when all are there. Progress goes
# to stderr, so callers' stdout stays theirs.
#   deploy/local/apt_install.sh python3-torch bible-kjv
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
printf '\n== installing: %s\n' "${missing[*]}" >&2
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo_cmd apt-get update -q >&2
$sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}" >&2

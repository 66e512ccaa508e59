#!/usr/bin/env bash
# Prints the Debian packages holding the shared libraries that the given
# binaries load, one per line: what a runtime image must install for them.
# Used by the build stage of deploy/docker/Dockerfile{,.cuda}.
#   deploy/docker/runtime-packages.sh /out/bin/* > runtime-packages.txt
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }

# The library paths ldd resolved ("libx.so => /path (0x..)", and the loader).
libs=$(ldd "$@" | awk '$2 == "=>" && $3 ~ /^\// {print $3}
                       $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' | sort -u)
if ldd "$@" | grep -q 'not found'; then
  ldd "$@" | grep 'not found' >&2
  echo "runtime-packages.sh: unresolved libraries (above)" >&2
  exit 1
fi

for lib in $libs; do
  real=$(readlink -f "$lib")
  pkg=""
  # dpkg knows a file by the path its package shipped it under: with merged
  # /usr that may be the /lib or the /usr/lib spelling, and the alternatives
  # system (libopenblas.so.0) hides the real file behind a link.
  for path in "$real" "$lib" "${real#/usr}" "${lib#/usr}" "/usr$lib"; do
    pkg=$(dpkg-query -S "$path" 2>/dev/null | head -n1 | cut -d: -f1 | cut -d, -f1) || true
    [ -n "$pkg" ] && break
  done
  if [ -z "$pkg" ] && [[ "$real" == /usr/local/cuda* ]]; then
    # NVIDIA's runtime image provides the CUDA libraries itself.
    echo "runtime-packages.sh: $lib comes with the CUDA base image" >&2
    continue
  fi
  if [ -z "$pkg" ]; then
    echo "runtime-packages.sh: no Debian package holds $lib ($real)" >&2
    exit 1
  fi
  echo "$pkg"
done | sort -u

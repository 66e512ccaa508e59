#!/usr/bin/env bash
# Compiles every shardps C++ source with clang's -Wthread-safety -Werror
# (syntax only), using the include paths from the build's compile database.
set -euo pipefail
build_dir=$(realpath "${1:?usage: thread_safety_check.sh BUILD_DIR}")
cd "$(dirname "$0")/.."
python3 - "$build_dir" <<'PY'
import json, shlex, subprocess, sys, os
build = sys.argv[1]
db = json.load(open(os.path.join(build, "compile_commands.json")))
root = os.getcwd()
failed = 0
for entry in db:
    src = entry["file"]
    if not src.startswith(root) or "/build" in src[len(root):] or not src.endswith(".cc"):
        continue
    args = shlex.split(entry["command"])[1:]
    keep = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = a == "-o"
            continue
        if a.startswith(("-I", "-D", "-std", "-isystem")) or a == src:
            keep.append(a)
            if a in ("-isystem",):
                keep.append(args[i + 1]); skip = True
    cmd = ["clang++", "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
           "-Wno-unknown-warning-option"] + [k for k in keep if k != src] + [src]
    r = subprocess.run(cmd, cwd=entry["directory"], capture_output=True, text=True)
    if r.returncode != 0:
        failed += 1
        print(r.stderr)
print(f"thread-safety: {failed} file(s) with errors")
sys.exit(1 if failed else 0)
PY

"""Reads deploy/compose and deploy/k8s for the deploy tests.

Shared by check_fields.py (static checks of the fields that matter) and
run_local.py (starts the real daemons with the flags these files give).
Needs PyYAML (Debian: python3-yaml).
"""

import os
import re
import shutil
import subprocess

import yaml

# SHARDPS_DEPLOY_ROOT: check a copy of the repository (tests of the tests).
ROOT = os.environ.get("SHARDPS_DEPLOY_ROOT") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
K8S_DIR = os.path.join(ROOT, "deploy", "k8s")
DOCKER_DIR = os.path.join(ROOT, "deploy", "docker")

DAEMONS = ("shardps-coordinator", "shardps-server", "shardps-worker",
           "shardps-ctl")
# Where each binary sits in a CMake build tree.
BUILD_TREE_PATHS = {
    "shardps-coordinator": "server/shardps-coordinator",
    "shardps-server": "server/shardps-server",
    "shardps-ctl": "server/shardps-ctl",
    "shardps-worker": "worker/shardps-worker",
}


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


def load_all_yaml(text):
    return [d for d in yaml.safe_load_all(text) if d is not None]


def compose_file(name="docker-compose.yml"):
    return load_yaml(os.path.join(COMPOSE_DIR, name))


def merge_compose(base, override):
    """Compose's override rules, as far as our overrides use them: a service
    key in the override replaces the base's (command, image, build, deploy,
    network_mode), except extra_hosts, which adds."""
    merged = {k: v for k, v in base.items() if k != "services"}
    services = {name: dict(svc) for name, svc in base["services"].items()}
    for name, svc in (override.get("services") or {}).items():
        target = services.setdefault(name, {})
        for key, value in svc.items():
            if key == "extra_hosts":
                target[key] = list(target.get(key, [])) + list(value)
            else:
                target[key] = value
    merged["services"] = services
    return merged


_COMPOSE_VAR = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env):
    """Compose's variable substitution in one string: ${VAR}, $VAR,
    ${VAR:-default} (default when unset or empty), ${VAR-default} (when
    unset) and $$ (a literal $). Unset without a default is empty."""
    def sub(m):
        dollar, name, op, default, bare = m.groups()
        if dollar:
            return "$"
        if bare:
            return env.get(bare, "")
        got = env.get(name)
        if op == ":-" and not got:
            return default
        if op == "-" and got is None:
            return default
        return got or ""
    return _COMPOSE_VAR.sub(sub, value)


def interpolate_compose(obj, env):
    """interpolate() over every string value of a loaded Compose file."""
    if isinstance(obj, dict):
        return {k: interpolate_compose(v, env) for k, v in obj.items()}
    if isinstance(obj, list):
        return [interpolate_compose(v, env) for v in obj]
    if isinstance(obj, str):
        return interpolate(obj, env)
    return obj


def compose_files(*overrides, env=None):
    """docker-compose.yml merged with `overrides` (file names in
    deploy/compose, in order) and interpolated with `env` (default: none
    set, so every ${VAR:-default} is its default)."""
    merged = compose_file()
    for name in overrides:
        merged = merge_compose(merged, compose_file(name))
    return interpolate_compose(merged, env or {})


# Wire compression: the values shardps-worker's --compression and
# --weight_encoding (and shardps.torch's SHARDPS_COMPRESSION and
# SHARDPS_WEIGHT_ENCODING) take, and the names shardps-server's --encodings
# gives the gradient encodings (worker/compression.cc,
# server/gradient_decode.cc).
GRADIENT_ENCODINGS = ("fp32", "bf16", "fp16", "int8", "topk")


def _topk_ratio(value):
    try:
        ratio = float(value[len("topk:"):])
    except ValueError:
        return None
    return ratio if 0 < ratio <= 1 else None


def gradient_encoding(compression):
    """--compression=VALUE -> the --encodings name a server must accept
    ('fp32' for none), or None when shardps-worker rejects VALUE."""
    if compression in ("none", "fp32"):
        return "fp32"
    if compression in ("bf16", "fp16", "int8"):
        return compression
    if compression.startswith("topk:") and _topk_ratio(compression):
        return "topk"
    return None


def weight_encoding_valid(value):
    return value in ("fp32", "bf16") or (
        value.startswith("topk:") and _topk_ratio(value) is not None)


def error_feedback_valid(value):
    """A value both shardps-worker's --error_feedback (an Abseil bool) and
    shardps.torch's SHARDPS_ERROR_FEEDBACK read, so one variable can feed
    both."""
    return str(value).lower() in ("1", "0", "true", "false", "yes", "no")


def accepted_encodings(value):
    """shardps-server --encodings=VALUE -> the set it accepts, or None when
    the server rejects VALUE."""
    if value in (None, "all"):
        return set(GRADIENT_ENCODINGS)
    names = value.split(",")
    return set(names) if all(n in GRADIENT_ENCODINGS for n in names) else None


def split_flag(arg):
    """'--name=value' -> ('name', 'value'); '--name' -> ('name', None)."""
    if not arg.startswith("--"):
        return None, arg
    name, sep, value = arg[2:].partition("=")
    return name, (value if sep else None)


def flags_of(argv):
    """The --flags of a command line (argv[0] is the binary), in order."""
    out = []
    for arg in argv:
        name, value = split_flag(arg)
        if name is not None:
            out.append((name, value))
    return out


def flag_dict(argv):
    return dict(flags_of(argv))


def flagfile_lines(text):
    """The flags of an Abseil flag file: one a line, '#' comments, blanks."""
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def render_kustomize(path):
    """kubectl kustomize PATH, or None when kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    return subprocess.run([kubectl, "kustomize", path], check=True,
                          capture_output=True, text=True).stdout


def k8s_objects(text):
    return load_all_yaml(text)


def find(objs, kind, name):
    for o in objs:
        if o.get("kind") == kind and o["metadata"]["name"] == name:
            return o
    return None


def pod_spec(job):
    return job["spec"]["template"]["spec"]


def expand_k8s(value, env):
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env.get(m.group(1), m.group(0)), value)


def find_binary(bin_dir, name):
    for rel in (BUILD_TREE_PATHS[name], name):
        path = os.path.join(bin_dir, rel)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def known_flags(binary):
    """The flag names `binary --helpfull` lists."""
    out = subprocess.run([binary, "--helpfull"], capture_output=True,
                         text=True).stdout
    return set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", out, re.M))

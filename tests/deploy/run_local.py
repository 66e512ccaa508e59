#!/usr/bin/env python3
"""Runs the real daemons on this machine with the flags that
deploy/compose/docker-compose.yml and deploy/k8s/base (the ConfigMap's flag
files plus each container's args) give them, and trains the main job to the
end; then the same for deploy/k8s/overlays/tls (mutual TLS and the bearer
token, the Secret made by deploy/tls/make-certs.sh, exec probes), and for
deploy/compose/docker-compose.compression.yml with its defaults (no
SHARDPS_* variable set): every worker says it compresses, every server
received fewer gradient bytes than their fp32 size, and the job still
trains to the end with the same checks.

  tests/deploy/run_local.py --bin_dir=build
      [--only=compose|k8s|k8s-tls|compose-compression]

Only what a container or pod changes is changed: every fixed port becomes a
free port on 127.0.0.1 (--host=0.0.0.0 becomes --host=127.0.0.1), the
hostnames (Compose service names, Kubernetes Services and server-<i>.server)
become 127.0.0.1 with that port, and the volume, ConfigMap and Secret mount
paths become folders in a temporary directory (flag files are copied there
with the same rewriting). Indexed Job pods get JOB_COMPLETION_INDEX as
Kubernetes sets it and $(VAR) in args is expanded.

Members start in reverse order (workers, servers, then the coordinator) to
check that a member started before its peers logs that it waits and retries.
Then: the health checks (Compose's shardps-ctl command, the Kubernetes gRPC
probe ports) must report SERVING, every process must exit 0, rank 0 must
write metrics.csv with a row per epoch and a safetensors model holding the
MLP's tensors, and the servers must have committed checkpoints. Every daemon
with --metrics_port is scraped while it runs: its /metrics must show the
job's work (pushes, steps, members) and pass 'promtool check metrics' when
promtool is installed (Debian package prometheus). Last, the
same deployment starts again on the same volume: the servers restore the
newest checkpoint, the workers resume at its step and train to the end.
Ends with 'run_local: N passed, M failed'.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import deploy_files as df

RETRY_LOG = "not joined yet"
MODEL_TENSORS = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                 "fc3.weight", "fc3.bias"}


# Ports handed out by free_port, never handed out twice.
_HANDED_OUT = set()


def ephemeral_ports():
    """The kernel's range of source ports for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A port of 127.0.0.1 that binds now, below the ephemeral range.

    A port from bind(("127.0.0.1", 0)) lies in the ephemeral range, where
    any connection opened before the daemon binds it (a member joining the
    coordinator, a health check, a scrape) may take it as its source port:
    a restore run once lost its server to "cannot serve metrics on
    127.0.0.1:51249 (is the port in use?)". Falls back to bind(0) when the
    range leaves no room below it.
    """
    low, _ = ephemeral_ports()
    rng = random.Random()
    for _ in range(1000 if low > 10100 else 0):
        port = rng.randrange(10000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Member:
    """One daemon of the job as a deployment file describes it."""

    def __init__(self, name, argv, health_argv=None):
        self.name = name
        self.argv = argv          # rewritten, argv[0] a binary name
        self.health_argv = health_argv  # shardps-ctl health ..., rewritten
        self.proc = None
        self.log_path = None
        self.healthy = False
        self.metrics_port = int(df.flag_dict(argv).get("metrics_port", -1))
        self.scraped = ""  # the last exposition /metrics returned

    def scrape(self):
        if self.metrics_port <= 0:
            return
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                self.scraped = r.read().decode()
        except OSError:
            pass  # not serving yet, or gone

    def log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


class Rewriter:
    """Maps what a container sees onto this machine."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.addresses = {}  # (host, port) -> local port
        self.mounts = []     # (container path, local path)

    def address(self, host, port):
        key = (host, int(port))
        if key not in self.addresses:
            self.addresses[key] = free_port()
        return self.addresses[key]

    def mount(self, container_path, local_name):
        local = os.path.join(self.tmp, local_name)
        os.makedirs(local, exist_ok=True)
        self.mounts.append((container_path.rstrip("/"), local))
        return local

    def value(self, value, mounts):
        m = re.fullmatch(r"([A-Za-z0-9.-]+):(\d+)", value)
        if m and (m.group(1), int(m.group(2))) in self.addresses:
            return f"127.0.0.1:{self.addresses[(m.group(1), int(m.group(2)))]}"
        for cpath, local in sorted(mounts, key=lambda x: -len(x[0])):
            if value == cpath or value.startswith(cpath + "/"):
                return local + value[len(cpath):]
        return value

    def args(self, args, own_host, mounts, hostnames):
        out = []
        for arg in args:
            name, value = df.split_flag(arg)
            if name is None or value is None:
                out.append(arg)
            elif name == "host":
                out.append("--host=127.0.0.1")
            elif name in ("port", "metrics_port"):
                out.append(f"--{name}={self.address(own_host, value)}")
            elif name == "advertise_host":
                if value not in hostnames:
                    raise ValueError(f"{own_host}: --advertise_host={value} "
                                     f"is not a name peers resolve ({sorted(hostnames)})")
                out.append("--advertise_host=127.0.0.1")
            else:
                out.append(f"--{name}={self.value(value, mounts)}")
        return out


# --- the two sources ---------------------------------------------------------
def members_from_compose(tmp, rw, overrides=()):
    """The members of docker-compose.yml with `overrides` (file names in
    deploy/compose) merged in and every ${VAR:-default} at its default."""
    compose = df.compose_files(*overrides)
    services = compose["services"]
    hostnames = set(services)
    # Every service's own --port first, so --coordinator=... can map.
    for name, svc in services.items():
        port = df.flag_dict(svc["command"]).get("port")
        if port:
            rw.address(name, port)
    members = []
    for name, svc in services.items():
        mounts = []
        for vol in svc.get("volumes", []):
            src, _, dst = vol.partition(":")
            local = rw.mount(dst.split(":")[0], os.path.join("volumes", src))
            mounts.append((dst.split(":")[0], local))
        argv = [svc["command"][0]] + rw.args(svc["command"][1:], name, mounts,
                                             hostnames)
        health = None
        test = svc.get("healthcheck", {}).get("test")
        if test:
            assert test[0] == "CMD", f"{name}: health check must be exec form"
            port = df.flag_dict(svc["command"]).get("port")
            hargs = []
            for a in test[2:]:
                n, v = df.split_flag(a)
                if n == "addr":
                    host, _, p = v.rpartition(":")
                    # Inside the container 127.0.0.1 is the service itself.
                    assert host == "127.0.0.1" and p == port, (name, v)
                    a = f"--addr=127.0.0.1:{rw.address(name, p)}"
                hargs.append(a)
            health = [test[1]] + hargs
        members.append(Member(name, argv, health))
    return members


def make_secret(tmp, name):
    """The Secret `name` as a folder shared by every pod; shardps-tls holds a
    CA, a certificate for the name `shardps` and a token made by
    deploy/tls/make-certs.sh, as deploy/README.md says to make them."""
    local = os.path.join(tmp, "secrets", name)
    if not os.path.isdir(local):
        os.makedirs(local)
        if name == "shardps-tls":
            script = os.path.join(df.ROOT, "deploy", "tls", "make-certs.sh")
            subprocess.run([script, local, "shardps"], check=True,
                           stdout=subprocess.DEVNULL)
    return local


def members_from_k8s(tmp, rw, overlay="base"):
    text = df.render_kustomize(os.path.join(df.K8S_DIR, overlay))
    if text is None:
        return None
    objs = df.k8s_objects(text)
    configmaps = {o["metadata"]["name"]: o.get("data", {})
                  for o in objs if o["kind"] == "ConfigMap"}
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    jobs = [o for o in objs if o["kind"] == "Job"]
    order = {"coordinator": 0, "server": 1, "worker": 2}
    jobs.sort(key=lambda j: order.get(j["metadata"]["name"], 9))

    # The pods, their DNS names and the Services in front of them.
    pods = []
    for job in jobs:
        indexed = job["spec"].get("completionMode") == "Indexed"
        for i in range(job["spec"].get("completions", 1)):
            spec = df.pod_spec(job)
            name = f"{job['metadata']['name']}-{i}" if indexed else job["metadata"]["name"]
            labels = job["spec"]["template"]["metadata"]["labels"]
            env = {"JOB_COMPLETION_INDEX": str(i)} if indexed else {}
            dns = [f"{name}.{spec['subdomain']}"] if spec.get("subdomain") else []
            pods.append((job, name, labels, env, dns))
    hostnames = set()
    for job, name, labels, env, dns in pods:
        ctr = df.pod_spec(job)["containers"][0]
        port = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
        for d in dns:
            for p in port.values():
                rw.addresses[(d, p)] = rw.address(name, p)
            hostnames.add(d)
        for sname, svc in services.items():
            sel = svc["spec"].get("selector", {})
            if svc["spec"].get("clusterIP") == "None":
                continue
            if sel and all(labels.get(k) == v for k, v in sel.items()):
                for sp in svc["spec"]["ports"]:
                    target = sp.get("targetPort", sp["port"])
                    cport = port.get(target, target)
                    rw.addresses[(sname, sp["port"])] = rw.address(name, cport)
                hostnames.add(sname)

    members = []
    for job, name, labels, env, dns in pods:
        spec = df.pod_spec(job)
        ctr = spec["containers"][0]
        for e in ctr.get("env", []):
            field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
            if "job-completion-index" in field:
                assert e["name"] in env, f"{name}: completion index outside an Indexed Job"
            elif "value" in e:
                env[e["name"]] = e["value"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = []
        for m in ctr.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "configMap" in v:
                local = os.path.join(tmp, "configmap", v["configMap"]["name"], name)
                os.makedirs(local, exist_ok=True)
                mounts.append((m["mountPath"], local))
            elif "persistentVolumeClaim" in v:
                mounts.append((m["mountPath"], rw.mount(
                    m["mountPath"], os.path.join(
                        "volumes", v["persistentVolumeClaim"]["claimName"]))))
            elif "secret" in v:
                mounts.append((m["mountPath"],
                               make_secret(tmp, v["secret"]["secretName"])))
            else:  # emptyDir: a folder of its own
                local = os.path.join(tmp, "pods", name, m["name"])
                os.makedirs(local, exist_ok=True)
                mounts.append((m["mountPath"], local))
        # The ConfigMap's flag files, rewritten like the args.
        for m in ctr.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "configMap" in v:
                local = dict(mounts)[m["mountPath"]]
                for key, content in configmaps[v["configMap"]["name"]].items():
                    lines = []
                    for line in content.splitlines():
                        stripped = line.strip()
                        if stripped.startswith("--"):
                            line = rw.args([stripped], name, mounts, hostnames)[0]
                        lines.append(line)
                    with open(os.path.join(local, key), "w") as f:
                        f.write("\n".join(lines) + "\n")
        args = [df.expand_k8s(a, env) for a in ctr.get("args", [])]
        argv = [ctr["command"][0]] + [df.expand_k8s(a, env) for a in ctr["command"][1:]]
        argv += rw.args(args, name, mounts, hostnames)
        health = None
        probe = ctr.get("readinessProbe", {}).get("grpc")
        if probe:
            health = ["shardps-ctl", "health",
                      f"--addr=127.0.0.1:{rw.address(name, probe['port'])}"]
            if probe.get("service"):
                health.append(f"--service={probe['service']}")
        command = ctr.get("readinessProbe", {}).get("exec", {}).get("command")
        if command:  # shardps-ctl health --addr=127.0.0.1:PORT ...
            assert command[:2] == ["shardps-ctl", "health"], (name, command)
            health = command[:2]
            for a in command[2:]:
                n, v = df.split_flag(a)
                if n == "addr":
                    host, _, p = v.rpartition(":")
                    # Inside the pod 127.0.0.1 is the pod itself.
                    assert host == "127.0.0.1", (name, v)
                    a = f"--addr=127.0.0.1:{rw.address(name, int(p))}"
                else:
                    a = rw.args([a], name, mounts, hostnames)[0]
                health.append(a)
        members.append(Member(name, argv, health))
    return members


# --- running them --------------------------------------------------------------
class Run:
    def __init__(self, c, bin_dir, tmp, members, logs="logs"):
        self.c = c
        self.bin_dir = bin_dir
        self.tmp = tmp
        self.members = members
        self.logs = logs

    def binary(self, name):
        path = df.find_binary(self.bin_dir, name)
        if path is None:
            raise FileNotFoundError(f"{name} not in {self.bin_dir}")
        return path

    def start(self, m):
        m.log_path = os.path.join(self.tmp, self.logs, m.name + ".log")
        os.makedirs(os.path.dirname(m.log_path), exist_ok=True)
        with open(m.log_path, "w") as log:
            log.write("$ " + " ".join(m.argv) + "\n")
            log.flush()
            m.proc = subprocess.Popen([self.binary(m.argv[0])] + m.argv[1:],
                                      stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)

    def probe(self, m):
        argv = [self.binary(m.health_argv[0])] + m.health_argv[1:]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=15)
        if r.returncode == 0 and "SERVING" in r.stdout:
            if not m.healthy:
                print(f"     {m.name}: health check {' '.join(m.health_argv[1:])}: "
                      f"{r.stdout.strip()}")
            m.healthy = True

    def wait_for(self, cond, deadline_s, what):
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if cond():
                return self.c.check(True, what)
            time.sleep(0.2)
        return self.c.check(False, f"{what} (within {deadline_s}s)")

    def run(self, timeout_s):
        c = self.c
        coordinator = [m for m in self.members if m.argv[0] == "shardps-coordinator"]
        early = [m for m in self.members if m.argv[0] != "shardps-coordinator"]
        early.sort(key=lambda m: m.argv[0] != "shardps-worker")  # workers first
        for m in early:
            self.start(m)
        # Before the coordinator exists, each member says it waits and retries.
        self.wait_for(lambda: all(RETRY_LOG in m.log() for m in early), 30,
                      "members started before the coordinator log that they retry")
        c.check(all(m.proc.poll() is None for m in early),
                "members started before the coordinator keep waiting")
        for m in early:
            line = next((l for l in m.log().splitlines() if RETRY_LOG in l), "")
            print(f"     {m.name}: {line[line.find('INFO'):][:150]}")
        for m in coordinator:
            self.start(m)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.members:
                if m.health_argv and not m.healthy and m.proc.poll() is None:
                    self.probe(m)
                if m.proc.poll() is None:
                    m.scrape()
            if all(m.proc.poll() is not None for m in self.members):
                break
            time.sleep(0.5)
        for m in self.members:
            if m.proc.poll() is None:
                c.check(False, f"{m.name} still running after {timeout_s}s")
                self.stop(m)
            else:
                c.equal(m.proc.returncode, 0, f"{m.name} exit code")
            if m.health_argv:
                c.check(m.healthy, f"{m.name}: health check reported SERVING "
                        f"({' '.join(m.health_argv)})")

    @staticmethod
    def stop(m):
        if m.proc is None or m.proc.poll() is not None:
            return
        m.proc.send_signal(signal.SIGTERM)
        try:
            m.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait()


class Checker:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        return ok

    def equal(self, got, want, what):
        return self.check(got == want, f"{what}: {got!r}" if got == want
                          else f"{what}: got {got!r}, want {want!r}")


def member_flags(m):
    """A member's flags, its flag file's included (later ones win): the TLS
    overlay adds a second flag file."""
    flags = df.flag_dict(m.argv)
    for name, flagfile in df.flags_of(m.argv):
        if name == "flagfile":
            with open(flagfile) as f:
                flags = {**df.flag_dict(df.flagfile_lines(f.read())), **flags}
    return flags


def rank0_outputs(members):
    rank0 = next(m for m in members if m.argv[0] == "shardps-worker"
                 and df.flag_dict(m.argv).get("rank") == "0")
    return member_flags(rank0)


def check_outputs(c, members):
    flags = rank0_outputs(members)
    epochs = int(flags.get("epochs", 10))
    model, metrics = flags.get("model_out"), flags.get("metrics_csv")
    if c.check(model and os.path.isfile(model), f"rank 0 wrote the model {model}"):
        with open(model, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        c.equal(set(header) - {"__metadata__"}, MODEL_TENSORS,
                "model.safetensors tensors")
    if c.check(metrics and os.path.isfile(metrics), f"rank 0 wrote {metrics}"):
        with open(metrics) as f:
            rows = [l.split(",") for l in f.read().splitlines()[1:] if l]
        c.equal(len(rows), epochs, "metrics.csv: a row per epoch")
        if rows:
            acc = float(rows[-1][4])
            c.check(acc >= 0.80, f"final test accuracy {acc:.4f} >= 0.80")


# A counter or gauge per binary that the main job must have moved.
METRIC_MOVED = {"shardps-coordinator": "shardps_coordinator_heartbeats_total",
                "shardps-server": "shardps_server_pushes_total",
                "shardps-worker": "shardps_worker_steps_total"}


def check_metrics(c, members):
    promtool = shutil.which("promtool")
    if promtool is None:
        print("     SKIP promtool check metrics: promtool is not installed "
              "(apt-get install prometheus)")
    for m in members:
        if m.metrics_port <= 0:
            continue
        if not c.check(m.scraped, f"{m.name}: /metrics scraped while running"):
            continue
        want = METRIC_MOVED.get(m.argv[0])
        values = [float(l.split()[-1]) for l in m.scraped.splitlines()
                  if l.startswith(want + " ")] if want else [1.0]
        c.check(values and values[0] > 0,
                f"{m.name}: {want} = {values[0] if values else 'missing'} > 0")
        if promtool is not None:
            r = subprocess.run([promtool, "check", "metrics"], input=m.scraped,
                               capture_output=True, text=True, timeout=60)
            c.check(r.returncode == 0,
                    f"{m.name}: promtool check metrics{': ' + r.stdout + r.stderr if r.returncode else ''}")


def metric_value(exposition, name):
    """The value of the unlabelled sample `name`, or None."""
    for line in exposition.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def check_compression(c, members):
    """Every worker logs the encoding its --compression asks for, and every
    server's last /metrics shows fewer gradient bytes received on the wire
    than the same gradients as fp32 (none: as many)."""
    encodings = set()
    for m in members:
        if m.argv[0] != "shardps-worker":
            continue
        want = member_flags(m).get("compression", "none")
        encoding = df.gradient_encoding(want)  # as the log names it
        encodings.add(encoding)
        line = next((l for l in m.log().splitlines() if " on the wire" in l), "")
        shown = line[line.find("rank "):] if "rank " in line else line
        c.check(encoding is not None and f", {encoding}" in line,
                f"{m.name}: --compression={want}: {shown or 'no on-the-wire line'}")
    for m in members:
        if m.argv[0] != "shardps-server":
            continue
        wire = metric_value(m.scraped, "shardps_server_received_bytes_total")
        fp32 = metric_value(m.scraped,
                            "shardps_server_received_fp32_bytes_total")
        if not c.check(bool(wire) and bool(fp32),
                       f"{m.name}: /metrics has received_bytes_total and "
                       f"received_fp32_bytes_total ({wire}, {fp32})"):
            continue
        ratio = wire / fp32
        if encodings == {"fp32"}:
            c.equal(wire, fp32, f"{m.name}: uncompressed gradients")
        else:
            c.check(wire < fp32, f"{m.name}: gradients on the wire "
                    f"{ratio:.3f} of their fp32 bytes ({sorted(encodings)})")


def committed_steps(members):
    """The committed checkpoint steps in the servers' --checkpoint_dir."""
    dirs = {member_flags(m).get("checkpoint_dir") for m in members
            if m.argv[0] == "shardps-server"}
    dirs.discard(None)
    if len(dirs) != 1:
        return None, sorted(d for d in dirs if d)
    d = dirs.pop()
    steps = []
    if os.path.isdir(d):
        for entry in os.listdir(d):
            if (entry.startswith("step-")
                    and os.path.isfile(os.path.join(d, entry, "COMMITTED"))):
                steps.append(int(entry[len("step-"):]))
    return d, sorted(steps)


def check_restore(c, name, bin_dir, builder, tmp, members, timeout_s):
    """The same deployment started again on the same volume resumes from the
    newest committed checkpoint and trains to the end."""
    d, steps = committed_steps(members)
    if d is None:
        c.check(False, f"{name}: every server has the same --checkpoint_dir ({steps})")
        return
    if not c.check(bool(steps), f"{name}: committed checkpoints in {d}: steps {steps}"):
        return
    print(f"== {name}: started again on the same volume (restore)")
    again = builder(tmp, Rewriter(tmp))
    run = Run(c, bin_dir, tmp, again, logs="logs-restore")
    try:
        run.run(timeout_s)
    finally:
        for m in again:
            Run.stop(m)
    want = f"restored from the checkpoint of step {steps[-1]}"
    for m in again:
        if m.argv[0] == "shardps-server":
            c.check(want in m.log(), f"{m.name} (restore): {want}")
    rank0 = next(m for m in again if m.argv[0] == "shardps-worker"
                 and member_flags(m).get("rank") == "0")
    c.check(f"resuming at step {steps[-1]}" in rank0.log(),
            f"{rank0.name} (restore): resuming at step {steps[-1]}")
    done = [l for l in rank0.log().splitlines() if " done: " in l]
    c.check(bool(done) and f"step {steps[-1]}" not in done[-1],
            f"{rank0.name} (restore) trained on to the end: "
            f"{done[-1][done[-1].find('done:'):] if done else 'no done: line'}")


def scenario(c, name, bin_dir, builder, timeout_s, keep, restore=True,
             extra_check=None):
    print(f"== {name}")
    tmp = tempfile.mkdtemp(prefix=f"shardps-deploy-{name}-")
    rw = Rewriter(tmp)
    try:
        members = builder(tmp, rw)
    except ValueError as e:
        c.check(False, f"{name}: {e}")
        return
    if members is None:
        print(f"SKIP {name}: kubectl is not installed (tests/deploy/setup.sh)")
        return
    for m in members:
        print(f"     {m.name}: {' '.join(m.argv)}")
    run = Run(c, bin_dir, tmp, members)
    start = time.monotonic()
    try:
        run.run(timeout_s)
        check_outputs(c, members)
        check_metrics(c, members)
        if extra_check:
            extra_check(c, members)
    finally:
        for m in members:
            Run.stop(m)
    if restore and c.failed == 0:
        check_restore(c, name, bin_dir, builder, tmp, members, timeout_s)
    print(f"     {name}: {time.monotonic() - start:.1f}s, logs in {tmp}/logs")
    if c.failed:
        for m in members:
            print(f"---- {m.name} (last lines)")
            print("\n".join(m.log().splitlines()[-15:]))
    if not keep and c.failed == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin_dir", required=True)
    ap.add_argument("--only", choices=["compose", "k8s", "k8s-tls",
                                       "compose-compression"])
    ap.add_argument("--timeout_s", type=int, default=300)
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs")
    a = ap.parse_args()
    c = Checker()
    if a.only in (None, "compose"):
        scenario(c, "compose", a.bin_dir, members_from_compose, a.timeout_s, a.keep)
    if a.only in (None, "k8s"):
        scenario(c, "k8s", a.bin_dir, members_from_k8s, a.timeout_s, a.keep)
    if a.only in (None, "k8s-tls"):
        # The TLS overlay: the same job with mutual TLS and the token, its
        # exec probes run as they are (the restore is the base's business).
        scenario(c, "k8s-tls", a.bin_dir,
                 lambda tmp, rw: members_from_k8s(tmp, rw, "overlays/tls"),
                 a.timeout_s, a.keep, restore=False)
    if a.only in (None, "compose-compression"):
        # Compressed gradients (the override's defaults): the same job, the
        # same accuracy, fewer bytes (the restore is the base's business).
        scenario(c, "compose-compression", a.bin_dir,
                 lambda tmp, rw: members_from_compose(
                     tmp, rw, ["docker-compose.compression.yml"]),
                 a.timeout_s, a.keep, restore=False,
                 extra_check=check_compression)
    print(f"run_local: {c.passed} passed, {c.failed} failed")
    return 0 if c.failed == 0 and c.passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Checks the fields of deploy/ that schemas cannot: ranks and shard
indices, probes, ports, volumes, images, flags, security settings, the
torch workers' environment, the compression settings, and that the Compose
file, its overrides, the kustomize base, its GPU, torch and compression
overlays and the Dockerfiles agree with each other.

  tests/deploy/check_fields.py [--bin_dir=BUILD]
      [--base=R.yaml --gpu=R.yaml --torch=R.yaml --compression=R.yaml]

--base/--gpu/--torch/--compression: manifests rendered by `kubectl
kustomize` (rendered here when kubectl exists, else the k8s checks are
skipped with a message). --bin_dir:
a build tree (or folder) holding the daemons; every flag the files use must
be in the `--helpfull` of the binary it is given to.
Ends with 'check_fields: N passed, M failed'; exit 0 only when none failed.
"""

import argparse
import os
import re
import sys

import deploy_files as df

IMAGE = "shardps:latest"
GPU_IMAGE = "shardps:cuda"
TORCH_IMAGE = "shardps:torch"
# The torch workers' command: the example in the image (Dockerfile.torch
# copies worker/python/examples to /opt/shardps/examples).
TORCH_EXAMPLE = "cnn_fashion_mnist.py"
TORCH_COMMAND = ["python3", f"/opt/shardps/examples/{TORCH_EXAMPLE}"]
UID = 10001
STATE_DIR = "/var/lib/shardps"
JOB_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Flags each pod gets in its args, not from the shared settings.
PER_MEMBER_FLAGS = {"rank", "shard_index", "coordinator", "advertise_host",
                    "host", "port", "metrics_port"}
# What docker-compose.compression.yml appends to each worker's command, in
# this order, as --FLAG=${VARIABLE:-default}; overlays/compression appends
# the same flags with those defaults.
COMPRESSION_FLAGS = (("compression", "SHARDPS_COMPRESSION"),
                     ("error_feedback", "SHARDPS_ERROR_FEEDBACK"),
                     ("weight_encoding", "SHARDPS_WEIGHT_ENCODING"))
# The same settings of the torch workers (shardps.torch.init() reads them).
TORCH_COMPRESSION_ENV = tuple(var for _, var in COMPRESSION_FLAGS)


class Checker:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
            print(f"ok   {what}")
        else:
            self.failed += 1
            print(f"FAIL {what}")
        return ok

    def equal(self, got, want, what):
        return self.check(got == want, f"{what}: {got!r}" if got == want
                          else f"{what}: got {got!r}, want {want!r}")


# Every (binary, flag) a file uses, for the --helpfull check.
used_flags = []


def note_flags(binary, flags, where):
    for name, _ in flags:
        used_flags.append((binary, name, where))


def addr_port(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


# --- Compose ---------------------------------------------------------------
def check_compose(c):
    base = df.compose_file()
    c.check("name" not in base, "compose: no top-level name: key (1.29)")
    services = base["services"]
    coord = services.get("coordinator")
    if not c.check(coord is not None, "compose: service coordinator"):
        return None
    cflags = df.flag_dict(coord["command"])
    num_servers = int(cflags.get("num_servers", 0))
    num_workers = int(cflags.get("num_workers", 0))
    c.check(num_servers >= 1 and num_workers >= 1,
            f"compose: coordinator expects {num_servers} servers, "
            f"{num_workers} workers")
    want = {"coordinator"} | {f"server-{i}" for i in range(num_servers)} | {
        f"worker-{i}" for i in range(num_workers)}
    c.equal(set(services), want, "compose: services match the job's shape")
    job_id = cflags.get("job_id")
    c.check(bool(job_id), f"compose: coordinator --job_id={job_id}")
    c.check(cflags.get("exit_when_finished", "true") == "true",
            "compose: the coordinator exits when the training ended")
    coord_addr = f"coordinator:{cflags.get('port')}"

    ports = {}
    metrics_ports = {}
    for name, svc in sorted(services.items()):
        argv = svc.get("command", [])
        binary = argv[0] if argv else None
        want_bin = {"c": "shardps-coordinator", "s": "shardps-server",
                    "w": "shardps-worker"}[name[0]]
        c.equal(binary, want_bin, f"compose {name}: binary")
        flags = df.flag_dict(argv)
        note_flags(binary, df.flags_of(argv), f"compose {name}")
        c.equal(svc.get("image"), IMAGE, f"compose {name}: image")
        c.equal(svc.get("user"), f"{UID}:{UID}", f"compose {name}: user")
        c.check(svc.get("read_only") is True, f"compose {name}: read_only")
        c.check(str(svc.get("restart", "")).startswith("on-failure"),
                f"compose {name}: restart on-failure (exit 0 ends it)")
        c.check("ports" not in svc and "networks" not in svc,
                f"compose {name}: no published ports or networks (host override)")
        mport = int(flags.get("metrics_port", -1))
        c.check(mport > 0 and mport not in ports.values() and
                mport not in metrics_ports.values(),
                f"compose {name}: --metrics_port={mport} fixed and unique")
        metrics_ports[name] = mport
        c.check(str(mport) in [str(e) for e in svc.get("expose", [])],
                f"compose {name}: exposes its metrics port")
        c.equal(flags.get("host"), "0.0.0.0",
                f"compose {name}: --host (gRPC and /metrics reachable)")
        if name != "coordinator":
            c.equal(flags.get("coordinator"), coord_addr,
                    f"compose {name}: --coordinator")
            c.equal(flags.get("job_id"), job_id, f"compose {name}: --job_id")
            vols = svc.get("volumes", [])
            c.check(f"checkpoints:{STATE_DIR}" in vols,
                    f"compose {name}: volume checkpoints at {STATE_DIR}")
        if binary in ("shardps-coordinator", "shardps-server"):
            port = int(flags.get("port", 0))
            c.check(port > 0 and port not in ports.values(),
                    f"compose {name}: --port={port} fixed and unique")
            ports[name] = port
            test = svc.get("healthcheck", {}).get("test", [])
            c.check(test[:3] == ["CMD", "shardps-ctl", "health"],
                    f"compose {name}: health check runs shardps-ctl health")
            hflags = df.flag_dict(["shardps-ctl"] + test[3:])
            note_flags("shardps-ctl", df.flags_of(test[3:]),
                       f"compose {name} healthcheck")
            c.equal(hflags.get("addr"), f"127.0.0.1:{port}",
                    f"compose {name}: health check address")
        if binary == "shardps-server":
            index = int(name.split("-")[1])
            c.equal(flags.get("shard_index"), str(index),
                    f"compose {name}: --shard_index")
            c.equal(flags.get("advertise_host"), name,
                    f"compose {name}: --advertise_host is its service name")
            c.equal(svc.get("depends_on", {}).get("coordinator", {}).get(
                "condition"), "service_healthy",
                f"compose {name}: starts once the coordinator is healthy")
            c.check(flags.get("checkpoint_dir", "").startswith(STATE_DIR + "/"),
                    f"compose {name}: --checkpoint_dir in the volume")
        if binary == "shardps-worker":
            index = int(name.split("-")[1])
            c.equal(flags.get("rank"), str(index), f"compose {name}: --rank")
            for f in ("model_out", "metrics_csv"):
                c.check(flags.get(f, "").startswith(STATE_DIR + "/"),
                        f"compose {name}: --{f} in the volume")
            c.equal(flags.get("dataset"), "fashion-mnist",
                    f"compose {name}: data set baked into the image")
    c.equal(ports.get("coordinator"), int(cflags.get("port", 0)),
            "compose: coordinator address port")
    servers = [services[f"server-{i}"]["command"] for i in range(num_servers)
               if f"server-{i}" in services]
    shared = [[a for a in srv[1:] if df.split_flag(a)[0] not in PER_MEMBER_FLAGS]
              for srv in servers]
    c.check(all(s == shared[0] for s in shared),
            "compose: servers share every setting but index, port and name")
    workers = [services[f"worker-{i}"]["command"] for i in range(num_workers)
               if f"worker-{i}" in services]
    stripped = [[a for a in w if not a.startswith(("--rank=", "--metrics_port="))]
                for w in workers]
    c.check(all(s == stripped[0] for s in stripped),
            "compose: workers differ only in --rank and --metrics_port")
    c.check("checkpoints" in (base.get("volumes") or {}),
            "compose: named volume checkpoints")

    # Host-network override: every service, names resolve to this machine.
    host = df.compose_file("docker-compose.host.yml")
    merged = df.merge_compose(base, host)
    hostnames = {"coordinator"} | {f"server-{i}" for i in range(num_servers)}
    for name, svc in sorted(merged["services"].items()):
        c.equal(svc.get("network_mode"), "host",
                f"compose host override {name}: network_mode")
        extra = {e.split(":")[0]: e.split(":")[1] for e in svc.get("extra_hosts", [])}
        c.check(all(extra.get(h) == "127.0.0.1" for h in hostnames),
                f"compose host override {name}: extra_hosts cover {sorted(hostnames)}")
    c.check("networks" not in host, "compose host override: defines no network")

    # GPU override: workers only; the base command with --backend=cuda.
    gpu = df.compose_file("docker-compose.gpu.yml")
    c.equal(set(gpu["services"]), {n for n in services if n.startswith("worker-")},
            "compose gpu override: services")
    for name, svc in sorted(gpu["services"].items()):
        c.equal(svc.get("image"), GPU_IMAGE, f"compose gpu override {name}: image")
        want_cmd = [("--backend=cuda" if a.startswith("--backend=") else a)
                    for a in services[name]["command"]]
        if "--backend=cuda" not in want_cmd:
            want_cmd.append("--backend=cuda")
        c.equal(svc.get("command"), want_cmd,
                f"compose gpu override {name}: base command with --backend=cuda")
        note_flags("shardps-worker", df.flags_of(svc["command"]),
                   f"compose gpu {name}")
        devices = (svc.get("deploy", {}).get("resources", {})
                   .get("reservations", {}).get("devices", []))
        c.check(any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
                    and d.get("count") == 1 for d in devices),
                f"compose gpu override {name}: reserves 1 nvidia GPU")
    check_compose_torch(c, base, coord_addr, job_id, num_workers)
    compression = check_compose_compression(c, base)
    return {"job_id": job_id, "num_servers": num_servers,
            "num_workers": num_workers, "compression": compression,
            "server_settings": shared[0] if shared else [],
            "worker_settings": [a for a in workers[0][1:]
                                if df.split_flag(a)[0] not in PER_MEMBER_FLAGS]}


def check_compression_values(c, where, values, servers):
    """`values` ({flag: value} of the three compression flags) are values
    shardps-worker takes, and `servers` (each server's {flag: value}) accept
    the gradient encoding and can send the weight encoding."""
    compression = values.get("compression", "")
    encoding = df.gradient_encoding(compression)
    c.check(encoding is not None,
            f"{where}: --compression={compression} is none, bf16, fp16, int8 "
            f"or topk:RATIO (0 < RATIO <= 1)")
    feedback = values.get("error_feedback", "")
    c.check(df.error_feedback_valid(feedback),
            f"{where}: --error_feedback={feedback} is true/false (1/0)")
    weights = values.get("weight_encoding", "")
    c.check(df.weight_encoding_valid(weights),
            f"{where}: --weight_encoding={weights} is fp32, bf16 or topk:RATIO")
    for i, flags in enumerate(servers if encoding else []):
        accepted = df.accepted_encodings(flags.get("encodings"))
        c.check(accepted is not None and encoding in accepted,
                f"{where}: server {i} (--encodings="
                f"{flags.get('encodings', 'all')}) accepts {encoding}")
        if weights.startswith("topk:"):
            c.equal(flags.get("mode", "sync"), "sync",
                    f"{where}: server {i} in sync mode (sparse weights)")


def check_compose_compression(c, base):
    """Compression override: workers only; each runs the base command with
    the three flags appended, their values from the shell's variables (the
    same for every worker) with valid defaults. Returns the defaults."""
    comp = df.compose_file("docker-compose.compression.yml")
    services = base["services"]
    workers = sorted(n for n in services if n.startswith("worker-"))
    c.equal(sorted(comp.get("services") or {}), workers,
            "compose compression override: services")
    c.check(all(k == "services" or k.startswith("x-") for k in comp),
            "compose compression override: services only (no networks, "
            "volumes or secrets)")
    defaults = []
    for name in workers:
        svc = (comp.get("services") or {}).get(name) or {}
        where = f"compose compression override {name}"
        c.equal(sorted(svc), ["command"], f"{where}: changes only the command")
        cmd = svc.get("command") or []
        base_cmd = services[name]["command"]
        c.equal(cmd[:len(base_cmd)], base_cmd, f"{where}: the base command")
        extra = cmd[len(base_cmd):]
        c.equal([df.split_flag(a)[0] for a in extra],
                [f for f, _ in COMPRESSION_FLAGS],
                f"{where}: then --compression, --error_feedback, "
                "--weight_encoding")
        values = {}
        for arg, (flag, var) in zip(extra, COMPRESSION_FLAGS):
            m = re.fullmatch(rf"--{flag}=\$\{{{var}:-([^}}]+)\}}", arg)
            if c.check(m is not None,
                       f"{where}: {arg} reads ${var} with a default"):
                values[flag] = m.group(1)
        defaults.append(values)
        note_flags("shardps-worker", df.flags_of(cmd),
                   f"compose compression {name}")
    values = defaults[0] if defaults else {}
    c.check(len(values) == len(COMPRESSION_FLAGS) and
            all(d == values for d in defaults),
            "compose compression override: every worker reads the same "
            f"variables with the same defaults {values} (one "
            "--weight_encoding for the job)")
    servers = [df.flag_dict(services[n]["command"]) for n in sorted(services)
               if n.startswith("server-")]
    check_compression_values(c, "compose compression override defaults",
                             values, servers)
    return values


def check_torch_env(c, where, env, coordinator, job_id, rank, num_workers):
    """The variables shardps.torch.init() reads, as shardps-local sets them."""
    c.equal(env.get("SHARDPS_COORDINATOR"), coordinator,
            f"{where}: SHARDPS_COORDINATOR is the coordinator's address")
    c.equal(env.get("SHARDPS_JOB_ID"), job_id,
            f"{where}: SHARDPS_JOB_ID is the coordinator's --job_id")
    c.equal(env.get("SHARDPS_RANK"), rank, f"{where}: SHARDPS_RANK")
    c.equal(env.get("SHARDPS_NUM_WORKERS"), str(num_workers),
            f"{where}: SHARDPS_NUM_WORKERS is the coordinator's --num_workers")
    c.check(str(env.get("SHARDPS_RUN_DIR", "")).startswith(STATE_DIR),
            f"{where}: SHARDPS_RUN_DIR in the volume")
    c.check("SHARDPS_SERVERS" not in env,
            f"{where}: no SHARDPS_SERVERS (the coordinator tells the servers)")
    # Compression, as shardps.torch.init() reads it.
    values = {flag: env.get(var) for (flag, _), var in
              zip(COMPRESSION_FLAGS, TORCH_COMPRESSION_ENV)}
    c.check(all(v is not None for v in values.values()),
            f"{where}: sets {', '.join(TORCH_COMPRESSION_ENV)}")
    if values["compression"] is not None:
        c.check(df.gradient_encoding(values["compression"]) is not None,
                f"{where}: SHARDPS_COMPRESSION={values['compression']} is "
                "none, bf16, fp16, int8 or topk:RATIO")
    if values["error_feedback"] is not None:
        c.check(df.error_feedback_valid(values["error_feedback"]),
                f"{where}: SHARDPS_ERROR_FEEDBACK="
                f"{values['error_feedback']} is 1/0 (true/false)")
    if values["weight_encoding"] is not None:
        c.check(df.weight_encoding_valid(values["weight_encoding"]),
                f"{where}: SHARDPS_WEIGHT_ENCODING="
                f"{values['weight_encoding']} is fp32, bf16 or topk:RATIO")


def check_compose_torch(c, base, coord_addr, job_id, num_workers):
    """Torch override: workers only; the example with the job's variables."""
    torch = df.compose_file("docker-compose.torch.yml")
    workers = {n for n in base["services"] if n.startswith("worker-")}
    c.equal(set(torch["services"]), workers, "compose torch override: services")
    merged = df.merge_compose(base, torch)
    for name in sorted(workers):
        svc = merged["services"][name]
        where = f"compose torch override {name}"
        c.equal(svc.get("image"), TORCH_IMAGE, f"{where}: image")
        c.equal(svc.get("build", {}).get("dockerfile"),
                "deploy/docker/Dockerfile.torch", f"{where}: built from")
        c.equal(svc.get("command"), TORCH_COMMAND, f"{where}: command")
        raw = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        for var in TORCH_COMPRESSION_ENV:
            c.check(re.fullmatch(rf"\$\{{{var}:-[^}}]+\}}",
                                 raw.get(var, "")) is not None,
                    f"{where}: {var} passes ${var} through, with a default "
                    f"({raw.get(var)!r})")
        # What the container sees with none of the variables set.
        env = {k: df.interpolate(v, {}) for k, v in raw.items()}
        check_torch_env(c, where, env, coord_addr, job_id,
                        name.split("-")[1], num_workers)
        # What the base gives every worker still holds.
        c.check(f"checkpoints:{STATE_DIR}" in svc.get("volumes", []) and
                svc.get("read_only") is True and
                svc.get("user") == f"{UID}:{UID}",
                f"{where}: base volume, read-only root and user kept")


# --- Kubernetes ------------------------------------------------------------
def container(job):
    return df.pod_spec(job)["containers"][0]


def check_pod_common(c, name, job, objs, configmap_data):
    spec = df.pod_spec(job)
    ctr = container(job)
    sc = spec.get("securityContext", {})
    c.check(sc.get("runAsNonRoot") is True and sc.get("runAsUser") == UID
            and sc.get("fsGroup") == UID,
            f"k8s {name}: pod runs as non-root {UID}, fsGroup {UID}")
    csc = ctr.get("securityContext", {})
    c.check(csc.get("readOnlyRootFilesystem") is True
            and csc.get("allowPrivilegeEscalation") is False
            and csc.get("capabilities", {}).get("drop") == ["ALL"],
            f"k8s {name}: read-only root, no privilege escalation, no capabilities")
    c.check(spec.get("automountServiceAccountToken") is False,
            f"k8s {name}: no service account token")
    c.equal(spec.get("restartPolicy"), "OnFailure", f"k8s {name}: restartPolicy")
    res = ctr.get("resources", {})
    c.check(all(k in res.get(t, {}) for t in ("requests", "limits")
                for k in ("cpu", "memory")),
            f"k8s {name}: cpu and memory requests and limits")
    # Volumes: every mount has a volume, every volume's source exists.
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in ctr.get("volumeMounts", [])}
    for m in ctr.get("volumeMounts", []):
        v = volumes.get(m["name"])
        if not c.check(v is not None, f"k8s {name}: mount {m['mountPath']} has a volume"):
            continue
        if "configMap" in v:
            c.check(df.find(objs, "ConfigMap", v["configMap"]["name"]) is not None,
                    f"k8s {name}: ConfigMap {v['configMap']['name']} exists")
        if "secret" in v:
            c.check(df.find(objs, "Secret", v["secret"]["secretName"]) is not None,
                    f"k8s {name}: Secret {v['secret']['secretName']} exists")
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            c.check(df.find(objs, "PersistentVolumeClaim", claim) is not None,
                    f"k8s {name}: PVC {claim} exists")
    c.check("/tmp" in mounts, f"k8s {name}: writable /tmp on a read-only root")
    # --flagfile names a key of the mounted ConfigMap.
    args = ctr.get("args", [])
    flagfile = df.flag_dict(args).get("flagfile")
    flags_from_file = []
    if c.check(flagfile is not None, f"k8s {name}: --flagfile"):
        mount_dir, key = os.path.split(flagfile)
        m = mounts.get(mount_dir)
        v = volumes.get(m["name"]) if m else None
        c.check(v is not None and "configMap" in v and key in configmap_data,
                f"k8s {name}: {flagfile} is key {key} of the mounted ConfigMap")
        flags_from_file = df.flagfile_lines(configmap_data.get(key, ""))
    all_flags = df.flags_of(flags_from_file + args)
    note_flags(ctr["command"][0], all_flags, f"k8s {name}")
    # Paths the daemon writes are on a writable volume (the root is not).
    pvc_mounts = [p for p, m in mounts.items()
                  if "persistentVolumeClaim" in volumes.get(m["name"], {})]
    for f, value in all_flags:
        if f in ("model_out", "metrics_csv", "checkpoint_dir", "port_file"):
            c.check(any(value.startswith(p + "/") for p in pvc_mounts),
                    f"k8s {name}: --{f}={value} is on a persistent volume")
    return dict(all_flags), ctr


def check_probes(c, name, ctr, port):
    ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    c.equal(ports.get("grpc"), port, f"k8s {name}: containerPort grpc is --port")
    for probe in ("readinessProbe", "livenessProbe"):
        p = ctr.get(probe, {})
        c.equal(p.get("grpc", {}).get("port"), port,
                f"k8s {name}: {probe} is a gRPC probe on --port")


def check_metrics(c, name, job, flags, ctr):
    """The pod serves /metrics on its port named metrics, and says so."""
    ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    mport = int(flags.get("metrics_port", -1))
    c.check(mport > 0 and ports.get("metrics") == mport,
            f"k8s {name}: containerPort metrics is --metrics_port={mport}")
    c.equal(flags.get("host"), "0.0.0.0", f"k8s {name}: --host (for /metrics)")
    ann = job["spec"]["template"]["metadata"].get("annotations", {})
    c.equal((ann.get("prometheus.io/scrape"), ann.get("prometheus.io/port"),
             ann.get("prometheus.io/path")), ("true", str(mport), "/metrics"),
            f"k8s {name}: prometheus.io annotations")


def check_service(c, svc, job, port):
    name = svc["metadata"]["name"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    sel = svc["spec"].get("selector", {})
    c.check(sel and all(labels.get(k) == v for k, v in sel.items()),
            f"k8s Service {name}: selector matches the Job's pods")
    sp = svc["spec"]["ports"][0]
    c.check(sp.get("targetPort") in ("grpc", port),
            f"k8s Service {name}: targetPort is the daemon's port")
    if svc["spec"].get("clusterIP") == "None":
        # Clients dial the pods' DNS names directly: same port as the pods.
        c.equal(sp["port"], port, f"k8s Service {name}: headless port is --port")
    return sp["port"]


def check_k8s(c, objs, gpu_objs, compose):
    for kind, name in (("Namespace", "shardps"), ("ConfigMap", "shardps-job"),
                       ("Secret", "shardps-tls"),
                       ("PersistentVolumeClaim", "checkpoints"),
                       ("Service", "coordinator"), ("Service", "server"),
                       ("Job", "coordinator"), ("Job", "server"),
                       ("Job", "worker")):
        c.check(df.find(objs, kind, name) is not None, f"k8s: {kind} {name}")
    for o in objs:
        if o["kind"] != "Namespace":
            c.equal(o["metadata"].get("namespace"), "shardps",
                    f"k8s {o['kind']} {o['metadata']['name']}: namespace")
    cm = df.find(objs, "ConfigMap", "shardps-job")["data"]
    cflags = df.flag_dict(df.flagfile_lines(cm.get("coordinator.flags", "")))
    num_servers = int(cflags.get("num_servers", 0))
    num_workers = int(cflags.get("num_workers", 0))
    job_id = cflags.get("job_id")
    c.check(cflags.get("exit_when_finished", "true") == "true",
            "k8s coordinator.flags: the coordinator exits when the training "
            "ended (its Job completes)")
    for key in ("server.flags", "worker.flags"):
        c.equal(df.flag_dict(df.flagfile_lines(cm.get(key, ""))).get("job_id"),
                job_id, f"k8s ConfigMap {key}: --job_id")
    if compose:
        c.equal((job_id, num_servers, num_workers),
                (compose["job_id"], compose["num_servers"], compose["num_workers"]),
                "k8s ConfigMap and compose: same job id and shape")
        c.equal(df.flagfile_lines(cm.get("worker.flags", "")),
                compose["worker_settings"],
                "k8s ConfigMap worker.flags: the compose workers' settings")
        c.equal(df.flagfile_lines(cm.get("server.flags", "")),
                compose["server_settings"],
                "k8s ConfigMap server.flags: the compose servers' settings")

    # Coordinator.
    cjob = df.find(objs, "Job", "coordinator")
    flags, ctr = check_pod_common(c, "coordinator", cjob, objs, cm)
    c.equal(ctr.get("command"), ["shardps-coordinator"], "k8s coordinator: command")
    c.equal(flags.get("host"), "0.0.0.0", "k8s coordinator: --host")
    cport = int(flags.get("port", 0))
    check_probes(c, "coordinator", ctr, cport)
    check_metrics(c, "coordinator", cjob, flags, ctr)
    csvc = df.find(objs, "Service", "coordinator")
    coord_addr = f"coordinator:{check_service(c, csvc, cjob, cport)}"

    # Servers.
    sjob = df.find(objs, "Job", "server")
    flags, ctr = check_pod_common(c, "server", sjob, objs, cm)
    spec = sjob["spec"]
    c.equal(ctr.get("command"), ["shardps-server"], "k8s server: command")
    c.equal(spec.get("completionMode"), "Indexed", "k8s server: Indexed Job")
    c.equal((spec.get("completions"), spec.get("parallelism")),
            (num_servers, num_servers),
            "k8s server: completions and parallelism are --num_servers")
    env = {e["name"]: e for e in ctr.get("env", [])}
    c.equal(env.get("JOB_COMPLETION_INDEX", {}).get("valueFrom", {})
            .get("fieldRef", {}).get("fieldPath"), JOB_INDEX_FIELD,
            "k8s server: JOB_COMPLETION_INDEX from the completion index")
    c.equal(flags.get("shard_index"), "$(JOB_COMPLETION_INDEX)",
            "k8s server: shard index is the completion index")
    headless = df.find(objs, "Service", "server")
    subdomain = df.pod_spec(sjob).get("subdomain")
    c.equal(subdomain, headless["metadata"]["name"],
            "k8s server: subdomain is the headless Service")
    c.equal(headless["spec"].get("clusterIP"), "None", "k8s Service server: headless")
    c.equal(flags.get("advertise_host"),
            f"{sjob['metadata']['name']}-$(JOB_COMPLETION_INDEX).{subdomain}",
            "k8s server: advertises its stable DNS name")
    c.equal(flags.get("host"), "0.0.0.0", "k8s server: --host")
    c.equal(flags.get("coordinator"), coord_addr, "k8s server: --coordinator")
    sport = int(flags.get("port", 0))
    check_probes(c, "server", ctr, sport)
    check_metrics(c, "server", sjob, flags, ctr)
    check_service(c, headless, sjob, sport)
    startup = ctr.get("startupProbe", {})
    c.equal(startup.get("grpc", {}).get("port"), sport,
            "k8s server: startupProbe is a gRPC probe on --port")
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    join = int(flags.get("join_timeout_s", 120))
    c.check(window >= join, f"k8s server: startup window {window}s covers "
            f"--join_timeout_s={join}")

    # Workers.
    wjob = df.find(objs, "Job", "worker")
    flags, ctr = check_pod_common(c, "worker", wjob, objs, cm)
    check_metrics(c, "worker", wjob, flags, ctr)
    spec = wjob["spec"]
    c.equal(ctr.get("command"), ["shardps-worker"], "k8s worker: command")
    c.equal(spec.get("completionMode"), "Indexed", "k8s worker: Indexed Job")
    c.equal((spec.get("completions"), spec.get("parallelism")),
            (num_workers, num_workers),
            "k8s worker: completions and parallelism are --num_workers")
    env = {e["name"]: e for e in ctr.get("env", [])}
    c.equal(env.get("JOB_COMPLETION_INDEX", {}).get("valueFrom", {})
            .get("fieldRef", {}).get("fieldPath"), JOB_INDEX_FIELD,
            "k8s worker: JOB_COMPLETION_INDEX from the completion index")
    c.equal(flags.get("rank"), "$(JOB_COMPLETION_INDEX)",
            "k8s worker: rank is the completion index")
    c.equal(flags.get("coordinator"), coord_addr, "k8s worker: --coordinator")

    # Images.
    for job in (cjob, sjob, wjob):
        c.equal(container(job).get("image"), IMAGE,
                f"k8s {job['metadata']['name']}: image")

    # NetworkPolicy: only the job's pods reach the servers, on their port.
    pods = [j["spec"]["template"]["metadata"]["labels"] for j in (cjob, sjob, wjob)]
    slabels = sjob["spec"]["template"]["metadata"]["labels"]

    def matches(selector, labels):
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    pols = [o for o in objs if o["kind"] == "NetworkPolicy"
            and matches(o["spec"]["podSelector"], slabels)]
    ok = False
    for p in pols:
        for rule in p["spec"].get("ingress", []):
            froms = rule.get("from", [])
            rports = [r.get("port") for r in rule.get("ports", [])]
            if (froms and all("podSelector" in f and "namespaceSelector" not in f
                              for f in froms)
                    and all(any(matches(f["podSelector"], l) for f in froms) for l in pods)
                    and rports == [sport]):
                ok = True
    c.check(bool(pols) and ok and all("Ingress" in p["spec"].get("policyTypes", [])
                                      for p in pols),
            "k8s NetworkPolicy: the job's pods (and only those selectors) reach "
            f"the servers on {sport}")

    # GPU overlay: only the worker changes.
    if gpu_objs is not None:
        gw = df.find(gpu_objs, "Job", "worker")
        gctr = container(gw)
        c.equal(gctr.get("image"), GPU_IMAGE, "k8s gpu: worker image")
        c.equal(gctr.get("args"), ctr.get("args", []) + ["--backend=cuda"],
                "k8s gpu: worker args are the base's plus --backend=cuda")
        note_flags("shardps-worker", df.flags_of(gctr["args"]), "k8s gpu worker")
        res = gctr.get("resources", {})
        c.check(str(res.get("limits", {}).get("nvidia.com/gpu")) == "1",
                "k8s gpu: worker limits nvidia.com/gpu: 1")
        for job in ("coordinator", "server"):
            c.check(df.find(gpu_objs, "Job", job) == df.find(objs, "Job", job),
                    f"k8s gpu: Job {job} unchanged")


def check_k8s_torch(c, objs, torch_objs):
    """Torch overlay: only the worker changes, to the example with the job's
    variables, and it no longer claims a /metrics port."""
    cm = df.find(objs, "ConfigMap", "shardps-job")["data"]
    cflags = df.flag_dict(df.flagfile_lines(cm.get("coordinator.flags", "")))
    csvc = df.find(objs, "Service", "coordinator")
    coord_addr = f"coordinator:{csvc['spec']['ports'][0]['port']}"
    tw = df.find(torch_objs, "Job", "worker")
    ctr = container(tw)
    c.equal(ctr.get("image"), TORCH_IMAGE, "k8s torch: worker image")
    c.equal(ctr.get("command"), TORCH_COMMAND, "k8s torch: worker command")
    c.check(not ctr.get("args"), "k8s torch: no shardps-worker args")
    env_list = ctr.get("env", [])
    env = {e["name"]: e.get("value") for e in env_list}
    names = [e["name"] for e in env_list]
    c.check("JOB_COMPLETION_INDEX" in names and "SHARDPS_RANK" in names and
            names.index("JOB_COMPLETION_INDEX") < names.index("SHARDPS_RANK"),
            "k8s torch: JOB_COMPLETION_INDEX defined before SHARDPS_RANK "
            "names it")
    num_workers = int(cflags.get("num_workers", 0))
    check_torch_env(c, "k8s torch worker", env, coord_addr,
                    cflags.get("job_id"), "$(JOB_COMPLETION_INDEX)",
                    num_workers)
    c.equal(tw["spec"].get("completions"), num_workers,
            "k8s torch: completions are SHARDPS_NUM_WORKERS")
    ann = tw["spec"]["template"]["metadata"].get("annotations") or {}
    c.check(ann.get("prometheus.io/scrape") != "true" and
            not any(p.get("name") == "metrics" for p in ctr.get("ports", [])),
            "k8s torch: no /metrics port claimed (the script serves none)")
    mounts = {m["mountPath"] for m in ctr.get("volumeMounts", [])}
    c.check(STATE_DIR in mounts and "/tmp" in mounts,
            f"k8s torch: {STATE_DIR} and /tmp mounted as in the base")
    for job in ("coordinator", "server"):
        c.check(df.find(torch_objs, "Job", job) == df.find(objs, "Job", job),
                f"k8s torch: Job {job} unchanged")


def check_k8s_compression(c, objs, comp_objs, compose):
    """Compression overlay: only the worker's args change, by the three
    flags, with the values docker-compose.compression.yml defaults to."""
    base_job = df.find(objs, "Job", "worker")
    job = df.find(comp_objs, "Job", "worker")
    base_args = container(base_job).get("args", [])
    args = container(job).get("args", [])
    c.equal(args[:len(base_args)], base_args,
            "k8s compression: worker args start with the base's")
    extra = df.flags_of(args[len(base_args):])
    c.equal([f for f, _ in extra], [f for f, _ in COMPRESSION_FLAGS],
            "k8s compression: then --compression, --error_feedback, "
            "--weight_encoding")
    values = dict(extra)
    if compose and compose.get("compression"):
        c.equal(values, compose["compression"],
                "k8s compression: the values docker-compose.compression.yml "
                "defaults to")
    note_flags("shardps-worker", df.flags_of(args), "k8s compression worker")

    def without_args(j):
        j = {**j, "spec": {**j["spec"], "template": {
            **j["spec"]["template"], "spec": dict(df.pod_spec(j))}}}
        ctrs = [dict(x) for x in df.pod_spec(j)["containers"]]
        ctrs[0].pop("args", None)
        j["spec"]["template"]["spec"]["containers"] = ctrs
        return j
    c.check(without_args(job) == without_args(base_job),
            "k8s compression: Job worker otherwise unchanged")
    for kind, name in (("Job", "coordinator"), ("Job", "server"),
                       ("ConfigMap", "shardps-job")):
        c.check(df.find(comp_objs, kind, name) == df.find(objs, kind, name),
                f"k8s compression: {kind} {name} unchanged")
    cm = df.find(comp_objs, "ConfigMap", "shardps-job")["data"]
    sjob = df.find(comp_objs, "Job", "server")
    server = df.flag_dict(df.flagfile_lines(cm.get("server.flags", "")) +
                          container(sjob).get("args", []))
    check_compression_values(c, "k8s compression", values, [server])


# --- Dockerfiles -------------------------------------------------------------
def check_torch_dockerfile(c):
    with open(os.path.join(df.DOCKER_DIR, "Dockerfile.torch")) as f:
        text = f.read()
    for pkg in ("python3-torch", "python3-numpy", "python3-matplotlib",
                "pybind11-dev"):
        c.check(re.search(rf"\b{pkg}\b", text) is not None,
                f"Dockerfile.torch: installs {pkg}")
    c.check(re.search(r"PYTHONPATH=/opt/shardps/python\b", text) is not None,
            "Dockerfile.torch: PYTHONPATH names the package")
    c.check(re.search(r"cp -r worker/python/examples /out/examples", text)
            is not None and "/opt/shardps/examples/" in text,
            "Dockerfile.torch: examples at /opt/shardps/examples")
    c.check("import numpy, torch, shardps.torch" in text,
            "Dockerfile.torch: the build imports the package with torch")
    examples = os.path.join(df.ROOT, "worker", "python", "examples")
    if not os.path.isdir(examples):
        print(f"SKIP the torch workers' script: no {examples} in this tree")
        return
    c.check(os.path.isfile(os.path.join(examples, TORCH_EXAMPLE)),
            f"the torch workers' script worker/python/examples/{TORCH_EXAMPLE}")


def check_dockerfiles(c, compose):
    for name in ("Dockerfile", "Dockerfile.cuda", "Dockerfile.torch"):
        with open(os.path.join(df.DOCKER_DIR, name)) as f:
            text = f.read()
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        c.equal(users[-1:], [f"{UID}:{UID}"], f"{name}: runs as {UID}")
        c.check(re.search(r"-DSHARDPS_ENABLE_CUDA=" +
                          ("ON" if name.endswith("cuda") else "OFF"), text) is not None,
                f"{name}: CUDA {'on' if name.endswith('cuda') else 'off'}")
        c.check(all(re.search(rf"\b{b}\b", text) for b in df.DAEMONS),
                f"{name}: builds and installs every daemon")
        c.check(re.search(rf"install -d -o {UID} -g {UID} .*{STATE_DIR}", text)
                is not None, f"{name}: {STATE_DIR} owned by {UID}")
        c.check("dataset-fashion-mnist" in text, f"{name}: data set in the image")
    check_torch_dockerfile(c)
    with open(os.path.join(df.ROOT, ".dockerignore")) as f:
        ignore = f.read()
    c.check("tests/deploy/" in ignore and "!deploy/docker/" in ignore,
            ".dockerignore: sources only (no node_modules, no build trees)")


def check_binaries(c, bin_dir):
    known = {}
    for b in df.DAEMONS:
        path = df.find_binary(bin_dir, b)
        if not c.check(path is not None, f"binary {b} in {bin_dir}"):
            continue
        known[b] = df.known_flags(path)
    seen = set()
    for binary, flag, where in used_flags:
        if binary not in known or (binary, flag) in seen:
            continue
        seen.add((binary, flag))
        c.check(flag in known[binary], f"{binary} accepts --{flag} ({where})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin_dir")
    ap.add_argument("--base", help="rendered deploy/k8s/base")
    ap.add_argument("--gpu", help="rendered deploy/k8s/overlays/gpu")
    ap.add_argument("--torch", help="rendered deploy/k8s/overlays/torch")
    ap.add_argument("--compression",
                    help="rendered deploy/k8s/overlays/compression")
    a = ap.parse_args()
    c = Checker()
    compose = check_compose(c)
    base_text = gpu_text = torch_text = comp_text = None
    if a.base:
        base_text = open(a.base).read()
        gpu_text = open(a.gpu).read() if a.gpu else None
        torch_text = open(a.torch).read() if a.torch else None
        comp_text = open(a.compression).read() if a.compression else None
    else:
        base_text = df.render_kustomize(os.path.join(df.K8S_DIR, "base"))
        gpu_text = df.render_kustomize(os.path.join(df.K8S_DIR, "overlays", "gpu"))
        torch_text = df.render_kustomize(
            os.path.join(df.K8S_DIR, "overlays", "torch"))
        comp_text = df.render_kustomize(
            os.path.join(df.K8S_DIR, "overlays", "compression"))
    if base_text is None:
        print("SKIP k8s checks: kubectl is not installed (tests/deploy/setup.sh)")
    else:
        base_objs = df.k8s_objects(base_text)
        check_k8s(c, base_objs,
                  df.k8s_objects(gpu_text) if gpu_text else None, compose)
        if torch_text:
            check_k8s_torch(c, base_objs, df.k8s_objects(torch_text))
        if comp_text:
            check_k8s_compression(c, base_objs, df.k8s_objects(comp_text),
                                  compose)
    check_dockerfiles(c, compose)
    if a.bin_dir:
        check_binaries(c, a.bin_dir)
    print(f"check_fields: {c.passed} passed, {c.failed} failed")
    return 0 if c.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

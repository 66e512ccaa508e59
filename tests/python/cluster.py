"""Real shardps daemons for the Python tests: a coordinator and servers
started as separate processes on 127.0.0.1 with ports picked at run time
(--port=0 --port_file), and worker scripts run as separate processes with
the environment shardps-local gives them. Test-only."""

import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
BUILD = os.environ.get("SHARDPS_BUILD_DIR", os.path.join(REPO, "build"))
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else (
    sys.executable)


def binary(name):
    for sub in ("server", "worker", "deploy/local", "tests"):
        path = os.path.join(BUILD, sub, name)
        if os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"{name} is not built under {BUILD}")


def python_env(extra=None):
    # Only what the caller gives of shardps's own settings.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SHARDPS_") or k == "SHARDPS_BUILD_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(BUILD, "worker", "python"),
         os.path.join(REPO, "tests", "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra or {})
    return env


class Daemon:
    """One daemon process, its log and the port it listens on."""

    def __init__(self, name, argv, log_dir, wait_port=True, timeout=60):
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(log_dir, name + ".log")
        self.port_file = os.path.join(log_dir, name + ".port")
        self.port = None
        self._wait_port = wait_port
        self._timeout = timeout
        self.proc = None
        self.start()

    def start(self, extra_args=()):
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        args = list(self.argv) + list(extra_args)
        if self.port is not None and not any(a.startswith("--port=")
                                             for a in args):
            args.append(f"--port={self.port}")  # a restart keeps its port
        elif not any(a.startswith("--port=") for a in args):
            args.append("--port=0")
        args.append(f"--port_file={self.port_file}")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if self._wait_port:
            deadline = time.time() + self._timeout
            while not _read_port(self.port_file):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with "
                                       f"{self.proc.returncode}:\n"
                                       f"{self.log()}")
                if time.time() > deadline:
                    raise TimeoutError(f"{self.name} did not listen:\n"
                                       f"{self.log()}")
                time.sleep(0.02)
            self.port = _read_port(self.port_file)

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _read_port(path):
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class Cluster:
    """A job's daemons: a coordinator (when coordinated) and servers.

    Static: servers get --shard_index/--num_shards/--num_workers and
    workers SHARDPS_SERVERS. Coordinated: servers and workers get
    --coordinator / SHARDPS_COORDINATOR and the job id.
    """

    def __init__(self, num_servers=2, num_workers=2, coordinated=False,
                 server_flags=(), coordinator_flags=(), job_id="pytest"):
        self.dir = tempfile.mkdtemp(prefix="shardps-pytest-")
        self.num_workers = num_workers
        self.coordinated = coordinated
        self.job_id = job_id
        self.coordinator = None
        self.servers = []
        self.workers = []
        if coordinated:
            self.coordinator = Daemon(
                "coordinator",
                [binary("shardps-coordinator"), f"--job_id={job_id}",
                 f"--num_servers={num_servers}",
                 f"--num_workers={num_workers}",
                 "--heartbeat_timeout_ms=3000"] + list(coordinator_flags),
                self.dir)
        for i in range(num_servers):
            if coordinated:
                args = [f"--job_id={job_id}",
                        f"--coordinator={self.coordinator.address}"]
            else:
                args = [f"--shard_index={i}", f"--num_shards={num_servers}",
                        f"--num_workers={num_workers}"]
            self.servers.append(Daemon(
                f"server{i}", [binary("shardps-server")] + args +
                list(server_flags), self.dir, wait_port=True))

    def worker_env(self, rank, extra=None):
        env = {"SHARDPS_RANK": str(rank),
               "SHARDPS_NUM_WORKERS": str(self.num_workers),
               "SHARDPS_CONNECT_TIMEOUT_S": "60"}
        if self.coordinated:
            env["SHARDPS_COORDINATOR"] = self.coordinator.address
            env["SHARDPS_JOB_ID"] = self.job_id
        else:
            env["SHARDPS_SERVERS"] = ",".join(s.address for s in self.servers)
        env.update(extra or {})
        return python_env(env)

    def run_workers(self, script, args=(), ranks=None, extra_env=None):
        """Starts `script` as each rank; returns the Popen objects."""
        procs = []
        for rank in (range(self.num_workers) if ranks is None else ranks):
            log = open(os.path.join(self.dir, f"worker{rank}.log"), "ab")
            procs.append(subprocess.Popen(
                [PYTHON, script] + list(args), stdout=log,
                stderr=subprocess.STDOUT, env=self.worker_env(rank,
                                                              extra_env)))
            log.close()
        self.workers.extend(procs)
        return procs

    def worker_log(self, rank):
        with open(os.path.join(self.dir, f"worker{rank}.log"),
                  errors="replace") as f:
            return f.read()

    def wait_workers(self, procs, timeout=300):
        deadline = time.time() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
        return codes

    def logs(self):
        parts = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    parts.append(f"--- {name}\n{f.read()[-4000:]}")
        return "\n".join(parts)

    def stop(self):
        for p in self.workers:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in self.servers:
            s.stop()
        if self.coordinator is not None:
            self.coordinator.stop()

"""The CNN example as users run it: shardps-local -- python3 EXAMPLE, with a
server killed with SIGKILL under --restart_on_crash. The job restarts from
its last committed checkpoint and ends with a model bitwise equal to the
uninterrupted run's."""

import glob
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import cluster
import safetensors_read

EXAMPLE = os.path.join(cluster.REPO, "worker", "python", "examples",
                       "cnn_fashion_mnist.py")
STEPS = 100

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/share/datasets/fashion-mnist"),
    reason="/usr/share/datasets/fashion-mnist is missing: apt-get install "
    "dataset-fashion-mnist")


def launch(run_dir, extra=()):
    args = [cluster.binary("shardps-local"), "--servers=2", "--workers=2",
            f"--run_dir={run_dir}", "--checkpoint_every_steps=20",
            "--timeout_s=600"] + list(extra) + [
            "--", cluster.PYTHON, EXAMPLE, f"--max_steps={STEPS}",
            "--epochs=1", f"--model_out={run_dir}/model.safetensors"]
    return subprocess.Popen(args, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=cluster.python_env())


def committed_steps(run_dir):
    return sorted(int(os.path.basename(os.path.dirname(p))[5:]) for p in
                  glob.glob(f"{run_dir}/checkpoints/step-*/COMMITTED"))


def test_cnn_example_survives_a_killed_server_bitwise(tmp_path):
    ref_dir, faulty_dir = str(tmp_path / "ref"), str(tmp_path / "faulty")
    ref = launch(ref_dir)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out
    assert f"final: epoch=1 step={STEPS}" in out, out

    faulty = launch(faulty_dir, ["--restart_on_crash"])
    deadline = time.time() + 300
    while not any(s >= 40 for s in committed_steps(faulty_dir)):
        assert faulty.poll() is None, faulty.communicate()[0]
        assert time.time() < deadline, "no checkpoint at step 40"
        time.sleep(0.05)
    with open(f"{faulty_dir}/pids/server-1.pid") as f:
        os.kill(int(f.read().strip()), signal.SIGKILL)
    out, _ = faulty.communicate(timeout=600)
    assert faulty.returncode == 0, out
    assert "restart" in out, out
    print(f"killed server-1 after checkpoint {committed_steps(faulty_dir)}")
    ours, meta = safetensors_read.read(f"{faulty_dir}/model.safetensors")
    theirs, _ = safetensors_read.read(f"{ref_dir}/model.safetensors")
    assert meta["step"] == str(STEPS)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert np.array_equal(ours[k], theirs[k]), k

"""The C++ worker's guarantees hold for torch workers: a server killed with
SIGKILL and restarted from its checkpoint rolls the job back, and the final
model is bitwise identical to an uninterrupted run; a worker that dies and
is not restarted is dropped and the others finish."""

import os
import re
import signal
import time

import numpy as np
import pytest

import cluster
import safetensors_read

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_job.py")
STEPS = 40


def wait_for_step(c, rank, step, procs, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = [int(m) for m in re.findall(r"^step (\d+) ",
                                            c.worker_log(rank), re.M)]
        if steps and steps[-1] >= step:
            return steps[-1]
        assert all(p.poll() is None for p in procs), c.logs()
        time.sleep(0.05)
    raise TimeoutError(c.logs())


def coordinated(make_cluster, tmp_path, name):
    return make_cluster(
        num_servers=2, num_workers=2, coordinated=True,
        server_flags=[f"--checkpoint_dir={tmp_path / name}",
                      "--checkpoint_every_steps=5"])


@pytest.mark.parametrize("extra", [
    [],
    # The LLM recipe's two-phase steps: clipping, loss scaling, a skip.
    ["--max_grad_norm=0.3", "--clip=call", "--loss_scale=1024",
     "--inf_at=16"],
], ids=["plain", "clip-scale-skip"])
def test_a_killed_server_comes_back_and_the_model_is_bitwise_the_same(
        make_cluster, tmp_path, extra):
    args = ["--model=cnn", "--optimizer=adamw", "--warmup", "--lr=0.01",
            f"--steps={STEPS}", "--step_delay=0.05"] + extra
    ref = coordinated(make_cluster, tmp_path, "ref")
    ref_out = str(tmp_path / "ref.safetensors")
    procs = ref.run_workers(JOB, args + [f"--out={ref_out}"])
    assert ref.wait_workers(procs) == [0, 0], ref.logs()

    c = coordinated(make_cluster, tmp_path, "faulty")
    out = str(tmp_path / "faulty.safetensors")
    procs = c.run_workers(JOB, args + [f"--out={out}"])
    at = wait_for_step(c, 0, 17, procs)
    c.servers[1].kill(signal.SIGKILL)
    time.sleep(0.5)
    c.servers[1].start()  # as shardps-local --restart_on_crash does
    assert c.wait_workers(procs) == [0, 0], c.logs()
    log = c.worker_log(0) + c.worker_log(1)
    assert "going on from step" in log, c.logs()
    print(f"killed shard 1 at step {at}; "
          + re.findall(r"going on from step \d+", log)[0])
    ours, _ = safetensors_read.read(out)
    theirs, _ = safetensors_read.read(ref_out)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert np.array_equal(ours[k], theirs[k]), k


def test_a_worker_that_dies_is_dropped_and_the_others_finish(make_cluster,
                                                             tmp_path):
    c = coordinated(make_cluster, tmp_path, "drop")
    out = str(tmp_path / "drop.safetensors")
    procs = c.run_workers(JOB, ["--model=cnn", f"--steps={STEPS}",
                                "--step_delay=0.05", f"--out={out}"])
    wait_for_step(c, 1, 10, procs)
    procs[1].send_signal(signal.SIGKILL)
    assert c.wait_workers(procs[:1]) == [0], c.logs()
    assert f"final: step={STEPS}" in c.worker_log(0), c.logs()
    weights, meta = safetensors_read.read(out)
    assert meta["step"] == str(STEPS)
    assert all(np.all(np.isfinite(w)) for w in weights.values())


def test_a_replacement_worker_joins_at_an_epoch_start(make_cluster, tmp_path):
    c = coordinated(make_cluster, tmp_path, "join")
    out = str(tmp_path / "join.safetensors")
    args = ["--model=cnn", f"--steps={STEPS}", "--step_delay=0.05",
            f"--out={out}"]
    procs = c.run_workers(JOB, args)
    wait_for_step(c, 1, 10, procs)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    # A new process for rank 1: new to the running job, it joins at the
    # next epoch start (8 steps an epoch) and takes the job's weights.
    (replacement,) = c.run_workers(JOB, args, ranks=[1])
    assert c.wait_workers([procs[0], replacement]) == [0, 0], c.logs()
    log = c.worker_log(1)
    starts = [int(s) for s in re.findall(r"starts at step (\d+)", log)]
    assert starts[-1] % 8 == 0 and starts[-1] > 10, log
    assert f"final: step={STEPS}" in c.worker_log(0), c.logs()
    print(f"the replacement joined at step {starts[-1]}")

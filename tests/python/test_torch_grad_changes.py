"""Changing p.grad between backward and step() raises, over gRPC and over
shared memory: shardps pushed the gradient as backward produced it, so the
change could not reach the servers. Each worker runs
tests/python/grad_change_job.py, which does the checks of every case."""

import os

import pytest

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "grad_change_job.py")

CASES = ["clip_grad_norm_", "clip_grad_value_", "p.grad.mul_", "unscale_",
         "p.grad = clone"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_a_changed_gradient_raises_after_the_step_as_pushed(
        make_cluster, shared_memory, dtype):
    c = make_cluster(num_servers=2, num_workers=1)
    procs = c.run_workers(JOB, [f"--dtype={dtype}"], extra_env={
        "SHARDPS_SHARED_MEMORY": shared_memory})
    codes = c.wait_workers(procs, timeout=120)
    log = c.worker_log(0)
    assert codes == [0], c.logs()
    # The gradients went through the client's region exactly when shared
    # memory was on.
    buffers = int(log.split("gradient buffers in shared memory: ")[1]
                  .split()[0])
    assert (buffers > 0) == (shared_memory == "1"), log
    for case in CASES:
        assert f"{case}: raised, then clean steps went through" in log, log
    assert "clipped in a hook: went through" in log, log
    assert "a disabled loss scaler: went through" in log, log
    assert "an enabled loss scaler: refused" in log, log
    print(log)

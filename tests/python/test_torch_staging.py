"""The device path (_device.py: gradients staged off the backward thread and
pushed from a thread of their own, as for a CUDA model), run with CPU
parameters (SHARDPS_TORCH_STAGING=1), since no GPU is here: it trains
bitwise as the direct path does, one-phase and two-phase, and a gradient
changed after its push still raises. tests/gpu/test_torch_cuda.py runs the
CUDA copies themselves where torch has CUDA."""

import os

import numpy as np
import pytest

import safetensors_read
from test_torch_grad_changes import CASES

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "torch_job.py")
GRAD_CHANGE_JOB = os.path.join(HERE, "grad_change_job.py")
STAGED = {"SHARDPS_TORCH_STAGING": "1"}


def run(make_cluster, tmp_path, args, staged):
    c = make_cluster(num_servers=2, num_workers=2)
    out = tmp_path / f"staged-{staged}.safetensors"
    procs = c.run_workers(JOB, [f"--out={out}"] + args,
                          extra_env=STAGED if staged else None)
    assert c.wait_workers(procs, timeout=300) == [0, 0], c.logs()
    for rank in (0, 1):
        assert f"staged {staged}" in c.worker_log(rank)
    return safetensors_read.read(str(out))[0]


@pytest.mark.parametrize("args", [
    ["--model=cnn", "--optimizer=sgd"],
    ["--model=gpt", "--optimizer=adamw", "--warmup", "--lr=0.01",
     "--accumulate=2"],
    ["--model=mixed", "--optimizer=adamw", "--lr=0.01"],
    ["--model=cnn", "--optimizer=sgd", "--max_grad_norm=0.1", "--clip=call"],
], ids=["cnn-sgd", "gpt-adamw-accumulate", "mixed-precision", "clip-calls"])
def test_the_staged_path_trains_bitwise_as_the_direct_one(
        make_cluster, tmp_path, args):
    args = args + ["--steps=12"]
    direct = run(make_cluster, tmp_path, args, False)
    staged = run(make_cluster, tmp_path, args, True)
    for name in direct:
        assert np.array_equal(direct[name], staged[name]), name


def test_a_gradient_changed_after_its_staged_push_raises(make_cluster):
    c = make_cluster(num_servers=2, num_workers=1)
    procs = c.run_workers(GRAD_CHANGE_JOB, ["--dtype=fp32"],
                          extra_env=STAGED)
    assert c.wait_workers(procs, timeout=120) == [0], c.logs()
    log = c.worker_log(0)
    assert "staged True" in log
    for case in CASES:
        assert f"{case}: raised, then clean steps went through" in log, log


def test_parameters_on_several_devices_or_an_unknown_one_are_refused():
    from types import SimpleNamespace

    import torch
    from shardps import _device

    def on(*devices):
        return [(f"p{i}", SimpleNamespace(device=torch.device(d)))
                for i, d in enumerate(devices)]

    assert _device.device_of(on("cuda:1", "cuda:1")) == torch.device("cuda:1")
    assert _device.device_of(on("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"2 devices \(p0 on cuda:0, p1 on "
                       r"cuda:1\).*one device per process"):
        _device.device_of(on("cuda:0", "cuda:1"))
    with pytest.raises(ValueError, match="p0 is on meta"):
        _device.device_of(on("meta"))

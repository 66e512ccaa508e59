"""Frozen parameters: every rank holds rank 0's values, whether or not the
optimizer has them; one in the optimizer trains once unfrozen, one left
out of it cannot be unfrozen."""

import os

import numpy as np
import torch
import torch.nn as nn

import cluster
import safetensors_read

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "frozen_job.py")


def rank0_initial():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4),
                          nn.Tanh(), nn.Linear(4, 2))
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def test_frozen_parameters_are_rank0s_and_an_unfrozen_one_trains(
        make_cluster, tmp_path):
    c = make_cluster(num_servers=2, num_workers=2)
    procs = c.run_workers(JOB, [f"--out={tmp_path}"])
    assert c.wait_workers(procs, timeout=120) == [0, 0], c.logs()
    ranks = [safetensors_read.read(str(tmp_path / f"rank{r}.safetensors"))[0]
             for r in range(2)]
    initial = rank0_initial()
    for name in initial:
        assert np.array_equal(ranks[0][name], ranks[1][name]), name
    # Left out of the optimizer: rank 0's values, unchanged.
    for name in ("0.weight", "0.bias"):
        assert np.array_equal(ranks[1][name], initial[name]), name
    # In the optimizer, unfrozen at step 2: trained from then on.
    for name in ("2.weight", "4.weight", "4.bias"):
        assert not np.array_equal(ranks[1][name], initial[name]), name


def test_unfreezing_a_parameter_out_of_the_optimizer_is_refused(
        make_cluster, tmp_path):
    c = make_cluster(num_servers=1, num_workers=2)
    procs = c.run_workers(JOB, [f"--out={tmp_path}", "--unfreeze_fc1"])
    codes = c.wait_workers(procs, timeout=120)
    assert all(code not in (0, None) for code in codes), c.logs()
    log = c.worker_log(0)
    assert ("ValueError: parameter 0.weight requires grad since the model "
            "was declared but is in no param_group of the optimizer") in log, \
        log

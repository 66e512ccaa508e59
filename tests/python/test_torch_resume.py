"""Checkpoints the torch way: opt.state_dict() from the servers, and a job
resumed from a torch.save file (model, optimizer, scheduler, sampler) on new
servers without a checkpoint directory ends with bitwise the model of the
uninterrupted job. Files of plain torch and of shardps load into each
other. Each job is tests/python/resume_job.py on real daemons."""

import os
import subprocess

import numpy as np
import pytest
import torch

import cluster
import safetensors_read

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "resume_job.py")


def run_shardps(make_cluster, args):
    c = make_cluster(num_servers=2, num_workers=2)
    procs = c.run_workers(JOB, args)
    assert c.wait_workers(procs, timeout=300) == [0, 0], c.logs()
    return c


def run_plain(args):
    subprocess.run([cluster.PYTHON, JOB, "--plain"] + args, check=True,
                   env=cluster.python_env(), timeout=300)


def weights(path):
    return safetensors_read.read(str(path))[0]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("model,optimizer", [("gpt", "adamw"),
                                             ("cnn", "sgd")])
def test_a_job_resumed_from_torch_save_ends_bitwise_equal(
        make_cluster, tmp_path, model, optimizer):
    common = [f"--model={model}", f"--optimizer={optimizer}", "--steps=16"]
    run_shardps(make_cluster, common + [f"--out={tmp_path / 'whole.st'}"])
    saved = tmp_path / "at6.pt"
    run_shardps(make_cluster, common + ["--save_at=6", f"--save={saved}"])
    c = run_shardps(make_cluster, common + [f"--resume={saved}",
                                            f"--out={tmp_path / 'resumed.st'}"])
    assert "starts at data step 6" in c.worker_log(1)
    whole, resumed = weights(tmp_path / "whole.st"), \
        weights(tmp_path / "resumed.st")
    for name in whole:
        assert np.array_equal(whole[name], resumed[name]), name

    # The file is torch's format: a plain torch optimizer loads it.
    state = torch.load(saved)["optimizer"]
    entries = list(state["state"].values())
    assert entries, "no per-parameter state"
    if optimizer == "adamw":
        assert all(set(e) == {"step", "exp_avg", "exp_avg_sq"} and
                   e["step"].item() == 6.0 for e in entries)
        assert len(state["param_groups"]) == 2
    else:
        assert all(set(e) == {"momentum_buffer"} for e in entries)
    import torch_job
    import tiny_models
    net = tiny_models.make(model)
    plain = torch_job.make_optimizer(net, optimizer, 0.01)
    plain.load_state_dict(state)


@pytest.mark.parametrize("first", ["plain", "shardps"])
def test_plain_torch_and_shardps_files_load_into_each_other(
        make_cluster, tmp_path, first):
    """Saved at step 6 by one, continued to 16 by the other: the model of
    the uninterrupted plain run to 1e-5 (the servers compute torch's
    formulas in float32, not its exact operation order)."""
    common = ["--model=gpt", "--optimizer=adamw", "--steps=16"]
    run_plain(common + [f"--out={tmp_path / 'plain.st'}"])
    saved = tmp_path / "at6.pt"
    out = tmp_path / "crossed.st"
    if first == "plain":
        run_plain(common + ["--save_at=6", f"--save={saved}"])
        run_shardps(make_cluster, common + [f"--resume={saved}",
                                            f"--out={out}"])
    else:
        run_shardps(make_cluster, common + ["--save_at=6",
                                            f"--save={saved}"])
        run_plain(common + [f"--resume={saved}", f"--out={out}"])
    diff = max_diff(weights(tmp_path / "plain.st"), weights(out))
    print(f"{first} -> other: max |dw| vs the uninterrupted plain run = "
          f"{diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_bad_state_dict_is_refused_with_the_servers_state_unchanged(
        make_cluster, tmp_path, optimizer):
    c = make_cluster(num_servers=2, num_workers=1)
    procs = c.run_workers(JOB, [f"--optimizer={optimizer}", "--steps=3",
                                "--bad_loads"])
    assert c.wait_workers(procs, timeout=300) == [0], c.logs()
    log = c.worker_log(0)
    print(log)
    for name in ("nan", "shape", "unknown", "groups", "count", "setting",
                 "step", "not-a-state-dict"):
        assert f"refused {name}:" in log
    assert "non-finite" in log and "weight_decay=0.5" in log
    assert ("loaded at momentum 0" in log) == (optimizer == "sgd")
    assert log.count("refused sampler") == 3, log

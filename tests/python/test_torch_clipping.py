"""Global-norm clipping and loss scaling on the servers (two-phase steps):
two workers through shardps against one torch process that averages the two
half-batch gradients, clips them with torch.nn.utils.clip_grad_norm_ and
steps; the same weights on 1 and 3 servers; a loss-scaled step with an inf
skipped on every shard; the refusals."""

import os
import re

import numpy as np
import pytest
import torch

import cluster
import safetensors_read
from test_torch_equivalence import JOB, max_diff, run_plain


def run(make_cluster, tmp_path, args, num_servers=2, name="shardps"):
    c = make_cluster(num_servers=num_servers, num_workers=2)
    out = str(tmp_path / f"{name}.safetensors")
    procs = c.run_workers(JOB, [f"--out={out}"] + args)
    codes = c.wait_workers(procs, timeout=300)
    assert codes == [0, 0], c.logs()
    logs = [c.worker_log(r) for r in range(2)]
    return safetensors_read.read(out)[0], logs


def norms(text, prefix="step"):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        rf"^{prefix} (\d+) norm (\S+)", text, re.M)}


def plain_log(tmp_path, args):
    import subprocess
    out = subprocess.run(
        [cluster.PYTHON, JOB, "--plain=halves",
         f"--out={tmp_path / 'plain-log.safetensors'}"] + args,
        check=True, env=cluster.python_env(), timeout=300,
        capture_output=True, text=True)
    return out.stdout


@pytest.mark.parametrize("model,optimizer,max_norm,extra", [
    ("cnn", "sgd", 0.1, []),
    ("gpt", "adamw", 0.3, ["--warmup", "--lr=0.01"]),  # parameter groups
])
@pytest.mark.parametrize("clip", ["constant", "call"])
def test_clipping_matches_torch_on_the_averaged_halves(
        make_cluster, tmp_path, model, optimizer, max_norm, extra, clip):
    args = [f"--model={model}", f"--optimizer={optimizer}", "--steps=20",
            f"--max_grad_norm={max_norm}", f"--clip={clip}"] + extra
    ours, logs = run(make_cluster, tmp_path, args)
    plain = run_plain(tmp_path, args)
    diff = max_diff(ours, plain)
    want = norms(plain_log(tmp_path, args))
    got = [norms(log) for log in logs]
    clipped = sum(n > max_norm for n in want.values())
    print(f"{model} {optimizer} clip={clip}: max |dw| = {diff:.3g}; "
          f"clipping active at {clipped} of {len(want)} steps")
    assert clipped >= 15  # most steps: the test exercises clipping
    assert diff <= 1e-5
    # Every rank reads the same norm, torch's to float32 rounding.
    assert got[0] == got[1] and sorted(got[0]) == sorted(want)
    for step, n in want.items():
        assert abs(got[0][step] - n) <= 1e-5 * n, (step, got[0][step], n)
    if clip == "call":
        # clip_grad_norm_'s return value is the norm the step used (as a
        # float32 tensor, as torch's).
        called = norms(logs[0], "called step")
        assert sorted(called) == sorted(got[0])
        for step, n in called.items():
            assert np.float32(n) == np.float32(got[0][step]), step


def test_one_and_three_servers_give_bitwise_the_same_weights(make_cluster,
                                                             tmp_path):
    args = ["--model=gpt", "--optimizer=adamw", "--lr=0.01", "--steps=12",
            "--max_grad_norm=0.3"]
    one, logs1 = run(make_cluster, tmp_path, args, 1, "one")
    three, logs3 = run(make_cluster, tmp_path, args, 3, "three")
    assert one.keys() == three.keys()
    for k in one:
        assert np.array_equal(one[k], three[k]), k
    assert norms(logs1[0]) == norms(logs3[0])


def test_a_loss_scaled_inf_skips_exactly_that_step_on_every_shard(
        make_cluster, tmp_path):
    args = ["--model=gpt", "--optimizer=adamw", "--lr=0.01", "--steps=12",
            "--loss_scale=1024", "--inf_at=5", "--max_grad_norm=0.5",
            "--clip=call"]
    ours, logs = run(make_cluster, tmp_path, args)
    for log in logs:
        skipped = re.findall(r"^step (\d+) norm \S+ skipped True", log, re.M)
        assert skipped == ["6"], log
    # The reference never takes step 6 (Adam's step count included).
    plain = run_plain(tmp_path, args)
    diff = max_diff(ours, plain)
    print(f"loss-scaled gpt with an inf at step 6: max |dw| = {diff:.3g}")
    assert diff <= 1e-5


def test_bad_clipping_and_scaling_settings_are_refused(make_cluster,
                                                       tmp_path):
    script = tmp_path / "bad.py"
    script.write_text('''
import math
import torch
import shardps.torch as spt
import tiny_models

ctx = spt.init()
model = tiny_models.make("cnn")
def refused(kind, fn, match):
    try:
        fn()
    except kind as e:
        assert match in str(e), str(e)
        print("refused:", e)
        return
    raise AssertionError(f"not refused: {match}")
for bad in (0, -1.0, float("nan"), float("inf"), "x"):
    refused(ValueError, lambda: spt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model,
        max_grad_norm=bad), "max_grad_norm")
refused(ValueError, lambda: spt.GradScaler(init_scale=0), "init_scale")
refused(ValueError, lambda: spt.GradScaler(backoff_factor=1.5),
        "backoff_factor")
refused(ValueError, lambda: spt.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), model=model,
    max_grad_norm=1.0, clip_grad_norm_calls=True), "choose one way")
opt = spt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model=model, max_grad_norm=1.0)
x, y = tiny_models.data("cnn", 8)
torch.nn.functional.cross_entropy(model(x), y).backward()
refused(RuntimeError, lambda: opt.clip_grad_norm_(1.0),
        "clip_grad_norm_calls=True")
opt.step()
print("ok", ctx.step)
''')
    c = make_cluster(num_servers=1, num_workers=1)
    procs = c.run_workers(str(script))
    assert c.wait_workers(procs, timeout=120) == [0], c.logs()
    log = c.worker_log(0)
    assert log.count("refused:") == 9 and "ok 1" in log, log


def test_speculative_weights_over_the_network_change_nothing(make_cluster,
                                                              tmp_path):
    """Over gRPC alone (as between machines) the servers send, with each
    chunk's sum of squares, the weights of the update that does not clip,
    and keep them at the steps that do not clip: the weights equal a run
    without speculative weights bitwise, at a bound about half the steps
    pass, and the servers say how many they kept and recomputed."""
    base = ["--model=gpt", "--optimizer=adamw", "--lr=0.01", "--steps=12"]
    unclipped = sorted(norms(plain_log(
        tmp_path, base + ["--max_grad_norm=1e9"])).values())
    bound = unclipped[len(unclipped) // 2]
    args = base + [f"--max_grad_norm={bound:.6g}"]
    results = {}
    for speculative in ("1", "0"):
        c = make_cluster(num_servers=2, num_workers=2)
        out = str(tmp_path / f"speculative{speculative}.safetensors")
        procs = c.run_workers(JOB, [f"--out={out}"] + args, extra_env={
            "SHARDPS_SHARED_MEMORY": "0",
            "SHARDPS_SPECULATIVE_WEIGHTS": speculative})
        assert c.wait_workers(procs, timeout=300) == [0, 0], c.logs()
        for s in c.servers:
            s.stop()  # graceful: the servers log their counters
        counts = [re.search(r"speculative weights: (\d+) chunk updates kept, "
                            r"(\d+) recomputed", s.log()) for s in c.servers]
        results[speculative] = (safetensors_read.read(out)[0],
                                norms(c.worker_log(0)), counts)
    spec, plain = results["1"], results["0"]
    assert spec[0].keys() == plain[0].keys()
    for k in spec[0]:
        assert np.array_equal(spec[0][k], plain[0][k]), k
    assert spec[1] == plain[1]
    clipped = sum(n > bound for n in spec[1].values())
    print(f"bound {bound:.4g}: {clipped} of {len(spec[1])} steps clipped; "
          f"servers kept / recomputed: "
          f"{[m.groups() for m in spec[2] if m]}")
    assert 0 < clipped < len(spec[1])
    assert all(m is not None for m in spec[2]), [s for s in spec[2]]
    assert sum(int(m.group(1)) for m in spec[2]) > 0
    assert sum(int(m.group(2)) for m in spec[2]) > 0
    assert all(m is None for m in plain[2])

"""torch's lr schedulers through shardps: the learning rate, SGD's momentum
and Adam's betas they set travel with every step, and two workers compute
what one torch process computes from the averaged half batches
(tests/python/torch_job.py --sched). The servers refuse ranks that
disagree; the torch layer refuses momentum for SGD declared without it."""

import re
import subprocess

import pytest

import cluster
import safetensors_read
from test_torch_equivalence import JOB, max_diff, run_plain


def schedule_of(log):
    """The "sched step N lr ... momentum ..." lines of a job's output."""
    return re.findall(r"^sched step .*$", log, re.M)


def run_job(make_cluster, tmp_path, args, workers=2):
    c = make_cluster(num_servers=2, num_workers=workers, coordinated=True)
    out = str(tmp_path / "shardps.safetensors")
    procs = c.run_workers(JOB, [f"--out={out}"] + args)
    return c, c.wait_workers(procs, timeout=300), out


@pytest.mark.parametrize("optimizer,sched", [
    ("sgd", "onecycle"),   # lr and momentum cycle
    ("adamw", "onecycle"),  # lr and betas[0] cycle, two groups
    ("sgd", "cyclic"),     # CyclicLR with cycle_momentum
    ("sgd", "plateau"),    # fed the loss every rank averages
    ("adamw", "cosine"),
    ("sgd", "step"),
])
def test_schedulers_match_the_averaged_half_batches(make_cluster, tmp_path,
                                                    optimizer, sched):
    # Adam at the job's default lr 0.05 amplifies rounding (4e-6 with
    # cosine, 1e-6 without a scheduler): the equivalence tests' 0.01.
    args = ["--model=cnn", f"--optimizer={optimizer}", f"--sched={sched}",
            "--steps=20"] + (["--lr=0.01"] if optimizer == "adamw" else [])
    c, codes, out = run_job(make_cluster, tmp_path, args)
    assert codes == [0, 0], c.logs()
    ours = safetensors_read.read(out)[0]
    plain = run_plain(tmp_path, args)
    diff = max_diff(ours, plain)
    print(f"{optimizer} {sched}: max |dw| vs averaged halves = {diff:.3g}")
    assert diff <= 1e-5
    # Each rank ran the reference's schedule, and the schedule changes.
    ref = subprocess.run(
        [cluster.PYTHON, JOB, "--plain=halves"] + args, check=True,
        env=cluster.python_env(), timeout=300, capture_output=True,
        text=True).stdout
    want = schedule_of(ref)
    assert len(want) == 20, ref
    for rank in (0, 1):
        assert schedule_of(c.worker_log(rank)) == want, c.worker_log(rank)
    values = {line.split(" lr ")[1] for line in want}
    assert len(values) > 3, want
    if sched in ("onecycle", "cyclic"):
        momenta = {line.split(" momentum ")[1] for line in want}
        assert len(momenta) > 3, want


def test_scheduler_that_sets_momentum_before_wrapping_declares_it(
        make_cluster, tmp_path):
    # SGD(momentum=0) given to OneCycleLR first: the momentum is declared.
    args = ["--model=cnn", "--optimizer=sgd", "--momentum=0",
            "--sched=onecycle", "--steps=8"]
    c, codes, out = run_job(make_cluster, tmp_path, args + ["--sched_first"])
    assert codes == [0, 0], c.logs()
    diff = max_diff(safetensors_read.read(out)[0], run_plain(tmp_path, args))
    print(f"sgd onecycle from momentum 0, built first: max |dw| = {diff:.3g}")
    assert diff <= 1e-5


def test_momentum_for_sgd_declared_without_it_is_refused(make_cluster,
                                                         tmp_path):
    # OneCycleLR built on the wrapper sets momentum 0.95 after the servers
    # were given momentum 0: refused at the first backward, named.
    args = ["--model=cnn", "--optimizer=sgd", "--momentum=0",
            "--sched=onecycle", "--steps=4"]
    c, codes, _ = run_job(make_cluster, tmp_path, args, workers=1)
    assert codes[0] not in (0, None), c.logs()
    log = c.worker_log(0)
    assert re.search(
        r"ValueError: SGD\(param_groups\[0\]\): momentum=0\.95, but the "
        r"group was declared with momentum 0, for which the servers keep no "
        r"momentum buffer\. Declare the SGD with a momentum > 0, or construct "
        r"the scheduler that sets it \(OneCycleLR, CyclicLR\) on the torch "
        r"optimizer before wrapping it", log), log
    assert "sched step 1" not in log


def test_ranks_that_disagree_on_momentum_are_refused(make_cluster, tmp_path):
    # Rank 1 sets momentum 0.8 at step 0, rank 0 keeps 0.9: on each chunk
    # the later of the two pushes is refused, naming both values.
    args = ["--model=cnn", "--optimizer=sgd", "--steps=2",
            "--skew_momentum=0.8"]
    c, codes, _ = run_job(make_cluster, tmp_path, args)
    assert None not in codes, c.logs()
    print(f"exit codes {codes}")
    logs = c.worker_log(0) + c.worker_log(1)
    assert re.search(
        r"INVALID_ARGUMENT.*rank [01] pushes chunk \d+ \([\w.]+\) of step 0 "
        r"with momentum 0\.(8|9)\d*, but the step's first push used "
        r"0\.(8|9)\d*: every worker of a step must use the same momentum",
        logs), c.logs()
    assert codes != [0, 0], c.logs()


def test_momentum_and_betas_are_checked_before_they_are_sent():
    import torch
    from shardps._optim_spec import _server_optimizer, _stepped
    p = [torch.nn.Parameter(torch.zeros(2))]

    def stepped(optimizer):
        group = optimizer.param_groups[0]
        return _stepped(optimizer, 0, group, declared)

    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)
    declared = _server_optimizer(sgd, 0, sgd.param_groups[0])
    assert stepped(sgd) == {"momentum": 0.9}
    sgd.param_groups[0]["momentum"] = 0.0  # a plain step, as torch's
    assert stepped(sgd) == {"momentum": 0.0}
    sgd.param_groups[0]["momentum"] = 1.0
    with pytest.raises(ValueError, match=r"SGD\(param_groups\[0\]\): "
                       r"momentum=1\.0 must be in \[0, 1\)"):
        stepped(sgd)
    adamw = torch.optim.AdamW(p, betas=(0.9, 0.95))
    declared = _server_optimizer(adamw, 0, adamw.param_groups[0])
    assert stepped(adamw) == {"beta1": 0.9, "beta2": 0.95}
    adamw.param_groups[0]["betas"] = (0.0, float("nan"))
    with pytest.raises(ValueError, match=r"betas\[1\]=nan must be in"):
        stepped(adamw)
    adagrad = torch.optim.Adagrad(p)
    declared = _server_optimizer(adagrad, 0, adagrad.param_groups[0])
    assert stepped(adagrad) == {}

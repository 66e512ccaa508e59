"""Bad input to the PyTorch layer: each a clear exception naming the
problem, raised before anything reaches the servers."""

import os
import subprocess
import time

import pytest
import torch
import torch.nn as nn

import cluster


def shard_table(c):
    out = subprocess.run(
        [cluster.binary("shardps-ctl"), "shards",
         "--servers=" + ",".join(s.address for s in c.servers)],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    header = lines[0].split("  ")
    header = [h.strip() for h in header if h.strip()]
    rows = []
    for line in lines[1:]:
        cells = [x.strip() for x in line.split("  ") if x.strip()]
        rows.append(dict(zip(header, cells)))
    return rows


@pytest.fixture(scope="module")
def ctx():
    c = cluster.Cluster(num_servers=1, num_workers=1)
    os.environ["SHARDPS_SERVERS"] = c.servers[0].address
    os.environ["SHARDPS_NUM_WORKERS"] = "1"
    os.environ["SHARDPS_RANK"] = "0"
    import shardps.torch as spt
    context = spt.init()
    yield spt, context, c
    c.stop()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)


def test_bad_models_and_options_are_refused_before_anything_is_sent(ctx):
    spt, context, c = ctx
    net = Net()

    def refused(optimizer, named, match):
        with pytest.raises(ValueError, match=match):
            spt.DistributedOptimizer(optimizer, named_parameters=named)

    net64 = Net().double()
    refused(torch.optim.SGD(net64.parameters(), lr=0.1),
            net64.named_parameters(), r"fc\.weight is torch\.float64")
    strided = nn.Parameter(torch.randn(4, 3).t())
    refused(torch.optim.SGD([strided], lr=0.1), [("strided", strided)],
            r"strided is not a contiguous")
    meta = nn.Parameter(torch.empty(3, device="meta"))
    refused(torch.optim.SGD([meta], lr=0.1), [("meta", meta)],
            r"meta is on meta: shardps.torch trains CPU parameters")
    refused(torch.optim.Adam(net.parameters(), amsgrad=True),
            net.named_parameters(), r"amsgrad=True")
    refused(torch.optim.SGD(net.parameters(), lr=0.1, maximize=True),
            net.named_parameters(), r"maximize=True")
    refused(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9,
                            dampening=0.5),
            net.named_parameters(), r"dampening=0.5")
    refused(torch.optim.RMSprop(net.parameters()), net.named_parameters(),
            r"RMSprop cannot run on the shardps servers")
    other = nn.Parameter(torch.zeros(2))
    refused(torch.optim.SGD(list(net.parameters()) + [other], lr=0.1),
            net.named_parameters(), r"not in named_parameters")
    # Nothing reached the shard.
    (row,) = shard_table(c)
    assert row["DECLARED"] == "no", row
    assert row["PUSHES"] == "0", row


def test_misuse_after_declaring_is_refused(ctx):
    spt, context, c = ctx
    net = Net()
    opt = spt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters())
    (declared,) = shard_table(c)  # the initial values are its only pushes
    with pytest.raises(RuntimeError, match=r"step\(\) without backward"):
        opt.step()
    with pytest.raises(ValueError, match=r"fc\.weight is already trained"):
        spt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 named_parameters=net.named_parameters())
    # A parameter whose shape changed: named, and no step is sent.
    weight = net.fc.weight.data
    net.fc.weight.data = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"fc\.weight changed shape"):
        net.fc(torch.ones(2, 5)).sum().backward()
    net.fc.weight.data = weight
    net.zero_grad(set_to_none=True)
    # Another hyper-parameter than lr changed: refused at the next step.
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ValueError, match=r"momentum changed"):
        net.fc(torch.ones(2, 4)).sum().backward()
    opt.param_groups[0]["momentum"] = 0
    net.zero_grad(set_to_none=True)
    (row,) = shard_table(c)
    assert row["DECLARED"] == "yes", row
    assert row["PUSHES"] == declared["PUSHES"] and row["UPDATES"] == "0", row
    # A good step goes through.
    net.fc(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert context.step == 1
    assert torch.allclose(net.fc.bias.grad, torch.full((3,), 2.0))


def test_unreachable_servers_fail_within_the_timeout(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, shardps.torch as spt\n"
        "ctx = spt.init()\n"
        "m = torch.nn.Linear(2, 2)\n"
        "spt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "                         named_parameters=m.named_parameters())\n")
    env = cluster.python_env({"SHARDPS_SERVERS": "127.0.0.1:1",
                              "SHARDPS_CONNECT_TIMEOUT_S": "2"})
    start = time.time()
    out = subprocess.run([cluster.PYTHON, str(script)], env=env,
                         capture_output=True, text=True, timeout=120)
    took = time.time() - start
    assert out.returncode != 0
    assert "shardps._errors.DeadlineExceeded" in out.stderr or (
        "DEADLINE_EXCEEDED" in out.stderr), out.stderr
    assert "127.0.0.1:1" in out.stderr, out.stderr
    print(f"unreachable servers: error after {took:.1f} s")

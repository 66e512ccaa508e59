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
            r"meta is on meta: shardps.torch trains CPU and CUDA parameters")
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


def test_parameters_of_other_dtypes_are_refused_by_name(ctx):
    spt, context, c = ctx
    # bfloat16 and float16 train (float32 on the servers); the others are
    # named, before anything is sent.
    net = Net().to(torch.bfloat16)
    net.half_scale = nn.Parameter(torch.ones(3, dtype=torch.float16))
    net.extra = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"parameter extra is torch\.float64: "
                       r"shardps trains float32, bfloat16 and float16"):
        spt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                 named_parameters=net.named_parameters())
    # A frozen parameter left out of the optimizer is declared too.
    del net.extra
    net.counts = nn.Parameter(torch.zeros(2, dtype=torch.int64),
                              requires_grad=False)
    with pytest.raises(ValueError, match=r"parameter counts is torch\.int64"):
        spt.DistributedOptimizer(
            torch.optim.SGD([p for p in net.parameters() if p.requires_grad],
                            lr=0.1),
            named_parameters=net.named_parameters())
    (row,) = shard_table(c)
    assert row["DECLARED"] == "no", row
    assert row["PUSHES"] == "0", row


def test_options_the_servers_would_not_run_exactly_are_refused(ctx):
    spt, context, c = ctx
    net = Net()

    def refused(optimizer, match, named=None):
        with pytest.raises(ValueError, match=match):
            spt.DistributedOptimizer(
                optimizer, named_parameters=named or net.named_parameters())

    # Keys: each known one, or refused by name.
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    sgd.param_groups[0]["my_note"] = "warm"
    refused(sgd, r"SGD\(param_groups\[0\]\): my_note='warm' is not an "
            r"option shardps knows")
    newer = torch.optim.Adam([{"params": [net.fc.weight]},
                              {"params": [net.fc.bias]}])
    newer.param_groups[1]["decoupled_weight_decay"] = True
    refused(newer, r"Adam\(param_groups\[1\]\): decoupled_weight_decay=True")
    refused(torch.optim.SGD(net.parameters(), lr=0.1, maximize=0),
            r"maximize=0 cannot run")
    refused(torch.optim.Adagrad(net.parameters(), lr_decay=0.1),
            r"lr_decay=0\.1 cannot run")
    # Zero betas and eps would become the servers' defaults.
    for optimizer, match in [
            (torch.optim.Adam(net.parameters(), betas=(0.0, 0.999)),
             r"Adam\(param_groups\[0\]\): betas\[0\]=0\.0 cannot run on "
             r"the shardps servers: their optimizer settings take 0 for "
             r"unset and would run betas\[0\]=0\.9 instead"),
            (torch.optim.AdamW(net.parameters(), betas=(0.9, 0.0)),
             r"betas\[1\]=0\.0 .* betas\[1\]=0\.999 instead"),
            (torch.optim.Adam(net.parameters(), eps=0.0),
             r"eps=0\.0 .* eps=1e-08 instead"),
            (torch.optim.Adagrad(net.parameters(), eps=1e-50),  # 0 in float32
             r"Adagrad\(param_groups\[0\]\): eps=1e-50 .* eps=1e-10")]:
        refused(optimizer, match)
    (row,) = shard_table(c)
    assert row["DECLARED"] == "no", row


def test_torch_defaults_and_scheduler_keys_are_let_through(ctx):
    spt, context, c = ctx
    from shardps.torch import _server_optimizer
    p = [nn.Parameter(torch.zeros(2))]
    for optimizer in (torch.optim.SGD(p, lr=0.1),
                      torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                      torch.optim.Adam(p), torch.optim.AdamW(p),
                      torch.optim.Adagrad(p)):
        torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1.0, total_steps=10,
            cycle_momentum="momentum" in optimizer.defaults or (
                "betas" in optimizer.defaults))
        spec = _server_optimizer(optimizer, 0, optimizer.param_groups[0])
        assert spec["kind"] == type(optimizer).__name__.lower(), spec
    # Momentum 0 and weight decay 0 are what they say: plain SGD.
    assert _server_optimizer(torch.optim.SGD(p, lr=0.1), 0,
                             {"params": p, "lr": 0.1, "momentum": 0,
                              "dampening": 0, "weight_decay": 0,
                              "nesterov": False})["momentum"] == 0


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
    # A hyper-parameter other than lr, momentum and betas changed: refused
    # at the next step.
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match=r"weight_decay changed after the "
                       r"model was declared: only lr, momentum \(SGD\) and "
                       r"betas \(Adam, AdamW\) can change"):
        net.fc(torch.ones(2, 4)).sum().backward()
    opt.param_groups[0]["weight_decay"] = 0
    net.zero_grad(set_to_none=True)
    # Momentum for SGD declared without: no buffer on the servers.
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ValueError, match=r"SGD\(param_groups\[0\]\): "
                       r"momentum=0\.5, but the group was declared with "
                       r"momentum 0"):
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

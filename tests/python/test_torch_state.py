"""The model's state the torch way: spt.save writes parameters, persistent
buffers and every name of a tied parameter, so a fresh model loads the file
strictly; a parameter changed after wrapping (model.load_state_dict) is
refused at the next step rather than silently overwritten."""

import cluster

SCRIPT = '''
import torch
import torch.nn as nn
import shardps.torch as spt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, x):
        return self.out(self.norm(self.embed(x)))


ctx = spt.init()
torch.manual_seed(0)
model = Net()
opt = spt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model=model)
x = torch.randint(0, 10, (16,))
for _ in range(3):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), x).backward()
    opt.step()
path = "{path}"
spt.save(model, path)
fresh = Net()
fresh.load_state_dict(spt.load(path), strict=True)
for k, v in model.state_dict().items():
    assert torch.equal(fresh.state_dict()[k], v), k
keys = sorted(spt.load(path))
print("saved", keys)
assert "out.weight" in keys and "norm.num_batches_tracked" in keys, keys
assert spt.load(path)["norm.num_batches_tracked"].item() == 3

# Weights loaded into the wrapped model would be overwritten: refused.
model.load_state_dict(Net().state_dict())
opt.zero_grad()
try:
    nn.functional.cross_entropy(model(x), x).backward()
except RuntimeError as e:
    assert "embed.weight" in str(e) and "load_state_dict" in str(e), e
    print("refused:", e)
else:
    raise AssertionError("a changed parameter was not refused")
'''


def test_save_loads_strictly_and_a_changed_parameter_is_refused(make_cluster,
                                                                tmp_path):
    script = tmp_path / "state.py"
    script.write_text(SCRIPT.replace("{path}", str(tmp_path / "m.st")))
    c = make_cluster(num_servers=1, num_workers=1)
    procs = c.run_workers(str(script))
    assert c.wait_workers(procs, timeout=120) == [0], c.logs()
    log = c.worker_log(0)
    assert "saved" in log and "refused:" in log, log

"""A shardps.torch job with frozen parameters, for test_torch_frozen.py:
each rank initialises the model from its own seed; fc1 is frozen and left
out of the optimizer, fc3 is in it but frozen until step 2. Writes this
rank's parameters as safetensors.

  python3 frozen_job.py --out=DIR [--unfreeze_fc1]
"""

import argparse
import os

import torch
import torch.nn as nn

import shardps.torch as spt


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--unfreeze_fc1", action="store_true")
    args = parser.parse_args()
    ctx = spt.init()
    torch.manual_seed(ctx.rank)  # a different model on every rank
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4),
                          nn.Tanh(), nn.Linear(4, 2))
    fc1, fc3 = model[0], model[4]
    fc1.requires_grad_(False)
    fc3.requires_grad_(False)
    opt = spt.DistributedOptimizer(
        torch.optim.SGD(list(model[2].parameters()) +
                        list(fc3.parameters()), lr=0.1),
        named_parameters=model.named_parameters())
    x = torch.linspace(-1, 1, 32).reshape(8, 4) * (ctx.rank + 1)
    for step in range(4):
        if step == 2:
            fc3.requires_grad_(True)
            if args.unfreeze_fc1:
                fc1.weight.requires_grad_(True)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    spt.save(model, os.path.join(args.out, f"rank{ctx.rank}.safetensors"))


if __name__ == "__main__":
    main()
